"""``--disk-budget`` for a balanced-samples pack: one ledger for OUT and its reference, kept by the
job that balances OUT.

A balanced shard takes samples from every stream of its step class over the records its
reference shard spans, so its size is known only once the class's reference records are
committed; no stream can reserve room for it alone (``prepack.run.bounded.ahead.DiskShare`` is per
stream).  So the balancing thread (``prepack.run.balance_beside``) keeps the budget.  Each step
class gets its streams' share of it (as ``DiskShare`` gives each stream its own: no class takes the
room another's trainings wait on), counting both packs' files of its streams.  Each round:

- it measures: the reference shards it granted that are not committed yet, each at its most
  (``shard_most``, as ``DiskShare`` reserves), then every file under OUT, counted to its stream's
  class (in that order: a shard committed in between is counted twice, never missed);
- it balances each class within what is left (``sample_balance.Room``: every step's most, from its
  records' real sizes, is taken before it is written; a step that does not fit stops the class,
  which goes on once that room is free);
- it grants the reference's streams their shards (``prepack.run.bounded.grants``): first what the
  class's next balanced shards need, then, while the class has room to spare beyond the twins of
  what its reference holds unbalanced, more, so the reference runs ahead of the balancing.

Never over: what it adds is bounded before it is written, and what others add is granted first.
Never waiting for good: when nothing is in flight and in every class not done even every trim
that could still come (the balanced shards behind the trainings, or behind where they stand when
one waits at a stream's end, since its checkpoints cannot pass that; the reference shards
balanced) leaves no room for the least it holds back, the run stops with ``DiskBudgetTooSmall``,
naming the budget that would have held it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from loader.reader import Pack
from prepack.run.bounded.ahead import (CKPT_BASE_BYTES, PACK_FILES_RESERVE, AheadGate, StreamUse, share_of,
                                       shard_most)
from prepack.run.bounded.grants import write_grant
from prepack.run.bounded.trainings import Trainings
from prepack.run.sample_balance import Room
from schemas.errors import DiskBudgetTooSmall
from schemas.layout import INDEX_NAME, REFERENCE_DIR, TMP_SUFFIX, index_file, parse
from schemas.location import PackLocation
from schemas.streams import step_classes

log = logging.getLogger(__name__)

STUCK_ROUNDS = 3  # rounds in a row, each reading the trainings afresh, before the run is declared stuck
GRANT_SHARDS = 8  # the most shards one grant lets a stream start (each a pause and resume fewer)


@dataclass
class Ledger:
    """One round's view of the folder, per step class ``k`` (its place in ``step_classes``): ``free``
    bytes (its share less what its streams hold, its grants in flight and its margin), and what the
    round's decisions read."""

    free: dict[int, int]
    used: dict[int, int]
    in_flight: dict[int, int]
    records: dict[int, int]  # reference stream -> chain records committed
    balanced: dict[int, int]  # balanced stream -> chain records committed
    index: dict[int, int]  # balanced stream -> its index file's size
    blocked: dict[int, int] = field(default_factory=dict)  # class -> the least it needs free to go on
    reserves: dict[int, int] = field(default_factory=dict)  # reference stream -> its next shard's most


def stream_of(relpath: str) -> "int | None":
    """The stream a file under OUT (or its reference) belongs to, by the layout (None: the pack's own)."""
    if relpath.startswith(REFERENCE_DIR + "/"):
        relpath = relpath[len(REFERENCE_DIR) + 1:]
    if relpath.endswith(TMP_SUFFIX):  # being written: ``temporary`` names it after the file
        relpath = relpath[:-len(TMP_SUFFIX)]
    top = relpath.split("/", 1)[0]
    for name in (relpath, relpath.rsplit(".", 1)[0], f"{top}/{INDEX_NAME}"):
        f = parse(name)
        if f is not None and f.stream is not None:
            return f.stream
    return None


class BalancedBudget:
    """``budget`` bytes for OUT (``out``) and its reference together (``cfg``: OUT's config), each step
    class its streams' share."""

    def __init__(self, budget: int, cfg, out: PackLocation, trainings: Trainings):
        share = share_of(cfg, budget)  # refused before any work where a stream cannot hold three shards
        self.budget, self.out, self.trainings = budget, out, trainings
        self.classes = step_classes(cfg.world_size, cfg.num_workers)
        self.share = {k: share * len(c) for k, c in enumerate(self.classes)}
        self.margin = {k: len(c) * CKPT_BASE_BYTES for k, c in enumerate(self.classes)}  # each ckpt-00000
        self.class_of = {s: k for k, c in enumerate(self.classes) for s in c}
        self.most = shard_most(cfg)
        self.granted: dict[int, int] = {}  # reference stream -> the records it may start a shard below
        self.wanted: dict[int, int] = {}  # class -> free bytes it needs to go on (0: it is not held)
        self._stuck = 0

    def measure(self, reference: Pack, balanced: Pack) -> Ledger:
        records = {s: reference.switch(s) + reference.index(s, refresh=True).num_records
                   for s in range(reference.num_streams)}
        in_flight, reserves = dict.fromkeys(self.share, 0), {}
        for s, g in self.granted.items():
            if g > records[s] and reference.done(s) is None:  # each record granted: a shard at most
                reserves[s] = StreamUse.of(reference, s, refresh=False).reserve(self.most)
                in_flight[self.class_of[s]] += (g - records[s]) * reserves[s]
        done = {s: balanced.switch(s) + balanced.index(s, refresh=True).num_records
                for s in range(balanced.num_streams)}
        used = dict.fromkeys(self.share, 0)
        sizes, base = {}, self.out.path("").rstrip("/") + "/"
        for info in self.out.list("", recursive=True):
            if info.size is not None:
                sizes[info.path] = info.size
                s = stream_of(info.path[len(base):])
                if s is not None:
                    used[self.class_of[s]] += info.size
        index = {s: sizes.get(self.out.path(index_file(s)), 0) for s in done}
        free = {k: self.share[k] - self.margin[k] - used[k] - in_flight[k] for k in self.share}
        return Ledger(free, used, in_flight, records, done, index, reserves=reserves)

    def _reserve(self, reference: Pack, ledger: Ledger, stream: int) -> int:
        """``stream``'s next shard's most, once a round (its index as this round read it)."""
        if stream not in ledger.reserves:
            ledger.reserves[stream] = StreamUse.of(reference, stream, refresh=False).reserve(self.most)
        return ledger.reserves[stream]

    def room(self, ledger: Ledger, k: int) -> "Room | None":
        """The room class ``k`` may take now (None: it waits for more than is free)."""
        if 0 < self.wanted.get(k, 0) > ledger.free[k]:
            ledger.blocked[k] = self.wanted[k]
            return None
        return Room(ledger.free[k], dict(ledger.index))

    def balanced(self, ledger: Ledger, k: int, room: Room) -> None:
        """Class ``k`` balanced within ``room``: what it took is no longer free; what it wants, if held."""
        ledger.free[k] = room.free
        self.wanted[k] = room.wanted
        if room.wanted:
            ledger.blocked[k] = room.wanted

    def grant(self, reference: Pack, ledger: Ledger, k: int, gate: AheadGate) -> int:
        """Grant the reference streams of class ``k`` room for up to ``GRANT_SHARDS`` shards each (as many
        as fit, shared among them), where their trainings let them pack (``gate``: ``--ahead``): first
        those its next balanced shards need; then, while the class has room to spare beyond the
        balanced twins of what its reference holds unbalanced (about as large: the same samples),
        the others, so the reference runs ahead instead of a shard at a time.  A grant of n records
        past what a stream holds lets it start at most n shards (each holds a record at least), so n
        reserves cover it.  The grants given."""
        streams = [s for s in self.classes[k] if reference.done(s) is None and self.granted.get(s, 0) <= ledger.records[s]
                   and gate.holding(s, ledger.records[s]) is None]
        need = needed(reference, ledger, self.classes[k])
        twins = sum(_present_after(reference, s, ledger.balanced[s]) for s in self.classes[k])
        order = sorted(streams, key=lambda s: (s not in need, ledger.records[s]))  # the needed first
        given = 0
        for i, s in enumerate(order):
            reserve = self._reserve(reference, ledger, s)
            spare = ledger.free[k] - twins - reserve * len(self.classes[k])  # the needed ones' room kept
            shards = spare // reserve // (len(order) - i) if spare >= reserve else 0  # shared among those left
            if s in need:
                if reserve > ledger.free[k]:
                    ledger.blocked[k] = min(ledger.blocked.get(k, reserve), reserve)
                    continue
                others = sum(1 for t in order[i:] if t in need)  # the room shared among the needed left
                shards = max(shards, 1, min(need[s], ledger.free[k] // reserve // others))
            if shards:
                self._give(reference, ledger, k, s, shards, reserve)
                given += 1
        return given

    def _give(self, reference: Pack, ledger: Ledger, k: int, stream: int, shards: int, reserve: int) -> None:
        shards = max(1, min(GRANT_SHARDS, shards))
        ledger.free[k] -= shards * reserve
        self.granted[stream] = ledger.records[stream] + shards
        write_grant(reference.location, stream, self.granted[stream])

    def check(self, reference: Pack, balanced: Pack, ledger: Ledger) -> None:
        """DiskBudgetTooSmall after ``STUCK_ROUNDS`` rounds in a row where nothing was in flight and
        every class not done is held back by what cannot fit even after every trim that could
        still come."""
        pending = [k for k, c in enumerate(self.classes) if not all(_complete(reference, ledger, s) for s in c)]
        if any(ledger.in_flight.values()) or not pending or any(k not in ledger.blocked for k in pending):
            self._stuck = 0
            return
        self.trainings.refresh(force=True)
        freeable = self._freeable(reference, balanced, ledger)
        short = {}
        for k in pending:
            kept = ledger.used[k] - freeable[k]
            if kept + ledger.blocked[k] + self.margin[k] <= self.share[k]:
                self._stuck = 0
                return
            short[k] = kept
        self._stuck += 1
        k = max(pending, key=lambda k: (short[k] + ledger.blocked[k] + self.margin[k]) / len(self.classes[k]))
        need = (short[k] + ledger.blocked[k] + self.margin[k]) * sum(map(len, self.classes)) // len(self.classes[k])
        if self._stuck >= STUCK_ROUNDS:
            raise DiskBudgetTooSmall(
                f"--disk-budget {self.budget:,} bytes: streams {self.classes[k]} (a step class) cannot hold in their "
                f"share ({self.share[k]:,} bytes) what no trim can free now ({short[k]:,} bytes: the balanced shards "
                f"the trainings still read or wait behind, the reference shards a balanced step still needs, "
                f"checkpoints, indexes) and the next balanced step or reference shard ({ledger.blocked[k]:,}); the "
                f"run would wait for good. A budget of at least {need + PACK_FILES_RESERVE:,} bytes holds this point "
                "(balanced shards end where their reference shards end, so a class's longest shard and the "
                "reference records it spans must fit at once)")
        log.info("balanced samples: --disk-budget holds nothing more now; waiting for the trainings")

    def _freeable(self, reference: Pack, balanced: Pack, ledger: Ledger) -> dict[int, int]:
        """Per class, the most any trim could still free: balanced shards (behind where the trainings
        stand, when one waits at the end of a stream still to be written), reference shards balanced."""
        waiting = any(self.trainings.reached(s) >= n and not _complete(reference, ledger, s)
                      for s, n in ledger.balanced.items())
        out = dict.fromkeys(self.share, 0)
        for s, n in ledger.balanced.items():
            limit = self.trainings.reached(s) if waiting else n
            out[self.class_of[s]] += _present_before(balanced, s, limit)
        for s in ledger.records:  # behind what s's own balanced stream holds: at least its class's least
            out[self.class_of[s]] += _present_before(reference, s, ledger.balanced.get(s, 0))
        return out


def _complete(reference: Pack, ledger: Ledger, stream: int) -> bool:
    return reference.done(stream) is not None and ledger.balanced[stream] >= ledger.records[stream]


def _present_before(pack: Pack, stream: int, limit: int) -> int:
    """Bytes of ``stream``'s shards not trimmed whose records all lie before ``limit`` (chain)."""
    n, trimmed = pack.switch(stream), pack.trimmed(stream)
    return sum(sh.nbytes for sh in pack.index(stream).shards
               if sh.shard not in trimmed and n + sh.first_record + len(sh.records) <= limit)


def _present_after(pack: Pack, stream: int, start: int) -> int:
    """Bytes of ``stream``'s shards not trimmed holding a record at or past ``start`` (chain)."""
    n, trimmed = pack.switch(stream), pack.trimmed(stream)
    return sum(sh.nbytes for sh in pack.index(stream).shards
               if sh.shard not in trimmed and n + sh.first_record + len(sh.records) > start)


def needed(reference: Pack, ledger: Ledger, streams: list[int]) -> dict[int, int]:
    """The reference streams of one class its next balanced shards need packed further, and how many
    records at least: a stream whose reference has no shard past what is balanced (one), and every
    stream short of the furthest end of those next shards (a balanced shard of s ends where
    reference shard s ends and takes the class's records up to there)."""
    ends = {}
    for s in streams:
        n, index = reference.switch(s), reference.index(s)
        at = max(0, ledger.balanced[s] - n)  # stream-local
        sh = index.shard_of(at) if at < index.num_records else None
        ends[s] = None if sh is None else n + sh.first_record + len(sh.records)
    furthest = max((e for e in ends.values() if e is not None), default=0)
    return {s: max(1, furthest - ledger.records[s]) for s in streams
            if reference.done(s) is None and (ends[s] is None or ledger.records[s] < furthest)}
