"""Whether a shard could be packed again now: its sources and tokenizer as they were.

A trimmed shard exists only as its checkpoint and its sources (``prepack.run.bounded.trim``), so a trim
must never delete the records of a shard a restore could not rebuild: the sources it read
(``schemas.sources``, recorded at pack time by the stream's ``SourceLedger``) must still be there
with the same bytes, and the tokenizer must be the one it was packed with.  ``RestoreCheck`` says
why not, in one line naming the file: the trim policy keeps such a shard (and says so once per
source), ``prepack restore`` refuses before doing any work, ``prepack verify --restorable`` lists
the trimmed shards it could not restore now.  A restore still checks every file it makes against
the index's digests: this check says why before the work, it does not replace that one.
"""

from __future__ import annotations

import logging

from loader.reader import Pack
from prepack.engine.sources.ledger import SourceCheck
from prepack.run.bounded.checkpoint_ladder import nearest_kept
from prepack.run.reference_pack import balances_samples, open_reference
from prepack.engine.tokenizer import load_tokenizer, special_token_ids, tokenizer_fingerprint
from schemas.errors import DamagedFile
from schemas.layout import shard_file, shard_sources_file
from schemas.manifest import TrimmedShards
from schemas.sources import ShardSources
from schemas.streams import step_class

log = logging.getLogger(__name__)


class RestoreCheck:
    """Why shards of ``pack`` could not be packed again now, or None; ``tokenizer_fingerprint``: the
    tokenizer a restore would load (None: not checked); ``sources``: the check of the sources, kept
    by a caller that checks again and again (the running job's trims) so each file is hashed once."""

    def __init__(self, pack: Pack, tokenizer_fingerprint: "str | None" = None, sources: "SourceCheck | None" = None):
        self.pack = pack
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.sources = sources if sources is not None else SourceCheck()
        # a balanced-samples pack's shards are re-split from its reference's: their restorability is theirs
        self.reference = RestoreCheck(open_reference(pack), tokenizer_fingerprint, self.sources) \
            if balances_samples(pack) else None
        self._read: dict[int, set[int]] = {}  # reference stream -> its trimmed shards (a balanced pack's)

    def why_not(self, stream: int, shard: int) -> "str | None":
        """What keeps shard ``shard`` of ``stream`` from being packed again byte for byte, in a few words
        naming the file (``source /data/a.jpg deleted since it was packed``), or None.  Where a trim
        dropped its checkpoint, the shards a restore packs again first count too; a balanced-samples
        pack's shard counts the trimmed reference shards its steps are re-split from."""
        if self.reference is not None:
            return self._why_not_balanced(stream, shard)
        dropped = set(TrimmedShards.read(self.pack.location, stream).checkpoints)
        start = nearest_kept(shard, dropped)
        for k in range(start, shard + 1):
            why = self._why_not_alone(stream, k)
            if why is not None:
                return why if k == shard else (f"{why}, in {shard_file(stream, k)}, which a restore packs again first "
                                               f"(from checkpoint {start}: the ones between were dropped)")
        return None

    def _why_not_balanced(self, stream: int, shard: int) -> "str | None":
        pack, reference = self.pack, self.reference.pack
        cfg = pack.info.stored_config()
        sh = next(x for x in pack.index(stream).shards if x.shard == shard)
        first = pack.switch(stream) + sh.first_record
        end = first + len(sh.records)
        for t in step_class(stream, cfg.world_size, cfg.num_workers):
            n = reference.switch(t)
            if t not in self._read:  # each reference stream's index and trims read once per check
                self._read[t] = set(TrimmedShards.read(reference.location, t).shards)
                reference.index(t, refresh=True)
            trimmed = self._read[t]
            for rsh in reference.index(t).shards:
                if rsh.shard in trimmed and n + rsh.first_record < end and n + rsh.first_record + len(rsh.records) > first:
                    why = self.reference.why_not(t, rsh.shard)
                    if why is not None:
                        return f"{why}, in the reference's {shard_file(t, rsh.shard)}, which its steps are re-split from"
        return None

    def _why_not_alone(self, stream: int, shard: int) -> "str | None":
        try:
            doc = ShardSources.read(self.pack.location, stream, shard)
        except DamagedFile as e:
            return f"its record of sources is damaged ({e})"
        if doc is None:
            return f"no record of the sources it read ({shard_sources_file(stream, shard)} is missing)"
        if self.tokenizer_fingerprint is not None and doc.tokenizer_fingerprint != self.tokenizer_fingerprint:
            return (f"the tokenizer a restore loads is not the one it was packed with (fingerprint "
                    f"{self.tokenizer_fingerprint[:80]}, packed with {doc.tokenizer_fingerprint[:16]})")
        for ident in doc.sources:
            problem = self.sources.problem(ident)
            if problem is not None:
                return f"source {ident.describe()} {problem} since it was packed"
        return None


def current_tokenizer(pack: "Pack | str") -> str:
    """The fingerprint of the tokenizer a restore of ``pack`` (a pack, or its folder or URI) would load
    now (its stored config's); a description that matches no fingerprint when it does not load (so
    nothing counts as restorable)."""
    pack = pack if isinstance(pack, Pack) else Pack.open(pack)
    try:
        return tokenizer_fingerprint(special_token_ids(load_tokenizer(pack.info.stored_config().tokenizer))[0])
    except Exception as e:  # noqa: BLE001 (whatever stops the tokenizer loading stops a restore)
        return f"(none: the tokenizer does not load: {type(e).__name__}: {e})"


class KeptShards:
    """Shards a trim kept because they could not be restored, each reason said once (a running job
    trims every few seconds; the first shard a changed source keeps says it)."""

    def __init__(self):
        self.said: set[str] = set()

    def say(self, stream: int, shard: int, reason: str) -> None:
        if reason not in self.said:
            self.said.add(reason)
            log.warning("%s kept, not trimmed: %s; a restore could not pack it again (so are other shards that "
                        "read it)", shard_file(stream, shard), reason)
