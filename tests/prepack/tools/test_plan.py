"""``prepack plan``: a sample of a config's streams projects the run, and the projection holds.

A real small pack (2 streams, several shards each) is packed after planning it from a smaller
sample (one stream, two batches): the projected records are exact for a batch budget, the
projected bytes — shards, checkpoints, lineage — within 30% of the bytes on disk, the shards per
stream within one.  Knobs that look wrong are named; nothing is written anywhere by planning.
"""

from __future__ import annotations

import os

from prepack.tools.plan import plan_pack, sample_streams
from schemas.config import load_config
from tests.helpers.packs import pack_in_process, small_dataset


def _bytes_under(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, names in os.walk(root) for f in names)


def test_projection_is_within_30_percent_of_a_real_pack(tmp_path, tokenizer_and_special):
    config = small_dataset(str(tmp_path), batches=8, shard_bytes=300_000)
    before = sorted(os.listdir(tmp_path))
    plan = plan_pack(load_config(config), cores=2, sample_batches=2, sample_streams_n=1, tokenizer=tokenizer_and_special)
    assert sorted(os.listdir(tmp_path)) == before, "planning wrote something"
    assert plan.sample["batches"] == 2 and plan.sample["streams"] == [0]
    out = pack_in_process(config, str(tmp_path / "out"), tokenizer_and_special)
    real = _bytes_under(out)
    assert plan.records == 16
    assert 0.7 <= plan.output_bytes / real <= 1.3, f"projected {plan.output_bytes:,} bytes, packed {real:,}"
    shards = [len([n for n in os.listdir(os.path.join(out, d)) if n.startswith("shard-") and n.endswith(".arrow")])
              for d in os.listdir(out) if d.startswith("stream-")]
    assert all(abs(plan.shards_per_stream - s) <= 1 for s in shards), (plan.shards_per_stream, shards)
    from loader.reader import Pack

    tokens = sum(r.num_tokens for s in range(2) for sh in Pack.open(out).index(s).shards for r in sh.records)
    assert 0.7 <= plan.tokens / tokens <= 1.3, (plan.tokens, tokens)
    assert abs(sum(g.token_share for g in plan.groups) - 1) < 1e-6
    assert plan.cpu_core_hours > 0 and plan.wall_hours > 0


def test_knobs_that_look_wrong_are_named(tmp_path, tokenizer_and_special):
    config = small_dataset(str(tmp_path), batches=400, shard_bytes=1000)
    plan = plan_pack(load_config(config), cores=64, sample_batches=2, sample_streams_n=1, tokenizer=tokenizer_and_special)
    text = "\n".join(plan.warnings)
    assert "smaller than one record" in text
    assert "runs it past its data" in text  # 400 batches over a dozen rows
    assert "cores stay idle" in text  # 2 streams on 64 cores
    assert plan.records == 800 and plan.shards_per_stream == 400
    quiet = plan_pack(load_config(small_dataset(str(tmp_path / "b"), batches=1, shard_bytes=300_000)), cores=2,
                      sample_batches=1, sample_streams_n=1, tokenizer=tokenizer_and_special)
    assert not [w for w in quiet.warnings if "past its data" in w or "shard" in w], quiet.warnings


def test_a_token_budget_is_converted_at_the_sampled_rate(tmp_path, tokenizer_and_special):
    cfg = load_config(small_dataset(str(tmp_path), batches=1))
    from dataclasses import replace

    per_batch = plan_pack(cfg, sample_batches=3, sample_streams_n=1, tokenizer=tokenizer_and_special)
    tokens_per_batch = per_batch.tokens / per_batch.records
    cfg = replace(cfg, prepack=replace(cfg.prepack, batches_per_stream=None, tokens_per_stream=int(50 * tokens_per_batch)))
    plan = plan_pack(cfg, sample_batches=3, sample_streams_n=1, tokenizer=tokenizer_and_special)
    assert 45 <= plan.batches_per_stream <= 55, plan.batches_per_stream
    assert plan.budget == {"tokens_per_stream": int(50 * tokens_per_batch)}


def test_sampled_streams_are_spread_and_include_both_ends():
    assert sample_streams(1, 3) == [0]
    assert sample_streams(8, 1) == [0]
    assert sample_streams(8, 2) == [0, 7]
    assert sample_streams(9, 3) == [0, 4, 8]
    assert sample_streams(2, 5) == [0, 1]
