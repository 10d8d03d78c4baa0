"""scripts/bench_resize.py runs, checks its results against Pillow and prints its figures."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from PIL import Image

from prepack.engine.resize import PINNED_PILLOW
from tests.helpers.paths import REPO


@pytest.mark.skipif(Image.__version__ != PINNED_PILLOW, reason="the kernel mirrors the pinned Pillow")
def test_bench_resize_prints_a_line_per_size_and_the_median():
    env = dict(os.environ, PYTHONPATH=REPO)
    env.pop("PREPACK_FAST_RESIZE", None)
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "bench_resize.py"), "--reps", "1",
                           "--sizes", "2", "--no-startup"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert sum("->" in ln and ln.rstrip().endswith("x") for ln in lines) == 2
    assert lines[-1].startswith("median speed-up") and "identical bytes" in lines[-1] and "native" in lines[-1]
