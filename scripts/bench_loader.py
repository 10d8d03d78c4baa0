"""Benchmark the loader on a pack: throughput per core, first-batch latency, size, floor ratio.

    python scripts/bench_loader.py --pack DIR [--streams 0,1] [--limit 200] [--verify 1|0|file]

Reports, for the batches read:
- batches/s and MB/s of record bytes (uncompressed Arrow buffers) per core: process CPU seconds,
  all threads, so the prefetch thread's decompression counts;
- time to first batch (open -> first batch in hand);
- bytes on disk per packed token (whole pack, from the manifest);
- floor ratio: loader CPU time / (read + zstd decompress + one memcpy of the same bytes), i.e.
  how far the loader is from the least work any reader of these files must do;
- the digest check's share (verify on vs off).
The reference comparison (online packing throughput) is left as a hook: ``reference_benchmark``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from loader import open_stream  # noqa: E402
from loader.reader import Pack, iter_records  # noqa: E402

log = logging.getLogger("bench_loader")
MB = 1e6


@dataclass
class Run:
    """One timed pass: batches, record bytes, wall and CPU seconds, first-batch latency."""

    name: str
    batches: int
    record_bytes: int
    wall_s: float
    cpu_s: float
    first_batch_s: float = float("nan")

    def line(self) -> str:
        per_core = self.record_bytes / MB / self.cpu_s if self.cpu_s else float("nan")
        return (
            f"{self.name:<22} {self.batches:6d} batches  {self.batches / self.wall_s:8.1f} batches/s  "
            f"{per_core:8.1f} MB/s/core  cpu {self.cpu_s:7.3f}s  wall {self.wall_s:7.3f}s  "
            f"first {self.first_batch_s * 1e3:7.1f} ms"
        )


def _selection(pack: Pack, streams: list[int], limit: int) -> list[tuple[int, int]]:
    """(stream, number of records) to read, at most ``limit`` records in all."""
    out, left = [], limit
    for s in streams:
        n = min(pack.num_records(s), left)
        if n:
            out.append((s, n))
        left -= n
    return out


def record_bytes(pack: Pack, selection) -> int:
    total = 0
    for s, n in selection:
        for _, (_, rec) in zip(range(n), iter_records(pack, s, verify=False)):
            total += rec.nbytes
    return total


def floor_run(pack: Pack, selection, nbytes: int) -> Run:
    """Least work: read each record (decompressing it) and copy its buffers once."""
    t0, c0 = time.perf_counter(), time.process_time()
    count = 0
    for s, n in selection:
        for _, (_, rec) in zip(range(n), iter_records(pack, s, verify=False)):
            for column in rec.columns:
                for buf in column.buffers():
                    if buf is not None:
                        np.frombuffer(buf, dtype=np.uint8).copy()
            count += 1
    return Run("floor (zstd+memcpy)", count, nbytes, time.perf_counter() - t0, time.process_time() - c0)


def loader_run(pack_dir: str, selection, nbytes: int, verify, prefetch: int) -> Run:
    """The real path: open_stream (prefetch thread, digest check, SimpleCustomBatch)."""
    t0, c0 = time.perf_counter(), time.process_time()
    first, count = float("nan"), 0
    for s, n in selection:
        for _ in zip(range(n), open_stream(pack_dir, s, verify=verify, prefetch=prefetch)):
            if count == 0:
                first = time.perf_counter() - t0
            count += 1
    return Run(f"loader verify={verify}", count, nbytes, time.perf_counter() - t0, time.process_time() - c0, first)


def disk_bytes_per_token(pack: Pack) -> float:
    disk = sum(sh.nbytes for st in pack.manifest.streams for sh in st.shards)
    tokens = sum(r.num_tokens for st in pack.manifest.streams for sh in st.shards for r in sh.records)
    return disk / tokens if tokens else float("nan")


def reference_benchmark(args: argparse.Namespace) -> Run | None:
    """Hook: time the online reference (PackedDataset + DataLoader) on the same data.

    Return a ``Run`` for the same number of batches to print it beside the loader; ``None``
    skips the comparison.
    """
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pack", required=True, help="pack directory or URI")
    ap.add_argument("--streams", default="", help="comma-separated stream ids (default: all)")
    ap.add_argument("--limit", type=int, default=200, help="records to read in all")
    ap.add_argument("--verify", default="1", choices=["0", "1", "file"], help="integrity check of the main run")
    ap.add_argument("--prefetch", type=int, default=2)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    pack = Pack.open(args.pack)
    streams = [int(s) for s in args.streams.split(",") if s] or [st.stream for st in pack.manifest.streams]
    selection = _selection(pack, streams, args.limit)
    nbytes = record_bytes(pack, selection)  # also warms the page cache for fair comparisons
    verify = {"0": False, "1": True, "file": "file"}[args.verify]

    loader_run(args.pack, [(selection[0][0], 1)], 0, verify, args.prefetch)  # warm-up: lazy imports, page cache
    floor = floor_run(pack, selection, nbytes)
    main_run = loader_run(args.pack, selection, nbytes, verify, args.prefetch)
    unverified = loader_run(args.pack, selection, nbytes, False, args.prefetch)
    log.info(
        "pack %s: %d streams, %.1f bytes on disk per packed token",
        args.pack,
        pack.manifest.num_streams,
        disk_bytes_per_token(pack),
    )
    log.info(
        "record bytes read: %.1f MB in %d batches (%.2f MB/batch)",
        nbytes / MB,
        floor.batches,
        nbytes / MB / max(floor.batches, 1),
    )
    for run in (floor, main_run, unverified):
        log.info(run.line())
    log.info(
        "floor ratio (loader cpu / floor cpu): %.2f", main_run.cpu_s / floor.cpu_s if floor.cpu_s else float("nan")
    )
    if verify:
        extra = main_run.cpu_s - unverified.cpu_s
        log.info(
            "integrity check: +%.3f s cpu (%.1f%% of the unverified loader)", extra, 100 * extra / unverified.cpu_s
        )
    reference = reference_benchmark(args)
    if reference is not None:
        log.info(reference.line())
        log.info(
            "speed-up over the reference: %.1fx (batches/s)",
            (main_run.batches / main_run.wall_s) / (reference.batches / reference.wall_s),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
