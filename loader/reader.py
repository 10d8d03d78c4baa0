"""Reading a pack: the manifest, and one stream's records in order, with integrity checks.

Integrity is checked where it matters to training: every record's content digest is compared
with the manifest's (``schemas.record.record_digest``, compression-independent), so corrupted
bytes, a truncated or replaced file, and two shard files swapped (digests differ per position)
all raise ``PackIntegrityError`` naming the file and the record, before the record reaches the
model.  ``verify="file"`` also checks each shard file's sha256 (it must then read whole files);
the default check covers every byte the model sees, not padding or file metadata.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.fs as pafs

from schemas.errors import PackIntegrityError
from schemas.location import PackLocation, resolve_location
from schemas.manifest import MANIFEST_NAME, Manifest, ShardEntry, StreamEntry
from schemas.record import RECORD_SCHEMA_VERSION, record_digest

_READ_OPTIONS = dict(use_threads=False)  # one core per reader; parallelism comes from streams


@dataclass
class Pack:
    """An opened pack directory: where it is and its manifest."""

    location: PackLocation
    manifest: Manifest

    @classmethod
    def open(cls, path: "str | os.PathLike | PackLocation", filesystem: pafs.FileSystem | None = None) -> "Pack":
        loc = resolve_location(path, filesystem)
        manifest = Manifest.from_json(loc.read_bytes(MANIFEST_NAME).decode())
        if manifest.record_schema_version != RECORD_SCHEMA_VERSION:
            raise ValueError(
                f"{loc.path(MANIFEST_NAME)}: record schema version {manifest.record_schema_version}, "
                f"this reader reads {RECORD_SCHEMA_VERSION}"
            )
        return cls(loc, manifest)

    def stream(self, stream: int) -> StreamEntry:
        for entry in self.manifest.streams:
            if entry.stream == stream:
                return entry
        raise KeyError(f"stream {stream} is not in the manifest ({self.manifest.num_streams} streams)")

    def num_records(self, stream: int) -> int:
        return sum(len(s.records) for s in self.stream(stream).shards)


def iter_records(
    pack: Pack, stream: int, start: int = 0, *, verify: "bool | str" = True
) -> Iterator[tuple[int, pa.RecordBatch]]:
    """Yield ``(record index, record)`` of one stream from record ``start`` on."""
    for shard in pack.stream(stream).shards:
        n = len(shard.records)
        if start < shard.first_record + n:
            yield from _read_shard(pack.location, shard, max(start - shard.first_record, 0), verify)


def _read_shard(loc: PackLocation, shard: ShardEntry, first: int, verify) -> Iterator[tuple[int, pa.RecordBatch]]:
    path = loc.path(shard.file)

    def fail(i: int, reason: str) -> PackIntegrityError:
        return PackIntegrityError(path, shard.stream, shard.first_record + i, reason)

    try:
        source = loc.fs.open_input_file(path)
    except FileNotFoundError:
        raise fail(first, "shard file is missing") from None
    with source:
        size = source.size()
        if verify and size != shard.nbytes:
            raise fail(first, f"shard file is {size} bytes, the manifest says {shard.nbytes} (truncated or replaced)")
        if verify == "file":
            data = source.read_buffer()
            if hashlib.sha256(memoryview(data)).hexdigest() != shard.sha256:
                raise fail(first, "shard file sha256 differs from the manifest")
            source = pa.BufferReader(data)
        try:
            reader = pa.ipc.open_file(source, options=pa.ipc.IpcReadOptions(**_READ_OPTIONS))
        except (pa.ArrowException, OSError) as exc:
            raise fail(first, f"not a readable Arrow IPC file ({exc})") from exc
        if reader.num_record_batches != len(shard.records):
            raise fail(first, f"holds {reader.num_record_batches} records, the manifest says {len(shard.records)}")
        for i in range(first, len(shard.records)):
            try:
                record = reader.get_batch(i)
                if verify:  # bounds first: damaged offsets must not make the digest read out of range
                    record.validate(full=True)
                digest = record_digest(record) if verify else None
            except (pa.ArrowException, OSError, ValueError) as exc:
                raise fail(i, f"cannot decode record ({exc})") from exc
            if verify and digest != shard.records[i].digest:
                raise fail(i, "record content digest differs from the manifest (corrupted, or shard files swapped)")
            yield shard.first_record + i, record
