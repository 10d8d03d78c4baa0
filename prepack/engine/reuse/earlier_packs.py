"""Earlier packs as reuse reads them: which shards are committed, whether their pixel catalog holds,
and ranged reads of their files (``prepack.engine.reuse.earlier_pixels`` looks pictures up in what this finds).

Only committed shards are read (the ones a stream's ``index.arrow`` lists), so an earlier pack may
still be packing.  ``read_old_pack`` reads an earlier pack once for a whole job (its driver, for all
its streams): ``pack.json``, the stream indexes, ``catalog.json`` and the fences, each once, the
catalog built first when it does not cover what is committed; its streams get what it read
(``OldPack``) and read none of those files again.  ``CatalogView`` serves lookups by content from
the catalog's fences and blocks; ``RangedFile`` reads a frame or a block alone, locally or on a store.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np
import pyarrow as pa

from prepack.engine.reuse.source_pictures import RESIZE_IMPL, ReuseCounts
from schemas.errors import DamagedFile, PackFormatError, PackRefused
from schemas.location import PackLocation, redact_uri, resolve_location
from schemas.layout import PACK_INFO_NAME
from schemas.manifest import StreamIndex
from schemas.pack_info import PackInfo
from schemas.pixel_catalog import ROW_DTYPE, Catalog, block_digest, fences_file, parse_fences, part_file

log = logging.getLogger(__name__)


class RangedFile:
    """One earlier file (a shard, a catalog part), opened at its first read; ranged reads only.
    On a store, reads may come from the read-ahead's threads (``read_at`` is thread-safe)."""

    def __init__(self, loc: PackLocation, relpath: str, size: int):
        self.loc, self.relpath, self.size = loc, relpath, size
        self._fd: int | None = None
        self._remote = None
        self._lock = threading.Lock()

    def read(self, offset: int, length: int) -> bytes:
        if offset < 0 or offset + length > self.size:
            raise ValueError(f"frame {offset}+{length} outside the {self.size}-byte shard")
        if self.loc.is_local:
            if self._fd is None:
                self._fd = os.open(self.loc.path(self.relpath), os.O_RDONLY)
                if os.fstat(self._fd).st_size != self.size:
                    raise ValueError(f"{self.relpath} is not the size its index recorded")
            data = os.pread(self._fd, length, offset)
        else:
            with self._lock:
                if self._remote is None:
                    self._remote = self.loc.fs.open_input_file(self.loc.path(self.relpath))
                remote = self._remote
            data = remote.read_at(length, offset)
        if len(data) != length:
            raise ValueError("short read")
        return bytes(data)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        with self._lock:
            self._remote = None  # dropped, not closed: a read in flight holds its own reference


class CatalogView:
    """Lookups by content in one earlier pack's pixel catalog: its fences in memory, its blocks read
    one ranged read at a time (checked against their digest) and the last ``cache_blocks`` kept."""

    def __init__(self, loc: PackLocation, catalog: Catalog, fences: pa.Table, cache_blocks: int = 256):
        self.loc, self.catalog = loc, catalog
        first = fences.column("first").combine_chunks()
        self._first = np.frombuffer(first.buffers()[1], dtype="S16", count=len(first), offset=first.offset * 16)
        self._part = fences.column("part").to_numpy()
        self._row = fences.column("row").to_numpy()
        self._rows = fences.column("rows").to_numpy()
        self._digest = fences.column("digest").to_numpy()
        self._files: dict[int, RangedFile] = {}
        self._blocks: OrderedDict[int, np.ndarray] = OrderedDict()
        self._cache = cache_blocks
        self._decode = {name: code for code, name in enumerate(catalog.decodes)}
        self._bad: set[int] = set()

    @classmethod
    def of(cls, loc: PackLocation, catalog: Catalog, fences: bytes) -> "CatalogView":
        """A view of ``catalog`` from its fences file as the driver read and checked it (no read here);
        ``ValueError`` when they do not parse."""
        return cls(loc, catalog, parse_fences(fences, loc.path(fences_file(catalog.build))))

    def rows(self, content: bytes, decode: str) -> "tuple[list[np.void], bool]":
        """``(rows, damaged)``: the catalog rows of ``(content, decode)`` (every resize target it holds)
        in the blocks that read and check, and whether a block the key may lie in did not."""
        code = self._decode.get(decode)
        if code is None or not len(self._first):
            return [], False
        out, damaged = [], False
        block = max(int(np.searchsorted(self._first, content, side="left")) - 1, 0)
        while block < len(self._first) and self._first[block] <= content:
            try:
                rows = self._block(block)
            except (OSError, ValueError, pa.ArrowException) as e:
                if block not in self._bad:
                    log.debug("reuse: %s", e)
                self._bad.add(block)  # its pictures are decoded; the other blocks still serve
                damaged = True
                block += 1
                continue
            keys = rows["content"]
            lo, hi = np.searchsorted(keys, content, "left"), np.searchsorted(keys, content, "right")
            out.extend(rows[i] for i in range(lo, hi) if rows["decode"][i] == code)
            block += 1
        return out, damaged

    def _block(self, block: int) -> np.ndarray:
        if block in self._bad:
            raise ValueError(f"catalog block {block} is damaged")
        rows = self._blocks.get(block)
        if rows is not None:
            self._blocks.move_to_end(block)
            return rows
        part = int(self._part[block])
        f = self._files.get(part)
        if f is None:
            size = int(self._rows[self._part == part].sum()) * ROW_DTYPE.itemsize
            f = self._files[part] = RangedFile(self.loc, part_file(self.catalog.build, part), size)
        data = f.read(int(self._row[block]) * ROW_DTYPE.itemsize, int(self._rows[block]) * ROW_DTYPE.itemsize)
        if block_digest(data) != self._digest[block]:
            raise ValueError(f"catalog block {block}: digest differs from its fence")
        rows = np.frombuffer(data, ROW_DTYPE)
        self._blocks[block] = rows
        if len(self._blocks) > self._cache:
            self._blocks.popitem(last=False)
        return rows

    def close(self) -> None:
        for f in self._files.values():
            f.close()


def open_old_pack(old: str) -> tuple[PackLocation, int]:
    """``(location, number of streams)`` of an earlier pack; ``NotAPack``-like errors name it."""
    loc = resolve_location(old)
    info = PackInfo.read(loc)
    if info is None:
        raise ValueError(f"{loc.path('')} is not a pack (no {PACK_INFO_NAME})")
    return loc, info.num_streams


@dataclass(frozen=True)
class OpenedPack:
    """An earlier pack whose ``pack.json`` was read and checked: where it is, its number of streams."""

    uri: str
    loc: PackLocation
    streams: int


def open_old_packs(olds: "Iterable[str]", out: PackLocation | None = None) -> tuple[OpenedPack, ...]:
    """The ``--reuse`` packs, each opened (its ``pack.json`` read once) and checked to be a pack this
    version reads (and not ``out``): a wrong one is the user's to fix, in one line (``PackRefused``),
    before anything runs."""
    opened = []
    for old in (str(o) for o in olds):
        try:
            loc, streams = open_old_pack(old)
        except (OSError, ValueError, DamagedFile, PackFormatError) as e:
            raise PackRefused(f"--reuse {redact_uri(old)}: {str(e).strip().splitlines()[0]}") from None
        if out is not None and loc.path("") == out.path(""):
            raise PackRefused(f"--reuse {redact_uri(old)} is the output itself (a stream reuses its own shards anyway)")
        opened.append(OpenedPack(old, loc, streams))
    return tuple(opened)


def check_old_packs(olds: "Iterable[str]", out: PackLocation | None = None) -> tuple[str, ...]:
    """``open_old_packs``, as the paths or URIs given."""
    return tuple(o.uri for o in open_old_packs(olds, out))


@dataclass(frozen=True)
class OldPack:
    """An earlier pack as read once (by a job's driver, for all its streams): where it is, the catalog
    whose coverage its stream indexes confirm with its fences file (None: no catalog that holds),
    and the committed shards that catalog does not cover, per stream.  A stream given this reads
    none of OLD's ``pack.json``, stream indexes, ``catalog.json`` or fences: on a store that is
    one request per OLD stream and two for the catalog saved per new stream.  Picklable (Ray
    task args; the fences are ~40 bytes per 256 pictures)."""

    uri: str
    readable: bool
    catalog: Catalog | None = None
    fences: bytes = b""  # the catalog's fences file, held to its sha256 by the driver
    uncovered: "tuple[tuple[int, tuple[CommittedShard, ...]], ...]" = ()
    fallbacks: "tuple[tuple[str, int], ...]" = ()  # counted while reading it (each stream counts them too)

    @property
    def catalog_build(self) -> str | None:
        return self.catalog.build if self.catalog is not None else None


# builds OLD's catalog from the stream indexes read (stream -> committed shards): the new catalog,
# or None when it could not be written (``prepack.run.catalog.build_for_reuse``)
CatalogBuilder = Callable[[PackLocation, "dict[int, list[CommittedShard]]"], "Catalog | None"]


def read_old_pack(old: "str | OpenedPack", build: CatalogBuilder | None = None) -> OldPack:
    """Read an earlier pack's stream indexes and check its catalog against them, each file once;
    with ``build``, a catalog that does not cover exactly what is committed is built first (from
    the indexes just read).  What failed is kept in ``fallbacks`` (a stream counts them as its own)."""
    mine = ReuseCounts()
    try:
        opened = old if isinstance(old, OpenedPack) else OpenedPack(str(old), *open_old_pack(old))
    except (OSError, ValueError, DamagedFile, PackFormatError) as e:
        log.warning("reuse: %s is not read (%s); its pictures are decoded", old, e)
        mine.fallback("old_pack_unreadable")
        return OldPack(str(old), False, fallbacks=tuple(mine.fallbacks.items()))
    loc = opened.loc
    committed = _committed(loc, opened.streams, mine)
    catalog, damaged = _read_catalog(loc)
    every = {s: committed.get(s, []) for s in range(opened.streams)}
    # (a stream index that did not read leaves the catalog as it is, as `prepack index` would)
    if build is not None and not mine.fallbacks and (damaged or catalog is None or not catalog.current_for(every)):
        built = build(loc, every)
        if built is not None:
            catalog, damaged = built, False
    if damaged:
        mine.fallback("pixel_catalog_damaged")
    catalog, fences = _checked_catalog(loc, catalog, committed, mine)
    covered = catalog.covered if catalog is not None else {}
    uncovered = tuple((stream, tuple(shards[covered.get(stream, (0, ""))[0]:])) for stream, shards in committed.items())
    return OldPack(opened.uri, True, catalog, fences, tuple((s, sh) for s, sh in uncovered if sh),
                   tuple(sorted(mine.fallbacks.items())))


def _committed(loc: PackLocation, streams: int, counts: ReuseCounts) -> "dict[int, list[CommittedShard]]":
    out: dict[int, list[CommittedShard]] = {}
    for stream in range(streams):
        try:
            index = StreamIndex.read(loc, stream)
        except (DamagedFile, PackFormatError, ValueError) as e:
            counts.fallback("stream_index_damaged")
            log.debug("reuse: stream_index_damaged (%s)", e)
            continue
        except OSError as e:
            counts.fallback("stream_index_unreadable")
            log.debug("reuse: stream_index_unreadable (%s)", e)
            continue
        if index is None:
            continue  # nothing committed yet
        out[stream] = [CommittedShard.of(e) for e in index.shards]  # the records' digests are not kept
    return out


def _read_catalog(loc: PackLocation) -> "tuple[Catalog | None, bool]":
    """``(catalog.json, damaged)``: None when the pack has none or it does not read."""
    try:
        return Catalog.read(loc), False
    except (OSError, DamagedFile) as e:
        log.debug("reuse: pixel_catalog_damaged (%s)", e)
        return None, True


def _checked_catalog(loc: PackLocation, catalog: "Catalog | None", committed: "dict[int, list[CommittedShard]]",
                     counts: ReuseCounts) -> "tuple[Catalog | None, bytes]":
    """The catalog and its fences file when it holds (its fences' checksum, resize and a coverage
    the stream indexes confirm), else ``(None, b"")``: its shards' own indexes are read instead."""
    if catalog is None:
        return None, b""
    try:
        fences = catalog.fence_bytes(loc)
        parse_fences(fences, loc.path(fences_file(catalog.build)))
    except (OSError, ValueError, pa.ArrowException) as e:
        counts.fallback("pixel_catalog_damaged")
        log.debug("reuse: pixel_catalog_damaged (%s)", e)
        return None, b""
    if catalog.resize != RESIZE_IMPL:
        counts.fallback("pixel_catalog_other_resize")
        return None, b""
    for stream in catalog.covered:
        if not catalog.holds_for(stream, committed.get(stream, [])):
            counts.fallback("pixel_catalog_stale")  # the pack changed under it: not one byte trusted
            return None, b""
    return catalog, fences


@dataclass(frozen=True)
class CommittedShard:
    """What reuse needs of a committed shard's index row."""

    shard: int
    nbytes: int
    pixels_sha256: str

    @classmethod
    def of(cls, entry) -> "CommittedShard":
        return cls(entry.shard, entry.nbytes, entry.pixels_sha256)
