"""Build a pack's pixel catalog (``schemas.pixel_catalog``) from its shards' pixel indexes.

Run once per pack, by ``prepack index OUT`` or by the first ``prepack run --reuse OUT`` that finds
no catalog covering what is committed.  An external sort: each committed shard's pixel index is
read (its sha256 against the stream index, its seal), its rows are split by the first byte of
their content key, parts that grow past ``spill_rows`` in memory go to temporary files, and each
part is then sorted by ``(content, decode, width, height)`` (first copy kept), cut into blocks and
written; ``catalog.json`` is written last and is the commit.  Memory: ``spill_rows`` rows (~100
bytes each) plus one part (1/256 of the pack).  What cannot be read (a missing or damaged pixel
index) ends that stream's coverage before it; a reader looks such shards up on its own.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np
import pyarrow as pa

from prepack.engine.pictures import RESIZE_IMPL
from prepack.engine.reuse import open_old_pack
from prepack.run.writer import write_bytes_atomic
from schemas.errors import DamagedFile, PackFormatError
from schemas.location import PackLocation
from schemas.manifest import StreamIndex, index_file, shard_pixels_file
from schemas.pixel_catalog import (BLOCK_ROWS, CATALOG_NAME, CATALOG_SCHEMA, FENCES_SCHEMA, PARTS, Catalog,
                                   arrow_file_bytes, block_digest, build_name, fences_file, packed_rows, part_file,
                                   table_columns)
from schemas.pixel_index import read_pixel_index

log = logging.getLogger(__name__)

_SORT_KEYS = ("content", "decode", "width", "height")


@dataclass(frozen=True)
class CatalogBuild:
    """What a build did: rows written, shards covered of those committed, where."""

    rows: int
    shards: int
    committed: int
    build: str
    skipped: tuple[str, ...] = ()  # why some shards were left out (their stream's coverage ends there)


class _Vocab:
    def __init__(self):
        self.values: list[str] = []
        self._codes: dict[str, int] = {}

    def codes(self, values: list[str]) -> np.ndarray:
        out = np.empty(len(values), np.int32)
        for i, v in enumerate(values):
            code = self._codes.get(v)
            if code is None:
                code = self._codes[v] = len(self.values)
                self.values.append(v)
            out[i] = code
        return out


class _Parts:
    """Rows by part, in memory up to ``spill_rows``, then in one temporary Arrow stream per part."""

    def __init__(self, spill_rows: int, tmp: str):
        self.spill_rows, self.tmp = spill_rows, tmp
        self.held: list[list[pa.RecordBatch]] = [[] for _ in range(PARTS)]
        self.held_rows = 0
        self.spilled: dict[int, pa.ipc.RecordBatchStreamWriter] = {}

    def add(self, batch: pa.RecordBatch) -> None:
        first = table_columns(batch)["content"].view(np.uint8).reshape(-1, 16)[:, 0]
        order = np.argsort(first, kind="stable")
        bounds = np.searchsorted(first[order], np.arange(PARTS + 1))
        for part in np.flatnonzero(np.diff(bounds)):
            self.held[part].append(batch.take(pa.array(order[bounds[part]:bounds[part + 1]])))
        self.held_rows += batch.num_rows
        if self.held_rows > self.spill_rows:
            self._spill()

    def _spill(self) -> None:
        for part, batches in enumerate(self.held):
            if not batches:
                continue
            if part not in self.spilled:
                self.spilled[part] = pa.ipc.new_stream(os.path.join(self.tmp, f"{part:03d}.arrows"), CATALOG_SCHEMA)
            for b in batches:
                self.spilled[part].write_batch(b)
            self.held[part] = []
        self.held_rows = 0

    def table(self, part: int) -> pa.Table:
        batches = []
        if part in self.spilled:
            self.spilled.pop(part).close()
            path = os.path.join(self.tmp, f"{part:03d}.arrows")
            with pa.ipc.open_stream(pa.memory_map(path)) as r:
                batches.extend(r.read_all().to_batches())
            os.unlink(path)
        batches.extend(self.held[part])
        self.held[part] = []
        return pa.Table.from_batches(batches, CATALOG_SCHEMA).combine_chunks()


def _sorted_unique(table: pa.Table) -> pa.Table:
    """Rows by ``(content, decode, width, height)``, the first copy of each kept (pack order)."""
    cols = table_columns(table)
    order = np.lexsort(tuple(cols[k] for k in reversed(_SORT_KEYS)))  # stable: pack order within a key
    keys = [cols[k][order] for k in _SORT_KEYS]
    keep = np.ones(len(order), bool)
    if len(order) > 1:
        same = np.ones(len(order) - 1, bool)
        for k in keys:
            same &= k[1:] == k[:-1]
        keep[1:] = ~same
    return table.take(pa.array(order[keep]))


def _covered(loc: PackLocation, streams: int) -> dict[int, list]:
    """Each stream's committed shards (entries of its stream index; [] when none)."""
    out: dict[int, list] = {}
    for stream in range(streams):
        try:
            data = loc.read_bytes(index_file(stream))
        except FileNotFoundError:
            out[stream] = []
            continue
        out[stream] = StreamIndex.from_bytes(data, stream, loc.path(index_file(stream))).shards
    return out


def catalog_is_current(loc: PackLocation, streams: int) -> bool:
    """Whether ``catalog.json`` exists and covers every shard committed now."""
    try:
        catalog = Catalog.from_bytes(loc.read_bytes(CATALOG_NAME), loc.path(CATALOG_NAME))
    except (FileNotFoundError, DamagedFile):
        return False
    for stream, shards in _covered(loc, streams).items():
        n, last = catalog.covered.get(stream, (0, ""))
        if n != len(shards) or (shards and shards[-1].pixels_sha256 != last):
            return False
    return True


def build_catalog(out: str, *, spill_rows: int = 2_000_000, on_shard: Callable[[int, int], None] | None = None,
                  tmp_dir: str | None = None) -> CatalogBuild:
    """Index every committed shard of the pack at ``out`` into its pixel catalog.

    ``on_shard(done, total)`` reports progress.  Raises ``ValueError`` when ``out`` is not a pack,
    ``OSError`` when the catalog cannot be written there.
    """
    loc, streams = open_old_pack(out)
    committed = _covered(loc, streams)
    total = sum(len(s) for s in committed.values())
    vocab = {"decode": _Vocab(), "codec": _Vocab(), "damage": _Vocab()}
    covered: dict[int, tuple[int, str]] = {}
    skipped: list[str] = []
    resize = ""
    done = 0
    tmp = tempfile.mkdtemp(prefix="prepack-catalog-", dir=tmp_dir)
    try:
        parts = _Parts(spill_rows, tmp)
        for stream, shards in committed.items():
            n = 0
            for entry in shards:
                rel = shard_pixels_file(stream, entry.shard)
                try:
                    data = loc.read_bytes(rel)
                    if hashlib.sha256(data).hexdigest() != entry.pixels_sha256:
                        raise ValueError(f"{loc.path(rel)}: sha256 differs from the stream index")
                    table, shard_resize = read_pixel_index(data, loc.path(rel))
                    if resize and shard_resize != resize:
                        raise ValueError(f"{loc.path(rel)}: resized by {shard_resize}, the rest by {resize}")
                except (OSError, ValueError) as e:
                    skipped.append(str(e).splitlines()[0])
                    log.warning("index: stream %d from shard %d on is left out: %s", stream, entry.shard, e)
                    break
                resize = resize or shard_resize
                parts.add(_catalog_rows(table, stream, entry.shard, entry.nbytes, vocab))
                n += 1
                done += 1
                if on_shard is not None:
                    on_shard(done, total)
            covered[stream] = (n, shards[n - 1].pixels_sha256 if n else "")
        vocabs = {k: v.values for k, v in vocab.items()}
        catalog = write_catalog(loc, ((p, _sorted_unique(parts.table(p))) for p in range(PARTS)), covered,
                                resize or RESIZE_IMPL, vocabs)  # a pack without pictures: nothing to refuse
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return CatalogBuild(rows=catalog.rows, shards=sum(n for n, _ in covered.values()), committed=total,
                        build=catalog.build, skipped=tuple(skipped))


def write_catalog(loc: PackLocation, parts: "Iterable[tuple[int, pa.Table]]", covered: dict[int, tuple[int, str]],
                  resize: str, vocabs: dict[str, list[str]]) -> Catalog:
    """Write the part files (each table sorted and unique by key, ``CATALOG_SCHEMA``), the fences
    and last ``catalog.json``; the catalog written."""
    build = build_name(covered, resize)
    fences: list[pa.RecordBatch] = []
    rows = 0
    for part, table in parts:
        if not table.num_rows:
            continue
        records = packed_rows(table)
        data = records.tobytes()
        rows += len(records)
        starts = list(range(0, len(records), BLOCK_ROWS))
        counts = [min(BLOCK_ROWS, len(records) - b) for b in starts]
        size = records.dtype.itemsize
        fences.append(pa.record_batch({
            "first": pa.array([records["content"][b:b + 1].tobytes() for b in starts], pa.binary(16)),
            "part": pa.array([part] * len(starts), pa.int16()),
            "row": pa.array(starts, pa.int64()),
            "rows": pa.array(counts, pa.int32()),
            "digest": pa.array([block_digest(data[b * size:(b + n) * size]) for b, n in zip(starts, counts)],
                               pa.uint64()),
        }, schema=FENCES_SCHEMA))
        write_bytes_atomic(loc, part_file(build, part), data)
    fence_table = pa.Table.from_batches(fences, FENCES_SCHEMA).combine_chunks()
    fence_bytes = arrow_file_bytes(fence_table, FENCES_SCHEMA)
    write_bytes_atomic(loc, fences_file(build), fence_bytes)
    catalog = Catalog(resize=resize, build=build, rows=rows, fences_sha256=hashlib.sha256(fence_bytes).hexdigest(),
                      covered=covered, decodes=vocabs["decode"], codecs=vocabs["codec"], damages=vocabs["damage"])
    write_bytes_atomic(loc, CATALOG_NAME, catalog.to_bytes())
    return catalog


def _catalog_rows(table: pa.Table, stream: int, shard: int, shard_bytes: int, vocab: dict[str, _Vocab]) -> pa.RecordBatch:
    n = table.num_rows
    col = {name: table.column(name) for name in table.schema.names}

    def ints(name: str) -> np.ndarray:
        return col[name].to_numpy()

    return pa.record_batch({
        "content": col["content"].combine_chunks(),
        "decode": pa.array(vocab["decode"].codes(col["decode"].to_pylist()), pa.int8()),
        "width": pa.array(ints("width"), pa.int32()),
        "height": pa.array(ints("height"), pa.int32()),
        "src_width": pa.array(ints("src_width"), pa.int32()),
        "src_height": pa.array(ints("src_height"), pa.int32()),
        "damage": pa.array(vocab["damage"].codes(col["damage"].to_pylist()), pa.int32()),
        "stream": pa.array(np.full(n, stream, np.int32)),
        "shard": pa.array(np.full(n, shard, np.int32)),
        "shard_bytes": pa.array(np.full(n, shard_bytes, np.int64)),
        "offset": pa.array(ints("offset"), pa.int64()),
        "length": pa.array(ints("length"), pa.int64()),
        "nbytes": pa.array(ints("nbytes"), pa.int64()),
        "codec": pa.array(vocab["codec"].codes(col["codec"].to_pylist()), pa.int8()),
        "digest": pa.array(ints("digest"), pa.uint64()),
    }, schema=CATALOG_SCHEMA)


def ensure_catalog(out: str) -> str | None:
    """Make sure the pack at ``out`` has a catalog covering what is committed now (built if not).

    Returns a line for the log when it built one, None when it was current; a catalog that cannot
    be written (a read-only pack) is a warning: the streams then read the shards' own indexes.
    """
    try:
        loc, streams = open_old_pack(out)
        if catalog_is_current(loc, streams):
            return None
        result = build_catalog(out)
    except (OSError, DamagedFile, PackFormatError) as e:
        log.warning("reuse: no pixel catalog written for %s (%s); each stream reads the shards' own pixel indexes",
                    out, str(e).splitlines()[0])
        return None
    return f"indexed {result.rows:,} pictures of {result.shards:,} shards in {out}"
