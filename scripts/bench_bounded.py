#!/usr/bin/env python
"""A bounded pack (``prepack run --ahead N --progress P``) against a simulated training: how much
disk it holds at most against the whole pack, how long the packer waits, how long the training
waits, and that the training reads exactly what a pack made at once gives.

Data: the demo data (``prepack demo-data``) under ``configs/demo.yaml`` with W=1 and K=``--streams``
(one stream per DataLoader worker), ``--batches`` batches per stream, ``--shard-bytes`` (the demo's
batches are ~2.4 MB: 1 MB makes every batch a shard of its own).  First the same config is packed
at once (``prepack run --no-ray``, unbounded) into WHOLE: its bytes (every file under it) are the
whole pack's, and its batches are the reference.

Then the bounded run, every piece a process of its own on this host, all on local disk:

- **the packer**: ``python -m prepack.cli -v run CFG --out OUT --ahead N --progress P
  --keep-checkpoints K --no-ray`` (one process packs the streams in turn: a stream that may not
  pack pauses at its shard boundary and the next goes on; no Ray start-up or idle workers
  competing with the trainers for 2 cores);
- **the trainers**: ``--ranks`` processes, rank r of ``--ranks`` reading OUT as it is packed
  (``PackedShardDataset(OUT, rank=r, world_size=R, follow=True, progress=P)``; with R != W a rank
  reads streams r, r+R, ...), one batch every ``--step-ms`` (a sleep: the simulated step), a
  checkpoint every ``--checkpoint-every`` steps (``state_dict()``, which publishes the checkpoint
  to P, saved to a JSON file with the step number, tmp + rename).

``--kill`` (the default): when rank 0 has read a third of its batches the packer is killed
(SIGKILL, by its PID) and started again at once with the same command (it resumes from its
streams' last committed shards); when the last rank has read two thirds of its batches, one past
a checkpoint, it is killed (SIGKILL) and started again from its saved checkpoint JSON, as a
crashed training would be: the batches after that checkpoint are read a second time.

Measured (a sampling thread here, every ``--sample-ms``):

- **disk**: the total bytes of OUT's files; its peak against the whole pack's bytes;
- **packer idle**: the wall time the packer process (all its threads) was charged no CPU tick
  (``/proc/PID/stat`` utime + stime, 10 ms ticks) over a sample interval, that is it waited for
  the trainings (or for the disk); beside it the packer's CPU and wall time (``wait4``) and the
  pauses it logged (``waiting (--ahead``);
- **trainer wait**: per step, the time blocked in ``next()`` (the simulated step is a sleep after
  it), mean over every step read (re-reads after the restart and the packer's restart included);
- **correctness**: per rank, the committed steps (each step's last read: the re-reads after a
  restart replace the reads the crash lost, and must equal them) equal the whole pack's batches
  in order (``sequence_length`` and ``repr(batch_data_indexes)``); every stream's index rows (XXH3
  per shard, bytes, records) equal WHOLE's; ``prepack verify`` passes on OUT.

Also printed: the shards trimmed by the end against those wholly behind the trainings' kept
checkpoints then (read fresh, as ``prepack trim --progress`` would: what the job could have
trimmed), the packer's stderr stamped with the seconds since the run's start (``--keep-tmp``
keeps it, with each rank's step log, under the temporary folder's ``work/``).  After each run the
trimmed shard a restore packs the most batches again for (its checkpoint dropped by the trims,
``prepack.run.bounded.checkpoint_ladder``) is restored and audited: byte for byte its index row.

``--batches N1,N2`` (default 32,160) runs the same at both lengths: what a bounded pack keeps for
the whole run (checkpoints, indexes, sources, lineage) must not grow its peak with the run.

Last line, exactly (two lengths; with one, ``bounded: disk peak X MiB of Y MiB (ratio R); ...``):
``bounded: disk peak X1 MiB at N1 batches a stream, X2 MiB at N2 (xG); whole packs Y1 and Y2 MiB;
trainer waited W ms/step; batches equal`` (``batches DIFFER`` and a non-zero exit when any check fails).

    python scripts/bench_bounded.py --ahead 3 --keep-checkpoints 1   # 32 and 160 batches/stream: ~6 min on 2 cores
    python scripts/bench_bounded.py --batches 48                     # one run: ~50 s
    python scripts/bench_bounded.py --batches 48 --no-kill           # the same without the crashes
    python scripts/bench_bounded.py --balance-samples --batches 32   # W=2 x K=2, balanced samples
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "helpers"), os.path.dirname(os.path.abspath(__file__))]

MIB = 2**20


# -- helpers ----------------------------------------------------------------------------------------
def tree_bytes(path: str) -> int:
    """Total bytes of the files under ``path`` (files vanishing while it looks count as gone)."""
    total = 0
    stack = [path]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for e in it:
                    try:
                        if e.is_dir(follow_symlinks=False):
                            stack.append(e.path)
                        elif e.is_file(follow_symlinks=False):
                            total += e.stat(follow_symlinks=False).st_size
                    except FileNotFoundError:
                        pass
        except (FileNotFoundError, NotADirectoryError):
            pass
    return total


def cpu_ticks(pid: int) -> int | None:
    """utime + stime of a process (all its threads, exited ones too), in clock ticks; None once gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return None


def batch_id(batch) -> str:
    """What identifies a packed batch (as the bounded-pack tests compare them), hashed short."""
    key = f"{batch.sequence_length}|{batch.batch_data_indexes!r}"
    return hashlib.sha1(key.encode()).hexdigest()[:20]


def write_json_atomic(path: str, doc: dict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def child_env() -> dict:
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")


# -- the simulated training (one rank, a process of its own) -----------------------------------------
def trainer_main(spec: dict) -> int:
    """Read this rank's batches as they are packed, one every ``step_ms``, a checkpoint every
    ``every`` steps; each step, its wait and its batch go to ``log`` as a line (flushed)."""
    from loader import PackedShardDataset

    ds = PackedShardDataset(spec["out"], rank=spec["rank"], world_size=spec["world_size"], follow=True,
                            poll_s=spec["poll_s"], progress=spec["progress"], live_every_s=spec["live_every_s"])
    step = 0
    if spec["resume"] and os.path.exists(spec["ckpt"]):
        with open(spec["ckpt"]) as f:
            saved = json.load(f)
        ds.load_state_dict(saved["state"])
        step = saved["step"]
    with open(spec["log"], "a", buffering=1) as log:
        log.write(f"start {step} {os.getpid()}\n")
        it = iter(ds)
        while True:
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                break
            waited = time.perf_counter() - t0
            step += 1
            log.write(f"step {step} {waited:.6f} {batch_id(batch)}\n")
            time.sleep(spec["step_ms"] / 1000.0)  # the training step
            if step % spec["every"] == 0:
                write_json_atomic(spec["ckpt"], {"step": step, "state": ds.state_dict()})
                log.write(f"ckpt {step}\n")
        log.write(f"end {step}\n")
    return 0


class TrainerLog:
    """What a rank's log says so far (read incrementally; one file across its restarts)."""

    def __init__(self, path: str):
        self.path, self._pos = path, 0
        self.steps: list[tuple[int, float, str]] = []  # every read: (step, wait s, batch id)
        self.step = 0  # the last step read
        self.checkpoint = 0  # the last step saved
        self.ended = False

    def poll(self) -> None:
        try:
            with open(self.path) as f:
                f.seek(self._pos)
                chunk = f.read()
        except FileNotFoundError:
            return
        complete = chunk[:chunk.rfind("\n") + 1]
        self._pos += len(complete.encode())
        for line in complete.splitlines():
            kind, *rest = line.split()
            if kind == "start":
                self.step, self.ended = int(rest[0]), False
            elif kind == "step":
                self.step = int(rest[0])
                self.steps.append((self.step, float(rest[1]), rest[2]))
            elif kind == "ckpt":
                self.checkpoint = int(rest[0])
            elif kind == "end":
                self.ended = True

    def committed(self) -> tuple[list[str], int, bool]:
        """Each step's batch (its last read), the number of re-reads, whether every re-read equals
        the read it repeats."""
        by_step: dict[int, str] = {}
        rereads, same = 0, True
        for step, _, bid in self.steps:
            if step in by_step:
                rereads += 1
                same &= by_step[step] == bid
            by_step[step] = bid
        return [by_step.get(k, "") for k in range(1, max(by_step, default=0) + 1)], rereads, same


# -- processes --------------------------------------------------------------------------------------
class Child:
    """A process started here, ended by its PID only; its CPU and wall time once reaped."""

    def __init__(self, argv: list[str], stderr_path: str, t0: float):
        self.started = time.monotonic()
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=child_env(), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.pid = self.proc.pid
        self.rc: int | None = None
        self.cpu_s = self.wall_s = 0.0
        # its stderr, each line stamped with the seconds since t0 (the bounded run's start)
        self._copier = threading.Thread(target=self._copy, args=(stderr_path, t0), daemon=True)
        self._copier.start()

    def _copy(self, path: str, t0: float) -> None:
        with open(path, "a", buffering=1, errors="replace") as f:
            for raw in self.proc.stderr:
                f.write(f"{time.monotonic() - t0:8.3f} [{self.pid}] {raw.decode(errors='replace')}")

    def poll(self) -> int | None:
        if self.rc is None:
            pid, status, usage = os.wait4(self.pid, os.WNOHANG)
            if pid:
                self._reaped(status, usage)
        return self.rc

    def kill(self) -> None:
        """SIGKILL by PID, then reap."""
        if self.rc is not None:
            return
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _, status, usage = os.wait4(self.pid, 0)
        self._reaped(status, usage)

    def _reaped(self, status: int, usage) -> None:
        self.rc = os.waitstatus_to_exitcode(status)
        self.proc.returncode = self.rc  # reaped here, not by Popen
        self.cpu_s = usage.ru_utime + usage.ru_stime
        self.wall_s = time.monotonic() - self.started
        self._copier.join(timeout=5)
        self.proc.stderr.close()


class Sampler(threading.Thread):
    """Every ``interval_s``: OUT's bytes (the peak kept) and whether the packer was charged CPU."""

    def __init__(self, out: str, interval_s: float):
        super().__init__(daemon=True, name="bench-bounded-sampler")
        self.out, self.interval_s = out, interval_s
        self.peak = 0
        self.packer_pid: int | None = None
        self.idle_s = self.watched_s = 0.0
        self._halt = threading.Event()

    def run(self) -> None:
        last_pid, last_ticks, last_t = None, None, time.monotonic()
        while not self._halt.is_set():
            self.peak = max(self.peak, tree_bytes(self.out))
            pid, now = self.packer_pid, time.monotonic()
            ticks = cpu_ticks(pid) if pid else None
            if pid == last_pid and ticks is not None and last_ticks is not None:
                self.watched_s += now - last_t
                if ticks == last_ticks:
                    self.idle_s += now - last_t
            last_pid, last_ticks, last_t = pid, ticks, now
            self._halt.wait(self.interval_s)
        self.peak = max(self.peak, tree_bytes(self.out))

    def stop(self) -> None:
        self._halt.set()
        self.join()


# -- the benchmark ----------------------------------------------------------------------------------
def make_config(tmp: str, args) -> str:
    from ray_helpers import make_demo

    path = make_demo(tmp)  # tmp/demo-data and tmp/configs/demo.yaml
    with open(path) as f:
        doc = yaml.safe_load(f)
    doc["prepack"].update(world_size=1, batches_per_stream=args.batches, shard_bytes=args.shard_bytes)
    doc["dataloader"]["num_workers"] = args.streams
    if args.balance_samples:  # W = --ranks, K = --streams each: every step re-split among the ranks
        doc["prepack"].update(world_size=args.ranks, balance="samples")
    out = os.path.join(os.path.dirname(path), "bounded.yaml")
    with open(out, "w") as f:
        yaml.safe_dump(doc, f, sort_keys=False)
    return out


def disk_budget(text: "str | None", config: str) -> int:
    """``--disk-budget``'s bytes (0: none): a size, or ``least``, the least ``prepack run`` accepts."""
    from prepack.run.bounded.ahead import least_budget
    from prepack.run.bounded.bound import parse_disk_budget
    from schemas.config_file import load_config

    if text is None:
        return 0
    return least_budget(load_config(config)) if text == "least" else parse_disk_budget(text, ".")


def pack_cmd(config: str, out: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "prepack.cli", "-v", "run", config, "--out", out, "--no-ray", "--no-progress",
            *extra]


def shard_rows(out: str) -> dict[int, list[tuple]]:
    from loader.reader import Pack

    p = Pack.open(out)
    return {s: [(sh.shard, sh.xxh3, sh.nbytes, sh.first_record, tuple(r.digest for r in sh.records))
                for sh in p.index(s, refresh=True).shards] for s in range(p.num_streams)}


def trimmable(out: str, progress: str, keep: int) -> int:
    """Shards wholly behind the trainings' kept checkpoints as they stand now (read fresh, as
    ``prepack trim --progress`` would): what the running job could have trimmed by its end."""
    from loader.reader import Pack
    from prepack.run.bounded.trainings import Trainings

    p = Pack.open(out)
    trainings = Trainings((progress,), p)
    trainings.refresh(force=True)
    n = 0
    for s in range(p.num_streams):
        before = trainings.kept_before(s, keep)
        n += sum(1 for sh in p.index(s).shards if sh.first_record + len(sh.records) <= before)
    return n


def reference(whole: str, ranks: int) -> dict[int, list[str]]:
    from loader import PackedShardDataset

    return {r: [batch_id(b) for b in PackedShardDataset(whole, rank=r, world_size=ranks)] for r in range(ranks)}


def trainer_spec(args, work: str, out: str, progress: str, rank: int, resume: bool) -> dict:
    return dict(out=out, progress=progress, rank=rank, world_size=args.ranks, every=args.checkpoint_every,
                step_ms=args.step_ms, poll_s=args.poll_s, live_every_s=args.live_every_s, resume=resume,
                log=os.path.join(work, f"rank{rank}.log"), ckpt=os.path.join(work, f"rank{rank}.ckpt.json"))


def start_trainer(spec: dict, work: str, t0: float) -> Child:
    return Child([sys.executable, os.path.abspath(__file__), "--trainer", json.dumps(spec)],
                 os.path.join(work, f"rank{spec['rank']}.stderr"), t0)


def kill_step(n: int, fraction: float, every: int) -> int:
    """The step after which to kill: ``fraction`` of ``n``, at least one past a checkpoint (so the
    restart re-reads something), and not before the first checkpoint."""
    k = max(int(n * fraction), every + 1)
    if every > 1 and k % every == 0:
        k += 1
    return k


def tail(path: str, n: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


@dataclass
class Result:
    batches: int
    peak: int
    whole: int
    wait_ms: float
    equal: bool


def restore_and_audit(out: str) -> bool:
    """Restore the trimmed shard a restore packs the most batches again for (its checkpoint dropped,
    the nearest kept far behind it) and audit it: byte for byte the file its index recorded."""
    from loader.reader import Pack
    from prepack.engine.tokenizer import load_tokenizer, special_token_ids
    from prepack.run.bounded.checkpoint_ladder import nearest_kept
    from prepack.run.bounded.restore import restore
    from prepack.tools.audit import audit_pack
    from schemas.layout import REFERENCE_DIR
    from schemas.manifest import TrimmedShards

    p = Pack.open(out)
    far = []
    for s in range(p.num_streams):
        doc, index = TrimmedShards.read(p.location, s), p.index(s)
        for k in doc.shards:
            j = nearest_kept(k, set(doc.checkpoints))
            far.append((index.shards[k].first_record - index.shards[j].first_record, s, k, j))
    if not far:
        print("restore: nothing was trimmed")
        return True
    todo, s, k, j = max(far)
    tokenizer = special_token_ids(load_tokenizer(p.info.stored_config().tokenizer))
    t0 = time.monotonic()
    first = p.switch(s) + p.index(s).shards[k].first_record
    restore(out, {s: (first, first)}, tokenizer=tokenizer)
    restore_s = time.monotonic() - t0
    ok = bool(audit_pack(out, stream=s, shard=k, tokenizer=tokenizer).ok)
    how = (f"re-split from {REFERENCE_DIR}/'s steps (its trimmed shards packed again from their checkpoints)"
           if p.info.stored_config().prepack.balance == "samples" else
           f"packed again from checkpoint {j} ({todo} batch(es) before it packed again first)")
    print(f"restore: stream {s} shard {k} {how}, {restore_s:.1f} s, byte for byte its index row; "
          f"audit {'ok' if ok else 'FAILED'}")
    return ok


def run(args, tmp: str, batches: int) -> Result:
    args = argparse.Namespace(**{**vars(args), "batches": batches})
    tmp = os.path.join(tmp, f"b{batches}")
    os.makedirs(tmp)
    config = make_config(tmp, args)
    work = os.path.join(tmp, "work")
    os.makedirs(work)

    # the whole pack, made at once: its bytes and its batches are what the bounded run is held to
    whole = os.path.join(tmp, "whole")
    t0 = time.monotonic()
    proc = subprocess.run(pack_cmd(config, whole), cwd=ROOT, env=child_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"the unbounded pack failed:\n{proc.stderr[-3000:]}")
    whole_s = time.monotonic() - t0
    whole_bytes = tree_bytes(whole)
    ref = reference(whole, args.ranks)
    whole_rows = shard_rows(whole)
    n_batches = sum(len(v) for v in ref.values())
    n_shards = sum(len(v) for v in whole_rows.values())
    shape = (f"W={args.ranks} x K={args.streams} streams, balanced samples (OUT/reference packed for the trainings, "
             "balanced as it commits)," if args.balance_samples else f"W=1 x K={args.streams} streams")
    print(f"config: demo data, {shape} read by {args.ranks} rank(s), {args.batches} batches "
          f"per stream, shard_bytes {args.shard_bytes} ({n_batches / n_shards:.1f} batches/shard); --ahead "
          f"{args.ahead}, --keep-checkpoints {args.keep_checkpoints}; trainers: a step every {args.step_ms:g} ms, a "
          f"checkpoint every {args.checkpoint_every} steps, live_every_s {args.live_every_s:g}, poll_s {args.poll_s:g}")
    print(f"whole pack (unbounded, packed at once): {whole_bytes / MIB:.1f} MiB, {n_batches} batches in {n_shards} "
          f"shards, {whole_s:.1f} s")

    out, progress = os.path.join(tmp, "out"), os.path.join(tmp, "progress")
    packer_log = os.path.join(work, "packer.stderr")
    budget = disk_budget(args.disk_budget, config)
    bounded = pack_cmd(config, out, "--ahead", str(args.ahead), "--progress", progress, "--keep-checkpoints",
                       str(args.keep_checkpoints), *(("--disk-budget", str(budget)) if budget else ()))
    sampler = Sampler(out, args.sample_ms / 1000.0)
    sampler.start()
    started = time.monotonic()
    packers = [Child(bounded, packer_log, started)]
    sampler.packer_pid = packers[0].pid
    trainers: dict[int, Child] = {}
    logs = {r: TrainerLog(os.path.join(work, f"rank{r}.log")) for r in range(args.ranks)}
    per_rank = {r: len(ref[r]) for r in ref}
    kill_packer_at = kill_step(per_rank[0], 1 / 3, 1)
    victim = args.ranks - 1
    kill_trainer_at = kill_step(per_rank[victim], 2 / 3, args.checkpoint_every)
    events: list[str] = []
    deadline = started + args.timeout
    failed = None
    try:
        while not os.path.exists(os.path.join(out, "pack.json")):  # a reader opens the pack once it exists
            if packers[-1].poll() is not None:
                raise RuntimeError(f"the packer ended before pack.json:\n{tail(packer_log)}")
            if time.monotonic() > deadline:
                raise RuntimeError("timed out waiting for pack.json")
            time.sleep(0.05)
        for r in range(args.ranks):
            trainers[r] = start_trainer(trainer_spec(args, work, out, progress, r, False), work, started)
        killed_packer = killed_trainer = not args.kill
        while True:
            for lg in logs.values():
                lg.poll()
            packer = packers[-1]
            if packer.poll() is not None and packer.rc != 0:
                raise RuntimeError(f"the packer failed (exit {packer.rc}):\n{tail(packer_log)}")
            for r, t in trainers.items():
                if t.poll() is not None and t.rc != 0:
                    raise RuntimeError(f"rank {r} failed (exit {t.rc}):\n{tail(os.path.join(work, f'rank{r}.stderr'))}")
            if not killed_packer and logs[0].step >= kill_packer_at and packer.rc is None:
                packer.kill()
                packers.append(Child(bounded, packer_log, started))
                sampler.packer_pid = packers[-1].pid
                killed_packer = True
                events.append(f"packer killed (SIGKILL) at rank 0's step {logs[0].step} after "
                              f"{packer.wall_s:.1f} s, started again at once")
            lg = logs[victim]
            if not killed_trainer and killed_packer and lg.step >= kill_trainer_at and not lg.ended:
                trainers[victim].kill()
                lg.poll()
                at, saved = lg.step, lg.checkpoint
                trainers[victim] = start_trainer(trainer_spec(args, work, out, progress, victim, True), work, started)
                killed_trainer = True
                events.append(f"rank {victim} killed (SIGKILL) after step {at}, started again from its checkpoint "
                              f"at step {saved} ({at - saved} batch(es) to read again)")
            if packer.rc == 0 and all(t.rc == 0 for t in trainers.values()):
                break  # every kill done, or the run ended before its kill point (too few batches)
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {args.timeout} s:\npacker: {tail(packer_log)}")
            time.sleep(0.05)
    except BaseException as e:  # noqa: BLE001 -- every process started here is ended, then reported
        failed = e
    finally:
        for child in packers + list(trainers.values()):
            child.kill()
        sampler.stop()
    wall = time.monotonic() - started
    if failed is not None:
        if isinstance(failed, RuntimeError):
            sys.exit(str(failed))
        raise failed
    for lg in logs.values():
        lg.poll()

    # -- figures ------------------------------------------------------------------------------------
    from loader.reader import Pack
    from prepack.tools.verify import verify_pack
    from schemas.manifest import TrimmedShards

    end_bytes = tree_bytes(out)
    p = Pack.open(out)
    trimmed = sum(len(TrimmedShards.read(p.location, s).shards) for s in range(p.num_streams))
    allowed = trimmable(out, progress, args.keep_checkpoints)
    for e in events:
        print(e)
    if args.kill and len(events) < 2:
        print("note: the run ended before every kill point (too few batches)")
    ratio = sampler.peak / whole_bytes
    print(f"disk: OUT peaked at {sampler.peak / MIB:.1f} MiB of the whole pack's {whole_bytes / MIB:.1f} MiB "
          f"({ratio:.2f}), sampled every {args.sample_ms:g} ms; {end_bytes / MIB:.1f} MiB at the end: {trimmed} of "
          f"{n_shards} shards trimmed, {allowed} behind the trainings' kept checkpoints")
    if budget:
        print(f"disk budget: {budget / MIB:.1f} MiB (--disk-budget {args.disk_budget}); the peak sampled "
              f"{'within it' if sampler.peak <= budget else 'OVER IT'} ({sampler.peak / budget:.2f})")
    pack_wall = sum(c.wall_s for c in packers)
    pack_cpu = sum(c.cpu_s for c in packers)
    pauses = sum(1 for line in open(packer_log, errors="replace") if "waiting (--ahead" in line)
    trims = sum(1 for line in open(packer_log, errors="replace") if "trimmed " in line and "shard(s)" in line)
    print(f"packer: {len(packers)} process(es), {pack_wall:.1f} s wall, {pack_cpu:.1f} s CPU; idle (no CPU tick in "
          f"a sample) {sampler.idle_s:.1f} s of {sampler.watched_s:.1f} s watched "
          f"({sampler.idle_s / max(sampler.watched_s, 1e-9):.0%}); {pauses} pause(s) for the trainings logged, "
          f"{trims} trim(s)")
    waits_all: list[float] = []
    equal = True
    for r in range(args.ranks):
        lg = logs[r]
        waits = [w for _, w, _ in lg.steps]
        waits_all += waits
        seq, rereads, same = lg.committed()
        ok = seq == ref[r] and same
        equal &= ok
        slow = sum(1 for w in waits if w > 0.05)
        median = sorted(waits)[len(waits) // 2] if waits else 0.0
        print(f"rank {r}: {len(seq)} steps committed ({len(waits)} read, {rereads} re-read after a restart"
              f"{'' if same else ', re-reads DIFFER'}); waited {1e3 * sum(waits) / max(len(waits), 1):.1f} ms/step, "
              f"median {1e3 * median:.1f} ms, max {1e3 * max(waits, default=0):.0f} ms, {slow} step(s) over 50 ms; "
              f"{'the same batches in order as the whole pack' if ok else 'batches DIFFER from the whole pack'}")
    rows = shard_rows(out)
    rows_equal = rows == whole_rows
    equal &= rows_equal
    report = verify_pack(out)
    equal &= bool(report.ok)
    print(f"shards: {sum(len(v) for v in rows.values())} index rows (XXH3, bytes, records) "
          f"{'equal' if rows_equal else 'DIFFER from'} the whole pack's; prepack verify "
          f"{'ok' if report.ok else 'FAILED'}; run {wall:.1f} s")
    wait_ms = 1e3 * sum(waits_all) / max(len(waits_all), 1)
    equal &= restore_and_audit(out)
    return Result(args.batches, sampler.peak, whole_bytes, wait_ms, equal)


def headline(results: list[Result]) -> str:
    """The last line: one run's peak against its whole pack, or two runs' peaks against each other."""
    wait_ms = sum(r.wait_ms for r in results) / len(results)
    verdict = "equal" if all(r.equal for r in results) else "DIFFER"
    if len(results) == 1:
        r = results[0]
        return (f"bounded: disk peak {r.peak / MIB:.1f} MiB of {r.whole / MIB:.1f} MiB (ratio {r.peak / r.whole:.2f}); "
                f"trainer waited {wait_ms:.1f} ms/step; batches {verdict}")
    a, b = results[0], results[-1]
    return (f"bounded: disk peak {a.peak / MIB:.1f} MiB at {a.batches} batches a stream, {b.peak / MIB:.1f} MiB at "
            f"{b.batches} (x{b.peak / a.peak:.2f}); whole packs {a.whole / MIB:.1f} and {b.whole / MIB:.1f} MiB; "
            f"trainer waited {wait_ms:.1f} ms/step; batches {verdict}")


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--trainer":
        return trainer_main(json.loads(sys.argv[2]))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="32,160",
                   help="batches per stream, or two counts N1,N2: the same run at each, their peaks compared (default "
                   "32,160: what a bounded pack keeps for the whole run must not grow its peak)")
    p.add_argument("--streams", type=int, default=2, help="streams: W=1 x K of them (default 2)")
    p.add_argument("--ranks", type=int, default=2, help="training ranks reading them (default 2)")
    p.add_argument("--ahead", type=int, default=4, help="prepack run --ahead (default 4)")
    p.add_argument("--checkpoint-every", type=int, default=6, help="steps between checkpoints (default 6)")
    p.add_argument("--keep-checkpoints", type=int, default=2, help="prepack run --keep-checkpoints (default 2)")
    p.add_argument("--step-ms", type=float, default=500.0, help="the simulated training step (default 500)")
    p.add_argument("--shard-bytes", type=int, default=1_000_000,
                   help="the pack's shard_bytes (default 1000000: every demo batch a shard of its own)")
    p.add_argument("--kill", action=argparse.BooleanOptionalAction, default=True,
                   help="kill the packer and one trainer mid-way and start them again (default on)")
    p.add_argument("--live-every-s", type=float, default=1.0, help="the trainers' live_every_s (default 1)")
    p.add_argument("--poll-s", type=float, default=0.25, help="the trainers' follow poll_s (default 0.25)")
    p.add_argument("--sample-ms", type=float, default=50.0, help="disk and packer CPU sampling (default 50)")
    p.add_argument("--timeout", type=float, default=600.0, help="give up after this many seconds (default 600)")
    p.add_argument("--balance-samples", action="store_true",
                   help="prepack.balance: samples at W = --ranks, K = --streams each (the reference's disk counts: "
                   "it lies under OUT)")
    p.add_argument("--disk-budget", metavar="SIZE",
                   help="prepack run --disk-budget as well: a size, or 'least' for the least the run accepts")
    p.add_argument("--keep-tmp", action="store_true", help="keep the temporary folder (its work/ has the logs)")
    p.add_argument("--tmp", help="where the temporary folder goes (default: the system's; local disk)")
    args = p.parse_args()
    if args.ranks > args.streams and not args.balance_samples:
        p.error("--ranks must not exceed --streams")
    if args.balance_samples and args.ranks < 2:
        p.error("--balance-samples re-splits each step among --ranks >= 2 ranks")
    try:
        args.batches = [int(x) for x in args.batches.split(",")]
    except ValueError:
        p.error(f"--batches takes N or N1,N2, got {args.batches!r}")
    if min(args.batches) < 2 or len(args.batches) > 2:
        p.error("--batches takes one or two counts, each >= 2")
    tmp = tempfile.mkdtemp(prefix="bench-bounded-", dir=args.tmp)
    try:
        from machine import machine_line

        print(machine_line(), flush=True)
        results = [run(args, tmp, n) for n in args.batches]
        print(headline(results))
        return 0 if all(r.equal for r in results) else 1
    finally:
        if args.keep_tmp:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
