"""What a shard's restore reads: its sources' identities, recorded as it was packed.

``prepack restore`` packs a trimmed shard again from its checkpoint, so it reads the *sources*
again: every file the shard's records came from (parquet files, JSONL files and the images and
videos their rows name), the listings that ordered them, and the files its stream read when it
started (a JSONL file, ``parquet_info``).  ``shard-k.sources.json`` lists each of them as it was
read, so a trim can check first that a restore would still find the same bytes (a trim never
deletes the only copy), and a restore can refuse, naming the file, before doing the work.

An identity is the file's size and the XXH3-128 of the part of it the shard read (the whole file,
or a parquet row group's column chunks and the footer that located them); a listing's is the
digest of its names in order.  Nothing else: no time, no stat, so two packs of the same data are
the same bytes, here as in every other file of a pack.  The check itself is
``prepack.engine.sources.ledger.SourceCheck``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas.documents import Document, read_document
from schemas.layout import shard_sources_file
from schemas.location import PackLocation

FILE = "file"
LISTING = "listing"


@dataclass(frozen=True)
class SourceIdentity(Document):
    """One source as a shard read it.  ``kind``: ``file`` or ``listing`` (a directory's names)."""

    path: str
    kind: str = FILE
    size: int = -1  # the file's bytes (a listing: its number of names)
    offset: int = 0  # the part of the file read and hashed: from offset ...
    length: int = -1  # ... this many bytes (-1: to the end; a parquet row group's chunks, its footer)
    digest: str = ""  # XXH3-128 hex of the part read (a listing: of its names in order)

    def describe(self) -> str:
        return f"{self.path} ({self.size} names)" if self.kind == LISTING else self.path


@dataclass
class ShardSources(Document):
    """``shard-k.sources.json``: every source shard k of a stream read, from its checkpoint to its
    end, and the tokenizer it was packed with."""

    stream: int
    shard: int
    tokenizer_fingerprint: str
    sources: list[SourceIdentity] = field(default_factory=list)

    @classmethod
    def read(cls, loc: PackLocation, stream: int, shard: int) -> "ShardSources | None":
        """The shard's sources, or None when the file is absent (never written, or damaged away)."""
        return read_document(loc, shard_sources_file(stream, shard), cls.from_json)
