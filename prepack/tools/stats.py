"""``prepack stats``: what a pack holds, from the stream indexes and summaries and the lineage (polars).

Why: packing is lossy by design (greedy fill, overflow buffer, drops) and weighted-random by
design (group mix); these numbers say whether the knobs did what was meant.  Fill ratio per
batch, group mix against the configured weights, samples and images per batch, how a batch's
tokens divide (text, ViT, VAE, CE and MSE loss tokens, images, flex padding: per batch and per
sample of each group, ``prepack.tools.composition``), drops by reason, how often each source row
was used, and per-stream throughput.  Counts come from the position arrays and image ids of each
shard (a projected read: the pixel table is not read), accumulated one stream at a time into value
counts, a fill histogram and fixed-size distributions: memory does not grow with the pack.  ``--html`` renders the same
tables with plots into one self-contained page (inline SVG).

The lineage is scanned lazily, never merged (``prepack.tools.lineage_queries``).
"""

from __future__ import annotations

import html as html_lib
import io
import logging
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import polars as pl

from loader.reader import Pack, read_shard
from prepack.tools.step_spread import cost_model as step_cost_model, pack_spread, syncs as step_syncs
from prepack.tools.composition import COLUMNS, BatchCounts, Composition, record_counts, table_lines
from prepack.tools.lineage_queries import ROW_KEY, chain_segments, scan_chain_lineage, scan_lineage
from schemas.manifest import StreamSummary
from schemas.pack_info import PackInfo

log = logging.getLogger(__name__)

FILL_BIN = 0.05


# -- numbers --------------------------------------------------------------------------------------
@dataclass
class PackStats:
    """Every table the report and the page show; all polars DataFrames."""

    title: str
    max_num_tokens: int
    totals: dict  # batches, tokens, samples, fill_mean, fill_min, fill_max
    per_batch: pl.DataFrame  # quantity (num_samples|images|vit_uses|vae_uses), value, batches
    fill_hist: pl.DataFrame  # lo, hi, batches
    group_mix: pl.DataFrame  # group, mandatory, weight, configured_share, samples, share
    drops: pl.DataFrame  # kind (drop|warning), reason, count
    row_use: pl.DataFrame  # uses, rows: how many source rows were packed that many times
    top_rows: pl.DataFrame  # the most used source rows
    streams: pl.DataFrame  # stream, rank, worker, records, tokens, samples, elapsed_s, tokens_per_s, records_per_s
    token_batch: pl.DataFrame  # quantity, min, p50, p90, max, mean, total, share (of the tokens) over batches
    token_group: pl.DataFrame  # group, quantity, samples, min, p50, p90, max, mean, total, share, over its samples
    # a continuation: each segment of the chain (oldest first), its records and its group mix side by side
    segments: pl.DataFrame = field(default_factory=pl.DataFrame)  # segment, pack, records, group, weight, samples, share
    # a schedule: each step (its first batch of every stream), its records and its group mix side by side
    steps: pl.DataFrame = field(default_factory=pl.DataFrame)  # step, from_batch, records, group, weight, samples, share


_PER_BATCH = ("num_samples", "images", "vit_uses", "vae_uses")


def _stream_records(pack: Pack, stream: int) -> Iterator[tuple[int, int, BatchCounts | None]]:
    """(tokens, samples, token composition) per record of ``stream``, from a projected read of
    each shard (``composition.COLUMNS``: position arrays and image ids, never the pixel table); a
    trimmed shard's records from its index row alone (no composition: None)."""
    trimmed = pack.trimmed(stream)
    for sh in pack.index(stream).shards:
        if sh.shard in trimmed and not pack.location.fs.get_file_info(pack.location.path(sh.file)).size:
            for r in sh.records:
                yield r.num_tokens, r.num_samples, None
            continue
        for (_, b), r in zip(read_shard(pack, sh, columns=list(COLUMNS)), sh.records):
            yield r.num_tokens, r.num_samples, record_counts(b)
    pack.forget(stream)


def _batch_tables(pack: Pack, max_tokens: int) -> tuple[dict, pl.DataFrame, pl.DataFrame, Composition]:
    """Totals, per-batch value counts, the fill histogram and the token composition, accumulated
    one stream at a time: memory is one stream's index plus counters, whatever the pack's size."""
    counts = {q: Counter() for q in _PER_BATCH}
    bins: Counter = Counter()
    composition = Composition()
    n = tokens = samples = trimmed = 0
    fill_sum, fill_min, fill_max = 0.0, float("inf"), 0.0
    for s in range(pack.num_streams):
        for toks, smp, c in _stream_records(pack, s):
            fill = toks / max(max_tokens, 1)
            n, tokens, samples, fill_sum = n + 1, tokens + toks, samples + smp, fill_sum + fill
            fill_min, fill_max = min(fill_min, fill), max(fill_max, fill)
            bins[int(fill / FILL_BIN)] += 1
            if c is None:  # a trimmed shard's record: its tokens and samples are in the index, no more
                trimmed += 1
                counts["num_samples"][smp] += 1
                continue
            composition.add(c)
            for q, v in zip(_PER_BATCH, (smp, c.batch["images"], c.batch["vit_images"], c.batch["vae_images"])):
                counts[q][v] += 1
    totals = {"batches": n, "tokens": tokens, "samples": samples, "fill_mean": fill_sum / n if n else 0.0,
              "fill_min": fill_min if n else 0.0, "fill_max": fill_max, "trimmed": trimmed}
    per_batch = pl.DataFrame([(q, v, c) for q in _PER_BATCH for v, c in sorted(counts[q].items())],
                             schema={"quantity": pl.String, "value": pl.Int64, "batches": pl.Int64}, orient="row")
    top = max(int(1.0 / FILL_BIN), max(bins, default=0) + 1)
    edges = np.round(np.arange(top + 1) * FILL_BIN, 6)
    fill_hist = pl.DataFrame({"lo": edges[:-1], "hi": edges[1:],
                              "batches": np.array([bins.get(i, 0) for i in range(top)], np.int64)})
    return totals, per_batch, fill_hist, composition


def _group_mix(info: PackInfo, lineage: pl.DataFrame, groups: list | None = None) -> pl.DataFrame:
    """Configured weights (``groups``: stored config groups; default the pack's) beside the samples packed."""
    groups = groups if groups is not None else (info.config or {}).get("groups") or []
    configured = pl.DataFrame(
        {"group": [g["name"] for g in groups], "mandatory": [bool(g.get("is_mandatory")) for g in groups],
         "weight": [float(g.get("weight", 0.0)) for g in groups]},
        schema={"group": pl.String, "mandatory": pl.Boolean, "weight": pl.Float64},
    ).with_columns((pl.col("weight") / pl.col("weight").sum()).alias("configured_share"))
    achieved = lineage
    return (configured.join(achieved, on="group", how="full", coalesce=True)
            .with_columns(pl.col("samples").fill_null(0))
            .with_columns((pl.col("samples") / pl.col("samples").sum()).alias("share"))
            .sort("group"))


def _segments(pack: Pack) -> pl.DataFrame:
    """A continuation's chain, oldest segment first: per segment, the records a reader takes from it
    and its group mix (configured weight, samples packed in those records).  Empty for a pack of
    its own."""
    if pack.parent is None:
        return pl.DataFrame()
    segments = chain_segments(pack)
    counts = scan_chain_lineage(pack).group_by("segment", "group").agg(pl.len().cast(pl.Int64).alias("samples")).collect()
    rows = []
    for i, seg in enumerate(segments):
        mix = _group_mix(seg.pack.info, counts.filter(pl.col("segment") == i).drop("segment"))
        for group, _, weight, _, samples, share in mix.iter_rows():
            rows.append((i, seg.pack.location.base, seg.records, group, weight, samples, share))
    return pl.DataFrame(rows, schema={"segment": pl.Int32, "pack": pl.String, "records": pl.Int64, "group": pl.String,
                                      "weight": pl.Float64, "samples": pl.Int64, "share": pl.Float64}, orient="row")


def _steps(pack: Pack) -> pl.DataFrame:
    """A pack with a schedule (``prepack.schedule``): per step, the records of every stream it packed and
    its group mix (the step's weights, samples packed in those records).  Empty without a schedule."""
    steps = (pack.info.config or {}).get("schedule") or []
    if not steps:
        return pl.DataFrame()
    starts = [0] + [int(st["after"]) for st in steps]
    configs = [pack.info.config] + [st["config"] for st in steps]
    step = pl.sum_horizontal([(pl.col("record") >= a).cast(pl.Int32) for a in starts[1:]]).alias("step")
    counts = (scan_lineage(pack.location).with_columns(step).group_by("step", "group")
              .agg(pl.len().cast(pl.Int64).alias("samples")).collect())
    n = [pack.index(s).num_records for s in range(pack.num_streams)]
    rows = []
    for i, (start, cfg) in enumerate(zip(starts, configs)):
        end = starts[i + 1] if i + 1 < len(starts) else None
        records = sum(max(0, (k if end is None else min(k, end)) - start) for k in n)
        mix = _group_mix(pack.info, counts.filter(pl.col("step") == i).drop("step"), cfg.get("groups") or [])
        for group, _, weight, _, samples, share in mix.iter_rows():
            rows.append((i, start, records, group, weight, samples, share))
    return pl.DataFrame(rows, schema={"step": pl.Int32, "from_batch": pl.Int64, "records": pl.Int64, "group": pl.String,
                                      "weight": pl.Float64, "samples": pl.Int64, "share": pl.Float64}, orient="row")


def _drops(summaries: list[StreamSummary]) -> pl.DataFrame:
    rows: dict[tuple[str, str], int] = {}
    for s in summaries:
        for kind, d in (("drop", s.drops), ("warning", s.warnings)):
            for reason, n in d.items():
                rows[(kind, reason)] = rows.get((kind, reason), 0) + int(n)
    return pl.DataFrame([(k, r, n) for (k, r), n in sorted(rows.items())],
                        schema={"kind": pl.String, "reason": pl.String, "count": pl.Int64}, orient="row")


def _streams(summaries: list[StreamSummary]) -> pl.DataFrame:
    df = pl.DataFrame(
        [(s.stream, s.rank, s.worker, s.num_records, s.num_tokens, s.num_samples, float(s.elapsed_s)) for s in summaries],
        schema={"stream": pl.Int32, "rank": pl.Int32, "worker": pl.Int32, "records": pl.Int64, "tokens": pl.Int64,
                "samples": pl.Int64, "elapsed_s": pl.Float64}, orient="row",
    )
    per_s = pl.when(pl.col("elapsed_s") > 0)
    return df.with_columns(per_s.then(pl.col("tokens") / pl.col("elapsed_s")).alias("tokens_per_s"),
                           per_s.then(pl.col("records") / pl.col("elapsed_s")).alias("records_per_s"))


_DISTRIBUTION = {"min": pl.Int64, "p50": pl.Int64, "p90": pl.Int64, "max": pl.Int64, "mean": pl.Float64,
                 "total": pl.Int64, "share": pl.Float64}


def compute_stats(out) -> PackStats:
    """All statistics of a pack's committed records (indexes, done.json, lineage, projected shard reads)."""
    pack = Pack.open(out)
    loc = pack.location
    max_tokens = pack.info.max_num_tokens or 0
    summaries = [d for d in (pack.done(s) for s in range(pack.num_streams)) if d is not None]
    lazy = scan_lineage(loc)
    groups = lazy.group_by("group").agg(pl.len().cast(pl.Int64).alias("samples")).collect()
    totals, per_batch, fill_hist, composition = _batch_tables(pack, max_tokens)
    per_row = lazy.group_by("group", *ROW_KEY).agg(pl.len().cast(pl.Int64).alias("uses")).collect()
    return PackStats(
        title=f"pack {loc.base}",
        max_num_tokens=max_tokens,
        totals=totals,
        per_batch=per_batch,
        fill_hist=fill_hist,
        group_mix=_group_mix(pack.info, groups),
        drops=_drops(summaries),
        row_use=per_row.group_by("uses").agg(pl.len().cast(pl.Int64).alias("rows")).sort("uses"),
        top_rows=per_row.sort(["uses", *ROW_KEY], descending=[True, False, False, False]).head(10),
        streams=_streams(summaries),
        token_batch=pl.DataFrame(composition.batch_rows(), schema={"quantity": pl.String, **_DISTRIBUTION}),
        token_group=pl.DataFrame(composition.group_rows(),
                                 schema={"group": pl.String, "quantity": pl.String, "samples": pl.Int64, **_DISTRIBUTION}),
        segments=_segments(pack),
        steps=_steps(pack),
    )


# -- text -----------------------------------------------------------------------------------------
def _cell(v) -> str:
    if isinstance(v, float):
        return "-" if v != v else f"{v:,.3f}".rstrip("0").rstrip(".")
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return "-" if v is None else str(v)


def text_table(df: pl.DataFrame, indent: str = "  ") -> list[str]:
    """A DataFrame as aligned plain-text lines (numbers right-aligned)."""
    cells = [[_cell(v) for v in row] for row in df.iter_rows()]
    widths = [max([len(c)] + [len(r[j]) for r in cells]) for j, c in enumerate(df.columns)]
    numeric = [dt.is_numeric() for dt in df.dtypes]
    fmt = lambda row: indent + "  ".join(c.rjust(w) if n else c.ljust(w) for c, w, n in zip(row, widths, numeric))  # noqa: E731
    return [fmt(df.columns).rstrip()] + [fmt(r).rstrip() for r in cells]


def _summary(st: PackStats, quantity: str) -> str:
    d = st.per_batch.filter(pl.col("quantity") == quantity)
    values, counts = d["value"].to_numpy(), d["batches"].to_numpy()
    if not counts.sum():
        return "-"
    median = values[np.searchsorted(np.cumsum(counts), (counts.sum() + 1) / 2)]
    return (f"mean {float((values * counts).sum() / counts.sum()):.2f}, min {values.min()}, median {median}, "
            f"max {values.max()}")


def format_stats(st: PackStats) -> str:
    t = st.totals
    lines = [
        f"{st.title}: {st.streams.height} streams, {t['batches']:,} batches, {t['tokens']:,} tokens, "
        f"{t['samples']:,} samples, max_num_tokens {st.max_num_tokens:,}",
        "",
        f"fill ratio (sequence length / max_num_tokens): mean {t['fill_mean']:.3f}, min {t['fill_min']:.3f}, "
        f"max {t['fill_max']:.3f}",
    ]
    peak = max(int(st.fill_hist["batches"].max() or 0), 1)
    for lo, hi, n in st.fill_hist.filter(pl.col("batches") > 0).iter_rows():
        lines.append(f"  {lo:.2f}-{hi:.2f}  {'#' * max(1, round(30 * n / peak)):<30} {n}")
    lines += ["", "group mix (samples packed vs configured weights):"]
    lines += text_table(st.group_mix.select(
        "group", "mandatory", "weight", (pl.col("configured_share") * 100).round(1).alias("configured %"),
        "samples", (pl.col("share") * 100).round(1).alias("achieved %")))
    if st.segments.height:
        lines += ["", "a continuation: each segment's mix (records a reader takes from it; samples in them):"]
        lines += text_table(st.segments.with_columns((pl.col("share") * 100).round(1).alias("share %"))
                            .drop("share"))
    if st.steps.height:
        lines += ["", "a schedule (prepack.schedule): each step's mix (the records it packed; samples in them):"]
        lines += text_table(st.steps.with_columns((pl.col("share") * 100).round(1).alias("share %")).drop("share"))
    if t.get("trimmed"):
        lines += ["", f"trimmed: {t['trimmed']:,} batches' records files were trimmed (prepack trim): their tokens, "
                  "samples and lineage count above; their images and token kinds do not"]
    lines += ["", f"samples per batch: {_summary(st, 'num_samples')}",
              f"images per batch:  stored {_summary(st, 'images')}",
              f"                   ViT uses {_summary(st, 'vit_uses')}; VAE uses {_summary(st, 'vae_uses')}", ""]
    lines += table_lines(t["batches"], st.token_batch.to_dicts(), st.token_group.to_dicts()) + [""]
    if st.drops.height:
        lines.append("drops and damaged-input warnings by reason:")
        lines += text_table(st.drops)
    else:
        lines.append("drops: none")
    distinct = int(st.row_use["rows"].sum() or 0)
    lines += ["", f"source row reuse: {distinct:,} distinct rows packed"]
    lines += text_table(st.row_use)
    if st.row_use.height and int(st.row_use["uses"].max()) > 1:
        lines += ["  most used rows:"] + text_table(st.top_rows, indent="    ")
    lines += ["", "streams:"] + text_table(st.streams.with_columns(pl.col("tokens_per_s", "records_per_s").round(1)))
    return "\n".join(lines)


# -- html -----------------------------------------------------------------------------------------
def _svg(fig) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None})
    text = buf.getvalue()
    return text[text.index("<svg"):]


def _figure(width: float = 6.4, height: float = 3.2):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)  # no pyplot, no global backend
    return fig, fig.add_subplot()


def _style(ax, title: str, xlabel: str, ylabel: str, integer_x: bool = False) -> None:
    from matplotlib.ticker import MaxNLocator

    if integer_x:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=ylabel in ("batches", "rows")))
    ax.set_title(title, fontsize=11, loc="left")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def _plots(st: PackStats) -> list[str]:
    svgs = []
    fig, ax = _figure()
    h = st.fill_hist
    ax.bar(h["lo"].to_numpy(), h["batches"].to_numpy(), width=FILL_BIN, align="edge", color="#4C72B0", edgecolor="white")
    ax.axvline(float(st.totals["fill_mean"]), color="#C44E52", ls="--", label="mean")
    ax.legend(frameon=False)
    _style(ax, "Fill ratio per batch", "sequence length / max_num_tokens", "batches")
    svgs.append(_svg(fig))

    fig, ax = _figure()
    g = st.group_mix
    x = np.arange(g.height)
    ax.bar(x - 0.2, g["configured_share"].fill_null(0).to_numpy(), 0.4, label="configured weight", color="#BBBBBB")
    ax.bar(x + 0.2, g["share"].to_numpy(), 0.4, label="achieved (samples)", color="#55A868")
    ax.set_xticks(x, [f"{n}{' (mandatory)' if m else ''}" for n, m in zip(g["group"], g["mandatory"].fill_null(False))])
    ax.legend(frameon=False)
    _style(ax, "Group mix", "", "share")
    svgs.append(_svg(fig))

    fig = _figure(9.6, 3.2)[0]
    fig.clear()
    axes = fig.subplots(1, 3)
    for ax, col, color, label in zip(axes, ("num_samples", "images", "vae_uses"), ("#4C72B0", "#DD8452", "#55A868"),
                                     ("samples", "stored images", "VAE image uses")):
        d = st.per_batch.filter(pl.col("quantity") == col)
        ax.bar(d["value"].to_numpy(), d["batches"].to_numpy(), width=0.8, color=color, edgecolor="white")
        _style(ax, f"{label} per batch", label, "batches", integer_x=True)
    svgs.append(_svg(fig))

    svgs.append(_mix_plot(st))

    fig, ax = _figure()
    uses = st.row_use["uses"].to_numpy()
    ax.bar(uses, st.row_use["rows"].to_numpy(), width=0.8, color="#8172B3", edgecolor="white")
    ax.set_xlim(0.4, max(uses.max(initial=1), 3) + 0.6)
    _style(ax, "Source row reuse", "times a row was packed", "rows", integer_x=True)
    svgs.append(_svg(fig))

    fig, ax = _figure()
    s = st.streams
    ax.bar(s["stream"].to_numpy(), s["tokens_per_s"].fill_null(0).to_numpy(), color="#DD8452")
    _style(ax, "Throughput per stream", "stream", "tokens / s", integer_x=True)
    svgs.append(_svg(fig))

    if st.drops.height:
        fig, ax = _figure(6.4, 0.6 + 0.35 * st.drops.height)
        d = st.drops
        ax.barh([f"{k}: {r}" for k, r in zip(d["kind"], d["reason"])], d["count"].to_numpy(),
                color=["#C44E52" if k == "drop" else "#CCB974" for k in d["kind"]])
        ax.invert_yaxis()
        _style(ax, "Drops (red) and warnings (yellow)", "count", "")
        svgs.append(_svg(fig))
    return svgs


_KIND_COLORS = {"text tokens": "#4C72B0", "ViT tokens": "#DD8452", "VAE tokens": "#55A868", "flex padding": "#D9D9D9"}


def _mix_plot(st: PackStats) -> str:
    """Stacked shares of text / ViT / VAE tokens (and padding) over all batches and per group."""
    fig, ax = _figure(6.4, 1.2 + 0.4 * (1 + st.token_group["group"].n_unique()))
    batch = dict(st.token_batch.select("quantity", "total").iter_rows())
    bars = [("all batches", {k: batch.get(k, 0) for k in _KIND_COLORS})]
    for (g,), d in st.token_group.partition_by("group", as_dict=True).items():
        totals = dict(d.select("quantity", "total").iter_rows())
        bars.append((g, {k: totals.get(k, 0) for k in _KIND_COLORS}))
    for y, (name, parts) in enumerate(bars):
        whole, left = sum(parts.values()) or 1, 0.0
        for kind, color in _KIND_COLORS.items():
            share = parts[kind] / whole
            ax.barh(y, share, left=left, color=color, label=kind if y == 0 else None)
            left += share
    ax.set_yticks(range(len(bars)), [b[0] for b in bars])
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.legend(frameon=False, fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    _style(ax, "Token mix (share of positions)", "share", "")
    return _svg(fig)


def _html_table(df: pl.DataFrame) -> str:
    head = "".join(f"<th>{html_lib.escape(c)}</th>" for c in df.columns)
    body = "".join("<tr>" + "".join(f"<td>{html_lib.escape(_cell(v))}</td>" for v in row) + "</tr>" for row in df.iter_rows())
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


_CSS = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}
h1{font-size:1.4em}h2{font-size:1.1em;margin-top:1.6em}pre{background:#f6f6f6;padding:1em;overflow-x:auto}
table{border-collapse:collapse;font-size:.9em}td,th{padding:.2em .8em;border-bottom:1px solid #ddd;text-align:right}
th{background:#f0f0f0}td:first-child,th:first-child{text-align:left}.plots{display:flex;flex-wrap:wrap;gap:1em}.plots svg{max-width:100%;height:auto}"""


def _percent(df: pl.DataFrame) -> pl.DataFrame:
    """A token-composition table for the page: mean to one decimal, share as a percentage."""
    return df.with_columns(pl.col("mean").round(1), (pl.col("share") * 100).round(1).alias("share %")).drop("share")


def render_html(st: PackStats) -> str:
    """One self-contained page: summary text, plots as inline SVG, tables."""
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html_lib.escape(st.title)}</title>",
             f"<style>{_CSS}</style></head><body><h1>{html_lib.escape(st.title)}</h1>",
             f"<pre>{html_lib.escape(format_stats(st))}</pre>", "<div class='plots'>", *_plots(st), "</div>"]
    for name, df in (("Group mix", st.group_mix),
                     ("Token composition per batch", _percent(st.token_batch)),
                     ("Token composition per sample, by group", _percent(st.token_group)),
                     ("Drops and warnings", st.drops), ("Source row reuse", st.row_use),
                     ("Most used source rows", st.top_rows), ("Streams", st.streams),
                     ("Per batch (value counts)", st.per_batch)):
        parts.append(f"<h2>{name}</h2>{_html_table(df) if df.height else '<p>none</p>'}")
    parts.append("</body></html>")
    return "\n".join(parts)


def pack_stats(out, html: str | None = None, steps: "tuple[int | None, int]" = (None, 1),
               cost_model: "str | None" = None, sync: "str | None" = None) -> str:
    """The plain-text report; with ``html``, also write the page there; ``steps``: the world size (None:
    the pack's) and micro-batches per step its step spread is weighed for (``prepack.tools.step_spread``),
    by the model in the file ``cost_model`` (None: the pack's), by the step model ``sync`` (None: both)."""
    st = compute_stats(out)
    spreads = pack_spread(out, *steps, model=step_cost_model(cost_model), syncs=step_syncs(sync))
    text = format_stats(st) + "\n\n" + "\n".join(line for s in spreads for line in s.lines())
    if html:
        with open(os.fspath(html), "w", encoding="utf-8") as f:
            f.write(render_html(st))
        text += f"\n\npage written to {html}"
    return text
