"""The training's own frozen VAE encoder, run on a packed record's canvas (``prepack latents``; issue 51).

Why this module calls the training stack's code instead of an encoder of its own: the point of
storing the moments is that they are what training would have computed, bit for bit, so the
encoder is the module the user trains with, loaded the way the recipe loads it
(``ENCODERS``: NeMo AutoModel's ``load_bagel_autoencoder`` or upstream BAGEL's ``load_ae``, each
taking the ``ae.safetensors`` path and returning the autoencoder; weights in the file's dtype,
``strict=False``), imported only here, only in this stage.  It runs as the recipe runs it:
``encoder(padded_images)`` on the whole canvas of the batch, under ``no_grad``, and on a GPU
under bfloat16 autocast (NeMo's ``_forward_backward_step``); on the CPU in the weights' dtype.

The canvas is the loader's own ``padded_images`` (``loader.batch.SimpleCustomBatch``: the
reference's normalisation, bit-identical on every device), so the moments are of exactly the
tensor training would encode.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from loader.batch import SimpleCustomBatch
from schemas.errors import UsageError
from schemas.latents import LatentsInfo, crop_shape
from schemas.packed_batch import PackedBatch

log = logging.getLogger(__name__)

# stack name -> (module, loader function, the distribution whose version names it)
ENCODERS = {
    "nemo": ("nemo_automodel.components.models.bagel.autoencoder", "load_bagel_autoencoder", "nemo_automodel"),
    "bagel": ("modeling.autoencoder", "load_ae", None),  # upstream ByteDance-Seed/Bagel on PYTHONPATH
}
_CHUNK = 1 << 24  # bytes read at a time when digesting the weights
CPU_THREADS = 1  # torch threads of a CPU encode: its bytes are the same on every machine


def weights_digest(path: str) -> str:
    """XXH3-128 of the weights file: which weights made a shard's moments."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _version(dist: "str | None") -> str:
    if dist is None:
        return ""
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415 (only to name the encoder)

    try:
        return " " + version(dist.replace("_", "-"))
    except PackageNotFoundError:
        return ""


def _weight_names(path: str) -> set[str]:
    """The tensors a safetensors file holds; a file that is not one is the user's mistake, in one line."""
    from safetensors import safe_open  # noqa: PLC0415 (a dependency of the training stacks, not of the packer)

    try:
        with safe_open(path, framework="pt") as f:
            return set(f.keys())
    except Exception as e:  # noqa: BLE001 -- safetensors raises its own error type for any damage
        raise UsageError(f"--vae {path}: not a safetensors file ({e})") from None


def load_autoencoder(stack: str, weights: str) -> tuple[torch.nn.Module, str]:
    """The training stack's autoencoder with ``weights`` loaded, and its name (stack and version).

    The stacks load with ``strict=False`` (a missing tensor is only a warning): here a file that
    lacks any of the encoder's tensors is refused, since its moments would come from random weights."""
    if stack not in ENCODERS:
        raise UsageError(f"--encoder {stack!r}: one of {', '.join(ENCODERS)}")
    names = _weight_names(weights)
    module_name, function, dist = ENCODERS[stack]
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UsageError(f"--encoder {stack}: cannot import {module_name} ({e}); install the training stack "
                         "that holds the VAE encoder") from None
    loaded = getattr(module, function)(weights)
    autoencoder = loaded[0] if isinstance(loaded, tuple) else loaded
    missing = sorted(f"encoder.{k}" for k in autoencoder.encoder.state_dict() if f"encoder.{k}" not in names)
    if missing:
        raise UsageError(f"--vae {weights}: lacks {len(missing)} of the encoder's tensors (e.g. {missing[0]}): not "
                         "the VAE the training loads")
    return autoencoder, f"{module_name}.{function}{_version(dist)}"


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


@dataclass
class VaeEncoder:
    """A loaded encoder on its device: the moments of a record's VAE canvas."""

    autoencoder: torch.nn.Module
    device: torch.device
    info: LatentsInfo

    @classmethod
    def load(cls, stack: str, weights: str, device: "str | torch.device") -> "VaeEncoder":
        device = torch.device(device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise UsageError(f"--device {device}: torch sees no CUDA device here")
        autoencoder, name = load_autoencoder(stack, weights)
        autoencoder = autoencoder.to(device).eval().requires_grad_(False)
        z = int(autoencoder.encoder.conv_out.out_channels) // 2  # the moments: mean and log-variance
        out_dtype = torch.bfloat16 if device.type == "cuda" else next(autoencoder.parameters()).dtype
        dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16"}.get(out_dtype)
        if dtype is None:
            raise UsageError(f"the VAE's weights are {out_dtype}: moments are stored as float32 or bfloat16")
        info = LatentsInfo(encoder=name, weights=weights_digest(weights), device=device_name(device),
                           device_type=device.type, dtype=dtype,
                           autocast="bfloat16" if device.type == "cuda" else "none", z_channels=z,
                           scale_factor=float(autoencoder.scale_factor), shift_factor=float(autoencoder.shift_factor))
        log.info("VAE encoder %s on %s (%s), moments in %s", name, info.device, device, dtype)
        return cls(autoencoder, device, info)

    def canvas_moments(self, padded_images: torch.Tensor) -> torch.Tensor:
        """``encoder(padded_images)`` as the recipe runs it: [n, 2 * z_channels, H/8, W/8].

        On the CPU with one thread (``CPU_THREADS``): float32 convolutions differ in their last bits
        with the thread count, and a shard's bytes must not depend on the machine that encoded it
        (a resume, a Ray actor, a restore elsewhere)."""
        with torch.no_grad():
            if self.device.type == "cuda":
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    return self.autoencoder.encoder(padded_images)
            threads = torch.get_num_threads()
            torch.set_num_threads(CPU_THREADS)
            try:
                return self.autoencoder.encoder(padded_images)
            finally:
                torch.set_num_threads(threads)

    def record_moments(self, batch: PackedBatch) -> list[np.ndarray]:
        """One record's moments, each VAE image use cropped to the latent rows the model reads."""
        if not len(batch.vae_image_ids):
            return []
        canvas = SimpleCustomBatch(batch)
        if self.device.type == "cuda":
            canvas = canvas.cuda(self.device)
        moments = self.canvas_moments(canvas.padded_images)
        if str(moments.dtype).removeprefix("torch.") != self.info.dtype:
            raise RuntimeError(f"the encoder gave {moments.dtype} moments on {self.device}, expected {self.info.dtype}")
        out = []
        for k, shape in enumerate(np.asarray(batch.vae_latent_shapes).reshape(-1, 2).tolist()):
            h, w = crop_shape(shape)
            m = moments[k, :, :h, :w].contiguous()
            if m.dtype == torch.bfloat16:
                out.append(m.view(torch.int16).cpu().numpy().view(np.uint16))
            else:
                out.append(m.to(torch.float32).cpu().numpy())
        return out
