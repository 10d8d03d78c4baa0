"""``build_dataloader``: a pack as the stateful DataLoader a BAGEL training loop already consumes.

Upstream BAGEL and NeMo AutoModel iterate a torchdata ``StatefulDataLoader`` whose items are the
collated ``SimpleCustomBatch`` (``.cuda(device).to_dict()``, ``batch_data_indexes``).  A pack's
records already are whole packed batches, so the loader runs with ``batch_size=None`` (no
collate): each item is one ``SimpleCustomBatch``.  Its ``state_dict()`` holds only ints, strings,
lists and dicts, so torch's weights-only loader (NeMo's checkpointer default) restores it in a new process.

With ``progress`` (a folder, ``file://`` or ``s3://`` URI) the training publishes where it stands
there, for a pack bounded by it (``prepack run --ahead N --progress P`` packs at most N batches
past the live position; ``prepack trim --progress P`` trims behind the K newest checkpoints):
each DataLoader worker its live position (``loader.dataset``), and the loader's ``state_dict()``
-- the checkpoint -- one entry for the rank with every worker's streams.  torchdata asks the
dataset for its state in every worker at every step, so the dataset itself does not publish
checkpoints here.  Publishing never fails training (a warning instead).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import pyarrow.fs as pafs
from torchdata.stateful_dataloader import StatefulDataLoader

from loader.balance import Balance
from loader.dataset import PackedShardDataset
from loader.state import checkpoint_entry
from schemas.progress import ProgressFolder

log = logging.getLogger(__name__)

# Where torchdata keeps the dataset's state in a loader state (torchdata 0.11): single process
# ``state[_DATASET_STATE]``; with workers ``state[_SNAPSHOT][_WORKER_SNAPSHOTS]["worker_<j>"][_DATASET_STATE]``.
try:
    from torchdata.stateful_dataloader.incremental_state import _DATASET_STATE
except ImportError:  # a torchdata that moved it: the value 0.11 uses (a layout it no longer has warns, below)
    _DATASET_STATE = "dataset_state"
try:
    from torchdata.stateful_dataloader.stateful_dataloader import _StatefulMultiProcessingDataLoaderIter as _MultiIter

    _SNAPSHOT, _WORKER_SNAPSHOTS = _MultiIter._SNAPSHOT, _MultiIter._WORKER_SNAPSHOTS
except (ImportError, AttributeError):
    _SNAPSHOT, _WORKER_SNAPSHOTS = "_snapshot", "_worker_snapshots"


def dataset_states(state: Mapping[str, Any]) -> list[Mapping[str, Any]] | None:
    """The dataset states (``WorkerState.to_dict()``, one per DataLoader worker) inside a
    ``StatefulDataLoader`` state, or None where they are not where torchdata 0.11 puts them."""
    try:
        if _SNAPSHOT in state:
            found = [w[_DATASET_STATE] for w in state[_SNAPSHOT][_WORKER_SNAPSHOTS].values()]
        else:
            found = [state[_DATASET_STATE]]
    except (KeyError, TypeError, AttributeError):
        return None
    ok = found and all(isinstance(d, Mapping) and {"streams", "positions"} <= set(d) for d in found)
    return found if ok else None


class ProgressDataLoader(StatefulDataLoader):
    """A ``StatefulDataLoader`` whose ``state_dict()`` (a checkpoint) also publishes the rank's
    checkpoint entry into the dataset's progress folder: positions and last digests of all its
    workers' streams (disjoint), exactly the values the returned state holds."""

    _warned_layout = False

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        dataset = self.dataset
        progress = getattr(dataset, "progress", None)
        if progress is None:
            return state
        states = dataset_states(state)
        if states is None:
            if not ProgressDataLoader._warned_layout:
                ProgressDataLoader._warned_layout = True
                log.warning("no dataset state found in the DataLoader's state (a torchdata version with another "
                            "layout?): no checkpoint published to the progress folder; training goes on")
            return state
        positions, last = checkpoint_entry(states)
        progress.checkpoint(dataset.fingerprint, dataset.world_size, dataset.rank, positions, last)
        return state


def build_dataloader(
    packed_dir: "str | os.PathLike",
    *,
    rank: int | None = None,
    world_size: int | None = None,
    num_workers: int = 0,
    pin_memory: bool = True,
    prefetch_factor: int | None = 2,
    persistent_workers: bool = False,
    verify: "bool | str" = True,
    prefetch: int = 2,
    filesystem: pafs.FileSystem | None = None,
    progress: "str | os.PathLike | ProgressFolder | None" = None,
    balance: "Balance | bool | dict | None" = None,
    vae_latents: "bool | str" = False,
) -> StatefulDataLoader:
    """A ``StatefulDataLoader`` over this rank's share of the pack at ``packed_dir``.

    ``rank``/``world_size`` default to the ``RANK``/``WORLD_SIZE`` environment (as under
    torchrun).  ``num_workers`` DataLoader worker processes split the rank's streams among them;
    ``prefetch_factor`` applies only with workers (torch refuses it without).  ``verify`` checks
    each record's digest; ``prefetch`` is the records read ahead by each reader thread.
    Resume: ``loader.load_state_dict(state)`` before iterating, with the state of the same rank.
    ``progress``: the folder where the training's live position and checkpoints are published
    (module doc); then the loader is a ``ProgressDataLoader``.
    ``balance=Balance(micro_batches=M, sync="lockstep"|"step", cost_model=...)`` deals each
    optimizer step's M x world-size batches to the ranks and micro-steps by their estimated cost
    (``loader.balance.Balance``): iterate M batches per optimizer step and normalize the loss by
    the step's global token counts.  ``vae_latents=True`` hands ``padded_latent`` from the moments
    ``prepack latents`` stored, in place of ``padded_images`` (``loader.latents``).
    """
    dataset = PackedShardDataset(
        packed_dir, rank=rank, world_size=world_size, verify=verify, prefetch=prefetch, filesystem=filesystem,
        progress=progress, publish_checkpoints=False, balance=balance, vae_latents=vae_latents,
    )
    return (StatefulDataLoader if progress is None else ProgressDataLoader)(
        dataset,
        batch_size=None,  # each record is already one packed batch
        num_workers=num_workers,
        pin_memory=pin_memory,
        prefetch_factor=prefetch_factor if num_workers > 0 else None,
        persistent_workers=persistent_workers and num_workers > 0,
    )
