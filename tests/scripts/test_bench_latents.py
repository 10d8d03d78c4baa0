"""scripts/bench_latents.py: the step model by the H200 per-part timings (without the VAE segment
never slower; balanced micro-steps faster still), the bytes of a pack and its latents, and the
whole bench on a tiny pack ending with its exact last line."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.helpers.fakepack import make_pack
from tests.helpers.paths import REPO

sys.path.insert(0, os.path.join(REPO, "scripts"))
import bench_latents  # noqa: E402

_NUM = r"(\d+\.\d+)"
_LAST = re.compile(rf"latents: step time {_NUM} of pixels at W=64 M=4 \((measured|model)\); encode {_NUM} "
                   rf"pictures/s on (.+); bytes {_NUM} of the pixel pack")


def test_the_step_without_the_encode_by_the_h200_timings():
    x, balanced, vae_ms = bench_latents.step_model(bench_latents.CHECK_CSV, steps=20, seed=0)
    assert 0.8 < x < 1.0  # the VAE is ~6% of a record and the most variable part: more than 6% of a step
    assert balanced < x
    assert 100 < vae_ms < 400


def test_pack_bytes_count_shards_and_latents(tmp_path):
    out = str(tmp_path / "pack")
    make_pack(out, world_size=1, num_workers=1, lengths=[3], shard_bytes=30 * 1024)
    shards, latents = bench_latents.pack_bytes(out)
    assert shards == sum(os.path.getsize(os.path.join(out, "stream-00000", f))
                         for f in os.listdir(os.path.join(out, "stream-00000")) if f.startswith("shard-")
                         and f.endswith(".arrow") and f.count(".") == 1)
    assert latents == 0


@pytest.mark.slow  # the encoder at BAGEL's sizes on a tiny pack, in a subprocess (~30 s)
def test_bench_latents_tiny_ends_with_its_line(tmp_path):
    out = str(tmp_path / "pack")
    make_pack(out, world_size=1, num_workers=1, lengths=[2], shard_bytes=30 * 1024)
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "bench_latents.py"), "--pack", out,
                           "--device", "cpu", "--steps", "5"], cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("machine: ")
    assert any(ln.startswith("encode on cpu") for ln in lines) and any(ln.startswith("bytes: ") for ln in lines)
    m = _LAST.fullmatch(lines[-1])
    assert m, lines[-1]
    assert float(m[1]) < 1.0 and m[2] == "model" and float(m[3]) > 0 and m[4] == "cpu" and float(m[5]) > 1.0
