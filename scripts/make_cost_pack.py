#!/usr/bin/env python
"""Packs to time a record's forward+backward on (``scripts/time_record_cost.py``), small enough to travel.

    python scripts/make_cost_pack.py [--out .costpack] [--batches 40] [--seed 0]

Builds under ``--out`` (default ``.costpack/`` at the repository root, which it adds to
``.git/info/exclude``) two packs of ``bench_pack.py``'s kind of data (t2i, edit and SFT groups with
NeMo's pretrain image transforms) under NeMo's pretrain knobs (expected_num_tokens 32768,
max_num_tokens 36864, per sample 16384, flex, CFG dropout 0.3), W=1, K=2, ``--batches`` records
per stream:

- ``default``: the three groups at equal weight;
- ``vlm``: VLM-heavy (weights t2i 1, edit 1, vlm 8, as ``bench_continue.py --mix vlm``), at the same
  token budget.

Pictures have camera sizes (sides drawn from 400..1600, so the packed images, ViT grids and VAE
canvases vary as real data's do) but flat content: a few solid, 16-pixel aligned rectangles.
A record's cost depends on its shapes only, never on its pixel values, and flat pictures compress
to almost nothing, so a record is its token arrays (~0.7 MB at 32k tokens: the writer stores them
uncompressed), ~0.5 MB: 160 records are ~85 MiB on disk.  So ``--out``/costpack.tar.xz holds both
packs (xz shrinks the token arrays ~60x, to ~1.5 MiB): that one file is what travels to a GPU machine
(``time_record_cost.py --pack`` reads the archive directly), and the packs themselves are deleted
once archived unless ``--keep-packs``, the source data unless ``--keep-data``.  Packing is
``prepack run CONFIG --out DEST --no-ray`` (one process, one stream after another).

Last line: ``cost packs: N records in P packs (X MiB unpacked), archive A MiB at PATH; OUT holds Y MiB``
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "helpers"), os.path.dirname(os.path.abspath(__file__))]

import numpy as np  # noqa: E402
import yaml  # noqa: E402
from PIL import Image  # noqa: E402

log = logging.getLogger("make_cost_pack")

VLM_WEIGHTS = {"t2i_pretrain": 1, "unified_edit": 1, "vlm_sft": 8}
ARCHIVE = "costpack.tar.xz"


def flat_picture(rs: np.random.RandomState, lo: int, hi: int) -> Image.Image:
    """A camera-sized picture of a few solid 16-pixel aligned rectangles (compresses to ~nothing)."""
    w, h = int(rs.randint(lo, hi + 1)), int(rs.randint(lo, hi + 1))
    arr = np.empty((h, w, 3), np.uint8)
    arr[:] = rs.randint(0, 256, 3)
    for _ in range(int(rs.randint(1, 4))):
        y0, x0 = 16 * int(rs.randint(0, h // 16)), 16 * int(rs.randint(0, w // 16))
        arr[y0:y0 + 16 * int(rs.randint(1, 20)), x0:x0 + 16 * int(rs.randint(1, 20))] = rs.randint(0, 256, 3)
    return Image.fromarray(arr)


def make_data(root: str, seed: int, size: tuple[int, int] = (400, 1600)):
    """``bench_pack.make_data``'s groups and NeMo pretrain transforms, flat pictures, more rows and
    more varied text (SFT answers of 20..400 words)."""
    import datagen as dg

    rs = np.random.RandomState(seed)
    pic = lambda: flat_picture(rs, *size)  # noqa: E731
    ds = dg.Dataset(root)
    t2i = [[{"image": dg.jpeg(pic(), 90), "captions": '{"c0": "%s", "c1": "%s"}'
             % (dg.sentence(rs, 5, 80), dg.sentence(rs, 5, 80))} for _ in range(16)] for _ in range(4)]
    dg.add_t2i(ds, t2i, row_group_size=8)
    edits = []
    for _ in range(4):
        rows = []
        for _ in range(8):
            base = pic()
            steps = int(rs.randint(1, 4))
            imgs = [dg.jpeg(base, 90)] + [dg.jpeg(base.rotate(90 * (j + 1), expand=True), 90) for j in range(steps)]
            rows.append({"image_list": imgs, "instruction_list": [[dg.sentence(rs, 5, 30)] for _ in range(steps)]})
        edits.append(rows)
    dg.add_edit(ds, edits, row_group_size=4)
    lines, files = [], {}
    for i in range(96):
        name = f"img_{i}.jpg"
        files[name] = dg.jpeg(pic(), 90)
        lines.append('{"image": "%s", "conversations": [{"from": "human", "value": "<image>\\n%s"}, '
                     '{"from": "gpt", "value": "%s"}]}' % (name, dg.sentence(rs, 4, 60), dg.sentence(rs, 20, 400)))
    dg.add_sft(ds, lines, files)
    from bench_pack import nemo_pretrain_transforms

    return nemo_pretrain_transforms(ds)


def config(ds, batches: int, seed: int, name: str, weights: dict | None) -> str:
    from bench_pack import NEMO_PRETRAIN_KNOBS

    path = ds.config(knobs=NEMO_PRETRAIN_KNOBS, num_workers=2, seed=seed, prepack={"batches_per_stream": batches})
    raw = yaml.safe_load(open(path))
    raw["prepack"]["compression"] = "zstd:3"
    for group, w in (weights or {}).items():
        raw["dataset"]["grouped_datasets"][group]["weight"] = w
    out = os.path.join(os.path.dirname(path), f"{name}.yaml")
    with open(out, "w") as f:
        yaml.safe_dump(raw, f, sort_keys=False)
    return out


def exclude(rel: str) -> None:
    """Add ``/rel/`` to the checkout's .git/info/exclude (never .gitignore)."""
    git = os.path.join(ROOT, ".git")
    if not os.path.isdir(git):
        return
    path = os.path.join(git, "info", "exclude")
    line = f"/{rel.strip('/')}/"
    old = open(path).read().splitlines() if os.path.exists(path) else []
    if line not in old:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "a") as f:
            f.write(line + "\n")


def records(pack_dir: str) -> int:
    """Records in a pack, all streams (the loader's reader)."""
    from loader.reader import Pack

    pack = Pack.open(pack_dir)
    return sum(pack.num_records(s) for s in range(pack.num_streams))


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, ".costpack"), help="folder of the archive (default .costpack/ at the repository root)")
    ap.add_argument("--batches", type=int, default=40, help="records per stream of each pack, 2 streams each (default 40)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the data and of the packs (default 0)")
    ap.add_argument("--mixes", default="default,vlm", help="which packs, comma separated (default: default,vlm)")
    ap.add_argument("--keep-data", action="store_true", help="keep the source data under OUT/data")
    ap.add_argument("--keep-packs", action="store_true", help="keep the packs beside their archive (~85 MiB)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

    out = os.path.abspath(args.out)
    if os.path.commonpath([out, ROOT]) == ROOT and out != ROOT:
        exclude(os.path.relpath(out, ROOT))
    os.makedirs(out, exist_ok=True)
    data = os.path.join(out, "data")
    shutil.rmtree(data, ignore_errors=True)
    t0 = time.perf_counter()
    ds = make_data(data, args.seed)
    log.info("data made in %.1f s", time.perf_counter() - t0)

    packs = []
    for mix in [m.strip() for m in args.mixes.split(",") if m.strip()]:
        if mix not in ("default", "vlm"):
            ap.error(f"unknown mix {mix!r} (default, vlm)")
        cfg = config(ds, args.batches, args.seed, mix, VLM_WEIGHTS if mix == "vlm" else None)
        dest = os.path.join(out, mix)
        shutil.rmtree(dest, ignore_errors=True)
        t0 = time.perf_counter()
        # the product's command, in one process without Ray (one stream after another)
        subprocess.run([sys.executable, "-m", "prepack.cli", "run", cfg, "--out", dest, "--no-ray", "--no-progress"],
                       cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": ROOT})
        n = records(dest)
        log.info("pack %s: %d records, %.1f MiB, in %.0f s", mix, n, du(dest) / 2**20, time.perf_counter() - t0)
        packs.append((mix, dest, n))
    if not args.keep_data:
        shutil.rmtree(data, ignore_errors=True)

    archive = os.path.join(out, ARCHIVE)
    tmp = archive + ".tmp"
    with tarfile.open(tmp, "w:xz", preset=6) as tar:
        for mix, dest, _ in packs:
            tar.add(dest, arcname=mix)
    os.replace(tmp, archive)
    unpacked = sum(du(d) for _, d, _ in packs)
    if not args.keep_packs:
        for _, dest, _ in packs:
            shutil.rmtree(dest)
    print(f"cost packs: {sum(n for *_, n in packs)} records in {len(packs)} packs ({unpacked / 2**20:.1f} MiB "
          f"unpacked), archive {os.path.getsize(archive) / 2**20:.2f} MiB at {archive}; {out} holds "
          f"{du(out) / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
