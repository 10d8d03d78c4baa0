"""Which rank computes which of an optimizer step's batches, so that no rank waits for another.

Why: a step lasts as long as its slowest rank, and batches of equal tokens are not equal compute
(``schemas.cost``).  NeMo's BAGEL recipe (and upstream BAGEL) divide the CE and MSE losses by the
token counts of the whole optimizer step, so which rank computes which of a step's W x M batches
does not change the step's gradient (beyond float summation order): the batches may be dealt
to the ranks, M each, to even out their sums (the design's "A step that waits for no one rank").

``assign_step`` is a pure function of the step's costs: every rank computes the same assignment
from the index alone, without communication, one step at a time.  Costs are first quantized to
integers (``_quantize``), so every sum is exact and no comparison can come out differently on
another machine or in another summation order.

**Method** (issue 44: within 3% of the ideal at W=64, M=4, cheap at W=512, M=8): balanced
largest differencing (Karmarkar-Karp for W subsets of exactly M items: the sorted costs in M rows
of W, each row a partial partition; repeatedly the two partitions of largest spread are merged,
the heaviest subset of one with the lightest of the other), then pairwise swaps between the
heaviest rank and any other while a swap lowers the heavier of the two below the heaviest's
load (each swap strictly lowers the sorted loads, so it ends).  The result is never worse than
the reference assignment (rank r computing batches r*M .. r*M+M-1): that is returned when it is
not strictly better.  At M = 1 every assignment is the same step time: the reference is kept.

``balance_samples`` is "balanced samples" for M = 1 (a pack-time option): the samples of a
step's W batches re-split among them within each batch's token capacity.  A sample attends only
to itself, so one without VAE images computes the same in any batch; one with a VAE image stays
in its reference batch (the VAE encodes the batch's images on one canvas padded to its largest
image, whose mid-block attention spans them all).  A batch's cost adds up over its samples for
every term but the VAE canvas, and the canvas is fixed by the VAE samples, which stay: so a
batch's cost is its fixed part plus the sum of its samples' costs (``samples_of``).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from schemas.cost import CANVAS_TERMS, COST_TERMS, CostModel, sample_terms_of, terms_of
from schemas.errors import UsageError

_QUANTUM_BITS = 40  # the largest cost becomes 2^40: sums of up to 2^23 costs stay exact in int64
# swaps stop within this of the lower bound: 10x below the cost model's own error (schemas.cost)
GOOD_ENOUGH = 1e-3
_MAX = np.iinfo(np.int64).max


def _quantize(values: np.ndarray, what: str) -> np.ndarray:
    """Non-negative finite costs as int64 on one scale (the largest -> 2^40), exact to ~1e-12."""
    v = np.asarray(values, np.float64)
    if v.size and (not np.isfinite(v).all() or (v < 0).any()):
        raise UsageError(f"{what}: costs must be finite and >= 0")
    top = float(v.max()) if v.size else 0.0
    if top == 0.0:
        return np.zeros(v.shape, np.int64)
    return np.rint(v * (float(1 << _QUANTUM_BITS) / top)).astype(np.int64)


def _check_step(costs: np.ndarray, world_size: int, micro_batches: int) -> np.ndarray:
    if int(world_size) < 1 or int(micro_batches) < 1:
        raise UsageError(f"world size {world_size} and micro-batches {micro_batches} must be >= 1")
    c = np.asarray(costs)
    if c.shape != (world_size * micro_batches,):
        raise UsageError(f"a step of W={world_size} ranks x M={micro_batches} micro-batches has "
                         f"{world_size * micro_batches} batches; got costs of shape {c.shape}")
    return c


def reference_assignment(world_size: int, micro_batches: int) -> np.ndarray:
    """The reference's assignment: rank r computes the step's batches r*M .. r*M+M-1, shape (W, M)."""
    return np.arange(world_size * micro_batches, dtype=np.int64).reshape(world_size, micro_batches)


def _differencing(q: np.ndarray, world_size: int, micro_batches: int) -> np.ndarray:
    """Balanced largest differencing: W subsets of exactly M items, (W, M) indices into q."""
    n = len(q)
    order = np.lexsort((np.arange(n), -q))  # heaviest first, ties by index
    heap = []
    for k in range(micro_batches):  # row k: the k-th W heaviest, one per subset, sums descending
        idx = order[k * world_size:(k + 1) * world_size]
        sums = q[idx]
        heap.append((-int(sums[0] - sums[-1]), k, sums, idx[:, None]))
    heapq.heapify(heap)
    seq = micro_batches
    while len(heap) > 1:
        _, _, sa, ma = heapq.heappop(heap)
        _, _, sb, mb = heapq.heappop(heap)
        sums = sa + sb[::-1]  # the heaviest of one with the lightest of the other
        members = np.concatenate([ma, mb[::-1]], axis=1)
        o = np.argsort(-sums, kind="stable")
        sums, members = sums[o], members[o]
        heapq.heappush(heap, (-int(sums[0] - sums[-1]), seq, sums, members))
        seq += 1
    return heap[0][3]


def _swap_down(q: np.ndarray, members: np.ndarray, bound: int, max_rounds: int) -> np.ndarray:
    """Pairwise swaps between the heaviest subset and any other: each round the swap that leaves
    the heavier of the two lightest, if that is below the heaviest's load; until none is, the
    heaviest is at ``bound``, or ``max_rounds``."""
    members = members.copy()
    w, m = members.shape
    owner = np.empty(len(q), np.int64)
    owner[members.reshape(-1)] = np.repeat(np.arange(w), m)
    loads = q[members].sum(axis=1)
    for _ in range(max_rounds):
        h = int(np.argmax(loads))
        top = int(loads[h])
        if top <= bound:
            break
        d = q[members[h]][:, None] - q[None, :]  # [M, n]: what h gives minus what it takes
        other = loads[owner][None, :] + d
        ok = (d > 0) & (other < top) & (owner != h)[None, :]
        if not ok.any():
            break
        worst = np.where(ok, np.maximum(top - d, other), _MAX)
        i, j = divmod(int(np.argmin(worst)), len(q))  # ties: the lowest (slot, item)
        a, o = int(members[h, i]), int(owner[j])
        members[h, i] = j
        members[o, np.flatnonzero(members[o] == j)[0]] = a
        owner[a], owner[j] = o, h
        loads[h] -= d[i, j]
        loads[o] += d[i, j]
    return members


def assign_step(costs: np.ndarray, world_size: int, micro_batches: int) -> np.ndarray:
    """Which of the step's batches each rank computes: (W, M) indices into ``costs``.

    ``costs`` (W*M,) are in the reference order (index r*M + j: rank r's j-th micro-batch).  Every
    batch is taken exactly once, M per rank, each rank's in ascending reference order; the slowest
    rank's sum is as small as the method (module doc) finds, never above the reference's.  The
    same costs give the same assignment on every machine.
    """
    c = _check_step(costs, world_size, micro_batches)
    ref = reference_assignment(world_size, micro_batches)
    if micro_batches == 1 or world_size == 1:
        return ref
    q = _quantize(c, "assign_step")
    members = _differencing(q, world_size, micro_batches)
    bound = int(_lower_bound(q, world_size, micro_batches) * (1 + GOOD_ENOUGH))
    members = _swap_down(q, members, bound, max_rounds=world_size)
    if q[members].sum(axis=1).max() >= q[ref].sum(axis=1).max():
        return ref
    members = np.sort(members, axis=1)
    return members[np.argsort(members[:, 0], kind="stable")]  # which rank takes which set: by its first batch


def _lower_bound(c: np.ndarray, world_size: int, micro_batches: int):
    """No assignment's slowest rank is below this: the mean rank load, and the largest batch plus
    the M-1 smallest others (the rank holding the largest holds M-1 more)."""
    if len(c) == 0:
        return 0
    s = np.sort(c)
    total = s.sum()
    mean = total / world_size if not np.issubdtype(s.dtype, np.integer) else -(-total // world_size)
    return max(mean, s[-1] + s[:micro_batches - 1].sum())


def rank_loads(costs: np.ndarray, world_size: int, micro_batches: int,
               assignment: np.ndarray | None = None) -> np.ndarray:
    """Each rank's summed cost (W,) under ``assignment`` (the reference when None)."""
    c = np.asarray(_check_step(costs, world_size, micro_batches), np.float64)
    a = reference_assignment(world_size, micro_batches) if assignment is None else np.asarray(assignment)
    if a.shape != (world_size, micro_batches):
        raise UsageError(f"an assignment of W={world_size} x M={micro_batches} has that shape; got {a.shape}")
    return c[a].sum(axis=1)


def step_spread(costs: np.ndarray, world_size: int, micro_batches: int, assignment: np.ndarray | None = None) -> float:
    """The slowest rank's sum over the mean rank's sum (1.0: perfectly even); reference assignment when None."""
    loads = rank_loads(costs, world_size, micro_batches, assignment)
    mean = loads.mean()
    return float(loads.max() / mean) if mean > 0 else 1.0


def ideal_spread(costs: np.ndarray, world_size: int, micro_batches: int) -> float:
    """A lower bound on ``step_spread`` of any assignment (``_lower_bound`` over the mean)."""
    c = np.asarray(_check_step(costs, world_size, micro_batches), np.float64)
    mean = c.sum() / world_size
    return float(_lower_bound(c, world_size, micro_batches) / mean) if mean > 0 else 1.0


# --- balanced samples (M = 1) ------------------------------------------------------------------------
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
    q = _quantize(np.concatenate([[x.cost for x in flat], fixed]), "balance_samples")
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
