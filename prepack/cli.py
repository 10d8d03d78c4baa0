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

from prepack import __version__
from prepack.demo import command as demo_data_command
from prepack.run import command as run_command
from prepack.run import index_command
from prepack.run.bounded import trim_command
from prepack.run.latents import command as latents_command
from prepack.tools import audit_command, inspect_record_command, plan_command, stats_command, verify_command
from schemas.errors import PrepackError

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
      prepack run anneal.yaml --out out/anneal --continue out/demo --after 3   # change the mix mid-run
      prepack trim out/demo --state loader.json         # drop shards training has checkpointed past
      prepack restore out/demo --streams 0 --records 0-2   # pack trimmed shards again, byte for byte

    A config is a NeMo AutoModel BAGEL recipe YAML (seed, tokenizer, dataset, dataloader.num_workers)
    plus a 'prepack:' section (world_size, batches_per_stream | tokens_per_stream | passes,
    shard_bytes, compression). Stream s = r*K + w holds exactly the batches the online packer yields
    in DataLoader worker w of rank r.

    exit codes: 0 success; 1 the work failed or was refused (a stream error, streams another job
    leases, another config over the output, a verify/audit mismatch); 2 bad usage or config;
    70 a bug in prepack (traceback shown); 130 interrupted (committed shards are kept).
    """
)

# Each subcommand registers itself beside the tool it runs: ``add_command(subparsers)`` adds its
# parser (help, description, arguments) and sets ``func=`` its handler.  These modules are light;
# a handler imports its tool (pyarrow, Ray, torch, ...) when it runs.  In the order --help lists them.
COMMANDS = (
    run_command.add_command,             # run        prepack/run/command.py (the driver)
    plan_command.add_command,            # plan       prepack/tools/plan_command.py
    demo_data_command.add_command,       # demo-data  prepack/demo/command.py
    verify_command.add_command,          # verify     prepack/tools/verify_command.py
    audit_command.add_command,           # audit      prepack/tools/audit_command.py
    index_command.add_command,         # index      prepack/run/index_command.py
    inspect_record_command.add_command,  # inspect    prepack/tools/inspect_record_command.py
    stats_command.add_command,           # stats      prepack/tools/stats_command.py
    trim_command.add_command,            # trim, restore  prepack/run/bounded/trim_command.py
    latents_command.add_command,         # latents    prepack/run/latents/command.py
)


def _version() -> str:
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
    for add_command in COMMANDS:
        add_command(sub)
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
