"""Crashes of a pack to ``s3://`` on a local Ray, against a real S3 server (SeaweedFS).

Two runs.  In the first, both streams are packing when "host a" is lost (driver and workers
SIGKILLed); the same command from "host b" must take over a lease whose holder it cannot see
(after one lease period) and resume.  In the second (one CPU, one stream at a time), a run from
this host and one from another host are refused while it packs; its Ray worker is SIGKILLed (Ray
retries the task, which resumes), then its driver as soon as one stream has finished; the same command on this
host takes over at once (the holder's PID is dead) and resumes.  Afterwards the objects of each
pack are exactly those of an uninterrupted pack on a local disk (same names, same bytes, no
lock, no leftover), every stream reads back through the loader as the local pack does, and the
secret key appears in no object, no output of any run and no Ray log.

Kill points are read from the run's progress bar (``--progress``) or from the stream index and
done files the format names (``schemas.manifest``), never from a file's bytes.
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from prepack.run.lease import HOST_ENV, LEASE_DIR, LEASE_ENV
from schemas.layout import done_file, index_file
from tests.helpers.packs import pack_in_process
from tests.helpers.ray_helpers import RayRun, cmdline, make_demo, prepack, read_log, summary, variant, wait_until
from tests.helpers.s3checks import local_files, same_pack_objects, secret_leaks, stream_fingerprints

pytestmark = pytest.mark.slow  # starts Ray and the S3 server

BATCHES = 12  # at ~0.2 s a batch, enough progress-bar updates to aim each kill
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


def _kill_driver(rr, driver, host_lost: bool) -> None:
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait(timeout=30)
    if host_lost:  # the host is gone: everything on it dies at once
        rr.kill_all()
        return
    # same host: the orphaned workers stop by themselves (they watch their raylet)
    survivors = rr.wait_gone(30, keep=lambda p: not is_agent(p))
    assert not survivors, [cmdline(p) for p in survivors]
    rr.kill_all()


def _rerun(rr, s3, uri, config, reference, host: str | None, texts: dict[str, str]):
    """The same command again after a kill: it takes the lock over, resumes, and ends with the reference's objects."""
    left = s3.objects(uri)
    leases = {k for k in left if k.startswith(LEASE_DIR + "/")}
    assert leases, "the killed run's lease should still be there"
    assert left.keys() - leases != reference[1].keys(), "the kill came after the pack was complete (inconclusive)"
    t = time.monotonic()
    rerun = rr.run(prepack("run", config, "--out", uri), timeout=240, **{LEASE_ENV: LEASE, **({HOST_ENV: host} if host else {})})
    took = time.monotonic() - t
    assert rerun.returncode == 0, rerun.stderr[-4000:]
    check_final(s3, uri, reference, {**texts, "rerun": rerun.stdout + rerun.stderr}, rr.tmp)
    assert "taking over the lease" in rerun.stderr, rerun.stderr[-3000:]
    if host:  # it could not see the holder's process: it watched the lease lapse first
        assert "not renewed for 3 s" in rerun.stderr and took > float(LEASE), rerun.stderr[-3000:]
    else:
        assert "on this host is gone" in rerun.stderr, rerun.stderr[-3000:]
    assert summary(rerun.stdout)[0].startswith(f"packed: 2 streams, {2 * BATCHES} batches, "), rerun.stdout
    assert "batches were already committed" in rerun.stdout, rerun.stdout  # resumed, not redone


def test_driver_sigkill_on_one_host_rerun_from_another(s3, reference, tmp_path):
    """Both streams packing, a first shard committed: host a is lost; host b runs the same command."""
    config = reference[0]
    uri = s3.new_prefix("kill-host-a")
    with RayRun() as rr:
        driver = rr.popen(prepack("run", config, "--out", uri, "--bar"), str(tmp_path / "killed"),
                          **{LEASE_ENV: LEASE, HOST_ENV: "host-a"})
        wait_until(lambda: any(s3.exists(f"{uri}/{index_file(s)}") for s in (0, 1)), 240, "a first committed shard",
                   driver, poll=0.05)
        _kill_driver(rr, driver, host_lost=True)
        # a run killed after every stream finished leaves a lease another host cannot prove stale yet
        assert not all(s3.exists(f"{uri}/{done_file(s)}") for s in (0, 1)), "every stream had finished (inconclusive)"
        _rerun(rr, s3, uri, config, reference, "host-b", dict(zip(("killed.out", "killed.err"), read_log(driver))))


def test_concurrent_runs_refused_worker_then_driver_killed(s3, reference, tmp_path):
    """One run (one CPU: one stream at a time).  While it packs, a run from this host and one
    from another host are refused; its Ray worker is SIGKILLed (Ray retries the task, which
    resumes); then the driver is SIGKILLed as soon as one stream has finished, and the same
    command on this host resumes the pack."""
    config = reference[0]
    uri = s3.new_prefix("kill-worker-driver")
    with RayRun() as rr:
        driver = rr.popen(prepack("run", config, "--out", uri, "--num-cpus", "1", "--bar"),
                          str(tmp_path / "run"), **{LEASE_ENV: LEASE})
        wait_until(lambda: any(k.startswith(LEASE_DIR + "/") for k in s3.objects(uri)), 120, "the run's lease", driver,
                   poll=0.2)
        same_host = rr.popen(prepack("run", config, "--out", uri), str(tmp_path / "same"), **{LEASE_ENV: LEASE})
        other_host = rr.popen(prepack("run", config, "--out", uri), str(tmp_path / "other"),
                              **{LEASE_ENV: LEASE, HOST_ENV: "host-b"})
        refused = {name: (p.wait(timeout=120), read_log(p)[1]) for name, p in
                   (("same", same_host), ("other", other_host))}
        assert driver.poll() is None, "the run ended before the concurrent runs were checked (inconclusive)"
        for name, (code, err) in refused.items():
            assert code == 1 and "is being packed by another prepack run" in err, (name, err[-2000:])

        wait_until(lambda: sum(batches_so_far(driver).values()) >= 2, 240, "two batches", driver, poll=0.05)
        workers = [p for p in rr.pids() if cmdline(p).startswith("ray::stream_task")]
        assert len(workers) == 1, [cmdline(p) for p in rr.pids()]
        os.kill(workers[0], signal.SIGKILL)
        retried = lambda: "stream_task" in "".join(read_log(driver)) and "retr" in "".join(read_log(driver))  # noqa: E731
        wait_until(retried, 240, "the driver to report Ray's retry of the killed task", driver, poll=0.05)
        # the store says first (the progress output lags by up to a second, and the retried stream
        # may be only a few batches behind): kill as soon as one stream's done.json exists
        wait_until(lambda: any(s3.exists(f"{uri}/{done_file(s)}") for s in (0, 1)), 240, "one stream to finish",
                   driver, poll=0.05)
        _kill_driver(rr, driver, host_lost=False)
        assert not all(s3.exists(f"{uri}/{done_file(s)}") for s in (0, 1)), "every stream had finished (inconclusive)"
        out, err = read_log(driver)
        texts = {"killed": out + err, **{name: e for name, (_, e) in refused.items()}}
        _rerun(rr, s3, uri, config, reference, None, texts)
