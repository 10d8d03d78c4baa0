"""What the user asks of a bounded pack (``--ahead N``, ``--progress P...``, ``--keep-checkpoints K``).

Plain values, light to import (``prepack run --help`` builds its parser from them) and shipped to
each stream task as they are; ``prepack.run.ahead`` packs by them, ``prepack.run.trim_policy`` trims.
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas.errors import UsageError
from schemas.layout import MAX_CHECKPOINTS

DEFAULT_KEEP_CHECKPOINTS = 2


@dataclass(frozen=True)
class BoundSpec:
    """``ahead``: batches a stream may pack past the furthest training (None: no limit); ``progress``:
    the trainings' progress folders; ``keep``: checkpoints of each training nothing is trimmed before."""

    ahead: int | None
    progress: tuple[str, ...]
    keep: int = DEFAULT_KEEP_CHECKPOINTS

    def __post_init__(self):
        if self.ahead is not None and self.ahead < 1:
            raise UsageError(f"--ahead takes a number of batches >= 1, got {self.ahead}")
        if self.ahead is not None and not self.progress:
            raise UsageError("--ahead needs --progress P: the folder (or s3:// prefix) where the training publishes "
                             "its position (PackedShardDataset(..., progress=P))")
        if not 1 <= self.keep <= MAX_CHECKPOINTS:
            raise UsageError(f"--keep-checkpoints takes 1..{MAX_CHECKPOINTS}, got {self.keep}")

    @property
    def active(self) -> bool:
        return bool(self.progress)

    def warnings(self) -> list[str]:
        """What the user may not have meant: a checkpoint is published when the loader's state is
        taken, before the training has saved it, so with K=1 a crash during that save rolls back to
        a checkpoint whose batches may be trimmed already (``prepack restore`` brings them back)."""
        if self.active and self.keep == 1:
            return ["--keep-checkpoints 1: a checkpoint counts once the loader's state is taken, before the "
                    "training has saved it; a crash during that save rolls back to the one before, whose batches "
                    "may be trimmed already (prepack restore --state brings them back). The default, 2, covers it."]
        return []
