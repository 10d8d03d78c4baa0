"""Counts of everything that did not become packed data as-is: nothing disappears unaccounted.

``drops``: rows, files or samples that were not packed, by reason.  ``warnings``: damaged input that
the default (reference-compatible) mode still packs, by kind; ``strict`` mode turns most of these
into a drop instead.  Counts are plain dicts of plain strings so they serialise into checkpoints,
``done.json`` and the manifest.

Every reason and kind is declared once, here (``Drop``, ``Warn``): its key (the string counted), its
meaning for a person reading the run's log, the level of its per-stream log line, and what the
reference does with the same input.  A source's row reasons are counted per group as
``group:reason`` (``Drop.counted_as``; ``parse_key`` reads such a key back); the packer's are
counted bare.  The declared members are ``str`` values equal to their key, so a key read back from
a file compares equal to its member.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from enum import Enum

log = logging.getLogger(__name__)


class Reference(Enum):
    """What the reference does with the input a reason or kind counts (its value ends the meaning)."""

    SAME = ", as the reference does"
    SILENT = "; so does the reference, without a trace"
    CRASHES = "; the reference crashes here"
    PACKS = "; the reference packs it"
    ENDLESS = "; the reference's stream never ends: it packs them in a later batch"

    @property
    def same(self) -> bool:
        """Whether we do what the reference does (and only count it)."""
        return self in (Reference.SAME, Reference.SILENT)


class _Declared(str, Enum):
    """A declared drop reason or warning kind: a ``str`` equal to its key."""

    def __new__(cls, key: str, *_):
        member = str.__new__(cls, key)
        member._value_ = key
        return member

    __str__ = str.__str__  # the key, in logs, messages and f-strings
    __format__ = str.__format__

    @property
    def key(self) -> str:
        return self._value_


class Drop(_Declared):
    """Why a row, file or sample was not packed.  ``per_group``: counted as ``group:reason``
    (a source's rows and files), else bare (the packer's samples and batches)."""

    # the packer
    OVERLENGTH_SAMPLE = ("overlength_sample", False, Reference.SAME,
                         "a sample of {detail} tokens exceeds max_num_tokens_per_sample={max_num_tokens_per_sample}; "
                         "dropped")
    OVERLENGTH_MANDATORY_SAMPLE = ("overlength_mandatory_sample", False, Reference.SAME,
                                   "a mandatory group's sample of {detail} tokens reaches max_num_tokens_per_sample="
                                   "{max_num_tokens_per_sample}; dropped and another one drawn")
    DISCARDED_NO_FIT_BUFFER_FULL = ("discarded_no_fit_buffer_full", False, Reference.SILENT,
                                    "a sample fit no batch while the overflow buffer (max_buffer_size="
                                    "{max_buffer_size}) was full: discarded")
    DISCARDED_NO_FIT_FROM_BUFFER = ("discarded_no_fit_from_buffer", False, Reference.SILENT,
                                    "a sample taken back out of the overflow buffer still did not fit: discarded "
                                    "(common when prefer_buffer_before={prefer_buffer_before} exceeds max_num_tokens="
                                    "{max_num_tokens})")
    BATCH_REFUSED_OVER_MAX_NUM_TOKENS = ("batch_refused_over_max_num_tokens", False, Reference.PACKS,
                                         "a batch of {detail} tokens (mandatory samples that together exceed "
                                         "max_num_tokens) was refused: flex padding would be negative",
                                         logging.INFO, "batches")
    SAMPLES_IN_REFUSED_BATCHES = ("samples_in_refused_batches", False, Reference.PACKS,
                                  "samples of refused batches (see batch_refused_over_max_num_tokens)")
    LEFT_IN_BUFFER_AT_END_OF_BUDGET = ("left_in_buffer_at_end_of_budget", False, Reference.ENDLESS,
                                       "samples still in the overflow buffer when the stream's budget was reached")
    # a source's files and row groups
    PARQUET_FILE_UNREADABLE = ("parquet_file_unreadable", True, Reference.CRASHES,
                               "a parquet file that does not open (corrupt, empty or not parquet): its rows dropped")
    PARQUET_ROW_GROUP_UNREADABLE = ("parquet_row_group_unreadable", True, Reference.CRASHES,
                                    "a parquet row group that does not read: its rows dropped")
    PARQUET_ROW_GROUP_PARSE = ("parquet_row_group_parse", True, Reference.SAME,
                               "an edit row group that does not read: its rows dropped")
    # a source's rows
    PARQUET_ROW_PARSE = ("parquet_row_parse", True, Reference.SAME, "an edit row that does not parse: dropped")
    EDIT_IMAGE_NOT_BYTES = ("edit_image_not_bytes", True, Reference.SAME,
                            "an edit row whose image is not bytes: dropped")
    IMAGE_NOT_BYTES = ("image_not_bytes", True, Reference.SAME, "an image that is neither bytes nor a path: dropped")
    IMAGE_OVER_PIXEL_LIMIT = ("image_over_pixel_limit", True, Reference.PACKS,
                              "an image above max_image_pixels, refused from its header, never decoded")
    T2I_IMAGE_PARSE = ("t2i_image_parse", True, Reference.SAME, "a t2i row whose image does not decode: dropped")
    T2I_CAPTION_PARSE = ("t2i_caption_parse", True, Reference.SAME,
                         "a t2i row whose captions are not JSON (or missing): dropped")
    T2I_CAPTION_NOT_OBJECT = ("t2i_caption_not_object", True, Reference.CRASHES,
                              "a t2i row whose captions are JSON but not an object: dropped")
    T2I_CAPTION_NOT_STRING = ("t2i_caption_not_string", True, Reference.CRASHES,
                              "a t2i row with a caption that is not a string: dropped")
    JSONL_NOT_UTF8 = ("jsonl_not_utf8", True, Reference.CRASHES,
                      "a JSONL line that is not valid UTF-8: that row dropped (the reference loses the whole file)")
    JSONL_PARSE = ("jsonl_parse", True, Reference.SAME,
                   "a JSONL row that is not JSON, or whose media fail to load: dropped")
    JSONL_NOT_OBJECT = ("jsonl_not_object", True, Reference.CRASHES, "a JSONL row that is JSON but not an object: dropped")
    JSONL_BAD_CONVERSATIONS = ("jsonl_bad_conversations", True, Reference.CRASHES,
                               "a JSONL row without a list of {{from, value}} string turns: dropped")
    JSONL_BAD_PATH = ("jsonl_bad_path", True, Reference.SAME, "a JSONL row whose image or video path is not a string: "
                      "dropped")
    UNSAFE_PATH_OUTSIDE_DATA_DIR = ("unsafe_path_outside_data_dir", True, Reference.PACKS,
                                    "an image or video path outside the data folder (absolute, ~, .. or a URI), "
                                    "refused in every mode")
    NO_LOSS_LABELS = ("no_loss_labels", True, Reference.SAME, "a conversation with no answer to learn from: dropped")
    MORE_IMAGE_PLACEHOLDERS_THAN_IMAGES = ("more_image_placeholders_than_images", True, Reference.CRASHES,
                                           "a conversation with more <image> placeholders than images: dropped")
    # strict mode: damaged input the default mode packs (see ``Warn``)
    STRICT_TRUNCATED_IMAGE = ("strict_truncated_image", True, Reference.PACKS,
                              "a truncated image, dropped by strict: true")
    STRICT_HIGH_BIT_DEPTH_IMAGE_SATURATED = ("strict_high_bit_depth_image_saturated", True, Reference.PACKS,
                                             "a 16-bit or float image (its RGB conversion saturates), dropped by "
                                             "strict: true")
    STRICT_ALPHA_DROPPED_WITHOUT_COMPOSITE = ("strict_alpha_dropped_without_composite", True, Reference.PACKS,
                                              "a grey+alpha image (its alpha would be dropped, not composited), "
                                              "dropped by strict: true")
    STRICT_T2I_NO_CAPTION = ("strict_t2i_no_caption", True, Reference.PACKS,
                             "a t2i row with an empty caption object, dropped by strict: true")
    STRICT_T2I_EMPTY_CAPTION = ("strict_t2i_empty_caption", True, Reference.PACKS,
                                "a t2i row whose chosen caption is empty, dropped by strict: true")
    STRICT_VIDEO_WITHOUT_FRAMES = ("strict_video_without_frames", True, Reference.PACKS,
                                   "a video that gave no frames, dropped by strict: true")
    STRICT_IMAGE_WITHOUT_PLACEHOLDER = ("strict_image_without_placeholder", True, Reference.PACKS,
                                        "a conversation with an image and no <image> placeholder for it, dropped by "
                                        "strict: true")

    def __init__(self, key: str, per_group: bool, reference: Reference, meaning: str, level: int = logging.INFO,
                 counts: str = "samples"):
        self.per_group = per_group
        self.reference = reference
        self.meaning = meaning  # ``{detail}``: the first occurrence's detail; other fields: the packing knobs
        self.level = level  # of the per-stream line logged for its first occurrences
        # what one count is: a row, file or sample lost ("samples"), or a batch refused ("batches",
        # whose samples are counted again under their own reason): rates of lost samples skip it
        self.counts = counts

    def counted_as(self, group: "str | None" = None) -> str:
        """The key counted: ``group:reason`` for a source's reason, the reason alone for the packer's."""
        if self.per_group != (group is not None):
            raise ValueError(f"drop reason {self.key} is counted {'per group' if self.per_group else 'bare'}")
        return f"{group}:{self.key}" if self.per_group else self.key


class Warn(_Declared):
    """Input packed as the reference packs it, counted by kind.  ``strict``: the drop that
    ``prepack.strict: true`` makes of it instead (None: strict mode packs it too)."""

    TRUNCATED_IMAGE = ("truncated_image", Reference.SAME, "a truncated image, packed as far as it decodes",
                       Drop.STRICT_TRUNCATED_IMAGE)
    HIGH_BIT_DEPTH_IMAGE_SATURATED = ("high_bit_depth_image_saturated", Reference.SAME,
                                      "a 16-bit or float image, packed saturated by its RGB conversion",
                                      Drop.STRICT_HIGH_BIT_DEPTH_IMAGE_SATURATED)
    ALPHA_DROPPED_WITHOUT_COMPOSITE = ("alpha_dropped_without_composite", Reference.SAME,
                                       "a grey+alpha image, packed with its alpha dropped instead of composited",
                                       Drop.STRICT_ALPHA_DROPPED_WITHOUT_COMPOSITE)
    ANIMATED_IMAGE_FIRST_FRAME_ONLY = ("animated_image_first_frame_only", Reference.SAME,
                                       "an animated image, packed as its first frame (a whole picture: strict mode "
                                       "packs it too)", None)
    T2I_NO_CAPTION_PACKED_AS_SPACE = ("t2i_no_caption_packed_as_space", Reference.SAME,
                                      "a t2i row with an empty caption object, packed with the caption \" \"",
                                      Drop.STRICT_T2I_NO_CAPTION)
    T2I_EMPTY_CAPTION = ("t2i_empty_caption", Reference.SAME, "a t2i row whose chosen caption is empty, packed",
                         Drop.STRICT_T2I_EMPTY_CAPTION)
    VIDEO_WITHOUT_FRAMES_PACKED_AS_TEXT = ("video_without_frames_packed_as_text", Reference.SAME,
                                           "a video that gave no frames, packed as a text-only sample",
                                           Drop.STRICT_VIDEO_WITHOUT_FRAMES)
    IMAGE_WITHOUT_PLACEHOLDER_COUNTED_NOT_PACKED = ("image_without_placeholder_counted_not_packed", Reference.SAME,
                                                    "an image with no <image> placeholder: its tokens counted, the "
                                                    "image not packed", Drop.STRICT_IMAGE_WITHOUT_PLACEHOLDER)
    PARQUET_FILE_CHOICE_DEPENDS_ON_LISTING_ORDER = ("parquet_file_choice_depends_on_listing_order", Reference.SAME,
                                                    "num_used_data is not a multiple of a folder's parquet files: "
                                                    "which files are used follows the folder's listing order", None)
    EDIT_FILE_MISSING_FROM_PARQUET_INFO = ("edit_file_missing_from_parquet_info", Reference.SAME,
                                           "an edit parquet file that parquet_info does not list: ignored", None)
    PARQUET_INFO_ENTRY_WITHOUT_FILE = ("parquet_info_entry_without_file", Reference.SAME,
                                       "a parquet_info entry whose file does not exist: ignored", None)
    BATCH_OVER_MAX_NUM_TOKENS = ("batch_over_max_num_tokens", Reference.SAME,
                                 "a batch over max_num_tokens={max_num_tokens} (mandatory samples that together "
                                 "exceed it), packed", None)

    def __init__(self, key: str, reference: Reference, meaning: str, strict: "Drop | None",
                 level: int = logging.INFO):
        self.reference = reference
        self.meaning = meaning
        self.strict = strict
        self.level = level


def parse_key(key: str, dropped: bool = True) -> "tuple[str | None, Drop | Warn | None]":
    """(group, declared reason or kind) of a counted key; ``group`` is None for a bare key, the
    reason None for a key nothing declares (counted by another version, say)."""
    if not dropped:
        return None, _declared(Warn, key)
    group, sep, name = key.partition(":")
    if not sep:
        return None, _declared(Drop, key)
    reason = _declared(Drop, name)
    return group, reason if reason is not None and reason.per_group else None


def _declared(cls: type, key: str):
    try:
        return cls(key)
    except ValueError:
        return None


class Rejected(Exception):
    """A row/sample refused with a counted reason (raised inside sources, caught by their loop)."""

    def __init__(self, reason: "Drop | str", detail: str = ""):
        reason = Drop(reason)  # a declared reason (its key names it too)
        super().__init__(f"{reason}: {detail}" if detail else reason.key)
        self.reason = reason
        self.detail = detail

    def __reduce__(self):
        return Rejected, (self.reason.key, self.detail)


@dataclass
class Counters:
    drops: dict[str, int] = field(default_factory=dict)
    warnings: dict[str, int] = field(default_factory=dict)
    samples_read: dict[str, int] = field(default_factory=dict)  # group -> samples produced by its source
    samples_packed: dict[str, int] = field(default_factory=dict)  # group -> samples placed in batches
    examples: dict[str, str] = field(default_factory=dict)  # drop/warning kind -> detail of its first occurrence

    def drop(self, reason: "Drop | str", detail: str = "", n: int = 1, *, group: "str | None" = None) -> None:
        """Count ``n`` occurrences of ``reason`` (of source group ``group`` for a per-group reason).

        A plain string is counted as the key it is (counts made elsewhere; tests)."""
        key = reason.counted_as(group) if isinstance(reason, Drop) else str(reason)
        before = self.drops.get(key, 0)
        c = before + n
        self.drops[key] = c
        self.examples.setdefault(key, detail)
        # Per-stream detail is for -v: the driver announces each reason once per run (run/progress_bar.py).
        if before < 3 or c // 1000 > before // 1000:  # this update holds a first-three or a 1000th occurrence
            log.log(_level(reason), "drop[%s]=%d %s", key, c, detail)

    def drop_total(self, reason: Drop, n: int) -> None:
        """Count ``n`` at once, with no example: a total known at the end, not an event (one log line)."""
        key = reason.counted_as()
        self.drops[key] = self.drops.get(key, 0) + n
        log.log(_level(reason), "drop[%s]=%d at the end", key, self.drops[key])

    def warn(self, kind: "Warn | str", detail: str = "") -> None:
        key = kind.key if isinstance(kind, Warn) else str(kind)
        c = self.warnings.get(key, 0) + 1
        self.warnings[key] = c
        self.examples.setdefault(key, detail)
        if c <= 3 or c % 1000 == 0:
            log.log(_level(kind), "warning[%s]=%d %s", key, c, detail)

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


def _level(declared: "Drop | Warn | str") -> int:
    return declared.level if isinstance(declared, (Drop, Warn)) else logging.INFO


def meaning(kind: str, detail: str, knobs: dict, dropped: bool = True) -> str:
    """What a counted drop key or warning kind means, with its first example (one line), from its
    declaration: what happened, what the reference does, and what strict mode does instead."""
    _, declared = parse_key(kind, dropped)
    if declared is None:
        return ("samples or rows dropped" if dropped else "damaged input packed as the reference does") + \
            (f", e.g. {detail}" if detail else "") + \
            "; see docs/architecture/packing.md, 'Accounting and divergences from the reference'"
    try:
        text = declared.meaning.format(detail=detail or "?", **knobs)
    except (KeyError, IndexError, ValueError):
        text = declared.meaning
    if detail and "{detail}" not in declared.meaning:
        text += f" (e.g. {detail})"
    text += declared.reference.value
    if isinstance(declared, Warn) and declared.strict is not None:
        text += f" (strict: true drops it: {declared.strict})"
    return text
