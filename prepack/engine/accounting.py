"""Counts of everything that did not become packed data as-is: nothing disappears unaccounted.

``drops``: rows, files or samples that were not packed, by reason.  ``warnings``: damaged input that
the default (reference-compatible) mode still packs, by kind; ``strict`` mode turns each of these
into a drop instead.  Counts are plain dicts so they serialise into checkpoints and the manifest.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


class Rejected(Exception):
    """A row/sample refused with a counted reason (raised inside sources, caught by their loop)."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass
class Counters:
    drops: dict[str, int] = field(default_factory=dict)
    warnings: dict[str, int] = field(default_factory=dict)
    samples_read: dict[str, int] = field(default_factory=dict)  # group -> samples produced by its source
    samples_packed: dict[str, int] = field(default_factory=dict)  # group -> samples placed in batches

    def drop(self, reason: str, detail: str = "", n: int = 1) -> None:
        before = self.drops.get(reason, 0)
        c = before + n
        self.drops[reason] = c
        if before < 3 or c // 1000 > before // 1000:  # this update holds a first-three or a 1000th occurrence
            log.warning("drop[%s]=%d %s", reason, c, detail)

    def warn(self, kind: str, detail: str = "") -> None:
        c = self.warnings.get(kind, 0) + 1
        self.warnings[kind] = c
        if c <= 3 or c % 1000 == 0:
            log.warning("warning[%s]=%d %s", kind, c, detail)

    def to_json(self) -> dict:
        return {
            "drops": dict(sorted(self.drops.items())),
            "warnings": dict(sorted(self.warnings.items())),
            "samples_read": dict(sorted(self.samples_read.items())),
            "samples_packed": dict(sorted(self.samples_packed.items())),
        }

    @classmethod
    def from_json(cls, d: dict) -> "Counters":
        return cls(**{k: dict(v) for k, v in d.items()})
