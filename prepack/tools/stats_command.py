"""``prepack stats``: the subcommand's parser and its handler (``prepack.tools.stats``).

Registered by ``prepack.cli`` (``add_command``); light to import: the tool (polars) is imported when it runs.
"""

from __future__ import annotations

from schemas.errors import UsageError


def cmd_stats(args) -> int:
    # the tool reads packs (pyarrow, numpy): imported when the command runs, not for `prepack --help`
    from prepack.tools import stats as tool

    tool.Pack.open(args.dir)  # one line (NotAPack, PackFormatError) when DIR is no pack this version reads
    if args.micro_batches < 1 or args.world_size is not None and args.world_size < 1:
        raise UsageError("--world-size and --micro-batches take numbers >= 1")
    report = tool.pack_stats(args.dir, html=args.html, steps=(args.world_size, args.micro_batches),
                             cost_model=args.cost_model, sync=args.sync)
    print(report)
    return 0


def add_cost_model_argument(parser) -> None:
    """``--cost-model FILE``: what a batch costs, for the step spread (``schemas.cost.CostModel.read``)."""
    parser.add_argument("--cost-model", metavar="FILE",
                        help="the step spread's cost model: JSON or YAML {term: ms per unit, intercept: ms}, or a "
                        "fit scripts/time_record_cost.py wrote (default: BAGEL-7B from FLOPs, docs/performance.md)")


def add_sync_argument(parser) -> None:
    """``--sync KIND``: which step model the step spread weighs by (default: both)."""
    parser.add_argument("--sync", choices=("lockstep", "step"),
                        help="where the ranks wait, for the step spread: lockstep (FSDP / ZeRO-3, or DDP without "
                        "no_sync: both BAGEL stacks; every segment of every micro-step) or step (DDP under "
                        "no_sync: the step's end); default: print both")


def add_command(subparsers) -> None:
    s = subparsers.add_parser("stats", help="fill ratio, group mix, drops, row reuse (polars over the indexes and lineage)")
    s.add_argument("dir")
    s.add_argument("--html", help="also write a self-contained HTML page with plots")
    s.add_argument("--world-size", type=int, metavar="W",
                   help="weigh the optimizer steps of W ranks (default: the pack's world size)")
    s.add_argument("--micro-batches", type=int, default=1, metavar="M",
                   help="micro-batches per rank per optimizer step (gradient accumulation; default 1): the step "
                   "spread lines say how much longer a step lasts than the mean rank's work, and what balancing "
                   "(PackedShardDataset(..., balance=Balance(micro_batches=M, sync=...))) gives")
    add_cost_model_argument(s)
    add_sync_argument(s)
    s.set_defaults(func=cmd_stats)
