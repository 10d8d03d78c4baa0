"""Token composition: the fixed-memory distribution, and per-batch / per-group counts of a pack whose
counts are known from its records (large batches, flex and dense-mask, several groups)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from prepack.tools import composition as comp
from prepack.tools.composition import BATCH_QUANTITIES, LABELS, SAMPLE_QUANTITIES, Composition, packed_batch_counts
from prepack.tools.sketch import EXACT_BITS, Distribution, bucket_floor
from prepack.tools.stats import compute_stats, format_stats, render_html
from prepack.run.commit.atomic_files import write_bytes_atomic
from schemas.documents import dump_checked
from schemas.layout import PACK_INFO_NAME
from schemas.location import resolve_location
from tests.helpers.fakepack import BatchSpec, make_batch, write_pack
from tests.helpers.tokens import check_summary, close, expected_values, nearest_rank


# -- the distribution -----------------------------------------------------------------------------
def test_small_values_are_exact_and_large_ones_within_a_thousandth():
    rng = np.random.default_rng(0)
    small = rng.integers(0, 1 << EXACT_BITS, 5000)
    d = Distribution()
    d.add(small)
    for q in (0.0, 0.01, 0.5, 0.9, 0.99, 1.0):
        assert d.quantile(q) == nearest_rank(small.tolist(), q), q
    for high in (1 << 12, 40_000, 1 << 40):
        big = rng.integers(0, high, 20_000)
        d = Distribution()
        d.add(big)
        for q in (0.1, 0.5, 0.9, 0.999):
            want = nearest_rank(big.tolist(), q)
            assert close(d.quantile(q), want), (high, q, d.quantile(q), want)
        assert (d.min, d.max, d.total, d.count) == (int(big.min()), int(big.max()), int(big.sum()), big.size)


def test_bucket_edges_at_powers_of_two():
    v = np.array([0, 2047, 2048, 2049, 4095, 4096, (1 << 21) - 1, 1 << 21, (1 << 52) + 12345], np.int64)
    edges = bucket_floor(v)
    assert edges.tolist()[:6] == [0, 2047, 2048, 2048, 4094, 4096]
    assert all(e <= x and (x - e) <= x >> (EXACT_BITS - 1) for e, x in zip(edges.tolist(), v.tolist()))
    with pytest.raises(ValueError):
        bucket_floor(np.array([-1]))


def test_merged_distributions_equal_one_and_memory_is_bounded():
    rng = np.random.default_rng(1)
    values = rng.integers(0, 1 << 21, 1_000_000)
    whole, parts = Distribution(), Distribution()
    whole.add(values)
    for chunk in np.array_split(values, 7):
        d = Distribution()
        d.add(chunk)
        parts.merge(d)
    assert parts.summary() == whole.summary() and parts.buckets == whole.buckets
    # 2,048 exact values, then 1,024 buckets for each power of two up to 2^21: fixed, whatever the count
    assert len(whole.buckets) <= (1 << EXACT_BITS) + 10 * (1 << (EXACT_BITS - 1))
    empty = Distribution().summary()
    assert empty["count"] == 0 and empty["p50"] is None and empty["min"] is None


def test_buffered_values_never_exceed_the_flush_size(monkeypatch):
    monkeypatch.setattr(comp, "FLUSH_VALUES", 100)
    c = Composition()
    counts = packed_batch_counts(make_batch(3))
    for _ in range(250):
        c.add(counts)
        assert c._buffered < 100
    assert c.num_batches == 250
    assert c.to_json()["per_batch"]["text"]["total"] == 250 * counts.batch["text"]


# -- a pack with known counts ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def known(tmp_path_factory):
    """2 streams x 9 batches with images of up to 40 patches a side (batches over 2,048 tokens),
    flex and dense-mask batches alternating, three groups."""
    batches = {s: [make_batch(1000 * s + i, BatchSpec(use_flex=bool((s + i) % 2), max_side=40, n_samples=1 + i % 4))
                   for i in range(9)] for s in range(2)}
    out = str(tmp_path_factory.mktemp("known") / "pack")
    identity = write_pack(out, batches, world_size=1, num_workers=2, shard_bytes=4 << 20)
    flat = [b for s in sorted(batches) for b in batches[s]]
    # the fill ratio needs the pack's max_num_tokens, which a fake identity lacks
    identity["max_num_tokens"] = max(b.max_num_tokens for b in flat)
    write_bytes_atomic(resolve_location(out), PACK_INFO_NAME, dump_checked(identity))
    return out, flat


def test_stats_per_batch_and_per_group_equal_counts_from_the_records(known):
    out, batches = known
    per_batch, per_group = expected_values(batches)
    assert max(per_batch["tokens"]) > 4096 and min(per_batch["padding"]) == 0  # both regimes are exercised
    assert [p for b, p in zip(batches, per_batch["padding"]) if not b.use_flex] == [0] * 9
    st = compute_stats(out)
    rows = {r["quantity"]: r for r in st.token_batch.to_dicts()}
    assert list(rows) == [LABELS[q] for q in BATCH_QUANTITIES]
    for q in BATCH_QUANTITIES:
        check_summary(rows[LABELS[q]], per_batch[q], q)
    assert sum(rows[LABELS[k]]["total"] for k in ("text", "vit", "vae")) == rows["tokens"]["total"]
    assert math.isclose(rows["ViT tokens"]["share"], sum(per_batch["vit"]) / sum(per_batch["tokens"]))
    padded = sum(per_batch["tokens"]) + sum(per_batch["padding"])
    assert math.isclose(rows["flex padding"]["share"], sum(per_batch["padding"]) / padded)
    groups = {}
    for r in st.token_group.to_dicts():
        groups.setdefault(r["group"], {})[r["quantity"]] = r
    assert sorted(groups) == sorted(per_group) == ["t2i_pretrain", "unified_edit", "vlm_sft"]
    for g, values in per_group.items():
        for q in SAMPLE_QUANTITIES:
            row = groups[g][LABELS[q]]
            assert row["samples"] == len(values[q])
            check_summary(row, values[q], f"{g}/{q}")
    text = format_stats(st)
    assert "token composition per batch (18 batches" in text and "token composition per sample, by group" in text
    line = next(ln for ln in text.splitlines() if ln.startswith("  ViT tokens "))  # the per-batch table's row
    vit = rows["ViT tokens"]
    assert line.split()[2:7] == [f"{vit[k]:,}" for k in ("min", "p50", "p90", "max")] + [f"{vit['mean']:,.1f}"]
    page = render_html(st)
    assert "<h2>Token composition per batch</h2>" in page and "<h2>Token composition per sample, by group</h2>" in page
    assert "Token mix" in page and "<td>VAE tokens</td>" in page and "<th>share %</th>" in page


def test_a_composition_from_records_equals_one_from_the_batches(known):
    """The projected read (stats) and the in-memory batches (plan) count alike."""
    out, batches = known
    from_batches = Composition()
    for b in batches:
        from_batches.add(packed_batch_counts(b))
    st = compute_stats(out)
    assert st.token_batch.to_dicts() == from_batches.batch_rows()
    assert st.token_group.to_dicts() == from_batches.group_rows()


def test_positions_in_any_order_count_alike():
    """Positions are laid out in increasing order (cut at the samples' bounds); any other order is
    counted position by position, with the same result."""
    b = make_batch(11, BatchSpec(n_samples=3))
    rng = np.random.default_rng(0)
    shuffled = {n: rng.permutation(getattr(b, n)) for n in ("packed_text_indexes", "packed_vit_token_indexes",
                                                            "packed_vae_token_indexes", "ce_loss_indexes")}
    ordered = packed_batch_counts(b)
    mixed = comp.count_batch(lambda n: shuffled.get(n, getattr(b, n)), b.use_flex, b.max_num_tokens,
                             b.sequence_length, [o.group for o in b.origins])
    assert ordered.batch == mixed.batch
    for q in ("tokens", "text", "vit", "vae", "ce", "mse"):
        assert np.array_equal(ordered.samples[q], mixed.samples[q]), q


# -- video frames in a real pack ------------------------------------------------------------------
def test_video_frames_per_sample_are_the_vit_images_of_video_rows(tmp_path, tokenizer_and_special):
    """A real pack of SFT rows with images, mp4 videos and a frame folder: a sample's frames are the
    ViT images of a row whose JSONL says ``video`` (found from its origin), none for any other row;
    stats and the in-memory count agree."""
    import json

    from loader.reader import Pack, iter_records
    from prepack.tools.inspect_record import VIT, sample_facts
    from schemas.record import record_to_batch
    from tests.helpers.packs import KNOBS, make_video_dataset, pack_in_process

    ds = make_video_dataset(str(tmp_path))
    out = pack_in_process(ds.config(knobs=KNOBS, num_workers=1, prepack={"batches_per_stream": 12}),
                          str(tmp_path / "out"), tokenizer_and_special)
    rows: dict[str, list[dict]] = {}
    want_batch, want_group, seen = [], {}, Composition()
    for _, record in iter_records(Pack.open(out), 0):
        packed = record_to_batch(record)
        frames = 0
        for f in sample_facts(packed):
            o = f.origin
            if o.source_file not in rows:
                with open(o.source_file) as fh:
                    rows[o.source_file] = [json.loads(line) for line in fh] if o.source_file.endswith(".jsonl") else []
            line = rows[o.source_file][o.source_row] if rows[o.source_file] else {}
            n = sum(u.kind == VIT for u in f.images) if "video" in line and "image" not in line else 0
            want_group.setdefault(o.group, []).append(n)
            frames += n
        want_batch.append(frames)
        seen.add(packed_batch_counts(packed))
    assert sum(want_batch) > 0 and sum(want_group.get("vlm_sft", [])) == sum(want_batch)
    st = compute_stats(out)
    row = {r["quantity"]: r for r in st.token_batch.to_dicts()}[LABELS["frames"]]
    check_summary(row, want_batch, "frames")
    groups = {(r["group"], r["quantity"]): r for r in st.token_group.to_dicts()}
    for g, values in want_group.items():
        check_summary(groups[(g, LABELS["frames"])], values, g)
    assert seen.batch_rows() == st.token_batch.to_dicts()
