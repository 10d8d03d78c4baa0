"""Run a pack: one Ray task per stream, progress from the workers, then manifest and lineage.

Local by default (``ray.init(address="local")`` on loopback, no dashboard, no usage stats); a
cluster when ``--address`` or ``RAY_ADDRESS`` names one (as under ``ray job submit``).  Streams
are independent, so S streams use up to S workers with no coordination.  A rerun continues every
stream after its last committed shard; a finished output is a no-op; another config over an
existing output, or two concurrent runs on one output, are refused.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq

from prepack.run.identity import identity_mismatch, pack_identity, record_metadata
from prepack.run.stream_job import lineage_file
from prepack.run.writer import write_bytes_atomic
from schemas.config import PrepackConfig
from schemas.errors import PackRefused, StreamFailed
from schemas.location import resolve_location
from schemas.manifest import LINEAGE_NAME, MANIFEST_NAME, MANIFEST_VERSION, PACK_INFO_NAME, Manifest, StreamEntry
from schemas.record import RECORD_SCHEMA_VERSION

log = logging.getLogger(__name__)

LOCK_NAME = ".prepack.lock"
LOG_EVERY_S = 30.0


@dataclass
class RunSummary:
    out: str
    streams: list[StreamEntry]
    manifest_written: bool
    elapsed_s: float
    already_done: bool = False
    max_num_tokens: int = 0
    output_bytes: int = 0
    extra: dict = field(default_factory=dict)
    # what this run itself packed (resumed streams count only their new shards); None: all of ``streams``
    packed_now: tuple[int, int] | None = None  # (records, tokens)

    def lines(self) -> list[str]:
        recs = sum(s.num_records for s in self.streams)
        toks = sum(s.num_tokens for s in self.streams)
        samples = sum(s.num_samples for s in self.streams)
        fill = toks / (recs * self.max_num_tokens) if recs and self.max_num_tokens else 0.0
        groups: dict[str, int] = {}
        drops: dict[str, int] = {}
        warns: dict[str, int] = {}
        for s in self.streams:
            for d, src in ((groups, s.group_samples), (drops, s.drops), (warns, s.warnings)):
                for k, v in src.items():
                    d[k] = d.get(k, 0) + v
        out = [
            f"{'already complete' if self.already_done else 'packed'}: {len(self.streams)} streams, {recs} batches, "
            f"{toks:,} tokens, {samples} samples -> {self.out}",
            f"fill ratio {fill:.3f} of max_num_tokens={self.max_num_tokens}; output {self.output_bytes / 2**20:.1f} MiB",
        ]
        if self.elapsed_s > 0 and not self.already_done:
            new_recs, new_toks = self.packed_now if self.packed_now is not None else (recs, toks)
            resumed = f"; {recs - new_recs} batches were already committed" if new_recs != recs else ""
            out.append(f"throughput {new_toks / self.elapsed_s:,.0f} tokens/s, {new_recs / self.elapsed_s:.2f} batches/s "
                       f"({self.elapsed_s:.1f} s wall{resumed})")
        total = sum(groups.values()) or 1
        out.append("group mix: " + ", ".join(f"{g} {n} ({n / total:.0%})" for g, n in sorted(groups.items())))
        out.append("drops: " + (", ".join(f"{k}={v}" for k, v in sorted(drops.items())) or "none"))
        if warns:
            out.append("damaged input packed as the reference does: " + ", ".join(f"{k}={v}" for k, v in sorted(warns.items())))
        if not self.manifest_written:
            out.append("manifest not written yet: some streams of this config are still unpacked")
        return out


# -- lock -------------------------------------------------------------------------------------
def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process on this host (a zombie, i.e. an exited process its parent
    has not reaped yet, holds no lock: it counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no procfs: trust kill(0)
    return state not in ("Z", "X")


def acquire_lock(loc) -> dict:
    me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
    path = loc.path(LOCK_NAME)
    if loc.is_local:
        for _ in range(2):
            # Write the holder first, then link it into place: the lock never exists empty, even
            # if this process dies between the two steps (link fails if a lock already exists).
            tmp = f"{path}.{me['pid']}.tmp"
            with open(tmp, "w") as f:
                json.dump(me, f)
            try:
                os.link(tmp, path)
                return me
            except FileExistsError:
                pass
            finally:
                os.unlink(tmp)
            try:
                held = json.loads(open(path).read() or "{}")
            except (OSError, ValueError):
                held = {}
            if held.get("host") == me["host"] and isinstance(held.get("pid"), int) and not _pid_alive(held["pid"]):
                log.warning("removing stale lock of dead process %s", held["pid"])
                os.unlink(path)
                continue
            raise PackRefused(
                f"another prepack run (pid {held.get('pid')} on {held.get('host')}) holds {path}; "
                "wait for it, or delete the lock file if that run is dead"
            )
        raise PackRefused(f"could not take the lock {path}")
    info = loc.fs.get_file_info(path)
    if info.type.name == "File":
        raise PackRefused(f"{path} exists: another run may be writing this output; delete it if none is")
    with loc.fs.open_output_stream(path) as f:
        f.write(json.dumps(me).encode())
    return me


def release_lock(loc) -> None:
    try:
        loc.fs.delete_file(loc.path(LOCK_NAME))
    except (FileNotFoundError, OSError):
        pass


# -- ray --------------------------------------------------------------------------------------
def init_ray(address: str | None, num_cpus: int | None = None):
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=True)
    else:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1", num_cpus=num_cpus,
                 logging_level=logging.WARNING, log_to_driver=True)
    return ray


def _make_remote(ray):
    @ray.remote
    class Progress:
        def __init__(self):
            self.state: dict[int, tuple[int, int, bool]] = {}

        def update(self, stream: int, batches: int, tokens: int, done: bool) -> None:
            self.state[stream] = (batches, tokens, done)

        def snapshot(self) -> dict:
            return dict(self.state)

    @ray.remote(num_cpus=1, max_retries=3)
    def stream_task(cfg, out, stream, metadata, progress, local_ray=False):
        from prepack.run.stream_job import pack_one_stream
        from prepack.run.worker_process import settle_worker_process
        from prepack.engine.tokenizer import load_tokenizer, special_token_ids

        # A local Ray fate-shares with its driver: a SIGKILLed driver takes the raylet along, but
        # its orphaned workers would go on packing (and even start a task pushed just before)
        # for seconds, racing a rerun over the same files.  So on a local Ray (same host, same
        # PID namespace) a task stops at the next record once its raylet has exited.
        raylet = int(os.environ.get("RAY_RAYLET_PID") or 0) if local_ray else 0

        def check_raylet() -> None:
            if raylet and not _pid_alive(raylet):
                raise RuntimeError(f"stream {stream}: this worker's raylet (pid {raylet}) is gone; stopping")

        check_raylet()
        tokenizer, special = special_token_ids(load_tokenizer(cfg.tokenizer))
        last = [0.0]

        def report(ev):
            check_raylet()
            now = time.monotonic()
            if ev.done or now - last[0] > 0.25:
                last[0] = now
                progress.update.remote(ev.stream, ev.batches, ev.tokens, ev.done)

        check_raylet()
        settle_worker_process()
        return pack_one_stream(cfg, out, stream, tokenizer, special, metadata, report)

    return Progress, stream_task


# -- manifest ---------------------------------------------------------------------------------
def _read_json(loc, rel: str) -> dict | None:
    if loc.fs.get_file_info(loc.path(rel)).type.name != "File":
        return None
    return json.loads(loc.read_bytes(rel))


def finalize(loc, cfg: PrepackConfig, identity: dict) -> tuple[bool, list[StreamEntry]]:
    """Write manifest.json and lineage.parquet once every stream is done."""
    from schemas.manifest import done_file

    entries = []
    for s in range(cfg.num_streams):
        d = _read_json(loc, done_file(s))
        if d is None:
            return False, entries
        entries.append(StreamEntry.from_json(d))
    tables = []
    for e in entries:
        for sh in e.shards:
            tables.append(pq.read_table(loc.fs.open_input_file(loc.path(lineage_file(e.stream, sh.shard)))))
    if tables:
        sink = pa.BufferOutputStream()
        pq.write_table(pa.concat_tables(tables), sink, compression="zstd")
        write_bytes_atomic(loc, LINEAGE_NAME, sink.getvalue().to_pybytes())  # a driver killed here leaves no torn file
    manifest = Manifest(version=MANIFEST_VERSION, record_schema_version=RECORD_SCHEMA_VERSION,
                        identity=identity, streams=entries)
    from prepack.run.writer import write_json_atomic

    write_json_atomic(loc, MANIFEST_NAME, manifest.to_json())
    return True, entries


def _committed_totals(loc, stream: int) -> tuple[int, int]:
    """(records, tokens) in the stream's committed shards (indexes contiguous from 0)."""
    from schemas.manifest import ShardEntry, shard_index_file

    recs = toks = 0
    k = 0
    while (d := _read_json(loc, shard_index_file(stream, k))) is not None:
        entry = ShardEntry.from_json(d)
        recs += len(entry.records)
        toks += sum(r.num_tokens for r in entry.records)
        k += 1
    return recs, toks


def output_bytes(loc) -> int:
    from pyarrow.fs import FileSelector

    return sum(i.size or 0 for i in loc.fs.get_file_info(FileSelector(loc.base, recursive=True)) if i.type.name == "File")


# -- run --------------------------------------------------------------------------------------
def run_pack(cfg: PrepackConfig, out: str, *, streams: list[int] | None = None, address: str | None = None,
             progress: bool = True, num_cpus: int | None = None) -> RunSummary:
    from prepack.engine.tokenizer import load_tokenizer, special_token_ids, tokenizer_fingerprint
    from prepack.run.writer import write_json_atomic

    start = time.perf_counter()
    tokenizer, special = special_token_ids(load_tokenizer(cfg.tokenizer))
    identity = pack_identity(cfg, tokenizer_fingerprint(tokenizer), special)
    wanted = list(range(cfg.num_streams)) if streams is None else sorted(set(streams))
    for s in wanted:
        cfg.stream_rank_worker(s)  # range check with a clear message
    loc = resolve_location(out)
    loc.fs.create_dir(loc.base, recursive=True)
    acquire_lock(loc)
    try:
        existing = _read_json(loc, PACK_INFO_NAME)
        if existing is not None:
            why = identity_mismatch(existing, identity)
            if why:
                raise PackRefused(f"{out}: {why}; use a new --out or the original config")
            identity = existing  # keep the original identity (code fingerprint of the first run)
        else:
            write_json_atomic(loc, PACK_INFO_NAME, identity)
        if _read_json(loc, MANIFEST_NAME) is not None:
            man = Manifest.from_json(loc.read_bytes(MANIFEST_NAME).decode())
            return RunSummary(out, man.streams, True, 0.0, already_done=True,
                              max_num_tokens=cfg.knobs.max_num_tokens, output_bytes=output_bytes(loc))
        metadata = record_metadata(identity)
        from schemas.manifest import done_file

        todo = [s for s in wanted if _read_json(loc, done_file(s)) is None]
        before = [_committed_totals(loc, s) for s in todo]  # shards a killed run already committed
        if todo:
            _run_tasks(cfg, out, todo, metadata, address, progress, num_cpus)
        written, entries = finalize(loc, cfg, identity)
        if not written:
            entries = [StreamEntry.from_json(_read_json(loc, done_file(s))) for s in wanted]
        now = [e for e in entries if e.stream in todo]
        packed_now = (sum(e.num_records for e in now) - sum(b[0] for b in before),
                      sum(e.num_tokens for e in now) - sum(b[1] for b in before))
        return RunSummary(out, entries, written, time.perf_counter() - start,
                          already_done=not todo, max_num_tokens=cfg.knobs.max_num_tokens,
                          output_bytes=output_bytes(loc), packed_now=packed_now)
    finally:
        release_lock(loc)


def progress_postfix(snap: dict[int, tuple[int, int, bool]], todo: list[int], budget: int | None,
                     elapsed: float) -> str:
    """Overall tokens and rate, then per stream: each one when few, the spread when many."""
    tokens = sum(v[1] for v in snap.values())
    done = sum(1 for v in snap.values() if v[2])
    rate = tokens / elapsed if elapsed > 0 else 0.0
    counts = [snap.get(s, (0, 0, False))[0] for s in todo]
    of = f"/{budget}" if budget else ""
    if len(todo) <= 6:
        per = " ".join(f"s{s}:{c}{of}" for s, c in zip(todo, counts))
    else:
        per = f"per stream {min(counts)}..{max(counts)}{of}"
    return f"{tokens:,} tok, {rate:,.0f} tok/s, {per}, done {done}/{len(todo)}"


def _run_tasks(cfg, out, todo, metadata, address, show_progress, num_cpus) -> None:
    ray = init_ray(address, num_cpus)
    try:
        Progress, stream_task = _make_remote(ray)
        progress = Progress.remote()
        local = not (address or os.environ.get("RAY_ADDRESS"))
        pending = {stream_task.remote(cfg, out, s, metadata, progress, local): s for s in todo}
        budget = cfg.prepack.batches_per_stream
        started = last_log = time.monotonic()
        bar = None
        if show_progress:
            from tqdm import tqdm

            bar = tqdm(total=(budget * len(todo)) if budget else None, unit="batch", dynamic_ncols=True,
                       desc=f"packing {len(todo)} streams")
        try:
            while pending:
                ready, _ = ray.wait(list(pending), timeout=0.5)
                for ref in ready:
                    s = pending.pop(ref)
                    try:
                        ray.get(ref)
                    except Exception as e:
                        for other in pending:
                            ray.cancel(other, force=True)
                        cause = getattr(e, "cause", None) or e
                        raise StreamFailed(f"stream {s} failed: {type(cause).__name__}: {str(cause).strip().splitlines()[-1] if str(cause).strip() else ''}") from e
                if bar is not None:
                    snap = ray.get(progress.snapshot.remote())
                    bar.n = sum(v[0] for v in snap.values())
                    bar.set_postfix_str(progress_postfix(snap, todo, budget, bar.format_dict.get("elapsed") or 0.0))
                    bar.refresh()
                elif time.monotonic() - last_log >= LOG_EVERY_S:  # no terminal (e.g. ray job logs)
                    last_log = time.monotonic()
                    snap = ray.get(progress.snapshot.remote())
                    log.info("%d batches; %s", sum(v[0] for v in snap.values()),
                             progress_postfix(snap, todo, budget, last_log - started))
        finally:
            if bar is not None:
                bar.close()
    finally:
        ray.shutdown()
