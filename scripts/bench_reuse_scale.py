#!/usr/bin/env python3
"""What ``--reuse OLD`` costs a stream worker when OLD holds 10^8 pictures: memory and lookup time.

1. Lookups: a pack identity (``pack.json``, through the project's own code) and a pixel catalog of
   ``--pictures`` synthetic pictures (random content keys, every column filled), written by the
   catalog's own ``write_catalog``.  Then, in a fresh process, a stream's ``PixelReuse`` over it:
   ``--lookups`` pictures that are there (decode facts, then the frame's location, as a stream asks)
   and as many that are not.  RSS is the peak above the process's RSS after its imports.
2. Build: ``--build-pictures`` pictures in real shard pixel indexes (``pixel_index_bytes``) under
   real stream indexes, merged by ``build_catalog`` (the external sort ``prepack index`` runs), in
   a fresh process: seconds and peak RSS.

Usage: python scripts/bench_reuse_scale.py --pictures 100000000
Last line: ``reuse scale: N pictures in OLD: worker RSS +X MB, lookup Y us (hit) / Z us (miss); build B pictures/s``
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_scale import PRELUDE as _PRELUDE  # noqa: E402  (each measuring process: the project, its memory)

log = logging.getLogger("bench_reuse_scale")

_LOOKUP = _PRELUDE + """import numpy as np
from prepack.engine.reuse.source_pictures import ReuseCounts
from prepack.engine.reuse.earlier_pixels import PixelReuse
from schemas.pixel_index import PictureSource
keys = [bytes.fromhex(k) for k in json.load(open({keys!r}))]
rng = np.random.default_rng(1)
misses = [rng.bytes(16) for _ in keys]
base = rss("VmRSS")
reuse = PixelReuse([{out!r}], ReuseCounts())
t0 = time.perf_counter()
assert reuse.facts((keys[0], "rgb")) is not None
first = time.perf_counter() - t0
t0 = time.perf_counter()
for k in keys:
    facts = reuse.facts((k, "rgb"))
    assert reuse._catalog_where(PictureSource(k, "rgb", facts), 512, 384) is not None
hit = (time.perf_counter() - t0) / len(keys)
t0 = time.perf_counter()
for k in misses:
    assert reuse.facts((k, "rgb")) is None
miss = (time.perf_counter() - t0) / len(misses)
print(json.dumps({{"rss_mb": rss("VmHWM") - base, "first_s": first, "hit_us": hit * 1e6, "miss_us": miss * 1e6,
                  "fallbacks": reuse.counts.fallbacks}}))
"""

_BUILD = _PRELUDE + """from prepack.run.catalog import build_catalog
base = rss("VmRSS")
t0 = time.perf_counter()
result = build_catalog({out!r})
print(json.dumps({{"s": time.perf_counter() - t0, "rss_mb": rss("VmHWM") - base, "rows": result.rows,
                  "shards": result.shards}}))
"""


def write_pack_identity(out: str, streams: int) -> None:
    from bench_scale import fake_config

    from prepack.run.identity import pack_identity, write_identity
    from schemas.location import resolve_location

    loc = resolve_location(out)
    loc.fs.create_dir(loc.base, recursive=True)
    write_identity(loc, pack_identity(fake_config(streams, 1, 1), "bench-tokenizer", {"bos_token_id": 1}))


def synthetic_catalog(out: str, pictures: int, sample: int, seed: int = 0) -> list[str]:
    """A catalog of ``pictures`` random pictures; returns ``sample`` of their keys (hex)."""
    import numpy as np

    from prepack.engine.reuse.source_pictures import RESIZE_IMPL
    from prepack.run.catalog import write_catalog
    from schemas.location import resolve_location
    from schemas.pixel_catalog import PARTS, ROW_DTYPE

    rng = np.random.default_rng(seed)
    per_part = pictures // PARTS
    keys: list[str] = []

    def parts():
        t0 = time.perf_counter()
        for part in range(PARTS):
            n = per_part + (1 if part < pictures % PARTS else 0)
            raw = np.frombuffer(rng.bytes(16 * n), np.uint8).reshape(n, 16).copy()
            raw[:, 0] = part
            content = np.sort(raw.view("S16").ravel())
            for i in rng.integers(0, n, max(1, sample // PARTS)):
                keys.append(bytes(content[i].ljust(16, b"\0")).hex())
            rows = np.zeros(n, ROW_DTYPE)
            rows["content"] = content
            rows["width"], rows["height"], rows["src_width"], rows["src_height"] = 512, 384, 1024, 768
            rows["stream"], rows["shard"] = rng.integers(0, 4096, n), rng.integers(0, 64, n)
            rows["shard_bytes"], rows["nbytes"] = 256 << 20, 512 * 384 * 3
            rows["offset"], rows["length"] = rng.integers(0, 256 << 20, n), rng.integers(100_000, 400_000, n)
            rows["digest"] = rng.integers(0, 2**63, n)
            yield part, rows
            if (part + 1) % 32 == 0:
                log.info("catalog: %d/%d parts (%.0f s)", part + 1, PARTS, time.perf_counter() - t0)

    write_catalog(resolve_location(out), parts(), {}, RESIZE_IMPL, {"decode": ["rgb"], "codec": ["zstd:1"], "damage": [""]})
    return keys


def synthetic_shards(out: str, pictures: int, per_shard: int = 1000, streams: int = 8) -> None:
    """Real shard pixel indexes under real stream indexes (no shard bytes): what ``prepack index`` reads."""
    import hashlib

    import numpy as np

    from prepack.engine.reuse.source_pictures import RESIZE_IMPL
    from prepack.run.commit.atomic_files import write_bytes_atomic
    from prepack.run.commit.writer import write_index
    from schemas.location import resolve_location
    from schemas.layout import shard_pixels_file
    from schemas.manifest import RecordEntry, ShardEntry, StreamIndex
    from schemas.pixel_index import DecodeFacts, PictureSource, PixelEntry, pixel_index_bytes

    loc = resolve_location(out)
    rng = np.random.default_rng(2)
    shards = max(1, pictures // per_shard // streams)
    for s in range(streams):
        loc.fs.create_dir(loc.path(f"stream-{s:05d}"), recursive=True)
        index = StreamIndex(s, [], "0" * 64, "0" * 64)
        for k in range(shards):
            entries = [PixelEntry(PictureSource(rng.bytes(16), "rgb", DecodeFacts(1024, 768)), 512, 384, i // 40, i % 40,
                                  i * 300_000, 300_000, 512 * 384 * 3, "zstd:1", int(rng.integers(0, 2**63)),
                                  int(rng.integers(0, 2**63)))
                       for i in range(per_shard)]
            data = pixel_index_bytes(entries, RESIZE_IMPL)
            write_bytes_atomic(loc, shard_pixels_file(s, k), data)
            recs = [RecordEntry(hashlib.blake2b(f"{s}/{k}/{i}".encode(), digest_size=16).hexdigest(), 30000, 10)
                    for i in range(per_shard // 40)]
            index.append(ShardEntry(stream=s, shard=k, nbytes=256 << 20, xxh3="0" * 32, first_record=k * len(recs),
                                    records=recs, pixels_sha256=hashlib.sha256(data).hexdigest()))
        write_index(loc, index)


def run(code: str) -> dict:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        sys.exit(f"bench_reuse_scale: a measuring process failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pictures", type=float, default=1e7, help="pictures in OLD's catalog (default 1e7; the target is 1e8)")
    p.add_argument("--lookups", type=int, default=20_000)
    p.add_argument("--build-pictures", type=float, default=4e5, help="pictures merged by the build measurement")
    p.add_argument("--dir", help="work folder (default: a temporary one, removed after)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from machine import machine_line  # CPU, ISA: where the figures were taken

    log.info("%s", machine_line())
    work = args.dir or tempfile.mkdtemp(prefix="bench-reuse-scale-")
    try:
        old = os.path.join(work, "old")
        write_pack_identity(old, 8)
        t0 = time.perf_counter()
        keys = synthetic_catalog(old, int(args.pictures), args.lookups)
        log.info("catalog of %s pictures written in %.0f s (%.1f GB)", f"{int(args.pictures):,}",
                 time.perf_counter() - t0, _du(os.path.join(old, "pixels")) / 1e9)
        keys_file = os.path.join(work, "keys.json")
        json.dump(keys, open(keys_file, "w"))
        look = run(_LOOKUP.format(root=ROOT, keys=keys_file, out=old))
        log.info("lookups: first %.2f s (fences), hit %.0f us, miss %.0f us, peak RSS +%.0f MB, fallbacks %s",
                 look["first_s"], look["hit_us"], look["miss_us"], look["rss_mb"], look["fallbacks"] or "none")
        shutil.rmtree(old)
        built = os.path.join(work, "built")
        write_pack_identity(built, 8)
        synthetic_shards(built, int(args.build_pictures))
        b = run(_BUILD.format(root=ROOT, out=built))
        log.info("build: %s pictures of %d shards in %.1f s, peak RSS +%.0f MB", f"{b['rows']:,}", b["shards"], b["s"],
                 b["rss_mb"])
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    print(f"reuse scale: {int(args.pictures):,} pictures in OLD: worker RSS +{look['rss_mb']:.0f} MB, lookup "
          f"{look['hit_us']:.0f} us (hit) / {look['miss_us']:.0f} us (miss); build {b['rows'] / b['s']:,.0f} pictures/s")


def _du(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(folder) for n in names)


if __name__ == "__main__":
    main()
