#!/usr/bin/env python
"""Packing throughput per core: this packer vs the reference online PackedDataset, same batches.

Realistic data (photographs of ~0.8 MP with sensor noise) and the NeMo pretrain knobs (expected
32768 / max 36864 / per-sample 16384), flex; the reference runs with one torch thread, as inside
a DataLoader worker.  Two figures, both in CPU seconds (``time.process_time``: every thread of
the process, so a helper thread never makes a figure look better than the work it burns):

- **end to end** (the headline): the real ``prepack run`` command, one stream (stream 0 of
  W=1, K=2), default ``compression`` and ``shard_bytes``, on a local Ray with one CPU.  The
  stream's Ray worker records its own CPU time (``cpu_s`` in its done entry: packing, encoding,
  compression, shard files, checkpoints, lineage, fsyncs, progress reports, Ray's own threads).
  Start-up (Ray, worker imports, tokenizer, first-use warm-up) is excluded by packing
  ``--skip`` batches and ``--skip + --batches`` batches and taking the difference; the reference
  is timed over exactly those batches of the same stream.  Output records are compared with the
  reference tensor for tensor before any figure is printed.  Best of ``--reps`` runs per side
  (CPU time only ever grows with interference from other processes).
- **in process**: ``StreamPacker`` in this process to a finished record (encode + compress), no
  files: where the packing code itself stands.

- **the floor** (``--floor``): the in-process pass again under cProfile, split into the three C
  calls the output bytes are defined by — libjpeg's decode (inside Pillow), the exact resize (the
  kernel the router chose) and zstd — and everything else.  No packer that writes these bytes can
  cost less than those three, so the reference's CPU per batch over their sum bounds the ratio.

``--ray`` also packs W*K streams on a local Ray with 1 and then 2 CPUs (wall time).

    python scripts/bench_pack.py --batches 6               # in-process and end-to-end
    python scripts/bench_pack.py --batches 6 --no-e2e      # in-process only (fast)
    python scripts/bench_pack.py --batches 10 --no-e2e --floor   # where the CPU goes, and the bound
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "helpers"), os.path.dirname(os.path.abspath(__file__))]

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402


# NeMo's BAGEL pretrain packing knobs (flex attention; CFG dropout of the ViT and VAE conditions)
NEMO_PRETRAIN_KNOBS = dict(expected_num_tokens=32768, max_num_tokens=36864, max_num_tokens_per_sample=16384,
                           prefer_buffer_before=16384, max_buffer_size=50, use_flex=True,
                           vit_cond_dropout_prob=0.3, vae_cond_dropout_prob=0.3)


def make_data(root: str, seed: int = 0, size: tuple[int, int] = (700, 1200)):
    """The benchmark's dataset under ``root``: photographs with sides in ``size`` (t2i, edit, SFT)."""
    import datagen as dg

    rs = np.random.RandomState(seed)

    def big(i):
        # skimage's photographs are small; upscaled they are smoother than camera photos, which
        # flatters both decoding and compression.  Sensor-like noise restores realistic detail.
        img = np.asarray(dg.photo(i, rs, *size), dtype=np.int16)
        noisy = np.clip(img + rs.normal(0, 6, img.shape), 0, 255).astype(np.uint8)
        return Image.fromarray(noisy)

    ds = dg.Dataset(root)
    t2i = [[{"image": dg.jpeg(big(10 * f + i), 90), "captions": '{"c0": "%s", "c1": "%s"}'
             % (dg.sentence(rs, 10, 40), dg.sentence(rs, 10, 40))} for i in range(10)] for f in range(4)]
    dg.add_t2i(ds, t2i, row_group_size=5)
    edits = []
    for f in range(4):
        rows = []
        for i in range(6):
            base = big(7 * f + i)
            imgs = [dg.jpeg(base, 90)] + [dg.jpeg(base.rotate(10 * (j + 1)), 90) for j in range(2)]
            rows.append({"image_list": imgs, "instruction_list": [[dg.sentence(rs, 5, 15)] for _ in range(2)]})
        edits.append(rows)
    dg.add_edit(ds, edits, row_group_size=3)
    lines, files = [], {}
    for i in range(40):
        name = f"img_{i}.jpg"
        files[name] = dg.jpeg(big(i), 90)
        lines.append('{"image": "%s", "conversations": [{"from": "human", "value": "<image>\\n%s"}, '
                     '{"from": "gpt", "value": "%s"}]}' % (name, dg.sentence(rs), dg.sentence(rs, 60, 200)))
    dg.add_sft(ds, lines, files)
    return nemo_pretrain_transforms(ds)


def nemo_pretrain_transforms(ds):
    """``ds`` with the image transforms of NeMo's BAGEL pretrain recipe on its three groups."""
    ds.groups["t2i_pretrain"]["image_transform_args"] = {"image_stride": 16, "max_image_size": 1024, "min_image_size": 512}
    ds.groups["unified_edit"]["image_transform_args"] = {"image_stride": 16, "max_image_size": 1024, "min_image_size": 512}
    ds.groups["unified_edit"]["vit_image_transform_args"] = {"image_stride": 14, "max_image_size": 518, "min_image_size": 224}
    ds.groups["vlm_sft"]["image_transform_args"] = {"image_stride": 14, "max_image_size": 980, "min_image_size": 378,
                                                    "max_pixels": 2_007_040}
    return ds


def reference_cpu_per_batch(cfg, stream: int, tok, first: int, count: int, keep: bool = True) -> tuple[float, list[dict]]:
    """CPU seconds the reference spends on batches ``first .. first+count-1`` of ``stream``, and
    (with ``keep``) those batches (``to_dict()``), iterated as in DataLoader worker w of rank r."""
    import oracle
    from nemo_automodel.components.datasets.multimodal import SimpleCustomBatch as RefBatch

    rank, worker = cfg.stream_rank_worker(stream)
    out = []
    with oracle.as_dataloader_worker(worker, cfg.num_workers):
        it = iter(oracle.reference_dataset(cfg, rank, tok))
        for _ in range(first):
            RefBatch([next(it)]).to_dict()
        t0 = time.process_time()
        for _ in range(count):
            batch = RefBatch([next(it)]).to_dict()
            if keep:  # ~120 MiB each: kept for one run only
                out.append(batch)
        cpu = time.process_time() - t0
    return cpu, out


def prepack_run_cpu(config: str, out: str, stream: int) -> tuple[float, int, int]:
    """Run the real ``prepack run`` for one stream on a one-CPU local Ray; (worker CPU s, tokens,
    records) from the stream's done entry.

    ``PREPACK_REUSE_OWN=0``: this dataset is small, so 26 batches read a stream's slice more than
    once, and the stream would take its later passes' pictures from its own shards (70 ms/batch
    instead of ~130 here).  The figure is a first pass over data, which is what a user's first pack
    of a large set costs; later passes are ``bench_reuse.py --passes``'s figure."""
    from schemas.layout import done_file
    from schemas.manifest import StreamSummary

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
               PREPACK_REUSE_OWN="0")
    cmd = [sys.executable, "-m", "prepack.cli", "run", config, "--out", out, "--streams", str(stream),
           "--num-cpus", "1", "--no-progress"]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"prepack run failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    with open(os.path.join(out, done_file(stream)), "rb") as f:
        entry = StreamSummary.from_json(f.read())
    return entry.cpu_s, entry.num_tokens, entry.num_records


def stream_records(out: str, stream: int) -> list:
    """The records of one packed stream, in order, through the loader's reader (digests checked)."""
    from loader.reader import Pack, iter_records

    return [rec for _, rec in iter_records(Pack.open(out), stream)]

# cProfile's names of the C calls the output bytes are defined by (the resize is the router's
# functions that call a kernel: a ctypes or numba call is not a profiled function, and the Python
# around it is a few lines; the C kernel runs in NativeKernel._run, coding as it resizes)
_FLOOR_PARTS = {
    "JPEG decode": lambda file, name: name == "<method 'decode' of 'ImagingDecoder' objects>",
    "resize": lambda file, name: (file.endswith(os.path.join("resize", "router.py")) and name in ("_run", "resize"))
    or name == "<method 'resize' of 'ImagingCore' objects>",
    "zstd": lambda file, name: "ZstdCompressor" in name,
}


def floor_profile(pack_and_encode, batches: int) -> tuple[dict[str, float], float]:
    """Run ``pack_and_encode()`` under cProfile: (ms per batch inside each of ``_FLOOR_PARTS``,
    ms per batch in all, by the process's CPU time)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    t0 = time.process_time()
    prof.enable()
    pack_and_encode()
    prof.disable()
    total = (time.process_time() - t0) / batches * 1e3
    parts = dict.fromkeys(_FLOOR_PARTS, 0.0)
    for (file, _line, name), (_cc, _nc, tottime, _ct, _callers) in pstats.Stats(prof).stats.items():
        for part, match in _FLOOR_PARTS.items():
            if match(file, name):
                parts[part] += tottime / batches * 1e3
    return parts, total


def print_floor(parts: dict[str, float], total: float, references: dict[str, float]) -> None:
    floor = sum(parts.values())
    print("floor, in process under cProfile: " + ", ".join(f"{k} {v:.1f}" for k, v in parts.items())
          + f" ms/batch = {floor:.1f} of {total:.1f} ms/batch; everything else {total - floor:.1f} ms/batch")
    for label, ref_ms in references.items():
        print(f"floor bound vs the reference {label} ({ref_ms:.0f} ms/batch): at most {ref_ms / floor:.2f}x "
              f"per core for any packer writing these bytes; now {ref_ms / total:.2f}x here")


def quiet(label: str) -> None:
    """Start a timed run on a quiet machine (``machine.wait_quiet``); say so when it is not."""
    from machine import wait_quiet

    busy = wait_quiet()
    if busy >= 0.15:
        print(f"note: the machine stayed {busy:.0%} busy before the {label} run (other work alongside)")


def end_to_end(ds, knobs: dict, skip: int, batches: int, reps: int, tok) -> float:
    """``prepack run`` (default compression and shard size) vs the reference, per core; returns the
    reference's best CPU ms per batch."""
    from compare import diff_batches
    from loader.batch import SimpleCustomBatch
    from schemas.config_file import load_config
    from schemas.record import record_to_batch

    configs = {}
    for n in (skip, skip + batches):
        path = ds.config(knobs=knobs, num_workers=2, prepack={"batches_per_stream": n})
        configs[n] = path.replace("config.yaml", f"config-e2e-{n}.yaml")
        os.replace(path, configs[n])
    cfg = load_config(configs[skip + batches])
    runs: dict[int, list[tuple[float, int, int]]] = {skip: [], skip + batches: []}
    ref_runs: list[float] = []
    last_out = None
    for rep in range(reps):  # the sides alternate, so a busy spell on the machine hits both
        for n, path in configs.items():
            out = tempfile.mkdtemp(prefix=f"e2e-{n}-")
            quiet(f"ours, {n} batches")
            runs[n].append(prepack_run_cpu(path, out, 0))
            if n == skip + batches and last_out is None:
                last_out = out  # compared with the reference below
            else:
                shutil.rmtree(out)
        # timed without keeping the batches (a DataLoader hands each on and frees it; keeping 24
        # batches of ~120 MiB made the kept run's CPU time ~1.7x higher: new pages for every batch)
        quiet("reference")
        ref_runs.append(reference_cpu_per_batch(cfg, 0, tok, skip, batches, keep=False)[0])
    _, ref = reference_cpu_per_batch(cfg, 0, tok, skip, batches)  # untimed: the batches to compare with
    small, large = (min(runs[n]) for n in (skip, skip + batches))
    cpu, tokens = large[0] - small[0], large[1] - small[1]
    ref_cpu = min(ref_runs)
    # each rep alternates the sides: its own ratio, so the median says what a typical run gets
    ratios = sorted(ref / (b[0] - a[0]) for a, b, ref in zip(runs[skip], runs[skip + batches], ref_runs))
    print(f"end to end, every run (CPU s): ours {skip} batches {[r[0] for r in runs[skip]]}, "
          f"{skip + batches} batches {[r[0] for r in runs[skip + batches]]}; "
          f"reference {batches} batches {[round(r, 2) for r in ref_runs]}")
    print(f"end to end, per alternating run: ratios {[round(r, 2) for r in ratios]}, "
          f"median {statistics.median(ratios):.2f}x (spread {ratios[0]:.2f}-{ratios[-1]:.2f})")
    ours = stream_records(last_out, 0)[skip:]
    shutil.rmtree(last_out)
    for i, (rec, r) in enumerate(zip(ours, ref, strict=True)):
        diffs = diff_batches(SimpleCustomBatch(record_to_batch(rec)).to_dict(), r)
        if diffs:
            sys.exit(f"prepack run output differs from the reference at batch {skip + i}: {diffs[:3]}")
    ref_tokens = sum(r["sequence_length"] for r in ref)
    assert ref_tokens == tokens, (ref_tokens, tokens)
    print(f"end to end: prepack run, stream 0, default compression and shard_bytes, batches {skip + 1}..{skip + batches} "
          f"(identical to the reference), {tokens:,} tokens; worker CPU best of {reps}: "
          f"{small[0]:.2f} s for {skip} batches, {large[0]:.2f} s for {skip + batches}")
    print(f"ours, prepack run : {tokens / cpu:10,.0f} tokens/s per core ({cpu:.2f} s CPU of the Ray worker, "
          f"{cpu / batches * 1e3:.0f} ms/batch)")
    print(f"reference         : {tokens / ref_cpu:10,.0f} tokens/s per core ({ref_cpu:.2f} s CPU, "
          f"{ref_cpu / batches * 1e3:.0f} ms/batch)")
    print(f"ratio, end to end : {ref_cpu / cpu:.2f}x the reference per core, best of {reps} per side; "
          f"median of alternating runs {statistics.median(ratios):.2f}x")
    return ref_cpu / batches * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--flex", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--ray", action="store_true", help="also measure 1 vs 2 Ray workers")
    ap.add_argument("--compression", default="zstd:1", help="record compression for the in-process write figure")
    ap.add_argument("--e2e", action=argparse.BooleanOptionalAction, default=True,
                    help="also measure the real prepack run command (the headline figure)")
    ap.add_argument("--skip", type=int, default=2, help="end to end: batches whose cost (with start-up) is subtracted")
    ap.add_argument("--e2e-batches", type=int, default=24, help="end to end: batches timed after --skip")
    ap.add_argument("--reps", type=int, default=2, help="end to end: runs per side, best taken")
    ap.add_argument("--floor", action="store_true",
                    help="also split the in-process pass into decode, resize, zstd and the rest (cProfile)")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    import oracle
    from compare import diff_batches
    from loader.batch import SimpleCustomBatch
    from prepack.engine.packer import StreamPacker
    from prepack.engine.tokenizer import load_tokenizer, special_token_ids
    from prepack.run.worker_process import settle_worker_process
    from schemas.compression import Compression
    from schemas.config_file import load_config
    from schemas.record import RECORD_SCHEMA, encode_record, record_to_batch
    import pyarrow as pa

    tmp = tempfile.mkdtemp(prefix="bench-pack-")
    ds = make_data(tmp)
    knobs = dict(NEMO_PRETRAIN_KNOBS, use_flex=args.flex)
    cfg = load_config(ds.config(knobs=knobs, num_workers=2, prepack={"batches_per_stream": args.batches}))
    tok, special = special_token_ids(load_tokenizer("qwen2-offline"))
    n = args.batches
    from machine import machine_line

    print(machine_line())

    # warm both code paths (imports, caches) on another stream
    list(StreamPacker(cfg, 1, tok, special))
    oracle.reference_batches(cfg, 1, tok, 1)
    settle_worker_process()  # the process settings a prepack run worker packs with

    compression = Compression.parse(args.compression)
    opts = compression.write_options()

    def encode(b) -> tuple[pa.RecordBatch, int]:
        rec = encode_record(b, compression).record
        buf = pa.BufferOutputStream()
        with pa.ipc.new_stream(buf, RECORD_SCHEMA, options=opts) as w:
            w.write_batch(rec)
        return rec, buf.getvalue().size

    t0 = time.process_time()
    w0 = time.perf_counter()
    batches = list(StreamPacker(cfg, 0, tok, special))
    pack_cpu, pack_wall = time.process_time() - t0, time.perf_counter() - w0
    t0 = time.process_time()
    encoded = [encode(b) for b in batches]
    write_cpu = time.process_time() - t0
    ours, nbytes = [rec for rec, _ in encoded], sum(size for _, size in encoded)
    del batches, encoded

    t0 = time.process_time()
    w0 = time.perf_counter()
    ref = oracle.reference_batches(cfg, 0, tok, n)
    ref_cpu, ref_wall = time.process_time() - t0, time.perf_counter() - w0

    for i, (rec, r) in enumerate(zip(ours, ref)):
        diffs = diff_batches(SimpleCustomBatch(record_to_batch(rec)).to_dict(), r)
        if diffs:
            sys.exit(f"output differs from the reference at batch {i}: {diffs[:3]}")
    tokens = sum(r["sequence_length"] for r in ref)
    print(f"batches: {n} (stream 0, identical to the reference), {tokens:,} packed tokens, "
          f"{tokens / n:,.0f} tokens/batch, flex={args.flex}")
    print(f"ours, pack        : {tokens / pack_cpu:10,.0f} tokens/s per core ({pack_cpu:.2f} s CPU, {pack_wall:.2f} s wall)")
    print(f"ours, pack + write: {tokens / (pack_cpu + write_cpu):10,.0f} tokens/s per core "
          f"(+{write_cpu:.2f} s to encode and {args.compression}-compress, {nbytes / n / 2**20:.1f} MiB/record)")
    print(f"reference         : {tokens / ref_cpu:10,.0f} tokens/s per core ({ref_cpu:.2f} s CPU, {ref_wall:.2f} s wall)")
    print(f"ratio             : {ref_cpu / pack_cpu:.2f}x the reference per core packing; "
          f"{ref_cpu / (pack_cpu + write_cpu):.2f}x including the {args.compression} record write")
    references = {"in process": ref_cpu / n * 1e3}
    if args.e2e:
        references["end to end, best"] = end_to_end(ds, knobs, args.skip, args.e2e_batches, args.reps, tok)
    if args.floor:
        parts, total = floor_profile(lambda: [encode(b) for b in StreamPacker(cfg, 0, tok, special)], n)
        print_floor(parts, total, references)

    if args.ray:
        from prepack.run.driver import RunOptions, run_pack

        for cpus in (1, 2):
            out = os.path.join(tmp, f"ray-{cpus}")
            t = time.perf_counter()
            s = run_pack(cfg, out, RunOptions(bar=False, num_cpus=cpus))
            wall = time.perf_counter() - t
            pack = max(e.elapsed_s for e in s.streams)
            toks = sum(e.num_tokens for e in s.streams)
            print(f"ray num_cpus={cpus}: {len(s.streams)} streams, {toks:,} tokens, {wall:.1f} s wall incl. Ray start, "
                  f"{toks / wall:,.0f} tokens/s overall, slowest stream {pack:.1f} s")


if __name__ == "__main__":
    main()
