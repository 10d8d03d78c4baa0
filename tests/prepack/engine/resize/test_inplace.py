"""The C kernel reading Pillow's rows in place: the same bytes as Pillow, with rows in one memory
block or spread over many, and the copy wherever the layout is not as expected."""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest
from PIL import Image

from prepack.engine.resize import PINNED_PILLOW, inplace, router, selftest
from tests.helpers.pictures import picture

pytestmark = pytest.mark.skipif(Image.__version__ != PINNED_PILLOW, reason="the layout is the pinned Pillow's")


def _needs_cc():
    from prepack.engine.resize import native

    try:
        native.compiler(os.environ)
    except native.BuildError as exc:
        pytest.skip(f"no C kernel on this machine: {exc}")


@pytest.fixture
def small_blocks():
    """Pillow's memory in 4 KiB blocks: a picture's rows no longer lie end to end."""
    size = Image.core.get_block_size()
    Image.core.set_block_size(4096)
    yield
    Image.core.set_block_size(size)


def _table(img: Image.Image) -> list[int]:
    held = inplace.rows(img)
    assert held is not None
    return list((ctypes.c_void_p * img.height).from_address(held[1]))


def test_the_probe_reads_this_pillows_rows_and_other_modes_are_not_read():
    assert inplace.probe()
    assert inplace.rows(picture("noise", 5, 4, 0)) is not None
    for mode in ("L", "RGBA", "P", "I;16"):
        assert inplace.rows(Image.new(mode, (5, 4))) is None
    assert inplace.rows(Image.new("RGB", (0, 3))) is None


def test_an_unexpected_layout_means_the_copy(monkeypatch):
    monkeypatch.setattr(inplace, "CAPSULE_NAME", b"Not Pillow")
    assert inplace.rows(picture("noise", 5, 4, 0)) is None and not inplace.probe()
    monkeypatch.undo()
    img = picture("noise", 6, 3, 0)
    real = inplace._Imaging.from_address

    def shifted(address):  # a struct one int further on: sizes no longer agree
        return real(address + 4)

    monkeypatch.setattr(inplace._Imaging, "from_address", shifted)
    assert inplace.rows(img) is None


@pytest.mark.parametrize("size", [(1024, 768, 512, 384), (768, 1024, 672, 384), (211, 157, 98, 73), (1, 9, 4, 2),
                                  (300, 7, 3, 7), (17, 13, 17, 13)])
def test_in_place_equals_pillow_with_rows_in_one_block_or_many(size, request):
    _needs_cc()
    w, h, ow, oh = size
    kernel = router.native_kernel()
    for spread in (False, True):
        if spread:
            request.getfixturevalue("small_blocks")
        img = picture("smooth", w, h, w + h)
        table = _table(img)
        contiguous = all(table[y] == table[0] + 4 * w * y for y in range(h))
        assert contiguous != (spread and 4 * w * h > 4096)
        want = np.asarray(img.resize((ow, oh), Image.Resampling.BICUBIC))
        np.testing.assert_array_equal(kernel(img, ow, oh), want)


def test_the_router_kernel_reads_in_place_and_copies_only_without_it(monkeypatch):
    _needs_cc()
    copies = []
    real = router.raw_pixels
    monkeypatch.setattr(router, "raw_pixels", lambda *a: copies.append(a) or real(*a))
    img = picture("noise", 64, 48, 1)
    want = router.pillow_resize(img, 31, 22)
    np.testing.assert_array_equal(router.native_kernel()(img, 31, 22), want)
    assert copies == []
    np.testing.assert_array_equal(router.native_kernel(in_place=False)(img, 31, 22), want)
    assert len(copies) == 1
    monkeypatch.setattr(inplace, "probe", lambda: False)  # the layout not as expected: the copy, still exact
    kernel = router.native_kernel()
    assert selftest.mismatches(kernel) == [] and len(copies) > 1
