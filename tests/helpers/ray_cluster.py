"""A real multi-node Ray cluster on loopback, owned by one test: started, a node killed hard, stopped by PID.

``LoopbackCluster`` starts ``python -m tests.helpers.ray_cluster`` with a ``RayRun``'s environment
(a private ``RAY_TMPDIR``, ``RAY_AUTH_MODE=disabled``, ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``: Ray
then keeps "127.0.0.1" as the node's address instead of resolving it to the host's other one), in
a session of its own.  That owner process builds a ``ray.cluster_utils.Cluster`` (a head with 0
CPUs and worker nodes with a few CPUs each, every node started with ``node_ip_address=127.0.0.1``
and the private temp dir), answers with the GCS address and each node's processes, and then
serves a few commands on its stdin (which nodes the GCS holds alive; add worker nodes in place
of killed ones).  If the test dies, stdin closes and the owner exits (``Cluster``'s exit hook
then stops the nodes it started).

A node is killed the way a machine dies: its raylet, its agents and every process they started
(the workers) are frozen with SIGSTOP, so none can start another or notice the others dying,
then SIGKILLed, by PID.  Teardown SIGKILLs every process of the ``RayRun`` (the owner's session,
which Ray keeps its processes in, the drivers the test started, and their descendants), by PID,
and checks that no process naming the cluster's temp dir is left: never ``ray stop``, never a
kill by name.

``outside_loopback`` lists the TCP sockets of given processes (``ss -tanp``) whose local or
peer address is not loopback, to check that nothing of a test's cluster leaves 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Self

from tests.helpers.ray_helpers import REPO, RayRun, cmdline, process_state, with_descendants

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class ClusterNode:
    """One node of the cluster as its owner started it."""

    index: int  # 0: the head, then the worker nodes in the order they were added
    node_id: str
    is_head: bool
    raylet_pid: int
    pids: tuple[int, ...]  # the node's own processes at start (raylet, agents, GCS on the head)


# -- /proc ------------------------------------------------------------------------------------------
def _children() -> dict[int, list[int]]:
    """ppid -> live children, for the whole host."""
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and _alive(int(name)):
            try:
                with open(f"/proc/{name}/stat") as f:
                    kids.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(name))
            except (OSError, IndexError, ValueError):
                continue
    return kids


def _alive(pid: int) -> bool:
    return process_state(pid) not in (None, "Z", "X")


def tree(roots) -> list[int]:
    """Live ``roots`` and all their live descendants."""
    return sorted(with_descendants({p for p in roots if _alive(p)}, _children()))


def ray_title(pid: int) -> str:
    """A Ray worker's process title (``ray::stream_task``, ``ray::Progress``, ``ray::IDLE``), else ''."""
    c = cmdline(pid)
    return c.split()[0] if c.startswith("ray::") else ""


# -- sockets ------------------------------------------------------------------------------------------
_LOOPBACK_HOSTS = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
_SS_USER = re.compile(r"pid=(\d+)")


def _host(addr: str) -> str:
    """The host of an ``ss -n`` address: ``127.0.0.1:80``, ``[::1]:80``, ``[::ffff:127.0.0.1]:80``, ``*:80``."""
    host = addr.rsplit(":", 1)[0]
    host = host.split("%", 1)[0]  # a zone (fe80::1%eth0)
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def outside_loopback(pids, listening: bool = True) -> list[str]:
    """``ss -tanp`` lines of ``pids``' TCP sockets whose local or peer address is not 127.0.0.1/::1.

    A listening socket's peer is ``*``; its local address counts (one bound to 0.0.0.0 or to the
    host's address is reachable from outside).  ``listening=False``: connections only.
    """
    pids = {int(p) for p in pids}
    res = subprocess.run(["ss", "-tanpH"], capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        raise AssertionError(f"ss -tanpH failed: {res.stderr.strip()}")
    bad = []
    for line in res.stdout.splitlines():
        parts = line.split()
        if len(parts) < 5:
            continue
        owners = {int(p) for p in _SS_USER.findall(line)}
        if not owners & pids:
            continue
        state, local, peer = parts[0], parts[3], parts[4]
        if state == "LISTEN":
            if listening and _host(local) not in _LOOPBACK_HOSTS:
                bad.append(line.strip())
            continue
        if _host(local) not in _LOOPBACK_HOSTS or _host(peer) not in _LOOPBACK_HOSTS:
            bad.append(line.strip())
    return bad


class SocketWatch:
    """Samples ``outside_loopback`` for a set of processes every ``every`` s in a thread; keeps offenders.

    ``pids`` is called each time (processes come and go during a run)."""

    def __init__(self, pids, every: float = 0.5, listening: bool = True):
        self._pids, self._every, self._listening = pids, every, listening
        self.bad: dict[str, None] = {}  # ordered set of offending ss lines
        self.samples = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                for line in outside_loopback(self._pids(), self._listening):
                    self.bad[line] = None
                self.samples += 1
            except Exception as e:  # keep watching; reported by the test
                self.errors.append(repr(e))
            self._stop.wait(self._every)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


# -- the cluster ----------------------------------------------------------------------------------
REPLY = "@@cluster "  # the owner's replies on its stdout start with this (anything else there is noise)


class LoopbackCluster:
    """A head (``head_cpus`` CPUs) and ``workers`` nodes of ``cpus`` CPUs each, all on 127.0.0.1.

    Use as a context manager; run drivers with ``self.rr`` (``popen``/``run``) and ``self.driver_env()``
    so teardown ends them too.  ``system_config`` goes to the head (Ray's ``_system_config``).
    ``replace_killed`` brings the cluster back to ``workers`` live worker nodes (one cluster can then
    serve several tests).
    """

    def __init__(self, workers: int = 2, cpus: int = 2, head_cpus: int = 0, system_config: dict | None = None,
                 start_timeout: float = 180.0, rr: RayRun | None = None):
        self.spec = {"workers": workers, "cpus": cpus, "head_cpus": head_cpus, "system_config": system_config or {}}
        self.start_timeout = start_timeout
        self._own_rr = rr is None
        self.rr = rr or RayRun()
        self.owner: subprocess.Popen | None = None
        self.address = ""
        self.nodes: list[ClusterNode] = []
        self.killed: list[int] = []  # indexes of the nodes killed, in order

    # -- start / stop
    def __enter__(self) -> Self:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> None:
        spec = {**self.spec, "temp_dir": os.path.join(self.rr.tmp, "ray")}
        self._log = os.path.join(self.rr.tmp, "owner.err")
        with open(self._log, "wb") as err:
            self.owner = subprocess.Popen([sys.executable, "-m", "tests.helpers.ray_cluster", json.dumps(spec)],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                                          env=self.rr.env(), cwd=REPO, start_new_session=True)
        self.rr.procs.append(self.owner)
        self.rr.sessions.add(self.owner.pid)  # RayRun.close ends the owner's session (Ray's processes live there)
        self._update(self._reply(self.start_timeout))
        assert self.address.startswith(LOOPBACK + ":"), self.address

    def _reply(self, timeout: float) -> dict:
        """The owner's next reply (it starts the cluster, then answers one command at a time)."""
        assert self.owner is not None and self.owner.stdout is not None
        got: list[dict] = []

        def read() -> None:
            for line in self.owner.stdout:  # type: ignore[union-attr]
                if line.startswith(REPLY):
                    got.append(json.loads(line[len(REPLY):]))
                    return

        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(timeout)
        if not got:
            raise AssertionError(f"the cluster's owner gave no answer in {timeout} s (rc {self.owner.poll()}):\n"
                                 f"{self.owner_log()}")
        if "error" in got[0]:
            raise AssertionError(f"the cluster's owner failed: {got[0]['error']}\n{self.owner_log()}")
        return got[0]

    def _ask(self, cmd: dict, timeout: float) -> dict:
        assert self.owner is not None and self.owner.stdin is not None
        self.owner.stdin.write(json.dumps(cmd) + "\n")
        self.owner.stdin.flush()
        return self._reply(timeout)

    def _update(self, doc: dict) -> None:
        self.address = doc["address"]
        self.nodes = [ClusterNode(i, n["node_id"], n["is_head"], n["raylet_pid"], tuple(n["pids"]))
                      for i, n in enumerate(doc["nodes"])]

    def close(self) -> None:
        """SIGKILL every process of this run by PID (``RayRun.close``), then check none is left.
        (With a ``RayRun`` passed in, its owner closes it: nothing is stopped here.)"""
        if not self._own_rr:
            return
        self.rr.close()
        left = self.leftovers()
        assert not left, f"processes of the test's cluster survived teardown: {left}"

    def leftovers(self) -> list[str]:
        """Live processes whose command line names this cluster's temp dir (raylet, GCS, agents, workers)."""
        tag = self.rr.tmp
        return [f"{p} {cmdline(p)[:120]}" for p in (int(n) for n in os.listdir("/proc") if n.isdigit())
                if tag in cmdline(p) and _alive(p)]

    def owner_log(self) -> str:
        with contextlib.suppress(OSError), open(self._log, errors="replace") as f:
            return f.read()[-3000:]
        return ""

    # -- a driver's view
    def driver_env(self) -> dict[str, str]:
        """What a job's driver gets (``RAY_ADDRESS`` as under ``ray job submit``), for ``rr.popen/run``."""
        return {"RAY_ADDRESS": self.address}

    def pids(self) -> list[int]:
        """Every live process of the test run (cluster, drivers, workers)."""
        return self.rr.pids()

    # -- nodes
    @property
    def head(self) -> ClusterNode:
        return self.nodes[0]

    @property
    def worker_nodes(self) -> list[ClusterNode]:
        """The live worker nodes (not killed)."""
        return [n for n in self.nodes if not n.is_head and n.index not in self.killed]

    def live_node_ids(self) -> set[str]:
        """Nodes the GCS holds alive now (a killed node stays alive there until its health checks fail)."""
        return set(self._ask({"cmd": "live"}, 60)["live"])

    def replace_killed(self, dead_timeout: float = 120.0) -> None:
        """Wait until the GCS has declared every killed node dead, then add worker nodes up to ``workers``."""
        doc = self._ask({"cmd": "replace", "dead": [self.nodes[i].node_id for i in self.killed],
                         "workers": self.spec["workers"], "timeout": dead_timeout}, dead_timeout + 120)
        killed = {self.nodes[i].node_id for i in self.killed}
        self._update(doc)
        self.killed = [n.index for n in self.nodes if n.node_id in killed]

    def processes(self, node: ClusterNode) -> list[int]:
        """The node's live processes: its own and everything they started (the workers)."""
        return tree(node.pids)

    def workers_on(self, node: ClusterNode, prefix: str = "ray::") -> list[int]:
        """The node's Ray worker processes whose title starts with ``prefix`` (e.g. ``ray::stream_task``)."""
        return [p for p in self.processes(node) if ray_title(p).startswith(prefix)]

    def titles(self) -> dict[int, list[str]]:
        """node index -> titles of its Ray workers (for messages)."""
        return {n.index: sorted(ray_title(p) for p in self.processes(n) if ray_title(p)) for n in self.nodes}

    def kill_node(self, node: ClusterNode, timeout: float = 30.0) -> list[int]:
        """Kill ``node`` hard: freeze its whole process tree (SIGSTOP, until no new process appears),
        SIGKILL it, wait until every one is gone.  Returns the PIDs killed."""
        assert not node.is_head, "the head holds the GCS: this cluster does not survive losing it"
        frozen: set[int] = set()
        while True:
            new = [p for p in tree(set(node.pids) | frozen) if p not in frozen]
            if not new:
                break
            for p in new:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGSTOP)
                frozen.add(p)
        for p in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        while any(_alive(p) for p in frozen):
            if time.monotonic() > deadline:
                raise AssertionError(f"node {node.index}: processes survive SIGKILL: "
                                     + "; ".join(f"{p} {cmdline(p)[:80]}" for p in frozen if _alive(p)))
            time.sleep(0.05)
        self.killed.append(node.index)
        return sorted(frozen)


# -- the owner process ------------------------------------------------------------------------------
def _serve(spec: dict) -> None:
    """Start the cluster, answer commands on stdin (one JSON line each) until stdin closes.

    Replies go to stdout as ``REPLY + json``.  The test ends this process and its nodes by PID; if
    the test dies first, stdin closes and the nodes are stopped here (``Cluster``'s exit hook).
    """
    from ray.cluster_utils import Cluster

    common = {"node_ip_address": LOOPBACK, "temp_dir": spec["temp_dir"]}

    def reply(doc: dict) -> None:
        sys.stdout.write(REPLY + json.dumps(doc) + "\n")
        sys.stdout.flush()

    def node_doc(node) -> dict:
        pids = sorted({pi.process.pid for infos in node.all_processes.values() for pi in infos})
        raylet = node.all_processes["raylet"][0].process.pid
        return {"node_id": node.node_id, "is_head": node.head, "raylet_pid": raylet, "pids": pids}

    order: list = []  # nodes in the order they were added (the head first)

    def info() -> dict:
        return {"address": cluster.address, "nodes": [node_doc(n) for n in order]}

    def live() -> list[str]:
        return [n["NodeID"] for n in cluster.global_state.node_table() if n["Alive"]]

    cluster = Cluster(initialize_head=True, shutdown_at_exit=True, head_node_args={
        **common, "num_cpus": spec["head_cpus"], "include_dashboard": False,
        "_system_config": spec["system_config"]})
    order.append(cluster.head_node)
    for _ in range(spec["workers"]):
        order.append(cluster.add_node(**common, num_cpus=spec["cpus"]))
    cluster.wait_for_nodes()
    reply(info())
    for line in sys.stdin:
        try:
            cmd = json.loads(line)
            if cmd["cmd"] == "live":
                reply({"live": live()})
            elif cmd["cmd"] == "replace":
                deadline = time.monotonic() + cmd["timeout"]
                while set(cmd["dead"]) & set(live()):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"the GCS still holds killed nodes alive after {cmd['timeout']} s")
                    time.sleep(0.2)
                dead = set(cmd["dead"])
                while sum(1 for n in order if not n.head and n.node_id not in dead) < cmd["workers"]:
                    order.append(cluster.add_node(**common, num_cpus=spec["cpus"]))
                reply(info())
            else:
                raise ValueError(f"unknown command {cmd!r}")
        except Exception as e:
            reply({"error": f"{type(e).__name__}: {e}"})


if __name__ == "__main__":
    _serve(json.loads(sys.argv[1]))
