"""``prepack stats``: the subcommand's parser and its handler (``prepack.tools.stats``).

Registered by ``prepack.cli`` (``add_command``); light to import: the tool (polars) is imported when it runs.
"""

from __future__ import annotations


def cmd_stats(args) -> int:
    # the tool reads packs (pyarrow, numpy): imported when the command runs, not for `prepack --help`
    from prepack.tools import stats as tool

    tool.Pack.open(args.dir)  # one line (NotAPack, PackFormatError) when DIR is no pack this version reads
    report = tool.pack_stats(args.dir, html=args.html)
    print(report)
    return 0


def add_command(subparsers) -> None:
    s = subparsers.add_parser("stats", help="fill ratio, group mix, drops, row reuse (polars over the indexes and lineage)")
    s.add_argument("dir")
    s.add_argument("--html", help="also write a self-contained HTML page with plots")
    s.set_defaults(func=cmd_stats)
