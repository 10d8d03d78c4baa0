"""scripts/bench_continue.py packs OLD, a fresh pack of B and a continuation of OLD on tiny demo
budgets, prints each side's whole job (in process and as a process), and ends with the headline
line in its exact form (no timing is asserted); its profile
charges a function without a category to the functions that called it."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.helpers.paths import REPO

sys.path.insert(0, os.path.join(REPO, "scripts"))
import bench_continue  # noqa: E402

_NUM = r"(-?\d+\.\d+)"
_LAST = re.compile(rf"continue: {_NUM} ms CPU/batch vs fresh {_NUM} ms CPU/batch \({_NUM}x less\); "
                   r"switch start-up (\d+) ms/stream; reused (\d+) of (\d+) pictures")


@pytest.mark.slow  # packs three times through the benchmark script (~30 s)
def test_bench_continue_tiny_ends_with_the_headline_line():
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "bench_continue.py"), "--after", "2",
                           "--skip", "1", "--batches", "2", "--old-batches", "6", "--reps", "1", "--fresh-reuse",
                           "--profile", "--job-batches", "3", "--no-process"], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("machine: "), lines[0]
    for side in ("fresh", "continue", "fresh --reuse OLD"):
        assert any(ln.startswith(f"  {side:17}: CPU best ") for ln in lines), proc.stdout
        assert any(ln.startswith(f"{side}, profiled: ") for ln in lines), proc.stdout
    assert any(ln.startswith("fixed costs: the switch (switch_at alone) best ") for ln in lines), proc.stdout
    # the whole job beside the per-batch figures: in process and as a `prepack run` process, each side
    assert any(ln.startswith("the whole job, 3 batches per stream x 2 streams, start-up included") for ln in lines)
    # (--no-process: the whole job as a `prepack run` process of its own is left out, to keep the suite short)
    for side in ("fresh", "continue", "fresh --reuse OLD"):
        assert any(ln.startswith(f"  {side:17}: in process (run_pack, the tokenizer loaded) ") and "as a process" not in ln
                   for ln in lines), proc.stdout
    assert not any(ln.startswith("  a prepack run process's start-up") for ln in lines)
    m = _LAST.fullmatch(lines[-1])
    assert m, lines[-1]
    continued, fresh, ratio = float(m[1]), float(m[2]), float(m[3])
    switch, reused, pictures = int(m[4]), int(m[5]), int(m[6])
    # the ratio of the two figures, within their rounding (each to its last printed digit: +-0.05 at one
    # decimal; a small figure's rounding moves the ratio most)
    dc, df = (0.5 * 10 ** -len(m[i].split(".")[1]) for i in (1, 2))
    lo, hi = (fresh - df) / (continued + dc), (fresh + df) / max(continued - dc, 1e-9)
    assert lo - 0.01 <= ratio <= hi + 0.01, (ratio, lo, hi)
    assert switch > 0 and 0 < reused <= pictures  # a continuation reuses OLD's pictures


def test_a_function_without_a_category_is_charged_to_its_callers():
    packer = (os.path.join(bench_continue.ROOT, "prepack", "engine", "packer.py"), 1, "_batches")
    writer = (os.path.join(bench_continue.ROOT, "prepack", "run", "writer.py"), 1, "append")
    helper = ("/usr/lib/python3.11/json/encoder.py", 1, "iterencode")  # the standard library: no category
    leaf = ("~", 0, "<built-in method posix.pwrite>")
    stats = {  # (cc, nc, tottime, cumtime, callers: caller -> (cc, nc, tottime, cumtime) of its calls)
        packer: (1, 1, 1.0, 2.0, {}),
        writer: (1, 1, 0.5, 2.5, {}),
        helper: (2, 2, 1.0, 1.5, {packer: (1, 1, 0.5, 0.75), writer: (1, 1, 0.5, 0.75)}),
        leaf: (2, 2, 2.0, 2.0, {helper: (1, 1, 0.5, 0.5), writer: (1, 1, 1.5, 1.5)}),
    }
    spent = bench_continue.where_cpu(stats)
    assert set(spent) == {"layout and packing", "shard files and index"}
    # the helper half each; the leaf 1/4 through the helper (then half each), 3/4 from the writer
    assert abs(spent["layout and packing"] - (1.0 + 0.5 + 0.25)) < 1e-9
    assert abs(spent["shard files and index"] - (0.5 + 0.5 + 0.25 + 1.5)) < 1e-9
    assert abs(sum(spent.values()) - 4.5) < 1e-9


def test_a_token_budget_keeps_nemo_pretrain_proportions():
    knobs = bench_continue.token_knobs(10240)  # the photographs' VLM-heavy budget
    assert knobs == dict(expected_num_tokens=10240, max_num_tokens=16384, max_num_tokens_per_sample=16384,
                         prefer_buffer_before=8192)
    small = bench_continue.token_knobs(6000)
    assert small["expected_num_tokens"] < small["prefer_buffer_before"] * 2 <= small["max_num_tokens"] * 2
