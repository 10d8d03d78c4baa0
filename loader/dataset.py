"""``PackedShardDataset``: this rank's share of a pack, resumable, for a training DataLoader.

Which streams a rank reads (pack made for W ranks x K workers, stream ``s = r*K + w``; K = 0 in the
pack identity means one stream per rank):

- same world size as the pack: rank r reads streams ``r*K .. r*K+K-1`` interleaved round-robin,
  exactly the order the online reference's K-worker DataLoader yields them;
- another world size W': stream s goes to rank ``s % W'``; each rank interleaves its streams
  round-robin in stream order (streams that run out are skipped).  Every batch is read exactly
  once over all ranks.  More ranks than streams is an error.

Inside a DataLoader with J > 1 workers, worker j takes every J-th stream of the rank's list
(``streams[j::J]``) and interleaves those, so nothing is read twice; with J = K on the pack's own
world size the DataLoader's round-robin over workers reproduces the rank order above.  Use
``batch_size=None`` (each item is already a whole packed batch).

``state_dict()`` is the position after the last batch handed out (one integer in the
deterministic order, plus what is needed to refuse a state from another pack or split);
``load_state_dict()`` makes the next ``iter()`` continue right after it.  Both are plain dicts on
the outside (torch's weights-only loader restores them), typed inside (``loader.state``).  It works under
torchdata's ``StatefulDataLoader`` (each worker's copy keeps its own state).

Changing the world size mid-training: merge the dataset states of every old rank (and DataLoader
worker) with ``PackedShardDataset.merge_states(states)`` and load the merged state on every new
rank; each stream then continues at its next unread record under the new assignment, so every
batch is read exactly once overall.

Balanced steps (``balance=Balance(micro_batches=M, sync=..., cost_model=...)``, or ``True`` for
the defaults; ``loader.balance.Balance``, ``loader.balanced``): each optimizer step's W x M
reference batches are dealt to the ranks and micro-steps by their estimated cost (default model:
the pack's, ``PackInfo.cost_model``): under ``sync="lockstep"`` (FSDP, the default) grouped into
micro-steps, under ``sync="step"`` (DDP under ``no_sync``) evening each rank's sum.  Every rank
computes the same assignment from the index.  Inside a DataLoader with J workers, worker j yields
items j, j+J, ... of the rank's balanced sequence (each worker computes the whole sequence and
reads only its items).  The state is the optimizer step, the item within it and every stream's
position at the step's start; ``merge_states`` of every rank's balanced states at one step
boundary loads on any world size, balanced or not.  Without ``balance`` nothing changes.

VAE latents (``vae_latents=True``; ``loader.latents``): each batch carries its VAE images' encoder
moments, stored beside its shard by ``prepack latents``, and hands ``padded_latent`` (drawn on its
device; ``set_epoch`` draws anew per pass) in place of ``padded_images``; a shard without latents
is an error naming it (``"prefer"``: pixels there).  Balancing then leaves the VAE out of a
batch's cost.

``progress`` (a folder, ``file://`` or ``s3://`` URI; ``schemas.progress``) publishes where the
training stands, for a pack that is bounded by it: ``prepack run --ahead N --progress P`` packs
at most N batches past the live position, ``prepack trim --progress P`` trims behind the K
newest checkpoints.  Live: each iterator's next record per stream, at most every
``live_every_s`` seconds, and at once when it starts (a resumed position), ends, or is about to
wait for a batch (so a packer holding back hears that training caught up).  Checkpoint:
``state_dict()`` in the training process appends the state's positions and last digests, unless
``publish_checkpoints`` is False; inside a DataLoader worker it never does, since torchdata's
``StatefulDataLoader`` calls it there at every step (``build_dataloader`` publishes the rank's
checkpoint from the loader's own ``state_dict()`` instead).  A folder that cannot be written
costs a warning, never a step; None (the default) publishes nothing.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pyarrow.fs as pafs
import torch

from loader.balance import Balance
from loader.balanced import (BalancedRun, StepStart, after, balanced_order, check_start, fresh_start, read_balanced,
                             refuse_a_filled_tail)
from loader.batch import SimpleCustomBatch
from loader.index_window import StreamWindows
from loader.latents import LatentsReader, latents_mode
from loader.prefetch import Prefetcher
from loader.progress import ProgressPublisher
from loader.reader import Follow, Pack
from loader.state import BalancedState, LoaderState, MergedState, WorkerState, merge_states, state_from_dict
from loader.stream import interleaved_batches
from schemas.errors import UsageError
from schemas.progress import ProgressFolder
from schemas.streams import rank_streams, workers_per_rank

log = logging.getLogger(__name__)


def streams_for_rank(
    num_streams: int, pack_world_size: int, pack_num_workers: int, rank: int, world_size: int
) -> list[int]:
    """The streams rank ``rank`` of ``world_size`` reads, in interleaving order (see module doc)."""
    per_rank = workers_per_rank(pack_num_workers)
    if num_streams != pack_world_size * per_rank:
        raise ValueError(
            f"pack has {num_streams} streams but its identity says {pack_world_size} ranks x {per_rank} streams"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, {world_size})")
    if world_size > num_streams:
        raise ValueError(
            f"{world_size} ranks but the pack has only {num_streams} streams: some ranks would get no data"
        )
    if world_size == pack_world_size:
        return rank_streams(rank, pack_num_workers)
    return list(range(rank, num_streams, world_size))


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


class PackedShardDataset(torch.utils.data.IterableDataset):
    """This rank's packed batches as ``SimpleCustomBatch`` objects (see module doc)."""

    def __init__(
        self,
        path: "str | os.PathLike",
        rank: int | None = None,
        world_size: int | None = None,
        *,
        verify: "bool | str" = True,
        prefetch: int = 2,
        follow: bool = False,
        poll_s: float = 1.0,
        timeout_s: float | None = None,
        filesystem: pafs.FileSystem | None = None,
        progress: "str | os.PathLike | ProgressFolder | None" = None,
        live_every_s: float = 5.0,
        publish_checkpoints: bool = True,
        balance: "Balance | bool | dict | None" = None,
        vae_latents: "bool | str" = False,
    ):
        super().__init__()
        try:
            setting = Balance.of(balance)
        except UsageError as e:
            raise ValueError(str(e)) from None
        self.vae_latents = latents_mode(vae_latents)
        self.epoch = 0
        self.pack = Pack.open(path, filesystem)
        self.rank = _env_int("RANK", 0) if rank is None else int(rank)
        self.world_size = _env_int("WORLD_SIZE", 1) if world_size is None else int(world_size)
        p = self.pack
        self.streams = streams_for_rank(p.num_streams, p.world_size, p.num_workers, self.rank, self.world_size)
        if p.info.balances_samples() and self.world_size != p.world_size and self.rank == 0:
            log.warning("%s balances each step's samples among %d ranks; read by %d ranks its steps are not "
                        "steps any more: every batch is read once, but the balancing is lost (pack it again "
                        "at this world size, or balance whole batches: balance=Balance(...))",
                        p.location.base, p.world_size, self.world_size)
        self.verify = verify
        self.prefetch = prefetch
        self.follow = Follow(poll_s, timeout_s) if follow else None
        self.fingerprint = p.fingerprint
        self._split = (0, 1)
        self._cursor = 0
        self._positions = [0] * len(self.streams)
        self._firsts = [0] * len(self.streams)
        self._pending: LoaderState | None = None
        self._pid = os.getpid()
        self.progress = None if progress is None else ProgressPublisher(progress, live_every_s=live_every_s)
        self.publish_checkpoints = publish_checkpoints
        # the balancing, with its cost model (the pack's when it names none); None: the reference order
        self.balance = setting.with_model(self.pack.info.cost_model()) if setting is not None else None
        if self.balance is not None and self.vae_latents:  # the encode is no longer the training's work
            self.balance = replace(self.balance, cost_model=self.balance.cost_model.without("vae"))
        self.micro_batches = self.balance.micro_batches if self.balance is not None else 1
        self._balanced_run = BalancedRun(self.fingerprint, self.rank, self.world_size, self.micro_batches,
                                         self.balance.fingerprint(), tuple(self.streams)) if self.balance else None
        self._start: StepStart | None = None  # balanced: where the next iteration starts, and its first item
        self._first = 0
        self._at: tuple[StepStart, int] | None = None  # balanced: (step start, this worker's next item)
        self._tail = False  # balanced: ``_at`` lies in the pack's tail (read unbalanced)
        self._resumed_tail = False  # balanced: the state loaded was taken in the tail

    def set_epoch(self, epoch: int) -> None:
        """The pass over the pack: with ``vae_latents`` each record's latent noise is drawn anew
        per epoch (seeded by the record and the epoch; ``loader.latents``)."""
        self.epoch = int(epoch)

    def _latents(self):
        """What gives each record its VAE moments when batches carry latents (else None)."""
        if not self.vae_latents:
            return None
        reader = LatentsReader(self.pack, self.vae_latents, self.verify, self.follow)
        reader.epoch = self.epoch
        return reader.moments

    def num_batches(self) -> int:
        """Batches committed for this rank so far (all DataLoader workers together); final once the
        pack is done."""
        return sum(self.pack.num_records(s) for s in self.streams)

    def _worker_streams(self) -> list[int]:
        worker, workers = self._split
        return self.streams[worker::workers]

    def __iter__(self) -> Iterator[SimpleCustomBatch]:
        # Set up eagerly (not in the generator body): StatefulDataLoader asks for state_dict()
        # right after iter(), before the first batch.
        info = torch.utils.data.get_worker_info()
        self._split = (info.id, info.num_workers) if info is not None else (0, 1)
        if os.getpid() != self._pid:  # a forked DataLoader worker: an object-store client of its own
            self.pack, self._pid = self.pack.reopened(), os.getpid()
        if self.balance:
            return self._iter_balanced()
        streams = self._worker_streams()
        self._positions = [0] * len(streams)
        self._firsts = [0] * len(streams)
        self._cursor = 0
        if self._pending is not None:
            state, self._pending = self._pending, None
            if isinstance(state, MergedState):
                self._firsts = [state.positions[s] for s in streams]
                self._positions = list(self._firsts)
                last = [state.last[s] for s in streams]
            else:
                if (state.worker, state.num_workers) != self._split or state.streams != streams:
                    raise ValueError(
                        f"state is for DataLoader worker {state.worker} of {state.num_workers} "
                        f"(streams {state.streams}); this is worker {self._split[0]} of {self._split[1]} "
                        f"(streams {streams})"
                    )
                self._cursor, self._positions, self._firsts = state.cursor, list(state.positions), list(state.firsts)
                last = state.last
            self._check_positions(streams, self._positions, last)
        source = interleaved_batches(self.pack, streams, self._cursor, verify=self.verify, firsts=self._firsts,
                                     follow=self.follow, latents=self._latents())
        prefetcher = Prefetcher(source, self.prefetch, f"prefetch-rank{self.rank}-worker{self._split[0]}")
        return self._hand_out(prefetcher, streams)

    def _hand_out(self, prefetcher: Prefetcher, streams: list[int]) -> Iterator[SimpleCustomBatch]:
        slot_of = {s: k for k, s in enumerate(streams)}
        live = None
        if self.progress is not None:
            live = self.progress.live(self.fingerprint, self.world_size, self.rank, self._split[0], streams)
            live.update(self._positions, now=True)
        try:
            while True:
                if live is not None and not prefetcher.ready():
                    live.update(self._positions, now=True)  # about to wait: the packer may be holding back
                try:
                    stream, record, batch = next(prefetcher)
                except StopIteration:
                    break
                self._cursor += 1
                self._positions[slot_of[stream]] = record + 1
                if live is not None:
                    live.update(self._positions)
                yield batch
            if live is not None:
                live.update(self._positions, now=True)
        finally:
            prefetcher.close()

    # --- balanced steps (loader.balanced) ---------------------------------------------------------
    def _rank_streams(self) -> list[list[int]]:
        """Every rank's streams in its interleaving order (each rank's reference)."""
        p = self.pack
        return [streams_for_rank(p.num_streams, p.world_size, p.num_workers, r, self.world_size)
                for r in range(self.world_size)]

    def _windows(self) -> StreamWindows:
        return StreamWindows(self.pack, self.follow)

    def _iter_balanced(self) -> Iterator[SimpleCustomBatch]:
        worker, workers = self._split
        if self._pending is not None:
            state, self._pending = self._pending, None
            if isinstance(state, BalancedState) and (state.worker, state.num_workers) != self._split:
                raise ValueError(f"balanced state is for DataLoader worker {state.worker} of {state.num_workers}; "
                                 f"this is worker {worker} of {workers}")
        start, first = self._start or fresh_start(self.pack.num_streams), self._first
        self._start, self._first = None, 0  # a later iter() without a state starts afresh, as without balance
        if first % workers != worker:  # a fresh start: this worker's first item
            first += (worker - first) % workers
        self._at = (start, first)
        windows = self._windows()
        order = balanced_order(windows, self._rank_streams(), self.rank, self.balance, start, first)
        if self._resumed_tail:
            order, self._resumed_tail = refuse_a_filled_tail(order, start), False
        mine = (item for item in order if item.index % workers == worker)
        source = read_balanced(windows, mine, self.verify, self._latents())
        prefetcher = Prefetcher(source, self.prefetch, f"prefetch-rank{self.rank}-worker{worker}")
        return self._hand_out_balanced(prefetcher)

    def _published_streams(self) -> list[int]:
        """The streams this worker's live file covers: its share of the rank's own streams."""
        worker, workers = self._split
        return self.streams[worker::workers]

    def _needs(self, streams: list[int]) -> list[int]:
        """What this worker publishes as read of ``streams``: their position at the current step's start
        plus M, the most of a stream the step can need.  A balanced step needs every rank's batches of
        it before any is dealt, so a packer holding back (``--ahead N``, any N >= 1) packs the whole
        step; the checkpoints (what trims go by) keep the step start."""
        return [self._at[0].positions[s] + self.micro_batches for s in streams]

    def _hand_out_balanced(self, prefetcher: Prefetcher) -> Iterator[SimpleCustomBatch]:
        workers, m = self._split[1], self.micro_batches
        live, mine = None, self._published_streams()
        if self.progress is not None:
            live = self.progress.live(self.fingerprint, self.world_size, self.rank, self._split[0], mine)
            live.update(self._needs(mine), now=True)
        try:
            while True:
                if live is not None and not prefetcher.ready():
                    live.update(self._needs(mine), now=True)
                try:
                    item, batch = next(prefetcher)
                except StopIteration:
                    break
                self._at, self._tail = after(item, workers, m), item.after is None
                if live is not None:
                    live.update(self._needs(mine))
                yield batch
            if live is not None:
                live.update(self._needs(mine), now=True)
        finally:
            prefetcher.close()

    def _balanced_state(self) -> BalancedState:
        worker, workers = self._split
        if self._at is not None:
            (start, nxt), tail = self._at, self._tail
        else:  # not iterated yet: where the next iteration starts
            start, tail = self._start or fresh_start(self.pack.num_streams), self._resumed_tail
            nxt = self._first + (worker - self._first) % workers
        return self._balanced_run.state(start, nxt, (worker, workers), tail)

    def _load_balanced(self, st: LoaderState) -> None:
        start, first = self._balanced_run.start_of(st, self.pack.num_streams)
        check_start(self._windows(), start)
        self._pending = st
        self._start, self._first, self._at = start, first, None
        # taken inside the tail: this worker read some of it (its offset past its first item there)
        self._resumed_tail = isinstance(st, BalancedState) and st.tail and st.offset >= st.num_workers
        if isinstance(st, BalancedState):
            self._split = (st.worker, st.num_workers)

    def _last_digests(self, streams: list[int], positions: list[int]) -> list[str]:
        """Digest of the last record read per stream ("" before the first): ties a state to content."""
        return [self.pack.record_digest(s, p - 1) if p else "" for s, p in zip(streams, positions)]

    def _check_positions(self, streams: list[int], positions: list[int], last: "list[str] | None") -> None:
        """Refuse a state whose streams' last records differ from this pack's (another pack's state)."""
        if last is None:
            return
        for s, p, digest in zip(streams, positions, last):
            if p and not self.pack.wait_for(s, p - 1, self.follow):
                raise ValueError(f"loader state is past the end of stream {s} ({p} records read, "
                                 f"{self.pack.num_records(s)} committed): it belongs to a different pack")
            if p and self.pack.record_digest(s, p - 1) != digest:
                raise ValueError(f"loader state belongs to a different pack (stream {s}, record {p - 1} differs)")

    def state_dict(self) -> dict[str, Any]:
        """Position after the last batch handed out by this (worker's) iterator, as plain values
        (``loader.state.WorkerState.to_dict``, or ``BalancedState.to_dict`` with balance)."""
        if self.balance:
            bal = self._balanced_state()
            if self.progress is not None and self.publish_checkpoints and torch.utils.data.get_worker_info() is None:
                self.progress.checkpoint(self.fingerprint, self.world_size, self.rank,
                                         {s: bal.positions[s] for s in bal.streams},
                                         {s: bal.last[s] for s in bal.streams})
            return bal.to_dict()
        worker, workers = self._split
        streams = self._worker_streams()
        state = WorkerState(
            pack=self.fingerprint, rank=self.rank, world_size=self.world_size, worker=worker, num_workers=workers,
            streams=streams, cursor=self._cursor, firsts=list(self._firsts), positions=list(self._positions),
            last=self._last_digests(streams, self._positions),
        )
        if self.progress is not None and self.publish_checkpoints and torch.utils.data.get_worker_info() is None:
            self.progress.checkpoint(self.fingerprint, self.world_size, self.rank, dict(zip(streams, state.positions)),
                                     dict(zip(streams, state.last)))
        return state.to_dict()

    @staticmethod
    def merge_states(states: list[dict[str, Any]]) -> dict[str, Any]:
        """One state from the states of every rank (and DataLoader worker) of a run, loadable on
        any rank of any world size: each stream's next unread record (``loader.state.merge_states``)."""
        return merge_states([state_from_dict(st) for st in states]).to_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next ``iter()`` continue right after the batch ``state`` was taken at."""
        st = state_from_dict(state)
        if st.pack not in self.pack.fingerprints():  # this pack's, or a state saved on the pack it continues
            raise ValueError("loader state belongs to a different pack (content fingerprint differs)")
        if self.balance:
            return self._load_balanced(st)
        if isinstance(st, BalancedState):
            raise ValueError("a balanced loader state (balance=True): load it with balance=True, or load "
                             "PackedShardDataset.merge_states(<every rank's state at one step boundary>)")
        if isinstance(st, MergedState):
            missing = [s for s in self.streams if s not in st.positions]
            if missing:
                raise ValueError(f"merged loader state lacks streams {missing}: merge the states of every rank")
            self._check_positions(self.streams, [st.positions[s] for s in self.streams],
                                  [st.last[s] for s in self.streams])
            self._pending = st
            return
        if (st.rank, st.world_size) != (self.rank, self.world_size):
            raise ValueError(
                f"loader state is for rank {st.rank} of {st.world_size}, "
                f"this is rank {self.rank} of {self.world_size}; to change the world size, load "
                "PackedShardDataset.merge_states(<every rank's state>)"
            )
        self._check_positions(st.streams, st.positions, st.last)
        self._pending = st
        self._split = (st.worker, st.num_workers)
        self._cursor = st.cursor
        self._positions = list(st.positions)
        self._firsts = list(st.firsts)

