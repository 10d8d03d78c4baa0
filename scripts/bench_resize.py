#!/usr/bin/env python
"""The resize alone: Pillow's bicubic resize vs the C kernel (as this machine builds it, or a
narrower x86 build: ``--isa``) and the numba kernel, as the packer calls them (an RGB PIL image
in, an (h, w, 3) uint8 array out), one thread; every result is checked equal to Pillow's before
it is timed.  CPU time of the thread, the ways alternating within each of ``--reps`` runs; per
size the median of the per-run speed-ups over Pillow with their range, and the best runs' ratio.
First the CPU, its vector level, the path each C build takes and the router's choice here.  Then
the start-up each kernel adds to a fresh process's first resize (building or loading it, the
self-test), with its cache cold (an empty PREPACK_CACHE_DIR for the C kernel: it is compiled and
the candidates are timed; an empty NUMBA_CACHE_DIR for numba: it is JIT-compiled) and warm,
against the same process with ``PREPACK_FAST_RESIZE=0``.

    python scripts/bench_resize.py                      # sizes the packer makes from ~0.8 MP photographs
    python scripts/bench_resize.py --no-startup --isa native,avx512,avx2,avx2-plain,portable   # each x86 build
    python scripts/bench_resize.py --no-startup --flags=-mno-avx512f --no-numba
    python scripts/bench_resize.py --no-startup --coded   # the packer's form: row-delta coded into a table slot

``--coded`` times what the packer's table asks for instead: the result row-delta coded into a
preallocated slot (``Resizer.resize_coded``: the C kernel codes as it resizes, Pillow and numba
resize and then ``encode_rows``), checked equal to ``encode_rows`` of Pillow's.
"""

from __future__ import annotations

import argparse
import os
import platform
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


# --isa: the C kernel's builds by the vector path they take (x86 flags narrow -march=native)
# (on a CPU with AVX-512 VNNI, native takes avx512-vnni, and avx2 takes avx2-vnni where it has AVX-VNNI)
ISA_FLAGS = {"native": (), "avx512": ("-mno-avx512vnni",), "avx2": ("-mno-avx512f",),
             "avx2-plain": ("-mno-avx512f", "-mno-avxvnni"), "portable": ("-mno-avx2", "-mno-avx512f")}


def cpu() -> tuple[str, str]:
    """This CPU's model and vector level (what the C kernel's widest path can use)."""
    from prepack.engine.resize import native

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    features = set(native.machine_features().split()[1:])
    level = next((name for flag, name in (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("asimd", "NEON")) if flag in features),
                 "none")
    return model, level


def c_kernel(flags: tuple[str, ...]):
    """The C kernel built with ``flags`` as the router wraps it, self-tested, and the path it took."""
    from prepack.engine.resize import native, router, selftest

    kernel = router.native_kernel(flags=flags)
    bad = selftest.mismatches(kernel)
    if bad:
        sys.exit(f"the C kernel built with {' '.join(flags)} differs from Pillow: {bad[:3]}")
    return kernel, native.isa(native.library(flags=flags))


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):5.2f}x ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--sizes", type=int, default=len(SIZES), help="measure only the first N sizes")
    ap.add_argument("--isa", default="native", help=f"comma-separated C builds to time: {', '.join(ISA_FLAGS)} "
                    "(all but native: x86 only)")
    ap.add_argument("--flags", default="", help="one more C build: these flags added to native.py's")
    ap.add_argument("--numba", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--startup", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--startup-runs", type=int, default=3)
    ap.add_argument("--coded", action="store_true", help="time the row-delta coded result into a table slot")
    args = ap.parse_args()

    from prepack.engine.resize import native
    from prepack.engine.resize.router import Resizer, pillow_resize
    from prepack.run.worker_process import settle_worker_process

    model, level = cpu()
    router_choice = Resizer.create()
    print(f"CPU: {model}; vector level {level}; the router resizes with {router_choice.name} "
          f"({router_choice.reason}; {os.environ.get('PREPACK_FAST_RESIZE', 'timed choice')})")
    settle_worker_process()  # a packing worker's allocator settings: fresh pixel buffers are not faulted in
    builds = [ISA_FLAGS[name] for name in args.isa.split(",") if name]
    if args.flags:
        builds.append(tuple(args.flags.split()))
    kernels = {}
    for extra in builds:
        kernel, isa = c_kernel(native.FLAGS + extra)
        label = f"C[{isa}]" if extra in ISA_FLAGS.values() else f"C[{' '.join(extra)}: {isa}]"
        print(f"{label}: built with {' '.join(native.FLAGS + extra)}")
        kernels[label] = kernel
    if args.numba:
        resizer = Resizer.create(env={**os.environ, "PREPACK_FAST_RESIZE": "numba"})
        if resizer.fast:
            kernels["numba"] = resizer.resize
        else:
            print(f"the numba kernel is off here ({resizer.reason})")
    if not kernels:
        sys.exit("no kernel is on here: nothing to compare")
    reference = pillow_resize
    if args.coded:  # each way as Resizer.resize_coded runs it, into one reused slot
        slot = np.empty(max(ow * oh * 3 for _, _, ow, oh in SIZES), np.uint8)

        def coding(resize):
            def run(img, ow, oh):
                out = slot[: ow * oh * 3].reshape(oh, ow, 3)
                Resizer(resize, "bench").resize_coded(img, ow, oh, out)
                return out
            return run

        kernels = {name: coding(kernel) for name, kernel in kernels.items()}
        reference = coding(None)
        print("timing the coded result into a table slot (resize_coded)")
    rng = np.random.default_rng(0)
    medians: dict[str, list[float]] = {name: [] for name in kernels}
    bests: dict[str, list[float]] = {name: [] for name in kernels}
    print(f"per size: ms (median of {args.reps} runs), speed-up over Pillow: median of the runs (range)")
    for w, h, ow, oh in SIZES[: args.sizes]:
        img = photo_like(w, h, rng)
        for name, resize in kernels.items():
            want = reference(img, ow, oh).copy()
            if not np.array_equal(resize(img, ow, oh), want):
                sys.exit(f"{w}x{h} -> {ow}x{oh}: the {name} kernel differs from Pillow")
        # alternate them, so a busy spell on the machine hits all
        times: dict[str, list[float]] = {"pillow": [], **{name: [] for name in kernels}}
        for _ in range(args.reps):
            times["pillow"].append(cpu_ms(lambda: reference(img, ow, oh)))
            for name, resize in kernels.items():
                times[name].append(cpu_ms(lambda: resize(img, ow, oh)))
        row = f"{w:>5}x{h:<5} -> {ow:>4}x{oh:<4} Pillow {statistics.median(times['pillow']):6.2f}"
        for name in kernels:
            ratios = [p / k for p, k in zip(times["pillow"], times[name])]
            medians[name].append(statistics.median(ratios))
            bests[name].append(min(times["pillow"]) / min(times[name]))
            row += f" | {name} {statistics.median(times[name]):6.2f} {spread(ratios)}"
        print(row)
    for name in kernels:
        print(f"{name}: median over the sizes {spread(medians[name])} of the per-size medians; "
              f"best runs {statistics.median(bests[name]):.2f}x (identical bytes)")

    if args.startup:
        off = min(startup({"PREPACK_FAST_RESIZE": "0"})[0] for _ in range(args.startup_runs))
        parts = [f"Pillow only {off:.2f} s"]
        # "timed": the default, PREPACK_FAST_RESIZE unset; cold, it builds, self-tests and times every candidate
        for name, setting, cache_env in (("native", "native", "PREPACK_CACHE_DIR"), ("numba", "numba", "NUMBA_CACHE_DIR"),
                                         ("timed choice", "1", "PREPACK_CACHE_DIR")):
            if name == "numba" and "numba" not in kernels:
                continue
            cold, warm = [], []
            for _ in range(args.startup_runs):
                with tempfile.TemporaryDirectory(prefix="bench-resize-cold-") as cache:
                    env = {"PREPACK_FAST_RESIZE": setting, cache_env: cache}
                    cold.append(startup(env)[0])
                    warm.append(startup(env)[0])
            parts.append(f"{name}: cache warm {min(warm):.2f} s (+{min(warm) - off:.2f} s), "
                         f"cold {min(cold):.2f} s (+{min(cold) - off:.2f} s)")
        print(f"start-up of a fresh process's first resize, best of {args.startup_runs}: " + "; ".join(parts))


if __name__ == "__main__":
    main()
