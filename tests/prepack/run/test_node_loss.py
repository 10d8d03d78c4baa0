"""A worker node lost in the middle of a pack does not end the run (issue 17, item 1).

One real multi-node Ray cluster on loopback for the module (``LoopbackCluster``: a head with 0
CPUs, two worker nodes with 2 CPUs each, every node on 127.0.0.1).  ``prepack run`` is started as
a job's driver is under ``ray job submit`` (a subprocess with ``RAY_ADDRESS`` set to the cluster),
on W=2 K=2 (4 streams) with small shards, and a worker node is killed hard (its raylet and
everything it started, SIGKILL by PID) at one point of the run:

- ``before_first_commit``: stream tasks are running, no shard is committed yet;
- ``mid_stream``: two streams have committed a shard (the node hosting a helper actor, if a
  worker node hosts one, else the node running the most stream tasks);
- ``stream_finishing``: the first ``done.json`` has appeared;
- ``then_driver``: mid-stream, then the driver is SIGKILLed at once and the same command rerun
  straight away (the GCS may still hold the dead node alive).

Each time: the same ``prepack run`` (the rerun, for the last) exits 0; every shard file is
byte-identical to an uninterrupted pack of the config; the output names the retried streams
(every stream seen running on the killed node); and no TCP socket of the cluster, the driver or
the workers has an address other than loopback (sampled with ``ss`` throughout).  Between tests
the cluster gets a fresh worker node once the GCS has declared the killed one dead.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest

from tests.helpers.ray_cluster import LoopbackCluster, SocketWatch, ray_title
from tests.helpers.ray_helpers import (
    RayRun,
    check_stream_contiguity,
    committed_shards,
    leftovers,
    load_manifest,
    make_demo,
    prepack,
    read_log,
    same_streams,
    variant,
    wait_until,
)

pytestmark = pytest.mark.slow  # starts a Ray cluster

STREAMS = 4  # world_size 2 x dataloader.num_workers 2
BATCHES = 8
SHARD_BYTES = 3_000_000  # records are ~1-4 MB: about two records a shard, four shards a stream
RUN_TIMEOUT = 300.0
# the GCS declares a killed node dead after 3 missed health checks a second apart (Ray's default:
# 5 checks 3 s apart), so Ray retries its tasks and a fresh node joins sooner; a live node that is
# merely slow under load answers within the 5 s each check waits
HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3, "health_check_timeout_ms": 5000}


# -- fixtures ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def config(tmp_path_factory):
    root = tmp_path_factory.mktemp("nodeloss")
    return variant(make_demo(str(root)), "nodeloss.yaml", world_size=2, batches_per_stream=BATCHES,
                   shard_bytes=SHARD_BYTES)


@pytest.fixture(scope="module")
def reference_job(config, tmp_path_factory):
    """The uninterrupted pack of ``config`` (``--no-ray``: each stream start to end in one process),
    started here so that it runs while the cluster starts; ``reference`` waits for it."""
    out = str(tmp_path_factory.mktemp("nodeloss-ref") / "out")
    with RayRun() as rr:
        yield out, rr.popen(prepack("run", config, "--out", out, "--no-ray", "--no-progress"), out + "-log")


@pytest.fixture(scope="module")
def reference(reference_job):
    out, proc = reference_job
    rc = proc.wait(timeout=RUN_TIMEOUT)
    assert rc == 0, read_log(proc)[1][-3000:]
    man = load_manifest(out)
    assert len(man["streams"]) == STREAMS
    assert all(s["num_records"] == BATCHES and len(s["shards"]) >= 3 for s in man["streams"]), \
        [(s["num_records"], len(s["shards"])) for s in man["streams"]]
    return out, man


@pytest.fixture(scope="module")
def cluster(reference_job):
    with LoopbackCluster(workers=2, cpus=2, head_cpus=0, system_config=HEALTH_CHECKS) as c:
        yield c
    # LoopbackCluster.close asserted that no process naming its temp dir is left


@pytest.fixture
def fresh(cluster):
    """The cluster with two live worker nodes and no stream task of an earlier test still running."""
    if cluster.killed:
        cluster.replace_killed()
    wait_until(lambda: not any(cluster.workers_on(n, "ray::stream_task") for n in cluster.nodes), 60,
               "the stream tasks of an earlier run to end", poll=0.2)
    assert len(cluster.worker_nodes) == 2
    return cluster


# -- what a run did ---------------------------------------------------------------------------------
def shard_files(out: str) -> dict[str, bytes]:
    """``stream-S/shard-N.arrow`` -> its bytes, for every shard file under ``out``."""
    got = {}
    for d in sorted(os.listdir(out)):
        if d.startswith("stream-"):
            for f in sorted(os.listdir(os.path.join(out, d))):
                if f.startswith("shard-") and f.endswith(".arrow"):  # the shard files and their pixel indexes
                    with open(os.path.join(out, d, f), "rb") as fh:
                        got[f"{d}/{f}"] = fh.read()
    return got


def output_problems(out: str, reference) -> list[str]:
    """How the finished output differs from the uninterrupted pack (empty: not at all)."""
    ref_out, ref_man = reference
    if not os.path.exists(os.path.join(out, "manifest.json")):
        return ["no manifest.json: the pack did not finish"]
    man = load_manifest(out)
    ours, theirs = man["identity"].get("code_fingerprint"), ref_man["identity"].get("code_fingerprint")
    if ours != theirs:  # shard metadata carries it: the bytes cannot match
        return [f"the reference was packed by other code (code fingerprint {theirs}, this run {ours}): "
                "was prepack edited while the test ran?"]
    problems = []
    want, got = shard_files(ref_out), shard_files(out)
    if sorted(got) != sorted(want):
        problems.append(f"shard files differ: {sorted(set(got) ^ set(want))}")
    differ = [name for name in want if name in got and got[name] != want[name]]
    if differ:
        problems.append(f"shard files not byte-identical to the uninterrupted pack: {differ}")
    for check in (lambda: same_streams(man, ref_man), lambda: check_stream_contiguity(man)):
        try:
            check()
        except AssertionError as e:
            problems.append(f"manifest: {e}")
    if leftovers(out):
        problems.append(f"left in the output: {leftovers(out)}")
    return problems


_RETRIED = re.compile(r"\bstreams?\s+(\d+(?:\s*(?:,|and|-)\s*\d+)*)", re.I)


def retried_streams(text: str) -> set[int]:
    """Streams the run's output says were retried: every ``stream N`` (``streams 1, 3``, ``0-2``) on
    a line that says ``retried``.  Ray's own retry lines name the task, not a stream."""
    found: set[int] = set()
    for line in text.splitlines():
        if "retried" not in line.lower():
            continue
        for m in _RETRIED.finditer(line):
            for part in re.split(r"\s*(?:,|and)\s*", m.group(1)):
                lo, _, hi = part.partition("-")
                found.update(range(int(lo), int(hi or lo) + 1))
    return found


def done_streams(out: str) -> set[int]:
    return {s for s in range(STREAMS) if os.path.exists(os.path.join(out, f"stream-{s:05d}", "done.json"))}


def streams_committed(out: str) -> set[int]:
    return {s for s in range(STREAMS) if committed_shards(out, s)}


class StreamMap:
    """Which stream each ``ray::stream_task`` worker packs, learnt from the files it holds open
    (``OUT/stream-S/shard-N.arrow.tmp`` while a shard fills), sampled in a thread."""

    def __init__(self, cluster: LoopbackCluster, out: str, every: float = 0.1):
        self.cluster, self.needle, self.every = cluster, os.path.realpath(out) + "/stream-", every
        self.by_pid: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            for node in self.cluster.worker_nodes:
                for pid in self.cluster.workers_on(node, "ray::stream_task"):
                    try:
                        fds = os.listdir(f"/proc/{pid}/fd")
                    except OSError:
                        continue
                    for fd in fds:
                        try:
                            target = os.readlink(f"/proc/{pid}/fd/{fd}")
                        except OSError:
                            continue
                        if target.startswith(self.needle):
                            self.by_pid[pid] = int(target[len(self.needle):].split("/", 1)[0])
            self._stop.wait(self.every)

    def streams(self, pids) -> set[int]:
        return {self.by_pid[p] for p in pids if p in self.by_pid}

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def helper_actors(cluster: LoopbackCluster, node) -> list[str]:
    """Titles of the Ray actors on ``node`` other than Ray's own agents (e.g. ``ray::Progress``)."""
    ray_own = ("ray::DashboardAgent", "ray::RuntimeEnvAgent", "ray::IDLE", "ray::stream_task")
    return [t for t in (ray_title(p) for p in cluster.processes(node)) if t and not t.startswith(ray_own)]


def pick_victim(cluster: LoopbackCluster, prefer_helper: bool):
    """The worker node running the most stream tasks (first: one hosting a helper actor, if asked)."""
    def load(n):
        tasks, helper = len(cluster.workers_on(n, "ray::stream_task")), bool(helper_actors(cluster, n))
        return (helper, tasks) if prefer_helper else (tasks, helper)

    return max(cluster.worker_nodes, key=load)


def _tasks_running(c: LoopbackCluster) -> bool:
    return any(c.workers_on(n, "ray::stream_task") for n in c.worker_nodes)


POINTS = {
    # stream tasks are running (some node shows one), nothing is committed yet
    "before_first_commit": lambda c, out: not streams_committed(out) and _tasks_running(c),
    "mid_stream": lambda c, out: len(streams_committed(out)) >= 2,
    # a stream has written done.json; the others (some of them) still run
    "stream_finishing": lambda c, out: bool(done_streams(out)) and _tasks_running(c),
}


def run_with_node_kill(cluster: LoopbackCluster, config: str, out: str, log: str, point: str,
                       then_kill_driver: bool = False) -> dict:
    """Start ``prepack run`` on the cluster, kill a worker node at ``point``; returns what happened."""
    seen: dict = {"point": point}
    with SocketWatch(cluster.pids) as sockets, StreamMap(cluster, out) as smap:
        t0 = time.monotonic()
        driver = cluster.rr.popen(prepack("run", config, "--out", out, "--no-progress"), log, **cluster.driver_env())
        wait_until(lambda: POINTS[point](cluster, out), RUN_TIMEOUT, f"kill point {point}", driver, poll=0.05)
        victim = pick_victim(cluster, prefer_helper=point == "mid_stream")
        tasks = cluster.workers_on(victim, "ray::stream_task")
        seen.update(victim=victim.index, titles=cluster.titles(), helpers=helper_actors(cluster, victim),
                    tasks_on_victim=len(tasks), streams_on_victim=smap.streams(tasks))
        cluster.kill_node(victim)
        seen.update(t_kill=round(time.monotonic() - t0, 1), done_at_kill=done_streams(out),
                    committed_at_kill=streams_committed(out))
        if then_kill_driver:
            others = [p for n in cluster.worker_nodes for p in cluster.workers_on(n, "ray::stream_task")]
            os.kill(driver.pid, signal.SIGKILL)
            driver.wait(timeout=30)
            # for the report: is the dead node still alive for the GCS, do the killed job's tasks still run
            seen["victim_alive_in_gcs"] = cluster.nodes[victim.index].node_id in cluster.live_node_ids()
            seen["old_tasks_alive_at_rerun"] = len(set(others) & set(cluster.pids()))
            t_rerun = time.monotonic()
            driver = cluster.rr.popen(prepack("run", config, "--out", out, "--no-progress"), log + "-rerun",
                                      **cluster.driver_env())
            # how long the killed driver's stream tasks went on beside the rerun (Ray ends them)
            wait_until(lambda: not set(others) & set(cluster.pids()), RUN_TIMEOUT, "the killed job's tasks to end",
                       poll=0.1)
            seen["old_tasks_lived_after_rerun_s"] = round(time.monotonic() - t_rerun, 1)
        seen["rc"] = driver.wait(timeout=RUN_TIMEOUT)
        seen["t_end"] = round(time.monotonic() - t0, 1)
        seen["stdout"], seen["stderr"] = read_log(driver)
    seen["outside_loopback"], seen["ss_samples"], seen["ss_errors"] = list(sockets.bad), sockets.samples, sockets.errors
    print({k: v for k, v in seen.items() if k not in ("stdout", "stderr")})  # shown with -s / on failure
    return seen


def socket_problems(seen: dict) -> list[str]:
    if seen["ss_errors"]:
        return [f"ss failed: {seen['ss_errors'][:3]}"]
    if not seen["ss_samples"]:
        return ["ss never ran during the run"]
    return ["sockets off loopback:\n" + "\n".join(seen["outside_loopback"])] if seen["outside_loopback"] else []


def retry_problems(seen: dict) -> list[str]:
    """What the run's output fails to say about the streams retried after the kill."""
    retried = retried_streams(seen["stdout"] + "\n" + seen["stderr"])
    if not retried:
        return ["the run does not name any retried stream"]
    if not retried <= set(range(STREAMS)):
        return [f"the run names streams that do not exist as retried: {sorted(retried)}"]
    # every stream task that ran on the killed node is retried (one that had just finished, on its
    # way out, need not be): as many streams named, and each one seen there by name
    done, problems = seen["done_at_kill"], []
    if len(retried - done) < seen["tasks_on_victim"] - len(done):
        problems.append(f"{seen['tasks_on_victim']} stream tasks ran on the killed node, the run names only "
                        f"{sorted(retried)} as retried")
    lost = seen["streams_on_victim"] - done
    if not lost <= retried:
        problems.append(f"streams {sorted(lost - retried)} ran on the killed node but are not named as retried "
                        f"(named: {sorted(retried)})")
    return problems


def kill_point_problems(seen: dict) -> list[str]:
    """Whether the kill landed where the test means it to (else the test proves nothing)."""
    problems = []
    if seen["tasks_on_victim"] < 1:
        problems.append(f"the killed node ran no stream task: {seen['titles']}")
    if seen["point"] == "before_first_commit" and seen["committed_at_kill"]:
        problems.append(f"streams {sorted(seen['committed_at_kill'])} had committed a shard before the kill")
    if seen["point"] != "stream_finishing" and len(seen["done_at_kill"]) == STREAMS:
        problems.append("every stream had finished before the kill")
    return problems


def report(what: str, seen: dict, problems: list[str]) -> None:
    assert not problems, f"{what}:\n- " + "\n- ".join(problems) + "\n" + _tail(seen)


def _tail(seen: dict) -> str:
    return f"stdout:\n{seen['stdout'][-3000:]}\nstderr:\n{seen['stderr'][-5000:]}"


# -- tests --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("point", ["before_first_commit", "mid_stream"])
def test_node_killed_run_survives(point, config, fresh, reference, tmp_path):
    out = str(tmp_path / "out")
    seen = run_with_node_kill(fresh, config, out, str(tmp_path / "run"), point)

    report("the kill point was missed", seen, kill_point_problems(seen))
    problems = [f"prepack run exited {seen['rc']}"] if seen["rc"] != 0 else []
    problems += output_problems(out, reference) if seen["rc"] == 0 else []
    problems += retry_problems(seen) + socket_problems(seen)
    report(f"node {seen['victim']} killed at {point}", seen, problems)


def test_node_then_driver_killed_rerun(config, fresh, reference, tmp_path):
    """While a stream finishes a node dies, the driver is SIGKILLed right after, and the same
    command is rerun at once (before Ray has declared the node dead)."""
    out = str(tmp_path / "out")
    seen = run_with_node_kill(fresh, config, out, str(tmp_path / "run"), "stream_finishing", then_kill_driver=True)

    report("the kill point was missed", seen, kill_point_problems(seen))
    problems = [f"the rerun exited {seen['rc']}"] if seen["rc"] != 0 else []
    problems += output_problems(out, reference) if seen["rc"] == 0 else []
    problems += socket_problems(seen)
    report(f"node {seen['victim']} killed, then the driver; rerun at once", seen, problems)
