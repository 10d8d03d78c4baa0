"""inspect on a record built by hand; stats and the lineage queries against counts made from the records."""

from __future__ import annotations

import math
import os
from collections import Counter

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

from tests.helpers.fakepack import BOS, EOI, EOS, SOI, write_pack
from loader.reader import Pack
from prepack.cli import main
from prepack.tools.inspect_record import attention_mask, inspect_record
from prepack.tools.composition import BATCH_QUANTITIES, LABELS
from prepack.tools.lineage_queries import batches_with_row, rows_of_batch
from prepack.tools.stats import compute_stats, pack_stats
from schemas.layout import MANIFEST_NAME
from schemas.manifest import PackSummary
from schemas.pixel_table import image_table
from schemas.packed_batch import ATTN_MODE_CODES, PackedBatch, SampleOrigin
from schemas.record import record_to_batch
from tests.helpers.packs import build_pack
from tests.helpers.tokens import check_summary, expected_values


# -- inspect --------------------------------------------------------------------------------------
def hand_batch(tok) -> PackedBatch:
    """Two samples laid out by hand the way the reference packs them.

    sample 0 (t2i): text "a red bird" (causal) + a VAE target 48x32 px = 3x2 latents (noise), t=0.5
    sample 1 (sft): a ViT image 28x28 px = 2x2 patches (full) + text "what is it?" with CE loss
    """
    cap = tok.encode("a red bird", add_special_tokens=False)
    ans = tok.encode("what is it?", add_special_tokens=False)
    t0 = [BOS, *cap, EOS]  # positions 0..n0-1
    n0 = len(t0)
    v0 = n0  # SOI at v0, 6 latents, EOI at v0+7
    s0 = n0 + 8
    vit = s0  # SOI at vit, 4 patches, EOI at vit+5
    t1 = s0 + 6
    n1 = len(ans) + 2
    seq = t1 + n1
    text_ids = t0 + [SOI, EOI] + [SOI, EOI] + [BOS, *ans, EOS]
    text_idx = list(range(n0)) + [v0, v0 + 7] + [vit, vit + 5] + list(range(t1, t1 + n1))
    ce = list(range(t1, t1 + n1 - 1))
    rng = np.random.default_rng(0)
    img_vae = rng.integers(0, 256, (32, 48, 3), dtype=np.uint8)
    img_vit = rng.integers(0, 256, (28, 28, 3), dtype=np.uint8)
    i32 = lambda v: np.asarray(v, np.int32)  # noqa: E731
    return PackedBatch(
        use_flex=True, max_num_tokens=seq + 10, vit_patch_size=14, sequence_length=seq,
        sample_lens=i32([s0, seq - s0]), sample_num_splits=i32([2, 2]), split_lens=i32([n0, 8, 6, n1]),
        attn_modes=np.asarray([ATTN_MODE_CODES[m] for m in ("causal", "noise", "full", "causal")], np.uint8),
        packed_text_ids=i32(text_ids), packed_text_indexes=i32(text_idx),
        packed_position_ids=i32(list(range(n0)) + [n0] * 8 + [0] * 6 + list(range(1, 1 + n1))),
        packed_label_ids=i32([*ans, EOS]), ce_loss_indexes=i32(ce),
        ce_loss_weights=np.full(len(ce), 1 / math.sqrt(len(ce)), np.float32),
        **image_table([img_vae, img_vit]),
        image_norm=np.asarray([[0.5] * 6, [0.485, 0.456, 0.406, 0.229, 0.224, 0.225]]),
        vit_image_ids=i32([1]), vit_token_seqlens=i32([4]), packed_vit_position_ids=i32([0, 1, 70, 71]),
        packed_vit_token_indexes=i32(range(vit + 1, vit + 5)),
        vae_image_ids=i32([0]), vae_latent_shapes=i32([[2, 3]]), packed_latent_position_ids=i32([0, 1, 2, 64, 65, 66]),
        packed_vae_token_indexes=i32(range(v0 + 1, v0 + 7)), packed_timesteps=np.full(6, 0.5, np.float32),
        mse_loss_indexes=i32(range(v0 + 1, v0 + 7)),
        origins=[
            SampleOrigin("t2i_pretrain", "ds-a", 0, [3, 2, 7], False, "/data/t2i/part-00003.parquet", 2, 7),
            SampleOrigin("vlm_sft", "ds-b", 0, [41], True, "/data/vlm/train.jsonl", -1, 41),
        ],
    )


def test_inspect_explains_a_hand_built_record(tmp_path, tokenizer_and_special):
    tok = tokenizer_and_special[0]
    batch = hand_batch(tok)
    out = str(tmp_path / "pack")
    write_pack(out, {0: [hand_batch(tok), batch]}, world_size=1, num_workers=1)
    png = tmp_path / "rec.png"
    text = inspect_record(out, stream=0, record=1, png=str(png), tokenizer=tok)
    n_cap = len(tok.encode("a red bird", add_special_tokens=False))
    n_ans = len(tok.encode("what is it?", add_special_tokens=False))
    s0, seq = n_cap + 2 + 8, batch.sequence_length
    expected = [
        "stream 0, record 1: stream-00000/shard-00000.arrow #1",
        "matches the stream index",
        f"{seq:,} of {seq + 10:,} tokens",
        "flex attention, 2 samples, 2 images stored (1 ViT uses, 1 VAE uses)",
        f"tokens text {n_cap + 2 + 4 + n_ans + 2:,}  ViT 4  VAE 6  padding 10",
        f"loss   CE {n_ans + 1} tokens (weights sum {math.sqrt(n_ans + 1):.3f})  MSE 6 latent tokens (1 noised images)",
        f"sample 0  t2i_pretrain / ds-a  positions 0-{s0 - 1} ({s0} tokens)  text {n_cap + 4}  ViT 0  VAE 6",
        "from   /data/t2i/part-00003.parquet  row group 2, row 7  data_indexes [3, 2, 7]  worker 0",
        f"split 0  causal 0-{n_cap + 1}  text {n_cap + 2}\n      <|im_start|>a red bird<|im_end|>",
        f"split 1  noise  {n_cap + 2}-{s0 - 1}  text 2  VAE 6  MSE 6\n"
        "      image #0 48x32 -> latent 3x2, noised target, timestep 0.5000",
        f"sample 1  vlm_sft / ds-b  positions {s0}-{seq - 1} ({seq - s0} tokens)  text {n_ans + 4}  ViT 4  VAE 0",
        "from   /data/vlm/train.jsonl  row 41  data_indexes 41  worker 0",
        f"split 0  full   {s0}-{s0 + 5}  text 2  ViT 4\n      image #1 28x28 as 4 ViT patches",
        f"split 1  causal {s0 + 6}-{seq - 1}  text {n_ans + 2}  CE {n_ans + 1}\n      <|im_start|>what is it?<|im_end|>",
        "picture written to",
    ]
    for fact in expected:
        assert fact in text, f"missing {fact!r} in:\n{text}"
    img = np.asarray(Image.open(png).convert("RGB"))
    assert img.shape[0] > 400 and img.shape[1] > 800 and img.std() > 10
    with pytest.raises(ValueError, match="no record 2"):
        inspect_record(out, stream=0, record=2, tokenizer=tok)


def test_attention_mask_follows_the_reference_rules():
    ref = pytest.importorskip("nemo_automodel.components.datasets.multimodal.utils")
    rng = np.random.default_rng(0)
    for _ in range(25):
        n = int(rng.integers(1, 6))
        lens = rng.integers(1, 9, n).tolist()
        modes = [("causal", "full", "noise")[int(k)] for k in rng.integers(0, 3, n)]
        want = ref.prepare_attention_mask_per_sample(lens, modes).numpy() == 0
        got = attention_mask(lens, modes)
        assert np.array_equal(got, want), (lens, modes)
        pos = np.unique(rng.integers(0, sum(lens), 7))
        assert np.array_equal(attention_mask(lens, modes, pos), want[np.ix_(pos, pos)])


# -- stats and lineage ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pack(tmp_path_factory, tokenizer_and_special) -> str:
    return build_pack(str(tmp_path_factory.mktemp("pack")), tokenizer_and_special, batches=8, edit=True)


def all_batches(out: str) -> tuple[PackSummary, dict[tuple[int, int], PackedBatch]]:
    man = PackSummary.from_json(open(os.path.join(out, MANIFEST_NAME)).read())
    pack = Pack.open(out)
    found = {}
    for s in man.streams:
        for sh in pack.index(s.stream).shards:
            with pa.OSFile(os.path.join(out, sh.file)) as f:
                reader = pa.ipc.open_file(f)
                for i in range(reader.num_record_batches):
                    found[(s.stream, sh.first_record + i)] = record_to_batch(reader.get_batch(i))
    return man, found


def row_key(o: SampleOrigin) -> tuple:
    return o.source_file, o.source_row_group, o.source_row


def test_stats_agree_with_counts_from_the_records(pack, tmp_path):
    man, batches = all_batches(pack)
    st = compute_stats(pack)
    max_tokens = man.identity["max_num_tokens"]
    b = [batches[k] for k in sorted(batches)]
    t = st.totals
    assert (t["batches"], t["tokens"], t["samples"]) == (len(b), sum(x.sequence_length for x in b),
                                                         sum(x.num_samples for x in b))
    fills = [x.sequence_length / max_tokens for x in b]
    assert math.isclose(t["fill_mean"], sum(fills) / len(fills)) and (t["fill_min"], t["fill_max"]) == (min(fills), max(fills))
    per_batch = {(q, v): n for q, v, n in st.per_batch.iter_rows()}
    for q, of in (("num_samples", lambda x: x.num_samples), ("images", lambda x: len(x.image_heights)),
                  ("vit_uses", lambda x: len(x.vit_image_ids)), ("vae_uses", lambda x: len(x.vae_image_ids))):
        assert {v: n for (qq, v), n in per_batch.items() if qq == q} == dict(Counter(of(x) for x in b)), q
    assert any(v > 0 for (q, v) in per_batch if q == "vit_uses") and any(v > 0 for (q, v) in per_batch if q == "vae_uses")

    bins = Counter(int(x.sequence_length / max_tokens / 0.05) for x in b)
    assert {int(round(lo / 0.05)): n for lo, n in zip(st.fill_hist["lo"], st.fill_hist["batches"]) if n} == dict(bins)

    groups = Counter(o.group for x in b for o in x.origins)
    mix = {g: (n, share, conf) for g, n, share, conf in st.group_mix.select("group", "samples", "share", "configured_share").iter_rows()}
    assert {g: v[0] for g, v in mix.items()} == dict(groups) and len(groups) == 3
    total = sum(groups.values())
    assert all(math.isclose(mix[g][1], groups[g] / total) and math.isclose(mix[g][2], 1 / 3) for g in groups)

    uses = Counter(row_key(o) for x in b for o in x.origins)
    assert dict(st.row_use.iter_rows()) == dict(Counter(uses.values()))
    assert max(uses.values()) > 1  # the test pack does reuse rows
    top = st.top_rows.row(0, named=True)
    assert top["uses"] == max(uses.values()) == uses[(top["source_file"], top["source_row_group"], top["source_row"])]

    drops = Counter()
    for s in man.streams:
        drops.update(s.drops)
    assert dict(st.drops.filter(kind="drop").select("reason", "count").iter_rows()) == dict(drops)
    assert st.streams["elapsed_s"].to_list() == [s.elapsed_s for s in man.streams]
    assert st.streams["tokens"].to_list() == [sum(x.sequence_length for k, x in batches.items() if k[0] == s.stream) for s in man.streams]

    want_batch, want_group = expected_values(b)
    rows = {r["quantity"]: r for r in st.token_batch.to_dicts()}
    for q in BATCH_QUANTITIES:
        check_summary(rows[LABELS[q]], want_batch[q], q)
    assert rows["VAE tokens"]["max"] > 0 and rows["ViT tokens"]["max"] > 0 and rows["CE loss tokens"]["max"] > 0
    for r in st.token_group.to_dicts():
        q = next(k for k, v in LABELS.items() if v == r["quantity"])
        check_summary(r, want_group[r["group"]][q], f"{r['group']}/{q}")
        assert r["samples"] == groups[r["group"]]

    html = tmp_path / "stats.html"
    text = pack_stats(pack, html=str(html))
    assert f"{len(b)} batches" in text and "group mix" in text
    assert f"token composition per batch ({len(b)} batches" in text and "token composition per sample, by group" in text
    page = html.read_text()
    assert page.count("<svg") >= 6 and "<script" not in page and "src=" not in page and "<link" not in page
    assert "<h2>Token composition per batch</h2>" in page and "<td>MSE loss tokens</td>" in page


def test_lineage_answers_which_batches_hold_a_row_and_which_rows_form_a_batch(pack):
    _, batches = all_batches(pack)
    for (stream, record), x in batches.items():
        got = rows_of_batch(pack, stream, record)
        want = [(j, o.group, o.dataset, o.source_file, o.source_row_group, o.source_row, list(o.data_indexes), n)
                for j, (o, n) in enumerate(zip(x.origins, x.sample_lens.tolist()))]
        assert [tuple(r[:6]) + (list(r[6]), r[7]) for r in got.iter_rows()] == want
    where = {}
    for (stream, record), x in sorted(batches.items()):
        for j, o in enumerate(x.origins):
            where.setdefault(row_key(o), []).append((stream, record, j))
    reused = [k for k, v in where.items() if len(v) > 1]
    assert reused
    for key in reused[:5] + [k for k in where if k[1] < 0][:2]:
        hits = batches_with_row(pack, key[0], key[2], key[1])
        assert [tuple(r) for r in hits.select("stream", "record", "sample").iter_rows()] == where[key]
    assert batches_with_row(pack, "/no/such/file.parquet", 0).height == 0


def test_cli_inspect_and_stats(pack, tmp_path, capsys):
    png = tmp_path / "r.png"
    assert main(["inspect", pack, "--stream", "1", "--record", "0", "--png", str(png)]) == 0
    text = capsys.readouterr().out
    assert "sample 0" in text and "<|im_start|>" in text and png.stat().st_size > 10_000
    assert main(["stats", pack]) == 0
    out = capsys.readouterr().out
    assert "fill ratio" in out and "token composition per batch" in out
