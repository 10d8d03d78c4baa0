"""A packed batch's anatomy: every field's kind, and which sample owns each row (issue 50).

Why its own module: ``prepack.engine.step_split`` cuts samples out of a batch and joins them into
another by this table alone, so no field of ``schemas.packed_batch.PackedBatch`` can be left out of a
balanced pack unsaid: a field without a kind fails here, at import (``check_field_kinds``).  The
record (its fields, their storage) stays ``schemas.record``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

from schemas.errors import PackingError
from schemas.packed_batch import PackedBatch

# Every field's kind, in one place: what one entry of it is one of (its rows) and what the entries
# hold (its values).  ``prepack.engine.step_split`` cuts samples out of a batch and joins them into
# another by this table alone, so no field of ``PackedBatch`` can be left out of a balanced pack
# unsaid: one without a kind fails at import (``check_field_kinds``).
# Rows:
BATCH = "batch"  # none: one value for the whole batch
SAMPLE = "sample"  # one per sample, in order
SPLIT = "split"  # one per split: a sample's are its sample_num_splits, after those of the samples before it
POSITION = "position"  # one per position of the sequence: a sample's are its span (sample_lens)
TEXT, CE, MSE = "text", "ce", "mse"  # text, CE-loss and MSE-loss tokens: a sample's are those in its span
VIT, VAE = "vit", "vae"  # one per ViT / VAE use of an image: a sample's have their first token in its span
VIT_TOKEN, VAE_TOKEN = "vit_token", "vae_token"  # the tokens of those uses, use after use
IMAGE = "image"  # one per image of the pixel table: a sample holds those it uses (two samples may share one)
# Values:
VALUE = "value"  # the sample's own: carried as they are
POSITIONS = "positions"  # positions in the sequence: where the sample lies, so they move with it
IMAGE_IDS = "image_ids"  # images of the table: renumbered when a table is made of some samples' images
LENGTH = "length"  # the sum of sample_lens
OFFSETS = "offsets"  # [n_images + 1]: where each image's pixels start, from their sizes
PIXELS = "pixels"  # the images' coded pixels, image after image (``PackedBatch.coded_image``)
NOT_STORED = "not_stored"  # the writer's notes on a batch it packed: not in the record, so never carried


@dataclass(frozen=True)
class FieldKind:
    """A field's kind: what one entry of it is one of, and what the entries hold."""

    rows: str
    values: str = VALUE


FIELD_KINDS: dict[str, FieldKind] = {
    "use_flex": FieldKind(BATCH), "max_num_tokens": FieldKind(BATCH), "vit_patch_size": FieldKind(BATCH),
    "sequence_length": FieldKind(BATCH, LENGTH),
    "sample_lens": FieldKind(SAMPLE), "sample_num_splits": FieldKind(SAMPLE), "sample_num_frames": FieldKind(SAMPLE),
    "split_lens": FieldKind(SPLIT), "attn_modes": FieldKind(SPLIT),
    "packed_text_ids": FieldKind(TEXT), "packed_text_indexes": FieldKind(TEXT, POSITIONS),
    "packed_position_ids": FieldKind(POSITION),
    "packed_label_ids": FieldKind(CE), "ce_loss_indexes": FieldKind(CE, POSITIONS), "ce_loss_weights": FieldKind(CE),
    "image_heights": FieldKind(IMAGE), "image_widths": FieldKind(IMAGE), "image_offsets": FieldKind(IMAGE, OFFSETS),
    "image_pixels": FieldKind(IMAGE, PIXELS), "image_norm": FieldKind(IMAGE),
    "vit_image_ids": FieldKind(VIT, IMAGE_IDS), "vit_token_seqlens": FieldKind(VIT),
    "packed_vit_position_ids": FieldKind(VIT_TOKEN), "packed_vit_token_indexes": FieldKind(VIT_TOKEN, POSITIONS),
    "vae_image_ids": FieldKind(VAE, IMAGE_IDS), "vae_latent_shapes": FieldKind(VAE),
    "packed_latent_position_ids": FieldKind(VAE_TOKEN), "packed_vae_token_indexes": FieldKind(VAE_TOKEN, POSITIONS),
    "packed_timesteps": FieldKind(VAE_TOKEN), "mse_loss_indexes": FieldKind(MSE, POSITIONS),
    "origins": FieldKind(SAMPLE),
    "image_sources": FieldKind(IMAGE, NOT_STORED), "image_stored": FieldKind(IMAGE, NOT_STORED),
}  # fmt: skip
SAMPLE_ROWS = (SAMPLE, SPLIT, POSITION, TEXT, CE, MSE, VIT, VAE, VIT_TOKEN, VAE_TOKEN)  # the rows samples own
_ROW_VALUES = (VALUE, POSITIONS, IMAGE_IDS)  # one entry per row
# the values each kind of rows may hold: what a cut and a join know how to carry
KIND_VALUES = {BATCH: (VALUE, LENGTH), IMAGE: (VALUE, OFFSETS, PIXELS, NOT_STORED),
               **dict.fromkeys(SAMPLE_ROWS, _ROW_VALUES)}


def check_field_kinds(cls: type = PackedBatch) -> None:
    """Every field of ``cls`` has a known kind, every kind a field, and the record stores all but
    those of kind ``NOT_STORED``."""
    names = {f.name for f in fields(cls)}
    if names != set(FIELD_KINDS):
        raise TypeError(f"{cls.__name__}: fields without a kind in FIELD_KINDS: {sorted(names - set(FIELD_KINDS))}, "
                        f"kinds of no field: {sorted(set(FIELD_KINDS) - names)}")
    for f in fields(cls):
        kind = FIELD_KINDS[f.name]
        if kind.values not in KIND_VALUES.get(kind.rows, ()):
            raise TypeError(f"{cls.__name__}.{f.name}: no such kind {kind}")
        if f.metadata.get("stored", True) == (kind.values == NOT_STORED):
            raise TypeError(f"{cls.__name__}.{f.name}: its metadata's 'stored' disagrees with its kind {kind}")


check_field_kinds()


@dataclass(frozen=True)
class Anatomy:
    """Which sample owns each row of a packed batch's fields (``batch_anatomy``)."""

    starts: np.ndarray  # int64 [n_samples + 1]: sample i spans positions starts[i]:starts[i + 1]
    owners: dict[str, np.ndarray]  # per kind of ``SAMPLE_ROWS``: the sample of each row
    use_images: np.ndarray  # per image use (ViT uses, then VAE uses): its image in the table
    use_first: np.ndarray  # per image use: the position of its first token
    use_owner: np.ndarray  # per image use: its sample
    num_images: int
    groups: dict[str, tuple[np.ndarray, np.ndarray]] = field(repr=False)  # per kind: rows by sample, bounds

    @property
    def num_samples(self) -> int:
        return len(self.starts) - 1

    def owner(self, positions) -> np.ndarray:
        """The sample whose span holds each position (-1 or ``num_samples`` outside them all)."""
        return _owner(self.starts, positions)

    def rows(self, kind: str, sample: int) -> np.ndarray:
        """The rows of ``kind`` that ``sample`` owns, in order."""
        order, bounds = self.groups[kind]
        return order[bounds[sample]:bounds[sample + 1]]

    def sample_images(self, sample: int) -> np.ndarray:
        """The images ``sample`` uses in the order of their first use in it (the packer's order)."""
        uses = np.flatnonzero(self.use_owner == sample)
        by_first = uses[np.lexsort((self.use_images[uses], self.use_first[uses]))]
        images = self.use_images[by_first]
        _, once = np.unique(images, return_index=True)
        return images[np.sort(once)]

    def image_first(self) -> np.ndarray:
        """Each image's first position in the sequence (-1: an image nothing uses)."""
        none = np.iinfo(np.int64).max
        out = np.full(self.num_images, none, np.int64)
        np.minimum.at(out, self.use_images, self.use_first)
        return np.where(out == none, -1, out)


def _owner(starts: np.ndarray, positions) -> np.ndarray:
    return np.searchsorted(starts, np.asarray(positions, np.int64), side="right") - 1


def _first_tokens(positions: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The first of each run of ``counts`` consecutive entries of ``positions``."""
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64) if len(counts) else np.zeros(0, np.int64)
    return np.asarray(positions, np.int64)[starts]


def batch_anatomy(batch: PackedBatch) -> Anatomy:
    """``batch``'s anatomy.  A batch whose fields disagree on how many rows a kind has, with rows
    outside its samples or uses of images not in its table is a ``PackingError``."""

    def check(kind: str, n: int) -> None:
        for name, k in FIELD_KINDS.items():
            if k.rows == kind and k.values in _ROW_VALUES and len(getattr(batch, name)) != n:
                raise PackingError(f"a batch's {name} has {len(getattr(batch, name))} rows, its {kind} rows are {n}")

    sl = np.asarray(batch.sample_lens, np.int64)
    n, n_images = len(sl), len(batch.image_heights)
    starts = np.concatenate([[0], np.cumsum(sl)]).astype(np.int64)
    if int(starts[-1]) != int(batch.sequence_length):
        raise PackingError(f"a batch's samples span {int(starts[-1])} tokens, its sequence {batch.sequence_length}")
    check(SAMPLE, n)
    check(IMAGE, n_images)
    # a kind's positions / images: its field of those values
    at = {k.rows: getattr(batch, name) for name, k in FIELD_KINDS.items() if k.values == POSITIONS}
    image_of = {k.rows: getattr(batch, name) for name, k in FIELD_KINDS.items() if k.values == IMAGE_IDS}
    owners = {SAMPLE: np.arange(n), SPLIT: np.repeat(np.arange(n), np.asarray(batch.sample_num_splits, np.int64)),
              POSITION: np.repeat(np.arange(n), sl), **{kind: _owner(starts, at[kind]) for kind in (TEXT, CE, MSE)}}
    first = {}
    tokens_per_use = {VIT: np.asarray(batch.vit_token_seqlens, np.int64),
                      VAE: np.prod(np.asarray(batch.vae_latent_shapes, np.int64).reshape(-1, 2), axis=1)}
    for use, tokens in ((VIT, VIT_TOKEN), (VAE, VAE_TOKEN)):
        counts = tokens_per_use[use]
        check(use, len(counts))
        check(tokens, int(counts.sum()))
        first[use] = _first_tokens(at[tokens], counts)
        owners[use] = _owner(starts, first[use])
        owners[tokens] = np.repeat(owners[use], counts)
    groups = {}
    for kind in SAMPLE_ROWS:
        of = owners[kind]
        check(kind, len(of))
        if len(of) and (of.min() < 0 or of.max() >= n):
            raise PackingError(f"a batch's {kind} rows lie outside its samples")
        order = np.argsort(of, kind="stable")
        groups[kind] = (order, np.searchsorted(of[order], np.arange(n + 1)))
    use_images = np.concatenate([image_of[VIT], image_of[VAE]]).astype(np.int64)
    if len(use_images) and (use_images.min() < 0 or use_images.max() >= n_images):
        raise PackingError(f"a batch's image uses name images outside its table of {n_images}")
    return Anatomy(starts, owners, use_images, np.concatenate([first[VIT], first[VAE]]),
                   np.concatenate([owners[VIT], owners[VAE]]), n_images, groups)
