#!/usr/bin/env python
"""What ``prepack run --reuse OLD`` saves: CPU per batch of a new config packed fresh vs from an
old pack's pixels, end to end through the real ``prepack run``, and the same bytes.

Data: ``bench_pack.py``'s realistic photographs (~0.8 MP, sensor noise) and the NeMo pretrain
knobs.  OLD: one pass (``passes: 1``) over every stream of W=1, K=2.  NEW: another seed, other
group weights and another W x K (W=2, K=1), ``--batches`` batches of stream 0.  Each side's CPU
is the stream worker's own (``cpu_s`` in its done.json); start-up is cancelled by packing
``--skip`` and ``--skip + --batches`` batches and taking the difference.  The sides alternate,
best of ``--reps``.  Before any figure: the reused pack's files equal the fresh pack's byte for
byte (all but the informational done.json / manifest.json) and ``prepack verify`` passes on it.

``--passes`` also measures reuse within one pack: a config that reads its data 4 times over,
packed with and without the stream's own shards (``PREPACK_REUSE_OWN``), per batch of the passes
after the first.

Last line, exactly: ``reuse: fresh X ms/batch, reused Y ms/batch (ratio R), hits H%``.

    python scripts/bench_reuse.py                  # ~3 min on 2 cores
    python scripts/bench_reuse.py --batches 12 --reps 3 --passes
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "helpers"), os.path.dirname(os.path.abspath(__file__))]

KNOBS = dict(expected_num_tokens=32768, max_num_tokens=36864, max_num_tokens_per_sample=16384,
             prefer_buffer_before=16384, max_buffer_size=50, use_flex=True,
             vit_cond_dropout_prob=0.3, vae_cond_dropout_prob=0.3)


def write_config(ds, path: str, *, seed: int = 42, num_workers: int = 2, weights: dict | None = None,
                 **prepack) -> str:
    tmp = ds.config(knobs=KNOBS, num_workers=num_workers, seed=seed, prepack=prepack)
    cfg = yaml.safe_load(open(tmp))
    if "passes" in prepack:
        cfg["prepack"].pop("batches_per_stream", None)
    for group, w in (weights or {}).items():
        cfg["dataset"]["grouped_datasets"][group]["weight"] = w
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f, sort_keys=False)
    return path


def prepack(*args: str, env: dict | None = None) -> str:
    full = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
                **(env or {}))
    proc = subprocess.run([sys.executable, "-m", "prepack.cli", *args], env=full, cwd=ROOT, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        sys.exit(f"prepack {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def stream_run(config: str, out: str, reuse: str | None, env: dict | None = None):
    """One ``prepack run`` of stream 0 on a one-CPU local Ray; its done.json entry."""
    from schemas.layout import done_file
    from schemas.manifest import StreamSummary

    args = ["run", config, "--out", out, "--streams", "0", "--num-cpus", "1", "--no-progress"]
    prepack(*args, *(["--reuse", reuse] if reuse else []), env=env)
    with open(os.path.join(out, done_file(0)), "rb") as f:
        return StreamSummary.from_json(f.read())


def files(root: str) -> dict[str, bytes]:
    from s3checks import pack_bytes  # tests/helpers: the pack's files but done.json / manifest.json

    return pack_bytes(root)


def measure(configs: dict[int, str], reuse: str | None, reps: int, tmp: str, env: dict | None = None) -> list[list]:
    """Per rep: [(done.json summary, output folder) for each budget]."""
    out = []
    for _ in range(reps):
        row = []
        for n, config in configs.items():
            dest = tempfile.mkdtemp(prefix=f"run-{'r' if reuse else 'f'}-{n}-", dir=tmp)
            row.append((stream_run(config, dest, reuse, env), dest))
        out.append(row)
    return out


def per_batch(runs: list[list], batches: int) -> tuple[float, list[float]]:
    """Best (min) start-up-free CPU ms per batch over the reps, and every rep's."""
    each = [(big[0].cpu_s - small[0].cpu_s) / batches * 1e3 for small, big in runs]
    return min(each), [round(x, 1) for x in each]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=8, help="batches timed after --skip")
    ap.add_argument("--skip", type=int, default=2, help="batches whose cost (with start-up) is subtracted")
    ap.add_argument("--reps", type=int, default=2, help="runs per side, alternating; best taken")
    ap.add_argument("--passes", action="store_true", help="also measure reuse within one pack (4 passes)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")

    from bench_pack import make_data
    from machine import machine_line

    tmp = tempfile.mkdtemp(prefix="bench-reuse-")
    try:
        ds = make_data(os.path.join(tmp, "data"))
        print(machine_line())
        old_cfg = write_config(ds, os.path.join(tmp, "old.yaml"), passes=1)
        old = os.path.join(tmp, "old")
        prepack("run", old_cfg, "--out", old, "--num-cpus", "1", "--no-progress")
        weights = {"t2i_pretrain": 2, "unified_edit": 1, "vlm_sft": 1}
        configs = {n: write_config(ds, os.path.join(tmp, f"new-{n}.yaml"), seed=7, num_workers=1, weights=weights,
                                   world_size=2, batches_per_stream=n) for n in (args.skip, args.skip + args.batches)}
        own_off = {"PREPACK_REUSE_OWN": "0"}  # only OLD's pixels: what --reuse itself saves
        fresh_runs, reused_runs = [], []
        for _ in range(args.reps):
            fresh_runs += measure(configs, None, 1, tmp, own_off)
            reused_runs += measure(configs, old, 1, tmp, own_off)
        fresh_ms, fresh_all = per_batch(fresh_runs, args.batches)
        reused_ms, reused_all = per_batch(reused_runs, args.batches)
        f_out, r_out = fresh_runs[0][-1][1], reused_runs[0][-1][1]
        if files(f_out) != files(r_out):
            diff = sorted(k for k in set(files(f_out)) | set(files(r_out)) if files(f_out).get(k) != files(r_out).get(k))
            sys.exit(f"the reused pack differs from the fresh pack: {diff[:5]}")
        prepack("verify", r_out)
        summary = reused_runs[0][-1][0]
        hits = summary.reuse.get("reused", 0) / max(1, summary.reuse.get("images", 0))
        print(f"fresh  : {fresh_ms:7.1f} ms/batch (every run {fresh_all})")
        print(f"reused : {reused_ms:7.1f} ms/batch (every run {reused_all}); "
              f"{summary.reuse.get('reused', 0)} of {summary.reuse.get('images', 0)} images reused, "
              f"{summary.reuse.get('decodes_saved', 0)} decodes saved, fallbacks {summary.reuse.get('fallbacks', {})}")
        print("same bytes as the fresh pack; prepack verify passed on the reused pack")
        if args.passes:
            passes = {p: write_config(ds, os.path.join(tmp, f"passes-{p}.yaml"), seed=3, passes=p) for p in (1, 4)}
            costs = {}
            for own in ("0", "1"):
                runs = {p: stream_run(c, os.path.join(tmp, f"passes-{p}-{own}"), None, {"PREPACK_REUSE_OWN": own})
                        for p, c in passes.items()}
                later = (runs[4].cpu_s - runs[1].cpu_s) / max(1, runs[4].num_records - runs[1].num_records) * 1e3
                costs[own] = (runs[1].cpu_s / runs[1].num_records * 1e3, later, runs[4].reuse)
            if files(os.path.join(tmp, "passes-4-0")) != files(os.path.join(tmp, "passes-4-1")):
                sys.exit("reuse within one pack changed its bytes")
            first, later, counts = costs["1"]
            print(f"passes: first pass {first:.1f} ms/batch, later passes {later:.1f} ms/batch from the stream's own "
                  f"shards (ratio {first / later:.2f}; {costs['0'][1]:.1f} ms/batch without), {counts}")
        print(f"reuse: fresh {fresh_ms:.1f} ms/batch, reused {reused_ms:.1f} ms/batch "
              f"(ratio {fresh_ms / reused_ms:.2f}), hits {hits:.0%}")
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
