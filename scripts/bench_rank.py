#!/usr/bin/env python
"""What one training rank pays for its data: the online reference pipeline vs a pack, same batches.

One rank (rank 0 of W=1) with K DataLoader workers (``--workers``), realistic photographs (as
``bench_pack.py`` makes them) and NeMo's pretrain knobs (32768 / 36864 / 16384, flex):

- **online**: the reference as NeMo's recipe builds it, ``BagelDataloaderConfig(...).build(...)``
  (its ``StatefulDataLoader``, ``bagel_packed_collate_fn``, ``pin_memory=True``,
  ``prefetch_factor=2``);
- **pack**: ``loader.build_dataloader`` over a pack of the same streams, made with ``prepack run``.

Each side runs in a fresh process that imports the same modules and loads the tokenizer (as a
NeMo rank's ``setup()`` does), so what differs is the pipeline.  Its consumer does what NeMo's
training step does with a batch before the model: ``batch.to_dict()`` (the step's token counts;
on a CPU this is also where a pack's batch builds its float tensors), with one torch thread
(``--trainer-threads``: torchrun's default when a node runs several ranks).  Measured:

- **memory**: every 50 ms (``--interval-ms``) this process reads ``/proc/PID/smaps_rollup`` of the
  side's process and its DataLoader workers and sums their PSS; shared memory holding batches in
  flight (``/dev/shm`` or memfd files a process of the tree holds open but has not mapped, e.g.
  a batch a worker has sent and the trainer not yet received) is added, since PSS misses it.
  Reported: the peak, the peak of the first and of the second half of the batches (still
  rising?), the trainer process alone after its imports (torch, the tokenizer: the floor), and
  the peak of shared memory the tree holds (mapped or not);
- **CPU per batch**, trainer process (all its threads) and workers (``/proc/PID/stat``), over the
  batches after the first (steady state; workers run ahead by their prefetch, a constant lead);
- **batches per second** the rank gets over the same window, and **first-batch latency** (from
  the loader's construction to the first batch in hand);
- with CUDA only: time from ``next()`` to the batch on the device (``.cuda()``, synchronized),
  with and without pinned memory, the consumer pausing ``--step-ms`` per step as training would.

Both sides must yield the same batches: each side digests every batch's ``to_dict()`` (outside
the CPU it is charged), the digests must be equal in order, and the first batch of every stream
is compared tensor for tensor with ``tests/helpers/compare.diff_batches``.  The last line is the
headline:

    rank: online K=2 X MB, A ms/batch; pack K=2 Y MB, B ms/batch (memory Rm x, CPU Rc x)

    python scripts/bench_rank.py                       # K=2, 24 batches (a few minutes on 2 cores)
    python scripts/bench_rank.py --workers 4 --batches 40
    python scripts/bench_rank.py --tiny --batches 4    # small photos and knobs (the smoke test)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "helpers"), os.path.join(ROOT, "scripts")]

MB = 1e6
TINY_KNOBS = dict(expected_num_tokens=6144, max_num_tokens=8192, max_num_tokens_per_sample=6144,
                  prefer_buffer_before=4096, max_buffer_size=8, use_flex=True,
                  vit_cond_dropout_prob=0.3, vae_cond_dropout_prob=0.3)
_CLOCK_TICK = os.sysconf("SC_CLK_TCK")
_SHM = re.compile(r"^(/dev/shm/|/memfd:)")


# -- the process tree, read from /proc -------------------------------------------------------------
def descendants(pid: int) -> list[int]:
    """``pid``'s child processes, recursively (from /proc/PID/task/TID/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                with open(f"/proc/{p}/task/{t}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (live and exited)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICK


_ROLLUP = ("Pss", "Pss_File")


def _rollup(pid: int) -> dict[str, int]:
    """PSS of a process, and the file-backed part of it, in bytes (0 when it has gone)."""
    out = dict.fromkeys(_ROLLUP, 0)
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in out:
                    out[key] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


def _shm_held(pid: int, sizes: dict[int, int], mapped: set[int]) -> None:
    """Shared-memory files ``pid`` holds open (inode -> size) and those it maps (inodes)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                if "/dev/shm/" in line or "/memfd:" in line:
                    parts = line.split(None, 5)
                    mapped.add(int(parts[4]))
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return
    for fd in fds:
        try:
            if _SHM.match(os.readlink(f"/proc/{pid}/fd/{fd}")):
                st = os.stat(f"/proc/{pid}/fd/{fd}")
                sizes[st.st_ino] = max(sizes.get(st.st_ino, 0), st.st_blocks * 512)
        except OSError:
            continue


@dataclass
class Sample:
    t: float  # time.time()
    pss: int  # sum over the tree
    file: int  # of which file-backed (libraries: their share also depends on processes outside the tree)
    shm: int  # shared-memory files the tree holds open, mapped or not
    unmapped: int  # of those, the ones no process of the tree maps (not in any PSS)

    @property
    def memory(self) -> int:
        return self.pss + self.unmapped


class TreeSampler(threading.Thread):
    """Samples the memory of ``pid`` and its descendants every ``interval`` seconds until stopped."""

    def __init__(self, pid: int, interval: float):
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.samples: list[Sample] = []
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            t = time.time()
            pids = [self.pid] + descendants(self.pid)
            sizes: dict[int, int] = {}
            mapped: set[int] = set()
            pss = file = 0
            for p in pids:
                r = _rollup(p)
                pss, file = pss + r["Pss"], file + r["Pss_File"]
                _shm_held(p, sizes, mapped)
            if pss:
                unmapped = sum(n for ino, n in sizes.items() if ino not in mapped)
                self.samples.append(Sample(t, pss, file, sum(sizes.values()), unmapped))
            self._halt.wait(max(0.0, self.interval - (time.time() - t)))

    def stop(self) -> list[Sample]:
        self._halt.set()
        self.join()
        return self.samples


# -- one side, in its own process ------------------------------------------------------------------
def _digest(d: dict) -> str:
    """Content digest of a ``to_dict()``: keys, tensor dtypes, shapes and bytes, other values' repr."""
    import torch
    import xxhash

    h = xxhash.xxh3_128()
    for k in sorted(d):
        v = d[k]
        h.update(k.encode())
        if isinstance(v, torch.Tensor):
            h.update(f"{v.dtype}{tuple(v.shape)}".encode())
            h.update(v.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().data)
        elif isinstance(v, list) and v and isinstance(v[0], torch.Tensor):
            for t in v:
                h.update(f"{t.dtype}{tuple(t.shape)}".encode())
                h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().data)
        else:
            h.update(repr(v).encode())
    return h.hexdigest()


def _loader(side: str, cfg, pack: str, workers: int, pin: bool, tok, special):
    if side == "online":
        from dataclasses import asdict

        from nemo_automodel.components.datasets.multimodal import BagelDatasetConfig
        from nemo_automodel.components.datasets.multimodal.loader import BagelDataloaderConfig

        import oracle

        grouped, info = oracle.reference_dataset_block(cfg)
        dataset = BagelDatasetConfig(grouped_datasets=grouped, dataset_info=info, **asdict(cfg.knobs))
        build = BagelDataloaderConfig(dataset_config=dataset, num_workers=workers, pin_memory=pin,
                                      prefetch_factor=2).build(
            tokenizer=tok, special_tokens=special, rank=0, world_size=1, batch_size=1, global_seed=cfg.seed)
        return build.dataloader
    from loader import build_dataloader

    return build_dataloader(pack, rank=0, world_size=1, num_workers=workers, pin_memory=pin, prefetch_factor=2)


def child(args) -> None:
    """One side: import, build the loader, take ``--batches`` batches; results as JSON to ``--result``."""
    import torch
    import nemo_automodel.components.datasets.multimodal  # noqa: F401  (both sides: what a NeMo rank imports)
    import loader  # noqa: F401
    from nemo_automodel.components.datasets.multimodal import add_special_tokens

    from prepack.engine.tokenizer import load_tokenizer
    from schemas.config_file import load_config

    torch.set_num_threads(args.trainer_threads)
    cfg = load_config(args.config)
    tok, special, _ = add_special_tokens(load_tokenizer(cfg.tokenizer))
    result: dict = {"floor_pss": _rollup(os.getpid())["Pss"], "ready_t": time.time()}
    if args.cuda:
        result["cuda"] = {pin: _cuda_steps(args, cfg, tok, special, pin) for pin in (True, False)}
    else:
        result.update(_cpu_steps(args, cfg, tok, special))
    with open(args.result, "w") as f:
        json.dump(result, f)


def _cpu_steps(args, cfg, tok, special) -> dict:
    me = os.getpid()

    def cpu() -> tuple[float, float]:
        r = resource.getrusage(resource.RUSAGE_SELF)
        kids = 0.0
        for p in descendants(me):
            try:
                kids += process_cpu_s(p)
            except OSError:
                pass
        return r.ru_utime + r.ru_stime, kids

    t0 = time.perf_counter()
    loader = _loader(args.child, cfg, args.pack, args.workers, True, tok, special)
    it = iter(loader)
    digests, times, cpus, first = [], [], [], None
    digest_cpu = 0.0
    for i in range(args.batches):
        batch = next(it)
        if first is None:
            first = time.perf_counter() - t0
        d = batch.to_dict()  # NeMo's training step: the token counts, before .cuda()
        times.append((time.perf_counter(), time.time()))
        main, kids = cpu()
        cpus.append((main - digest_cpu, kids))  # the digests so far are the benchmark's CPU, not the rank's
        c = time.thread_time()
        digests.append(_digest(d))
        digest_cpu += time.thread_time() - c
        del d, batch
    steps = max(1, args.batches - 1)
    main_cpu = (cpus[-1][0] - cpus[0][0]) / steps
    worker_cpu = (cpus[-1][1] - cpus[0][1]) / steps
    wall = (times[-1][0] - times[0][0]) / steps
    del it, loader
    return {"digests": digests, "first_batch_s": first, "main_cpu_s": main_cpu, "worker_cpu_s": worker_cpu,
            "wall_s": wall, "step_t": [t for _, t in times], "workers_seen": args.workers}


def _cuda_steps(args, cfg, tok, special, pin: bool) -> float:
    """Median seconds from ``next()`` to the batch on the device (after the first batch)."""
    import torch

    device = torch.device("cuda", 0)
    it = iter(_loader(args.child, cfg, args.pack, args.workers, pin, tok, special))
    waits = []
    for i in range(args.batches):
        t = time.perf_counter()
        batch = next(it).cuda(device)
        torch.cuda.synchronize(device)
        if i:
            waits.append(time.perf_counter() - t)
        batch.to_dict()
        del batch
        time.sleep(args.step_ms / 1e3)  # the training step the loader overlaps with
    del it
    waits.sort()
    return waits[len(waits) // 2] if waits else float("nan")


# -- the parent: data, pack, both sides, the report ------------------------------------------------
@dataclass
class Side:
    name: str
    samples: list[Sample]
    result: dict
    halves: tuple[int, int] = (0, 0)
    peak: Sample | None = None
    shm_peak: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def cpu_ms(self) -> float:
        return (self.result["main_cpu_s"] + self.result["worker_cpu_s"]) * 1e3


def run_side(name: str, args, config: str, pack: str, cuda: bool = False) -> Side:
    result_path = os.path.join(args.tmp, f"{name}{'-cuda' if cuda else ''}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--config", config, "--pack", pack,
           "--workers", str(args.workers), "--batches", str(args.batches), "--result", result_path,
           "--step-ms", str(args.step_ms), "--trainer-threads", str(args.trainer_threads)] + (["--cuda"] if cuda else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sampler = TreeSampler(proc.pid, args.interval_ms / 1e3)
    sampler.start()
    output = proc.communicate()[0]
    samples = sampler.stop()
    if proc.returncode != 0:
        sys.exit(f"bench_rank: the {name} side failed ({proc.returncode}):\n{output[-4000:]}")
    with open(result_path) as f:
        result = json.load(f)
    side = Side(name, samples, result)
    if not cuda and samples:
        side.peak = max(samples, key=lambda s: s.memory)
        side.shm_peak = max(s.shm for s in samples)
        steps = result["step_t"]  # the batches' times: the halves are of the batches, start-up excluded
        mid = steps[len(steps) // 2 - 1]
        first = [s.memory for s in samples if steps[0] <= s.t <= mid]
        second = [s.memory for s in samples if mid < s.t <= steps[-1]]
        side.halves = (max(first, default=0), max(second, default=0))
    return side


def make_pack(args, config: str, out: str) -> None:
    """``prepack run`` over the config (a local Ray, or ``--no-ray`` with ``--pack-inline``)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    env.setdefault("RAY_AUTH_MODE", "disabled")
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    cmd = [sys.executable, "-m", "prepack.cli", "run", config, "--out", out, "--no-progress"]
    cmd += ["--no-ray"] if args.pack_inline else ["--num-cpus", str(min(os.cpu_count() or 1, args.workers))]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"bench_rank: prepack run failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")


def check_same_batches(online: Side, pack: Side, cfg, pack_dir: str, workers: int) -> str:
    """Digests equal in order, and each stream's first batch identical with ``diff_batches``."""
    a, b = online.result["digests"], pack.result["digests"]
    if a != b:
        bad = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y) if len(a) == len(b) else min(len(a), len(b))
        sys.exit(f"bench_rank: batch {bad} differs between the online pipeline and the pack (digests)")
    import oracle
    from compare import diff_batches

    from loader.batch import SimpleCustomBatch
    from loader.reader import Pack, iter_records
    from prepack.engine.tokenizer import load_tokenizer
    from schemas.record import record_to_batch

    tok = load_tokenizer(cfg.tokenizer)
    p = Pack.open(pack_dir)
    streams = range(max(workers, 1))
    for s in streams:
        ref = oracle.reference_batches(cfg, s, tok, 1)[0]
        _, record = next(iter_records(p, s))
        diffs = diff_batches(SimpleCustomBatch(record_to_batch(record)).to_dict(), ref)
        if diffs:
            sys.exit(f"bench_rank: stream {s}'s first batch differs from the reference: {diffs[:3]}")
    return (f"same batches: all {len(a)} digests equal in order; the first batch of each of the {len(streams)} "
            "streams identical to the reference (diff_batches)")


def _mb(n: float) -> str:
    return f"{n / MB:,.0f} MB"


def report(args, online: Side, pack: Side, same: str, cuda: dict | None) -> list[str]:
    knobs = TINY_KNOBS if args.tiny else None
    lines = [f"rank 0 of W=1, K={args.workers} DataLoader workers, {args.batches} batches, "
             f"{args.trainer_threads} torch thread(s) in the trainer, "
             + ("tiny knobs and photographs" if knobs else "NeMo pretrain knobs (32768 / 36864 / 16384, flex), "
                "photographs of ~0.8 MP"),
             same, "",
             f"{'':8} {'peak memory':>12} {'files':>8} {'1st half':>10} {'2nd half':>10} {'trainer floor':>14} {'shm held':>9} "
             f"{'CPU/batch':>10} {'trainer':>8} {'workers':>8} {'batches/s':>10} {'first batch':>12}"]
    for s in (online, pack):
        r = s.result
        lines.append(
            f"{s.name:8} {_mb(s.peak.memory):>12} {_mb(s.peak.file):>8} {_mb(s.halves[0]):>10} {_mb(s.halves[1]):>10} "
            f"{_mb(r['floor_pss']):>14} {_mb(s.shm_peak):>9} {s.cpu_ms:>7,.0f} ms {r['main_cpu_s'] * 1e3:>5,.0f} ms "
            f"{r['worker_cpu_s'] * 1e3:>5,.0f} ms {1 / r['wall_s']:>10.2f} {r['first_batch_s'] * 1e3:>9,.0f} ms")
    lines += ["", "peak memory: PSS of the trainer process and its workers, plus shared memory the tree holds but "
              f"does not map (batches in flight), sampled every {args.interval_ms:g} ms; files: the file-backed part "
              "of that PSS at the peak (mostly libraries, whose share also falls as other processes on the machine "
              "map them); halves: the peak over the first and the second half of the batches; trainer floor: the "
              "trainer's PSS after its imports and tokenizer, before the loader; CPU per batch over the batches after "
              "the first"]
    if cuda is None:
        lines.append("cuda: skipped (no CUDA device here): time from next() to a batch on the device, pinned and "
                     "not, is measured only with a GPU")
    else:
        for name, pins in cuda.items():
            lines.append(f"cuda {name}: next() to the batch on the device {pins['true'] * 1e3:,.1f} ms pinned, "
                         f"{pins['false'] * 1e3:,.1f} ms not pinned (median; {args.step_ms:g} ms step between)")
    rm = online.peak.memory / pack.peak.memory
    rc = online.cpu_ms / pack.cpu_ms
    lines.append(f"rank: online K={args.workers} {online.peak.memory / MB:.0f} MB, {online.cpu_ms:.0f} ms/batch; "
                 f"pack K={args.workers} {pack.peak.memory / MB:.0f} MB, {pack.cpu_ms:.0f} ms/batch "
                 f"(memory {rm:.2f} x, CPU {rc:.2f} x)")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2, help="K: DataLoader workers of the rank (streams in the pack)")
    ap.add_argument("--batches", type=int, default=24, help="batches the rank takes on each side")
    ap.add_argument("--tiny", action="store_true", help="small photographs and knobs (a quick check of the script)")
    ap.add_argument("--pack-inline", action="store_true", help="prepack run --no-ray (no Ray start-up)")
    ap.add_argument("--interval-ms", type=float, default=50.0, help="memory sampling interval")
    ap.add_argument("--step-ms", type=float, default=500.0, help="with CUDA: the training step between batches")
    ap.add_argument("--trainer-threads", type=int, default=1,
                    help="torch threads of the trainer process (torchrun sets OMP_NUM_THREADS=1 when a node runs "
                    "several ranks; DataLoader workers always use 1)")
    ap.add_argument("--keep", action="store_true", help="keep the data and the pack (their folder is printed)")
    ap.add_argument("--child", choices=["online", "pack"], help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--pack", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--cuda", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args)
        return 0
    if args.workers < 1 or args.batches < 2:
        ap.error("--workers must be at least 1 and --batches at least 2")

    import bench_pack

    from schemas.config_file import load_config

    args.tmp = tempfile.mkdtemp(prefix="bench-rank-")
    try:
        ds = bench_pack.make_data(os.path.join(args.tmp, "data"), size=(300, 500) if args.tiny else (700, 1200))
        per_stream = math.ceil(args.batches / args.workers)
        config = ds.config(knobs=TINY_KNOBS if args.tiny else bench_pack.NEMO_PRETRAIN_KNOBS,
                           num_workers=args.workers, prepack={"batches_per_stream": per_stream})
        cfg = load_config(config)
        pack_dir = os.path.join(args.tmp, "pack")
        make_pack(args, config, pack_dir)
        online = run_side("online", args, config, pack_dir)
        pack = run_side("pack", args, config, pack_dir)
        same = check_same_batches(online, pack, cfg, pack_dir, args.workers)
        cuda = None
        import torch

        if torch.cuda.is_available():
            cuda = {name: {str(k).lower(): v for k, v in run_side(name, args, config, pack_dir, cuda=True)
                           .result["cuda"].items()} for name in ("online", "pack")}
        for line in report(args, online, pack, same, cuda):
            print(line)
    finally:
        if args.keep:
            print(f"data and pack kept in {args.tmp}", file=sys.stderr)
        else:
            shutil.rmtree(args.tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
