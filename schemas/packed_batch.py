"""A packed batch in memory (``PackedBatch``): the compact, exact content of one reference batch.

- integer token-level arrays as int32 (the loader widens them to the reference's int64);
- images as the uint8 HWC pixels the resize produced, each stored once (an edit frame used as
  both a VAE condition and a VAE target is one image referenced twice), row-delta coded (PNG's
  "Sub" filter: ``schemas.pixel_table.decode_rows`` undoes it), plus per-image normalisation
  (mean, std) so the loader rebuilds the float tensors bit-identically;
- ``split_lens`` / ``attn_modes`` per sample (dense masks and flex padding are derived);
- the reference's ``batch_data_indexes`` and, for lineage, where each sample came from
  (``SampleOrigin``).

``packed_vit_tokens``, ``padded_images`` and ``nested_attention_masks`` are never held: the loader
derives them.  How a batch is stored on disk is ``schemas.record``'s; how it is cut into its
samples, ``schemas.anatomy``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

from schemas.pixel_table import decode_rows

ATTN_MODES = ("causal", "full", "noise")
ATTN_MODE_CODES = {name: code for code, name in enumerate(ATTN_MODES)}


def _i32() -> np.ndarray:
    return np.zeros(0, dtype=np.int32)


@dataclass
class SampleOrigin:
    """Where one packed sample came from: the reference's index plus the physical source row.

    ``data_indexes`` is exactly the reference's ``data_indexes`` value (an int for JSONL rows, a
    list for parquet rows); ``scalar`` says which.  ``source_file``/``source_row_group``/
    ``source_row`` locate the row on disk (JSONL: line number; row group -1).
    """

    group: str
    dataset: str
    worker_id: int
    data_indexes: list[int]
    scalar: bool
    source_file: str
    source_row_group: int
    source_row: int

    def reference_dict(self) -> dict:
        """The reference's ``batch_data_indexes`` entry for this sample."""
        value = int(self.data_indexes[0]) if self.scalar else [int(v) for v in self.data_indexes]
        return {"data_indexes": value, "worker_id": int(self.worker_id), "dataset_name": self.group}


@dataclass
class PackedBatch:
    """One packed batch in compact form. Arrays are numpy; see module doc for dtypes."""

    use_flex: bool
    max_num_tokens: int
    vit_patch_size: int
    sequence_length: int
    sample_lens: np.ndarray = field(default_factory=_i32)  # int32 [n_samples]
    sample_num_splits: np.ndarray = field(default_factory=_i32)  # int32 [n_samples]
    sample_num_frames: np.ndarray = field(default_factory=_i32)  # int32 [n_samples]: of its images, video frames
    split_lens: np.ndarray = field(default_factory=_i32)  # int32 [n_splits]
    attn_modes: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))  # codes
    packed_text_ids: np.ndarray = field(default_factory=_i32)
    packed_text_indexes: np.ndarray = field(default_factory=_i32)
    packed_position_ids: np.ndarray = field(default_factory=_i32)
    packed_label_ids: np.ndarray = field(default_factory=_i32)
    ce_loss_indexes: np.ndarray = field(default_factory=_i32)
    ce_loss_weights: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    # image table: pixels of image i are image_pixels[image_offsets[i]:image_offsets[i+1]],
    # shaped (image_heights[i], image_widths[i], 3)
    image_heights: np.ndarray = field(default_factory=_i32)
    image_widths: np.ndarray = field(default_factory=_i32)
    image_offsets: np.ndarray = field(default_factory=lambda: np.zeros(1, np.int64))
    image_pixels: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))
    image_norm: np.ndarray = field(default_factory=lambda: np.zeros((0, 6), np.float64))
    vit_image_ids: np.ndarray = field(default_factory=_i32)
    vit_token_seqlens: np.ndarray = field(default_factory=_i32)
    packed_vit_position_ids: np.ndarray = field(default_factory=_i32)
    packed_vit_token_indexes: np.ndarray = field(default_factory=_i32)
    vae_image_ids: np.ndarray = field(default_factory=_i32)
    vae_latent_shapes: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int32))
    packed_latent_position_ids: np.ndarray = field(default_factory=_i32)
    packed_vae_token_indexes: np.ndarray = field(default_factory=_i32)
    packed_timesteps: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    mse_loss_indexes: np.ndarray = field(default_factory=_i32)
    origins: list[SampleOrigin] = field(default_factory=list)
    # where each image of the table came from (``schemas.pixel_index.PictureSource`` or None), for the
    # shard's pixel index: never part of the record (empty for a batch read back)
    image_sources: list = field(default_factory=list, compare=False, repr=False, metadata={"stored": False})
    # per image, None or the ``StoredImage`` it was taken from; an image with a frame to pass through
    # (``StoredImage.frame``) has its slot of ``image_pixels`` left unwritten: ``image(i)`` and
    # ``encode_record`` read the frame instead (empty for a batch read back)
    image_stored: list = field(default_factory=list, compare=False, repr=False, metadata={"stored": False})

    def __post_init__(self) -> None:
        if len(self.sample_num_frames) == 0 and len(self.sample_lens):  # made without it: no video frames
            self.sample_num_frames = np.zeros(len(self.sample_lens), np.int32)

    @property
    def num_samples(self) -> int:
        return int(len(self.sample_lens))

    def image(self, i: int) -> np.ndarray:
        """Image i as decoded (h, w, 3) uint8 pixels."""
        return decode_rows(self.coded_image(i).reshape(int(self.image_heights[i]), int(self.image_widths[i]), 3))

    def coded_image(self, i: int) -> np.ndarray:
        """Image i's row-delta coded bytes, flat (from its frame when its slot was left unwritten)."""
        stored = self.image_stored[i] if i < len(self.image_stored) else None
        if stored is not None and stored.frame is not None:
            return stored.coded_pixels()
        return self.image_pixels[int(self.image_offsets[i]):int(self.image_offsets[i + 1])]

    def sample_splits(self) -> list[tuple[list[int], list[str]]]:
        """Per sample: its split lengths and attention-mode names."""
        out, pos = [], 0
        for n in self.sample_num_splits.tolist():
            out.append(
                (self.split_lens[pos : pos + n].tolist(), [ATTN_MODES[c] for c in self.attn_modes[pos : pos + n]])
            )
            pos += n
        return out


def batch_fields() -> list[str]:
    """Names of PackedBatch fields, in declaration order (for comparisons and reports)."""
    return [f.name for f in fields(PackedBatch) if f.metadata.get("stored", True)]
