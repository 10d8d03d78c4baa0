"""``prepack inspect``: the subcommand's parser and its handler (``prepack.tools.inspect_record``).

Registered by ``prepack.cli`` (``add_command``); light to import: the tool is imported when it runs.
"""

from __future__ import annotations


def cmd_inspect(args) -> int:
    # the tool reads packs (pyarrow, numpy): imported when the command runs, not for `prepack --help`
    from prepack.tools import inspect_record as tool

    tool.Pack.open(args.dir)  # one line (NotAPack, PackFormatError) when DIR is no pack this version reads
    text = tool.inspect_record(args.dir, stream=args.stream, record=args.record, png=args.png)
    print(text)
    return 0


def add_command(subparsers) -> None:
    i = subparsers.add_parser("inspect", help="explain one packed batch (text, samples, layout picture)")
    i.add_argument("dir")
    i.add_argument("--stream", type=int, required=True)
    i.add_argument("--record", type=int, required=True, help="record index within the stream")
    i.add_argument("--png", help="write a picture of the token layout and a sample's attention mask")
    i.set_defaults(func=cmd_inspect)
