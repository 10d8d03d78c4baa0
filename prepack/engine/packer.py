"""One stream's greedy packer: weighted group sampling, mandatory groups, overflow buffer, budget.

Stream ``s = r*K + w`` owns two explicit generators seeded like the reference seeds its process
globals at iterator start (``random`` and NumPy's legacy generator, same seed) and draws from them
in the reference's order: group choice, the sources' per-row draws, then CFG dropout and
timesteps while laying a sample out.  Divergences from the reference (documented in
docs/architecture/packing.md): a source that never yields stops the stream with an error instead of
looping forever; in flex mode a batch whose mandatory samples exceed ``max_num_tokens`` (negative
padding) is refused and counted instead of emitted.  Every sample that is not packed is counted.
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from prepack.engine.accounting import Counters, Drop, Warn
from prepack.engine.decode import ImagePolicy
from prepack.engine.sequence import PackingError, SequenceBuilder
from prepack.engine.reuse.source_pictures import PictureStore, PixelProvider
from prepack.engine.sample import Sample
from prepack.engine.sources import Source, StreamContext, make_source
from prepack.engine.sources.ledger import NoLedger, SourceLedger
from prepack.engine.sources.readahead import IOPool, ReadAheadSettings
from schemas.config import PrepackConfig
from schemas.mix_change import group_matches
from schemas.packed_batch import PackedBatch

log = logging.getLogger(__name__)

MAX_CONSECUTIVE_REFUSED_BATCHES = 100


@dataclass
class StreamState:
    """Everything needed to continue a stream exactly after its last emitted batch."""

    stream: int
    batches: int
    tokens: int
    py_rng: list  # random.Random.getstate() as JSON
    np_rng: dict  # RandomState.get_state(legacy) as JSON
    sources: list[dict]
    buffer: list[Sample]
    counters: Counters
    refused_in_row: int = 0


@dataclass(frozen=True)
class Switch:
    """A stream's state made under another config, to go on from (a mix change, ``schemas.mix_change``):
    a continuation's start (``prepack.run.chain.switch_at``) or a schedule's step.  ``whole_stream``:
    the budget counts and the accounting go on too (a step of one pack's schedule), else they start
    again at zero (a continuation is a pack of its own)."""

    state: StreamState
    config: PrepackConfig  # the config the state was made under
    whole_stream: bool = False


@dataclass(frozen=True)
class PackerOptions:
    """How a packer works, none of which changes a byte it makes.

    ``reuse_pixel_table``: every batch's pixel table is coded into one buffer kept by the packer, so
    a batch's ``image_pixels`` is valid only until the next batch is made: for a consumer that writes
    each batch before asking for the next (the stream writer), the ~20 MB table then stops costing
    fresh pages every batch.  ``read_ahead``: how far sources on an object store read ahead (default:
    from the environment, ``ReadAheadSettings.from_env``).  ``pixels``: where earlier pixels of the
    same pictures can be taken from instead of decoding and resizing
    (``prepack.engine.reuse.earlier_pixels``).  ``ledger``: told what the sources read, shard by
    shard (``prepack.engine.sources.ledger``; a stream that may be trimmed)."""

    reuse_pixel_table: bool = False
    read_ahead: ReadAheadSettings | None = None
    pixels: PixelProvider | None = None
    ledger: SourceLedger | None = None


def _py_state_to_json(state: tuple) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _py_state_from_json(d: list) -> tuple:
    return (d[0], tuple(d[1]), d[2])


def _np_state_to_json(rs: np.random.RandomState) -> dict:
    name, keys, pos, has_gauss, cached = rs.get_state(legacy=True)
    return {"name": name, "keys": [int(k) for k in keys], "pos": int(pos), "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached)}


def _np_state_from_json(d: dict) -> tuple:
    return (d["name"], np.asarray(d["keys"], dtype=np.uint32), d["pos"], d["has_gauss"], d["cached_gaussian"])


class StreamPacker:
    """Iterate packed batches of one stream until its budget is spent, from its start or from
    ``state`` (a checkpoint of the same config).  ``options``: ``PackerOptions``.  ``close()`` (or
    ``with``) stops the I/O threads; a packer that reaches its budget stops them itself.
    ``pictures.counts`` says how the resizes were served."""

    def __init__(self, cfg: PrepackConfig, stream: int, tokenizer, special, state: StreamState | None = None,
                 options: PackerOptions = PackerOptions()):
        self.cfg = cfg
        self.stream = stream
        self.rank, self.worker = cfg.stream_rank_worker(stream)
        self.seed = cfg.stream_seed(stream)
        self.special = special
        self.py = random.Random(self.seed)
        self.np = np.random.RandomState(self.seed)
        self.counters = Counters()
        policy = ImagePolicy(max_pixels=cfg.prepack.max_image_pixels, strict=cfg.prepack.strict)
        self.pictures = PictureStore(policy, self.counters.warn, options.pixels)
        self._io = IOPool(options.read_ahead if options.read_ahead is not None else ReadAheadSettings.from_env(),
                          name=f"prepack-io-s{stream}")
        ctx = StreamContext(
            rank=self.rank,
            worker=self.worker,
            world_size=cfg.world_size,
            num_workers=cfg.num_workers,
            data_seed=cfg.knobs.data_seed,
            tokenizer=tokenizer,
            py_rng=self.py,
            np_rng=self.np,
            counters=self.counters,
            image_policy=policy,
            max_consecutive_failures=cfg.prepack.max_consecutive_failures,
            config_dir=os.path.dirname(cfg.config_path) if cfg.config_path else os.getcwd(),
            io=self._io,
            pictures=self.pictures,
            ledger=options.ledger if options.ledger is not None else NoLedger(),
        )
        with ctx.ledger.starting():  # what they read now, every shard's restore reads again
            self.sources: list[Source] = [make_source(g, ctx) for g in cfg.groups]
        self.buffer: list[Sample] = []
        self.batches = 0
        self.tokens = 0
        self.refused_in_row = 0
        self._table_buffer: np.ndarray | None = np.empty(0, np.uint8) if options.reuse_pixel_table else None
        weights = [g.weight for g in cfg.groups]
        total = sum(weights)
        self.cumprobs = [sum(weights[: i + 1]) / total for i in range(len(weights))]
        if state is not None:
            self._restore(state)

    # -- state ----------------------------------------------------------------------------------
    def state(self) -> StreamState:
        """The state after the last emitted batch (call only between batches)."""
        return StreamState(
            stream=self.stream,
            batches=self.batches,
            tokens=self.tokens,
            py_rng=_py_state_to_json(self.py.getstate()),
            np_rng=_np_state_to_json(self.np),
            sources=[s.state() for s in self.sources],
            buffer=list(self.buffer),
            counters=Counters.from_json(self.counters.to_json()),
            refused_in_row=self.refused_in_row,
        )

    def _restore(self, st: StreamState) -> None:
        if st.stream != self.stream:
            raise ValueError(f"checkpoint is for stream {st.stream}, not {self.stream}")
        self.batches, self.tokens, self.refused_in_row = st.batches, st.tokens, st.refused_in_row
        self.py.setstate(_py_state_from_json(st.py_rng))
        self.np.set_state(_np_state_from_json(st.np_rng))
        for source, s in zip(self.sources, st.sources, strict=True):
            source.restore(s)
        self.buffer = list(st.buffer)
        self._restore_counters(st.counters)

    def go_on_from(self, switch: Switch) -> None:
        """Go on from another config's state (a mix change, ``schemas.mix_change``): its random state
        and buffer, and each group's data position where the group is in both configs (matched by
        name; a new group starts fresh).  Budget counts (batches, tokens, passes) and the accounting
        start again at zero, unless ``switch.whole_stream`` (a step of a schedule): they go on."""
        st, whole = switch.state, switch.whole_stream
        if st.stream != self.stream:
            raise ValueError(f"state is for stream {st.stream}, not {self.stream}")
        self.py.setstate(_py_state_from_json(st.py_rng))
        self.np.set_state(_np_state_from_json(st.np_rng))
        for source, at in zip(self.sources, group_matches(switch.config, self.cfg), strict=True):
            if at is not None:
                source.restore(st.sources[at] if whole else {**st.sources[at], "passes": 0})
        self.buffer = list(st.buffer)
        self.refused_in_row = st.refused_in_row
        if whole:
            self.batches, self.tokens = st.batches, st.tokens
            self._restore_counters(st.counters)

    def _restore_counters(self, restored: Counters) -> None:
        """In place: the sources and the picture store count into this object."""
        self.counters.drops, self.counters.warnings = dict(restored.drops), dict(restored.warnings)
        self.counters.samples_read, self.counters.samples_packed = dict(restored.samples_read), dict(restored.samples_packed)
        self.counters.examples = dict(restored.examples)

    def close(self) -> None:
        """Stop the sources' read-ahead and the stream's I/O threads (the cursors stay; packing can go on)."""
        for source in self.sources:
            source.close()
        self._io.close()

    def __enter__(self) -> "StreamPacker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- budget ---------------------------------------------------------------------------------
    def budget_spent(self) -> bool:
        p = self.cfg.prepack
        if p.batches_per_stream is not None and self.batches >= p.batches_per_stream:
            return True
        if p.tokens_per_stream is not None and self.tokens >= p.tokens_per_stream:
            return True
        if p.passes is not None and all(s.passes >= p.passes for s in self.sources):
            return True
        return False

    def final_counters(self) -> Counters:
        """Counters at the end of the stream, with what is still buffered accounted for."""
        c = Counters.from_json(self.counters.to_json())
        if self.buffer:
            c.drop_total(Drop.LEFT_IN_BUFFER_AT_END_OF_BUDGET, len(self.buffer))
        return c

    # -- packing --------------------------------------------------------------------------------
    def _new_builder(self) -> SequenceBuilder:
        return SequenceBuilder(self.cfg.knobs, self.special, self.py, self.np)

    def _pick_group(self) -> int:
        n = self.py.random()
        for i, cp in enumerate(self.cumprobs):
            if n < cp:
                return i
        return 0

    def _emit(self, builder: SequenceBuilder) -> PackedBatch | None:
        k = self.cfg.knobs
        length = builder.curr
        if length > k.max_num_tokens:
            if k.use_flex:
                self.counters.drop(Drop.BATCH_REFUSED_OVER_MAX_NUM_TOKENS, f"{length} > {k.max_num_tokens}")
                self.counters.drop(Drop.SAMPLES_IN_REFUSED_BATCHES, n=len(builder.origins))
                self.refused_in_row += 1
                if self.refused_in_row >= MAX_CONSECUTIVE_REFUSED_BATCHES:
                    raise PackingError(
                        f"{self.refused_in_row} batches in a row exceed max_num_tokens={k.max_num_tokens} "
                        "(mandatory samples alone overflow it): raise max_num_tokens or lower max_num_tokens_per_sample"
                    )
                return None
            self.counters.warn(Warn.BATCH_OVER_MAX_NUM_TOKENS)
        self.refused_in_row = 0
        batch = builder.build(None if self._table_buffer is None else self._reused_table)
        batch.image_sources = [img.source for img in builder.images]
        for o in builder.origins:
            self.counters.samples_packed[o.group] = self.counters.samples_packed.get(o.group, 0) + 1
        self.batches += 1
        self.tokens += batch.sequence_length
        return batch

    def _reused_table(self, size: int) -> np.ndarray:
        """The first ``size`` bytes of the packer's table buffer, grown (with headroom) as needed."""
        if self._table_buffer.size < size:
            self._table_buffer = np.empty(size + size // 4, np.uint8)
        return self._table_buffer[:size]

    def __iter__(self) -> Iterator[PackedBatch]:
        try:
            yield from self._batches()
        finally:  # budget reached, an error, or the consumer stopped: no I/O thread outlives the iteration
            self.close()

    def _batches(self) -> Iterator[PackedBatch]:
        k = self.cfg.knobs
        cap = k.max_num_tokens_per_sample
        builder = self._new_builder()
        if self.budget_spent():
            return
        for source in self.sources:  # remote sources start reading ahead together, before the first sample
            source.start()
        while True:  # the budget is checked at batch boundaries only, so no sample is left half-packed
            if builder.curr == 0:
                for group, source in zip(self.cfg.groups, self.sources):
                    if not group.is_mandatory:
                        continue
                    while True:
                        sample = source.next_sample()
                        if sample.packed_len_estimate < cap:
                            builder.add(sample)
                            break
                        self.counters.drop(Drop.OVERLENGTH_MANDATORY_SAMPLE, str(sample.packed_len_estimate))
            if builder.curr < k.prefer_buffer_before and self.buffer:
                sample, from_buffer = self.buffer.pop(0), True
            else:
                sample, from_buffer = self.sources[self._pick_group()].next_sample(), False
            n = sample.packed_len_estimate
            if n > cap:
                self.counters.drop(Drop.OVERLENGTH_SAMPLE, str(n))
                continue
            if builder.curr + n > k.max_num_tokens:
                if len(self.buffer) < k.max_buffer_size and not from_buffer:
                    self.buffer.append(sample)
                    continue
                # The reference emits the batch and discards this sample without a trace.
                self.counters.drop(Drop.DISCARDED_NO_FIT_FROM_BUFFER if from_buffer else Drop.DISCARDED_NO_FIT_BUFFER_FULL)
            else:
                builder.add(sample)
                if builder.curr < k.expected_num_tokens:
                    continue
            batch = self._emit(builder)
            builder = self._new_builder()
            if batch is not None:
                yield batch
            if self.budget_spent():
                return
