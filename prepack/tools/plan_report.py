"""What ``prepack plan`` reports: the projected run (``PackPlan``, a ``GroupPlan`` per group) as JSON
and as the lines it prints.  The sampling and the projection are ``prepack.tools.plan``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from prepack.tools.composition import Composition


@dataclass
class GroupPlan:
    name: str
    token_share: float  # of the packed tokens in the sample
    drop_rate: float  # rows the source dropped / rows it read
    rows_per_batch: float  # rows the source consumed per batch (packed or dropped)
    rows_per_pass: int  # rows in one stream's slice of this group's data (estimated from footers for parquet)
    passes: float  # how many times a stream reads its slice under the budget

    def to_json(self) -> dict:
        return {k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in dataclasses.asdict(self).items()}


@dataclass
class PackPlan:
    config: str
    streams: int
    cores: int
    budget: dict
    batches_per_stream: float
    records: int
    tokens: int
    output_bytes: int
    shards_per_stream: int
    shard_bytes: int  # a full shard's size (the last one of a stream is smaller)
    record_bytes: float
    cpu_core_hours: float
    wall_hours: float
    groups: list[GroupPlan]
    packer_drop_rate: float  # samples the packer discarded (over-long, no fit) per sample read
    fill: float  # tokens per batch / max_num_tokens
    warnings: list[str]
    sample: dict = field(default_factory=dict)
    composition: Composition = field(default_factory=Composition, repr=False)  # of the sampled batches
    batch_terms: list = field(default_factory=list, repr=False)  # each sampled batch's compute terms (step spread)
    reuse: dict = field(default_factory=dict)  # with --reuse: the packs, the sampled images and those found there
    # with --continue: the pack continued, the switch, and where each group's data stands there (the
    # sampled streams' mean: completed passes + the share of the pass read), from which NEW goes on
    continues: dict = field(default_factory=dict)
    # with --ahead: the bounded run asked for (ahead, keep_checkpoints, checkpoint_every) and its disk peak
    bounded: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        d = dataclasses.asdict(dataclasses.replace(self, composition=None))
        d["composition"] = self.composition.to_json()
        d["groups"] = {g.name: g.to_json() for g in self.groups}
        for k in ("batches_per_stream", "record_bytes", "cpu_core_hours", "wall_hours", "packer_drop_rate", "fill"):
            d[k] = float(f"{d[k]:.4g}")  # 4 significant digits: a demo's core-hours are tiny
        return d

    def lines(self) -> list[str]:
        s = self.sample
        out = [
            f"plan for {self.config}: {self.streams} streams, budget {_budget_text(self.budget)}",
            f"  sampled {s['batches']} batches of {len(s['streams'])} stream(s) in {s['seconds']:.1f} s "
            f"({s['cpu_s_per_batch'] * 1e3:.0f} ms CPU and {size_text(self.record_bytes)} per batch)",
            f"  records       {self.records:,} ({self.batches_per_stream:,.0f} per stream)",
            f"  tokens        {self.tokens:,} ({self.fill:.0%} of max_num_tokens per batch)",
            f"  output        {size_text(self.output_bytes)} ({self.shards_per_stream} shard(s) per stream of "
            f"~{size_text(self.shard_bytes)}; checkpoints and lineage included)",
            f"  CPU           {self.cpu_core_hours:,.2f} core-hours = {self.cpu_core_hours * 3600:,.0f} core-seconds "
            "(this machine's cores)",
            f"  wall          {_duration(self.wall_hours * 3600)} on {self.cores} cores "
            f"({min(self.cores, self.streams)} streams at a time, after each worker loads the tokenizer; Ray's own "
            "start not included)",
            "  groups        token share / rows dropped / passes over its data per stream:",
        ]
        for g in self.groups:
            out.append(f"    {g.name:14s} {g.token_share:6.1%} / {g.drop_rate:6.2%} / {g.passes:8.2f}"
                       f"  ({g.rows_per_batch:.1f} rows per batch of {g.rows_per_pass:,} per pass)")
        out.append(f"  packer drops  {self.packer_drop_rate:.2%} of samples (over-long, no fit in the buffer)")
        if self.bounded:
            b = self.bounded
            out.append(f"  bounded       disk peak ~{size_text(b['peak_bytes'])} of {size_text(self.output_bytes)} "
                       f"({b['peak_bytes'] / max(self.output_bytes, 1):.0%}): --ahead {b['ahead']}, "
                       f"{b['keep_checkpoints']} checkpoint(s) kept, one every {b['checkpoint_every']:,} steps")
            # --disk-budget holds each stream to its share with its next shard's most on top of what it holds
            fits = b['peak_bytes'] + self.streams * b['reserve_bytes'] + b.get('pack_files_bytes', 0)
            out.append(f"  disk budget   --disk-budget {size_text(fits)} holds that run (the peak plus a shard's most a "
                       "stream: a record of max_num_tokens and a full buffer stored raw); a smaller one makes the "
                       "streams wait for the trims")
        if self.continues:
            c = self.continues
            out.append(f"  continues     {c['from']} after {c['after']}; each group's data stands there at "
                       "(passes read before the switch; the passes above are the run's own):")
            for name, at in sorted(c["groups"].items()):
                out.append(f"    {name:14s} {at:8.2f}" if at is not None else f"    {name:14s}      new (starts at "
                           "its data's beginning)")
        if self.reuse:
            images, reused = self.reuse["images"], self.reuse["reused"]
            out.append(f"  reuse         {reused / images if images else 0:.0%} of the sampled images found in "
                       f"{' + '.join(self.reuse['from'])} ({reused:,} of {images:,}); CPU above is with them")
        out += [f"  {line}" if line else line for line in self.composition.lines()]
        out += [f"  warning: {w}" for w in self.warnings] or ["  no warnings"]
        return out


def _budget_text(budget: dict) -> str:
    return ", ".join(f"{k}={v:,}" for k, v in budget.items())


def size_text(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _duration(s: float) -> str:
    if s >= 2 * 86400:
        return f"{s / 86400:.1f} days"
    if s >= 2 * 3600:
        return f"{s / 3600:.1f} h"
    if s >= 120:
        return f"{s / 60:.0f} min"
    return f"{s:.0f} s"
