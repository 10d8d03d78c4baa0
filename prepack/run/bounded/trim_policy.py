"""The trim policy: which shards of a pack may go now.  The one place a new policy goes.

A shard may go once no training can read it again: all its records lie before ``before(stream)``,
the earliest chain record any training may still come back to.  Two sources of that position:

- ``behind_states``: loader states given by hand (``prepack trim --state``): each one's position;
- ``behind_checkpoints``: the trainings' progress folders (``prepack trim --progress``, and a
  bounded run as it packs): the earliest of each training's ``keep`` newest checkpoints
  (``prepack.run.bounded.trainings``), so a crash rolls back to nothing trimmed.

Whatever the position, a shard goes only if it could be packed again now: its sources unchanged
and the tokenizer the same (``prepack.run.bounded.restorable``); otherwise it is kept and the reason said
once.  ``TrimPolicy.apply`` is the one loop over streams; the deleting itself (list the shard in
``trimmed.json`` first, then delete its records file) is ``prepack.run.bounded.trim.trim_shards``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from loader.reader import Pack
from prepack.engine.sources.ledger import SourceCheck
from prepack.run.bounded.restorable import KeptShards, RestoreCheck
from prepack.run.bounded.trainings import Trainings
from prepack.run.bounded.trim import drop_checkpoints, positions_of, trim_shards
from schemas.layout import shard_file
from schemas.manifest import ShardEntry, TrimmedShards

log = logging.getLogger(__name__)


@dataclass
class TrimResult:
    shards: dict[int, list[int]] = field(default_factory=dict)  # stream -> shards trimmed now
    freed_bytes: int = 0
    checkpoints: int = 0  # checkpoints dropped now (off the ladder)
    kept: dict[tuple[int, int], str] = field(default_factory=dict)  # (stream, shard) -> why it could not go

    def lines(self) -> list[str]:
        n = sum(len(v) for v in self.shards.values())
        dropped = f", {self.checkpoints} checkpoint(s) off the ladder dropped" if self.checkpoints else ""
        out = [f"trimmed {n} shard(s) of {len(self.shards)} stream(s){dropped}, {self.freed_bytes / 2**20:,.1f} MiB "
               "freed (indexes, digests and a ladder of checkpoints kept: prepack restore packs them again)"] \
            if n or self.checkpoints else []
        if self.kept:
            (stream, shard), why = min(self.kept.items())
            out.append(f"kept {len(self.kept)} shard(s) behind the trainings that could not be packed again now, "
                       f"e.g. {shard_file(stream, shard)}: {why}")
        return out or ["nothing to trim: no shard lies wholly behind the positions given"]


@dataclass
class TrimPolicy:
    """Trim ``pack``'s shards wholly before ``before(stream)`` (chain records; 0: keep the stream whole)
    that could be packed again now (``tokenizer_fingerprint``: the tokenizer a restore would load)."""

    pack: Pack
    before: Callable[[int], int]
    tokenizer_fingerprint: "str | None" = None
    kept: KeptShards = field(default_factory=KeptShards)
    sources: SourceCheck = field(default_factory=SourceCheck)  # each source file hashed once per policy

    @classmethod
    def behind_states(cls, pack: Pack, states: "list[dict | list]",
                      tokenizer_fingerprint: "str | None" = None) -> "TrimPolicy":
        """Nothing at or after the position of any of ``states`` (several trainings or checkpoints)."""
        at = positions_of(pack, states)
        return cls(pack, lambda s: at.get(s, 0), tokenizer_fingerprint)

    @classmethod
    def behind_checkpoints(cls, trainings: Trainings, keep: int,
                           tokenizer_fingerprint: "str | None" = None) -> "TrimPolicy":
        """Nothing at or after the earliest of each training's ``keep`` newest checkpoints."""
        return cls(trainings.pack, lambda s: trainings.kept_before(s, keep), tokenizer_fingerprint)

    def behind(self, stream: int) -> list[ShardEntry]:
        """The shards of ``stream`` not trimmed yet whose records all lie before its position."""
        before = self.before(stream)
        if not before:
            return []
        n = self.pack.switch(stream)
        index = self.pack.index(stream, refresh=True)
        listed = set(TrimmedShards.read(self.pack.location, stream).shards)
        return [sh for sh in index.shards
                if n + sh.first_record + len(sh.records) <= before and sh.shard not in listed]

    def may_go(self, stream: int, check: RestoreCheck, result: TrimResult) -> list[ShardEntry]:
        """The shards behind the position (``behind``) that could be packed again now; the others are
        kept, in ``result.kept``, and said once."""
        out = []
        for sh in self.behind(stream):
            why = check.why_not(stream, sh.shard)
            if why is None:
                out.append(sh)
            else:
                result.kept[(stream, sh.shard)] = why
                self.kept.say(stream, sh.shard, why)
        return out

    def apply(self, streams: "list[int] | range | None" = None, forget: bool = False) -> TrimResult:
        """Trim every shard that may go, of ``streams`` (default: all); ``forget``: drop each stream's
        index from memory after it (a pass over a whole pack)."""
        result = TrimResult()
        check = RestoreCheck(self.pack, self.tokenizer_fingerprint, self.sources)
        ladder = check.reference is None  # a balanced-samples pack's streams have no checkpoints of their own
        for stream in sorted(range(self.pack.num_streams) if streams is None else streams):
            shards = self.may_go(stream, check, result)
            if shards:
                result.shards[stream] = [sh.shard for sh in shards]
                result.freed_bytes += trim_shards(self.pack, stream, shards)
            if ladder:
                dropped, freed = drop_checkpoints(self.pack, stream)  # the ladder thins as the head moves on, too
                result.checkpoints += dropped
                result.freed_bytes += freed
            if forget:
                self.pack.forget(stream)
        return result


def trim_pack(out, states: "list[dict | list]", tokenizer_fingerprint: "str | None" = None) -> TrimResult:
    """``prepack trim OUT --state ...``: every shard wholly behind the positions of ``states``."""
    pack = Pack.open(out)
    return TrimPolicy.behind_states(pack, states, tokenizer_fingerprint).apply(forget=True)


def trim_to_progress(out, folders: "list[str]", keep: int, tokenizer_fingerprint: "str | None" = None) -> TrimResult:
    """``prepack trim OUT --progress ...``: every shard behind the ``keep`` newest checkpoints the
    trainings publishing to ``folders`` kept; a stream some training has not checkpointed ``keep``
    times yet is left whole."""
    trainings = Trainings(folders, Pack.open(out))
    trainings.refresh(force=True)
    return TrimPolicy.behind_checkpoints(trainings, keep, tokenizer_fingerprint).apply(forget=True)
