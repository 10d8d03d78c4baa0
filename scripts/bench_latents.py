#!/usr/bin/env python
"""What storing the VAE's moments at pack time gives (``prepack latents``; issue 51): encode speed,
the training step without the encode, and the bytes.

    python scripts/bench_latents.py                          # a small pack, the CPU (a few minutes)
    python scripts/bench_latents.py --pack PACK --vae ae.safetensors --device cuda

Why: every step of NeMo's BAGEL recipe runs the frozen VAE encoder on its batch's padded canvas,
on every rank, every micro-batch and every pass, inside FSDP's lockstep (``loader.balance``); a
pack fixes each canvas, so the moments can be encoded once, on other GPUs.

What it does:

- **encode**: runs the stage (``prepack.run.latents.stage.run_latents``, in this process) on the pack
  (default: ``bench_pack.py``'s photographs under NeMo's pretrain knobs, two streams of
  ``--batches`` records, its VAE pictures capped at ``--vae-side`` pixels so a CPU finishes in
  minutes: a CPU encode runs on one thread; ``--pack`` takes yours)
  with ``--vae`` weights (default: NeMo's autoencoder at BAGEL's real sizes with random weights:
  the encoder's speed does not depend on its weights), and prints pictures, records and canvas
  megapixels per second on the device.
- **step time**: a step without the encode, at W=64, M=4 under lockstep, by the H200's per-part
  timings (``docs/data/record_cost_h200.csv``: the VAE segment taken out), the reference
  assignment and with micro-steps balanced (``assign_lockstep``, by the default model less its VAE
  terms, as the loader weighs a batch with latents): "model", since no GPU measured the
  recipe's encode against the loader's draw here.  The training GPU time saved per record is the
  VAE segment's mean (the H200's ``vae_ms``; the loader's draw is a few element-wise kernels).
- **bytes**: the pack's shard files and its latents files (moments are float32 on the CPU,
  bfloat16 from a GPU's autocast: half).

Last line, exactly:
``latents: step time X of pixels at W=64 M=4 (measured|model); encode R pictures/s on DEVICE; bytes B of the pixel pack``
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (os.path.dirname(os.path.abspath(__file__)), ROOT):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import numpy as np  # noqa: E402

from cost_fit import read_csv, segment_times  # noqa: E402
from loader.balance import assign_lockstep, lockstep_time  # noqa: E402
from loader.reader import Pack  # noqa: E402
from schemas.cost import COST_TERMS, SEGMENTS, CostModel  # noqa: E402
from schemas.layout import shard_file, shard_latents_file  # noqa: E402

log = logging.getLogger("bench_latents")
HEADLINE = (64, 4)
CHECK_CSV = os.path.join(ROOT, "docs", "data", "record_cost_h200.csv")


def build_pack(out: str, batches: int, side: int, seed: int) -> str:
    """``bench_pack.py``'s photographs (with a sensor's noise: they compress as camera pictures do)
    under NeMo's pretrain knobs, its VAE pictures at most ``side`` pixels a side, packed by the
    product's command (``make_cost_pack``'s config)."""
    import bench_pack  # scripts beside this one (PIL, yaml): only when a pack is built
    import make_cost_pack as mcp
    import yaml

    ds = bench_pack.nemo_pretrain_transforms(bench_pack.make_data(os.path.join(out, "data"), seed,
                                                                  size=(max(64, side // 2), max(96, side))))
    for group in ("t2i_pretrain", "unified_edit"):
        ds.groups[group]["image_transform_args"] = {"image_stride": 16, "max_image_size": side,
                                                    "min_image_size": min(side, 64)}
    path = mcp.config(ds, batches, seed, "latents", None)
    raw = yaml.safe_load(open(path))
    with open(path, "w") as f:
        yaml.safe_dump(raw, f, sort_keys=False)
    dest = os.path.join(out, "pack")
    subprocess.run([sys.executable, "-m", "prepack.cli", "run", path, "--out", dest, "--no-ray", "--no-progress"],
                   cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": ROOT}, stdout=sys.stderr)
    return dest


def random_weights(out: str) -> str:
    """NeMo's autoencoder at BAGEL's real sizes, random weights, saved as the recipe's ae.safetensors."""
    import torch
    from nemo_automodel.components.models.bagel.autoencoder import load_bagel_autoencoder
    from safetensors.torch import save_file

    torch.manual_seed(0)
    ae, _ = load_bagel_autoencoder(None)
    path = os.path.join(out, "ae.safetensors")
    save_file({k: v.contiguous() for k, v in ae.state_dict().items()}, path)
    return path


def encode(pack_dir: str, weights: str, device: str) -> tuple[str, dict]:
    """The stage on the whole pack, timed: its device and counts."""
    from prepack.run.latents.stage import LatentsOptions, read_listing, run_latents

    t0, c0 = time.perf_counter(), time.process_time()
    run_latents(pack_dir, LatentsOptions(weights=weights, device=device, inline=True, bar=False))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    pack = Pack.open(pack_dir)
    images = records = 0
    where = "?"
    for s in range(pack.num_streams):
        listing = read_listing(pack.location, s)
        for e in listing.shards if listing else ():
            images, records, where = images + e.images, records + e.records, e.device
    pixels = 0
    for s in range(pack.num_streams):
        for i in range(pack.num_records(s)):
            t = pack.record_terms(s, i)
            pixels += int(t[COST_TERMS.index("vae_canvas_pixels")])
    return where, {"wall": wall, "cpu": cpu, "images": images, "records": records, "pixels": pixels}


def pack_bytes(pack_dir: str) -> tuple[int, int]:
    """The pack's shard files' bytes and its latents files' bytes."""
    pack = Pack.open(pack_dir)
    shards = latents = 0
    for s in range(pack.num_streams):
        for sh in pack.index(s).shards:
            shards += os.path.getsize(os.path.join(pack_dir, shard_file(s, sh.shard)))
            name = os.path.join(pack_dir, shard_latents_file(s, sh.shard))
            latents += os.path.getsize(name) if os.path.exists(name) else 0
    return shards, latents


def step_model(csv_path: str, steps: int, seed: int) -> tuple[float, float, float]:
    """Lockstep step time without the VAE over with it, at the headline cell, by the H200 per-part
    timings: (reference, balanced over reference with pixels, balanced without over balanced with);
    and the mean VAE time per record."""
    rows = read_csv(csv_path)
    timed = np.array([[segment_times(r)[s] for s in SEGMENTS] for r in rows])
    terms = np.array([[int(r[k]) for k in COST_TERMS] for r in rows], np.int64)
    vae = SEGMENTS.index("vae")
    without = timed.copy()
    without[:, vae] = 0.0
    model = CostModel.default()
    priced, priced_without = model.segments(terms), model.without("vae").segments(terms)
    w, m = HEADLINE
    rng = np.random.default_rng([seed, w, m])
    t = np.zeros(4)  # pixels reference, latents reference, pixels balanced, latents balanced
    for _ in range(steps):
        idx = rng.integers(len(rows), size=w * m)
        t += [lockstep_time(timed[idx], w, m), lockstep_time(without[idx], w, m),
              lockstep_time(timed[idx], w, m, assign_lockstep(priced[idx], w, m)),
              lockstep_time(without[idx], w, m, assign_lockstep(priced_without[idx], w, m))]
    return t[1] / t[0], t[3] / t[0], float(timed[:, vae].mean())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pack", help="a pack to encode (a copy is encoded; default: build a small one)")
    ap.add_argument("--vae", help="the VAE weights (ae.safetensors; default: random weights at BAGEL's sizes)")
    ap.add_argument("--device", default="auto", help="cpu, cuda (default auto)")
    ap.add_argument("--batches", type=int, default=1, help="records per stream of the built pack (default 1)")
    ap.add_argument("--vae-side", type=int, default=192, help="largest VAE picture side of the built pack (default 192)")
    ap.add_argument("--steps", type=int, default=200, help="steps drawn for the step time (default 200)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check-csv", default=CHECK_CSV, help="the GPU per-part timings (time_record_cost.py's CSV)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    from machine import machine_line  # a script beside this one

    from prepack.run.latents.stage import resolve_device

    print(machine_line())
    device = resolve_device(args.device)
    with tempfile.TemporaryDirectory(prefix="bench-latents-") as tmp:
        if args.pack:
            import shutil

            pack_dir = os.path.join(tmp, "pack")
            shutil.copytree(args.pack, pack_dir)
        else:
            pack_dir = build_pack(tmp, args.batches, args.vae_side, args.seed)
        weights = args.vae or random_weights(tmp)
        where, enc = encode(pack_dir, weights, device)
        shards, latents = pack_bytes(pack_dir)
    rate = enc["images"] / enc["wall"] if enc["wall"] else 0.0
    print(f"encode on {where} ({device}): {enc['images']} pictures of {enc['records']} records "
          f"({enc['pixels'] / 1e6:.1f} canvas megapixels) in {enc['wall']:.1f} s wall, {enc['cpu']:.1f} s CPU: "
          f"{rate:.2f} pictures/s, {enc['records'] / enc['wall']:.2f} records/s, "
          f"{enc['pixels'] / 1e6 / enc['wall']:.2f} canvas megapixels/s"
          + ("" if args.vae else " (random weights: the encoder's speed does not depend on them)"))
    ratio = (shards + latents) / shards if shards else 0.0
    print(f"bytes: shards {shards / 2**20:.2f} MiB, latents {latents / 2**20:.2f} MiB "
          f"({latents / max(enc['pixels'], 1):.2f} bytes per canvas pixel): the pack with latents is {ratio:.3f}x "
          f"the pixel pack")
    x, balanced, vae_ms = step_model(args.check_csv, args.steps, args.seed)
    print(f"step time at W={HEADLINE[0]} M={HEADLINE[1]}, lockstep, by the H200 per-part timings "
          f"({os.path.relpath(args.check_csv, ROOT)}), {args.steps} steps: without the encode {x:.3f} of pixels; "
          f"with micro-steps balanced too {balanced:.3f}; training GPU time saved per record {vae_ms:.0f} ms "
          "(the VAE segment's mean; model: no GPU timed the recipe's encode against the loader's draw here)")
    print(f"latents: step time {x:.3f} of pixels at W={HEADLINE[0]} M={HEADLINE[1]} (model); encode {rate:.2f} "
          f"pictures/s on {where}; bytes {ratio:.3f} of the pixel pack")
    return 0


if __name__ == "__main__":
    sys.exit(main())
