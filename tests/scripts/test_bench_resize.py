"""scripts/bench_resize.py runs, checks its results against Pillow and prints its figures."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
from PIL import Image

from prepack.engine.resize import PINNED_PILLOW
from tests.helpers.paths import REPO


@pytest.mark.skipif(Image.__version__ != PINNED_PILLOW, reason="the kernel mirrors the pinned Pillow")
def test_bench_resize_prints_the_cpu_a_line_per_size_and_the_medians():
    env = dict(os.environ, PYTHONPATH=REPO)
    env.pop("PREPACK_FAST_RESIZE", None)
    isa = "native,portable" if platform.machine() in ("x86_64", "AMD64") else "native"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "bench_resize.py"), "--reps", "2",
                           "--sizes", "2", "--no-startup", "--isa", isa], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("CPU: ") and "vector level" in lines[0] and "the router resizes with" in lines[0]
    rows = [ln for ln in lines if "->" in ln]
    assert len(rows) == 2 and all(ln.count("x (") == len(isa.split(",")) + 1 for ln in rows)  # each C build, numba
    summary = [ln for ln in lines if "median over the sizes" in ln]
    assert len(summary) == len(isa.split(",")) + 1 and all("identical bytes" in ln for ln in summary)
    if "portable" in isa:
        assert any(ln.startswith("C[portable]:") for ln in summary)
