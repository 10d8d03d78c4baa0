#!/usr/bin/env python
"""What a continuation (``prepack run B.yaml --out NEW --continue OLD --after N``) costs against a
fresh pack of the same new config B: CPU per batch of NEW's own batches, end to end through the
product path, and the fixed cost of the switch per stream.

OLD is a finished pack of config A (W=1, K=2: 2 streams): ``--data demo`` (default) the demo data
(``prepack demo-data``) under ``configs/demo.yaml``; ``--data photos`` ``bench_pack.py``'s
camera-sized photographs under NeMo's pretrain knobs (as ``bench_reuse.py`` and ``bench_s3.py
--data photos``).  ``--mix vlm`` makes A VLM-heavy (weights t2i 1, edit 1, vlm 8; with the
photographs also a smaller token budget, expected_num_tokens 10240).  ``--tokens N`` sets the
budget of either (``--data demo --mix vlm --tokens 10240``: small pictures at a 10k-token budget);
``--shard-bytes`` the shards' size (the demo config's 16 MiB commit a shard every few batches).
B is A annealed: one group's weight x4 (``--anneal``), a budget of batches per stream.  OLD runs ``--after`` batches
plus enough beyond them to hold what NEW reads next (a training that switches mid-run).

Both sides run in this process as ``prepack run --no-ray`` does (``run_pack(..., RunOptions(inline=True))``,
one stream after another, the packing worker's allocator settings), with the tokenizer loaded
once before any timing and passed in.  OLD's pixel catalog (built once per OLD, by the first run
that reuses it) is built and timed alone first; the resize kernel, the imports and the page cache
are warmed by an untimed run of each side.  CPU is ``time.process_time()`` of this process (every
thread: the read-ahead threads too), wall time beside it: around each ``run_pack`` call, and
inside it each stream's own window (its done.json ``cpu_s`` / ``elapsed_s``: the same clocks from
the stream's start, the switch included, to its done.json).

- **fresh**: ``run_pack(B, FRESH)``;
- **continue**: ``run_pack(B, NEW, RunOptions(continue_from=Continue(OLD, N)))``: each stream's state after
  OLD's batch N (``prepack.run.chain.switch_at``: OLD's checkpoint read, at most one shard of
  batches replayed with the pictures from OLD's shards), then B's batches, OLD's chain's pictures
  reused (``--reuse`` implied);
- ``--fresh-reuse`` adds **fresh --reuse OLD**: ``run_pack(B, FRESH, RunOptions(reuse=[OLD]))``, a fresh pack of
  B that takes OLD's pixels (what separates the continuation from reuse alone).

Per batch: each side packs ``--skip`` and ``--skip + --batches`` batches per stream and the
difference of the streams' CPU is taken (as ``bench_reuse.py`` does), so every fixed cost
(opening sources, the switch, the first shard) cancels and the figure is what one more of NEW's
own batches costs (OLD's batches are never counted).  The fixed costs are printed on their own:
the switch (``switch_at`` alone per stream, after ``open_parent(OLD)``), the job outside its
streams (``run_pack``'s CPU less its streams': pack identity and tokenizer fingerprint, OLD's
checks and catalogs, the manifest), and from them after how many batches per stream a
continuation costs less than a fresh pack.  The sides alternate (the order flips each rep),
``--reps`` times; best and median are printed, the last line has the best.  A stream's own
earlier shards are not reused (``PREPACK_REUSE_OWN=0``, as in ``bench_reuse.py``: the small data
sets here would be read several times over, which a real data set is not within a budget);
``--own-reuse`` leaves it on.  ``--profile`` then packs each side at both budgets again with
cProfile on inside each stream's packing (the switch and the job outside the streams left out)
and prints, per category, the difference: where one more batch's CPU goes (a C function such as
the JPEG decoder, zstd or the resize counts as itself; the standard library, numpy and pyarrow as
the project code that called them).  cProfile sees the packing thread only and slows Python code
more than C, so its totals are above the measured ones.

**The whole job** (what a user pays for a small pack, start-up included), beside the per-batch
figure: each side also packs ``--job-batches`` batches per stream (default 24), measured two ways,
sides alternating, ``--reps`` times (median and best printed):

- **in process**: the CPU of the whole ``run_pack`` call (the job's own start-up included: pack
  identity, the tokenizer fingerprint, OLD's checks, indexes and catalog, every stream's start and
  end, the manifest), the tokenizer loaded before, as above;
- **as a process**: ``prepack run B.yaml --out X --no-ray`` (with ``--reuse OLD`` or ``--continue OLD
  --after N``) as a user runs it, in a process of its own: the interpreter, the imports and the
  tokenizer's load included (CPU: its rusage, user + system).  ``--no-process`` leaves it out.  Its
  start-up is broken down once, in another process: the interpreter, ``prepack run``'s imports
  (and whether they bring torch), the tokenizer's load, its fingerprint (from the record).

Last line, exactly:
``continue: X ms CPU/batch vs fresh Y ms CPU/batch (Rx less); switch start-up Z ms/stream; reused I of J pictures``

    python scripts/bench_continue.py --fresh-reuse --profile               # demo data, ~2.5 min on 2 cores
    python scripts/bench_continue.py --fresh-reuse --profile --mix vlm
    python scripts/bench_continue.py --fresh-reuse --mix vlm --tokens 10240  # issue 45's whole job, ~6 min
    python scripts/bench_continue.py --fresh-reuse --profile --data photos  # ~3 min
    python scripts/bench_continue.py --fresh-reuse --no-process            # the per-batch figures, ~1 min
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "helpers"), os.path.dirname(os.path.abspath(__file__))]

GROUPS = ("t2i_pretrain", "unified_edit", "vlm_sft")
VLM_WEIGHTS = {"t2i_pretrain": 1, "unified_edit": 1, "vlm_sft": 8}
VLM_PHOTO_TOKENS = 10240  # the photographs' VLM-heavy mix's budget (the demo's own is smaller, expected 6144)


def token_knobs(expected: int) -> dict:
    """A token budget in the proportions of NeMo's pretrain knobs (10240 -> max 16384, buffer 8192)."""
    return dict(expected_num_tokens=expected, max_num_tokens=expected * 8 // 5,
                max_num_tokens_per_sample=expected * 8 // 5, prefer_buffer_before=expected * 4 // 5)


def config_a(args, tmp: str) -> tuple[dict, str]:
    """Config A as a YAML document, and the folder its variants are written to (relative data paths
    stay valid there)."""
    if args.data == "photos":
        from bench_pack import NEMO_PRETRAIN_KNOBS, make_data

        ds = make_data(os.path.join(tmp, "photo-data"))
        path = ds.config(knobs=NEMO_PRETRAIN_KNOBS, num_workers=2, prepack={"batches_per_stream": 1})
        raw = yaml.safe_load(open(path))
        raw["prepack"].pop("shard_bytes", None)  # the default 256 MiB, as bench_reuse.py
    else:
        from ray_helpers import make_demo

        path = make_demo(tmp)  # tmp/demo-data (prepack demo-data) and tmp/configs/demo.yaml
        raw = yaml.safe_load(open(path))
    tokens = args.tokens or (VLM_PHOTO_TOKENS if args.data == "photos" and args.mix == "vlm" else None)
    if tokens:
        raw["dataset"].update(token_knobs(tokens))
    if args.shard_bytes:
        raw["prepack"]["shard_bytes"] = args.shard_bytes
    if args.mix == "vlm":
        for group, w in VLM_WEIGHTS.items():
            raw["dataset"]["grouped_datasets"][group]["weight"] = w
    return raw, os.path.dirname(path)


def variant(raw: dict, folder: str, name: str, *, weights: dict | None = None, **prepack) -> str:
    doc = yaml.safe_load(yaml.safe_dump(raw))
    for group, w in (weights or {}).items():
        doc["dataset"]["grouped_datasets"][group]["weight"] = w
    doc["prepack"].update(prepack)
    path = os.path.join(folder, f"{name}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(doc, f, sort_keys=False)
    return path


class Run:
    """One timed ``run_pack``: CPU and wall seconds of the whole call, and its streams' done.json
    (each with ``cpu_s``: the same clock from the stream's start to its end, the switch included)."""

    def __init__(self, cpu_s: float, wall_s: float, streams: list):
        self.cpu_s, self.wall_s, self.streams = cpu_s, wall_s, streams
        self.stream_cpu_s = sum(s.cpu_s for s in streams)
        self.stream_wall_s = sum(s.elapsed_s for s in streams)


def pack(config: str, out: str, tok, *, old: str | None = None, after: int | None = None,
         reuse: tuple[str, ...] = ()) -> Run:
    from prepack.run.chain import Continue
    from prepack.run.driver import RunOptions, run_pack
    from schemas.config_file import load_config

    cfg = load_config(config)  # outside the timing: the same on every side
    how = Continue(old, after) if old is not None else None
    c0, w0 = time.process_time(), time.perf_counter()
    summary = run_pack(cfg, out, RunOptions(inline=True, bar=False, reuse=reuse, continue_from=how), tokenizer=tok)
    return Run(time.process_time() - c0, time.perf_counter() - w0, summary.streams)


def switch_cpu(old: str, after: int, streams: int, tok) -> tuple[float, list[float], list[int]]:
    """CPU of opening OLD, and per stream of ``switch_at`` alone (its checkpoint read, its replay),
    with the batches each replays."""
    from prepack.run.chain import open_parent, switch_at

    c0 = time.process_time()
    parent = open_parent(old)
    opened = time.process_time() - c0
    each, replayed = [], []
    for s in range(streams):
        c0 = time.process_time()
        switch_at(parent, s, after, *tok)
        each.append(time.process_time() - c0)
        starts = [sh.first_record for sh in parent.index(s).shards]
        replayed.append(after - max(b for b in starts if b <= after))
    return opened, each, replayed


def process_cpu(args: list[str]) -> float:
    """CPU seconds (user + system) of one ``prepack`` command in a process of its own, as a user runs
    it: the interpreter's start, every import and the tokenizer's load included."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-m", "prepack.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the command's process, reaped (and only it)
    if proc.returncode != 0:
        sys.exit(f"prepack {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


_STARTUP = """
import json, resource, sys
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
t0 = cpu()
import prepack.cli, prepack.run.command, prepack.run.driver, prepack.run.stream_job  # what `prepack run` imports
t1 = cpu()
torch = "torch" in sys.modules
from prepack.engine.tokenizer import load_tokenizer, recorded_fingerprint, special_token_ids
from schemas.config_file import load_config
tok, _ = special_token_ids(load_tokenizer(load_config(sys.argv[1]).tokenizer))
t2 = cpu()
recorded_fingerprint(tok)
t3 = cpu()
print(json.dumps({"interpreter": t0, "imports": t1 - t0, "torch": torch, "tokenizer": t2 - t1,
                  "fingerprint": t3 - t2}))
"""


def startup_cpu(config: str) -> dict:
    """Where a ``prepack run`` process's start-up CPU goes (seconds), measured in a process of its own."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-c", _STARTUP, config], cwd=ROOT, env=env, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        sys.exit(f"start-up probe failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- where the CPU goes (cProfile; the switch is left out) ------------------------------------------
# cProfile's names of C calls, whatever calls them (as bench_pack.py's floor)
_LEAVES = (
    ("JPEG decode", lambda file, name: name == "<method 'decode' of 'ImagingDecoder' objects>"),
    ("video decode (decord)", lambda file, name: "/decord/" in file),
    ("resize", lambda file, name: (file.endswith(os.path.join("resize", "router.py")) and name in ("_run", "resize"))
     or name == "<method 'resize' of 'ImagingCore' objects>"),
    ("zstd compress", lambda file, name: "ZstdCompressor" in name or "compress' of 'zstd" in name),
    ("zstd decompress", lambda file, name: "ZstdDecompressor" in name or "decompress" in name),
    ("hashing (XXH3, SHA)", lambda file, name: "xxh" in name or "openssl_" in name or "_hashlib" in name
     or "sha256" in name or "blake2" in name),
    ("tokenizing", lambda file, name: "tokenizers" in name or "/tokenizers/" in file or "/transformers/" in file),
    ("fsync", lambda file, name: "fsync" in name),
)
# the project's own frames, by where they are (first match); anything else (the standard library,
# builtins, numpy, pyarrow) is charged to the frames that called it, in proportion
_PLACES = (
    ("source reads", ("prepack/engine/sources/",)),
    ("reuse: lookups, frame reads", ("prepack/engine/reuse/", "schemas/pixel_index.py", "schemas/pixel_catalog.py")),
    ("JPEG decode", ("prepack/engine/decode.py",)),
    ("resize", ("prepack/engine/resize/",)),
    ("tokenizing", ("prepack/engine/tokenizer.py",)),
    ("layout and packing", ("prepack/engine/sample.py", "prepack/engine/sequence.py", "prepack/engine/packer.py",
                            "prepack/engine/accounting.py")),
    ("record encoding", ("schemas/record.py", "schemas/pixel_table.py", "schemas/compression.py")),
    ("checkpoints", ("prepack/run/commit/checkpoint_files.py", "prepack/engine/state_codec.py", "schemas/checkpoint.py")),
    ("lineage", ("prepack/run/commit/lineage.py",)),
    ("shard files and index", ("prepack/run/", "schemas/")),
    ("loader (OLD's chain)", ("loader/",)),
)


def _category(file: str, name: str) -> str | None:
    for label, match in _LEAVES:
        if match(file, name):
            return label
    path = file.replace(os.sep, "/")
    if path.startswith(ROOT.replace(os.sep, "/") + "/") and "/site-packages/" not in path:
        rel = path[len(ROOT) + 1:]
        for label, places in _PLACES:
            if rel.startswith(places):
                return label
        return "other (project)"
    return None


def where_cpu(stats: dict) -> dict[str, float]:
    """Seconds per category: a function's own time goes to its category, or, for a function that has
    none, to its callers' in proportion to the time each caller's calls took."""
    shares: dict = {}

    def share(key, depth: int = 0) -> dict[str, float]:
        if key in shares:
            return shares[key]
        file, _line, name = key
        cat = _category(file, name)
        if cat is not None:
            out = {cat: 1.0}
        else:
            callers = stats[key][4] if key in stats else {}
            weights = {c: (v[3] or v[2]) for c, v in callers.items() if c != key}
            total = sum(weights.values())
            if depth > 40 or not total:
                out = {"other": 1.0}
            else:
                shares[key] = {"other": 1.0}  # a cycle ends here
                out = {}
                for c, w in weights.items():
                    for k, v in share(c, depth + 1).items():
                        out[k] = out.get(k, 0.0) + v * w / total
        shares[key] = out
        return out

    spent: dict[str, float] = {}
    for key, (_cc, _nc, tottime, _ct, _callers) in stats.items():
        for k, v in share(key).items():
            spent[k] = spent.get(k, 0.0) + tottime * v
    return spent


def profiled(fn, spent: dict[str, float]) -> None:
    """Run ``fn()`` with cProfile on inside each stream's packing (``pack_one_stream``) but not in its
    switch (``switch_at``): the job's start-up and the switch are timed on their own.  Adds seconds per
    category to ``spent``."""
    import cProfile
    import pstats

    from prepack.run import driver, stream_job

    prof = cProfile.Profile()
    real_pack, real_switch = driver.pack_one_stream, stream_job.switch_at

    def toggled(fn, on: bool):  # ``fn`` with the profiler on (or off) while it runs
        def call(*a, **k):
            (prof.enable if on else prof.disable)()
            try:
                return fn(*a, **k)
            finally:
                (prof.disable if on else prof.enable)()
        return call

    driver.pack_one_stream, stream_job.switch_at = toggled(real_pack, True), toggled(real_switch, False)
    try:
        fn()
    finally:
        driver.pack_one_stream, stream_job.switch_at = real_pack, real_switch
    for k, v in where_cpu(pstats.Stats(prof).stats).items():
        spent[k] = spent.get(k, 0.0) + v


def print_profile(label: str, small: dict[str, float], big: dict[str, float], batches: int) -> None:
    """Per category, the difference between the two budgets' profiles: what one more batch costs."""
    per = {k: (big.get(k, 0.0) - small.get(k, 0.0)) / batches * 1e3 for k in set(small) | set(big)}
    total = sum(per.values())
    parts = sorted(per.items(), key=lambda kv: -kv[1])
    print(f"{label}: {total:.1f} ms/batch under cProfile (the packing thread; one more batch, as above): "
          + ", ".join(f"{k} {v:.1f} ({v / total:.0%})" for k, v in parts if abs(v) >= 0.005 * total))


# -- the measurement --------------------------------------------------------------------------------
def print_whole_jobs(jobs: dict[str, list[float]], processes: dict[str, list[float]], batches: int,
                     streams: int) -> None:
    """The whole job's CPU per side (start-up included), and how many times less than a fresh pack's."""
    print(f"the whole job, {batches} batches per stream x {streams} streams, start-up included (ms CPU, median "
          f"and best; x less than fresh, medians):")
    fresh_job = statistics.median(jobs["fresh"])
    for side in jobs:
        job = statistics.median(jobs[side])
        line = (f"  {side:17}: in process (run_pack, the tokenizer loaded) {job * 1e3:.0f}, best "
                f"{min(jobs[side]) * 1e3:.0f} ({fresh_job / job:.2f}x)")
        if processes[side]:
            proc = statistics.median(processes[side])
            line += (f"; as a process (prepack run --no-ray: interpreter, imports, tokenizer load) {proc * 1e3:.0f}, "
                     f"best {min(processes[side]) * 1e3:.0f} ({statistics.median(processes['fresh']) / proc:.2f}x)")
        print(line)


def fmt(xs: list[float]) -> str:
    return f"best {min(xs):.1f}, median {statistics.median(xs):.1f} (every rep {', '.join(f'{x:.1f}' for x in xs)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", choices=("demo", "photos"), default="demo",
                    help="demo: prepack demo-data under configs/demo.yaml (small pictures); photos: bench_pack.py's "
                         "camera-sized photographs under NeMo's pretrain knobs")
    ap.add_argument("--mix", choices=("default", "vlm"), default="default",
                    help="vlm: weights t2i 1, edit 1, vlm 8 (photos: expected_num_tokens 10240)")
    ap.add_argument("--tokens", type=int, default=None,
                    help="expected_num_tokens of both configs (max_num_tokens 1.6x, prefer_buffer_before 0.8x, as "
                         "NeMo's pretrain knobs; default: the data's own, 10240 for photos with --mix vlm)")
    ap.add_argument("--shard-bytes", type=int, default=None,
                    help="shard_bytes of both configs (default: the demo config's 16 MiB; photos: prepack's 256 MiB)")
    ap.add_argument("--anneal", choices=GROUPS, default="unified_edit", help="the group whose weight B multiplies by 4")
    ap.add_argument("--after", type=int, default=None,
                    help="OLD's batches before the switch (default: 10 demo, 6 photos)")
    ap.add_argument("--batches", type=int, default=None,
                    help="NEW's batches timed after --skip (default: 24 demo, 16 photos)")
    ap.add_argument("--skip", type=int, default=2, help="NEW's first batches, whose cost (with start-up) is subtracted")
    ap.add_argument("--old-batches", type=int, default=None,
                    help="OLD's batches per stream (default: --after + 2 x (--skip + --batches))")
    ap.add_argument("--reps", type=int, default=3, help="runs per side, alternating; best and median")
    ap.add_argument("--fresh-reuse", action="store_true", help="also a fresh pack of B with --reuse OLD")
    ap.add_argument("--own-reuse", action="store_true", help="a stream also reuses its own earlier shards (the default "
                    "of prepack run; off here, as in bench_reuse.py)")
    ap.add_argument("--profile", action="store_true",
                    help="then where each side's batch CPU goes (cProfile)")
    ap.add_argument("--job-batches", type=int, default=24,
                    help="batches per stream of the whole-job runs (in process and as a process)")
    ap.add_argument("--no-process", action="store_true",
                    help="leave out the whole job as a process of its own (prepack run --no-ray)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = ap.parse_args()
    after = args.after if args.after is not None else (10 if args.data == "demo" else 6)
    batches = args.batches if args.batches is not None else (24 if args.data == "demo" else 16)
    budgets = (args.skip, args.skip + batches)
    old_batches = args.old_batches or after + 2 * budgets[1]
    if not args.own_reuse:
        os.environ["PREPACK_REUSE_OWN"] = "0"

    from machine import machine_line

    from prepack.engine.tokenizer import load_tokenizer, special_token_ids
    from prepack.run.catalog import ensure_catalog
    from prepack.run.worker_process import settle_worker_process

    tmp = tempfile.mkdtemp(prefix="bench-continue-")
    try:
        raw, folder = config_a(args, tmp)
        print(machine_line())
        tok = special_token_ids(load_tokenizer(raw["tokenizer"]))  # once, outside every timing
        settle_worker_process()  # what prepack run --no-ray gives its process
        logging.getLogger("prepack").setLevel(logging.ERROR)  # the runs' accounting lines, not figures
        weights = {g: raw["dataset"]["grouped_datasets"][g]["weight"] for g in GROUPS}
        annealed = dict(weights, **{args.anneal: weights[args.anneal] * 4})
        cfg_a = variant(raw, folder, "a", batches_per_stream=old_batches)
        cfgs_b = {n: variant(raw, folder, f"b-{n}", weights=annealed, batches_per_stream=n) for n in budgets}
        cfg_job = variant(raw, folder, "b-job", weights=annealed, batches_per_stream=args.job_batches)
        old = os.path.join(tmp, "old")
        knobs = {k: raw["dataset"][k] for k in ("expected_num_tokens", "max_num_tokens")}
        print(f"data {args.data}, mix {args.mix}: A weights {weights}, {knobs}; B: {args.anneal} x4 -> {annealed}")
        c0, w0 = time.process_time(), time.perf_counter()
        built = pack(cfg_a, old, tok)
        n_streams = len(built.streams)
        print(f"OLD: {n_streams} streams x {old_batches} batches of A in {time.perf_counter() - w0:.1f} s "
              f"({(time.process_time() - c0) / (n_streams * old_batches) * 1e3:.1f} ms CPU/batch, start-up included)")
        c0 = time.process_time()
        line = ensure_catalog(old)
        print(f"OLD's pixel catalog, built once per OLD by the first run that reuses it: "
              f"{(time.process_time() - c0) * 1e3:.0f} ms CPU ({line or 'already current'})")

        count = [0]

        def out(label: str) -> str:
            count[0] += 1
            return os.path.join(tmp, f"{label}-{count[0]}")

        sides = {"fresh": lambda c, o: pack(c, o, tok),
                 "continue": lambda c, o: pack(c, o, tok, old=old, after=after)}
        if args.fresh_reuse:
            sides["fresh --reuse OLD"] = lambda c, o: pack(c, o, tok, reuse=(old,))
        for side, run in sides.items():  # untimed: imports, the kernel, the page cache
            run(cfgs_b[budgets[0]], out("warm"))
        runs: dict[str, list[tuple[Run, Run]]] = {side: [] for side in sides}
        switches: list[tuple[float, list[float], list[int]]] = []
        flags = {"fresh": [], "continue": ["--continue", old, "--after", str(after)], "fresh --reuse OLD": ["--reuse", old]}
        jobs: dict[str, list[float]] = {side: [] for side in sides}  # the whole run_pack call, in this process
        processes: dict[str, list[float]] = {side: [] for side in sides}  # prepack run --no-ray, a process of its own
        order = list(sides)
        for rep in range(args.reps):
            for side in order if rep % 2 == 0 else order[::-1]:
                small = sides[side](cfgs_b[budgets[0]], out(side))
                big = sides[side](cfgs_b[budgets[1]], out(side))
                for s in big.streams:
                    if s.num_records != budgets[1]:
                        sys.exit(f"{side}: stream {s.stream} packed {s.num_records} records, not {budgets[1]}")
                runs[side].append((small, big))
                jobs[side].append(sides[side](cfg_job, out(side)).cpu_s)
                if not args.no_process:
                    processes[side].append(process_cpu(["run", cfg_job, "--out", out(f"{side}-process"), "--no-ray",
                                                        "--no-bar", *flags[side]]))
            switches.append(switch_cpu(old, after, n_streams, tok))

        n = batches * n_streams
        per, job = {}, {}
        print(f"per batch of NEW's own (the difference of {budgets[1]} and {budgets[0]} batches per stream, "
              f"{n_streams} streams; ms):")
        for side, rs in runs.items():
            cpu = [(big.stream_cpu_s - small.stream_cpu_s) / n * 1e3 for small, big in rs]
            wall = [(big.stream_wall_s - small.stream_wall_s) / n * 1e3 for small, big in rs]
            whole = [(big.cpu_s - small.cpu_s) / n * 1e3 for small, big in rs]
            per[side] = cpu
            job[side] = [(r.cpu_s - r.stream_cpu_s) * 1e3 for pair in rs for r in pair]
            print(f"  {side:17}: CPU {fmt(cpu)}; wall {fmt(wall)}; CPU around the whole run_pack calls {fmt(whole)}")
        print_whole_jobs(jobs, processes, args.job_batches, n_streams)
        if not args.no_process:
            parts = startup_cpu(cfg_job)
            print(f"  a prepack run process's start-up, ms CPU: interpreter {parts['interpreter'] * 1e3:.0f}, imports "
                  f"{parts['imports'] * 1e3:.0f} (torch {'among them' if parts['torch'] else 'not imported'}), tokenizer "
                  f"load {parts['tokenizer'] * 1e3:.0f}, its fingerprint (recorded) {parts['fingerprint'] * 1e3:.0f}")
        opened = [o * 1e3 for o, _, _ in switches]
        per_stream = [statistics.mean(each) * 1e3 for _, each, _ in switches]
        replayed = switches[-1][2]
        print(f"fixed costs: the switch (switch_at alone) {fmt(per_stream)} ms CPU per stream (after batch {after}: "
              f"{', '.join(str(r) for r in replayed)} batches replayed from a checkpoint); opening OLD "
              f"{statistics.median(opened):.1f} ms per job")
        print("  the job outside its streams (identity, tokenizer fingerprint, OLD's checks and catalogs, manifest), "
              "median ms CPU: " + ", ".join(f"{side} {statistics.median(v):.0f} ({min(v):.0f}-{max(v):.0f})"
                                            for side, v in job.items()))
        extra_job = statistics.median(job["continue"]) - statistics.median(job["fresh"])
        saved = statistics.median(per["fresh"]) - statistics.median(per["continue"])
        fixed = extra_job + n_streams * statistics.median(per_stream)
        print(f"  a continuation's fixed extra over a fresh pack (medians): job {extra_job:.0f} ms + switch "
              f"{n_streams} x {statistics.median(per_stream):.0f} ms = {fixed:.0f} ms CPU; it saves {saved:.1f} ms a "
              + (f"batch, so it costs less from {fixed / (saved * n_streams):.1f} batches per stream on"
                 if saved > 0 else "batch: never less"))
        counted = {}
        for side in sides:
            counts = [s.reuse for s in runs[side][-1][1].streams]
            got = {k: sum(c.get(k, 0) for c in counts) for k in ("images", "reused", "decodes_saved")}
            fallbacks: dict[str, int] = {}
            for c in counts:
                for k, v in c.get("fallbacks", {}).items():
                    fallbacks[k] = fallbacks.get(k, 0) + v
            counted[side] = got
            print(f"  {side:17}: reuse over {budgets[1]} batches/stream: {got['reused']} of {got['images']} pictures "
                  f"reused, {got['decodes_saved']} decodes saved, fallbacks {fallbacks}")

        if args.profile:
            for side in sides:
                spent = {b: {} for b in budgets}
                for b in budgets:
                    profiled(lambda: sides[side](cfgs_b[b], out(f"profile-{side}")), spent[b])
                print_profile(f"{side}, profiled", spent[budgets[0]], spent[budgets[1]], n)

        x, y, z = min(per["continue"]), min(per["fresh"]), min(per_stream)
        got, ratio = counted["continue"], y / x if x else float("nan")
        print(f"continue: {x:.1f} ms CPU/batch vs fresh {y:.1f} ms CPU/batch ({ratio:.2f}x less); "
              f"switch start-up {z:.0f} ms/stream; reused {got['reused']} of {got['images']} pictures")
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
