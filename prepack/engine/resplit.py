"""Balanced samples' choice (``prepack: balance: samples``): which batch of a step takes each sample.

Why: at M = 1 (upstream BAGEL trains on one packed batch per step) no batch can change rank
without changing the step, but its samples can: a sample attends only to itself, so one without
VAE images computes the same in any batch.  One with a VAE image stays in its reference batch
(the VAE encodes the batch's images on one canvas padded to its largest image, whose mid-block
attention spans them all).  A batch's cost adds up over its samples for every term but the VAE
canvas, and the canvas is fixed by the VAE samples, which stay: so a batch's cost is its fixed
part plus the sum of its samples' costs (``samples_of``).

``prepack.engine.step_split`` cuts and joins the samples this module places.  Costs are
quantized to integers first (``schemas.cost.quantize``): the same input gives the same split on
every machine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from schemas.cost import CANVAS_TERMS, COST_TERMS, CostModel, quantize, sample_terms_of, terms_of
from schemas.errors import UsageError

_MAX = np.iinfo(np.int64).max

@dataclass(frozen=True)
class StepSample:
    """One sample of a step's batch as the re-split sees it."""

    tokens: int  # its sequence length (what the batch's capacity counts)
    cost: float  # what it adds to its batch's estimated cost (ms; ``samples_of``)
    has_vae: bool  # it holds a VAE image: it stays in its reference batch


def samples_of(batch, model: CostModel) -> tuple[list[StepSample], float]:
    """A batch's samples for ``balance_samples`` and its fixed cost (the model's intercept and the
    VAE canvas): the fixed cost plus the samples' costs is ``model.estimate(terms_of(batch))``."""
    per_sample, has_vae = sample_terms_of(batch)
    costs = model.variable(per_sample)
    canvas = np.zeros(len(COST_TERMS), np.int64)
    whole = terms_of(batch)
    for name in CANVAS_TERMS:
        i = COST_TERMS.index(name)
        canvas[i] = whole[i]
    fixed = float(model.estimate(canvas))
    return [StepSample(int(t), float(c), bool(v))
            for t, c, v in zip(per_sample[:, 0].tolist(), costs.tolist(), has_vae.tolist())], fixed


def balance_samples(batches: Sequence[Sequence[StepSample]], capacities: Sequence[int],
                    fixed_costs: Sequence[float] | None = None) -> list[list[tuple[int, int]]]:
    """Re-split one step's samples among its batches: for every output batch, the ``(batch,
    sample)`` it takes, in ascending order.

    Every sample is taken once; a sample with a VAE image stays in its batch; no batch holds more
    tokens than its capacity (or than its reference batch held, where that was more); the most
    costly batch (``fixed_costs[b]`` plus its samples' costs) is as cheap as a local search
    finds, never above the reference's.  Deterministic: the same input, the same split.
    """
    w = len(batches)
    if len(capacities) != w or (fixed_costs is not None and len(fixed_costs) != w):
        raise UsageError(f"{w} batches need {w} capacities and fixed costs; got {len(capacities)} and "
                         f"{w if fixed_costs is None else len(fixed_costs)}")
    ref = np.array([b for b, samples in enumerate(batches) for _ in samples], np.int64)
    place = [(b, s) for b, samples in enumerate(batches) for s in range(len(samples))]
    if not place:
        return [[] for _ in range(w)]
    flat = [x for samples in batches for x in samples]
    tok = np.array([x.tokens for x in flat], np.int64)
    movable = ~np.array([x.has_vae for x in flat], bool)
    fixed = np.zeros(w) if fixed_costs is None else np.asarray(fixed_costs, np.float64)
    q = quantize(np.concatenate([[x.cost for x in flat], fixed]), "balance_samples")
    cost, fq = q[:len(flat)], q[len(flat):]
    cap = np.maximum(np.asarray(capacities, np.int64), np.bincount(ref, tok, w).astype(np.int64))
    problem = _Split(cost, tok, movable, fq, cap)
    best = problem.improve(ref)
    start = problem.greedy(ref)
    if start is not None:
        other = problem.improve(start)
        if problem.worst(other) < problem.worst(best):
            best = other
    out: list[list[tuple[int, int]]] = [[] for _ in range(w)]
    for i, b in enumerate(best.tolist()):
        out[b].append(place[i])
    return out


@dataclass
class _Split:
    """One step's samples (quantized costs, tokens, which may move) and its batches (fixed cost, capacity)."""

    cost: np.ndarray
    tok: np.ndarray
    movable: np.ndarray
    fixed: np.ndarray
    cap: np.ndarray

    def loads(self, at: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        w = len(self.cap)
        cost = self.fixed + np.bincount(at, self.cost, w).astype(np.int64)
        return cost, np.bincount(at, self.tok, w).astype(np.int64)

    def worst(self, at: np.ndarray) -> int:
        return int(self.loads(at)[0].max())

    def greedy(self, ref: np.ndarray) -> np.ndarray | None:
        """Fixed samples where they are, then the movable ones heaviest first, each into the least
        loaded batch with room for it (ties: the lowest batch); None when one fits nowhere."""
        at = np.where(self.movable, -1, ref)
        w = len(self.cap)
        keep = ~self.movable
        load = self.fixed + np.bincount(ref[keep], self.cost[keep], w).astype(np.int64)
        room = self.cap - np.bincount(ref[keep], self.tok[keep], w).astype(np.int64)
        idx = np.flatnonzero(self.movable)
        for i in idx[np.lexsort((idx, -self.cost[idx]))].tolist():
            fits = room >= self.tok[i]
            if not fits.any():
                return None
            b = int(np.argmin(np.where(fits, load, _MAX)))
            at[i] = b
            load[b] += self.cost[i]
            room[b] -= self.tok[i]
        return at

    def improve(self, at: np.ndarray, max_rounds: int | None = None) -> np.ndarray:
        """Moves and swaps of movable samples out of the costliest batch: each round the one that
        leaves the costlier of the two batches cheapest, if that is below the costliest's cost."""
        at = at.copy()
        load, toks = self.loads(at)
        w, n = len(self.cap), len(at)
        batch_ids = np.arange(w)
        for _ in range(max_rounds or 8 * n + 8):
            h = int(np.argmax(load))
            top = int(load[h])
            a = np.flatnonzero((at == h) & self.movable)
            if not len(a):
                break
            ca, ta = self.cost[a][:, None], self.tok[a][:, None]
            # moves: a -> batch o
            dest = load[None, :] + ca
            ok_move = (dest < top) & (toks[None, :] + ta <= self.cap[None, :]) & (batch_ids != h)[None, :]
            move = np.where(ok_move, np.maximum(top - ca, dest), _MAX)
            # swaps: a <-> b (b movable, elsewhere)
            b = np.flatnonzero((at != h) & self.movable)
            d = ca - self.cost[b][None, :]
            ob = at[b]
            other = load[ob][None, :] + d
            dt = ta - self.tok[b][None, :]
            fits = (toks[h] - dt <= self.cap[h]) & (toks[ob][None, :] + dt <= self.cap[ob][None, :])
            ok_swap = (d > 0) & (other < top) & fits
            swap = np.where(ok_swap, np.maximum(top - d, other), _MAX)
            best_move = int(np.argmin(move)) if move.size else 0
            best_swap = int(np.argmin(swap)) if swap.size else 0
            mv = int(move.flat[best_move]) if move.size else _MAX
            sw = int(swap.flat[best_swap]) if swap.size else _MAX
            if min(mv, sw) == _MAX:
                break
            if mv <= sw:  # ties: a move (fewer samples change batch)
                i, o = divmod(best_move, w)
                item = int(a[i])
                at[item] = o
                load[h] -= self.cost[item]
                load[o] += self.cost[item]
                toks[h] -= self.tok[item]
                toks[o] += self.tok[item]
            else:
                i, j = divmod(best_swap, len(b))
                x, y, o = int(a[i]), int(b[j]), int(ob[j])
                at[x], at[y] = o, h
                load[h] -= d[i, j]
                load[o] += d[i, j]
                toks[h] -= dt[i, j]
                toks[o] += dt[i, j]
        return at
