"""A stream packed under a schedule (``prepack.schedule`` in the config): a mix change within one pack.

Step k of the schedule packs the stream's batches from its ``after`` on under its own config; at
the step's first batch the stream goes on from the state the step before left, exactly as a
continuation goes on from its parent (``prepack.run.chain``): a ``StreamPacker`` of the step's
config given that state with ``continue_from`` (groups matched by name), so the pack is what
``prepack run A --out P0`` with a budget of ``after`` batches, then ``prepack run B --out P1
--continue P0 --after N`` would make, record for record, and what a reference ``PackedDataset``
built from B yields after ``load_state_dict`` of A's state at N.  Unlike a chain it is one pack: its
budget, counts and accounting are the whole stream's, and every reader, follower, bounded run and
tool reads it as any other pack.

The state after batch n (a checkpoint) was made under the step of batch n - 1; a packer built from
it at a step's first batch switches there, so a run killed, extended or audited at a switch goes on
exactly.  Callers get it from ``prepack.engine.packers.open_packer``.
"""

from __future__ import annotations

import logging
from typing import Iterator

from prepack.engine.accounting import Counters
from prepack.engine.packer import PackerOptions, StreamPacker, StreamState, Switch
from prepack.engine.reuse.source_pictures import PictureStore
from prepack.engine.sources import Source
from prepack.engine.state_codec import detached
from schemas.config import PrepackConfig
from schemas.packed_batch import PackedBatch

log = logging.getLogger(__name__)


class ScheduledPacker:
    """A ``StreamPacker`` per step, one at a time: each is iterated until the next step's first batch,
    then its state goes on under the next step's config.  Presents the ``Packer`` interface
    (``prepack.engine.packers``) as a ``StreamPacker`` does."""

    def __init__(self, cfg: PrepackConfig, stream: int, tokenizer, special, state: StreamState | None = None,
                 options: PackerOptions = PackerOptions()):
        self.cfg = cfg
        self.stream = stream
        self._args = (tokenizer, special)
        self._options = options
        batches = state.batches if state is not None else 0
        self.step = cfg.step_of(batches)
        if state is None or cfg.step_of(max(batches - 1, 0)) == self.step:
            self._packer = StreamPacker(cfg.step_config(self.step), stream, tokenizer, special, state, options)
        else:  # a checkpoint at a step's first batch: made under the step before
            self._packer = self._switched(state, self.step)

    def _switched(self, state: StreamState, step: int) -> StreamPacker:
        packer = StreamPacker(self.cfg.step_config(step), self.stream, *self._args, options=self._options)
        packer.go_on_from(Switch(state, self.cfg.step_config(step - 1), whole_stream=True))
        return packer

    # -- the Packer interface (prepack.engine.packers): the current step's packer answers ----------
    @property
    def batches(self) -> int:
        return self._packer.batches

    @property
    def tokens(self) -> int:
        return self._packer.tokens

    @property
    def counters(self) -> Counters:
        return self._packer.counters

    @property
    def pictures(self) -> PictureStore:
        return self._packer.pictures

    @property
    def sources(self) -> list[Source]:
        return self._packer.sources

    def state(self) -> StreamState:
        return self._packer.state()

    def budget_spent(self) -> bool:
        return self._packer.budget_spent()

    def final_counters(self) -> Counters:
        return self._packer.final_counters()

    def close(self) -> None:
        self._packer.close()

    def go_on_from(self, switch: Switch) -> None:
        """A continuation of another pack starts here (at this pack's batch 0, step 0)."""
        self._packer.go_on_from(switch)

    def __enter__(self) -> "ScheduledPacker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __iter__(self) -> Iterator[PackedBatch]:
        try:
            while True:
                steps = self.cfg.schedule
                switch_at = steps[self.step].after if self.step < len(steps) else None
                batches = iter(self._packer)
                for batch in batches:
                    yield batch
                    if switch_at is not None and self._packer.batches >= switch_at:
                        break
                else:
                    return  # the budget is spent
                batches.close()  # stops this step's sources (the packer's own ``finally``)
                if self._packer.budget_spent():
                    return
                state, counts = detached(self._packer.state()), self._packer.pictures.counts
                self.step += 1
                self._packer = self._switched(state, self.step)
                self._packer.pictures.counts = counts  # done.json's reuse counts are the whole stream's too
                log.info("stream %d: step %d of the schedule from batch %d", self.stream, self.step,
                         self.cfg.schedule[self.step - 1].after)
        finally:
            self._packer.close()
