"""A stream's packer at any point of its history, behind one interface: the one home for "go on
from another config's state".

``open_packer`` is how every caller (a stream job, a continuation's switch, a schedule's step,
``audit``, ``plan``, ``restore``) gets a packer: a plain ``StreamPacker`` for a config without a
schedule, a ``ScheduledPacker`` for one with, started at the stream's beginning, from a checkpoint
of the same config, or from a ``Switch`` (a state made under another config).  Both present the
``Packer`` protocol, so no caller asks which it holds.
"""

from __future__ import annotations

from typing import Iterator, Protocol

from prepack.engine.accounting import Counters
from prepack.engine.packer import PackerOptions, StreamPacker, StreamState, Switch
from prepack.engine.reuse.source_pictures import PictureStore
from prepack.engine.schedule import ScheduledPacker
from prepack.engine.sources import Source
from schemas.config import PrepackConfig
from schemas.packed_batch import PackedBatch


class Packer(Protocol):
    """What a caller of either packer uses (``StreamPacker`` and ``ScheduledPacker`` present it all)."""

    batches: int
    tokens: int
    counters: Counters  # drops and warnings so far
    pictures: PictureStore  # the stream's pictures: reuse counts, the pixel provider
    sources: "list[Source]"  # one per group, in the config's order

    def __iter__(self) -> Iterator[PackedBatch]: ...
    def state(self) -> StreamState: ...
    def budget_spent(self) -> bool: ...
    def final_counters(self) -> Counters: ...
    def go_on_from(self, switch: Switch) -> None: ...
    def close(self) -> None: ...
    def __enter__(self) -> "Packer": ...
    def __exit__(self, *exc) -> None: ...


def open_packer(cfg: PrepackConfig, stream: int, tokenizer, special,
                start: "StreamState | Switch | None" = None, options: PackerOptions = PackerOptions()) -> Packer:
    """The packer of ``stream`` under ``cfg`` from ``start``: None (the stream's start), a checkpoint
    of ``cfg`` (a ``StreamState``; under a schedule, one on a step's first batch switches there), or a
    ``Switch`` (another config's state: the packer starts where ``cfg`` starts and goes on from it)."""
    state = start if isinstance(start, StreamState) else None
    if cfg.schedule:
        packer = ScheduledPacker(cfg, stream, tokenizer, special, state, options)
    else:
        packer = StreamPacker(cfg, stream, tokenizer, special, state, options)
    if isinstance(start, Switch):
        packer.go_on_from(start)
    return packer

