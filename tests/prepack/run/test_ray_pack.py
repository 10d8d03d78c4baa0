"""End to end on a local Ray, through the CLI as a user runs it: pack the demo config, read it back.

Also the run's guard rails: a finished output is a no-op, another config over it is refused,
two runs at once on one output (the second is refused by the lock), ``--streams`` packs a subset
and the manifest waits for the rest, and ``file://`` output URIs.
"""

from __future__ import annotations

import os

import pytest
from tests.helpers.ray_helpers import (
    lease_files,
    RayRun,
    check_stream_contiguity,
    leftovers,
    load_manifest,
    make_demo,
    prepack,
    read_back,
    read_log,
    same_streams,
    summary,
    variant,
    wait_until,
)

pytestmark = pytest.mark.slow  # starts Ray or runs the reference for many batches



def snapshot(out: str) -> dict[str, tuple[int, int]]:
    """Every file under ``out`` with its size and mtime: a no-op leaves it unchanged."""
    files = {}
    for dirpath, _, names in os.walk(out):
        for n in names:
            st = os.stat(os.path.join(dirpath, n))
            files[os.path.relpath(os.path.join(dirpath, n), out)] = (st.st_size, st.st_mtime_ns)
    return files


def error_line(stderr: str) -> str:
    """The one line a refused run prints (and no traceback)."""
    assert "Traceback" not in stderr, stderr
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got:\n{stderr}"
    assert lines[0].startswith("prepack: error: "), lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    root = tmp_path_factory.mktemp("raypack")
    return root, make_demo(str(root))


@pytest.fixture(scope="module")
def packed(demo):
    """Pack the demo config; while it runs, start a second run on the same output."""
    root, config = demo
    out = str(root / "out")
    with RayRun() as rr:
        first = rr.popen(prepack("run", config, "--out", out), str(root / "first"))
        wait_until(lambda: bool(lease_files(out)), 120, "the first run's lease", first)
        leases = lease_files(out)
        second = rr.run(prepack("run", config, "--out", out), timeout=120)
        first_still_running = first.poll() is None
        lock_kept = lease_files(out) == leases
        rc = first.wait(timeout=300)
        stdout, stderr = read_log(first)
    return {"out": out, "config": config, "rc": rc, "stdout": stdout, "stderr": stderr, "second": second,
            "first_still_running": first_still_running, "lock_kept": lock_kept}


def test_pack_demo_reads_back(packed):
    assert packed["rc"] == 0, packed["stderr"][-3000:]
    out = packed["out"]
    lines = summary(packed["stdout"])
    assert lines[0].startswith("packed: 2 streams, 12 batches, ") and lines[0].endswith(f"-> {out}"), lines
    assert any(ln.startswith("fill ratio ") for ln in lines) and any(ln.startswith("throughput ") for ln in lines)
    assert any(ln.startswith("group mix: ") for ln in lines)
    assert not any("manifest not written" in ln for ln in lines)

    man = load_manifest(out)
    assert [s["stream"] for s in man["streams"]] == [0, 1]
    assert all(s["num_records"] == 6 for s in man["streams"])
    check_stream_contiguity(man)
    assert leftovers(out) == []
    assert os.path.exists(os.path.join(out, "lineage", "stream-00000.parquet"))

    counts = read_back(out, man, decode=2)
    assert counts == {s["stream"]: s["num_records"] for s in man["streams"]}

    from loader import PackedShardDataset

    ds = PackedShardDataset(out, rank=0, world_size=1)
    order = []
    for i, batch in enumerate(ds):
        if i == 0:
            assert batch.to_dict()["packed_text_ids"].numel() > 0
        order.append(batch.sequence_length)
    # rank 0 of 1 reads streams 0 and 1 round-robin, as a 2-worker DataLoader yields them
    expect = [r["num_tokens"] for pair in zip(*[[r for sh in s["shards"] for r in sh["records"]]
                                                for s in man["streams"]]) for r in pair]
    assert order == expect


def test_second_concurrent_run_is_refused(packed):
    second = packed["second"]
    assert packed["first_still_running"], "the first run ended before the second one checked the lock (inconclusive)"
    assert second.returncode != 0
    msg = error_line(second.stderr)
    assert "is being packed by another prepack run" in msg and "stream 0" in msg, msg
    assert packed["lock_kept"], "the refused run removed the lease of the run holding it, or left its own"
    assert packed["rc"] == 0


def test_rerun_over_finished_output_is_a_noop(packed):
    out = packed["out"]
    before = snapshot(out)
    with RayRun() as rr:
        r = rr.run(prepack("run", packed["config"], "--out", out), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert summary(r.stdout)[0].startswith("already complete: 2 streams, 12 batches, "), r.stdout
    assert "throughput" not in r.stdout
    assert snapshot(out) == before


def test_other_config_over_output_is_refused(packed):
    out = packed["out"]
    other = variant(packed["config"], "other.yaml", batches_per_stream=5)
    before = snapshot(out)
    with RayRun() as rr:
        r = rr.run(prepack("run", other, "--out", out), timeout=120)
    assert r.returncode != 0
    msg = error_line(r.stderr)
    assert out in msg and "config" in msg and "--out" in msg, msg
    assert snapshot(out) == before


def test_streams_subset_then_rest_with_file_uri(packed, tmp_path):
    """``--streams 0`` into a ``file://`` URI: no manifest until stream 1 is packed too; the result
    equals the one-shot pack record for record, shard for shard."""
    out = str(tmp_path / "subset")
    uri = "file://" + out
    with RayRun() as rr:
        r0 = rr.run(prepack("run", packed["config"], "--out", uri, "--streams", "0"), timeout=180)
        assert r0.returncode == 0, r0.stderr[-3000:]
        assert summary(r0.stdout)[0].startswith("packed: 1 streams, 6 batches, "), r0.stdout
        assert "manifest not written yet" in r0.stdout
        assert os.path.exists(os.path.join(out, "stream-00000", "done.json"))
        assert not os.path.exists(os.path.join(out, "stream-00001"))
        assert not os.path.exists(os.path.join(out, "manifest.json"))
        assert not os.path.exists(os.path.join(out, "lineage", "stream-00001.parquet"))
        assert leftovers(out) == []

        # the rest without Ray: the subset rules are the driver's, the same with and without it
        r0again = rr.run(prepack("run", packed["config"], "--out", uri, "--streams", "0", "--no-ray"), timeout=180)
        assert r0again.returncode == 0, r0again.stderr[-3000:]
        assert summary(r0again.stdout)[0].startswith("already complete: 1 streams, 6 batches, "), r0again.stdout
        assert "manifest not written yet" in r0again.stdout

        r1 = rr.run(prepack("run", packed["config"], "--out", uri, "--streams", "1", "--no-ray"), timeout=180)
        assert r1.returncode == 0, r1.stderr[-3000:]
        assert "manifest not written" not in r1.stdout
    man = load_manifest(out)
    check_stream_contiguity(man)
    assert leftovers(out) == []
    same_streams(man, load_manifest(packed["out"]))
    counts = read_back(uri, man)
    assert counts == {0: 6, 1: 6}


def test_reuse_through_ray_tasks(packed, tmp_path):
    """``--reuse`` on Ray: the driver indexes OLD and reads it once, and hands every stream task what
    it found; the same config packed again from the demo pack's pixels is the demo pack byte for
    byte, every picture taken from it.  (Runs last: it adds OLD's catalog to the module's pack.)"""
    from tests.helpers.s3checks import pack_bytes

    old = packed["out"]
    out = str(tmp_path / "again")
    with RayRun() as rr:
        r = rr.run(prepack("run", packed["config"], "--out", out, "--reuse", old), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(ln for ln in summary(r.stdout) if ln.startswith("reused "))
    reused, images = (int(x.replace(",", "")) for x in line.split()[1:4:2])
    assert images > 0 and reused == images and line.endswith(f"from {old}"), line
    assert pack_bytes(out) == {k: v for k, v in pack_bytes(old).items() if not k.startswith("pixels/")}
    assert any(k.startswith("pixels/") for k in pack_bytes(old))  # the job indexed OLD once, for its streams
