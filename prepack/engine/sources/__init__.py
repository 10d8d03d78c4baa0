"""Data sources, one per BAGEL group kind; each yields ``Sample`` objects for one stream."""

from __future__ import annotations

from prepack.engine.sources.base import Source, SourceStalled, StreamContext
from prepack.engine.sources.edit import EditSource
from prepack.engine.sources.sft import SftSource
from prepack.engine.sources.t2i import T2ISource
from schemas.config import GroupConfig

SOURCE_KINDS = {"t2i_pretrain": T2ISource, "vlm_sft": SftSource, "unified_edit": EditSource}


def make_source(group: GroupConfig, ctx: StreamContext) -> Source:
    return SOURCE_KINDS[group.name](group, ctx)


__all__ = ["Source", "SourceStalled", "StreamContext", "make_source", "SOURCE_KINDS"]
