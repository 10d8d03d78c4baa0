"""Balanced samples (``prepack: balance: samples``): one optimizer step's samples re-split among its W batches.

Why it is exact: inside a packed batch every sample attends only to itself (per-sample masks,
varlen ViT), so a sample without VAE images computes the same in any batch; a sample with a VAE
image stays in its reference batch (the VAE encodes a batch's images on one canvas padded to its
largest); and NeMo's BAGEL recipe divides its losses by the whole step's token counts.  Which
samples move is ``prepack.engine.resplit.balance_samples``'s choice, from each sample's cost.

A sample is cut out of its batch with its own arrays (``BatchSample``: positions relative to its
span, its images as its own small table) and joined into another batch at a new offset, so each
sample's tensors are the reference's: its token ids, labels, loss weights, rope and latent
position ids, timesteps, split lengths, attention modes and pixels, only where it lies in the
sequence changes.  Joining a batch's own samples in their order gives the batch back, byte for byte
(an image is placed where its first use is, as the packer places it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from prepack.engine.resplit import balance_samples, samples_of
from schemas.cost import CostModel
from schemas.errors import PackingError
from schemas.record import PackedBatch, SampleOrigin

_I32 = np.int32


@dataclass(frozen=True)
class SampleImage:
    """One picture a sample uses: its coded pixels (``PackedBatch.coded_image``), size and norm."""

    height: int
    width: int
    coded: np.ndarray
    norm: np.ndarray  # (6,) float64
    key: tuple[int, int]  # (the batch it came from, its id there): one picture used twice stays one


@dataclass(frozen=True)
class BatchSample:
    """One sample of a packed batch, its positions relative to the start of its span."""

    length: int
    split_lens: np.ndarray
    attn_modes: np.ndarray
    num_frames: int
    text_ids: np.ndarray
    text_pos: np.ndarray
    position_ids: np.ndarray
    label_ids: np.ndarray
    ce_pos: np.ndarray
    ce_weights: np.ndarray
    images: tuple[SampleImage, ...]
    vit_images: np.ndarray  # per ViT use: its picture in ``images``
    vit_seqlens: np.ndarray
    vit_position_ids: np.ndarray
    vit_pos: np.ndarray
    vae_images: np.ndarray  # per VAE use: its picture in ``images``
    vae_shapes: np.ndarray  # (n, 2)
    latent_position_ids: np.ndarray
    vae_pos: np.ndarray
    timesteps: np.ndarray
    mse_pos: np.ndarray
    origin: SampleOrigin

    @property
    def has_vae(self) -> bool:
        return len(self.vae_images) > 0

    def digest(self) -> str:
        """XXH3-128 of everything the sample is (not where it lies): equal digests, identical tensors."""
        h = xxhash.xxh3_128()
        for name in ("split_lens", "attn_modes", "text_ids", "text_pos", "position_ids", "label_ids", "ce_pos",
                     "ce_weights", "vit_images", "vit_seqlens", "vit_position_ids", "vit_pos", "vae_images",
                     "vae_shapes", "latent_position_ids", "vae_pos", "timesteps", "mse_pos"):
            a = np.ascontiguousarray(getattr(self, name))
            h.update(name.encode())
            h.update(len(a).to_bytes(8, "little"))
            h.update(a.view(np.uint8).data)
        h.update(repr((self.length, self.num_frames, sorted(vars(self.origin).items()))).encode())
        for img in self.images:
            h.update(repr((img.height, img.width)).encode())
            h.update(np.ascontiguousarray(img.norm, "<f8").view(np.uint8).data)
            h.update(xxhash.xxh3_64_digest(np.ascontiguousarray(img.coded).data))
        return h.hexdigest()


def _runs(positions: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per run of ``lengths`` consecutive entries of ``positions``: its first position, and per entry its run."""
    lengths = np.asarray(lengths, np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if len(lengths) else lengths
    return np.asarray(positions, np.int64)[starts], np.repeat(np.arange(len(lengths)), lengths)


def split_batch(batch: PackedBatch, tag: int = 0) -> list[BatchSample]:
    """The samples of ``batch`` in their order; ``tag`` names the batch in each picture's key."""
    sl = np.asarray(batch.sample_lens, np.int64)
    bounds = np.concatenate([[0], np.cumsum(sl)])
    if int(bounds[-1]) != int(batch.sequence_length):
        raise PackingError(f"a batch's samples span {int(bounds[-1])} tokens, its sequence {batch.sequence_length}")

    def owner(pos) -> np.ndarray:
        return np.searchsorted(bounds, np.asarray(pos, np.int64), side="right") - 1

    seqlens = np.asarray(batch.vit_token_seqlens, np.int64)
    vit_first, vit_run = _runs(batch.packed_vit_token_indexes, seqlens)
    shapes = np.asarray(batch.vae_latent_shapes, np.int64).reshape(-1, 2)
    vae_first, vae_run = _runs(batch.packed_vae_token_indexes, shapes[:, 0] * shapes[:, 1])
    if len(batch.packed_timesteps) != len(batch.packed_vae_token_indexes):
        raise PackingError("a batch's timesteps and VAE token positions disagree in length")
    vit_of, vae_of = owner(vit_first), owner(vae_first)
    text_of, ce_of, mse_of = owner(batch.packed_text_indexes), owner(batch.ce_loss_indexes), owner(batch.mse_loss_indexes)
    splits = np.concatenate([[0], np.cumsum(np.asarray(batch.sample_num_splits, np.int64))])
    out = []
    for i in range(len(sl)):
        a = int(bounds[i])
        vit_uses, vae_uses = np.flatnonzero(vit_of == i), np.flatnonzero(vae_of == i)
        # the sample's pictures in the order of their first use, as the packer's slots are
        first_use: dict[int, int] = {}
        for ids, first, uses in ((batch.vit_image_ids, vit_first, vit_uses), (batch.vae_image_ids, vae_first, vae_uses)):
            for u in uses.tolist():
                img = int(ids[u])
                first_use[img] = min(first_use.get(img, 1 << 62), int(first[u]))
        order = sorted(first_use, key=lambda img: (first_use[img], img))
        local = {img: n for n, img in enumerate(order)}
        images = tuple(SampleImage(int(batch.image_heights[img]), int(batch.image_widths[img]),
                                   np.asarray(batch.coded_image(img)), np.asarray(batch.image_norm[img], np.float64),
                                   (tag, img)) for img in order)
        vit_tok, vae_tok = np.isin(vit_run, vit_uses), np.isin(vae_run, vae_uses)
        s, e = int(splits[i]), int(splits[i + 1])
        out.append(BatchSample(
            length=int(sl[i]),
            split_lens=np.asarray(batch.split_lens[s:e], _I32),
            attn_modes=np.asarray(batch.attn_modes[s:e], np.uint8),
            num_frames=int(batch.sample_num_frames[i]) if len(batch.sample_num_frames) else 0,
            text_ids=np.asarray(batch.packed_text_ids, _I32)[text_of == i],
            text_pos=(np.asarray(batch.packed_text_indexes, np.int64)[text_of == i] - a).astype(_I32),
            position_ids=np.asarray(batch.packed_position_ids[a:a + int(sl[i])], _I32),
            label_ids=np.asarray(batch.packed_label_ids, _I32)[ce_of == i],
            ce_pos=(np.asarray(batch.ce_loss_indexes, np.int64)[ce_of == i] - a).astype(_I32),
            ce_weights=np.asarray(batch.ce_loss_weights, np.float32)[ce_of == i],
            images=images,
            vit_images=np.asarray([local[int(batch.vit_image_ids[u])] for u in vit_uses.tolist()], _I32),
            vit_seqlens=seqlens[vit_uses].astype(_I32),
            vit_position_ids=np.asarray(batch.packed_vit_position_ids, _I32)[vit_tok],
            vit_pos=(np.asarray(batch.packed_vit_token_indexes, np.int64)[vit_tok] - a).astype(_I32),
            vae_images=np.asarray([local[int(batch.vae_image_ids[u])] for u in vae_uses.tolist()], _I32),
            vae_shapes=shapes[vae_uses].astype(_I32).reshape(-1, 2),
            latent_position_ids=np.asarray(batch.packed_latent_position_ids, _I32)[vae_tok],
            vae_pos=(np.asarray(batch.packed_vae_token_indexes, np.int64)[vae_tok] - a).astype(_I32),
            timesteps=np.asarray(batch.packed_timesteps, np.float32)[vae_tok],
            mse_pos=(np.asarray(batch.mse_loss_indexes, np.int64)[mse_of == i] - a).astype(_I32),
            origin=batch.origins[i],
        ))
    return out


def _cat(parts: list[np.ndarray], dtype) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)


def join_samples(samples: Sequence[BatchSample], like: PackedBatch) -> PackedBatch:
    """One packed batch of ``samples`` in this order (``like``: the flex, token budget and patch size)."""
    table: dict[tuple[int, int], int] = {}
    pictures: list[SampleImage] = []
    cols: dict[str, list[np.ndarray]] = {}

    def put(name: str, a: np.ndarray) -> None:
        cols.setdefault(name, []).append(a)

    at = 0
    for smp in samples:
        ids = []
        for img in smp.images:
            if img.key not in table:
                table[img.key] = len(pictures)
                pictures.append(img)
            ids.append(table[img.key])
        ids = np.asarray(ids, np.int64)
        for name, pos in (("packed_text_indexes", smp.text_pos), ("ce_loss_indexes", smp.ce_pos),
                          ("packed_vit_token_indexes", smp.vit_pos), ("packed_vae_token_indexes", smp.vae_pos),
                          ("mse_loss_indexes", smp.mse_pos)):
            put(name, pos.astype(np.int64) + at)
        for name, a in (("split_lens", smp.split_lens), ("attn_modes", smp.attn_modes), ("packed_text_ids", smp.text_ids),
                        ("packed_position_ids", smp.position_ids), ("packed_label_ids", smp.label_ids),
                        ("ce_loss_weights", smp.ce_weights), ("vit_token_seqlens", smp.vit_seqlens),
                        ("packed_vit_position_ids", smp.vit_position_ids), ("vae_latent_shapes", smp.vae_shapes),
                        ("packed_latent_position_ids", smp.latent_position_ids), ("packed_timesteps", smp.timesteps),
                        ("vit_image_ids", ids[smp.vit_images]), ("vae_image_ids", ids[smp.vae_images])):
            put(name, a)
        at += smp.length
    sizes = [img.coded.size for img in pictures]
    col = lambda name, dtype: _cat(cols.get(name, []), dtype)  # noqa: E731
    return PackedBatch(
        use_flex=like.use_flex, max_num_tokens=like.max_num_tokens, vit_patch_size=like.vit_patch_size,
        sequence_length=at,
        sample_lens=np.asarray([s.length for s in samples], _I32),
        sample_num_splits=np.asarray([len(s.split_lens) for s in samples], _I32),
        sample_num_frames=np.asarray([s.num_frames for s in samples], _I32),
        split_lens=col("split_lens", _I32), attn_modes=col("attn_modes", np.uint8),
        packed_text_ids=col("packed_text_ids", _I32), packed_text_indexes=col("packed_text_indexes", _I32),
        packed_position_ids=col("packed_position_ids", _I32), packed_label_ids=col("packed_label_ids", _I32),
        ce_loss_indexes=col("ce_loss_indexes", _I32), ce_loss_weights=col("ce_loss_weights", np.float32),
        image_heights=np.asarray([p.height for p in pictures], _I32),
        image_widths=np.asarray([p.width for p in pictures], _I32),
        image_offsets=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
        image_pixels=_cat([p.coded.reshape(-1) for p in pictures], np.uint8),
        image_norm=np.asarray([p.norm for p in pictures], np.float64).reshape(-1, 6),
        vit_image_ids=col("vit_image_ids", _I32), vit_token_seqlens=col("vit_token_seqlens", _I32),
        packed_vit_position_ids=col("packed_vit_position_ids", _I32),
        packed_vit_token_indexes=col("packed_vit_token_indexes", _I32),
        vae_image_ids=col("vae_image_ids", _I32),
        vae_latent_shapes=col("vae_latent_shapes", _I32).reshape(-1, 2),
        packed_latent_position_ids=col("packed_latent_position_ids", _I32),
        packed_vae_token_indexes=col("packed_vae_token_indexes", _I32),
        packed_timesteps=col("packed_timesteps", np.float32), mse_loss_indexes=col("mse_loss_indexes", _I32),
        origins=[s.origin for s in samples],
    )


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
