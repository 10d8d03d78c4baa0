"""The loader publishes where training stands (``progress=``): live positions per DataLoader worker,
and one checkpoint entry per rank per saved state, with exactly the state's positions and digests;
``schemas.progress.ProgressFolder.read`` gives them back.  Nothing depends on timing: the throttle
is off (``live_every_s=0``) or out of reach (``1e9``), and only positions are compared."""

from __future__ import annotations

import json
import logging
import os
import pickle
import threading
import time

import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from loader import PackedShardDataset, build_dataloader
from loader.dataloader import ProgressDataLoader, dataset_states
from loader.prefetch import Prefetcher
from loader.reader import Pack
from schemas.location import resolve_location
from schemas.progress import ProgressFolder, rank_checkpoints_file, live_file
from tests.helpers.fakepack import SMALL_LENGTHS, make_pack, mark_done, small_pack_fixture

LENGTHS = SMALL_LENGTHS  # W=2 ranks x K=2 workers
pack = small_pack_fixture()


def take(iterator, n: int) -> None:
    for _ in range(n):
        next(iterator)


def files(folder) -> set[str]:
    """The published files (not the temporary one a worker still writing may have open)."""
    return {n for n in os.listdir(folder) if not n.endswith(".tmp")} if os.path.isdir(folder) else set()


def positions_of(state: dict) -> dict[int, int]:
    return dict(zip(state["streams"], state["positions"]))


def last_of(state: dict) -> dict[int, str]:
    return dict(zip(state["streams"], state["last"]))


def digests(pack: str, positions: dict[int, int]) -> dict[int, str]:
    """The digest of the last record read per stream, from the pack itself ("" before the first)."""
    p = Pack.open(pack)
    return {s: p.record_digest(s, n - 1) if n else "" for s, n in positions.items()}


def test_prefetcher_ready():
    gate = threading.Event()

    def source():
        yield 1
        gate.wait()
        yield 2

    pf = Prefetcher(source(), 2)
    while not pf.ready():  # the first item is queued without waiting for the gate
        time.sleep(0.001)
    assert next(pf) == 1 and not pf.ready()  # the second waits for the gate: next() would block
    gate.set()
    assert list(pf) == [2] and pf.ready()  # over: next() returns (StopIteration) at once
    pf.close()


def test_state_dict_publishes_the_states_checkpoint(pack, tmp_path):
    where = str(tmp_path / "progress")
    ds = PackedShardDataset(pack, rank=0, world_size=2, progress=where, live_every_s=0)
    it = iter(ds)
    take(it, 3)
    first = ds.state_dict()
    take(it, 2)
    second = ds.state_dict()
    assert positions_of(first) == {0: 2, 1: 1} and positions_of(second) == {0: 3, 1: 2}  # round-robin of [0, 1]
    got = ProgressFolder(where).read()
    assert got.packs == {ds.fingerprint}
    assert files(where) == {rank_checkpoints_file(2, 0), live_file(2, 0, 0)}
    for s in (0, 1):
        assert got.reached(s) == positions_of(second)[s]
        entries = sorted(got.checkpoints[s], key=lambda e: e.time)
        assert [e.positions for e in entries] == [positions_of(first), positions_of(second)]
        assert [e.last for e in entries] == [last_of(first), last_of(second)]
        assert entries[1].last == digests(pack, positions_of(second))
        assert got.kept(s, 1) == entries[1] and got.kept(s, 2) == entries[0] and got.kept(s, 3) is None
    with open(os.path.join(where, live_file(2, 0, 0))) as f:
        live = json.load(f)  # every batch published (no throttle): the position after the fifth
    assert live["entries"][0]["positions"] == {"0": 3, "1": 2} and live["worker"] == 0


def test_live_position_reaches_the_end_without_the_throttle(pack, tmp_path):
    where = str(tmp_path / "progress")
    ds = PackedShardDataset(pack, rank=1, world_size=2, progress=where, live_every_s=1e9)
    assert len(list(ds)) == LENGTHS[2] + LENGTHS[3]
    got = ProgressFolder(where).read()
    assert got.reached(2) == LENGTHS[2] and got.reached(3) == LENGTHS[3]
    assert got.checkpoints == {} and files(where) == {live_file(2, 1, 0)}


def test_live_position_is_published_before_waiting_for_the_packer(tmp_path):
    """A pack being written: the reader caught up and waits for the next commit; with the throttle
    out of reach the packer still hears where it stands (before the wait, not after)."""
    out, where = str(tmp_path / "pack"), str(tmp_path / "progress")
    identity = make_pack(out, world_size=1, num_workers=2, lengths=[3, 2], done=False)
    ds = PackedShardDataset(out, rank=0, world_size=1, follow=True, poll_s=0.02, progress=where, live_every_s=1e9)
    got: list = []
    reader = threading.Thread(target=lambda: got.extend(ds), daemon=True)
    reader.start()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        progress = ProgressFolder(where).read()
        if (progress.reached(0), progress.reached(1)) == (3, 2):
            break
        time.sleep(0.02)
    assert (progress.reached(0), progress.reached(1)) == (3, 2)
    assert reader.is_alive()  # still waiting: the position came before the end
    loc, pack = resolve_location(out), Pack.open(out)
    for s in (0, 1):
        mark_done(loc, identity, pack.index(s), 2)
    reader.join(60)
    assert not reader.is_alive() and len(got) == 5


def test_a_resumed_iteration_publishes_where_it_starts(pack, tmp_path):
    ds = PackedShardDataset(pack, rank=0, world_size=2)
    it = iter(ds)
    take(it, 4)
    state = ds.state_dict()
    where = str(tmp_path / "progress")
    resumed = PackedShardDataset(pack, rank=0, world_size=2, progress=where, live_every_s=1e9)
    resumed.load_state_dict(state)
    next(iter(resumed))  # the start is published before the first batch is waited for
    got = ProgressFolder(where).read()
    assert (got.reached(0), got.reached(1)) == (positions_of(state)[0], positions_of(state)[1])  # throttled after
    assert got.checkpoints == {}


@pytest.mark.parametrize("workers", [0, 2])
def test_build_dataloader_publishes_one_checkpoint_per_state_dict(pack, tmp_path, workers):
    where = str(tmp_path / "progress")
    loader = build_dataloader(pack, rank=1, world_size=2, num_workers=workers, pin_memory=False, progress=where)
    assert type(loader) is ProgressDataLoader
    it = iter(loader)
    take(it, 5)  # streams 2 and 3 alternate (with 2 workers: worker 0 reads 2, worker 1 reads 3)
    state = loader.state_dict()
    want = {2: 3, 3: 2}
    states = dataset_states(state)
    assert states is not None and len(states) == max(workers, 1)
    assert {s: p for st in states for s, p in positions_of(st).items()} == want
    got = ProgressFolder(where).read()
    assert {n for n in files(where) if n.startswith("ckpt-")} == {rank_checkpoints_file(2, 1)}
    assert {n for n in files(where) if n.startswith("live-")} == {live_file(2, 1, j) for j in range(max(workers, 1))}
    for s in (2, 3):
        (entry,) = got.checkpoints[s]  # one entry, whatever the workers' per-step snapshots did
        assert entry.positions == want and entry.last == digests(pack, want)
    take(it, 2)
    loader.state_dict()
    got = ProgressFolder(where).read()
    assert [len(got.checkpoints[s]) for s in (2, 3)] == [2, 2]
    assert got.kept(2, 2).positions == want and got.kept(2, 1).positions == {2: 4, 3: 3}
    del it


def test_worker_snapshots_are_not_checkpoints(pack, tmp_path):
    """torchdata calls the dataset's state_dict() in each worker at every step: never published."""
    where = str(tmp_path / "progress")
    ds = PackedShardDataset(pack, rank=0, world_size=2, progress=where, live_every_s=0)
    assert ds.publish_checkpoints
    loader = StatefulDataLoader(ds, batch_size=None, num_workers=2)
    it = iter(loader)
    take(it, 4)
    state = loader.state_dict()
    assert dataset_states(state) is not None
    assert files(where) == {live_file(2, 0, 0), live_file(2, 0, 1)}
    assert ProgressFolder(where).read().checkpoints == {}
    del it


def test_another_world_size_is_read_across_files(pack, tmp_path):
    """A merged state continued on one rank: each stream's entries come from both sets of files."""
    where = str(tmp_path / "progress")
    states = []
    for rank in (0, 1):
        ds = PackedShardDataset(pack, rank=rank, world_size=2, progress=where, live_every_s=0)
        take(iter(ds), 3)
        states.append(ds.state_dict())
    old = {s: p for st in states for s, p in positions_of(st).items()}
    assert old == {0: 2, 1: 1, 2: 2, 3: 1}
    one = PackedShardDataset(pack, rank=0, world_size=1, progress=where, live_every_s=0)
    one.load_state_dict(PackedShardDataset.merge_states(states))
    take(iter(one), 4)  # rounds over streams 0..3 from where each stood: (1, 1), (3, 1), then (0, 2), (1, 2)
    new = positions_of(one.state_dict())
    assert new == {0: 3, 1: 3, 2: 2, 3: 2}
    assert files(where) == {rank_checkpoints_file(2, 0), rank_checkpoints_file(2, 1), rank_checkpoints_file(1, 0),
                            live_file(2, 0, 0), live_file(2, 1, 0), live_file(1, 0, 0)}
    got = ProgressFolder(where).read()
    for s in range(4):
        assert len(got.checkpoints[s]) == 2
        assert got.reached(s) == new[s]
        assert got.kept(s, 1).positions[s] == new[s] and got.kept(s, 2).positions[s] == old[s]
        assert got.kept(s, 3) is None


def test_no_progress_publishes_nothing(pack, tmp_path):
    where = str(tmp_path / "progress")
    ds = PackedShardDataset(pack, rank=0, world_size=2)
    assert ds.progress is None
    loader = build_dataloader(pack, rank=0, world_size=2, pin_memory=False)
    assert type(loader) is StatefulDataLoader
    before = files(tmp_path)
    assert len(list(ds)) == LENGTHS[0] + LENGTHS[1]
    ds.state_dict()
    take(iter(loader), 2)
    loader.state_dict()
    assert files(tmp_path) == before
    lazy = PackedShardDataset(pack, rank=0, world_size=2, progress=where)  # set, but nothing read or saved yet
    pickle.loads(pickle.dumps(lazy))
    assert not os.path.exists(where)
    assert ProgressFolder(where).read().live == {}


def test_a_pickled_dataset_publishes(pack, tmp_path):
    """What a spawned DataLoader worker gets: the dataset pickled, publisher included."""
    where = str(tmp_path / "progress")
    ds = pickle.loads(pickle.dumps(PackedShardDataset(pack, rank=0, world_size=2, progress=where, live_every_s=0)))
    take(iter(ds), 2)
    state = ds.state_dict()
    got = ProgressFolder(where).read()
    assert got.kept(0, 1).positions == positions_of(state) == {0: 1, 1: 1}


def test_a_folder_that_cannot_be_written_does_not_fail_training(pack, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    where = str(blocker / "progress")
    caplog.set_level(logging.WARNING, logger="loader.progress")
    ds = PackedShardDataset(pack, rank=0, world_size=2, progress=where, live_every_s=0)
    assert len(list(ds)) == LENGTHS[0] + LENGTHS[1]
    state = ds.state_dict()
    ds.state_dict()
    assert positions_of(state) == {0: LENGTHS[0], 1: LENGTHS[1]}

    def warned() -> list[str]:
        return [r.getMessage().split(" position", 1)[0] for r in caplog.records if r.name == "loader.progress"]

    assert warned() == ["could not publish the live", "could not publish the checkpoint"]  # once per kind
    loader = build_dataloader(pack, rank=0, world_size=2, pin_memory=False, progress=where)
    assert len(list(loader)) == LENGTHS[0] + LENGTHS[1]
    loader.state_dict()
    loader.state_dict()
    assert len(warned()) == 4  # the loader's dataset: its own publisher, once per kind again
    assert not os.path.exists(where)


def test_an_unknown_loader_state_layout_publishes_nothing(pack, tmp_path, monkeypatch, caplog):
    assert dataset_states({}) is None and dataset_states({"_snapshot": {}}) is None
    assert dataset_states({"dataset_state": None}) is None
    where = str(tmp_path / "progress")
    loader = build_dataloader(pack, rank=0, world_size=2, pin_memory=False, progress=where)
    monkeypatch.setattr(StatefulDataLoader, "state_dict", lambda self: {"something": "else"})
    monkeypatch.setattr(ProgressDataLoader, "_warned_layout", False)
    caplog.set_level(logging.WARNING, logger="loader.dataloader")
    assert loader.state_dict() == {"something": "else"} and loader.state_dict() == {"something": "else"}
    assert not os.path.exists(where)
    assert len([r for r in caplog.records if r.name == "loader.dataloader"]) == 1


def test_on_s3(s3, pack):
    where = s3.new_prefix("progress")
    ds = PackedShardDataset(pack, rank=0, world_size=2, progress=where, live_every_s=0)
    take(iter(ds), 3)
    state = ds.state_dict()
    got = ProgressFolder(where).read()
    assert got.packs == {ds.fingerprint}
    for s in (0, 1):
        (entry,) = got.checkpoints[s]
        assert entry.positions == positions_of(state) == {0: 2, 1: 1} and entry.last == last_of(state)
        assert got.reached(s) == positions_of(state)[s]
    # forked DataLoader workers publish through S3 clients of their own
    loader = build_dataloader(pack, rank=1, world_size=2, num_workers=2, pin_memory=False, progress=where)
    it = iter(loader)
    take(it, 5)
    loader.state_dict()
    del it
    assert set(s3.objects(where)) == {rank_checkpoints_file(2, 0), live_file(2, 0, 0), rank_checkpoints_file(2, 1),
                                      live_file(2, 1, 0), live_file(2, 1, 1)}
    got = ProgressFolder(where).read()
    assert [e.positions for e in got.checkpoints[2]] == [{2: 3, 3: 2}]
