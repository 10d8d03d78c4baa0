"""``prepack index``: the subcommand's parser and its handler, which builds a pack's pixel catalog
(``prepack.run.catalog``).

Registered by ``prepack.cli`` (``add_command``).  Apart from ``catalog.py`` so that building the
parser imports neither numpy nor pyarrow: the handler imports them when it runs.
"""

from __future__ import annotations

import sys


def cmd_index(args) -> int:
    # the catalog's builder (numpy, pyarrow): imported when the command runs, not for `prepack --help`
    from prepack.run import catalog

    catalog.check_pack(args.dir)  # one line (NotAPack, PackFormatError) when DIR is no pack this version reads
    if not args.force and catalog.catalog_is_current(*catalog.open_old_pack(args.dir)):
        print(f"pixel catalog of {args.dir} is up to date")
        return 0

    def progress(done: int, total: int) -> None:
        if sys.stderr.isatty():
            print(f"\rindexing shards {done:,}/{total:,}", end="", file=sys.stderr, flush=True)

    result = catalog.build_catalog(args.dir, on_shard=progress)
    if sys.stderr.isatty():
        print(file=sys.stderr)
    print(f"indexed {result.rows:,} pictures of {result.shards:,} of {result.committed:,} committed shards in {args.dir}")
    for why in result.skipped:
        print(f"left out (its stream's later shards are looked up in their own index): {why}")
    return 0


def add_command(subparsers) -> None:
    x = subparsers.add_parser("index", help="build a pack's pixel catalog, so later --reuse runs look pictures up "
                              "without loading every shard's index",
                              description="Merge the pixel indexes of DIR's committed shards into one catalog sorted "
                              "by content (DIR/pixels/). prepack run --reuse DIR builds it when it is missing or behind; "
                              "run this ahead of time, or for a pack still packing, to index what is committed now.")
    x.add_argument("dir", help="pack directory or URI")
    x.add_argument("--force", action="store_true", help="rebuild even when the catalog covers every committed shard")
    x.set_defaults(func=cmd_index)
