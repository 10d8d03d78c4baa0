"""Writing one stream: its shard files, and the commit that makes each one part of the pack.

**The shard commit** (described here once; the layout, the stream job and docs/architecture.md
point here).  A stream is the unit of resume, so its output must always be a clean prefix of
committed shards.  For shard k a committing ``StreamWriter`` writes, each file atomically
(``prepack.run.commit.atomic_files``: under a temporary name, made durable, renamed; on an object store, where
an upload appears whole or not at all, under its final name; names from ``schemas.layout``):

1. ``shard-k.arrow``: the records (its XXH3-128 taken from the bytes as they are written, never
   read back); the shard ends after the record that makes it reach ``shard_bytes``;
2. ``shard-k.pixels.arrow``: where each keyed picture's frame lies in it (``schemas.pixel_index``);
3. ``shard-k.lineage.parquet``: one row per packed sample;
4. ``shard-k.sources.json``: every source the shard read, by identity (``schemas.sources``: what a
   trim checks before it deletes the shard's records, and a restore before it packs them again);
5. ``ckpt-(k+1).arrow`` then ``.json``: the stream's state after the shard's last record;
6. ``index.arrow`` rewritten with shard k's row (sizes and digests of 1-3 and 5, chained): **the
   commit**, atomic on a local disk (rename) and on an object store (PUT).

A shard exists exactly when the index lists it; anything after the last listed shard is a crash
leftover, which ``prepack.run.commit.recovery.recover_stream`` deletes (``ckpt-next`` stays: it is the
state to resume from).
The stream then resumes from that checkpoint, after checking it against the sha256 its index row
recorded, and writes the same bytes.  Before shard 0 the writer writes ``ckpt-00000``, whose
digests the index holds; a stream with no record at all still writes its (empty) index.

Output bytes depend only on the batches, the compression and the metadata: no timestamps, no uuids.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable

import pyarrow as pa
import xxhash

from prepack.engine.reuse.source_pictures import RESIZE_IMPL
from prepack.run.commit.atomic_files import AtomicFile, sha256_hex, write_bytes_atomic
from prepack.run.commit.checkpoint_files import write_checkpoint
from prepack.run.commit.direct_file import staging_buffer
from prepack.run.commit.lineage import compact_lineage, lineage_table, parquet_bytes
from schemas.compression import Compression
from schemas.config import PrepackConfig
from schemas.cost import terms_of
from schemas.layout import done_file, index_file, shard_file, shard_lineage_file, shard_pixels_file, shard_sources_file
from schemas.location import PackLocation, resolve_location
from schemas.manifest import RecordEntry, ShardEntry, StreamIndex, StreamSummary, shard_metadata
from schemas.pack_info import SHARD_KEYS
from schemas.pixel_index import PictureSource, PixelEntry, pixel_index_bytes
from schemas.pixel_table import StoredImage
from schemas.packed_batch import PackedBatch
from schemas.record import EncodedRecord, RECORD_SCHEMA, encode_record, stored_pixel_frames
from schemas.sources import ShardSources, SourceIdentity

log = logging.getLogger(__name__)
TOKENIZER_KEY = {name: key for key, name in SHARD_KEYS}["tokenizer_fingerprint"]  # in the shard metadata


class _HashingSink:
    """File-like sink for pyarrow that counts and XXH3-128-hashes every byte on its way to ``raw``.

    ``watch(buffer)`` asks where one buffer of the next record lands in the file: pyarrow hands a
    record's body buffers to ``write`` as they are (zero copy), so the write of that memory is
    recognised by address and size; ``seen`` is its file offset (None if it was not seen, e.g. a
    pyarrow that copies: then the shard's pixel index simply lists nothing for that record).
    """

    def __init__(self, raw):
        self.raw = raw
        self.xxh3 = xxhash.xxh3_128()
        self.nbytes = 0
        self.closed = False
        self._watch: tuple[int, int] | None = None
        self.seen: int | None = None

    def watch(self, buffer: pa.Buffer | None) -> None:
        self._watch = (buffer.address, buffer.size) if buffer is not None and buffer.size else None
        self.seen = None

    def write(self, data) -> int:
        if self._watch is not None and isinstance(data, pa.Buffer) and (data.address, data.size) == self._watch:
            self.seen, self._watch = self.nbytes, None
        view = memoryview(data)
        self.xxh3.update(view)
        self.raw.write(view)
        self.nbytes += view.nbytes
        return view.nbytes

    def tell(self) -> int:
        return self.nbytes

    def flush(self) -> None:
        self.raw.flush()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def close(self) -> None:
        # pyarrow never closes a Python sink itself; the writer closes ``raw`` after fsync.
        self.closed = True


@dataclass(frozen=True)
class ShardFormat:
    """How a stream's shards are written: ``shard_bytes`` (a shard ends after the record that reaches
    it), ``compression`` (``schemas.compression``) and the pack's shard ``metadata``."""

    shard_bytes: int
    compression: str
    metadata: dict[str, str]


@dataclass(frozen=True)
class Committing:
    """What a committing writer needs: the stream's ``index`` (as ``recover_stream`` returned it) and
    ``state``, a call giving the packer's state at that moment as a checkpoint's (json, arrow) bytes
    (None: the stream has no states of its own, as a balanced-samples stream, whose states are its
    reference's); ``sources``, a call giving the sources the shard just ended read (``SourceLedger.take``)."""

    index: StreamIndex
    state: "Callable[[], tuple[bytes, bytes]] | None"
    sources: "Callable[[], list[SourceIdentity]] | None" = None


class StreamWriter:
    """Appends packed batches of one stream to rolling shard files, and commits each shard.

    Given the stream's ``index`` (as ``recover_stream`` returned it) and ``state`` (the packer's
    state at the moment of the call, as the (json, arrow) bytes of a checkpoint), the writer makes
    the whole commit of the module doc, index included, and continues after the index's last
    shard; when the index has no shard yet, constructing it writes ``ckpt-00000`` (so construct it
    before the first batch is packed).  Without them (tests, tools that build packs by hand) it
    stops after the shard file and its pixel index, from ``start_shard``/``start_record``, and the
    caller commits (``StreamIndex.append`` + ``write_index``).

    ``append`` returns the ``ShardEntry`` of a shard the record completed, else ``None``;
    ``finish`` commits the last, partial shard (a committing writer whose stream has no record at
    all writes the empty index, which records ``ckpt-00000``'s digests).  ``committed_pixels``
    holds the pixel index entries of the shard just committed.  Leaving a ``with`` block drops a
    shard still in progress (``abort``): only ``finish`` commits it.
    """

    def __init__(self, out: "str | os.PathLike | PackLocation", stream: int, fmt: "ShardFormat",
                 commit: "Committing | None" = None, start: tuple[int, int] = (0, 0)):
        """``fmt``: the shards' size, compression and metadata; ``commit``: the stream's index and state
        (a committing writer); else ``start``: the (shard, record) the first record written is."""
        if fmt.shard_bytes <= 0:
            raise ValueError(f"shard_bytes must be positive, got {fmt.shard_bytes}")
        index, state = (commit.index, commit.state) if commit is not None else (None, None)
        self._sources = commit.sources if commit is not None else None
        start_shard, start_record = start
        self.loc = resolve_location(out)
        self.stream = stream
        self.shard_bytes = fmt.shard_bytes
        self.compression = Compression.parse(fmt.compression)
        self.metadata = {str(k): str(v) for k, v in fmt.metadata.items()}
        self.index, self._state = index, state
        if index is not None:
            start_shard, start_record = len(index.shards), index.num_records
        self.next_shard = start_shard
        self.next_record = start_record
        self._file: AtomicFile | None = None
        self._sink: _HashingSink | None = None
        self._ipc: pa.ipc.RecordBatchFileWriter | None = None
        self._records: list[RecordEntry] = []
        self._pixels: list[PixelEntry] = []
        self._lineage: list[tuple[list, list[int]]] = []  # of the open shard's records (committing writer)
        self.committed_pixels: list[PixelEntry] = []
        self.last_images: list[tuple[PictureSource, StoredImage]] = []
        self._staging = None  # one direct-I/O staging buffer for every shard file (made at the first)
        if index is not None and not index.shards and state is not None:
            index.ckpt0_json_sha256, index.ckpt0_arrow_sha256 = self._checkpoint(0)

    def __enter__(self) -> "StreamWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.abort()

    def _schema(self) -> pa.Schema:
        return RECORD_SCHEMA.with_metadata(shard_metadata(self.metadata, self.stream, self.next_shard))

    def _open(self) -> None:
        if self._staging is None and self.loc.is_local:
            self._staging = staging_buffer()
        self._file = AtomicFile(self.loc, shard_file(self.stream, self.next_shard), direct=True, staging=self._staging)
        self._sink = _HashingSink(self._file.raw)
        self._ipc = pa.ipc.new_file(self._sink, self._schema(), options=self.compression.write_options())
        self._records = []
        self._pixels = []

    def encode(self, batch: PackedBatch) -> EncodedRecord:
        """The record ``append`` writes for ``batch`` (the pixel table compressed here): its size is
        known before it is written (``pa.ipc.get_record_batch_size``, buffers stored as they are)."""
        return encode_record(batch, self.compression)

    def append(self, batch: PackedBatch, encoded: "EncodedRecord | None" = None) -> ShardEntry | None:
        """Write one packed batch (``encoded``: as ``encode`` made it); return the shard's entry if
        this record completed a shard."""
        if self.index is not None:
            self._lineage.append((batch.origins, batch.sample_lens.tolist()))
        encoded = encoded if encoded is not None else self.encode(batch)
        record = encoded.record
        if self._ipc is None:
            self._open()
        _, stored, frames = stored_pixel_frames(record)
        self._sink.watch(stored)
        self._ipc.write_batch(record)
        if self._sink.seen is not None:
            self._index_pixels(batch, encoded, self._sink.seen, frames)
        self.last_images = _written_images(batch, encoded, stored, frames)
        self._records.append(RecordEntry(encoded.digest, int(batch.sequence_length), batch.num_samples,
                                         tuple(int(x) for x in terms_of(batch))))
        if self._sink.nbytes >= self.shard_bytes:
            return self._commit()
        return None

    def _index_pixels(self, batch: PackedBatch, encoded: EncodedRecord, at: int, frames) -> None:
        """Pixel index rows for the record about to be listed (``at``: its pixel bytes' file offset)."""
        offsets = batch.image_offsets
        for i, source in enumerate(batch.image_sources):
            if source is None:
                continue
            self._pixels.append(PixelEntry(
                source=source, width=int(batch.image_widths[i]), height=int(batch.image_heights[i]),
                record=len(self._records), image=i, offset=at + int(frames[i]),
                length=int(frames[i + 1] - frames[i]), nbytes=int(offsets[i + 1] - offsets[i]),
                codec=encoded.frame_format, digest=int(encoded.image_digests[i]),
                frame_digest=int(encoded.frame_digests[i])))

    def finish(self) -> ShardEntry | None:
        """Commit the current partial shard, if it holds any record."""
        if self._ipc is not None:
            return self._commit()
        if self.index is not None and not self.index.shards:
            write_index(self.loc, self.index)  # no record at all: still record ckpt-0's digests
        return None

    def abort(self) -> None:
        """Drop the shard in progress (its temporary file is removed)."""
        if self._ipc is not None:
            try:
                self._ipc.close()
            except (OSError, pa.ArrowException):
                pass
            self._file.abort()
            self._ipc = self._sink = self._file = None
        self._lineage = []

    def _commit(self) -> ShardEntry:
        """Steps 1-6 of the module doc for the open shard (1-2 alone without an index)."""
        self._ipc.close()
        self._file.commit()
        pixel_index = pixel_index_bytes(self._pixels, RESIZE_IMPL)
        write_bytes_atomic(self.loc, shard_pixels_file(self.stream, self.next_shard), pixel_index)
        self.committed_pixels = self._pixels
        entry = ShardEntry(
            stream=self.stream,
            shard=self.next_shard,
            nbytes=self._sink.nbytes,
            xxh3=self._sink.xxh3.hexdigest(),
            first_record=self.next_record,
            records=self._records,
            pixels_sha256=sha256_hex(pixel_index),
        )
        log.debug(
            "stream %d: wrote %s (%d records, %d bytes)", self.stream, entry.file, len(entry.records), entry.nbytes
        )
        self.next_shard += 1
        self.next_record += len(self._records)
        self._ipc = self._sink = self._file = None
        if self.index is not None:
            lineage = parquet_bytes(lineage_table(self.stream, entry.first_record, self._lineage))
            write_bytes_atomic(self.loc, shard_lineage_file(self.stream, entry.shard), lineage)
            entry.lineage_sha256, entry.lineage_rows = sha256_hex(lineage), sum(len(o) for o, _ in self._lineage)
            if self._sources is not None:
                doc = ShardSources(self.stream, entry.shard, self.metadata.get(TOKENIZER_KEY, ""), self._sources())
                write_bytes_atomic(self.loc, shard_sources_file(self.stream, entry.shard), doc.to_json().encode())
            if self._state is not None:
                entry.ckpt_json_sha256, entry.ckpt_arrow_sha256 = self._checkpoint(entry.shard + 1)
            self.index.append(entry)
            write_index(self.loc, self.index)  # the commit
        self._records = []
        self._pixels = []
        self._lineage = []
        return entry

    def _checkpoint(self, shard: int) -> tuple[str, str]:
        """Write the state now as ``ckpt-shard``; the sha256 of its (json, arrow) files."""
        return write_checkpoint(self.loc, self.stream, shard, self._state())


def _written_images(batch: PackedBatch, encoded: EncodedRecord, stored: pa.Buffer, frames) -> list:
    """``(source, StoredImage)`` of each keyed image of the record just written: its frame as
    written (zero-copy slices of the stored table), for a later pass of the same stream."""
    out = []
    for i, source in enumerate(batch.image_sources):
        if source is not None:
            a, b = int(frames[i]), int(frames[i + 1])
            out.append((source, StoredImage(int(batch.image_widths[i]), int(batch.image_heights[i]),
                                            int(encoded.image_digests[i]), frame=stored.slice(a, b - a),
                                            frame_format=encoded.frame_format)))
    return out


def write_index(loc: PackLocation, index: StreamIndex) -> None:
    """Commit: publish the index that lists every committed shard (atomic replace / PUT)."""
    write_bytes_atomic(loc, index_file(index.stream), index.to_bytes())


def write_done(cfg: PrepackConfig, loc: PackLocation, index: StreamIndex,
               accounting: "Callable[[int], dict]") -> StreamSummary:
    """A stream's end, in one place: compact its lineage into one file, write ``done.json`` (its
    totals from the index; ``accounting(lineage_rows)`` the rest: drops, warnings, examples, group
    counts, timings), then delete the shard lineage files it replaces.  Used by a packed stream
    (``prepack.run.stream_job.finish_stream``) and a balanced one (``prepack.run.sample_balance``)."""
    stream = index.stream
    lineage_sha, rows = compact_lineage(loc, index) if index.shards else ("", 0)
    records = [r for sh in index.shards for r in sh.records]
    rank, worker = cfg.stream_rank_worker(stream)
    summary = StreamSummary(
        stream=stream, rank=rank, worker=worker, seed=cfg.stream_seed(stream), num_shards=len(index.shards),
        num_records=len(records), num_tokens=sum(r.num_tokens for r in records),
        num_samples=sum(r.num_samples for r in records), root=index.root, budget=cfg.prepack.budget(),
        lineage_sha256=lineage_sha, lineage_rows=rows, **accounting(rows))
    write_bytes_atomic(loc, done_file(stream), summary.to_json().encode())
    for entry in index.shards:  # the stream's lineage file now holds these rows
        try:
            loc.fs.delete_file(loc.path(shard_lineage_file(stream, entry.shard)))
        except FileNotFoundError:
            pass
    return summary
