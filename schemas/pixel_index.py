"""The pixel index of a shard: which pictures the shard holds, and where each one's frame lies.

Why it exists: a picture's resized pixels depend only on its encoded bytes, how they were decoded
and the resize target.  A later pack (``prepack run --reuse OLD``), or a later pass of the same
stream, can copy them instead of decoding and resizing again.  It needs to find a picture by
content and read it alone, so each committed shard has ``shard-NNNNN.pixels.arrow`` beside it:
one row per stored image, keyed by

- ``content``: XXH3-128 of the picture's encoded bytes as read from the source (never its path),
- ``decode``: how those bytes became RGB (``rgb``: transparency composited on white, as the
  reference's ``pil_img2rgb``; ``plain``: ``convert("RGB")``, as its frame folders),
- ``width``, ``height``: the resize target (the stored image's size),

and the resize's implementation for the whole file (``prepack.resize`` in the schema metadata:
the Pillow release and filter), with the decode's policy-free observations (the source size, and
the damage the decode saw: ``truncated_image``, ``high_bit_depth_image_saturated`` ...) so the
reader applies its own policy and counts the same warnings and drops as a fresh decode.

Where: ``offset``/``length`` locate the image's compressed frame in the shard file (absolute byte
offsets; ``codec`` is the frame's exact format, ``schemas.compression.Compression.frame_format``:
codec, library version, parameters), ``nbytes`` is its row-delta coded size, ``digest`` the
XXH3-64 of those coded bytes and ``frame_digest`` the XXH3-64 of the frame as stored.  A reader
checks one of the two before any reused byte is used: the frame's when it passes the frame through
untouched (its writer makes frames of the same format), the pixels' when it decompresses.  The file carries a seal
(XXH3-128 over its columns) so a damaged index is refused whole instead of pointing a key at
another picture.  The index is only read for shards the stream index lists (committed).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import xxhash

from schemas.layout import shard_pixels_file

if TYPE_CHECKING:
    from schemas.location import PackLocation

PIXEL_INDEX_VERSION = 2  # 2: frame formats in ``codec``, ``frame_digest``
SEAL_KEY = b"prepack.pixels_seal"
RESIZE_KEY = b"prepack.resize"
VERSION_KEY = b"prepack.pixel_index_version"

PIXEL_INDEX_SCHEMA = pa.schema([
    pa.field("content", pa.binary(16), nullable=False),
    pa.field("decode", pa.string(), nullable=False),
    pa.field("width", pa.int32(), nullable=False),
    pa.field("height", pa.int32(), nullable=False),
    pa.field("src_width", pa.int32(), nullable=False),
    pa.field("src_height", pa.int32(), nullable=False),
    pa.field("damage", pa.string(), nullable=False),  # comma-separated observations ("" when clean)
    pa.field("record", pa.int32(), nullable=False),  # within the shard
    pa.field("image", pa.int32(), nullable=False),  # within the record's image table
    pa.field("offset", pa.int64(), nullable=False),
    pa.field("length", pa.int64(), nullable=False),
    pa.field("nbytes", pa.int64(), nullable=False),
    pa.field("codec", pa.string(), nullable=False),  # the frame's format (see module doc)
    pa.field("digest", pa.uint64(), nullable=False),
    pa.field("frame_digest", pa.uint64(), nullable=False),
])


@dataclass(frozen=True)
class DecodeFacts:
    """What decoding a picture's bytes showed, before any policy: its size and its damage."""

    width: int
    height: int
    damage: tuple[str, ...] = ()


@dataclass(frozen=True)
class PictureSource:
    """A picture's identity for reuse: the content of its encoded bytes and how they are decoded."""

    content: bytes  # XXH3-128 digest, 16 bytes
    decode: str  # "rgb" | "plain"
    facts: DecodeFacts

    @property
    def key(self) -> tuple[bytes, str]:
        return self.content, self.decode


@dataclass(frozen=True)
class PixelEntry:
    """One row of a pixel index, as the writer makes it (``file`` is implied: the shard's)."""

    source: PictureSource
    width: int
    height: int
    record: int
    image: int
    offset: int
    length: int
    nbytes: int
    codec: str  # frame format
    digest: int
    frame_digest: int


def content_key(data: "bytes | memoryview") -> bytes:
    """The content part of a picture's key: XXH3-128 of its encoded bytes (~30 GB/s)."""
    return xxhash.xxh3_128_digest(data)


def frame_digest(frame: "bytes | memoryview") -> int:
    """XXH3-64 of a frame as stored (checked before it is passed through undecompressed)."""
    return xxhash.xxh3_64_intdigest(frame)


def _seal(table: pa.Table) -> str:
    """XXH3-128 over the columns' logical values (not their buffers, whose padding may differ)."""
    h = xxhash.xxh3_128()
    for field_ in PIXEL_INDEX_SCHEMA:
        column = table.column(field_.name)
        h.update(field_.name.encode())
        h.update(len(column).to_bytes(8, "little"))
        if pa.types.is_integer(field_.type):
            h.update(np.ascontiguousarray(column.to_numpy(), dtype=field_.type.to_pandas_dtype()).data)
        else:
            h.update(_length_prefixed(column))
    return h.hexdigest()


def _length_prefixed(column: "pa.ChunkedArray | pa.Array") -> bytes:
    """Each value's UTF-8/binary bytes after its length (4 bytes, little-endian), concatenated:
    what hashing the values one by one in that form feeds the hash, built in one pass."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    n = len(column)
    if pa.types.is_fixed_size_binary(column.type):
        width = column.type.byte_width
        lengths = np.full(n, width, np.int64)
        data = np.frombuffer(column.buffers()[1], np.uint8, count=n * width, offset=column.offset * width)
    else:
        offsets = np.frombuffer(column.buffers()[1], np.int32, count=n + 1, offset=column.offset * 4).astype(np.int64)
        lengths = np.diff(offsets)
        data = np.frombuffer(column.buffers()[2], np.uint8, count=int(offsets[-1] - offsets[0]), offset=int(offsets[0]))
    out = np.empty(4 * n + len(data), np.uint8)
    starts = 4 * np.arange(n) + np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
    prefix = lengths.astype("<u4").view(np.uint8).reshape(n, 4)
    for j in range(4):
        out[starts + j] = prefix[:, j]
    out[np.arange(len(data)) + 4 * (np.repeat(np.arange(n), lengths) + 1)] = data
    return out.tobytes()


def pixel_index_table(entries: list[PixelEntry], resize: str) -> pa.Table:
    """The sealed index of one shard's images."""
    cols = {
        "content": pa.array([e.source.content for e in entries], pa.binary(16)),
        "decode": pa.array([e.source.decode for e in entries], pa.string()),
        "width": pa.array([e.width for e in entries], pa.int32()),
        "height": pa.array([e.height for e in entries], pa.int32()),
        "src_width": pa.array([e.source.facts.width for e in entries], pa.int32()),
        "src_height": pa.array([e.source.facts.height for e in entries], pa.int32()),
        "damage": pa.array([",".join(e.source.facts.damage) for e in entries], pa.string()),
        "record": pa.array([e.record for e in entries], pa.int32()),
        "image": pa.array([e.image for e in entries], pa.int32()),
        "offset": pa.array([e.offset for e in entries], pa.int64()),
        "length": pa.array([e.length for e in entries], pa.int64()),
        "nbytes": pa.array([e.nbytes for e in entries], pa.int64()),
        "codec": pa.array([e.codec for e in entries], pa.string()),
        "digest": pa.array([e.digest for e in entries], pa.uint64()),
        "frame_digest": pa.array([e.frame_digest for e in entries], pa.uint64()),
    }
    table = pa.Table.from_pydict(cols, schema=PIXEL_INDEX_SCHEMA).combine_chunks()
    meta = {VERSION_KEY: str(PIXEL_INDEX_VERSION).encode(), RESIZE_KEY: resize.encode(),
            SEAL_KEY: _seal(table).encode()}
    return table.replace_schema_metadata(meta)


def pixel_index_bytes(entries: list[PixelEntry], resize: str) -> bytes:
    """The file bytes of one shard's pixel index (Arrow IPC file, deterministic)."""
    table = pixel_index_table(entries, resize)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def read_pixel_index(data: bytes, where: str) -> tuple[pa.Table, str]:
    """``(table, resize implementation)`` of a pixel index file; ``ValueError`` naming ``where``
    when it is not one this code wrote or its seal does not hold."""
    try:
        table = pa.ipc.open_file(pa.py_buffer(data)).read_all().combine_chunks()
    except (pa.ArrowInvalid, OSError) as e:
        raise ValueError(f"{where}: not a pixel index ({e})") from None
    meta = table.schema.metadata or {}
    if meta.get(VERSION_KEY) != str(PIXEL_INDEX_VERSION).encode():
        raise ValueError(f"{where}: pixel index version {meta.get(VERSION_KEY)!r}, this code reads {PIXEL_INDEX_VERSION}")
    if not table.schema.remove_metadata().equals(PIXEL_INDEX_SCHEMA):
        raise ValueError(f"{where}: pixel index columns differ from this code's")
    if meta.get(SEAL_KEY, b"").decode() != _seal(table):
        raise ValueError(f"{where}: pixel index is damaged (its seal does not hold)")
    return table, meta.get(RESIZE_KEY, b"").decode()


def read_committed_pixel_index(loc: "PackLocation", stream: int, shard: int, sha256: str) -> tuple[pa.Table, str]:
    """``read_pixel_index`` of a committed shard's file, after holding its bytes to the ``sha256`` its
    stream index row records.  ``OSError`` (``FileNotFoundError`` when absent) when it cannot be read,
    ``ValueError`` naming it when it is damaged."""
    rel = shard_pixels_file(stream, shard)
    data = loc.read_bytes(rel)
    if hashlib.sha256(data).hexdigest() != sha256:
        raise ValueError(f"{loc.path(rel)}: sha256 differs from the stream index")
    return read_pixel_index(data, loc.path(rel))
