"""``prepack plan`` of a config with ``prepack.schedule``: a plan per step, over the step's batches,
and the totals (``prepack.tools.plan`` plans each step)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from prepack.tools.plan import PlanOptions, plan_pack
from prepack.tools.plan_report import size_text
from schemas.config import PrepackConfig


@dataclass
class SchedulePlan:
    """``prepack plan`` of a config with ``prepack.schedule``: a plan per step (its config, over its
    batches), and the totals.  Each step is sampled from its config's own start: where its groups'
    data stand after the steps before it is not simulated (``prepack plan B --continue OLD`` does
    that from a real pack)."""

    config: str
    steps: list  # (first batch, last batch or None, PackPlan)
    unreached: list = field(default_factory=list)  # first batches of the steps past a batch budget

    def totals(self) -> dict:
        plans = [p for _, _, p in self.steps]
        return {"records": sum(p.records for p in plans), "tokens": sum(p.tokens for p in plans),
                "output_bytes": sum(p.output_bytes for p in plans),
                "cpu_core_hours": float(f"{sum(p.cpu_core_hours for p in plans):.4g}"),
                "wall_hours": float(f"{sum(p.wall_hours for p in plans):.4g}")}

    def to_json(self) -> dict:
        return {"config": self.config, **self.totals(), "unreached_steps_from_batch": list(self.unreached),
                "schedule": [{"from_batch": a, "to_batch": b, "plan": p.to_json()} for a, b, p in self.steps]}

    def lines(self) -> list[str]:
        t = self.totals()
        out = [f"plan for {self.config}: a schedule of {len(self.steps) + len(self.unreached)} steps, each sampled "
               "from its config's own start (where a step's groups stand after the earlier steps is not simulated)"]
        for i, (a, b, p) in enumerate(self.steps):
            span = f"batches {a}-{b - 1}" if b is not None else f"batches {a} on"
            out.append(f"step {i} ({span} of every stream{', the config itself' if i == 0 else ''}):")
            out.extend("  " + line for line in p.lines())
        for i, start in enumerate(self.unreached, len(self.steps)):
            out.append(f"step {i} (from batch {start}): not reached with this budget (an extension would reach it)")
        out.append(f"whole schedule: {t['records']:,} records, {t['tokens']:,} tokens, "
                   f"{size_text(t['output_bytes'])}, {t['cpu_core_hours']:.3g} CPU core-hours, "
                   f"{t['wall_hours']:.3g} h wall")
        return out


def plan_schedule(cfg: PrepackConfig, options: PlanOptions = PlanOptions(), tokenizer=None) -> SchedulePlan:
    """``plan_pack`` of each step of ``cfg``'s schedule over its own batches (a batch budget is split at
    the steps; a token or passes budget is the last step's, as planned from its start)."""
    bounds = [0] + [st.after for st in cfg.schedule]
    limit = cfg.prepack.batches_per_stream  # a batch budget caps the stream whatever else is set
    unreached = [b for b in bounds if limit is not None and b >= limit]  # an extension of the pack would reach them
    bounds = [b for b in bounds if b not in unreached]
    steps = []
    for i, start in enumerate(bounds):
        end = bounds[i + 1] if i + 1 < len(bounds) else limit
        step = cfg.step_config(i)
        if end is not None:
            step = dataclasses.replace(step, prepack=dataclasses.replace(
                step.prepack, batches_per_stream=end - start, tokens_per_stream=None, passes=None))
        # only the first step can continue another pack: the later ones start from their own config
        steps.append((start, end, plan_pack(step, options if i == 0 else dataclasses.replace(options, continue_from=None),
                                            tokenizer)))
    return SchedulePlan(cfg.config_path or "config", steps, unreached)
