"""``prepack audit``: the subcommand's parser and its handler (``prepack.tools.audit``).

Registered by ``prepack.cli`` (``add_command``); light to import: the tool is imported when it runs.
"""

from __future__ import annotations

import sys


def cmd_audit(args) -> int:
    # the tool reads packs (pyarrow, numpy): imported when the command runs, not for `prepack --help`
    from prepack.tools import audit as tool

    tool.Pack.open(args.dir)  # one line (NotAPack, PackFormatError) when DIR is no pack this version reads
    report = tool.audit_pack(args.dir, stream=args.stream, shard=args.shard, all_streams=args.all,
                             progress=sys.stderr.isatty())
    for line in report.lines():
        print(line)
    return 0 if report.ok else 1


def add_command(subparsers) -> None:
    a = subparsers.add_parser("audit", help="re-pack shards from their checkpoints and compare record by record")
    a.add_argument("dir")
    a.add_argument("--stream", type=int, help="stream to audit (default: all)")
    a.add_argument("--shard", type=int, help="shard of that stream (default: all of its shards)")
    a.add_argument("--all", action="store_true", help="re-pack whole streams from their seeds (also proves checkpoints)")
    a.set_defaults(func=cmd_audit)
