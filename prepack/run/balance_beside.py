"""Balanced samples beside a bounded run (``prepack.balance: samples`` with ``--ahead``/``--progress``).

Without a bound the reference is packed whole and then balanced (``prepack.run.sample_balance``).
Beside trainings that read OUT as it is packed, that would keep them waiting for the whole
reference, and keep a second copy of the pack on disk.  So the reference's streams are packed
ahead of OUT's trainings (``BoundSpec.reads``: they wait on the positions the trainings publish
for OUT, and pack what their step class needs: ``prepack.run.bounded.ahead.StepNeeds``), and this
thread, in the driver, writes each balanced shard as soon as every stream of its step class has
committed the reference records it is re-split from.  It trims the reference's shards once they
are balanced (what packs them again stays), and OUT's behind the trainings' kept checkpoints
(``prepack restore`` re-splits them from the reference).  The balanced shards are the ones a run
without a bound writes, byte for byte: each ends where its reference shard ends.
"""

from __future__ import annotations

import logging
import threading
import time

from loader.reader import Pack
from prepack.engine.tokenizer import recorded_fingerprint
from prepack.run.bounded import trainings as trainings_module
from prepack.run.bounded.bound import BoundSpec
from prepack.run.bounded.trainings import Trainings
from prepack.run.bounded.trim_policy import TrimPolicy
from prepack.run.commit.writer import ShardFormat
from prepack.run.sample_balance import SHARD_NEVER_ENDS, Balancing, balance_class
from schemas.config import PrepackConfig
from schemas.cost import CostModel
from schemas.errors import NotAPack, StreamFailed
from schemas.location import PackLocation
from schemas.streams import step_classes

log = logging.getLogger(__name__)

TRIM_EVERY_S = 5.0


class BalancingBeside:
    """The balancing thread of a bounded balanced-samples run over OUT (``loc``), whose reference is
    packed at ``ref_out`` meanwhile.  ``check()`` raises once it failed (the reference's run stops
    then: its streams would wait for good on trainings that wait on this); ``close()`` stops it."""

    def __init__(self, cfg: PrepackConfig, loc: PackLocation, metadata: dict[str, str], ref_out: str,
                 tokenizer: tuple, bound: BoundSpec):
        self.cfg, self.loc, self.ref_out, self.tokenizer, self.bound = cfg, loc, ref_out, tokenizer, bound
        self.how = Balancing(ShardFormat(SHARD_NEVER_ENDS, cfg.prepack.compression, metadata), CostModel.of(cfg),
                             tokenizer)
        self.classes = step_classes(cfg.world_size, cfg.num_workers)
        self.fingerprint = recorded_fingerprint(tokenizer[0])
        self.balanced: dict[int, int] = {}  # stream -> chain records every stream of its class has balanced
        self.error: "BaseException | None" = None
        self._stop = threading.Event()
        self._trimmed_at = -1e9
        self._reference: "Pack | None" = None
        self._stops: dict[int, int] = {}  # class -> the reference records it was last balanced up to
        self._policies: "tuple[TrimPolicy, TrimPolicy] | None" = None  # (the reference's, OUT's)
        self._thread = threading.Thread(target=self._run, name="prepack-balancing", daemon=True)

    def start(self) -> "BalancingBeside":
        self._thread.start()
        return self

    def check(self) -> None:
        if self.error is not None:
            raise StreamFailed(f"balancing OUT beside its reference failed: {type(self.error).__name__}: {self.error}")

    def close(self) -> None:
        """Stop after the round in progress (raise what failed it), and trim a last time."""
        self._stop.set()
        self._thread.join()
        self.check()
        if self._policies is not None:
            self.trim()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.round()
                self._stop.wait(trainings_module.POLL_S)
        except BaseException as e:  # noqa: BLE001 (raised in the driver by check() and close())
            log.exception("balancing beside the reference failed")
            self.error = e

    def _opened(self) -> "Pack | None":
        if self._reference is None:
            try:
                self._reference = Pack.open(self.ref_out)
            except NotAPack:  # its run has not written pack.json yet
                return None
            trainings = Trainings(self.bound.progress, Pack.open(self.loc))
            self._policies = (TrimPolicy(self._reference, lambda s: self.balanced.get(s, 0), self.fingerprint),
                              TrimPolicy.behind_checkpoints(trainings, self.bound.keep, self.fingerprint))
        return self._reference

    def round(self) -> None:
        """Write every balanced shard whose reference records are committed, and trim the reference
        shards that balanced at once (they are a second copy); OUT behind its trainings every few seconds."""
        reference = self._opened()
        if reference is None:
            return
        for k, streams in enumerate(self.classes):
            stop = min(reference.switch(t) + reference.index(t, refresh=True).num_records for t in streams)
            if self._stops.get(k) == stop:  # nothing newly committed by every stream of the class
                continue
            done = balance_class(reference, self.loc, streams, self.how, stop)
            self._stops[k] = stop
            if done > self.balanced.get(streams[0], 0):
                self.balanced.update({s: done for s in streams})
                self._trim(0, streams, "reference")
        if time.monotonic() - self._trimmed_at >= TRIM_EVERY_S:
            self._trimmed_at = time.monotonic()
            self._trim(1, sorted(s for s, n in self.balanced.items() if n > 0), "balanced")

    def _trim(self, which: int, streams: list[int], what: str) -> None:
        """``which``: the reference's policy (behind what every stream of a class has balanced) or OUT's
        (behind its trainings' kept checkpoints)."""
        result = self._policies[which].apply(streams)
        if result.shards:
            log.info("trimmed %d %s shard(s), %.1f MiB (balanced samples)",
                     sum(len(v) for v in result.shards.values()), what, result.freed_bytes / 2**20)

    def trim(self) -> None:
        """Both, once (the run's end)."""
        ready = sorted(s for s, n in self.balanced.items() if n > 0)
        self._trim(0, ready, "reference")
        self._trim(1, ready, "balanced")
