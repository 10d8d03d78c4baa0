"""How a packed batch's tokens divide: text, ViT, VAE, loss-bearing, padding; per batch and per group.

Why: fill and sample counts say how full a batch is, not what it holds.  A training run is sized
by the visual-token budget of each batch (ViT patches, VAE latent slots), by the tokens that carry
a loss (CE on text, MSE on noised latents) and by the flex padding every batch is padded with; a
group's mix (text vs image tokens per sample) says where those come from.

Everything is counted from the record's position arrays, never from pixels: a position is text,
ViT or VAE (``packed_text_indexes``, ``packed_vit_token_indexes``, ``packed_vae_token_indexes``
partition ``0 .. sequence_length-1``), a sample owns the positions of its span (``sample_lens``)
and an image use belongs to the sample of its first token (``vit_token_seqlens`` and
``vae_latent_shapes`` cut the ViT and VAE positions per image).  ``prepack stats`` reads these
columns in a projected read (``COLUMNS``: a few hundred KB of a record, not its pixel table);
``prepack plan`` counts the batches it packs in memory.

Distributions are ``prepack.tools.sketch.Distribution``: fixed memory whatever the number of
records, exact min and max, percentiles exact below 2,048 and within 0.1% above.  What is not
counted apart: video frames (an SFT video's frames are ViT images like any other in the record;
``sample_num_frames`` says how many of a sample's images are frames).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from prepack.tools.sketch import Distribution
from schemas.record import RECORD_SCHEMA

# The record columns a projected read needs (see module doc), in the record's column order (a
# projection reads them in that order); none of them is the pixel table.
COLUMNS = tuple(sorted(("use_flex", "max_num_tokens", "sequence_length", "sample_lens", "packed_text_indexes",
                        "packed_vit_token_indexes", "packed_vae_token_indexes", "ce_loss_indexes", "mse_loss_indexes",
                        "vit_token_seqlens", "vae_latent_shapes", "image_heights", "vit_image_ids", "vae_image_ids",
                        "sample_num_frames", "origin_group"), key=RECORD_SCHEMA.get_field_index))

TOKEN_KINDS = ("text", "vit", "vae")
SAMPLE_QUANTITIES = ("tokens", "text", "vit", "vae", "ce", "mse", "vit_images", "vae_images", "frames")
BATCH_QUANTITIES = ("tokens", "text", "vit", "vae", "ce", "mse", "padding", "samples", "images", "vit_images",
                    "vae_images", "frames")
LABELS = {"tokens": "tokens", "text": "text tokens", "vit": "ViT tokens", "vae": "VAE tokens",
          "ce": "CE loss tokens", "mse": "MSE loss tokens", "padding": "flex padding", "samples": "samples",
          "images": "images stored", "vit_images": "ViT images", "vae_images": "VAE images",
          "frames": "video frames"}
_OF_TOKENS = {"text", "vit", "vae", "ce", "mse", "padding"}  # quantities shown as a share of the tokens
FLUSH_VALUES = 1 << 16  # values buffered before they go into the distributions (bounded memory)


@dataclass
class BatchCounts:
    """One batch's counts: ``batch[q]`` per quantity, ``samples[q]`` per sample, ``groups`` per sample."""

    batch: dict[str, int]
    groups: list[str]
    samples: dict[str, np.ndarray]


def _per_image_first(positions: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """First position of each image's run of ``lengths`` tokens in ``positions``."""
    lengths = np.asarray(lengths, np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if len(lengths) else lengths
    return positions[starts[lengths > 0]]


def count_batch(get: Callable[[str], np.ndarray], use_flex: bool, max_num_tokens: int, sequence_length: int,
                groups: list[str]) -> BatchCounts:
    """Counts of one batch whose arrays ``get(name)`` returns (a record's columns or a PackedBatch's fields)."""
    sample_lens = np.asarray(get("sample_lens"), np.int64)
    n = len(sample_lens)
    bounds = np.concatenate([[0], np.cumsum(sample_lens)])

    def per_sample(positions: np.ndarray) -> np.ndarray:
        # positions are laid out in increasing order: cut them at the samples' bounds; in any
        # other order, look up each position's sample
        if len(positions) < 2 or bool((positions[1:] >= positions[:-1]).all()):
            return np.diff(np.searchsorted(positions, bounds))
        return np.bincount(np.repeat(np.arange(n), sample_lens)[positions], minlength=n)

    pos = {"text": get("packed_text_indexes"), "vit": get("packed_vit_token_indexes"),
           "vae": get("packed_vae_token_indexes"), "ce": get("ce_loss_indexes"), "mse": get("mse_loss_indexes")}
    shapes = np.asarray(get("vae_latent_shapes"), np.int64).reshape(-1, 2)
    firsts = {"vit_images": _per_image_first(pos["vit"], get("vit_token_seqlens")),
              "vae_images": _per_image_first(pos["vae"], shapes[:, 0] * shapes[:, 1])}
    frames = np.asarray(get("sample_num_frames"), np.int64)
    samples = {"tokens": sample_lens, **{k: per_sample(v) for k, v in pos.items()},
               **{k: per_sample(v) for k, v in firsts.items()}, "frames": frames}
    batch = {k: int(len(v)) for k, v in pos.items()}
    batch.update(tokens=int(sequence_length), padding=int(max_num_tokens) - int(sequence_length) if use_flex else 0,
                 samples=n, images=int(len(get("image_heights"))), vit_images=int(len(get("vit_image_ids"))),
                 vae_images=int(len(get("vae_image_ids"))), frames=int(frames.sum()))
    return BatchCounts(batch, list(groups), samples)


def record_counts(record) -> BatchCounts:
    """Counts of one record (a ``pyarrow.RecordBatch`` holding at least ``COLUMNS``)."""
    def get(name: str) -> np.ndarray:
        return record.column(name).flatten().to_numpy(zero_copy_only=True)

    scalar = lambda name: record.column(name)[0].as_py()  # noqa: E731
    return count_batch(get, scalar("use_flex"), scalar("max_num_tokens"), scalar("sequence_length"),
                       record.column("origin_group").flatten().to_pylist())


def packed_batch_counts(batch) -> BatchCounts:
    """Counts of one ``schemas.packed_batch.PackedBatch`` (in memory: ``prepack plan``)."""
    return count_batch(lambda name: getattr(batch, name), batch.use_flex, batch.max_num_tokens,
                       batch.sequence_length, [o.group for o in batch.origins])


class Composition:
    """Distributions of every quantity per batch, and per sample of each group; memory is fixed
    (buckets, plus at most ``FLUSH_VALUES`` buffered values), whatever the number of batches."""

    def __init__(self) -> None:
        self.batch = {q: Distribution() for q in BATCH_QUANTITIES}
        self.groups: dict[str, dict[str, Distribution]] = {}
        self._batch_buf: dict[str, list[int]] = {q: [] for q in BATCH_QUANTITIES}
        self._sample_buf: list[tuple[list[str], dict[str, np.ndarray]]] = []
        self._buffered = 0

    def add(self, counts: BatchCounts) -> None:
        for q, v in counts.batch.items():
            self._batch_buf[q].append(v)
        self._sample_buf.append((counts.groups, counts.samples))
        self._buffered += 1 + len(counts.groups)
        if self._buffered >= FLUSH_VALUES:
            self.flush()

    def flush(self) -> None:
        """Move the buffered values into the distributions (done by every reader of the results)."""
        for q, values in self._batch_buf.items():
            self.batch[q].add(values)
            values.clear()
        if self._sample_buf:
            names = [g for groups, _ in self._sample_buf for g in groups]
            uniq, codes = np.unique(np.asarray(names, dtype=object).astype(str), return_inverse=True)
            for q in SAMPLE_QUANTITIES:
                values = np.concatenate([s[q] for _, s in self._sample_buf])
                for k, g in enumerate(uniq.tolist()):
                    self.groups.setdefault(g, {p: Distribution() for p in SAMPLE_QUANTITIES})[q].add(values[codes == k])
            self._sample_buf.clear()
        self._buffered = 0

    def merge(self, other: "Composition") -> None:
        self.flush()
        other.flush()
        for q, d in other.batch.items():
            self.batch[q].merge(d)
        for g, dists in other.groups.items():
            mine = self.groups.setdefault(g, {p: Distribution() for p in SAMPLE_QUANTITIES})
            for q, d in dists.items():
                mine[q].merge(d)

    @property
    def num_batches(self) -> int:
        self.flush()
        return self.batch["tokens"].count

    def batch_rows(self) -> list[dict]:
        """One row per quantity: min, p50, p90, max, mean, total and (token kinds) share of the tokens
        (padding: of the padded length, tokens + padding)."""
        self.flush()
        tokens = self.batch["tokens"].total
        of = {q: tokens for q in _OF_TOKENS} | {"padding": tokens + self.batch["padding"].total}
        return [_row({"quantity": LABELS[q]}, self.batch[q], of.get(q)) for q in BATCH_QUANTITIES]

    def group_rows(self) -> list[dict]:
        """One row per (group, quantity), over the group's samples; share of the group's tokens."""
        self.flush()
        out = []
        for g in sorted(self.groups):
            d = self.groups[g]
            for q in SAMPLE_QUANTITIES:
                out.append(_row({"group": g, "quantity": LABELS[q], "samples": d[q].count}, d[q],
                                d["tokens"].total if q in _OF_TOKENS else None))
        return out

    def to_json(self) -> dict:
        """``{"per_batch": {quantity: stats}, "per_group": {group: {quantity: stats}}}`` (keys as in
        ``BATCH_QUANTITIES`` / ``SAMPLE_QUANTITIES``; stats: min, p50, p90, max, mean, total, count)."""
        self.flush()
        rnd = lambda s: {k: round(v, 2) if isinstance(v, float) else v for k, v in s.items()}  # noqa: E731
        return {"per_batch": {q: rnd(d.summary()) for q, d in self.batch.items()},
                "per_group": {g: {q: rnd(d.summary()) for q, d in dists.items()} for g, dists in sorted(self.groups.items())}}

    def lines(self, indent: str = "  ") -> list[str]:
        """Both tables as aligned plain text (what ``plan`` prints)."""
        return table_lines(self.num_batches, self.batch_rows(), self.group_rows(), indent)


def table_lines(batches: int, batch_rows: list[dict], group_rows: list[dict], indent: str = "  ") -> list[str]:
    """The per-batch and per-group tables as aligned plain text (``plan`` and ``stats``)."""
    out = [f"token composition per batch ({batches:,} batches; nearest-rank percentiles, exact below 2,048, "
           "else within 0.1%; share: of the tokens, padding of the padded length):"]
    out += aligned(batch_rows, indent)
    out += ["", "token composition per sample, by group (share: of the group's tokens):"]
    return out + aligned(group_rows, indent)


def _row(head: dict, d: Distribution, of: int | None) -> dict:
    s = d.summary()
    share = s["total"] / of if of else None
    return {**head, "min": s["min"], "p50": s["p50"], "p90": s["p90"], "max": s["max"], "mean": s["mean"],
            "total": s["total"], "share": share}


def _text(v, key: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if key == "share":
        return f"{v:.1%}"
    if isinstance(v, float):
        return f"{v:,.1f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def aligned(rows: list[dict], indent: str = "  ") -> list[str]:
    """Rows of equal keys as text columns: names left, numbers right."""
    if not rows:
        return [indent + "(no batches)"]
    keys = list(rows[0])
    cells = [[_text(r[k], k) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[j]) for c in cells)) for j, k in enumerate(keys)]
    left = [k in ("group", "quantity") for k in keys]
    fmt = lambda row: indent + "  ".join(c.ljust(w) if lf else c.rjust(w) for c, w, lf in zip(row, widths, left))  # noqa: E731
    return [fmt(keys).rstrip()] + [fmt(c).rstrip() for c in cells]
