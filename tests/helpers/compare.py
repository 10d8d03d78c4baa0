"""Exact comparison of packed-batch dicts (ours vs the reference's ``to_dict()``)."""

from __future__ import annotations

import torch


def diff_batches(ours: dict, ref: dict) -> list[str]:
    """Every difference, as readable lines; empty means identical (keys, dtypes, values)."""
    out = []
    if set(ours) != set(ref):
        out.append(f"keys differ: only ours {sorted(set(ours) - set(ref))}, only ref {sorted(set(ref) - set(ours))}")
    for key in sorted(set(ours) & set(ref)):
        a, b = ours[key], ref[key]
        out += [f"{key}{p}" for p in _diff(a, b)]
    return out


def _diff(a, b, path: str = "") -> list[str]:
    if isinstance(b, torch.Tensor):
        if not isinstance(a, torch.Tensor):
            return [f"{path}: ours is {type(a).__name__}, ref is a tensor"]
        if a.dtype != b.dtype:
            return [f"{path}: dtype {a.dtype} != {b.dtype}"]
        if a.shape != b.shape:
            return [f"{path}: shape {tuple(a.shape)} != {tuple(b.shape)}"]
        if not torch.equal(a.cpu(), b.cpu()):
            ne = (a.cpu() != b.cpu()).nonzero()
            return [f"{path}: {len(ne)} values differ, first at {ne[0].tolist()}"]
        return []
    if isinstance(b, (list, tuple)):
        if not isinstance(a, (list, tuple)) or type(a) is not type(b):
            return [f"{path}: type {type(a).__name__} != {type(b).__name__}"]
        if len(a) != len(b):
            return [f"{path}: length {len(a)} != {len(b)}"]
        res = []
        for i, (x, y) in enumerate(zip(a, b)):
            res += _diff(x, y, f"{path}[{i}]")
            if len(res) > 5:
                break
        return res
    if isinstance(b, dict):
        if not isinstance(a, dict) or set(a) != set(b):
            return [f"{path}: dict {a!r} != {b!r}"]
        res = []
        for k in b:
            res += _diff(a[k], b[k], f"{path}.{k}")
        return res
    if type(a) is not type(b) or a != b:
        return [f"{path}: {a!r} ({type(a).__name__}) != {b!r} ({type(b).__name__})"]
    return []
