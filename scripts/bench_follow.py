#!/usr/bin/env python3
"""Follow mode: what it costs per batch, and how soon a committed shard reaches the reader.

1. Cost: a finished synthetic pack (the real writer, ``tests/helpers/fakepack.py``) read whole by
   ``PackedShardDataset`` with and without ``follow=True``; CPU per batch, best of 3.
2. Latency: a writer thread commits one single-record shard every ``--interval`` seconds while a
   ``follow=True`` reader (default ``poll_s``) reads; for each batch, the time from its commit
   (the index write) to the reader handing it out.

Usage: python scripts/bench_follow.py [--batches 60] [--interval 0.5] [--poll 1.0]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

log = logging.getLogger("bench_follow")


def read_cpu(path: str, follow: bool) -> tuple[int, float]:
    from loader import PackedShardDataset

    ds = PackedShardDataset(path, rank=0, world_size=1, follow=follow, poll_s=0.05)
    c0 = time.process_time()
    n = sum(1 for _ in ds)
    return n, time.process_time() - c0


def latency(tmp: str, batches: int, interval: float, poll: float) -> list[float]:
    from loader import PackedShardDataset
    from prepack.run.commit.writer import ShardFormat, StreamWriter
    from schemas.location import resolve_location
    from schemas.manifest import StreamIndex
    from tests.helpers.fakepack import commit_entry, fake_metadata, mark_done, stream_batches, write_pack

    out = os.path.join(tmp, "live")
    identity = write_pack(out, {0: stream_batches(0, 1)}, world_size=1, num_workers=0, done=False)  # pack.json + shard 0
    loc = resolve_location(out)
    committed: dict[int, float] = {0: time.monotonic()}
    batches_list = stream_batches(0, batches)

    def writer() -> None:
        index = StreamIndex(0, [])
        w = StreamWriter(out, 0, ShardFormat(1, "zstd:1", fake_metadata(identity)))
        for i, b in enumerate(batches_list):
            entry = w.append(b)  # shard_bytes=1: every record is a shard
            if i == 0:
                index.append(entry)  # already committed by write_pack above: same bytes
                continue
            time.sleep(interval)
            commit_entry(loc, index, entry)
            committed[i] = time.monotonic()
        mark_done(loc, identity, index, 0)

    t = threading.Thread(target=writer)
    ds = PackedShardDataset(out, rank=0, world_size=1, follow=True, poll_s=poll, timeout_s=30)
    t.start()
    delays = []
    for i, _ in enumerate(ds):
        delays.append(time.monotonic() - committed[i])
    t.join()
    return delays[1:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, default=60)
    p.add_argument("--interval", type=float, default=0.5, help="seconds between commits in the latency run")
    p.add_argument("--poll", type=float, default=1.0, help="the follower's poll_s")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from tests.helpers.fakepack import make_pack

    with tempfile.TemporaryDirectory(prefix="bench-follow-") as tmp:
        path = os.path.join(tmp, "done")
        make_pack(path, world_size=1, num_workers=2, lengths=[args.batches // 2, args.batches - args.batches // 2])
        read_cpu(path, False)  # warm-up
        plain = min((read_cpu(path, False) for _ in range(3)), key=lambda r: r[1])
        follow = min((read_cpu(path, True) for _ in range(3)), key=lambda r: r[1])
        log.info("finished pack, %d batches: %.2f ms CPU per batch plain, %.2f ms with follow=True",
                 plain[0], 1e3 * plain[1] / plain[0], 1e3 * follow[1] / follow[0])
        delays = latency(tmp, min(args.batches, 20), args.interval, args.poll)
    delays.sort()
    print(f"follow: commit -> batch handed out: median {delays[len(delays) // 2]:.2f} s, max {delays[-1]:.2f} s "
          f"(poll_s={args.poll:g}); per batch {1e3 * follow[1] / follow[0]:.2f} ms vs {1e3 * plain[1] / plain[0]:.2f} ms "
          "on a finished pack")


if __name__ == "__main__":
    main()
