"""Continuing a pack under a new config (``prepack run B.yaml --out NEW --continue OLD --after N``).

Stream s of NEW starts from OLD's stream s exactly as the loader reads it after ``after[s]``
records (OLD's own chain counted whole) and packs B's budget from there; the loader then reads
NEW as OLD's first records followed by NEW's (``loader.reader``).  The state after a record is
what the online packer's ``state_dict`` holds there (its buffer, its random state and each group's
data position), so NEW is what a reference ``PackedDataset`` built from B yields after
``load_state_dict`` of OLD's state (``schemas.mix_change`` says what may change, and how groups
match).

The state after record n comes from the nearest checkpoint the segment holding n kept at or before
it (``ckpt-k``: the state at the start of shard k), replayed forward under that segment's config
(``prepack.run.bounded.replay``): the replayed batches' pictures are taken from the segment's own
shards (the reuse path) where they are still there, and each replayed batch must have the digest
the segment's index records, so a replay that would not reproduce OLD is refused instead of
continued.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from loader.reader import Pack
from loader.state import positions_in, read_state_file
from prepack.engine.packer import Switch
from prepack.run.bounded.replay import state_at
from schemas.config import PrepackConfig
from schemas.errors import PackRefused, UsageError
from schemas.layout import REFERENCE_DIR
from schemas.location import redact_uri, resolve_location
from schemas.mix_change import check_mix_change
from schemas.pack_info import ParentLink

log = logging.getLogger(__name__)

WAIT_LOG_S = 30.0


@dataclass(frozen=True)
class Continue:
    """``--continue URI`` with ``--after N`` (every stream) or ``--after-state`` (each stream its own)."""

    uri: str
    after: int | None = None
    # a loader state, or a list of them (one per rank), or a merged one (read from JSON)
    after_state: dict | list | None = None

    @classmethod
    def from_cli(cls, args) -> "Continue | None":
        """From ``--continue/--after/--after-state`` (``prepack run`` and ``prepack plan``); None without them."""
        if args.continue_from is None and args.after is None and args.after_state is None:
            return None
        if args.continue_from is None:
            raise UsageError("--after and --after-state go with --continue OLD")
        return cls.from_args(args.continue_from, args.after, args.after_state)

    @classmethod
    def from_args(cls, uri: str, after: int | None, after_state_path: str | None) -> "Continue":
        if (after is None) == (after_state_path is None):
            raise UsageError("--continue needs exactly one of --after N and --after-state STATE.json")
        if after is not None and after < 0:
            raise UsageError(f"--after must be 0 or more, got {after}")
        state = None
        if after_state_path is not None:
            try:
                state = read_state_file(after_state_path)
            except ValueError as e:
                raise UsageError(f"--after-state {e}") from None
        return cls(uri, after, state)


def open_parent(uri: str) -> Pack:
    """The pack to continue, as the loader reads it (a chain of its own included)."""
    try:
        return Pack.open(uri)
    except OSError as e:
        raise PackRefused(f"--continue {redact_uri(uri)}: {str(e).strip().splitlines()[0]}") from None


def chain_configs(pack: Pack) -> list[PrepackConfig]:
    """The config of every segment of ``pack``'s chain, newest first (a segment with a schedule: each
    of its steps' configs)."""
    out = []
    while pack is not None:
        out.extend(reversed(steps_of(pack.info.stored_config())))
        pack = pack.parent
    return out


def steps_of(cfg: PrepackConfig) -> list[PrepackConfig]:
    """The configs a pack of ``cfg`` packs under: itself, or each step of its schedule."""
    return [cfg.step_config(i) for i in range(len(cfg.schedule) + 1)]


def check_continuation(parent: Pack, cfg: PrepackConfig, uri: str) -> None:
    """``cfg`` (each step of its schedule) may continue every segment of the parent's chain
    (``schemas.mix_change``); a balanced-samples pack holds no states of its own to go on from."""
    segment = parent
    while segment is not None:
        if segment.info.stored_config().prepack.balance == "samples":
            where = redact_uri(segment.location.base)
            raise UsageError(f"--continue {redact_uri(uri)}: {where} is a balanced-samples pack, whose streams' "
                             f"states are its reference's: continue from {where}/{REFERENCE_DIR} (the same samples, "
                             "step for step)")
        segment = segment.parent
    for old in chain_configs(parent):
        for new in steps_of(cfg):
            check_mix_change(old, new, redact_uri(uri))


def switch_points(parent: Pack, how: Continue) -> list[int]:
    """Per stream, after how many of the parent's records the continuation starts."""
    if how.after is not None:
        return [how.after] * parent.num_streams
    try:
        at = positions_in(parent, [how.after_state])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise PackRefused(f"--after-state: {e} ({redact_uri(how.uri)})") from None
    return [at[s] for s in range(parent.num_streams)]


def wait_for_parent(parent: Pack, after: list[int], uri: str, poll_s: float = 2.0) -> None:
    """Wait until every stream of the parent holds the records a continuation takes from it; a stream
    that finished with fewer is refused."""
    last_log = time.monotonic()
    while True:
        short = []
        for s, n in enumerate(after):
            if n and parent.num_records(s) < n:
                parent.index(s, refresh=True)
                if parent.num_records(s) < n:
                    if parent.done(s) is not None:
                        raise PackRefused(f"--continue {redact_uri(uri)}: stream {s} ended after "
                                          f"{parent.num_records(s)} records, before record {n}")
                    short.append(s)
        if not short:
            return
        if time.monotonic() - last_log >= WAIT_LOG_S:
            last_log = time.monotonic()
            log.info("waiting for %s: %d streams not yet past the switch (e.g. stream %d: %d of %d records)",
                     redact_uri(uri), len(short), short[0], parent.num_records(short[0]), after[short[0]])
        time.sleep(poll_s)


def parent_link(parent: Pack, after: list[int], uri: str) -> ParentLink:
    """What NEW's pack.json records of its parent (a local path is made absolute)."""
    loc = resolve_location(uri)
    return ParentLink(uri=loc.base if loc.is_local else uri, fingerprint=parent.fingerprint, after=list(after),
                      last=[parent.record_digest(s, n - 1) if n else "" for s, n in enumerate(after)])


def switch_at(pack: Pack, stream: int, n: int, tokenizer, special) -> Switch:
    """Where a continuation of ``pack`` after its chain's record ``n`` goes on from: the stream's state
    there, and the config it was packed under (of a pack with a schedule: the step that packed record
    ``n - 1``)."""
    m = pack.switch(stream)
    if n < m:
        return switch_at(pack.parent, stream, n, tokenizer, special)
    cfg = pack.info.stored_config()
    index = pack.index(stream)
    local = n - m
    if local > index.num_records:
        raise PackRefused(f"{pack.location.base}: stream {stream} has {m + index.num_records} records, not {n}")
    got = state_at(pack.location, index, cfg, local, (tokenizer, special))
    log.info("stream %d: state after record %d from %s (checkpoint %d, %d batches replayed)",
             stream, n, pack.location.base, got.checkpoint, got.replayed)
    return Switch(got.state, cfg.packed_under(local))
