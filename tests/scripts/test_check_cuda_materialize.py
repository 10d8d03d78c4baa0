"""scripts/check_cuda_materialize.py: one clean line without CUDA; its whole logic dry-runs on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from tests.helpers.paths import REPO

SCRIPT = os.path.join(REPO, "scripts", "check_cuda_materialize.py")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_without_cuda_exits_0_with_one_line():
    proc = _run()
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    assert lines == ["no CUDA device present: nothing to check (run this on a GPU machine)"]


@pytest.mark.slow  # builds a pack and times the loader in a subprocess
def test_cpu_dry_run_checks_and_times_the_loader():
    proc = _run("--device", "cpu", "--batches", "3", "--max-side", "6", "--workers", "1")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "PASSED" in out and "loader feeding cpu: 3 batches" in out and "ms per batch (1 workers" in out
