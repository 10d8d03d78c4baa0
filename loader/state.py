"""The loader's resume state, typed: one DataLoader worker's position, or the merge of a run's.

On disk a state is plain values only (ints, strings, lists, dicts with string keys), so JSON and
torch's weights-only loader (NeMo's checkpointer default) restore it in a new process.
``to_dict``/``from_dict`` keep the version-2 shapes every saved state already has:

- one worker's state: ``{"version", "pack", "rank", "world_size", "worker", "num_workers",
  "streams", "cursor", "firsts", "positions", "last"}``; a state saved before ``firsts`` existed
  loads with zeros there, one without ``last`` is not checked against the pack's digests;
- a merged state: ``{"version", "kind": "merged", "pack", "positions": {"<stream>": next record},
  "last": {"<stream>": digest}}``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

STATE_VERSION = 2
MERGED = "merged"


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


LoaderState = WorkerState | MergedState


def state_from_dict(d: Mapping[str, Any]) -> LoaderState:
    """Either shape, from its plain values (the version is checked first)."""
    _check_version(d)
    return MergedState.from_dict(d) if d.get("kind") == MERGED else WorkerState.from_dict(d)


def merge_states(states: Iterable[LoaderState]) -> MergedState:
    """One state from the states of every rank (and DataLoader worker) of a run; a merged state
    may be merged again with others."""
    states = list(states)
    if not states:
        raise ValueError("merge_states needs at least one state")
    packs = {st.pack for st in states}
    if len(packs) != 1:
        raise ValueError("loader states belong to different packs")
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


def positions_in(pack: Any, states: "Iterable[Any]") -> dict[int, int]:
    """Per stream of ``pack`` (a ``loader.reader.Pack``), the earliest next record over ``states``:
    each a loader state as saved (one rank's, a list of every rank's, or merged), of this pack or of
    a pack it continues, checked against its record digests.  Every stream must be covered.
    ``ValueError`` (one line) otherwise."""
    out: dict[int, int] = {}
    for given in states:
        parsed = [state_from_dict(st) for st in (given if isinstance(given, list) else [given])]
        merged = parsed[0] if len(parsed) == 1 and isinstance(parsed[0], MergedState) else merge_states(parsed)
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
