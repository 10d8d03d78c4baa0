"""A job's streams on Ray (``prepack run`` without ``--no-ray``): a task per stream, its retries,
lost nodes said as they happen, the progress bar fed from a progress actor, and (with a bound) a
stream task that waits too long for its trainings paused and started again when they come close.
``prepack.run.driver`` decides what to pack; this runs it on the cluster."""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

from prepack.run.bounded.ahead import JobStreams
from prepack.run.lease import StreamLease
from prepack.run.progress_bar import RunProgress
from prepack.run.ray_init import init_ray
from prepack.run.stream_job import StreamJob, paused_at
from schemas.errors import StreamFailed
from schemas.location import resolve_location

if TYPE_CHECKING:
    from prepack.run.driver import RunOptions

LOG_EVERY_S = 30.0
NODE_CHECK_S = 5.0  # how often the driver looks for lost nodes

log = logging.getLogger("prepack.run.driver")  # the driver's lines, as users and prepack.cli know them


def _pinned_progress(ray, Progress):
    """The progress actor, on the driver's own node (a worker node may vanish; this one holds the run)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    return Progress.options(scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False)).remote()


class _Watch:
    """The driver's guarded view of the cluster: progress reports, task attempts, lost nodes.

    Every call may fail (an actor or the GCS briefly unreachable): it then returns what it knew."""

    def __init__(self, ray, progress):
        self.ray, self.progress = ray, progress
        self.reports: dict = {}
        self.attempts: dict = {}
        self.dead: dict[str, str] = {}  # node id -> address, for nodes seen alive then dead
        self._alive: dict[str, str] = {}
        self._last_nodes = 0.0
        self._warned = False

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Wait until the actor answers, before any task starts: a task's first report would
        otherwise queue in its own worker until the actor exists, and be lost if that worker's
        node died meanwhile (the retry would then look like a first attempt)."""
        try:
            self.ray.get(self.progress.poll.remote(), timeout=timeout_s)
        except Exception as e:  # noqa: BLE001  (best effort: pack without progress)
            log.info("progress actor not ready after %.0f s (%s); packing goes on", timeout_s, type(e).__name__)

    def poll(self) -> None:
        try:
            self.reports, self.attempts = self.ray.get(self.progress.poll.remote(), timeout=10)
        except Exception as e:  # noqa: BLE001  (progress is best effort)
            if not self._warned:
                self._warned = True
                log.info("progress reports unavailable for now (%s); packing goes on", type(e).__name__)

    def attempts_from_state_api(self, timeout_s: int = 10) -> None:
        """Add what Ray's state API knows about this job's stream task attempts (best effort).

        A task killed with its node before its first statement ran never reported; Ray's own
        record of its attempts still names the stream (``stream_task[S]``).  Needs the cluster's
        dashboard (there under ``ray job submit``); a local Ray without one just skips this."""
        try:
            from ray.util.state import list_tasks

            job = self.ray.get_runtime_context().get_job_id()
            tasks = list_tasks(filters=[("job_id", "=", job)], limit=100_000, timeout=timeout_s,
                               raise_on_missing_output=False)
        except Exception as e:  # noqa: BLE001
            log.debug("Ray's state API did not answer (%s: %s); retries named from progress reports only",
                     type(e).__name__, e)
            return
        seen: dict[int, dict[int, str]] = {}
        for t in tasks:
            name = getattr(t, "name", "") or ""
            if name.startswith("stream_task[") and name.endswith("]"):
                seen.setdefault(int(name[12:-1]), {})[int(getattr(t, "attempt_number", 0) or 0)] = \
                    getattr(t, "node_id", "") or "?"
        for stream, by_attempt in seen.items():
            known = self.attempts.get(stream, [])
            if max(by_attempt) + 1 > len(known):
                self.attempts[stream] = [by_attempt.get(k, known[k] if k < len(known) else "?")
                                         for k in range(max(by_attempt) + 1)]

    def lost_nodes(self) -> list[str]:
        """Lines for nodes that died since the last look (looked at every NODE_CHECK_S)."""
        if time.monotonic() - self._last_nodes < NODE_CHECK_S:
            return []
        self._last_nodes = time.monotonic()
        try:
            nodes = self.ray.nodes()
        except Exception:  # noqa: BLE001
            return []
        lines = []
        for n in nodes:
            nid, addr = n.get("NodeID", ""), n.get("NodeManagerAddress", "?")
            if n.get("Alive"):
                self._alive[nid] = addr
            elif nid in self._alive and nid not in self.dead:
                self.dead[nid] = addr
                lines.append(f"node {addr} ({nid[:8]}) was lost; Ray retries its stream tasks on the other nodes")
        if self.dead:
            self.attempts_from_state_api()
        return lines


# A stream task waiting for its trainings longer than this lets its CPU go (with more streams than
# CPUs).  Short: a queued stream may be the one its trainings wait for (balanced samples couple a
# step class's streams); a pause costs a task start (the tokenizer, the checkpoint) on a CPU that
# would idle anyway.  4 streams on 2 CPUs, --ahead 1: 108 s with 30 s, 28 s with 3 s (balanced
# samples); 24.8 s and 22.7 s unbalanced.
PAUSE_AFTER_S = 3.0


class RayRun:
    """``job``'s streams ``todo`` as Ray tasks, under ``lease``, reporting to ``run``: the driver's loop
    (submit the streams that may pack, collect the finished, trim, show progress and retries)."""

    def __init__(self, job: StreamJob, todo: list[int], lease: StreamLease, run: RunProgress):
        self.job, self.todo, self.lease, self.run_progress = job, todo, lease, run
        self.bar = None

    def run(self, options: RunOptions) -> None:
        ray = init_ray(options.address, options.num_cpus)
        try:
            # the Ray side is imported with Ray: `prepack run --no-ray`, plan and --help never import it
            from prepack.run.ray_tasks import Progress, stream_task

            self.ray, self.stream_task = ray, stream_task
            self.watch = _Watch(ray, _pinned_progress(ray, Progress))
            self.watch.wait_ready()
            self.local = not (options.address or os.environ.get("RAY_ADDRESS"))
            self.guard = options.guard
            self.level = logging.getLogger().getEffectiveLevel()
            self.job_ref = ray.put(self.job)  # once in the object store, not once per task
            self.streams = JobStreams(resolve_location(self.job.out), self.todo, self.job.bound)
            # a waiting task holds its CPU: with more streams than CPUs it lets it go after a while (and is
            # started again when its trainings come close), or the streams behind it would never start
            self.give_up = (None if len(self.todo) <= int(ray.cluster_resources().get("CPU", 1))
                            else PAUSE_AFTER_S)
            if options.bar:
                from tqdm import tqdm

                run = self.run_progress
                self.bar = tqdm(total=(run.budget * len(self.todo)) if run.budget else None, unit="batch",
                                dynamic_ncols=True, desc=f"packing {len(self.todo)} streams")
            try:
                self._loop()
            finally:
                if self.bar is not None:
                    self.bar.close()
        finally:
            ray.shutdown()

    def _submit(self, s: int):
        self.streams.started(s)
        return self.stream_task.options(name=f"stream_task[{s}]").remote(
            self.job_ref, s, self.watch.progress, self.local, self.level, self.give_up)

    def _say(self, lines) -> None:
        for line in lines:
            if self.bar is not None:
                self.bar.clear()
            log.warning("%s", line)

    def _collect(self, pending: dict) -> None:
        """The tasks that ended: a stream done or paused; a failed one fails the run (the others cancelled)."""
        ray = self.ray
        ready, _ = ray.wait(list(pending), timeout=0.5) if pending else ([], None)
        for ref in ready:
            s = pending.pop(ref)
            try:
                self.streams.returned(s, paused_at(ray.get(ref)))
            except Exception as e:
                for other in pending:
                    ray.cancel(other, force=True)
                cause = getattr(e, "cause", None) or e
                why = str(cause).strip().splitlines()[-1] if str(cause).strip() else ""
                raise StreamFailed(f"stream {s} failed: {type(cause).__name__}: {why}") from e

    def _loop(self) -> None:
        ray, watch, run = self.ray, self.watch, self.run_progress
        pending = {self._submit(s): s for s in self.streams.ready()}
        started = last_log = time.monotonic()
        while self.streams.streams:
            try:
                self.lease.check()  # another run took our streams over: stop writing at once
                if self.guard is not None:
                    self.guard()
            except Exception:
                for ref in pending:
                    ray.cancel(ref, force=True)
                raise
            self._collect(pending)
            for s in self.streams.ready():  # paused streams their trainings came close to
                pending[self._submit(s)] = s
            self.streams.trim()
            if not pending:
                time.sleep(0.5)
            watch.poll()
            for report in watch.reports.values():
                run.update(report)
            self._say(watch.lost_nodes())
            self._say(run.retried(watch.attempts, watch.dead))
            self._say(run.new_kinds())
            if self.bar is not None:
                self.bar.n = run.batches
                self.bar.set_postfix_str(run.postfix(self.bar.format_dict.get("elapsed") or 0.0))
                self.bar.refresh()
            elif time.monotonic() - last_log >= LOG_EVERY_S:  # no terminal (e.g. ray job logs)
                last_log = time.monotonic()
                log.info("%d batches; %s", run.batches, run.postfix(last_log - started))
        self.streams.trim(force=True)
        watch.poll()  # the last word on retries and on the streams' final counts: every task has ended
        for report in watch.reports.values():
            run.update(report)
        self._say(run.new_kinds())  # kinds only a stream's end counts (what was left in its buffer)
        if watch.dead:  # (the state API is asked only after a node loss: it may take seconds)
            watch.attempts_from_state_api(timeout_s=30)
        self._say(run.retried(watch.attempts, watch.dead))
