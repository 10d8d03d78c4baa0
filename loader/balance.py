"""Which rank computes which of an optimizer step's batches, and in which micro-step (issues 44, 50).

Why: batches of equal tokens are not equal compute (``schemas.cost``), and ranks wait for each
other.  NeMo's BAGEL recipe (and upstream BAGEL) divide the CE and MSE losses by the token counts
of the whole optimizer step, so which rank computes which of a step's W x M batches, and in which
of its M micro-steps, does not change the step's gradient (beyond float summation order).  What
to even out depends on where the ranks wait (``Balance.sync``):

- **lockstep** (FSDP / ZeRO-3, or DDP without ``no_sync``; both BAGEL stacks, NeMo's recipe
  included, which does not even defer FSDP's gradient sync): every layer of every micro-batch
  all-gathers parameters and reduce-scatters gradients, collectives every rank joins.  A
  micro-step lasts as long as its slowest rank in each segment (``schemas.cost.SEGMENTS``: the
  VAE encode, the ViT layers, the LLM layers), and the step is the sum of its micro-steps
  (``lockstep_time``).  So what matters is which batches share a micro-step: ``assign_lockstep``.
- **step** (DDP under ``no_sync``): ranks meet once, at the step's end; the step lasts as long as
  the largest rank sum.  ``assign_step`` deals the batches, M a rank, to even those sums.

Both are pure functions of the step's costs: every rank computes the same assignment from the
index alone, without communication, one step at a time.  Costs are first quantized to integers
(``schemas.cost.quantize``), so every sum is exact and no comparison can come out differently on
another machine or in another summation order.  Both return the reference assignment (rank r
computes batches r*M .. r*M+M-1, its j-th in micro-step j) unless they are strictly better by
their own model; at M = 1 or W = 1 every assignment is the same step, and the reference is kept.

**assign_lockstep** (issue 50: at most 0.93 of the reference at W=64, M=4 by the H200's per-part
timings; cheap at W=512, M=8): the step's batches are grouped W at a time in sorted order by each
segment's cost, and by the total; the grouping with the least summed maxima (the reference's
grouping among the candidates) is improved by best-improvement swaps between micro-steps (only a
batch that is its micro-step's maximum in some segment can lower anything, so a round weighs
those against every other batch: O(M x S x W x M)).  Sorting by the VAE cost usually wins: the
VAE varies most between batches.  ``lockstep_bound`` (each segment grouped on its own) is a
lower bound no grouping beats; it is not reachable when the segments disagree.  Within a
micro-step the ranks are interchangeable under lockstep; the batches are dealt so that the
ranks' sums stay even too (``_deal_ranks``).

**assign_step** (issue 44: within 3% of the ideal at W=64, M=4): balanced largest differencing
(Karmarkar-Karp for W subsets of exactly M items: the sorted costs in M rows of W, each row a
partial partition; repeatedly the two partitions of largest spread are merged, the heaviest subset
of one with the lightest of the other), then pairwise swaps between the heaviest rank and any other
while a swap lowers the heavier of the two below the heaviest's load (each swap strictly lowers the
sorted loads, so it ends).  Each rank's batches in ascending reference order.

``Balance`` is the one setting a loader takes (M, the sync kind, the cost model).
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np
import xxhash

from schemas.cost import CostModel, quantize
from schemas.errors import UsageError

# swaps stop within this of the lower bound: 10x below the cost model's own error (schemas.cost)
GOOD_ENOUGH = 1e-3
_MAX = np.iinfo(np.int64).max


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
    q = quantize(c, "assign_step")
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


# --- lockstep: which batches share a micro-step ------------------------------------------------------
def _check_segments(segment_costs: np.ndarray, world_size: int, micro_batches: int) -> np.ndarray:
    if int(world_size) < 1 or int(micro_batches) < 1:
        raise UsageError(f"world size {world_size} and micro-batches {micro_batches} must be >= 1")
    c = np.asarray(segment_costs)
    if c.ndim != 2 or c.shape[0] != world_size * micro_batches:
        raise UsageError(f"a step of W={world_size} ranks x M={micro_batches} micro-batches has "
                         f"{world_size * micro_batches} batches; got segment costs of shape {c.shape}")
    return c


def _group_maxima(q: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """(M, S): each micro-step's slowest batch per segment; ``groups`` (M, W) indices into q."""
    return q[groups].max(axis=1)


def lockstep_time(segment_costs: np.ndarray, world_size: int, micro_batches: int,
                  assignment: np.ndarray | None = None) -> float:
    """The step's time when ranks wait for each other in every segment of every micro-step: the sum
    over micro-steps j and segments of the slowest rank's cost there.  ``assignment`` (W, M): rank
    r computes batch ``assignment[r, j]`` in micro-step j (the reference when None)."""
    c = np.asarray(_check_segments(segment_costs, world_size, micro_batches), np.float64)
    a = reference_assignment(world_size, micro_batches) if assignment is None else np.asarray(assignment)
    if a.shape != (world_size, micro_batches):
        raise UsageError(f"an assignment of W={world_size} x M={micro_batches} has that shape; got {a.shape}")
    return float(_group_maxima(c, a.T).sum())


def _sorted_groups(q: np.ndarray, key: np.ndarray, world_size: int) -> np.ndarray:
    """Micro-steps of W consecutive batches in ``key`` order (heaviest first, ties by index)."""
    order = np.lexsort((np.arange(len(key)), -key))
    return order.reshape(-1, world_size)


def lockstep_bound(segment_costs: np.ndarray, world_size: int, micro_batches: int) -> float:
    """No grouping into micro-steps is faster than this: each segment grouped on its own.

    For one segment the sum of the micro-steps' maxima is least when the batches are grouped in
    sorted order, W at a time: with the costs sorted, the k-th largest micro-step maximum is at
    least the ((k-1)W+1)-th largest cost (the k-1 micro-steps above it hold only (k-1)W batches),
    and sorted groups reach exactly that.  A grouping serves every segment at once, so its time is
    at least the sum of these per-segment optima (also never below the mean rank's work)."""
    c = np.asarray(_check_segments(segment_costs, world_size, micro_batches), np.float64)
    return float(sum(np.sort(c[:, s])[::-1][::world_size].sum() for s in range(c.shape[1])))


def _swap_groups(q: np.ndarray, groups: np.ndarray, max_rounds: int) -> np.ndarray:
    """Best-improvement swaps of two batches between micro-steps, while one lowers the summed
    maxima.  Only a batch that is its micro-step's maximum in some segment can lower anything, so
    each round weighs those (at most M x S) against every batch of another micro-step."""
    groups = groups.copy()
    m, w = groups.shape
    n, s = q.shape
    where = np.empty(n, np.int64)  # the micro-step of each batch
    slot = np.empty(n, np.int64)
    where[groups.reshape(-1)] = np.repeat(np.arange(m), w)
    slot[groups.reshape(-1)] = np.tile(np.arange(w), m)
    for _ in range(max_rounds):
        vals = q[groups]  # (M, W, S)
        top_at = vals.argmax(axis=1)  # (M, S): slot of each micro-step's maximum
        top1 = np.take_along_axis(vals, top_at[:, None, :], axis=1)[:, 0, :]
        masked = vals.copy()
        np.put_along_axis(masked, top_at[:, None, :], -1, axis=1)
        top2 = masked.max(axis=1) if w > 1 else np.zeros_like(top1)
        top2 = np.maximum(top2, 0)
        # each batch's micro-step maximum without it, per segment
        is_top = np.zeros((m, w, s), bool)
        np.put_along_axis(is_top, top_at[:, None, :], True, axis=1)
        without = np.where(is_top, top2[:, None, :], top1[:, None, :]).reshape(m * w, s)
        without_of = np.empty((n, s), np.int64)
        without_of[groups.reshape(-1)] = without
        crit = np.unique(groups[np.arange(m)[:, None], top_at])  # batches that are a maximum somewhere
        gi, gj = where[crit][:, None], where[None, :]
        new_i = np.maximum(without_of[crit][:, None, :], q[None, :, :])  # crit's micro-step, taking j
        new_j = np.maximum(without_of[None, :, :], q[crit][:, None, :])  # j's micro-step, taking crit
        delta = (new_i + new_j).sum(axis=2) - (top1[gi] + top1[gj]).sum(axis=2)
        delta = np.where(gi != gj, delta, 0)
        k = int(np.argmin(delta))  # ties: the lowest (critical batch, batch)
        if delta.flat[k] >= 0:
            break
        a, b = int(crit[k // n]), k % n
        ga, gb, sa, sb = where[a], where[b], slot[a], slot[b]
        groups[ga, sa], groups[gb, sb] = b, a
        where[a], where[b], slot[a], slot[b] = gb, ga, sb, sa
    return groups


def _deal_ranks(q_total: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """Which rank takes which batch of each micro-step (any, under lockstep): the heaviest batch
    to the rank with the least work so far, micro-step after micro-step, so that the ranks' sums
    also stay even (what a step waits for at its end).  (W, M) indices."""
    m, w = groups.shape
    loads = np.zeros(w, np.int64)
    out = np.empty((w, m), np.int64)
    for j in range(m):
        batches = groups[j][np.lexsort((groups[j], -q_total[groups[j]]))]  # heaviest first, ties by index
        ranks = np.lexsort((np.arange(w), loads))  # least loaded first, ties by rank
        out[ranks, j] = batches
        loads[ranks] += q_total[batches]
    return out


def assign_lockstep(segment_costs: np.ndarray, world_size: int, micro_batches: int) -> np.ndarray:
    """Which batch each rank computes in each micro-step: (W, M) indices into ``segment_costs``
    ((W*M, S): each batch's cost per segment, in the reference order, index r*M + j).

    Candidates: the reference grouping, and the batches grouped W at a time in sorted order by each
    segment's cost and by the total; the best of them (the least summed maxima) is improved by
    swaps (``_swap_groups``).  Micro-steps are then ordered by their first batch, and their batches
    dealt to the ranks (``_deal_ranks``).  The reference assignment is returned unless this is
    strictly faster; the same costs give the same assignment on every machine."""
    c = _check_segments(segment_costs, world_size, micro_batches)
    ref = reference_assignment(world_size, micro_batches)
    if micro_batches == 1 or world_size == 1:
        return ref
    q = quantize(c, "assign_lockstep")
    total = q.sum(axis=1)
    keys = [total] + [q[:, k] for k in range(q.shape[1])]
    candidates = [ref.T] + [_sorted_groups(q, key, world_size) for key in keys]
    score = [int(_group_maxima(q, g).sum()) for g in candidates]
    best = candidates[int(np.argmin(score))]
    groups = _swap_groups(q, best, max_rounds=4 * world_size * micro_batches)
    if int(_group_maxima(q, groups).sum()) >= score[0]:
        return ref
    groups = np.sort(groups, axis=1)
    groups = groups[np.argsort(groups[:, 0], kind="stable")]
    return _deal_ranks(total, groups)


# --- the one setting ---------------------------------------------------------------------------------
SYNC_KINDS = ("lockstep", "step")


@dataclass(frozen=True)
class Balance:
    """How a training's optimizer steps are balanced: what a loader's ``balance=`` takes.

    - ``micro_batches``: M, the batches each rank computes per optimizer step (gradient
      accumulation);
    - ``sync``: where the ranks wait for each other.  ``"lockstep"`` (the default): in every segment
      of every micro-batch (FSDP / ZeRO-3, or DDP without ``no_sync``: both BAGEL stacks, NeMo's
      recipe included), so the step's batches are grouped into micro-steps (``assign_lockstep``).
      ``"step"``: only at the step's end (DDP under ``no_sync``), so each rank's sum over the step
      is evened out (``assign_step``);
    - ``cost_model``: what a batch costs (``schemas.cost.CostModel``); None: the pack's own
      (``PackInfo.cost_model``, its config's ``prepack.cost_model`` or the default).

    Every rank computes the same assignment from the index alone, without communication.
    """

    micro_batches: int = 1
    sync: str = "lockstep"
    cost_model: CostModel | None = None

    def __post_init__(self) -> None:
        m = self.micro_batches
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise UsageError(f"balance: micro_batches must be an integer >= 1, got {m!r}")
        if self.sync not in SYNC_KINDS:
            raise UsageError(f"balance: sync must be one of {', '.join(SYNC_KINDS)}, got {self.sync!r}")
        if self.cost_model is not None and not isinstance(self.cost_model, CostModel):
            raise UsageError(f"balance: cost_model must be a schemas.cost.CostModel, got "
                             f"{type(self.cost_model).__name__}")

    @classmethod
    def of(cls, value: "Balance | bool | Mapping | None") -> "Balance | None":
        """A loader's ``balance=``: None or False (no balancing), True (the defaults), a mapping of
        these fields (``cost_model`` a ``CostModel`` or a file ``CostModel.read`` takes), or one."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, Balance):
            return value
        if isinstance(value, Mapping):
            unknown = sorted(str(k) for k in value if k not in ("micro_batches", "sync", "cost_model"))
            if unknown:
                raise UsageError(f"balance: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} "
                                 "(known: micro_batches, sync, cost_model)")
            fields = dict(value)
            if isinstance(fields.get("cost_model"), str):
                fields["cost_model"] = CostModel.read(fields["cost_model"])
            return cls(**fields)
        raise UsageError(f"balance must be True, a mapping or a loader.Balance, got {type(value).__name__}")

    def with_model(self, model: CostModel) -> "Balance":
        """This setting with ``model`` where it names none."""
        return self if self.cost_model is not None else replace(self, cost_model=model)

    def fingerprint(self) -> str:
        """A short name of how steps are dealt: a state says which dealt its steps (another deals them
        otherwise, so its positions mean something else mid-step).  ``step`` keeps the name states
        had before there was a choice, so they still load."""
        if self.cost_model is None:
            raise UsageError("balance: a fingerprint needs its cost model (with_model)")
        mapping = self.cost_model.to_mapping()
        if self.sync != "step":
            mapping = {**mapping, "sync": self.sync}
        return xxhash.xxh3_64(json.dumps(mapping, sort_keys=True).encode()).hexdigest()

    def assign(self, terms: np.ndarray, world_size: int) -> np.ndarray:
        """Which of a step's batches each rank computes in each micro-step: (W, M) indices into
        ``terms`` ((W*M, len(COST_TERMS)), the step's batches in the reference order)."""
        if self.cost_model is None:
            raise UsageError("balance: assign needs its cost model (with_model)")
        if self.sync == "step":
            return assign_step(self.cost_model.estimate(terms), world_size, self.micro_batches)
        return assign_lockstep(self.cost_model.segments(terms), world_size, self.micro_batches)
