"""``prepack trim`` and ``prepack restore``: their parsers and handlers (``prepack.run.bounded.trim_policy``,
``prepack.run.bounded.trim``, ``prepack.run.bounded.restore``).

Registered by ``prepack.cli`` (``add_command``); light to import: the tool is imported when it runs.
"""

from __future__ import annotations

import logging

from prepack.run.bounded.bound import BoundSpec
from prepack.run.command import add_bound_arguments, parse_streams
from schemas.errors import UsageError

log = logging.getLogger(__name__)


def cmd_trim(args) -> int:
    # the policy reads packs (pyarrow): imported when the command runs, not for `prepack --help`
    from prepack.run.bounded import restorable, trim, trim_policy

    if bool(args.state) == bool(args.progress):
        raise UsageError("trim takes --progress P (a training's progress folder), or --state STATE.json")
    # a shard packed with another tokenizer than a restore would load now cannot be packed again: kept
    tokenizer = restorable.current_tokenizer(args.dir)
    if args.progress:
        for line in BoundSpec(None, tuple(args.progress), args.keep_checkpoints).warnings():  # checks: one line
            log.warning("%s", line)
        result = trim_policy.trim_to_progress(args.dir, args.progress, args.keep_checkpoints, tokenizer)
    else:
        result = trim_policy.trim_pack(args.dir, trim.read_states(args.state), tokenizer)
    for line in result.lines():
        print(line)
    return 0


def cmd_restore(args) -> int:
    # restoring packs (torch, transformers): imported when the command runs, not for `prepack --help`
    from prepack.run.bounded import restore as restoring
    from prepack.run.latents import stage as latents  # (the same reason: torch)

    if (args.state is None) == (args.streams is None):
        raise UsageError("restore takes --state STATE.json, or --streams S with --records A-B")
    if args.state is not None:
        spans = restoring.spans_of_state(args.dir, args.state)
    else:
        span = restoring.parse_records(args.records) if args.records else (0, None)
        spans = {s: span for s in parse_streams(args.streams)}
    done = restoring.restore(args.dir, spans, latents=latents.LatentsRestore(args.vae, args.encoder))
    n = sum(len(v) for v in done.values())
    print(f"restored {n} shard(s)" + (f" of stream(s) {', '.join(map(str, sorted(done)))}: each file is the "
                                      "one its index recorded" if n else ": none of those records was trimmed"))
    return 0


def add_command(subparsers) -> None:
    t = subparsers.add_parser(
        "trim", help="delete the records files of shards every training has checkpointed past (restorable)",
        description="Delete the records file of every shard of DIR whose records all lie before what the trainings "
        "may still read: the earliest of the K newest checkpoints each published to its --progress folder (a crash "
        "rolls back at most that far), or the loader states given. Its index row, digests, checkpoints, pixel index and lineage stay; 'prepack restore' packs it "
        "again byte for byte, and a reader of a trimmed shard is told so.")
    t.add_argument("dir", help="pack directory or URI")
    t.add_argument("--progress", action="append", metavar="P",
                   help="a training's progress folder or s3:// prefix (PackedShardDataset(..., progress=P)): trim "
                   "behind its --keep-checkpoints newest checkpoints; repeat for several trainings (the slowest counts)")
    add_bound_arguments(t, "with --progress")
    t.add_argument("--state", action="append", metavar="STATE",
                   help="instead of --progress: a loader state as JSON (one rank's state_dict, a list of every rank's, or "
                   "merged); repeat for several trainings or checkpoints: nothing at or after any of them is trimmed")
    t.set_defaults(func=cmd_trim)
    r = subparsers.add_parser(
        "restore", help="pack trimmed shards again from their checkpoints, byte for byte",
        description="Re-pack the trimmed shards of DIR that hold the records asked for, each from its checkpoint, "
        "and check every file against the size and digest its index recorded before it counts.")
    r.add_argument("dir", help="pack directory or URI")
    r.add_argument("--state", metavar="STATE",
                   help="a loader state: restore everything it will read (each stream from its position on)")
    r.add_argument("--streams", help="stream ids, e.g. 0,5,8-15 (with --records; default every record)")
    r.add_argument("--records", help="chain record numbers A-B (inclusive), A- (to the end) or A")
    r.add_argument("--vae", metavar="FILE", help="the VAE weights a shard's latents were encoded with "
                   "(prepack latents): restore encodes them again, on the same kind of device")
    r.add_argument("--encoder", default="nemo", choices=("nemo", "bagel"),
                   help="whose encoder module made the latents (default nemo)")
    r.set_defaults(func=cmd_restore)
