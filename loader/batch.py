"""``SimpleCustomBatch``: one packed batch as the BAGEL model expects it, built lazily.

Attribute names, presence rules, values and dtypes are those of the reference's batch, so a
training loop written for the online pipeline runs unchanged.  What differs is where the work
happens: the batch keeps only the compact record (uint8 pixels, int32 token arrays, per-position
mask bounds) and builds the reference tensors on demand, on the device the batch is on:

- ``cuda(device)`` copies the compact tensors (a few bytes per token, one byte per pixel channel)
  and builds every reference tensor there: int64 widening, normalised ``padded_images``,
  patchified ``packed_vit_tokens``, dense ``nested_attention_masks``;
- on the CPU, attribute access and ``to_dict()`` build them on first use.

With VAE latents (``vae_latents``; ``loader.latents``) the batch holds its VAE images' stored
encoder moments instead of building ``padded_images``: ``padded_latent`` is drawn on the batch's
device, as NeMo's recipe draws it from ``encoder(padded_images)`` (``VaeMoments``), and
``padded_images`` is absent, so the recipe skips its encode.

Reference dtype rules kept on purpose: fields the reference makes with ``torch.tensor(list)`` are
int64 (integers), float32 (floats) -- and float32 when the list is empty (e.g. ``mse_loss_indexes``
when every VAE image of the batch is a condition); fields it makes with ``torch.cat`` of position
ids are int64.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from loader.masks import dense_mask, row_bounds
from loader.normalize import CHANNELS, LEVELS, TABLE_SIZE, norm_key, stacked_tables
from schemas.packed_batch import ATTN_MODES, PackedBatch

# Reference construction of each light tensor field: "list" = torch.tensor(python list),
# "cat" = torch.cat of int64 position-id tensors.
_LIGHT = {
    "packed_text_ids": "list",
    "packed_text_indexes": "list",
    "packed_position_ids": "list",
    "packed_latent_position_ids": "cat",
    "packed_vae_token_indexes": "list",
    "packed_vit_position_ids": "cat",
    "packed_vit_token_indexes": "list",
    "vit_token_seqlens": "list",
    "packed_timesteps": "list",
    "mse_loss_indexes": "list",
    "packed_label_ids": "list",
    "ce_loss_indexes": "list",
    "ce_loss_weights": "list",
}
_HEAVY = ("padded_images", "padded_latent", "packed_vit_tokens", "nested_attention_masks")
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# Optional groups in the reference's to_dict order; a group is present or absent as a whole.
_BASE = (
    "sequence_length",
    "sample_lens",
    "packed_text_ids",
    "packed_text_indexes",
    "packed_position_ids",
    "batch_data_indexes",
)
_GROUPS = {
    "vae": ("padded_images", "patchified_vae_latent_shapes", "packed_latent_position_ids", "packed_vae_token_indexes"),
    "vit": ("packed_vit_tokens", "packed_vit_position_ids", "packed_vit_token_indexes", "vit_token_seqlens"),
    "timesteps": ("packed_timesteps", "mse_loss_indexes"),
    "labels": ("packed_label_ids", "ce_loss_indexes", "ce_loss_weights"),
}


@dataclass(frozen=True)
class VaeMoments:
    """A record's stored VAE encoder moments (``schemas.latents``) and how to draw its latent.

    ``moments[k]``: VAE image use k's ``[2 * z_channels, h, w]`` (mean, then log-variance), numpy
    of the stored ``dtype`` (bfloat16 as its raw 16 bits); ``seed``: the record's noise seed."""

    moments: "list[np.ndarray]"
    dtype: str
    z_channels: int
    scale_factor: float
    shift_factor: float
    seed: int


def _view(array: np.ndarray) -> torch.Tensor:
    """Zero-copy tensor over an Arrow-backed (read-only) numpy array.

    torch warns that it cannot mark such a tensor read-only.  These compact tensors are never
    written in place: every tensor handed to the user is freshly built from them (widened,
    gathered, copied), so that is where the one necessary copy happens, not here.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


class SimpleCustomBatch:
    """A packed batch with the reference ``SimpleCustomBatch`` attributes, built from a ``PackedBatch``.

    Plain attributes (always): ``batch_data_indexes``, ``sequence_length``, ``sample_lens``,
    ``use_flex``, and ``split_lens``/``attn_modes`` (flex) or ``patchified_vae_latent_shapes``
    (VAE images).  Tensor attributes are built on first access on the batch's device.
    """

    def __init__(self, packed: PackedBatch, latents: "VaeMoments | None" = None):
        self._device = torch.device("cpu")
        self.use_flex = bool(packed.use_flex)
        self.sequence_length = int(packed.sequence_length)
        self.batch_data_indexes = [o.reference_dict() for o in packed.origins]
        self.sample_lens = [int(n) for n in packed.sample_lens.tolist()]
        self._patch = int(packed.vit_patch_size)

        compact: dict[str, torch.Tensor] = {name: _view(getattr(packed, name)) for name in _LIGHT}
        present = {"packed_text_ids", "packed_text_indexes", "packed_position_ids"}
        if self.use_flex:
            pad = int(packed.max_num_tokens) - self.sequence_length
            self.sample_lens.append(pad)
            self.split_lens = [int(n) for n in packed.split_lens.tolist()] + [pad]
            self.attn_modes = [ATTN_MODES[c] for c in packed.attn_modes.tolist()] + ["causal"]
        else:
            start, limit, keep = row_bounds(
                packed.sample_lens, packed.sample_num_splits, packed.split_lens, packed.attn_modes
            )
            compact.update(
                mask_start=torch.from_numpy(start), mask_limit=torch.from_numpy(limit), mask_keep=torch.from_numpy(keep)
            )
            present.add("nested_attention_masks")

        self._vit_ids = [int(i) for i in packed.vit_image_ids.tolist()]
        self._vae_ids = [int(i) for i in packed.vae_image_ids.tolist()]
        self._latents = latents if self._vae_ids else None
        if self._vae_ids:
            present.update(_GROUPS["vae"])
            present.discard("patchified_vae_latent_shapes")
            self.patchified_vae_latent_shapes = [(int(h), int(w)) for h, w in packed.vae_latent_shapes.tolist()]
        if self._latents is not None:
            if len(self._latents.moments) != len(self._vae_ids):
                raise ValueError(f"{len(self._latents.moments)} images' VAE moments for {len(self._vae_ids)} VAE images")
            present.discard("padded_images")
            present.add("padded_latent")
            for k, m in enumerate(self._latents.moments):
                compact[f"moments{k}"] = _view(m)
        if self._vit_ids:
            present.update(_GROUPS["vit"])
        if len(packed.packed_timesteps):
            present.update(_GROUPS["timesteps"])
        if len(packed.packed_label_ids):
            present.update(_GROUPS["labels"])

        # Image table (host side: shapes never require a device round trip).
        self._heights = [int(v) for v in packed.image_heights.tolist()]
        self._widths = [int(v) for v in packed.image_widths.tolist()]
        self._offsets = [int(v) for v in packed.image_offsets.tolist()]
        keys = [norm_key(row) for row in packed.image_norm]
        uniq = sorted(set(keys))
        self._table_base = [uniq.index(k) * TABLE_SIZE for k in keys]
        if self._vit_ids or (self._vae_ids and self._latents is None):
            compact["pixels"] = _view(packed.image_pixels)
            compact["norm_tables"] = stacked_tables(uniq)
        self._compact = compact
        self._present = frozenset(present)

    # --- reference API -------------------------------------------------------------------

    def pin_memory(self) -> "SimpleCustomBatch":
        """Pin the compact tensors (what ``cuda`` copies); derived tensors are rebuilt from them."""
        self._compact = {k: v.pin_memory() for k, v in self._compact.items()}
        self._drop_built()
        return self

    def cuda(self, device=None) -> "SimpleCustomBatch":
        """Copy the compact tensors to ``device`` and build every reference tensor there."""
        device = torch.device("cuda" if device is None else device)
        self._compact = {k: v.to(device, non_blocking=True) for k, v in self._compact.items()}
        self._device = device
        self._drop_built()
        for name in self._present:
            getattr(self, name)
        return self

    def to_dict(self) -> dict:
        """The reference ``to_dict()``: same keys, values and dtypes (built on this batch's device)."""
        names = list(_BASE)
        names += ["split_lens", "attn_modes"] if self.use_flex else ["nested_attention_masks"]
        for group in ("vae", "vit", "timesteps", "labels"):
            if _GROUPS[group][-1] in self._present:
                names += _GROUPS[group]
        if self._latents is not None:  # the encoder's output in place of its input
            names[names.index("padded_images")] = "padded_latent"
        return {name: getattr(self, name) for name in names}

    @property
    def device(self) -> torch.device:
        return self._device

    def __repr__(self) -> str:
        return (
            f"SimpleCustomBatch(sequence_length={self.sequence_length}, samples={len(self.batch_data_indexes)}, "
            f"vit_images={len(self._vit_ids)}, vae_images={len(self._vae_ids)}, use_flex={self.use_flex}, "
            f"device={self._device})"
        )

    # --- lazy construction ---------------------------------------------------------------

    def __getattr__(self, name: str):
        # Only reached when normal lookup fails: i.e. a tensor not built yet (or absent).
        if name.startswith("_") or name not in self.__dict__.get("_present", ()):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        value = self._build(name)
        self.__dict__[name] = value
        return value

    def _drop_built(self) -> None:
        for name in self._present:
            self.__dict__.pop(name, None)

    def _build(self, name: str):
        if name == "packed_vit_tokens":
            return self._build_vit_tokens()
        if name == "padded_images":
            return self._build_padded_images()
        if name == "padded_latent":
            return self._build_padded_latent()
        if name == "nested_attention_masks":
            return self._build_masks()
        return self._widen(self._compact[name], _LIGHT[name])

    def _widen(self, src: torch.Tensor, how: str) -> torch.Tensor:
        if how == "list" and src.numel() == 0:
            dtype = torch.float32  # torch.tensor([]) is float32
        else:
            dtype = torch.float32 if src.is_floating_point() else torch.int64
        # Always a fresh tensor: the compact source may alias read-only Arrow memory.
        return torch.empty(src.shape, dtype=dtype, device=src.device).copy_(src)

    def _pixel_index(self, image: int) -> tuple[torch.Tensor, int, int]:
        """Image ``image`` as decoded uint8 (h, w, 3) pixels, on the batch's device.

        The record stores rows delta coded (``schemas.record.encode_rows``); a running sum along
        each row, mod 256, restores them exactly (int32 accumulation, then the low byte).
        """
        h, w, off = self._heights[image], self._widths[image], self._offsets[image]
        coded = self._compact["pixels"][off : off + h * w * CHANNELS].view(h, w, CHANNELS)
        return torch.cumsum(coded, dim=1, dtype=torch.int32).bitwise_and_(255).to(torch.uint8), h, w

    def _channel_offsets(self, length: int) -> torch.Tensor:
        """int32 [length]: table offset of the channel of each HWC-interleaved element."""
        return (torch.arange(length, dtype=torch.int32, device=self._device) % CHANNELS) * LEVELS

    def _build_vit_tokens(self) -> torch.Tensor:
        """float32 [N, p*p*3]: the reference's patchify of each normalised CHW ViT image."""
        p = self._patch
        counts = [(self._heights[i] // p) * (self._widths[i] // p) for i in self._vit_ids]
        width = p * p * CHANNELS
        index = torch.empty((sum(counts), width), dtype=torch.int32, device=self._device)
        row = 0
        for image, n in zip(self._vit_ids, counts):
            hwc, h, w = self._pixel_index(image)
            # patch (y, x), then pixel (py, px) inside it, channel last: the reference's
            # "chpwq->hwpqc" order, taken straight from HWC.
            patches = hwc.view(h // p, p, w // p, p, CHANNELS).permute(0, 2, 1, 3, 4)
            index[row : row + n].view(h // p, w // p, p, p, CHANNELS).copy_(patches)
            if self._table_base[image]:
                index[row : row + n] += self._table_base[image]
            row += n
        index += self._channel_offsets(width)
        return self._compact["norm_tables"].index_select(0, index.view(-1)).view(-1, width)

    def _build_padded_images(self) -> torch.Tensor:
        """float32 [n_vae, 3, Hmax, Wmax]: normalised CHW images, zero padded bottom/right."""
        hmax = max(self._heights[i] for i in self._vae_ids)
        wmax = max(self._widths[i] for i in self._vae_ids)
        out = torch.zeros((len(self._vae_ids), CHANNELS, hmax, wmax), dtype=torch.float32, device=self._device)
        channels = self._channel_offsets(CHANNELS)
        for k, image in enumerate(self._vae_ids):
            hwc, h, w = self._pixel_index(image)
            index = hwc.to(torch.int32) + (channels + self._table_base[image])
            values = self._compact["norm_tables"].index_select(0, index.view(-1)).view(h, w, CHANNELS)
            out[k, :, :h, :w].copy_(values.permute(2, 0, 1))
        return out

    def _build_padded_latent(self) -> torch.Tensor:
        """float32 [n_vae, z, Hmax/8, Wmax/8]: each image's latent drawn from its moments at its
        top left (the rows the model reads of it), zeros elsewhere.

        The draw is the recipe's ``scale * (mean + exp(0.5 * logvar) * randn_like(mean) - shift)``
        in the moments' dtype as autocast runs it: ``0.5 * logvar`` and the noise in that dtype,
        ``exp`` and the rest in float32."""
        lat = self._latents
        z, down = lat.z_channels, 8
        hmax = max(self._heights[i] for i in self._vae_ids) // down
        wmax = max(self._widths[i] for i in self._vae_ids) // down
        out = torch.zeros((len(self._vae_ids), z, hmax, wmax), dtype=torch.float32, device=self._device)
        dtype = _TORCH_DTYPES[lat.dtype]
        generator = torch.Generator(device=self._device).manual_seed(lat.seed)
        for k in range(len(self._vae_ids)):
            m = self._compact[f"moments{k}"]
            m = m.view(dtype) if dtype == torch.bfloat16 else m  # bfloat16 arrives as its raw 16 bits
            mean, logvar = m[:z], m[z:]
            eps = torch.randn(mean.shape, dtype=dtype, device=self._device, generator=generator)
            std = torch.exp((0.5 * logvar).float())
            sample = mean.float() + std * eps.float()
            out[k, :, : m.shape[1], : m.shape[2]].copy_(lat.scale_factor * (sample - lat.shift_factor))
        return out

    def _build_masks(self) -> list[torch.Tensor]:
        c = self._compact
        masks, pos = [], 0
        for n in self.sample_lens:
            masks.append(
                dense_mask(
                    c["mask_start"][pos : pos + n], c["mask_limit"][pos : pos + n], c["mask_keep"][pos : pos + n]
                )
            )
            pos += n
        return masks
