"""The loader's resume state, typed: one DataLoader worker's position, or the merge of a run's.

On disk a state is plain values only (ints, strings, lists, dicts with string keys), so JSON and
torch's weights-only loader (NeMo's checkpointer default) restore it in a new process.
``to_dict``/``from_dict`` keep the version-2 shapes every saved state already has:

- one worker's state: ``{"version", "pack", "rank", "world_size", "worker", "num_workers",
  "streams", "cursor", "firsts", "positions", "last"}``; a state saved before ``firsts`` existed
  loads with zeros there, one without ``last`` is not checked against the pack's digests;
- a merged state: ``{"version", "kind": "merged", "pack", "positions": {"<stream>": next record},
  "last": {"<stream>": digest}}``;
- one worker's state under balanced steps (``loader.balanced``): ``{"version", "kind": "balanced",
  "pack", "rank", "world_size", "micro_batches", "cost", "worker", "num_workers", "step", "offset",
  "streams", "positions", "last"}``: the worker's next batch is item ``step*M + offset`` of the
  rank's balanced sequence, ``positions``/``last`` are every stream's next record and last digest
  at the start of optimizer step ``step`` (at a step boundary the batches read are exactly the
  reference's first ``step`` steps of every rank, so those positions say where every rank stands),
  ``streams`` the rank's own reference streams (what its progress files cover).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

STATE_VERSION = 2
MERGED = "merged"
BALANCED = "balanced"


def _check_version(d: Mapping[str, Any]) -> None:
    if d.get("version") != STATE_VERSION:
        raise ValueError(f"unsupported loader state version {d.get('version')!r}")


@dataclass(frozen=True)
class WorkerState:
    """Where one (rank, DataLoader worker) iterator stands after the last batch it handed out."""

    pack: str  # the pack's content fingerprint
    rank: int
    world_size: int
    worker: int
    num_workers: int
    streams: list[int]  # this worker's streams, in interleaving order
    cursor: int  # batches handed out by this iteration
    firsts: list[int]  # per stream, where this iteration started (non-zero after a merge)
    positions: list[int]  # per stream, the next record
    last: list[str] | None  # per stream, the digest of the last record read ("" before the first)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "version": STATE_VERSION,
            "pack": self.pack,
            "rank": self.rank,
            "world_size": self.world_size,
            "worker": self.worker,
            "num_workers": self.num_workers,
            "streams": list(self.streams),
            "cursor": self.cursor,
            "firsts": list(self.firsts),
            "positions": list(self.positions),
        }
        if self.last is not None:
            d["last"] = list(self.last)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "WorkerState":
        _check_version(d)
        positions = [int(p) for p in d["positions"]]
        last = d.get("last")
        return cls(
            pack=d["pack"],
            rank=int(d["rank"]),
            world_size=int(d["world_size"]),
            worker=int(d["worker"]),
            num_workers=int(d["num_workers"]),
            streams=[int(s) for s in d["streams"]],
            cursor=int(d["cursor"]),
            firsts=[int(p) for p in d.get("firsts", [0] * len(positions))],
            positions=positions,
            last=None if last is None else [str(x) for x in last],
        )

    def reads(self) -> Iterator[tuple[int, int, str]]:
        """``(stream, next record, last digest)`` per stream."""
        if self.last is None:
            raise ValueError("a loader state without record digests cannot be merged")
        return zip(self.streams, self.positions, self.last)


@dataclass(frozen=True)
class MergedState:
    """Every stream's next unread record over all ranks and workers of a run: loadable on any rank
    of any world size."""

    pack: str
    positions: dict[int, int]  # stream -> next record
    last: dict[int, str]  # stream -> digest of the last record read

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "kind": MERGED,
            "pack": self.pack,
            "positions": {str(s): int(p) for s, p in self.positions.items()},
            "last": {str(s): str(x) for s, x in self.last.items()},
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "MergedState":
        _check_version(d)
        return cls(
            pack=d["pack"],
            positions={int(s): int(p) for s, p in d["positions"].items()},
            last={int(s): str(x) for s, x in d["last"].items()},
        )

    def reads(self) -> Iterator[tuple[int, int, str]]:
        """``(stream, next record, last digest)`` per stream."""
        return ((s, p, self.last[s]) for s, p in self.positions.items())


@dataclass(frozen=True)
class BalancedState:
    """Where one (rank, DataLoader worker) iterator of balanced steps stands (``loader.balanced``)."""

    pack: str
    rank: int
    world_size: int
    micro_batches: int
    cost: str  # the cost model's fingerprint (``loader.balanced.cost_fingerprint``)
    worker: int
    num_workers: int
    step: int  # the optimizer step ``positions`` stand at the start of
    offset: int  # the worker's next batch is item step*M + offset of the rank's balanced sequence
    streams: list[int]  # the rank's own reference streams
    positions: list[int]  # every stream's next record at the start of ``step``
    last: list[str]  # every stream's digest of the record before that ("" at 0)
    tail: bool = False  # taken in the pack's tail (``step`` and after read unbalanced: too few batches then)

    @property
    def next_item(self) -> int:
        return self.step * self.micro_batches + self.offset

    def to_dict(self) -> dict[str, Any]:
        d = {"version": STATE_VERSION, "kind": BALANCED, "pack": self.pack, "rank": self.rank,
             "world_size": self.world_size, "micro_batches": self.micro_batches, "cost": self.cost,
             "worker": self.worker, "num_workers": self.num_workers, "step": self.step, "offset": self.offset,
             "streams": list(self.streams), "positions": list(self.positions), "last": list(self.last)}
        if self.tail:  # only then: every other state keeps its bytes
            d["tail"] = True
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "BalancedState":
        _check_version(d)
        st = cls(pack=d["pack"], rank=int(d["rank"]), world_size=int(d["world_size"]),
                 micro_batches=int(d["micro_batches"]), cost=str(d["cost"]), worker=int(d["worker"]),
                 num_workers=int(d["num_workers"]), step=int(d["step"]), offset=int(d["offset"]),
                 streams=[int(s) for s in d["streams"]], positions=[int(p) for p in d["positions"]],
                 last=[str(x) for x in d["last"]], tail=bool(d.get("tail", False)))
        if len(st.positions) != len(st.last) or st.micro_batches < 1 or st.offset < 0:
            raise ValueError("a damaged balanced loader state (positions and digests differ in number)")
        return st


LoaderState = WorkerState | MergedState | BalancedState


def state_from_dict(d: Mapping[str, Any]) -> LoaderState:
    """Any shape, from its plain values (the version is checked first)."""
    _check_version(d)
    kind = d.get("kind")
    if kind == MERGED:
        return MergedState.from_dict(d)
    return BalancedState.from_dict(d) if kind == BALANCED else WorkerState.from_dict(d)


def at_step_boundary(states: list[BalancedState]) -> BalancedState:
    """Of one rank's worker states, the one whose positions say exactly which batches the rank has
    handed out (every worker's together): the rank must stand at an optimizer step boundary.

    Worker w of J hands out the rank's items w, w+J, ...; its state's next item tells how many it
    has handed out, their sum is the rank's count n, and the worker that handed out item n-1 (or,
    before any, every worker) holds the positions at the start of step n/M."""
    first = states[0]
    workers = sorted(st.worker for st in states)
    if workers != list(range(first.num_workers)) or any(st.num_workers != first.num_workers for st in states):
        raise ValueError(f"balanced loader states of rank {first.rank}: DataLoader workers {workers} of "
                         f"{first.num_workers}; give every worker's state")
    count = 0
    for st in states:
        done, rest = divmod(st.next_item - st.worker, st.num_workers)
        if rest or done < 0:
            raise ValueError(f"balanced loader state of rank {st.rank} worker {st.worker} is not one of its own "
                             f"(item {st.next_item})")
        count += done
    for st in states:
        if st.step * st.micro_batches == count:
            return st
    raise ValueError(f"the balanced loader state of rank {first.rank} is inside an optimizer step ({count} batches "
                     f"handed out, {first.micro_batches} per step, or inside the pack's last partial step): a "
                     "world-size change needs every rank's state taken at a step boundary")


def _merge_balanced(states: list[BalancedState]) -> MergedState:
    """Every rank's balanced states at one step boundary: every stream's position then."""
    first = states[0]
    if any((st.world_size, st.micro_batches, st.cost) != (first.world_size, first.micro_batches, first.cost)
           for st in states):
        raise ValueError("balanced loader states of different runs (world size, micro-batches or cost model differ)")
    by_rank: dict[int, list[BalancedState]] = {}
    for st in states:
        by_rank.setdefault(st.rank, []).append(st)
    if sorted(by_rank) != list(range(first.world_size)):
        missing = sorted(set(range(first.world_size)) - set(by_rank))
        raise ValueError(f"balanced loader states lack ranks {missing[:8]}: merge the states of every rank")
    at = [at_step_boundary(by_rank[r]) for r in sorted(by_rank)]
    steps = {st.step for st in at}
    if len(steps) != 1 or any(st.positions != at[0].positions for st in at):
        raise ValueError(f"balanced loader states of different optimizer steps ({sorted(steps)}): take every "
                         "rank's state at the same step")
    return MergedState(first.pack, dict(enumerate(at[0].positions)), dict(enumerate(at[0].last)))


def merge_states(states: Iterable[LoaderState]) -> MergedState:
    """One state from the states of every rank (and DataLoader worker) of a run; a merged state
    may be merged again with others.  Balanced states: every rank's, taken at the same optimizer
    step boundary (``at_step_boundary``)."""
    states = list(states)
    if not states:
        raise ValueError("merge_states needs at least one state")
    packs = {st.pack for st in states}
    if len(packs) != 1:
        raise ValueError("loader states belong to different packs")
    balanced = [st for st in states if isinstance(st, BalancedState)]
    if balanced:
        if len(balanced) != len(states):
            raise ValueError("balanced and unbalanced loader states cannot be merged together")
        return _merge_balanced(balanced)
    positions: dict[int, int] = {}
    last: dict[int, str] = {}
    for st in states:
        for stream, pos, digest in st.reads():
            if stream in positions:
                raise ValueError(f"stream {stream} appears in two loader states")
            positions[stream] = pos
            last[stream] = digest
    return MergedState(packs.pop(), positions, last)


def read_state_file(path: str) -> Any:
    """A saved loader state (or a list of them, one per rank), as JSON: ``state_dict()`` is plain
    values, so ``json.dump`` writes it (a state inside a torch checkpoint: load that, dump the
    loader's part); nothing executable is loaded.  ``ValueError`` names the file."""
    import json

    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable loader state as JSON ({e})") from None


def _step_start(st: BalancedState) -> MergedState:
    """Where every rank stood at the start of the balanced state's step: nothing after it is read
    by every rank yet."""
    return MergedState(st.pack, dict(enumerate(st.positions)), dict(enumerate(st.last)))


def checkpoint_entry(states: "Iterable[Mapping[str, Any]]") -> tuple[dict[int, int], dict[int, str]]:
    """What a rank's checkpoint publishes to a progress folder (``schemas.progress``), from the
    dataset states of its DataLoader workers: per stream its next record and last digest.  Without
    balance the workers' streams (disjoint); with it the rank's own reference streams at the
    earliest worker's step start, the positions every rank has passed (it reads other ranks'
    streams too, and each stream is published by one rank, as without balance, so that a
    training's ``keep`` newest checkpoints are its own)."""
    positions: dict[int, int] = {}
    last: dict[int, str] = {}
    for d in states:
        st = state_from_dict(d)
        if isinstance(st, BalancedState):
            for s in st.streams:
                if s not in positions or st.positions[s] < positions[s]:
                    positions[s], last[s] = st.positions[s], st.last[s]
        elif isinstance(st, WorkerState):
            positions.update(zip(st.streams, st.positions))
            if st.last is not None:
                last.update(zip(st.streams, st.last))
    return positions, last


def positions_in(pack: Any, states: "Iterable[Any]") -> dict[int, int]:
    """Per stream of ``pack`` (a ``loader.reader.Pack``), the earliest next record over ``states``:
    each a loader state as saved (one rank's, a list of every rank's, or merged), of this pack or of
    a pack it continues, checked against its record digests.  A balanced state counts at the start
    of its optimizer step, for every stream (any rank may read any stream's batch of a step).  Every
    stream must be covered.  ``ValueError`` (one line) otherwise."""
    out: dict[int, int] = {}
    for given in states:
        parsed = [state_from_dict(st) for st in (given if isinstance(given, list) else [given])]
        if all(isinstance(st, BalancedState) for st in parsed):  # each one's step start: safe mid-step too
            merged_states = [_step_start(st) for st in parsed]
        elif len(parsed) == 1 and isinstance(parsed[0], MergedState):
            merged_states = parsed
        else:
            merged_states = [merge_states(parsed)]
        for merged in merged_states:
            if merged.pack not in pack.fingerprints():
                raise ValueError("a loader state of another pack")
            for s, p in merged.positions.items():
                if p and (not pack.wait_for(s, p - 1, None) or pack.record_digest(s, p - 1) != merged.last[s]):
                    raise ValueError(f"a loader state that does not match stream {s} (record {p - 1} differs or is "
                                     "not there)")
                out[s] = min(out.get(s, p), p)
    missing = [s for s in range(pack.num_streams) if s not in out]
    if missing:
        raise ValueError(f"loader states that lack streams {missing[:8]}{'...' if len(missing) > 8 else ''}: give "
                         "every rank's state (PackedShardDataset.merge_states merges them)")
    return out
