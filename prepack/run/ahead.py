"""A bounded pack: pack each stream just ahead of the trainings reading it, trim behind them.

``AheadGate.may_pack(stream, records)``: may the stream start another shard, having ``records`` in
its chain?  Only while that is fewer than the furthest training's position (``prepack.run.trainings``)
plus ``ahead``.  A shard once started is finished (readers see whole shards), so a stream holds at
most ``ahead`` plus one shard of batches past the furthest reader.  Readers publish their position
before they would wait for a batch not yet packed, so a packer holding back always hears that they
caught up.  What may be trimmed meanwhile is the trim policy's to say (``prepack.run.trim_policy``);
``JobStreams`` is the job's side: which of its streams may pack now, and its trims every few seconds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from loader.reader import Pack
from prepack.run import trainings as trainings_module
from prepack.run.bound import BoundSpec
from prepack.run.trainings import Trainings
from prepack.run.trim_policy import TrimPolicy
from schemas.location import PackLocation

log = logging.getLogger(__name__)


class AheadGate:
    """``spec.ahead`` read against the trainings of ``pack`` (None ahead: every shard may start)."""

    def __init__(self, spec: BoundSpec, pack: Pack):
        self.spec = spec
        self.trainings = Trainings(spec.progress, pack)

    def may_pack(self, stream: int, records: int) -> bool:
        if self.spec.ahead is None:
            return True
        return records < self.trainings.reached(stream) + self.spec.ahead


@dataclass(frozen=True)
class WaitRule:
    """How a stream waits for its trainings: ``give_up_s`` (None: as long as it takes; then the stream
    returns ``Paused`` and lets its CPU go), ``on_wait`` run at each poll (a job packing in one
    process trims meanwhile)."""

    give_up_s: float | None = None
    on_wait: "Callable[[], None] | None" = None


def wait_to_pack(gate: AheadGate, stream: int, records: int, rule: WaitRule = WaitRule()) -> bool:
    """Wait until ``stream`` may start another shard; False when ``rule.give_up_s`` passed first."""
    start = time.monotonic()
    said = False
    while not gate.may_pack(stream, records):
        if not said:
            log.info("stream %d: %d records packed, training at %d: waiting (--ahead %d)", stream, records,
                     gate.trainings.reached(stream), gate.spec.ahead)
            said = True
        if rule.give_up_s is not None and time.monotonic() - start >= rule.give_up_s:
            return False
        if rule.on_wait is not None:
            rule.on_wait()
        time.sleep(trainings_module.POLL_S)
        gate.trainings.refresh(force=True)
    return True


class JobStreams:
    """The streams of a job not finished yet, and which of them may pack now.  Without a bound every
    stream is ready once; with one (``--ahead``), a stream that returned ``Paused`` is ready again when
    its trainings come close enough, and the job trims its streams behind their kept checkpoints."""

    TRIM_EVERY_S = 5.0

    def __init__(self, loc: PackLocation, todo: list[int], bound: "BoundSpec | None"):
        self.streams: dict[int, int | None] = {s: None for s in todo}  # stream -> chain records when paused
        self.todo = list(todo)  # a finished stream is still read: it is trimmed too
        self.gate: AheadGate | None = None
        self.policy: TrimPolicy | None = None
        self._trimmed_at = -1e9
        if bound is not None and bound.active:
            self.gate = AheadGate(bound, Pack.open(loc))
            self.policy = TrimPolicy.behind_checkpoints(self.gate.trainings, bound.keep)
        self.running: set[int] = set()

    def ready(self) -> list[int]:
        out = []
        for s, records in self.streams.items():
            if s in self.running:
                continue
            if records is None or self.gate is None or self.gate.may_pack(s, records):
                out.append(s)
        return out

    def started(self, stream: int) -> None:
        self.running.add(stream)

    def returned(self, stream: int, paused_at: int | None) -> None:
        """``stream`` returned: finished (``paused_at`` None) or paused with that many chain records."""
        self.running.discard(stream)
        if paused_at is not None:
            self.streams[stream] = paused_at
        else:
            self.streams.pop(stream, None)

    def trim(self, force: bool = False) -> None:
        """Trim this job's streams behind the trainings' kept checkpoints, every few seconds."""
        if self.policy is None or (not force and time.monotonic() - self._trimmed_at < self.TRIM_EVERY_S):
            return
        self._trimmed_at = time.monotonic()
        result = self.policy.apply(self.todo)
        if result.shards:
            log.info("trimmed %d shard(s), %.1f MiB behind the trainings' kept checkpoints",
                     sum(len(v) for v in result.shards.values()), result.freed_bytes / 2**20)

    def idle(self) -> None:
        """Between rounds: trim, and wait a moment when no stream may pack."""
        self.trim()
        if self.streams and not self.ready():
            time.sleep(trainings_module.POLL_S)
