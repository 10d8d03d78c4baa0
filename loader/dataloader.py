"""``build_dataloader``: a pack as the stateful DataLoader a BAGEL training loop already consumes.

Upstream BAGEL and NeMo AutoModel iterate a torchdata ``StatefulDataLoader`` whose items are the
collated ``SimpleCustomBatch`` (``.cuda(device).to_dict()``, ``batch_data_indexes``).  A pack's
records already are whole packed batches, so the loader runs with ``batch_size=None`` (no
collate): each item is one ``SimpleCustomBatch``.  Its ``state_dict()`` holds only ints, strings,
lists and dicts, so torch's weights-only loader (NeMo's checkpointer default) restores it in a new process.
"""

from __future__ import annotations

import os

import pyarrow.fs as pafs
from torchdata.stateful_dataloader import StatefulDataLoader

from loader.dataset import PackedShardDataset


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
) -> StatefulDataLoader:
    """A ``StatefulDataLoader`` over this rank's share of the pack at ``packed_dir``.

    ``rank``/``world_size`` default to the ``RANK``/``WORLD_SIZE`` environment (as under
    torchrun).  ``num_workers`` DataLoader worker processes split the rank's streams among them;
    ``prefetch_factor`` applies only with workers (torch refuses it without).  ``verify`` checks
    each record's digest; ``prefetch`` is the records read ahead by each reader thread.
    Resume: ``loader.load_state_dict(state)`` before iterating, with the state of the same rank.
    """
    dataset = PackedShardDataset(
        packed_dir, rank=rank, world_size=world_size, verify=verify, prefetch=prefetch, filesystem=filesystem
    )
    return StatefulDataLoader(
        dataset,
        batch_size=None,  # each record is already one packed batch
        num_workers=num_workers,
        pin_memory=pin_memory,
        prefetch_factor=prefetch_factor if num_workers > 0 else None,
        persistent_workers=persistent_workers and num_workers > 0,
    )
