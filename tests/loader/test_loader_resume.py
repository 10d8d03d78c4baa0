"""Stream assignment and exact resume: no batch repeated, none skipped, across processes and loaders."""

from __future__ import annotations

import collections
import json
import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch
from tests.helpers.fakepack import batch_id, make_pack

from loader import PackedShardDataset, streams_for_rank

StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader

LENGTHS = [4, 7, 5, 2, 6, 3]  # W=3 ranks x K=2 workers; unequal so exhausted streams get skipped
from tests.helpers.paths import REPO as ROOT


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("pack"))
    make_pack(out, world_size=3, num_workers=2, lengths=LENGTHS, shard_bytes=40 * 1024)
    return out


@pytest.fixture(scope="module")
def stream_ids(pack):
    """Every stream's batch ids, in order, read one stream at a time."""
    from loader import open_stream

    return {s: [batch_id(b) for b in open_stream(pack, s)] for s in range(len(LENGTHS))}


def ids(iterable) -> list[str]:
    return [batch_id(b) for b in iterable]


def test_assignment_rules():
    assert streams_for_rank(6, 3, 2, 1, 3) == [2, 3]
    assert streams_for_rank(6, 3, 2, 1, 4) == [1, 5]
    assert streams_for_rank(6, 3, 2, 0, 1) == [0, 1, 2, 3, 4, 5]
    assert streams_for_rank(3, 3, 0, 2, 3) == [2]  # K = 0: one stream per rank
    with pytest.raises(ValueError, match="7 ranks"):
        streams_for_rank(6, 3, 2, 0, 7)
    with pytest.raises(ValueError, match="identity"):
        streams_for_rank(5, 3, 2, 0, 3)


def test_rank_order_is_k_worker_dataloader_order(pack, stream_ids):
    for rank in range(3):
        a, b = 2 * rank, 2 * rank + 1
        want = [stream_ids[s][r] for r in range(max(LENGTHS)) for s in (a, b) if r < LENGTHS[s]]
        assert ids(PackedShardDataset(pack, rank=rank, world_size=3)) == want
        # J = K DataLoader workers over the same rank reproduce that order
        loader = torch.utils.data.DataLoader(
            PackedShardDataset(pack, rank=rank, world_size=3), batch_size=None, num_workers=2
        )
        assert ids(loader) == want


@pytest.mark.parametrize("world_size", [1, 2, 4, 5, 6])
def test_other_world_size_reads_every_batch_once(pack, stream_ids, world_size):
    seen = collections.Counter()
    for rank in range(world_size):
        ds = PackedShardDataset(pack, rank=rank, world_size=world_size)
        got = ids(ds)
        # interleaved round-robin over s % W' == rank, in stream order
        mine = [s for s in range(len(LENGTHS)) if s % world_size == rank]
        assert got == [stream_ids[s][r] for r in range(max(LENGTHS)) for s in mine if r < LENGTHS[s]]
        seen.update(got)
    assert sorted(seen) == sorted(i for v in stream_ids.values() for i in v) and set(seen.values()) == {1}


def test_dataloader_workers_split_streams(pack, stream_ids):
    ds = PackedShardDataset(pack, rank=0, world_size=2)  # streams 0, 2, 4 -> workers [0, 4] and [2]
    got = ids(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2))
    assert sorted(got) == sorted(stream_ids[0] + stream_ids[2] + stream_ids[4]) and len(set(got)) == len(got)


@pytest.mark.parametrize("seed", range(4))
def test_dataset_state_resume_in_process(pack, seed):
    rng = random.Random(seed)
    world_size = rng.choice([1, 2, 3])
    rank = rng.randrange(world_size)
    full = ids(PackedShardDataset(pack, rank=rank, world_size=world_size))
    stop = rng.randrange(len(full) + 1)
    ds = PackedShardDataset(pack, rank=rank, world_size=world_size)
    it = iter(ds)
    head = [batch_id(next(it)) for _ in range(stop)]
    state = json.loads(json.dumps(ds.state_dict()))  # must survive JSON
    del it
    resumed = PackedShardDataset(pack, rank=rank, world_size=world_size)
    resumed.load_state_dict(state)
    assert head + ids(resumed) == full
    assert ids(resumed) == full  # the loaded state is used once; the next pass starts over


@pytest.mark.parametrize("old_ws, new_ws, seed", [(3, 2, 0), (3, 6, 1), (2, 1, 2), (1, 3, 3)])
def test_world_size_change_reads_every_batch_exactly_once(pack, stream_ids, old_ws, new_ws, seed):
    """Train on old_ws ranks, stop each at a random batch, merge their states, continue on new_ws
    ranks (resuming twice on the new world, through JSON): every batch read exactly once overall."""
    rng = random.Random(seed)
    seen, states = [], []
    for rank in range(old_ws):
        ds = PackedShardDataset(pack, rank=rank, world_size=old_ws)
        it = iter(ds)
        total = ds.num_batches()
        seen += [batch_id(next(it)) for _ in range(rng.randrange(total + 1))]
        states.append(json.loads(json.dumps(ds.state_dict())))
    merged = json.loads(json.dumps(PackedShardDataset.merge_states(states)))
    for rank in range(new_ws):
        ds = PackedShardDataset(pack, rank=rank, world_size=new_ws)
        ds.load_state_dict(merged)
        it = iter(ds)
        first = [batch_id(b) for _, b in zip(range(2), it)]
        mid = json.loads(json.dumps(ds.state_dict()))
        again = PackedShardDataset(pack, rank=rank, world_size=new_ws)
        again.load_state_dict(mid)
        seen += first + ids(again)
    assert sorted(seen) == sorted(b for s in stream_ids.values() for b in s) and len(seen) == len(set(seen))


def test_state_shapes_on_disk_and_older_states(pack):
    """state_dict/merge_states write today's plain shapes; a state saved before ``firsts`` existed resumes."""
    ds = PackedShardDataset(pack, rank=1, world_size=3)
    full = ids(PackedShardDataset(pack, rank=1, world_size=3))
    it = iter(ds)
    head = [batch_id(next(it)) for _ in range(3)]
    state = ds.state_dict()
    assert list(state) == ["version", "pack", "rank", "world_size", "worker", "num_workers", "streams", "cursor",
                           "firsts", "positions", "last"]
    assert state["version"] == 2 and state["streams"] == [2, 3] and state["cursor"] == 3
    assert all(type(v) is int for k in ("firsts", "positions") for v in state[k])
    assert all(type(v) is str for v in state["last"]) and type(state["pack"]) is str
    merged = PackedShardDataset.merge_states([state])
    assert list(merged) == ["version", "kind", "pack", "positions", "last"] and merged["kind"] == "merged"
    assert merged["positions"] == {"2": state["positions"][0], "3": state["positions"][1]}
    assert merged["last"] == {"2": state["last"][0], "3": state["last"][1]}
    older = PackedShardDataset(pack, rank=1, world_size=3)
    older.load_state_dict({k: v for k, v in state.items() if k != "firsts"})
    assert head + ids(older) == full


def test_merge_refuses_overlap_and_gaps(pack):
    a = PackedShardDataset(pack, rank=0, world_size=3).state_dict()
    with pytest.raises(ValueError, match="appears in two"):
        PackedShardDataset.merge_states([a, a])
    with pytest.raises(ValueError, match="merge the states of every rank"):
        PackedShardDataset(pack, rank=1, world_size=2).load_state_dict(PackedShardDataset.merge_states([a]))


def test_state_is_refused_elsewhere(pack):
    ds = PackedShardDataset(pack, rank=0, world_size=3)
    state = ds.state_dict()
    with pytest.raises(ValueError, match="rank 0 of 3"):
        PackedShardDataset(pack, rank=1, world_size=3).load_state_dict(state)
    with pytest.raises(ValueError, match="different pack"):
        PackedShardDataset(pack, rank=0, world_size=3).load_state_dict({**state, "pack": "0" * 32})


_SUBPROCESS = """
import json, sys
sys.path[:0] = [{root!r}]
import torch
from loader import PackedShardDataset
from tests.helpers.fakepack import batch_id
ds = PackedShardDataset({pack!r}, rank={rank}, world_size={world_size})
kind = {kind!r}
if kind == "dataset":
    ds.load_state_dict(json.load(open({state!r})))
    out = [batch_id(b) for b in ds]
else:
    from torchdata.stateful_dataloader import StatefulDataLoader
    loader = StatefulDataLoader(ds, batch_size=None, num_workers={workers})
    loader.load_state_dict(torch.load({state!r}, weights_only=False))
    out = [batch_id(b) for b in loader]
print(json.dumps(out))
"""


def _resume_in_subprocess(tmp_path, pack, rank, world_size, kind, workers=0) -> list[str]:
    code = _SUBPROCESS.format(
        root=ROOT, tests=os.path.join(ROOT, "tests"), pack=pack, rank=rank, world_size=world_size,
        kind=kind, state=str(tmp_path / "state"), workers=workers,
    )  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_dataset_state_resume_in_new_process(pack, tmp_path):
    rng = random.Random(7)
    full = ids(PackedShardDataset(pack, rank=1, world_size=2))
    stop = rng.randrange(1, len(full))
    ds = PackedShardDataset(pack, rank=1, world_size=2)
    it = iter(ds)
    head = [batch_id(next(it)) for _ in range(stop)]
    (tmp_path / "state").write_text(json.dumps(ds.state_dict()))
    assert head + _resume_in_subprocess(tmp_path, pack, 1, 2, "dataset") == full


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_stateful_dataloader_resume(pack, tmp_path, workers):
    rank, world_size = 0, 1  # all six streams: with 2 workers each takes three
    make = lambda: StatefulDataLoader(  # noqa: E731
        PackedShardDataset(pack, rank=rank, world_size=world_size), batch_size=None, num_workers=workers
    )
    full = ids(make())
    assert len(full) == sum(LENGTHS) and len(set(full)) == len(full)
    for stop in sorted({1, random.Random(workers).randrange(2, len(full) - 1), len(full) - 1}):
        loader = make()
        it = iter(loader)
        head = [batch_id(next(it)) for _ in range(stop)]
        state = loader.state_dict()
        del it
        resumed = make()
        resumed.load_state_dict(state)
        assert head + ids(resumed) == full, f"stop={stop}"
    torch.save(state, tmp_path / "state")
    assert head + _resume_in_subprocess(tmp_path, pack, rank, world_size, "loader", workers) == full


@pytest.mark.parametrize("how", ["plain", "balanced", "dataloader"])
def test_a_second_resume_from_a_state_saved_after_a_first_resume_continues_exactly(pack, how):
    """Resume, read on, save, resume again: the second resume continues exactly (Hugging Face
    datasets shipped a bug there, huggingface/datasets#8308: a state saved after a resume lost the
    resumed offset)."""
    from loader.balance import Balance

    def make():
        balance = Balance(micro_batches=2) if how == "balanced" else None
        ds = PackedShardDataset(pack, rank=1, world_size=3, balance=balance)
        return StatefulDataLoader(ds, batch_size=None, num_workers=0) if how == "dataloader" else ds

    full = ids(make())
    assert len(full) > 6
    first = make()
    it = iter(first)
    read = [batch_id(next(it)) for _ in range(3)]
    state = json.loads(json.dumps(first.state_dict()))
    second = make()
    second.load_state_dict(state)
    it = iter(second)
    read += [batch_id(next(it)) for _ in range(2)]  # after the first resume
    state = json.loads(json.dumps(second.state_dict()))
    third = make()
    third.load_state_dict(state)
    read += ids(third)
    assert read == full
