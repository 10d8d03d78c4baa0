"""Per-value normalisation tables: uint8 pixel -> the exact float32 the reference feeds the model.

The reference turns a uint8 image into floats with torchvision ``ToTensor`` (``.to(float32)
.div(255)``) then ``Normalize`` (``.sub_(mean).div_(std)`` with float32 mean/std tensors).  Every
output value depends only on (pixel value, channel, mean, std), so the 256 possible results per
channel are computed once here, with those same CPU operations, and the loader gathers from the
table.  A gather is exact on any device, whereas recomputing the division on a GPU may differ in
the last bit (CUDA rewrites division by a scalar as multiplication by its reciprocal).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

NormKey = tuple[tuple[float, float, float], tuple[float, float, float]]

LEVELS = 256
CHANNELS = 3
TABLE_SIZE = LEVELS * CHANNELS  # one table: [channel, level] flattened


def norm_key(row: np.ndarray) -> NormKey:
    """(mean rgb, std rgb) of one ``PackedBatch.image_norm`` row, as a hashable key."""
    values = [float(v) for v in row]
    return (tuple(values[:3]), tuple(values[3:]))


@lru_cache(maxsize=256)
def norm_table(key: NormKey) -> torch.Tensor:
    """float32 [3 * 256]: entry ``c * 256 + v`` is channel c's normalised value of pixel v."""
    mean, std = key
    levels = torch.arange(LEVELS, dtype=torch.uint8).repeat(CHANNELS, 1)  # [3, 256], like CHW
    values = levels.to(torch.float32).div(255)  # ToTensor
    mean_t = torch.as_tensor(mean, dtype=torch.float32)
    std_t = torch.as_tensor(std, dtype=torch.float32)
    if bool((std_t == 0).any()):
        raise ValueError(f"image std {std} is zero in float32")
    values.sub_(mean_t.view(-1, 1)).div_(std_t.view(-1, 1))  # Normalize(inplace=True)
    return values.reshape(-1)


def stacked_tables(keys: list[NormKey]) -> torch.Tensor:
    """Tables of several norms back to back: norm k's table starts at ``k * TABLE_SIZE``."""
    return torch.cat([norm_table(k) for k in keys]) if keys else torch.zeros(0, dtype=torch.float32)
