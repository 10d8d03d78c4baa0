#!/usr/bin/env python
"""The resize alone: Pillow's bicubic resize vs the C kernel and the numba kernel, as the packer
calls them (an RGB PIL image in, an (h, w, 3) uint8 array out), one thread, best of ``--reps``;
every result is checked equal to Pillow's before its time is printed (CPU time of the thread, best
of the runs, the three alternating).  Then the start-up each kernel adds to a fresh process's
first resize (building or loading it, the self-test), with its cache cold (an empty
PREPACK_CACHE_DIR for the C kernel: it is compiled; an empty NUMBA_CACHE_DIR for numba: it is
JIT-compiled) and warm, against the same process with ``PREPACK_FAST_RESIZE=0``.

    python scripts/bench_resize.py            # sizes the packer makes from ~0.8 MP photographs
    python scripts/bench_resize.py --no-startup
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

# (in_w, in_h, out_w, out_h): NaViT targets of the bench_pack photographs (VAE 16-stride, ViT 14)
SIZES = [(1024, 768, 512, 384), (1024, 768, 672, 504), (1200, 800, 1024, 688), (800, 1200, 672, 1008),
         (1000, 750, 518, 392), (2000, 1500, 980, 728), (640, 480, 512, 384), (700, 1200, 224, 378)]

_STARTUP = ("import time; t = time.perf_counter(); from prepack.engine.resize import default_resizer; "
            "r = default_resizer(); print(time.perf_counter() - t, r.fast)")


def photo_like(w: int, h: int, rng: np.random.Generator) -> Image.Image:
    y, x = np.mgrid[0:h, 0:w]
    base = (np.sin(x / 37.0) * 60 + np.cos(y / 23.0) * 50 + 128)[..., None] + np.array([0, 20, -20])
    return Image.fromarray(np.clip(base + rng.normal(0, 8, (h, w, 3)), 0, 255).astype(np.uint8))


def cpu_ms(fn) -> float:
    """CPU time of this thread (not wall: the machine may be shared)."""
    t = time.thread_time()
    fn()
    return (time.thread_time() - t) * 1e3


def startup(env_extra: dict[str, str]) -> tuple[float, str]:
    env = dict(os.environ, PYTHONPATH=ROOT, **env_extra)
    out = subprocess.run([sys.executable, "-c", _STARTUP], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    secs, fast = out.stdout.split()
    return float(secs), fast


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--sizes", type=int, default=len(SIZES), help="measure only the first N sizes")
    ap.add_argument("--startup", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--startup-runs", type=int, default=3)
    args = ap.parse_args()

    from prepack.engine.resize.router import Resizer, pillow_resize
    from prepack.run.worker_process import settle_worker_process

    settle_worker_process()  # a packing worker's allocator settings: fresh pixel buffers are not faulted in
    kernels = {}
    for name in ("native", "numba"):
        resizer = Resizer.create(env={**os.environ, "PREPACK_FAST_RESIZE": name})
        if resizer.fast:
            kernels[name] = resizer.resize
        else:
            print(f"the {name} kernel is off here ({resizer.reason})")
    if not kernels:
        sys.exit("no kernel is on here: nothing to compare")
    rng = np.random.default_rng(0)
    ratios: dict[str, list[float]] = {name: [] for name in kernels}
    print(f"{'resize':>24} {'Pillow':>9} " + " ".join(f"{n:>9} {'speed-up':>8}" for n in kernels))
    for w, h, ow, oh in SIZES[: args.sizes]:
        img = photo_like(w, h, rng)
        for name, resize in kernels.items():
            if not np.array_equal(resize(img, ow, oh), pillow_resize(img, ow, oh)):
                sys.exit(f"{w}x{h} -> {ow}x{oh}: the {name} kernel differs from Pillow")
        # alternate them, so a busy spell on the machine hits all
        times: dict[str, list[float]] = {"pillow": [], **{name: [] for name in kernels}}
        for _ in range(args.reps):
            times["pillow"].append(cpu_ms(lambda: pillow_resize(img, ow, oh)))
            for name, resize in kernels.items():
                times[name].append(cpu_ms(lambda: resize(img, ow, oh)))
        row = f"{w:>5}x{h:<5} -> {ow:>4}x{oh:<4} {min(times['pillow']):6.2f} ms"
        for name in kernels:
            ratios[name].append(min(times["pillow"]) / min(times[name]))
            row += f" {min(times[name]):6.2f} ms {ratios[name][-1]:7.2f}x"
        print(row)
    print("median speed-up " + ", ".join(f"{name} {statistics.median(r):.2f}x" for name, r in ratios.items())
          + f" (best of {args.reps} each, identical bytes)")

    if args.startup:
        off = min(startup({"PREPACK_FAST_RESIZE": "0"})[0] for _ in range(args.startup_runs))
        parts = [f"Pillow only {off:.2f} s"]
        for name, cache_env in (("native", "PREPACK_CACHE_DIR"), ("numba", "NUMBA_CACHE_DIR")):
            if name not in kernels:
                continue
            cold, warm = [], []
            for _ in range(args.startup_runs):
                with tempfile.TemporaryDirectory(prefix=f"{name}-cold-") as cache:
                    env = {"PREPACK_FAST_RESIZE": name, cache_env: cache}
                    cold.append(startup(env)[0])
                    warm.append(startup(env)[0])
            parts.append(f"{name}: cache warm {min(warm):.2f} s (+{min(warm) - off:.2f} s), "
                         f"cold {min(cold):.2f} s (+{min(cold) - off:.2f} s)")
        print(f"start-up of a fresh process's first resize, best of {args.startup_runs}: " + "; ".join(parts))


if __name__ == "__main__":
    main()
