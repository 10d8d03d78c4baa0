"""Crashes of a pack to ``s3://`` on a local Ray, against a real S3 server (SeaweedFS).

Killed: the driver at two points (then the same command again: from "another host" after the
first kill, so the rerun must take over a lease whose holder it cannot see; from the same host
after the second, where the dead PID is proof), and, in a separate run, the Ray worker packing a
stream (Ray retries the task, which resumes).  While that run packs, two more runs on the same
output — one from this host, one from "another host" — are refused.  Afterwards the objects of
the pack are exactly those of an uninterrupted pack on a local disk (same names, same bytes, no
lock, no leftover), and every stream reads back through the loader as the local pack does.

Kill points are read from the run's progress bar (``--progress``), not from file names, so these
tests hold whatever the on-disk format is.
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from prepack.run.lock import HOST_ENV, LEASE_ENV, LOCK_NAME
from tests.helpers.packs import pack_in_process
from tests.helpers.ray_helpers import RayRun, cmdline, make_demo, prepack, read_log, summary, variant, wait_until
from tests.helpers.s3checks import local_files, same_pack_objects, secret_leaks, stream_fingerprints

pytestmark = pytest.mark.slow  # starts Ray and the S3 server

BATCHES = 6
SHARD_BYTES = 5_000_000  # records are ~2-4 MB: about two records per shard
LEASE = "3"  # seconds: a rerun from another host waits this long before taking a dead run's lock over


@pytest.fixture(scope="module")
def reference(tokenizer_and_special, tmp_path_factory):
    """The demo config and its uninterrupted pack on a local disk, in process (no Ray)."""
    root = str(tmp_path_factory.mktemp("s3faults"))
    config = variant(make_demo(root), "faults.yaml", batches_per_stream=BATCHES, shard_bytes=SHARD_BYTES)
    out = pack_in_process(config, os.path.join(root, "reference"), tokenizer_and_special)
    return config, local_files(out), stream_fingerprints(out, 2)


_PROGRESS = re.compile(r"s(\d+):(\d+)/")


def batches_so_far(proc) -> dict[int, int]:
    """Batches per stream as the run's progress bar last showed them."""
    _, err = read_log(proc)
    seen: dict[int, int] = {}
    for s, n in _PROGRESS.findall(err):
        seen[int(s)] = int(n)
    return seen


def is_agent(pid: int) -> bool:
    # Ray's per-node agents outlive a SIGKILLed driver by up to a minute; they write nothing here.
    return any(a in cmdline(pid) for a in ("DashboardAgent", "RuntimeEnvAgent"))


def check_final(s3, uri: str, reference, texts: dict[str, str], ray_dir: str) -> None:
    """Exactly the reference's objects; the loader reads the same batches; no secret anywhere
    (objects, the runs' output, Ray's session logs)."""
    _, ref_files, ref_prints = reference
    objects = s3.objects(uri)
    assert same_pack_objects(objects, ref_files) == []  # no lock, no leftover, same bytes
    assert stream_fingerprints(uri, 2) == ref_prints
    assert secret_leaks(s3.secret_key, objects, texts, (ray_dir,)) == []


@pytest.mark.parametrize("point,rerun_host", [("first_shards", "host-b"), ("one_stream_done", None)])
def test_driver_sigkill_then_rerun(point, rerun_host, s3, reference, tmp_path):
    config = reference[0]
    uri = s3.new_prefix(f"kill-{point}")
    with RayRun() as rr:
        if point == "first_shards":  # both streams packing; a couple of shards committed
            args, cond = [], lambda: max(batches_so_far(driver).values(), default=0) >= 2
        else:  # one CPU: stream 0 runs to its budget first; kill as it finishes
            args, cond = ["--num-cpus", "1"], lambda: batches_so_far(driver).get(0, 0) >= BATCHES
        first_env = {LEASE_ENV: LEASE, **({HOST_ENV: "host-a"} if rerun_host else {})}
        driver = rr.popen(prepack("run", config, "--out", uri, "--progress", *args), str(tmp_path / "killed"),
                          **first_env)
        wait_until(cond, 240, f"kill point {point}", driver, poll=0.05)
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(timeout=30)
        survivors = rr.wait_gone(30, keep=lambda p: not is_agent(p))
        assert not survivors, [cmdline(p) for p in survivors]
        rr.kill_all()

        left = s3.objects(uri)
        assert LOCK_NAME in left, "the killed run's lock should still be there"
        assert left.keys() != reference[1].keys(), "the kill came after the pack was complete (inconclusive)"

        env = {LEASE_ENV: LEASE, **({HOST_ENV: rerun_host} if rerun_host else {})}
        t = time.monotonic()
        rerun = rr.run(prepack("run", config, "--out", uri), timeout=240, **env)
        took = time.monotonic() - t
        assert rerun.returncode == 0, rerun.stderr[-4000:]
        texts = dict(zip(("killed.out", "killed.err"), read_log(driver)), rerun=rerun.stdout + rerun.stderr)
        check_final(s3, uri, reference, texts, rr.tmp)
    assert "taking over the lock" in rerun.stderr, rerun.stderr[-3000:]
    if rerun_host:  # it could not see the holder's process: it watched the lease lapse first
        assert "not renewed for 3 s" in rerun.stderr and took > float(LEASE), rerun.stderr[-3000:]
    else:
        assert "on this host is gone" in rerun.stderr, rerun.stderr[-3000:]
    assert summary(rerun.stdout)[0].startswith(f"packed: 2 streams, {2 * BATCHES} batches, "), rerun.stdout
    assert "batches were already committed" in rerun.stdout, rerun.stdout  # resumed, not redone


def test_worker_sigkill_and_concurrent_runs_refused(s3, reference, tmp_path):
    config = reference[0]
    uri = s3.new_prefix("worker-kill")
    with RayRun() as rr:
        driver = rr.popen(prepack("run", config, "--out", uri, "--num-cpus", "1", "--progress"),
                          str(tmp_path / "run"), **{LEASE_ENV: LEASE})
        wait_until(lambda: s3.exists(f"{uri}/{LOCK_NAME}"), 120, "the run's lock", driver, poll=0.2)
        same_host = rr.popen(prepack("run", config, "--out", uri), str(tmp_path / "same"), **{LEASE_ENV: LEASE})
        other_host = rr.popen(prepack("run", config, "--out", uri), str(tmp_path / "other"),
                              **{LEASE_ENV: LEASE, HOST_ENV: "host-b"})
        refused = {name: (p.wait(timeout=120), read_log(p)[1]) for name, p in
                   (("same", same_host), ("other", other_host))}
        still_running = driver.poll() is None

        wait_until(lambda: sum(batches_so_far(driver).values()) >= 2, 240, "two batches", driver, poll=0.05)
        workers = [p for p in rr.pids() if cmdline(p).startswith("ray::stream_task")]
        assert len(workers) == 1, [cmdline(p) for p in rr.pids()]
        os.kill(workers[0], signal.SIGKILL)
        rc = driver.wait(timeout=300)
        stdout, stderr = read_log(driver)
        assert rc == 0, stderr[-4000:]
        texts = {"run": stdout + stderr, **{name: err for name, (_, err) in refused.items()}}
        check_final(s3, uri, reference, texts, rr.tmp)
    assert still_running, "the run ended before the concurrent runs were checked (inconclusive)"
    for name, (code, err) in refused.items():
        assert code == 1 and "another prepack run" in err and LOCK_NAME in err, (name, err[-2000:])
    assert "stream_task" in stdout + stderr and "retr" in stdout + stderr, (stdout + stderr)[-3000:]
