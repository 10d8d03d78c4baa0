"""Room granted shard by shard: how a balanced-samples pack's reference keeps to ``--disk-budget``.

A reference shard's balanced twin takes samples from every stream of its step class, so its size is
known only once the class's records are committed, and no stream alone can reserve room for it.
So one job holds the budget: the one balancing OUT (``prepack.run.bounded.balanced_budget``), which
sees every stream.  It grants each reference stream a few shards at a time (each reserved at its
most), by writing the chain records the stream may start a shard below (``grant_file``: a JSON ``{"records": n}``); a reference
stream's gate (``BoundSpec.granted``) holds it at or past that.  Files, not messages, so a second
job packing reference streams (``--streams``) waits on the same grants.
"""

from __future__ import annotations

import json
import time

from prepack.run.bounded import trainings as trainings_module
from prepack.run.commit.atomic_files import write_bytes_atomic
from schemas.layout import GRANT_DIR, grant_file
from schemas.location import PackLocation


def write_grant(loc: PackLocation, stream: int, records: int) -> None:
    """Let ``stream`` start shards while it has fewer than ``records`` chain records."""
    write_bytes_atomic(loc, grant_file(stream), json.dumps({"records": records}).encode())


def read_grant(loc: PackLocation, stream: int) -> int:
    """The chain records ``stream`` may start a shard below (0: no grant yet)."""
    try:
        data = loc.read_bytes(grant_file(stream))
    except FileNotFoundError:
        return 0
    return int(json.loads(data)["records"])


def clear_grants(loc: PackLocation) -> None:
    """Withdraw every grant (a balancing job starting: a grant of a run before holds no room now;
    ending: nothing packs on them any more)."""
    for info in loc.list(GRANT_DIR):
        loc.fs.delete_file(info.path)


class GrantReader:
    """A reference stream's side: whether its next shard is granted (its grant read again at most
    every ``trainings.POLL_S``, as the trainings' positions are)."""

    def __init__(self, loc: PackLocation):
        self.loc = loc
        self._read: dict[int, tuple[float, int]] = {}

    def holding(self, stream: int, records: int) -> "str | None":
        at, granted = self._read.get(stream, (-1e9, 0))
        if records >= granted and time.monotonic() - at >= trainings_module.POLL_S:
            granted = read_grant(self.loc, stream)
            self._read[stream] = (time.monotonic(), granted)
        if records < granted:
            return None
        return (f"{records} records packed, room granted below {granted} (--disk-budget: the job balancing the pack "
                "grants each reference shard its room)")
