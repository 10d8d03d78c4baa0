"""The Ray side of a run: the stream task (one per stream) and the progress mailbox actor.

Imported only when a run uses Ray (``prepack.run.driver``), so ``prepack --help``, ``plan`` and
``--no-ray`` never import Ray.  The driver pins the actor to its own node (a worker node may vanish;
this one holds the run) and every call to it is best effort: progress never fails a stream.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

import ray

if TYPE_CHECKING:
    from prepack.run.stream_job import StreamJob

from prepack.run.lease import pid_alive
from prepack.run.progress_bar import StreamProgress

TASK_RETRIES = 10  # per stream task, for system failures (a lost worker or node); each retry resumes


def _attempt() -> int:
    """This task's attempt number (0 first, 1 first retry...), or -1 where Ray does not say.

    Ray has no public call for it; its core worker's is used if present (best effort)."""
    try:
        from ray._private.worker import global_worker

        return int(global_worker.core_worker.get_current_task_attempt_number())
    except Exception:  # noqa: BLE001
        return -1


@ray.remote(num_cpus=0)
class Progress:
    """A mailbox for progress reports: on the driver's node, holds plain data only."""

    def __init__(self):
        self.reports: dict[int, StreamProgress] = {}
        self.attempts: dict[int, list[str]] = {}  # stream -> node id of each attempt

    def started(self, stream: int, node: str, attempt: int = -1) -> None:
        """``attempt``: Ray's attempt number for the task (-1 unknown).  Attempts that died before
        they could report are filled in as "?", so a retry is known even then."""
        nodes = self.attempts.setdefault(stream, [])
        if attempt == 0:  # a new task for the stream (a bounded run starts a paused stream again): not a retry
            nodes.clear()
        while len(nodes) < attempt:
            nodes.append("?")
        nodes.append(node)

    def update(self, report: StreamProgress) -> None:
        self.reports[report.stream] = report

    def poll(self) -> tuple[dict, dict]:
        return dict(self.reports), {s: list(n) for s, n in self.attempts.items()}


@ray.remote(num_cpus=1, max_retries=TASK_RETRIES)
def stream_task(job: "StreamJob", stream: int, progress, local_ray: bool = False, log_level: int = logging.WARNING,
                give_up_s: float | None = None):
    def tell(method, *args) -> None:  # progress is best effort: it may never fail the stream
        try:
            getattr(progress, method).remote(*args)
        except Exception:  # noqa: BLE001  (a dead or unreachable actor)
            pass

    # First: with Ray's attempt number a retry is known even when the attempt before it died before
    # it could report.  Not waited for: a task blocked in ray.get lends its CPU to the next task, and
    # packing workers would then oversubscribe.
    tell("started", stream, ray.get_runtime_context().get_node_id(), _attempt())
    # only now the packer's modules (torch, transformers: seconds): a node lost meanwhile still shows the retry
    from prepack.engine.tokenizer import load_tokenizer, special_token_ids
    from prepack.run import stream_job, worker_process  # (the same reason)

    if log_level < logging.WARNING:  # -v: each drop's detail from the worker, as it happens
        logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    # A local Ray fate-shares with its driver: a SIGKILLed driver takes the raylet along, but
    # its orphaned workers would go on packing (and even start a task pushed just before)
    # for seconds, racing a rerun over the same files.  So on a local Ray (same host, same
    # PID namespace) a task stops at the next record once its raylet has exited.
    raylet = int(os.environ.get("RAY_RAYLET_PID") or 0) if local_ray else 0

    def check_raylet() -> None:
        if raylet and not pid_alive(raylet):
            raise RuntimeError(f"stream {stream}: this worker's raylet (pid {raylet}) is gone; stopping")

    check_raylet()
    tokenizer, special = special_token_ids(load_tokenizer(job.cfg.tokenizer))
    last = [0.0]

    def report(progress_now: StreamProgress) -> None:
        check_raylet()
        now = time.monotonic()
        if progress_now.done or now - last[0] > 1.0:  # each report is a Ray call: once a second is enough for a bar
            last[0] = now
            tell("update", progress_now)

    check_raylet()
    worker_process.settle_worker_process()
    return stream_job.pack_one_stream(job, stream, tokenizer, special, report, stream_job.WaitRule(give_up_s))
