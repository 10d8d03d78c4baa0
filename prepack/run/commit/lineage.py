"""Lineage written: one row per packed sample (``schemas.lineage``: its schema, its files and how
they are read), what an audit of "what was trained on" reads.

Written per shard at its commit (``shard-k.lineage.parquet``, its sha256 in the index row), then
compacted into ``lineage/stream-S.parquet`` (one row group per shard) when the stream finishes,
after which the shard files go.
"""

from __future__ import annotations

import logging

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from prepack.run.commit.atomic_files import sha256_hex, write_bytes_atomic
from schemas.layout import LINEAGE_DIR, SHARD_LINEAGE, parse, shard_lineage_file, stream_dir, stream_lineage_file
from schemas.lineage import LINEAGE_SCHEMA, lineage_by_shard, read_lineage
from schemas.location import PackLocation
from schemas.manifest import StreamIndex

log = logging.getLogger(__name__)


def lineage_table(stream: int, first_record: int, batches: "list[tuple[list, list[int]]]") -> pa.Table:
    """Lineage rows (``schemas.lineage.LINEAGE_SCHEMA``) of consecutive records from each one's
    (origins, sample lengths)."""
    cols: dict[str, list] = {f.name: [] for f in LINEAGE_SCHEMA}
    for i, (origins, lens) in enumerate(batches):
        for j, (o, n) in enumerate(zip(origins, lens)):
            cols["stream"].append(stream)
            cols["record"].append(first_record + i)
            cols["sample"].append(j)
            cols["group"].append(o.group)
            cols["dataset"].append(o.dataset)
            cols["worker_id"].append(o.worker_id)
            cols["data_indexes"].append(list(o.data_indexes))
            cols["source_file"].append(o.source_file)
            cols["source_row_group"].append(o.source_row_group)
            cols["source_row"].append(o.source_row)
            cols["num_tokens"].append(n)
    return pa.Table.from_pydict(cols, schema=LINEAGE_SCHEMA)


def parquet_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue().to_pybytes()


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
            previous = lineage_by_shard(loc.read_bytes(rel))
            for g in range(previous.num_row_groups):
                table = previous.read_row_group(g)
                w.write_table(table)
                rows += table.num_rows
            done_before = previous.num_row_groups
        except FileNotFoundError:
            pass
        for entry in index.shards[done_before:]:
            table = read_lineage(loc.read_bytes(shard_lineage_file(stream, entry.shard)))
            if table.num_rows:
                w.write_table(table.cast(LINEAGE_SCHEMA))
            rows += table.num_rows
    data = sink.getvalue().to_pybytes()
    loc.make_dirs(loc.path(LINEAGE_DIR))
    write_bytes_atomic(loc, rel, data)
    return sha256_hex(data), rows


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
