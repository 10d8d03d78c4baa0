"""scripts/bench_balance.py reads every record's cost terms through the loader's reader (equal to
``terms_of`` of the batches written), simulates a grid of steps from a fixed seed by both step
models, and ends with the headline line in its exact form; balanced never slower than the
reference, the bound never above balanced."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from schemas.cost import CostModel, terms_of
from schemas.errors import ConfigError
from tests.helpers.fakepack import BatchSpec, make_batch, write_pack
from tests.helpers.paths import REPO

sys.path.insert(0, os.path.join(REPO, "scripts"))
import bench_balance  # noqa: E402

_NUM = r"(\d+\.\d+)"
_LAST = re.compile(rf"balance: lockstep step time {_NUM} of the reference at W=64 M=4 \(bound {_NUM}\); "
                   rf"step model {_NUM}; samples at M=1: (n/a|{_NUM})")


def _pack(out: str) -> list:
    specs = [BatchSpec(use_flex=i % 2 == 0, n_samples=1 + i % 4, vae=i % 3 != 0, max_side=3 + i % 4) for i in range(10)]
    batches = [make_batch(300 + i, spec) for i, spec in enumerate(specs)]
    write_pack(out, {0: batches[:6], 1: batches[6:]}, world_size=1, num_workers=2)
    return batches


def test_terms_read_through_the_reader_are_the_batches_terms(tmp_path):
    batches = _pack(str(tmp_path / "pack"))
    got = bench_balance.read_terms(str(tmp_path / "pack"))
    assert got.tolist() == [terms_of(b).tolist() for b in batches]  # stream 0's, then stream 1's


def test_a_cell_of_the_simulation():
    rng = np.random.default_rng(0)
    timed = np.c_[rng.choice([5.0, 200.0, 500.0], 50), rng.uniform(80, 500, 50), rng.lognormal(8, 0.05, 50)]
    cell = bench_balance.simulate(timed, 8, 4, steps=5, seed=1)
    assert cell.ideal <= cell.balanced <= cell.reference and cell.reference > 1.0
    assert cell.ideal_time <= cell.step_time < 1.0 and cell.cpu_us > 0
    assert cell.lock_bound <= cell.lock_balanced < 1.0 and cell.lock_reference > 1.0 and cell.lock_cpu_us > 0
    again = bench_balance.simulate(timed, 8, 4, steps=5, seed=1)
    assert dataclasses.replace(again, lock_cpu_us=0, cpu_us=0) == dataclasses.replace(cell, lock_cpu_us=0, cpu_us=0)
    # assigned by a model that sees only the VAE: still never slower than the reference by the timings
    by_vae = np.c_[timed[:, 0], np.zeros(50), np.zeros(50)]
    assert bench_balance.simulate(timed, 8, 4, steps=5, seed=1, priced=by_vae).lock_balanced < 1.0
    one = bench_balance.simulate(timed, 8, 1, steps=3, seed=1)
    assert one.step_time == 1.0 and one.balanced == one.reference and one.lock_balanced == 1.0


def test_a_fit_with_terms_the_model_lacks_is_refused_unless_they_are_zero(tmp_path):
    fit = tmp_path / "fit.json"
    fit.write_text('{"coefficients_ms": {"tokens": 0.08, "vit_images": 0.0}, "intercept_ms": 5}')
    model, _ = bench_balance.model_of(str(fit))
    assert model == CostModel.from_mapping({"tokens": 0.08, "intercept": 5})
    fit.write_text('{"coefficients_ms": {"tokens": 0.08, "vit_images": 1.0}, "intercept_ms": 5}')
    with pytest.raises(ConfigError, match="vit_images"):
        bench_balance.model_of(str(fit))


@pytest.mark.slow  # the whole benchmark in a subprocess (~10 s: the machine line's resize self-test)
def test_bench_balance_tiny_ends_with_the_headline_line(tmp_path):
    _pack(str(tmp_path / "pack"))
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "bench_balance.py"), "--pack",
                           str(tmp_path / "pack"), "--worlds", "8", "--micro", "1,4", "--steps", "3"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("machine: "), lines[0]
    assert any(ln.startswith("records: 10 from 1 pack(s)") for ln in lines), proc.stdout
    assert any(ln.startswith("draw: ") and "seed=0" in ln for ln in lines), proc.stdout
    assert any(ln.startswith("cost model vs docs/data/record_cost_h200.csv") for ln in lines), proc.stdout
    cells = [ln.split() for ln in lines if re.match(r"\s*\d+\s+\d+\s+\d", ln)]
    # the pack by the model, each H200 pack, then both pooled: the headline's cell added to each grid
    assert [(int(c[0]), int(c[1])) for c in cells] == [(8, 1), (8, 4), (64, 4)] * 3 + [(64, 4)]
    for c in cells:
        lock_balanced, lock_bound = float(c[3]), float(c[4])
        reference, balanced, ideal = (float(v) for v in c[6:9])
        assert lock_bound <= lock_balanced <= 1.0 and ideal <= balanced <= reference
    m = _LAST.fullmatch(lines[-1])
    assert m, lines[-1]
    assert float(m[2]) <= float(m[1]) <= 0.93  # issue 50: by the H200 per-part timings
    assert float(m[3]) <= 1.0 and 0 < float(m[4]) <= 1.0  # balanced samples never slower
