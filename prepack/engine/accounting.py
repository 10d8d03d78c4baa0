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
    examples: dict[str, str] = field(default_factory=dict)  # drop/warning kind -> detail of its first occurrence

    def drop(self, reason: str, detail: str = "", n: int = 1) -> None:
        before = self.drops.get(reason, 0)
        c = before + n
        self.drops[reason] = c
        self.examples.setdefault(reason, detail)
        # Per-stream detail is for -v: the driver announces each reason once per run (run/progress.py).
        if before < 3 or c // 1000 > before // 1000:  # this update holds a first-three or a 1000th occurrence
            log.info("drop[%s]=%d %s", reason, c, detail)

    def warn(self, kind: str, detail: str = "") -> None:
        c = self.warnings.get(kind, 0) + 1
        self.warnings[kind] = c
        self.examples.setdefault(kind, detail)
        if c <= 3 or c % 1000 == 0:
            log.info("warning[%s]=%d %s", kind, c, detail)

    def to_json(self) -> dict:
        return {
            "drops": dict(sorted(self.drops.items())),
            "warnings": dict(sorted(self.warnings.items())),
            "samples_read": dict(sorted(self.samples_read.items())),
            "samples_packed": dict(sorted(self.samples_packed.items())),
            "examples": dict(sorted(self.examples.items())),
        }

    @classmethod
    def from_json(cls, d: dict) -> "Counters":
        return cls(**{k: dict(v) for k, v in d.items()})


# What each drop reason and warning kind means, for a person reading a run's log.  ``{detail}`` is
# the first occurrence's detail; knob names are filled from the config's packing knobs.
MEANINGS: dict[str, str] = {
    "overlength_sample": "a sample of {detail} tokens exceeds max_num_tokens_per_sample={max_num_tokens_per_sample}; "
                         "dropped, as the reference does",
    "overlength_mandatory_sample": "a mandatory group's sample of {detail} tokens exceeds max_num_tokens="
                                   "{max_num_tokens}; dropped",
    "discarded_no_fit_buffer_full": "a sample fit no batch while the overflow buffer (max_buffer_size="
                                    "{max_buffer_size}) was full; the reference discards it without a trace",
    "discarded_no_fit_from_buffer": "a sample taken back out of the overflow buffer still did not fit; the reference "
                                    "discards it without a trace (common when prefer_buffer_before="
                                    "{prefer_buffer_before} exceeds max_num_tokens={max_num_tokens})",
    "batch_refused_over_max_num_tokens": "a batch of {detail} tokens (mandatory samples that together exceed "
                                         "max_num_tokens) was refused",
    "samples_in_refused_batches": "samples of refused batches (see batch_refused_over_max_num_tokens)",
    "image_over_pixel_limit": "an image above max_image_pixels ({detail}), refused from its header, never decoded",
    "unsafe_path_outside_data_dir": "an image or video path outside the data folder ({detail}), refused in every mode",
    "truncated_image": "a truncated image, packed as the reference packs it (strict: true drops it)",
}


def meaning(kind: str, detail: str, knobs: dict, dropped: bool = True) -> str:
    """What a drop reason or warning kind means, with its first example (one line)."""
    template = MEANINGS.get(kind)
    if template is None:
        return ("samples or rows dropped" if dropped else "damaged input packed as the reference does") + \
            (f", e.g. {detail}" if detail else "") + \
            "; see docs/architecture.md, 'Accounting and divergences from the reference'"
    try:
        return template.format(detail=detail or "?", **knobs)
    except (KeyError, IndexError, ValueError):
        return template
