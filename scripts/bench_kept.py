#!/usr/bin/env python
"""What a bounded pack keeps per shard for the whole run, in bytes: the files no trim deletes.

A trim deletes a shard's records file (and its VAE latents) and the checkpoints off the ladder
(``prepack.run.bounded.checkpoint_ladder``); each shard's index row, pixel index, sources document
and lineage stay, and so do the ladder's checkpoints.  Two packs, each made at once (``prepack run
--no-ray``) then trimmed whole (as if every training had read everything):

- **demo knobs**: the demo data under ``configs/demo.yaml`` (W=1, K=2), 1 MB shards (a ~2.4 MB
  batch each: a bounded pack wants small shards), ``--batches`` a stream;
- **NeMo pretrain knobs**: ``scripts/bench_pack.py``'s photographs (~0.8 MP) under NeMo's BAGEL
  pretrain knobs (32768 / 36864 / 16384, flex), the default 256 MiB shards, ``--pretrain-batches``
  a stream.

For each, per shard: the stream index's bytes, the pixel index, the sources document, the lineage
(the stream's compacted lineage over its shards), everything else a stream folder keeps (done.json,
trimmed.json), and the ladder's checkpoints apart (they do not grow per shard: ~2 log2(shards)).

Last line, exactly:
``kept: X KB a shard at demo knobs (S1 shards of M1 MB), Y KB at NeMo pretrain knobs (S2 of M2 MB); ladder C checkpoints``

    python scripts/bench_kept.py          # ~2 min on 2 cores
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

KB, MB = 1000, 10**6


def pack(config: str, out: str) -> None:
    env = dict(os.environ, PYTHONPATH=ROOT, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.run([sys.executable, "-m", "prepack.cli", "run", config, "--out", out, "--no-ray"], cwd=ROOT,
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"prepack run failed:\n{proc.stderr[-3000:]}")


def kept(out: str) -> dict:
    """Trim everything, then sort what stays by kind: bytes per kind, shards, records bytes trimmed."""
    from loader.reader import Pack
    from prepack.run.bounded.trim_policy import TrimPolicy

    p = Pack.open(out)
    shards = sum(len(p.index(s).shards) for s in range(p.num_streams))
    records = sum(sh.nbytes for s in range(p.num_streams) for sh in p.index(s).shards)
    TrimPolicy(p, lambda s: 1 << 62).apply(forget=True)
    kinds: dict[str, int] = {}
    ckpts = 0
    for d, _, names in os.walk(out):
        for n in names:
            size = os.path.getsize(os.path.join(d, n))
            if n.startswith("ckpt-"):
                kind = "checkpoint"
                ckpts += n.endswith(".json")
            elif n.endswith(".pixels.arrow"):
                kind = "pixel index"
            elif n.endswith(".sources.json"):
                kind = "sources"
            elif "lineage" in n or "lineage" in d:
                kind = "lineage"
            elif n.startswith("index"):
                kind = "stream index"
            elif n.startswith("shard-"):
                kind = "records (not trimmed)"
            else:
                kind = "other"
            kinds[kind] = kinds.get(kind, 0) + size
    return {"kinds": kinds, "shards": shards, "records": records, "ckpts": ckpts, "streams": p.num_streams}


def report(name: str, got: dict) -> float:
    per = {k: v / got["shards"] for k, v in got["kinds"].items()}
    grows = sum(v for k, v in per.items() if k not in ("checkpoint", "records (not trimmed)"))
    print(f"{name}: {got['shards']} shards of {got['records'] / got['shards'] / MB:.1f} MB over {got['streams']} "
          f"streams, all trimmed; kept per shard: " + ", ".join(f"{k} {v / KB:.1f} KB" for k, v in sorted(per.items()))
          + f"; {got['ckpts']} checkpoints on the ladder ({got['kinds'].get('checkpoint', 0) / MB:.1f} MB)")
    print(f"{name}: {grows / KB:.1f} KB a shard grows with the run, {grows / (got['records'] / got['shards']):.3%} of "
          "a shard's records")
    return grows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, default=160, help="batches a stream at demo knobs (default 160)")
    p.add_argument("--pretrain-batches", type=int, default=60, help="batches a stream at NeMo pretrain knobs (default 60)")
    args = p.parse_args()
    from machine import machine_line

    print(machine_line(), flush=True)
    tmp = tempfile.mkdtemp(prefix="bench-kept-")
    try:
        from bench_pack import NEMO_PRETRAIN_KNOBS, make_data
        from ray_helpers import make_demo

        demo = make_demo(os.path.join(tmp, "demo"))
        with open(demo) as f:
            doc = yaml.safe_load(f)
        doc["prepack"].update(world_size=1, batches_per_stream=args.batches, shard_bytes=1_000_000)
        doc["dataloader"]["num_workers"] = 2
        with open(demo, "w") as f:
            yaml.safe_dump(doc, f, sort_keys=False)
        pack(demo, os.path.join(tmp, "demo-out"))
        a = kept(os.path.join(tmp, "demo-out"))
        ga = report("demo knobs", a)
        ds = make_data(os.path.join(tmp, "photos"))
        cfg = ds.config(knobs=dict(NEMO_PRETRAIN_KNOBS), num_workers=2, prepack={"batches_per_stream": args.pretrain_batches})
        pack(cfg, os.path.join(tmp, "pretrain-out"))
        b = kept(os.path.join(tmp, "pretrain-out"))
        gb = report("NeMo pretrain knobs", b)
        print(f"kept: {ga / KB:.1f} KB a shard at demo knobs ({a['shards']} shards of {a['records'] / a['shards'] / MB:.1f} "
              f"MB), {gb / KB:.1f} KB at NeMo pretrain knobs ({b['shards']} of {b['records'] / b['shards'] / MB:.1f} MB); "
              f"ladder {a['ckpts']} checkpoints")
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
