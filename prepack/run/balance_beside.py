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
without a bound writes, byte for byte: each ends where its reference shard ends.  Under
``--disk-budget`` it also keeps the budget for OUT and its reference together, granting the
reference's streams their shards one by one (``prepack.run.bounded.balanced_budget``), and the run
ends only once it has balanced everything (``finish``).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace

from loader.reader import Pack
from prepack.engine.tokenizer import recorded_fingerprint
from prepack.run.bounded import trainings as trainings_module
from prepack.run.bounded.ahead import AheadGate
from prepack.run.bounded.balanced_budget import BalancedBudget
from prepack.run.bounded.bound import BoundSpec
from prepack.run.bounded.grants import clear_grants
from prepack.run.bounded.trainings import Trainings
from prepack.run.bounded.trim_policy import TrimPolicy
from prepack.run.commit.writer import ShardFormat
from prepack.run.sample_balance import SHARD_NEVER_ENDS, Balancing, balance_class
from schemas.config import PrepackConfig
from schemas.cost import CostModel
from schemas.errors import DiskBudgetTooSmall, NotAPack, StreamFailed
from schemas.location import PackLocation, resolve_location
from schemas.streams import step_classes

log = logging.getLogger(__name__)

TRIM_EVERY_S = 5.0
AGAIN_S = 0.05  # the pause after a round that wrote or granted something


class BalancingBeside:
    """The balancing thread of a bounded balanced-samples run over OUT (``loc``), whose reference is
    packed at ``ref_out`` meanwhile.  ``check()`` raises once it failed (the reference's run stops
    then: its streams would wait for good on trainings that wait on this); ``close()`` stops it.
    ``bound``: OUT's (``reads`` OUT; with ``disk_budget``, this thread keeps it)."""

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
        self._out: "Pack | None" = None
        self._budget: "BalancedBudget | None" = None
        self._gate: "AheadGate | None" = None  # the reference's --ahead, which a grant heeds
        self._complete = threading.Event()
        self._short = False
        self._thread = threading.Thread(target=self._run, name="prepack-balancing", daemon=True)

    def start(self) -> "BalancingBeside":
        if self.bound.disk_budget is not None:
            clear_grants(resolve_location(self.ref_out))  # a grant of a run before holds no room now
        self._thread.start()
        return self

    def finish(self) -> None:
        """Under ``--disk-budget``, once this job's reference streams are done: wait until every
        balanced stream holds all its reference's records (the budget is this thread's to keep to
        the end, and other jobs' reference streams wait on its grants)."""
        while not self._complete.wait(trainings_module.POLL_S):
            self.check()

    def check(self) -> None:
        if isinstance(self.error, DiskBudgetTooSmall):
            raise DiskBudgetTooSmall(str(self.error))
        if self.error is not None:
            raise StreamFailed(f"balancing OUT beside its reference failed: {type(self.error).__name__}: {self.error}")

    def close(self) -> None:
        """Stop after the round in progress (raise what failed it), and trim a last time."""
        self._stop.set()
        self._thread.join()
        if self.bound.disk_budget is not None:
            clear_grants(resolve_location(self.ref_out))  # nothing packs on them any more
        self.check()
        if self._policies is not None:
            self.trim()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                moved = self.round()  # a round that wrote or granted: the next may find more at once
                self._stop.wait(AGAIN_S if moved else trainings_module.POLL_S)
        except BaseException as e:  # noqa: BLE001 (raised in the driver by check() and close())
            log.exception("balancing beside the reference failed")
            self.error = e

    def _opened(self) -> "Pack | None":
        if self._reference is None:
            try:
                self._reference = Pack.open(self.ref_out)
            except NotAPack:  # its run has not written pack.json yet
                return None
            self._out = Pack.open(self.loc)
            trainings = Trainings(self.bound.progress, self._out)
            self._policies = (TrimPolicy(self._reference, lambda s: self.balanced.get(s, 0), self.fingerprint),
                              TrimPolicy.behind_checkpoints(trainings, self.bound.keep, self.fingerprint))
            if self.bound.disk_budget is not None:
                self._budget = BalancedBudget(self.bound.disk_budget, self.cfg, self.loc, trainings)
                self._gate = AheadGate(replace(self.bound, disk_budget=None), self._reference)
        return self._reference

    def round(self) -> bool:
        """Write every balanced shard whose reference records are committed (within the budget's
        room), and trim the reference shards that balanced at once (they are a second copy); OUT
        behind its trainings every few seconds (each round while the budget holds something back); grant the reference
        the shards the next balanced ones need.  Whether it wrote or granted anything."""
        reference = self._opened()
        if reference is None:
            return False
        moved = False
        budget = self._budget
        ledger = budget.measure(reference, self._out) if budget is not None else None
        for k, streams in enumerate(self.classes):
            stop = min(reference.switch(t) + reference.index(t, refresh=ledger is None).num_records for t in streams)
            room = budget.room(ledger, k) if budget is not None else None
            if budget is not None and room is None:
                continue
            if self._stops.get(k) == stop and not (budget is not None and budget.wanted.get(k)):
                continue  # nothing newly committed by every stream of the class, nothing held for room
            done = balance_class(reference, self.loc, streams, self.how, stop, room)
            self._stops[k] = stop
            if budget is not None:
                budget.balanced(ledger, k, room)
                for s in streams:
                    self._out.index(s, refresh=True)
                    ledger.balanced[s] = self._out.num_records(s)
            if done > self.balanced.get(streams[0], 0):
                moved = True
                self.balanced.update({s: done for s in streams})
                self._trim(0, streams, "reference")
        if self._short or time.monotonic() - self._trimmed_at >= TRIM_EVERY_S:
            self._trimmed_at = time.monotonic()
            self._trim(1, sorted(s for s, n in self.balanced.items() if n > 0), "balanced")
        if budget is None:
            return moved
        for k in range(len(self.classes)):
            moved = budget.grant(reference, ledger, k, self._gate) or moved
        budget.check(reference, self._out, ledger)
        self._short = bool(ledger.blocked)  # the budget held something back: trim OUT each round till it does not
        if all(reference.done(s) is not None and ledger.balanced[s] >= ledger.records[s] for s in ledger.records):
            self._complete.set()
        return moved

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
