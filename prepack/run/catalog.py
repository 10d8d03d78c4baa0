"""Build a pack's pixel catalog (``schemas.pixel_catalog``) from its shards' pixel indexes.

Run once per pack, by ``prepack index OUT`` or by the first ``prepack run --reuse OUT`` that finds
no catalog covering what is committed.  An external sort: each committed shard's pixel index is
read (its sha256 against the stream index, its seal), its rows are split by the first byte of
their content key and appended to one temporary file per part, and each part is then sorted by
``(content, decode, width, height)`` (first copy kept), cut into blocks and written;
``catalog.json`` is written last and is the commit.  Memory: one part (1/256 of the pack's
pictures, 86 bytes each: ~34 MB at 10^8) and one shard's index.  What cannot be read (a missing or damaged pixel
index) ends that stream's coverage before it; a reader looks such shards up on its own.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np
import pyarrow as pa

from prepack.engine.reuse.source_pictures import RESIZE_IMPL
from prepack.engine.reuse.earlier_packs import open_old_pack
from prepack.run.commit.atomic_files import write_bytes_atomic
from schemas.errors import DamagedFile, PackFormatError
from schemas.layout import PACK_INFO_NAME, shard_pixels_file
from schemas.location import PackLocation, redact_uri, resolve_location
from schemas.pack_info import PackInfo
from schemas.manifest import StreamIndex
from schemas.pixel_catalog import (BLOCK_ROWS, CATALOG_NAME, FENCES_SCHEMA, PARTS, ROW_DTYPE, Catalog,
                                   arrow_file_bytes, block_digest, build_name, fences_file, part_file)
from schemas.pixel_index import read_committed_pixel_index

log = logging.getLogger(__name__)

_SORT_KEYS = ("content", "decode", "width", "height")


def check_pack(uri: str) -> None:
    """One line (NotAPack, PackFormatError) when ``uri`` is no pack this version reads."""
    loc = resolve_location(uri)
    PackInfo.open(loc).check_record_schema(loc.path(PACK_INFO_NAME))


@dataclass(frozen=True)
class CatalogBuild:
    """What a build did: rows written, shards covered of those committed, where."""

    rows: int
    shards: int
    committed: int
    build: str
    skipped: tuple[str, ...] = ()  # why some shards were left out (their stream's coverage ends there)
    catalog: Catalog | None = None  # what was written (catalog.json)


class _Vocab:
    def __init__(self):
        self.values: list[str] = []
        self._codes: dict[str, int] = {}

    def codes(self, column: "pa.Array | pa.ChunkedArray") -> np.ndarray:
        """The codes of a string column's values (new values get the next codes, in first-seen order)."""
        if isinstance(column, pa.ChunkedArray):
            column = column.combine_chunks()
        encoded = column.dictionary_encode()
        local = np.array([self._code(v) for v in encoded.dictionary.to_pylist()] or [0], np.int32)
        return local[encoded.indices.to_numpy(zero_copy_only=False)]

    def _code(self, value: str) -> int:
        code = self._codes.get(value)
        if code is None:
            code = self._codes[value] = len(self.values)
            self.values.append(value)
        return code


class _Parts:
    """Rows by part, appended to one temporary file of ``ROW_DTYPE`` records per part."""

    def __init__(self, tmp: str):
        self.tmp = tmp
        self._files: dict[int, "io.BufferedWriter"] = {}

    def add(self, rows: np.ndarray) -> None:
        first = rows.view(np.uint8).reshape(-1, ROW_DTYPE.itemsize)[:, ROW_DTYPE.fields["content"][1]]  # its first byte
        order = np.argsort(first, kind="stable")
        rows, first = rows[order], first[order]
        bounds = np.searchsorted(first, np.arange(PARTS + 1))
        for part in np.flatnonzero(np.diff(bounds)):
            f = self._files.get(int(part))
            if f is None:
                f = self._files[int(part)] = open(self._path(int(part)), "wb", buffering=1 << 16)
            f.write(rows[bounds[part]:bounds[part + 1]].tobytes())

    def rows(self, part: int) -> np.ndarray:
        f = self._files.pop(part, None)
        if f is None:
            return np.empty(0, ROW_DTYPE)
        f.close()
        rows = np.fromfile(self._path(part), ROW_DTYPE)
        os.unlink(self._path(part))
        return rows

    def close(self) -> None:
        for f in self._files.values():
            f.close()

    def _path(self, part: int) -> str:
        return os.path.join(self.tmp, f"{part:03d}.rows")


def _sorted_unique(rows: np.ndarray) -> np.ndarray:
    """Rows by ``(content, decode, width, height)``, the first copy of each kept (pack order)."""
    order = np.lexsort(tuple(rows[k] for k in reversed(_SORT_KEYS)))  # stable: pack order within a key
    rows = rows[order]
    keep = np.ones(len(rows), bool)
    if len(rows) > 1:
        same = np.ones(len(rows) - 1, bool)
        for k in _SORT_KEYS:
            same &= rows[k][1:] == rows[k][:-1]
        keep[1:] = ~same
    return rows[keep]


def _covered(loc: PackLocation, streams: int) -> dict[int, list]:
    """Each stream's committed shards (entries of its stream index; [] when none)."""
    out: dict[int, list] = {}
    for stream in range(streams):
        index = StreamIndex.read(loc, stream)
        out[stream] = index.shards if index is not None else []
    return out


def catalog_is_current(loc: PackLocation, streams: int) -> bool:
    """Whether ``catalog.json`` exists and covers every shard committed now."""
    try:
        catalog = Catalog.read(loc)
    except DamagedFile:
        return False
    return catalog is not None and catalog.current_for(_covered(loc, streams))


def build_catalog(out: str, *, on_shard: Callable[[int, int], None] | None = None,
                  tmp_dir: str | None = None) -> CatalogBuild:
    """Index every committed shard of the pack at ``out`` into its pixel catalog.

    ``on_shard(done, total)`` reports progress.  Raises ``ValueError`` when ``out`` is not a pack,
    ``OSError`` when the catalog cannot be written there.
    """
    loc, streams = open_old_pack(out)
    return _build(loc, _covered(loc, streams), on_shard, tmp_dir)


def build_for_reuse(loc: PackLocation, committed: "dict[int, list]") -> Catalog | None:
    """The catalog a ``--reuse`` job's driver builds when OLD has none covering what is committed,
    from the stream indexes it has just read (``engine.reuse.earlier_packs.read_old_pack``): the
    catalog written, or None when it cannot be (a read-only pack: a warning; the streams then read
    the shards' own pixel indexes)."""
    try:
        result = _build(loc, committed)
    except (OSError, DamagedFile, PackFormatError) as e:
        log.warning("reuse: no pixel catalog written for %s (%s); each stream reads the shards' own pixel indexes",
                    redact_uri(loc.base), str(e).splitlines()[0])
        return None
    log.info("reuse: indexed %s pictures of %s shards in %s", f"{result.rows:,}", f"{result.shards:,}",
             redact_uri(loc.base))
    return result.catalog


def _build(loc: PackLocation, committed: "dict[int, list]", on_shard: Callable[[int, int], None] | None = None,
           tmp_dir: str | None = None) -> CatalogBuild:
    """``build_catalog`` of the committed shards listed (stream -> its stream index rows)."""
    total = sum(len(s) for s in committed.values())
    vocab = {"decode": _Vocab(), "codec": _Vocab(), "damage": _Vocab()}
    covered: dict[int, tuple[int, str]] = {}
    skipped: list[str] = []
    resize = ""
    done = 0
    tmp = tempfile.mkdtemp(prefix="prepack-catalog-", dir=tmp_dir)
    try:
        parts = _Parts(tmp)
        for stream, shards in committed.items():
            n = 0
            for entry in shards:
                try:
                    table, shard_resize = read_committed_pixel_index(loc, stream, entry.shard, entry.pixels_sha256)
                    if resize and shard_resize != resize:
                        where = loc.path(shard_pixels_file(stream, entry.shard))
                        raise ValueError(f"{where}: resized by {shard_resize}, the rest by {resize}")
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
        catalog = write_catalog(loc, ((p, _sorted_unique(parts.rows(p))) for p in range(PARTS)), covered,
                                resize or RESIZE_IMPL, vocabs)  # a pack without pictures: nothing to refuse
    finally:
        parts.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return CatalogBuild(rows=catalog.rows, shards=sum(n for n, _ in covered.values()), committed=total,
                        build=catalog.build, skipped=tuple(skipped), catalog=catalog)


def write_catalog(loc: PackLocation, parts: "Iterable[tuple[int, np.ndarray]]", covered: dict[int, tuple[int, str]],
                  resize: str, vocabs: dict[str, list[str]]) -> Catalog:
    """Write the part files (each part's ``ROW_DTYPE`` rows, sorted and unique by key), the fences
    and last ``catalog.json``; the catalog written."""
    build = build_name(covered, resize)
    fences: list[pa.RecordBatch] = []
    rows = 0
    for part, records in parts:
        if not len(records):
            continue
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


def _catalog_rows(table: pa.Table, stream: int, shard: int, shard_bytes: int, vocab: dict[str, _Vocab]) -> np.ndarray:
    """A shard pixel index's rows as catalog rows (``ROW_DTYPE``)."""
    rows = np.zeros(table.num_rows, ROW_DTYPE)
    content = table.column("content").combine_chunks()
    rows["content"] = np.frombuffer(content.buffers()[1], "S16", count=len(content), offset=content.offset * 16)
    for name in ("width", "height", "src_width", "src_height", "offset", "length", "nbytes", "digest", "frame_digest"):
        rows[name] = table.column(name).to_numpy()
    for name in ("decode", "codec", "damage"):
        rows[name] = vocab[name].codes(table.column(name))
    rows["stream"], rows["shard"], rows["shard_bytes"] = stream, shard, shard_bytes
    return rows


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
