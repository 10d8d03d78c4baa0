"""What ``prepack run`` prints is about the run, not about each stream.

The same data packed as 2 and as 8 streams, with a per-sample limit that drops samples in every
stream: the output has the same few lines (summary, one announcement per drop reason with its
meaning, those counted only at a stream's end too), not a line per stream; with ``-v`` each stream's drops are there in full.  Once through
Ray (4 streams), where worker logs are forwarded to the driver.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import datagen as dg
from tests.helpers.packs import KNOBS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> dg.Dataset:
    data = str(tmp_path_factory.mktemp("logs") / "data")
    os.makedirs(data)
    rs = np.random.RandomState(3)
    ds = dg.Dataset(data)
    dg.add_t2i(ds, [dg.good_t2i_rows(rs, 3, i * 3) for i in range(8)], row_group_size=3)
    lines, files = dg.good_sft(rs, 16)
    dg.add_sft(ds, lines, files)
    return ds


# samples over the per-sample limit in every stream, and (a large expected batch, buffering early)
# samples still in a stream's overflow buffer at its end: a reason counted only when a stream ends
LOG_KNOBS = {**KNOBS, "max_num_tokens_per_sample": 250, "expected_num_tokens": 850, "prefer_buffer_before": 100}


def run(ds: dg.Dataset, world_size: int, out: str, *flags: str) -> list[str]:
    cfg = ds.config(knobs=LOG_KNOBS, num_workers=2, prepack={"world_size": world_size, "batches_per_stream": 2})
    r = subprocess.run([sys.executable, "-m", "prepack.cli", "run", cfg, "--out", out, *flags], cwd=REPO,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return (r.stdout + r.stderr).strip().splitlines()


def announcements(lines: list[str], reason: str) -> list[str]:
    return [line for line in lines if line.startswith(f"WARNING prepack.run.driver: {reason}:")]


@pytest.mark.slow  # packs twice through the CLI
def test_output_does_not_grow_with_streams(dataset, tmp_path):
    two = run(dataset, 1, str(tmp_path / "two"), "--no-ray")
    eight = run(dataset, 4, str(tmp_path / "eight"), "--no-ray")
    assert any(line.startswith("drops: ") and "overlength_sample=" in line for line in eight), eight
    assert len(eight) <= len(two) + 2, "\n".join(eight)
    [line] = announcements(eight, "overlength_sample")
    assert "exceeds max_num_tokens_per_sample=250" in line and "tokens" in line, line
    assert not [line for line in eight if "drop[" in line], eight  # per-stream detail only with -v
    assert_left_in_buffer_announced(eight)


def assert_left_in_buffer_announced(lines: list[str]) -> None:
    """A count made only at a stream's end is in the summary and announced once like any other."""
    [summary] = [line for line in lines if line.startswith("drops: ")]
    assert "left_in_buffer_at_end_of_budget=" in summary, summary
    [line] = announcements(lines, "left_in_buffer_at_end_of_budget")
    assert "still in the overflow buffer" in line, line


@pytest.mark.slow  # packs through the CLI
def test_verbose_shows_each_streams_drops(dataset, tmp_path):
    lines = run(dataset, 4, str(tmp_path / "v"), "--no-ray", "-v")
    streams = {line.split("stream ")[1].split()[0] for line in lines if "drop[overlength_sample]" in line
               and "stream " in line}
    assert len([line for line in lines if "drop[overlength_sample]" in line]) >= 4, lines
    assert len(announcements(lines, "overlength_sample")) == 1, streams


@pytest.mark.slow
def test_ray_run_of_4_streams_prints_a_few_lines(dataset, tmp_path):
    """Under Ray too (workers' logs are forwarded to the driver): the in-process test above shows
    that 2 and 8 streams print the same lines; 4 Ray workers would print 4 times as many."""
    lines = run(dataset, 2, str(tmp_path / "ray"), "--num-cpus", "2")
    assert len(announcements(lines, "overlength_sample")) == 1, lines
    assert not [line for line in lines if "drop[" in line or "(stream_task pid=" in line], lines
    assert_left_in_buffer_announced(lines)
    assert len(lines) <= 10, "\n".join(lines)
