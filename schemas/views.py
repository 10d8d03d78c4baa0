"""Read-only, seekable file objects over bytes fetched from a store, for pyarrow's ``PythonFile``.

Both sides read remote files through one: the packer a parquet file from the spans it fetched
(``prepack.engine.sources.parquet``), the loader a shard through blocks
(``loader.reader``).  Subclasses say what ``read`` returns; position and size live here.
"""

from __future__ import annotations

import io


class SeekableView(io.RawIOBase):
    """A file of ``size`` bytes whose reads a subclass serves (``read(n)`` from ``self._pos``)."""

    def __init__(self, size: int):
        super().__init__()
        self._size = size
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def _span(self, n: "int | None") -> tuple[int, int]:
        """(start, end) of a read of ``n`` bytes (all to the end if None or negative); moves past it."""
        start = self._pos
        end = self._size if n is None or n < 0 else min(self._size, start + n)
        self._pos = max(start, end)
        return start, end

    def readall(self):
        return self.read(-1)
