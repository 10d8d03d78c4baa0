"""The lineage of a pack as one lazy polars frame, and the two questions asked of it.

The lineage is a dataset of parquet files, never merged: ``lineage/stream-SSSSS.parquet`` per
finished stream and ``stream-SSSSS/shard-KKKKK.lineage.parquet`` per committed shard of a stream
still packing.  ``scan_lineage`` scans one pack's own files lazily, its records numbered as that
pack's.  A continuation (``prepack run --continue``) is read as one pack, so ``scan_chain_lineage``
joins every segment of its chain in a reader's numbering: per stream the records a reader takes
from each segment, ``record`` counted over the chain, each row naming its ``segment`` (0: the
chain's first pack) and ``pack`` (where that segment lies).  ``batches_with_row`` and
``rows_of_batch`` are plain polars queries over the chain, here so that ``stats``, tests and users
share one spelling.
"""

from __future__ import annotations

from dataclasses import dataclass

import polars as pl

from loader.reader import Pack
from schemas.lineage import LINEAGE_SCHEMA, lineage_files
from schemas.location import resolve_location

ROW_KEY = ["source_file", "source_row_group", "source_row"]  # a source row, wherever it lies


def scan_lineage(out) -> pl.LazyFrame:
    """The whole lineage as one lazy frame (no merge, no read until ``collect``), of the files
    ``schemas.lineage.lineage_files`` finds."""
    loc = resolve_location(out)
    files = lineage_files(loc)
    if not files:
        return pl.from_arrow(LINEAGE_SCHEMA.empty_table()).lazy()
    if loc.is_local:
        return pl.scan_parquet(files)
    import pyarrow.dataset as pads

    return pl.scan_pyarrow_dataset(pads.dataset(files, filesystem=loc.fs, format="parquet", schema=LINEAGE_SCHEMA))


@dataclass(frozen=True)
class Segment:
    """One pack of a chain as a reader sees it: per stream, its own records a reader takes
    (``own``, from its first) and how many chain records come before them (``offset``)."""

    pack: object  # loader.reader.Pack
    offset: dict[int, int]
    own: dict[int, int]

    @property
    def records(self) -> int:
        return sum(self.own.values())


def chain_segments(out) -> list[Segment]:
    """The chain of the pack at ``out`` (a path, URI or ``loader.reader.Pack``), first segment first;
    one segment for a pack of its own."""
    pack = out if isinstance(out, Pack) else Pack.open(out)
    limits: dict[int, int | None] = {s: None for s in range(pack.num_streams)}  # chain records a reader takes
    found = []
    p = pack
    while p is not None:
        switch = {s: p.switch(s) for s in limits}
        own = {s: p.index(s).num_records if limits[s] is None else max(0, limits[s] - switch[s]) for s in limits}
        found.append(Segment(p, switch, own))
        limits = {s: switch[s] if limits[s] is None else min(limits[s], switch[s]) for s in limits}
        p = p.parent
    return found[::-1]


def scan_chain_lineage(out) -> pl.LazyFrame:
    """The lineage of the whole chain as a reader reads it: ``scan_lineage``'s columns with
    ``record`` counted over the chain, then ``segment`` and ``pack`` (module doc)."""
    frames = []
    for i, seg in enumerate(chain_segments(out)):
        cut = pl.DataFrame({"stream": list(seg.own), "below": list(seg.own.values()),
                            "offset": [seg.offset[s] for s in seg.own]},
                           schema={"stream": pl.Int32, "below": pl.Int64, "offset": pl.Int64})
        frames.append(scan_lineage(seg.pack.location).join(cut.lazy(), on="stream")
                      .filter(pl.col("record") < pl.col("below"))
                      .with_columns(pl.col("record") + pl.col("offset"), pl.lit(i, pl.Int32).alias("segment"),
                                    pl.lit(seg.pack.location.base).alias("pack"))
                      .drop("below", "offset"))
    return pl.concat(frames)


def batches_with_row(out, source_file: str, source_row: int, source_row_group: int | None = None) -> pl.DataFrame:
    """Which packed batches contain source row X: (stream, record, sample, group, num_tokens,
    segment) rows, in stream order, records counted over a continuation's chain."""
    q = scan_chain_lineage(out).filter((pl.col("source_file") == source_file) & (pl.col("source_row") == source_row))
    if source_row_group is not None:
        q = q.filter(pl.col("source_row_group") == source_row_group)
    return (q.select("stream", "record", "sample", "group", "num_tokens", "segment")
            .sort("stream", "record", "sample").collect())


def rows_of_batch(out, stream: int, record: int) -> pl.DataFrame:
    """Which source rows formed batch (stream, record) -- the record a reader counts, over a
    continuation's chain -- in packing order, and the segment they were packed in."""
    return (scan_chain_lineage(out).filter((pl.col("stream") == stream) & (pl.col("record") == record))
            .sort("sample").select("sample", "group", "dataset", *ROW_KEY, "data_indexes", "num_tokens", "segment")
            .collect())
