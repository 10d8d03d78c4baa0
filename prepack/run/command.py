"""``prepack run``: the subcommand's parser and its handler, which calls the driver.

Registered by ``prepack.cli`` (``add_command``).  Light to import: the driver, Ray and the config
are imported when the command runs, not when ``prepack --help`` builds its parser.
"""

from __future__ import annotations

import argparse
import logging
import sys

from prepack.run.bounded.bound import DEFAULT_KEEP_CHECKPOINTS, BoundSpec, parse_disk_budget
from schemas.errors import UsageError

log = logging.getLogger(__name__)


def parse_streams(text: str | None) -> list[int] | None:
    """``--streams``: comma-separated ids and inclusive ranges, e.g. ``0,5,8-15``."""
    if text is None:
        return None
    out: list[int] = []
    try:
        for part in (p.strip() for p in text.split(",")):
            if not part:
                continue
            lo, sep, hi = part.partition("-")
            out.extend(range(int(lo), int(hi) + 1) if sep else [int(lo)])
    except ValueError:
        raise UsageError(f"--streams takes comma-separated stream ids or ranges (0,5,8-15), got {text!r}") from None
    return out


def add_reuse_argument(parser, help_reuse: str) -> None:
    """``--reuse OLD`` (repeatable): earlier packs whose pixels are taken (``prepack run``) or counted
    (``prepack plan``)."""
    parser.add_argument("--reuse", action="append", metavar="OLD", help=help_reuse)


def add_continue_arguments(parser, help_continue: str) -> None:
    """``--continue OLD`` with ``--after N`` or ``--after-state``: a continuation (``prepack run``) or its
    plan (``prepack plan``); ``prepack.run.chain.Continue.from_cli`` reads them."""
    parser.add_argument("--continue", dest="continue_from", metavar="OLD", help=help_continue)
    parser.add_argument("--after", type=int, metavar="N",
                        help="with --continue: switch every stream after its N-th batch (counted over OLD's whole chain)")
    parser.add_argument("--after-state", metavar="STATE.json",
                        help="with --continue: switch each stream where this loader state leaves it (JSON of a "
                        "training's state_dict: one rank's, a list of every rank's, or merged)")


_BAR = "<bar>"  # --progress without a folder: the older name of --bar (before --progress named trainings' folders)


def add_bound_arguments(parser, what: str) -> None:
    """``--progress P`` (repeatable) and ``--keep-checkpoints K``: the trainings a bounded pack follows
    (``prepack.run.bounded.ahead``), for ``run`` and ``trim``."""
    parser.add_argument("--keep-checkpoints", type=int, default=DEFAULT_KEEP_CHECKPOINTS, metavar="K",
                        help=f"{what}: nothing a training's K newest checkpoints may read again is trimmed (a "
                        f"crash rolls back at most that far; default {DEFAULT_KEEP_CHECKPOINTS})")


def cmd_run(args) -> int:
    # the driver imports the packer (torch, transformers, Ray's side): only when the command runs
    from prepack.run import driver, worker_process
    from schemas.config_file import load_config  # here too: schemas.config imports numpy and pyarrow

    cfg = load_config(args.config)
    continue_from = driver.Continue.from_cli(args)
    if args.no_ray:  # this process packs: give it a packing worker's allocator and GC settings
        worker_process.settle_worker_process()
    folders = [p for p in args.progress or () if p is not _BAR]
    if _BAR in (args.progress or ()):
        log.warning("--progress without a folder: use --bar (--progress P names a training's progress folder)")
    budget = parse_disk_budget(args.disk_budget, args.out) if args.disk_budget is not None else None
    asked = folders or args.ahead is not None or budget is not None
    bound = BoundSpec(args.ahead, tuple(folders), args.keep_checkpoints, budget) if asked else None
    for line in bound.warnings() if bound is not None else ():
        log.warning("%s", line)
    options = driver.RunOptions(streams=parse_streams(args.streams), reuse=args.reuse or (),
                                continue_from=continue_from, bound=bound, inline=args.no_ray, address=args.address,
                                num_cpus=args.num_cpus,
                                bar=args.bar or not args.no_bar and sys.stderr.isatty() or _BAR in (args.progress or ()))
    summary = driver.run_pack(cfg, args.out, options)
    for line in summary.lines():
        print(line)
    return 0


def add_command(subparsers) -> None:
    r = subparsers.add_parser("run", help="pack streams (all, or --streams) into an output directory",
                              description="Pack every stream of CONFIG into --out. Reruns resume after the last "
                              "committed shard; a finished output is left as is.")
    r.add_argument("config", help="config YAML (NeMo recipe form + prepack: section)")
    r.add_argument("--out", required=True, help="output directory or URI (local path, file://, s3://, gs://, hdfs://)")
    r.add_argument("--streams", help="stream ids to pack, e.g. 0,5,8-15 (default: all W*K); other jobs may pack the rest")
    r.add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS, else a local Ray)")
    r.add_argument("--num-cpus", type=int, help="CPUs for the local Ray (default: all)")
    r.add_argument("--progress", action="append", nargs="?", const=_BAR, metavar="P",
                   help="a training's progress folder or s3:// prefix (PackedShardDataset(..., progress=P)): with "
                   "--ahead, pack just ahead of it; and trim behind its checkpoints as it goes; repeat for several "
                   "trainings")
    r.add_argument("--ahead", type=int, metavar="N",
                   help="a bounded pack: each stream packs at most N batches (plus the shard it is in) past the "
                   "furthest training's position, and waits otherwise; the disk holds what the trainings still need")
    r.add_argument("--disk-budget", metavar="SIZE",
                   help="a bounded pack by disk: the pack stays under SIZE (2TiB, 500GB) or a share of the disk's "
                   "free space at the start (20%%); each stream waits for the trims behind its trainings when its "
                   "share is full (with --progress; with --ahead too, both hold); a balanced-samples pack and its "
                   "reference share one budget, kept by the job balancing it")
    add_bound_arguments(r, "with --progress")
    r.add_argument("--bar", action="store_true", help="show the progress bar (default: when stderr is a terminal)")
    r.add_argument("--no-bar", "--no-progress", dest="no_bar", action="store_true",
                   help="no progress bar (--no-progress: its older name)")
    add_reuse_argument(r, "an earlier pack (any config over the same pictures, finished or still packing, local or "
                       "s3://) whose resized pixels are copied instead of decoding and resizing again: the output "
                       "is byte-identical to a fresh pack; repeat for several")
    add_continue_arguments(r, "continue the pack OLD under CONFIG (a mix change: new weights, mandatory groups, "
                           "token budgets, dropouts, transforms, appended groups): every stream goes on from OLD's "
                           "state after --after N of its batches (or where --after-state leaves it), nothing repeated "
                           "or skipped; readers read --out as OLD's first batches, then its own. OLD may still be "
                           "packing. A change planned ahead goes in CONFIG instead, one pack: prepack.schedule "
                           "(docs/architecture/mix-change.md)")
    r.add_argument("--no-ray", action="store_true",
                   help="pack in this process, one stream after another (debugging; same bytes as with Ray)")
    r.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                   help="every drop and warning of every stream as it happens, and Ray's info lines (-vv debug)")
    r.set_defaults(func=cmd_run)
