"""How unequal a pack's optimizer steps are across ranks, and what balancing them would give.

Per step, its W x M batches' estimated costs (``schemas.cost``: the terms the stream index
stores, through a ``CostModel``) weighed by both step models (``loader.balance``):

- ``lockstep`` (FSDP: ranks wait in every segment of every micro-step): the step's time, the sum
  over micro-steps and segments of the slowest rank, over the mean rank's work, for the reference
  assignment and the balanced one (``assign_lockstep``), and the bound no grouping beats
  (``lockstep_bound``);
- ``step`` (DDP under ``no_sync``: ranks meet at the step's end): the slowest rank's sum over the
  mean rank sum, reference and balanced (``assign_step``), and the ideal (no assignment beats the
  mean, nor the largest batch plus the M-1 smallest).

``prepack stats --world-size W --micro-batches M [--sync KIND]`` reads the pack's own steps;
``prepack plan`` draws steps from the batches it sampled (a plan has a few batches, not a run's
steps: it says so).  Both print both models unless ``--sync`` picks one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loader.balance import (SYNC_KINDS, assign_lockstep, assign_step, ideal_spread, lockstep_bound, lockstep_time,
                            rank_loads)
from loader.dataset import streams_for_rank
from loader.reader import Pack
from loader.stream import round_robin
from schemas.config import PrepackConfig
from schemas.cost import CostModel
from schemas.errors import UsageError


@dataclass
class StepSpread:
    """A step model's figures over ``steps`` steps: step time over the mean rank's work, averaged
    (``reference``, ``balanced``, ``ideal``: the bound); ``*_time``: summed step time relative to
    the reference's.  ``sync``: the step model (``loader.balance.SYNC_KINDS``)."""

    world_size: int
    micro_batches: int
    steps: int
    reference: float
    balanced: float
    ideal: float
    balanced_time: float
    ideal_time: float
    drawn: bool = False  # steps drawn from a sample of batches (a plan), not the pack's own
    sync: str = "step"

    def lines(self) -> list[str]:
        name = f"{self.sync} step spread" if self.sync != "step" else "step spread"
        if not self.steps:
            return [f"{name} (W={self.world_size}, M={self.micro_batches}): no whole step "
                    f"({self.world_size} x {self.micro_batches} batches) to weigh"]
        how = "steps drawn from the sampled batches" if self.drawn else "steps of this pack"
        if self.sync == "lockstep":
            return [f"{name} (W={self.world_size}, M={self.micro_batches}, {self.steps:,} {how}; FSDP: ranks wait "
                    f"in every segment of every micro-step; step time / mean rank's work, by the cost model): "
                    f"reference {self.reference:.3f}, micro-steps balanced {self.balanced:.3f} (bound "
                    f"{self.ideal:.3f}); step time with balance {self.balanced_time:.3f} of the reference (bound "
                    f"{self.ideal_time:.3f})" + ("; M=1: one micro-step, nothing to group" if self.micro_batches == 1
                                                 else "")]
        return [f"{name} (W={self.world_size}, M={self.micro_batches}, {self.steps:,} {how}; DDP under no_sync: "
                f"ranks meet at the step's end; slowest rank / mean, by the cost model): reference "
                f"{self.reference:.3f}, balanced batches {self.balanced:.3f} (ideal {self.ideal:.3f}); step time "
                f"with balance {self.balanced_time:.3f} of the reference (ideal {self.ideal_time:.3f})"
                + ("; M=1: batches cannot be rebalanced" if self.micro_batches == 1 else "")]


def syncs(sync: "str | None") -> "tuple[str, ...]":
    """The step models to print: the one ``--sync`` names, else both."""
    return SYNC_KINDS if sync is None else (sync,)


def cost_model(path: "str | None", config: "PrepackConfig | None" = None) -> "CostModel | None":
    """The model in ``path`` (``--cost-model``), else ``config``'s ``prepack.cost_model``, else the
    default BAGEL-7B one; None without a path or config (a pack's own then: ``PackInfo.cost_model``)."""
    if path:
        return CostModel.read(path)
    if config is None:
        return None
    return CostModel.of(config)


def spread_of_steps(steps: "list[np.ndarray]", world_size: int, micro_batches: int, drawn: bool = False,
                    sync: str = "step") -> StepSpread:
    """The spread of ``steps`` in reference order (rank r's j-th batch at r*M + j): each the W x M
    batches' costs (``sync="step"``) or their costs per segment, (W*M, S) (``sync="lockstep"``)."""
    if sync not in SYNC_KINDS:
        raise UsageError(f"--sync takes one of {', '.join(SYNC_KINDS)}, got {sync!r}")
    ref, bal, ideal, t_ref, t_bal, t_ideal = [], [], [], 0.0, 0.0, 0.0
    for costs in steps:
        mean = float(costs.sum()) / world_size
        if mean <= 0:
            continue
        if sync == "lockstep":
            slowest_ref = lockstep_time(costs, world_size, micro_batches)
            slowest_bal = lockstep_time(costs, world_size, micro_batches,
                                        assign_lockstep(costs, world_size, micro_batches))
            best = lockstep_bound(costs, world_size, micro_batches)
        else:
            slowest_ref = float(rank_loads(costs, world_size, micro_batches).max())
            slowest_bal = float(rank_loads(costs, world_size, micro_batches,
                                           assign_step(costs, world_size, micro_batches)).max())
            best = ideal_spread(costs, world_size, micro_batches) * mean
        ref.append(slowest_ref / mean)
        bal.append(slowest_bal / mean)
        ideal.append(best / mean)
        t_ref, t_bal, t_ideal = t_ref + slowest_ref, t_bal + slowest_bal, t_ideal + best
    n = len(ref)
    return StepSpread(world_size, micro_batches, n, float(np.mean(ref)) if n else 1.0, float(np.mean(bal)) if n else 1.0,
                      float(np.mean(ideal)) if n else 1.0, t_bal / t_ref if t_ref else 1.0,
                      t_ideal / t_ref if t_ref else 1.0, drawn, sync)


def _priced(model: CostModel, terms: np.ndarray, sync: str) -> np.ndarray:
    """What a step model weighs of each batch: its cost, or its cost per segment."""
    return model.segments(terms) if sync == "lockstep" else model.estimate(terms)


def _rank_sequence(pack: Pack, streams: "list[int]") -> "list[tuple[int, int]]":
    """A rank's batches in the order the loader hands them out: its streams round-robin."""
    counts = [pack.num_records(s) for s in streams]
    return [(streams[k], r) for k, r in round_robin(lambda k, r: r < counts[k], len(streams))]


def pack_spread(out, world_size: "int | None", micro_batches: int, model: "CostModel | None" = None,
                syncs: "tuple[str, ...]" = SYNC_KINDS) -> "list[StepSpread]":
    """The spread of the pack's own steps by each step model in ``syncs``, read by ``world_size``
    ranks (default: the pack's), from its indexes alone."""
    pack = Pack.open(out)
    w = world_size or pack.world_size
    if micro_batches < 1:
        raise UsageError(f"--micro-batches takes M >= 1, got {micro_batches}")
    try:
        rank_streams = [streams_for_rank(pack.num_streams, pack.world_size, pack.num_workers, r, w) for r in range(w)]
    except ValueError as e:
        raise UsageError(f"--world-size {w}: {e}") from None
    model = model or pack.info.cost_model()
    ranks = []
    for streams in rank_streams:
        seq = _rank_sequence(pack, streams)
        ranks.append(np.array([pack.record_terms(s, i) for s, i in seq], np.int64).reshape(len(seq), -1))
    m = micro_batches
    steps = [np.concatenate([t[k * m:(k + 1) * m] for t in ranks]) for k in range(min(len(t) for t in ranks) // m)]
    return [spread_of_steps([_priced(model, t, sync) for t in steps], w, m, sync=sync) for sync in syncs]


DRAW_SEED = 0  # a plan's steps are drawn the same way every time


def drawn_spread(terms: np.ndarray, model: CostModel, world_size: int, micro_batches: int, steps: int = 200,
                 syncs: "tuple[str, ...]" = SYNC_KINDS) -> "list[StepSpread]":
    """The spread of ``steps`` steps whose batches are drawn (with replacement, seed ``DRAW_SEED``)
    from batches of these ``terms`` ((n, len(COST_TERMS))): a plan's sampled batches standing for a run's."""
    terms = np.asarray(terms, np.int64).reshape(len(terms), -1)
    rng = np.random.default_rng([DRAW_SEED, world_size, micro_batches])
    drawn = [terms[rng.integers(0, len(terms), world_size * micro_batches)] for _ in range(steps)] if len(terms) else []
    return [spread_of_steps([_priced(model, t, sync) for t in drawn], world_size, micro_batches, drawn=True, sync=sync)
            for sync in syncs]
