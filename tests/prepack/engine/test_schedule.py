"""A planned mix change within one pack (``prepack.schedule``) is what the real reference yields when
a ``PackedDataset`` of each step's config loads the ``state_dict`` of the one before at the step's
batch, and what a chain of continuations makes, record for record; it resumes, extends and audits
across a switch like any pack.

The pack is small and real (t2i + SFT + edit, W=1, K=2, several shards a stream); the schedule has
two steps, the second making a group mandatory and changing a knob, the first new weights and a
group added (edit, absent before): so every switch changes something the reference compares.
"""

from __future__ import annotations

import json
import os

import pytest
import yaml

from loader import open_stream
from loader.reader import Pack
from prepack.run.chain import Continue
from prepack.run.driver import RunOptions, run_pack
from prepack.tools.audit import audit_pack
from schemas.config_file import load_config
from tests.helpers import oracle
from tests.helpers.compare import diff_batches
from tests.helpers.packs import KNOBS, make_dataset

pytestmark = pytest.mark.slow  # the reference packs every compared batch

STEPS = (3, 6)  # batches of every stream at which the steps begin
TOTAL = 9


def write(root: str, name: str, raw: dict) -> str:
    path = os.path.join(root, f"{name}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(raw, f, sort_keys=False)
    return path


@pytest.fixture(scope="module")
def sched(tmp_path_factory, tokenizer_and_special):
    root = str(tmp_path_factory.mktemp("schedule"))
    ds = make_dataset(root, edit=True)
    full = yaml.safe_load(open(ds.config(knobs=KNOBS, num_workers=2,
                                         prepack={"batches_per_stream": TOTAL, "shard_bytes": 250_000})))
    base = json.loads(json.dumps(full))
    base["dataset"]["grouped_datasets"].pop("unified_edit")  # added by the first step
    edit = full["dataset"]["grouped_datasets"]["unified_edit"]
    sets = [
        {"dataset.grouped_datasets.t2i_pretrain.weight": 3.0, "dataset.grouped_datasets.unified_edit": edit,
         "dataset.text_cond_dropout_prob": 0.3},
        {"dataset.grouped_datasets.vlm_sft.is_mandatory": True, "dataset.max_buffer_size": 1},
    ]
    scheduled = json.loads(json.dumps(base))
    scheduled["prepack"]["schedule"] = [{"after": a, "set": s} for a, s in zip(STEPS, sets)]
    # the same configs written out whole: the steps as a chain of continuations, and for the reference
    step1 = json.loads(json.dumps(base))
    step1["dataset"]["grouped_datasets"]["t2i_pretrain"]["weight"] = 3.0
    step1["dataset"]["grouped_datasets"]["unified_edit"] = edit
    step1["dataset"]["text_cond_dropout_prob"] = 0.3
    step2 = json.loads(json.dumps(step1))
    step2["dataset"]["grouped_datasets"]["vlm_sft"]["is_mandatory"] = True
    step2["dataset"]["max_buffer_size"] = 1
    cfg = write(root, "scheduled", scheduled)
    out = os.path.join(root, "packed")
    run_pack(load_config(cfg), out, RunOptions(inline=True, bar=False), tokenizer=tokenizer_and_special)
    return {"root": root, "cfg": cfg, "out": out, "scheduled": scheduled,
            "steps": [write(root, "step0", base), write(root, "step1", step1), write(root, "step2", step2)]}


def test_a_schedule_packs_what_the_reference_yields_switching_at_each_step(sched, tokenizer_and_special):
    configs = [load_config(c) for c in sched["steps"]]
    for s in (0, 1):
        ours = [b.to_dict() for b in open_stream(sched["out"], s)]
        assert len(ours) == TOTAL
        ref = oracle.reference_chain(configs, list(STEPS), s, tokenizer_and_special[0], TOTAL)
        for i, (a, b) in enumerate(zip(ours, ref)):
            diffs = diff_batches(a, b)
            assert not diffs, f"stream {s} batch {i}: " + "; ".join(diffs[:5])
    # every switch changed something: the same stream packed without the schedule differs after it
    plain = os.path.join(sched["root"], "plain")
    run_pack(load_config(sched["steps"][0]), plain, RunOptions(inline=True, bar=False), tokenizer=tokenizer_and_special)
    for s in (0, 1):
        a = [repr(b.batch_data_indexes) for b in open_stream(plain, s)]
        b = [repr(b.batch_data_indexes) for b in open_stream(sched["out"], s)]
        assert a[:STEPS[0]] == b[:STEPS[0]]
    assert any(repr(x.batch_data_indexes) != repr(y.batch_data_indexes)
               for s in (0, 1) for x, y in zip(list(open_stream(plain, s))[STEPS[0]:],
                                               list(open_stream(sched["out"], s))[STEPS[0]:]))
    before = {d["dataset_name"] for s in (0, 1) for b in list(open_stream(sched["out"], s))[:STEPS[0]]
              for d in b.batch_data_indexes}
    after = {d["dataset_name"] for s in (0, 1) for b in list(open_stream(sched["out"], s))[STEPS[0]:]
             for d in b.batch_data_indexes}
    assert "unified_edit" not in before and "unified_edit" in after  # the group the first step adds packs from then on


def test_a_schedule_is_the_chain_of_its_steps_record_for_record(sched, tokenizer_and_special):
    """``prepack run step0 (N1 batches)``, then each step ``--continue`` the one before ``--after`` its
    batch: the same records as the scheduled pack, each stream's digests equal."""
    root, tok = sched["root"], tokenizer_and_special
    bounds = list(STEPS) + [TOTAL]
    prev, done = None, 0
    for i, path in enumerate(sched["steps"]):
        raw = yaml.safe_load(open(path))
        raw["prepack"]["batches_per_stream"] = bounds[i] - done
        out = os.path.join(root, f"chain{i}")
        run_pack(load_config(write(root, f"chain{i}", raw)), out, RunOptions(inline=True, bar=False, continue_from=None if prev is None else Continue(prev, done)), tokenizer=tok)
        prev, done = out, bounds[i]
    ours, chain = Pack.open(sched["out"]), Pack.open(prev)
    for s in (0, 1):
        assert [ours.record_digest(s, r) for r in range(TOTAL)] == [chain.record_digest(s, r) for r in range(TOTAL)]


def test_a_schedule_resumes_extends_and_audits_across_a_switch(sched, tokenizer_and_special):
    """Packed to exactly the first switch (its last checkpoint is the state there), then extended: the
    extension starts the step from that checkpoint and gives the same records; audit re-packs every
    shard from its checkpoint and every stream from its seed."""
    tok, root = tokenizer_and_special, sched["root"]
    raw = json.loads(json.dumps(sched["scheduled"]))
    out = os.path.join(root, "extended")
    for budget in (STEPS[0] + 1, STEPS[1], TOTAL):  # ends one past a switch, then exactly at one, then the rest
        raw["prepack"]["batches_per_stream"] = budget
        run_pack(load_config(write(root, f"budget{budget}", raw)), out, RunOptions(inline=True, bar=False), tokenizer=tok)
    once, extended = Pack.open(sched["out"]), Pack.open(out)
    for s in (0, 1):
        assert [extended.record_digest(s, r) for r in range(TOTAL)] == [once.record_digest(s, r) for r in range(TOTAL)]
    for how in ({}, {"all_streams": True}):  # every shard from its checkpoint; every stream from its seed
        report = audit_pack(sched["out"], tokenizer=tok, **how)
        assert report.ok, report.lines()


def test_a_continuation_of_a_scheduled_pack_takes_the_state_of_the_step_there(sched, tokenizer_and_special):
    """``--continue`` a scheduled pack past its first switch: the state there was made under step 1,
    so a config equal to step 1 with new weights matches groups against step 1 (edit included)."""
    tok, root = tokenizer_and_special, sched["root"]
    raw = yaml.safe_load(open(sched["steps"][1]))
    raw["dataset"]["grouped_datasets"]["vlm_sft"]["weight"] = 4.0
    raw["prepack"]["batches_per_stream"] = 2
    new = os.path.join(root, "continued")
    after = STEPS[0] + 1
    run_pack(load_config(write(root, "continued", raw)), new, RunOptions(inline=True, bar=False, continue_from=Continue(sched["out"], after)), tokenizer=tok)
    configs = [load_config(c) for c in sched["steps"][:2]] + [load_config(os.path.join(root, "continued.yaml"))]
    for s in (0, 1):
        ours = [b.to_dict() for b in open_stream(new, s)]
        ref = oracle.reference_chain(configs, [STEPS[0], after], s, tok[0], after + 2)
        assert len(ours) == len(ref) == after + 2
        for i, (a, b) in enumerate(zip(ours, ref)):
            assert not diff_batches(a, b), (s, i)


def test_stats_shows_each_steps_mix_counted_over_the_records_it_packed(sched):
    import polars as pl

    from prepack.tools.stats import compute_stats, format_stats

    st = compute_stats(sched["out"])
    per_step = st.steps.group_by("step", "records").agg(pl.col("samples").sum()).sort("step")
    bounds = [0, *STEPS, TOTAL]
    assert per_step["records"].to_list() == [2 * (b - a) for a, b in zip(bounds, bounds[1:])]
    want = [0, 0, 0]
    for s in (0, 1):
        for r, b in enumerate(open_stream(sched["out"], s)):
            want[sum(r >= a for a in STEPS)] += len(b.batch_data_indexes)
    assert per_step["samples"].to_list() == want
    t2i = st.steps.filter(pl.col("group") == "t2i_pretrain").sort("step")["weight"].to_list()
    assert t2i == [1.0, 3.0, 3.0]
    edit = st.steps.filter(pl.col("group") == "unified_edit").sort("step")
    assert edit["step"].to_list() == [1, 2] and sum(edit["samples"].to_list()) > 0  # the group step 1 adds
    assert "each step's mix" in format_stats(st)


def test_plan_plans_each_step_over_its_batches_and_adds_them_up(sched, tokenizer_and_special):
    from prepack.tools.plan import PlanOptions
    from prepack.tools.plan_schedule import plan_schedule

    plan = plan_schedule(load_config(sched["cfg"]), PlanOptions(max_seconds=30), tokenizer=tokenizer_and_special)
    assert [(a, b) for a, b, _ in plan.steps] == [(0, STEPS[0]), (STEPS[0], STEPS[1]), (STEPS[1], TOTAL)]
    assert [p.records for _, _, p in plan.steps] == [2 * STEPS[0], 2 * (STEPS[1] - STEPS[0]), 2 * (TOTAL - STEPS[1])]
    assert plan.totals()["records"] == 2 * TOTAL
    assert plan.totals()["output_bytes"] == sum(p.output_bytes for _, _, p in plan.steps)
    shares = [{g.name for g in p.groups} for _, _, p in plan.steps]
    assert "unified_edit" not in shares[0] and "unified_edit" in shares[1]  # each step planned under its own config
    text = "\n".join(plan.lines())
    assert "step 2 (batches 6-8 of every stream" in text and "whole schedule: 18 records" in text
    assert plan.to_json()["records"] == 2 * TOTAL
    # a budget that ends before the last step: planned up to the budget, the step named as not reached
    import dataclasses

    cfg = load_config(sched["cfg"])
    short = dataclasses.replace(cfg, prepack=dataclasses.replace(cfg.prepack, batches_per_stream=5))
    plan = plan_schedule(short, PlanOptions(max_seconds=30), tokenizer=tokenizer_and_special)
    assert [(a, b) for a, b, _ in plan.steps] == [(0, 3), (3, 5)] and plan.unreached == [6]
    assert plan.totals()["records"] == 2 * 5 and "step 2 (from batch 6): not reached" in "\n".join(plan.lines())


def test_done_json_counts_the_whole_stream_across_its_steps(sched, tokenizer_and_special, monkeypatch):
    """Without a pixel provider (no reuse at all) each step's packer has a picture store of its own:
    the stream's reuse counts still cover every step's images, and its accounting every step's samples."""
    from loader.reader import iter_records
    from schemas.manifest import StreamSummary

    monkeypatch.setenv("PREPACK_REUSE_OWN", "0")
    out = os.path.join(sched["root"], "no-reuse")
    run_pack(load_config(sched["cfg"]), out, RunOptions(inline=True, bar=False), tokenizer=tokenizer_and_special)
    pack = Pack.open(out)
    for s in (0, 1):
        done = StreamSummary.read(pack.location, s)
        images = sum(len(rec.column("image_heights")[0]) for _, rec in iter_records(pack, s))
        assert done.reuse["images"] >= images > 0
        assert sum(done.group_samples.values()) == sum(len(b.batch_data_indexes) for b in open_stream(out, s))


def test_a_continuation_may_itself_have_a_schedule_counted_in_its_own_batches(sched, tokenizer_and_special):
    """``prepack run B.yaml --continue P --after 4`` where B has a step after 2 of its own batches: the
    reference switches at 3 (P's step), 4 (the continuation) and 6 (B's step)."""
    tok, root = tokenizer_and_special, sched["root"]
    raw = yaml.safe_load(open(sched["steps"][1]))
    raw["dataset"]["grouped_datasets"]["vlm_sft"]["weight"] = 4.0
    raw["prepack"]["batches_per_stream"] = 4
    b0 = write(root, "own-step0", raw)
    stepped = json.loads(json.dumps(raw))
    stepped["dataset"]["grouped_datasets"]["t2i_pretrain"]["weight"] = 0.2
    b1 = write(root, "own-step1", stepped)
    raw["prepack"]["schedule"] = [{"after": 2, "set": {"dataset.grouped_datasets.t2i_pretrain.weight": 0.2}}]
    new = os.path.join(root, "own-schedule")
    run_pack(load_config(write(root, "own-schedule", raw)), new, RunOptions(inline=True, bar=False, continue_from=Continue(sched["out"], 4)), tokenizer=tok)
    configs = [load_config(c) for c in (sched["steps"][0], sched["steps"][1], b0, b1)]
    changed = False
    for s in (0, 1):
        ours = [b.to_dict() for b in open_stream(new, s)]
        ref = oracle.reference_chain(configs, [STEPS[0], 4, 6], s, tok[0], 8)
        assert len(ours) == len(ref) == 8
        for i, (a, b) in enumerate(zip(ours, ref)):
            assert not diff_batches(a, b), (s, i)
        # B's own step changed something: without it the reference's last batches differ
        unstepped = oracle.reference_chain(configs[:3], [STEPS[0], 4], s, tok[0], 8)
        changed |= any(diff_batches(a, b) for a, b in zip(unstepped[6:], ref[6:]))
    assert changed


def test_a_scheduled_pack_is_trimmed_and_restored_across_its_switches(sched, tokenizer_and_special, tmp_path):
    """schedule x bounded: trimmed whole (checkpoints off the ladder dropped), each shard is packed
    again from the nearest checkpoint kept, under the step that packed it, byte for byte; a shard
    after a switch is audited from an earlier step's checkpoint."""
    import shutil

    from prepack.run.bounded.restore import restore
    from prepack.run.bounded.trim_policy import TrimPolicy
    from prepack.tools.verify import verify_pack
    from schemas.manifest import TrimmedShards

    out = str(tmp_path / "packed")
    shutil.copytree(sched["out"], out)
    TrimPolicy(Pack.open(out), lambda s: 1 << 62).apply()
    p = Pack.open(out)
    late = [(s, k) for s in (0, 1) for k in TrimmedShards.read(p.location, s).checkpoints
            if p.index(s).shards[k].first_record >= STEPS[0]]
    assert late, "a shard after the first switch must have lost its checkpoint"
    s, k = late[-1]
    assert audit_pack(out, stream=s, shard=k, tokenizer=tokenizer_and_special).ok
    restore(out, {s: (0, None) for s in (0, 1)}, tokenizer=tokenizer_and_special)
    for s in (0, 1):
        for sh in p.index(s).shards:
            assert open(os.path.join(out, sh.file), "rb").read() == open(os.path.join(sched["out"], sh.file), "rb").read()
    assert verify_pack(out).ok


def test_a_scheduled_pack_is_followed_balanced_and_resumed_at_another_world_size(sched, tokenizer_and_special,
                                                                                  tmp_path):
    """schedule x follow: a follower reading the pack while it is packed reads what the finished pack
    holds; schedule x balanced batches: every step holds the reference's batches; schedule x world-size
    change: two ranks' states merged resume on one rank with the rest."""
    from loader import PackedShardDataset
    from loader.balance import Balance
    from tests.helpers.packs import pack_in_background

    def key(b) -> str:
        return json.dumps(b.batch_data_indexes, sort_keys=True) + str(b.sequence_length)

    out = str(tmp_path / "packed")
    packer = pack_in_background(sched["cfg"], out, tokenizer_and_special)
    followed = [key(b) for b in PackedShardDataset(out, rank=0, world_size=1, follow=True, poll_s=0.05, timeout_s=300)]
    packer.join(timeout=300)
    whole = [key(b) for b in PackedShardDataset(sched["out"], rank=0, world_size=1)]
    assert followed == whole and len(whole) == 2 * TOTAL
    # balanced steps of M=2 over 2 ranks: each step's batches are the reference's
    m = 2
    ref = [[key(b) for b in PackedShardDataset(sched["out"], rank=r, world_size=2)] for r in range(2)]
    bal = [[key(b) for b in PackedShardDataset(sched["out"], rank=r, world_size=2, balance=Balance(micro_batches=m))]
           for r in range(2)]
    steps = min(len(x) for x in ref) // m
    for t in range(steps):
        assert sorted(x for r in range(2) for x in bal[r][t * m:(t + 1) * m]) == \
            sorted(x for r in range(2) for x in ref[r][t * m:(t + 1) * m])
    assert sorted(sum(bal, [])) == sorted(sum(ref, []))
    # two ranks' states merged, resumed by one rank
    states = []
    for r in range(2):
        ds = PackedShardDataset(sched["out"], rank=r, world_size=2)
        it = iter(ds)
        for _ in range(STEPS[0] + 1):  # past the first switch
            next(it)
        states.append(ds.state_dict())
    one = PackedShardDataset(sched["out"], rank=0, world_size=1)
    one.load_state_dict(PackedShardDataset.merge_states(states))
    rest = [key(b) for b in one]
    assert sorted(rest) == sorted(set(whole) - {x for r in range(2) for x in ref[r][:STEPS[0] + 1]})
