"""A tiny BAGEL-shaped model and VAE for CPU training tests: every batch field changes the loss.

``TinyBagel.forward`` takes the keyword arguments NeMo's multimodal recipe passes to BAGEL
(stage 2: the ``padded_latent`` the recipe's VAE step makes from ``padded_images``) and returns
``{"ce": per-token CE or None, "mse": per-token squared error [n, d] or None}`` like BAGEL.
Token ids, position ids, ViT patches and their positions/lengths, VAE latents with their shapes,
positions and timesteps, the attention layout (flex ``split_lens``/``attn_modes`` or dense
``nested_attention_masks``), loss indexes, labels and CE weights all enter the computation, so a
batch that differs in any field trains differently.  Small and deterministic on one CPU thread.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 512
POSITIONS = 256
LATENT_PATCH = 2


class TinyVAE(nn.Module):
    """Frozen stand-in for BAGEL's autoencoder: 8x average pool + a fixed channel mix."""

    def __init__(self, channels: int = 4, seed: int = 7):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.register_buffer("mix", torch.randn(channels, 3, generator=g))

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        pooled = F.avg_pool2d(images.float(), 8)
        return torch.einsum("nchw,kc->nkhw", pooled, self.mix)


def attention_bias(length: int, split_lens, attn_modes, sample_lens) -> torch.Tensor:
    """BAGEL's flex layout as an additive [length, length] bias: samples are blocks; inside a
    sample a token sees earlier non-noise splits, its own split whole (full/noise) or causally."""
    allowed = torch.zeros(length, length, dtype=torch.bool)
    splits = list(zip(split_lens, attn_modes))
    pos = k = 0
    for n in sample_lens:
        start, visible, end = pos, [], pos + int(n)
        while pos < end:
            size, mode = splits[k]
            a, b = pos, pos + int(size)
            for va, vb in visible:
                allowed[a:b, va:vb] = True
            if mode == "causal":
                allowed[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
            else:
                allowed[a:b, a:b] = True
            if mode != "noise":
                visible.append((a, b))
            pos, k = b, k + 1
        assert pos == end and start <= end
    return torch.zeros(length, length).masked_fill(~allowed, float("-inf"))


def dense_bias(length: int, masks, sample_lens) -> torch.Tensor:
    bias = torch.full((length, length), float("-inf"))
    pos = 0
    for n, m in zip(sample_lens, masks):
        bias[pos : pos + n, pos : pos + n] = m
        pos += n
    return bias


class TinyBagel(nn.Module):
    def __init__(self, dim: int = 16, vit_patch: int = 14, latent_channels: int = 4):
        super().__init__()
        latent_dim = latent_channels * LATENT_PATCH * LATENT_PATCH
        self.tok = nn.Embedding(VOCAB, dim)
        self.pos = nn.Embedding(POSITIONS, dim)
        self.vit_in = nn.Linear(vit_patch * vit_patch * 3, dim)
        self.vit_pos = nn.Embedding(POSITIONS, dim)
        self.vit_len = nn.Linear(1, dim)
        self.vae_in = nn.Linear(latent_dim, dim)
        self.lat_pos = nn.Embedding(POSITIONS, dim)
        self.time = nn.Linear(1, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.lm_head = nn.Linear(dim, VOCAB)
        self.mse_head = nn.Linear(dim, latent_dim)
        self.dim = dim

    def forward(
        self,
        *,
        sequence_length,
        packed_text_ids,
        packed_text_indexes,
        sample_lens,
        packed_position_ids,
        nested_attention_masks=None,
        split_lens=None,
        attn_modes=None,
        packed_vit_tokens=None,
        packed_vit_token_indexes=None,
        packed_vit_position_ids=None,
        vit_token_seqlens=None,
        padded_latent=None,
        patchified_vae_latent_shapes=None,
        packed_latent_position_ids=None,
        packed_vae_token_indexes=None,
        packed_timesteps=None,
        mse_loss_indexes=None,
        packed_label_ids=None,
        ce_loss_indexes=None,
        ce_loss_weights=None,
    ):
        length = int(sum(sample_lens))
        h = torch.zeros(length, self.dim)
        h = h.index_add(0, packed_text_indexes, self.tok(packed_text_ids % VOCAB))
        if packed_vit_tokens is not None:
            per_token_len = torch.repeat_interleave(vit_token_seqlens, vit_token_seqlens).float().unsqueeze(1)
            vit = self.vit_in(packed_vit_tokens) + self.vit_pos(packed_vit_position_ids % POSITIONS)
            h = h.index_add(0, packed_vit_token_indexes, vit + self.vit_len(per_token_len / 64))
        latents = None
        if padded_latent is not None:
            shapes = patchified_vae_latent_shapes
            latents = torch.cat([self._patchify(padded_latent[i], hw) for i, hw in enumerate(shapes)])
            vae = self.vae_in(latents) + self.lat_pos(packed_latent_position_ids % POSITIONS)
            vae = vae + self.time(torch.sigmoid(packed_timesteps).unsqueeze(1))
            h = h.index_add(0, packed_vae_token_indexes, vae)
        h = h + F.pad(self.pos(packed_position_ids % POSITIONS), (0, 0, 0, length - int(sequence_length)))

        if split_lens is not None:
            bias = attention_bias(length, split_lens, attn_modes, sample_lens)
        else:
            bias = dense_bias(length, nested_attention_masks, sample_lens)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        h = h + torch.softmax(q @ k.T / self.dim**0.5 + bias, dim=-1) @ v
        h = h + self.mlp(h)

        ce = mse = None
        if ce_loss_indexes is not None and ce_loss_indexes.numel():
            logits = self.lm_head(h[ce_loss_indexes])
            ce = F.cross_entropy(logits, packed_label_ids % VOCAB, reduction="none") * ce_loss_weights
        if mse_loss_indexes is not None and mse_loss_indexes.numel() and latents is not None:
            row = torch.full((length,), -1, dtype=torch.long)
            row[packed_vae_token_indexes] = torch.arange(packed_vae_token_indexes.numel())
            target = latents[row[mse_loss_indexes]]
            mse = (self.mse_head(h[mse_loss_indexes]) - target) ** 2
        return {"ce": ce, "mse": mse}

    @staticmethod
    def _patchify(latent: torch.Tensor, hw) -> torch.Tensor:
        h, w = int(hw[0]), int(hw[1])
        p = LATENT_PATCH
        c = latent.shape[0]
        x = latent[:, : h * p, : w * p].reshape(c, h, p, w, p)
        return torch.einsum("chpwq->hwpqc", x).reshape(h * w, p * p * c)
