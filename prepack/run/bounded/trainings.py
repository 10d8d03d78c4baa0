"""Where the trainings reading a pack stand, from the progress folders they publish to.

A training's loader (``progress=P``, ``schemas.progress``) publishes each DataLoader worker's live
position and each checkpoint its rank's state takes.  ``Trainings`` reads those folders (at most
every ``POLL_S`` seconds) and answers, per stream and in the chain's record numbers (what a loader
state counts), the two facts a bounded run needs: how far the furthest training has read
(``reached``), and where the earliest of each training's ``keep`` newest checkpoints stands
(``kept_before``): what packing ahead (``prepack.run.bounded.ahead``) and the trim policy
(``prepack.run.bounded.trim_policy``) decide from.
"""

from __future__ import annotations

import time

from loader.reader import Pack
from schemas.errors import PackRefused
from schemas.progress import ProgressFolder, TrainingProgress

POLL_S = 1.0  # how often a waiting stream, or the running job, reads the progress folders again


class Trainings:
    """The progress folders ``folders`` of the trainings reading ``pack``."""

    def __init__(self, folders: "tuple[str, ...] | list[str]", pack: Pack):
        self.pack = pack
        self._folders = [ProgressFolder(p) for p in folders]
        self._read: list[TrainingProgress] = []
        self._at = -1e9

    def refresh(self, force: bool = False) -> None:
        """Read the folders again (unless read within ``POLL_S``); a folder of another pack is refused."""
        if not force and time.monotonic() - self._at < POLL_S:
            return
        self._at = time.monotonic()
        self._read = [f.read() for f in self._folders]
        ours = set(self.pack.fingerprints())
        for folder, got in zip(self._folders, self._read):
            if got.packs - ours:
                raise PackRefused(f"--progress {folder.location.base}: it holds the progress of another pack "
                                  "(a training of another pack, or of this pack before it was made again)")

    def reached(self, stream: int) -> int:
        """The furthest position of any training on ``stream`` (chain records)."""
        self.refresh()
        return max((got.reached(stream) for got in self._read), default=0)

    def kept_before(self, stream: int, keep: int) -> int:
        """The earliest position, over every training, of the ``keep`` newest checkpoints it published on
        ``stream``: 0 while a training has published fewer (a crash may take it back to the start), and
        0 for a checkpoint whose last record digest is not the pack's (a folder of another pack)."""
        self.refresh()
        before = None
        for got in self._read:
            entry = got.kept(stream, keep)
            at = 0 if entry is None else entry.positions[stream]
            if at and not self._matches(stream, at, entry.last.get(stream, "")):
                at = 0
            before = at if before is None else min(before, at)
        return before or 0

    def _matches(self, stream: int, at: int, digest: str) -> bool:
        try:
            if at > self.pack.num_records(stream):  # packed since the index was read (it is read once)
                self.pack.index(stream, refresh=True)
            return self.pack.wait_for(stream, at - 1, None) and self.pack.record_digest(stream, at - 1) == digest
        except (KeyError, IndexError, ValueError, OSError):
            return False
