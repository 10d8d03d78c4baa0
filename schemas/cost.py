"""What a packed batch costs to train on: its compute terms, and the model that prices them.

Why: a step lasts as long as its slowest rank, and equal tokens are not equal compute (the
design's "A step that waits for no one rank"; issue 44).  A pack knows every batch's shapes
before training, so a balancer can even the ranks out if it can tell a batch's time from its
shapes.  This module is the cost model's one home: the terms (``COST_TERMS``, counted from a
record's fields by ``terms_of``; per sample by ``sample_terms_of``), and ``CostModel``, a linear
price per term.  The loader imports it: numpy only.

**Terms** (why each, and what is left out):

- ``tokens``: the packed sequence's length: every token passes the LLM's 28 layers (its dense
  GEMMs are ~80% of a BAGEL-7B step; the Mixture-of-Transformers sends a token through one of two
  weight sets, the same FLOPs either way);
- ``sum_sq_sample_lens``: LLM attention, quadratic in each sample's length (a sample attends only
  within itself);
- ``vit_tokens``, ``sum_sq_vit_lens``: ViT patches pass the ViT (SigLIP, 26 layers) and its
  connector; ViT attention is quadratic per image;
- ``vae_images``: per-image overhead of the VAE encoder (0 in the FLOPs model; a fitted model may
  price it);
- ``vae_canvas_pixels``: the VAE encodes a batch's VAE images on one zero-padded canvas of the
  largest height and the largest width among them: images x H x W pixels are convolved;
- ``vae_canvas_sq``: the encoder's mid-block self-attention over each canvas's latent grid:
  images x (H/8 x W/8)^2 (the H200 fit prices it; ~11% of the encoder's FLOPs at 1024x1024);
- ``ce_tokens``: the LM head (hidden x 152,064 vocabulary) and cross entropy run on the CE loss
  positions only;
- ``mse_tokens``: the ``llm2vae`` head and the MSE on the diffusion loss positions.

Left out: ``vit_images`` (the H200 fit gives it 0, and no FLOPs are per image beyond the
patches) and the flex pad (``max_num_tokens - sequence_length`` more attention rows, one causal
sample: the fit gives its square 0; priced as LLM attention it is under 0.5% of a step).
``record_terms`` still counts both, and the rest of what ``scripts/time_record_cost.py`` writes
per record.

**The default model** (``CostModel.default``: BAGEL-7B from FLOPs; the derivation is in
``DEFAULT_FLOPS`` and ``DEFAULT_RATES`` below and in docs/performance.md).  FLOPs per unit of
each term, forward+backward = 3x forward for the trained parts (LLM, connector, ViT, heads),
forward only for the frozen VAE encoder, divided by an assumed sustained rate per kind of compute
on an H200 (989 TFLOP/s bf16 dense): the LLM's GEMMs and attention at 1/2 of it, the ViT (hidden
1152: skinny GEMMs, short per-image sequences) at 1/4, the VAE encoder (convolutions at 128-512
channels on megapixel canvases, GroupNorm-bound) at 1/8.  Scale does not matter to a balancer
(only ratios between batches do); the rates matter only in how they weigh the kinds of compute.

Determinism: ``estimate`` adds the terms' products one column at a time (no BLAS, no fused
multiply-add), so the same terms give the same bits on every machine: ranks that each compute
their step's assignment from the index must agree without communication.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from schemas.errors import ConfigError, UsageError

COST_TERMS = ("tokens", "sum_sq_sample_lens", "vit_tokens", "sum_sq_vit_lens", "vae_images", "vae_canvas_pixels",
              "vae_canvas_sq", "ce_tokens", "mse_tokens")
_INDEX = {name: i for i, name in enumerate(COST_TERMS)}
# the terms that depend on the batch as a whole (its VAE canvas), not on each sample alone
CANVAS_TERMS = ("vae_canvas_pixels", "vae_canvas_sq")

# every quantity ``record_terms`` counts (scripts/time_record_cost.py's CSV columns after pack, stream, record)
RECORD_TERMS = ("tokens", "samples", "sum_sq_sample_lens", "flex_pad", "flex_pad_sq", "vit_images", "vit_tokens",
                "sum_sq_vit_lens", "vae_images", "vae_canvas_h", "vae_canvas_w", "vae_canvas_pixels", "vae_canvas_sq",
                "vae_latent_tokens", "ce_tokens", "mse_tokens", "text_tokens")

# the record columns the terms are counted from (a projected read needs these, never the pixel table)
TERM_COLUMNS = ("use_flex", "max_num_tokens", "sequence_length", "sample_lens", "packed_text_ids", "ce_loss_indexes",
                "image_heights", "image_widths", "vit_token_seqlens", "packed_vit_token_indexes", "vae_image_ids",
                "vae_latent_shapes", "packed_vae_token_indexes", "mse_loss_indexes")

# Where a rank waits (issue 50): under FSDP every layer of every micro-batch is a collective that
# every rank joins, so a micro-step lasts as long as the slowest rank in each of these segments,
# one after the other: the frozen VAE encode (before the first collective), the ViT's layers, the
# LLM's layers (with the heads that run beside its last layer).  Each term belongs to one segment.
SEGMENTS = ("vae", "vit", "llm")
SEGMENT_TERMS = {
    "vae": ("vae_images", "vae_canvas_pixels", "vae_canvas_sq"),
    "vit": ("vit_tokens", "sum_sq_vit_lens"),
    "llm": ("tokens", "sum_sq_sample_lens", "ce_tokens", "mse_tokens"),
}
INTERCEPT_SEGMENT = "llm"  # a constant per batch: the same on every rank, whichever segment holds it
assert sorted(t for ts in SEGMENT_TERMS.values() for t in ts) == sorted(COST_TERMS)

VAE_LATENT_DOWNSAMPLE = 8  # the VAE encoder's spatial reduction: its mid-block attends over (H/8) x (W/8)

# --- the default model's derivation: BAGEL-7B ---------------------------------------------------
_LLM = dict(layers=28, hidden=3584, kv=4 * 128, mlp=18944, vocab=152064)  # Qwen2.5-7B
_VIT = dict(layers=26, hidden=1152, mlp=4304, patch=14)  # SigLIP-so400m less its last layer
_LLM_LAYER_PARAMS = _LLM["hidden"] * (2 * _LLM["hidden"] + 2 * _LLM["kv"]) + 3 * _LLM["hidden"] * _LLM["mlp"]
_VIT_LAYER_PARAMS = 4 * _VIT["hidden"] ** 2 + 2 * _VIT["hidden"] * _VIT["mlp"]
_CONNECTOR_PARAMS = _VIT["hidden"] * _LLM["hidden"] + _LLM["hidden"] ** 2  # BAGEL's ViT connector MLP


def _vae_encoder_flops_per_pixel() -> float:
    """Forward FLOPs per canvas pixel of a FLUX-shaped VAE encoder (channels 128, 256, 512, 512, two
    ResNet blocks per level, x2 downsampling after the first three, mid-block ResNets and the
    attention's projections, 2x16 latent channels out); the attention's N^2 part is
    ``vae_canvas_sq``'s."""
    def conv(cin: int, cout: int, k: int, scale: float) -> float:  # scale: output pixels per input pixel
        return 2.0 * k * k * cin * cout * scale

    flops, cin, scale = conv(3, 128, 3, 1.0), 128, 1.0
    for level, cout in enumerate((128, 256, 512, 512)):
        for _ in range(2):
            flops += conv(cin, cout, 3, scale) + conv(cout, cout, 3, scale)
            flops += conv(cin, cout, 1, scale) if cin != cout else 0  # the shortcut
            cin = cout
        if level < 3:
            scale /= 4
            flops += conv(cout, cout, 3, scale)
    flops += 4 * conv(512, 512, 3, scale) + 4 * 2.0 * 512 * 512 * scale  # mid ResNets, attention q/k/v/out
    return flops + conv(512, 32, 3, scale)


# FLOPs per unit of each term (fwd+bwd = 3 x forward where trained; the VAE encoder is frozen: forward only)
DEFAULT_FLOPS = {
    "tokens": 3 * 2.0 * _LLM["layers"] * _LLM_LAYER_PARAMS,  # ~39.2 GFLOP: 2 x 6.5B params x 3
    # QK^T and AV: 4 d L^2 per sample per layer, counted dense (no causal half: BAGEL's masks mix causal
    # text with full image splits, and flex attention runs below the GEMMs' rate, which about cancels)
    "sum_sq_sample_lens": 3 * 4.0 * _LLM["hidden"] * _LLM["layers"],
    "vit_tokens": 3 * 2.0 * (_VIT["layers"] * _VIT_LAYER_PARAMS + _CONNECTOR_PARAMS  # + the patch embedding
                             + 3 * _VIT["patch"] ** 2 * _VIT["hidden"]),
    "sum_sq_vit_lens": 3 * 4.0 * _VIT["hidden"] * _VIT["layers"],
    "vae_images": 0.0,
    "vae_canvas_pixels": _vae_encoder_flops_per_pixel(),  # ~4.13 MFLOP
    "vae_canvas_sq": 4.0 * 512,  # the mid-block's single-head attention, 512 channels, forward
    "ce_tokens": 3 * 2.0 * _LLM["hidden"] * _LLM["vocab"],  # the LM head on the CE positions
    "mse_tokens": 3 * 2.0 * _LLM["hidden"] * 64,  # llm2vae (hidden -> 2x2 patches of 16 latent channels)
}
H200_BF16_PEAK = 989e12  # FLOP/s, dense
# assumed sustained share of the peak per kind of compute (see the module doc)
DEFAULT_RATES = {"tokens": 1 / 2, "sum_sq_sample_lens": 1 / 2, "ce_tokens": 1 / 2, "mse_tokens": 1 / 2,
                 "vit_tokens": 1 / 4, "sum_sq_vit_lens": 1 / 4,
                 "vae_images": 1 / 8, "vae_canvas_pixels": 1 / 8, "vae_canvas_sq": 1 / 8}


# --- counting the terms ----------------------------------------------------------------------------
def _vae_sizes(batch) -> tuple[np.ndarray, np.ndarray]:
    vae = np.asarray(batch.vae_image_ids, np.int64)
    return np.asarray(batch.image_heights, np.int64)[vae], np.asarray(batch.image_widths, np.int64)[vae]


def canvas_terms(heights: np.ndarray, widths: np.ndarray) -> tuple[int, int]:
    """``(vae_canvas_pixels, vae_canvas_sq)`` of VAE images of these sizes encoded on one canvas."""
    n = len(heights)
    if not n:
        return 0, 0
    h, w = int(np.max(heights)), int(np.max(widths))
    grid = (h // VAE_LATENT_DOWNSAMPLE) * (w // VAE_LATENT_DOWNSAMPLE)
    return n * h * w, n * grid * grid


def record_terms(batch) -> dict[str, int]:
    """Every quantity in ``RECORD_TERMS`` of one batch (a ``schemas.packed_batch.PackedBatch``, or any
    object with its fields named in ``TERM_COLUMNS``): the cost terms and what describes them."""
    sl = np.asarray(batch.sample_lens, np.int64)
    vit = np.asarray(batch.vit_token_seqlens, np.int64)
    vh, vw = _vae_sizes(batch)
    pixels, sq = canvas_terms(vh, vw)
    lat = np.asarray(batch.vae_latent_shapes, np.int64).reshape(-1, 2)
    pad = int(batch.max_num_tokens) - int(batch.sequence_length) if batch.use_flex else 0
    return {
        "tokens": int(batch.sequence_length),
        "samples": len(sl),
        "sum_sq_sample_lens": int((sl * sl).sum()),
        "flex_pad": pad,
        "flex_pad_sq": pad * pad,
        "vit_images": len(vit),
        "vit_tokens": int(vit.sum()),
        "sum_sq_vit_lens": int((vit * vit).sum()),
        "vae_images": len(vh),
        "vae_canvas_h": int(vh.max()) if len(vh) else 0,
        "vae_canvas_w": int(vw.max()) if len(vw) else 0,
        "vae_canvas_pixels": pixels,
        "vae_canvas_sq": sq,
        "vae_latent_tokens": int((lat[:, 0] * lat[:, 1]).sum()),
        "ce_tokens": len(batch.ce_loss_indexes),
        "mse_tokens": len(batch.mse_loss_indexes),
        "text_tokens": len(batch.packed_text_ids),
    }


def terms_of(batch) -> np.ndarray:
    """The ``COST_TERMS`` of one batch, int64 ``[len(COST_TERMS)]`` (exact: every term is a count)."""
    terms = record_terms(batch)
    return np.array([terms[name] for name in COST_TERMS], np.int64)


def _first_positions(positions: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """First position of each image's run of ``lengths`` positions in ``positions``."""
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if len(lengths) else lengths
    return np.asarray(positions, np.int64)[starts]


def sample_terms_of(batch) -> tuple[np.ndarray, np.ndarray]:
    """Per sample: its ``COST_TERMS`` (int64 ``[n_samples, len(COST_TERMS)]``) and whether it holds
    a VAE image (bool ``[n_samples]``).

    A sample owns the positions of its span (``sample_lens``), an image belongs to the sample of
    its first token.  Every term but ``CANVAS_TERMS`` adds up over the samples to ``terms_of``;
    the canvas terms are the batch's (its largest VAE image's), so they are 0 here: they stay with
    the batch, as its VAE-holding samples do when samples move (``prepack.engine.resplit``).
    """
    sl = np.asarray(batch.sample_lens, np.int64)
    n = len(sl)
    bounds = np.concatenate([[0], np.cumsum(sl)])
    owner = lambda pos: np.searchsorted(bounds, np.asarray(pos, np.int64), side="right") - 1  # noqa: E731
    out = np.zeros((n, len(COST_TERMS)), np.int64)
    out[:, _INDEX["tokens"]] = sl
    out[:, _INDEX["sum_sq_sample_lens"]] = sl * sl
    vit = np.asarray(batch.vit_token_seqlens, np.int64)
    if len(vit):
        of = owner(_first_positions(batch.packed_vit_token_indexes, vit))
        out[:, _INDEX["vit_tokens"]] = np.bincount(of, vit, n).astype(np.int64)
        out[:, _INDEX["sum_sq_vit_lens"]] = np.bincount(of, vit * vit, n).astype(np.int64)
    lat = np.asarray(batch.vae_latent_shapes, np.int64).reshape(-1, 2)
    has_vae = np.zeros(n, bool)
    if len(lat):
        of = owner(_first_positions(batch.packed_vae_token_indexes, lat[:, 0] * lat[:, 1]))
        out[:, _INDEX["vae_images"]] = np.bincount(of, minlength=n)
        has_vae = out[:, _INDEX["vae_images"]] > 0
    for name, column in (("ce_tokens", batch.ce_loss_indexes), ("mse_tokens", batch.mse_loss_indexes)):
        if len(column):
            out[:, _INDEX[name]] = np.bincount(owner(column), minlength=n)
    return out, has_vae


QUANTUM_BITS = 40  # the largest cost becomes 2^40: sums of up to 2^23 costs stay exact in int64


def quantize(values: np.ndarray, what: str) -> np.ndarray:
    """Non-negative finite costs as int64 on one scale (the largest of them all -> 2^40), exact to
    ~1e-12: every sum and comparison of them is exact, so ranks that each compute an assignment
    agree without communication."""
    v = np.asarray(values, np.float64)
    if v.size and (not np.isfinite(v).all() or (v < 0).any()):
        raise UsageError(f"{what}: costs must be finite and >= 0")
    top = float(v.max()) if v.size else 0.0
    if top == 0.0:
        return np.zeros(v.shape, np.int64)
    return np.rint(v * (float(1 << QUANTUM_BITS) / top)).astype(np.int64)


# --- the model -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CostModel:
    """A batch's estimated time (ms): ``intercept + sum_i coefficients[i] * terms[i]`` over ``COST_TERMS``."""

    coefficients: tuple[float, ...]  # ms per unit of each term, in COST_TERMS order
    intercept: float = 0.0  # ms per batch

    def __post_init__(self) -> None:
        if len(self.coefficients) != len(COST_TERMS):
            raise ConfigError(f"cost model: {len(self.coefficients)} coefficients for {len(COST_TERMS)} terms "
                              f"({', '.join(COST_TERMS)})")

    def variable(self, terms: np.ndarray) -> np.ndarray:
        """The terms' part of the estimate, without the intercept (what samples add to a batch)."""
        t = np.asarray(terms)
        if t.shape[-1:] != (len(COST_TERMS),):
            raise ValueError(f"terms of shape {t.shape}: the last axis must be the {len(COST_TERMS)} COST_TERMS")
        t = t.astype(np.float64)
        out = np.zeros(t.shape[:-1], np.float64)
        for i, c in enumerate(self.coefficients):  # one column at a time: the same bits on every machine
            if c:
                out = out + c * t[..., i]
        return out

    def estimate(self, terms: np.ndarray) -> np.ndarray:
        """Estimated ms of each batch: terms ``[n, len(COST_TERMS)]`` -> ``[n]`` (one row -> a 0-d array)."""
        return self.variable(terms) + self.intercept

    def segments(self, terms: np.ndarray) -> np.ndarray:
        """Estimated ms of each batch per segment: terms ``[..., len(COST_TERMS)]`` -> ``[..., len(SEGMENTS)]``
        (``SEGMENT_TERMS``; the intercept in ``INTERCEPT_SEGMENT``).  Their sum is ``estimate``'s up
        to float summation order."""
        t = np.asarray(terms)
        if t.shape[-1:] != (len(COST_TERMS),):
            raise ValueError(f"terms of shape {t.shape}: the last axis must be the {len(COST_TERMS)} COST_TERMS")
        t = t.astype(np.float64)
        out = np.zeros(t.shape[:-1] + (len(SEGMENTS),), np.float64)
        for k, segment in enumerate(SEGMENTS):
            part = np.full(t.shape[:-1], self.intercept if segment == INTERCEPT_SEGMENT else 0.0)
            for name in SEGMENT_TERMS[segment]:  # one column at a time: the same bits on every machine
                c = self.coefficients[_INDEX[name]]
                if c:
                    part = part + c * t[..., _INDEX[name]]
            out[..., k] = part
        return out

    def without(self, segment: str) -> "CostModel":
        """This model with one segment's terms priced 0 (work no longer done in the step)."""
        if segment not in SEGMENT_TERMS:
            raise ConfigError(f"cost model: no segment {segment!r} (segments: {', '.join(SEGMENTS)})")
        gone = set(SEGMENT_TERMS[segment])
        return CostModel(tuple(0.0 if n in gone else c for n, c in zip(COST_TERMS, self.coefficients)),
                         self.intercept)

    @classmethod
    def of(cls, config: "Mapping | object | None") -> "CostModel":
        """A config's model: its ``prepack.cost_model`` (a stored config's mapping, or a
        ``schemas.config.PrepackConfig``), else the default.  The one reading of that setting."""
        if config is None:
            return cls.default()
        if isinstance(config, Mapping):
            mapping = (config.get("prepack") or {}).get("cost_model")
        else:
            mapping = config.prepack.cost_model
        return cls.from_mapping(mapping) if mapping else cls.default()

    @classmethod
    def default(cls) -> "CostModel":
        """BAGEL-7B on an H200, from FLOPs (``DEFAULT_FLOPS`` at ``DEFAULT_RATES`` of the bf16 peak)."""
        return cls(tuple(1e3 * DEFAULT_FLOPS[n] / (DEFAULT_RATES[n] * H200_BF16_PEAK) for n in COST_TERMS), 0.0)

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, float]) -> "CostModel":
        """A model from ``{term: ms per unit, ..., "intercept": ms}`` (a config's override); a term
        left out costs 0.  Unknown names, negative or non-finite values are refused."""
        if not isinstance(mapping, Mapping):
            raise ConfigError(f"cost model: expected a mapping of term -> ms per unit, got {type(mapping).__name__}")
        unknown = sorted(str(k) for k in mapping if k not in _INDEX and k != "intercept")
        if unknown:
            raise ConfigError(f"cost model: unknown term{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} "
                              f"(known: {', '.join(COST_TERMS)}, intercept)")
        values = {}
        for key, value in mapping.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"cost model: {key} must be a finite number >= 0 (ms), got {value!r}")
            values[key] = float(value)
        if not any(values.get(n, 0.0) for n in COST_TERMS):
            raise ConfigError("cost model: every term costs 0; price at least one of " + ", ".join(COST_TERMS))
        return cls(tuple(values.get(n, 0.0) for n in COST_TERMS), values.get("intercept", 0.0))

    @classmethod
    def read(cls, path: str) -> "CostModel":
        """A model from a JSON or YAML file: ``{term: ms per unit, ..., "intercept": ms}``, or a fit
        ``scripts/time_record_cost.py`` wrote (its ``coefficients_ms`` and ``intercept_ms``; terms it
        fitted that the model does not use must be 0)."""
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
            if path.endswith((".yaml", ".yml")):
                import yaml  # noqa: PLC0415 (only for a YAML file)

                raw = yaml.safe_load(text)
            else:
                raw = json.loads(text)
        except (OSError, ValueError) as e:
            raise ConfigError(f"cost model {path}: cannot read it ({e})") from None
        if isinstance(raw, Mapping) and "coefficients_ms" in raw:
            fitted = dict(raw["coefficients_ms"])
            extra = sorted(k for k, v in fitted.items() if k not in _INDEX and v)
            if extra:
                raise ConfigError(f"cost model {path}: fitted terms this model does not count: {', '.join(extra)}")
            raw = {**{k: v for k, v in fitted.items() if k in _INDEX}, "intercept": raw.get("intercept_ms", 0.0)}
        try:
            return cls.from_mapping(raw)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    def to_mapping(self) -> dict[str, float]:
        """Every term's coefficient and the intercept: ``from_mapping`` of it is this model."""
        return {**dict(zip(COST_TERMS, self.coefficients)), "intercept": self.intercept}
