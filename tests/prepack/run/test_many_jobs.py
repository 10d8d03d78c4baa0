"""Many jobs, one output: ``prepack run --streams`` processes packing disjoint streams at the same
time, on a local folder and on the S3 test server, give the pack one job gives; a job asking for a
stream a live job holds is refused naming it and the holder; a killed job's streams are resumed by
its rerun while the other job goes on; a follower reads the same batches throughout.

The jobs run ``--no-ray`` (each packs its streams in its own process): the leases, pack.json and
the manifest are what is under test, not Ray.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest
import yaml

from loader import Balance, PackedShardDataset, open_stream
from loader.reader import Pack
from prepack.run.lease import LEASE_DIR
from prepack.tools.verify import verify_pack
from schemas.layout import MANIFEST_NAME
from tests.helpers import datagen as dg
from tests.helpers.packs import KNOBS, pack_in_process
from tests.helpers.s3checks import same_pack_objects

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
STREAMS = 4  # W=2, K=2


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, tokenizer_and_special):
    import numpy as np

    root = str(tmp_path_factory.mktemp("jobs"))
    data = os.path.join(root, "data")
    os.makedirs(data)
    rs = np.random.RandomState(7)
    ds = dg.Dataset(data)
    dg.add_t2i(ds, [dg.good_t2i_rows(rs, 4, i * 4) for i in range(STREAMS)], row_group_size=2)
    lines, files = dg.good_sft(rs, 12)
    dg.add_sft(ds, lines, files)
    config = ds.config(knobs=KNOBS, num_workers=2,
                       prepack={"world_size": 2, "batches_per_stream": 6, "shard_bytes": 300_000})
    ref = pack_in_process(config, os.path.join(root, "reference"), tokenizer_and_special)
    return config, ref


def files_of(root: str) -> dict[str, bytes]:
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            rel = os.path.relpath(os.path.join(d, n), root).replace(os.sep, "/")
            if not rel.startswith(".prepack/"):
                out[rel] = open(os.path.join(d, n), "rb").read()
    return out


def job(config: str, out: str, streams: str, env: dict | None = None, extra: tuple = ()) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "prepack.cli", "run", config, "--out", out, "--streams", streams,
                             "--no-ray", *extra], cwd=REPO, env={**os.environ, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(p: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    out, err = p.communicate(timeout=timeout)
    return p.returncode, out, err


def follow_all(out: str, stream: int, got: dict) -> None:
    try:
        got[stream] = [b.to_dict()["packed_text_ids"].tolist()
                       for b in open_stream(out, stream, follow=True, poll_s=0.1, timeout_s=240)]
    except Exception as e:  # noqa: BLE001  (reported by the test)
        got[stream] = e


def reference_batches(ref: str) -> dict[int, list]:
    return {s: [b.to_dict()["packed_text_ids"].tolist() for b in open_stream(ref, s)] for s in range(STREAMS)}


def lease_pids(out: str) -> set[int]:
    leases, pids = os.path.join(out, LEASE_DIR), set()
    for name in os.listdir(leases) if os.path.isdir(leases) else ():
        try:
            with open(os.path.join(leases, name)) as f:
                pids.add(json.load(f)["pid"])
        except (OSError, ValueError, KeyError):  # being written or removed right now
            pass
    return pids


def wait_for_lease(out: str, proc: subprocess.Popen) -> None:
    """Until the job ``proc`` holds its lease on ``out``."""
    deadline = time.monotonic() + 120
    while proc.pid not in lease_pids(out):
        assert proc.poll() is None and time.monotonic() < deadline, "the job ended before its lease was seen"
        time.sleep(0.05)


@pytest.mark.slow  # three packing jobs as subprocesses
def test_two_jobs_fill_one_local_output_and_an_overlapping_one_is_refused(dataset, tmp_path):
    config, ref = dataset
    out = str(tmp_path / "out")
    a = job(config, out, "0,1")
    wait_for_lease(out, a)
    followed: dict = {}
    followers = [threading.Thread(target=follow_all, args=(out, s, followed)) for s in range(STREAMS)]
    for t in followers:
        t.start()
    # c overlaps a (and b's streams): refused by a's live lease.  a is held (SIGSTOP: alive, its
    # lease unexpired) until c has answered, so a small pack cannot finish before c claims.  b
    # starts once c has withdrawn: two overlapping claims made at the same instant may both
    # withdraw (the protocol promises at most one proceeds; test_lease covers that race).
    os.kill(a.pid, signal.SIGSTOP)
    try:
        c = job(config, out, "1,2")
        rc_c, _, err_c = finish(c)
    finally:
        os.kill(a.pid, signal.SIGCONT)
    b = job(config, out, "2-3")
    (rc_a, out_a, err_a), (rc_b, out_b, err_b) = finish(a), finish(b)
    for t in followers:
        t.join(timeout=300)
    assert rc_a == 0 and rc_b == 0, (err_a[-2000:], err_b[-2000:])
    assert rc_c == 1 and "is being packed by another prepack run" in err_c, err_c[-2000:]
    assert len(err_c.strip().splitlines()) == 1, err_c
    assert "stream 1 " in err_c or "stream 2 " in err_c, err_c
    assert (out_a + out_b).count("manifest not written yet") <= 1  # the job finishing last wrote it
    assert os.path.exists(os.path.join(out, MANIFEST_NAME))
    assert same_pack_objects(files_of(out), files_of(ref)) == []
    assert verify_pack(out).ok
    assert os.listdir(os.path.join(out, LEASE_DIR)) == []  # every lease released
    assert followed == reference_batches(ref)
    # what two jobs made reads as any pack: balanced (M=2) on both ranks for a step, their states
    # merged onto one rank, which reads the rest: every batch once
    read, states = [], []
    for r in range(2):
        ds = PackedShardDataset(out, rank=r, world_size=2, balance=Balance(micro_batches=2))
        it = iter(ds)
        read += [_key(next(it)) for _ in range(2)]
        states.append(ds.state_dict())
    rest = PackedShardDataset(out, rank=0, world_size=1)
    rest.load_state_dict(PackedShardDataset.merge_states(states))
    read += [_key(b) for b in rest]
    assert Counter(read) == Counter(tuple(x) for batches in followed.values() for x in batches)


def _key(batch) -> tuple:
    return tuple(batch.to_dict()["packed_text_ids"].tolist())


@pytest.mark.slow  # packing jobs as subprocesses, one killed and rerun
def test_a_killed_job_is_resumed_while_the_other_goes_on(dataset, tmp_path):
    config, ref = dataset
    out = str(tmp_path / "out")
    a, b = job(config, out, "0,1"), job(config, out, "2,3")
    index = os.path.join(out, "stream-00000", "index.arrow")
    deadline = time.monotonic() + 180
    while not os.path.exists(index):
        if a.poll() is not None:
            raise AssertionError(f"job a ended before its first commit (exit {a.returncode}): {finish(a)[2][-3000:]}")
        assert time.monotonic() < deadline, "job a made no commit in 180 s"
        time.sleep(0.02)
    os.kill(a.pid, signal.SIGKILL)
    a.wait()
    rerun = job(config, out, "0,1")  # at once: the dead job's lease (same host, dead pid) is taken over
    (rc_r, _, err_r), (rc_b, _, err_b) = finish(rerun), finish(b)
    assert rc_r == 0 and rc_b == 0, (err_r[-2000:], err_b[-2000:])
    assert "taking over the lease" in err_r, err_r[-2000:]
    if not os.path.exists(os.path.join(out, MANIFEST_NAME)):  # b finished last but saw a's streams unfinished
        rc, _, err = finish(job(config, out, "0-3"))  # the no-op rerun writes it
        assert rc == 0, err
    assert same_pack_objects(files_of(out), files_of(ref)) == []
    assert verify_pack(out).ok


@pytest.mark.slow
def test_two_jobs_fill_one_s3_output(dataset, s3, tmp_path):
    config, ref = dataset
    uri = s3.new_prefix("many-jobs")
    env = s3.env
    a, b = job(config, uri, "0,1", env), job(config, uri, "2,3", env)
    (rc_a, _, err_a), (rc_b, _, err_b) = finish(a), finish(b)
    assert rc_a == 0 and rc_b == 0, (err_a[-2000:], err_b[-2000:])
    objects = s3.objects(uri)
    assert not [k for k in objects if k.startswith(LEASE_DIR + "/")], "a lease was left behind"
    assert same_pack_objects(objects, files_of(ref)) == []
    c = job(config, uri, "0-3", env)  # finished: a no-op, whoever asks
    rc_c, out_c, err_c = finish(c)
    assert rc_c == 0 and "already complete" in out_c, err_c


def test_extending_is_refused_while_another_job_packs(dataset, tmp_path, tokenizer_and_special):
    """A larger budget rewrites pack.json's budget: not under a live job packing to the old one."""
    import shutil

    from prepack.run.driver import RunOptions, run_pack
    from prepack.run.lease import acquire_streams
    from schemas.config_file import load_config
    from schemas.errors import PackRefused
    from schemas.location import resolve_location
    from tests.helpers.ray_helpers import variant

    config, ref = dataset
    out = str(tmp_path / "out")
    shutil.copytree(ref, out)
    other = acquire_streams(resolve_location(out), [2])  # a live job (this process) holds stream 2
    try:
        bigger = load_config(variant(config, "bigger.yaml", batches_per_stream=8))
        with pytest.raises(PackRefused, match="needs the output to itself"):
            run_pack(bigger, out, RunOptions(streams=[0], inline=True, bar=False), tokenizer=tokenizer_and_special)
    finally:
        other.release()
    assert same_pack_objects(files_of(out), files_of(ref)) == []  # nothing was touched


@pytest.mark.slow  # three packing jobs as subprocesses
def test_two_jobs_pack_a_scheduled_continuation_with_reuse_as_one_job_does(dataset, tmp_path):
    """Many jobs with what a job reads before it packs: ``--continue`` (each job settles the same
    parent link), a schedule (stored in pack.json), ``--reuse`` (each job reads OLD and may build its
    catalog beside the other): two jobs of disjoint streams make one job's pack, byte for byte."""
    config, ref = dataset
    raw = yaml.safe_load(open(config))
    raw["prepack"]["batches_per_stream"] = 3
    raw["prepack"]["schedule"] = [{"after": 1, "set": {"dataset.grouped_datasets.t2i_pretrain.weight": 3.0}}]
    scheduled = os.path.join(os.path.dirname(config), "scheduled.yaml")
    with open(scheduled, "w") as f:
        yaml.safe_dump(raw, f, sort_keys=False)
    extra = ("--continue", ref, "--after", "3", "--reuse", ref)
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    rc, _, err = finish(job(scheduled, one, "0-3", extra=extra))
    assert rc == 0, err[-2000:]
    for rc, _, err in [finish(p) for p in (job(scheduled, two, "0,1", extra=extra), job(scheduled, two, "2,3", extra=extra))]:
        assert rc == 0, err[-2000:]
    assert same_pack_objects(files_of(two), files_of(one)) == []
    assert verify_pack(two).ok
    pack = Pack.open(two)
    assert pack.switch(0) == 3 and pack.info.stored_config().schedule  # a scheduled continuation indeed
