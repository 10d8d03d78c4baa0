"""Balanced steps in the loader (``balance=Balance(...)``, ``loader.balanced``): each optimizer step's
batches are the reference's, dealt by cost and never slower by the model (under lockstep, each
micro-step's batches read as that micro-step by every rank; under step, each rank's sum); resume at a step
boundary and mid-step (in process and under 2 DataLoader workers); a world-size change reads
every batch exactly once; a pack being written is followed; the progress published never counts a
record some rank may still read.  Training with and without balance: tests/loader/test_balance_training.py."""

from __future__ import annotations

import collections
import json
import os
import shutil
import threading
import time

import numpy as np
import pytest
import torch

from loader import PackedShardDataset, build_dataloader, open_stream
from loader.balance import Balance, lockstep_time, rank_loads
from loader.dataloader import dataset_states
from loader.index_window import StreamWindows
from loader.reader import Pack
from loader.state import positions_in
from prepack.run.bounded.trainings import Trainings
from prepack.run.commit.writer import write_index
from schemas.cost import CostModel
from schemas.layout import PACK_INFO_NAME, index_file
from schemas.location import resolve_location
from schemas.manifest import StreamIndex
from schemas.progress import ProgressFolder
from tests.helpers.fakepack import batch_id, make_pack, mark_done

LENGTHS = [9, 7, 11, 8, 10, 6]  # W=3 ranks x K=2 workers; unequal, so streams end at different steps
MODEL = CostModel.default()


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("pack"))
    make_pack(out, world_size=3, num_workers=2, lengths=LENGTHS, shard_bytes=40 * 1024)
    return out


@pytest.fixture(scope="module")
def where(pack) -> dict[str, tuple[int, int]]:
    """Every batch's (stream, record), by content."""
    return {batch_id(b): (s, r) for s in range(len(LENGTHS)) for r, b in enumerate(open_stream(pack, s))}


def places(batches, where) -> list[tuple[int, int]]:
    return [where[batch_id(b)] for b in batches]


def reference(pack, where, world_size: int) -> list[list[tuple[int, int]]]:
    """Each rank's batches without balance (its reference order)."""
    return [places(PackedShardDataset(pack, rank=r, world_size=world_size), where) for r in range(world_size)]


def balanced(pack, where, world_size: int, m: int, sync: str = "lockstep", cost_model=None,
             **kw) -> list[list[tuple[int, int]]]:
    setting = Balance(micro_batches=m, sync=sync, cost_model=cost_model)
    return [places(PackedShardDataset(pack, rank=r, world_size=world_size, balance=setting, **kw), where)
            for r in range(world_size)]


def step_start(ref: list[list[tuple[int, int]]], items: int) -> dict[int, int]:
    """Every stream's next record once each rank has read its first ``items`` reference batches."""
    start = {s: 0 for s in range(len(LENGTHS))}
    for batches in ref:
        for s, rec in batches[:items]:
            start[s] = max(start[s], rec + 1)
    return start


def cost(pack: Pack, item: tuple[int, int]) -> float:
    return float(MODEL.estimate(np.array(pack.record_terms(*item))))


def segments(pack: Pack, item: tuple[int, int]) -> np.ndarray:
    return MODEL.segments(np.array(pack.record_terms(*item)))


@pytest.mark.parametrize("sync", ["lockstep", "step"])
@pytest.mark.parametrize("world_size, m", [(3, 2), (3, 3), (2, 4), (6, 2), (4, 3), (1, 3), (3, 1)])
def test_each_step_holds_the_references_batches_and_is_never_slower(pack, where, world_size, m, sync):
    ref, bal = reference(pack, where, world_size), balanced(pack, where, world_size, m, sync)
    p = Pack.open(pack)
    full = min(len(x) for x in ref) // m  # steps whose every rank has M batches
    moved = 0
    for t in range(full):
        want = [x[t * m:(t + 1) * m] for x in ref]
        got = [x[t * m:(t + 1) * m] for x in bal]
        flat = sum(want, [])
        assert sorted(sum(got, [])) == sorted(flat)  # the step's batches, each once
        assignment = np.array([[flat.index(item) for item in g] for g in got])
        if sync == "step":  # each rank's in reference order, its sum never above the slowest reference rank's
            assert all(g == sorted(g, key=flat.index) for g in got)
            costs = np.array([cost(p, item) for item in flat])
            assert rank_loads(costs, world_size, m, assignment).max() <= rank_loads(costs, world_size, m).max()
        else:  # micro-step j is every rank's j-th batch: its slowest per segment never above the reference's
            seg = np.stack([segments(p, item) for item in flat])
            assert lockstep_time(seg, world_size, m, assignment) <= lockstep_time(seg, world_size, m)
        moved += got != want
    if world_size > 1 and m > 1:
        assert moved, "no step was dealt otherwise than the reference: the test proves nothing"
    else:
        assert bal == ref  # one rank, or one micro-batch: every assignment is the same step
    for r in range(world_size):  # the tail: each rank's own reference batches, as without balance
        assert bal[r][full * m:] == ref[r][full * m:]
    every = sum(bal, [])
    assert len(every) == len(set(every)) == sum(LENGTHS)


def test_the_order_is_deterministic_and_any_cost_model_deals_the_same_batches(pack, where):
    assert balanced(pack, where, 3, 2) == balanced(pack, where, 3, 2)
    assert balanced(pack, where, 3, 2) != balanced(pack, where, 3, 2, "step")  # the two models deal otherwise
    vae_heavy = CostModel.from_mapping({"vae_canvas_pixels": 1.0, "tokens": 1e-9})
    names = {Balance(2, sync, model).fingerprint() for sync in ("lockstep", "step") for model in (vae_heavy, MODEL)}
    assert len(names) == 4  # a state says which model and sync kind dealt its steps
    for sync in ("lockstep", "step"):
        other = balanced(pack, where, 3, 2, sync, cost_model=vae_heavy)
        assert sorted(sum(other, [])) == sorted(sum(balanced(pack, where, 3, 2), []))


def test_mistakes_are_one_clear_error(pack, tmp_path):
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="micro_batches must be an integer"):
            PackedShardDataset(pack, rank=0, world_size=3, balance={"micro_batches": bad})
    with pytest.raises(ValueError, match="sync must be one of lockstep, step"):
        PackedShardDataset(pack, rank=0, world_size=3, balance={"micro_batches": 2, "sync": "fsdp"})
    with pytest.raises(ValueError, match="unknown key micro_batch "):
        PackedShardDataset(pack, rank=0, world_size=3, balance={"micro_batch": 2})
    with pytest.raises(ValueError, match="balance must be True, a mapping"):
        PackedShardDataset(pack, rank=0, world_size=3, balance=2)
    with pytest.raises(TypeError):  # the keywords before one setting: gone, not ignored
        PackedShardDataset(pack, rank=0, world_size=3, balance=True, micro_batches=2)
    # a mapping is the same setting (a cost model file read as CostModel.read reads it)
    path = tmp_path / "model.json"
    path.write_text(json.dumps({"vae_canvas_pixels": 1.0, "tokens": 1e-9}))
    ds = PackedShardDataset(pack, rank=0, world_size=3, balance={"micro_batches": 2, "cost_model": str(path)})
    assert ds.balance == Balance(2, "lockstep", CostModel.read(str(path)))
    assert PackedShardDataset(pack, rank=0, world_size=3, balance=True).balance == Balance(1, "lockstep", MODEL)
    assert PackedShardDataset(pack, rank=0, world_size=3, balance=False).balance is None


def _take(it, n: int) -> list:
    return [next(it) for _ in range(n)]


@pytest.mark.parametrize("stop", [0, 4, 5, 7, 12, 40])  # M=2: boundaries at even counts; 40: in the tail
def test_resume_in_process_at_a_step_boundary_and_mid_step(pack, where, stop):
    make = lambda: PackedShardDataset(pack, rank=1, world_size=3, balance=Balance(micro_batches=2))  # noqa: E731
    full = places(make(), where)
    stop = min(stop, len(full) - 1)
    ds = make()
    it = iter(ds)
    head = places(_take(it, stop), where)
    state = json.loads(json.dumps(ds.state_dict()))
    assert state["kind"] == "balanced" and state["step"] * 2 + state["offset"] == stop
    resumed = make()
    resumed.load_state_dict(state)
    assert head + places(resumed, where) == full
    # the state is refused by an unbalanced dataset, another rank, M or cost model, and vice versa
    with pytest.raises(ValueError, match="balance=True"):
        PackedShardDataset(pack, rank=1, world_size=3).load_state_dict(state)
    with pytest.raises(ValueError, match="sync kind"):  # dealt under lockstep, read as step
        PackedShardDataset(pack, rank=1, world_size=3, balance=Balance(2, "step")).load_state_dict(state)
    with pytest.raises(ValueError, match="rank 1 of 3"):
        PackedShardDataset(pack, rank=0, world_size=3, balance=Balance(micro_batches=2)).load_state_dict(state)
    with pytest.raises(ValueError, match="micro-batches"):
        PackedShardDataset(pack, rank=1, world_size=3, balance=Balance(micro_batches=3)).load_state_dict(state)
    with pytest.raises(ValueError, match="unbalanced loader state"):
        make().load_state_dict(PackedShardDataset(pack, rank=1, world_size=3).state_dict())


def test_a_state_of_another_pack_is_refused(pack, tmp_path):
    other = str(tmp_path / "other")
    shutil.copytree(pack, other)
    ds = PackedShardDataset(pack, rank=0, world_size=3, balance=Balance(micro_batches=2))
    it = iter(ds)
    _take(it, 4)
    state = ds.state_dict()
    state["last"][state["positions"].index(max(state["positions"]))] = "0" * 32
    with pytest.raises(ValueError, match="different pack"):
        PackedShardDataset(pack, rank=0, world_size=3, balance=Balance(micro_batches=2)).load_state_dict(state)


@pytest.mark.parametrize("workers, m", [(2, 2), (2, 3), pytest.param(3, 2, marks=pytest.mark.slow)])
def test_dataloader_workers_yield_the_ranks_balanced_order_and_resume(pack, where, workers, m, tmp_path):
    make = lambda: build_dataloader(pack, rank=2, world_size=3, num_workers=workers, pin_memory=False,  # noqa: E731
                                    balance=Balance(micro_batches=m))
    single = places(PackedShardDataset(pack, rank=2, world_size=3, balance=Balance(micro_batches=m)), where)
    assert places(make(), where) == single  # worker j yields items j::J: torchdata's round-robin is the order
    for stop in (2 * m, 2 * m + 1, len(single) - 1):  # a step boundary, mid-step, in the tail
        loader = make()
        it = iter(loader)
        head = places(_take(it, stop), where)
        state = loader.state_dict()
        del it
        torch.save(state, tmp_path / "state.pt")  # plain values: NeMo's weights-only load restores it
        resumed = make()
        resumed.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
        assert head + places(resumed, where) == single, f"stop={stop}"


def _run_ranks(pack, world_size: int, m: int, steps: int, where, **kw):
    """Every rank of a balanced run reads ``steps`` optimizer steps; their states and what they read."""
    sets, read = [], []
    for r in range(world_size):
        ds = PackedShardDataset(pack, rank=r, world_size=world_size, balance=Balance(micro_batches=m), **kw)
        it = iter(ds)
        read += places(_take(it, steps * m), where)
        sets.append(ds.state_dict())
    return sets, read


@pytest.mark.parametrize("old_ws, new_ws, new_balance", [(2, 1, True), (2, 1, False), (2, 4, True), (2, 4, False),
                                                         (3, 2, True), (3, 6, True), (3, 6, False)])
def test_a_world_size_change_reads_every_batch_exactly_once(pack, where, old_ws, new_ws, new_balance):
    states, read = _run_ranks(pack, old_ws, 2, 3, where)
    merged = PackedShardDataset.merge_states(json.loads(json.dumps(states)))
    for r in range(new_ws):
        setting = Balance(micro_batches=2) if new_balance else None
        ds = PackedShardDataset(pack, rank=r, world_size=new_ws, balance=setting)
        ds.load_state_dict(merged)
        read += places(ds, where)
    assert sorted(read) == sorted(where.values())  # every batch once overall


def test_a_world_size_change_from_dataloader_workers(pack, where):
    states, read = [], []
    for r in range(3):
        loader = build_dataloader(pack, rank=r, world_size=3, num_workers=2, pin_memory=False,
                                  balance=Balance(micro_batches=2))
        it = iter(loader)
        read += places(_take(it, 6), where)
        states += dataset_states(loader.state_dict())
        del it
    merged = PackedShardDataset.merge_states(states)
    ds = PackedShardDataset(pack, rank=0, world_size=1)
    ds.load_state_dict(merged)
    read += places(ds, where)
    assert sorted(read) == sorted(where.values())


def test_a_world_size_change_needs_every_rank_at_one_step_boundary(pack, where):
    states, _ = _run_ranks(pack, 3, 2, 2, where)
    with pytest.raises(ValueError, match="lack ranks"):
        PackedShardDataset.merge_states(states[:2])
    mid = PackedShardDataset(pack, rank=2, world_size=3, balance=Balance(micro_batches=2))
    it = iter(mid)
    _take(it, 5)
    with pytest.raises(ValueError, match="inside an optimizer step"):
        PackedShardDataset.merge_states(states[:2] + [mid.state_dict()])
    _take(it, 1)
    with pytest.raises(ValueError, match="different optimizer steps"):
        PackedShardDataset.merge_states(states[:2] + [mid.state_dict()])
    unbalanced = PackedShardDataset(pack, rank=2, world_size=3).state_dict()
    with pytest.raises(ValueError, match="balanced and unbalanced"):
        PackedShardDataset.merge_states(states[:2] + [unbalanced])


def test_windows_hold_few_indexes(pack):
    """A rank weighs every stream but keeps only the indexes of the streams it reads lately."""
    p = Pack.open(pack)
    windows = StreamWindows(p, None, chunk=3, keep=2)
    for s in range(len(LENGTHS)):
        for r in range(LENGTHS[s]):
            assert windows.has(s, r)
            assert windows.terms(s, r).tolist() == list(p.record_terms(s, r))
            assert windows.digest(s, r) == p.record_digest(s, r)
            p.forget(s)
        assert not windows.has(s, LENGTHS[s])
    assert not p._indexes
    for s in range(len(LENGTHS)):
        windows.read(s, 0, True)
    assert sorted(p._indexes) == [4, 5]


# --- a pack being written -------------------------------------------------------------------------
def _partial_copy(pack: str, out: str) -> list[StreamIndex]:
    """``out``: ``pack``'s pack.json and shard files, and each stream's index with its first shard
    only, no done.json (a pack being written).  Returns the full indexes."""
    os.makedirs(out)
    shutil.copy(os.path.join(pack, PACK_INFO_NAME), out)
    src = Pack.open(pack)
    loc = resolve_location(out)
    full = []
    for s in range(src.num_streams):
        index = src.index(s)
        os.makedirs(os.path.join(out, os.path.dirname(index_file(s))), exist_ok=True)
        for sh in index.shards:
            shutil.copy(os.path.join(pack, sh.file), os.path.join(out, sh.file))
        write_index(loc, StreamIndex(s, index.shards[:1], index.ckpt0_json_sha256, index.ckpt0_arrow_sha256))
        full.append(index)
    return full


def test_follow_waits_for_every_batch_of_the_step(pack, where, tmp_path):
    out = str(tmp_path / "growing")
    full = _partial_copy(pack, out)
    want = balanced(pack, where, 3, 2)
    got: dict[int, list] = {}
    errors: list = []

    def read(r):
        try:
            ds = PackedShardDataset(out, rank=r, world_size=3, balance=Balance(micro_batches=2), follow=True,
                                    poll_s=0.02, timeout_s=60)
            got[r] = places(ds, where)
        except Exception as e:  # noqa: BLE001 -- reported below
            errors.append(e)

    threads = [threading.Thread(target=read, args=(r,), daemon=True) for r in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    assert all(t.is_alive() for t in threads) and not errors  # waiting for the rest of the pack
    # without follow, a stream still being packed is refused where it ends
    with pytest.raises(ValueError, match="follow=True"):
        list(PackedShardDataset(out, rank=0, world_size=3, balance=Balance(micro_batches=2)))
    loc = resolve_location(out)
    identity = Pack.open(out).identity
    for index in full:  # the packer commits the rest, then finishes each stream
        write_index(loc, index)
        time.sleep(0.05)
    for index in full:
        mark_done(loc, identity, index, 2)
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads)
    assert [got[r] for r in range(3)] == want


# --- progress -------------------------------------------------------------------------------------
def test_progress_counts_a_record_only_once_every_rank_has_passed_it(pack, where, tmp_path):
    """Every rank reads 2.5 steps (mid-step) and checkpoints; whatever any rank reads after resuming
    from its checkpoint lies at or after the published position of its stream (so trimming behind
    the checkpoints is safe), and the positions are the reference's at the step start (the live
    position M past it)."""
    folder = str(tmp_path / "progress")
    m, world_size = 2, 3
    states, reads_before = [], []
    for r in range(world_size):
        ds = PackedShardDataset(pack, rank=r, world_size=world_size, balance=Balance(micro_batches=m),
                                progress=folder, live_every_s=0)
        it = iter(ds)
        reads_before += places(_take(it, 2 * m + 1), where)
        states.append(ds.state_dict())
    ref = reference(pack, where, world_size)
    start = {s: 0 for s in range(len(LENGTHS))}  # the reference positions at the start of step 2
    for r in range(world_size):
        for s, rec in ref[r][:2 * m]:
            start[s] = max(start[s], rec + 1)
    got = ProgressFolder(folder).read()
    assert {s: got.kept(s, 1).positions[s] for s in range(len(LENGTHS))} == start
    # what a packer holding back counts from: the step start plus M, the most of a stream the step can need
    assert {s: got.reached(s) for s in range(len(LENGTHS))} == {s: p + m for s, p in start.items()}
    later = []
    for r in range(world_size):
        ds = PackedShardDataset(pack, rank=r, world_size=world_size, balance=Balance(micro_batches=m))
        ds.load_state_dict(states[r])
        later += places(ds, where)
    assert all(rec >= start[s] for s, rec in later)
    assert sorted(set(reads_before) | set(later)) == sorted(where.values())
    trainings = Trainings([folder], Pack.open(pack))
    assert {s: trainings.kept_before(s, 1) for s in range(len(LENGTHS))} == start
    assert positions_in(Pack.open(pack), [states]) == start  # prepack trim --state: the same rule
    # each stream is published by one rank only (a training's K newest checkpoints are its own)
    files = collections.Counter(s for name in os.listdir(folder) if name.startswith("ckpt")
                                for s in json.load(open(os.path.join(folder, name)))["entries"][0]["positions"])
    assert set(files.values()) == {1} and len(files) == len(LENGTHS)


def test_dataloader_checkpoint_publishes_the_earliest_workers_step_start(pack, where, tmp_path):
    folder = str(tmp_path / "progress")
    loader = build_dataloader(pack, rank=0, world_size=3, num_workers=2, pin_memory=False,
                              balance=Balance(micro_batches=2), progress=folder)
    it = iter(loader)
    _take(it, 3)  # worker 0 is at step 2 (its next item is 4), worker 1 at step 1 (item 3)
    state = loader.state_dict()
    del it
    steps = sorted(d["step"] for d in dataset_states(state))
    assert steps == [1, 2]
    start = step_start(reference(pack, where, 3), 2)
    got = ProgressFolder(folder).read()
    assert {s: got.kept(s, 1).positions[s] for s in (0, 1)} == {0: start[0], 1: start[1]}


# --- a real pack, and a continuation read as one pack with its parent ------------------------------
@pytest.mark.slow  # packs twice
def test_a_real_continuation_is_weighed_and_balanced_across_its_switch(tmp_path, tokenizer_and_special):
    import yaml

    from prepack.run.chain import Continue
    from prepack.run.driver import RunOptions, run_pack
    from schemas.config_file import load_config
    from tests.helpers.packs import KNOBS, make_dataset

    ds = make_dataset(str(tmp_path))
    first = ds.config(knobs=KNOBS, num_workers=2, prepack={"batches_per_stream": 6, "shard_bytes": 250_000})
    old, new = str(tmp_path / "old"), str(tmp_path / "new")
    run_pack(load_config(first), old, RunOptions(inline=True, bar=False), tokenizer=tokenizer_and_special)
    raw = yaml.safe_load(open(first))
    raw["dataset"]["grouped_datasets"]["t2i_pretrain"]["weight"] = 4.0
    raw["prepack"]["batches_per_stream"] = 4
    path = str(tmp_path / "b.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(raw, f, sort_keys=False)
    run_pack(load_config(path), new, RunOptions(inline=True, bar=False, continue_from=Continue(old, 3, None)),
             tokenizer=tokenizer_and_special)
    pack = Pack.open(new)
    assert pack.parent is not None and pack.num_records(0) == 3 + 4
    windows = StreamWindows(pack, None, chunk=2)
    for s in (0, 1):
        for r in range(pack.num_records(s)):  # windows of 2 records straddle the switch at 3
            assert windows.terms(s, r).tolist() == list(pack.record_terms(s, r))
            assert windows.digest(s, r) == pack.record_digest(s, r)
    where = {batch_id(b): (s, r) for s in (0, 1) for r, b in enumerate(open_stream(new, s))}
    ref, bal = reference(new, where, 2), balanced(new, where, 2, 2)
    for t in range(min(len(x) for x in ref) // 2):
        assert sorted(sum((x[2 * t:2 * t + 2] for x in bal), [])) == sorted(sum((x[2 * t:2 * t + 2] for x in ref), []))
    assert sorted(sum(bal, [])) == sorted(where.values())


def test_a_state_taken_in_the_tail_is_refused_once_an_extension_fills_it(pack, where, tmp_path):
    """extend x balanced batches: the pack's last steps, too short for M batches a rank, are read
    unbalanced (each rank its own); a state taken inside them resumes there while the pack is as it
    was, and is refused in one line once the pack grew to fill that step (a balanced reading of it
    would give some batches twice and miss others).  A pack of the same streams' first records stands
    for the old pack, the whole one for its extension."""
    short = str(tmp_path / "short")
    make_pack(short, world_size=3, num_workers=2, lengths=[n - 4 for n in LENGTHS], shard_bytes=40 * 1024)
    setting = Balance(micro_batches=2)
    state = None
    for rank in range(3):  # the rank with the most batches reads some in the tail
        ds = PackedShardDataset(short, rank=rank, world_size=3, balance=setting)
        it = iter(ds)
        for batch in it:
            st = ds.state_dict()
            if st.get("tail") and st["offset"] >= 1:
                state = json.loads(json.dumps(st))
                break
        if state is not None:
            break
    assert state is not None, "the short pack must end in a tail with something read in it"
    rest = places(it, where)
    resumed = PackedShardDataset(short, rank=rank, world_size=3, balance=setting)
    resumed.load_state_dict(state)
    assert places(resumed, where) == rest  # the pack as it was: the tail goes on
    grown = PackedShardDataset(pack, rank=rank, world_size=3, balance=setting)
    grown.load_state_dict(state)
    with pytest.raises(ValueError, match=r"taken in the pack's last steps \(from step \d+\), read unbalanced .* "
                       r"extended to fill: .* resume from a checkpoint taken before step \d+"):
        next(iter(grown))
    # a state taken outside the tail never says tail, and loads on the grown pack as before
    ds = PackedShardDataset(short, rank=0, world_size=3, balance=setting)
    next(iter(ds))
    assert "tail" not in ds.state_dict()
