"""scripts/cost_fit.py: non-negative least squares, and the per-segment fit (issue 50): each
segment's own terms fitted to its own measured time, together one ``CostModel``; the H200 data's
segments add up to its full-depth estimates."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from schemas.cost import COST_TERMS, SEGMENT_TERMS, SEGMENTS, CostModel
from tests.helpers.paths import REPO

sys.path.insert(0, os.path.join(REPO, "scripts"))
import cost_fit  # noqa: E402

H200_CSV = os.path.join(REPO, "docs", "data", "record_cost_h200.csv")


def test_nnls_is_a_nonnegative_least_squares_solution():
    rng = np.random.default_rng(0)
    A = rng.random((40, 6))
    b = A @ np.array([1.0, 0.0, 2.0, 0.0, 0.5, 0.0]) + rng.normal(0, 0.05, 40) - 0.3 * A[:, 1]
    x = cost_fit.nnls(A, b)
    grad = A.T @ (A @ x - b)
    assert (x >= 0).all()
    assert np.allclose(grad[x > 0], 0, atol=1e-8) and (grad[x == 0] >= -1e-8).all()  # KKT conditions
    assert x[1] == 0  # the negative effect is clipped


def test_segment_times_add_up_to_the_full_depth_estimate():
    rows = cost_fit.read_csv(H200_CSV)
    for r in rows:
        parts = cost_fit.segment_times(r)
        assert list(parts) == list(SEGMENTS)
        assert sum(parts.values()) == pytest.approx(float(r["est_full_ms"]), rel=1e-5)


def test_the_segment_fit_recovers_each_segments_own_prices():
    """Rows whose parts are exact linear functions of their terms: each segment's fit gives back its
    own coefficients, and the model made of them prices each segment as measured."""
    rng = np.random.default_rng(4)
    truth = {"tokens": 0.08, "sum_sq_sample_lens": 2e-6, "vit_tokens": 0.002, "sum_sq_vit_lens": 3e-6,
             "vae_canvas_pixels": 3e-5, "vae_canvas_sq": 2e-8, "mse_tokens": 0.001}
    model = CostModel.from_mapping(truth)
    rows = []
    for _ in range(60):
        terms = {"tokens": int(rng.integers(30_000, 36_000)), "sum_sq_sample_lens": int(rng.integers(1e8, 3e8)),
                 "vit_tokens": int(rng.integers(0, 20_000)), "sum_sq_vit_lens": int(rng.integers(0, 9e7)),
                 "vae_images": int(rng.integers(0, 8)), "vae_canvas_pixels": int(rng.integers(0, 8e6)),
                 "vae_canvas_sq": int(rng.integers(0, 2e9)), "ce_tokens": int(rng.integers(0, 2000)),
                 "mse_tokens": int(rng.integers(0, 16_000))}
        vae, vit, llm = model.segments(np.array([terms[k] for k in COST_TERMS])).tolist()
        rows.append({**terms, "vae_ms": vae, "mask_ms": 0.0, "vit_layer_ms": vit / cost_fit.FULL_VIT_LAYERS,
                     "llm_layer_ms": llm / cost_fit.FULL_LLM_LAYERS, "glue_ms": 0.0})
    fit = cost_fit.fit_segments(rows)
    for name in COST_TERMS:
        assert fit["coefficients_ms"][name] == pytest.approx(truth.get(name, 0.0), rel=1e-6, abs=1e-9)
    assert abs(fit["intercept_ms"]) < 1e-6
    for segment in SEGMENTS:
        assert set(fit["per_segment"][segment]["coefficients_ms"]) == set(SEGMENT_TERMS[segment])
        assert fit["per_segment"][segment]["heldout"]["r2"] > 0.999999
    fitted = CostModel.from_mapping({**fit["coefficients_ms"], "intercept": fit["intercept_ms"]})
    terms = np.array([[r[k] for k in COST_TERMS] for r in rows])
    assert np.allclose(fitted.segments(terms), model.segments(terms), rtol=1e-6)


def test_the_committed_h200_segment_fit_is_a_cost_model():
    path = os.path.join(REPO, "docs", "data", "record_cost_fit_h200_segments.json")
    model = CostModel.read(path)
    rows = cost_fit.read_csv(H200_CSV)
    terms = np.array([[int(r[k]) for k in COST_TERMS] for r in rows])
    measured = np.array([[cost_fit.segment_times(r)[s] for s in SEGMENTS] for r in rows])
    vae = SEGMENTS.index("vae")
    assert np.corrcoef(model.segments(terms)[:, vae], measured[:, vae])[0, 1] > 0.99  # the VAE: the one that varies
