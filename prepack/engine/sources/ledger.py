"""What a stream's sources read, shard by shard, and whether each is still what was read.

A trimmed shard is re-packed from its checkpoint by reading its sources again
(``prepack.run.bounded.trim``), so a trim is safe only while those sources are unchanged.  The sources
tell the ``SourceLedger`` on their ``StreamContext`` what they use, on the packing thread and at
the point they use it (a read-ahead's fetch counts where the source takes it, so an object read
ahead for the next shard belongs to that shard):

- ``note_bytes``: a whole file in hand (a JSONL file, an image or video object, a frame);
- ``note_file``: a local file handed to a decoder by its path (hashed here: images and videos are
  small, and the page cache still holds them);
- ``hold_row_group``: a parquet row group's column chunks and the footer they were found by (the
  bytes a restore reads, not the whole file: a stream reads a few row groups of a large file).  Its
  rows may be packed over several shards, and a restore from a checkpoint inside it reads it again
  at the source's first sample, so the source holds it until it moves on (``release``) and each
  shard in which it is asked for a sample meanwhile lists it (``touch``, at every sample);
- ``note_listing``: a directory's names in order (they order or slice the data).

What the sources read while they start (``with ledger.starting()``: listings, JSONL files,
``parquet_info``) a restore reads again for every shard, so every shard lists it.  ``take`` hands
the writer a committed shard's list (``schemas.sources``) and starts the next.  ``SourceCheck``
answers, for a recorded identity, why a restore could not read the same bytes now (or None): it
hashes the part read again, once per file for as long as it lives (the running job's trims, one
``prepack trim``): after that a file whose stat (a store: size and modification time) has not
moved since well before it was hashed is taken as the same.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Callable, Iterator

import xxhash

from prepack.engine.sources import files
from prepack.engine.sources.parquet import FOOTER_READ
from schemas.sources import FILE, LISTING, SourceIdentity

# a file whose stat moved later than this before it was hashed may have changed while it was hashed:
# it is hashed again at the next check rather than trusted by its stat (coarse file-system clocks)
SETTLE_NS = 60 * 10**9


def _digest(data) -> str:
    return xxhash.xxh3_128(data).hexdigest()


def _names_digest(names: "list[str]") -> str:
    return _digest("\0".join(names).encode("utf-8", "surrogateescape"))


def _read_range(path: str, offset: int, length: int) -> bytes:
    """``length`` bytes of ``path`` at ``offset`` (-1: to the end), local or on a store."""
    if not files.is_uri(path):
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read() if length < 0 else f.read(length)
    if length < 0:
        data = files.read_bytes(path)
        return data[offset:]
    client, key = files.objects_and_key(path)
    return bytes(client.get_range(key, offset, offset + length))


def _stat(path: str) -> "tuple[int, int, int] | None":
    """(size, mtime_ns, ctime_ns) of ``path`` (ctime -1 on a store); None when it is not there."""
    if not files.is_uri(path):
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        return st.st_size, st.st_mtime_ns, st.st_ctime_ns
    import pyarrow.fs as pafs  # noqa: PLC0415 (pyarrow is loaded by then; only a store's check stats)

    fs, key = files.fs_and_path(path)
    info = fs.get_file_info(key)
    if info.type == pafs.FileType.NotFound:
        return None
    mtime = info.mtime_ns if info.mtime_ns is not None else -1
    return int(info.size), int(mtime), -1


def _key(ident: SourceIdentity) -> tuple:
    return ident.kind, ident.path, ident.offset, ident.length


def _footer_range(path: str, size: int) -> tuple[int, int]:
    """Where a local parquet file's footer lies (its metadata, length and magic): (offset, length);
    the last 64 KiB if it does not end as a parquet file does."""
    if size >= 12:
        with open(path, "rb") as f:
            f.seek(size - 8)
            end = f.read(8)
        n = int.from_bytes(end[:4], "little")
        if end[4:] == b"PAR1" and 0 < n <= size - 12:
            return size - 8 - n, n + 8
    at = max(0, size - FOOTER_READ)
    return at, size - at


class NoLedger:
    """A stream nobody will trim (a plan, an audit, a restore): nothing noted, nothing hashed."""

    def starting(self) -> "contextlib.AbstractContextManager[None]":
        return contextlib.nullcontext()

    def note_bytes(self, path: str, data) -> None:
        pass

    def note_file(self, path: str) -> None:
        pass

    def note_listing(self, directory: str, names: "list[str]") -> None:
        pass

    def hold_row_group(self, holder: object, row_group) -> None:
        pass

    def touch(self, holder: object) -> None:
        pass

    def release(self, holder: object) -> None:
        pass


class SourceLedger:
    """The sources one stream read since its last committed shard (and while it started)."""

    def __init__(self):
        self._start: dict[tuple, SourceIdentity] = {}
        self._shard: dict[tuple, SourceIdentity] = {}
        self._starting = 0
        self._held: dict[int, list[SourceIdentity]] = {}  # id(source) -> the row group it is reading
        self._hashed: dict[tuple, str] = {}  # (path, offset, length, stat) -> digest: a file read by many shards

    @contextlib.contextmanager
    def starting(self) -> Iterator[None]:
        """Sources made inside read what every shard's restore reads again."""
        self._starting += 1
        try:
            yield
        finally:
            self._starting -= 1

    def _add(self, ident: SourceIdentity) -> SourceIdentity:
        (self._start if self._starting else self._shard)[_key(ident)] = ident
        return ident

    def note_bytes(self, path: str, data) -> None:
        """A whole file, its bytes in hand."""
        self._add(SourceIdentity(path, FILE, size=len(memoryview(data)), digest=_digest(data)))

    def note_file(self, path: str) -> None:
        """A local file a decoder reads by its path (hashed once per stat); on a store: by its bytes."""
        self._note_range(path, 0, -1)

    def note_listing(self, directory: str, names: "list[str]") -> None:
        self._add(SourceIdentity(directory, LISTING, size=len(names), digest=_names_digest(list(names))))

    def hold_row_group(self, holder: object, row_group) -> None:
        """A parquet row group ``holder`` (a source) just decoded (``prepack.engine.sources.parquet.RowGroup``):
        its column chunks' span, and the footer that located it (bytes already fetched are hashed as
        they are), listed again by each shard that asks ``holder`` for a sample (``touch``) until ``release(holder)``."""
        self._held[id(holder)] = [i for i in self._row_group(row_group) if i is not None]

    def release(self, holder: object) -> None:
        """``holder`` has moved past its row group: a restore from here on does not read it."""
        self._held.pop(id(holder), None)

    def _row_group(self, row_group) -> "list[SourceIdentity | None]":
        handle = row_group.handle
        tail = handle.tail
        if tail is not None:
            footer = self._add(SourceIdentity(handle.path, FILE, size=handle.size, digest=_digest(tail[1]),
                                              offset=tail[0], length=len(tail[1])))
        else:
            at, length = _footer_range(handle.path, handle.size)
            footer = self._note_range(handle.path, at, length)
        if row_group.fetched is not None:
            at, data = row_group.fetched
            return [footer, self._add(SourceIdentity(handle.path, FILE, size=handle.size, digest=_digest(data),
                                                     offset=at, length=len(data)))]
        span = row_group.chunk_span()
        return [footer, self._note_range(handle.path, span[0], span[1] - span[0]) if span is not None else None]

    def _note_range(self, path: str, offset: int, length: int) -> "SourceIdentity | None":
        st = _stat(path)
        if st is None:
            return None  # gone already: the read that follows fails and drops it, by the reference's rule
        key = (path, offset, length, st)
        digest = self._hashed.get(key)
        if digest is None:
            digest = self._hashed[key] = _digest(_read_range(path, offset, length))
        return self._add(SourceIdentity(path, FILE, size=st[0], offset=offset, length=length, digest=digest))

    def touch(self, holder: object) -> None:
        """``holder`` goes on from what it holds: a restore from any checkpoint since it was read reads
        it again here (its cursor lies inside it), so the shard being packed lists it."""
        for ident in self._held.get(id(holder), ()):
            self._add(ident)

    def take(self) -> list[SourceIdentity]:
        """The sources of the shard just committed (with the start's), sorted; the next shard begins."""
        out = {**self._start, **self._shard}
        self._shard = {}
        return [out[k] for k in sorted(out)]


class SourceCheck:
    """Whether recorded sources are still the bytes read.  Each part is hashed once per check's life,
    then trusted while its stat stays what it was, unmoved since well before that hash."""

    def __init__(self, clock: Callable[[], int] = time.time_ns):
        self._clock = clock
        self._hashed: dict[tuple, tuple[tuple[int, int, int], str, int]] = {}  # part -> (stat, digest, hashed at)

    def problem(self, ident: SourceIdentity) -> "str | None":
        """Why a restore would not read ``ident``'s bytes now (``"deleted"``, ``"size 10 -> 12 bytes"``,
        ``"content changed"``...), or None when it would."""
        try:
            return self._problem(ident)
        except OSError as e:
            return f"unreadable ({type(e).__name__}: {e})"

    def _problem(self, ident: SourceIdentity) -> "str | None":
        if ident.kind == LISTING:
            try:
                names = files.list_names(ident.path)
            except FileNotFoundError:
                return "deleted"
            if _names_digest(names) != ident.digest:
                return f"its entries changed ({ident.size} -> {len(names)} names)" if len(names) != ident.size \
                    else "its entries changed"
            return None
        st = _stat(ident.path)
        if st is None:
            return "deleted"
        if st[0] != ident.size:
            return f"size {ident.size} -> {st[0]} bytes"
        part = (ident.path, ident.offset, ident.length)
        known = self._hashed.get(part)
        if known is not None and known[0] == st and 0 <= st[1] and max(st[1], st[2]) < known[2] - SETTLE_NS:
            digest = known[1]  # untouched since well before this check hashed it
        else:
            now = self._clock()
            digest = _digest(_read_range(ident.path, ident.offset, ident.length))
            self._hashed[part] = (st, digest, now)
        return None if digest == ident.digest else "content changed"
