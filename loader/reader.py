"""Reading a pack: its identity, one stream's index, and its records in order, integrity-checked.

This is the one shard reader: the training loader and every tool (verify, audit, inspect, stats)
read shards through ``read_shard``.  What it checks, before a record reaches anyone:

- the shard file's size (and with ``verify="file"`` its XXH3-128 digest) against the stream index;
- the identity stamped into the shard's schema (stream, shard number, config, tokenizer), so a
  shard copied from another stream or pack is named as such;
- every record's content digest (``schemas.record.record_digest``, compression-independent)
  against the index, after validating its buffers, so corrupted bytes, a truncated or replaced
  file and swapped shards all raise ``PackIntegrityError`` naming the file and the record.

A pack is readable while it is written: a stream's committed shards are exactly the rows of its
``index.arrow``, which is replaced atomically at each commit.

A continuation (``prepack run --continue``) reads as one pack with its parent: stream s is the
parent's first ``after[s]`` records (its own chain counted whole), then the continuation's own;
record numbers, ``num_records``, ``wait_for``, ``record_digest`` and ``iter_records`` count the
whole chain.  The parent is opened when the pack is, and held to the link: its fingerprint, and
the digest of the last record the continuation takes from it in each stream (checked when the
stream is first read), so a parent that changed since is refused, never read.  ``Follow`` makes a reader wait for
the next commit (polling) until the stream's ``done.json`` says it has ended.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.fs as pafs
import xxhash

from schemas.errors import DamagedFile, FollowTimeout, NotAPack, PackIntegrityError, ShardTrimmed, UsageError
from schemas.location import PackLocation, redact_uri, resolve_location
from schemas.views import SeekableView
from schemas.layout import (
    CHECKPOINT_FILES,
    MANIFEST_NAME,
    PACK_INFO_NAME,
    SHARD,
    done_file,
    index_file,
    parse,
    stream_dir,
    stream_lineage_file,
)
from schemas.manifest import (PackSummary, ShardEntry, StreamIndex, StreamSummary, TrimmedShards,
                              expected_shard_metadata)
from schemas.pack_info import PackInfo
from schemas.record import RECORD_SCHEMA, record_digest

_READ_OPTIONS = pa.ipc.IpcReadOptions(use_threads=False)  # one core per reader; parallelism comes from streams
REMOTE_BLOCK = 16 << 20  # what one request of a shard on a store fetches ahead
REMOTE_TAIL = 64 << 10  # what a read in a shard's last bytes (its footer) fetches


class _Blocks(SeekableView):
    """A shard on a store, read through one block of ``REMOTE_BLOCK`` bytes at a time.

    pyarrow reads a record as two reads (its metadata, then its body), each a request to a store,
    and the footer as two more; here a read outside the block fetches the next block from that
    point (a shard no larger than a block whole, a footer with the 64 KiB before it), so a record
    and the records after it cost one request.  Reads of a block or more go straight to the
    file.  The bytes are the file's: every check of ``read_shard`` applies to them unchanged."""

    def __init__(self, raw: pa.NativeFile, size: int, block: int = REMOTE_BLOCK):
        super().__init__(size)
        self._raw, self._block = raw, block
        self._at, self._data = 0, pa.py_buffer(b"")

    def _fetch(self, start: int, n: int) -> pa.Buffer:
        self._raw.seek(start)
        return self._raw.read_buffer(n)

    def read(self, n: int = -1):
        start, end = self._span(n)
        if end <= start:
            return b""
        if not (self._at <= start and end <= self._at + self._data.size):
            if end - start >= self._block:
                return self._fetch(start, end - start)
            at = start
            if self._size <= self._block:  # a small shard: all of it in one request
                at = 0
            elif self._size - start <= min(REMOTE_TAIL, self._block):  # the footer, and what pyarrow reads back
                at = self._size - min(REMOTE_TAIL, self._block)
            self._at, self._data = at, self._fetch(at, min(self._block, self._size - at))
            have = self._at + self._data.size
            if end > have:  # the file ended early (it changed under us): what there is
                self._pos = max(start, have)
                return self._data.slice(start - self._at) if start < have else b""
        return self._data.slice(start - self._at, end - start)


@dataclass(frozen=True)
class Follow:
    """Wait for shards that are not committed yet: poll every ``poll_s`` seconds, give up after
    ``timeout_s`` without a new commit (None: wait as long as the stream is not done)."""

    poll_s: float = 1.0
    timeout_s: float | None = None


@dataclass
class Pack:
    """An opened pack: where it is, its identity (pack.json) and the indexes of the streams read so far."""

    location: PackLocation
    info: PackInfo
    parent: "Pack | None" = None  # what a continuation continues (``info.parent``), opened with it
    _indexes: dict[int, StreamIndex] = field(default_factory=dict, repr=False)
    _done: dict[int, StreamSummary | None] = field(default_factory=dict, repr=False)
    _linked: set[int] = field(default_factory=set, repr=False)  # streams whose parent link was checked

    @classmethod
    def open(cls, path: "str | os.PathLike | PackLocation", filesystem: pafs.FileSystem | None = None) -> "Pack":
        loc = resolve_location(path, filesystem)
        info = PackInfo.open(loc)
        info.check_record_schema(loc.path(PACK_INFO_NAME))
        parent = None
        if info.parent is not None:
            link = info.parent
            try:
                parent = cls.open(link.uri, filesystem if "://" in link.uri else None)  # a store's client for a store
            except NotAPack:
                raise DamagedFile(f"{loc.path(PACK_INFO_NAME)}: continues {link.uri}, which is no longer a pack "
                                  "there (move it back, or re-pack)") from None
            if parent.fingerprint != link.fingerprint:
                raise DamagedFile(f"{loc.path(PACK_INFO_NAME)}: continues {link.uri}, but the pack there is not the "
                                  "one it continued (its fingerprint differs)")
        return cls(loc, info, parent)

    def reopened(self) -> "Pack":
        """This pack (and its parent) with object-store clients of their own (a forked process)."""
        return Pack(self.location.reopened(), self.info, self.parent.reopened() if self.parent else None)

    def fingerprints(self) -> list[str]:
        """This pack's fingerprint, then its parent's, ...: a loader state of any of them loads here
        (its positions are checked against this chain's record digests)."""
        return [self.fingerprint] + (self.parent.fingerprints() if self.parent is not None else [])

    def switch(self, stream: int) -> int:
        """How many of ``stream``'s first records come from the parent (0 for a pack of its own)."""
        if self.parent is None:
            return 0
        self.check_stream(stream)
        if stream not in self._linked:
            self._check_link(stream)
        return self.info.parent.after[stream]

    def _check_link(self, stream: int) -> None:
        link, where = self.info.parent, self.location.path(PACK_INFO_NAME)
        n = link.after[stream]
        if n and not self.parent.wait_for(stream, n - 1, None):
            raise DamagedFile(f"{where}: continues stream {stream} of {link.uri} after record {n - 1}, which it "
                              f"no longer holds ({self.parent.num_records(stream)} records)")
        if n and self.parent.record_digest(stream, n - 1) != link.last[stream]:
            raise DamagedFile(f"{where}: stream {stream} of {link.uri} changed since this pack continued it "
                              f"(record {n - 1} differs)")
        self._linked.add(stream)

    def trimmed(self, stream: int) -> set[int]:
        """The stream's shards whose records file was trimmed (read fresh: a restore may have run)."""
        return set(TrimmedShards.read(self.location, stream).shards)

    def record_digest(self, stream: int, record: int) -> str:
        """The digest of ``record`` of ``stream``, counted over the whole chain."""
        n = self.switch(stream)
        if record < n:
            return self.parent.record_digest(stream, record)
        return self.index(stream).record(record - n).digest

    def record_terms(self, stream: int, record: int) -> tuple[int, ...]:
        """The compute terms (``schemas.cost.COST_TERMS``) of ``record`` of ``stream``, over the whole
        chain, from the index: what balancing a step weighs, without reading the record."""
        n = self.switch(stream)
        if record < n:
            return self.parent.record_terms(stream, record)
        return self.index(stream).record(record - n).terms

    @property
    def identity(self) -> dict:
        """pack.json as plain data (what the manifest stores); typed: ``info``."""
        return self.info.to_dict()

    @property
    def num_streams(self) -> int:
        return self.info.num_streams

    @property
    def world_size(self) -> int:
        return self.info.world_size

    @property
    def num_workers(self) -> int:
        return self.info.num_workers

    @property
    def fingerprint(self) -> str:
        return self.info.fingerprint

    def check_stream(self, stream: int) -> None:
        if not 0 <= stream < self.num_streams:
            raise UsageError(f"stream {stream} is not in this pack ({self.num_streams} streams)")

    def index(self, stream: int, *, refresh: bool = False) -> StreamIndex:
        """The stream's committed shards (read once, or again with ``refresh``); empty before its first commit.

        Never silently less: an index that is missing while anything of the pack says the stream
        has records, or that holds fewer records than the stream's ``done.json``, is ``DamagedFile``.
        """
        if refresh or stream not in self._indexes:
            self.check_stream(stream)
            summary = self._read_done(stream)  # before the index: done.json is written after the last commit
            path = self.location.path(index_file(stream))
            index = StreamIndex.read(self.location, stream)
            if index is None:
                evidence = self._evidence_of_records(stream, summary)
                if evidence:
                    raise DamagedFile(f"{path}: missing, but {evidence}")
                index = StreamIndex(stream, [])
            if summary is not None:
                _check_index_covers(index, summary, path, self.location.path(done_file(stream)))
            old = self._indexes.get(stream)
            if old is not None and index.num_records < old.num_records:
                raise DamagedFile(f"{path}: the stream index shrank from {old.num_records} to {index.num_records} records")
            self._indexes[stream] = index
        return self._indexes[stream]

    def _read_done(self, stream: int) -> StreamSummary | None:
        """The stream's done.json, whatever budget it finished (None when absent)."""
        summary = StreamSummary.read(self.location, stream)
        self._done[stream] = summary
        return summary

    def _evidence_of_records(self, stream: int, summary: StreamSummary | None) -> str:
        """Why a stream without an index must have committed records ("" when nothing says so).

        Written only after shard 0's commit: done.json, the stream's compacted lineage, shard
        files from 1 on, checkpoints from 2 on, and the manifest.  (shard-00000 and ckpt-00001
        alone are what a crash before the first commit leaves.)"""
        if summary is not None and summary.num_records > 0:
            return f"{done_file(stream)} says the stream has {summary.num_records} records"
        loc = self.location
        infos = loc.list(stream_dir(stream))
        for info in sorted(infos, key=lambda i: i.base_name):
            f = parse(f"{stream_dir(stream)}/{info.base_name}")
            if f is not None and ((f.kind == SHARD and f.shard >= 1) or (f.kind in CHECKPOINT_FILES and f.shard >= 2)):
                return f"{stream_dir(stream)}/{info.base_name} exists (written only after the stream's first commit)"
        if loc.fs.get_file_info(loc.path(stream_lineage_file(stream))).type == pafs.FileType.File:
            return f"{stream_lineage_file(stream)} exists (written when the stream finished)"
        summary_of_pack = PackSummary.read(loc)
        if summary_of_pack is None:
            return ""
        listed = [s for s in summary_of_pack.streams if s.stream == stream and s.num_records > 0]
        return f"{MANIFEST_NAME} says the stream has {listed[0].num_records} records" if listed else ""

    def _finished_without_done(self, stream: int) -> bool:
        """Whether the pack has its manifest (every stream finished) while ``stream`` has no done.json.

        A follower would otherwise wait for a done.json that will never come."""
        if self._done.get(stream) is not None:
            return False
        return PackSummary.written(self.location)

    def forget(self, stream: int) -> None:
        """Drop what was read of ``stream`` (tools that walk every stream keep one in memory)."""
        self._indexes.pop(stream, None)
        self._done.pop(stream, None)

    def done(self, stream: int) -> StreamSummary | None:
        """The stream's done.json if it has finished the pack's budget, else None (as of the last
        read of its index)."""
        if stream not in self._done:
            self.index(stream, refresh=True)
        summary = self._done.get(stream)
        if summary is None or summary.budget != self.info.budget:
            return None  # not finished, or finished an earlier, smaller budget: being extended
        return summary

    def num_records(self, stream: int) -> int:
        """Records committed in ``stream`` as of the last read of its index (the whole chain's)."""
        return self.switch(stream) + self.index(stream).num_records

    def wait_for(self, stream: int, record: int, follow: Follow | None) -> bool:
        """Whether ``record`` of ``stream`` (counted over the chain) exists; with ``follow``, wait for
        it until the stream is done."""
        n = self.switch(stream)
        if record < n:
            return True
        return self._wait_for_own(stream, record - n, follow)

    def _wait_for_own(self, stream: int, record: int, follow: Follow | None) -> bool:
        if record < self.index(stream).num_records:
            return True
        if follow is None:
            return False
        last_change = time.monotonic()
        seen = self.index(stream).num_records
        while True:
            n = self.index(stream, refresh=True).num_records  # reads done.json first, then the index
            done = self.done(stream)
            if record < n:
                return True
            if done is not None:
                return False
            if self._finished_without_done(stream):
                raise DamagedFile(f"{self.location.path(done_file(stream))}: missing, but {MANIFEST_NAME} says the "
                                  "pack is finished")
            if n != seen:
                seen, last_change = n, time.monotonic()
            if follow.timeout_s is not None and time.monotonic() - last_change > follow.timeout_s:
                raise FollowTimeout(f"stream {stream}: no new committed shard for {follow.timeout_s:g} s "
                                    f"(waiting for record {record}; {n} committed)")
            time.sleep(follow.poll_s)


def _check_index_covers(index: StreamIndex, summary: StreamSummary, where: str, done_path: str) -> None:
    """The index holds every record the stream's done.json counts, ending a shard with its root
    (an index may hold more: the stream is being extended past that budget)."""
    ends = {sh.first_record + len(sh.records): sh.root for sh in index.shards}
    if summary.num_records == 0 or ends.get(summary.num_records) == summary.root:
        return
    if index.num_records < summary.num_records:
        raise DamagedFile(f"{where}: holds {index.num_records} records, but {done_path} says the stream has "
                          f"{summary.num_records} (an older or damaged index)")
    raise DamagedFile(f"{where}: its records do not end a shard with the digest root {done_path} records "
                      f"(the index and done.json are of different packs, or one is damaged)")


def iter_records(
    pack: Pack, stream: int, start: int = 0, *, verify: "bool | str" = True, follow: Follow | None = None,
    stop: int | None = None,
) -> Iterator[tuple[int, pa.RecordBatch]]:
    """Yield ``(record index, record)`` of one stream from record ``start`` on (committed records only;
    before ``stop`` if given), over the whole chain of a continuation: the parent's records before
    the switch, then its own."""
    n = pack.switch(stream)
    if start < n:
        with contextlib.closing(iter_records(pack.parent, stream, start, verify=verify,
                                             stop=n if stop is None else min(n, stop))) as parent_records:
            yield from parent_records
        start = n
    i = start - n
    while (stop is None or n + i < stop) and pack._wait_for_own(stream, i, follow):
        index = pack.index(stream)
        shard = index.shard_of(i)
        end = len(shard.records) if stop is None else min(len(shard.records), stop - n - shard.first_record)
        with contextlib.closing(read_shard(pack, shard, i - shard.first_record, verify=verify)) as records:
            for j, record in records:
                yield n + j, record
                if j - shard.first_record + 1 >= end:
                    break
        i = shard.first_record + end


def read_shard(
    pack: Pack, shard: ShardEntry, first: int = 0, *, verify: "bool | str" = True, columns: list[str] | None = None
) -> Iterator[tuple[int, pa.RecordBatch]]:
    """Yield ``(stream record index, record)`` of one committed shard from its record ``first`` on.

    ``verify``: False reads as is; True checks size, schema metadata and every record's digest;
    ``"file"`` also the whole file's XXH3-128 digest (reading the file whole first); ``"bytes"`` the
    file's digest and its structure but no record's digest (every byte is as written, and no pixel
    table is decompressed to prove it: what a re-split passing frames through reads).  ``columns`` reads only
    those (a projected read: the other buffers are not read); record digests need every column,
    so a projection checks the file's size, identity and record count only.
    """
    if columns is not None and verify:
        verify = "structure"
    fields = None if columns is None else [RECORD_SCHEMA.get_field_index(c) for c in columns]
    loc = pack.location
    path = loc.path(shard.file)

    def fail(i: int, reason: str) -> PackIntegrityError:
        return PackIntegrityError(path, shard.stream, shard.first_record + i, reason)

    try:
        source = loc.fs.open_input_file(path)
    except FileNotFoundError:
        if shard.shard in pack.trimmed(shard.stream):
            a, b = shard.first_record, shard.first_record + len(shard.records) - 1
            s = shard.stream
            raise ShardTrimmed(f"{path}: trimmed (stream {s} records {a}-{b}, behind the training checkpoints "
                               f"kept); pack it again with: prepack restore {redact_uri(loc.base)} --streams {s} "
                               f"--records {a}-{b}") from None
        raise fail(first, "shard file is missing") from None
    with source:
        size = source.size()
        if verify and size != shard.nbytes:
            raise fail(first, f"shard file is {size} bytes, the stream index says {shard.nbytes} (truncated or replaced)")
        if verify in ("file", "bytes"):
            data = source.read_buffer()
            if xxhash.xxh3_128(memoryview(data)).hexdigest() != shard.xxh3:
                raise fail(first, "shard file digest (XXH3-128) differs from the stream index")
            source = pa.BufferReader(data)
        elif not loc.is_local and fields is None:  # a projection reads a few buffers: those alone, not blocks
            source = pa.PythonFile(_Blocks(source, size), mode="r")
        try:
            options = _READ_OPTIONS if fields is None else pa.ipc.IpcReadOptions(use_threads=False, included_fields=fields)
            reader = pa.ipc.open_file(source, options=options)
        except (pa.ArrowException, OSError) as exc:
            raise fail(first, f"not a readable Arrow IPC file ({exc})") from exc
        if verify:
            meta = {k.decode(): v.decode() for k, v in (reader.schema.metadata or {}).items()}
            wrong = [f"{k}={meta.get(k)!r} (expected {v!r})"
                     for k, v in expected_shard_metadata(pack.info, shard).items() if meta.get(k) != v]
            expected = RECORD_SCHEMA if columns is None else pa.schema([RECORD_SCHEMA.field(c) for c in columns])
            if reader.schema.remove_metadata() != expected:
                wrong.append("its columns differ from this reader's record schema")
            if wrong:
                raise fail(first, "shard belongs elsewhere: " + "; ".join(wrong))
        if reader.num_record_batches != len(shard.records):
            raise fail(first, f"holds {reader.num_record_batches} records, the stream index says {len(shard.records)}")
        for i in range(first, len(shard.records)):
            try:
                record = reader.get_batch(i)
                if verify:  # bounds first: damaged offsets must not make the digest read out of range
                    record.validate(full=True)
                digest = record_digest(record) if verify in (True, "file") else None
            except (pa.ArrowException, OSError, ValueError) as exc:
                raise fail(i, f"cannot decode record ({exc})") from exc
            if digest is not None and digest != shard.records[i].digest:
                raise fail(i, "record content digest differs from the stream index (corrupted, or shard files swapped)")
            yield shard.first_record + i, record
