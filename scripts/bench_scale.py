#!/usr/bin/env python3
"""What a pack's metadata costs at cluster scale: open a rank's share, finalize, verify, lineage.

Builds the metadata of a synthetic pack of S streams x R records through the project's own
writer code (``StreamIndex.append`` + ``write_index`` per shard, ``done.json`` per stream, lineage
files per stream, ``finalize``); no shard bytes.  Then, each in a fresh process:

- open: ``PackedShardDataset(dir, rank=0, world_size=W)``, its committed batch count, and loading a
  resume state positioned mid-stream (which checks the digest of each stream's last read record);
  RSS is the peak above the process's RSS right after ``import loader``;
- finalize: ``manifest.json`` from every ``done.json``;
- verify --metadata-only: every stream index (digest chain) and done.json, one stream at a time;
- lineage: the README's two polars questions over every lineage file.

Usage: python scripts/bench_scale.py --streams 256 --records 2000 --world 64
The last line is ``scale: S streams x R records = N records: open X s, RSS +Y MB (rank 0 of W)``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

log = logging.getLogger("bench_scale")

# each measuring process: the project on its path, and its resident memory (MB) from /proc
PRELUDE = """
import json, sys, time
sys.path.insert(0, {root!r})
def rss(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) / 1024
"""

_OPEN = PRELUDE + """import loader
base = rss("VmRSS")
t0 = time.perf_counter()
from loader import PackedShardDataset
ds = PackedShardDataset({out!r}, rank=0, world_size={world})
n = ds.num_batches()
pack = ds.pack
half = {{str(s): pack.num_records(s) // 2 for s in ds.streams}}
state = {{"version": 2, "kind": "merged", "pack": ds.fingerprint, "positions": half,
          "last": {{k: pack.index(int(k)).record(v - 1).digest if v else "" for k, v in half.items()}}}}
ds.load_state_dict(state)
elapsed = time.perf_counter() - t0
print(json.dumps({{"open_s": elapsed, "rss_mb": rss("VmHWM") - base, "batches": n, "streams": ds.streams}}))
"""

_TIMED = """
import json, sys, time
sys.path.insert(0, {root!r})
{imports}
t0 = time.perf_counter()
{body}
print(json.dumps({{"s": time.perf_counter() - t0, "rss_mb": int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) / 1024}}))
"""

_FINALIZE_IMPORTS = """
from prepack.run.driver import finalize
from loader.reader import Pack
"""
_FINALIZE = """
pack = Pack.open({out!r})
cfg = pack.info.stored_config()
assert finalize(pack.location, cfg)[0]
"""

_VERIFY_IMPORTS = "from prepack.tools.verify import verify_pack"
_VERIFY = """
rep = verify_pack({out!r}, metadata_only=True)
assert rep.ok, rep.lines()[-1]
"""

_LINEAGE_IMPORTS = """
import polars as pl
from prepack.tools.lineage_queries import scan_lineage
"""
_LINEAGE = """
lin = scan_lineage({out!r})
a = lin.filter((pl.col("source_file") == "/data/part-00007.parquet") & (pl.col("source_row_group") == 3)
               & (pl.col("source_row") == 11)).select("stream", "record", "sample").sort("stream", "record", "sample").collect()
b = lin.filter((pl.col("stream") == {s}) & (pl.col("record") == {r})).sort("sample").collect()
assert b.height > 0
"""


def fake_config(streams: int, world: int, records: int) -> dict:
    """A real PrepackConfig dict for the identity (paths are never opened)."""
    from schemas.config_file import parse_config

    k = streams // world
    raw = {"seed": 1, "dataloader": {"num_workers": k},
           "prepack": {"world_size": world, "batches_per_stream": records},
           "dataset": {"dataset_info": {"t2i_pretrain": {"t2i": {"data_dir": "/data", "num_files": 1}}},
                       "grouped_datasets": {"t2i_pretrain": {"dataset_names": ["t2i"], "weight": 1.0,
                                                             "image_transform_args": {"image_stride": 16, "max_image_size": 512, "min_image_size": 256},
                                                             "num_used_data": [streams]}}}}
    return parse_config(raw, "/", check_files=False)


def build(out: str, streams: int, records: int, world: int, per_shard: int, samples: int) -> None:
    import hashlib

    import pyarrow as pa
    import pyarrow.parquet as pq

    from prepack.run.identity import pack_identity, write_identity
    from prepack.run.commit.atomic_files import write_bytes_atomic
    from prepack.run.commit.writer import write_index
    from schemas.layout import done_file, stream_lineage_file
    from schemas.lineage import LINEAGE_SCHEMA
    from schemas.location import resolve_location
    from schemas.manifest import RecordEntry, ShardEntry, StreamIndex, StreamSummary

    cfg = fake_config(streams, world, records)
    identity = pack_identity(cfg, "bench-tokenizer", {"bos_token_id": 1})
    loc = resolve_location(out)
    loc.fs.create_dir(loc.base, recursive=True)
    write_identity(loc, identity)
    t0 = time.perf_counter()
    for s in range(streams):
        loc.fs.create_dir(loc.path(f"stream-{s:05d}"), recursive=True)
        index = StreamIndex(s, [], "0" * 64, "0" * 64)
        for k, first in enumerate(range(0, records, per_shard)):
            n = min(per_shard, records - first)
            recs = [RecordEntry(hashlib.blake2b(f"{s}/{first + i}".encode(), digest_size=16).hexdigest(), 30000, samples)
                    for i in range(n)]
            index.append(ShardEntry(stream=s, shard=k, nbytes=200 * 2**20, xxh3="0" * 32, first_record=first,
                                    records=recs, lineage_sha256="0" * 64, lineage_rows=n * samples,
                                    ckpt_json_sha256="0" * 64, ckpt_arrow_sha256="0" * 64))
        write_index(loc, index)  # the last commit of the stream (one write per stream keeps the build fast)
        rows = records * samples
        table = pa.table({
            "stream": pa.array([s] * rows, pa.int32()),
            "record": pa.array([r for r in range(records) for _ in range(samples)], pa.int64()),
            "sample": pa.array(list(range(samples)) * records, pa.int32()),
            "group": pa.array(["t2i_pretrain"] * rows), "dataset": pa.array(["t2i"] * rows),
            "worker_id": pa.array([s % max(1, streams // world)] * rows, pa.int32()),
            "data_indexes": pa.array([[i % 50, i % 7, i % 13] for i in range(rows)], pa.list_(pa.int64())),
            "source_file": pa.array([f"/data/part-{(s * 7 + i) % 64:05d}.parquet" for i in range(rows)]),
            "source_row_group": pa.array([i % 7 for i in range(rows)], pa.int64()),
            "source_row": pa.array([i % 13 for i in range(rows)], pa.int64()),
            "num_tokens": pa.array([3000] * rows, pa.int32()),
        }, schema=LINEAGE_SCHEMA)
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink, compression="zstd")
        data = sink.getvalue().to_pybytes()
        loc.fs.create_dir(loc.path("lineage"), recursive=True)
        write_bytes_atomic(loc, stream_lineage_file(s), data)
        rank, worker = cfg.stream_rank_worker(s)
        summary = StreamSummary(stream=s, rank=rank, worker=worker, seed=cfg.stream_seed(s),
                                num_shards=len(index.shards), num_records=records, num_tokens=30000 * records,
                                num_samples=records * samples, root=index.root, budget=cfg.prepack.budget(),
                                lineage_sha256=hashlib.sha256(data).hexdigest(), lineage_rows=rows)
        write_bytes_atomic(loc, done_file(s), summary.to_json().encode())
        if (s + 1) % max(1, streams // 10) == 0:
            log.info("built %d/%d streams (%.0f s)", s + 1, streams, time.perf_counter() - t0)


def run(code: str) -> dict:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"bench step failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=256, help="S streams in the pack")
    p.add_argument("--records", type=int, default=2000, help="R records per stream")
    p.add_argument("--world", type=int, default=64, help="W ranks the pack is for (S must be a multiple)")
    p.add_argument("--per-shard", type=int, default=20, help="records per shard (256 MiB shards hold ~20)")
    p.add_argument("--samples", type=int, default=2, help="lineage rows per record")
    p.add_argument("--out", help="build here (default: a temporary folder, removed after)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.streams % args.world:
        p.error("--streams must be a multiple of --world")
    tmp = None
    out = args.out
    if out is None:
        tmp = tempfile.TemporaryDirectory(prefix="bench-scale-")
        out = os.path.join(tmp.name, "pack")
    n = args.streams * args.records
    t0 = time.perf_counter()
    build(out, args.streams, args.records, args.world, args.per_shard, args.samples)
    log.info("built %d records of metadata in %.1f s", n, time.perf_counter() - t0)
    opened = min((run(_OPEN.format(root=ROOT, out=out, world=args.world)) for _ in range(3)), key=lambda r: r["open_s"])
    fin = run(_TIMED.format(root=ROOT, imports=_FINALIZE_IMPORTS, body=_FINALIZE.format(out=out)))
    ver = run(_TIMED.format(root=ROOT, imports=_VERIFY_IMPORTS, body=_VERIFY.format(out=out)))
    lin = run(_TIMED.format(root=ROOT, imports=_LINEAGE_IMPORTS,
                            body=_LINEAGE.format(out=out, s=args.streams - 1, r=args.records // 2)))
    log.info("finalize (manifest.json from %d done.json): %.2f s, peak RSS %.0f MB", args.streams, fin["s"], fin["rss_mb"])
    log.info("verify --metadata-only: %.2f s, peak RSS %.0f MB", ver["s"], ver["rss_mb"])
    log.info("lineage, both README questions over %d rows: %.2f s, peak RSS %.0f MB",
             n * args.samples, lin["s"], lin["rss_mb"])
    if tmp is not None:
        tmp.cleanup()
    print(f"scale: {args.streams} streams x {args.records} records = {n} records: open {opened['open_s']:.3f} s, "
          f"RSS +{opened['rss_mb']:.1f} MB (rank 0 of {args.world})")


if __name__ == "__main__":
    main()
