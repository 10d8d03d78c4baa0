"""Run a pack: one Ray task per stream (or inline), progress from the workers, then the manifest.

Local by default (``ray.init(address="local")`` on loopback, no dashboard, no usage stats); a
cluster when ``--address`` or ``RAY_ADDRESS`` names one (as under ``ray job submit``).  Streams
are independent, so S streams use up to S workers with no coordination.  A rerun continues every
stream after its last committed shard; a finished output is a no-op; another config over an
existing output, or two concurrent runs on one output, are refused.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

from prepack.run.identity import budget_change, identity_mismatch, pack_identity, record_metadata, write_identity
from prepack.run.lock import RunLock, acquire_lock, pid_alive
from prepack.run.stream_job import drop_lineage_leftovers, read_done
from prepack.run.writer import read_index, write_bytes_atomic
from schemas.config import PrepackConfig
from schemas.errors import PackRefused, StreamFailed
from schemas.location import PackLocation, redact_uri, resolve_location
from schemas.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    PACK_INFO_NAME,
    PackSummary,
    StreamSummary,
    check_format,
    load_checked,
)

log = logging.getLogger(__name__)

LOG_EVERY_S = 30.0


@dataclass
class RunSummary:
    out: str
    streams: list[StreamSummary]
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
            out.append("manifest not written yet: some streams of this config are still unpacked "
                       "(their committed shards are readable now)")
        return out


# -- ray --------------------------------------------------------------------------------------
def init_ray(address: str | None, num_cpus: int | None = None):
    """Connect to ``address`` (or $RAY_ADDRESS), else start a local Ray on loopback.

    The local Ray listens on 127.0.0.1 only and dies with this process, so it runs without token
    authentication unless RAY_AUTH_MODE says otherwise (so no token warning).  Ray's info
    messages are shown with ``-v`` only; its warnings (a retried task, a dead worker) always.
    """
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    quiet = not logging.getLogger().isEnabledFor(logging.INFO)
    level = logging.WARNING if quiet else logging.INFO  # warnings stay: a retried task is worth a line
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, logging_level=level, log_to_driver=True)
    else:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1", num_cpus=num_cpus,
                 logging_level=level, log_to_driver=True)
    return ray


def _make_remote(ray):
    @ray.remote
    class Progress:
        def __init__(self):
            self.state: dict[int, tuple[int, int, bool]] = {}
            self.attempts: dict[int, int] = {}

        def started(self, stream: int) -> None:
            self.attempts[stream] = self.attempts.get(stream, 0) + 1

        def retried(self) -> dict:
            """stream -> attempts, for streams whose task started more than once (Ray retried it)."""
            return {s: n for s, n in self.attempts.items() if n > 1}

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
            if raylet and not pid_alive(raylet):
                raise RuntimeError(f"stream {stream}: this worker's raylet (pid {raylet}) is gone; stopping")

        check_raylet()
        progress.started.remote(stream)
        tokenizer, special = special_token_ids(load_tokenizer(cfg.tokenizer))
        last = [0.0]

        def report(ev):
            check_raylet()
            now = time.monotonic()
            if ev.done or now - last[0] > 1.0:  # each report is a Ray call: once a second is enough for a bar
                last[0] = now
                progress.update.remote(ev.stream, ev.batches, ev.tokens, ev.done)

        check_raylet()
        settle_worker_process()
        return pack_one_stream(cfg, out, stream, tokenizer, special, metadata, report)

    return Progress, stream_task


# -- pack metadata -----------------------------------------------------------------------------
def finalize(loc: PackLocation, cfg: PrepackConfig, identity: dict) -> tuple[bool, list[StreamSummary]]:
    """Write manifest.json (a summary per stream) once every stream has finished this budget.

    Reads one ``done.json`` per stream: memory and time O(streams), never O(records); lineage
    stays per stream (``lineage/``), so nothing is merged here.
    """
    budget = cfg.prepack.budget()
    entries = []
    for s in range(cfg.num_streams):
        done = read_done(loc, s)
        if done is None or done.budget != budget:
            return False, entries
        entries.append(done)
    summary = PackSummary(format_version=FORMAT_VERSION, identity=identity, streams=entries)
    write_bytes_atomic(loc, MANIFEST_NAME, summary.to_json().encode())
    return True, entries


def _committed_totals(loc, stream: int) -> tuple[int, int]:
    """(records, tokens) in the stream's committed shards."""
    index = read_index(loc, stream)
    if index is None:
        return 0, 0
    return index.num_records, sum(r.num_tokens for sh in index.shards for r in sh.records)


def output_bytes(loc) -> int:
    from pyarrow.fs import FileSelector

    return sum(i.size or 0 for i in loc.fs.get_file_info(FileSelector(loc.base, recursive=True)) if i.type.name == "File")


def _settle_identity(loc: PackLocation, out: str, identity: dict) -> tuple[dict, bool]:
    """The identity to pack under, and whether this run extends the budget of an existing pack.

    A new output gets ``identity`` in pack.json.  An existing one must hold this format, config
    and tokenizer; a larger budget of the same kind is written into its pack.json (an extension).
    """
    try:
        existing = load_checked(loc.read_bytes(PACK_INFO_NAME), loc.path(PACK_INFO_NAME))
    except FileNotFoundError:
        write_identity(loc, identity)
        return identity, False
    check_format(existing, loc.path(PACK_INFO_NAME))
    why = identity_mismatch(existing, identity) or budget_change(existing, identity)
    if why:
        raise PackRefused(f"{out}: {why}; use a new --out or the original config")
    if existing["budget"] == identity["budget"]:
        return existing, False  # keep the original identity (code fingerprint of the first run)
    extended = {**existing, "budget": identity["budget"], "config": identity["config"]}
    try:
        loc.fs.delete_file(loc.path(MANIFEST_NAME))  # no longer complete; rewritten when it is
    except FileNotFoundError:
        pass
    write_identity(loc, extended)
    log.info("extending %s from %s to %s", out, existing["budget"], identity["budget"])
    return extended, True


# -- run --------------------------------------------------------------------------------------
def run_pack(cfg: PrepackConfig, out: str, *, streams: list[int] | None = None, address: str | None = None,
             progress: bool = True, num_cpus: int | None = None, inline: bool = False,
             tokenizer=None) -> RunSummary:
    """Pack ``streams`` (default: all) of ``cfg`` into ``out``: new, resumed or extended.

    ``inline`` packs the streams one after another in this process, without Ray (debugging,
    tests); ``tokenizer`` is an already loaded ``(tokenizer, special)`` pair to use.
    """
    from prepack.engine.tokenizer import load_tokenizer, special_token_ids, tokenizer_fingerprint

    start = time.perf_counter()
    tokenizer, special = tokenizer or special_token_ids(load_tokenizer(cfg.tokenizer))
    identity = pack_identity(cfg, tokenizer_fingerprint(tokenizer), special)
    wanted = list(range(cfg.num_streams)) if streams is None else sorted(set(streams))
    for s in wanted:
        cfg.stream_rank_worker(s)  # range check with a clear message
    loc = resolve_location(out)
    try:
        loc.fs.create_dir(loc.base, recursive=True)
    except OSError as e:  # no such bucket, no access, store unreachable: the user's to fix, in one line
        raise PackRefused(f"cannot write to {redact_uri(out)}: {str(e).strip().splitlines()[0]}") from None
    lock = acquire_lock(loc)
    try:
        identity, _ = _settle_identity(loc, out, identity)
        budget = cfg.prepack.budget()
        dones = {s: read_done(loc, s) for s in wanted}
        for s in wanted:
            if dones[s] is not None and dones[s].budget == budget:
                drop_lineage_leftovers(loc, s)  # what a run killed just after finishing s left
        todo = [s for s in wanted if dones[s] is None or dones[s].budget != budget]
        if not todo:  # nothing to pack; write the manifest only if an earlier job could not yet
            written = loc.fs.get_file_info(loc.path(MANIFEST_NAME)).type.name == "File"
            if not written:
                written, _ = finalize(loc, cfg, identity)
            return RunSummary(out, [dones[s] for s in wanted], written, 0.0, already_done=True,
                              max_num_tokens=cfg.knobs.max_num_tokens, output_bytes=output_bytes(loc))
        before = [_committed_totals(loc, s) for s in todo]  # shards an earlier run already committed
        if inline:
            from prepack.run.stream_job import pack_one_stream

            for s in todo:
                lock.check()
                pack_one_stream(cfg, out, s, tokenizer, special, record_metadata(identity))
        else:
            _run_tasks(cfg, out, todo, record_metadata(identity), address, progress, num_cpus, lock)
        lock.check()  # never write the manifest over a run that took the output over
        written, _ = finalize(loc, cfg, identity)
        entries = [read_done(loc, s) for s in wanted]
        now = [e for e in entries if e.stream in todo]
        packed_now = (sum(e.num_records for e in now) - sum(b[0] for b in before),
                      sum(e.num_tokens for e in now) - sum(b[1] for b in before))
        return RunSummary(out, entries, written, time.perf_counter() - start,
                          max_num_tokens=cfg.knobs.max_num_tokens, output_bytes=output_bytes(loc),
                          packed_now=packed_now)
    finally:
        lock.release()


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


def _run_tasks(cfg, out, todo, metadata, address, show_progress, num_cpus, lock: RunLock) -> None:
    ray = init_ray(address, num_cpus)
    try:
        Progress, stream_task = _make_remote(ray)
        progress = Progress.remote()
        local = not (address or os.environ.get("RAY_ADDRESS"))
        pending = {stream_task.remote(cfg, out, s, metadata, progress, local): s for s in todo}
        budget = cfg.prepack.batches_per_stream
        started = last_log = time.monotonic()
        announced: dict[int, int] = {}
        bar = None
        if show_progress:
            from tqdm import tqdm

            bar = tqdm(total=(budget * len(todo)) if budget else None, unit="batch", dynamic_ncols=True,
                       desc=f"packing {len(todo)} streams")
        try:
            while pending:
                try:
                    lock.check()  # another run took over our lease: stop writing at once
                except Exception:
                    for ref in pending:
                        ray.cancel(ref, force=True)
                    raise
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
                for s, n in ray.get(progress.retried.remote()).items():
                    if announced.get(s) != n:
                        announced[s] = n
                        log.warning("stream %d: Ray retried its stream_task (attempt %d; its worker died); it resumes "
                                    "after its last committed shard", s, n)
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
