#!/usr/bin/env python
"""Packing throughput per core: this packer vs the reference online PackedDataset, same batches.

One process, one torch thread (as inside a DataLoader worker), real photographs of ~0.8 MP and the
NeMo pretrain knobs (expected 32768 / max 36864 / per-sample 16384).  Both sides produce the first
N batches of the same stream; the outputs are compared tensor for tensor before any figure is
printed.  Ours is timed to a finished zstd record (pack + encode + compress); the reference to its
collated batch.  ``--ray`` also packs W*K streams on a local Ray with 1 and then 2 CPUs.

    python scripts/bench_pack.py --batches 6
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402


def make_data(root: str, seed: int = 0):
    import datagen as dg

    rs = np.random.RandomState(seed)

    def big(i):
        # skimage's photographs are small; upscaled they are smoother than camera photos, which
        # flatters both decoding and compression.  Sensor-like noise restores realistic detail.
        img = np.asarray(dg.photo(i, rs, 700, 1200), dtype=np.int16)
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
    # NeMo pretrain transforms
    ds.groups["t2i_pretrain"]["image_transform_args"] = {"image_stride": 16, "max_image_size": 1024, "min_image_size": 512}
    ds.groups["unified_edit"]["image_transform_args"] = {"image_stride": 16, "max_image_size": 1024, "min_image_size": 512}
    ds.groups["unified_edit"]["vit_image_transform_args"] = {"image_stride": 14, "max_image_size": 518, "min_image_size": 224}
    ds.groups["vlm_sft"]["image_transform_args"] = {"image_stride": 14, "max_image_size": 980, "min_image_size": 378,
                                                    "max_pixels": 2_007_040}
    return ds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--flex", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--ray", action="store_true", help="also measure 1 vs 2 Ray workers")
    ap.add_argument("--compression", default="zstd:1", help="record compression for the write figure")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    import oracle
    from compare import diff_batches
    from loader.batch import SimpleCustomBatch
    from prepack.engine.packer import StreamPacker
    from prepack.engine.tokenizer import load_tokenizer, special_token_ids
    from prepack.run.writer import Compression
    from schemas.config import load_config
    from schemas.record import RECORD_SCHEMA, batch_to_record, record_to_batch
    import pyarrow as pa

    tmp = tempfile.mkdtemp(prefix="bench-pack-")
    ds = make_data(tmp)
    knobs = dict(expected_num_tokens=32768, max_num_tokens=36864, max_num_tokens_per_sample=16384,
                 prefer_buffer_before=16384, max_buffer_size=50, use_flex=args.flex,
                 vit_cond_dropout_prob=0.3, vae_cond_dropout_prob=0.3)
    cfg = load_config(ds.config(knobs=knobs, num_workers=2, prepack={"batches_per_stream": args.batches}))
    tok, special = special_token_ids(load_tokenizer("qwen2-offline"))
    n = args.batches

    # warm both code paths (imports, caches) on another stream
    list(StreamPacker(cfg, 1, tok, special))
    oracle.reference_batches(cfg, 1, tok, 1)

    t0 = time.process_time()
    w0 = time.perf_counter()
    batches = list(StreamPacker(cfg, 0, tok, special))
    pack_cpu, pack_wall = time.process_time() - t0, time.perf_counter() - w0
    t0 = time.process_time()
    ours, nbytes = [], 0
    opts = Compression.parse(args.compression).write_options() if args.compression != "none" else None
    for b in batches:
        rec = batch_to_record(b)
        buf = pa.BufferOutputStream()
        with pa.ipc.new_stream(buf, RECORD_SCHEMA, options=opts) as w:
            w.write_batch(rec)
        nbytes += buf.getvalue().size
        ours.append(rec)
    write_cpu = time.process_time() - t0

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
    print(f"ratio             : {ref_cpu / pack_cpu:.2f}x the reference per core packing (target >= 1.5x); "
          f"{ref_cpu / (pack_cpu + write_cpu):.2f}x including the {args.compression} record write")

    if args.ray:
        from prepack.run.driver import run_pack

        for cpus in (1, 2):
            out = os.path.join(tmp, f"ray-{cpus}")
            t = time.perf_counter()
            s = run_pack(cfg, out, progress=False, num_cpus=cpus)
            wall = time.perf_counter() - t
            pack = max(e.elapsed_s for e in s.streams)
            toks = sum(e.num_tokens for e in s.streams)
            print(f"ray num_cpus={cpus}: {len(s.streams)} streams, {toks:,} tokens, {wall:.1f} s wall incl. Ray start, "
                  f"{toks / wall:,.0f} tokens/s overall, slowest stream {pack:.1f} s")


if __name__ == "__main__":
    main()
