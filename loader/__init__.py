"""The training-time reader of a pack: ``PackedShardDataset`` for a DataLoader, ``open_stream`` for one stream.

Imports only ``schemas``, torch, numpy, pyarrow and the standard library, so a training job can
install it without Ray, PIL, transformers or the packer.
"""

from loader.batch import SimpleCustomBatch
from loader.dataset import PackedShardDataset, streams_for_rank
from loader.reader import Pack, PackIntegrityError
from loader.stream import open_stream

__all__ = ["PackIntegrityError", "Pack", "PackedShardDataset", "SimpleCustomBatch", "open_stream", "streams_for_rank"]
