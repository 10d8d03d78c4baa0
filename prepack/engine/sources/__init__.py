"""Data sources, one per group kind (``schemas.kinds``); each yields ``Sample`` objects for one stream."""

from __future__ import annotations

from prepack.engine.sources.base import Source, SourceStalled, StreamContext
from prepack.engine.sources.edit import EditSource
from prepack.engine.sources.sft import SftSource
from prepack.engine.sources.t2i import T2ISource
from schemas.config import GroupConfig
from schemas.kinds import KINDS


def implementations(*classes: type[Source], kinds=KINDS) -> dict[str, type[Source]]:
    """Kind name -> the source class that implements it; every declared kind exactly once."""
    by_kind: dict[str, type[Source]] = {}
    for cls in classes:
        name = cls.kind.name
        if name in by_kind:
            raise TypeError(f"source kind {name} has two implementations: {by_kind[name].__name__}, {cls.__name__}")
        if kinds.get(name) is not cls.kind:
            raise TypeError(f"{cls.__name__} implements {name}, which schemas.kinds does not declare")
        by_kind[name] = cls
    missing = [name for name in kinds if name not in by_kind]
    if missing:
        raise TypeError(f"source kind(s) {', '.join(missing)} declared in schemas.kinds have no implementation")
    return by_kind


SOURCES = implementations(T2ISource, SftSource, EditSource)


def make_source(group: GroupConfig, ctx: StreamContext) -> Source:
    return SOURCES[group.kind.name](group, ctx)


__all__ = ["Source", "SourceStalled", "StreamContext", "make_source", "implementations", "SOURCES"]
