"""A bounded pack: pack each stream just ahead of the trainings reading it, trim what they keep no
checkpoint before.

The trainings say where they stand through their progress folders (``schemas.progress``, written
by the loader's ``progress=``).  ``Bound`` answers the two questions a bounded run asks, per
stream, in the chain's record numbers (what a loader state counts):

- ``may_pack(stream, records)``: may the stream start another shard, having ``records`` in its
  chain?  Only while that is fewer than the furthest training's position plus ``ahead``.  A shard
  once started is finished (readers see whole shards), so a stream holds at most ``ahead`` plus
  one shard of batches past the furthest reader.  Readers publish their position before they would
  wait for a batch not yet packed, so a packer holding back always hears that they caught up.
- ``trim_before(stream)``: nothing at or after this record may be trimmed: the earliest position,
  over every training, of the K newest checkpoints it published (``--keep-checkpoints``); 0 while
  a training has published fewer than K (a crash may take it back to the start), and 0 for a
  stream whose checkpoint does not match the pack's record digests (a folder of another pack).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from schemas.errors import PackRefused, UsageError

if TYPE_CHECKING:  # schemas.progress (pyarrow) is imported when a bound is used: run's --help stays light
    from schemas.progress import ProgressFolder, TrainingProgress

log = logging.getLogger(__name__)

DEFAULT_KEEP_CHECKPOINTS = 2
POLL_S = 1.0  # how often a waiting stream, or the running job, reads the progress folders again


@dataclass(frozen=True)
class BoundSpec:
    """What the user asked: ``--ahead N`` (None: no limit), ``--progress P...``, ``--keep-checkpoints K``.
    Plain values, so it travels to a stream task as it is."""

    ahead: int | None
    progress: tuple[str, ...]
    keep: int = DEFAULT_KEEP_CHECKPOINTS

    def __post_init__(self):
        if self.ahead is not None and self.ahead < 1:
            raise UsageError(f"--ahead takes a number of batches >= 1, got {self.ahead}")
        if self.ahead is not None and not self.progress:
            raise UsageError("--ahead needs --progress P: the folder (or s3:// prefix) where the training publishes "
                             "its position (PackedShardDataset(..., progress=P))")
        from schemas.progress import MAX_CHECKPOINTS

        if not 1 <= self.keep <= MAX_CHECKPOINTS:
            raise UsageError(f"--keep-checkpoints takes 1..{MAX_CHECKPOINTS}, got {self.keep}")

    @property
    def active(self) -> bool:
        return bool(self.progress)

    def warnings(self) -> list[str]:
        """What the user may not have meant: a checkpoint is published when the loader's state is
        taken, before the training has saved it, so with K=1 a crash during that save rolls back to
        a checkpoint whose batches may be trimmed already (``prepack restore`` brings them back)."""
        if self.active and self.keep == 1:
            return ["--keep-checkpoints 1: a checkpoint counts once the loader's state is taken, before the "
                    "training has saved it; a crash during that save rolls back to the one before, whose batches "
                    "may be trimmed already (prepack restore --state brings them back). The default, 2, covers it."]
        return []


@dataclass
class Bound:
    """``BoundSpec`` read against a pack (``loader.reader.Pack``): the progress folders, re-read at
    most every ``POLL_S`` seconds."""

    spec: BoundSpec
    pack: object  # loader.reader.Pack
    _folders: "list[ProgressFolder]" = field(default_factory=list)
    _read: "list[TrainingProgress]" = field(default_factory=list)
    _at: float = -1e9

    def __post_init__(self):
        from schemas.progress import ProgressFolder

        self._folders = [ProgressFolder(p) for p in self.spec.progress]

    def refresh(self, force: bool = False) -> None:
        if not force and time.monotonic() - self._at < POLL_S:
            return
        self._at = time.monotonic()
        self._read = [f.read() for f in self._folders]
        ours = set(self.pack.fingerprints())
        for folder, got in zip(self._folders, self._read):
            if got.packs - ours:
                raise PackRefused(f"--progress {folder.location.base}: it holds the progress of another pack "
                                  "(a training of another pack, or of this pack before it was made again)")

    def reached(self, stream: int) -> int:
        """The furthest position of any training on ``stream`` (chain records)."""
        self.refresh()
        return max((got.reached(stream) for got in self._read), default=0)

    def may_pack(self, stream: int, records: int) -> bool:
        if self.spec.ahead is None:
            return True
        return records < self.reached(stream) + self.spec.ahead

    def trim_before(self, stream: int) -> int:
        self.refresh()
        before = None
        for got in self._read:
            entry = got.kept(stream, self.spec.keep)
            at = 0 if entry is None else entry.positions[stream]
            if at and not self._matches(stream, at, entry.last.get(stream, "")):
                at = 0
            before = at if before is None else min(before, at)
        return before or 0

    def _matches(self, stream: int, at: int, digest: str) -> bool:
        try:
            if at > self.pack.num_records(stream):  # packed since the index was read (it is read once)
                self.pack.index(stream, refresh=True)
            return self.pack.wait_for(stream, at - 1, None) and self.pack.record_digest(stream, at - 1) == digest
        except (KeyError, IndexError, ValueError, OSError):
            return False


def wait_to_pack(bound: Bound, stream: int, records: int, give_up_s: float | None = None,
                 on_wait: "Callable[[], None] | None" = None) -> bool:
    """Wait until ``stream`` may start another shard; False when ``give_up_s`` passed first (the
    caller then lets its CPU go and is started again later).  ``on_wait`` runs at each poll (a job
    packing in one process trims meanwhile)."""
    start = time.monotonic()
    said = False
    while not bound.may_pack(stream, records):
        if not said:
            log.info("stream %d: %d records packed, training at %d: waiting (--ahead %d)", stream, records,
                     bound.reached(stream), bound.spec.ahead)
            said = True
        if give_up_s is not None and time.monotonic() - start >= give_up_s:
            return False
        if on_wait is not None:
            on_wait()
        time.sleep(POLL_S)
        bound.refresh(force=True)
    return True


def trim_behind(bound: Bound, streams: "list[int]") -> tuple[int, int]:
    """Trim each of ``streams`` behind its training checkpoints; (shards trimmed, bytes freed)."""
    from prepack.run.trim import trim_stream

    n = freed = 0
    for s in streams:
        before = bound.trim_before(s)
        if before:
            shards, b = trim_stream(bound.pack, s, before)
            n, freed = n + len(shards), freed + b
    if n:
        log.info("trimmed %d shard(s), %.1f MiB behind the trainings' kept checkpoints", n, freed / 2**20)
    return n, freed
