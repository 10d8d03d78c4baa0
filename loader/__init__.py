"""The training-time reader of a pack: ``build_dataloader`` (a ready ``StatefulDataLoader``),
``PackedShardDataset`` for your own DataLoader, ``open_stream`` for one stream; ``Balance``, the
setting that balances a training's steps.

Imports only ``schemas``, torch, torchdata, numpy, pyarrow, xxhash and the standard library, so a training job can
install it without Ray, PIL, transformers or the packer.
"""

from loader.balance import Balance
from loader.batch import SimpleCustomBatch
from loader.dataloader import build_dataloader
from loader.dataset import PackedShardDataset, streams_for_rank
from loader.reader import Follow, FollowTimeout, Pack, PackIntegrityError
from loader.stream import open_stream

__all__ = [
    "Balance",
    "Follow",
    "FollowTimeout",
    "PackIntegrityError",
    "Pack",
    "PackedShardDataset",
    "SimpleCustomBatch",
    "build_dataloader",
    "open_stream",
    "streams_for_rank",
]
