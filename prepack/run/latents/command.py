"""``prepack latents``: its parser and handler (``prepack.run.latents.stage``).

Registered by ``prepack.cli`` (``add_command``); light to import: the stage (torch, the training
stack's encoder, Ray) is imported when it runs.
"""

from __future__ import annotations

import argparse
import os
import textwrap

from prepack.run.command import parse_streams
from schemas.errors import UsageError


def cmd_latents(args) -> int:
    from prepack.run.latents.stage import LatentsOptions, run_latents  # noqa: PLC0415 (torch: when it runs)

    if not os.path.isfile(args.vae):
        raise UsageError(f"--vae {args.vae}: no such file (the VAE weights the training loads, ae.safetensors)")
    streams = parse_streams(args.streams)
    options = LatentsOptions(weights=args.vae, stack=args.encoder, device=args.device,
                             streams=tuple(streams) if streams is not None else None, follow=args.follow,
                             inline=args.no_ray, bar=args.bar)
    written = run_latents(args.dir, options)
    print(f"latents: {sum(written.values())} shard(s) encoded in {len(written)} stream(s)")
    return 0


def add_command(subparsers) -> None:
    p = subparsers.add_parser(
        "latents", help="encode each batch's VAE pictures once (the training's frozen encoder), beside its shard",
        description=textwrap.dedent("""\
            Run the training's own frozen VAE encoder on every committed record's padded canvas and
            store its moments (mean, log-variance) beside each shard; a loader with vae_latents=True
            then hands padded_latent (drawn on the device) and the training skips its encode.
            Resumable: run it again after a kill and it goes on after the last shard written."""),
        epilog=textwrap.dedent("""\
            examples:
              prepack latents /data/packed --vae /models/BAGEL-7B-MoT/ae.safetensors
              prepack latents /data/packed --vae ae.safetensors --follow      # beside a running prepack run
              prepack latents /data/packed --vae ae.safetensors --device cpu --no-ray   # small packs, tests"""),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", help="the pack")
    p.add_argument("--vae", required=True, metavar="FILE", help="the VAE weights the training loads (ae.safetensors)")
    p.add_argument("--encoder", default="nemo", choices=("nemo", "bagel"),
                   help="whose encoder module: NeMo AutoModel's (default) or upstream BAGEL's (modeling.autoencoder "
                        "on PYTHONPATH); it must be the one training uses")
    p.add_argument("--device", default="auto",
                   help="cuda, cuda:N or cpu (default auto: one encoder per GPU of the Ray cluster, else the CPU)")
    p.add_argument("--streams", help="only these streams (0,5,8-15)")
    p.add_argument("--follow", action="store_true", help="wait for shards still being packed until every stream is done")
    p.add_argument("--no-ray", action="store_true", help="encode in this process (same bytes)")
    p.add_argument("--no-bar", dest="bar", action="store_false", help="no progress bar")
    p.set_defaults(func=cmd_latents)
