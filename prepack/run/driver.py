"""Run a pack: one Ray task per stream (or inline), progress from the workers, then the manifest.

Local by default (``ray.init(address="local")`` on loopback, no dashboard, no usage stats); a
cluster when ``--address`` or ``RAY_ADDRESS`` names one (as under ``ray job submit``).  Streams
are independent, so S streams use up to S workers with no coordination.  A rerun continues every
stream after its last committed shard; a finished output is a no-op; another config over an
existing output is refused.  A run leases the streams it packs (``lease.py``), so several jobs
pack disjoint streams of one output at once; whichever finishes the last stream writes the
manifest.

A worker node may vanish at any moment (preemption): Ray retries its stream tasks on the other
nodes and each resumes after its last commit.  Nothing the run needs lives on a worker node:
the progress actor (``ray_tasks``, with the stream task) is pinned to the driver's node, and every
call to it is guarded, so progress reporting can never fail a run.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass

from pyarrow.fs import FileSelector

from loader.reader import Pack
from prepack.engine.reuse.earlier_packs import open_old_packs, read_old_pack
from prepack.engine.tokenizer import load_tokenizer, recorded_fingerprint, special_token_ids
from prepack.run.bounded.ahead import JobStreams, WaitRule, share_of
from prepack.run.ray_init import init_ray
from prepack.run.commit.atomic_files import write_bytes_atomic
from prepack.run.bounded.bound import BoundSpec
from prepack.run.catalog import build_for_reuse
from prepack.run.chain import Continue, check_continuation, open_parent, parent_link, switch_points, wait_for_parent
from prepack.run.identity import settle_identity
from prepack.run.lease import StreamLease, acquire_streams, live_leases, remove_stale_leases
from prepack.run.commit.lineage import drop_lineage_leftovers
from prepack.run.progress_bar import RunProgress, StreamProgress
from prepack.run.sample_balance import reference_config, write_balanced
from prepack.run.stream_job import Paused, StreamJob, pack_one_stream
from prepack.run.summary import RunSummary
from schemas.config import PrepackConfig
from schemas.errors import PackRefused, StreamFailed, UsageError
from schemas.layout import MANIFEST_NAME, REFERENCE_DIR
from schemas.location import PackLocation, redact_uri, resolve_location
from schemas.manifest import PackSummary, StreamIndex, StreamSummary
from schemas.pack_info import FORMAT_VERSION, PackInfo, ParentLink

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunOptions:
    """How ``run_pack`` runs, beside the config and the output.

    ``streams``: which streams (default all); ``reuse``: earlier packs whose pixels the streams may
    take (``prepack.engine.reuse.earlier_pixels``; the output is the same bytes with or without them,
    and pack.json does not name them); ``continue_from``: the pack this one continues, and after
    which record (``prepack.run.chain``; its chain's pictures are reused); ``bound``: pack just ahead
    of the trainings and trim behind them (``prepack.run.bounded.ahead``).  Where it runs: ``inline`` packs
    the streams one after another in this process, without Ray (debugging, tests); else on Ray at
    ``address`` (default $RAY_ADDRESS, else a local Ray of ``num_cpus``).  ``bar``: show a progress bar."""

    streams: "list[int] | None" = None
    reuse: "tuple[str, ...] | list[str]" = ()
    continue_from: "Continue | None" = None
    bound: "BoundSpec | None" = None
    inline: bool = False
    address: "str | None" = None
    num_cpus: "int | None" = None
    bar: bool = True

LOG_EVERY_S = 30.0
NODE_CHECK_S = 5.0  # how often the driver looks for lost nodes


# -- pack metadata -----------------------------------------------------------------------------
def finalize(loc: PackLocation, cfg: PrepackConfig) -> tuple[bool, list[StreamSummary]]:
    """Write manifest.json (a summary per stream) once every stream has finished this budget.

    Reads one ``done.json`` per stream: memory and time O(streams), never O(records); lineage
    stays per stream (``lineage/``), so nothing is merged here.  Several jobs may finish at once:
    each that sees every stream done writes the same manifest (of two finishing together at least
    one sees the other's done.json).  Not written when pack.json has moved on to a larger budget
    (another job is extending the pack).
    """
    budget = cfg.prepack.budget()
    entries = []
    for s in range(cfg.num_streams):
        done = StreamSummary.read(loc, s)
        if done is None or done.budget != budget:
            return False, entries
        entries.append(done)
    stored = PackInfo.read(loc)
    if stored is None or stored.budget != budget:
        log.warning("not writing the manifest: pack.json now has budget %s (another run is extending the pack)",
                    stored and stored.budget)
        return False, entries
    summary = PackSummary(format_version=FORMAT_VERSION, identity=stored.to_dict(), streams=entries)
    write_bytes_atomic(loc, MANIFEST_NAME, summary.to_json().encode())
    return True, entries


def _committed_totals(loc, stream: int) -> tuple[int, int]:
    """(records, tokens) in the stream's committed shards."""
    index = StreamIndex.read(loc, stream)
    if index is None:
        return 0, 0
    return index.num_records, sum(r.num_tokens for sh in index.shards for r in sh.records)


def output_bytes(loc) -> int:
    return sum(i.size or 0 for i in loc.fs.get_file_info(FileSelector(loc.base, recursive=True)) if i.type.name == "File")


# -- run --------------------------------------------------------------------------------------
def run_pack(cfg: PrepackConfig, out: str, options: RunOptions = RunOptions(), tokenizer=None) -> RunSummary:
    """Pack ``options.streams`` (default: all) of ``cfg`` into ``out``: new, resumed or extended
    (``RunOptions`` says how); ``tokenizer``: an already loaded ``(tokenizer, special)`` pair to use."""
    start = time.perf_counter()
    tokenizer, special = tokenizer or special_token_ids(load_tokenizer(cfg.tokenizer))
    if cfg.prepack.balance == "samples":
        return _run_balanced(cfg, out, options, (tokenizer, special))
    wanted = list(range(cfg.num_streams)) if options.streams is None else sorted(set(options.streams))
    for s in wanted:
        cfg.stream_rank_worker(s)  # range check with a clear message
    if options.bound is not None and options.bound.disk_budget is not None:
        share_of(cfg, options.bound.disk_budget)  # a budget too small for two shards: refused before any work
    loc = resolve_location(out)
    tokenizer_fp = recorded_fingerprint(tokenizer)  # once per job, and recorded: it hashes the whole vocabulary
    link, reuse = None, tuple(options.reuse)
    if options.continue_from is not None:
        link, chain = _settle_parent(options.continue_from, cfg, loc, tokenizer_fp)
        reuse = reuse + tuple(u for u in chain if u not in reuse)
    opened = open_old_packs(reuse, loc)  # each OLD's pack.json read once, for the whole job
    reuse = tuple(o.uri for o in opened)
    try:
        loc.fs.create_dir(loc.base, recursive=True)  # on a store too: its bucket HEAD and PUTs are the early probe
    except OSError as e:  # no such bucket, no access, store unreachable: the user's to fix, in one line
        raise PackRefused(f"cannot write to {redact_uri(out)}: {str(e).strip().splitlines()[0]}") from None
    pack = settle_identity(loc, cfg, tokenizer_fp, special, other_jobs=lambda: live_leases(loc),
                           parent=link)
    budget = cfg.prepack.budget()
    dones = {s: StreamSummary.read(loc, s) for s in wanted}
    todo = [s for s in wanted if dones[s] is None or dones[s].budget != budget]
    for s in set(wanted) - set(todo):
        drop_lineage_leftovers(loc, s)  # what a run killed just after finishing s left
    if not todo:  # nothing to pack; write the manifest only if an earlier job could not yet
        remove_stale_leases(loc)  # a job killed after its last stream finished left its lease
        written = PackSummary.written(loc)
        if not written:
            written, _ = finalize(loc, cfg)
        return RunSummary(out, [dones[s] for s in wanted], written, 0.0, already_done=True,
                          max_num_tokens=cfg.knobs.max_num_tokens, output_bytes=output_bytes(loc))
    lease = acquire_streams(loc, todo)
    try:
        # each OLD read once per job (its stream indexes, its catalog: built first when behind), not per
        # stream: the streams get what was read (StreamJob, one ray.put) and look pictures up in it
        olds = tuple(read_old_pack(old, build_for_reuse) for old in opened)
        job = StreamJob(cfg, out, pack.metadata, olds, pack.info.parent, options.bound)
        before = [_committed_totals(loc, s) for s in todo]  # shards an earlier run already committed
        run = RunProgress(todo, cfg.prepack.batches_per_stream, asdict(cfg.knobs))
        if options.inline:
            _run_inline(job, todo, (tokenizer, special), lease, run)
        else:
            RayRun(job, todo, lease, run).run(options)
        lease.check()  # never write the manifest over a run that took our streams over
        written, _ = finalize(loc, cfg)
        entries = [StreamSummary.read(loc, s) for s in wanted]
        now = [e for e in entries if e.stream in todo]
        packed_now = (sum(e.num_records for e in now) - sum(b[0] for b in before),
                      sum(e.num_tokens for e in now) - sum(b[1] for b in before))
        return RunSummary(out, entries, written, time.perf_counter() - start,
                          max_num_tokens=cfg.knobs.max_num_tokens, output_bytes=output_bytes(loc),
                          packed_now=packed_now, retried=run.retry_summary(), reuse_from=reuse)
    finally:
        lease.release()


def _run_balanced(cfg: PrepackConfig, out: str, options: RunOptions, tokenizer: tuple) -> RunSummary:
    """A balanced-samples pack (``prepack.run.sample_balance``): its reference packed into
    ``OUT/reference`` as any pack, then, once every reference stream is done, the balanced streams
    (by the one job that leases them: a job finishing beside it leaves them to it)."""
    start = time.perf_counter()
    for given, what in ((options.continue_from, "--continue"), (options.bound, "--ahead / --disk-budget / --progress"),
                        (cfg.schedule, "prepack.schedule")):
        if given:
            raise UsageError(f"prepack.balance: samples is not supported with {what} yet; pack without it, "
                             "or balance whole batches in the loader (balance=Balance(micro_batches=M))")
    if "batches_per_stream" not in cfg.prepack.budget():  # streams that end unevenly leave their last steps whole
        existing = PackInfo.read(resolve_location(out))
        if existing is not None and existing.budget != cfg.prepack.budget():
            raise UsageError("prepack.balance: samples extends a batches_per_stream budget only (streams that end "
                             "unevenly under a token or pass budget leave their last steps unsplit); pack afresh")
    loc = resolve_location(out)
    try:
        loc.fs.create_dir(loc.base, recursive=True)
    except OSError as e:
        raise PackRefused(f"cannot write to {redact_uri(out)}: {str(e).strip().splitlines()[0]}") from None
    # this config's identity first: another config over OUT is refused before anything is packed
    pack = settle_identity(loc, cfg, recorded_fingerprint(tokenizer[0]), tokenizer[1],
                           other_jobs=lambda: live_leases(loc))
    ref_out = out.rstrip("/") + "/" + REFERENCE_DIR
    ref = run_pack(reference_config(cfg), ref_out, options, tokenizer)
    reference = Pack.open(ref_out)
    if any(reference.done(s) is None for s in range(cfg.num_streams)):
        log.info("balanced samples: written once every stream of %s is packed", redact_uri(ref_out))
        return ref
    try:
        lease = acquire_streams(loc, list(range(cfg.num_streams)))
    except PackRefused as e:  # only a balancing job leases OUT's own streams: another job finishing at once
        log.info("balanced samples: every reference stream is packed and another job writes the balanced ones "
                 "(%s); this job's part is done", e)
        return ref
    try:
        entries = write_balanced(cfg, loc, pack.metadata, reference, tokenizer)
        lease.check()
        written, _ = finalize(loc, cfg)
    finally:
        lease.release()
    return RunSummary(out, entries, written, time.perf_counter() - start, max_num_tokens=cfg.knobs.max_num_tokens,
                      output_bytes=output_bytes(loc), packed_now=ref.packed_now, retried=ref.retried,
                      reuse_from=ref.reuse_from)


def _paused_at(result: "StreamSummary | Paused") -> int | None:
    return result.records if isinstance(result, Paused) else None


def _run_inline(job: StreamJob, todo: list[int], tokens: tuple, lease: StreamLease, run: RunProgress) -> None:
    """Pack ``todo`` one after another in this process (``--no-ray``); a stream of a bounded run that
    waits lets the others go on, and the last one trims while it waits."""
    def report(progress_now: StreamProgress) -> None:
        run.update(progress_now)
        for line in run.new_kinds():
            log.warning("%s", line)

    streams = JobStreams(resolve_location(job.out), todo, job.bound)
    while streams.streams:
        for s in streams.ready():
            lease.check()
            streams.started(s)
            rule = WaitRule(0.0 if len(streams.streams) > 1 else None, streams.trim)
            streams.returned(s, _paused_at(pack_one_stream(job, s, *tokens, report, rule)))
        streams.idle()
    streams.trim(force=True)


def _settle_parent(how: "Continue", cfg: PrepackConfig, loc: PackLocation,
                   tokenizer_fp: str) -> "tuple[ParentLink, list[str]]":
    """The link to the pack ``how`` continues, once its streams hold the records taken from it (waited
    for while it is still packing); and where each segment of its chain is (their pictures are reused)."""
    parent = open_parent(how.uri)
    if parent.location.path("") == loc.path(""):
        raise PackRefused(f"--continue {redact_uri(how.uri)} is the output itself; continue into a new --out")
    check_continuation(parent, cfg, how.uri)  # world size and K among what may not change: named first
    if parent.info.tokenizer_fingerprint != tokenizer_fp:
        raise PackRefused(f"cannot continue {redact_uri(how.uri)}: the tokenizer differs from the one it was "
                          "packed with (tokenizer_fingerprint)")
    if parent.num_streams != cfg.num_streams:
        raise PackRefused(f"cannot continue {redact_uri(how.uri)}: it has {parent.num_streams} streams, "
                          f"this config {cfg.num_streams}")
    after = switch_points(parent, how)
    wait_for_parent(parent, after, how.uri)
    link = parent_link(parent, after, how.uri)
    chain, p, uri = [], parent, link.uri
    while p is not None:  # each segment where its child's link says it is
        chain.append(uri)
        uri = p.info.parent.uri if p.info.parent is not None else None
        p = p.parent
    return link, chain


def _pinned_progress(ray, Progress):
    """The progress actor, on the driver's own node (a worker node may vanish; this one holds the run)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    return Progress.options(scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False)).remote()


class _Watch:
    """The driver's guarded view of the cluster: progress reports, task attempts, lost nodes.

    Every call may fail (an actor or the GCS briefly unreachable): it then returns what it knew."""

    def __init__(self, ray, progress):
        self.ray, self.progress = ray, progress
        self.reports: dict = {}
        self.attempts: dict = {}
        self.dead: dict[str, str] = {}  # node id -> address, for nodes seen alive then dead
        self._alive: dict[str, str] = {}
        self._last_nodes = 0.0
        self._warned = False

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Wait until the actor answers, before any task starts: a task's first report would
        otherwise queue in its own worker until the actor exists, and be lost if that worker's
        node died meanwhile (the retry would then look like a first attempt)."""
        try:
            self.ray.get(self.progress.poll.remote(), timeout=timeout_s)
        except Exception as e:  # noqa: BLE001  (best effort: pack without progress)
            log.info("progress actor not ready after %.0f s (%s); packing goes on", timeout_s, type(e).__name__)

    def poll(self) -> None:
        try:
            self.reports, self.attempts = self.ray.get(self.progress.poll.remote(), timeout=10)
        except Exception as e:  # noqa: BLE001  (progress is best effort)
            if not self._warned:
                self._warned = True
                log.info("progress reports unavailable for now (%s); packing goes on", type(e).__name__)

    def attempts_from_state_api(self, timeout_s: int = 10) -> None:
        """Add what Ray's state API knows about this job's stream task attempts (best effort).

        A task killed with its node before its first statement ran never reported; Ray's own
        record of its attempts still names the stream (``stream_task[S]``).  Needs the cluster's
        dashboard (there under ``ray job submit``); a local Ray without one just skips this."""
        try:
            from ray.util.state import list_tasks

            job = self.ray.get_runtime_context().get_job_id()
            tasks = list_tasks(filters=[("job_id", "=", job)], limit=100_000, timeout=timeout_s,
                               raise_on_missing_output=False)
        except Exception as e:  # noqa: BLE001
            log.debug("Ray's state API did not answer (%s: %s); retries named from progress reports only",
                     type(e).__name__, e)
            return
        seen: dict[int, dict[int, str]] = {}
        for t in tasks:
            name = getattr(t, "name", "") or ""
            if name.startswith("stream_task[") and name.endswith("]"):
                seen.setdefault(int(name[12:-1]), {})[int(getattr(t, "attempt_number", 0) or 0)] = \
                    getattr(t, "node_id", "") or "?"
        for stream, by_attempt in seen.items():
            known = self.attempts.get(stream, [])
            if max(by_attempt) + 1 > len(known):
                self.attempts[stream] = [by_attempt.get(k, known[k] if k < len(known) else "?")
                                         for k in range(max(by_attempt) + 1)]

    def lost_nodes(self) -> list[str]:
        """Lines for nodes that died since the last look (looked at every NODE_CHECK_S)."""
        if time.monotonic() - self._last_nodes < NODE_CHECK_S:
            return []
        self._last_nodes = time.monotonic()
        try:
            nodes = self.ray.nodes()
        except Exception:  # noqa: BLE001
            return []
        lines = []
        for n in nodes:
            nid, addr = n.get("NodeID", ""), n.get("NodeManagerAddress", "?")
            if n.get("Alive"):
                self._alive[nid] = addr
            elif nid in self._alive and nid not in self.dead:
                self.dead[nid] = addr
                lines.append(f"node {addr} ({nid[:8]}) was lost; Ray retries its stream tasks on the other nodes")
        if self.dead:
            self.attempts_from_state_api()
        return lines


PAUSE_AFTER_S = 30.0  # a stream task waiting for its trainings longer than this lets its CPU go


class RayRun:
    """``job``'s streams ``todo`` as Ray tasks, under ``lease``, reporting to ``run``: the driver's loop
    (submit the streams that may pack, collect the finished, trim, show progress and retries)."""

    def __init__(self, job: StreamJob, todo: list[int], lease: StreamLease, run: RunProgress):
        self.job, self.todo, self.lease, self.run_progress = job, todo, lease, run
        self.bar = None

    def run(self, options: RunOptions) -> None:
        ray = init_ray(options.address, options.num_cpus)
        try:
            # the Ray side is imported with Ray: `prepack run --no-ray`, plan and --help never import it
            from prepack.run.ray_tasks import Progress, stream_task

            self.ray, self.stream_task = ray, stream_task
            self.watch = _Watch(ray, _pinned_progress(ray, Progress))
            self.watch.wait_ready()
            self.local = not (options.address or os.environ.get("RAY_ADDRESS"))
            self.level = logging.getLogger().getEffectiveLevel()
            self.job_ref = ray.put(self.job)  # once in the object store, not once per task
            self.streams = JobStreams(resolve_location(self.job.out), self.todo, self.job.bound)
            # a waiting task holds its CPU: with more streams than CPUs it lets it go after a while (and is
            # started again when its trainings come close), or the streams behind it would never start
            self.give_up = (None if len(self.todo) <= int(ray.cluster_resources().get("CPU", 1))
                            else PAUSE_AFTER_S)
            if options.bar:
                from tqdm import tqdm

                run = self.run_progress
                self.bar = tqdm(total=(run.budget * len(self.todo)) if run.budget else None, unit="batch",
                                dynamic_ncols=True, desc=f"packing {len(self.todo)} streams")
            try:
                self._loop()
            finally:
                if self.bar is not None:
                    self.bar.close()
        finally:
            ray.shutdown()

    def _submit(self, s: int):
        self.streams.started(s)
        return self.stream_task.options(name=f"stream_task[{s}]").remote(
            self.job_ref, s, self.watch.progress, self.local, self.level, self.give_up)

    def _say(self, lines) -> None:
        for line in lines:
            if self.bar is not None:
                self.bar.clear()
            log.warning("%s", line)

    def _collect(self, pending: dict) -> None:
        """The tasks that ended: a stream done or paused; a failed one fails the run (the others cancelled)."""
        ray = self.ray
        ready, _ = ray.wait(list(pending), timeout=0.5) if pending else ([], None)
        for ref in ready:
            s = pending.pop(ref)
            try:
                self.streams.returned(s, _paused_at(ray.get(ref)))
            except Exception as e:
                for other in pending:
                    ray.cancel(other, force=True)
                cause = getattr(e, "cause", None) or e
                why = str(cause).strip().splitlines()[-1] if str(cause).strip() else ""
                raise StreamFailed(f"stream {s} failed: {type(cause).__name__}: {why}") from e

    def _loop(self) -> None:
        ray, watch, run = self.ray, self.watch, self.run_progress
        pending = {self._submit(s): s for s in self.streams.ready()}
        started = last_log = time.monotonic()
        while self.streams.streams:
            try:
                self.lease.check()  # another run took our streams over: stop writing at once
            except Exception:
                for ref in pending:
                    ray.cancel(ref, force=True)
                raise
            self._collect(pending)
            for s in self.streams.ready():  # paused streams their trainings came close to
                pending[self._submit(s)] = s
            self.streams.trim()
            if not pending:
                time.sleep(0.5)
            watch.poll()
            for report in watch.reports.values():
                run.update(report)
            self._say(watch.lost_nodes())
            self._say(run.retried(watch.attempts, watch.dead))
            self._say(run.new_kinds())
            if self.bar is not None:
                self.bar.n = run.batches
                self.bar.set_postfix_str(run.postfix(self.bar.format_dict.get("elapsed") or 0.0))
                self.bar.refresh()
            elif time.monotonic() - last_log >= LOG_EVERY_S:  # no terminal (e.g. ray job logs)
                last_log = time.monotonic()
                log.info("%d batches; %s", run.batches, run.postfix(last_log - started))
        self.streams.trim(force=True)
        watch.poll()  # the last word on retries and on the streams' final counts: every task has ended
        for report in watch.reports.values():
            run.update(report)
        self._say(run.new_kinds())  # kinds only a stream's end counts (what was left in its buffer)
        if watch.dead:  # (the state API is asked only after a node loss: it may take seconds)
            watch.attempts_from_state_api(timeout_s=30)
        self._say(run.retried(watch.attempts, watch.dead))
