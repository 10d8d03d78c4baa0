"""``prepack plan``: a sample of a config's streams projects the run, and the projection holds.

A real small pack (2 streams, several shards each) is packed after planning it from a smaller
sample (one stream, two batches): the projected records are exact for a batch budget, the
projected bytes — shards, checkpoints, lineage — within 30% of the bytes on disk, the shards per
stream within one.  Knobs that look wrong are named; nothing is written anywhere by planning.
A small pack is sampled less (never much more than a quarter of its batches), the tokenizer plan
samples with is the run's, and planning imports neither Ray nor transformers.
"""

from __future__ import annotations

import os
import re

import pytest

from loader.reader import Pack, iter_records
from prepack.tools.composition import BATCH_QUANTITIES, SAMPLE_QUANTITIES
from prepack.tools.plan import PlanOptions, batch_allotment, estimate_settled, plan_pack, sample_streams
from schemas.config_file import load_config
from schemas.record import record_to_batch
from tests.helpers.packs import pack_in_process, small_dataset
from tests.helpers.tokens import check_summary, expected_values


def _bytes_under(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, names in os.walk(root) for f in names)


@pytest.mark.slow  # packs for real to compare
def test_projection_is_within_30_percent_of_a_real_pack(tmp_path, tokenizer_and_special):
    config = small_dataset(str(tmp_path), batches=8, shard_bytes=300_000)
    before = sorted(os.listdir(tmp_path))
    plan = plan_pack(load_config(config), PlanOptions(cores=2, sample_batches=2, sample_streams_n=1), tokenizer=tokenizer_and_special)
    assert sorted(os.listdir(tmp_path)) == before, "planning wrote something"
    assert plan.sample["batches"] == 2 and plan.sample["streams"] == [0]
    out = pack_in_process(config, str(tmp_path / "out"), tokenizer_and_special)
    real = _bytes_under(out)
    assert plan.records == 16
    assert 0.7 <= plan.output_bytes / real <= 1.3, f"projected {plan.output_bytes:,} bytes, packed {real:,}"
    shards = [len([n for n in os.listdir(os.path.join(out, d)) if re.fullmatch(r"shard-\d+\.arrow", n)])
              for d in os.listdir(out) if d.startswith("stream-")]
    assert all(abs(plan.shards_per_stream - s) <= 1 for s in shards), (plan.shards_per_stream, shards)
    tokens = sum(r.num_tokens for s in range(2) for sh in Pack.open(out).index(s).shards for r in sh.records)
    assert 0.7 <= plan.tokens / tokens <= 1.3, (plan.tokens, tokens)
    assert abs(sum(g.token_share for g in plan.groups) - 1) < 1e-6
    assert plan.cpu_core_hours > 0 and plan.wall_hours > 0

    # what the sampled batches hold: stream 0's first two records, counted from the records
    records = [record_to_batch(r) for _, (_, r) in zip(range(2), iter_records(Pack.open(out), 0))]
    want_batch, want_group = expected_values(records)
    got = plan.to_json()["composition"]
    assert list(got["per_batch"]) == list(BATCH_QUANTITIES)
    for q in BATCH_QUANTITIES:
        check_summary(got["per_batch"][q], want_batch[q], q)
    assert sorted(got["per_group"]) == sorted(want_group)
    for g, values in want_group.items():
        assert list(got["per_group"][g]) == list(SAMPLE_QUANTITIES)
        for q in SAMPLE_QUANTITIES:
            check_summary(got["per_group"][g][q], values[q], f"{g}/{q}")
    text = "\n".join(plan.lines())
    assert "token composition per batch (2 batches" in text and "token composition per sample, by group" in text


def test_knobs_that_look_wrong_are_named(tmp_path, tokenizer_and_special):
    config = small_dataset(str(tmp_path), batches=400, shard_bytes=1000)
    plan = plan_pack(load_config(config), PlanOptions(cores=64, sample_batches=2, sample_streams_n=1), tokenizer=tokenizer_and_special)
    text = "\n".join(plan.warnings)
    assert "smaller than one record" in text
    assert "runs it past its data" in text  # 400 batches over a dozen rows
    assert "cores stay idle" in text  # 2 streams on 64 cores
    assert plan.records == 800 and plan.shards_per_stream == 400
    quiet = plan_pack(load_config(small_dataset(str(tmp_path / "b"), batches=1, shard_bytes=300_000)), PlanOptions(cores=2, sample_batches=1, sample_streams_n=1), tokenizer=tokenizer_and_special)
    assert not [w for w in quiet.warnings if "past its data" in w or "shard" in w], quiet.warnings


def test_a_token_budget_is_converted_at_the_sampled_rate(tmp_path, tokenizer_and_special):
    cfg = load_config(small_dataset(str(tmp_path), batches=1))
    from dataclasses import replace

    per_batch = plan_pack(cfg, PlanOptions(sample_batches=3, sample_streams_n=1), tokenizer=tokenizer_and_special)
    tokens_per_batch = per_batch.tokens / per_batch.records
    cfg = replace(cfg, prepack=replace(cfg.prepack, batches_per_stream=None, tokens_per_stream=int(50 * tokens_per_batch)))
    plan = plan_pack(cfg, PlanOptions(sample_batches=3, sample_streams_n=1), tokenizer=tokenizer_and_special)
    assert 45 <= plan.batches_per_stream <= 55, plan.batches_per_stream
    assert plan.budget == {"tokens_per_stream": int(50 * tokens_per_batch)}


def test_sampled_streams_are_spread_and_include_both_ends():
    assert sample_streams(1, 3) == [0]
    assert sample_streams(8, 1) == [0]
    assert sample_streams(8, 2) == [0, 7]
    assert sample_streams(9, 3) == [0, 4, 8]
    assert sample_streams(2, 5) == [0, 1]


def test_a_small_pack_is_sampled_a_fraction_of_its_batches():
    # the demo's shape: 2 streams x 6 batches, at most a quarter (3): 2 of the first stream, 1 of the last
    assert batch_allotment(2, 4, 6, 2) == [(2, 2), (1, 1)]
    assert batch_allotment(2, 4, 8, 2) == [(2, 3), (1, 1)]  # 16 batches: 4
    assert batch_allotment(2, 4, 20000, 64) == [(2, 4), (1, 4)]  # a real pack: the full sample
    assert batch_allotment(2, 4, None, 2) == [(2, 4), (1, 4)]  # tokens / passes: no batch count to cap
    assert batch_allotment(2, 4, 1, 2) == [(1, 1), (1, 1)]  # never more than the budget, at least one each
    assert batch_allotment(3, 1, 100, 8) == [(1, 1), (1, 1), (1, 1)]
    for streams, per, budget, n in ((2, 4, 6, 2), (2, 8, 10, 2), (4, 4, 5, 3), (2, 16, 40, 2)):
        allot = batch_allotment(n, per, budget, streams)
        assert sum(most for _, most in allot) <= max(n + 1, budget * streams // 4), allot
        assert all(1 <= least <= most <= min(per, budget) for least, most in allot), allot


def test_sampling_stops_once_the_bytes_estimate_settles():
    assert not estimate_settled([100])
    assert estimate_settled([100, 104])  # the mean moves 2%
    assert not estimate_settled([100, 200])  # 33%
    assert estimate_settled([100, 200, 150, 160])
    assert not estimate_settled([100, 100, 100, 300], tolerance=0.1)


@pytest.mark.slow  # packs for real to compare
def test_a_small_pack_is_planned_from_a_quarter_of_it(tmp_path, tokenizer_and_special):
    config = small_dataset(str(tmp_path), batches=6)  # 12 batches: 3 are sampled, the projection holds
    plan = plan_pack(load_config(config), PlanOptions(cores=2), tokenizer=tokenizer_and_special)
    assert plan.sample["batches"] == 3 and plan.sample["streams"] == [0, 1], plan.sample
    out = pack_in_process(config, str(tmp_path / "out"), tokenizer_and_special)
    assert plan.records == 12
    assert 0.7 <= plan.output_bytes / _bytes_under(out) <= 1.3, (plan.output_bytes, _bytes_under(out))
    assert plan.cpu_core_hours > 0


def _texts() -> list[str]:
    import random

    from prepack.engine.tokenizer import BAGEL_TOKENS, QWEN2_ADDED_TOKENS

    pool = (list("abcXYZ019 .,;:!?'\"\n\t\r-_/()[]{}") + ["  ", "\n\n", "你好", "世界", "😀", "é", "e\u0301", "ﬁ", "’s",
            "'ll", "123456", "\u00a0", "\u200b", "<|", "|>"] + list(BAGEL_TOKENS) + [t for t, _ in QWEN2_ADDED_TOKENS])
    rng = random.Random(0)
    texts = ["", "Hello, world! It's 2025: 你好，世界 😀\n\n  tabs\tand   spaces\r\n",
             "<|im_start|>user\nDescribe <|vision_start|><|image_pad|><|vision_end|> please.<|im_end|>",
             "A photo of a cat sitting on a mat, 4k, highly detailed."]
    texts += ["".join(rng.choice(pool) for _ in range(rng.randint(1, 60))) for _ in range(400)]
    return texts


def test_plan_samples_with_the_run_s_tokenizer(tokenizer_and_special):
    """qwen2-offline is read without transformers for planning: the backend, the ids and every
    encoding are those of the tokenizer ``prepack run`` packs with."""
    import json

    from prepack.tools.plan_tokenizer import load_plan_tokenizer

    full, special = tokenizer_and_special
    lite, lite_special = load_plan_tokenizer("qwen2-offline")
    assert lite_special == special
    assert json.loads(lite.backend.to_str()) == json.loads(full.backend_tokenizer.to_str())
    for text in _texts():
        assert lite.encode(text) == full.encode(text), text


def test_planning_imports_neither_ray_nor_transformers(tmp_path):
    import subprocess
    import sys

    config = small_dataset(str(tmp_path), batches=2)
    code = ("import sys; from prepack.tools.plan import PlanOptions, plan_pack; from schemas.config_file import load_config; "
            f"plan = plan_pack(load_config({config!r}), PlanOptions(cores=2)); assert plan.records == 4; "
            "print(sorted(m for m in ('ray', 'transformers') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout


def test_the_packer_drop_rate_counts_lost_samples_not_refused_batches():
    from prepack.tools.plan import lost_samples

    drops = {"batch_refused_over_max_num_tokens": 3, "samples_in_refused_batches": 7, "overlength_sample": 2,
             "left_in_buffer_at_end_of_budget": 5, "t2i:t2i_image_parse": 1, "edit:parquet_row_parse": 4,
             "t2i:jsonl_parse": 2, "reason_of_a_later_version": 1}
    by_group, packer = lost_samples(drops)
    assert by_group == {"t2i": 3, "edit": 4}
    assert packer == 7 + 2 + 1  # samples of refused batches, overlength, an undeclared reason: not batches or buffer


def test_a_bounded_plan_reports_the_disk_high_water_mark(tmp_path, tokenizer_and_special, capsys):
    """``plan --ahead N``: a bounded run holds a window of records per stream (N ahead of the reader, K
    checkpoints of C steps behind it, a shard at each end), never more than the whole pack."""
    from prepack.cli import main

    config = small_dataset(str(tmp_path), batches=400, shard_bytes=1000)  # a record per shard
    cfg = load_config(config)
    bound = {"ahead": 10, "keep_checkpoints": 2, "checkpoint_every": 6}
    plan = plan_pack(cfg, PlanOptions(sample_batches=2, sample_streams_n=1, bounded=bound), tokenizer=tokenizer_and_special)
    b = plan.bounded
    assert {k: b[k] for k in bound} == bound
    shards, ckpt = plan.shards_per_stream, b["checkpoint_bytes"]
    # indexes, sources, lineage: never trimmed
    kept_bytes = plan.output_bytes - (plan.record_bytes * plan.records + (shards + 1) * ckpt * plan.streams)
    # 10 ahead, 2 checkpoints 6 steps apart over K=2 workers (3 records of a stream each), 2 shards of 1
    want = 10 + 2 * 3 + 2
    # their checkpoints, and the ladder behind them: about two per doubling of the distance
    ladder = (want + 2 * shards.bit_length() + 2) * ckpt
    held = (b["peak_bytes"] - kept_bytes - ladder * plan.streams) / plan.record_bytes / plan.streams
    assert ckpt > 0 and round(held) == want, held
    assert kept_bytes < b["peak_bytes"] < plan.output_bytes / 2
    assert any(line.startswith("  bounded       disk peak") for line in plan.lines())
    more = plan_pack(cfg, PlanOptions(sample_batches=2, sample_streams_n=1, bounded=dict(bound, ahead=10_000)), tokenizer=tokenizer_and_special)
    assert more.bounded["peak_bytes"] == more.output_bytes  # a window past the budget: the whole pack
    for argv, why in ((["--ahead", "0"], "--ahead takes"), (["--ahead", "5", "--keep-checkpoints", "0"],
                      "--keep-checkpoints takes"), (["--ahead", "5", "--checkpoint-every", "0"], "--checkpoint-every")):
        assert main(["plan", config, *argv]) == 2
        assert why in capsys.readouterr().err
