"""Balanced samples (``prepack: balance: samples``): one optimizer step's samples re-split among its W batches.

Why it is exact: inside a packed batch every sample attends only to itself (per-sample masks,
varlen ViT), so a sample without VAE images computes the same in any batch; a sample with a VAE
image stays in its reference batch (the VAE encodes a batch's images on one canvas padded to its
largest); and NeMo's BAGEL recipe divides its losses by the whole step's token counts.  Which
samples move is ``prepack.engine.resplit.balance_samples``'s choice, from each sample's cost.

A sample is cut out of its batch with its own arrays (``BatchSample``: positions relative to its
span, its images as its own small table) and joined into another batch at a new offset, each field
as its kind says (``schemas.record.FIELD_KINDS``: a new field is carried by its kind, or
``schemas.record`` refuses to import), so each sample's tensors are the reference's: its token ids,
labels, loss weights, rope and latent position ids, timesteps, split lengths, attention modes and
pixels, only where it lies in the sequence changes.  Joining a batch's own samples in their order
gives the batch back, byte for byte (an image is placed where its first use is, as the packer
places it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
import xxhash

from prepack.engine.resplit import balance_samples, samples_of
from schemas.cost import CostModel
from schemas.anatomy import (BATCH, FIELD_KINDS, IMAGE, IMAGE_IDS, LENGTH, OFFSETS, PIXELS, POSITIONS, VALUE,
                             batch_anatomy)
from schemas.pixel_table import StoredImage
from schemas.packed_batch import PackedBatch, SampleOrigin
from schemas.record import ARRAY_DTYPES

# the fields a sample owns rows of, and those of the image table a picture takes along (``FIELD_KINDS``)
_ROW_FIELDS = [(name, k.values) for name, k in FIELD_KINDS.items() if k.rows not in (BATCH, IMAGE)]
_IMAGE_FIELDS = [name for name, k in FIELD_KINDS.items() if k.rows == IMAGE and k.values == VALUE]


@dataclass(frozen=True)
class SampleImage:
    """One picture a sample uses: its row of each per-image field, its coded pixels (``PackedBatch.coded_image``)."""

    rows: dict[str, np.ndarray]  # per field of ``_IMAGE_FIELDS``: its one row
    coded: "np.ndarray | StoredImage"  # its coded pixels, or its compressed frame to pass through
    key: tuple[int, int]  # (the batch it came from, its id there): one picture used twice stays one

    def digest(self) -> bytes:
        """XXH3-64 of its coded pixels (big-endian), known without decompressing a frame."""
        if isinstance(self.coded, StoredImage):
            return int(self.coded.digest).to_bytes(8, "big")
        return xxhash.xxh3_64_digest(np.ascontiguousarray(self.coded).data)


@dataclass(frozen=True)
class BatchSample:
    """One sample of a packed batch: its rows of every field that has rows per sample, split, position,
    token or image use (``_ROW_FIELDS``), positions relative to the start of its span, image ids into
    ``images``."""

    rows: dict[str, np.ndarray | list]
    images: tuple[SampleImage, ...]

    @property
    def length(self) -> int:
        return int(self.rows["sample_lens"][0])

    @property
    def origin(self) -> SampleOrigin:
        return self.rows["origins"][0]

    @property
    def has_vae(self) -> bool:
        return len(self.rows["vae_image_ids"]) > 0

    def digest(self) -> str:
        """XXH3-128 of everything the sample is (not where it lies): equal digests, identical tensors."""
        h = xxhash.xxh3_128()
        for name, a in self.rows.items():
            h.update(name.encode())
            if isinstance(a, list):
                h.update(repr([sorted(vars(x).items()) for x in a]).encode())
                continue
            a = np.ascontiguousarray(a)
            h.update(len(a).to_bytes(8, "little"))
            h.update(a.view(np.uint8).data)
        for img in self.images:
            for name, a in img.rows.items():
                h.update(name.encode())
                h.update(np.ascontiguousarray(a).view(np.uint8).data)
            h.update(img.digest())
        return h.hexdigest()


def split_batch(batch: PackedBatch, tag: int = 0) -> list[BatchSample]:
    """The samples of ``batch`` in their order; ``tag`` names the batch in each picture's key."""
    body = batch_anatomy(batch)
    columns = {name: getattr(batch, name) for name, _ in _ROW_FIELDS}
    out = []
    for i in range(body.num_samples):
        start = int(body.starts[i])
        pictures = body.sample_images(i)
        local = np.zeros(body.num_images, np.int64)
        local[pictures] = np.arange(len(pictures))
        rows: dict[str, np.ndarray | list] = {}
        for name, values in _ROW_FIELDS:
            mine, column = body.rows(FIELD_KINDS[name].rows, i), columns[name]
            if name not in ARRAY_DTYPES:  # a list (origins)
                rows[name] = [column[j] for j in mine.tolist()]
                continue
            a = np.asarray(column)[mine]
            if values == POSITIONS:
                a = a.astype(np.int64) - start
            elif values == IMAGE_IDS:
                a = local[a]
            rows[name] = a.astype(ARRAY_DTYPES[name], copy=False)
        images = tuple(SampleImage({name: np.asarray(getattr(batch, name)[img:img + 1]) for name in _IMAGE_FIELDS},
                                   _coded(batch, img), (tag, img)) for img in pictures.tolist())
        out.append(BatchSample(rows, images))
    return out


def _coded(batch: PackedBatch, img: int) -> "np.ndarray | StoredImage":
    """Image ``img``'s coded pixels, or its frame where the batch holds it as one (passed through)."""
    stored = batch.image_stored[img] if img < len(batch.image_stored) else None
    if stored is not None and stored.frame is not None:
        return stored
    return np.asarray(batch.coded_image(img))


def _pixel_table(pictures: "list[SampleImage]") -> tuple[np.ndarray, list]:
    """The pictures' coded pixels one after the other, and ``image_stored``: a frame passed through
    leaves its slot unwritten (``PackedBatch.image_stored``)."""
    sizes = [p.coded.size for p in pictures]
    table = np.empty(sum(sizes), np.uint8)
    stored: list = []
    at = 0
    for p, n in zip(pictures, sizes):
        if isinstance(p.coded, StoredImage):
            stored.append(p.coded)
        else:
            table[at:at + n] = p.coded.reshape(-1)
            stored.append(None)
        at += n
    return table, stored if any(x is not None for x in stored) else []


_EMPTY = {f.name: f.default_factory() for f in fields(PackedBatch) if f.name in ARRAY_DTYPES}  # shaped (0, ...)


def _cat(name: str, parts: list[np.ndarray]) -> np.ndarray:
    """A field's rows of some samples or pictures, one after the other."""
    return np.concatenate([_EMPTY[name][:0], *parts]).astype(ARRAY_DTYPES[name], copy=False)


def join_samples(samples: Sequence[BatchSample], like: PackedBatch) -> PackedBatch:
    """One packed batch of ``samples`` in this order (``like``: the flex, token budget and patch size)."""
    table: dict[tuple[int, int], int] = {}
    pictures: list[SampleImage] = []
    parts: dict[str, list] = {name: [] for name, _ in _ROW_FIELDS}
    at = 0
    for smp in samples:
        ids = []
        for img in smp.images:
            if img.key not in table:
                table[img.key] = len(pictures)
                pictures.append(img)
            ids.append(table[img.key])
        ids = np.asarray(ids, np.int64)
        for name, values in _ROW_FIELDS:
            a = smp.rows[name]
            parts[name].append(a.astype(np.int64) + at if values == POSITIONS else ids[a] if values == IMAGE_IDS else a)
        at += smp.length
    out = {}
    for name, kind in FIELD_KINDS.items():
        if kind.rows == BATCH:
            out[name] = at if kind.values == LENGTH else getattr(like, name)
        elif kind.rows != IMAGE:
            out[name] = _cat(name, parts[name]) if name in ARRAY_DTYPES else [x for part in parts[name] for x in part]
        elif kind.values == VALUE:
            out[name] = _cat(name, [p.rows[name] for p in pictures])
        elif kind.values == PIXELS:
            out[name], out["image_stored"] = _pixel_table(pictures)
        elif kind.values == OFFSETS:
            out[name] = np.concatenate([[0], np.cumsum([p.coded.size for p in pictures])]).astype(np.int64)
    return PackedBatch(**out)  # the fields not stored keep their empty defaults


def split_step(batches: Sequence[PackedBatch], model: CostModel) -> list[PackedBatch]:
    """Step t's W reference batches -> its W balanced batches: the same samples (a multiset), each
    batch within its token budget (or its reference size, where that was more), none costlier than
    the reference's costliest; a batch no sample left or entered comes back byte for byte."""
    if not batches:
        return []
    parts = [split_batch(b, tag=i) for i, b in enumerate(batches)]
    seen = [samples_of(b, model) for b in batches]
    plan = balance_samples([s for s, _ in seen], [int(b.max_num_tokens) for b in batches], [f for _, f in seen])
    out = []
    for b, take in enumerate(plan):
        if take == [(b, s) for s in range(len(parts[b]))]:
            out.append(batches[b])
        else:
            out.append(join_samples([parts[src][s] for src, s in take], batches[b]))
    return out
