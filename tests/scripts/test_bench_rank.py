"""scripts/bench_rank.py runs both sides of one rank on tiny data, checks they yield the same
batches, and ends with the headline line in its exact form (every number positive); the /proc
readers it samples memory and CPU with see a process tree and its shared memory."""

from __future__ import annotations

import multiprocessing
import os
import re
import subprocess
import sys
import time

import pytest

from tests.helpers.paths import REPO

sys.path.insert(0, os.path.join(REPO, "scripts"))
import bench_rank  # noqa: E402

_LAST = re.compile(r"rank: online K=(\d+) (\d+) MB, (\d+) ms/batch; pack K=(\d+) (\d+) MB, (\d+) ms/batch "
                   r"\(memory (\d+\.\d+) x, CPU (\d+\.\d+) x\)")


@pytest.mark.slow  # runs the whole benchmark, both sides of a rank (~1 min)
def test_bench_rank_tiny_ends_with_the_headline_line():
    env = dict(os.environ, PYTHONPATH=REPO, RAY_AUTH_MODE="disabled")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "bench_rank.py"), "--tiny", "--batches", "2",
                           "--pack-inline"], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert any(ln.startswith("same batches: all 2 digests equal") for ln in lines), proc.stdout
    m = _LAST.fullmatch(lines[-1])
    assert m, lines[-1]
    k1, x, a, k2, y, b = (int(v) for v in m.groups()[:6])
    rm, rc = float(m[7]), float(m[8])
    assert k1 == k2 == 2 and min(x, a, y, b) > 0 and rm > 0 and rc > 0
    assert abs(rm - x / y) < 0.01 + 0.01 * rm and abs(rc - a / b) < 0.02 + 0.02 * rc  # the ratios of the figures


def _hold(ready, done) -> None:
    import mmap

    buf = mmap.mmap(-1, 1 << 20)
    buf.write(b"x" * (1 << 20))
    ready.set()
    done.wait(30)


def test_the_tree_sampler_sees_children_and_their_memory():
    ctx = multiprocessing.get_context("fork")
    ready, done = ctx.Event(), ctx.Event()
    kids = [ctx.Process(target=_hold, args=(ready, done)) for _ in range(2)]
    for k in kids:
        k.start()
    try:
        ready.wait(10)
        time.sleep(0.2)
        me = os.getpid()
        found = bench_rank.descendants(me)
        assert {k.pid for k in kids} <= set(found)
        sampler = bench_rank.TreeSampler(me, 0.02)
        sampler.start()
        time.sleep(0.2)
        samples = sampler.stop()
        assert samples and all(s.pss > 0 for s in samples)
        assert bench_rank.process_cpu_s(me) > 0
    finally:
        done.set()
        for k in kids:
            k.join(10)


def test_shared_memory_held_open_but_not_mapped_counts_as_in_flight():
    """A batch a DataLoader worker has sent and the trainer not yet received is a shared-memory
    file only an open descriptor holds: in no process's PSS, so the sampler adds it."""
    from multiprocessing import shared_memory

    mib = 1 << 20
    path = f"/dev/shm/bench-rank-test-{os.getpid()}"
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o600)
    os.unlink(path)
    os.write(fd, b"y" * (2 * mib))
    mapped = shared_memory.SharedMemory(create=True, size=3 * mib)
    mapped.buf[:] = b"z" * (3 * mib)
    try:
        sizes, maps = {}, set()
        bench_rank._shm_held(os.getpid(), sizes, maps)
        held = os.fstat(fd).st_ino
        assert sizes.get(held, 0) >= 2 * mib and held not in maps
        assert any(ino in maps for ino in sizes if ino != held)  # the mapped one is in the maps
        sampler = bench_rank.TreeSampler(os.getpid(), 0.02)
        sampler.start()
        time.sleep(0.1)
        s = sampler.stop()[-1]
        assert s.unmapped >= 2 * mib and s.shm >= 5 * mib and s.memory == s.pss + s.unmapped
    finally:
        os.close(fd)
        mapped.close()
        mapped.unlink()
