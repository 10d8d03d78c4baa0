"""Earlier pixels: pictures already decoded and resized by another pack, or by this stream's own
earlier shards, found by content and checked before use.

The rule (docs/architecture/pack-on-disk.md, "Reuse"): a picture's resized pixels are a function of its encoded
bytes, how they are decoded and the resize target, for one resize implementation.  So an image is
taken from an earlier shard when its ``(content, decode, width, height)`` is in that shard's pixel
index (``schemas.pixel_index``) and the index names the same resize implementation; its frame is
read alone (one ranged read) and checked against the index before a byte is used: when the
stream's writer makes frames of the frame's exact format (``Compression.frame_format``) the frame
is passed through untouched, checked by its own XXH3-64 (equal pixels, same deterministic
compression: the bytes a fresh pack writes); otherwise it is decompressed and its pixels' XXH3-64
checked.  A picture whose decode facts are known is not decoded at all (``prepack.engine.reuse.source_pictures``).
Anything that does not hold — an index missing, damaged or of another resize, a shard file gone,
short or changed, a frame that fails its digest — means decode and resize as usual, counted by
reason: never a wrong byte, never a failed run.

Only committed shards are read (the ones a stream's ``index.arrow`` lists), so an earlier pack may
still be packing.  Lookups go to the earlier pack's pixel catalog (``schemas.pixel_catalog``: the
same rows sorted by content in blocks) where it covers a shard: memory is its block fences (~40
bytes per 256 pictures), a few cached blocks and the rows of the last pictures looked up, whatever
the size of the pack.  Shards the catalog does not cover (committed after it was built, or no
catalog at all) and this stream's own shards are held in memory, ~150 bytes a picture, loaded once
per stream at its first picture.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable

import numpy as np
import pyarrow as pa

from prepack.engine.accounting import Warn
from prepack.engine.reuse.earlier_packs import CatalogView, CommittedShard, OldPack, RangedFile, read_old_pack
from prepack.engine.reuse.source_pictures import RESIZE_IMPL, ReuseCounts
from prepack.engine.sources.readahead import ReadAheadSettings
from schemas.compression import decompress_frame, frame_codec
from schemas.layout import shard_file
from schemas.location import PackLocation, resolve_location
from schemas.manifest import StreamIndex, TrimmedShards
from schemas.pixel_index import DecodeFacts, PictureSource, PixelEntry, frame_digest, read_committed_pixel_index
from schemas.pixel_table import StoredImage, image_digest

log = logging.getLogger(__name__)

WRITTEN_LIMIT_BYTES = 128 << 20  # frames of the open shard kept in memory for a stream's later passes
RECENT_PICTURES = 512  # pictures whose catalog rows are kept (a row pins its 22 KB block: <= ~11 MB)
OWN_SETTING = "PREPACK_REUSE_OWN"  # 0: a stream's later passes decode again instead of reading its own shards


def own_reuse_on(env: "dict[str, str] | None" = None) -> bool:
    """Whether a stream takes pictures back from its own committed shards (default: yes)."""
    env = os.environ if env is None else env
    return env.get(OWN_SETTING, "1").strip().lower() not in ("0", "false", "no", "off")


@dataclass(frozen=True)
class _Where:
    file: int  # into PixelReuse._files
    offset: int
    length: int
    nbytes: int
    codec: str  # frame format
    digest: int
    frame_digest: int


class PixelReuse:
    """A stream's view of earlier pixels: ``facts`` and ``fetch`` for ``PictureStore``.

    ``olds``: earlier packs (paths or URIs), loaded at the first lookup.  ``add_shard`` adds one
    of this stream's own shards once it is committed (reuse within one pack).  ``counts`` is the
    stream's ``ReuseCounts`` (fallbacks are counted there by reason).  At most ``open_files``
    earlier shard files are held open at once.  ``frame_format``: the format of the frames the
    stream's writer makes (``Compression.frame_format``); frames of that format are handed over
    undecompressed (None: always as pixels).
    """

    def __init__(self, olds: "Iterable[str | OldPack]" = (), counts: ReuseCounts | None = None, open_files: int = 64,
                 frame_format: str | None = None, read_ahead: "FrameReadAhead | None" = None):
        self.olds = [o if isinstance(o, OldPack) else str(o) for o in olds]
        self.frame_format = frame_format
        self._ahead = read_ahead if read_ahead is not None else FrameReadAhead()
        self._pending: OrderedDict[tuple[bytes, str, int, int], tuple[_Where, Future]] = OrderedDict()
        self._written: OrderedDict[tuple[bytes, str, int, int], StoredImage] = OrderedDict()
        self._written_bytes = 0
        self.written_limit = WRITTEN_LIMIT_BYTES
        self.counts = counts if counts is not None else ReuseCounts()
        self._facts: dict[tuple[bytes, str], DecodeFacts] = {}
        self._where: dict[tuple[bytes, str, int, int], _Where] = {}
        self._files: list[RangedFile] = []
        self._file_ids: dict[tuple[int, int, int], int] = {}  # (catalog, stream, shard) -> into _files
        self._open: OrderedDict[int, None] = OrderedDict()
        self._open_files = open_files
        self._catalogs: list[CatalogView | None] = []
        self._recent: OrderedDict[tuple[bytes, str], list] = OrderedDict()  # catalog rows of the last pictures
        self._loaded = not self.olds
        self.indexed = 0  # pictures the loaded indexes list (catalogs included)

    # -- PixelProvider --------------------------------------------------------------------------
    def facts(self, key: tuple[bytes, str]) -> DecodeFacts | None:
        self._load()
        known = self._facts.get(key)
        if known is None:
            for i, row, view in self._catalog_rows(*key):
                known = DecodeFacts(int(row["src_width"]), int(row["src_height"]),
                                    tuple(k for k in view.catalog.damages[row["damage"]].split(",") if k))
                break
        if known is not None and not all(_declared_damage(k) for k in known.damage):
            # a kind this code does not know (an index of another version): the picture is decoded to
            # learn its damage under this code's rules; its pixels may still be reused
            return self._fallback("pixel_index_unknown_damage", ",".join(known.damage))
        return known

    def prefetch(self, source: PictureSource, width: int, height: int) -> None:
        """A target this stream will ask for: on a store, its frame's read starts now (in the
        read-ahead's threads), so ``fetch`` finds it there instead of waiting for the request."""
        key = (source.content, source.decode, width, height)
        if not self._ahead.enabled or key in self._pending:
            return
        self._load()
        where = self._locate(source, width, height)
        if where is None or self._files[where.file].loc.is_local:
            return  # a local pread is cheaper than a thread
        f = self._files[where.file]
        self._pending[key] = (where, self._ahead.submit(f.read, where.offset, where.length))
        self.counts.frames_read_ahead += 1
        while len(self._pending) > self._ahead.depth:  # targets never asked for (their sample dropped)
            self._pending.popitem(last=False)[1][1].cancel()

    def fetch(self, source: PictureSource, width: int, height: int) -> StoredImage | None:
        self._load()
        written = self._written.get((source.content, source.decode, width, height))
        if written is not None and written.frame_format == self.frame_format:
            return written  # this stream's own frame, written by this process: nothing to check
        pending = self._pending.pop((source.content, source.decode, width, height), None)
        where = pending[0] if pending is not None else self._locate(source, width, height)
        if where is None:
            return None
        try:
            frame = pending[1].result() if pending is not None else self._read(where)
        except (OSError, ValueError, pa.ArrowException) as e:
            return self._fallback("shard_unreadable", e)
        if where.codec == self.frame_format and frame_codec(where.codec) != "none":
            if where.nbytes != width * height * 3 or frame_digest(frame) != where.frame_digest:
                return self._fallback("frame_damaged", "frame digest differs from the pixel index")
            return StoredImage(width, height, where.digest, frame=frame, frame_format=where.codec)
        recompressed = self.frame_format is not None and frame_codec(self.frame_format) != "none"
        try:
            coded = np.frombuffer(decompress_frame(where.codec, frame, where.nbytes), np.uint8)
        except (OSError, ValueError, pa.ArrowException) as e:  # pyarrow says "data corruption" as an OSError
            return self._fallback("frame_damaged", e)
        if coded.size != width * height * 3 or image_digest(coded) != where.digest:
            return self._fallback("frame_damaged", "digest differs from the pixel index")
        self.counts.frames_recompressed += recompressed
        return StoredImage(width, height, where.digest, coded=coded.reshape(height, width, 3))

    def _locate(self, source: PictureSource, width: int, height: int) -> _Where | None:
        where = self._where.get((source.content, source.decode, width, height))
        return where if where is not None else self._catalog_where(source, width, height)

    # -- catalogs -------------------------------------------------------------------------------
    def _catalog_rows(self, content: bytes, decode: str) -> "list[tuple[int, dict, CatalogView]]":
        """Every catalog's rows of a picture.  The last ``RECENT_PICTURES`` pictures' are kept: a
        stream asks for a picture's facts when it samples it, then for each of its targets when it
        plans its batch (the read-ahead) and again when it builds it, other pictures in between."""
        key = (content, decode)
        found = self._recent.get(key)
        if found is not None:
            self._recent.move_to_end(key)
            return found
        found = []
        for i, view in enumerate(self._catalogs):
            if view is None:
                continue
            rows, damaged = view.rows(content, decode)
            if damaged and not rows:
                self.counts.fallback("pixel_catalog_damaged")
            found.extend((i, row, view) for row in rows)
        self._recent[key] = found
        if len(self._recent) > RECENT_PICTURES:
            self._recent.popitem(last=False)
        return found

    def _catalog_where(self, source: PictureSource, width: int, height: int) -> _Where | None:
        for i, row, view in self._catalog_rows(source.content, source.decode):
            if row["width"] == width and row["height"] == height:
                key = (i, int(row["stream"]), int(row["shard"]))
                file = self._file_ids.get(key)
                if file is None:
                    file = self._file_ids[key] = len(self._files)
                    self._files.append(RangedFile(view.loc, shard_file(key[1], key[2]), int(row["shard_bytes"])))
                return _Where(file, int(row["offset"]), int(row["length"]), int(row["nbytes"]),
                              view.catalog.codecs[row["codec"]], int(row["digest"]), int(row["frame_digest"]))
        return None

    def _read(self, where: _Where) -> bytes:
        """A frame's bytes, keeping at most ``open_files`` shard files open."""
        self._open[where.file] = None
        self._open.move_to_end(where.file)
        while len(self._open) > self._open_files:
            oldest, _ = self._open.popitem(last=False)
            self._files[oldest].close()
        return self._files[where.file].read(where.offset, where.length)

    # -- loading --------------------------------------------------------------------------------
    def add_shard(self, loc: PackLocation, stream: int, shard: int, size: int, entries: list[PixelEntry]) -> None:
        """A committed shard's pictures (from the writer: no index file to read back); the frames
        held in memory since it was open are dropped (its file serves them now)."""
        self._written.clear()
        self._written_bytes = 0
        file = len(self._files)
        self._files.append(RangedFile(loc, shard_file(stream, shard), size))
        for e in entries:
            self._add(e.source.content, e.source.decode, e.source.facts, e.width, e.height,
                      _Where(file, e.offset, e.length, e.nbytes, e.codec, e.digest, e.frame_digest))

    def add_written(self, images: "list[tuple[PictureSource, StoredImage]]") -> None:
        """Frames this stream just wrote into the shard still open (in memory until it commits, the
        last ``written_limit`` bytes of them), so a later pass finds them before that shard is
        committed; ``add_shard`` of the shard then serves them from its file."""
        for source, image in images:
            key = (source.content, source.decode, image.width, image.height)
            if key in self._written or frame_codec(image.frame_format) == "none":
                continue  # (an uncompressed table is the packer's buffer, rewritten by the next batch)
            self._facts.setdefault(key[:2], source.facts)
            self._written[key] = image
            self._written_bytes += len(image.frame)
        while self._written_bytes > self.written_limit and self._written:
            self._written_bytes -= len(self._written.popitem(last=False)[1].frame)

    def add_stream(self, loc: PackLocation, index: StreamIndex) -> None:
        """Every committed shard of one stream that is there (not trimmed), read from its pixel index files."""
        trimmed = set(TrimmedShards.read(loc, index.stream).shards)
        self._add_shards(loc, index.stream, [CommittedShard.of(e) for e in index.shards if e.shard not in trimmed])

    def _add_shards(self, loc: PackLocation, stream: int, shards: "list[CommittedShard]") -> None:
        for entry in shards:
            try:
                table, resize = read_committed_pixel_index(loc, stream, entry.shard, entry.pixels_sha256)
            except FileNotFoundError:
                self.counts.fallback("pixel_index_missing")
                continue
            except OSError as e:
                self._fallback("pixel_index_unreadable", e)
                continue
            except ValueError as e:
                self._fallback("pixel_index_damaged", e)
                continue
            if resize != RESIZE_IMPL:
                self.counts.fallback("pixel_index_other_resize")
                continue
            self._add_table(loc, stream, entry.shard, entry.nbytes, table)

    def _add_table(self, loc: PackLocation, stream: int, shard: int, size: int, table: pa.Table) -> None:
        file = len(self._files)
        self._files.append(RangedFile(loc, shard_file(stream, shard), size))
        cols = {name: table.column(name).to_pylist() for name in table.schema.names}
        for i in range(table.num_rows):
            damage = tuple(k for k in cols["damage"][i].split(",") if k)
            facts = DecodeFacts(cols["src_width"][i], cols["src_height"][i], damage)
            self._add(cols["content"][i], cols["decode"][i], facts, cols["width"][i], cols["height"][i],
                      _Where(file, cols["offset"][i], cols["length"][i], cols["nbytes"][i], cols["codec"][i],
                             cols["digest"][i], cols["frame_digest"][i]))

    def _add(self, content: bytes, decode: str, facts: DecodeFacts, width: int, height: int, where: _Where) -> None:
        self._facts.setdefault((content, decode), facts)
        self._where.setdefault((content, decode, width, height), where)
        self.indexed += 1

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        for old in self.olds:
            snapshot = old if isinstance(old, OldPack) else read_old_pack(old)
            for reason, n in snapshot.fallbacks:  # what the driver's one reading of OLD met
                self.counts.fallbacks[reason] = self.counts.fallbacks.get(reason, 0) + n
            if not snapshot.readable:
                continue
            loc = resolve_location(snapshot.uri)
            view = None
            if snapshot.catalog is not None:  # as the driver read and checked it: nothing of it read again
                try:
                    view = CatalogView.of(loc, snapshot.catalog, snapshot.fences)
                except ValueError as e:
                    self._fallback("pixel_catalog_damaged", e)
            self._catalogs.append(view)
            for stream, shards in snapshot.uncovered:
                self._add_shards(loc, stream, list(shards))
            if view is not None:
                self.indexed += view.catalog.rows
        log.info("reuse: %d pictures indexed (%d in memory)", self.indexed, len(self._where))

    def close(self) -> None:
        for _, fut in self._pending.values():
            fut.cancel()
        self._pending.clear()
        self._ahead.close()
        for f in self._files:
            f.close()
        for view in self._catalogs:
            if view is not None:
                view.close()

    def _fallback(self, reason: str, detail) -> None:
        self.counts.fallback(reason)
        log.debug("reuse: %s (%s); decoding instead", reason, detail)
        return None


def _declared_damage(key: str) -> bool:
    try:
        Warn(key)
    except ValueError:
        return False
    return True


class FrameReadAhead:
    """The I/O threads that read earlier frames on a store ahead of their use (started at the first
    read; ``PREPACK_READ_AHEAD=0`` turns it off, ``PREPACK_IO_THREADS`` sets the threads, as for
    sources).  At most ``depth`` frames are read ahead (~300 KB each): a target whose sample never
    reaches a batch is dropped first."""

    def __init__(self, settings: "ReadAheadSettings | None" = None):
        self.settings = settings if settings is not None else ReadAheadSettings.from_env()
        self._pool: ThreadPoolExecutor | None = None

    @property
    def enabled(self) -> bool:
        return self.settings.depth > 0

    @property
    def depth(self) -> int:
        return max(1, min(4 * self.settings.depth, self.settings.max_bytes // (256 << 10)))

    def submit(self, fn, *args) -> Future:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.settings.threads, thread_name_prefix="prepack-frames")
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
