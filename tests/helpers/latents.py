"""Helpers for the ``prepack latents`` tests: VAE weights, the reference canvas and moments, file snapshots.

The reference side is NeMo AutoModel 0.7.0's own code (installed --no-deps as a test oracle): the
autoencoder from ``load_bagel_autoencoder``, the VAE picture transform's ``ToTensor`` and
``Normalize`` (``ImageTransform``), and ``PackedDataset.to_tensor``'s padding of the pictures into
``padded_images``; nothing of the loader's is used to build it.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import torch

from schemas.packed_batch import PackedBatch

Z_CHANNELS = 16  # BAGEL's VAE: moments have 2 * 16 channels
SCALE_FACTOR, SHIFT_FACTOR = 0.3611, 0.1159


def write_weights(path: str, seed: int = 0, *, only: "str | None" = None) -> str:
    """An ``ae.safetensors`` of random weights with BAGEL's channel sizes (``torch.manual_seed(seed)``);
    ``only``: just that one tensor (a tiny file NeMo still loads, ``strict=False``: other weights)."""
    import safetensors.torch
    from nemo_automodel.components.models.bagel.autoencoder import load_bagel_autoencoder

    torch.manual_seed(seed)
    ae, _ = load_bagel_autoencoder(None)
    state = {k: v.contiguous() for k, v in ae.state_dict().items() if only is None or k == only}
    safetensors.torch.save_file(state, path)
    return path


def load_reference_autoencoder(path: str) -> torch.nn.Module:
    """The autoencoder as NeMo's recipe loads it from ``path``, in eval mode."""
    from nemo_automodel.components.models.bagel.autoencoder import load_bagel_autoencoder

    ae, _ = load_bagel_autoencoder(path)
    return ae.eval().requires_grad_(False)


def reference_canvas(batch: PackedBatch) -> torch.Tensor:
    """``padded_images`` of a packed batch as NeMo builds it: each VAE use's picture through the
    reference transform's ToTensor and Normalize (its group's mean and std), padded by
    ``PackedDataset.to_tensor``."""
    from PIL import Image
    from nemo_automodel.components.datasets.multimodal.packing import PackedDataset
    from nemo_automodel.components.datasets.multimodal.transforms import _require_torchvision

    tv_transforms, _, _ = _require_torchvision()
    tensors = []
    for i in np.asarray(batch.vae_image_ids).tolist():
        norm = np.asarray(batch.image_norm[i], np.float64).tolist()
        picture = Image.fromarray(np.ascontiguousarray(batch.image(i)))
        t = tv_transforms.ToTensor()(picture)
        tensors.append(tv_transforms.Normalize(mean=norm[:3], std=norm[3:], inplace=True)(t))
    status = {"sample_lens": [1], "packed_text_ids": [0], "packed_text_indexes": [0], "packed_position_ids": [0],
              "split_lens": [1], "attn_modes": ["causal"], "vae_image_tensors": tensors,
              "vae_latent_shapes": np.asarray(batch.vae_latent_shapes).reshape(-1, 2).tolist(),
              "packed_latent_position_ids": [torch.zeros(1, dtype=torch.long)], "packed_vae_token_indexes": [0],
              "packed_vit_tokens": [], "packed_timesteps": [], "packed_label_ids": []}
    data = PackedDataset.to_tensor(SimpleNamespace(use_flex=True, max_num_tokens=1), status)
    return data["padded_images"]


def reference_moments(autoencoder: torch.nn.Module, padded_images: torch.Tensor, latent_shapes) -> list[torch.Tensor]:
    """``autoencoder.encoder(padded_images)`` (as the recipe runs it on the CPU: no_grad, no autocast),
    each image's moments cropped to 2 x its ``vae_latent_shapes`` (the latent rows BAGEL reads)."""
    with torch.no_grad():
        moments = autoencoder.encoder(padded_images)
    return [moments[k, :, : 2 * int(h), : 2 * int(w)] for k, (h, w) in enumerate(latent_shapes)]


def latents_bytes(out: str) -> dict[str, bytes]:
    """Every latents file and ``latents.json`` under ``out`` (temporaries left out): relpath -> bytes."""
    got = {}
    for d, _, names in os.walk(out):
        for n in names:
            if n.endswith(".latents.arrow") or n == "latents.json":
                p = os.path.join(d, n)
                with open(p, "rb") as f:
                    got[os.path.relpath(p, out)] = f.read()
    return got


def snapshot(out: str) -> dict[str, tuple[bytes, int]]:
    """Every file under ``out``: its bytes and mtime (a run that writes nothing leaves it unchanged)."""
    got = {}
    for d, _, names in os.walk(out):
        for n in names:
            p = os.path.join(d, n)
            with open(p, "rb") as f:
                got[os.path.relpath(p, out)] = (f.read(), os.stat(p).st_mtime_ns)
    return got
