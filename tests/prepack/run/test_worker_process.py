"""Packing-worker process settings: freed memory stays with the process (no page faults per record)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from tests.helpers.paths import REPO

# Two 20 MiB arrays made and freed per round, as a record's buffers are; prints each round's
# minor page faults.  With glibc's defaults the heap is trimmed after every round and faulted in
# again; kept, rounds after the first fault nothing.
_ROUNDS = """
import resource, sys
import numpy as np
if sys.argv[1] == "settled":
    from prepack.run.worker_process import settle_worker_process
    settle_worker_process()
out = []
for _ in range(5):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a = np.ones(20 * 2**20, np.uint8); b = np.ones(20 * 2**20, np.uint8)
    del a, b
    out.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print(" ".join(map(str, out)))
"""


def _faults(mode: str) -> list[int]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-c", _ROUNDS, mode], env=env, capture_output=True, text=True, check=True)
    return [int(x) for x in proc.stdout.split()]


@pytest.mark.skipif(not (sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"),
                    reason="the allocator settings are glibc's")
def test_settled_worker_reuses_freed_record_buffers():
    default, settled = _faults("default"), _faults("settled")
    assert sum(default[2:]) > 100, default  # glibc's defaults fault the buffers in every round
    assert sum(settled[2:]) < sum(default[2:]) / 10, (default, settled)


def test_settings_are_a_no_op_without_glibc(monkeypatch):
    from prepack.run import worker_process

    monkeypatch.setattr(worker_process.sys, "platform", "darwin")
    assert worker_process._keep_freed_memory() is False
