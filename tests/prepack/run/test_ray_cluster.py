"""A pack submitted as a Ray job to a running cluster, as a user does on a real one.

The test starts its own head (``ray start --head --block`` on 127.0.0.1, free ports, a private
``--temp-dir``), submits ``prepack run`` with ``ray job submit --working-dir`` (a copy of just the
packages a job needs), waits for it, reads the output back, and then stops exactly the processes
it started: the ``ray start`` process group first, then anything of the run left behind, by PID.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.helpers.ray_helpers import (
    REPO,
    RayRun,
    check_stream_contiguity,
    cmdline,
    free_port,
    leftovers,
    load_manifest,
    make_demo,
    read_back,
    wait_until,
)

pytestmark = pytest.mark.slow  # starts Ray or runs the reference for many batches

RAY = os.path.join(os.path.dirname(sys.executable), "ray")


def _dashboard_up(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/api/version", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _working_dir(dst: str) -> str:
    """The code a job needs, nothing else (no venv, no data, no tests)."""
    for pkg in ("prepack", "loader", "schemas"):
        shutil.copytree(os.path.join(REPO, pkg), os.path.join(dst, pkg),
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dst


def _stop_head(rr: RayRun, head, temp_dir: str) -> None:
    """Stop the head: SIGTERM to ``ray start --block`` (it drains the node and stops what it started,
    ~2 s; a SIGTERM to the whole group instead makes every process drain at once, ~20 s), then
    SIGKILL to its process group; verify no raylet/gcs_server of ``temp_dir`` survives, and SIGKILL
    whatever else of this run is left (workers and a job's driver live in other groups)."""
    if head.poll() is None:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(head.pid, signal.SIGKILL)
    head.wait(timeout=10)

    def core_left() -> list[str]:
        return [f"{p} {cmdline(p)[:100]}" for p in rr.pids()
                if temp_dir in cmdline(p) and any(n in cmdline(p) for n in ("raylet", "gcs_server"))]

    deadline = time.monotonic() + 20
    while core_left() and time.monotonic() < deadline:
        time.sleep(0.2)
    left = core_left()
    rr.kill_all()
    assert not left, f"raylet/gcs_server of {temp_dir} survived stopping the head: {left}"
    assert rr.pids() == []


def test_ray_job_submit_to_own_head(tmp_path):
    config = make_demo(str(tmp_path / "demo"))
    out = str(tmp_path / "out")
    wd = _working_dir(str(tmp_path / "job"))
    with RayRun() as rr:
        temp_dir = os.path.join(rr.tmp, "ray")
        gcs, dash = free_port(), free_port()
        ports = {
            "--port": gcs, "--dashboard-port": dash, "--ray-client-server-port": free_port(),
            "--dashboard-agent-listen-port": free_port(), "--dashboard-agent-grpc-port": free_port(),
            "--runtime-env-agent-port": free_port(), "--metrics-export-port": free_port(),
            "--node-manager-port": free_port(), "--object-manager-port": free_port(),
        }
        head = rr.popen([RAY, "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
                         "--dashboard-host", "127.0.0.1", "--include-dashboard=true", "--num-cpus", "2",
                         "--temp-dir", temp_dir, "--disable-usage-stats",
                         *[f"{k}={v}" for k, v in ports.items()]],
                        str(tmp_path / "head"))
        try:
            url = f"http://127.0.0.1:{dash}"
            wait_until(lambda: _dashboard_up(url), 120, "the head's dashboard", head, poll=0.5)
            job_id = f"prepack-test-{rr.mark}"
            submit = rr.run([RAY, "job", "submit", "--address", url, "--submission-id", job_id,
                             "--working-dir", wd, "--",
                             sys.executable, "-m", "prepack.cli", "run", config, "--out", out, "--no-progress"],
                            timeout=300)

            from ray.job_submission import JobStatus, JobSubmissionClient

            client = JobSubmissionClient(url)
            status = client.get_job_status(job_id)
            logs = client.get_job_logs(job_id)
            assert submit.returncode == 0 and status == JobStatus.SUCCEEDED, \
                f"rc {submit.returncode}, status {status}\n{submit.stdout[-3000:]}\n{submit.stderr[-3000:]}\n{logs[-3000:]}"
            assert "packed: 2 streams, 12 batches, " in logs, logs[-3000:]
            # the job's driver joined this cluster (no local Ray of its own)
            assert "Started a local Ray instance" not in logs, logs[-3000:]
        finally:
            _stop_head(rr, head, temp_dir)

    man = load_manifest(out)
    assert [s["num_records"] for s in man["streams"]] == [6, 6]
    check_stream_contiguity(man)
    assert leftovers(out) == []
    assert read_back(out, man) == {0: 6, 1: 6}
