"""``prepack verify``: the subcommand's parser and its handler (``prepack.tools.verify``).

Registered by ``prepack.cli`` (``add_command``); light to import: the tool is imported when it runs.
"""

from __future__ import annotations

import sys


def cmd_verify(args) -> int:
    # the tool reads packs (pyarrow, numpy): imported when the command runs, not for `prepack --help`
    from prepack.tools import verify as tool

    tool.Pack.open(args.dir)  # one line (NotAPack, PackFormatError) when DIR is no pack this version reads
    report = tool.verify_pack(args.dir, progress=sys.stderr.isatty(), metadata_only=args.metadata_only,
                              restorable=args.restorable)
    for line in report.lines():
        print(line)
    return 0 if report.ok else 1


def add_command(subparsers) -> None:
    v = subparsers.add_parser("verify", help="check every file of a pack (shards, indexes, checkpoints, lineage) "
                              "against its recorded digests")
    v.add_argument("dir")
    v.add_argument("--metadata-only", action="store_true",
                   help="check pack.json, stream indexes, done.json and the manifest only (seconds, whatever the size)")
    v.add_argument("--restorable", action="store_true",
                   help="also tell, for each trimmed shard, whether 'prepack restore' could pack it again now: every "
                   "source it read still there with the same bytes, and the same tokenizer (fast with --metadata-only)")
    v.set_defaults(func=cmd_verify)
