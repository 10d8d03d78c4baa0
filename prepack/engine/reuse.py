"""Earlier pixels: pictures already decoded and resized by another pack, or by this stream's own
earlier shards, found by content and checked before use.

The rule (docs/architecture.md, "Reuse"): a picture's resized pixels are a function of its encoded
bytes, how they are decoded and the resize target, for one resize implementation.  So an image is
taken from an earlier shard when its ``(content, decode, width, height)`` is in that shard's pixel
index (``schemas.pixel_index``) and the index names the same resize implementation; its frame is
read alone (one ranged read), decompressed and its XXH3-64 compared with the index before a byte is
used.  A picture whose decode facts are known is not decoded at all (``prepack.engine.pictures``).
Anything that does not hold — an index missing, damaged or of another resize, a shard file gone,
short or changed, a frame that fails its digest — means decode and resize as usual, counted by
reason: never a wrong byte, never a failed run.

Only committed shards are read (the ones a stream's ``index.arrow`` lists), so an earlier pack may
still be packing.  Memory: the index rows of every committed shard of the earlier packs, ~150
bytes a picture (10^6 pictures: ~150 MB) — loaded once per stream at its first picture.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from typing import Iterable

import numpy as np
import pyarrow as pa

from prepack.engine.pictures import RESIZE_IMPL, ReuseCounts
from schemas.compression import decompress_frame
from schemas.location import PackLocation, resolve_location
from schemas.errors import DamagedFile, PackFormatError
from schemas.manifest import (PACK_INFO_NAME, StreamIndex, check_format, index_file, load_checked, shard_file,
                              shard_pixels_file)
from schemas.pixel_index import DecodeFacts, PictureSource, PixelEntry, pixel_digest, read_pixel_index

log = logging.getLogger(__name__)

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
    codec: str
    digest: int


class _ShardFile:
    """One earlier shard file, opened at its first read (ranged reads only)."""

    def __init__(self, loc: PackLocation, relpath: str, size: int):
        self.loc, self.relpath, self.size = loc, relpath, size
        self._fd: int | None = None
        self._remote = None

    def read(self, offset: int, length: int) -> bytes:
        if offset < 0 or offset + length > self.size:
            raise ValueError(f"frame {offset}+{length} outside the {self.size}-byte shard")
        if self.loc.is_local:
            if self._fd is None:
                self._fd = os.open(self.loc.path(self.relpath), os.O_RDONLY)
                if os.fstat(self._fd).st_size != self.size:
                    raise ValueError("shard file is not the size its index recorded")
            data = os.pread(self._fd, length, offset)
        else:
            if self._remote is None:
                self._remote = self.loc.fs.open_input_file(self.loc.path(self.relpath))
            data = self._remote.read_at(length, offset)
        if len(data) != length:
            raise ValueError("short read")
        return bytes(data)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._remote is not None:
            self._remote.close()
            self._remote = None


def open_old_pack(old: str) -> tuple[PackLocation, int]:
    """``(location, number of streams)`` of an earlier pack; ``NotAPack``-like errors name it."""
    loc = resolve_location(old)
    try:
        raw = loc.read_bytes(PACK_INFO_NAME)
    except FileNotFoundError:
        raise ValueError(f"{loc.path('')} is not a pack (no {PACK_INFO_NAME})") from None
    identity = check_format(load_checked(raw, loc.path(PACK_INFO_NAME)), loc.path(PACK_INFO_NAME))
    return loc, int(identity["num_streams"])


class PixelReuse:
    """A stream's view of earlier pixels: ``facts`` and ``fetch`` for ``PictureStore``.

    ``olds``: earlier packs (paths or URIs), loaded at the first lookup.  ``add_shard`` adds one
    of this stream's own shards once it is committed (reuse within one pack).  ``counts`` is the
    stream's ``ReuseCounts`` (fallbacks are counted there by reason).
    """

    def __init__(self, olds: Iterable[str] = (), counts: ReuseCounts | None = None):
        self.olds = [str(o) for o in olds]
        self.counts = counts if counts is not None else ReuseCounts()
        self._facts: dict[tuple[bytes, str], DecodeFacts] = {}
        self._where: dict[tuple[bytes, str, int, int], _Where] = {}
        self._files: list[_ShardFile] = []
        self._loaded = not self.olds
        self.indexed = 0  # pictures the loaded indexes list

    # -- PixelProvider --------------------------------------------------------------------------
    def facts(self, key: tuple[bytes, str]) -> DecodeFacts | None:
        self._load()
        return self._facts.get(key)

    def fetch(self, source: PictureSource, width: int, height: int) -> np.ndarray | None:
        self._load()
        where = self._where.get((source.content, source.decode, width, height))
        if where is None:
            return None
        try:
            frame = self._files[where.file].read(where.offset, where.length)
        except (OSError, ValueError, pa.ArrowException) as e:
            return self._fallback("shard_unreadable", e)
        try:
            coded = np.frombuffer(decompress_frame(where.codec, frame, where.nbytes), np.uint8)
        except (OSError, ValueError, pa.ArrowException) as e:  # pyarrow says "data corruption" as an OSError
            return self._fallback("frame_damaged", e)
        if coded.size != width * height * 3 or pixel_digest(coded) != where.digest:
            return self._fallback("frame_damaged", "digest differs from the pixel index")
        return coded.reshape(height, width, 3)  # as stored: the new table takes them coded

    # -- loading --------------------------------------------------------------------------------
    def add_shard(self, loc: PackLocation, stream: int, shard: int, size: int, entries: list[PixelEntry]) -> None:
        """A committed shard's pictures (from the writer: no index file to read back)."""
        file = len(self._files)
        self._files.append(_ShardFile(loc, shard_file(stream, shard), size))
        for e in entries:
            self._add(e.source.content, e.source.decode, e.source.facts, e.width, e.height,
                      _Where(file, e.offset, e.length, e.nbytes, e.codec, e.digest))

    def add_stream(self, loc: PackLocation, index: StreamIndex) -> None:
        """Every committed shard of one stream, read from its pixel index files."""
        for entry in index.shards:
            rel = shard_pixels_file(index.stream, entry.shard)
            try:
                data = loc.read_bytes(rel)
            except FileNotFoundError:
                self.counts.fallback("pixel_index_missing")
                continue
            except OSError as e:
                self._fallback("pixel_index_unreadable", e)
                continue
            try:
                if hashlib.sha256(data).hexdigest() != entry.pixels_sha256:
                    raise ValueError(f"{loc.path(rel)}: sha256 differs from the stream index")
                table, resize = read_pixel_index(data, loc.path(rel))
            except ValueError as e:
                self._fallback("pixel_index_damaged", e)
                continue
            if resize != RESIZE_IMPL:
                self.counts.fallback("pixel_index_other_resize")
                continue
            self._add_table(loc, index.stream, entry.shard, entry.nbytes, table)

    def _add_table(self, loc: PackLocation, stream: int, shard: int, size: int, table: pa.Table) -> None:
        file = len(self._files)
        self._files.append(_ShardFile(loc, shard_file(stream, shard), size))
        cols = {name: table.column(name).to_pylist() for name in table.schema.names}
        for i in range(table.num_rows):
            damage = tuple(k for k in cols["damage"][i].split(",") if k)
            facts = DecodeFacts(cols["src_width"][i], cols["src_height"][i], damage)
            self._add(cols["content"][i], cols["decode"][i], facts, cols["width"][i], cols["height"][i],
                      _Where(file, cols["offset"][i], cols["length"][i], cols["nbytes"][i], cols["codec"][i],
                             cols["digest"][i]))

    def _add(self, content: bytes, decode: str, facts: DecodeFacts, width: int, height: int, where: _Where) -> None:
        self._facts.setdefault((content, decode), facts)
        self._where.setdefault((content, decode, width, height), where)
        self.indexed += 1

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        for old in self.olds:
            try:
                loc, streams = open_old_pack(old)
            except (OSError, ValueError, DamagedFile, PackFormatError) as e:
                log.warning("reuse: %s is not read (%s); its pictures are decoded", old, e)
                self.counts.fallback("old_pack_unreadable")
                continue
            for stream in range(streams):
                try:
                    data = loc.read_bytes(index_file(stream))
                except FileNotFoundError:
                    continue  # nothing committed yet
                except OSError as e:
                    self._fallback("stream_index_unreadable", e)
                    continue
                try:
                    index = StreamIndex.from_bytes(data, stream, loc.path(index_file(stream)))
                except (DamagedFile, PackFormatError, ValueError) as e:
                    self._fallback("stream_index_damaged", e)
                    continue
                self.add_stream(loc, index)
        log.info("reuse: %d pictures indexed in %d earlier shards", self.indexed, len(self._files))

    def close(self) -> None:
        for f in self._files:
            f.close()

    def _fallback(self, reason: str, detail) -> None:
        self.counts.fallback(reason)
        log.debug("reuse: %s (%s); decoding instead", reason, detail)
        return None
