"""How unequal a pack's optimizer steps are across ranks, and what balancing them would give.

A step of W ranks x M micro-batches lasts as long as its slowest rank.  Per step, its W x M batches'
estimated costs (``schemas.cost``: the terms the stream index stores, through a ``CostModel``)
give the slowest rank's sum over the mean rank sum for the reference assignment (rank r's own
micro-batches) and for the balanced one (``loader.balance.assign_step``), and the ideal (no
assignment can beat the mean, nor the largest batch plus the M-1 smallest).  ``prepack stats
--world-size W --micro-batches M`` reads the pack's own steps; ``prepack plan`` draws steps from
the batches it sampled (a plan has a few batches, not a run's steps: it says so).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loader.balance import assign_step, ideal_spread, rank_loads
from loader.dataset import streams_for_rank
from loader.reader import Pack
from loader.stream import round_robin
from schemas.config import PrepackConfig
from schemas.cost import CostModel
from schemas.errors import UsageError


@dataclass
class StepSpread:
    """Slowest rank over the mean, averaged over ``steps`` steps; ``*_time``: summed step time (the
    slowest rank's) relative to the reference's."""

    world_size: int
    micro_batches: int
    steps: int
    reference: float
    balanced: float
    ideal: float
    balanced_time: float
    ideal_time: float
    drawn: bool = False  # steps drawn from a sample of batches (a plan), not the pack's own

    def lines(self) -> list[str]:
        if not self.steps:
            return [f"step spread (W={self.world_size}, M={self.micro_batches}): no whole step "
                    f"({self.world_size} x {self.micro_batches} batches) to weigh"]
        how = "steps drawn from the sampled batches" if self.drawn else "steps of this pack"
        return [f"step spread (W={self.world_size}, M={self.micro_batches}, {self.steps:,} {how}; slowest rank / "
                f"mean, by the cost model): reference {self.reference:.3f}, "
                f"balanced batches {self.balanced:.3f} (ideal {self.ideal:.3f}); step time with balance "
                f"{self.balanced_time:.3f} of the reference (ideal {self.ideal_time:.3f})"
                + ("; M=1: batches cannot be rebalanced" if self.micro_batches == 1 else "")]


def cost_model(path: "str | None", config: "PrepackConfig | None" = None) -> "CostModel | None":
    """The model in ``path`` (``--cost-model``), else ``config``'s ``prepack.cost_model``, else the
    default BAGEL-7B one; None without a path or config (a pack's own then: ``PackInfo.cost_model``)."""
    if path:
        return CostModel.read(path)
    if config is None:
        return None
    return CostModel.of(config)


def spread_of_steps(steps: "list[np.ndarray]", world_size: int, micro_batches: int, drawn: bool = False) -> StepSpread:
    """The spread of ``steps``, each the W x M costs in reference order (rank r's j-th at r*M + j)."""
    ref, bal, ideal, t_ref, t_bal, t_ideal = [], [], [], 0.0, 0.0, 0.0
    for costs in steps:
        mean = float(costs.sum()) / world_size
        if mean <= 0:
            continue
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
                      t_ideal / t_ref if t_ref else 1.0, drawn)


def _rank_sequence(pack: Pack, streams: "list[int]") -> "list[tuple[int, int]]":
    """A rank's batches in the order the loader hands them out: its streams round-robin."""
    counts = [pack.num_records(s) for s in streams]
    return [(streams[k], r) for k, r in round_robin(lambda k, r: r < counts[k], len(streams))]


def pack_spread(out, world_size: "int | None", micro_batches: int, model: "CostModel | None" = None) -> StepSpread:
    """The spread of the pack's own steps, read by ``world_size`` ranks (default: the pack's), from its
    indexes alone."""
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
        terms = np.array([pack.record_terms(s, i) for s, i in seq], np.int64).reshape(len(seq), -1)
        ranks.append(model.estimate(terms) if len(seq) else np.zeros(0))
    steps = min(len(c) for c in ranks) // micro_batches
    return spread_of_steps([np.concatenate([c[t * micro_batches:(t + 1) * micro_batches] for c in ranks])
                            for t in range(steps)], w, micro_batches)


def drawn_spread(costs: "np.ndarray | list[float]", world_size: int, micro_batches: int, steps: int = 200,
                 seed: int = 0) -> StepSpread:
    """The spread of ``steps`` steps whose batches are drawn (with replacement, a fixed seed) from
    ``costs``: a plan's sampled batches standing for a run's."""
    costs = np.asarray(costs, np.float64)
    rng = np.random.default_rng([seed, world_size, micro_batches])
    drawn = [costs[rng.integers(0, len(costs), world_size * micro_batches)] for _ in range(steps)] if len(costs) else []
    return spread_of_steps(drawn, world_size, micro_batches, drawn=True)
