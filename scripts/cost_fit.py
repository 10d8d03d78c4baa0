"""The record-cost fit, apart from the timing (numpy only: the benches and tests read it without torch).

``scripts/time_record_cost.py`` times records and writes a CSV; this fits it:

- **one cost per record** (``fit_report``): time ~ c0 + sum_i c_i * term_i over ``FEATURES``,
  non-negative least squares (``nnls``), every 4th record held out to measure it;
- **one cost per segment** (``fit_segments``, issue 50): under FSDP the ranks wait for each other
  in every segment of a micro-step (``schemas.cost.SEGMENTS``), so each segment's own terms
  (``schemas.cost.SEGMENT_TERMS``) are fitted to that segment's own measured time
  (``segment_times``: the parts of the CSV that run in it).  Each term lies in one segment, so the
  fits together are one ``CostModel`` (``CostModel.read`` takes the JSON this writes), whose
  ``segments()`` prices each segment as measured.
"""

from __future__ import annotations

import contextlib
import csv

import numpy as np

from schemas.cost import COST_TERMS, SEGMENT_TERMS, SEGMENTS

FULL_LLM_LAYERS = 28  # Qwen2.5-7B
FULL_VIT_LAYERS = 26  # SigLIP-so400m's 27, less the last (BAGEL's vit_select_layer -2)

# the cost model's terms (with an intercept); flex_pad itself is tokens' complement (max_num_tokens - tokens)
FEATURES = ("tokens", "sum_sq_sample_lens", "flex_pad_sq", "vit_images", "vit_tokens", "sum_sq_vit_lens",
            "vae_images", "vae_canvas_pixels", "vae_canvas_sq", "ce_tokens", "mse_tokens")


# -- the fit -----------------------------------------------------------------------------------
def nnls(A: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """min ||Ax - b|| subject to x >= 0 (Lawson-Hanson active set)."""
    m, n = A.shape
    x, passive = np.zeros(n), np.zeros(n, bool)
    tol = 10 * np.finfo(float).eps * np.abs(A).sum(axis=0).max() * max(m, n)
    w = A.T @ (b - A @ x)
    for _ in range(max_iter or 3 * n + 10):
        if passive.all() or (w[~passive] <= tol).all():
            break
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(A[:, passive], b, rcond=None)[0]
            if (z[passive] > tol).all():
                break
            neg = passive & (z <= tol)
            alpha = np.min(x[neg] / np.maximum(x[neg] - z[neg], 1e-300))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
            if not passive.any():
                z = np.zeros(n)
                break
        x = z
        w = A.T @ (b - A @ x)
    return x


def fit_linear(rows: list[dict], features: tuple, target: str, train: list[int]) -> np.ndarray:
    """Coefficients [c0, c_features...] >= 0 fitted on the ``train`` rows (columns scaled first)."""
    X = np.array([[1.0] + [float(rows[i][f]) for f in features] for i in train])
    y = np.array([float(rows[i][target]) for i in train])
    scale = np.abs(X).max(axis=0)
    scale[scale == 0] = 1.0
    return nnls(X / scale, y) / scale


def predict(coef: np.ndarray, rows: list[dict], features: tuple, idx: list[int]) -> np.ndarray:
    return np.array([coef[0] + sum(c * float(rows[i][f]) for c, f in zip(coef[1:], features)) for i in idx])


def metrics(y: np.ndarray, p: np.ndarray) -> dict:
    if len(y) == 0:
        return {"r2": float("nan"), "median_ape": float("nan"), "max_ape": float("nan")}
    ss = float(((y - y.mean()) ** 2).sum())
    ape = np.abs(p - y) / np.maximum(np.abs(y), 1e-12) * 100
    return {"r2": 1 - float(((y - p) ** 2).sum()) / ss if ss > 0 else float("nan"),
            "median_ape": float(np.median(ape)), "max_ape": float(ape.max())}


def fit_report(rows: list[dict], target: str) -> dict:
    held = [i for i in range(len(rows)) if i % 4 == 3]
    train = [i for i in range(len(rows)) if i % 4 != 3]
    y = np.array([float(rows[i][target]) for i in held])
    coef = fit_linear(rows, FEATURES, target, train)
    tok = fit_linear(rows, ("tokens",), target, train)
    full, alone = metrics(y, predict(coef, rows, FEATURES, held)), metrics(y, predict(tok, rows, ("tokens",), held))
    mean_terms = {f: float(np.mean([r[f] for r in rows])) for f in FEATURES}
    mean_pred = coef[0] + sum(c * mean_terms[f] for c, f in zip(coef[1:], FEATURES))
    return {
        "target": target, "n_train": len(train), "n_heldout": len(held),
        "intercept_ms": float(coef[0]),
        "coefficients_ms": {f: float(c) for f, c in zip(FEATURES, coef[1:])},
        "share_of_mean": {"intercept": float(coef[0] / mean_pred) if mean_pred else 0.0,
                          **{f: float(c * mean_terms[f] / mean_pred) if mean_pred else 0.0
                             for f, c in zip(FEATURES, coef[1:])}},
        "heldout": full,
        "tokens_alone": {"intercept_ms": float(tok[0]), "ms_per_token": float(tok[1]), **alone},
        "mean_ms": float(np.mean([r[target] for r in rows])),
        "min_ms": float(min(r[target] for r in rows)), "max_ms": float(max(r[target] for r in rows)),
    }


def segment_times(row: dict) -> dict[str, float]:
    """A timed record's full-depth time per segment (ms), from its parts: ``vae`` the encoder and the
    flex mask (both before the first collective), ``vit`` 26 ViT layers, ``llm`` 28 LLM layers and
    the glue (embeddings, connectors, heads: they run beside the first and last LLM layer).  They
    add up to ``est_full_ms``."""
    return {"vae": float(row["vae_ms"]) + float(row["mask_ms"]),
            "vit": FULL_VIT_LAYERS * float(row["vit_layer_ms"]),
            "llm": FULL_LLM_LAYERS * float(row["llm_layer_ms"]) + float(row["glue_ms"])}


def fit_segments(rows: list[dict]) -> dict:
    """Each segment's terms fitted to its own measured time (``segment_times``; every 4th record held
    out): one ``CostModel``'s coefficients (the intercepts summed), and per segment its held-out R2
    and errors.  The JSON ``report`` writes holds it under ``segments``; ``CostModel.read`` reads it."""
    held = [i for i in range(len(rows)) if i % 4 == 3]
    train = [i for i in range(len(rows)) if i % 4 != 3]
    seg_rows = [{**r, **{f"{k}_seg_ms": v for k, v in segment_times(r).items()}} for r in rows]
    coefficients = {name: 0.0 for name in COST_TERMS}
    intercept, per = 0.0, {}
    for segment in SEGMENTS:
        features = SEGMENT_TERMS[segment]
        target = f"{segment}_seg_ms"
        coef = fit_linear(seg_rows, features, target, train)
        y = np.array([seg_rows[i][target] for i in held])
        intercept += float(coef[0])
        coefficients.update({f: float(c) for f, c in zip(features, coef[1:])})
        per[segment] = {"intercept_ms": float(coef[0]), "coefficients_ms": {f: float(c) for f, c in zip(features, coef[1:])},
                        "heldout": metrics(y, predict(coef, seg_rows, features, held)),
                        "mean_ms": float(np.mean([r[target] for r in seg_rows])),
                        "min_ms": float(min(r[target] for r in seg_rows)),
                        "max_ms": float(max(r[target] for r in seg_rows))}
    return {"coefficients_ms": coefficients, "intercept_ms": intercept, "per_segment": per,
            "n_train": len(train), "n_heldout": len(held)}


def read_csv(path: str) -> list[dict]:
    """Rows of an earlier run's CSV, numbers as numbers (``--from-csv``: fit again without timing)."""
    rows = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            for k, v in row.items():
                with contextlib.suppress(ValueError, TypeError):
                    row[k] = float(v) if any(c in v for c in ".eE") or k.endswith("_ms") else int(v)
            rows.append(row)
    return rows
