"""The ``prepack`` command: pack, check and explain offline BAGEL batches.

Exit codes (``_dispatch``): 0 success; 1 the work failed or was refused (a stream error, a
verification or audit mismatch, streams another run leases); 2 bad usage or config, or the
packer's ``[pack]`` extra missing (one line on stderr says what to fix); 70 an internal error, a
bug (its traceback is printed); 130 interrupted (Ctrl-C; committed shards are kept).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import textwrap
from typing import NoReturn

from schemas.errors import PrepackError, UsageError

EPILOG = textwrap.dedent(
    """\
    examples:
      prepack demo-data demo-data                       # a small demo dataset from real photos
      prepack plan configs/demo.yaml                    # what the run will cost: bytes, shards, core-hours
      prepack run configs/demo.yaml --out out/demo      # pack every stream on a local Ray
      RAY_ADDRESS=http://head:8265 ray job submit --working-dir . -- prepack run cfg.yaml --out s3://b/p
      prepack verify out/demo                           # digests of every file and record
      prepack audit out/demo --stream 1 --shard 0       # re-pack a shard, compare record by record
      prepack inspect out/demo --stream 0 --record 3 --png rec.png
      prepack stats out/demo --html stats.html
      prepack index out/demo                            # sort its pixel indexes for later --reuse runs
      prepack run new.yaml --out out/new --reuse out/demo   # another mix, the old pack's pixels

    A config is a NeMo AutoModel BAGEL recipe YAML (seed, tokenizer, dataset, dataloader.num_workers)
    plus a 'prepack:' section (world_size, batches_per_stream | tokens_per_stream | passes,
    shard_bytes, compression). Stream s = r*K + w holds exactly the batches the online packer yields
    in DataLoader worker w of rank r.

    exit codes: 0 success; 1 the work failed or was refused (a stream error, streams another job
    leases, another config over the output, a verify/audit mismatch); 2 bad usage or config;
    70 a bug in prepack (traceback shown); 130 interrupted (committed shards are kept).
    """
)


def _streams(text: str | None) -> list[int] | None:
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


def cmd_run(args) -> int:
    from prepack.run.driver import run_pack
    from schemas.config import load_config

    cfg = load_config(args.config)
    if args.no_ray:  # this process packs: give it a packing worker's allocator and GC settings
        from prepack.run.worker_process import settle_worker_process

        settle_worker_process()
    summary = run_pack(cfg, args.out, streams=_streams(args.streams), address=args.address,
                       progress=not args.no_progress and sys.stderr.isatty() or args.progress,
                       num_cpus=args.num_cpus, inline=args.no_ray, reuse=args.reuse or ())
    for line in summary.lines():
        print(line)
    return 0


def cmd_plan(args) -> int:
    import json

    from prepack.tools.plan import plan_pack
    from schemas.config import load_config

    if args.cores is not None and args.cores < 1:
        raise UsageError(f"--cores must be at least 1, got {args.cores}")
    plan = plan_pack(load_config(args.config), cores=args.cores, sample_batches=args.sample_batches,
                     sample_streams_n=args.sample_streams, max_seconds=args.max_seconds, reuse=args.reuse or ())
    if args.json:
        print(json.dumps(plan.to_json(), sort_keys=True))
    else:
        for line in plan.lines():
            print(line)
    return 0


def cmd_demo_data(args) -> int:
    from prepack.demo.data import write_demo_data

    data = write_demo_data(args.dir, seed=args.seed)
    print(f"demo dataset written to {data.root}: {data.num_t2i_rows} t2i rows, {data.num_edit_rows} edit rows, "
          f"{data.num_vlm_rows} VLM rows ({len(data.videos)} videos, {len(data.frame_dirs)} frame folders)")
    return 0


def _require_pack(path: str) -> None:
    """One line (NotAPack, PackFormatError) when DIR is no pack this version reads."""
    from loader.reader import Pack

    Pack.open(path)


def cmd_verify(args) -> int:
    from prepack.tools.verify import verify_pack

    _require_pack(args.dir)
    report = verify_pack(args.dir, progress=sys.stderr.isatty(), metadata_only=args.metadata_only)
    for line in report.lines():
        print(line)
    return 0 if report.ok else 1


def cmd_audit(args) -> int:
    from prepack.tools.audit import audit_pack

    _require_pack(args.dir)
    report = audit_pack(args.dir, stream=args.stream, shard=args.shard, all_streams=args.all,
                        progress=sys.stderr.isatty())
    for line in report.lines():
        print(line)
    return 0 if report.ok else 1


def cmd_index(args) -> int:
    from prepack.run.catalog import build_catalog, catalog_is_current
    from prepack.engine.reuse.earlier_packs import open_old_pack

    _require_pack(args.dir)
    if not args.force and catalog_is_current(*open_old_pack(args.dir)):
        print(f"pixel catalog of {args.dir} is up to date")
        return 0

    def progress(done: int, total: int) -> None:
        if sys.stderr.isatty():
            print(f"\rindexing shards {done:,}/{total:,}", end="", file=sys.stderr, flush=True)

    result = build_catalog(args.dir, on_shard=progress)
    if sys.stderr.isatty():
        print(file=sys.stderr)
    print(f"indexed {result.rows:,} pictures of {result.shards:,} of {result.committed:,} committed shards in {args.dir}")
    for why in result.skipped:
        print(f"left out (its stream's later shards are looked up in their own index): {why}")
    return 0


def cmd_inspect(args) -> int:
    from prepack.tools.inspect_record import inspect_record

    _require_pack(args.dir)
    text = inspect_record(args.dir, stream=args.stream, record=args.record, png=args.png)
    print(text)
    return 0


def cmd_stats(args) -> int:
    from prepack.tools.stats import pack_stats

    _require_pack(args.dir)
    report = pack_stats(args.dir, html=args.html)
    print(report)
    return 0


def _version() -> str:
    from prepack import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="prepack",
        description="Offline pre-packing for BAGEL-style multimodal training: Ray packs streams of "
        "packed batches into zstd Arrow shards; the 'loader' package streams them back in training.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-v info, -vv debug)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    r = sub.add_parser("run", help="pack streams (all, or --streams) into an output directory",
                       description="Pack every stream of CONFIG into --out. Reruns resume after the last "
                       "committed shard; a finished output is left as is.")
    r.add_argument("config", help="config YAML (NeMo recipe form + prepack: section)")
    r.add_argument("--out", required=True, help="output directory or URI (local path, file://, s3://, gs://, hdfs://)")
    r.add_argument("--streams", help="stream ids to pack, e.g. 0,5,8-15 (default: all W*K); other jobs may pack the rest")
    r.add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS, else a local Ray)")
    r.add_argument("--num-cpus", type=int, help="CPUs for the local Ray (default: all)")
    r.add_argument("--progress", action="store_true", help="force the progress bar (default: when stderr is a terminal)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.add_argument("--reuse", action="append", metavar="OLD",
                   help="an earlier pack (any config over the same pictures, finished or still packing, local or "
                        "s3://) whose resized pixels are copied instead of decoding and resizing again: the output "
                        "is byte-identical to a fresh pack; repeat for several")
    r.add_argument("--no-ray", action="store_true",
                   help="pack in this process, one stream after another (debugging; same bytes as with Ray)")
    r.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                   help="every drop and warning of every stream as it happens, and Ray's info lines (-vv debug)")
    r.set_defaults(func=cmd_run)

    pl = sub.add_parser(
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
    pl.add_argument("--reuse", action="append", metavar="OLD",
                    help="an earlier pack the run will take pixels from (prepack run --reuse): the sample takes them "
                    "too, so the CPU is projected with them, and the plan says what share it found; repeat for several "
                    "(reads OLD's pixel catalog if it has one, else every shard's pixel index: 'prepack index OLD')")
    pl.set_defaults(func=cmd_plan, skip_teardown=True)

    d = sub.add_parser("demo-data", help="write the small demo dataset configs/demo.yaml points at")
    d.add_argument("dir", help="where to write it (configs/demo.yaml expects ./demo-data)")
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(func=cmd_demo_data)

    v = sub.add_parser("verify", help="check every file of a pack (shards, indexes, checkpoints, lineage) against its recorded digests")
    v.add_argument("dir")
    v.add_argument("--metadata-only", action="store_true",
                   help="check pack.json, stream indexes, done.json and the manifest only (seconds, whatever the size)")
    v.set_defaults(func=cmd_verify)

    a = sub.add_parser("audit", help="re-pack shards from their checkpoints and compare record by record")
    a.add_argument("dir")
    a.add_argument("--stream", type=int, help="stream to audit (default: all)")
    a.add_argument("--shard", type=int, help="shard of that stream (default: all of its shards)")
    a.add_argument("--all", action="store_true", help="re-pack whole streams from their seeds (also proves checkpoints)")
    a.set_defaults(func=cmd_audit)

    x = sub.add_parser("index", help="build a pack's pixel catalog, so later --reuse runs look pictures up without "
                       "loading every shard's index",
                       description="Merge the pixel indexes of DIR's committed shards into one catalog sorted by "
                       "content (DIR/pixels/). prepack run --reuse DIR builds it when it is missing or behind; run "
                       "this ahead of time, or for a pack still packing, to index what is committed now.")
    x.add_argument("dir", help="pack directory or URI")
    x.add_argument("--force", action="store_true", help="rebuild even when the catalog covers every committed shard")
    x.set_defaults(func=cmd_index)

    i = sub.add_parser("inspect", help="explain one packed batch (text, samples, layout picture)")
    i.add_argument("dir")
    i.add_argument("--stream", type=int, required=True)
    i.add_argument("--record", type=int, required=True, help="record index within the stream")
    i.add_argument("--png", help="write a picture of the token layout and a sample's attention mask")
    i.set_defaults(func=cmd_inspect)

    s = sub.add_parser("stats", help="fill ratio, group mix, drops, row reuse (polars over the indexes and lineage)")
    s.add_argument("dir")
    s.add_argument("--html", help="also write a self-contained HTML page with plots")
    s.set_defaults(func=cmd_stats)
    return p


def main(argv: list[str] | None = None, *, exit_process: bool = False) -> int:
    """Run one command; its exit code.  ``exit_process``: the ``prepack`` program itself, which may end
    the process at once after a command that holds nothing (see :func:`_exit_now`)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("prepack.run.driver").setLevel(min(level, logging.INFO))  # progress lines without a terminal
    code = _dispatch(args)
    if exit_process and getattr(args, "skip_teardown", False):
        _exit_now(code)
    return code


def _exit_now(code: int) -> NoReturn:
    """End the process without the interpreter's teardown, after flushing what it printed and logged.

    Only for commands that leave nothing to clean up (``plan``: no files, no Ray, no threads that
    write): unloading torch and numba at exit takes ~1 s, a sixth of a demo plan's whole time.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said there anyway
            pass
    os._exit(code)


def entry() -> NoReturn:
    """The ``prepack`` program (console script and ``python -m prepack.cli``)."""
    sys.exit(main(exit_process=True))


def _dispatch(args: argparse.Namespace) -> int:
    try:
        return args.func(args)
    except PrepackError as e:  # the user's mistake or a refused/failed piece of work: one line
        if args.verbose:
            logging.exception("details")
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"prepack: error: {msg}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("prepack: interrupted (committed shards are kept; rerun to resume)", file=sys.stderr)
        return 130
    except ModuleNotFoundError as e:  # the slim (loader-only) install: the packer's extra is missing
        print(f"prepack: error: {e}; the packer's tools need: pip install 'bagel-prepack[pack]'", file=sys.stderr)
        return 2
    except Exception:  # anything else is a bug in prepack: show where
        import traceback

        traceback.print_exc()
        print(f"prepack: internal error (a bug in prepack {_version()}; please report it with the traceback above)",
              file=sys.stderr)
        return 70


if __name__ == "__main__":
    entry()
