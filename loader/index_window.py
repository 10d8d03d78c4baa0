"""What the balanced order needs of every stream's index, without holding every stream's index.

A rank under balanced steps (``loader.balanced``) weighs every stream of the pack at every step
but reads only its own batches.  Holding every stream's whole index (the loader's ``Pack`` keeps
each index it reads) would cost every rank, and every DataLoader worker, the index of the whole
pack (~100 bytes a record: gigabytes at 10^8 records).  ``StreamWindows`` keeps per stream how many
records exist, and the compute terms and digests of a window of ``CHUNK`` records, read from the index,
which is then dropped again; only the ``KEEP_INDEXES`` streams read last keep theirs (reading a
record needs its shard's row).  So a rank holds O(streams x CHUNK) numbers, and reads each stream's
index about once per ``CHUNK`` of its records.
"""

from __future__ import annotations

import bisect
import contextlib
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from loader.batch import SimpleCustomBatch, VaeMoments
from loader.reader import Follow, Pack, iter_records
from schemas.cost import COST_TERMS
from schemas.manifest import RecordList
from schemas.record import record_to_batch

CHUNK = 512  # records per stream whose terms and digests are held at a time
KEEP_INDEXES = 32  # stream indexes held for reading records (the least recently read ones are dropped)


def _forget(pack: Pack, stream: int) -> None:
    """Drop what ``pack`` (and the packs it continues) hold of ``stream``'s index."""
    while pack is not None:
        pack.forget(stream)
        pack = pack.parent


def _index_slice(pack: Pack, stream: int, lo: int, hi: int) -> tuple[np.ndarray, bytes]:
    """Terms ``[hi-lo, len(COST_TERMS)]`` and 16-byte digests of records ``lo .. hi-1`` of ``stream``
    (chain records), copied out of the index."""
    terms: list[np.ndarray] = []
    digests: list[bytes] = []
    n = pack.switch(stream)
    if lo < n:
        t, d = _index_slice(pack.parent, stream, lo, min(hi, n))
        terms.append(t)
        digests.append(d)
    if hi > n:
        shards = pack.index(stream).shards
        k = max(0, bisect.bisect_right(shards, max(lo, n) - n, key=lambda sh: sh.first_record) - 1)
        for sh in shards[k:]:
            a, b = max(lo - n, sh.first_record), min(hi - n, sh.first_record + len(sh.records))
            if sh.first_record >= hi - n:
                break
            if a >= b:
                continue
            i, j, recs = a - sh.first_record, b - sh.first_record, sh.records
            if isinstance(recs, RecordList):
                terms.append(np.asarray(recs.terms[i:j], np.int64))
                digests.append(bytes(recs.digests[16 * i:16 * j]))
            else:  # an index built in memory (a writer's): entries
                entries = recs[i:j]
                terms.append(np.array([e.terms for e in entries], np.int64).reshape(len(entries), len(COST_TERMS)))
                digests.append(b"".join(bytes.fromhex(e.digest) for e in entries))
    out = np.concatenate(terms) if terms else np.zeros((0, len(COST_TERMS)), np.int64)
    if len(out) != hi - lo:
        raise RuntimeError(f"stream {stream}: the index holds {len(out)} of records {lo}..{hi - 1}")
    return out, b"".join(digests)


class StreamWindows:
    """What the balanced order needs of each stream's index, read once per window of ``chunk``
    records: whether a record exists, its compute terms, its digest; and reading a record (verified as
    the unbalanced loader does).

    ``follow``: wait for records not committed yet until the stream is done.  Without it a stream
    ends only where its ``done.json`` says: every rank must see the same records, so a stream
    still being packed without ``follow`` is a ``ValueError``."""

    def __init__(self, pack: Pack, follow: Follow | None, *, chunk: int = CHUNK, keep: int = KEEP_INDEXES):
        self.pack, self.follow = pack, follow
        self.chunk, self.keep = chunk, keep
        self._known: dict[int, int] = {}  # stream -> records known to exist
        self._windows: dict[int, tuple[int, np.ndarray, bytes]] = {}  # stream -> (first, terms, digests)
        self._held: OrderedDict[int, None] = OrderedDict()  # streams whose index is kept for reading

    def _release(self, stream: int) -> None:
        if stream not in self._held:
            _forget(self.pack, stream)

    def has(self, stream: int, record: int) -> bool:
        """Whether ``record`` of ``stream`` exists (with ``follow``: waiting for it)."""
        if record < self._known.get(stream, 0):
            return True
        pack = self.pack
        ok = pack.wait_for(stream, record, self.follow)
        if not ok and self.follow is None:
            pack.index(stream, refresh=True)
            ok = pack.wait_for(stream, record, None)
            if not ok and pack.done(stream) is None:
                raise ValueError(f"stream {stream} is still being packed ({pack.num_records(stream)} records "
                                 "committed): balanced steps on a pack being written need follow=True, so that "
                                 "every rank sees the same records")
        self._known[stream] = pack.num_records(stream)
        self._release(stream)
        return ok

    def _window(self, stream: int, record: int) -> tuple[int, np.ndarray, bytes]:
        w = self._windows.get(stream)
        if w is not None and w[0] <= record < w[0] + len(w[2]) // 16:
            return w
        if not self.has(stream, record):
            raise ValueError(f"stream {stream} has no record {record} ({self._known.get(stream, 0)} records)")
        lo = max(0, record - 1)  # the record before too: a step start's digest and its first cost
        terms, digests = _index_slice(self.pack, stream, lo, min(lo + self.chunk, self._known[stream]))
        self._release(stream)
        w = self._windows[stream] = (lo, terms, digests)
        return w

    def terms(self, stream: int, record: int) -> np.ndarray:
        """The record's compute terms (``schemas.cost.COST_TERMS``), from the index."""
        lo, terms, _ = self._window(stream, record)
        return terms[record - lo]

    def digest(self, stream: int, record: int) -> str:
        lo, _, digests = self._window(stream, record)
        return digests[16 * (record - lo):16 * (record - lo + 1)].hex()

    def last_digest(self, stream: int, position: int) -> str:
        """The digest of the record before ``position`` ("" at 0): what a state holds per stream."""
        return self.digest(stream, position - 1) if position else ""

    def read(self, stream: int, record: int, verify: "bool | str",
             latents: "Callable[[int, int], VaeMoments | None] | None" = None) -> SimpleCustomBatch:
        """One record, checked as ``loader.reader.read_shard`` checks every record (with its VAE
        moments from ``latents``, when batches carry latents)."""
        self._held[stream] = None
        self._held.move_to_end(stream)
        while len(self._held) > self.keep:
            _forget(self.pack, self._held.popitem(last=False)[0])
        with contextlib.closing(iter_records(self.pack, stream, record, verify=verify, stop=record + 1)) as records:
            for index, rec in records:
                if index != record:  # the index and the schedule disagree: a reader bug, not data
                    raise RuntimeError(f"stream {stream}: expected record {record}, read {index}")
                return SimpleCustomBatch(record_to_batch(rec), latents(stream, record) if latents else None)
        raise RuntimeError(f"stream {stream}: record {record} was not read")
