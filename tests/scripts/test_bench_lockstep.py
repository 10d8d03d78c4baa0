"""scripts/bench_lockstep.py places its batches where the rank-sum and lockstep models disagree, and
a tiny run (two ranks under FSDP2 on CPU) ends with the headline line in its exact form, every
step time positive.  No timing is asserted: the figures depend on the machine and its load."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers.paths import REPO

sys.path.insert(0, os.path.join(REPO, "scripts"))
import bench_lockstep  # noqa: E402

_NUM = r"(\d+\.\d+)"
_LAST = re.compile(rf"lockstep bench: step time reference {_NUM} s, rank-sum {_NUM} s, micro-step {_NUM} s "
                   r"\(W=2 M=4, FSDP2 on cpu\)")


def test_the_batches_separate_the_two_models():
    sizes = bench_lockstep.arrangement(64, 8)
    assert sorted(sizes.tolist()) == [8] * 4 + [64] * 4
    plans = bench_lockstep.assignments(sizes)
    (ref_lock, ref_sum), (rs_lock, rs_sum), (ms_lock, ms_sum) = (
        bench_lockstep.predictions(sizes, plans[k]) for k in bench_lockstep.NAMES)
    for plan in plans.values():  # each an assignment: every batch once
        assert sorted(np.asarray(plan).reshape(-1).tolist()) == list(range(8))
    assert rs_sum == ms_sum == sizes.sum() / 2 < ref_sum  # rank-sum balancing evens the sums perfectly,
    assert ms_lock < ref_lock < rs_lock  # yet under lockstep it is slower than the reference


@pytest.mark.slow  # the benchmark in a subprocess, two ranks under FSDP2 (~5 s)
def test_bench_lockstep_tiny_ends_with_the_headline_line():
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "bench_lockstep.py"), "--width", "16",
                           "--layers", "2", "--large", "64", "--small", "8", "--warmup", "0", "--repeats", "1"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[1] == "batch sizes (rows, reference order): " + " ".join(
        str(s) for s in bench_lockstep.arrangement(64, 8)), proc.stdout
    for name in bench_lockstep.NAMES:
        assert any(ln.startswith(f"{name} ") for ln in lines), proc.stdout
    m = _LAST.fullmatch(lines[-1])
    assert m, lines[-1]
    assert all(float(v) > 0 for v in m.groups())
