"""Streams of batches: one stream in order, or several interleaved round-robin.

The interleaving is the order a K-worker DataLoader yields K independent streams: batch 0 of
each (in list order), then batch 1 of each, ...; a stream that has run out is skipped.  The order
depends only on the streams' lengths, so a position in it is one integer (the number of batches
handed out), which is what resuming needs; while a pack is being written (``follow``) a round
waits for each stream's next record or its end.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pyarrow.fs as pafs

from loader.batch import SimpleCustomBatch, VaeMoments
from loader.prefetch import Prefetcher
from loader.reader import Follow, Pack, iter_records
from schemas.record import record_to_batch


def round_robin(
    has: Callable[[int, int], bool], num_slots: int, start: int = 0, firsts: list[int] | None = None
) -> Iterator[tuple[int, int]]:
    """``(slot, record)`` pairs of the interleaved order, from position ``start`` on.

    ``has(slot, record)`` says whether the slot's stream holds that record (it may wait for it,
    when following a pack being written); a slot is dropped from later rounds once it says no.
    ``firsts[k]`` is the first record of slot k to schedule (records before it were read in an
    earlier run, e.g. by another rank before a world-size change); default all zeros.
    """
    firsts = firsts or [0] * num_slots
    active = list(range(num_slots))
    r = 0
    while active:
        for k in list(active):
            if r < firsts[k]:
                continue
            if not has(k, r):
                active.remove(k)
                continue
            if start > 0:
                start -= 1
                continue
            yield k, r
        r += 1


def interleaved_batches(
    pack: Pack,
    streams: list[int],
    start: int = 0,
    *,
    verify: "bool | str" = True,
    firsts: list[int] | None = None,
    follow: Follow | None = None,
    latents: "Callable[[int, int], VaeMoments | None] | None" = None,
) -> Iterator[tuple[int, int, SimpleCustomBatch]]:
    """``(stream, record, batch)`` for ``streams`` interleaved round-robin, from position ``start``.

    Without ``follow`` each stream ends at the records committed when it is first asked for.
    ``latents(stream, record)``: the record's VAE moments, when batches carry latents (``loader.latents``).
    """
    readers: dict[int, Iterator] = {}
    lengths: dict[int, int] = {}

    def has(slot: int, record: int) -> bool:
        if follow is not None:
            return pack.wait_for(streams[slot], record, follow)
        if slot not in lengths:
            lengths[slot] = pack.num_records(streams[slot])
        return record < lengths[slot]

    try:
        for slot, record in round_robin(has, len(streams), start, firsts):
            reader = readers.get(slot)
            if reader is None:
                reader = readers[slot] = iter_records(pack, streams[slot], record, verify=verify, follow=follow)
            index, rec = next(reader)
            if index != record:  # the index and the schedule disagree: a reader bug, not data
                raise RuntimeError(f"stream {streams[slot]}: expected record {record}, read {index}")
            moments = latents(streams[slot], record) if latents is not None else None
            yield streams[slot], record, SimpleCustomBatch(record_to_batch(rec), moments)
    finally:
        for reader in readers.values():
            reader.close()


def open_stream(
    path: "str | os.PathLike",
    stream: int,
    *,
    verify: "bool | str" = True,
    start: int = 0,
    prefetch: int = 2,
    follow: bool = False,
    poll_s: float = 1.0,
    timeout_s: float | None = None,
    filesystem: pafs.FileSystem | None = None,
) -> Iterator[SimpleCustomBatch]:
    """Iterate one stream's packed batches in order, read and decoded ``prefetch`` batches ahead.

    Reads the shards committed so far, whether the pack is finished or still being packed; with
    ``follow=True`` waits for each next committed shard (polling every ``poll_s`` seconds, giving
    up after ``timeout_s`` without a commit) until the stream is marked done.
    """
    pack = Pack.open(path, filesystem)
    pack.check_stream(stream)  # unknown stream: fail here, not on the prefetch thread
    source = interleaved_batches(pack, [stream], start, verify=verify,
                                 follow=Follow(poll_s, timeout_s) if follow else None)
    return _consume(Prefetcher(source, prefetch, f"prefetch-stream-{stream}"))


def _consume(prefetcher: Prefetcher) -> Iterator[SimpleCustomBatch]:
    try:
        for _, _, batch in prefetcher:
            yield batch
    finally:
        prefetcher.close()
