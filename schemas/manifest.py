"""The pack's documents, declared once and each read in one place, checked: the stream index
(``StreamIndex.read``), done.json (``StreamSummary.read``), the manifest (``PackSummary.read``) and
the identity stamped into every shard file.  ``pack.json`` is ``schemas.pack_info``, the lineage
``schemas.lineage``; a checkpoint's files are read and written by ``prepack.run.commit.checkpoint_files``.

Where each file lies is ``schemas.layout``; in what order a shard is committed, and why the stream
index is the commit marker, is ``prepack.run.commit.writer`` (its module doc).  A reader needs
``pack.json`` and its own streams' ``index.arrow`` only, so opening a rank's share costs the same
for a pack of 10^3 or 10^8 records.

Every record digest is chained into a per-stream root (``chain_root``), stored per shard row: a
loader state names the pack by its identity and each stream's position, and checks the digest of
the last record it read, so a resume never needs to hash the whole pack.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import xxhash

from schemas.cost import COST_TERMS
from schemas.documents import Document, read_document
from schemas.errors import DamagedFile, PackFormatError
from schemas.layout import MANIFEST_NAME, done_file, index_file, shard_file, trimmed_file
from schemas.pack_info import FORMAT_VERSION, SHARD_KEYS, PackInfo
from schemas.record import RECORD_SCHEMA_VERSION

if TYPE_CHECKING:
    from schemas.location import PackLocation



def chain_root(previous: str, digests: "Sequence[str] | bytes", facts: bytes = b"") -> str:
    """The stream's digest chain after appending ``digests`` (hex record digests) to ``previous``.

    ``facts`` (the rest of an index row: file sizes and sha256s, ``row_facts``) are chained too, so
    any change to a committed row shows as a broken chain."""
    h = hashlib.blake2b(bytes.fromhex(previous) if previous else b"", digest_size=16)
    h.update(digests if isinstance(digests, bytes) else bytes.fromhex("".join(digests)))
    h.update(facts)
    return h.hexdigest()


def row_facts(s: "ShardEntry") -> bytes:
    """The parts of an index row besides record digests that the chain covers."""
    scalars = (s.shard, s.nbytes, s.xxh3, s.first_record, s.lineage_sha256, s.lineage_rows,
               s.ckpt_json_sha256, s.ckpt_arrow_sha256, s.pixels_sha256)
    tokens = np.asarray([r.num_tokens for r in s.records] if not isinstance(s.records, RecordList)
                        else s.records.tokens, dtype="<i4")
    samples = np.asarray([r.num_samples for r in s.records] if not isinstance(s.records, RecordList)
                         else s.records.samples, dtype="<i4")
    return "|".join(map(str, scalars)).encode() + tokens.tobytes() + samples.tobytes()


# done.json fields that say how the last run went, not what was packed: a resumed, retried or
# reused pack has other values and the same bytes (comparisons of packs leave them out)
INFORMATIONAL_FIELDS = ("elapsed_s", "cpu_s", "reuse")


@dataclass
class StreamSummary(Document):
    """``done.json``: a finished stream's totals and accounting (and the manifest's per-stream entry)."""

    stream: int
    rank: int
    worker: int
    seed: int
    num_shards: int
    num_records: int
    num_tokens: int
    num_samples: int
    root: str  # chain_root over every record digest
    budget: dict[str, int]  # the budget this stream finished (kind -> value)
    lineage_sha256: str = ""  # of lineage/stream-SSSSS.parquet ("" when no sample)
    lineage_rows: int = 0
    drops: dict[str, int] = field(default_factory=dict)  # reason -> samples/rows dropped
    warnings: dict[str, int] = field(default_factory=dict)  # kind -> damaged-but-packed count
    examples: dict[str, str] = field(default_factory=dict)  # drop reason / warning kind -> its first occurrence
    group_samples: dict[str, int] = field(default_factory=dict)  # group -> samples packed
    elapsed_s: float = 0.0  # packing time of the last run (informational, not digested)
    cpu_s: float = 0.0  # CPU seconds of the packing process, all threads, worker start-up excluded (informational)
    # how the last run's resizes were served: images, reused, decodes_saved, fallbacks (informational;
    # a reused pack's bytes are a fresh pack's, see prepack.engine.reuse.earlier_pixels)
    reuse: dict = field(default_factory=dict)

    @classmethod
    def read(cls, loc: "PackLocation", stream: int) -> "StreamSummary | None":
        """The stream's ``done.json``, or None while it is not finished."""
        return read_document(loc, done_file(stream), cls.from_json)


@dataclass
class PackSummary(Document):
    """``manifest.json``: written once every stream is done; O(streams), never O(records)."""

    format_version: int
    identity: dict[str, Any]  # pack.json's content (PackInfo.to_dict)
    streams: list[StreamSummary]

    @classmethod
    def read(cls, loc: "PackLocation") -> "PackSummary | None":
        """The pack's ``manifest.json``, or None while some stream is not finished."""
        return read_document(loc, MANIFEST_NAME, cls.from_json)

    @staticmethod
    def written(loc: "PackLocation") -> bool:
        """Whether the pack's ``manifest.json`` is there (every stream finished), without reading it:
        the one "is the pack finished?" probe (the driver, verify and a following reader ask it)."""
        return loc.fs.get_file_info(loc.path(MANIFEST_NAME)).type.name == "File"


@dataclass
class TrimmedShards(Document):
    """``trimmed.json``: the shards of a stream whose records file was trimmed, and the checkpoints a
    trim dropped (``ckpt-k``'s two files; ``prepack.run.bounded.checkpoint_ladder`` says which go, a
    restore starts from the nearest one kept).  Written before a file is deleted (a crash between
    leaves a listed file still there: a listed shard is read as any, a listed checkpoint is not read)
    and after a restored file is in place, so the list never hides a missing file."""

    stream: int
    shards: list[int] = field(default_factory=list)
    checkpoints: list[int] = field(default_factory=list)

    @classmethod
    def read(cls, loc: "PackLocation", stream: int) -> "TrimmedShards":
        """The stream's trimmed shards (none when the file is absent)."""
        found = read_document(loc, trimmed_file(stream), cls.from_json)
        return found if found is not None else cls(stream)


# -- the per-stream index -------------------------------------------------------------------------
@dataclass
class RecordEntry:
    """One packed batch inside a shard."""

    digest: str  # schemas.record.record_digest of the record (hex)
    num_tokens: int  # sequence_length (unpadded)
    num_samples: int
    terms: tuple[int, ...] = ()  # its compute terms, ``schemas.cost.COST_TERMS`` in order (what balancing reads)


class RecordList(Sequence[RecordEntry]):
    """A shard's records as columns, read from an index without one object per record.

    ``digests`` is the records' 16-byte digests back to back; hex strings are made on access;
    ``terms`` their compute terms, int64 ``[records, len(COST_TERMS)]``."""

    __slots__ = ("digests", "tokens", "samples", "terms")

    def __init__(self, digests: bytes, tokens: Sequence[int], samples: Sequence[int], terms: np.ndarray):
        self.digests, self.tokens, self.samples, self.terms = digests, tokens, samples, terms

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return RecordEntry(self.digests[16 * i:16 * i + 16].hex(), int(self.tokens[i]), int(self.samples[i]),
                           tuple(int(x) for x in self.terms[i]))

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and len(other) == len(self) and all(a == b for a, b in zip(self, other))

    def __repr__(self) -> str:
        return f"RecordList({len(self)} records)"


@dataclass
class ShardEntry:
    """One committed shard: a row of the stream's index."""

    stream: int
    shard: int
    nbytes: int
    xxh3: str  # XXH3-128 of the whole shard file (hex): as strong as the record digests, ~10x cheaper than sha256
    first_record: int  # index of this shard's first record within its stream
    records: Sequence[RecordEntry]
    root: str = ""  # chain_root after this shard's records
    lineage_sha256: str = ""  # of shard-k.lineage.parquet
    lineage_rows: int = 0
    ckpt_json_sha256: str = ""  # of ckpt-(k+1).json, the state after this shard
    ckpt_arrow_sha256: str = ""
    pixels_sha256: str = ""  # of shard-k.pixels.arrow

    @property
    def file(self) -> str:
        return shard_file(self.stream, self.shard)

    @property
    def num_records(self) -> int:
        return len(self.records)


# -- the identity a shard file carries in its schema metadata --------------------------------------
_CHECKED_PACK_KEYS = SHARD_KEYS[:2]  # config and tokenizer: what a reader holds a shard to


def _place(stream: int, shard: int) -> dict[str, str]:
    return {"prepack.record_schema_version": str(RECORD_SCHEMA_VERSION), "prepack.stream": str(stream),
            "prepack.shard": str(shard)}


def shard_metadata(pack_meta: dict[str, str], stream: int, shard: int) -> dict[str, str]:
    """What the writer stamps into shard ``shard`` of ``stream``: the pack's part (``PackInfo.shard_metadata``),
    then its place."""
    return {**pack_meta, **_place(stream, shard)}


def expected_shard_metadata(info: PackInfo, shard: "ShardEntry") -> dict[str, str]:
    """What a reader holds a shard's metadata to (the record schema, config, tokenizer and its place),
    so a shard of another stream or pack is named as such."""
    place = _place(shard.stream, shard.shard)
    version = {"prepack.record_schema_version": place.pop("prepack.record_schema_version")}
    return {**version, **{key: str(getattr(info, name)) for key, name in _CHECKED_PACK_KEYS}, **place}


INDEX_SCHEMA = pa.schema([
    ("shard", pa.int32()), ("nbytes", pa.int64()), ("xxh3", pa.string()), ("first_record", pa.int64()),
    ("record_digests", pa.list_(pa.binary(16))), ("record_tokens", pa.list_(pa.int32())),
    ("record_samples", pa.list_(pa.int32())), ("record_terms", pa.list_(pa.int64())), ("root", pa.string()),
    ("lineage_sha256", pa.string()), ("lineage_rows", pa.int64()),
    ("ckpt_json_sha256", pa.string()), ("ckpt_arrow_sha256", pa.string()), ("pixels_sha256", pa.string()),
])


# An index seals itself: its schema metadata carries the XXH3-128 of the file's own bytes, taken
# with this placeholder standing where the digest is (an Arrow IPC file holds its schema twice: the
# stream header and the footer).  Every byte of the file is covered, padding and flatbuffer slack
# included, without a second file that a crash could leave out of step with the commit marker.
_SEAL_KEY = "prepack.index_xxh3"
_TERMS_KEY = "prepack.cost_terms"  # the names of record_terms' columns, in order
_SEAL_PLACEHOLDER = b"~" * 32


def _seal(data: bytes) -> bytes:
    if data.count(_SEAL_PLACEHOLDER) != 2:  # header and footer schema; anything else is not our writer
        raise RuntimeError(f"index seal placeholder found {data.count(_SEAL_PLACEHOLDER)} times, expected 2")
    return data.replace(_SEAL_PLACEHOLDER, xxhash.xxh3_128(data).hexdigest().encode())


def _seal_holds(data: bytes, seal: bytes) -> bool:
    """Whether ``data`` is exactly the bytes that were sealed with ``seal`` (a hex digest)."""
    if len(seal) != len(_SEAL_PLACEHOLDER):
        return False
    return xxhash.xxh3_128(data.replace(seal, _SEAL_PLACEHOLDER)).hexdigest().encode() == seal


def _int_values(arr: pa.Array, dtype=np.int32) -> np.ndarray:
    """An integer Arrow array (no nulls) as a numpy view: ``to_numpy`` would import pandas (~50 MB)."""
    return np.frombuffer(arr.buffers()[1], dtype=dtype)[arr.offset:arr.offset + len(arr)]


@dataclass
class StreamIndex:
    """A stream's committed shards, plus the digests of its first checkpoint (``ckpt-00000``)."""

    stream: int
    shards: list[ShardEntry]
    ckpt0_json_sha256: str = ""
    ckpt0_arrow_sha256: str = ""

    @property
    def num_records(self) -> int:
        return self.shards[-1].first_record + len(self.shards[-1].records) if self.shards else 0

    @property
    def root(self) -> str:
        return self.shards[-1].root if self.shards else ""

    def append(self, entry: "ShardEntry") -> None:
        """Add a committed shard's row, chaining it (write the index afterwards to commit it)."""
        entry.root = chain_root(self.root or self._chain_start(), [r.digest for r in entry.records], row_facts(entry))
        self.shards.append(entry)

    def shard_of(self, record: int) -> ShardEntry:
        """The shard holding record ``record`` of the stream (binary search over the shards' first records)."""
        if not 0 <= record < self.num_records:
            raise IndexError(f"stream {self.stream} has {self.num_records} records, not record {record}")
        return self.shards[bisect.bisect_right(self.shards, record, key=lambda s: s.first_record) - 1]

    def record(self, index: int) -> RecordEntry:
        """Entry of record ``index`` of the stream."""
        shard = self.shard_of(index)
        return shard.records[index - shard.first_record]

    @classmethod
    def read(cls, loc: "PackLocation", stream: int) -> "StreamIndex | None":
        """The stream's committed index, checked (``from_bytes``), or None before its first commit."""
        return read_document(loc, index_file(stream), lambda data, where: cls.from_bytes(data, stream, where))

    def _chain_start(self) -> str:
        return chain_root("", [], f"{self.ckpt0_json_sha256}|{self.ckpt0_arrow_sha256}".encode())

    def to_bytes(self) -> bytes:
        cols: dict[str, list] = {f.name: [] for f in INDEX_SCHEMA}
        for s in self.shards:
            cols["shard"].append(s.shard)
            cols["nbytes"].append(s.nbytes)
            cols["xxh3"].append(s.xxh3)
            cols["first_record"].append(s.first_record)
            cols["record_digests"].append([bytes.fromhex(r.digest) for r in s.records])
            cols["record_tokens"].append([r.num_tokens for r in s.records])
            cols["record_samples"].append([r.num_samples for r in s.records])
            cols["record_terms"].append([int(x) for r in s.records for x in (r.terms or (0,) * len(COST_TERMS))])
            for name in ("root", "lineage_sha256", "lineage_rows", "ckpt_json_sha256", "ckpt_arrow_sha256",
                         "pixels_sha256"):
                cols[name].append(getattr(s, name))
        meta = {"prepack.format_version": str(FORMAT_VERSION), "prepack.stream": str(self.stream),
                "prepack.ckpt0_json_sha256": self.ckpt0_json_sha256,
                "prepack.ckpt0_arrow_sha256": self.ckpt0_arrow_sha256, _TERMS_KEY: ",".join(COST_TERMS),
                _SEAL_KEY: _SEAL_PLACEHOLDER.decode()}
        batch = pa.RecordBatch.from_pydict(cols, schema=INDEX_SCHEMA.with_metadata(meta))
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, batch.schema, options=pa.ipc.IpcWriteOptions(compression="zstd")) as w:
            w.write_batch(batch)
        return _seal(sink.getvalue().to_pybytes())

    @classmethod
    def from_bytes(cls, data: bytes, stream: int, where: str) -> "StreamIndex":
        """Parse and check an index: its seal (every byte), schema, stream, contiguous shards and
        records, digest chain."""
        if not data:
            raise DamagedFile(f"{where}: empty file (a stream index is never empty)")
        try:
            reader = pa.ipc.open_file(pa.BufferReader(data))
        except (pa.ArrowException, OSError) as e:
            raise DamagedFile(f"{where}: not a readable stream index ({e})") from None
        raw_meta = reader.schema.metadata or {}
        seal = raw_meta.get(_SEAL_KEY.encode(), b"")
        if not seal and raw_meta.get(b"prepack.format_version", b"") != str(FORMAT_VERSION).encode():
            version = raw_meta.get(b"prepack.format_version", b"?").decode(errors="replace")
            raise PackFormatError(f"{where}: index of format {version!r}, this bagel-prepack reads {FORMAT_VERSION}")
        if not _seal_holds(bytes(data), seal):  # before any record buffer is decoded
            raise DamagedFile(f"{where}: damaged (its bytes do not match the digest it was sealed with)")
        meta = {k.decode(): v.decode() for k, v in raw_meta.items()}
        if meta.get("prepack.format_version") != str(FORMAT_VERSION):
            raise PackFormatError(f"{where}: index of format {meta.get('prepack.format_version')!r}, "
                                  f"this bagel-prepack reads {FORMAT_VERSION}")
        try:
            if reader.num_record_batches != 1:  # the writer writes one; anything else is not ours
                raise DamagedFile(f"{where}: {reader.num_record_batches} record batches, expected 1")
            table = reader.get_batch(0)
            table.validate(full=True)
        except (pa.ArrowException, OSError) as e:
            raise DamagedFile(f"{where}: not a readable stream index ({e})") from None
        if reader.schema.remove_metadata() != INDEX_SCHEMA:
            raise DamagedFile(f"{where}: unexpected index columns")
        if meta.get("prepack.stream") != str(stream):
            raise DamagedFile(f"{where}: index of stream {meta.get('prepack.stream')}, expected {stream}")
        if meta.get(_TERMS_KEY) != ",".join(COST_TERMS):
            raise DamagedFile(f"{where}: its records' compute terms are {meta.get(_TERMS_KEY)!r}, this bagel-prepack "
                              f"counts {','.join(COST_TERMS)!r}")
        # Plain column reads: Table/ChunkedArray helpers and to_numpy would import pyarrow.compute
        # and pandas (~40 MB, 0.4 s) into every training rank.
        scalars = {f.name: table.column(f.name).to_pylist() for f in INDEX_SCHEMA if not f.name.startswith("record_")}
        lists = {name: table.column(name) for name in ("record_digests", "record_tokens", "record_samples",
                                                       "record_terms")}
        offsets = _int_values(lists["record_digests"].offsets)
        values = lists["record_digests"].values  # (.flatten() would import pyarrow.compute)
        digests = values.buffers()[1].to_pybytes()[16 * values.offset:16 * (values.offset + len(values))]
        tokens = _int_values(lists["record_tokens"].values)
        samples = _int_values(lists["record_samples"].values)
        terms = _int_values(lists["record_terms"].values, np.int64).reshape(-1, len(COST_TERMS))
        if not (np.array_equal(offsets, _int_values(lists["record_tokens"].offsets))
                and np.array_equal(offsets, _int_values(lists["record_samples"].offsets))
                and np.array_equal(offsets * len(COST_TERMS), _int_values(lists["record_terms"].offsets))):
            raise DamagedFile(f"{where}: record columns of different lengths")
        index = cls(stream, [], meta.get("prepack.ckpt0_json_sha256", ""), meta.get("prepack.ckpt0_arrow_sha256", ""))
        root, next_record = index._chain_start(), 0
        for i in range(table.num_rows):
            lo, hi = int(offsets[i]), int(offsets[i + 1])
            if scalars["shard"][i] != i or scalars["first_record"][i] != next_record:
                raise DamagedFile(f"{where}: row {i} does not continue the stream (shard {scalars['shard'][i]}, "
                                  f"first record {scalars['first_record'][i]}, expected {i} / {next_record})")
            entry = ShardEntry(
                stream=stream, shard=i, nbytes=scalars["nbytes"][i], xxh3=scalars["xxh3"][i], first_record=next_record,
                records=RecordList(digests[16 * lo:16 * hi], tokens[lo:hi], samples[lo:hi], terms[lo:hi]),
                root=scalars["root"][i],
                lineage_sha256=scalars["lineage_sha256"][i], lineage_rows=scalars["lineage_rows"][i],
                ckpt_json_sha256=scalars["ckpt_json_sha256"][i], ckpt_arrow_sha256=scalars["ckpt_arrow_sha256"][i],
                pixels_sha256=scalars["pixels_sha256"][i])
            root = chain_root(root, entry.records.digests, row_facts(entry))
            if root != entry.root:
                raise DamagedFile(f"{where}: shard {i}: the row does not chain to its stored root (damaged index)")
            index.shards.append(entry)
            next_record = hi
        return index
