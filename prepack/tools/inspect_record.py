"""``prepack inspect``: explain one packed batch to a person, in text and as a picture.

Why: a packed record is a bag of index arrays; whether the layout is right (where each sample,
image and loss token sits, which split attends to what) is only visible when it is drawn out.
The text lists samples with their source rows, tokens per modality, splits with attention modes,
loss tokens and weights, timesteps per VAE image and each text split decoded by the pack's
tokenizer.  The PNG shows the token layout along the sequence, one sample's attention mask (the
reference's ``prepare_attention_mask_per_sample`` rules) and that sample's images.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from loader.reader import Pack, read_shard
from schemas.errors import UsageError
from schemas.manifest import ShardEntry
from schemas.pack_info import PackInfo
from schemas.packed_batch import PackedBatch, SampleOrigin
from schemas.record import record_digest, record_to_batch

log = logging.getLogger(__name__)

TEXT, VIT, VAE, PAD = 0, 1, 2, 3
KIND_NAMES = ("text", "ViT", "VAE", "padding")
KIND_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#D9D9D9")
CE_COLOR, MSE_COLOR = "#C44E52", "#8172B3"
_TEXT_CHARS = 240
_MASK_PIXELS = 640
_MAX_THUMBS = 8


# -- facts ----------------------------------------------------------------------------------------
@dataclass
class ImageUse:
    """One use of a stored image: as ViT patches or VAE latents at ``positions``."""

    kind: int  # VIT | VAE
    image: int  # index into the record's image table
    positions: np.ndarray
    latent: tuple[int, int] | None = None  # VAE (h, w) in latent slots
    timestep: float | None = None  # VAE: the flow-matching timestep; -inf for a condition

    @property
    def is_target(self) -> bool:
        return self.kind == VAE and self.timestep is not None and np.isfinite(self.timestep)


@dataclass
class SplitFacts:
    index: int  # within the sample
    start: int  # absolute position
    length: int
    mode: str
    counts: list[int]  # tokens per kind (text, ViT, VAE)
    ce: int
    mse: int
    text_ids: list[int]
    images: list[ImageUse] = field(default_factory=list)


@dataclass
class SampleFacts:
    index: int
    start: int
    length: int
    origin: SampleOrigin
    counts: list[int]
    ce: int
    ce_weight: float
    mse: int
    splits: list[SplitFacts]
    images: list[ImageUse]


def image_uses(batch: PackedBatch) -> list[ImageUse]:
    """Every ViT and VAE image use in sequence order of their first token."""
    uses = []
    pos = batch.packed_vit_token_indexes
    cum = np.concatenate([[0], np.cumsum(batch.vit_token_seqlens)]).astype(np.int64)
    for k, img in enumerate(batch.vit_image_ids.tolist()):
        uses.append(ImageUse(VIT, img, pos[cum[k] : cum[k + 1]]))
    shapes = batch.vae_latent_shapes.reshape(-1, 2)
    cum = np.concatenate([[0], np.cumsum(shapes[:, 0] * shapes[:, 1])]).astype(np.int64)
    for k, img in enumerate(batch.vae_image_ids.tolist()):
        a, b = cum[k], cum[k + 1]
        t = float(batch.packed_timesteps[a]) if b > a else None
        uses.append(ImageUse(VAE, img, batch.packed_vae_token_indexes[a:b], tuple(shapes[k].tolist()), t))
    return sorted(uses, key=lambda u: int(u.positions[0]) if len(u.positions) else -1)


def token_kinds(batch: PackedBatch) -> np.ndarray:
    """Kind of every position up to ``max_num_tokens`` (flex) or ``sequence_length``."""
    total = max(int(batch.sequence_length), int(batch.max_num_tokens) if batch.use_flex else 0)
    kinds = np.full(total, PAD, np.int8)
    kinds[batch.packed_text_indexes] = TEXT
    kinds[batch.packed_vit_token_indexes] = VIT
    kinds[batch.packed_vae_token_indexes] = VAE
    return kinds


def _count(mask_positions: np.ndarray, a: int, b: int) -> int:
    return int(np.count_nonzero((mask_positions >= a) & (mask_positions < b)))


def sample_facts(batch: PackedBatch) -> list[SampleFacts]:
    """Per sample: its place, origin, tokens per modality, loss tokens, splits and images."""
    kinds = token_kinds(batch)
    text_at = np.full(len(kinds), -1, np.int64)
    text_at[batch.packed_text_indexes] = batch.packed_text_ids
    ce, mse, w = batch.ce_loss_indexes, batch.mse_loss_indexes, batch.ce_loss_weights
    uses = image_uses(batch)
    out, start = [], 0
    for i, ((lens, modes), n) in enumerate(zip(batch.sample_splits(), batch.sample_lens.tolist())):
        splits, s0 = [], start
        for j, (length, mode) in enumerate(zip(lens, modes)):
            a, b = s0, s0 + length
            seg = kinds[a:b]
            ids = text_at[a:b][seg == TEXT]
            splits.append(SplitFacts(
                j, a, length, mode, [int(np.count_nonzero(seg == k)) for k in (TEXT, VIT, VAE)],
                _count(ce, a, b), _count(mse, a, b), ids.tolist(),
                [u for u in uses if len(u.positions) and a <= int(u.positions[0]) < b],
            ))
            s0 = b
        sel = (ce >= start) & (ce < start + n)
        seg = kinds[start : start + n]
        out.append(SampleFacts(
            i, start, n, batch.origins[i] if i < len(batch.origins) else None,
            [int(np.count_nonzero(seg == k)) for k in (TEXT, VIT, VAE)],
            int(np.count_nonzero(sel)), float(w[sel].sum()), _count(mse, start, start + n), splits,
            [u for sp in splits for u in sp.images],
        ))
        start += n
    return out


def attention_mask(split_lens: list[int], modes: list[str], positions: np.ndarray | None = None) -> np.ndarray:
    """Boolean mask (True = may attend) of one sample, by the reference's rules.

    A query sees every key of earlier splits and, in its own split, the keys up to itself
    (``causal``) or all of them (``full``/``noise``); keys of a ``noise`` split are seen only from
    inside that split.  ``positions`` (sample-local) picks the rows/columns to compute, so a
    16k-token sample can be drawn at screen resolution without building 16k x 16k.
    """
    lens = np.asarray(split_lens, np.int64)
    split_of = np.repeat(np.arange(len(lens)), lens)
    pos = np.arange(len(split_of)) if positions is None else np.asarray(positions, np.int64)
    s = split_of[pos]
    causal = np.array([m == "causal" for m in modes])[s]
    noise = np.array([m == "noise" for m in modes])[s]
    q_split, k_split = s[:, None], s[None, :]
    same = q_split == k_split
    own = same & (~causal[:, None] | (pos[None, :] <= pos[:, None]))
    earlier = (k_split < q_split) & ~noise[None, :]
    return own | earlier


# -- text -----------------------------------------------------------------------------------------
def _short(text: str, limit: int = _TEXT_CHARS) -> str:
    text = text.replace("\n", "\\n")
    return text if len(text) <= limit else f"{text[:limit]}... (+{len(text) - limit} chars)"


def _origin_line(o: SampleOrigin | None) -> str:
    if o is None:
        return "from   (no origin recorded)"
    where = f"row {o.source_row}" if o.source_row_group < 0 else f"row group {o.source_row_group}, row {o.source_row}"
    idx = o.data_indexes[0] if o.scalar else list(o.data_indexes)
    return f"from   {o.source_file}  {where}  data_indexes {idx}  worker {o.worker_id}"


def _image_text(batch: PackedBatch, u: ImageUse) -> str:
    h, w = int(batch.image_heights[u.image]), int(batch.image_widths[u.image])
    if u.kind == VIT:
        return f"image #{u.image} {w}x{h} as {len(u.positions)} ViT patches"
    role = f"noised target, timestep {u.timestep:.4f}" if u.is_target else "condition (timestep -inf)"
    return f"image #{u.image} {w}x{h} -> latent {u.latent[1]}x{u.latent[0]}, {role}"


def describe(batch: PackedBatch, tokenizer=None, title: str = "") -> str:
    """The readable account of one packed batch (see module doc)."""
    facts = sample_facts(batch)
    kinds = token_kinds(batch)
    totals = [int(np.count_nonzero(kinds == k)) for k in (TEXT, VIT, VAE, PAD)]
    uses = image_uses(batch)
    n_vit = sum(u.kind == VIT for u in uses)
    n_target = sum(u.is_target for u in uses)
    lines = [title] if title else []
    lines += [
        f"{batch.sequence_length:,} of {batch.max_num_tokens:,} tokens ({batch.sequence_length / max(batch.max_num_tokens, 1):.1%}), "
        f"{'flex' if batch.use_flex else 'dense-mask'} attention, {batch.num_samples} samples, "
        f"{len(batch.image_heights)} images stored ({n_vit} ViT uses, {len(uses) - n_vit} VAE uses)",
        "tokens " + "  ".join(f"{KIND_NAMES[k]} {totals[k]:,}" for k in range(4)),
        f"loss   CE {len(batch.ce_loss_indexes):,} tokens (weights sum {float(batch.ce_loss_weights.sum()):.3f})  "
        f"MSE {len(batch.mse_loss_indexes):,} latent tokens ({n_target} noised images)",
    ]
    for f in facts:
        o = f.origin
        lines += [
            "",
            f"sample {f.index}  {o.group if o else '?'} / {o.dataset if o else '?'}  positions {f.start}-{f.start + f.length - 1} "
            f"({f.length} tokens)  text {f.counts[0]}  ViT {f.counts[1]}  VAE {f.counts[2]}",
            f"  {_origin_line(o)}",
            f"  loss   CE {f.ce} tokens (weights sum {f.ce_weight:.3f})  MSE {f.mse}",
        ]
        for sp in f.splits:
            what = "  ".join(f"{KIND_NAMES[k]} {c}" for k, c in enumerate(sp.counts) if c)
            loss = "".join([f"  CE {sp.ce}" if sp.ce else "", f"  MSE {sp.mse}" if sp.mse else ""])
            lines.append(f"  split {sp.index}  {sp.mode:<6} {sp.start}-{sp.start + sp.length - 1}  {what}{loss}")
            for u in sp.images:
                lines.append(f"      {_image_text(batch, u)}")
            if sp.counts[0] and not sp.images:
                text = tokenizer.decode(sp.text_ids, skip_special_tokens=False) if tokenizer is not None else \
                    f"ids {sp.text_ids[:16]}{'...' if len(sp.text_ids) > 16 else ''}"
                lines.append(f"      {_short(text) if tokenizer is not None else text}")
    return "\n".join(lines)


# -- picture --------------------------------------------------------------------------------------
def _runs(values: np.ndarray) -> list[tuple[int, int, int]]:
    """(start, length, value) of each run of equal values."""
    if not len(values):
        return []
    edges = np.flatnonzero(np.diff(values)) + 1
    starts = np.concatenate([[0], edges])
    ends = np.concatenate([edges, [len(values)]])
    return [(int(a), int(b - a), int(values[a])) for a, b in zip(starts, ends)]


def pick_sample(facts: list[SampleFacts]) -> int:
    """The sample whose mask is most telling: most distinct attention modes, then most splits."""
    return max(range(len(facts)), key=lambda i: (len({s.mode for s in facts[i].splits}), len(facts[i].splits), -i))


def _draw_layout(ax, batch: PackedBatch, facts: list[SampleFacts], chosen: int) -> None:
    kinds = token_kinds(batch)
    for k in (TEXT, VIT, VAE, PAD):
        bars = [(a, n) for a, n, v in _runs(kinds) if v == k]
        ax.broken_barh(bars, (1.0, 1.0), facecolors=KIND_COLORS[k], label=KIND_NAMES[k])
    loss = np.zeros(len(kinds), np.int8)
    loss[batch.mse_loss_indexes] = 2
    loss[batch.ce_loss_indexes] = 1
    for v, color, name in ((1, CE_COLOR, "CE loss"), (2, MSE_COLOR, "MSE loss")):
        bars = [(a, max(n, len(kinds) / 1500)) for a, n, x in _runs(loss) if x == v]
        ax.broken_barh(bars, (0.25, 0.5), facecolors=color, label=name)
    for f in facts:
        ax.axvline(f.start, color="black", lw=1.2)
        if f.length < len(kinds) / 60 and f.index != chosen:
            continue
        label = f"s{f.index}" + (f" {f.origin.group.split('_')[0]}" if f.origin else "")
        ax.text(f.start + f.length / 2, 2.15, label, ha="center", va="bottom", fontsize=8,
                fontweight="bold" if f.index == chosen else "normal", clip_on=True)
    ax.axvline(batch.sequence_length, color="black", lw=1.2, ls="--")
    ax.set_xlim(0, len(kinds))
    ax.set_ylim(0, 2.8)
    ax.set_yticks([0.5, 1.5], ["loss", "tokens"])
    ax.set_xlabel("position in the packed sequence")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=6, frameon=False, fontsize=9)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)


def _draw_mask(ax, f: SampleFacts) -> None:
    from matplotlib.colors import ListedColormap

    lens = [s.length for s in f.splits]
    modes = [s.mode for s in f.splits]
    n = f.length
    pos = np.unique(np.linspace(0, n - 1, min(n, _MASK_PIXELS)).round().astype(np.int64))
    mask = attention_mask(lens, modes, pos)
    ax.imshow(mask, cmap=ListedColormap(["#F4F4F4", "#2F4B7C"]), interpolation="nearest",
              extent=(0, n, n, 0), vmin=0, vmax=1)
    bounds = np.cumsum([0] + lens)
    for b in bounds[1:-1]:
        ax.axhline(b, color="#E15759", lw=0.6)
        ax.axvline(b, color="#E15759", lw=0.6)
    mids = (bounds[:-1] + bounds[1:]) / 2
    shown = [i for i, s in enumerate(f.splits) if s.length >= n / 40] or [int(np.argmax(lens))]
    ax.xaxis.tick_top()
    ax.set_xticks(mids[shown], [f"{KIND_NAMES[_main_kind(f.splits[i])]}\n{modes[i]}" for i in shown], fontsize=8)
    for i, tick in zip(shown, ax.xaxis.get_major_ticks()):
        tick.label2.set_color(KIND_COLORS[_main_kind(f.splits[i])])
        tick.label2.set_fontweight("bold")
    ax.set_title(f"attention mask of sample {f.index} ({n} tokens, {len(lens)} splits; dark = may attend)",
                 fontsize=10)
    ax.set_ylabel("query position (sample-local)")
    ax.set_xlabel("key position")


def _main_kind(split: SplitFacts) -> int:
    return int(np.argmax(split.counts))


def _draw_thumbs(fig, spec, batch: PackedBatch, f: SampleFacts) -> None:
    uses = f.images[:_MAX_THUMBS] or image_uses(batch)[:_MAX_THUMBS]
    if not uses:
        ax = fig.add_subplot(spec)
        ax.text(0.5, 0.5, "no images", ha="center", va="center", color="grey")
        ax.axis("off")
        return
    cols = int(np.ceil(np.sqrt(len(uses))))
    rows = -(-len(uses) // cols)
    grid = spec.subgridspec(rows, cols, wspace=0.08, hspace=0.35)
    for i, u in enumerate(uses):
        ax = fig.add_subplot(grid[i // cols, i % cols])
        ax.imshow(batch.image(u.image))
        h, w = int(batch.image_heights[u.image]), int(batch.image_widths[u.image])
        role = "ViT" if u.kind == VIT else (f"VAE t={u.timestep:.2f}" if u.is_target else "VAE cond")
        ax.set_title(f"#{u.image} {role}\n{w}x{h}", fontsize=8, color=KIND_COLORS[u.kind])
        ax.set_xticks([])
        ax.set_yticks([])
        for s in ax.spines.values():
            s.set_edgecolor(KIND_COLORS[u.kind])
            s.set_linewidth(2)


def render_png(batch: PackedBatch, path: str, title: str = "", sample: int | None = None) -> int:
    """Draw the layout, one sample's mask and its images to ``path``; returns the sample drawn."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    facts = sample_facts(batch)
    chosen = pick_sample(facts) if sample is None else sample
    fig = Figure(figsize=(15, 9.5), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)  # explicit Agg canvas: no pyplot, no global backend switch
    outer = fig.add_gridspec(2, 2, height_ratios=[1, 3.2], width_ratios=[1.05, 1])
    _draw_layout(fig.add_subplot(outer[0, :]), batch, facts, chosen)
    _draw_mask(fig.add_subplot(outer[1, 0]), facts[chosen])
    _draw_thumbs(fig, outer[1, 1], batch, facts[chosen])
    fig.suptitle(title or "packed batch", fontsize=12, fontweight="bold")
    fig.savefig(path, format="png")
    return chosen


# -- command --------------------------------------------------------------------------------------
def _load_tokenizer(info: PackInfo):
    spec = (info.config or {}).get("tokenizer")
    if spec is None:
        return None
    # here, not at the top: transformers (seconds), only for a pack that names its tokenizer
    from prepack.engine.tokenizer import load_tokenizer, special_token_ids

    try:
        return special_token_ids(load_tokenizer(spec))[0]
    except (OSError, ValueError, TypeError) as e:
        log.warning("tokenizer %r unavailable (%s): text is shown as token ids", spec, e)
        return None


def read_record(out, stream: int, record: int) -> tuple[ShardEntry, int, pa.RecordBatch, dict]:
    """One committed record: (its shard entry, index in the shard, the record, the pack's pack.json)."""
    pack = Pack.open(out)
    pack.check_stream(stream)
    index = pack.index(stream)
    if not 0 <= record < index.num_records:
        raise UsageError(f"stream {stream} has no record {record} ({index.num_records} committed)")
    shard = next(sh for sh in index.shards if record < sh.first_record + len(sh.records))
    i = record - shard.first_record
    return shard, i, next(read_shard(pack, shard, i, verify=False))[1], pack.info


def inspect_record(out, *, stream: int, record: int, png: str | None = None, tokenizer=None) -> str:
    """Text account of record ``record`` of ``stream``; with ``png``, also the picture."""
    shard, i, rec, info = read_record(out, stream, record)
    digest = record_digest(rec)
    check = "matches the stream index" if digest == shard.records[i].digest else "DIFFERS from the stream index (run verify)"
    batch = record_to_batch(rec)
    title = f"stream {stream}, record {record}: {shard.file} #{i}, digest {digest[:12]}.. {check}"
    text = describe(batch, tokenizer if tokenizer is not None else _load_tokenizer(info), title)
    if png:
        chosen = render_png(batch, os.fspath(png), f"stream {stream}, record {record} ({shard.file} #{i})")
        text += f"\n\npicture written to {png} (attention mask of sample {chosen})"
    return text
