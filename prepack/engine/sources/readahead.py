"""Bounded read-ahead of source objects on an object store: request latency overlaps packing.

On a store every source object (a parquet footer or row group, a JSONL row's image or video) is a
request of tens of milliseconds, and the packer would wait for each in turn.  A source on a URI
instead gets a ``ReadAhead``: a planner thread walks the objects the source will read next, in
exactly the order it reads them, and hands each fetch to the stream's I/O threads (``IOPool``,
started as fetches wait for one, at most 32); the source takes the results back in that order.  What the source computes is
unchanged: the same calls fetch the same bytes, and a fetch that failed re-raises its own
exception where the source would have made the call, so a missing or damaged object is counted
and dropped by the same rule at the same point.  Nothing of it is state: a resumed source starts
a new read-ahead at its restored cursor.

The bound, per source (a stream has at most three): at most ``depth`` objects (64) fetched or
being fetched ahead of the packer, and no new fetch starts while those objects reach
``max_bytes`` (64 MiB) — fetched ones by their size, those in flight by their size in a parquet
footer or else by the mean size of the source's fetches so far.  So a source holds about
``max_bytes`` plus the one object that crossed it (estimates aside), and the row being packed:
the packer takes all of a JSONL row's objects at once, as decoding the row needs them.  Within
that bound the window is only as deep as the store needs: it starts at 8 objects and doubles
each time the source has to wait for an object, so a near store is not read far ahead (a stream's
end wastes fewer fetches) and a far one is after three waits, once per stream.  A full window
takes new fetches again once a quarter of it is free, so the planner wakes once for several.  Settings come
from the environment of the packing process (``PREPACK_READ_AHEAD``, ``PREPACK_READ_AHEAD_MB``,
``PREPACK_IO_THREADS``): they change no byte of the output, so they are not part of the config.

Local paths do not use it: the page cache and the kernel's own read-ahead already hide a local
disk's latency, and the threads would only cost the packer CPU.

A source describes its reads once (``Read``, ``Reads``): a generator of the objects it reads from
its cursor on, in order, that is sent the value of each read it goes on from (a footer, a
listing).  ``plan_of`` turns the description into the read-ahead's plan; ``read_along`` walks the
same description on the source's side, taking each object from the read-ahead or, without one,
reading it there and then.  So the read-ahead cannot fetch another object than the one the source
reads next (``ReadAhead.take`` still checks each key).
"""

from __future__ import annotations

import collections
import io
import logging
import os
import threading
import time
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from typing import Any, Callable, Generator, Hashable, Iterator

import pyarrow as pa

from prepack.engine.sources import files
from prepack.engine.sources.ledger import NoLedger
from schemas.errors import ConfigError

log = logging.getLogger(__name__)

Submit = Callable[..., Future]  # submit(key, fetch, size=None) -> the fetch's future


@dataclass(frozen=True)
class ReadAheadSettings:
    """How far a remote source reads ahead; ``depth == 0`` turns read-ahead off."""

    depth: int = 64  # objects fetched or in flight per source (a frame folder row alone can be 31, the next row behind it)
    max_bytes: int = 64 << 20  # no new fetch while a source's objects ahead (held or in flight) reach this
    threads: int = 32  # at most this many I/O threads per stream, shared by its sources, started as fetches queue

    @classmethod
    def from_env(cls, env: "dict[str, str] | None" = None) -> "ReadAheadSettings":
        env = os.environ if env is None else env
        d = cls()
        try:
            return cls(depth=max(0, int(env.get("PREPACK_READ_AHEAD", d.depth))),
                       max_bytes=max(1, int(float(env.get("PREPACK_READ_AHEAD_MB", d.max_bytes >> 20)) * (1 << 20))),
                       threads=max(1, int(env.get("PREPACK_IO_THREADS", d.threads))))
        except ValueError as e:
            raise ConfigError(f"PREPACK_READ_AHEAD / PREPACK_READ_AHEAD_MB / PREPACK_IO_THREADS: {e}") from None


class IOPool:
    """One stream's I/O threads, shared by its remote sources, started as fetches wait for one.

    A blocking fetch holds its thread for the store's whole latency, so the threads bound the
    requests in flight: 8 of them behind 30 ms fetch at most ~250 objects a second, fewer than a
    stream packing ~6 objects a batch at 15 ms a batch needs.  So a thread is started whenever a
    fetch is queued and every thread is busy, up to ``settings.threads``: a near store needs few,
    a far one as many as its latency asks for (they wait on the network, not the CPU).

    Fair between sources: a free thread takes the waiting fetch that is nearest to being needed —
    fewest objects ahead of what its source has taken — so one source's deep window never queues
    another source's next object behind it.  Within a source, fetches start in plan order.
    """

    def __init__(self, settings: ReadAheadSettings, name: str = "prepack-io"):
        self.settings = settings
        self.name = name
        self._cond = threading.Condition()
        self._sources: list[ReadAhead] = []
        self._threads: list[threading.Thread] = []
        self._free = 0  # threads not in a fetch (a thread just started counts as free)
        self._epoch = 0  # a close ends the threads of its epoch; a read-ahead after it starts new ones
        self._closed = False

    @property
    def enabled(self) -> bool:
        return self.settings.depth > 0

    @property
    def threads(self) -> int:
        """I/O threads started so far (since the last close)."""
        with self._cond:
            return len(self._threads)

    def read_ahead(self, plan: Callable[[Submit], None], name: str) -> "ReadAhead":
        """Start reading ahead along ``plan`` (see ``ReadAhead``)."""
        with self._cond:
            self._closed = False
            ra = ReadAhead(self, plan, depth=self.settings.depth, max_bytes=self.settings.max_bytes,
                           name=f"{self.name}-{name}")
            self._sources.append(ra)
            return ra

    def _submit(self, ra: "ReadAhead", seq: int, fut: Future, fetch: Callable[[], Any],
                fetched: Callable[[Any], None]) -> None:
        """Queue ``fetch`` for ``fut``; ``fetched(value or None)`` runs before the future is done."""
        with self._cond:
            if self._closed:
                raise _Closed
            ra._pending.append((seq, fut, fetch, fetched))
            if len(self._threads) < self.settings.threads and self._free < sum(len(r._pending) for r in self._sources):
                t = threading.Thread(target=self._work, args=(self._epoch,), name=f"{self.name}_{len(self._threads)}",
                                     daemon=True)
                self._threads.append(t)
                self._free += 1
                t.start()
            self._cond.notify()

    def _forget(self, ra: "ReadAhead") -> None:
        with self._cond:
            if ra in self._sources:
                self._sources.remove(ra)

    def _next_job(self, epoch: int):
        """(future, fetch, fetched) nearest to being needed, or None once the pool is closed."""
        with self._cond:
            while True:
                if self._closed or epoch != self._epoch:
                    return None
                ready = [ra for ra in self._sources if ra._pending]
                if ready:
                    ra = min(ready, key=lambda r: r._pending[0][0] - r._taken)
                    self._free -= 1
                    return ra._pending.popleft()[1:]
                self._cond.wait()

    def _work(self, epoch: int) -> None:
        while True:
            job = self._next_job(epoch)
            if job is None:
                return
            fut, fetch, fetched = job
            if not fut.set_running_or_notify_cancel():  # cancelled while it waited
                self._freed(epoch)
                continue
            try:
                value = fetch()
            except BaseException as e:  # delivered to the source where it reads this object
                fetched(None)
                self._freed(epoch)
                fut.set_exception(e)
            else:
                fetched(value)  # the window's byte count is right before anyone sees the future done
                self._freed(epoch)  # and this thread free: the next fetch the source makes room for needs no new one
                fut.set_result(value)

    def _freed(self, epoch: int) -> None:
        with self._cond:
            if epoch == self._epoch:
                self._free += 1

    def close(self) -> None:
        """Stop every read-ahead and end the threads once their fetch in flight returns."""
        with self._cond:
            sources, self._sources = self._sources, []
        for ra in sources:
            ra.close()
        with self._cond:
            self._closed = True
            self._epoch += 1
            threads, self._threads, self._free = self._threads, [], 0
            self._cond.notify_all()
        log.debug("%s: %d I/O threads", self.name, len(threads))
        for t in threads:
            t.join(timeout=60)
            if t.is_alive():
                log.warning("%s: still in a fetch after 60 s; it ends with the fetch", t.name)


class _Closed(BaseException):  # not an Exception: a plan's own error handling must not swallow it
    """Raised inside the planner thread when its read-ahead was closed: unwinds the plan."""


INITIAL_WINDOW = 8  # objects ahead of a new read-ahead; ``depth`` is where its growth stops


class _Fetch(Future):
    """A fetch's future that tells its read-ahead when the source has to wait for it."""

    def __init__(self, owner: "ReadAhead"):
        super().__init__()
        self._owner = owner

    def result(self, timeout=None):
        if self.done() or threading.current_thread() is self._owner._thread:  # done, or a plan awaiting a footer
            return super().result(timeout)
        self._owner._late()
        t = time.perf_counter()
        try:
            return super().result(timeout)
        finally:
            self._owner._waited(time.perf_counter() - t)


class ReadAheadOutOfStep(RuntimeError):
    """The source asked for another object than the plan fetched next (a bug in a plan)."""


def nbytes(value: Any) -> int:
    """What a fetched value holds in memory, for the byte bound (0 for small metadata)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return len(value)
    if isinstance(value, (pa.Table, pa.RecordBatch)) or isinstance(getattr(value, "nbytes", None), int):
        return value.nbytes  # a table, or a fetched object that says what it holds (a parquet RowGroup)
    if isinstance(value, dict):
        return sum(nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(nbytes(v) for v in value)
    return 0


class ReadAhead:
    """An ordered, bounded window of fetches along one source's plan.

    ``plan(submit)`` runs in the planner thread and walks what the source will read, in order,
    forever (sources cycle); ``submit(key, fetch)`` blocks while the window is full, starts
    ``fetch`` on the pool and returns its future (a plan may wait for one, e.g. a parquet footer
    before its row groups).  The source calls ``take(key)`` for each object in the same order and
    gets that future; ``future.result()`` is the value, or raises the fetch's exception.
    """

    def __init__(self, pool: IOPool, plan: Callable[[Submit], None], *, depth: int, max_bytes: int, name: str):
        self.depth = depth
        self.max_bytes = max_bytes
        self._pool = pool
        self._pending: collections.deque = collections.deque()  # (seq, future, fetch, fetched) not started; the pool's lock
        self._seq = 0  # objects submitted so far
        self._taken = 0  # objects the source has taken so far
        self._plan = plan
        self._cond = threading.Condition()
        self._queue: collections.deque[list] = collections.deque()  # [key, future, bytes counted, in window]
        self._ahead = 0  # bytes of the window: fetched objects by size, those in flight by estimate
        self._fetched = 0  # fetches done so far and the bytes they returned: the estimate for unsized ones
        self._fetched_bytes = 0
        self._window = min(depth, INITIAL_WINDOW)  # objects ahead allowed now: grows while the source waits
        self.waits = 0  # times the source waited for an object, and for how long (seconds): logged at close
        self.waited_s = 0.0
        self._closed = False
        self._refilling = False  # the planner found the window full: it waits for a quarter of it free
        self._planner_waiting = False
        self._planner_error: BaseException | None = None
        self._planner_done = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def window(self) -> int:
        """How many objects may be ahead now (``INITIAL_WINDOW`` up to ``depth``)."""
        return self._window

    def _room(self) -> bool:
        """Whether the planner may submit the next fetch (under the lock).  A window that was full
        takes new fetches again once a quarter of it is free, so the planner wakes once for several
        objects, not once per object taken (each wake-up takes the GIL from the packer); and no new
        fetch while the objects ahead hold ``max_bytes``."""
        n = len(self._queue)
        if self._refilling and n > self._window - max(1, self._window // 4):
            return False
        return not (n and self._ahead >= self.max_bytes)

    def _wake_planner(self) -> None:
        """Under the lock, after the queue or its bytes went down: wake the planner only if it may go on."""
        if self._planner_waiting and self._room():
            self._cond.notify_all()

    def _late(self) -> None:
        """The source waits for an object: the window was too short for the store's latency."""
        with self._cond:
            if self._window < self.depth:
                self._window = min(self.depth, 2 * self._window)
                self._cond.notify_all()

    def _waited(self, seconds: float) -> None:
        self.waits += 1  # the source's thread only
        self.waited_s += seconds
        log.debug("%s: the source waited %.1f ms (window %d)", self._thread.name, seconds * 1e3, self._window)

    @property
    def outstanding(self) -> int:
        """Objects fetched or being fetched that the source has not taken yet (at most ``depth``)."""
        with self._cond:
            return len(self._queue)

    # -- planner thread ----------------------------------------------------------------------
    def _mean_bytes(self) -> int:
        return self._fetched_bytes // self._fetched if self._fetched else 0

    def _fetched_one(self, entry: list, value: Any) -> None:
        """A fetch finished (``value`` None if it failed): its real size replaces its estimate."""
        size = nbytes(value)
        with self._cond:
            if value is not None:
                self._fetched += 1
                self._fetched_bytes += size
            if entry[3]:  # still in the window
                self._ahead += size - entry[2]
                entry[2] = size
                self._wake_planner()  # a smaller object than its estimate may free the byte bound

    def _submit(self, key: Hashable, fetch: "Callable[[], Any] | None", size: "int | None" = None) -> Future:
        """Queue ``fetch`` (None: a mark that fetches nothing, e.g. the end of a row).

        ``size``: what the fetch will hold, when the plan knows it (a parquet row group's size in
        the footer); otherwise the mean of this plan's fetches so far stands in for it until it
        is fetched.
        """
        with self._cond:
            self._refilling = len(self._queue) >= self._window  # full: go on once a quarter of it is free
            while not self._closed and not self._room():
                self._planner_waiting = True
                self._cond.wait()
            self._planner_waiting = False
            if self._closed:
                raise _Closed
            fut = _Fetch(self)
            estimate = 0 if fetch is None else (size if size is not None else self._mean_bytes())
            entry = [key, fut, estimate, True]  # key, future, bytes counted in _ahead, in the window
            if fetch is None:
                fut.set_result(None)
            else:
                self._pool._submit(self, self._seq, fut, fetch, lambda value, entry=entry: self._fetched_one(entry, value))
            self._seq += 1
            self._queue.append(entry)
            self._ahead += estimate
            self._cond.notify_all()
        return fut

    def _run(self) -> None:
        try:
            self._plan(self._submit)
        except (_Closed, CancelledError):
            pass
        except BaseException as e:  # a bug in a plan: the source sees it at its next take
            self._planner_error = e
        finally:
            with self._cond:
                self._planner_done = True
                self._cond.notify_all()

    # -- source thread -----------------------------------------------------------------------
    def take(self, key: Hashable) -> Future:
        """The next object's future; it must be ``key`` (the plan and the source walk in step)."""
        got, fut = self.take_next(key)
        if got != key:
            raise ReadAheadOutOfStep(f"read-ahead fetched {got!r} where the source reads {key!r}")
        return fut

    def take_next(self, wanted: Hashable = None) -> tuple[Hashable, Future]:
        """The next (key, future) of the plan, whatever it is (``wanted`` only names it in errors)."""
        with self._cond:
            while not self._queue and not self._planner_done and not self._closed:
                self._cond.wait()
            if not self._queue:
                raise ReadAheadOutOfStep(f"read-ahead has nothing for {wanted!r}"
                                         + (f": its plan failed ({self._planner_error!r})" if self._planner_error else ""))
            key, fut, counted, _ = entry = self._queue.popleft()
            entry[3] = False
            self._ahead -= counted
            self._taken += 1
            self._wake_planner()
        return key, fut

    def close(self) -> None:
        """Stop planning, drop what was fetched ahead; the pool finishes fetches already running."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            pending = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        for entry in pending:
            entry[1].cancel()
        log.debug("%s: %d objects taken, %d waits (%.3f s), window %d at the end", self._thread.name,
                  self._taken, self.waits, self.waited_s, self._window)
        self._pool._forget(self)
        self._thread.join(timeout=60)
        if self._thread.is_alive():  # waiting on a fetch that hangs; it is a daemon and ends with the fetch
            log.warning("%s: planner still waiting on a fetch after 60 s", self._thread.name)


@dataclass(frozen=True)
class Read:
    """One step of a source's reads: an object to fetch, or a mark (``fetch`` None) where the
    source's walk needs to know it stands (the end of a row, of a pass)."""

    key: Hashable  # names the step; the source's walk reads where it stands from it
    fetch: "Callable[[], Any] | None" = None
    size: "int | None" = None  # what the fetch will hold, when the description knows it (a row group's size)
    needed: bool = False  # the description goes on from its value: it is sent back (a failure thrown in)
    info: Any = None  # what the description learnt on the way, handed to the walk (an SFT row's parse)


Reads = Generator[Read, Any, None]  # a source's reads from its cursor on, forever


def _advance(reads: Reads, read: Read, fut: Future) -> Read:
    """The step after ``read``: a needed read's value is sent in, or its failure thrown in."""
    if not read.needed:
        return next(reads)
    try:
        value = fut.result()
    except Exception as e:  # the description goes on without it (a file that does not open, say)
        return reads.throw(e)
    return reads.send(value)


def plan_of(reads: Reads) -> Callable[[Submit], None]:
    """The read-ahead plan of a description: each of its reads submitted in its order."""

    def plan(submit: Submit) -> None:
        read = next(reads)
        while True:
            read = _advance(reads, read, submit(read.key, read.fetch, read.size))

    return plan


def _now(fetch: "Callable[[], Any] | None") -> Future:
    fut: Future = Future()
    try:
        fut.set_result(None if fetch is None else fetch())
    except Exception as e:  # raised where the source takes the value, as a read-ahead's would be
        fut.set_exception(e)
    return fut


def read_along(reads: Reads, ra: "ReadAhead | None") -> Iterator[tuple[Read, Future]]:
    """The source's side of a description: each read, in order, with its future — the one ``ra``
    fetched ahead, or, without a read-ahead, a done one, fetched when the walk gets there."""
    read = next(reads)
    while True:
        fut = ra.take(read.key) if ra is not None else _now(read.fetch)
        yield read, fut
        read = _advance(reads, read, fut)


class Prefetched:
    """A row's fetched objects, handed to the readers in place of direct reads.

    ``read_bytes``, ``media``, ``video_source`` and ``list_names`` answer from the futures of the
    row's plan, in the order they were fetched (re-raising a failed fetch there), and read
    directly what the plan did not fetch (a local path of a mixed group, say).  Each answer is
    told to the stream's ``ledger`` here, where the row uses it (``prepack.engine.sources.ledger``).
    """

    def __init__(self, futures: "dict[tuple[str, str], list[Future]] | None" = None, ledger=None):
        self._futures = futures if futures is not None else {}
        self._ledger = ledger if ledger is not None else NoLedger()

    def _get(self, op: str, path: str):
        queued = self._futures.get((op, path))
        return queued.pop(0).result() if queued else None

    def read_bytes(self, path: str) -> bytes:
        got = self._get("read", path)
        data = files.read_bytes(path) if got is None else got
        self._ledger.note_bytes(path, data)
        return data

    def media(self, path: str) -> "str | bytes":
        if files.is_uri(path):
            return self.read_bytes(path)
        self._ledger.note_file(path)
        return path

    def video_source(self, path: str):
        if files.is_uri(path):
            return io.BytesIO(self.read_bytes(path))
        self._ledger.note_file(path)
        return path

    def list_names(self, directory: str) -> list[str]:
        got = self._get("list", directory)
        names = files.list_names(directory) if got is None else list(got)
        self._ledger.note_listing(directory, names)
        return names


DIRECT = Prefetched({})  # nothing fetched: every call reads directly (never holds futures)
