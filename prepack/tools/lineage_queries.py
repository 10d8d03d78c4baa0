"""The lineage of a pack as one lazy polars frame, and the two questions asked of it.

The lineage is a dataset of parquet files, never merged: ``lineage/stream-SSSSS.parquet`` per
finished stream and ``stream-SSSSS/shard-KKKKK.lineage.parquet`` per committed shard of a stream
still packing.  ``scan_lineage`` scans them lazily; ``batches_with_row`` and ``rows_of_batch``
are plain polars queries over it, here so that ``stats``, tests and users share one spelling.
"""

from __future__ import annotations

import polars as pl

from schemas.layout import SHARD_LINEAGE, STREAM_LINEAGE, parse
from schemas.location import resolve_location

ROW_KEY = ["source_file", "source_row_group", "source_row"]  # a source row, wherever it lies


def lineage_files(out) -> list[str]:
    """Filesystem paths of every lineage file of a pack (finished streams, then shards of the rest)."""
    import pyarrow.fs as pafs

    loc = resolve_location(out)
    infos = loc.list("", recursive=True)
    base = loc.base.rstrip("/") + "/"
    rel = sorted(i.path[len(base):] for i in infos if i.type == pafs.FileType.File and i.path.startswith(base))
    files = [(r, f) for r, f in ((r, parse(r)) for r in rel) if f is not None]
    done = [r for r, f in files if f.kind == STREAM_LINEAGE]
    finished = {f.stream for _, f in files if f.kind == STREAM_LINEAGE}
    shards = [r for r, f in files if f.kind == SHARD_LINEAGE and f.stream not in finished]
    return [loc.path(r) for r in done + shards]


def scan_lineage(out) -> pl.LazyFrame:
    """The whole lineage as one lazy frame (no merge, no read until ``collect``)."""
    from schemas.manifest import LINEAGE_SCHEMA

    loc = resolve_location(out)
    files = lineage_files(loc)
    if not files:
        return pl.from_arrow(LINEAGE_SCHEMA.empty_table()).lazy()
    if loc.is_local:
        return pl.scan_parquet(files)
    import pyarrow.dataset as pads

    return pl.scan_pyarrow_dataset(pads.dataset(files, filesystem=loc.fs, format="parquet", schema=LINEAGE_SCHEMA))


def batches_with_row(out, source_file: str, source_row: int, source_row_group: int | None = None) -> pl.DataFrame:
    """Which packed batches contain source row X: (stream, record, sample) rows, in stream order."""
    q = scan_lineage(out).filter((pl.col("source_file") == source_file) & (pl.col("source_row") == source_row))
    if source_row_group is not None:
        q = q.filter(pl.col("source_row_group") == source_row_group)
    return q.select("stream", "record", "sample", "group", "num_tokens").sort("stream", "record", "sample").collect()


def rows_of_batch(out, stream: int, record: int) -> pl.DataFrame:
    """Which source rows formed batch (stream, record), in packing order."""
    return (scan_lineage(out).filter((pl.col("stream") == stream) & (pl.col("record") == record))
            .sort("sample").select("sample", "group", "dataset", *ROW_KEY, "data_indexes", "num_tokens").collect())
