"""``prepack plan``: the subcommand's parser and its handler (``prepack.tools.plan``).

Registered by ``prepack.cli`` (``add_command``); light to import: the planner (pyarrow, the
packer) is imported when it runs, so ``prepack plan --help`` stays quick.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import textwrap

from prepack.run.bounded.bound import BoundSpec
from prepack.run.command import add_bound_arguments, add_continue_arguments, add_reuse_argument
from prepack.tools.stats_command import add_cost_model_argument, add_sync_argument
from schemas.errors import UsageError


def cmd_plan(args) -> int:
    # the planner packs (pyarrow, torch, the tokenizer): imported when the command runs, not for --help
    from prepack.tools import plan as planner, plan_schedule, step_spread
    from schemas.config_file import load_config  # here too: schemas.config imports numpy and pyarrow

    if args.cores is not None and args.cores < 1:
        raise UsageError(f"--cores must be at least 1, got {args.cores}")
    if args.micro_batches < 1 or args.world_size is not None and args.world_size < 1:
        raise UsageError("--world-size and --micro-batches take numbers >= 1")
    continue_from = planner.Continue.from_cli(args)
    bounded = None
    if args.ahead is not None:
        BoundSpec(args.ahead, ("(plan)",), args.keep_checkpoints)  # the run's own checks
        if args.checkpoint_every < 1:
            raise UsageError(f"--checkpoint-every takes training steps >= 1, got {args.checkpoint_every}")
        bounded = {"ahead": args.ahead, "keep_checkpoints": args.keep_checkpoints,
                   "checkpoint_every": args.checkpoint_every}
    cfg = load_config(args.config)
    if cfg.schedule and bounded is not None:
        raise UsageError("plan --ahead takes a config without prepack.schedule: plan each step's disk peak "
                         "with a config of its own")
    options = planner.PlanOptions(cores=args.cores, sample_batches=args.sample_batches,
                                  sample_streams_n=args.sample_streams, max_seconds=args.max_seconds,
                                  reuse=args.reuse or (), continue_from=continue_from, bounded=bounded)
    plan = plan_schedule.plan_schedule(cfg, options) if cfg.schedule else planner.plan_pack(cfg, options)
    spreads = []
    if getattr(plan, "batch_terms", None):  # a schedule's plan is per step: weigh a step's own config
        model = step_spread.cost_model(args.cost_model, cfg)
        spreads = step_spread.drawn_spread(plan.batch_terms, model, args.world_size or cfg.world_size,
                                           args.micro_batches, syncs=step_spread.syncs(args.sync))
    if args.json:
        doc = {"step_spread": {s.sync: dataclasses.asdict(s) for s in spreads}} if spreads else {}
        print(json.dumps({**plan.to_json(), **doc}, sort_keys=True))
    else:
        for line in plan.lines() + [line for s in spreads for line in s.lines()]:
            print(line)
    return 0


def add_command(subparsers) -> None:
    pl = subparsers.add_parser(
        "plan", help="project a run's records, bytes, shards, CPU and wall time from a small sample (writes nothing)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Pack a few batches of a few streams of CONFIG in this process, size them as the writer "
        "would (into nothing: no output is written), and project the whole run from them and the budget.",
        epilog=textwrap.dedent(
            """\
            what it prints:
              records, tokens        W*K streams x the budget in batches (tokens_per_stream / passes are
                                     converted at the sampled tokens and rows per batch)
              output                 shards + checkpoints + lineage, from the sampled records' real size
              shards per stream      and their size: aim for a few hundred MB (prepack.shard_bytes)
              CPU core-hours, wall   this machine's CPU per batch; wall = streams packed cores at a time
              groups                 token share, rows dropped, passes each stream makes over its slice
              warnings               knobs that look wrong: shard size, a budget that runs a group past
                                     its data, many drops, low fill, idle cores

            examples:
              prepack plan configs/demo.yaml
              prepack plan cfg.yaml --cores 512 --json | jq .output_bytes
              prepack plan cfg.yaml --sample-batches 16 --sample-streams 4   # a larger, slower sample
              prepack plan new.yaml --reuse /data/packed   # how many pictures an old pack saves, and the CPU
              prepack plan anneal.yaml --continue /data/packed --after 15000   # a mix change from batch 15000
              prepack plan cfg.yaml --ahead 200 --checkpoint-every 500   # a bounded run's disk peak
              prepack plan scheduled.yaml   # a config with prepack.schedule: each step, then the totals

            It samples each stream's first batches and measures CPU here: expect the projection within
            tens of percent, not exactly (docs/performance.md says how close it came on the demo).
            """
        ),
    )
    pl.add_argument("config", help="config YAML (NeMo recipe form + prepack: section)")
    pl.add_argument("--cores", type=int, help="cores the run will have, for the wall time (default: this machine's)")
    pl.add_argument("--json", action="store_true",
                    help="print one JSON object (records, tokens, output_bytes, cpu_core_hours, wall_hours, groups, warnings, ...)")
    pl.add_argument("--sample-batches", type=int, default=4,
                    help="most batches to pack per sampled stream (default 4); a stream stops once the bytes per "
                    "batch settle, and a small pack is sampled at most a quarter of its batches")
    pl.add_argument("--sample-streams", type=int, default=2, help="streams to sample, first and last included (default 2)")
    pl.add_argument("--max-seconds", type=float, default=60.0,
                    help="stop sampling after this long (default 60; each sampled stream begun packs its 1-2 batches)")
    add_reuse_argument(pl, "an earlier pack the run will take pixels from (prepack run --reuse): the sample takes "
                       "them too, so the CPU is projected with them, and the plan says what share it found; repeat for "
                       "several (reads OLD's pixel catalog if it has one, else every shard's pixel index: "
                       "'prepack index OLD')")
    add_continue_arguments(pl, "plan a continuation of OLD (prepack run --continue): the sampled streams start "
                           "from OLD's state at the switch, and the plan says where each group's data stands there")
    pl.add_argument("--ahead", type=int, metavar="N",
                    help="plan a bounded run (prepack run --ahead N): add its disk high-water mark next to the total")
    add_bound_arguments(pl, "with --ahead")
    pl.add_argument("--world-size", type=int, metavar="W",
                    help="weigh optimizer steps of W ranks (default: the config's world size): the step spread "
                    "line draws steps from the sampled batches and says how much slower the slowest rank is than "
                    "the mean, and what balancing gives")
    pl.add_argument("--micro-batches", type=int, default=1, metavar="M",
                    help="micro-batches per rank per optimizer step for the step spread (default 1)")
    add_cost_model_argument(pl)
    add_sync_argument(pl)
    pl.add_argument("--checkpoint-every", type=int, default=1000, metavar="C",
                    help="with --ahead: training steps between the training's checkpoints (default 1000)")
    # skip_teardown: the program ends a plan without the interpreter's teardown (prepack.cli._exit_now)
    pl.set_defaults(func=cmd_plan, skip_teardown=True)
