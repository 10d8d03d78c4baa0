"""The self-test's cases span what the arithmetic distinguishes, and it reports differences."""

from __future__ import annotations

import ctypes

import numpy as np

from prepack.engine.resize.router import pillow_resize, vertical_first
from prepack.engine.resize.selftest import CASES, mismatches
from schemas.pixel_table import encode_rows


def test_cases_cover_both_pass_orders_scaling_directions_and_one_pixel():
    orders = {vertical_first(*c) for c in CASES if c[1] != c[3] and c[0] != c[2]}
    assert orders == {True, False}
    assert any(ow < w for w, h, ow, oh in CASES) and any(ow > w for w, h, ow, oh in CASES)
    assert any(oh < h for w, h, ow, oh in CASES) and any(oh > h for w, h, ow, oh in CASES)
    assert any(1 in (w, h) for w, h, ow, oh in CASES) and any(1 in (ow, oh) for w, h, ow, oh in CASES)
    assert any((w, h) == (ow, oh) for w, h, ow, oh in CASES)


def test_pillow_itself_passes_and_a_wrong_shape_or_value_is_named():
    assert mismatches(pillow_resize) == []

    def transposed(img, w, h):
        return np.ascontiguousarray(pillow_resize(img, w, h).swapaxes(0, 1))

    bad = mismatches(transposed)
    assert bad and all("->" in b for b in bad)


class _Coding:
    """Pillow, with a coded form that ``spoil`` may get wrong."""

    def __init__(self, spoil=None):
        self.spoil = spoil

    def __call__(self, img, w, h):
        return pillow_resize(img, w, h)

    def coded(self, img, w, h, out):
        encode_rows(pillow_resize(img, w, h), out=out)
        if self.spoil is not None:
            self.spoil(out)


def test_a_coded_form_is_checked_too_even_outside_its_slot():
    assert mismatches(_Coding()) == []

    def one_value(out):
        out[-1, -1, 2] ^= 1

    def past_the_end(out):
        ctypes.memset(out.ctypes.data + out.size, 0, 1)

    def plain(out):
        out[:] = np.cumsum(out, axis=1, dtype=np.uint8)

    for spoil in (one_value, past_the_end, plain):
        bad = mismatches(_Coding(spoil))
        assert bad and all(b.endswith(" coded") for b in bad), spoil.__name__
