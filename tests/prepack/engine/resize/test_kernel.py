"""Every kernel against the installed Pillow, value for value: random sizes and contents, tall,
wide and 1-pixel pictures, both pass orders, photographs at the packer's target sizes.

The C kernel is checked as this machine builds it and, on x86, also built without AVX-512 VNNI
(the AVX-512 path of 32-bit multiplies), without AVX-512 (the AVX2 path: with AVX-VNNI where the
CPU has it, and without, and its opt-in 16-bit multiply-add variant) and without AVX2 (the
portable loops), so each of its x86 code paths this CPU can run is proven here, not only the one it
happens to take
(test_cross.py runs the aarch64 ones under qemu).  The numba kernel is the fallback for machines
with no C compiler.  Each C build's coded entry points (the result row-delta coded, as the record's
pixel table stores it) are checked against ``encode_rows`` of Pillow's bytes the same ways, from
the RGBX copy and from a table of rows that do not lie end to end.
"""

from __future__ import annotations

import os
import platform
from typing import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

import ctypes

from prepack.engine.decode import raw_pixels
from prepack.engine.resize import PINNED_PILLOW
from prepack.engine.resize.router import vertical_first
from tests.helpers import datagen as dg
from tests.helpers.pictures import KINDS
from schemas.pixel_table import encode_rows
from tests.helpers.pictures import picture as _picture

pytestmark = pytest.mark.skipif(Image.__version__ != PINNED_PILLOW, reason="the kernel mirrors the pinned Pillow")

# (picture, out_w, out_h, vertical_first) -> (out_h, out_w, 3) uint8, with the pass order forced
Raw = Callable[[Image.Image, int, int, bool], np.ndarray]
# build -> (its extra flags, the vector path it must take, the CPU features it needs); the VNNI
# paths are what -march=native takes where the CPU has them, so the other ones are built without
NARROWER_X86 = {
    "native-avx512": (("-mno-avx512vnni",), "avx512", {"avx512f", "avx512bw"}),
    "native-avx2": (("-mno-avx512f",), "avx2-vnni", {"avx2", "avx_vnni"}),
    "native-avx2-plain": (("-mno-avx512f", "-mno-avxvnni"), "avx2", {"avx2"}),
    "native-avx2-madd": (("-mno-avx512f", "-mno-avxvnni", "-DPREPACK_RESIZE_MADD"), "avx2-madd", {"avx2"}),
    "native-portable": (("-mno-avx2", "-mno-avx512f"), "portable", set()),
}
BUILDS = ["native", *NARROWER_X86]


def _native_flags(name: str) -> tuple[str, ...]:
    """The build's flags, proven to take its vector path (skips where it cannot be built here)."""
    from prepack.engine.resize import native

    extra, isa, needs = NARROWER_X86.get(name, ((), None, set()))
    if extra and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the narrower builds are x86 flags")
    missing = needs - set(native.machine_features().split()[1:])
    if missing:
        pytest.skip(f"this CPU has no {', '.join(sorted(missing))}: not the {isa} path")
    try:
        native.compiler(os.environ)
    except native.BuildError as exc:
        pytest.skip(f"no C kernel on this machine: {exc}")
    assert isa is None or native.isa(native.library(flags=native.FLAGS + extra)) == isa  # the path it is to prove
    return native.FLAGS + extra


def _native(name: str) -> Raw:
    from prepack.engine.resize import native

    fn = native.load(flags=_native_flags(name))

    def raw(img: Image.Image, ow: int, oh: int, vfirst: bool) -> np.ndarray:
        out = np.empty((oh, ow, 3), np.uint8)
        assert fn(raw_pixels(img, "RGBX", 4).ctypes.data, img.width, img.height, out.ctypes.data, ow, oh,
                  int(vfirst)) == 0
        return out

    return raw


# (picture, out_w, out_h, vertical_first, from_rows) -> the (out_h, out_w, 3) result row-delta coded
Coded = Callable[[Image.Image, int, int, bool, bool], np.ndarray]


def _native_coded(name: str) -> Coded:
    """A build's coded entry points: from the RGBX copy, or (``from_rows``) from a table of row
    pointers laid out bottom row first, 64 bytes apart (the gathering path); the result is written
    between guard bytes that must stay as they were."""
    from prepack.engine.resize import native

    flags = _native_flags(name)
    from_copy = native.load(flags=flags, entry="prepack_resize_rgbx_coded")
    from_rows = native.load(flags=flags, entry="prepack_resize_rows_coded")

    def coded(img: Image.Image, ow: int, oh: int, vfirst: bool, rows: bool) -> np.ndarray:
        src = raw_pixels(img, "RGBX", 4)
        buf = np.full(oh * ow * 3 + 128, 0x5A, np.uint8)
        out = buf[64:-64]
        if rows:
            line = img.width * 4
            spread = np.zeros((img.height, line + 64), np.uint8)
            spread[::-1, :line] = src.reshape(img.height, line)
            table = (ctypes.c_void_p * img.height)(*(spread.ctypes.data + (img.height - 1 - y) * (line + 64)
                                                     for y in range(img.height)))
            rc = from_rows(ctypes.addressof(table), img.width, img.height, out.ctypes.data, ow, oh, int(vfirst))
        else:
            rc = from_copy(src.ctypes.data, img.width, img.height, out.ctypes.data, ow, oh, int(vfirst))
        assert rc == 0
        assert (buf[:64] == 0x5A).all() and (buf[-64:] == 0x5A).all(), "written outside the result"
        return out.reshape(oh, ow, 3)

    return coded


def _numba() -> Raw:
    from prepack.engine.resize.router import _import_kernel

    resize_rgbx = _import_kernel().resize_rgbx

    def raw(img: Image.Image, ow: int, oh: int, vfirst: bool) -> np.ndarray:
        src = raw_pixels(img, "RGBX", 4).view(np.int32).reshape(img.height, img.width)
        return resize_rgbx(src, ow, oh, vfirst)

    return raw


def _raw(name: str) -> Raw:
    return _numba() if name == "numba" else _native(name)


@pytest.fixture(scope="module", params=[*BUILDS, "numba"])
def raw(request) -> Raw:
    return _raw(request.param)


@pytest.fixture(scope="module")
def kernel(raw):
    return lambda img, ow, oh: raw(img, ow, oh, vertical_first(img.width, img.height, ow, oh))


@pytest.fixture(scope="module")
def default_kernel():
    """The build this machine packs with: it gets the long property test."""
    raw = _raw("native")
    return lambda img, ow, oh: raw(img, ow, oh, vertical_first(img.width, img.height, ow, oh))


def _check(kernel, img: Image.Image, ow: int, oh: int) -> None:
    want = np.asarray(img.resize((ow, oh), Image.Resampling.BICUBIC))
    got = kernel(img, ow, oh)
    assert got.dtype == np.uint8 and got.shape == want.shape == (oh, ow, 3)
    if not np.array_equal(got, want):
        bad = np.argwhere(got != want)
        pytest.fail(f"{img.size} -> {(ow, oh)}: {len(bad)} values differ, first at {bad[0].tolist()}")


sides = st.integers(1, 160)
kinds = st.sampled_from(KINDS)


@pytest.mark.slow  # 3,000 examples; every build gets 400 in the fast lane
@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=sides, h=sides, ow=sides, oh=sides, kind=kinds, seed=st.integers(0, 2**32 - 1))
def test_random_sizes_and_contents_equal_pillow(default_kernel, w, h, ow, oh, kind, seed):
    _check(default_kernel, _picture(kind, w, h, seed), ow, oh)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=sides, h=sides, ow=sides, oh=sides, kind=kinds, seed=st.integers(0, 2**32 - 1))
def test_every_build_on_random_sizes_and_contents_equals_pillow(kernel, w, h, ow, oh, kind, seed):
    _check(kernel, _picture(kind, w, h, seed), ow, oh)


@settings(max_examples=150, deadline=None)
@given(long=st.integers(1, 1500), short=st.integers(1, 4), out_long=st.integers(1, 600),
       out_short=st.integers(1, 6), tall=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_tall_and_wide_strips_equal_pillow(kernel, long, short, out_long, out_short, tall, seed):
    w, h, ow, oh = (short, long, out_short, out_long) if tall else (long, short, out_long, out_short)
    _check(kernel, _picture("noise", w, h, seed), ow, oh)


@pytest.mark.parametrize("size", [(1, 1, 1, 1), (1, 1, 9, 7), (9, 7, 1, 1), (1, 50, 1, 3), (50, 1, 3, 1),
                                  (2, 2, 1, 1), (1, 2, 3, 1), (640, 480, 640, 480), (5, 400, 3, 2)])
def test_edge_sizes_equal_pillow(kernel, size):
    w, h, ow, oh = size
    for kind in ("noise", "checker"):
        _check(kernel, _picture(kind, w, h, 7), ow, oh)


@pytest.mark.parametrize("size", [(1024, 768, 512, 384), (1024, 768, 672, 504), (700, 1200, 504, 868),
                                  (1200, 700, 980, 574), (640, 480, 512, 384), (300, 900, 224, 672)])
def test_photographs_at_packer_sizes_equal_pillow(kernel, size):
    w, h, ow, oh = size
    img = dg.photo(3, np.random.RandomState(5), min(w, h), max(w, h)).resize((w, h))
    _check(kernel, img, ow, oh)


def test_pass_order_is_pillows_and_matters(raw):
    """Where Pillow runs the vertical pass first, the other order gives other bytes (the uint8
    intermediate rounds differently): the rule is load-bearing, and ours follows Pillow's."""
    differing = 0
    for i, (w, h, ow, oh) in enumerate([(40, 120, 36, 30), (37, 29, 64, 11), (300, 900, 280, 200), (64, 200, 60, 50)]):
        assert vertical_first(w, h, ow, oh)
        img = _picture("noise", w, h, i)
        want = np.asarray(img.resize((ow, oh), Image.Resampling.BICUBIC))
        assert np.array_equal(raw(img, ow, oh, True), want)
        differing += not np.array_equal(raw(img, ow, oh, False), want)
    assert differing >= 3
    assert not vertical_first(120, 40, 30, 36) and not vertical_first(100, 100, 100, 100)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PREPACK_RESIZE_SWEEP"), reason="1,500 large cases (~2 min): PREPACK_RESIZE_SWEEP=1")
@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=st.integers(1, 2000), h=st.integers(1, 2000), ow=st.integers(1, 1100), oh=st.integers(1, 1100),
       kind=kinds, seed=st.integers(0, 2**32 - 1))
def test_sweep_large_sizes_equal_pillow(default_kernel, w, h, ow, oh, kind, seed):
    if w * h > 1_500_000:  # keep one example under ~50 ms
        w, h = w // 2 + 1, h // 2 + 1
    _check(default_kernel, _picture(kind, w, h, seed), ow, oh)


@pytest.fixture(scope="module", params=BUILDS)
def coded(request) -> Coded:
    return _native_coded(request.param)


def _check_coded(coded: Coded, img: Image.Image, ow: int, oh: int, rows: bool = False) -> None:
    want = encode_rows(np.asarray(img.resize((ow, oh), Image.Resampling.BICUBIC)))
    got = coded(img, ow, oh, vertical_first(img.width, img.height, ow, oh), rows)
    if not np.array_equal(got, want):
        bad = np.argwhere(got != want)
        pytest.fail(f"{img.size} -> {(ow, oh)} coded{' from rows' if rows else ''}: {len(bad)} values differ, "
                    f"first at {bad[0].tolist()}")


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=sides, h=sides, ow=sides, oh=sides, kind=kinds, seed=st.integers(0, 2**32 - 1), rows=st.booleans())
def test_every_build_codes_as_encode_rows_of_pillow(coded, w, h, ow, oh, kind, seed, rows):
    _check_coded(coded, _picture(kind, w, h, seed), ow, oh, rows)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=sides, h=sides, ow=sides, oh=sides, seed=st.integers(0, 2**32 - 1))
def test_coding_follows_either_pass_order(coded, w, h, ow, oh, seed):
    """The coded result is ``encode_rows`` of the plain one in both pass orders (the plain one is
    Pillow's in Pillow's order: the tests above), so coding is independent of the last pass."""
    img = _picture("noise", w, h, seed)
    raw = _native("native")
    for vfirst in (True, False):
        np.testing.assert_array_equal(coded(img, ow, oh, vfirst, False), encode_rows(raw(img, ow, oh, vfirst)))


@pytest.mark.parametrize("size", [(1, 1, 1, 1), (1, 1, 9, 7), (9, 7, 1, 1), (1, 50, 1, 3), (50, 1, 3, 1),
                                  (2, 2, 1, 1), (1, 2, 3, 1), (640, 480, 640, 480), (5, 400, 3, 2),
                                  (17, 33, 17, 5), (33, 17, 5, 17), (16, 16, 17, 17), (18, 9, 16, 8)])
def test_every_build_codes_edge_sizes(coded, size):
    w, h, ow, oh = size
    for kind in ("noise", "checker", "extremes"):
        for rows in (False, True):
            _check_coded(coded, _picture(kind, w, h, 7), ow, oh, rows)


@pytest.mark.parametrize("size", [(1024, 768, 512, 384), (700, 1200, 504, 868), (1200, 700, 980, 574),
                                  (300, 900, 224, 672)])
def test_every_build_codes_photographs_at_packer_sizes(coded, size):
    w, h, ow, oh = size
    img = dg.photo(3, np.random.RandomState(5), min(w, h), max(w, h)).resize((w, h))
    _check_coded(coded, img, ow, oh)
    _check_coded(coded, img, ow, oh, rows=True)
