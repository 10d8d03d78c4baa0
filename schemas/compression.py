"""Record compression: the one parser of ``prepack.compression`` (config load and writer agree).

What is compressed, and why there: nearly all of a record is its pixel table (~22 MB of uint8
pixels per NeMo-sized batch against ~0.7 MB of token arrays), so the record encoder compresses that
one buffer itself (``schemas.record``) and Arrow IPC stores every buffer as is.  Doing it ourselves
lets zstd level 1 run with a small match-finder hash table (``hash_log`` 8 instead of 13): on
row-delta coded photographs it finds almost nothing with the big table anyway, and the small one
makes compression much faster for a few more bytes (measured: docs/performance.md, "Earlier steps",
"Compression").  Arrow's IPC codec exposes only the level.  Any zstd or lz4 frame decompresses with
pyarrow's own codecs, so the loader needs nothing beyond pyarrow.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

# zstd level 1 on the pixel table: a 256-entry match-finder table (see module doc).
FAST_ZSTD_HASH_LOG = 8

_local = threading.local()  # zstd compressors are not thread-safe: one per thread and level


def _zstd_compressor(level: int):
    import zstandard  # writer side only: the loader decompresses with pyarrow

    cache = getattr(_local, "zstd", None)
    if cache is None:
        cache = _local.zstd = {}
    if level not in cache:
        params = (zstandard.ZstdCompressionParameters.from_level(1, hash_log=FAST_ZSTD_HASH_LOG) if level == 1
                  else zstandard.ZstdCompressionParameters.from_level(level))
        cache[level] = zstandard.ZstdCompressor(compression_params=params)
    return cache[level]


@dataclass(frozen=True)
class Compression:
    """A validated compression spec: ``"none"``, ``"zstd:LEVEL"`` or ``"lz4"``.

    zstd:1 (the default) stores photos at ~58% of their size; lz4 stores ~88% but decompresses
    faster, for readers that are short of CPU.
    """

    codec: str | None
    level: int | None

    @classmethod
    def parse(cls, spec: str) -> "Compression":
        if spec == "none":
            return cls(None, None)
        if spec == "lz4":
            return cls("lz4", None)
        m = re.fullmatch(r"zstd:(-?\d+)", spec or "")
        if not m:
            raise ValueError(f"compression must be 'none', 'lz4' or 'zstd:LEVEL' (e.g. 'zstd:1'), got {spec!r}")
        level = int(m.group(1))
        lo, hi = pa.Codec.minimum_compression_level("zstd"), pa.Codec.maximum_compression_level("zstd")
        if not lo <= level <= hi or level == 0:
            raise ValueError(f"zstd level must be a non-zero integer in [{lo}, {hi}], got {level} in {spec!r}")
        return cls("zstd", level)

    @property
    def frame_format(self) -> str:
        """What a frame of this compression is, exactly enough that equal pixels give equal frames:
        the codec, the library that wrote it and its parameters (``"zstd/libzstd-1.5.7/level-1/
        hash_log-8"``).  A later pack whose writer has the same ``frame_format`` passes an earlier
        frame through untouched instead of decompressing and compressing it again: same bytes,
        since both compressions are deterministic.  ``frame_codec`` reads the codec back."""
        if self.codec is None:
            return "none"
        if self.codec == "lz4":
            return f"lz4/pyarrow-{pa.__version__}"
        import zstandard  # writer side only

        library = ".".join(str(v) for v in zstandard.ZSTD_VERSION)
        tail = f"/hash_log-{FAST_ZSTD_HASH_LOG}" if self.level == 1 else ""
        return f"zstd/libzstd-{library}/level-{self.level}{tail}"

    def write_options(self) -> pa.ipc.IpcWriteOptions:
        """IPC options: buffers stored as they are (the pixel table arrives compressed, see
        ``compress``), written on the calling thread."""
        return pa.ipc.IpcWriteOptions(compression=None, use_threads=False)

    def compress(self, data: np.ndarray) -> tuple[str, "np.ndarray | bytes | pa.Buffer"]:
        """``(codec name, stored bytes)`` for a contiguous uint8 buffer; ``decompress`` inverts it."""
        if self.codec is None:
            return "none", data
        if self.codec == "lz4":
            return "lz4", pa.Codec("lz4").compress(data)
        return "zstd", _zstd_compressor(self.level).compress(data)

    def compress_frames(self, data: np.ndarray, offsets: np.ndarray,
                        given: "list[bytes | None] | None" = None) -> tuple[str, "np.ndarray | bytes", np.ndarray]:
        """``(codec, stored bytes, frame offsets)``: each ``data[offsets[i]:offsets[i+1]]`` compressed
        as a frame of its own, the frames concatenated (frame i is ``stored[frames[i]:frames[i+1]]``).
        ``given[i]``, when not None, is frame i already made by a compression of this
        ``frame_format`` (an earlier pack's, passed through): used as is, ``data``'s slice unread.

        Why frames: a later pack reuses one picture by reading its frame alone (``decompress_frame``),
        never the whole record; a picture is hundreds of KB, so the frames cost ~0.1% in size.  zstd
        decompresses concatenated frames in one call, so a whole-table read stays one call too."""
        offsets = np.asarray(offsets, np.int64)
        given = given if given is not None else [None] * (len(offsets) - 1)
        if self.codec is None:
            if any(g is not None for g in given):  # the frames are the coded bytes themselves
                data = np.array(data, np.uint8)
                for a, b, g in zip(offsets[:-1].tolist(), offsets[1:].tolist(), given):
                    if g is not None:
                        data[a:b] = np.frombuffer(g, np.uint8)
            return "none", data, offsets.copy()
        bounds = list(zip(offsets[:-1].tolist(), offsets[1:].tolist()))
        made = iter(self._compress_each(data, [ab for ab, g in zip(bounds, given) if g is None]))
        parts = [g if g is not None else next(made) for g in given]
        frames = np.zeros(len(parts) + 1, np.int64)
        np.cumsum([memoryview(p).nbytes for p in parts], out=frames[1:])
        return self.codec, b"".join(memoryview(p) for p in parts), frames


    def _compress_each(self, data: np.ndarray, bounds: "list[tuple[int, int]]") -> list:
        """``compress(data[a:b])`` for each ``(a, b)``.  zstd compresses them in one call
        (``multi_compress_to_buffer`` over the table's own memory): the same frames, byte for byte,
        without a compression context set up and an input copied per picture (~1.5-2x less CPU
        than a call per frame on this project's tables)."""
        if self.codec != "zstd" or len(bounds) < 2 or any(b <= a for a, b in bounds):
            return [self.compress(data[a:b])[1] for a, b in bounds]
        import zstandard

        segments = np.asarray([(a, b - a) for a, b in bounds], dtype="<u8")
        frames = _zstd_compressor(self.level).multi_compress_to_buffer(
            zstandard.BufferWithSegments(np.ascontiguousarray(data), segments.tobytes()), threads=0)
        return [frames[i] for i in range(len(frames))]


def frame_codec(frame_format: str) -> str:
    """The codec (``none``, ``zstd``, ``lz4``) of a ``Compression.frame_format``: all a reader
    needs to decompress the frame."""
    return frame_format.split("/", 1)[0]


def decompress(codec: str, stored: pa.Buffer, nbytes: int) -> pa.Buffer:
    """The ``nbytes`` bytes that ``Compression.compress`` stored under ``codec``."""
    if codec == "none":
        out = stored
    elif codec in ("zstd", "lz4"):
        out = pa.Codec(codec).decompress(stored, decompressed_size=nbytes)
    else:
        raise ValueError(f"unknown pixel codec {codec!r}")
    if out.size != nbytes:
        raise ValueError(f"pixel table is {out.size} bytes after {codec}, the image offsets say {nbytes}")
    return out


def decompress_frames(codec: str, stored: pa.Buffer, frames: np.ndarray, offsets: np.ndarray) -> "pa.Buffer | np.ndarray":
    """The table that ``Compression.compress_frames`` stored: one call for zstd (it reads
    concatenated frames), frame by frame for lz4 (pyarrow's lz4 reads one frame per call)."""
    nbytes = int(offsets[-1]) if len(offsets) else 0
    if codec != "lz4" or len(frames) <= 2:
        return decompress(codec, stored, nbytes)
    out = np.empty(nbytes, np.uint8)
    for i in range(len(frames) - 1):
        a, b = int(offsets[i]), int(offsets[i + 1])
        part = decompress(codec, stored.slice(int(frames[i]), int(frames[i + 1] - frames[i])), b - a)
        out[a:b] = np.frombuffer(part, np.uint8)
    return out


def decompress_frame(frame_format: str, frame: "bytes | pa.Buffer", nbytes: int) -> pa.Buffer:
    """One picture's frame (see ``Compression.compress_frames``) -> its ``nbytes`` bytes."""
    return decompress(frame_codec(frame_format), frame if isinstance(frame, pa.Buffer) else pa.py_buffer(frame), nbytes)
