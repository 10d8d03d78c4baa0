"""One sample's own tensors out of a loader batch's ``to_dict()`` (ours or the reference's): what it
computes with, not where it lies in the packed sequence; for balanced samples' tests."""

from __future__ import annotations

import hashlib

import numpy as np
import torch


def sample_tensors(d: dict, i: int) -> dict:
    """Sample i's own tensors from a loader batch's ``to_dict()``: what it computes with, not where it lies."""
    lens = d["sample_lens"]
    a = sum(lens[:i])
    b = a + lens[i]

    def inside(idx):
        return (idx >= a) & (idx < b)

    out = {"position_ids": d["packed_position_ids"][a:b]}
    t = inside(d["packed_text_indexes"])
    out["text_ids"], out["text_at"] = d["packed_text_ids"][t], d["packed_text_indexes"][t] - a
    if "ce_loss_indexes" in d:
        c = inside(d["ce_loss_indexes"])
        out.update(labels=d["packed_label_ids"][c], ce_at=d["ce_loss_indexes"][c] - a, ce_w=d["ce_loss_weights"][c])
    if "packed_vit_tokens" in d:
        seq = d["vit_token_seqlens"].tolist()
        starts = np.cumsum([0] + seq)
        mine = [k for k in range(len(seq)) if a <= int(d["packed_vit_token_indexes"][starts[k]]) < b]
        out["vit"] = [(d["packed_vit_tokens"][starts[k]:starts[k + 1]], d["packed_vit_position_ids"][starts[k]:starts[k + 1]],
                       d["packed_vit_token_indexes"][starts[k]:starts[k + 1]] - a) for k in mine]
    if "padded_images" in d:
        shapes = d["patchified_vae_latent_shapes"]
        sizes = [h * w for h, w in shapes]
        starts = np.cumsum([0] + sizes)
        mine = [k for k in range(len(sizes)) if a <= int(d["packed_vae_token_indexes"][starts[k]]) < b]
        out["vae"] = [(d["padded_images"][k], shapes[k], d["packed_latent_position_ids"][starts[k]:starts[k + 1]],
                       d["packed_vae_token_indexes"][starts[k]:starts[k + 1]] - a) for k in mine]
    if "packed_timesteps" in d:
        v = inside(d["packed_vae_token_indexes"])
        out["timesteps"] = d["packed_timesteps"][v]
    if "mse_loss_indexes" in d:
        m = inside(d["mse_loss_indexes"])
        out["mse_at"] = d["mse_loss_indexes"][m] - a
    splits = d["split_lens"]
    first = sum(len(x) for x in _splits_per_sample(d)[:i])
    n = len(_splits_per_sample(d)[i])
    out["splits"] = (splits[first:first + n], d["attn_modes"][first:first + n])
    out["origin"] = d["batch_data_indexes"][i]
    return {k: v for k, v in out.items() if not _empty(v)}  # a batch without ViT has no ViT keys at all


def _empty(v) -> bool:
    return (isinstance(v, torch.Tensor) and v.numel() == 0) or (isinstance(v, list) and not v)


def _splits_per_sample(d: dict) -> list[list[int]]:
    """Split lengths of each sample (they add up to its length)."""
    out, k = [], 0
    for n in d["sample_lens"]:
        mine, total = [], 0
        while total < n:
            mine.append(d["split_lens"][k])
            total += d["split_lens"][k]
            k += 1
        out.append(mine)
    return out


def same(x, y) -> bool:
    if isinstance(x, torch.Tensor):
        return x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
    if isinstance(x, (list, tuple)):
        return len(x) == len(y) and all(same(p, q) for p, q in zip(x, y))
    if isinstance(x, dict):
        return x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
    return x == y


def sample_key(d: dict, i: int) -> str:
    """A digest of ``sample_tensors(d, i)``: equal keys, equal tensors (dtypes and shapes included)."""
    h = hashlib.sha256()

    def put(x) -> None:
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(x, (list, tuple)):
            h.update(b"[")
            for y in x:
                put(y)
            h.update(b"]")
        elif isinstance(x, dict):
            for k in sorted(x):
                h.update(str(k).encode())
                put(x[k])
        else:
            h.update(repr(x).encode())

    put(sample_tensors(d, i))
    return h.hexdigest()


def keys_of(d: dict) -> list[str]:
    """Every real sample's key (a flex batch's padding, the last entry of ``sample_lens``, is none)."""
    n = len(d["batch_data_indexes"])
    return [sample_key(d, i) for i in range(n)]
