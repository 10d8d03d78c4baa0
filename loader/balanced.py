"""Balanced steps: the order in which a rank reads its share of each optimizer step (issues 44, 50).

Why: a step waits for its slowest rank, and batches of equal tokens are not equal compute.
NeMo's BAGEL recipe divides its losses by the whole optimizer step's token counts (summed over
every rank and micro-batch), so which rank computes which of a step's batches, and in which of
its micro-steps, does not change the step's gradient (beyond float summation order).  With M
micro-batches per optimizer step the step's W x M batches are the reference's (rank r's j-th
micro-batch of step t is its reference batch t*M+j); here they are dealt to the ranks and
micro-steps as the ``loader.balance.Balance`` setting says (under FSDP: grouped into micro-steps).

What every rank computes, alike and without communication (``balanced_order``): for step t, each
rank r' of the W's reference batches t*M .. t*M+M-1 -- its streams interleaved round-robin from
where the step starts, exactly the unbalanced dataset's order, streams that ran out skipped --
their compute terms (stored in each stream's index: what ``Pack.record_terms`` returns; never the
records), ``Balance.assign``, and its own row of it: the batch of each micro-step, in order.

End of data: the first step for which some rank's reference holds fewer than M batches is the
pack's tail; from there every rank reads its own reference batches to their end, as without
balance, so every batch is still read exactly once.

Cost at scale (10^8 records): steps are computed one at a time, as they are read, and what they
need of the stream indexes comes through ``loader.index_window.StreamWindows`` (a window of each
stream's costs and digests, not every stream's whole index).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from loader.balance import Balance
from loader.batch import SimpleCustomBatch, VaeMoments
from loader.index_window import StreamWindows
from loader.state import BalancedState, LoaderState, MergedState
from loader.stream import round_robin


@dataclass(frozen=True)
class StepStart:
    """Every stream's next record and last digest at the start of optimizer step ``step``."""

    step: int
    positions: tuple[int, ...]
    last: tuple[str, ...]


@dataclass(frozen=True)
class Placed:
    """Item ``index`` of a rank's balanced sequence: record ``record`` of ``stream``, in the step
    that ``start`` begins; ``after`` is the next step's start (None in the pack's tail)."""

    index: int
    stream: int
    record: int
    start: StepStart
    after: StepStart | None


def fresh_start(num_streams: int) -> StepStart:
    """Step 0 of a run that starts at the pack's beginning."""
    return StepStart(0, (0,) * num_streams, ("",) * num_streams)


def after(item: Placed, workers: int, micro_batches: int) -> tuple[StepStart, int]:
    """Where a DataLoader worker (one of ``workers``) stands once it has handed out ``item``: its
    next item (``item.index + workers``) and the start of that item's step when known, else of
    ``item``'s step (a state then resumes from there and skips to the item)."""
    nxt = item.index + workers
    if item.after is not None and nxt >= item.after.step * micro_batches:
        return item.after, nxt
    return item.start, nxt


@dataclass(frozen=True)
class BalancedRun:
    """What a balanced state belongs to: the pack, this rank of the world, M, how steps are dealt."""

    pack: str  # the pack's fingerprint
    rank: int
    world_size: int
    micro_batches: int
    cost: str  # ``Balance.fingerprint``: the cost model and the sync kind
    streams: tuple[int, ...]  # this rank's own reference streams

    def state(self, start: StepStart, next_item: int, split: tuple[int, int], tail: bool = False) -> BalancedState:
        """The state of DataLoader worker ``split[0]`` of ``split[1]`` whose next item is ``next_item``
        (``tail``: in the pack's tail, ``start`` its first step)."""
        return BalancedState(
            pack=self.pack, rank=self.rank, world_size=self.world_size, micro_batches=self.micro_batches,
            cost=self.cost, worker=split[0], num_workers=split[1], step=start.step,
            offset=next_item - start.step * self.micro_batches, streams=list(self.streams),
            positions=list(start.positions), last=list(start.last), tail=tail)

    def start_of(self, st: LoaderState, num_streams: int) -> tuple[StepStart, int]:
        """Where a loaded state starts this run: the step start and the rank's next item.  A merged
        state (any world size, balanced or not) starts a new run at its positions; a balanced
        state must be this run's (same rank, world size, M, balancing): ``ValueError`` else."""
        merge_hint = "PackedShardDataset.merge_states(<every rank's state at one step boundary>)"
        if isinstance(st, MergedState):
            missing = [s for s in range(num_streams) if s not in st.positions]
            if missing:
                raise ValueError(f"merged loader state lacks streams {missing[:8]}: merge the states of every rank")
            return StepStart(0, tuple(st.positions[s] for s in range(num_streams)),
                             tuple(st.last[s] for s in range(num_streams))), 0
        if not isinstance(st, BalancedState):
            raise ValueError("an unbalanced loader state cannot resume balanced steps: load "
                             "PackedShardDataset.merge_states(<every rank's state>) instead")
        if (st.rank, st.world_size) != (self.rank, self.world_size):
            raise ValueError(f"balanced loader state is for rank {st.rank} of {st.world_size}, this is rank "
                             f"{self.rank} of {self.world_size}; to change the world size, load {merge_hint}")
        if (st.micro_batches, st.cost) != (self.micro_batches, self.cost):
            raise ValueError(f"balanced loader state is for {st.micro_batches} micro-batches and balancing "
                             f"{st.cost} (sync kind and cost model), this dataset has {self.micro_batches} and "
                             f"{self.cost}; to change them, load {merge_hint}")
        if len(st.positions) != num_streams:
            raise ValueError(f"balanced loader state holds {len(st.positions)} streams, the pack {num_streams}")
        return StepStart(st.step, tuple(st.positions), tuple(st.last)), st.next_item


def refuse_a_filled_tail(order: Iterator[Placed], start: StepStart) -> Iterator[Placed]:
    """``order`` resumed from a state taken inside the pack's tail (its steps from ``start`` read
    unbalanced, each rank its own batches), refused where the step it resumes in is now whole (the
    pack was extended): the balanced reading of that step would give some of its batches twice and
    miss others."""
    first = next(order, None)
    if first is not None and first.after is not None:
        raise ValueError(f"this balanced loader state was taken in the pack's last steps (from step {start.step}), "
                         "read unbalanced for want of batches, which the pack has since been extended to fill: "
                         f"resuming there would read some batches twice and miss others; resume from a checkpoint "
                         f"taken before step {start.step}")
    if first is not None:
        yield first
        yield from order


def check_start(windows: StreamWindows, start: StepStart) -> None:
    """Refuse a start whose streams' last records differ from this pack's (another pack's state)."""
    for s, (p, digest) in enumerate(zip(start.positions, start.last)):
        if p and not windows.has(s, p - 1):
            raise ValueError(f"loader state is past the end of stream {s} ({p} records read, "
                             f"{windows.pack.num_records(s)} committed): it belongs to a different pack")
        if p and windows.last_digest(s, p) != digest:
            raise ValueError(f"loader state belongs to a different pack (stream {s}, record {p - 1} differs)")


def _exists(windows: StreamWindows, streams: list[int]) -> Callable[[int, int], bool]:
    return lambda slot, record: windows.has(streams[slot], record)


def _mine(windows: StreamWindows, refs: list[list[tuple[int, int]]], rank: int,
          balance: Balance) -> list[tuple[int, int]]:
    """This rank's share of one step: ``balance.assign`` over the step's terms, micro-step by micro-step."""
    w, m = len(refs), len(refs[0])
    if w == 1 or m == 1:  # every assignment is the same step: the reference
        return refs[rank]
    flat = [item for items in refs for item in items]
    terms = np.stack([windows.terms(s, r) for s, r in flat])
    return [flat[i] for i in balance.assign(terms, w)[rank].tolist()]


def balanced_order(windows: StreamWindows, ranks: list[list[int]], rank: int, balance: Balance,
                   start: StepStart, first: int) -> Iterator[Placed]:
    """Rank ``rank``'s balanced sequence from item ``first`` on (``first >= start.step * M``).

    ``ranks[r]``: rank r's streams in its interleaving order; ``start``: where every stream stands
    at the start of step ``start.step`` (resuming the round-robin from those positions is resuming
    it where it stood).  Steps before the one holding ``first`` are walked without their costs.
    ``balance`` holds its cost model (``Balance.with_model``)."""
    m = balance.micro_batches
    pos, last = list(start.positions), list(start.last)
    orders = [round_robin(_exists(windows, streams), len(streams), 0, [pos[s] for s in streams])
              for streams in ranks]
    mark = start
    while True:
        refs = [[(ranks[r][k], rec) for k, rec in itertools.islice(order, m)] for r, order in enumerate(orders)]
        if any(len(items) < m for items in refs):
            break
        for items in refs:
            for s, rec in items:
                pos[s] = rec + 1
                last[s] = windows.digest(s, rec)
        following = StepStart(mark.step + 1, tuple(pos), tuple(last))
        base = mark.step * m
        if base + m > first:
            for j, (s, rec) in enumerate(_mine(windows, refs, rank, balance)):
                if base + j >= first:
                    yield Placed(base + j, s, rec, mark, following)
        mark = following
    # the tail: this rank's own reference batches to their end
    own = itertools.chain(refs[rank], ((ranks[rank][k], rec) for k, rec in orders[rank]))
    for j, (s, rec) in enumerate(own):
        if mark.step * m + j >= first:
            yield Placed(mark.step * m + j, s, rec, mark, None)


def read_balanced(windows: StreamWindows, items: Iterator[Placed], verify: "bool | str",
                  latents: "Callable[[int, int], VaeMoments | None] | None" = None
                  ) -> Iterator[tuple[Placed, SimpleCustomBatch]]:
    """Each placed item with its batch, read and checked (with its VAE moments from ``latents``)."""
    for item in items:
        yield item, windows.read(item.stream, item.record, verify, latents)
