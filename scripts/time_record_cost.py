#!/usr/bin/env python
"""Time a BAGEL-7B-shaped forward+backward per packed record, and fit a per-record cost model to it.

    PYTHONPATH=. python3 scripts/time_record_cost.py --pack .costpack/costpack.tar.xz --device cuda \\
        --time-budget 270 --csv cost.csv --fit cost_fit.json   # on a GPU: no new record after 270 s
    python scripts/time_record_cost.py --device cpu --pack PACK --max-records 8 --reps 1   # dry run (tiny dims)
    python scripts/time_record_cost.py --from-csv cost.csv --fit cost_fit.json  # fit an earlier run's CSV again

What feeds what: a pack knows every record's shapes before training, so a balancer can even out
the ranks of a step if it can tell a record's time from its shapes (the design's "A step that
waits for no one rank"; issue 44).  This script measures that time on a stand-in of the model
and fits the linear cost model the balancer would use.

Records are read with the project's loader (``loader.reader.iter_records``, every record's
digest checked, ``schemas.record.record_to_batch``); the stand-in uses their integer fields and
image sizes only, never their pixels (its inputs are random values of the record's shapes).  Pixel
tables decompress with pyarrow's own zstd/lz4, so neither ``zstandard`` nor ``torchdata`` is needed: when torchdata is absent, ``loader/__init__.py`` (which
imports ``build_dataloader``, hence torchdata) is bypassed and ``loader.reader`` imported alone.
``--pack`` takes a pack folder, a folder of packs, or a ``.tar``/``.tar.xz``/``.tar.gz`` archive of
packs (``scripts/make_cost_pack.py`` makes one), unpacked to a temporary folder; several
``--pack`` are read in turn, and records are taken round-robin over every (pack, stream), so a
``--max-records`` prefix has every kind.

**Terms** (one dict per record, ``schemas.cost.record_terms``, the cost model's one home; the CSV's
columns after pack, stream, record):

- ``tokens``: the packed sequence's length (``sequence_length``, = sum of ``sample_lens``);
- ``samples``: number of samples; ``sum_sq_sample_lens``: sum of the samples' lengths squared
  (LLM attention: every sample attends only within itself);
- ``flex_pad``, ``flex_pad_sq``: with ``use_flex`` the reference pads the attention to
  ``max_num_tokens`` with one more, causal, sample: its length and its length squared (0 otherwise);
- ``vit_images``, ``vit_tokens``, ``sum_sq_vit_lens``: ViT images, their patches
  (``vit_token_seqlens``) and the sum of each image's patch count squared (ViT attention is per image);
- ``vae_images``: VAE images (``vae_image_ids``: conditions and targets);
  ``vae_canvas_h``/``vae_canvas_w``: the largest height and width among them (the VAE encodes them
  all on one zero-padded canvas of that size); ``vae_canvas_pixels`` = images x H x W, what the
  encoder convolves; ``vae_canvas_sq`` = images x (H/8 x W/8)^2: its mid-block self-attention,
  quadratic in the latent grid of the canvas;
- ``vae_latent_tokens``: latent tokens in the sequence (sum of ``vae_latent_shapes`` h x w);
- ``ce_tokens``, ``mse_tokens``: the text (CE) and diffusion (MSE) loss positions;
- ``text_tokens``: text positions (``packed_text_ids``: BOS/EOS and image markers included).

**Stand-in** (bf16 on a GPU; fp32 ``--tiny`` dims on the CPU), one forward+backward per record:

- LLM: ``--llm-layers`` (default 2) Qwen2.5-7B decoder layers as BAGEL uses them (hidden 3584,
  28 query / 4 KV heads of 128, SwiGLU MLP 18944, RMSNorm, QK-norm, RoPE on the record's position
  ids), Mixture-of-Transformers: the VAE latent tokens go through a second set of weights
  (BAGEL's ``*_moe_gen``), the others through the first.  Attention: ``flex`` (a CUDA device and a
  ``use_flex`` record) is BAGEL's ``flex_attention`` over the sequence padded to
  ``max_num_tokens``, with its mask (per sample; causal text, full ViT/VAE splits, noise splits
  seen by themselves only; the pad as one causal sample), ``torch.compile``d once; ``sdpa-mask``
  (a CUDA device, a record without flex) is one SDPA call per sample with its dense mask;
  ``sdpa-causal`` (the CPU) one causal SDPA call per sample (and the flex pad), the shapes of the
  real thing without its masks.  Around it: token embedding, ViT connector (MLP 1152->3584->3584)
  and position embeddings, VAE latent in (64->3584) and timestep embedder, final norms, ``lm_head``
  (vocabulary 152064) and cross entropy over the CE positions, ``llm2vae`` (3584->64) and MSE over
  the MSE positions: the *glue*.
- ViT: ``--vit-layers`` (default 2) SigLIP-so400m layers (hidden 1152, 16 heads, MLP 4304) over
  the record's ViT patches (linear patch embedding, position embedding), attention per image
  (variable-length flash attention where torch has it on the device, else one SDPA call per image).
- VAE: a frozen (no_grad) encoder shaped as FLUX's (channels 128, 256, 512, 512, two ResNet
  blocks each, x8 downsampling, a mid-block self-attention over the latent grid, 2x16 latent
  channels) over the record's VAE images on their padded canvas, its latents patchified 2x2.

Timed per record, each the median of ``--reps`` runs (CUDA events around a synchronized run; the
first record is run ``--warmup`` times untimed first, 2 on CUDA: compilation, kernels, allocator), in milliseconds:
``mask_ms`` (building the flex block mask; 0 without flex), ``vae_ms`` (the encoder),
``vit_layers_ms`` / ``llm_layers_ms`` (the layer stacks alone, forward+backward, from a leaf input),
``glue_ms`` (the model at depth 0: everything but the layer stacks and the encoder),
``total_ms`` (the whole stand-in, one forward+backward, mask and encoder included).  Then per
layer ``llm_layer_ms``, ``vit_layer_ms``, ``parts_ms`` (mask + vae + glue + the stacks: ~total_ms),
and ``est_full_ms`` = mask + vae + glue + 28 x llm_layer + 26 x vit_layer: **the full-depth
estimate** of BAGEL-7B (SigLIP-so400m has 27 layers; BAGEL uses 26, ``vit_select_layer`` -2).
A record that fails (out of memory, say) is logged and skipped (beyond a quarter of them the run
stops); when flex attention fails on the first record (no compiler for ``torch.compile``, say) the
run falls back to per-sample SDPA with dense masks (the CSV's ``attention`` column says which).
The CSV is written as records are timed; ``--time-budget`` (seconds since the start) or SIGTERM
(``timeout``) stop the timing and the records done are fitted; ``--from-csv`` fits a CSV again.

**Fit**: time ~ c0 + sum_i c_i * term_i over the terms in ``FEATURES``, least squares with every
coefficient >= 0 (Lawson-Hanson NNLS in numpy; no scipy), on 3 of every 4 records; every 4th
record is held out and the R^2 and the absolute percentage errors are measured on those.  Beside
it "tokens alone" (c0 + c1 * tokens, the same way): how much of the time a token count explains,
the reason a balancer needs the other terms.  Both for ``est_full_ms`` (the BAGEL-7B estimate:
what ``--fit`` JSON's ``coefficients_ms`` are) and for ``total_ms`` (the stand-in as measured).

Output: progress lines (logging), ``--csv`` (one row per record: where it is, its terms, its
times, the device), ``--fit`` (JSON: coefficients, metrics, the device, the stand-in), and last,
exactly: ``record cost on DEVICE: fit R2 X (tokens alone Y), median error Z% over N records``
for the full-depth estimate, N the held-out records the R^2 and error are measured on; DEVICE
names the device, and says ``tiny`` when the dims were (the CPU: a dry run, not BAGEL's figures).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import importlib.util
import json
import logging
import math
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
import types
from dataclasses import asdict, dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (os.path.dirname(os.path.abspath(__file__)), ROOT):  # pack_dirs: a script beside this one
    if _p not in sys.path:
        sys.path.insert(0, _p)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from pack_dirs import pack_dirs  # noqa: E402
from torch import nn  # noqa: E402

from cost_fit import FEATURES, FULL_LLM_LAYERS, FULL_VIT_LAYERS, fit_report, fit_segments, read_csv  # noqa: E402
from schemas.cost import RECORD_TERMS, record_terms  # noqa: E402 (numpy only: what a GPU machine has)

log = logging.getLogger("time_record_cost")

TERMS = RECORD_TERMS  # the CSV's term columns
TIMES = ("mask_ms", "vae_ms", "vit_layers_ms", "llm_layers_ms", "glue_ms", "total_ms", "llm_layer_ms",
         "vit_layer_ms", "parts_ms", "est_full_ms")


# -- reading records ---------------------------------------------------------------------------
def import_reader():
    """``(Pack, iter_records, record_to_batch)`` from the project's loader.

    ``loader/__init__.py`` imports ``build_dataloader`` and with it torchdata, which a GPU machine
    may lack; ``loader.reader`` itself needs only ``schemas``, pyarrow, numpy and xxhash.  Without
    torchdata the package is registered bare (its ``__init__`` not run) before importing the reader.
    """
    if "loader" not in sys.modules and importlib.util.find_spec("torchdata") is None:
        pkg = types.ModuleType("loader")
        pkg.__path__ = [os.path.join(ROOT, "loader")]
        pkg.__file__ = os.path.join(ROOT, "loader", "__init__.py")
        sys.modules["loader"] = pkg
        log.info("torchdata absent: importing loader.reader without loader/__init__.py")
    from loader.reader import Pack, iter_records
    from schemas.record import record_to_batch

    return Pack, iter_records, record_to_batch


@dataclass
class Shape:
    """What the stand-in needs of a record: its integer fields and image sizes (no pixels)."""

    where: str
    use_flex: bool
    max_num_tokens: int
    sequence_length: int
    sample_lens: np.ndarray
    split_lens: np.ndarray
    attn_modes: np.ndarray  # codes of schemas.packed_batch.ATTN_MODES
    sample_num_splits: np.ndarray
    packed_text_ids: np.ndarray
    packed_text_indexes: np.ndarray
    packed_position_ids: np.ndarray
    ce_loss_indexes: np.ndarray
    ce_loss_weights: np.ndarray
    packed_label_ids: np.ndarray
    vit_patch_size: int
    vit_token_seqlens: np.ndarray
    packed_vit_position_ids: np.ndarray
    packed_vit_token_indexes: np.ndarray
    vae_heights: np.ndarray
    vae_widths: np.ndarray
    vae_latent_shapes: np.ndarray  # [n_vae, 2]: latent tokens per side (patchified)
    packed_latent_position_ids: np.ndarray
    packed_vae_token_indexes: np.ndarray
    packed_timesteps: np.ndarray
    mse_loss_indexes: np.ndarray
    terms: dict  # schemas.cost.record_terms of the record


def shape_of(pb, where: str) -> Shape:
    """A ``PackedBatch``'s fields the stand-in uses, copied (the record's buffers are released)."""
    vae = np.asarray(pb.vae_image_ids, np.int64)
    c = lambda a, t=np.int64: np.array(a, dtype=t)  # noqa: E731
    return Shape(
        where=where, use_flex=bool(pb.use_flex), max_num_tokens=int(pb.max_num_tokens),
        sequence_length=int(pb.sequence_length), sample_lens=c(pb.sample_lens), split_lens=c(pb.split_lens),
        attn_modes=c(pb.attn_modes), sample_num_splits=c(pb.sample_num_splits),
        packed_text_ids=c(pb.packed_text_ids), packed_text_indexes=c(pb.packed_text_indexes),
        packed_position_ids=c(pb.packed_position_ids), ce_loss_indexes=c(pb.ce_loss_indexes),
        ce_loss_weights=c(pb.ce_loss_weights, np.float32), packed_label_ids=c(pb.packed_label_ids),
        vit_patch_size=int(pb.vit_patch_size), vit_token_seqlens=c(pb.vit_token_seqlens),
        packed_vit_position_ids=c(pb.packed_vit_position_ids), packed_vit_token_indexes=c(pb.packed_vit_token_indexes),
        vae_heights=c(np.asarray(pb.image_heights)[vae]), vae_widths=c(np.asarray(pb.image_widths)[vae]),
        vae_latent_shapes=c(pb.vae_latent_shapes).reshape(-1, 2),
        packed_latent_position_ids=c(pb.packed_latent_position_ids),
        packed_vae_token_indexes=c(pb.packed_vae_token_indexes),
        packed_timesteps=c(pb.packed_timesteps, np.float32), mse_loss_indexes=c(pb.mse_loss_indexes),
        terms=record_terms(pb),
    )


def read_shapes(specs: list[str], max_records: int, tmp: str, verify: bool = True) -> list[Shape]:
    """Up to ``max_records`` records of the packs, round-robin over every (pack, stream)."""
    Pack, iter_records, record_to_batch = import_reader()
    iters = []
    for spec in specs:
        for d in pack_dirs(spec, tmp):
            pack = Pack.open(d)
            name = os.path.basename(os.path.normpath(d))
            for s in range(pack.num_streams):
                iters.append((name, s, iter_records(pack, s, verify=verify)))
    log.info("reading up to %d records from %d streams of %s", max_records, len(iters), ", ".join(specs))
    out: list[Shape] = []
    while iters and len(out) < max_records:
        for item in list(iters):
            name, s, it = item
            got = next(it, None)
            if got is None:
                iters.remove(item)
                continue
            i, rec = got
            out.append(shape_of(record_to_batch(rec), f"{name}/{s}/{i}"))
            if len(out) >= max_records:
                break
    for *_, it in iters:
        it.close()
    return out


# -- the stand-in ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Dims:
    hidden: int = 3584
    heads: int = 28
    kv_heads: int = 4
    head_dim: int = 128
    mlp: int = 18944
    vocab: int = 152064
    rope_theta: float = 1e6
    vit_hidden: int = 1152
    vit_heads: int = 16
    vit_mlp: int = 4304
    vae_channels: tuple = (128, 256, 512, 512)
    vae_groups: int = 32
    latent_channels: int = 16
    latent_patch: int = 2
    vit_pos: int = 70 * 70  # 980 / 14 patches per side
    latent_pos: int = 64 * 64  # BAGEL's max_latent_size 64
    canvas_scale: int = 1  # the VAE canvas's sides are divided by this (tiny: its latents are stand-ins)


FULL = Dims()
TINY = Dims(hidden=64, heads=4, kv_heads=2, head_dim=16, mlp=176, vocab=2048, vit_hidden=32, vit_heads=2,
            vit_mlp=96, vae_channels=(4, 8, 8, 8), vae_groups=4, canvas_scale=8)


class Expert(nn.Module):
    """One Mixture-of-Transformers expert of a Qwen2 decoder layer (BAGEL's und or gen weights)."""

    def __init__(self, d: Dims):
        super().__init__()
        h, hd = d.hidden, d.head_dim
        self.ln1 = nn.RMSNorm(h, eps=1e-6)
        self.q = nn.Linear(h, d.heads * hd)
        self.k = nn.Linear(h, d.kv_heads * hd)
        self.v = nn.Linear(h, d.kv_heads * hd)
        self.q_norm = nn.RMSNorm(hd, eps=1e-6)
        self.k_norm = nn.RMSNorm(hd, eps=1e-6)
        self.o = nn.Linear(d.heads * hd, h, bias=False)
        self.ln2 = nn.RMSNorm(h, eps=1e-6)
        self.gate = nn.Linear(h, d.mlp, bias=False)
        self.up = nn.Linear(h, d.mlp, bias=False)
        self.down = nn.Linear(d.mlp, h, bias=False)
        self.d = d

    def qkv(self, x):
        x = self.ln1(x)
        d = self.d
        return (self.q_norm(self.q(x).view(-1, d.heads, d.head_dim)),
                self.k_norm(self.k(x).view(-1, d.kv_heads, d.head_dim)),
                self.v(x).view(-1, d.kv_heads, d.head_dim))

    def mlp(self, x):
        x = self.ln2(x)
        return (self.down(F.silu(self.gate(x)) * self.up(x)),)


def routed(ctx, x, und, gen, fn):
    """``fn(expert, tokens)`` (a tuple) with the und tokens through ``und``, the gen ones through ``gen``
    (BAGEL's MoT: gather each group, scatter each result back in sequence order)."""
    if ctx.gen_idx is None:
        return fn(und, x)
    a, b = fn(und, x[ctx.und_idx]), fn(gen, x[ctx.gen_idx])
    outs = []
    for ta, tb in zip(a, b):
        o = ta.new_zeros((x.shape[0],) + ta.shape[1:])
        o[ctx.und_idx] = ta
        o[ctx.gen_idx] = tb
        outs.append(o)
    return outs


def rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class LLMLayer(nn.Module):
    def __init__(self, d: Dims):
        super().__init__()
        self.und, self.gen = Expert(d), Expert(d)
        self.d = d

    def forward(self, x, ctx):
        q, k, v = routed(ctx, x, self.und, self.gen, lambda e, t: e.qkv(t))
        q, k = rope(q, ctx.cos, ctx.sin), rope(k, ctx.cos, ctx.sin)
        a = ctx.attend(q, k, v).reshape(x.shape[0], -1)
        x = x + routed(ctx, a, self.und, self.gen, lambda e, t: (e.o(t),))[0]
        return x + routed(ctx, x, self.und, self.gen, lambda e, t: e.mlp(t))[0]


class ViTLayer(nn.Module):
    """A SigLIP encoder layer (pre-LayerNorm, fused qkv, GELU-tanh MLP)."""

    def __init__(self, d: Dims):
        super().__init__()
        h = d.vit_hidden
        self.ln1, self.ln2 = nn.LayerNorm(h, eps=1e-6), nn.LayerNorm(h, eps=1e-6)
        self.qkv, self.o = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, d.vit_mlp), nn.Linear(d.vit_mlp, h)
        self.heads = d.vit_heads

    def forward(self, x, ctx):
        n, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(n, 3, self.heads, h // self.heads).unbind(1)
        x = x + self.o(ctx.vit_attend(q, k, v).reshape(n, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int, groups: int):
        super().__init__()
        self.n1, self.c1 = nn.GroupNorm(groups, cin, eps=1e-6), nn.Conv2d(cin, cout, 3, padding=1)
        self.n2, self.c2 = nn.GroupNorm(groups, cout, eps=1e-6), nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x):
        h = self.c1(F.silu(self.n1(x)))
        return self.skip(x) + self.c2(F.silu(self.n2(h)))


class MidAttention(nn.Module):
    """The VAE mid-block's single-head self-attention over every position of the latent grid."""

    def __init__(self, c: int, groups: int):
        super().__init__()
        self.norm = nn.GroupNorm(groups, c, eps=1e-6)
        self.qkv, self.o = nn.Conv2d(c, 3 * c, 1), nn.Conv2d(c, c, 1)

    def forward(self, x):
        b, c, h, w = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, 3, 1, c, h * w).transpose(-1, -2).unbind(1)
        a = F.scaled_dot_product_attention(q, k, v)  # [b, 1, hw, c]
        return x + self.o(a[:, 0].transpose(-1, -2).reshape(b, c, h, w))


class VAEEncoder(nn.Module):
    """FLUX-VAE-encoder-shaped: conv in, 4 levels of 2 ResNet blocks (x2 down after the first 3),
    mid block (ResNet, attention, ResNet), norm, conv out to 2 x latent channels."""

    def __init__(self, d: Dims):
        super().__init__()
        ch, g = d.vae_channels, d.vae_groups
        self.conv_in = nn.Conv2d(3, ch[0], 3, padding=1)
        blocks, prev = [], ch[0]
        for i, c in enumerate(ch):
            blocks += [ResBlock(prev, c, g), ResBlock(c, c, g)]
            prev = c
            if i < len(ch) - 1:
                blocks.append(nn.Conv2d(c, c, 3, stride=2))  # padded (0, 1, 0, 1) in forward
        self.blocks = nn.ModuleList(blocks)
        self.mid = nn.ModuleList([ResBlock(prev, prev, g), MidAttention(prev, g), ResBlock(prev, prev, g)])
        self.norm_out = nn.GroupNorm(g, prev, eps=1e-6)
        self.conv_out = nn.Conv2d(prev, 2 * d.latent_channels, 3, padding=1)
        self.latent = d.latent_channels

    def forward(self, x):
        x = self.conv_in(x)
        for b in self.blocks:
            x = b(F.pad(x, (0, 1, 0, 1))) if isinstance(b, nn.Conv2d) else b(x)
        for b in self.mid:
            x = b(x)
        return self.conv_out(F.silu(self.norm_out(x)))[:, : self.latent]  # the posterior's mean


class Glue(nn.Module):
    """Everything of BAGEL's training forward but the layer stacks and the VAE encoder."""

    def __init__(self, d: Dims, patch: int):
        super().__init__()
        h, lat = d.hidden, d.latent_channels * d.latent_patch ** 2
        self.embed = nn.Embedding(d.vocab, h)
        self.vit_patch = nn.Linear(3 * patch * patch, d.vit_hidden)
        self.vit_pos = nn.Embedding(d.vit_pos, d.vit_hidden)
        self.vit_post = nn.LayerNorm(d.vit_hidden, eps=1e-6)
        self.connector = nn.Sequential(nn.Linear(d.vit_hidden, h), nn.GELU(approximate="tanh"), nn.Linear(h, h))
        self.vae2llm = nn.Linear(lat, h)
        self.time_embed = nn.Sequential(nn.Linear(256, h), nn.SiLU(), nn.Linear(h, h))
        self.norm_und, self.norm_gen = nn.RMSNorm(h, eps=1e-6), nn.RMSNorm(h, eps=1e-6)
        self.lm_head = nn.Linear(h, d.vocab, bias=False)
        self.llm2vae = nn.Linear(h, lat)
        # fixed 2D position embeddings (BAGEL's vit_pos_embed / latent_pos_embed: not trained)
        self.register_buffer("vit_pos2d", torch.randn(d.vit_pos, h) * 0.02, persistent=False)
        self.register_buffer("latent_pos2d", torch.randn(d.latent_pos, h) * 0.02, persistent=False)


def timestep_features(t, dim: int = 256):
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = t.float()[:, None] * 1000 * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class Model(nn.Module):
    def __init__(self, d: Dims, llm_layers: int, vit_layers: int, patch: int):
        super().__init__()
        self.d = d
        self.llm = nn.ModuleList(LLMLayer(d) for _ in range(llm_layers))
        self.vit = nn.ModuleList(ViTLayer(d) for _ in range(vit_layers))
        self.glue = Glue(d, patch)
        self.vae = VAEEncoder(d).requires_grad_(False)

    def vae_tokens(self, inp):
        """The VAE images' latent tokens [n, 64], from the encoder over the padded canvas."""
        with torch.no_grad():
            lat = self.vae(inp.canvas)
        if self.d.canvas_scale != 1:  # tiny: a shrunk canvas was encoded; its latents stand in
            return inp.latents + lat.mean()
        p, out = self.d.latent_patch, []
        for i, (h, w) in enumerate(inp.latent_hw):
            x = lat[i, :, : h * p, : w * p].reshape(lat.shape[1], h, p, w, p)
            out.append(torch.einsum("chpwq->hwpqc", x).reshape(h * w, -1))
        return torch.cat(out)

    def step(self, inp, ctx, *, llm_layers: int, vit_layers: int, encode: bool) -> torch.Tensor:
        """One training forward (loss) of the record: ``encode`` runs the VAE encoder (else the
        latents are a stand-in of their shape); the given depths of the stacks."""
        g = self.glue
        text = g.embed(inp.text_ids)
        seq = text.new_zeros(inp.n, self.d.hidden).index_put((inp.text_idx,), text)
        if inp.vit_idx.numel():
            v = g.vit_patch(inp.vit_pixels) + g.vit_pos(inp.vit_pos)
            for layer in self.vit[:vit_layers]:
                v = layer(v, ctx)
            v = g.connector(g.vit_post(v)) + g.vit_pos2d[inp.vit_pos]
            seq = seq.index_put((inp.vit_idx,), v)
        if inp.vae_idx.numel():
            x0 = self.vae_tokens(inp) if encode else inp.latents
            t = torch.sigmoid(inp.timesteps).to(x0.dtype)[:, None]
            xt = (1 - t) * x0 + t * inp.noise
            e = g.vae2llm(xt) + g.time_embed(timestep_features(t[:, 0]).to(xt.dtype)) + g.latent_pos2d[inp.latent_pos]
            seq = seq.index_put((inp.vae_idx,), e)
        for layer in self.llm[:llm_layers]:
            seq = layer(seq, ctx)
        seq = routed(ctx, seq, g.norm_und, g.norm_gen, lambda e, t: (e(t),))[0]
        loss = seq.new_zeros((), dtype=torch.float32)
        if inp.ce_idx.numel():
            logits = g.lm_head(seq[inp.ce_idx])
            loss = loss + (F.cross_entropy(logits.float(), inp.labels, reduction="none") * inp.ce_weights).sum()
        if inp.mse_idx.numel():
            pred = g.llm2vae(seq[inp.mse_idx])
            loss = loss + ((pred.float() - inp.mse_target.float()) ** 2).mean()
        return loss


# -- attention ---------------------------------------------------------------------------------
_FLEX: dict = {}  # per device type: flex_attention, compiled once on CUDA (eager elsewhere: tests)


def flex_fn(device_type: str):
    if device_type not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX[device_type] = torch.compile(flex_attention, dynamic=False) if device_type == "cuda" else flex_attention
    return _FLEX[device_type]


class FlexMask:
    """BAGEL's flex mask (``create_sparse_mask``) over a sequence padded to ``length``: same sample,
    then causal, or the same full/noise split, and never a key of another split's noise.  The
    mask function reads fixed buffers refilled per record, so neither it nor the compiled
    attention kernel is made again for each record."""

    def __init__(self, length: int, device):
        self.length = length
        self.doc = torch.zeros(length, dtype=torch.int32, device=device)
        self.full = torch.zeros(length, dtype=torch.int32, device=device)
        self.noise = torch.zeros(length, dtype=torch.int32, device=device)
        doc, full, noise = self.doc, self.full, self.noise

        def mask_mod(b, h, q, kv):
            causal = q >= kv
            same_full = (full[q] == full[kv]) & (full[q] >= 0)
            hidden_noise = (noise[kv] >= 0) & (noise[q] != noise[kv])
            return (causal | same_full) & ~hidden_noise & (doc[q] == doc[kv])

        self.mask_mod = mask_mod

    def fill(self, ids: dict[str, torch.Tensor]) -> None:
        self.doc.copy_(ids["doc"])
        self.full.copy_(ids["full"])
        self.noise.copy_(ids["noise"])

    def block_mask(self):
        from torch.nn.attention.flex_attention import create_block_mask

        kw = dict(B=None, H=None, Q_LEN=self.length, KV_LEN=self.length, device=self.doc.device, BLOCK_SIZE=128)
        if self.doc.device.type != "cuda":
            return create_block_mask(self.mask_mod, **kw)
        try:
            return create_block_mask(self.mask_mod, _compile=True, **kw)
        except TypeError:  # a torch without _compile
            return create_block_mask(self.mask_mod, **kw)


def split_ids(sh: Shape, pad: int) -> dict[str, np.ndarray]:
    """Per position (the flex pad included, as one more causal sample): sample, full/noise split, noise split."""
    codes = {name: i for i, name in enumerate(_attn_modes())}
    split_lens = np.append(sh.split_lens, pad) if pad else sh.split_lens
    modes = np.append(sh.attn_modes, codes["causal"]) if pad else sh.attn_modes
    sample_lens = np.append(sh.sample_lens, pad) if pad else sh.sample_lens
    split = np.arange(len(split_lens))
    full = np.where((modes == codes["full"]) | (modes == codes["noise"]), split, -1)
    noise = np.where(modes == codes["noise"], split, -1)
    return {"doc": np.repeat(np.arange(len(sample_lens)), sample_lens),
            "full": np.repeat(full, split_lens), "noise": np.repeat(noise, split_lens)}


def _attn_modes():
    from schemas.packed_batch import ATTN_MODES

    return ATTN_MODES


def dense_sample_masks(sh: Shape) -> list[np.ndarray]:
    """Per sample, its [L, L] boolean mask (True: attend), the same rules (the non-flex reference)."""
    ids = split_ids(sh, 0)
    out, pos = [], 0
    for n in sh.sample_lens.tolist():
        f, z = ids["full"][pos:pos + n], ids["noise"][pos:pos + n]
        i = np.arange(n)
        m = (i[:, None] >= i[None, :]) | ((f[:, None] == f[None, :]) & (f[:, None] >= 0))
        m &= ~((z[None, :] >= 0) & (z[:, None] != z[None, :]))
        out.append(m)
        pos += n
    return out


def sdpa_per_range(q, k, v, bounds, masks=None, causal=False):
    """q [N, H, D], k/v [N, Hkv, D]: one SDPA call per [a, b) range (GQA expanded), on 4-d
    [1, H, L, D] views (CUDA's fused kernels take nothing else)."""
    rep = q.shape[1] // k.shape[1]
    outs = []
    for j, (a, b) in enumerate(bounds):
        qs, ks, vs = (x[a:b].transpose(0, 1)[None] for x in (q, k, v))
        if rep > 1:
            ks, vs = ks.repeat_interleave(rep, 1), vs.repeat_interleave(rep, 1)
        mask = masks[j] if masks is not None else None
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=causal and mask is None)
                    [0].transpose(0, 1))
    return torch.cat(outs)


_VARLEN = None  # torch.nn.attention.varlen.varlen_attn when it works on the device (probed once)


def probe_varlen(device, dtype) -> bool:
    global _VARLEN
    if device.type != "cuda":
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn

        x = torch.randn(96, 3 * 2 * 72, device=device, dtype=dtype, requires_grad=True)
        q, k, v = (t.contiguous() for t in x.view(96, 3, 2, 72).unbind(1))  # as the ViT layers make them
        cu = torch.tensor([0, 40, 96], device=device, dtype=torch.int32)
        varlen_attn(q, k, v, cu, cu, 56, 56).float().square().sum().backward()
        if x.grad is None or not torch.isfinite(x.grad).all():
            raise RuntimeError("no finite gradient")
        q, k, v = (t.detach() for t in (q, k, v))
        ref = sdpa_per_range(q, k, v, [(0, 40), (40, 96)])
        got = varlen_attn(q, k, v, cu, cu, 56, 56)
        if not torch.allclose(got.float(), ref.float(), atol=3e-2, rtol=3e-2):
            raise RuntimeError("differs from per-image SDPA")
        _VARLEN = varlen_attn
        return True
    except Exception as exc:  # noqa: BLE001 (any failure: the per-image loop instead)
        log.info("varlen attention not usable here (%s): ViT attention is one SDPA call per image",
                 str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__)
        return False


@dataclass
class Ctx:
    """Per-record attention and routing state shared by the layers."""

    attend: object = None
    vit_attend: object = None
    cos: object = None
    sin: object = None
    und_idx: object = None
    gen_idx: object = None


class Record:
    """A record's device inputs for the stand-in (random values, the record's shapes and indexes)."""

    def __init__(self, sh: Shape, d: Dims, device, dtype, gen: torch.Generator, attention: str,
                 flex_masks: dict):
        self.sh, self.d = sh, d
        dev = device
        t = lambda a: torch.as_tensor(np.asarray(a, np.int64), device=dev)  # noqa: E731
        rnd = lambda *s: torch.randn(*s, generator=gen, device=dev, dtype=dtype)  # noqa: E731
        self.n = sh.sequence_length
        self.text_ids = t(sh.packed_text_ids % d.vocab)
        self.text_idx = t(sh.packed_text_indexes)
        self.positions = t(sh.packed_position_ids)
        self.ce_idx = t(sh.ce_loss_indexes)
        self.labels = t(sh.packed_label_ids % d.vocab)
        self.ce_weights = torch.as_tensor(sh.ce_loss_weights, device=dev)
        p = sh.vit_patch_size
        self.vit_idx = t(sh.packed_vit_token_indexes)
        self.vit_pos = t(sh.packed_vit_position_ids % d.vit_pos)
        self.vit_pixels = rnd(len(sh.packed_vit_token_indexes), 3 * p * p)
        self.vae_idx = t(sh.packed_vae_token_indexes)
        self.latent_pos = t(sh.packed_latent_position_ids % d.latent_pos)
        self.latent_hw = [tuple(map(int, hw)) for hw in sh.vae_latent_shapes]
        lat_dim = d.latent_channels * d.latent_patch ** 2
        n_lat = len(sh.packed_vae_token_indexes)
        self.latents, self.noise = rnd(n_lat, lat_dim), rnd(n_lat, lat_dim)
        self.timesteps = torch.as_tensor(sh.packed_timesteps, device=dev)
        self.mse_idx = t(sh.mse_loss_indexes)
        self.mse_target = rnd(len(sh.mse_loss_indexes), lat_dim)
        if len(sh.vae_heights):
            k = d.canvas_scale
            side = lambda x: max(8, -(-int(x.max()) // k))  # noqa: E731 (the encoder's x8 needs 8 pixels)
            self.canvas = rnd(len(sh.vae_heights), 3, side(sh.vae_heights), side(sh.vae_widths))
            per_token = 8 * d.latent_patch  # pixels per latent token side
            if k == 1 and any(per_token * h > H or per_token * w > W for (h, w), H, W
                              in zip(self.latent_hw, sh.vae_heights.tolist(), sh.vae_widths.tolist())):
                raise ValueError(f"{sh.where}: a VAE latent shape {self.latent_hw} exceeds its image")
        und = np.concatenate([sh.packed_text_indexes, sh.packed_vit_token_indexes])
        if len(und) + n_lat != self.n:
            raise ValueError(f"{sh.where}: text + ViT + VAE positions ({len(und)} + {n_lat}) != {self.n} tokens")
        self.und_idx, self.gen_idx = (t(und), t(sh.packed_vae_token_indexes)) if n_lat else (None, None)
        # attention
        self.pad = sh.max_num_tokens - sh.sequence_length if sh.use_flex else 0
        bounds = np.cumsum(np.append(0, sh.sample_lens)).tolist()
        self.sample_bounds = list(zip(bounds[:-1], bounds[1:]))
        if attention == "flex" and not sh.use_flex:
            attention = "sdpa-mask"
        self.attention = attention
        self.flex = None
        if attention == "flex":
            length = sh.max_num_tokens
            if length not in flex_masks:
                flex_masks[length] = FlexMask(length, dev)
            self.flex = flex_masks[length]
            self.flex_ids = {k: torch.as_tensor(v.astype(np.int32), device=dev)
                             for k, v in split_ids(sh, self.pad).items()}
        elif attention == "sdpa-mask":
            self.masks = [torch.as_tensor(m, device=dev) for m in dense_sample_masks(sh)]
        vb = np.cumsum(np.append(0, sh.vit_token_seqlens)).tolist()
        self.vit_bounds = list(zip(vb[:-1], vb[1:]))
        self.vit_cu = torch.as_tensor(vb, device=dev, dtype=torch.int32)
        self.vit_max = int(max(sh.vit_token_seqlens.tolist(), default=0))
        self.block_mask = None

    def make_block_mask(self):
        self.flex.fill(self.flex_ids)
        return self.flex.block_mask()

    def ctx(self, block_mask=None) -> Ctx:
        d = self.d
        inv = 1.0 / (d.rope_theta ** (torch.arange(0, d.head_dim, 2, device=self.positions.device).float() / d.head_dim))
        ang = self.positions.float()[:, None] * inv[None]
        ang = torch.cat([ang, ang], dim=-1)[:, None, :]
        dtype = self.latents.dtype
        c = Ctx(cos=ang.cos().to(dtype), sin=ang.sin().to(dtype), und_idx=self.und_idx, gen_idx=self.gen_idx)
        n, pad = self.n, self.pad
        if self.attention == "flex":
            bm = block_mask if block_mask is not None else self.block_mask

            def attend(q, k, v):
                qkv = [F.pad(x, (0, 0, 0, 0, 0, pad)).transpose(0, 1)[None] for x in (q, k, v)]
                return flex_fn(q.device.type)(*qkv, block_mask=bm, enable_gqa=True)[0].transpose(0, 1)[:n]
        elif self.attention == "sdpa-mask":
            def attend(q, k, v):
                return sdpa_per_range(q, k, v, self.sample_bounds, masks=self.masks)
        else:
            bounds = self.sample_bounds + ([(n, n + pad)] if pad else [])

            def attend(q, k, v):
                if pad:
                    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
                return sdpa_per_range(q, k, v, bounds, causal=True)[:n]
        c.attend = attend

        if _VARLEN is not None:
            def vit_attend(q, k, v):
                q, k, v = (x.contiguous() for x in (q, k, v))
                return _VARLEN(q, k, v, self.vit_cu, self.vit_cu, self.vit_max, self.vit_max)
        else:
            def vit_attend(q, k, v):
                return sdpa_per_range(q, k, v, self.vit_bounds)
        c.vit_attend = vit_attend
        return c


# -- timing ------------------------------------------------------------------------------------
class Timer:
    def __init__(self, device):
        self.device = device

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def median(self, fn, reps: int, after=None) -> float:
        """Median milliseconds of ``fn()`` over ``reps`` synchronized runs (``after()`` between, untimed)."""
        ts = []
        for _ in range(reps):
            self.sync()
            if self.device.type == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                ts.append(a.elapsed_time(b))
            else:
                t0 = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t0) * 1e3)
            if after is not None:
                after()
        return statistics.median(ts)


def time_record(model: Model, rec: Record, timer: Timer, reps: int, llm_layers: int, vit_layers: int,
                gen: torch.Generator) -> dict[str, float]:
    """The record's times (module doc): each part alone, then the whole stand-in."""
    d, dev, dtype = model.d, rec.latents.device, rec.latents.dtype
    clear = lambda: model.zero_grad(set_to_none=True)  # noqa: E731
    out = {}
    if rec.attention == "flex":
        out["mask_ms"] = timer.median(rec.make_block_mask, reps)
        rec.block_mask = rec.make_block_mask()
    else:
        out["mask_ms"] = 0.0
    out["vae_ms"] = timer.median(lambda: model.vae_tokens(rec), reps) if rec.vae_idx.numel() else 0.0
    ctx = rec.ctx()

    def stack(layers, n, width):
        """fwd+bwd of ``layers`` alone, from a leaf input, with a random output gradient."""
        x = torch.randn(n, width, generator=gen, device=dev, dtype=dtype).requires_grad_(True)
        g = torch.randn(n, width, generator=gen, device=dev, dtype=dtype)

        def run():
            x.grad = None  # each run makes its gradient anew, as the model's
            y = x
            for layer in layers:
                y = layer(y, ctx)
            y.backward(g)

        return run

    n_vit = rec.vit_idx.numel()
    out["vit_layers_ms"] = (timer.median(stack(model.vit[:vit_layers], n_vit, d.vit_hidden), reps, clear)
                            if n_vit and vit_layers else 0.0)
    out["llm_layers_ms"] = (timer.median(stack(model.llm[:llm_layers], rec.n, d.hidden), reps, clear)
                            if llm_layers else 0.0)
    out["glue_ms"] = timer.median(
        lambda: model.step(rec, ctx, llm_layers=0, vit_layers=0, encode=False).backward(), reps, clear)

    def total():
        bm = rec.make_block_mask() if rec.attention == "flex" else None
        model.step(rec, rec.ctx(bm), llm_layers=llm_layers, vit_layers=vit_layers, encode=True).backward()

    out["total_ms"] = timer.median(total, reps, clear)
    out["llm_layer_ms"] = out["llm_layers_ms"] / llm_layers if llm_layers else 0.0
    out["vit_layer_ms"] = out["vit_layers_ms"] / vit_layers if vit_layers else 0.0
    fixed = out["mask_ms"] + out["vae_ms"] + out["glue_ms"]
    out["parts_ms"] = fixed + out["llm_layers_ms"] + out["vit_layers_ms"]
    out["est_full_ms"] = fixed + FULL_LLM_LAYERS * out["llm_layer_ms"] + FULL_VIT_LAYERS * out["vit_layer_ms"]
    return out


def print_fit(label: str, rep: dict) -> None:
    h, t = rep["heldout"], rep["tokens_alone"]
    print(f"{label} ({rep['target']}: mean {rep['mean_ms']:.1f} ms, {rep['min_ms']:.1f}..{rep['max_ms']:.1f}; "
          f"fit on {rep['n_train']} records, measured on {rep['n_heldout']} held out):")
    print(f"  {'intercept':<20} {rep['intercept_ms']:12.5g} ms        {rep['share_of_mean']['intercept']:6.1%} of the mean")
    for f, c in rep["coefficients_ms"].items():
        print(f"  {f:<20} {c:12.5g} ms/unit   {rep['share_of_mean'][f]:6.1%}")
    print(f"  full model: R2 {h['r2']:.3f}, median error {h['median_ape']:.1f}%, max {h['max_ape']:.1f}%; "
          f"tokens alone: R2 {t['r2']:.3f}, median error {t['median_ape']:.1f}%, max {t['max_ape']:.1f}%")


# -- main --------------------------------------------------------------------------------------
def device_label(device, tiny: bool) -> str:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"
    return f"{name}, tiny dims" if tiny else name


def print_segments(fit: dict) -> None:
    """The per-segment fit (``cost_fit.fit_segments``): each segment's terms against its own time."""
    print("per segment (where FSDP ranks wait; each segment's terms fitted to its own measured time, "
          f"{fit['n_train']} records, {fit['n_heldout']} held out):")
    for segment, part in fit["per_segment"].items():
        h = part["heldout"]
        terms = ", ".join(f"{k} {v:.4g}" for k, v in part["coefficients_ms"].items())
        print(f"  {segment:<4} mean {part['mean_ms']:7.1f} ms ({part['min_ms']:.1f}..{part['max_ms']:.1f}): R2 "
              f"{h['r2']:.3f}, median error {h['median_ape']:.1f}%, max {h['max_ape']:.1f}%; intercept "
              f"{part['intercept_ms']:.4g} ms, {terms} ms/unit")


def report(rows: list[dict], label: str, fit_path: str, info: dict, segments_path: str | None = None) -> None:
    """Print both fits and the last line; write the fit JSON (and the per-segment model's, to
    ``segments_path``: a file ``CostModel.read`` and ``--cost-model`` take)."""
    full, standin = fit_report(rows, "est_full_ms"), fit_report(rows, "total_ms")
    ratio = np.array([r["parts_ms"] / r["total_ms"] for r in rows if r["total_ms"] > 0])
    r0 = rows[0]
    depth = f"LLM {r0['llm_layers']} + ViT {r0['vit_layers']} layers"
    print(f"{len(rows)} records timed on {label}: stand-in {r0['dims']} dims, {depth}, {r0['dtype']}, attention "
          f"{', '.join(sorted({str(r['attention']) for r in rows}))}")
    if len(ratio):
        print(f"parts vs whole: the parts timed alone sum to {np.median(ratio):.2f}x the whole stand-in's time "
              f"(median; {ratio.min():.2f}..{ratio.max():.2f})")
    print_fit(f"the stand-in as measured ({depth})", standin)
    print_fit(f"full-depth estimate (LLM {FULL_LLM_LAYERS} + ViT {FULL_VIT_LAYERS} layers from the per-layer times)",
              full)
    doc = {"device": label, **info, "stand_in_layers": {"llm": r0["llm_layers"], "vit": r0["vit_layers"]},
           "full_depth_layers": {"llm": FULL_LLM_LAYERS, "vit": FULL_VIT_LAYERS}, "dims_name": r0["dims"],
           "dtype": r0["dtype"], "attention": sorted({str(r["attention"]) for r in rows}), "records": len(rows),
           "features": list(FEATURES), "heldout_rule": "every 4th record (index % 4 == 3) is held out",
           **full, "stand_in_measured": standin}
    with open(fit_path, "w") as f:
        json.dump(doc, f, indent=2)
    segments = fit_segments(rows)
    print_segments(segments)
    if segments_path:
        os.makedirs(os.path.dirname(os.path.abspath(segments_path)), exist_ok=True)
        with open(segments_path, "w") as f:
            json.dump({"device": label, **info, "target": "per segment: cost_fit.segment_times", **segments}, f,
                      indent=2)
    h = full["heldout"]
    print(f"record cost on {label}: fit R2 {h['r2']:.3f} (tokens alone {full['tokens_alone']['r2']:.3f}), "
          f"median error {h['median_ape']:.1f}% over {full['n_heldout']} records")


class _Stop(BaseException):
    """SIGTERM (a wall-clock limit such as ``timeout``): stop timing, fit what is done.  Not an
    ``Exception``, so no per-record or flex fallback handler takes it for a failure."""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description="Time a BAGEL-7B-shaped forward+backward per packed record and fit a per-record cost model "
                    "(the terms, the stand-in and the fit: the script's docstring).",
        epilog="examples:\n"
               "  PYTHONPATH=. python3 scripts/time_record_cost.py --pack .costpack/costpack.tar.xz --device cuda "
               "--time-budget 270\n"
               "  python scripts/time_record_cost.py --device cpu --pack .costpack/costpack.tar.xz --max-records 8 "
               "--reps 1\n"
               "  python scripts/time_record_cost.py --from-csv record_cost.csv",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pack", action="append", default=[],
                    help="a pack folder, a folder of packs or a .tar[.xz|.gz] of packs (scripts/make_cost_pack.py); "
                         "repeat for several")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device (default: cuda when torch sees one, else cpu)")
    ap.add_argument("--tiny", action="store_true", help="tiny dims (a dry run; implied on the CPU)")
    ap.add_argument("--full-dims", action="store_true", help="BAGEL-7B dims even on the CPU (very slow)")
    ap.add_argument("--llm-layers", type=int, default=2, help="Qwen2.5-7B decoder layers in the stand-in (default 2)")
    ap.add_argument("--vit-layers", type=int, default=2, help="SigLIP-so400m layers in the stand-in (default 2)")
    ap.add_argument("--reps", type=int, default=3, help="timed runs per record and part, the median kept (default 3)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="untimed runs of everything on the first record (default: 2 on CUDA, 0 on the CPU)")
    ap.add_argument("--max-records", type=int, default=200, help="records read, round-robin over the packs' streams (default 200)")
    ap.add_argument("--time-budget", type=float, default=0.0,
                    help="start no record after this many seconds since the start (reading and warm-up included; "
                         "default 0: no limit); the fit uses the records done.  SIGTERM (timeout) also stops "
                         "and fits")
    ap.add_argument("--attention", choices=("auto", "flex", "sdpa-mask", "sdpa-causal"), default="auto",
                    help="auto (default): flex on CUDA (records without use_flex: per-sample SDPA with dense masks), "
                         "sdpa-causal on the CPU; flex and sdpa-mask on the CPU are for small records (tests)")
    ap.add_argument("--no-verify", action="store_true", help="skip the records' digest checks while reading")
    ap.add_argument("--csv", default=os.path.join(ROOT, ".costpack", "record_cost.csv"), help="per-record CSV, written as records are timed (default .costpack/record_cost.csv)")
    ap.add_argument("--fit", default=os.path.join(ROOT, ".costpack", "record_cost_fit.json"), help="the fit's coefficients and metrics, JSON (default .costpack/record_cost_fit.json)")
    ap.add_argument("--segments-fit", default=None,
                    help="the per-segment model (VAE, ViT, LLM: each fitted to its own time), a --cost-model file "
                         "(default: beside --fit, its name + _segments.json)")
    ap.add_argument("--from-csv", metavar="CSV", help="time nothing: fit an earlier run's CSV again")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights and the random inputs (default 0)")
    ap.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    args = ap.parse_args(argv)
    args.segments_fit = args.segments_fit or os.path.splitext(args.fit)[0] + "_segments.json"
    t_begin = time.perf_counter()  # --time-budget counts from here: reading and warm-up included
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    if args.from_csv:
        rows = read_csv(args.from_csv)
        if not rows:
            ap.error(f"{args.from_csv}: no rows")
        report(rows, str(rows[0]["device"]), args.fit, {"from_csv": args.from_csv}, args.segments_fit)
        return 0
    if not args.pack:
        ap.error("--pack is required (or --from-csv)")

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but torch sees no CUDA device (use --device cpu for a dry run)")
    tiny = args.tiny or (device.type == "cpu" and not args.full_dims)
    dims = TINY if tiny else FULL
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    attention = args.attention if args.attention != "auto" else "flex" if device.type == "cuda" else "sdpa-causal"
    warmup = args.warmup if args.warmup is not None else (2 if device.type == "cuda" else 0)
    torch.manual_seed(args.seed)
    gen = torch.Generator(device=device).manual_seed(args.seed)  # inputs made on the device

    with tempfile.TemporaryDirectory(prefix="time_record_cost-") as tmp:
        shapes = read_shapes(args.pack, args.max_records, tmp, verify=not args.no_verify)
    if not shapes:
        raise SystemExit("no records in the packs")
    log.info("%d records; stand-in on %s: %s dims, %s, LLM %d + ViT %d layers, %s attention", len(shapes),
             device, "tiny" if tiny else "BAGEL-7B", str(dtype).replace("torch.", ""), args.llm_layers,
             args.vit_layers, attention)
    model = Model(dims, args.llm_layers, args.vit_layers, shapes[0].vit_patch_size).to(device, dtype)
    if device.type == "cuda":
        probe_varlen(device, dtype)
    timer = Timer(device)
    flex_masks: dict = {}
    label = device_label(device, tiny)

    def on_term(signum, frame):  # a wall-clock limit: stop, and fit what is done
        raise _Stop()

    signal.signal(signal.SIGTERM, on_term)
    rows: list[dict] = []
    failed = 0
    os.makedirs(os.path.dirname(os.path.abspath(args.csv)), exist_ok=True)
    out = open(args.csv, "w", newline="")
    writer = None
    t_start = time.perf_counter()
    try:
        for n, sh in enumerate(shapes):
            if args.time_budget and rows and time.perf_counter() - t_begin > args.time_budget:
                log.info("time budget of %.0f s spent: %d of %d records timed", args.time_budget, n, len(shapes))
                break
            terms = sh.terms
            try:
                rec = Record(sh, dims, device, dtype, gen, attention, flex_masks)
                if n == 0 and warmup:  # compilation, kernels, allocator
                    t0 = time.perf_counter()
                    try:
                        for _ in range(warmup):
                            time_record(model, rec, timer, 1, args.llm_layers, args.vit_layers, gen)
                    except Exception as exc:  # noqa: BLE001
                        if rec.attention != "flex":
                            raise
                        log.warning("flex attention failed (%s): per-sample SDPA with dense masks instead",
                                    str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else type(exc).__name__)
                        attention = "sdpa-mask"
                        model.zero_grad(set_to_none=True)
                        rec = Record(sh, dims, device, dtype, gen, attention, flex_masks)
                        for _ in range(warmup):
                            time_record(model, rec, timer, 1, args.llm_layers, args.vit_layers, gen)
                    log.info("warm-up (%d runs of the first record) done in %.1f s", warmup, time.perf_counter() - t0)
                    t_start = time.perf_counter()
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                times = time_record(model, rec, timer, args.reps, args.llm_layers, args.vit_layers, gen)
            except Exception as exc:  # noqa: BLE001 (one record's failure, e.g. out of memory, is not the run's)
                failed += 1
                log.error("record %s failed, skipped: %s: %s", sh.where, type(exc).__name__,
                          str(exc).strip().splitlines()[0][:300] if str(exc).strip() else "")
                model.zero_grad(set_to_none=True)
                rec = None
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                if failed > max(3, len(shapes) // 4):
                    raise
                continue
            peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
            pack_name, stream, index = sh.where.rsplit("/", 2)
            row = {"pack": pack_name, "stream": int(stream), "record": int(index), **terms,
                   **{k: round(times[k], 4) for k in TIMES}, "peak_gib": round(peak, 2),
                   "attention": rec.attention, "llm_layers": args.llm_layers, "vit_layers": args.vit_layers,
                   "dims": "tiny" if tiny else "bagel-7b", "dtype": str(dtype).replace("torch.", ""), "device": label}
            rows.append(row)
            if writer is None:
                writer = csv.DictWriter(out, fieldnames=list(row))
                writer.writeheader()
            writer.writerow(row)
            out.flush()
            rec = None
            spent = time.perf_counter() - t_start
            left = spent / len(rows) * (len(shapes) - n - 1)
            if args.time_budget:
                left = min(left, max(0.0, args.time_budget - (time.perf_counter() - t_begin)))
            log.info("record %d/%d %s: %d tokens, %d samples, ViT %d tok/%d img, VAE %d img on %dx%d: "
                     "total %.1f ms (parts %.1f), full-depth estimate %.1f ms; ~%.0f s left",
                     n + 1, len(shapes), sh.where, terms["tokens"], terms["samples"], terms["vit_tokens"],
                     terms["vit_images"], terms["vae_images"], terms["vae_canvas_h"], terms["vae_canvas_w"],
                     times["total_ms"], times["parts_ms"], times["est_full_ms"], left)
    except (_Stop, KeyboardInterrupt):
        log.warning("stopped (signal) after %d records: fitting those", len(rows))
    finally:
        out.close()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if not rows:
        raise SystemExit("no record could be timed")
    if failed:
        log.warning("%d records failed and were skipped", failed)
    info = {"device_type": device.type, "reps": args.reps, "packs": args.pack, "failed_records": failed,
            "dims": asdict(dims)}
    report(rows, label, args.fit, info, args.segments_fit)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
