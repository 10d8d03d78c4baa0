"""schemas/cost.py: a batch's cost terms equal an independent count from its arrays (real packed
records and synthetic ones), per sample they add up to the batch's but for the VAE canvas, the
model prices them column by column, refuses what it does not know in one line, and the default
(BAGEL-7B from FLOPs) ranks the H200's full-depth estimates better than tokens alone."""

from __future__ import annotations

import csv
import os

import numpy as np
import pytest

from loader.reader import Pack, iter_records
from schemas.cost import (CANVAS_TERMS, COST_TERMS, CostModel, DEFAULT_FLOPS, RECORD_TERMS, SEGMENTS, SEGMENT_TERMS,
                          TERM_COLUMNS, record_terms, sample_terms_of, terms_of)
from schemas.errors import ConfigError
from schemas.record import RECORD_SCHEMA, record_to_batch
from tests.helpers.fakepack import BatchSpec, make_batch
from tests.helpers.packs import build_pack
from tests.helpers.paths import REPO

H200_CSV = os.path.join(REPO, "docs", "data", "record_cost_h200.csv")


@pytest.fixture(scope="module")
def real_batches(tmp_path_factory, tokenizer_and_special):
    """Every record of a small real pack (t2i, SFT and edit groups: ViT and VAE images, flex)."""
    out = build_pack(str(tmp_path_factory.mktemp("cost")), tokenizer_and_special, batches=3, edit=True)
    pack = Pack.open(out)
    return [record_to_batch(r) for s in range(pack.num_streams) for _, r in iter_records(pack, s)]


def _synthetic() -> list:
    specs = [BatchSpec(use_flex=i % 2 == 0, n_samples=1 + i % 4, vae=i % 5 != 0, vit=i % 7 != 3, max_side=4 + i % 3)
             for i in range(24)]
    return [make_batch(900 + i, spec) for i, spec in enumerate(specs)]


def _count_here(b) -> tuple[dict, list[dict]]:
    """The terms, and each sample's, counted with plain loops over the batch's arrays."""
    lens = [int(n) for n in b.sample_lens]
    starts = [sum(lens[:i]) for i in range(len(lens))]
    owner = lambda pos: max(i for i, s in enumerate(starts) if s <= pos)  # noqa: E731
    per = [dict.fromkeys(COST_TERMS, 0) for _ in lens]
    for i, n in enumerate(lens):
        per[i]["tokens"], per[i]["sum_sq_sample_lens"] = n, n * n
    pos = 0
    for n in [int(x) for x in b.vit_token_seqlens]:
        s = owner(int(b.packed_vit_token_indexes[pos]))
        per[s]["vit_tokens"] += n
        per[s]["sum_sq_vit_lens"] += n * n
        pos += n
    pos = 0
    for h, w in b.vae_latent_shapes.reshape(-1, 2).tolist():
        per[owner(int(b.packed_vae_token_indexes[pos]))]["vae_images"] += 1
        pos += h * w
    for name, column in (("ce_tokens", b.ce_loss_indexes), ("mse_tokens", b.mse_loss_indexes)):
        for p in column.tolist():
            per[owner(p)][name] += 1
    vae = [int(i) for i in b.vae_image_ids]
    hs, ws = [int(b.image_heights[i]) for i in vae], [int(b.image_widths[i]) for i in vae]
    H, W = (max(hs), max(ws)) if vae else (0, 0)
    whole = {k: sum(p[k] for p in per) for k in COST_TERMS}
    whole.update(vae_canvas_pixels=len(vae) * H * W, vae_canvas_sq=len(vae) * ((H // 8) * (W // 8)) ** 2)
    return whole, per


def _check(batches) -> None:
    for b in batches:
        whole, per = _count_here(b)
        assert terms_of(b).tolist() == [whole[k] for k in COST_TERMS]
        assert terms_of(b).dtype == np.int64
        samples, has_vae = sample_terms_of(b)
        assert samples.tolist() == [[p[k] if k not in CANVAS_TERMS else 0 for k in COST_TERMS] for p in per]
        assert has_vae.tolist() == [p["vae_images"] > 0 for p in per]
        t = record_terms(b)
        assert set(t) == set(RECORD_TERMS)
        pad = b.max_num_tokens - b.sequence_length if b.use_flex else 0
        assert (t["flex_pad"], t["samples"], t["vit_images"]) == (pad, len(b.sample_lens), len(b.vit_token_seqlens))


def test_terms_of_real_records_equal_a_count_from_their_arrays(real_batches):
    _check(real_batches)
    # the pack holds what the terms are about (else the test would check zeros)
    total = np.sum([terms_of(b) for b in real_batches], axis=0)
    assert all(total[COST_TERMS.index(k)] > 0 for k in COST_TERMS), dict(zip(COST_TERMS, total))
    assert any(sample_terms_of(b)[1].any() and not sample_terms_of(b)[1].all() for b in real_batches)


def test_terms_of_synthetic_batches_equal_a_count_from_their_arrays():
    _check(_synthetic())


def test_the_vae_canvas_is_each_largest_side_not_the_largest_image():
    b = make_batch(7, BatchSpec(n_samples=3, vit=False, max_side=5))
    vae = np.asarray(b.vae_image_ids)
    b.image_heights[vae] = 16
    b.image_widths[vae] = 16
    b.image_heights[vae[0]], b.image_widths[vae[-1]] = 160, 48
    n = len(vae)
    assert n >= 2
    t = dict(zip(COST_TERMS, terms_of(b).tolist()))
    assert t["vae_canvas_pixels"] == n * 160 * 48 and t["vae_canvas_sq"] == n * (20 * 6) ** 2


def test_term_columns_are_record_columns_and_enough():
    assert all(RECORD_SCHEMA.get_field_index(c) >= 0 for c in TERM_COLUMNS)
    b = make_batch(3)
    view = type("View", (), {c: getattr(b, c) for c in TERM_COLUMNS})()  # nothing but TERM_COLUMNS
    assert record_terms(view) == record_terms(b)
    assert sample_terms_of(view)[0].tolist() == sample_terms_of(b)[0].tolist()


def test_estimate_is_vectorized_and_adds_the_columns_in_order():
    model = CostModel.from_mapping({"tokens": 0.1, "sum_sq_sample_lens": 3e-7, "vae_canvas_sq": 1e-9, "intercept": 2.5})
    rng = np.random.default_rng(1)
    terms = rng.integers(0, 10**9, size=(50, len(COST_TERMS)))
    est = model.estimate(terms)
    assert est.shape == (50,) and est.dtype == np.float64
    for row, e in zip(terms.tolist(), est.tolist()):
        acc = 0.0
        for c, t in zip(model.coefficients, row):
            if c:
                acc = acc + c * float(t)
        assert e == acc + 2.5  # the same operations in the same order: the same bits
    assert model.estimate(terms[0]).shape == () and float(model.estimate(terms[0])) == est[0]
    assert np.array_equal(model.variable(terms), est - 2.5)
    with pytest.raises(ValueError, match="COST_TERMS"):
        model.estimate(terms[:, :3])


def test_from_mapping_and_to_mapping():
    default = CostModel.default()
    assert CostModel.from_mapping(default.to_mapping()) == default
    assert list(default.to_mapping()) == [*COST_TERMS, "intercept"]
    partial = CostModel.from_mapping({"tokens": 1})
    assert partial.coefficients == (1.0,) + (0.0,) * (len(COST_TERMS) - 1) and partial.intercept == 0.0
    for bad, words in [({"tokens": 1, "vit_images": 2}, "unknown term vit_images"),
                       ({"tokens": 1, "flex_pad_sq": 0, "nope": 1}, "unknown terms flex_pad_sq, nope"),
                       ({"tokens": -1}, "tokens must be a finite number >= 0"),
                       ({"tokens": float("nan")}, "finite"),
                       ({"tokens": True}, "finite number"),
                       ({"tokens": "1"}, "finite number"),
                       ({"intercept": 3.0}, "every term costs 0"),
                       ([("tokens", 1)], "expected a mapping")]:
        with pytest.raises(ConfigError, match=words) as e:
            CostModel.from_mapping(bad)
        assert "\n" not in str(e.value) and str(e.value).startswith("cost model: ")
    with pytest.raises(ConfigError, match="coefficients"):
        CostModel((1.0,))


def test_the_default_model_s_derivation():
    # Qwen2.5-7B: ~6.5e9 parameters in its 28 decoder layers, 2 FLOPs each, x3 for forward+backward
    assert DEFAULT_FLOPS["tokens"] == pytest.approx(2 * 6.525e9 * 3, rel=0.01)
    assert DEFAULT_FLOPS["vae_canvas_pixels"] == pytest.approx(4.13e6, rel=0.01)  # FLUX-shaped encoder, forward
    ms = CostModel.default().to_mapping()
    assert ms["vae_images"] == 0.0 and ms["intercept"] == 0.0
    assert all(ms[k] > 0 for k in COST_TERMS if k != "vae_images")
    # 32k tokens of text in 8 samples of 4k at half an H200's 989 TFLOP/s: 39.2e9 x 32768 / 494.5e12 s
    # = 2.59 s of GEMMs, 28 x 3 x 4 x 3584 x 8 x 4096^2 / 494.5e12 s = 0.33 s of attention
    text = np.zeros(len(COST_TERMS), np.int64)
    text[COST_TERMS.index("tokens")] = 32768
    text[COST_TERMS.index("sum_sq_sample_lens")] = 8 * 4096**2
    assert float(CostModel.default().estimate(text)) == pytest.approx(2594 + 327, rel=0.002)


def _rank(a):
    return np.argsort(np.argsort(a, kind="stable"), kind="stable")


def test_the_default_model_against_the_h200_full_depth_estimates():
    with open(H200_CSV, newline="") as f:
        rows = list(csv.DictReader(f))
    terms = np.array([[int(r[k]) for k in COST_TERMS] for r in rows])
    measured = np.array([float(r["est_full_ms"]) for r in rows])
    est = CostModel.default().estimate(terms)
    spearman = float(np.corrcoef(_rank(est), _rank(measured))[0, 1])
    tokens_alone = float(np.corrcoef(_rank(terms[:, 0]), _rank(measured))[0, 1])
    assert spearman > 0.85 and spearman > tokens_alone + 0.1, (spearman, tokens_alone)
    scaled = np.abs(est * (measured.mean() / est.mean()) / measured - 1)  # a balancer needs ratios only
    assert np.median(scaled) < 0.015 and scaled.max() < 0.08
    assert 0.9 < est.mean() / measured.mean() < 1.1  # and the scale is the H200's


def test_a_model_read_from_a_file_or_a_fit(tmp_path):
    from schemas.cost import COST_TERMS, CostModel
    from schemas.errors import ConfigError

    path = tmp_path / "model.json"
    path.write_text('{"tokens": 0.5, "intercept": 2}')
    m = CostModel.read(str(path))
    assert m.to_mapping()["tokens"] == 0.5 and m.intercept == 2.0 and sum(m.coefficients) == 0.5
    yml = tmp_path / "model.yaml"
    yml.write_text("vae_canvas_pixels: 0.001\n")
    assert CostModel.read(str(yml)).coefficients[COST_TERMS.index("vae_canvas_pixels")] == 0.001
    import os

    fit = CostModel.read(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "data",
                                      "record_cost_fit_h200.json"))  # the H200 fit, its unused terms at 0
    assert fit.coefficients[COST_TERMS.index("tokens")] > 0
    path.write_text('{"coefficients_ms": {"tokens": 1, "flex_pad_sq": 3}}')
    with pytest.raises(ConfigError, match="flex_pad_sq"):
        CostModel.read(str(path))
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read"):
        CostModel.read(str(path))


def test_segments_add_up_to_the_estimate_and_each_term_has_one():
    assert sorted(t for terms in SEGMENT_TERMS.values() for t in terms) == sorted(COST_TERMS)
    assert tuple(SEGMENT_TERMS) == SEGMENTS
    rng = np.random.default_rng(2)
    terms = rng.integers(0, 50_000, (40, len(COST_TERMS)))
    for model in (CostModel.default(), CostModel.from_mapping({"tokens": 0.5, "vae_images": 3.0, "intercept": 7.0})):
        seg = model.segments(terms)
        assert seg.shape == (40, len(SEGMENTS))
        assert np.allclose(seg.sum(axis=1), model.estimate(terms), rtol=1e-12)
        assert model.segments(terms[3]).tolist() == seg[3].tolist()  # one row alike
        for k, name in enumerate(SEGMENTS):  # a segment prices its own terms only
            only = np.zeros_like(terms)
            cols = [COST_TERMS.index(t) for t in SEGMENT_TERMS[name]]
            only[:, cols] = terms[:, cols]
            assert np.allclose(model.segments(only)[:, k], model.segments(terms)[:, k])
    no_vae = CostModel.default().without("vae")
    assert (no_vae.segments(terms)[:, SEGMENTS.index("vae")] == 0).all()
    assert no_vae.segments(terms)[:, 1:].tolist() == CostModel.default().segments(terms)[:, 1:].tolist()
    with pytest.raises(ConfigError, match="no segment"):
        CostModel.default().without("gpu")


def test_of_a_config_is_its_cost_model_else_the_default():
    assert CostModel.of(None) == CostModel.default() == CostModel.of({"prepack": {}})
    assert CostModel.of({"prepack": {"cost_model": {"tokens": 2.0}}}) == CostModel.from_mapping({"tokens": 2.0})
    section = type("Section", (), {"cost_model": {"tokens": 3.0}})
    assert CostModel.of(type("Config", (), {"prepack": section})) == CostModel.from_mapping({"tokens": 3.0})
