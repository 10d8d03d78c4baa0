"""A write-only local file that bypasses the page cache (``O_DIRECT``), for shard files.

Why: a packing worker writes each record once (~10-15 MB per NeMo-sized batch) and never reads it
back.  Through the page cache every record costs the kernel a copy into freshly allocated cache
pages, then background writeback; written direct it costs neither (measured: docs/performance.md,
"Earlier steps", "System time").  Records are staged in a page-aligned buffer and written in
aligned blocks; the final partial block is written padded and the file truncated to its true size,
so the bytes on disk are exactly what was written.

Where ``O_DIRECT`` is unavailable (another OS, tmpfs or a FUSE mount that refuses it at open or
at the first write) the same object writes through the page cache instead: same bytes, same
interface; ``PREPACK_DIRECT_IO=0`` in a worker's environment asks for that everywhere (e.g. on a
network filesystem where direct writes are slow).  Readers are unaffected (a reader on the same
host reads from disk, not from cache).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os

log = logging.getLogger(__name__)

DIRECT_IO_ENV = "PREPACK_DIRECT_IO"  # "0": write shards through the page cache
_BLOCK = 4096  # a multiple of every common logical block size (512, 4096)
_STAGING = 4 * 2**20  # staging buffer: a multiple of _BLOCK


def _round_up(n: int) -> int:
    return -(-n // _BLOCK) * _BLOCK


def staging_buffer() -> mmap.mmap:
    """A page-aligned staging buffer, as ``O_DIRECT`` requires.  A writer that writes one file after
    another passes the same one to each (``DirectFile(path, staging=...)``): a fresh 4 MiB buffer
    costs ~1,000 page faults as it is first filled (~2.7 ms of CPU measured here, per file)."""
    return mmap.mmap(-1, _STAGING)


class DirectFile:
    """``open(path, "wb")`` for large sequential writes, without the page cache where possible.

    ``write`` stages bytes; full staging buffers go to disk as they fill (``staging``: a buffer from
    ``staging_buffer()`` lent for this file's lifetime, e.g. the same one for every shard of a
    stream; what an earlier file left in it past this one's bytes only ever lands in the padding
    the truncation drops).  ``flush`` writes what is staged (the last block padded) and truncates
    the file to the bytes written so far; more writes may follow it.  ``close`` flushes.
    ``direct`` says whether ``O_DIRECT`` is in use.
    """

    def __init__(self, path: str, staging: "mmap.mmap | None" = None):
        if staging is not None and len(staging) != _STAGING:
            raise ValueError(f"a staging buffer is {_STAGING} bytes (staging_buffer()), got {len(staging)}")
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        o_direct = getattr(os, "O_DIRECT", 0) if os.environ.get(DIRECT_IO_ENV, "1") != "0" else 0
        self.direct = bool(o_direct)
        self._fd = -1
        if o_direct:
            try:
                self._fd = os.open(path, flags | o_direct, 0o644)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self.direct = False
        if self._fd < 0:
            self._fd = os.open(path, flags, 0o644)
        self._own = staging is None  # a buffer of its own is closed with the file; a lent one is not
        self._buf = staging_buffer() if staging is None else staging
        self._mv = memoryview(self._buf)
        self._offset = 0  # file offset of the staging buffer's first byte (block-aligned)
        self._fill = 0  # bytes staged
        self._dirty = False  # staged bytes not yet on disk
        self.closed = False

    # -- file-object interface used by the writers -----------------------------------------------
    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        n, pos = len(view), 0
        while pos < n:
            take = min(_STAGING - self._fill, n - pos)
            self._mv[self._fill : self._fill + take] = view[pos : pos + take]
            self._fill += take
            pos += take
            self._dirty = True
            if self._fill == _STAGING:
                self._pwrite(self._mv, self._offset)
                self._offset += _STAGING
                self._fill = 0
                self._dirty = False
        return n

    def tell(self) -> int:
        return self._offset + self._fill

    def flush(self) -> None:
        """Write the staged bytes (the last block padded), then truncate to the true size."""
        if not self._dirty:
            return
        end = _round_up(self._fill) if self.direct else self._fill
        self._pwrite(self._mv[:end], self._offset)
        if end != self._fill:  # drop the padding
            os.ftruncate(self._fd, self._offset + self._fill)
        self._dirty = False

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        if self.closed:
            return
        try:
            self.flush()
        finally:
            self.closed = True
            os.close(self._fd)
            self._mv.release()
            if self._own:
                self._buf.close()

    def __enter__(self) -> "DirectFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------------
    def _pwrite(self, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            try:
                n = os.pwrite(self._fd, view[done:], offset + done)
                if n <= 0:
                    raise OSError(errno.EIO, f"write returned {n} at offset {offset + done}")
                done += n
            except OSError as e:
                if e.errno != errno.EINVAL or not self.direct:
                    raise
                self._go_buffered()  # the filesystem took O_DIRECT at open but refuses the write

    def _go_buffered(self) -> None:
        import fcntl  # POSIX only, like O_DIRECT itself

        log.debug("O_DIRECT refused by this filesystem: writing through the page cache")
        flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
        fcntl.fcntl(self._fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
        self.direct = False
