"""A balanced-samples pack (``prepack: balance: samples``) end to end, W=2 ranks x K=2 workers: its
reference is the ordinary pack byte for byte; each step holds the real reference's step's samples
(NeMo's ``PackedDataset``, tensor for tensor); no step's costliest batch is costlier than the
reference's; ``verify`` and ``audit`` pass and catch a reference that is not its own; a crashed
balancing resumes to the same bytes; the loader reads it like any pack; the config's cost model is
the one used; a two-rank gloo training on it equals one on the reference within float tolerance."""

from __future__ import annotations

import ast
import os
import shutil
from collections import Counter

import numpy as np
import pytest
import yaml

from loader import Balance, PackedShardDataset, open_stream
from loader.batch import SimpleCustomBatch
from loader.reader import Pack, iter_records
from prepack.run.bounded.bound import BoundSpec
from prepack.run.chain import Continue
from prepack.run.bounded.trim_policy import TrimPolicy
from prepack.run.driver import RunOptions, run_pack
from prepack.run.commit.writer import write_index
from prepack.tools.audit import audit_pack
from prepack.tools.verify import verify_pack
from schemas.config_file import load_config
from schemas.cost import CostModel
from schemas.errors import ConfigError, UsageError
from schemas.layout import DONE_NAME, MANIFEST_NAME, REFERENCE_DIR, index_file, stream_dir
from schemas.location import resolve_location
from schemas.manifest import StreamIndex
from schemas.record import record_to_batch
from tests.helpers import datagen as dg
from tests.helpers import oracle
from tests.helpers.packs import KNOBS
from tests.helpers.samples import keys_of

BATCHES = 5
W, K = 2, 2


def _dataset(root: str, seed: int = 0) -> dg.Dataset:
    """t2i and edit (VAE samples: they stay) and SFT (ViT and text: they may move), enough rows for 4 streams."""
    rs = np.random.RandomState(seed)
    ds = dg.Dataset(os.path.join(root, "data"))
    os.makedirs(ds.root)
    dg.add_t2i(ds, [dg.good_t2i_rows(rs, 4, i * 4) for i in range(4)], row_group_size=2)
    lines, files = dg.good_sft(rs, 16)
    dg.add_sft(ds, lines, files)
    dg.add_edit(ds, [dg.good_edit_rows(rs, 2, i * 2) for i in range(4)])
    return ds


def _config(ds: dg.Dataset, name: str = "config.yaml", **prepack) -> str:
    """The config written as ``name`` beside the data (each config its own file: packs read theirs later)."""
    path = ds.config(knobs=KNOBS, num_workers=K, prepack={"batches_per_stream": BATCHES, "shard_bytes": 150_000,
                                                          "world_size": W, **prepack})
    mine = os.path.join(os.path.dirname(path), name)
    os.replace(path, mine)
    return mine


@pytest.fixture(scope="module")
def packs(tmp_path_factory, tokenizer_and_special):
    root = str(tmp_path_factory.mktemp("balanced"))
    ds = _dataset(root)
    balanced, plain = _config(ds, "balanced.yaml", balance="samples"), _config(ds, "plain.yaml")
    out, ref = os.path.join(root, "out"), os.path.join(root, "plain")
    opts = RunOptions(inline=True, bar=False)
    assert run_pack(load_config(balanced), out, opts, tokenizer=tokenizer_and_special).manifest_written
    assert run_pack(load_config(plain), ref, opts, tokenizer=tokenizer_and_special).manifest_written
    return dict(root=root, out=out, plain=ref, config=balanced, ds=ds)


def _shards(out: str, s: int) -> list[tuple[str, int]]:
    return [(sh.xxh3, sh.nbytes) for sh in StreamIndex.read(resolve_location(out), s).shards]


def test_its_reference_is_the_ordinary_pack_byte_for_byte(packs):
    for s in range(W * K):
        assert _shards(os.path.join(packs["out"], REFERENCE_DIR), s) == _shards(packs["plain"], s)
    assert Pack.open(packs["out"]).info.stored_config().prepack.balance == "samples"


def _steps(out: str, streams: list[int]) -> list[list[dict]]:
    per = [[SimpleCustomBatch(record_to_batch(r)).to_dict() for _, r in iter_records(Pack.open(out), s)] for s in streams]
    return [list(step) for step in zip(*per)]


def test_each_step_holds_the_reference_steps_samples_tensor_for_tensor(packs, tokenizer_and_special):
    """Against NeMo's PackedDataset itself: step j of worker w is batch j of ranks 0..W-1's worker w."""
    cfg = load_config(packs["config"])
    tok, _ = tokenizer_and_special
    moved = 0
    for w in range(K):
        streams = [r * K + w for r in range(W)]
        theirs = [oracle.reference_batches(cfg, s, tok, BATCHES) for s in streams]
        ours = _steps(packs["out"], streams)
        assert len(ours) == BATCHES
        for j, step in enumerate(ours):
            ref_step = [theirs[i][j] for i in range(W)]
            assert Counter(k for d in step for k in keys_of(d)) == Counter(k for d in ref_step for k in keys_of(d)), \
                f"worker {w} step {j}: the samples differ from the reference step's"
            moved += any(keys_of(a) != keys_of(b) for a, b in zip(step, ref_step))
    assert moved, "no step moved a sample: the data gives the balancer nothing to do"


def test_no_step_is_slower_than_the_reference_by_the_model(packs):
    model = CostModel.default()
    out, ref = Pack.open(packs["out"]), Pack.open(packs["plain"])
    for w in range(K):
        streams = [r * K + w for r in range(W)]
        for j in range(BATCHES):
            mine = max(float(model.estimate(out.record_terms(s, j))) for s in streams)
            theirs = max(float(model.estimate(ref.record_terms(s, j))) for s in streams)
            assert mine <= theirs + 1e-9


def test_verify_and_audit_pass_and_catch_a_reference_that_is_not_its_own(packs, tokenizer_and_special, tmp_path):
    rep = verify_pack(packs["out"])
    assert rep.ok, [r for r in rep.rows if not r.ok]
    assert sum(r.check == "balanced steps" and r.ok for r in rep.rows) == K
    audit = audit_pack(packs["out"], tokenizer=tokenizer_and_special)
    assert audit.ok and len(audit.rows) == sum(len(StreamIndex.read(resolve_location(packs["out"]), s).shards)
                                               for s in range(W * K))
    # the same pack over another seed's reference: same shapes, other samples
    other = str(tmp_path / "other")
    shutil.copytree(packs["out"], other)
    ds = _dataset(str(tmp_path / "seed1"), seed=1)
    shutil.rmtree(os.path.join(other, REFERENCE_DIR))
    run_pack(load_config(_config(ds)), os.path.join(other, REFERENCE_DIR), RunOptions(inline=True, bar=False),
             tokenizer=tokenizer_and_special)
    rep = verify_pack(other)
    bad = [r for r in rep.rows if r.check == "balanced steps" and not r.ok]
    assert bad and "step 0" in bad[0].detail
    assert not audit_pack(other, tokenizer=tokenizer_and_special).ok
    # that reference trimmed too: verify compares by lineage, audit packs it again: both still catch it
    TrimPolicy(Pack.open(os.path.join(other, REFERENCE_DIR)), lambda s: 1 << 62).apply()
    bad = [r for r in verify_pack(other).rows if r.check == "balanced steps" and not r.ok]
    assert bad and "step 0" in bad[0].detail and "by their lineage" in bad[0].detail
    assert not audit_pack(other, tokenizer=tokenizer_and_special).ok


def _bytes(out: str, skip: str = "") -> int:
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(out) for n in names
               if not (skip and os.path.join(d, n).startswith(skip)))


def test_no_second_copy_stays_once_balanced(packs):
    """Once a worker class's balanced streams are written, their reference shards are trimmed (what
    packs them again stays: a ladder of checkpoints, the sources each read): the balanced pack's disk
    is within 10% of the ordinary pack's; verify checks its steps by lineage, audit (above) by
    packing the reference again."""
    ref = Pack.open(os.path.join(packs["out"], REFERENCE_DIR))
    assert all(ref.trimmed(s) == {sh.shard for sh in ref.index(s).shards} for s in range(W * K))
    assert _bytes(packs["out"]) <= 1.1 * _bytes(packs["plain"]), (_bytes(packs["out"]), _bytes(packs["plain"]))
    rep = verify_pack(packs["out"])
    assert rep.ok and all("by their lineage" in r.detail for r in rep.rows if r.check == "balanced steps")


def test_a_crashed_balancing_resumes_to_the_same_bytes(packs, tokenizer_and_special, tmp_path):
    out = str(tmp_path / "out")
    shutil.copytree(packs["out"], out)
    loc = resolve_location(out)
    for s in (0, 3):  # one stream of each worker class lost its last two shards, another none
        index = StreamIndex.read(loc, s)
        cut = StreamIndex(s, index.shards[:-2], index.ckpt0_json_sha256, index.ckpt0_arrow_sha256)
        write_index(loc, cut)
        os.remove(os.path.join(out, stream_dir(s), DONE_NAME))
        with open(os.path.join(out, stream_dir(s), f"shard-{len(cut.shards):05d}.arrow.tmp"), "wb") as f:
            f.write(b"half a shard")  # a crash leftover
    os.remove(os.path.join(out, MANIFEST_NAME))
    summary = run_pack(load_config(packs["config"]), out, RunOptions(inline=True, bar=False),
                       tokenizer=tokenizer_and_special)
    assert summary.manifest_written
    for s in range(W * K):
        with open(os.path.join(out, index_file(s)), "rb") as a, open(os.path.join(packs["out"], index_file(s)), "rb") as b:
            assert a.read() == b.read(), f"stream {s}'s index differs after the resume"
        assert _shards(out, s) == _shards(packs["out"], s)
    assert verify_pack(out).ok


def test_the_loader_reads_it_as_any_pack(packs):
    for r in range(W):
        got = list(PackedShardDataset(packs["out"], rank=r, world_size=W))
        assert len(got) == K * BATCHES
        assert all(b.sequence_length <= KNOBS["max_num_tokens"] for b in got)
    assert [b.to_dict()["sample_lens"] for b in open_stream(packs["out"], 1)]


def test_refused_where_it_does_not_apply(packs, tmp_path, tokenizer_and_special):
    ds = packs["ds"]
    with pytest.raises(ConfigError, match="world_size >= 2"):
        load_config(ds.config(knobs=KNOBS, num_workers=K, prepack={"batches_per_stream": 2, "balance": "samples"}))
    with pytest.raises(ConfigError, match="balance must be one of"):
        load_config(_config(ds, balance="steps"))
    # --disk-budget: each stream's share must hold three shards' most (the one read, a reference shard
    # and its balanced twin), one less than an ordinary pack's two would not do; refused before any work
    from prepack.run.bounded.ahead import PACK_FILES_RESERVE, SHARD_FILES_SLACK, shard_most

    cfg = load_config(packs["config"])
    smallest = W * K * 3 * (shard_most(cfg) + SHARD_FILES_SLACK) + PACK_FILES_RESERVE
    with pytest.raises(UsageError, match=f"3 shards' most .* the smallest budget that works is {smallest:,} bytes"):
        run_pack(cfg, str(tmp_path / "bounded"),
                 RunOptions(inline=True, bar=False, bound=BoundSpec(ahead=2, progress=(str(tmp_path / "p"),),
                                                                    disk_budget=smallest - 1)),
                 tokenizer=tokenizer_and_special)
    assert not os.path.exists(tmp_path / "bounded" / "pack.json")


def test_a_continuation_is_balanced_from_its_switch_on(packs, tmp_path, tokenizer_and_special):
    """``--continue OLD --after 2`` under another mix, balanced: OUT and its reference both go on from
    OLD's records (the chain); each step from the switch on holds the samples of the same
    continuation packed without balance, the steps before are OLD's own; verify and audit pass,
    and a follower reads the chain."""
    raw = yaml.safe_load(open(packs["config"]))
    raw["dataset"]["grouped_datasets"]["t2i_pretrain"]["weight"] = 3.0
    balanced = _beside(packs["config"], raw, "continued-balanced.yaml")
    raw["prepack"]["balance"] = "none"
    plain = _beside(packs["config"], raw, "continued-plain.yaml")
    out, ref = str(tmp_path / "continued"), str(tmp_path / "continued-plain")
    for config, where in ((balanced, out), (plain, ref)):
        opts = RunOptions(inline=True, bar=False, continue_from=Continue(packs["plain"], 2, None))
        assert run_pack(load_config(config), where, opts, tokenizer=tokenizer_and_special).manifest_written
    assert Pack.open(out).switch(0) == Pack.open(os.path.join(out, REFERENCE_DIR)).switch(0) == 2
    moved = 0
    for w in range(K):
        streams = [r * K + w for r in range(W)]
        ours, theirs = _step_samples(out, streams), _step_samples(ref, streams)
        assert len(ours) == 2 + BATCHES and ours == theirs
        keys, plain_keys = _batch_keys(out, streams), _batch_keys(ref, streams)
        assert keys[:2] == _batch_keys(packs["plain"], streams)[:2]  # OLD's, as it was
        moved += keys[2:] != plain_keys[2:]
    assert moved, "no step moved a sample"
    rep = verify_pack(out)
    assert rep.ok and sum(r.check == "balanced steps" and r.ok for r in rep.rows) == K, \
        [r for r in rep.rows if not r.ok]
    assert audit_pack(out, tokenizer=tokenizer_and_special).ok
    got = list(PackedShardDataset(out, rank=1, world_size=W))
    assert len(got) == K * (2 + BATCHES)


def test_with_reuse_a_schedule_and_an_s3_output(packs, s3, tmp_path, tokenizer_and_special):
    """Balanced samples under a schedule, packed onto S3 (SeaweedFS) with ``--reuse`` of a local pack:
    the reference is the local scheduled pack byte for byte (reuse changes no byte) and took the old
    pack's pictures; each step holds that pack's step's samples; verify and audit (packing the
    trimmed reference again from the store) pass; the loader follows it balanced (M=2) on both ranks
    for a step, then on one rank from their merged states: every batch once."""
    raw = yaml.safe_load(open(packs["config"]))
    raw["prepack"]["schedule"] = [{"after": 2, "set": {"dataset.grouped_datasets.t2i_pretrain.weight": 3.0}}]
    balanced = _beside(packs["config"], raw, "s3-balanced.yaml")
    raw["prepack"]["balance"] = "none"
    plain = _beside(packs["config"], raw, "s3-plain.yaml")
    uri, local = s3.new_prefix("balanced-samples"), str(tmp_path / "plain")
    assert run_pack(load_config(balanced), uri, RunOptions(inline=True, bar=False, reuse=(packs["plain"],)),
                    tokenizer=tokenizer_and_special).manifest_written
    assert run_pack(load_config(plain), local, RunOptions(inline=True, bar=False),
                    tokenizer=tokenizer_and_special).manifest_written
    reference = Pack.open(f"{uri}/{REFERENCE_DIR}")
    for s in range(W * K):
        assert _shards(f"{uri}/{REFERENCE_DIR}", s) == _shards(local, s)
        assert reference.trimmed(s) == {sh.shard for sh in reference.index(s).shards}
    assert sum(int(reference.done(s).reuse.get("reused", 0)) for s in range(W * K)) > 0
    moved = 0
    for w in range(K):
        streams = [r * K + w for r in range(W)]
        assert _step_samples(uri, streams) == _step_samples(local, streams)
        moved += _batch_keys(uri, streams) != _batch_keys(local, streams)
    assert moved, "no step moved a sample"
    assert _batch_keys(local, [0, 2]) != _batch_keys(packs["plain"], [0, 2]), "the schedule changed nothing"
    rep = verify_pack(uri)
    assert rep.ok and sum(r.check == "balanced steps" and r.ok for r in rep.rows) == K, \
        [r for r in rep.rows if not r.ok]
    assert audit_pack(uri, tokenizer=tokenizer_and_special).ok
    # followed from the store: a step on both ranks, balanced; their states merged onto one rank, which
    # follows the rest
    read, states = Counter(), []
    for r in range(W):
        ds = PackedShardDataset(uri, rank=r, world_size=W, balance=Balance(micro_batches=2), follow=True, timeout_s=60)
        it = iter(ds)
        for _ in range(2):
            read.update(keys_of(next(it).to_dict()))
        states.append(ds.state_dict())
    rest = PackedShardDataset(uri, rank=0, world_size=1, follow=True, timeout_s=60)
    rest.load_state_dict(PackedShardDataset.merge_states(states))
    for b in rest:
        read.update(keys_of(b.to_dict()))
    everything = Counter(k for s in range(W * K) for b in open_stream(local, s) for k in keys_of(b.to_dict()))
    assert read == everything


def _batch_keys(out: str, streams: list[int]) -> list[list[list]]:
    return [[keys_of(d) for d in step] for step in _steps(out, streams)]


def _step_samples(out: str, streams: list[int]) -> list[Counter]:
    return [Counter(k for d in step for k in keys_of(d)) for step in _steps(out, streams)]


def _beside(config: str, raw: dict, name: str) -> str:
    """``raw`` written as ``name`` beside ``config`` (its data paths are relative to it)."""
    path = os.path.join(os.path.dirname(config), name)
    with open(path, "w") as f:
        yaml.safe_dump(raw, f, sort_keys=False)
    return path


def test_going_on_from_or_extending_a_balanced_pack_is_refused_where_it_cannot_hold(packs, tmp_path,
                                                                                      tokenizer_and_special):
    """A balanced-samples pack has no states of its own: a continuation goes on from its reference;
    it extends a batch budget only (streams ending unevenly under a token budget leave steps whole)."""
    raw = yaml.safe_load(open(packs["config"]))
    raw["prepack"]["balance"] = "none"
    plain = _beside(packs["config"], raw, "after-balanced.yaml")
    with pytest.raises(UsageError, match=r"is a balanced-samples pack, whose streams' states are its reference's: "
                                         r"continue from .*/reference"):
        run_pack(load_config(plain), str(tmp_path / "next"),
                 RunOptions(inline=True, bar=False, continue_from=Continue(packs["out"], 2, None)),
                 tokenizer=tokenizer_and_special)
    assert not os.path.exists(tmp_path / "next" / "pack.json")  # refused before anything is written
    tokens = yaml.safe_load(open(packs["config"]))
    tokens["prepack"].pop("batches_per_stream")
    tokens["prepack"]["tokens_per_stream"] = 2000
    out = str(tmp_path / "tokens")
    run_pack(load_config(_beside(packs["config"], tokens, "tokens-a.yaml")), out, RunOptions(inline=True, bar=False),
             tokenizer=tokenizer_and_special)
    tokens["prepack"]["tokens_per_stream"] = 4000
    with pytest.raises(UsageError, match="extends a batches_per_stream budget only"):
        run_pack(load_config(_beside(packs["config"], tokens, "tokens-b.yaml")), out,
                 RunOptions(inline=True, bar=False), tokenizer=tokenizer_and_special)


def test_the_configs_cost_model_splits_and_is_the_packs(packs, tmp_path, tokenizer_and_special):
    """``prepack.cost_model`` (here: a batch costs its tokens) is what the split evens out, and what
    the loader's balance and ``prepack stats`` weigh the pack's batches by."""
    config = _config(packs["ds"], "tokens.yaml", balance="samples", cost_model={"tokens": 1.0})
    out = str(tmp_path / "tokens")
    run_pack(load_config(config), out, RunOptions(inline=True, bar=False), tokenizer=tokenizer_and_special)
    tokens_only = CostModel.from_mapping({"tokens": 1.0})
    pack, ref = Pack.open(out), Pack.open(os.path.join(out, REFERENCE_DIR))
    assert pack.info.cost_model() == tokens_only and ref.info.cost_model() == CostModel.default()
    assert PackedShardDataset(out, rank=0, world_size=W, balance=True).balance.cost_model == tokens_only
    evened = 0
    for w in range(K):
        for j in range(BATCHES):
            mine = [int(pack.record_terms(r * K + w, j)[0]) for r in range(W)]  # term 0: tokens
            theirs = [int(ref.record_terms(r * K + w, j)[0]) for r in range(W)]
            assert sum(mine) == sum(theirs) and max(mine) <= max(theirs)
            evened += max(mine) < max(theirs)
    assert evened
    assert verify_pack(out).ok


# float32 sums in another order, samples at other offsets of the packed sequence (SGD,
# tests/helpers/balanced_training.py): measured 1.4e-7 relative on the losses, 6.0e-8 absolute on the weights
LOSS_RTOL = 1e-6
WEIGHT_ATOL = 1e-6


@pytest.mark.slow
def test_training_on_balanced_samples_equals_training_on_the_reference(packs, tmp_path):
    """Two ranks over gloo, M=1, NeMo's loss normalization by the step's global token counts: every
    step's loss and the final weights agree within float tolerance, though the ranks' batches differ."""
    import torch
    import torch.multiprocessing as mp

    from tests.helpers.balanced_training import differences, spawn_target

    steps = BATCHES * K

    def train(packed_dir: str, name: str) -> list[dict]:
        out, init = str(tmp_path / f"{name}-rank"), str(tmp_path / f"pg-{name}")
        mp.spawn(spawn_target, args=(W, packed_dir, False, 1, steps, init, out), nprocs=W, join=True)
        return [torch.load(f"{out}{r}", weights_only=True) for r in range(W)]

    ref = train(packs["plain"], "reference")  # OUT/reference is trimmed once balanced: its twin, packed plain
    bal = train(packs["out"], "balanced")

    def samples(run: list[dict], t: int) -> list[str]:  # step t's samples, by their batch_data_indexes entry
        return sorted(repr(d) for r in run for batch in r["read"][t] for d in ast.literal_eval(batch))

    for t in range(steps):  # each step computes the same samples, split otherwise
        assert samples(ref, t) == samples(bal, t)
    assert any(ref[r]["read"] != bal[r]["read"] for r in range(W)), "no rank's batches changed"
    assert len(set(ref[0]["losses"])) > 1  # training moves
    loss_diff, weight_diff = differences(ref[0], bal[0])
    print(f"balanced samples vs reference: loss max relative difference {loss_diff:.3g}, weights max absolute "
          f"difference {weight_diff:.3g}")
    assert loss_diff <= LOSS_RTOL
    assert weight_diff <= WEIGHT_ATOL


def test_a_second_job_finishing_beside_the_balancing_one_leaves_it_the_balanced_streams(packs, tmp_path,
                                                                                       tokenizer_and_special):
    """bal-samples x many jobs: two jobs packing disjoint reference streams may both find every reference
    stream done; the one that leases OUT's streams writes the balanced ones, the other returns (exit 0)
    instead of failing on the lease; the pack is the one a single job makes."""
    from prepack.run.lease import acquire_streams

    out = str(tmp_path / "out")
    shutil.copytree(packs["out"], out)
    loc = resolve_location(out)
    for s in range(W * K):  # the balanced streams not written yet: every reference stream is done
        shutil.rmtree(os.path.join(out, stream_dir(s)))
    os.remove(os.path.join(out, MANIFEST_NAME))
    other = acquire_streams(loc, list(range(W * K)))  # the other job, balancing now
    try:
        summary = run_pack(load_config(packs["config"]), out, RunOptions(inline=True, bar=False, streams=[0, 1]),
                           tokenizer=tokenizer_and_special)
        assert summary.out.endswith(REFERENCE_DIR) and not os.path.exists(os.path.join(out, MANIFEST_NAME))
        assert not os.path.exists(os.path.join(out, index_file(0)))
    finally:
        other.release()
    assert run_pack(load_config(packs["config"]), out, RunOptions(inline=True, bar=False),
                    tokenizer=tokenizer_and_special).manifest_written  # the balancing job's part, done once it may
    for s in range(W * K):
        assert _shards(out, s) == _shards(packs["out"], s)
    assert verify_pack(out).ok

    # two real jobs at once, each packing half the reference streams: whichever finds every reference
    # stream done first balances; the pack is the one a single job makes
    import threading

    raced, errors = str(tmp_path / "raced"), []

    def job(streams: list[int]) -> None:
        try:
            run_pack(load_config(packs["config"]), raced, RunOptions(inline=True, bar=False, streams=streams),
                     tokenizer=tokenizer_and_special)
        except BaseException as e:  # noqa: BLE001 (asserted below)
            errors.append(e)

    jobs = [threading.Thread(target=job, args=(half,)) for half in ([0, 1], [2, 3])]
    for t in jobs:
        t.start()
    for t in jobs:
        t.join(timeout=300)
    assert not errors and not any(t.is_alive() for t in jobs), errors
    assert os.path.exists(os.path.join(raced, MANIFEST_NAME))
    for s in range(W * K):
        assert _shards(raced, s) == _shards(packs["out"], s)


def test_extending_a_trimmed_balanced_pack_equals_packing_it_at_once(packs, tmp_path, tokenizer_and_special):
    """extend x bal-samples under batches_per_stream: the reference streams go on from their newest
    checkpoints (kept by the trim), the new steps are balanced, their reference shards trimmed; the
    pack is the one packed at the larger budget at once."""
    out = str(tmp_path / "out")
    shutil.copytree(packs["out"], out)
    more = _config(packs["ds"], "more.yaml", balance="samples", batches_per_stream=BATCHES + 2)
    assert run_pack(load_config(more), out, RunOptions(inline=True, bar=False),
                    tokenizer=tokenizer_and_special).manifest_written
    fresh = str(tmp_path / "fresh")
    run_pack(load_config(more), fresh, RunOptions(inline=True, bar=False), tokenizer=tokenizer_and_special)
    for s in range(W * K):
        assert [r.digest for sh in Pack.open(out).index(s).shards for r in sh.records] == \
            [r.digest for sh in Pack.open(fresh).index(s).shards for r in sh.records]
    ref = Pack.open(os.path.join(out, REFERENCE_DIR))
    assert all(ref.trimmed(s) == {sh.shard for sh in ref.index(s).shards} for s in range(W * K))
    assert verify_pack(out).ok


def test_read_at_another_world_size_it_says_the_balancing_is_lost(packs, caplog):
    """bal-samples x world-size change: every batch is still read once, and the loader says once, on
    rank 0, that the steps it balanced are not this world size's steps."""
    import logging

    with caplog.at_level(logging.WARNING, logger="loader.dataset"):
        one = [b for b in PackedShardDataset(packs["out"], rank=0, world_size=1)]
        both = [b for r in range(W) for b in PackedShardDataset(packs["out"], rank=r, world_size=W)]
    said = [r.getMessage() for r in caplog.records if "the balancing is lost" in r.getMessage()]
    assert len(said) == 1 and f"among {W} ranks; read by 1 ranks" in said[0]
    assert sorted(repr(b.batch_data_indexes) for b in one) == sorted(repr(b.batch_data_indexes) for b in both)


def test_a_follower_reads_the_balanced_streams_once_they_are_written(packs, tmp_path, tokenizer_and_special):
    """bal-samples x follow: the balanced streams are written once every reference stream is done; a
    follower started with the job waits for them, then reads what the finished pack holds."""
    from tests.helpers.packs import pack_in_background

    out = str(tmp_path / "out")
    job = pack_in_background(packs["config"], out, tokenizer_and_special)
    got = [repr(b.batch_data_indexes) for b in PackedShardDataset(out, rank=0, world_size=W, follow=True, poll_s=0.05,
                                                                  timeout_s=300)]
    job.join(timeout=300)
    assert got == [repr(b.batch_data_indexes) for b in PackedShardDataset(packs["out"], rank=0, world_size=W)]


def test_packed_ahead_of_two_trainings_it_is_the_unbounded_pack_trimmed_and_restored(packs, tmp_path, monkeypatch,
                                                                                     tokenizer_and_special):
    """bal-samples x bounded: two ranks follow the pack while it is packed --ahead 1.  The reference's
    streams wait on the trainings' positions in OUT and pack what their step class needs (else a
    training waits for a balanced shard that a neighbour's short shards never reach: a stall); each
    balanced shard is written as soon as its class's reference records are committed.  Every batch
    is read once, the pack is the unbounded balanced pack byte for byte, the reference was trimmed
    as it was balanced and OUT behind the trainings' kept checkpoints, and ``restore`` re-splits the
    trimmed balanced shards into the files they were."""
    from prepack.run import balance_beside
    from prepack.run.bounded import trainings as trainings_module
    from prepack.run.bounded.restore import restore
    from schemas.manifest import TrimmedShards
    from tests.helpers.trainings import Trainer, run_beside_trainings

    monkeypatch.setattr(trainings_module, "POLL_S", 0.05)
    monkeypatch.setattr(balance_beside, "TRIM_EVERY_S", 0.0)
    # shards of 1 to 3 records, ending at other records in each stream of a step class
    config = load_config(_config(packs["ds"], "ahead.yaml", balance="samples", shard_bytes=550_000,
                                 batches_per_stream=8))
    whole = str(tmp_path / "whole")
    run_pack(config, whole, RunOptions(inline=True, bar=False), tokenizer=tokenizer_and_special)
    ends = [{sh.first_record + len(sh.records) for sh in Pack.open(whole).index(s).shards} for s in range(W * K)]
    assert ends[0] != ends[K] or ends[1] != ends[K + 1], "the data no longer gives uneven shard ends"
    out, progress = str(tmp_path / "out"), str(tmp_path / "progress")
    per_shard = max(len(sh.records) for s in range(W * K) for sh in Pack.open(whole).index(s).shards)
    bound = BoundSpec(1, (progress,), keep=2)
    trainers = run_beside_trainings(
        lambda: run_pack(config, out, RunOptions(inline=True, bar=False, bound=bound), tokenizer=tokenizer_and_special),
        out, lambda: [Trainer(out, r, W, progress, every=1, pause_s=0.02, ahead=1, per_shard=2 * per_shard,
                              also=(os.path.join(out, REFERENCE_DIR),)) for r in range(W)], timeout=300)
    for r, t in enumerate(trainers):  # every batch once, in the unbounded pack's order
        assert [repr(b.batch_data_indexes) for b in t.seen] == \
            [repr(b.batch_data_indexes) for b in PackedShardDataset(whole, rank=r, world_size=W)]
    for s in range(W * K):
        assert _shards(out, s) == _shards(whole, s)
    ref = Pack.open(os.path.join(out, REFERENCE_DIR))
    assert all(ref.trimmed(s) == {sh.shard for sh in ref.index(s).shards} for s in range(W * K))
    pack = Pack.open(out)
    trimmed = {s: sorted(TrimmedShards.read(pack.location, s).shards) for s in range(W * K)}
    assert any(trimmed.values()), "no balanced shard lay behind the trainings' kept checkpoints"
    for s, shards in trimmed.items():  # only behind the earlier of the rank's two newest checkpoints
        states = trainers[s // K].states[-2:]
        kept = min(st["positions"][st["streams"].index(s)] for st in states) if len(states) == 2 else 0
        for k in shards:
            sh = pack.index(s).shards[k]
            assert sh.first_record + len(sh.records) <= kept and not os.path.exists(os.path.join(out, sh.file))
    assert verify_pack(out).ok  # the trimmed shards' steps checked by their lineage
    assert audit_pack(out, tokenizer=tokenizer_and_special).ok  # re-split from the trimmed reference
    restore(out, {s: (0, None) for s in range(W * K)}, tokenizer=tokenizer_and_special)
    for s in range(W * K):
        for sh in StreamIndex.read(resolve_location(out), s).shards:
            with open(os.path.join(out, sh.file), "rb") as a, open(os.path.join(whole, sh.file), "rb") as b:
                assert a.read() == b.read()
    assert verify_pack(out).ok


def test_a_balanced_budget_no_trim_can_make_room_in_stops_the_run_and_no_other(packs, tmp_path):
    """``BalancedBudget.check``: with nothing in flight, the run stops (DiskBudgetTooSmall, naming a
    budget that holds the point) only where in every step class what no trim can free and the least
    it holds back pass its share, for ``STUCK_ROUNDS`` rounds in a row.  What a trim could free: every
    balanced shard while the trainings can read on; only those behind where they stand once one
    waits at the end of a stream still being written (its checkpoints cannot pass that point)."""
    from prepack.run.bounded.ahead import PACK_FILES_RESERVE, SHARD_FILES_SLACK, shard_most
    from prepack.run.bounded.balanced_budget import STUCK_ROUNDS, BalancedBudget, stream_of
    from schemas.errors import DiskBudgetTooSmall

    # each file is counted to its stream, in either pack, whole or being written; the packs' own to none
    assert [stream_of(p) for p in ("stream-00003/shard-00001.arrow", "reference/stream-00002/ckpt-00004.arrow",
                                   "stream-00001/index.arrow.a1b2.tmp", "reference/lineage/stream-00002.parquet",
                                   "pack.json", "reference/manifest.json", ".prepack/leases/a1b2.json")] == \
        [3, 2, 1, 2, None, None, None]
    out = str(tmp_path / "out")
    shutil.copytree(packs["out"], out)
    cfg = load_config(packs["config"])
    reference, balanced = Pack.open(os.path.join(out, REFERENCE_DIR)), Pack.open(out)

    class Standing:  # trainings standing where the test says
        def __init__(self, at: dict[int, int]):
            self.at = at

        def refresh(self, force: bool = False) -> None:
            pass

        def reached(self, stream: int) -> int:
            return self.at.get(stream, 0)

    least = W * K * 3 * (shard_most(cfg) + SHARD_FILES_SLACK) + PACK_FILES_RESERVE  # the least accepted
    classes = [[w + r * K for r in range(W)] for w in range(K)]
    shards = {s: sum(sh.nbytes for sh in balanced.index(s).shards) for s in range(W * K)}
    budget = BalancedBudget(least, cfg, resolve_location(out), Standing({}))
    ledger = budget.measure(reference, balanced)
    assert sum(ledger.used.values()) > sum(shards.values())  # every stream's files, both packs', counted
    # per class: the room once every balanced shard of its streams is trimmed
    fits = {k: budget.share[k] - budget.margin[k] - (ledger.used[k] - sum(shards[s] for s in c))
            for k, c in enumerate(classes)}

    def rounds(n: int, need: dict[int, int]) -> None:
        for _ in range(n):
            ledger.blocked = dict(need)
            budget.check(reference, balanced, ledger)

    for s in (0, 1):  # streams 0 and 1 (one of each class) are still packed: no class is done
        ledger.records[s] += 1
    reference.done = lambda s, real=reference.done: None if s in (0, 1) else real(s)
    over = {k: f + 1 for k, f in fits.items()}
    rounds(STUCK_ROUNDS + 1, fits)  # the trainings read on: the trims to come make that room
    rounds(STUCK_ROUNDS + 1, {0: over[0]})  # class 1 is not held back: it goes on
    rounds(STUCK_ROUNDS + 1, {0: over[0], 1: fits[1]})  # class 1 fits once trimmed: the trainings go on
    rounds(STUCK_ROUNDS - 1, over)
    ledger.in_flight[1] = 1  # a granted shard still to commit: something may yet change
    rounds(1, over)
    ledger.in_flight[1] = 0
    rounds(STUCK_ROUNDS - 1, over)  # the count started again
    with pytest.raises(DiskBudgetTooSmall, match=f"A budget of at least {least + K:,} bytes holds this point"):
        rounds(1, over)
    # a training waits at the end of stream 0: every other stream's shards lie ahead of where it
    # stands (0), and cannot be trimmed any more, so class 1 is held back for good by much less
    budget = BalancedBudget(least, cfg, resolve_location(out), Standing({0: ledger.balanced[0]}))
    short = fits[1] - sum(shards[s] for s in classes[1])
    waiting = {0: fits[0] - shards[2], 1: short}  # class 0 keeps stream 2's shards now
    rounds(STUCK_ROUNDS + 1, waiting)
    rounds(STUCK_ROUNDS + 1, {0: waiting[0], 1: short + 1})  # class 0 goes on: the training may yet read on
    with pytest.raises(DiskBudgetTooSmall, match=r"streams \[1, 3\] \(a step class\) cannot hold"):
        rounds(STUCK_ROUNDS, {0: waiting[0] + 1, 1: short + (1 << 20)})  # named: the class furthest over


def test_a_balancing_that_fails_beside_a_bounded_run_stops_it(packs, tmp_path, monkeypatch, tokenizer_and_special):
    """The reference's streams wait on trainings that wait on the balancing: when the balancing
    fails, the run stops with its cause (``RunOptions.guard``) instead of waiting for good."""
    from prepack.run import balance_beside
    from prepack.run.bounded import trainings as trainings_module
    from schemas.errors import StreamFailed

    monkeypatch.setattr(trainings_module, "POLL_S", 0.05)

    def broken(*args, **kwargs):
        raise OSError("the disk went away")

    monkeypatch.setattr(balance_beside, "balance_class", broken)
    bound = BoundSpec(1, (str(tmp_path / "progress"),), keep=2)  # no training: the streams would wait for good
    with pytest.raises(StreamFailed, match="balancing OUT beside its reference failed: OSError: the disk went away"):
        run_pack(load_config(packs["config"]), str(tmp_path / "out"), RunOptions(inline=True, bar=False, bound=bound),
                 tokenizer=tokenizer_and_special)
