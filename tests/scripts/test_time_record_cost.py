"""scripts/time_record_cost.py: a CPU dry run over a small fake pack writes a CSV row per record
whose terms equal the ones computed here from the record's fields, ends with its headline line,
and imports nothing a GPU machine lacks (torchdata, zstandard, yaml, PIL, ray, pandas); its flex mask is
the reference's dense mask; its NNLS is a non-negative least-squares solution."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from tests.helpers.paths import REPO

SCRIPT = os.path.join(REPO, "scripts", "time_record_cost.py")
sys.path.insert(0, os.path.join(REPO, "scripts"))
import time_record_cost as trc  # noqa: E402

_LAST = re.compile(r"record cost on (.+): fit R2 (-?[\d.]+|nan) \(tokens alone (-?[\d.]+|nan)\), "
                   r"median error ([\d.]+|nan)% over (\d+) records")
# what the GPU machine does not have: the script must run without them
_ABSENT = ("torchdata", "zstandard", "yaml", "PIL", "ray", "scipy", "transformers", "pandas")
_RUN_WITHOUT = ("import runpy, sys\n"
                "for name in {absent!r}: sys.modules[name] = None\n"
                "sys.argv = [{script!r}] + sys.argv[1:]\n"
                "runpy.run_path({script!r}, run_name='__main__')\n")


def _fake_pack(out: str) -> list:
    """7 small records over 2 streams: flex and not, ViT and VAE images, several samples."""
    from tests.helpers.fakepack import BatchSpec, make_batch, write_pack

    specs = [BatchSpec(use_flex=i % 2 == 0, n_samples=2 + i % 3, max_side=4, vae_targets=i != 3) for i in range(7)]
    batches = [make_batch(500 + i, spec) for i, spec in enumerate(specs)]
    write_pack(out, {0: batches[:4], 1: batches[4:]}, world_size=1, num_workers=2)
    return batches


def _terms_here(pb) -> dict:
    """The terms, computed from the fields independently of the script."""
    lens = [int(n) for n in pb.sample_lens]
    vit = [int(n) for n in pb.vit_token_seqlens]
    vae = [int(i) for i in pb.vae_image_ids]
    hs, ws = [int(pb.image_heights[i]) for i in vae], [int(pb.image_widths[i]) for i in vae]
    H, W = (max(hs), max(ws)) if vae else (0, 0)
    pad = pb.max_num_tokens - pb.sequence_length if pb.use_flex else 0
    return {"tokens": sum(lens), "samples": len(lens), "sum_sq_sample_lens": sum(n * n for n in lens),
            "flex_pad": pad, "flex_pad_sq": pad * pad, "vit_images": len(vit), "vit_tokens": sum(vit),
            "sum_sq_vit_lens": sum(n * n for n in vit), "vae_images": len(vae), "vae_canvas_h": H, "vae_canvas_w": W,
            "vae_canvas_pixels": len(vae) * H * W, "vae_canvas_sq": len(vae) * (H * W // 64) ** 2,
            "vae_latent_tokens": len(pb.packed_vae_token_indexes), "ce_tokens": len(pb.ce_loss_indexes),
            "mse_tokens": len(pb.mse_loss_indexes), "text_tokens": len(pb.packed_text_ids)}


def test_cpu_dry_run_rows_terms_and_last_line(tmp_path, capsys):
    pack = str(tmp_path / "pack")
    batches = _fake_pack(pack)
    out_csv, out_fit = str(tmp_path / "cost.csv"), str(tmp_path / "fit.json")
    code = _RUN_WITHOUT.format(absent=_ABSENT, script=SCRIPT)
    proc = subprocess.run([sys.executable, "-c", code, "--device", "cpu", "--pack", pack, "--reps", "1",
                           "--csv", out_csv, "--fit", out_fit], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "torchdata absent: importing loader.reader without loader/__init__.py" in proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    m = _LAST.fullmatch(last)
    assert m, last
    assert "tiny" in m[1] and int(m[5]) == 1  # 7 records: the 4th is held out
    with open(out_csv, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(batches)
    by_place = {(int(r["stream"]), int(r["record"])): r for r in rows}
    for i, pb in enumerate(batches):
        row = by_place[(0, i) if i < 4 else (1, i - 4)]
        assert {k: int(row[k]) for k in trc.TERMS} == _terms_here(pb)
        times = {k: float(row[k]) for k in trc.TIMES}
        assert times["total_ms"] > 0 and times["llm_layers_ms"] > 0 and times["glue_ms"] > 0
        assert (times["vae_ms"] > 0) == bool(len(pb.vae_image_ids))
        assert times["est_full_ms"] >= times["parts_ms"] > 0
        assert row["attention"] == "sdpa-causal" and row["dims"] == "tiny"
    fit = json.load(open(out_fit))
    assert set(fit["coefficients_ms"]) == set(trc.FEATURES) and min(fit["coefficients_ms"].values()) >= 0
    assert fit["n_heldout"] == 1 and fit["n_train"] == 6 and fit["device_type"] == "cpu"
    from schemas.cost import CostModel  # the per-segment model beside it: a --cost-model file

    segments = json.load(open(str(tmp_path / "fit_segments.json")))
    assert set(segments["per_segment"]) == {"vae", "vit", "llm"}
    assert CostModel.read(str(tmp_path / "fit_segments.json")).to_mapping()["intercept"] >= 0

    # the fit again from the CSV alone: the same last line
    assert trc.main(["--from-csv", out_csv, "--fit", str(tmp_path / "fit2.json")]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == last


_EAGER_FLEX = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def _flex_by_dense_mask(q, k, v, block_mask, enable_gqa):
    """flex_attention's result through SDPA with the block mask's mask materialized (flex has no
    backward on the CPU)."""
    from torch.nn.attention.flex_attention import create_mask

    mask = create_mask(block_mask.mask_mod, None, None, q.shape[-2], k.shape[-2], device=q.device)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa)


def test_flex_and_dense_mask_paths_run_end_to_end(tmp_path, monkeypatch):
    """The GPU's attention paths run through the whole timing (flex for use_flex records, dense
    masks for the others): flex_attention itself replaced by its mask's dense equivalent."""
    monkeypatch.setitem(trc._FLEX, "cpu", _flex_by_dense_mask)
    pack = str(tmp_path / "pack")
    _fake_pack(pack)
    out_csv = str(tmp_path / "cost.csv")
    assert trc.main(["--device", "cpu", "--pack", pack, "--reps", "1", "--max-records", "4", "--attention", "flex",
                     "--csv", out_csv, "--fit", str(tmp_path / "fit.json")]) == 0
    with open(out_csv, newline="") as f:
        rows = list(csv.DictReader(f))
    # round-robin over the streams: batches 0, 4, 1, 5; the even ones use flex
    assert [r["attention"] for r in rows] == ["flex", "flex", "sdpa-mask", "sdpa-mask"]
    assert [float(r["mask_ms"]) > 0 for r in rows] == [True, True, False, False]


@_EAGER_FLEX
@pytest.mark.parametrize("seed", [3, 8])
def test_flex_mask_is_the_dense_reference_mask(seed):
    """The stand-in's flex attention (BAGEL's mask, the pad a sample of its own) gives the real tokens
    what per-sample SDPA with the reference's dense masks gives them."""
    from tests.helpers.fakepack import BatchSpec, make_batch

    pb = make_batch(seed, BatchSpec(use_flex=True, n_samples=3, max_side=3))
    pb.max_num_tokens = pb.sequence_length + 37
    sh = trc.shape_of(pb, "fake/0/0")
    dims, dev = trc.TINY, torch.device("cpu")
    gen = torch.Generator().manual_seed(seed)
    flex = trc.Record(sh, dims, dev, torch.float32, gen, "flex", {})
    dense = trc.Record(sh, dims, dev, torch.float32, gen, "sdpa-mask", {})
    flex.block_mask = flex.make_block_mask()
    n = sh.sequence_length
    q = torch.randn(n, dims.heads, dims.head_dim, generator=gen)
    k, v = (torch.randn(n, dims.kv_heads, dims.head_dim, generator=gen) for _ in range(2))
    torch.testing.assert_close(flex.ctx().attend(q, k, v), dense.ctx().attend(q, k, v), rtol=1e-4, atol=1e-5)
    # and the dense masks are loader.masks' (the loader's non-flex reference)
    from loader.masks import dense_mask, row_bounds

    start, limit, keep = row_bounds(pb.sample_lens, pb.sample_num_splits, pb.split_lens, pb.attn_modes)
    a = 0
    for mask, ln in zip(trc.dense_sample_masks(sh), pb.sample_lens.tolist()):
        ref = dense_mask(*(torch.from_numpy(np.asarray(x[a:a + ln])) for x in (start, limit, keep))) == 0
        assert torch.equal(torch.from_numpy(mask), ref)
        a += ln


def test_bf16_stand_in_with_the_real_canvas_runs():
    """The GPU's dtype (bf16) and the VAE at its real canvas scale (latents cut from the padded canvas
    per image and patchified), at tiny widths on the CPU: the latent tokens are exactly the record's."""
    import dataclasses

    from tests.helpers.fakepack import BatchSpec, make_batch

    dims = dataclasses.replace(trc.TINY, canvas_scale=1)
    model = trc.Model(dims, 1, 1, 14).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    pb = make_batch(11, BatchSpec(use_flex=True, n_samples=3, max_side=4))
    assert len(pb.vae_image_ids) >= 2
    rec = trc.Record(trc.shape_of(pb, "fake/0/0"), dims, torch.device("cpu"), torch.bfloat16, gen, "sdpa-causal", {})
    tokens = model.vae_tokens(rec)
    assert tokens.shape == (len(pb.packed_vae_token_indexes), dims.latent_channels * dims.latent_patch ** 2)
    assert tokens.dtype == torch.bfloat16
    times = trc.time_record(model, rec, trc.Timer(torch.device("cpu")), 1, 1, 1, gen)
    assert min(times[k] for k in ("vae_ms", "llm_layers_ms", "vit_layers_ms", "glue_ms", "total_ms")) > 0
