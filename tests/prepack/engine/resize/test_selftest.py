"""The self-test's cases span what the arithmetic distinguishes, and it reports differences."""

from __future__ import annotations

import numpy as np

from prepack.engine.resize.router import pillow_resize, vertical_first
from prepack.engine.resize.selftest import CASES, mismatches


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
