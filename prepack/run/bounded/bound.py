"""What the user asks of a bounded pack (``--ahead N``, ``--disk-budget SIZE``, ``--progress P...``,
``--keep-checkpoints K``).

Plain values, light to import (``prepack run --help`` builds its parser from them) and shipped to
each stream task as they are; ``prepack.run.bounded.ahead`` packs by them, ``prepack.run.bounded.trim_policy`` trims.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass

from schemas.errors import UsageError
from schemas.layout import MAX_CHECKPOINTS

DEFAULT_KEEP_CHECKPOINTS = 2


@dataclass(frozen=True)
class BoundSpec:
    """``ahead``: batches a stream may pack past the furthest training (None: no limit); ``progress``:
    the trainings' progress folders; ``keep``: checkpoints of each training nothing is trimmed before;
    ``disk_budget``: bytes the whole pack may hold (None: no limit; ``parse_disk_budget``); ``reads``:
    the pack the trainings read when it is not the one packed (a balanced-samples pack's reference is
    packed for the trainings of OUT, whose steps need every stream of a step class: ``StepNeeds``);
    ``granted``: each shard waits for room granted by the job balancing OUT (its reference under
    ``--disk-budget``: ``prepack.run.bounded.grants``)."""

    ahead: int | None
    progress: tuple[str, ...]
    keep: int = DEFAULT_KEEP_CHECKPOINTS
    disk_budget: int | None = None
    reads: str | None = None
    granted: bool = False

    def __post_init__(self):
        if self.ahead is not None and self.ahead < 1:
            raise UsageError(f"--ahead takes a number of batches >= 1, got {self.ahead}")
        for flag, value in (("--ahead", self.ahead), ("--disk-budget", self.disk_budget)):
            if value is not None and not self.progress:
                raise UsageError(f"{flag} needs --progress P: the folder (or s3:// prefix) where the training "
                                 "publishes its position (PackedShardDataset(..., progress=P))")
        if not 1 <= self.keep <= MAX_CHECKPOINTS:
            raise UsageError(f"--keep-checkpoints takes 1..{MAX_CHECKPOINTS}, got {self.keep}")

    @property
    def active(self) -> bool:
        return bool(self.progress)

    @property
    def holds_back(self) -> bool:
        """Whether a stream may have to wait for its trainings before a shard."""
        return self.ahead is not None or self.disk_budget is not None or self.granted

    def warnings(self) -> list[str]:
        """What the user may not have meant: a checkpoint is published when the loader's state is
        taken, before the training has saved it, so with K=1 a crash during that save rolls back to
        a checkpoint whose batches may be trimmed already (``prepack restore`` brings them back)."""
        if self.active and self.keep == 1:
            return ["--keep-checkpoints 1: a checkpoint counts once the loader's state is taken, before the "
                    "training has saved it; a crash during that save rolls back to the one before, whose batches "
                    "may be trimmed already (prepack restore --state brings them back). The default, 2, covers it."]
        return []


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50, "pb": 10**15}


def parse_disk_budget(text: str, out: str) -> int:
    """``--disk-budget``: a size (``2TiB``, ``500GB``, ``1.5e12``) or a share of the free space of
    ``out``'s disk now (``20%``), in bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*|%)\s*", text.lower())
    if m is None or m.group(2) not in _UNITS and m.group(2) != "%":
        raise UsageError(f"--disk-budget takes a size (2TiB, 500GB, 800MiB) or a share of the free disk (20%), "
                         f"got {text!r}")
    value = float(m.group(1))
    if m.group(2) == "%":
        if "://" in out:
            raise UsageError(f"--disk-budget {text}: a store has no free space to take a share of; give a size")
        if not 0 < value <= 100:
            raise UsageError(f"--disk-budget {text}: a share of the free disk is more than 0% and at most 100%")
        probe = os.path.abspath(out)
        while not os.path.exists(probe):
            probe = os.path.dirname(probe)
        return int(shutil.disk_usage(probe).free * value / 100)
    budget = int(value * _UNITS[m.group(2)])
    if budget <= 0:
        raise UsageError(f"--disk-budget {text}: a budget of no bytes")
    return budget
