"""Streams of batches: one stream in order, or several interleaved round-robin.

The interleaving is the order a K-worker DataLoader yields K independent streams: batch 0 of
each (in list order), then batch 1 of each, ...; a stream that has run out is skipped.  Because
every stream's length is in the manifest, the whole order is known up front and a position in
it is one integer (the number of batches handed out), which is what resuming needs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pyarrow.fs as pafs

from loader.batch import SimpleCustomBatch
from loader.prefetch import Prefetcher
from loader.reader import Pack, iter_records
from schemas.record import record_to_batch


def round_robin(lengths: list[int], start: int = 0, firsts: list[int] | None = None) -> Iterator[tuple[int, int]]:
    """``(slot, record)`` pairs of the interleaved order, from position ``start`` on.

    ``firsts[k]`` is the first record of slot k to schedule (records before it were read in an
    earlier run, e.g. by another rank before a world-size change); default all zeros.
    """
    firsts = firsts or [0] * len(lengths)
    rounds = max(lengths, default=0)
    for r in range(rounds):
        active = [k for k, n in enumerate(lengths) if firsts[k] <= r < n]
        if start >= len(active):
            start -= len(active)
            continue
        for k in active[start:]:
            yield k, r
        start = 0


def interleaved_batches(
    pack: Pack, streams: list[int], start: int = 0, *, verify: "bool | str" = True, firsts: list[int] | None = None
) -> Iterator[tuple[int, int, SimpleCustomBatch]]:
    """``(stream, record, batch)`` for ``streams`` interleaved round-robin, from position ``start``."""
    readers: dict[int, Iterator] = {}
    lengths = [pack.num_records(s) for s in streams]
    try:
        for slot, record in round_robin(lengths, start, firsts):
            reader = readers.get(slot)
            if reader is None:
                reader = readers[slot] = iter_records(pack, streams[slot], record, verify=verify)
            index, rec = next(reader)
            if index != record:  # the manifest and the schedule disagree: a reader bug, not data
                raise RuntimeError(f"stream {streams[slot]}: expected record {record}, read {index}")
            yield streams[slot], record, SimpleCustomBatch(record_to_batch(rec))
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
    filesystem: pafs.FileSystem | None = None,
) -> Iterator[SimpleCustomBatch]:
    """Iterate one stream's packed batches in order, read and decoded ``prefetch`` batches ahead."""
    pack = Pack.open(path, filesystem)
    pack.stream(stream)  # unknown stream: fail here, not on the prefetch thread
    return _consume(
        Prefetcher(interleaved_batches(pack, [stream], start, verify=verify), prefetch, f"prefetch-stream-{stream}")
    )


def _consume(prefetcher: Prefetcher) -> Iterator[SimpleCustomBatch]:
    try:
        for _, _, batch in prefetcher:
            yield batch
    finally:
        prefetcher.close()
