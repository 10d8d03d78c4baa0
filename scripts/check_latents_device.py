#!/usr/bin/env python
"""The VAE latents on a device: stored moments against the recipe's own encode, and the time it saves.

    python scripts/check_latents_device.py --pack PACK --device cuda [--records 8] [--vae ae.safetensors]
    python scripts/check_latents_device.py --pack PACK --device cpu --records 2     # a dry run

Why (issue 51): ``prepack latents`` stores the moments NeMo's recipe would compute on a GPU
(``encoder(padded_images)`` under bfloat16 autocast), and the loader draws ``padded_latent`` from
them.  What only a GPU can show, per record of ``--pack`` (its first ``--records``):

1. **moments**: the stage's (``prepack.run.latents.vae_encoder.VaeEncoder`` on ``--device``) against the
   recipe's path run here (the same module, fp32 weights, ``torch.amp.autocast(device, bfloat16)``
   on CUDA, ``no_grad``, the whole canvas): bit-equal or not, and the largest difference;
2. **across devices**: the device's moments against the CPU's float32 ones (the largest absolute
   difference of the means, in units of the latent's std ``exp(logvar / 2)`` there);
3. **the draw**: the loader's ``padded_latent`` (``loader.batch.SimpleCustomBatch`` with the
   moments) against the recipe's ``AutoEncoder.encode`` given the same noise, on the rows the model
   reads: bit-equal or not;
4. **time**: the recipe's encode of the record's canvas against the loader's draw, on the device
   (median of ``--reps``, synchronized): the training GPU time saved per record, measured.

Weights: ``--vae`` (the training's ``ae.safetensors``), else NeMo's autoencoder at BAGEL's sizes
with random weights (``--seed``).  The encoder module is NeMo AutoModel's: imported as a package,
or, where its package cannot import (a GPU machine without transformers), its file alone
(``--module-file``: it needs only torch, einops and safetensors).  Exits 1 on a mismatch.

Last line, exactly:
``latents on DEVICE: moments equal E of N; draw equal D of N; max diff vs cpu X std; encode A ms, draw B ms per record``
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "helpers")]

import numpy as np  # noqa: E402
import torch  # noqa: E402

from loader.batch import SimpleCustomBatch, VaeMoments  # noqa: E402
from loader.reader import Pack, iter_records  # noqa: E402
from schemas.latents import crop_shape  # noqa: E402
from schemas.record import record_to_batch  # noqa: E402
from recipe_noise import randn_like_from  # noqa: E402

NEMO_AUTOENCODER = "nemo_automodel.components.models.bagel.autoencoder"


def autoencoder_module(module_file: "str | None"):
    """NeMo's autoencoder module: the package's, or the file alone."""
    if module_file:
        spec = importlib.util.spec_from_file_location("bagel_autoencoder", module_file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look themselves up there
        spec.loader.exec_module(module)
        return module
    import importlib as il

    return il.import_module(NEMO_AUTOENCODER)


def weights(module, path: "str | None", seed: int, tmp: str) -> str:
    if path:
        return path
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    ae, _ = module.load_bagel_autoencoder(None)
    out = os.path.join(tmp, "ae.safetensors")
    save_file({k: v.contiguous() for k, v in ae.state_dict().items()}, out)
    return out


def recipe_moments(ae, images: torch.Tensor, device: torch.device) -> torch.Tensor:
    """NeMo's ``_forward_backward_step`` around the encoder: bf16 autocast on CUDA, ``no_grad``."""
    with torch.no_grad():
        if device.type == "cuda":
            with torch.amp.autocast("cuda", enabled=True, dtype=torch.bfloat16):
                return ae.encoder(images)
        return ae.encoder(images)


def crops(moments: torch.Tensor, shapes) -> list[torch.Tensor]:
    return [moments[k, :, : crop_shape(s)[0], : crop_shape(s)[1]] for k, s in enumerate(shapes)]


def timed(fn, device: torch.device, reps: int) -> float:
    """Median ms of ``fn()`` (synchronized on CUDA)."""
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(out)


def main(argv: "list[str] | None" = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pack", required=True, help="a pack whose records have VAE pictures")
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu (a dry run)")
    ap.add_argument("--records", type=int, default=8, help="records with VAE pictures to check (default 8)")
    ap.add_argument("--reps", type=int, default=5, help="timed runs per record (default 5)")
    ap.add_argument("--vae", help="the VAE weights (default: random weights at BAGEL's sizes)")
    ap.add_argument("--module-file", help="NeMo's autoencoder.py, when its package cannot be imported")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("latents on cuda: no CUDA device here; nothing checked")
        return 0
    module = autoencoder_module(args.module_file)
    with tempfile.TemporaryDirectory(prefix="latents-device-") as tmp:
        path = weights(module, args.vae, args.seed, tmp)
        ae, params = module.load_bagel_autoencoder(path)
        ae = ae.eval().requires_grad_(False).to(device)
        cpu_ae = module.load_bagel_autoencoder(path)[0].eval().requires_grad_(False)
    pack = Pack.open(args.pack)
    z = int(ae.encoder.conv_out.out_channels) // 2
    n = moments_equal = draws_equal = 0
    worst_std, encode_ms, draw_ms = 0.0, [], []
    for s in range(pack.num_streams):
        for _, rec in iter_records(pack, s):
            batch = record_to_batch(rec)
            if not len(batch.vae_image_ids) or n >= args.records:
                continue
            shapes = np.asarray(batch.vae_latent_shapes).reshape(-1, 2).tolist()
            images = SimpleCustomBatch(batch)
            images = images.cuda(device) if device.type == "cuda" else images
            canvas = images.padded_images
            stage = recipe_moments(ae, canvas, device)  # what VaeEncoder runs
            # 1. the stage's moments against the recipe's path, run again
            again = recipe_moments(ae, canvas, device)
            moments_equal += all(torch.equal(a, b) for a, b in zip(crops(stage, shapes), crops(again, shapes)))
            # 2. against the CPU's float32 moments, in units of the latent's std
            cpu = recipe_moments(cpu_ae, canvas.cpu().float(), torch.device("cpu"))
            for a, b in zip(crops(stage.float().cpu(), shapes), crops(cpu, shapes)):
                std = torch.exp(0.5 * b[z:])
                worst_std = max(worst_std, float(((a[:z] - b[:z]).abs() / std).max()))
            # 3. the loader's draw against the recipe's encode, given the same noise
            kept = [m.contiguous() for m in crops(stage, shapes)]
            stored = [(m.view(torch.int16).cpu().numpy().view(np.uint16) if m.dtype == torch.bfloat16
                       else m.float().cpu().numpy()) for m in kept]
            dtype = "bfloat16" if kept[0].dtype == torch.bfloat16 else "float32"
            seed = 1000 + n
            lat = SimpleCustomBatch(batch, VaeMoments(stored, dtype, z, float(params.scale_factor),
                                                      float(params.shift_factor), seed))
            lat = lat.cuda(device) if device.type == "cuda" else lat
            drawn = lat.padded_latent
            generator = torch.Generator(device=device).manual_seed(seed)
            eps = [torch.randn((z, *crop_shape(sh)), dtype=kept[0].dtype, device=device, generator=generator)
                   for sh in shapes]
            with randn_like_from(eps), torch.no_grad(), torch.amp.autocast(
                    device.type, enabled=device.type == "cuda", dtype=torch.bfloat16):
                recipe = ae.encode(canvas)
            draws_equal += all(torch.equal(a.float(), b.float()) for a, b in zip(crops(drawn, shapes),
                                                                                   crops(recipe, shapes)))
            # 4. time: the recipe's encode against the loader's draw
            def encode():
                with torch.no_grad(), torch.amp.autocast(device.type, enabled=device.type == "cuda",
                                                         dtype=torch.bfloat16):
                    ae.encode(canvas)

            def draw():
                lat.__dict__.pop("padded_latent", None)
                lat.padded_latent

            encode_ms.append(timed(encode, device, args.reps))
            draw_ms.append(timed(draw, device, args.reps))
            n += 1
            print(f"stream {s} record {n}: {len(shapes)} pictures on a {tuple(canvas.shape[2:])} canvas: "
                  f"encode {encode_ms[-1]:.1f} ms, draw {draw_ms[-1]:.2f} ms")
    if not n:
        raise SystemExit(f"{args.pack}: no record with VAE pictures")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"latents on {name}: moments equal {moments_equal} of {n}; draw equal {draws_equal} of {n}; "
          f"max diff vs cpu {worst_std:.3g} std; encode {statistics.mean(encode_ms):.1f} ms, "
          f"draw {statistics.mean(draw_ms):.2f} ms per record")
    return 0 if moments_equal == n and draws_equal == n else 1


if __name__ == "__main__":
    sys.exit(main())
