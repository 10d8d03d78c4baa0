"""Lay samples out along one packed sequence, drawing CFG dropout and timesteps in reference order.

``SequenceBuilder.add(sample)`` follows the reference ``pack_sequence`` rules: per plan item, a text
split (BOS + ids, then an EOS that closes the split), a ViT image (start marker, patches, end
marker, one rope id for the whole image) or a VAE image (markers around latent slots, a timestep
per slot), with classifier-free-guidance dropout per item and the split/rope bookkeeping of video
frames (``split_start``/``split_end``/``frame_delta``).  Each kind is placed by its own method
(``_text``, ``_vit_image``, ``_vae_image``) on a per-sample ``_Cursor``; the random draws happen
exactly where the reference makes them, on the stream's explicit generators.  ``build()`` returns the compact
``PackedBatch``; nothing heavy (patches, padded floats, dense masks) is made here.
"""

from __future__ import annotations

import dataclasses
import random
from functools import lru_cache
from typing import Callable

import numpy as np
import torch

from prepack.engine.sample import Sample, SampleImage
from schemas.config import PackingKnobs
from schemas.errors import PackingError
from schemas.pixel_table import image_table
from schemas.packed_batch import ATTN_MODE_CODES, PackedBatch, SampleOrigin


@lru_cache(maxsize=4096)
def _extrapolated_ids(n_h: int, n_w: int, max_side: int) -> np.ndarray:
    ids = (np.arange(n_h, dtype=np.int64)[:, None] * max_side + np.arange(n_w, dtype=np.int64)).reshape(-1)
    return ids.astype(np.int32)


@lru_cache(maxsize=4096)
def _interpolated_ids(n_h: int, n_w: int, max_side: int) -> np.ndarray:
    # The reference buckets float32 fractional coordinates against float32 boundaries made by
    # torch.arange; the same torch calls give the same buckets, so use them rather than numpy.
    edges = torch.arange(1 / max_side, 1.0, 1 / max_side)
    rows = torch.bucketize(torch.arange(0, 1 - 1e-6, 1 / n_h), edges, right=True)
    cols = torch.bucketize(torch.arange(0, 1 - 1e-6, 1 / n_w), edges, right=True)
    return (rows[:, None] * max_side + cols).reshape(-1).numpy().astype(np.int32)


def position_ids(height: int, width: int, patch: int, max_side: int, interpolate: bool) -> np.ndarray:
    fn = _interpolated_ids if interpolate else _extrapolated_ids
    return fn(height // patch, width // patch, max_side)


class _Runs:
    """A sequence kept as runs: (first value, length, step 1 for a range or 0 for a repeat).

    The layout appends ranges of token positions and repeated values (a rope id, a timestep, a
    loss weight), tens of thousands of tokens a batch in a few hundred runs; appending them one
    by one to Python lists and converting those cost a few ms a batch."""

    __slots__ = ("_values", "_lens", "_steps")

    def __init__(self):
        self._values: list = []
        self._lens: list[int] = []
        self._steps: list[int] = []

    def range(self, start: int, n: int) -> None:
        """``start, start + 1, ..., start + n - 1``."""
        self._values.append(start)
        self._lens.append(n)
        self._steps.append(1)

    def repeat(self, value, n: int) -> None:
        """``value`` ``n`` times."""
        self._values.append(value)
        self._lens.append(n)
        self._steps.append(0)

    def ints(self, dtype=np.int32) -> np.ndarray:
        """The whole sequence as integers, ``np.asarray(list)`` of it element for element."""
        if not self._values:
            return np.zeros(0, dtype)
        lens = np.asarray(self._lens, np.int64)
        steps = np.asarray(self._steps, np.int64)
        offsets = np.cumsum(lens) - lens  # where each run starts in the output
        starts = np.asarray(self._values, np.int64) - steps * offsets
        ramp = np.repeat(steps, lens) * np.arange(int(lens.sum()), dtype=np.int64)
        return (np.repeat(starts, lens) + ramp).astype(dtype)

    def floats(self) -> np.ndarray:
        """The whole sequence of repeats as float64 (each value as the Python float it was)."""
        return np.repeat(np.asarray(self._values, np.float64), np.asarray(self._lens, np.int64))


@dataclasses.dataclass
class _Cursor:
    """Where one sample's layout stands: the running token position, the rope id, the open split's
    length so far and its timestep (a video's later frames reuse their split's draw)."""

    curr: int
    rope: int = 0
    split_len: int = 0
    timestep: float | None = None

    def take(self, n: int) -> int:
        """Claim ``n`` positions of the open split; returns the first."""
        start = self.curr
        self.curr += n
        self.split_len += n
        return start


class SequenceBuilder:
    """Accumulates one packed batch; ``curr`` is the reference's running token position."""

    def __init__(self, knobs: PackingKnobs, special, py_rng: random.Random, np_rng: np.random.RandomState):
        self.knobs = knobs
        self.special = special
        self.py_rng = py_rng  # the stream's random.Random: CFG dropout draws
        self.np_rng = np_rng  # the stream's RandomState: flow-matching timesteps
        self.curr = 0
        self.sample_lens: list[int] = []
        self.sample_num_splits: list[int] = []
        self.sample_num_frames: list[int] = []
        self.split_lens: list[int] = []
        self.attn_modes: list[int] = []
        self.text_ids: list[int] = []
        self.text_indexes = _Runs()
        self.position_ids = _Runs()
        self.label_ids: list[int] = []
        self.ce_indexes = _Runs()
        self.ce_weights = _Runs()
        self.images: list[SampleImage] = []
        self._image_slot: dict[int, int] = {}
        self.vit_ids: list[int] = []
        self.vit_seqlens: list[int] = []
        self.vit_pos: list[np.ndarray] = []
        self.vit_indexes = _Runs()
        self.vae_ids: list[int] = []
        self.vae_shapes: list[tuple[int, int]] = []
        self.latent_pos: list[np.ndarray] = []
        self.vae_indexes = _Runs()
        self.timesteps = _Runs()
        self.mse_indexes = _Runs()
        self.origins: list[SampleOrigin] = []

    def _slot(self, image: SampleImage) -> int:
        key = id(image)
        if key not in self._image_slot:
            self._image_slot[key] = len(self.images)
            self.images.append(image)
        return self._image_slot[key]

    def _marker(self, token: int, pos: int) -> None:
        """A single text-stream token (BOS/EOS or an image start/end marker) at ``pos``."""
        self.text_ids.append(token)
        self.text_indexes.range(pos, 1)

    def _special_loss(self, item, pos: int) -> None:
        if item.special_token_loss == 1:
            self.ce_indexes.range(pos, 1)
            self.ce_weights.repeat(1.0, 1)
            self.label_ids.append(item.special_token_label)

    def add(self, sample: Sample) -> None:
        """Append one sample (reference ``pack_sequence`` semantics, random draws included).

        Each plan item is placed by its kind's method; one that CFG dropout removes (the method
        returns False) does not close its split."""
        texts, images = iter(sample.texts), iter(sample.images)  # ViT and VAE items share one image list
        placers = {"text": (texts, self._text), "vit_image": (images, self._vit_image),
                   "vae_image": (images, self._vae_image)}
        c = _Cursor(self.curr)
        sample_len = 0
        n_splits = 0
        n_frames = 0
        n_modes_before = len(self.attn_modes)
        for item in sample.plan:
            if item.split_start:
                c.split_len = 0
            if item.kind not in placers:
                raise PackingError(f"unknown plan item kind {item.kind!r}")
            content, place = placers[item.kind]
            if not place(item, next(content), c):
                continue
            n_frames += item.video_frame
            if item.split_end:
                self.split_lens.append(c.split_len)
                n_splits += 1
                sample_len += c.split_len
        if len(self.attn_modes) - n_modes_before != n_splits:
            raise PackingError("a sample's splits and attention modes disagree (malformed multi-frame plan)")
        self.curr = c.curr
        self.sample_lens.append(sample_len)
        self.sample_num_splits.append(n_splits)
        self.sample_num_frames.append(n_frames)
        self.origins.append(sample.origin)

    def _dropped(self, item, prob: float) -> bool:
        """CFG dropout of one plan item: the one ``py_rng`` draw, made only for CFG-enabled items."""
        return item.enable_cfg == 1 and self.py_rng.random() < prob

    def _close(self, item, token: int, c: _Cursor) -> None:
        """The marker that ends an item (EOS or end of image), with its optional special-token loss."""
        self._marker(token, c.curr)
        self._special_loss(item, c.curr)
        c.take(1)

    def _open_image(self, item, prob: float, c: _Cursor) -> bool:
        """An image's start marker, or False when CFG dropout removes it (its rope id still counts)."""
        if self._dropped(item, prob):
            c.rope += 1
            return False
        self._marker(self.special.start_of_image, c.curr)
        c.take(1)
        return True

    def _text(self, item, ids: list[int], c: _Cursor) -> bool:
        """BOS + ids + EOS, causal, one rope id per token."""
        if self._dropped(item, self.knobs.text_cond_dropout_prob):
            return False
        sp = self.special
        n = len(ids) + 1
        start = c.take(n)
        self.text_ids.append(sp.bos_token_id)
        self.text_ids.extend(ids)
        self.text_indexes.range(start, n)
        if item.loss == 1:
            self.ce_indexes.range(start, n)
            self.ce_weights.repeat(1 / (n**0.5), n)
            self.label_ids.extend(ids)
            self.label_ids.append(sp.eos_token_id)
        self._close(item, sp.eos_token_id, c)
        self.attn_modes.append(ATTN_MODE_CODES["causal"])
        self.position_ids.range(c.rope, c.split_len)
        c.rope += c.split_len
        return True

    def _vit_image(self, item, image: SampleImage, c: _Cursor) -> bool:
        """Start marker, ViT patches, end marker; full attention, one rope id for the whole image."""
        k = self.knobs
        if not self._open_image(item, k.vit_cond_dropout_prob, c):
            return False
        p = k.vit_patch_size
        if image.height % p or image.width % p:
            raise PackingError(
                f"ViT image {image.width}x{image.height} is not divisible by vit_patch_size={p}: "
                "set the group's image_stride to the patch size"
            )
        n_tok = (image.height // p) * (image.width // p)
        start = c.take(n_tok)
        self.vit_indexes.range(start, n_tok)
        self.vit_ids.append(self._slot(image))
        self.vit_seqlens.append(n_tok)
        self.vit_pos.append(position_ids(image.height, image.width, p, k.max_num_patch_per_side, k.interpolate_pos))
        self._close(item, self.special.end_of_image, c)
        self.attn_modes.append(ATTN_MODE_CODES["full"])
        self.position_ids.repeat(c.rope, c.split_len)
        c.rope += 1
        return True

    def _vae_image(self, item, image: SampleImage, c: _Cursor) -> bool:
        """Start marker, latent slots (a timestep each), end marker; a video frame may continue its
        split (``split_start`` false) and moves the rope id by ``frame_delta``."""
        k = self.knobs
        if not self._open_image(item, k.vae_cond_dropout_prob, c):
            return False
        d = k.vae_image_downsample
        self.vae_ids.append(self._slot(image))
        self.latent_pos.append(position_ids(image.height, image.width, d, k.max_latent_size, k.interpolate_pos))
        h, w = image.height // d, image.width // d
        self.vae_shapes.append((h, w))
        n_tok = h * w
        start = c.take(n_tok)
        self.vae_indexes.range(start, n_tok)
        if item.loss == 1:
            self.mse_indexes.range(start, n_tok)
            if item.split_start:
                c.timestep = self.np_rng.randn()
            elif c.timestep is None:
                raise PackingError("a continued VAE split with loss has no timestep (malformed video plan)")
        else:
            c.timestep = float("-inf")
        self.timesteps.repeat(c.timestep, n_tok)
        self._close(item, self.special.end_of_image, c)
        if item.split_start:
            noisy = item.loss == 1 and item.frame_delta is None
            self.attn_modes.append(ATTN_MODE_CODES["noise" if noisy else "full"])
        self.position_ids.repeat(c.rope, n_tok + 2)
        if item.frame_delta is not None:
            c.rope += item.frame_delta
        elif item.loss == 0:
            c.rope += 1
        return True

    def build(self, alloc: Callable[[int], np.ndarray] | None = None) -> PackedBatch:
        """The compact batch; pixels are resized here (once per distinct picture).  ``alloc``: where
        the pixel table goes (``image_table``)."""
        k = self.knobs
        table = image_table(self.images, alloc)  # each image resized (or taken) straight into its slot
        cat = lambda parts: np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32)  # noqa: E731
        return PackedBatch(
            use_flex=k.use_flex,
            max_num_tokens=k.max_num_tokens,
            vit_patch_size=k.vit_patch_size,
            sequence_length=int(sum(self.sample_lens)),
            sample_lens=np.asarray(self.sample_lens, np.int32),
            sample_num_splits=np.asarray(self.sample_num_splits, np.int32),
            sample_num_frames=np.asarray(self.sample_num_frames, np.int32),
            split_lens=np.asarray(self.split_lens, np.int32),
            attn_modes=np.asarray(self.attn_modes, np.uint8),
            packed_text_ids=np.asarray(self.text_ids, np.int32),
            packed_text_indexes=self.text_indexes.ints(),
            packed_position_ids=self.position_ids.ints(),
            packed_label_ids=np.asarray(self.label_ids, np.int32),
            ce_loss_indexes=self.ce_indexes.ints(),
            ce_loss_weights=self.ce_weights.floats().astype(np.float32),
            **table,
            image_norm=np.asarray([img.norm for img in self.images], np.float64).reshape(-1, 6),
            vit_image_ids=np.asarray(self.vit_ids, np.int32),
            vit_token_seqlens=np.asarray(self.vit_seqlens, np.int32),
            packed_vit_position_ids=cat(self.vit_pos),
            packed_vit_token_indexes=self.vit_indexes.ints(),
            vae_image_ids=np.asarray(self.vae_ids, np.int32),
            vae_latent_shapes=np.asarray(self.vae_shapes, np.int32).reshape(-1, 2),
            packed_latent_position_ids=cat(self.latent_pos),
            packed_vae_token_indexes=self.vae_indexes.ints(),
            packed_timesteps=self.timesteps.floats().astype(np.float32),
            mse_loss_indexes=self.mse_indexes.ints(),
            origins=list(self.origins),
        )
