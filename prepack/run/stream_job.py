"""Pack one stream into its directory, resumably and extendably: the body of one Ray task.

The stream's shards are committed by ``prepack.run.writer.StreamWriter`` (the commit protocol is
that module's doc); here: where a stream starts (fresh, after a crash from the checkpoint of its
first uncommitted shard, or extended past an earlier budget), and how it ends.  When the budget
is reached the shard lineage files are compacted into ``lineage/stream-S.parquet`` and
``done.json`` is written; a later run with a larger budget continues from the last checkpoint.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from prepack.engine.accounting import Counters
from prepack.engine.checkpoint import state_from_payload, state_to_payload
from prepack.engine.packer import StreamPacker, StreamState
from prepack.engine.reuse.earlier_packs import OldPack
from prepack.engine.reuse.earlier_pixels import PixelReuse, own_reuse_on
from prepack.run.writer import StreamWriter, recover_stream, sha256_hex, write_bytes_atomic
from schemas.checkpoint import CheckpointDoc
from schemas.compression import Compression
from schemas.config import PrepackConfig
from schemas.errors import DamagedFile
from schemas.location import PackLocation, resolve_location
from schemas.layout import (
    LINEAGE_DIR,
    SHARD_LINEAGE,
    checkpoint_file,
    done_file,
    parse,
    shard_lineage_file,
    stream_dir,
    stream_lineage_file,
)
from schemas.manifest import LINEAGE_SCHEMA, ShardEntry, StreamIndex, StreamSummary

log = logging.getLogger(__name__)


@dataclass
class ProgressEvent:
    stream: int
    batches: int
    tokens: int
    done: bool = False
    counters: "Counters | None" = None  # the packer's live counts (drops, warnings, first examples)

    def payload(self) -> dict:
        """What a progress report carries to the driver: small, plain data."""
        c = self.counters
        return {"batches": self.batches, "tokens": self.tokens, "done": self.done,
                "drops": dict(c.drops) if c else {}, "warnings": dict(c.warnings) if c else {},
                "examples": dict(c.examples) if c else {}}


def checkpoint_bytes(packer: StreamPacker) -> tuple[bytes, bytes]:
    """The packer's state now, as the (json, arrow) bytes of a checkpoint."""
    doc, pixels = state_to_payload(packer.state())
    return doc.to_json().encode(), pixels


def checkpoint_digests(index: StreamIndex, shard: int) -> tuple[str, str]:
    """The recorded sha256 of ``ckpt-shard`` (json, arrow): the start checkpoint or a shard's end."""
    if shard == 0:
        return index.ckpt0_json_sha256, index.ckpt0_arrow_sha256
    row = index.shards[shard - 1]
    return row.ckpt_json_sha256, row.ckpt_arrow_sha256


def read_checkpoint_files(loc: PackLocation, index: StreamIndex, shard: int) -> tuple[bytes, bytes]:
    """The (json, arrow) bytes of ``ckpt-shard``, each checked against the digest the index recorded."""
    out = []
    for ext, sha in zip(("json", "arrow"), checkpoint_digests(index, shard)):
        rel = checkpoint_file(index.stream, shard, ext)
        try:
            data = loc.read_bytes(rel)
        except FileNotFoundError:
            raise DamagedFile(f"{loc.path(rel)}: checkpoint is missing") from None
        if sha256_hex(data) != sha:
            raise DamagedFile(f"{loc.path(rel)}: checkpoint is damaged (sha256 differs from the stream index)")
        out.append(data)
    return out[0], out[1]


def read_checkpoint(loc: PackLocation, stream: int, shard: int, index: StreamIndex) -> StreamState:
    """Load ``ckpt-shard`` after checking both files against the digests the index recorded."""
    text, pixels = read_checkpoint_files(loc, index, shard)
    try:
        return state_from_payload(CheckpointDoc.from_json(text, loc.path(checkpoint_file(stream, shard))), pixels)
    except DamagedFile:
        raise
    except (ValueError, KeyError, TypeError) as e:
        raise DamagedFile(f"{loc.path(checkpoint_file(stream, shard))}: checkpoint does not load ({e})") from None


def compact_lineage(loc: PackLocation, index: StreamIndex) -> tuple[str, int]:
    """Write ``lineage/stream-S.parquet`` from the shard lineage files (one row group per shard).

    Memory is one shard's lineage at a time.  A stream extended after it was done appends its new
    shards to the rows of its earlier lineage file.  Returns (sha256, rows).
    """
    stream = index.stream
    rel = stream_lineage_file(stream)
    sink = pa.BufferOutputStream()
    rows = 0
    with pq.ParquetWriter(sink, LINEAGE_SCHEMA, compression="zstd") as w:
        done_before = 0
        try:
            previous = pq.ParquetFile(pa.BufferReader(loc.read_bytes(rel)))
            for g in range(previous.num_row_groups):
                table = previous.read_row_group(g)
                w.write_table(table)
                rows += table.num_rows
            done_before = previous.num_row_groups
        except FileNotFoundError:
            pass
        for entry in index.shards[done_before:]:
            table = pq.read_table(pa.BufferReader(loc.read_bytes(shard_lineage_file(stream, entry.shard))))
            if table.num_rows:
                w.write_table(table.cast(LINEAGE_SCHEMA))
            rows += table.num_rows
    data = sink.getvalue().to_pybytes()
    loc.make_dirs(loc.path(LINEAGE_DIR))
    write_bytes_atomic(loc, rel, data)
    return sha256_hex(data), rows


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


def pack_one_stream(cfg: PrepackConfig, out: "str | PackLocation", stream: int, tokenizer, special,
                    metadata: dict[str, str], report: Callable[[ProgressEvent], None] | None = None,
                    reuse: "tuple[str | OldPack, ...] | list" = ()) -> StreamSummary:
    """Pack (or continue, or extend) stream ``stream`` into ``out``; returns its summary (done.json).

    ``reuse``: earlier packs whose pixels may be taken instead of decoding (no byte changes): paths or
    URIs, or ``OldPack`` snapshots the driver read once for every stream."""
    cpu_start = time.process_time()  # the whole process (Ray's threads too): what packing costs per core
    loc = resolve_location(out)
    rank, worker = cfg.stream_rank_worker(stream)
    budget = cfg.prepack.budget()
    previous = read_done(loc, stream)
    if previous is not None and previous.budget == budget:
        drop_lineage_leftovers(loc, stream)
        return previous
    loc.make_dirs(loc.path(stream_dir(stream)))
    if previous is not None:  # extending a finished stream: it is no longer done
        log.info("stream %d: extending from %s to %s", stream, previous.budget, budget)
        loc.fs.delete_file(loc.path(done_file(stream)))
    index = recover_stream(loc, stream)
    pixels = pixel_provider(loc, index, reuse, Compression.parse(cfg.prepack.compression))
    own = pixels is not None and own_reuse_on()
    if not index.shards:
        packer = StreamPacker(cfg, stream, tokenizer, special, reuse_pixel_table=True,  # each batch is written before the next
                              pixels=pixels)
    else:
        packer = StreamPacker(cfg, stream, tokenizer, special,
                              state=read_checkpoint(loc, stream, len(index.shards), index),
                              reuse_pixel_table=True, pixels=pixels)
        log.info("stream %d: continuing at shard %d (record %d)", stream, len(index.shards), index.num_records)
    start = time.perf_counter()

    def committed(writer: StreamWriter, entry: ShardEntry | None) -> None:
        if not own:
            return
        if entry is not None:  # a later pass of this stream may take these pictures back
            pixels.add_shard(loc, stream, entry.shard, entry.nbytes, writer.committed_pixels)
        else:  # and those of the shard still open, from memory
            pixels.add_written(writer.last_images)

    try:
        # a new stream's writer writes ckpt-00000 here, before the packer's first batch
        with StreamWriter(loc, stream, shard_bytes=cfg.prepack.shard_bytes, compression=cfg.prepack.compression,
                          metadata=metadata, index=index, state=lambda: checkpoint_bytes(packer)) as writer:
            for batch in packer:
                committed(writer, writer.append(batch))
                if report is not None:
                    report(ProgressEvent(stream, packer.batches, packer.tokens, counters=packer.counters))
            committed(writer, writer.finish())
    except BaseException:
        packer.close()  # the sources' read-ahead threads end with the stream, on errors too
        raise
    finally:
        if pixels is not None:
            pixels.close()
    lineage_sha, lineage_rows = compact_lineage(loc, index) if index.shards else ("", 0)
    counters = packer.final_counters()
    records = [r for s in index.shards for r in s.records]
    result = StreamSummary(
        stream=stream, rank=rank, worker=worker, seed=cfg.stream_seed(stream), num_shards=len(index.shards),
        num_records=len(records), num_tokens=sum(r.num_tokens for r in records),
        num_samples=sum(r.num_samples for r in records), root=index.root, budget=budget,
        lineage_sha256=lineage_sha, lineage_rows=lineage_rows,
        drops=counters.drops, warnings=counters.warnings, examples=counters.examples,
        group_samples=counters.samples_packed,
        elapsed_s=round(time.perf_counter() - start, 3), cpu_s=round(time.process_time() - cpu_start, 3),
        reuse=packer.pictures.counts.to_json(),
    )
    write_bytes_atomic(loc, done_file(stream), result.to_json().encode())
    for entry in index.shards:  # the stream's lineage file now holds these rows
        try:
            loc.fs.delete_file(loc.path(shard_lineage_file(stream, entry.shard)))
        except FileNotFoundError:
            pass
    if report is not None:
        report(ProgressEvent(stream, packer.batches, packer.tokens, done=True, counters=counters))  # what done.json says
    return result


def drop_lineage_leftovers(loc: PackLocation, stream: int) -> int:
    """Delete the shard lineage files of a finished stream; returns how many there were.

    A finished stream's lineage is ``lineage/stream-S.parquet``; its shard lineage files are
    deleted after ``done.json`` is written, so a run killed in between leaves them behind.  Called
    for every finished stream a run is asked for (one listing each).
    """
    sdir = loc.path(stream_dir(stream))
    files = [(i.base_name, parse(f"{stream_dir(stream)}/{i.base_name}"))
             for i in loc.list(stream_dir(stream)) if i.type == pafs.FileType.File]
    names = [name for name, f in files if f is not None and f.kind == SHARD_LINEAGE]
    for name in names:
        try:
            loc.fs.delete_file(f"{sdir}/{name}")
        except FileNotFoundError:
            pass
    if names:
        log.warning("stream %d: removed %d shard lineage files that an interrupted run left after finishing it",
                    stream, len(names))
    return len(names)


def read_done(loc: PackLocation, stream: int) -> StreamSummary | None:
    """The stream's ``done.json``, or None while it is not finished."""
    try:
        data = loc.read_bytes(done_file(stream))
    except FileNotFoundError:
        return None
    return StreamSummary.from_json(data, loc.path(done_file(stream)))
