"""A bounded pack (issue 35): ``prepack run --ahead N --progress P`` packs just ahead of the trainings
reading it and trims behind the checkpoints they keep; ``prepack trim --progress P`` does the same
afterwards.  Trainings here are real loaders (``PackedShardDataset(..., progress=P)``) in threads;
nothing asserted depends on timing: the bound is checked against the positions the trainings
themselves report, which only grow while the packer may lag behind them.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import threading
import time

import numpy as np
import pytest

from loader import PackedShardDataset, open_stream
from loader.reader import Pack
from prepack.cli import main
from prepack.run.bounded import trainings as trainings_module
from prepack.run.bounded.ahead import PACK_FILES_RESERVE, JobStreams, share_of, SHARD_FILES_SLACK, shard_most
from prepack.run.bounded.bound import BoundSpec
from prepack.run.bounded.trainings import Trainings
from prepack.run.bounded.trim_policy import TrimPolicy, trim_to_progress
from prepack.run.driver import RunOptions, run_pack
from prepack.run.bounded.restore import restore
from prepack.tools.verify import verify_pack
from schemas.config_file import load_config
from schemas.errors import DiskBudgetTooSmall, UsageError
from schemas.layout import stream_dir
from schemas.location import resolve_location
from schemas.manifest import PackSummary, TrimmedShards
from schemas.progress import ProgressFolder
from tests.helpers import datagen as dg
from tests.helpers.trainings import Trainer, run_beside_trainings, wait_for_pack_json
from tests.helpers.packs import KNOBS, make_dataset, pack_in_process, small_config, small_dataset

pytestmark = pytest.mark.slow

BATCHES = 10


@pytest.fixture(scope="module")
def unbounded(tmp_path_factory, tokenizer_and_special):
    """The same config packed at once: what every bounded pack must equal, record for record."""
    root = str(tmp_path_factory.mktemp("ahead"))
    config = small_dataset(root, batches=BATCHES, shard_bytes=150_000)
    out = pack_in_process(config, os.path.join(root, "out"), tokenizer_and_special)
    return {"config": config, "out": out}


@pytest.fixture(autouse=True)
def quick_polls(monkeypatch):
    monkeypatch.setattr(trainings_module, "POLL_S", 0.05)


def trim_behind(policy: TrimPolicy, streams: list[int]) -> tuple[int, int]:
    """What the running job's trim does: (shards trimmed, bytes freed)."""
    result = policy.apply(streams)
    return sum(len(v) for v in result.shards.values()), result.freed_bytes


def digests(out: str) -> dict[int, list[str]]:
    p = Pack.open(out)
    return {s: [r.digest for sh in p.index(s).shards for r in sh.records] for s in range(p.num_streams)}


def records_per_shard(out: str) -> int:
    p = Pack.open(out)
    return max(len(sh.records) for s in range(p.num_streams) for sh in p.index(s).shards)


def ids(batches) -> list:
    return [(b.sequence_length, repr(b.batch_data_indexes)) for b in batches]


def test_ahead_packs_each_stream_just_ahead_of_its_own_rank(unbounded, tmp_path, tokenizer_and_special):
    """Two ranks at different speeds on one pack: each stream is held to its own reader, the batches
    and records are those of a pack made at once, and the job trims behind both trainings."""
    out, progress, ahead = str(tmp_path / "out"), str(tmp_path / "progress"), 2
    per_shard = records_per_shard(unbounded["out"])
    bound = BoundSpec(ahead, (progress,), keep=2)
    result = {}

    def pack():
        try:
            result["summary"] = run_pack(load_config(unbounded["config"]), out, RunOptions(inline=True, bar=False, bound=bound), tokenizer=tokenizer_and_special)
        except BaseException as e:  # noqa: BLE001
            result["error"] = e

    packer = threading.Thread(target=pack, daemon=True)
    packer.start()
    wait_for_pack_json(out, packer)
    trainers = [Trainer(out, r, 2, progress, every=3, pause_s=0.0 if r == 0 else 0.05, ahead=ahead,
                        per_shard=per_shard) for r in (0, 1)]
    for t in trainers:
        t.start()
    for t in trainers + [packer]:
        t.join(timeout=300)
        assert not t.is_alive(), "a bounded pack and its trainings must never wait on each other for ever"
    assert "error" not in result, result.get("error")
    for t in trainers:
        assert t.error is None, t.error
    # the same records as a pack made at once, and each training read its stream whole, in order
    assert digests(out) == digests(unbounded["out"])
    whole = {r: ids(PackedShardDataset(unbounded["out"], rank=r, world_size=2)) for r in (0, 1)}
    assert {r: ids(t.seen) for r, t in enumerate(trainers)} == whole
    # trimmed by the job, behind the earliest of each training's two newest checkpoints only
    p = Pack.open(out)
    trimmed_any = False
    for r, t in enumerate(trainers):
        kept = min(st["positions"][0] for st in t.states[-2:])
        trimmed = set(TrimmedShards.read(p.location, r).shards)
        for sh in p.index(r).shards:
            behind = sh.first_record + len(sh.records) <= kept
            assert (sh.shard in trimmed) <= behind, (r, sh.shard, kept)
            assert os.path.exists(os.path.join(out, sh.file)) == (sh.shard not in trimmed)
        trimmed_any |= bool(trimmed)
    assert trimmed_any
    assert verify_pack(out).ok


def test_the_job_trims_records_packed_after_it_first_looked(tmp_path, tokenizer_and_special):
    """The running job's view of the pack is read once and grows with it: a checkpoint past what it
    first read still trims every shard wholly behind it (a stale index would trim nothing more)."""
    data = make_dataset(str(tmp_path / "data"))
    out, progress = str(tmp_path / "out"), str(tmp_path / "progress")
    run_pack(small_config(data, shard_bytes=150_000, batches_per_stream=4), out, RunOptions(inline=True, bar=False), tokenizer=tokenizer_and_special)
    trainings = Trainings((progress,), Pack.open(out))
    policy = TrimPolicy.behind_checkpoints(trainings, keep=2)
    assert trim_behind(policy, [0, 1]) == (0, 0)  # no checkpoint yet; the job has read 4 records a stream
    run_pack(small_config(data, shard_bytes=150_000, batches_per_stream=BATCHES), out, RunOptions(inline=True, bar=False), tokenizer=tokenizer_and_special)  # the same pack, extended
    ds = PackedShardDataset(out, rank=0, world_size=1, progress=progress)
    it = iter(ds)
    states = []
    for n in (2 * BATCHES - 4, 2):
        for _ in range(n):
            next(it)
        states.append(ds.state_dict())
    trainings.refresh(force=True)
    trimmed_now, freed = trim_behind(policy, [0, 1])
    assert trimmed_now and freed > 0
    p = Pack.open(out)
    for slot, s in enumerate(ds.streams):
        kept = min(st["positions"][slot] for st in states)
        assert kept > 4
        behind = {sh.shard for sh in p.index(s).shards if sh.first_record + len(sh.records) <= kept}
        assert set(TrimmedShards.read(p.location, s).shards) == behind, (s, kept)
        assert any(sh.first_record >= 4 for sh in p.index(s).shards if sh.shard in behind)


def read_from(out: str, state: "dict | None") -> list:
    ds = PackedShardDataset(out, rank=0, world_size=1)
    if state is not None:
        ds.load_state_dict(state)
    return ids(ds)


def test_trim_to_progress_never_removes_what_a_kept_checkpoint_reads(unbounded, tmp_path, monkeypatch):
    """Random reading, checkpoints, crashes (a training rolled back to one of its kept checkpoints,
    publishing again from there), a second slower training, and trims killed half-way: after each
    trim every checkpoint a training keeps reads exactly what the untrimmed pack gives."""
    out = str(tmp_path / "out")
    shutil.copytree(unbounded["out"], out)
    whole = read_from(unbounded["out"], None)
    rng = random.Random(35)
    keep = 2
    folders = [str(tmp_path / "a"), str(tmp_path / "b")]

    class Training:
        def __init__(self, folder):
            self.folder, self.kept, self.ds, self.it, self.read = folder, [], None, None, 0
            self.start(None)

        def start(self, state):
            self.ds = PackedShardDataset(out, rank=0, world_size=1, progress=self.folder, live_every_s=0)
            if state is not None:
                self.ds.load_state_dict(state)
            self.it = iter(self.ds)

        def step(self, n):
            for _ in range(n):
                if next(self.it, None) is None:
                    return

        def checkpoint(self):
            st = json.loads(json.dumps(self.ds.state_dict()))
            self.kept = (self.kept + [st])[-keep:]

        def crash(self):  # back to one of the checkpoints it keeps (or the start), a new process
            st = rng.choice(self.kept) if self.kept else None
            self.start(st)

    trainings = [Training(f) for f in folders]
    import prepack.run.bounded.trim as trim_module

    real_shard_file = trim_module.shard_file
    for round_ in range(14):
        t = trainings[0] if rng.random() < 0.7 else trainings[1]
        action = rng.choice(["step", "step", "checkpoint", "crash"])
        if action == "step":
            t.step(rng.randint(1, 4))
        elif action == "checkpoint":
            t.checkpoint()
        else:
            t.crash()
        if round_ % 3 == 2:  # a trim killed after its list is written and its first file deleted, then run again
            calls = []

            def killed_after_one(stream, shard, calls=calls):
                calls.append(shard)
                if len(calls) > 1:
                    raise KeyboardInterrupt("killed")
                return real_shard_file(stream, shard)

            monkeypatch.setattr(trim_module, "shard_file", killed_after_one)
            try:
                trim_to_progress(out, folders, keep)
            except KeyboardInterrupt:
                pass
            monkeypatch.setattr(trim_module, "shard_file", real_shard_file)
        trim_to_progress(out, folders, keep)
        for tr in trainings:
            for st in tr.kept:
                assert read_from(out, st) == whole[sum(st["positions"]):], (round_, st["positions"])
    assert verify_pack(out).ok


def test_a_killed_bounded_run_gives_the_same_records(unbounded, tmp_path, tokenizer_and_special, monkeypatch):
    """The packer killed mid-way (after a random shard) and started again: the same records, the
    training's position and checkpoints are followed from where they stand."""
    from prepack.run.commit.writer import StreamWriter

    out, progress = str(tmp_path / "out"), str(tmp_path / "progress")
    fp = Pack.open(unbounded["out"]).info.fingerprint
    folder = ProgressFolder(progress)
    folder.publish_live(fp, 1, 0, 0, {0: 4, 1: 4})  # a training at batch 4 of each stream
    bound = BoundSpec(3, (progress,), keep=1)
    real_append = StreamWriter.append
    kill_at = random.Random(3).randint(2, 6)
    count = [0]

    def killed_append(self, batch):
        count[0] += 1
        if count[0] == kill_at:
            raise KeyboardInterrupt("killed")
        return real_append(self, batch)

    cfg = load_config(unbounded["config"])
    monkeypatch.setattr(StreamWriter, "append", killed_append)
    with pytest.raises(KeyboardInterrupt):
        run_pack(cfg, out, RunOptions(inline=True, bar=False, bound=bound), tokenizer=tokenizer_and_special)
    monkeypatch.setattr(StreamWriter, "append", real_append)
    threading.Thread(target=lambda: (time.sleep(0.5), folder.publish_live(fp, 1, 0, 0, {0: BATCHES, 1: BATCHES})),
                     daemon=True).start()
    run_pack(cfg, out, RunOptions(inline=True, bar=False, bound=bound), tokenizer=tokenizer_and_special)
    assert digests(out) == digests(unbounded["out"])
    assert verify_pack(out).ok


def test_bounded_cli_and_refusals(unbounded, tmp_path, capsys):
    out = str(tmp_path / "out")
    shutil.copytree(unbounded["out"], out)
    with pytest.raises(UsageError, match="--ahead needs --progress"):
        BoundSpec(3, ())
    with pytest.raises(UsageError, match="--keep-checkpoints"):
        BoundSpec(None, ("p",), keep=0)
    assert BoundSpec(None, ("p",), keep=1).warnings() and not BoundSpec(None, ("p",)).warnings()
    assert main(["run", unbounded["config"], "--out", str(tmp_path / "x"), "--ahead", "2", "--no-ray"]) == 2
    assert "--ahead needs --progress" in capsys.readouterr().err
    assert main(["trim", out]) == 2  # neither --progress nor --state
    # a progress folder of another pack is refused, by name
    other = ProgressFolder(str(tmp_path / "other"))
    other.publish_checkpoint("f" * 32, 1, 0, {0: 1, 1: 1}, {0: "0" * 32, 1: "0" * 32})
    assert main(["trim", out, "--progress", str(tmp_path / "other")]) == 1  # refused (PackRefused)
    assert "another pack" in capsys.readouterr().err
    # no checkpoint yet: nothing trimmed; two checkpoints with --keep-checkpoints 1: behind the newest
    ds = PackedShardDataset(out, rank=0, world_size=1, progress=str(tmp_path / "p"), live_every_s=0)
    assert main(["trim", out, "--progress", str(tmp_path / "p")]) == 0
    assert "nothing to trim" in capsys.readouterr().out
    it = iter(ds)
    for _ in range(6):
        next(it)
    ds.state_dict()
    for _ in range(4):
        next(it)
    st = json.loads(json.dumps(ds.state_dict()))
    assert main(["trim", out, "--progress", str(tmp_path / "p"), "--keep-checkpoints", "2"]) == 0
    two = {s: list(TrimmedShards.read(Pack.open(out).location, s).shards) for s in (0, 1)}
    assert main(["trim", out, "--progress", str(tmp_path / "p"), "--keep-checkpoints", "1"]) == 0
    one = {s: list(TrimmedShards.read(Pack.open(out).location, s).shards) for s in (0, 1)}
    assert all(set(two[s]) < set(one[s]) for s in (0, 1)), (two, one)
    assert read_from(out, st) == read_from(unbounded["out"], None)[10:]
    assert main(["restore", out, "--streams", "0,1"]) == 0
    assert digests(out) == digests(unbounded["out"]) and verify_pack(out).ok


def test_trim_and_restore_on_s3(unbounded, s3, tokenizer_and_special):
    """A pack and a training's progress folder on the S3 server: trimmed behind the training's
    checkpoints, then restored, object for object."""
    out = pack_in_process(unbounded["config"], s3.new_prefix("bounded"), tokenizer_and_special)
    progress = s3.new_prefix("progress")
    before = s3.objects(out)
    ds = PackedShardDataset(out, rank=0, world_size=1, progress=progress, live_every_s=0)
    it = iter(ds)
    for _ in range(8):
        next(it)
    ds.state_dict()
    st = json.loads(json.dumps(ds.state_dict()))
    result = trim_to_progress(out, [progress], 2)
    assert result.shards and result.freed_bytes > 0
    after_trim = s3.objects(out)
    p = Pack.open(out)
    for s, shards in result.shards.items():
        for sh in p.index(s).shards:
            assert (sh.file in after_trim) == (sh.shard not in shards), (s, sh.shard)
    assert read_from(out, st) == read_from(unbounded["out"], None)[8:]
    done = restore(out, {s: (0, None) for s in (0, 1)}, tokenizer=tokenizer_and_special)
    assert done
    now = s3.objects(out)
    assert {k: v for k, v in now.items() if not k.endswith("trimmed.json")} == before
    assert verify_pack(out).ok


def test_the_readme_command_packs_beside_a_training_on_a_local_ray(unbounded, tmp_path):
    """The README's "Pack just ahead of training" command, run as written (paths and N replaced) on a
    local Ray, with a training reading beside it: it ends when the training has read the budget."""
    import shlex
    import subprocess
    import sys

    from tests.helpers.paths import REPO
    from tests.helpers.readme import readme_tested_blocks

    block = [line for line in readme_tested_blocks()[4].splitlines() if line.strip()]
    assert len(block) == 1 and "--ahead" in block[0], "README block changed shape"
    out, progress, ahead = str(tmp_path / "packed"), str(tmp_path / "progress"), 2
    words = [{"cfg.yaml": unbounded["config"], "/data/packed": out, "/data/progress": progress, "200": str(ahead)}
             .get(w, w) for w in shlex.split(block[0])]
    assert words[0] == "prepack"
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    proc = subprocess.Popen([sys.executable, "-m", "prepack.cli", *words[1:], "--num-cpus", "2"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(1200):
            if os.path.exists(os.path.join(out, "pack.json")) or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        trainer = Trainer(out, 0, 1, progress, every=4, pause_s=0.0, ahead=ahead,
                          per_shard=records_per_shard(unbounded["out"]))
        trainer.run()  # in this thread: the pack can only finish as it reads
        assert trainer.error is None, trainer.error
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr[-2000:]
    assert ids(trainer.seen) == ids(PackedShardDataset(unbounded["out"], rank=0, world_size=1))
    assert digests(out) == digests(unbounded["out"])


def _pack_bytes(out: str) -> int:
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(out) for n in names
               if os.path.exists(os.path.join(d, n)))


def _record_sizes(out: str, stream: int) -> list[int]:
    """Each record's bytes in memory, in stream order."""
    from loader.reader import read_shard

    p = Pack.open(out)
    return [rec.nbytes for sh in p.index(stream).shards for _, rec in read_shard(p, sh)]


def _late_big_dataset(root: str, batches: int) -> str:
    """t2i rows with long captions and tiny pictures, then (the last file, read after them) rows of
    large pictures: records far larger than any before them."""
    rs = np.random.RandomState(5)
    ds = dg.Dataset(os.path.join(root, "data"))
    os.makedirs(ds.root)

    dg.add_t2i(ds, [dg.captioned_rows(rs, 480, 64, 250) + dg.captioned_rows(rs, 8, 300, 4) for _ in range(2)],
               row_group_size=8)
    return ds.config(knobs=dict(KNOBS, max_buffer_size=1), num_workers=2,
                     prepack={"batches_per_stream": batches, "shard_bytes": 150_000})


def test_a_disk_budget_is_never_exceeded_beside_two_trainings(tmp_path, tokenizer_and_special, monkeypatch):
    """``--disk-budget``: the pack (every file of it, checked after each shard commit) stays under the
    budget while two trainings read it, though a record far larger than any before it comes late (the
    reserve is the most a shard can add, not the largest so far); the records are those of a pack
    made at once."""
    from prepack.run.commit.writer import StreamWriter

    root = str(tmp_path)
    config = _late_big_dataset(root, batches=220)
    whole = pack_in_process(config, os.path.join(root, "whole"), tokenizer_and_special)
    cfg = load_config(config)
    w = Pack.open(whole)
    sizes = [_record_sizes(whole, s) for s in range(cfg.num_streams)]
    late = [(i, n / max(sz[:i])) for sz in sizes for i, n in enumerate(sz) if i >= 120]
    assert max(r for _, r in late) >= 3, ("the data needs a late record far larger than those before it", sizes)
    most = shard_most(cfg) + SHARD_FILES_SLACK
    # a share: the smallest the run accepts (one shard read, the next one's most) and 0.5 MiB for what the
    # stream never trims; the packer outruns the trainings, so it packs at the edge of its share when the
    # large records come (a reserve of the largest shard so far would overshoot the budget there)
    budget = PACK_FILES_RESERVE + cfg.num_streams * (2 * most + (1 << 19))
    assert _pack_bytes(whole) > 1.2 * budget, ("the budget must bind: the whole pack is larger", _pack_bytes(whole),
                                               budget)
    out, progress = str(tmp_path / "out"), str(tmp_path / "progress")
    peak, stream_peak = [0], [0]
    real_commit = StreamWriter._commit

    def measured_commit(self):
        entry = real_commit(self)
        peak[0] = max(peak[0], _pack_bytes(out))
        stream_peak[0] = max(stream_peak[0], _pack_bytes(os.path.join(out, stream_dir(self.stream))))
        return entry

    monkeypatch.setattr(StreamWriter, "_commit", measured_commit)
    monkeypatch.setattr(JobStreams, "TRIM_EVERY_S", 0.1)  # trims close behind the trainings: the packer at its edge
    bound = BoundSpec(None, (progress,), keep=2, disk_budget=budget)
    run_beside_trainings(
        lambda: run_pack(cfg, out, RunOptions(inline=True, bar=False, bound=bound), tokenizer=tokenizer_and_special),
        out, lambda: [Trainer(out, r, 2, progress, every=3, pause_s=0.05, ahead=None, per_shard=0) for r in (0, 1)],
        timeout=600)
    assert digests(out) == digests(whole)
    assert 0 < peak[0] <= budget and _pack_bytes(out) <= budget, (peak[0], budget)
    assert stream_peak[0] <= share_of(cfg, budget), (stream_peak[0], share_of(cfg, budget))  # each stream its share
    assert any(TrimmedShards.read(Pack.open(out).location, s).shards for s in range(cfg.num_streams))
    # a budget whose share cannot hold the shard the trainings read and the next one's most: refused at the start,
    # with the smallest budget that works
    smallest = cfg.num_streams * 2 * most + PACK_FILES_RESERVE
    with pytest.raises(UsageError, match=f"the smallest budget that works is {smallest:,} bytes"):
        run_pack(cfg, str(tmp_path / "small"), RunOptions(inline=True, bar=False, bound=BoundSpec(
            None, (progress,), keep=2, disk_budget=smallest - 1)), tokenizer=tokenizer_and_special)
    assert not os.path.exists(str(tmp_path / "small" / "pack.json"))


def test_a_stream_never_waits_for_room_no_trim_frees(tmp_path, tokenizer_and_special):
    """What no trim frees (checkpoints, indexes, sources, lineage) grows with a stream: once it and the
    next shard's most pass the stream's share, the stream stops with the smallest budget that works
    then (DiskBudgetTooSmall), instead of waiting for good; where trims could make the room, it waits."""
    from prepack.run.bounded.ahead import DiskShare

    config = small_dataset(str(tmp_path), batches=80, shard_bytes=150_000)
    cfg = load_config(config)
    out = pack_in_process(config, str(tmp_path / "out"), tokenizer_and_special)
    budget = PACK_FILES_RESERVE + cfg.num_streams * 2 * (shard_most(cfg) + SHARD_FILES_SLACK)  # accepted
    share = DiskShare(budget, Pack.open(out))
    with pytest.raises(DiskBudgetTooSmall, match=r"stream 0: .* no trim can make that room\. The smallest budget "
                       r"that works now is [0-9,]+ bytes"):
        share.holding(0)  # every checkpoint of 80 batches kept: more than the share leaves beside the reserve
    smallest = int(str(pytest.raises(DiskBudgetTooSmall, share.holding, 0).value).rsplit(" is ", 1)[1].split()[0]
                   .replace(",", ""))
    assert DiskShare(smallest, Pack.open(out)).holding(0) is not None  # that budget: room once trims free it
    TrimPolicy(Pack.open(out), lambda s: 1 << 62).apply()  # everything read: shards and off-ladder checkpoints go
    assert DiskShare(budget, Pack.open(out)).holding(0) is None  # the same budget now has room


def test_balanced_trainings_follow_a_pack_held_one_batch_ahead(unbounded, tmp_path, tokenizer_and_special):
    """bounded x balanced batches: a balanced step needs every rank's M batches before any is dealt,
    so with --ahead 1 < M the packer, counting from the step start, held back what the step waited
    for (a stall).  A balanced rank publishes the step start plus M: every batch is read once, and the
    packer ran at most M + 1 past the step start."""
    cfg = load_config(unbounded["config"])
    out, progress = str(tmp_path / "out"), str(tmp_path / "progress")
    bound = BoundSpec(1, (progress,), keep=2)
    trainers = run_beside_trainings(
        lambda: run_pack(cfg, out, RunOptions(inline=True, bar=False, bound=bound), tokenizer=tokenizer_and_special),
        out, lambda: [Trainer(out, r, 2, progress, every=3, pause_s=0.01, ahead=1, per_shard=1, micro_batches=3)
                      for r in (0, 1)], timeout=120)
    assert digests(out) == digests(unbounded["out"])
    seen = sorted(ids(t.seen)[i] for t in trainers for i in range(len(t.seen)))
    assert seen == sorted(x for s in range(cfg.num_streams) for x in ids(open_stream(unbounded["out"], s)))


def test_two_jobs_pack_disjoint_streams_ahead_and_each_trims_its_own(unbounded, tmp_path, tokenizer_and_special):
    """bounded x many jobs: two jobs, one per stream (``--streams``), each packing ahead of the
    training reading its stream and trimming behind it (a job trims the streams it packs); the pack
    is the one made at once, and each stream was trimmed behind its training by its job."""
    cfg = load_config(unbounded["config"])
    out, progress = str(tmp_path / "out"), str(tmp_path / "progress")
    bound = BoundSpec(2, (progress,), keep=1)
    trimmed_by: dict[int, set] = {}

    def both_jobs():
        errors = []

        def job(stream):
            try:
                run_pack(cfg, out, RunOptions(inline=True, bar=False, bound=bound, streams=[stream]),
                         tokenizer=tokenizer_and_special)
                trimmed_by[stream] = Pack.open(out).trimmed(stream)
            except BaseException as e:  # noqa: BLE001 (re-raised below)
                errors.append(e)

        jobs = [threading.Thread(target=job, args=(s,), daemon=True) for s in (0, 1)]
        for j in jobs:
            j.start()
        for j in jobs:
            j.join()
        if errors:
            raise errors[0]

    run_beside_trainings(both_jobs, out, lambda: [Trainer(out, r, 2, progress, every=2, pause_s=0.02, ahead=2,
                                                         per_shard=1) for r in (0, 1)], timeout=300)
    assert digests(out) == digests(unbounded["out"])
    assert PackSummary.written(resolve_location(out))  # the job finishing last wrote the manifest
    assert all(trimmed_by.get(s) for s in (0, 1)), trimmed_by  # each job trimmed its stream behind its training
    assert verify_pack(out).ok


def test_a_training_that_changes_its_world_size_is_followed_to_the_end(unbounded, tmp_path, tokenizer_and_special):
    """bounded x world-size change: two ranks read a pack packed --ahead 2, stop, and their states
    merged onto one rank resume it (the progress folder then holds both world sizes' files): the
    packer follows the resumed rank to the end, every batch is read once, the records are the
    unbounded pack's, and nothing a kept checkpoint of the resumed rank reads was trimmed."""
    cfg = load_config(unbounded["config"])
    out, progress = str(tmp_path / "out"), str(tmp_path / "progress")
    bound = BoundSpec(2, (progress,), keep=2)
    trainers: list = []

    def trainings() -> list:
        first = [Trainer(out, r, 2, progress, every=1, pause_s=0.02, ahead=2, per_shard=1, stop_after=3)
                 for r in (0, 1)]
        for t in first:
            t.start()
        for t in first:
            t.join(timeout=120)
        assert not any(t.is_alive() or t.error for t in first), [t.error for t in first]
        merged = PackedShardDataset.merge_states([t.states[-1] for t in first])
        trainers.extend(first)
        return [Trainer(out, 0, 1, progress, every=2, pause_s=0.02, ahead=2, per_shard=1, state=merged)]

    resumed = run_beside_trainings(
        lambda: run_pack(cfg, out, RunOptions(inline=True, bar=False, bound=bound), tokenizer=tokenizer_and_special),
        out, trainings, timeout=300)
    assert digests(out) == digests(unbounded["out"])
    read = ids([b for t in trainers + resumed for b in t.seen])
    assert sorted(read) == sorted(ids(b for s in (0, 1) for b in open_stream(unbounded["out"], s)))
    p = Pack.open(out)
    last = resumed[0].states[-2] if len(resumed[0].states) >= 2 else {"streams": [], "positions": []}
    kept = dict(zip(last["streams"], last["positions"]))
    for s in (0, 1):
        for sh in p.index(s).shards:
            if sh.shard in p.trimmed(s):
                assert sh.first_record + len(sh.records) <= kept.get(s, 0), (s, sh.shard, kept)
    # trimmed behind the resumed rank's checkpoints, past where the two ranks stopped (3 batches each)
    assert any(sh.first_record + len(sh.records) > 3 for s in (0, 1) for sh in p.index(s).shards
               if sh.shard in p.trimmed(s))
