"""A balanced-samples pack (``prepack: balance: samples``): its streams written from its reference.

Such a pack is two packs in one place.  ``OUT/reference/`` is the ordinary pack of the same config
without ``balance`` (every stream the reference's, stream for stream: its checkpoints, audits,
restores); once a worker class's balanced streams are done, its reference shards are trimmed
(``trim_reference``: what packs them again stays), so the finished pack holds no second copy.
Beside trainings (``--ahead``) each balanced shard is written, and its reference trimmed, as soon
as the reference records it is made from are committed (``prepack.run.balance_beside``).
``OUT``'s own streams hold the balanced batches: for each optimizer step at M = 1 (step t of worker
class w is record j = t // K of streams r*K + w, r < W), the W reference batches' samples re-split
among them (``prepack.engine.step_split``).  A trainer reads ``OUT`` like any pack.

Why a second layer and not a second pass in place: a balanced record depends on W streams'
records, so it cannot be re-made from one stream's checkpoint; the reference's records and
checkpoints stay what re-makes it (``prepack audit`` re-splits, ``prepack verify`` compares each
step's samples).  The balanced stream s ends its shards where reference stream s does, so each
stream resumes on its own after a crash (from its committed shards) and a step's split is the
same whichever streams are being written.  A step some stream has no record for (budgets in tokens
or passes end streams unevenly) is left as the reference's.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import pyarrow as pa

from loader.reader import Pack, iter_records
from prepack.engine.step_split import split_step
from prepack.engine.tokenizer import recorded_fingerprint
from prepack.run.bounded.replay import packed_again
from prepack.run.bounded.trim_policy import TrimPolicy
from prepack.run.commit.recovery import recover_stream
from prepack.run.commit.writer import Committing, ShardFormat, StreamWriter, write_done
from schemas.compression import Compression
from schemas.config import PrepackConfig
from schemas.cost import CostModel
from schemas.errors import PackRefused
from schemas.layout import stream_lineage_file
from schemas.lineage import read_lineage
from schemas.location import PackLocation
from schemas.manifest import StreamIndex, StreamSummary
from schemas.packed_batch import PackedBatch
from schemas.pixel_index import read_committed_pixel_index
from schemas.record import batch_to_record, record_to_batch, record_to_framed_batch
from schemas.streams import step_classes

log = logging.getLogger(__name__)
SHARD_NEVER_ENDS = 1 << 62  # shard bytes: a balanced shard ends where its reference shard ends, never by size


class _Frames:
    """Per reference stream, the ``image_digest`` of each picture its pixel index lists, shard by
    shard as its records are read: those pictures pass through a re-split as their frames."""

    def __init__(self, reference: Pack, stream: int, frame_format: str):
        self.reference, self.stream, self.frame_format = reference, stream, frame_format
        self._switch = reference.switch(stream)
        self._shard: int | None = None
        self._known: dict[int, dict[int, int]] = {}

    def batch(self, j: int, record) -> PackedBatch:
        """Record ``j`` of the stream (checked with its shard's file digest) with its frames kept."""
        index = self.reference.index(self.stream)
        shard = index.shard_of(j - self._switch)
        if shard.shard != self._shard:
            self._shard, self._known = shard.shard, {}
            table, _ = read_committed_pixel_index(self.reference.location, self.stream, shard.shard,
                                                  shard.pixels_sha256)
            for rec, img, digest, codec in zip(*(table.column(c).to_pylist()
                                                  for c in ("record", "image", "digest", "codec"))):
                if codec == self.frame_format:
                    self._known.setdefault(rec, {})[img] = digest
        known = self._known.get(j - self._switch - shard.first_record, {})
        return record_to_framed_batch(record, known, self.frame_format)


def reference_batches(reference: Pack, stream: int, start: int, tokenizer: "tuple | None") -> "Iterator[tuple[int, PackedBatch]]":
    """The reference stream's own batches from record ``start`` (counted over a continuation's chain,
    as yielded): read from its shards (their files' digests checked, listed pictures kept as frames:
    ``_Frames``), or, where a shard was trimmed once balanced, packed again from the nearest
    checkpoint kept (``tokenizer``: needed then)."""
    fmt = Compression.parse(reference.info.stored_config().prepack.compression).frame_format
    frames = _Frames(reference, stream, fmt)
    index, trimmed = reference.index(stream), reference.trimmed(stream)
    n = reference.switch(stream)
    start = max(0, start - n)  # stream-local from here
    for sh in index.shards:
        end = sh.first_record + len(sh.records)
        if end <= start:
            continue
        first, start = max(start, sh.first_record), end
        if sh.shard not in trimmed:
            for j, record in iter_records(reference, stream, n + first, verify="bytes", stop=n + end):
                yield j, frames.batch(j, record)
            continue
        if tokenizer is None:
            raise PackRefused(f"{reference.location.path(sh.file)}: the reference shard was trimmed once balanced; "
                              "packing it again needs the tokenizer")
        for j, batch in packed_again(reference.location, index, reference.info.stored_config(), tokenizer,
                                     (first, end)):
            yield n + j, record_to_batch(batch_to_record(batch))  # as read back: no packer-side fields


def balanced_records(reference: Pack, streams: list[int], model: CostModel, start: int = 0,
                     tokenizer: "tuple | None" = None,
                     stop: "int | None" = None) -> "Callable[[], tuple[int, dict[int, PackedBatch]] | None]":
    """A call giving, step after step from record ``start`` (counted over a continuation's chain),
    ``(j, {stream: balanced batch j})`` (only the streams with a record j of their own: a
    continuation's records before its switch are its parent's), then None (at ``stop`` too: the
    steps every stream has committed, while the reference is still packed).  A step is split only
    where every stream has its own record j; the others are the reference's unchanged.  The
    reference's records are read with their shard files' digests checked, and every picture its
    pixel index lists passes through as its compressed frame (no decompressing, no compressing: a
    re-split copies few bytes); a reference shard trimmed once balanced is packed again
    (``reference_batches``)."""
    lengths = {s: reference.num_records(s) for s in streams}
    firsts = {s: max(start, reference.switch(s)) for s in streams}
    its = {s: reference_batches(reference, s, firsts[s], tokenizer) for s in streams if lengths[s] > firsts[s]}
    j = start

    def step() -> "tuple[int, dict[int, PackedBatch]] | None":
        nonlocal j
        if stop is not None and j >= stop:
            return None
        while not (live := [s for s in streams if firsts[s] <= j < lengths[s]]):
            ahead = [firsts[s] for s in streams if j < firsts[s] < lengths[s]]
            if not ahead:
                return None
            j = min(ahead)  # before a stream's switch its records are the parent's: none to write
        batches = {}
        for s in live:
            at, batches[s] = next(its[s])
            assert at == j, (s, at, j)
        if len(live) == len(streams) > 1:
            batches = dict(zip(live, split_step([batches[s] for s in live], model)))
        j += 1
        return j - 1, batches

    return step


@dataclass
class _Out:
    """One balanced stream being written: its index, where its reference shards end, its writer."""

    stream: int
    index: StreamIndex
    ends: list[tuple[int, int]]  # per reference shard: (first record over the chain, records)
    switch: int  # records before the first of its own (a continuation's parent's)
    writer: StreamWriter | None = None

    @property
    def start(self) -> int:
        """The first record this run writes (after the committed shards), over the chain."""
        k = len(self.index.shards)
        return self.ends[k][0] if k < len(self.ends) else self.switch + sum(n for _, n in self.ends)

    def shard_end(self, j: int) -> bool:
        k = len(self.index.shards)
        return k < len(self.ends) and j + 1 == self.ends[k][0] + self.ends[k][1]

    def limit(self, stop: "int | None") -> int:
        """Where this run's writing of the stream ends: the end of its last reference shard within
        ``stop`` (a shard is written whole or not at all), or of them all."""
        ends = [first + n for first, n in self.ends if stop is None or first + n <= stop]
        return max(ends, default=self.switch)


@dataclass(frozen=True)
class Balancing:
    """How balanced streams are written: their shards' ``fmt`` (``SHARD_NEVER_ENDS``: a balanced shard
    ends where its reference shard ends), the cost ``model`` a step is split
    by, and the ``tokenizer`` that packs a reference shard trimmed since again (None: none is)."""

    fmt: ShardFormat
    model: CostModel
    tokenizer: "tuple | None" = None


@dataclass
class Room:
    """What a balancing under ``--disk-budget`` may add to the disk (``prepack.run.bounded.balanced_budget``):
    ``free`` bytes, taken step by step by a sound bound of what the step writes (``step_bytes``);
    ``index`` the size of each balanced stream's index now (rewritten beside the old at each commit).
    Where a step does not fit, the class stops there (its open shards dropped: readers see whole
    shards) and ``wanted`` says what it needs free to go on: that step and the dropped shards again."""

    free: int
    index: dict[int, int]
    wanted: int = 0


RECORD_SLACK = 16 << 10  # a record's IPC message and footer entry, and direct I/O padding
SAMPLE_ROW_BYTES = 2048  # a sample's lineage row, at most
PICTURE_ROW_BYTES = 512  # a picture's pixel index row, at most
SHARD_OPEN_BYTES = 1 << 20  # a shard file's schema and footer, its small files' headers
INDEX_ROW_BYTES = (4 << 10, 256)  # an index row: per shard, per record


def step_bytes(record_size: int, batch: PackedBatch) -> int:
    """The most one balanced record adds: its IPC record (``record_size``, buffers stored as they
    are: ``schemas.compression``) and its rows in the shard's lineage and pixel index."""
    return record_size + RECORD_SLACK + SAMPLE_ROW_BYTES * batch.num_samples \
        + PICTURE_ROW_BYTES * len(batch.image_widths)


def balance_class(reference: Pack, loc: PackLocation, streams: list[int], how: Balancing,
                  stop: "int | None" = None, room: "Room | None" = None) -> int:
    """Write ``streams`` (one worker class of the pack) from the reference, resuming after their
    committed shards (a reference shard trimmed since is packed again: ``how.tokenizer``); their
    ``done.json`` is the caller's.  ``stop``: the records (over the chain) every stream of the class
    has committed in a reference still being packed, by the reference's indexes as last read: only
    the shards ending within it are written now.  ``room``: the disk it may take (``Room``; None:
    any).  The balanced records each stream has committed, the fewest of the class."""
    outs = []
    for s in streams:
        index, n = recover_stream(loc, s), reference.switch(s)
        ends = [(n + sh.first_record, len(sh.records)) for sh in reference.index(s).shards]
        outs.append(_Out(s, index, ends, n))
    start = min(o.start for o in outs)
    limits = {o.stream: o.limit(stop) for o in outs}
    if all(o.start >= limits[o.stream] for o in outs):
        return min(o.start for o in outs)
    step = balanced_records(reference, streams, how.model, start, how.tokenizer, max(limits.values()))
    taken = {o.stream: 0 for o in outs}  # what each stream's open shard took of ``room`` (0: none open)
    last = time.monotonic()
    while (got := step()) is not None:
        j, batches = got
        writes = []
        for o in outs:
            if j < o.start or j >= limits[o.stream] or o.stream not in batches:
                continue
            if o.writer is None:  # the writer's own commit: records, pixel index, lineage, index (no states)
                o.writer = StreamWriter(loc, o.stream, how.fmt, Committing(o.index, None))
            batch = batches[o.stream]
            writes.append((o, batch, o.writer.encode(batch)))
        if room is not None and not _take(room, j, writes, taken):
            break
        for o, batch, encoded in writes:
            o.writer.append(batch, encoded)
            if o.shard_end(j):
                o.writer.finish()
                taken[o.stream] = 0
        if time.monotonic() - last > 30:
            log.info("balanced samples: streams %d..%d at record %d", streams[0], streams[-1], j + 1)
            last = time.monotonic()
    for o in outs:
        if o.writer is not None:
            o.writer.abort()
    return min(o.start for o in outs)


def _take(room: Room, j: int, writes: list, taken: dict[int, int]) -> bool:
    """Take from ``room`` the most step ``j``'s ``writes`` add (a shard opened, a shard committed with
    its index rewritten); False, with ``room.wanted`` set, where it does not fit."""
    costs = []
    for o, batch, encoded in writes:
        cost = step_bytes(pa.ipc.get_record_batch_size(encoded.record), batch)
        cost += SHARD_OPEN_BYTES if taken[o.stream] == 0 else 0
        if o.shard_end(j):
            k = len(o.index.shards)
            grown = room.index.get(o.stream, 0) + INDEX_ROW_BYTES[0] + INDEX_ROW_BYTES[1] * o.ends[k][1]
            cost += 2 * grown  # the new index beside the old until it is renamed over it
            room.index[o.stream] = grown
        costs.append(cost)
    if sum(costs) > room.free:
        room.wanted = sum(costs) + sum(taken.values())
        return False
    room.free -= sum(costs)
    for (o, _, _), cost in zip(writes, costs):
        taken[o.stream] += cost
    return True


def finish_balanced(cfg: PrepackConfig, loc: PackLocation, reference: Pack, stream: int) -> StreamSummary:
    """``done.json`` of a balanced stream: its own totals and lineage, the reference stream's accounting."""
    ref = reference.done(stream)

    def accounting(rows: int) -> dict:
        groups = Counter()
        if rows:
            groups.update(read_lineage(loc.read_bytes(stream_lineage_file(stream))).column("group").to_pylist())
        return dict(drops=ref.drops, warnings=ref.warnings, examples=ref.examples,
                    group_samples=dict(sorted(groups.items())))

    return write_done(cfg, loc, StreamIndex.read(loc, stream), accounting)


def reference_config(cfg: PrepackConfig) -> PrepackConfig:
    """The config of a balanced-samples pack's reference: the same without ``balance`` and ``cost_model``,
    its schedule's steps too (so its identity is the ordinary pack's)."""
    def plain(c: PrepackConfig) -> PrepackConfig:
        return replace(c, prepack=replace(c.prepack, balance="none", cost_model=None))

    return replace(plain(cfg), schedule=tuple(replace(st, config=plain(st.config)) for st in cfg.schedule))


def trim_reference(reference: Pack, streams: list[int], tokenizer: tuple) -> None:
    """Trim the reference shards of ``streams``, whose every record is balanced and committed: no
    second copy of the pack stays, only what packs them again (a ladder of checkpoints, the
    sources each read; ``prepack.run.bounded``).  A shard whose sources changed since is kept."""
    policy = TrimPolicy(reference, lambda s: 1 << 62 if s in streams else 0, recorded_fingerprint(tokenizer[0]))
    for line in policy.apply(streams).lines():
        log.info("balanced samples: the reference of streams %s: %s", streams, line)


def write_balanced(cfg: PrepackConfig, loc: PackLocation, metadata: dict[str, str], reference: Pack,
                   tokenizer: tuple) -> list[StreamSummary]:
    """Write (or finish) every balanced stream of ``loc`` from the finished ``reference``; their
    ``done.json`` once written, and then their reference shards trimmed (``trim_reference``).  A
    stream already done at this budget is kept as it is."""
    how = Balancing(ShardFormat(SHARD_NEVER_ENDS, cfg.prepack.compression, metadata), CostModel.of(cfg), tokenizer)
    budget = cfg.prepack.budget()
    out = {}
    for streams in step_classes(cfg.world_size, cfg.num_workers):
        todo = [s for s in streams if (d := StreamSummary.read(loc, s)) is None or d.budget != budget]
        if todo:
            log.info("balanced samples: writing streams %s from the reference", streams)
            balance_class(reference, loc, streams, how)
        for s in streams:
            out[s] = finish_balanced(cfg, loc, reference, s) if s in todo else StreamSummary.read(loc, s)
        trim_reference(reference, streams, tokenizer)  # also where an earlier run stopped before it
    return [out[s] for s in sorted(out)]
