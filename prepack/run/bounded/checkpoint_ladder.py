"""Which checkpoints of trimmed shards a trim drops: a bounded pack's disk stays O(window).

A checkpoint carries the overflow buffer's samples with their pixels (up to a few MB), one per
shard, so keeping them all grows a pack with its run however much is trimmed.  A trimmed shard
needs a checkpoint only for a restore (or an audit), and any earlier checkpoint serves: the
restore packs the shards between again, each record checked against its index row and the
state at the end against the dropped checkpoint's recorded digests
(``prepack.run.bounded.replay``).  So behind the trainings only a *ladder* is kept, dense near
the head and sparse far from it: of a stream with ``head`` committed shards, ``ckpt-k`` of a
trimmed shard stays iff ``k`` is a multiple of ``2**(floor(log2(head - k)) - 1)``.  About two stay
per doubling of the distance (``2 log2(head)`` in all: 15 of 160, 25 of 5,000), a restore of a shard
``d`` behind the head packs fewer than ``d`` shards again (``k`` rounded down to a multiple of
``2**(floor(log2 d))`` is on the ladder), and a checkpoint dropped once is never wanted back (the
ladder only thins as the head moves on).  ``ckpt-0`` (the stream's start) and every checkpoint of a
shard that is not trimmed stay; so does one whose restore would pack again a shard that is not
trimmed (a shard the trim kept because it could not be packed again).
"""

from __future__ import annotations

from collections.abc import Iterable


def ladder_keeps(k: int, head: int) -> bool:
    """Whether ``ckpt-k`` is on the ladder of a stream with ``head`` committed shards."""
    distance = head - k
    if k <= 0 or distance <= 2:
        return True
    return k % (1 << (distance.bit_length() - 2)) == 0


def nearest_kept(k: int, dropped: "set[int] | frozenset[int]") -> int:
    """The nearest checkpoint at or before ``ckpt-k`` that is not dropped (``ckpt-0`` never is)."""
    while k > 0 and k in dropped:
        k -= 1
    return k


def to_drop(head: int, trimmed: Iterable[int], dropped: Iterable[int]) -> list[int]:
    """The checkpoints to drop now, of a stream with ``head`` committed shards, ``trimmed`` shards
    and ``dropped`` checkpoints: off the ladder, their shard trimmed, and every shard from the
    nearest checkpoint kept before them trimmed too (so a restore packs again only shards a trim
    found restorable).  One pass over the stream's shards."""
    trimmed, gone = set(trimmed), set(dropped)
    out = []
    clean = 0 in trimmed  # every shard from the nearest checkpoint kept so far (ckpt-0 always) up to k - 1 is trimmed
    for k in range(1, head):
        if k not in gone and (k not in trimmed or ladder_keeps(k, head) or not clean):
            clean = True  # ckpt-k stays: a restore after it starts here
        elif k not in gone:
            out.append(k)
        clean = clean and k in trimmed
    return out
