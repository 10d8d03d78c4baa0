"""Process plumbing for the Ray tests: run ``prepack`` in a subprocess, find and end what it started.

A test's processes are found three ways (``marked_pids``): every subprocess it starts opens a
session of its own, and Ray keeps the processes it spawns (GCS, raylet, agents, workers) in the
session of whoever started it, even when it moves them to other process groups or a killed
driver leaves them orphaned; a job's driver, which Ray starts in a new session, still carries
the unique ``PREPACK_TEST_MARK`` the test put in the environment; and descendants of either.
Nothing of any other Ray session on the host matches.  They are ended by PID: never
``ray stop``, never a kill by name.

Each run also gets its own short ``RAY_TMPDIR`` (Ray's unix socket paths must stay under 107
bytes) so its session directory and ``session_latest`` link do not touch anyone else's.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Self

import yaml

from schemas.manifest import INFORMATIONAL_FIELDS
from tests.helpers.paths import REPO
MARK_VAR = "PREPACK_TEST_MARK"


# -- demo data and configs ----------------------------------------------------------------------
def make_demo(root: str) -> str:
    """``root/demo-data`` (the demo dataset) and ``root/configs/demo.yaml``; returns the config path."""
    from prepack.demo.data import write_demo_data

    write_demo_data(os.path.join(root, "demo-data"), seed=0)
    os.makedirs(os.path.join(root, "configs"), exist_ok=True)
    cfg = os.path.join(root, "configs", "demo.yaml")
    shutil.copy(os.path.join(REPO, "configs", "demo.yaml"), cfg)
    return cfg


def variant(config: str, name: str, **prepack) -> str:
    """A copy of ``config`` next to it (same relative data paths) with ``prepack:`` keys changed."""
    with open(config) as f:
        doc = yaml.safe_load(f)
    doc["prepack"].update(prepack)
    path = os.path.join(os.path.dirname(config), name)
    with open(path, "w") as f:
        yaml.safe_dump(doc, f, sort_keys=False)
    return path


# -- processes ------------------------------------------------------------------------------------
def process_state(pid: int) -> str | None:
    """The one-letter state of a process (``Z``: exited, not reaped), None if it is gone."""
    st = _stat(pid)
    return st[0] if st else None


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, session id) of a process, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[1]), int(fields[3])
    except (OSError, IndexError, ValueError):
        return None


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _has_mark(pid: int, needle: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return needle in b"\0" + f.read()
    except OSError:
        return False


def marked_pids(mark: str, sessions: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """Live (non-zombie) processes of one test run: those in one of ``sessions`` (the sessions of
    the subprocesses it started: Ray keeps its processes in the session of whoever started it),
    those whose environment holds ``PREPACK_TEST_MARK=mark`` (a job's driver, which Ray starts in
    a session of its own), and every descendant of either.  The environment alone is not enough:
    a Ray worker's process title overwrites the start of its ``/proc/PID/environ``."""
    needle = f"\0{MARK_VAR}={mark}\0".encode()
    procs = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            st = _stat(int(name))
            if st is not None:
                procs[int(name)] = st
    found = {pid for pid, (_, _, sid) in procs.items() if sid in sessions}
    found |= {pid for pid in procs if pid not in found and _has_mark(pid, needle)}
    children: dict[int, list[int]] = {}
    for pid, (_, ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    return sorted(pid for pid in with_descendants(found, children) if procs[pid][0] not in ("Z", "X"))


def with_descendants(found: set[int], children: dict[int, list[int]]) -> set[int]:
    """``found`` and every descendant of its processes (``children``: pid -> child pids)."""
    found = set(found)
    todo = list(found)
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in found:
                found.add(c)
                todo.append(c)
    return found


def kill_marked(mark: str, sessions: set[int] | frozenset[int] = frozenset(), timeout: float = 20.0) -> list[int]:
    """SIGKILL every live process of the run until none is left; returns those it killed."""
    killed: list[int] = []
    deadline = time.monotonic() + timeout
    while True:
        pids = marked_pids(mark, sessions)
        if not pids:
            return killed
        if time.monotonic() > deadline:
            raise AssertionError(f"processes of test run {mark} survive SIGKILL: "
                                 + "; ".join(f"{p} {cmdline(p)[:80]}" for p in pids))
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        time.sleep(0.2)


def wait_gone(mark: str, sessions, timeout: float, keep: Callable[[int], bool] = lambda pid: True) -> list[int]:
    """Wait up to ``timeout`` s for the run's processes selected by ``keep`` to exit; return survivors."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in marked_pids(mark, sessions) if keep(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RayRun:
    """One test's processes: a marker, a private Ray temp dir, environment, and cleanup by PID.

    Use as a context manager: on exit (pass or fail) every process carrying the marker is
    SIGKILLed, the subprocesses this object started are reaped, and the temp dir is removed.
    """

    def __init__(self):
        self.mark = uuid.uuid4().hex[:12]
        # short: Ray puts unix sockets under <RAY_TMPDIR>/ray/session_<date>_<pid>/sockets/
        self.tmp = tempfile.mkdtemp(prefix="pp-ray-", dir="/tmp")
        self.procs: list[subprocess.Popen] = []
        self.sessions: set[int] = set()  # each subprocess starts a session of its own (sid = its pid)

    def pids(self) -> list[int]:
        """Live processes of this run (see ``marked_pids``)."""
        return marked_pids(self.mark, self.sessions)

    def kill_all(self) -> list[int]:
        return kill_marked(self.mark, self.sessions)

    def wait_gone(self, timeout: float, keep: Callable[[int], bool] = lambda pid: True) -> list[int]:
        return wait_gone(self.mark, self.sessions, timeout, keep)

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        for k in ("RAY_ADDRESS", "RAY_JOB_CONFIG_JSON_ENV_VAR"):
            env.pop(k, None)
        env.update(
            {
                MARK_VAR: self.mark,
                "RAY_TMPDIR": self.tmp,
                "RAY_USAGE_STATS_ENABLED": "0",
                "RAY_AUTH_MODE": "disabled",
                "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                "PYTHONUNBUFFERED": "1",
            }
        )
        env.update(extra)
        return env

    def popen(self, args: list[str], log: str, **extra_env: str) -> subprocess.Popen:
        """Start ``args`` in a new session, stdout/stderr to ``log``(.out/.err)."""
        with open(log + ".out", "wb") as out, open(log + ".err", "wb") as err:
            p = subprocess.Popen(args, stdout=out, stderr=err, env=self.env(**extra_env), cwd=REPO,
                                 start_new_session=True)
        p.log = log  # type: ignore[attr-defined]
        self.procs.append(p)
        self.sessions.add(p.pid)
        return p

    def run(self, args: list[str], timeout: float = 300, **extra_env: str) -> subprocess.CompletedProcess:
        """Run ``args`` to completion (captured output); on timeout everything marked is killed."""
        p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=self.env(**extra_env),
                             cwd=REPO, start_new_session=True, text=True)
        self.procs.append(p)
        self.sessions.add(p.pid)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()
            out, err = p.communicate()
            raise AssertionError(f"{' '.join(args)} did not finish in {timeout} s\nstdout:\n{out}\nstderr:\n{err[-4000:]}")
        return subprocess.CompletedProcess(args, p.returncode, out, err)

    def close(self) -> None:
        try:
            self.kill_all()
        finally:
            for p in self.procs:
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        p.kill()
                with contextlib.suppress(Exception):
                    p.wait(timeout=10)
            shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def prepack(*args: str) -> list[str]:
    """The CLI as a user runs it, with this interpreter (the project's venv)."""
    return [sys.executable, "-m", "prepack.cli", *args]


def read_log(p: subprocess.Popen) -> tuple[str, str]:
    with open(p.log + ".out") as f1, open(p.log + ".err") as f2:  # type: ignore[attr-defined]
        return f1.read(), f2.read()


def wait_until(cond: Callable[[], bool], timeout: float, what: str, proc: subprocess.Popen | None = None,
               poll: float = 0.01) -> None:
    """Poll ``cond`` every ``poll`` s; fail if ``proc`` exits first or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while not cond():
        if proc is not None and proc.poll() is not None:
            out, err = read_log(proc) if hasattr(proc, "log") else ("", "")
            raise AssertionError(f"the run ended (rc {proc.returncode}) before {what}\n{out}\n{err[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(poll)


# -- output checks --------------------------------------------------------------------------------
def leftovers(out: str) -> list[str]:
    """Temporary files anywhere under ``out`` (and a stream lease left behind)."""
    bad = []
    for dirpath, _, files in os.walk(out):
        for f in files:
            rel = os.path.relpath(os.path.join(dirpath, f), out)
            if f.endswith(".tmp") or rel.startswith(".prepack" + os.sep):
                bad.append(rel)
    return bad


def lease_files(out: str) -> list[str]:
    """The stream leases present in a local output (one per live or killed run)."""
    from prepack.run.lease import LEASE_DIR

    d = os.path.join(out, LEASE_DIR)
    return sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".json")) if os.path.isdir(d) else []


def load_manifest(out: str) -> dict:
    """A finished pack as one dict: manifest.json's identity and stream summaries, each stream with
    the shards and records of its index (the shape these tests compare)."""
    from dataclasses import asdict

    from loader.reader import Pack
    from schemas.manifest import PackSummary

    with open(os.path.join(out, "manifest.json")) as f:
        summary = PackSummary.from_json(f.read())
    pack = Pack.open(out)
    streams = []
    for s in summary.streams:
        d = asdict(s)
        d["shards"] = [{**{k: v for k, v in vars(sh).items() if k != "root"}, "records": [asdict(r) for r in sh.records]}
                       for sh in pack.index(s.stream).shards]
        streams.append(d)
    return {"identity": summary.identity, "streams": streams}


def committed_shards(out: str, stream: int) -> list[int]:
    """Shard numbers the stream's index lists (the committed ones)."""
    from loader.reader import Pack

    try:
        return [sh.shard for sh in Pack.open(out).index(stream).shards]
    except Exception:  # pack.json or the index not written yet
        return []


def comparable(stream_entry: dict, with_bytes: bool = True) -> dict:
    """A manifest stream entry without its timing (wall and CPU seconds) (and, unless
    ``with_bytes``, without the shard files' sha256/size: shard metadata carries the code
    fingerprint, records do not)."""
    d = {k: v for k, v in stream_entry.items() if k not in INFORMATIONAL_FIELDS}
    if not with_bytes:
        d["shards"] = [{k: v for k, v in sh.items() if k not in ("xxh3", "nbytes", "ckpt_json_sha256", "ckpt_arrow_sha256",
                                                                "lineage_sha256", "pixels_sha256")} for sh in d["shards"]]
        d.pop("root", None)  # the chain covers the file digests too
    return d


def same_streams(a: dict, b: dict) -> None:
    """Two manifests hold the same streams: every record digest, shard boundary and counter; the
    shard bytes too when both were packed by the same code."""
    same_code = a["identity"].get("code_fingerprint") == b["identity"].get("code_fingerprint")
    left = [comparable(s, same_code) for s in a["streams"]]
    right = [comparable(s, same_code) for s in b["streams"]]
    assert len(left) == len(right)
    for x, y in zip(left, right):
        dx = [r["digest"] for sh in x["shards"] for r in sh["records"]]
        dy = [r["digest"] for sh in y["shards"] for r in sh["records"]]
        assert dx == dy, f"stream {x['stream']}: record digests differ"
        assert x == y, f"stream {x['stream']}: manifest entries differ"


def check_stream_contiguity(manifest: dict) -> None:
    """Shards numbered 0.. with first_record continuing the stream; counts agree with the shards."""
    for s in manifest["streams"]:
        nxt = 0
        for k, sh in enumerate(s["shards"]):
            assert sh["shard"] == k and sh["stream"] == s["stream"], (s["stream"], k, sh["shard"])
            assert sh["first_record"] == nxt, f"stream {s['stream']} shard {k}: first_record {sh['first_record']} != {nxt}"
            assert sh["records"], f"stream {s['stream']} shard {k} is empty"
            nxt += len(sh["records"])
        assert s["num_records"] == nxt, (s["stream"], s["num_records"], nxt)
        assert s["num_tokens"] == sum(r["num_tokens"] for sh in s["shards"] for r in sh["records"])


def read_back(out: str, manifest: dict, decode: int = 1) -> dict[int, int]:
    """Read every stream through ``open_stream`` (digests verified); decode the first ``decode``
    batches of each fully.  Returns records read per stream."""
    from loader import open_stream

    counts = {}
    for s in manifest["streams"]:
        n = 0
        records = [r for sh in s["shards"] for r in sh["records"]]
        for i, batch in enumerate(open_stream(out, stream=s["stream"])):
            assert batch.sequence_length == records[i]["num_tokens"]
            assert len(batch.batch_data_indexes) == records[i]["num_samples"]
            if i < decode:
                d = batch.to_dict()
                assert d["sequence_length"] == records[i]["num_tokens"]
                assert d["packed_text_ids"].ndim == 1 and d["packed_text_ids"].numel() > 0
                assert int(d["packed_position_ids"].numel()) == d["sequence_length"]
            n += 1
        counts[s["stream"]] = n
    return counts


def summary(stdout: str) -> list[str]:
    """The run summary's lines (Ray's own messages to the driver may come before them)."""
    lines = stdout.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(("packed: ", "already complete: ")):
            return lines[i:]
    raise AssertionError(f"no run summary in the output:\n{stdout}")
