"""scripts/bench_bounded.py runs a bounded pack (``prepack run --ahead``) against two simulated
trainings on tiny demo budgets, kills the packer and one training mid-way and starts them again
(by PID, inside the script), and ends with the headline line in its exact form: the ratio is the
two figures', the bounded pack held less than the whole pack at its peak, and every batch equals
the pack made at once.  No timing is asserted."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.helpers.paths import REPO

_LAST = re.compile(r"bounded: disk peak (\d+\.\d) MiB of (\d+\.\d) MiB \(ratio (\d+\.\d\d)\); "
                   r"trainer waited (\d+\.\d) ms/step; batches (equal|DIFFER)")


@pytest.mark.slow  # a bounded pack, two trainings and restarts through the script
def test_bench_bounded_tiny_ends_with_the_headline_line(tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    # 6 batches a stream, a shard each; a checkpoint every 2 steps, the newest kept: the restarted
    # packer trims the first shards before it packs the last ones, so the peak is below the whole; under
    # the least --disk-budget the run accepts as well
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "bench_bounded.py"), "--batches", "6",
                           "--ahead", "1", "--checkpoint-every", "2", "--keep-checkpoints", "1", "--step-ms", "200",
                           "--disk-budget", "least", "--timeout", "240", "--tmp", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("machine: "), lines[0]
    assert any(ln.startswith("packer killed (SIGKILL)") for ln in lines), proc.stdout
    assert any(ln.startswith("rank 1 killed (SIGKILL)") for ln in lines), proc.stdout
    assert sum(ln.endswith("the same batches in order as the whole pack") for ln in lines) == 2, proc.stdout
    assert any(ln.startswith("disk budget: ") and "the peak sampled within it" in ln for ln in lines), proc.stdout
    m = _LAST.fullmatch(lines[-1])
    assert m, lines[-1]
    peak, whole, ratio, waited = float(m[1]), float(m[2]), float(m[3]), float(m[4])
    assert m[5] == "equal"
    assert 0 < peak and 0 < whole and waited >= 0
    # the ratio of the two figures, within their rounding (X and Y to 0.05 MiB, R to 0.005)
    assert abs(ratio - peak / whole) <= 0.005 + 0.05 / whole * (1 + peak / whole) + 1e-9
    assert ratio < 1, lines[-1]  # a bounded pack holds less than the whole pack
    assert os.listdir(tmp_path) == []  # its temporary folder is gone


_TWO = re.compile(r"bounded: disk peak (\d+\.\d) MiB at (\d+) batches a stream, (\d+\.\d) MiB at (\d+) \(x(\d+\.\d\d)\); "
                  r"whole packs (\d+\.\d) and (\d+\.\d) MiB; trainer waited (\d+\.\d) ms/step; batches (equal|DIFFER)")


def test_two_lengths_headline_compares_their_peaks():
    """``--batches N1,N2``: the last line gives both peaks and their ratio (the run itself is the slow
    test above, with one length)."""
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    try:
        import bench_bounded
    finally:
        sys.path.pop(0)
    mib = bench_bounded.MIB
    runs = [bench_bounded.Result(32, int(88.3 * mib), int(155.8 * mib), 120.0, True),
            bench_bounded.Result(160, int(91.4 * mib), int(752.5 * mib), 80.0, True)]
    m = _TWO.fullmatch(bench_bounded.headline(runs))
    assert m and (m[2], m[4], m[9]) == ("32", "160", "equal")
    assert abs(float(m[5]) - float(m[3]) / float(m[1])) < 0.006 and float(m[8]) == 100.0
    runs[1].equal = False
    assert bench_bounded.headline(runs).endswith("batches DIFFER")
    assert _LAST.fullmatch(bench_bounded.headline(runs[:1]))
