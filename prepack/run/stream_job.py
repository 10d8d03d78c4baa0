"""Pack one stream into its directory, resumably and extendably: the body of one Ray task.

The stream's shards are committed by ``prepack.run.commit.writer.StreamWriter`` (the commit protocol is
that module's doc).  Here, the stream's two ends: ``start_stream`` decides where it starts (fresh,
after a crash from the checkpoint of its first uncommitted shard, or extended past an earlier
budget) and ``finish_stream`` how it ends (the shard lineage files compacted into
``lineage/stream-S.parquet``, then ``done.json``); ``pack_one_stream`` packs between the two.  A
later run with a larger budget continues from the last checkpoint.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

from loader.reader import Pack
from prepack.engine.packer import PackerOptions
from prepack.engine.packers import Packer, open_packer
from prepack.engine.reuse.earlier_packs import OldPack
from prepack.engine.reuse.earlier_pixels import PixelReuse, own_reuse_on
from prepack.engine.sources.ledger import SourceLedger
from prepack.run.bounded.ahead import AheadGate, WaitRule, wait_to_pack
from prepack.run.bounded.bound import BoundSpec
from prepack.run.chain import open_parent, switch_at
from prepack.run.commit.checkpoint_files import read_checkpoint, state_files
from prepack.run.commit.lineage import drop_lineage_leftovers
from prepack.run.progress_bar import StreamProgress
from prepack.run.commit.recovery import recover_stream
from prepack.run.commit.writer import Committing, ShardFormat, StreamWriter, write_done
from schemas.compression import Compression
from schemas.config import PrepackConfig
from schemas.location import PackLocation, resolve_location
from schemas.layout import done_file, stream_dir
from schemas.manifest import ShardEntry, StreamIndex, StreamSummary
from schemas.pack_info import ParentLink

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamJob:
    """What every stream of one run shares, built once by the driver and handed to each stream (a
    Ray task gets it from the object store, once per node): the config, the output, the pack's shard
    metadata, the earlier packs whose pixels may be taken (``OldPack`` snapshots read once by the
    driver, or paths/URIs), the parent of a continuation (its pack.json's link) and the bound of a
    bounded run (``--ahead``)."""

    cfg: PrepackConfig
    out: str
    metadata: dict[str, str]
    reuse: "tuple[str | OldPack, ...]" = ()
    parent: ParentLink | None = None
    bound: BoundSpec | None = None


def pixel_provider(loc: PackLocation, index: StreamIndex, reuse: "tuple[str | OldPack, ...] | list",
                   compression: Compression) -> PixelReuse | None:
    """Where this stream's earlier pixels come from: the ``reuse`` packs, and its own committed shards
    (its later passes over a small set) unless ``PREPACK_REUSE_OWN=0``.  Frames the stream's writer
    (``compression``) would make byte for byte are handed over as they are stored."""
    own = own_reuse_on()
    if not reuse and not own:
        return None
    provider = PixelReuse(reuse, frame_format=compression.frame_format)
    if own:
        provider.add_stream(loc, index)
    return provider


@dataclass
class StartedStream:
    """A stream ready to pack from where it stands: its recovered index, its packer (fresh or from the
    checkpoint after the last committed shard) and where its earlier pixels come from."""

    stream: int
    index: StreamIndex
    packer: Packer
    pixels: PixelReuse | None
    own: bool  # the stream's own committed shards are among its pixel sources
    cpu_start: float
    start: float
    ledger: SourceLedger

    def committed(self, loc: PackLocation, writer: StreamWriter, entry: ShardEntry | None) -> None:
        """After each record: a later pass of this stream may take back the pictures just written."""
        if not self.own:
            return
        if entry is not None:  # those of the shard just committed, from its pixel index
            self.pixels.add_shard(loc, self.stream, entry.shard, entry.nbytes, writer.committed_pixels)
        else:  # and those of the shard still open, from memory
            self.pixels.add_written(writer.last_images)


def start_stream(job: StreamJob, loc: PackLocation, stream: int, tokenizer, special) -> "StartedStream | StreamSummary":
    """Where ``stream`` starts: its ``done.json`` when it already finished this budget, else a
    ``StartedStream`` (a finished stream with a larger budget is no longer done: extended).  A new
    stream of a continuation (``job.parent``) starts from the parent's state at its switch
    (``prepack.run.chain``); once it has committed a shard it resumes from its own checkpoints."""
    cpu_start = time.process_time()  # the whole process (Ray's threads too): what packing costs per core
    cfg = job.cfg
    budget = cfg.prepack.budget()
    previous = StreamSummary.read(loc, stream)
    if previous is not None and previous.budget == budget:
        drop_lineage_leftovers(loc, stream)
        return previous
    loc.make_dirs(loc.path(stream_dir(stream)))
    if previous is not None:  # extending a finished stream: it is no longer done
        log.info("stream %d: extending from %s to %s", stream, previous.budget, budget)
        loc.fs.delete_file(loc.path(done_file(stream)))
    index = recover_stream(loc, stream)
    pixels = pixel_provider(loc, index, job.reuse, Compression.parse(cfg.prepack.compression))
    start = None
    if index.shards:
        start = read_checkpoint(loc, index, len(index.shards))
        log.info("stream %d: continuing at shard %d (record %d)", stream, len(index.shards), index.num_records)
    elif job.parent is not None:
        start = switch_at(open_parent(job.parent.uri), stream, job.parent.after[stream], tokenizer, special)
    # each batch is written before the next: the packer may reuse one pixel table buffer
    ledger = SourceLedger()  # what each shard reads: a trim checks it first (prepack.run.bounded.trim_policy)
    packer = open_packer(cfg, stream, tokenizer, special, start,
                         PackerOptions(reuse_pixel_table=True, pixels=pixels, ledger=ledger))
    return StartedStream(stream, index, packer, pixels, pixels is not None and own_reuse_on(), cpu_start,
                         time.perf_counter(), ledger)


def finish_stream(cfg: PrepackConfig, loc: PackLocation, started: StartedStream) -> StreamSummary:
    """The stream reached its budget: compact its lineage, write ``done.json`` (the stream's end), then
    delete the shard lineage files it replaces."""
    counters, packer = started.packer.final_counters(), started.packer
    return write_done(cfg, loc, started.index, lambda rows: dict(
        drops=counters.drops, warnings=counters.warnings, examples=counters.examples,
        group_samples=counters.samples_packed, elapsed_s=round(time.perf_counter() - started.start, 3),
        cpu_s=round(time.process_time() - started.cpu_start, 3), reuse=packer.pictures.counts.to_json()))


@dataclass(frozen=True)
class Paused:
    """A stream of a bounded run (``--ahead``) that stopped after a committed shard to wait for its
    trainings; ``records``: its chain's records so far.  It resumes from that shard's checkpoint."""

    stream: int
    records: int


def paused_at(result: "StreamSummary | Paused") -> int | None:
    """A stream task's result as its job counts it: the chain records of a paused stream, None when done."""
    return result.records if isinstance(result, Paused) else None


def pack_one_stream(job: StreamJob, stream: int, tokenizer, special,
                    report: Callable[[StreamProgress], None] | None = None,
                    wait: WaitRule = WaitRule()) -> "StreamSummary | Paused":
    """Pack (or continue, or extend) stream ``stream`` of ``job``; returns its summary (done.json).

    With a bound that holds streams back (``--ahead``, ``--disk-budget``), before each new shard the
    stream waits until the trainings are close enough and its disk share has room (``prepack.run.bounded.ahead``),
    as ``wait`` says; a stream that gave up
    waiting returns ``Paused`` instead."""
    loc = resolve_location(job.out)
    started = start_stream(job, loc, stream, tokenizer, special)
    if isinstance(started, StreamSummary):
        return started
    packer = started.packer
    gate = AheadGate(job.bound, Pack.open(loc)) if job.bound is not None and job.bound.holds_back else None
    offset = job.parent.after[stream] if job.parent is not None else 0  # the chain's records before this pack's
    cfg = job.cfg
    paused = None
    try:
        # a new stream's writer writes ckpt-00000 here, before the packer's first batch
        fmt = ShardFormat(cfg.prepack.shard_bytes, cfg.prepack.compression, job.metadata)
        commit = Committing(started.index, lambda: state_files(packer.state()), started.ledger.take)
        with StreamWriter(loc, stream, fmt, commit) as writer:
            if gate is not None and not wait_to_pack(gate, stream, offset + writer.next_record, wait):
                paused = Paused(stream, offset + writer.next_record)
            for batch in () if paused else packer:
                entry = writer.append(batch)
                started.committed(loc, writer, entry)
                if report is not None:
                    report(StreamProgress.of(stream, packer.batches, packer.tokens, packer.counters))
                if (entry is not None and gate is not None and not packer.budget_spent()
                        and not wait_to_pack(gate, stream, offset + writer.next_record, wait)):
                    paused = Paused(stream, offset + writer.next_record)  # at a shard boundary: nothing open
                    break
            if paused is None:
                started.committed(loc, writer, writer.finish())
    except BaseException:
        packer.close()  # the sources' read-ahead threads end with the stream, on errors too
        raise
    finally:
        if started.pixels is not None:
            started.pixels.close()
    if paused is not None:
        packer.close()
        return paused
    result = finish_stream(cfg, loc, started)
    if report is not None:  # what done.json says
        report(StreamProgress(stream, packer.batches, packer.tokens, True, dict(result.drops), dict(result.warnings),
                              dict(result.examples)))
    return result
