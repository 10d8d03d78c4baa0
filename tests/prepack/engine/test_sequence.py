"""The layout's run-length sequences give, element for element, the arrays of the lists they replace."""

from __future__ import annotations

import random

import numpy as np

from prepack.engine.sequence import _Runs


def test_runs_of_ranges_and_repeats_are_the_lists_they_stand_for():
    rng = random.Random(5)
    for _ in range(300):
        runs, as_list = _Runs(), []
        for _ in range(rng.randrange(0, 12)):
            n = rng.choice([0, 1, 2, rng.randrange(1, 3000)])
            v = rng.randrange(-5, 40000)
            if rng.random() < 0.5:
                runs.range(v, n)
                as_list.extend(range(v, v + n))
            else:
                runs.repeat(v, n)
                as_list.extend([v] * n)
        got, want = runs.ints(), np.asarray(as_list, np.int32)
        assert got.dtype == want.dtype and np.array_equal(got, want)


def test_float_repeats_keep_each_value_and_minus_infinity():
    rng = random.Random(6)
    runs, as_list = _Runs(), []
    for value in [float("-inf"), 1.0] + [rng.gauss(0, 1) for _ in range(50)] + [1 / 7 ** 0.5]:
        n = rng.randrange(0, 40)
        runs.repeat(value, n)
        as_list.extend([value] * n)
    got = runs.floats().astype(np.float32)
    want = np.asarray(as_list, np.float64).astype(np.float32)
    assert got.tobytes() == want.tobytes()
    assert _Runs().floats().size == 0 and _Runs().ints().size == 0
