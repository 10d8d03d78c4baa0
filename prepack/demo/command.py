"""``prepack demo-data``: the subcommand's parser and its handler (``prepack.demo.data``).

Registered by ``prepack.cli`` (``add_command``); light to import: the data module (PIL, numpy) is
imported when it runs.
"""

from __future__ import annotations


def cmd_demo_data(args) -> int:
    # the demo's makers (scikit-image, PyAV, Pillow): imported when the command runs, not for --help
    from prepack.demo.data import write_demo_data

    data = write_demo_data(args.dir, seed=args.seed)
    print(f"demo dataset written to {data.root}: {data.num_t2i_rows} t2i rows, {data.num_edit_rows} edit rows, "
          f"{data.num_vlm_rows} VLM rows ({len(data.videos)} videos, {len(data.frame_dirs)} frame folders)")
    return 0


def add_command(subparsers) -> None:
    d = subparsers.add_parser("demo-data", help="write the small demo dataset configs/demo.yaml points at")
    d.add_argument("dir", help="where to write it (configs/demo.yaml expects ./demo-data)")
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(func=cmd_demo_data)
