"""A pack's pixel catalog: every picture of its committed shards, sorted by content, in blocks.

Why: the per-shard pixel indexes (``schemas.pixel_index``) are written as shards commit, in pack
order.  A later pack looking pictures up in them would have to load all of them (~150 bytes a
picture in memory: 15 GB at 10^8).  The catalog is the same rows merged and sorted by content key,
stored in blocks of ``BLOCK_ROWS`` rows; a reader keeps only the first key of each block (the
fences, ~40 bytes a block: ~4 MB at 10^8 pictures) and reads the one block a key falls in.

Layout, under the pack (the only home of these names):

    OUT/pixels/catalog.json               the commit point: what the catalog covers, its vocabulary,
                                          its build folder and the sha256 of its fences
    OUT/pixels/<build>/fences.arrow       one row per block: first key, part, first row, rows, digest
    OUT/pixels/<build>/part-PPP.rows      the rows whose content key starts with byte PPP, sorted:
                                          fixed-width little-endian records (``ROW_DTYPE``), so a
                                          block is one ranged read and one ``np.frombuffer``

A build folder is named by what it covers, so two jobs indexing the same pack at once write the
same files or different folders, never a mix.  Every block has an XXH3-64 of its bytes (in the fences), the fences have their sha256 in ``catalog.json`` and ``catalog.json`` a checksum
of its own: a damaged catalog is refused (the reader decodes instead), never misread.  Strings
are small codes into vocabularies kept in ``catalog.json`` so a row is fixed-width.
``covered`` names, per stream, how many shards the catalog holds and the pixel index sha256 of
the last of them (stream indexes are chained, so it pins the earlier ones): shards committed
later are read from their own pixel indexes.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import numpy as np
import pyarrow as pa
import xxhash

from schemas.documents import dump_checked, load_checked, read_document
from schemas.errors import DamagedFile

if TYPE_CHECKING:
    from schemas.location import PackLocation

CATALOG_VERSION = 2  # 2: frame formats in ``codecs``, ``frame_digest``
CATALOG_DIR = "pixels"
CATALOG_NAME = f"{CATALOG_DIR}/catalog.json"
FENCES_NAME = "fences.arrow"
BLOCK_ROWS = 256
PARTS = 256  # by the first byte of the content key: at 10^8 pictures a part is ~400k rows to sort

# A part file's row, packed little-endian (the file format: never reordered, only versioned).
ROW_DTYPE = np.dtype([
    ("content", "S16"),  # XXH3-128 of the picture's encoded bytes
    ("decode", "<i1"),  # code into Catalog.decodes
    ("width", "<i4"), ("height", "<i4"),  # the resize target
    ("src_width", "<i4"), ("src_height", "<i4"),
    ("damage", "<i4"),  # code into Catalog.damages
    ("stream", "<i4"), ("shard", "<i4"), ("shard_bytes", "<i8"),
    ("offset", "<i8"), ("length", "<i8"), ("nbytes", "<i8"),  # the frame in the shard file
    ("codec", "<i1"),  # code into Catalog.codecs (frame formats)
    ("digest", "<u8"),  # XXH3-64 of the frame's decompressed (coded) bytes
    ("frame_digest", "<u8"),  # XXH3-64 of the frame as stored
])

FENCES_SCHEMA = pa.schema([
    pa.field("first", pa.binary(16), nullable=False),  # the block's first content key
    pa.field("part", pa.int16(), nullable=False),
    pa.field("row", pa.int64(), nullable=False),  # the block's first row in its part file
    pa.field("rows", pa.int32(), nullable=False),
    pa.field("digest", pa.uint64(), nullable=False),  # XXH3-64 of the block's bytes
])


def part_file(build: str, part: int) -> str:
    return f"{CATALOG_DIR}/{build}/part-{part:03d}.rows"


def fences_file(build: str) -> str:
    return f"{CATALOG_DIR}/{build}/{FENCES_NAME}"


def block_digest(data: "bytes | memoryview") -> int:
    return xxhash.xxh3_64_intdigest(data)


@dataclass
class Catalog:
    """``catalog.json``: what a build covers and how to read it."""

    resize: str  # the resize implementation every covered pixel index named
    build: str  # the folder under pixels/
    rows: int
    fences_sha256: str
    covered: dict[int, tuple[int, str]] = field(default_factory=dict)  # stream -> (shards, last pixels_sha256)
    decodes: list[str] = field(default_factory=list)
    codecs: list[str] = field(default_factory=list)
    damages: list[str] = field(default_factory=list)

    def to_bytes(self) -> bytes:
        return dump_checked({
            "catalog_version": CATALOG_VERSION, "resize": self.resize, "build": self.build, "rows": self.rows,
            "fences_sha256": self.fences_sha256,
            "covered": [[s, n, last] for s, (n, last) in sorted(self.covered.items())],
            "decodes": self.decodes, "codecs": self.codecs, "damages": self.damages,
        })

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> "Catalog":
        d = load_checked(data, where)
        if d.get("catalog_version") != CATALOG_VERSION:
            raise DamagedFile(f"{where}: pixel catalog version {d.get('catalog_version')!r}, this code reads "
                              f"{CATALOG_VERSION}")
        try:
            return cls(resize=str(d["resize"]), build=str(d["build"]), rows=int(d["rows"]),
                       fences_sha256=str(d["fences_sha256"]),
                       covered={int(s): (int(n), str(last)) for s, n, last in d["covered"]},
                       decodes=[str(x) for x in d["decodes"]], codecs=[str(x) for x in d["codecs"]],
                       damages=[str(x) for x in d["damages"]])
        except (KeyError, TypeError, ValueError) as e:
            raise DamagedFile(f"{where}: not a pixel catalog ({e})") from None

    @classmethod
    def read(cls, loc: "PackLocation") -> "Catalog | None":
        """The pack's ``catalog.json``, checked (``DamagedFile`` naming it); None when it has none."""
        return read_document(loc, CATALOG_NAME, cls.from_bytes)

    def fence_bytes(self, loc: "PackLocation") -> bytes:
        """This build's fences file (``parse_fences`` reads it), held to its sha256 in ``catalog.json``:
        ``ValueError`` naming the file when it differs, ``OSError`` when it cannot be read.  A job's
        driver reads it once; each of its streams parses the bytes it was given."""
        rel = fences_file(self.build)
        data = loc.read_bytes(rel)
        if hashlib.sha256(data).hexdigest() != self.fences_sha256:
            raise ValueError(f"{loc.path(rel)}: sha256 differs from {CATALOG_NAME}")
        return data

    def holds_for(self, stream: int, shards: Sequence) -> bool:
        """Whether the shards it covers of ``stream`` are still the first of ``shards`` (the stream's
        committed index rows, or anything with their ``pixels_sha256``): a catalog of a pack that
        changed under it is not one byte trusted."""
        n, last = self.covered.get(stream, (0, ""))
        return not n or (len(shards) >= n and shards[n - 1].pixels_sha256 == last)

    def current_for(self, committed: "dict[int, Sequence]") -> bool:
        """Whether it covers exactly the shards ``committed`` lists (stream -> its committed index
        rows, every stream of the pack): nothing committed since, nothing changed under it."""
        return all(self.covered.get(stream, (0, ""))[0] == len(shards) and self.holds_for(stream, shards)
                   for stream, shards in committed.items())


def parse_fences(data: bytes, where: str) -> pa.Table:
    """A fences file's table (``FENCES_SCHEMA``); ``ValueError`` naming ``where`` when it does not read."""
    try:
        return pa.ipc.open_file(pa.py_buffer(data)).read_all()
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{where}: not readable ({e})") from None


def build_name(covered: dict[int, tuple[int, str]], resize: str) -> str:
    """The build folder of a coverage: the same coverage always lands in the same folder."""
    h = hashlib.sha256(resize.encode())
    for s, (n, last) in sorted(covered.items()):
        h.update(f"{s}:{n}:{last};".encode())
    return h.hexdigest()[:16]


def arrow_file_bytes(table: pa.Table, schema: pa.Schema) -> bytes:
    """An Arrow IPC file of ``table`` in one record batch (deterministic bytes)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, schema) as w:
        w.write_table(table.combine_chunks())
    return sink.getvalue().to_pybytes()
