"""Lineage: one row per packed sample (``LINEAGE_SCHEMA``), what an audit of "what was trained on"
reads.  Its files are found and decoded here, for every reader (compaction, verify, the queries).

A shard's rows are written at its commit (``shard-k.lineage.parquet``, its sha256 in the index row);
when the stream finishes they are compacted into ``lineage/stream-S.parquet``, one row group per
shard in shard order, and the shard files go (``prepack.run.commit.lineage``).  A stream extended after it
finished keeps that file for its first shards and has shard files for the later ones until it
finishes again.  Names: ``schemas.layout``; queries: ``prepack.tools.lineage_queries``.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from schemas.layout import SHARD_LINEAGE, STREAM_LINEAGE, parse
from schemas.location import PackLocation

LINEAGE_SCHEMA = pa.schema([
    ("stream", pa.int32()), ("record", pa.int64()), ("sample", pa.int32()),
    ("group", pa.string()), ("dataset", pa.string()), ("worker_id", pa.int32()),
    ("data_indexes", pa.list_(pa.int64())), ("source_file", pa.string()),
    ("source_row_group", pa.int64()), ("source_row", pa.int64()),
    ("num_tokens", pa.int32()),
])


def read_lineage(data: bytes) -> pa.Table:
    """A lineage file's rows, as written."""
    return pq.read_table(pa.BufferReader(data))


def lineage_by_shard(data: bytes) -> pq.ParquetFile:
    """A stream's lineage file, whose row groups are its shards in order: ``num_row_groups`` says how
    many of the stream's first shards it covers."""
    return pq.ParquetFile(pa.BufferReader(data))


def lineage_columns(data: bytes) -> pa.Schema:
    """A lineage file's columns, read from its footer alone."""
    return pq.read_schema(pa.BufferReader(data))


def samples_per_record(data: bytes) -> dict[int, int]:
    """Rows per ``record`` (the samples each record packed, by the file), reading that column alone."""
    counts: dict[int, int] = {}
    for r in pq.read_table(pa.BufferReader(data), columns=["record"]).column("record").to_pylist():
        counts[r] = counts.get(r, 0) + 1
    return counts


def lineage_files(loc: PackLocation) -> list[str]:
    """Filesystem paths of a pack's lineage files: each stream's compacted file, then the shard files
    it does not cover (a stream still packing, or extended past an earlier finish: its compacted file
    holds one row group per shard it covers, so a shard file of a shard it covers is a leftover)."""
    infos = loc.list("", recursive=True)
    base = loc.base.rstrip("/") + "/"
    rel = sorted(i.path[len(base):] for i in infos if i.type == pafs.FileType.File and i.path.startswith(base))
    files = [(r, f) for r, f in ((r, parse(r)) for r in rel) if f is not None]
    done = {f.stream: r for r, f in files if f.kind == STREAM_LINEAGE}
    shards = [(r, f) for r, f in files if f.kind == SHARD_LINEAGE]
    covered = {s: lineage_by_shard(loc.read_bytes(done[s])).num_row_groups
               for s in {f.stream for _, f in shards if f.stream in done}}
    return [loc.path(r) for r in done.values()] + [loc.path(r) for r, f in shards
                                                   if f.shard >= covered.get(f.stream, 0)]
