"""Crashes of a pack on a local Ray: the rerun (or Ray's task retry) finishes with exactly the
records of an uninterrupted run.

The config has small shards (about two records each) so every stream commits several shards
and a kill lands between commits.  Killed: the driver (``prepack run``) at two points, and, in
a separate run, the Ray worker process executing a stream task.  Afterwards: every record
digest, shard boundary and counter equals an uninterrupted pack's, streams are contiguous (no
record lost or repeated), shards committed before the kill were kept (resumed, not redone),
and no ``.tmp`` file or lock is left.  Locks of dead (or zombie) processes are taken over.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from prepack.tools.lineage_queries import scan_lineage
from tests.helpers.ray_helpers import (
    lease_files,
    RayRun,
    check_stream_contiguity,
    committed_shards,
    cmdline,
    leftovers,
    load_manifest,
    make_demo,
    prepack,
    process_state,
    read_back,
    read_log,
    same_streams,
    summary,
    variant,
    wait_until,
)

pytestmark = pytest.mark.slow  # starts Ray or runs the reference for many batches

BATCHES = 8
SHARD_BYTES = 3_000_000  # records are ~1-4 MB: about two records a shard, four shards a stream


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    root = tmp_path_factory.mktemp("rayfaults")
    return variant(make_demo(str(root)), "faults.yaml", batches_per_stream=BATCHES, shard_bytes=SHARD_BYTES)


@pytest.fixture(scope="module")
def reference(config, tokenizer_and_special, tmp_path_factory):
    """The uninterrupted pack, in process (no Ray): each stream packed start to end."""
    from prepack.run.driver import finalize
    from prepack.run.identity import pack_identity
    from prepack.run.stream_job import StreamJob, pack_one_stream
    from prepack.engine.tokenizer import tokenizer_fingerprint
    from prepack.run.identity import write_identity
    from schemas.config_file import load_config
    from schemas.location import resolve_location

    cfg = load_config(config)
    tok, special = tokenizer_and_special
    identity = pack_identity(cfg, tokenizer_fingerprint(tok), special)
    out = str(tmp_path_factory.mktemp("reference") / "out")
    for s in range(cfg.num_streams):
        pack_one_stream(StreamJob(cfg, out, identity.shard_metadata()), s, tok, special)
    loc = resolve_location(out)
    write_identity(loc, identity)
    assert finalize(loc, cfg)[0]
    man = load_manifest(out)
    assert all(s["num_records"] == BATCHES and len(s["shards"]) >= 4 for s in man["streams"]), \
        [(s["num_records"], len(s["shards"])) for s in man["streams"]]
    return out, man


def exists(out: str, stream: int, name: str) -> bool:
    return os.path.exists(os.path.join(out, f"stream-{stream:05d}", name))


def shard_mtimes(out: str) -> dict[str, int]:
    """mtime of every committed shard file: a resumed stream must not rewrite them."""
    got = {}
    for s in (0, 1):
        for k in committed_shards(out, s):
            p = os.path.join(out, f"stream-{s:05d}", f"shard-{k:05d}.arrow")
            got[p] = os.stat(p).st_mtime_ns
    return got


def check_final(out: str, reference_manifest: dict) -> None:
    man = load_manifest(out)
    same_streams(man, reference_manifest)
    check_stream_contiguity(man)
    assert leftovers(out) == [], leftovers(out)
    lineage = scan_lineage(out).select("stream", "record").collect().to_dicts()
    for s in man["streams"]:
        seen = sorted({r["record"] for r in lineage if r["stream"] == s["stream"]})
        assert seen == list(range(s["num_records"])), f"stream {s['stream']}: lineage records {seen}"
    assert read_back(out, man) == {s["stream"]: s["num_records"] for s in man["streams"]}


def is_agent(pid: int) -> bool:
    # Ray's per-node agents outlive a SIGKILLed driver by up to a minute; they write nothing here.
    return any(a in cmdline(pid) for a in ("DashboardAgent", "RuntimeEnvAgent"))


@pytest.mark.parametrize("point", ["first_shard", "stream_done"])
def test_driver_sigkill_then_rerun(point, config, reference, tmp_path):
    _, ref_man = reference
    out = str(tmp_path / "out")
    with RayRun() as rr:
        if point == "first_shard":
            # both streams running; kill as soon as any shard is committed
            args, cond = [], lambda: bool(committed_shards(out, 0) or committed_shards(out, 1))
        else:
            # one CPU: stream 0 finishes, then stream 1 runs; kill right after stream 0 is done
            args, cond = ["--num-cpus", "1"], lambda: exists(out, 0, "done.json")
        driver = rr.popen(prepack("run", config, "--out", out, *args), str(tmp_path / "killed"))
        wait_until(cond, 180, f"kill point {point}", driver)
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(timeout=30)

        # The local Ray dies with its driver; its orphaned workers stop at their next record (the
        # stream task watches its raylet) and exit.  Ray's agents linger up to a minute: end them.
        survivors = rr.wait_gone(30, keep=lambda p: not is_agent(p))
        assert not survivors, [cmdline(p) for p in survivors]
        rr.kill_all()

        # what the kill left: a partial pack, its lock, no manifest
        assert not os.path.exists(os.path.join(out, "manifest.json"))
        assert lease_files(out), "the killed run's lease should still be there"
        done = [s for s in (0, 1) if exists(out, s, "done.json")]
        assert done != [0, 1], "both streams finished: orphaned workers went on packing after the driver died, or the kill came too late"
        if point == "stream_done":
            assert done == [0]
        kept = shard_mtimes(out)
        assert kept, "no committed shard at the kill"

        rerun = rr.run(prepack("run", config, "--out", out), timeout=240)
    assert rerun.returncode == 0, rerun.stderr[-4000:]
    assert "taking over the lease" in rerun.stderr and "is gone" in rerun.stderr, rerun.stderr[-3000:]
    assert summary(rerun.stdout)[0].startswith(f"packed: 2 streams, {2 * BATCHES} batches, "), rerun.stdout
    assert "batches were already committed" in rerun.stdout, rerun.stdout
    check_final(out, ref_man)
    # resumed, not redone: every shard committed before the kill is the very same file
    assert {p: os.stat(p).st_mtime_ns for p in kept} == kept


def test_worker_sigkill_task_retried(config, reference, tmp_path):
    """SIGKILL the worker process running a stream task: Ray retries the task, which resumes."""
    _, ref_man = reference
    out = str(tmp_path / "out")
    with RayRun() as rr:
        driver = rr.popen(prepack("run", config, "--out", out, "--num-cpus", "1"), str(tmp_path / "run"))
        wait_until(lambda: len(committed_shards(out, 0)) >= 2, 240, "stream 0's second shard", driver)
        workers = [p for p in rr.pids() if cmdline(p).startswith("ray::stream_task")]
        assert len(workers) == 1, [cmdline(p) for p in rr.pids()]
        kept = shard_mtimes(out)
        os.kill(workers[0], signal.SIGKILL)
        assert not exists(out, 0, "done.json") or not exists(out, 1, "done.json")
        rc = driver.wait(timeout=300)
        stdout, stderr = read_log(driver)
        gone = workers[0] not in rr.pids()
    assert rc == 0, stderr[-4000:]
    assert gone
    # Ray reports the lost worker and the retry of its task to the driver
    assert "stream_task" in stdout + stderr and "retr" in stdout + stderr, (stdout + stderr)[-3000:]
    assert summary(stdout)[0].startswith(f"packed: 2 streams, {2 * BATCHES} batches, "), stdout
    check_final(out, ref_man)
    assert {p: os.stat(p).st_mtime_ns for p in kept} == kept


def _lease(pid: int) -> str:
    """A lease on both streams, as a run of ``pid`` on this host leaves it."""
    return json.dumps({"holder": "left", "pid": pid, "host": socket.gethostname(), "since": time.time() - 3600,
                       "expires": time.time() + 3600, "lease_s": 30, "streams": [[0, 1]]})


@pytest.mark.parametrize("holder", ["dead", "zombie", "live"])
def test_lock_left_by_a_process(holder, config, reference, tmp_path):
    """A lease whose process is gone (or exited but not reaped) is taken over; a live one refuses.

    Stream 1 is left unfinished (its done.json and the manifest removed), so the run needs it."""
    ref_out, ref_man = reference
    out = str(tmp_path / "out")
    shutil.copytree(ref_out, out)
    os.remove(os.path.join(out, "manifest.json"))
    os.remove(os.path.join(out, "stream-00001", "done.json"))
    if holder == "live":
        proc = subprocess.Popen(["sleep", "120"])
    else:
        proc = subprocess.Popen([sys.executable, "-c", "pass"])
        if holder == "dead":
            proc.wait()
        else:  # exited, not reaped: still in the process table as a zombie
            wait_until(lambda: process_state(proc.pid) == "Z", 30, "the child to exit")
    from prepack.run.lease import LEASE_DIR

    os.makedirs(os.path.join(out, LEASE_DIR))
    lock = os.path.join(out, LEASE_DIR, "left.json")
    with open(lock, "w") as f:
        f.write(_lease(proc.pid))
    try:
        with RayRun() as rr:  # packed inline: the lease rules are the driver's, with or without Ray
            r = rr.run(prepack("run", config, "--out", out, "--no-ray"), timeout=120)
    finally:
        proc.kill()
        proc.wait()
    if holder == "live":
        assert r.returncode != 0
        assert f"stream 1 is being packed by another prepack run (pid {proc.pid}" in r.stderr, r.stderr[-2000:]
        with open(lock) as f:
            assert json.loads(f.read())["pid"] == proc.pid  # the holder's lease is left alone
    else:
        assert r.returncode == 0, r.stderr[-2000:]
        assert "taking over the lease" in r.stderr and "is gone" in r.stderr, r.stderr[-2000:]
        assert summary(r.stdout)[0].startswith(f"packed: 2 streams, {2 * BATCHES} batches"), r.stdout
        assert not os.path.exists(lock) and not lease_files(out)
        check_final(out, ref_man)
