"""A source's parquet file, local or on a store, read one row group at a time.

Locally this is ``pq.ParquetFile(path)`` and its ``read_row_group``, the calls the reference
makes.  On a store, reading a parquet file through a filesystem costs a request per column chunk
after a HEAD and a footer read; here the file is opened with one request (the object's last
64 KiB, which give its size and, nearly always, the whole footer) and each row group is one
ranged GET of the span of the column chunks asked for.  pyarrow then decodes those same bytes
from memory (``_Spans``), so the tables are the same; a read outside the spans fetched (a footer
over 64 KiB, a reader that looks past a chunk) is fetched directly, so nothing depends on the
spans being right.  Handles are read-only and may be read from several threads at once.
"""

from __future__ import annotations

import collections
import os
import threading
from typing import Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from prepack.engine.sources import files
from schemas.views import SeekableView

FOOTER_READ = 64 << 10  # what pyarrow reads first for a footer, too


class _Spans(SeekableView):
    """A read-only seekable view of one object: bytes fetched earlier serve reads inside them."""

    def __init__(self, objects, key: str, size: int, spans: dict[int, bytes]):
        super().__init__(size)
        self._objects = objects
        self._key = key
        self._spans = sorted(spans.items())

    def read(self, n: int = -1) -> bytes:
        start, end = self._span(n)
        if end <= start:
            return b""
        for at, data in self._spans:
            if at <= start and end <= at + len(data):
                return memoryview(data)[start - at:end - at]  # pyarrow takes any buffer: no copy
        return self._objects.get_range(self._key, start, end)


def _chunk_span(metadata: pq.FileMetaData, rg: int, columns: Sequence[str]) -> "tuple[int, int] | None":
    """Byte range of row group ``rg``'s column chunks of the top-level ``columns`` (None if none)."""
    group = metadata.row_group(rg)
    starts, ends = [], []
    for i in range(group.num_columns):
        chunk = group.column(i)
        if chunk.path_in_schema.split(".", 1)[0] not in columns:
            continue
        start = chunk.data_page_offset
        if chunk.has_dictionary_page and chunk.dictionary_page_offset is not None and chunk.dictionary_page_offset > 0:
            start = min(start, chunk.dictionary_page_offset)
        starts.append(start)
        ends.append(start + chunk.total_compressed_size)
    return (min(starts), max(ends)) if starts else None


class ParquetHandle:
    """One open parquet file: its footer, its column names, and its row groups on demand."""

    def __init__(self, path: str):
        self.path = path
        if files.is_uri(path):
            self._objects, self._key = files.objects_and_key(path)
            tail, self._size = self._objects.tail(self._key, FOOTER_READ)
            self._tail = (self._size - len(tail), tail)
            self._local = None
            footer = pq.ParquetFile(pa.PythonFile(self._view(), mode="r"))
            self.metadata = footer.metadata
            self.schema = footer.schema_arrow
        else:
            self._local = pq.ParquetFile(path)
            self.metadata = self._local.metadata
            self.schema = self._local.schema_arrow
        self.names = set(self.schema.names)
        self.num_row_groups = self.metadata.num_row_groups

    @property
    def size(self) -> int:
        """The file's size in bytes."""
        return self._size if self._local is None else os.path.getsize(self.path)

    @property
    def tail(self) -> "tuple[int, bytes] | None":
        """On a store, the file's last bytes as fetched to open it (its footer): (offset, bytes)."""
        return None if self._local is not None else self._tail

    def _view(self, *extra: tuple[int, bytes]) -> _Spans:
        return _Spans(self._objects, self._key, self._size, dict([self._tail, *extra]))

    def row_group_bytes(self, rg: int) -> int:
        """What reading row group ``rg`` holds in memory, as the footer gives it."""
        return self.metadata.row_group(rg).total_byte_size

    def fetch_row_group(self, rg: int, columns: Sequence[str]) -> "RowGroup":
        """What decoding row group ``rg``'s ``columns`` needs: on a store, the bytes of its column
        chunks (one ranged GET); locally nothing yet (the file is read where it is decoded)."""
        columns = [c for c in columns if c in self.names]
        if self._local is not None:
            return RowGroup(self, rg, columns, None)
        span = _chunk_span(self.metadata, rg, columns)
        return RowGroup(self, rg, columns, None if span is None else (span[0], self._objects.get_range(self._key, *span)))

    def read_row_group(self, rg: int, columns: Sequence[str]) -> pa.Table:
        """Row group ``rg``'s ``columns`` (those the file has), on one thread."""
        return self.fetch_row_group(rg, columns).table()

    def _decode(self, rg: int, columns: list[str], span: "tuple[int, bytes] | None") -> pa.Table:
        if self._local is not None:
            return self._local.read_row_group(rg, columns=columns, use_threads=False)  # a thread pool costs ~2x the CPU here
        reader = pq.ParquetFile(pa.PythonFile(self._view(*([span] if span else [])), mode="r"), metadata=self.metadata)
        return reader.read_row_group(rg, columns=columns, use_threads=False)


class RowGroup:
    """A fetched row group: ``table()`` decodes it (each call anew); ``nbytes`` is what it holds."""

    def __init__(self, handle: ParquetHandle, rg: int, columns: list[str], span: "tuple[int, bytes] | None"):
        self.handle = handle
        self.rg = rg
        self.columns = columns
        self._span = span
        self.nbytes = len(span[1]) if span else 0

    def table(self) -> pa.Table:
        return self.handle._decode(self.rg, self.columns, self._span)

    @property
    def fetched(self) -> "tuple[int, bytes] | None":
        """On a store, the column chunks' bytes as fetched: (offset, bytes)."""
        return self._span

    def chunk_span(self) -> "tuple[int, int] | None":
        """The byte range decoding reads: the column chunks of ``columns``."""
        return _chunk_span(self.handle.metadata, self.rg, self.columns)


def open_parquet(path: str) -> ParquetHandle:
    return ParquetHandle(path)


class RecentHandles:
    """The last ``size`` files opened, so a read-ahead reading row groups of one file in turn reads
    its footer once (the reference opens the file per row group: same bytes, one request fewer).

    Thread-safe; a file that fails to open is not remembered, so each of its row groups fails at
    its own read, as it would without the cache.
    """

    def __init__(self, size: int = 16):
        self._size = size
        self._lock = threading.Lock()
        self._handles: collections.OrderedDict[str, ParquetHandle] = collections.OrderedDict()

    def open(self, path: str) -> ParquetHandle:
        with self._lock:
            handle = self._handles.get(path)
            if handle is not None:
                self._handles.move_to_end(path)
                return handle
        handle = open_parquet(path)  # outside the lock: two threads may both open one file, harmlessly
        with self._lock:
            self._handles[path] = handle
            while len(self._handles) > self._size:
                self._handles.popitem(last=False)
        return handle
