"""Dense per-sample attention masks (non-flex mode), rebuilt from split lengths and modes.

The rules are those of the reference's additive masks (0 = attend, -inf = blocked): a query in
split a sees every earlier split, and within its own split either the keys up to itself
(``causal``) or the whole split (``full``, ``noise``); keys in a ``noise`` split are seen only by
queries of that same split.  Row i of a sample can therefore be described by three numbers:

- ``start[i]``: where i's own split begins,
- ``limit[i]``: one past the last key i may see (i + 1 for causal, its split's end otherwise),
- ``keep[j]``: key j is not in a noise split.

and ``allowed(i, j) = j < limit[i] and (keep[j] or j >= start[i])``.  The three arrays are O(L)
and computed on the host when a record is decoded; the O(L^2) mask is built wherever it is
needed, e.g. directly on the GPU.
"""

from __future__ import annotations

import numpy as np
import torch

from schemas.packed_batch import ATTN_MODE_CODES

_CAUSAL = ATTN_MODE_CODES["causal"]
_NOISE = ATTN_MODE_CODES["noise"]


def row_bounds(
    sample_lens: np.ndarray, sample_num_splits: np.ndarray, split_lens: np.ndarray, modes: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(start, limit, keep)`` for every position of the packed sequence, sample-local.

    Raises ``ValueError`` when the splits do not tile the samples (a malformed record).
    """
    split_lens = split_lens.astype(np.int64)
    if len(split_lens) != int(sample_num_splits.sum()) or len(modes) != len(split_lens):
        raise ValueError("split_lens / attn_modes / sample_num_splits disagree in length")
    sample_of_split = np.repeat(np.arange(len(sample_lens)), sample_num_splits)
    per_sample = np.bincount(sample_of_split, weights=split_lens, minlength=len(sample_lens))
    if not np.array_equal(per_sample.astype(np.int64), sample_lens.astype(np.int64)):
        raise ValueError("split_lens do not sum to sample_lens")

    split_end = np.cumsum(split_lens)
    split_begin = split_end - split_lens
    sample_begin = (np.cumsum(sample_lens) - sample_lens).astype(np.int64)
    split_begin_local = split_begin - sample_begin[sample_of_split]
    split_end_local = split_end - sample_begin[sample_of_split]

    position_split = np.repeat(np.arange(len(split_lens)), split_lens)
    local = np.arange(len(position_split)) - sample_begin[sample_of_split[position_split]]
    mode = modes[position_split]
    start = split_begin_local[position_split]
    limit = np.where(mode == _CAUSAL, local + 1, split_end_local[position_split])
    keep = mode != _NOISE
    return start.astype(np.int32), limit.astype(np.int32), keep


def dense_mask(start: torch.Tensor, limit: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """float32 [L, L] additive mask of one sample, on the device of the inputs."""
    n = start.numel()
    keys = torch.arange(n, dtype=start.dtype, device=start.device)
    allowed = keys.unsqueeze(0) < limit.unsqueeze(1)
    own_split = keys.unsqueeze(0) >= start.unsqueeze(1)
    own_split |= keep.unsqueeze(0)
    allowed &= own_split
    mask = torch.full((n, n), float("-inf"), dtype=torch.float32, device=start.device)
    return mask.masked_fill_(allowed, 0.0)
