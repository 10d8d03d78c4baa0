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
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

from pyarrow.fs import FileSelector

from loader.reader import Pack
from prepack.engine.reuse.earlier_packs import open_old_packs, read_old_pack
from prepack.engine.tokenizer import load_tokenizer, recorded_fingerprint, special_token_ids
from prepack.run.balance_beside import BalancingBeside
from prepack.run.bounded.ahead import JobStreams, WaitRule, share_of
from prepack.run.commit.atomic_files import write_bytes_atomic
from prepack.run.bounded.bound import BoundSpec
from prepack.run.catalog import build_for_reuse
from prepack.run.chain import Continue, check_continuation, open_parent, parent_link, switch_points, wait_for_parent
from prepack.run.identity import settle_identity
from prepack.run.lease import StreamLease, acquire_streams, live_leases, remove_stale_leases
from prepack.run.commit.lineage import drop_lineage_leftovers
from prepack.run.progress_bar import RunProgress, StreamProgress
from prepack.run.sample_balance import reference_config, write_balanced
from prepack.run.ray_run import RayRun
from prepack.run.stream_job import StreamJob, pack_one_stream, paused_at
from prepack.run.summary import RunSummary
from schemas.config import PrepackConfig
from schemas.errors import PackRefused, UsageError
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
    ``address`` (default $RAY_ADDRESS, else a local Ray of ``num_cpus``).  ``bar``: show a progress bar.
    ``guard``: called as the run goes on; what it raises stops the run (the balancing beside a
    bounded balanced-samples pack's reference: ``prepack.run.balance_beside``)."""

    streams: "list[int] | None" = None
    reuse: "tuple[str, ...] | list[str]" = ()
    continue_from: "Continue | None" = None
    bound: "BoundSpec | None" = None
    inline: bool = False
    address: "str | None" = None
    num_cpus: "int | None" = None
    bar: bool = True
    guard: "Callable[[], None] | None" = None


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
            _run_inline(job, todo, (tokenizer, special), lease, run, options.guard)
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
    if options.bound is not None and options.bound.disk_budget is not None:
        share_of(cfg, options.bound.disk_budget)  # a budget too small for three shards: refused before any work
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
    # this config's identity first: another config over OUT is refused before anything is packed; a
    # continuation links OUT and its reference to the same parent, so both count records over its chain
    tokenizer_fp = recorded_fingerprint(tokenizer[0])
    link = None
    if options.continue_from is not None:
        link, _ = _settle_parent(options.continue_from, cfg, loc, tokenizer_fp)
    pack = settle_identity(loc, cfg, tokenizer_fp, tokenizer[1], other_jobs=lambda: live_leases(loc), parent=link)
    ref_out = out.rstrip("/") + "/" + REFERENCE_DIR
    lease = None
    try:
        if options.bound is not None and options.bound.active:  # balanced as the reference is packed
            lease = _balancing_lease(loc, cfg, "this job packs its reference streams only")
            ref = _pack_reference_beside(cfg, (out, ref_out, pack.metadata), options, tokenizer, lease)
        else:
            ref = run_pack(reference_config(cfg), ref_out, options, tokenizer)
        reference = Pack.open(ref_out)
        if any(reference.done(s) is None for s in range(cfg.num_streams)):
            log.info("balanced samples: written once every stream of %s is packed", redact_uri(ref_out))
            return ref
        lease = lease or _balancing_lease(loc, cfg, "this job's part is done")
        if lease is None:
            return ref
        entries = write_balanced(cfg, loc, pack.metadata, reference, tokenizer)
        lease.check()
        written, _ = finalize(loc, cfg)
    finally:
        if lease is not None:
            lease.release()
    return RunSummary(out, entries, written, time.perf_counter() - start, max_num_tokens=cfg.knobs.max_num_tokens,
                      output_bytes=output_bytes(loc), packed_now=ref.packed_now, retried=ref.retried,
                      reuse_from=ref.reuse_from)


def _pack_reference_beside(cfg: PrepackConfig, where: tuple, options: RunOptions, tokenizer: tuple,
                           lease: "StreamLease | None") -> RunSummary:
    """A bounded balanced-samples pack's reference, packed for OUT's trainings (``BoundSpec.reads``)
    while the job holding OUT's ``lease`` balances it beside (``prepack.run.balance_beside``); ``where``:
    OUT, its reference and OUT's shard metadata.  Under ``--disk-budget`` that job keeps the budget
    and grants the reference's streams their shards (``BoundSpec.granted``), to the end."""
    out, ref_out, metadata = where
    bound = replace(options.bound, reads=out)
    ref_options = replace(options, bound=replace(bound, disk_budget=None, granted=bound.disk_budget is not None))
    if lease is None:
        return run_pack(reference_config(cfg), ref_out, ref_options, tokenizer)
    beside = BalancingBeside(cfg, resolve_location(out), metadata, ref_out, tokenizer, bound).start()
    try:
        summary = run_pack(reference_config(cfg), ref_out, replace(ref_options, guard=beside.check), tokenizer)
        if bound.disk_budget is not None:
            beside.finish()
        return summary
    finally:
        beside.close()


def _balancing_lease(loc: PackLocation, cfg: PrepackConfig, otherwise: str) -> "StreamLease | None":
    """The lease on OUT's balanced streams (only a balancing job takes it), or None where another job
    holds it (it writes them; ``otherwise`` says what this job does then)."""
    try:
        return acquire_streams(loc, list(range(cfg.num_streams)))
    except PackRefused as e:
        log.info("balanced samples: another job writes the balanced streams (%s); %s", e, otherwise)
        return None


def _run_inline(job: StreamJob, todo: list[int], tokens: tuple, lease: StreamLease, run: RunProgress,
                guard: "Callable[[], None] | None" = None) -> None:
    """Pack ``todo`` one after another in this process (``--no-ray``); a stream of a bounded run that
    waits lets the others go on, and the last one trims while it waits (``guard``: ``RunOptions``)."""
    def report(progress_now: StreamProgress) -> None:
        run.update(progress_now)
        for line in run.new_kinds():
            log.warning("%s", line)

    streams = JobStreams(resolve_location(job.out), todo, job.bound)

    def waiting() -> None:
        if guard is not None:
            guard()
        streams.trim()

    while streams.streams:
        for s in streams.ready():
            lease.check()
            streams.started(s)
            rule = WaitRule(0.0 if len(streams.streams) > 1 else None, waiting)
            streams.returned(s, paused_at(pack_one_stream(job, s, *tokens, report, rule)))
        if guard is not None:
            guard()
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
