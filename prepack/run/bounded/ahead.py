"""A bounded pack: pack each stream just ahead of the trainings reading it, trim behind them.

``AheadGate.holding(stream, records)``: what keeps the stream from starting another shard, having
``records`` in its chain (None: nothing)?  ``--ahead N``: it has N batches or more past the furthest
training's position (``prepack.run.bounded.trainings``).  A shard once started is finished (readers see
whole shards), so a stream holds at most ``ahead`` plus one shard of batches past the furthest
reader.  ``--disk-budget``: the stream's directory and its next shard would not fit in the stream's
share of the budget (``DiskShare``; the shares add up to the budget, so the pack stays under it
without the streams talking to each other).  Readers publish their position
before they would wait for a batch not yet packed, so a packer holding back always hears that they
caught up.  What may be trimmed meanwhile is the trim policy's to say (``prepack.run.bounded.trim_policy``);
``JobStreams`` is the job's side: which of its streams may pack now, and its trims every few seconds.
"""

from __future__ import annotations

import logging
import posixpath
import time
from collections.abc import Callable
from dataclasses import dataclass

from loader.reader import Pack
from schemas.errors import DiskBudgetTooSmall, UsageError
from schemas.layout import index_file, shard_latents_file, stream_dir
from schemas.manifest import TrimmedShards
from schemas.streams import step_class
from prepack.run.bounded import trainings as trainings_module
from prepack.run.bounded.bound import BoundSpec
from prepack.run.bounded.grants import GrantReader
from prepack.run.bounded.trainings import Trainings
from prepack.run.bounded.trim_policy import TrimPolicy
from schemas.location import PackLocation

log = logging.getLogger(__name__)


RECORD_BYTES_PER_TOKEN = 1024  # a record's most: every token an image patch of 16x16 RGB pixels, stored raw, + arrays
CKPT_BYTES_PER_TOKEN = 800  # a buffered sample's most in a checkpoint: a 16x16 RGB patch (768) or a token id in JSON
CKPT_BASE_BYTES = 1 << 16  # a checkpoint's random states, source cursors and counters
SHARD_FILES_SLACK = 1 << 20  # a shard's pixel index, lineage and sources, at least
PACK_FILES_RESERVE = 1 << 20  # the pack's own files (pack.json, manifest.json), outside every stream's share


def shard_most(cfg) -> int:
    """The most one shard adds to its stream's folder, whatever its records: its records file (it ends
    after the record that reaches ``shard_bytes``: at most ``shard_bytes`` plus one record of
    ``max_num_tokens`` image tokens stored raw) and the checkpoint at its end (``max_buffer_size``
    buffered samples of ``max_num_tokens_per_sample`` tokens, each a raw patch).  Its small files are
    ``DiskShare``'s to add (they scale with what it holds)."""
    k = cfg.knobs
    records = cfg.prepack.shard_bytes + k.max_num_tokens * RECORD_BYTES_PER_TOKEN
    return records + k.max_buffer_size * k.max_num_tokens_per_sample * CKPT_BYTES_PER_TOKEN + CKPT_BASE_BYTES


def shards_held(cfg) -> int:
    """The shards' most a stream's share must hold at once: the one the trainings read and the next
    one; a balanced-samples pack a third, the balanced twin of the reference shard being packed."""
    return 3 if cfg.prepack.balance == "samples" else 2


def least_budget(cfg) -> int:
    """The least ``--disk-budget`` a run of ``cfg`` accepts (``share_of``)."""
    return shards_held(cfg) * (shard_most(cfg) + SHARD_FILES_SLACK) * cfg.num_streams + PACK_FILES_RESERVE


def share_of(cfg, budget: int) -> int:
    """A stream's share of ``--disk-budget``; UsageError, before any work, when it cannot hold
    ``shards_held`` shards' most, naming the smallest budget that works."""
    streams, shards = cfg.num_streams, shards_held(cfg)
    share = max(0, budget - PACK_FILES_RESERVE) // max(1, streams)
    need = shards * (shard_most(cfg) + SHARD_FILES_SLACK)  # less can never pack the next shard
    if share < need:
        what = ("one shard the trainings read and the next one's most" if shards == 2 else
                f"{shards} shards' most (one the trainings read, a reference shard and its balanced twin)")
        raise UsageError(f"--disk-budget {budget:,} bytes: each of the {streams} streams would get {share:,}, less than "
                         f"{what} ({need:,}: shard_bytes, a record of max_num_tokens and a checkpoint of "
                         "max_buffer_size samples, stored raw); the smallest budget "
                         f"that works is {least_budget(cfg):,} bytes (and the trainings' window on "
                         "top: prepack plan --ahead N prints it); raise it, or lower prepack.shard_bytes")
    return share


@dataclass(frozen=True)
class StreamUse:
    """What a stream's folder holds now: ``used`` bytes in all, of which ``shards`` (records files not
    trimmed, and their latents: what a trim frees) and ``index`` (rewritten whole at each commit);
    ``committed`` shards in its index."""

    used: int
    shards: int
    index: int
    committed: int

    @classmethod
    def of(cls, pack: Pack, stream: int, refresh: bool = True) -> "StreamUse":
        """Read the index first (``refresh``: again; else as last read), then list: a shard committed
        in between is counted in ``used`` (its reserve is released by the index read before), never missed."""
        shards = pack.index(stream, refresh=refresh).shards
        trimmed = set(TrimmedShards.read(pack.location, stream).shards)
        listing = [i for i in pack.location.list(stream_dir(stream)) if i.size is not None]
        present = sum(sh.nbytes for sh in shards if sh.shard not in trimmed)
        names = {posixpath.basename(shard_latents_file(stream, sh.shard)) for sh in shards}
        latents = sum(i.size for i in listing if posixpath.basename(i.path) in names)  # trimmed with their shard
        index = next((i.size for i in listing if posixpath.basename(i.path) == posixpath.basename(index_file(stream))), 0)
        return cls(sum(i.size for i in listing), present + latents, index, len(shards))

    @property
    def kept(self) -> int:
        """What no trim frees: checkpoints, indexes, sources, lineage."""
        return self.used - self.shards

    def reserve(self, most: int) -> int:
        """The most the stream's next shard adds: ``most`` (``shard_most``), its small files (twice the
        stream's mean so far, at least ``SHARD_FILES_SLACK``) and the index rewritten beside the old."""
        return most + max(SHARD_FILES_SLACK, 2 * (max(0, self.kept) // max(1, self.committed))) + self.index


class DiskShare:
    """A stream's share of ``--disk-budget``: the budget, less the pack's own files, over the pack's
    streams.  A stream may start a shard while its folder plus that shard's most (``reserve``) fits
    in its share.  The reserve is sound (``shard_most``: a record far larger than any before fits)
    plus the shard's small files and the stream index's size (``StreamUse.reserve``).  A share that
    cannot hold that and the shard the trainings read is refused at the start; a stream whose files
    no trim can free (checkpoints of the ladder, indexes, sources, lineage) leave no room for the
    reserve stops with the smallest budget that works then (``DiskBudgetTooSmall``), instead of
    waiting for good."""

    def __init__(self, budget: int, pack: Pack):
        cfg = pack.info.stored_config()
        self.pack, self.budget = pack, budget
        self.share = share_of(cfg, budget)
        self.most = shard_most(cfg)

    def holding(self, stream: int) -> "str | None":
        """Why ``stream`` may not start a shard within its share now (None: it may).
        DiskBudgetTooSmall when no trim could ever make that room."""
        use = StreamUse.of(self.pack, stream)
        reserve = use.reserve(self.most)
        if use.used + reserve <= self.share:
            return None
        if use.kept + reserve > self.share:
            smallest = (use.kept + reserve + self.most) * self.pack.num_streams + PACK_FILES_RESERVE
            raise DiskBudgetTooSmall(
                f"stream {stream}: its share of --disk-budget ({self.share:,} bytes) cannot hold what no trim frees "
                f"({use.kept:,} bytes: checkpoints on the ladder, indexes, sources, lineage) and its next shard's most "
                f"({reserve:,}); no trim can make that room. The smallest budget that works now is {smallest:,} bytes")
        return f"{use.used:,} bytes on disk + {reserve:,} for its next shard > its share of --disk-budget ({self.share:,})"


class StepNeeds:
    """What a balanced-samples pack's reference must pack beyond ``--ahead`` (``BoundSpec.reads``).

    A balanced shard of stream s ends where reference shard s ends and is made from the records of
    every stream of s's step class, so the trainings' next balanced shard of s needs the class's
    other streams packed at least that far.  Held to ``--ahead`` alone, a stream of short shards
    would stop before the end of its neighbour's long one, and the trainings would wait for good.
    So a stream also packs up to the furthest end of its class's shards that hold a record its
    trainings want (their position plus ``--ahead``); the shards it packs for that want nothing more,
    so the class stops."""

    def __init__(self, pack: Pack, trainings: Trainings, ahead: int):
        cfg = pack.info.stored_config()
        self.pack, self.trainings, self.ahead = pack, trainings, ahead
        self.world_size, self.num_workers = cfg.world_size, cfg.num_workers
        self._read_at: dict[int, float] = {}  # each stream's index read again at most every POLL_S

    def need(self, stream: int) -> int:
        """The chain records ``stream`` must have for the balanced shards its class's trainings want."""
        out = 0
        for s in step_class(stream, self.world_size, self.num_workers):
            want = self.trainings.reached(s) + self.ahead  # records s packs for its own trainings
            n = self.pack.switch(s)
            fresh = time.monotonic() - self._read_at.get(s, -1e9) >= trainings_module.POLL_S
            if fresh:
                self._read_at[s] = time.monotonic()
            for sh in reversed(self.pack.index(s, refresh=fresh).shards):
                if n + sh.first_record < want:  # the last shard holding a wanted record
                    out = max(out, n + sh.first_record + len(sh.records))
                    break
        return out


class AheadGate:
    """``spec.ahead`` and ``spec.disk_budget`` read against the trainings of ``pack`` (or of
    ``spec.reads``; neither: every shard may start)."""

    def __init__(self, spec: BoundSpec, pack: Pack):
        self.spec = spec
        self.trainings = Trainings(spec.progress, Pack.open(spec.reads) if spec.reads else pack)
        self.steps = StepNeeds(pack, self.trainings, spec.ahead) if spec.reads and spec.ahead is not None else None
        self.disk = DiskShare(spec.disk_budget, pack) if spec.disk_budget is not None else None
        self.grants = GrantReader(pack.location) if spec.granted else None

    def holding(self, stream: int, records: int) -> "str | None":
        """Why ``stream`` may not start another shard now, having ``records`` in its chain; None: it may."""
        if self.spec.ahead is not None:
            reached = self.trainings.reached(stream)
            if records >= reached + self.spec.ahead and (self.steps is None or records >= self.steps.need(stream)):
                return f"{records} records packed, training at {reached} (--ahead {self.spec.ahead})"
        if self.grants is not None and (why := self.grants.holding(stream, records)) is not None:
            return why
        return self.disk.holding(stream) if self.disk is not None else None

    def may_pack(self, stream: int, records: int) -> bool:
        return self.holding(stream, records) is None


@dataclass(frozen=True)
class WaitRule:
    """How a stream waits for its trainings: ``give_up_s`` (None: as long as it takes; then the stream
    returns ``Paused`` and lets its CPU go), ``on_wait`` run at each poll (a job packing in one
    process trims meanwhile)."""

    give_up_s: float | None = None
    on_wait: "Callable[[], None] | None" = None


def wait_to_pack(gate: AheadGate, stream: int, records: int, rule: WaitRule = WaitRule()) -> bool:
    """Wait until ``stream`` may start another shard; False when ``rule.give_up_s`` passed first."""
    start = time.monotonic()
    said = False
    while (why := gate.holding(stream, records)) is not None:
        if not said:
            log.info("stream %d: waiting: %s", stream, why)
            said = True
        if rule.give_up_s is not None and time.monotonic() - start >= rule.give_up_s:
            return False
        if rule.on_wait is not None:
            rule.on_wait()
        time.sleep(trainings_module.POLL_S)
        gate.trainings.refresh(force=True)
    return True


class JobStreams:
    """The streams of a job not finished yet, and which of them may pack now.  Without a bound every
    stream is ready once; with one (``--ahead``), a stream that returned ``Paused`` is ready again when
    its trainings come close enough, and the job trims its streams behind their kept checkpoints."""

    TRIM_EVERY_S = 5.0

    def __init__(self, loc: PackLocation, todo: list[int], bound: "BoundSpec | None"):
        self.streams: dict[int, int | None] = {s: None for s in todo}  # stream -> chain records when paused
        self.todo = list(todo)  # a finished stream is still read: it is trimmed too
        self.gate: AheadGate | None = None
        self.policy: TrimPolicy | None = None
        self._trimmed_at = -1e9
        if bound is not None and bound.active:
            self.gate = AheadGate(bound, Pack.open(loc))  # a budget no stream's shard fits in: refused here
            if bound.reads is None:  # a reference packed for another pack's trainings is trimmed as it is balanced
                self.policy = TrimPolicy.behind_checkpoints(self.gate.trainings, bound.keep)
        self.running: set[int] = set()

    def ready(self) -> list[int]:
        out = []
        for s, records in self.streams.items():
            if s in self.running:
                continue
            if records is None or self.gate is None or self.gate.may_pack(s, records):
                out.append(s)
        return out

    def started(self, stream: int) -> None:
        self.running.add(stream)

    def returned(self, stream: int, paused_at: int | None) -> None:
        """``stream`` returned: finished (``paused_at`` None) or paused with that many chain records."""
        self.running.discard(stream)
        if paused_at is not None:
            self.streams[stream] = paused_at
        else:
            self.streams.pop(stream, None)

    def trim(self, force: bool = False) -> None:
        """Trim this job's streams behind the trainings' kept checkpoints, every few seconds."""
        if self.policy is None or (not force and time.monotonic() - self._trimmed_at < self.TRIM_EVERY_S):
            return
        self._trimmed_at = time.monotonic()
        result = self.policy.apply(self.todo)
        if result.shards:
            log.info("trimmed %d shard(s), %.1f MiB behind the trainings' kept checkpoints",
                     sum(len(v) for v in result.shards.values()), result.freed_bytes / 2**20)

    def idle(self) -> None:
        """Between rounds: trim, and wait a moment when no stream may pack."""
        self.trim()
        if self.streams and not self.ready():
            time.sleep(trainings_module.POLL_S)
