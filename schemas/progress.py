"""A training's progress folder: where each rank stands on a pack, published for the packer.

A bounded pack (``prepack run --ahead``, ``prepack trim --progress``) needs two facts per stream
from each training reading it, and the loader already has both:

- **where it reads now** (``live-w{W}-r{R}-j{J}.json``, one per DataLoader worker): the next
  record of each of that worker's streams, published as the training reads (at most every few
  seconds, and at once before it would wait for a record not yet packed, so a packer holding back
  always hears that the training caught up).  ``--ahead N`` packs up to N batches past it.
- **the checkpoints it keeps** (``ckpt-w{W}-r{R}.json``, one per rank): each time the rank's loader
  state is saved (``state_dict()``: a checkpoint), the position of each of its streams and the
  digest of the last record read, newest last, at most ``MAX_CHECKPOINTS``.  A crash rolls a
  training back to one of the last K checkpoints it keeps, so nothing at or after the earliest
  position among a stream's K newest entries may be trimmed; with fewer than K entries, nothing.

Entries of every file covering a stream count, ordered by the time they were published, so a
training that changed its world size (a merged state loaded on W' ranks) is read across both
sets of files.  Each file is written whole by its one writer (a rename on a local disk, one PUT
on an object store); a file that is absent or unreadable counts as no entries: the bound only
gets more careful, never less.  The folder is the training's, not the pack's: training stays
read-only on the pack.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field

import pyarrow.fs as pafs

from schemas.layout import MAX_CHECKPOINTS
from schemas.location import PackLocation, resolve_location

PROGRESS_VERSION = 1
_LIVE = "live-w{world_size}-r{rank:05d}-j{worker}.json"
_CKPT = "ckpt-w{world_size}-r{rank:05d}.json"
_NAME = re.compile(r"^(live|ckpt)-w(\d+)-r(\d+)(?:-j(\d+))?\.json$")


def live_file(world_size: int, rank: int, worker: int) -> str:
    return _LIVE.format(world_size=world_size, rank=rank, worker=worker)


def rank_checkpoints_file(world_size: int, rank: int) -> str:
    return _CKPT.format(world_size=world_size, rank=rank)


@dataclass(frozen=True)
class Entry:
    """One published position: per stream the next record (and, for a checkpoint, the digest of the
    record before it, "" at 0)."""

    time: float
    positions: dict[int, int]
    last: dict[int, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = {"time": self.time, "positions": {str(s): int(p) for s, p in self.positions.items()}}
        if self.last:
            d["last"] = {str(s): str(x) for s, x in self.last.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Entry":
        return cls(float(d["time"]), {int(s): int(p) for s, p in d["positions"].items()},
                   {int(s): str(x) for s, x in d.get("last", {}).items()})


def _document(pack: str, world_size: int, rank: int, entries: list[Entry], worker: int | None = None) -> bytes:
    d = {"version": PROGRESS_VERSION, "pack": pack, "world_size": world_size, "rank": rank,
         "entries": [e.to_dict() for e in entries]}
    if worker is not None:
        d["worker"] = worker
    return json.dumps(d, sort_keys=True).encode()


def _parse(data: bytes) -> tuple[str, list[Entry]]:
    d = json.loads(data)
    if d.get("version") != PROGRESS_VERSION:
        raise ValueError(f"progress version {d.get('version')!r}")
    return str(d["pack"]), [Entry.from_dict(e) for e in d["entries"]]


@dataclass
class TrainingProgress:
    """What one progress folder says, per stream (entries of every file that covers it)."""

    packs: set[str] = field(default_factory=set)  # the pack fingerprints its files name
    live: dict[int, list[Entry]] = field(default_factory=dict)  # stream -> entries (live and checkpoints)
    checkpoints: dict[int, list[Entry]] = field(default_factory=dict)  # stream -> checkpoint entries

    def reached(self, stream: int) -> int:
        """The next record the training reads on ``stream``: its newest entry of a live file (0 before
        any).  A checkpoint counts only where no live file covers the stream: a balanced loader's
        checkpoint stands at its step start, behind the M batches its live file says the step needs."""
        saved = {id(e) for e in self.checkpoints.get(stream, ())}
        entries = [e for e in self.live.get(stream, ()) if id(e) not in saved] or self.live.get(stream)
        return max(entries, key=lambda e: e.time).positions[stream] if entries else 0

    def kept(self, stream: int, keep: int) -> "Entry | None":
        """Of the ``keep`` newest checkpoints of ``stream``, the one standing earliest (None: fewer
        than ``keep`` published, so a crash may go back to the start)."""
        entries = sorted(self.checkpoints.get(stream, ()), key=lambda e: e.time, reverse=True)[:keep]
        if keep < 1 or len(entries) < keep:
            return None
        return min(entries, key=lambda e: e.positions[stream])


class ProgressFolder:
    """A training's progress folder (a local path, ``file://`` or ``s3://...`` prefix)."""

    def __init__(self, where: "str | os.PathLike | PackLocation", filesystem: pafs.FileSystem | None = None):
        self.location = resolve_location(where, filesystem)
        self._history: dict[tuple[int, int], list[Entry]] = {}  # this process's checkpoint files

    def _put(self, name: str, data: bytes) -> None:
        loc = self.location
        path = loc.path(name)
        if loc.is_local:
            os.makedirs(loc.base, exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        else:
            loc.make_dirs(loc.base)
            with loc.open_output(path) as f:
                f.write(data)

    def publish_live(self, pack: str, world_size: int, rank: int, worker: int, positions: dict[int, int]) -> None:
        """Where DataLoader worker ``worker`` of ``rank`` reads now."""
        self._put(live_file(world_size, rank, worker),
                  _document(pack, world_size, rank, [Entry(time.time(), dict(positions))], worker))

    def publish_checkpoint(self, pack: str, world_size: int, rank: int, positions: dict[int, int],
                           last: dict[int, str]) -> None:
        """A checkpoint of ``rank``: appended to its file (read once per process), the oldest dropped
        past ``MAX_CHECKPOINTS``."""
        key = (world_size, rank)
        name = rank_checkpoints_file(world_size, rank)
        if key not in self._history:
            try:
                old_pack, entries = _parse(self.location.read_bytes(name))
                self._history[key] = entries if old_pack == pack else []
            except (OSError, ValueError, KeyError, TypeError):
                self._history[key] = []
        entries = self._history[key]
        entries.append(Entry(time.time(), dict(positions), dict(last)))
        del entries[:-MAX_CHECKPOINTS]
        self._put(name, _document(pack, world_size, rank, entries))

    def read(self) -> TrainingProgress:
        """Every file of the folder (an absent folder: no progress yet)."""
        out = TrainingProgress()
        for info in self.location.list(""):
            name = info.path.rsplit("/", 1)[-1]
            m = _NAME.match(name)
            if not m or info.type != pafs.FileType.File:
                continue
            try:
                pack, entries = _parse(self.location.read_bytes(name))
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                continue  # being replaced, or damaged: no entries (the bound only gets more careful)
            out.packs.add(pack)
            for e in entries:
                for s in e.positions:
                    out.live.setdefault(s, []).append(e)
                    if m.group(1) == "ckpt":
                        out.checkpoints.setdefault(s, []).append(e)
        return out
