"""Token composition of packed batches counted the long way, to check ``prepack.tools.composition``.

Independent of the code under test: each position's kind comes from ``inspect_record.token_kinds``
(one label per position), a sample's counts from masks over its span, image uses from
``inspect_record.sample_facts``; the statistics are numpy over every value (nearest rank).
"""

from __future__ import annotations

import math

import numpy as np

from prepack.tools.inspect_record import TEXT, VAE, VIT, sample_facts, token_kinds
from schemas.packed_batch import PackedBatch


def expected_values(batches: list[PackedBatch]) -> tuple[dict[str, list[int]], dict[str, dict[str, list[int]]]]:
    """(per batch: quantity -> one value per batch, per group: group -> quantity -> one value per sample)."""
    per_batch: dict[str, list[int]] = {}
    per_group: dict[str, dict[str, list[int]]] = {}
    for b in batches:
        kinds = token_kinds(b)[: b.sequence_length]
        seq = np.arange(b.sequence_length)
        ce, mse = np.isin(seq, b.ce_loss_indexes), np.isin(seq, b.mse_loss_indexes)
        values = {"tokens": b.sequence_length, "text": int((kinds == TEXT).sum()), "vit": int((kinds == VIT).sum()),
                  "vae": int((kinds == VAE).sum()), "ce": int(ce.sum()), "mse": int(mse.sum()),
                  "padding": b.max_num_tokens - b.sequence_length if b.use_flex else 0, "samples": b.num_samples,
                  "images": len(b.image_heights), "vit_images": len(b.vit_image_ids),
                  "vae_images": len(b.vae_image_ids), "frames": int(np.sum(b.sample_num_frames))}
        for q, v in values.items():
            per_batch.setdefault(q, []).append(int(v))
        for j, f in enumerate(sample_facts(b)):
            span = slice(f.start, f.start + f.length)
            sample = {"tokens": f.length, "text": f.counts[0], "vit": f.counts[1], "vae": f.counts[2],
                      "ce": int(ce[span].sum()), "mse": int(mse[span].sum()),
                      "vit_images": sum(u.kind == VIT for u in f.images),
                      "vae_images": sum(u.kind == VAE for u in f.images), "frames": int(b.sample_num_frames[j])}
            for q, v in sample.items():
                per_group.setdefault(f.origin.group, {}).setdefault(q, []).append(int(v))
    return per_batch, per_group


def nearest_rank(values: list[int], q: float) -> int:
    s = sorted(values)
    return s[max(1, math.ceil(q * len(s))) - 1]


def expected_summary(values: list[int]) -> dict:
    """What a ``Distribution`` must report for these values (percentiles exact: see ``close``)."""
    return {"min": min(values), "p50": nearest_rank(values, 0.5), "p90": nearest_rank(values, 0.9),
            "max": max(values), "total": sum(values), "count": len(values)}


def close(got: int, want: int) -> bool:
    """A percentile as a Distribution reports it: exact below 2,048, else within 0.1%."""
    return got == want if want < 2048 else abs(got - want) <= want / 1000


def check_summary(got: dict, values: list[int], what: str) -> None:
    """``got`` (a summary, or a table row without ``count``) against the values it summarises."""
    want = expected_summary(values)
    for k in ("min", "max", "total") + (("count",) if "count" in got else ()):
        assert got[k] == want[k], (what, k, got[k], want[k])
    for k in ("p50", "p90"):
        assert close(got[k], want[k]), (what, k, got[k], want[k])
    assert math.isclose(got["mean"], sum(values) / len(values), rel_tol=1e-9, abs_tol=0.01), (what, got["mean"])
