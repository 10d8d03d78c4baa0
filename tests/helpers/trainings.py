"""Trainings in threads beside a bounded pack (``--ahead``): real loaders that follow the pack,
publish their progress, keep their states, and check the packer never ran further ahead of them
than the bound allows."""

from __future__ import annotations

import json
import os
import threading
import time

from loader import PackedShardDataset
from loader.balance import Balance
from loader.reader import Pack


class Trainer(threading.Thread):
    """One rank of a training: reads its stream as it is packed, publishes to ``progress``, saves a
    checkpoint (its loader state) every ``every`` batches, and checks the packer never ran further
    ahead of it than the bound allows (``ahead``; None: a pack bounded by disk alone, not checked)."""

    def __init__(self, out, rank, world_size, progress, *, every, pause_s, ahead, per_shard, micro_batches=0,
                 also=(), stop_after=None, state=None, hold=None):
        super().__init__(daemon=True)
        self.args = (out, rank, world_size, progress)
        self.also = tuple(also)  # other packs held to the same bound (a balanced-samples pack's reference)
        self.stop_after, self.state = stop_after, state  # a training that stops, and one resumed from a state
        self.hold = hold  # (n, event): after n batches, wait for the event (the packer runs as far as it may)
        self.every, self.pause_s, self.ahead, self.per_shard = every, pause_s, ahead, per_shard
        self.m = micro_batches  # > 0: balanced steps of M micro-batches (the packer may run M further)
        self.states, self.seen, self.error = [], [], None

    def run(self):
        try:
            out, rank, world_size, progress = self.args
            ds = PackedShardDataset(out, rank=rank, world_size=world_size, follow=True, progress=progress,
                                    live_every_s=0, balance=Balance(micro_batches=self.m) if self.m else None)
            if self.state is not None:
                ds.load_state_dict(self.state)
            before = sum(self.state["positions"].values()) if self.state is not None else 0  # a merged state's
            for i, batch in enumerate(ds, start=before):
                if self.stop_after is not None and len(self.seen) == self.stop_after:
                    break
                if self.hold is not None and len(self.seen) == self.hold[0]:
                    assert self.hold[1].wait(300), "the event held for never came"
                self.seen.append(batch)
                # the packer starts a shard of a stream only while it is less than `ahead` past a
                # position the trainer reported (never more than this one), and finishes the shard
                # it started: over this rank's streams, at most that much past the batches read
                slack = len(ds.streams) * ((self.ahead or 0) + self.per_shard + self.m)
                for path in (out, *self.also) if self.ahead is not None else ():
                    pack = Pack.open(path)
                    committed = sum(pack.num_records(s) for s in ds.streams)
                    assert committed <= i + 1 + slack, (path, ds.streams, i, committed)
                if (i + 1) % self.every == 0:
                    self.states.append(json.loads(json.dumps(ds.state_dict())))
                time.sleep(self.pause_s)
        except BaseException as e:  # noqa: BLE001 (re-raised by the test)
            self.error = e


def wait_for_pack_json(out: str, thread: threading.Thread) -> None:
    for _ in range(600):
        if os.path.exists(os.path.join(out, "pack.json")) or not thread.is_alive():
            return
        time.sleep(0.05)


def run_beside_trainings(pack, out: str, trainers_of, timeout: float) -> list:
    """``pack()`` in a thread, then the trainings ``trainers_of()`` makes once pack.json exists; both
    must end (neither waits on the other for ever) and without an error.  The trainings."""
    result = {}

    def packing():
        try:
            pack()
        except BaseException as e:  # noqa: BLE001 (re-raised below)
            result["error"] = e

    packer = threading.Thread(target=packing, daemon=True)
    packer.start()
    wait_for_pack_json(out, packer)
    trainers = trainers_of()
    for t in trainers:
        t.start()
    for t in trainers + [packer]:
        t.join(timeout=timeout)
        assert not t.is_alive(), "a bounded pack and its trainings must never wait on each other for ever"
    assert "error" not in result, result.get("error")
    for t in trainers:
        assert t.error is None, t.error
    return trainers
