"""Publishing where a training stands into its progress folder (``schemas.progress``).

A bounded pack reads these files: ``prepack run --ahead N --progress P`` packs at most N batches
past the live position, ``prepack trim --progress P`` trims behind the K newest checkpoints.
Publishing is a side channel of training, so it never fails it: a folder that cannot be written
costs one warning per kind (live, checkpoint) per process, and a failed live publish is not tried
again for ``RETRY_S`` seconds (an unreachable store must not add its timeouts to every step).
The bound only gets more careful when a file is stale or absent.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable

from schemas.progress import ProgressFolder

log = logging.getLogger(__name__)

RETRY_S = 30.0  # after a failed live publish, the earliest next attempt (seconds)


def _where(folder: ProgressFolder) -> str:
    loc = folder.location
    return loc.base if loc.is_local else f"{loc.fs.type_name}://{loc.base}"


class ProgressPublisher:
    """A progress folder (path, ``file://``/``s3://`` URI or ``ProgressFolder``) that swallows
    failures; picklable, and reopened in a forked DataLoader worker (an S3 client's connections
    do not survive ``fork``, see ``PackLocation.reopened``)."""

    def __init__(self, where: "str | os.PathLike | ProgressFolder", *, live_every_s: float = 5.0):
        self.folder = where if isinstance(where, ProgressFolder) else ProgressFolder(where)
        self.live_every_s = float(live_every_s)
        self._pid = os.getpid()
        self._warned: set[str] = set()

    def _own_folder(self) -> ProgressFolder:
        if os.getpid() != self._pid:
            self.folder, self._pid = ProgressFolder(self.folder.location.reopened()), os.getpid()
        return self.folder

    def _publish(self, kind: str, call: Callable[[ProgressFolder], None]) -> bool:
        try:
            call(self._own_folder())
            return True
        except Exception as e:  # noqa: BLE001 -- whatever the store raises, training goes on
            if kind not in self._warned:
                self._warned.add(kind)
                log.warning("could not publish the %s position to the progress folder %s: %s: %s (training goes on; "
                            "not repeated)", kind, _where(self.folder), type(e).__name__, e)
            return False

    def checkpoint(self, pack: str, world_size: int, rank: int, positions: dict[int, int],
                   last: dict[int, str]) -> bool:
        """Append one checkpoint entry of ``rank``; False when it could not be written."""
        return self._publish("checkpoint", lambda f: f.publish_checkpoint(pack, world_size, rank, positions, last))

    def live(self, pack: str, world_size: int, rank: int, worker: int, streams: list[int]) -> "LivePosition":
        """The live publisher of one iteration of DataLoader worker ``worker``."""
        return LivePosition(self, pack, world_size, rank, worker, streams)


class LivePosition:
    """One iterator's position, published at most every ``live_every_s`` seconds, or at once
    (``now``) where the iterator starts, ends or is about to wait for its next batch."""

    def __init__(self, publisher: ProgressPublisher, pack: str, world_size: int, rank: int, worker: int,
                 streams: list[int]):
        self._publisher = publisher
        self._args = (pack, world_size, rank, worker)
        self._streams = list(streams)
        self._sent: list[int] | None = None
        self._at = -math.inf  # monotonic time of the last attempt
        self._retry_at = -math.inf

    def update(self, positions: list[int], *, now: bool = False) -> None:
        """Publish ``positions`` (per stream, the next record) if they changed since the last
        publish and ``now`` or the throttle allows."""
        if positions == self._sent:
            return
        t = time.monotonic()
        if t < self._retry_at or (not now and t - self._at < self._publisher.live_every_s):
            return
        self._sent, self._at = list(positions), t
        mine = dict(zip(self._streams, positions))
        if not self._publisher._publish("live", lambda f: f.publish_live(*self._args, mine)):
            self._retry_at = t + max(RETRY_S, self._publisher.live_every_s)
