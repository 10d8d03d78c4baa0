"""Run an iterator on a background thread, a bounded number of items ahead of the consumer.

Why a thread: reading and zstd-decompressing a record releases the GIL, so it overlaps the
training step for free.  The thread holds no reference to the consumer-side object, so dropping
the iterator (or an exception in the consumer) lets ``__del__``/``close`` stop and join it;
an exception in the producer is re-raised, with its traceback, at the consumer's ``next()``.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)

_ITEM, _END, _ERROR = range(3)
_POLL_S = 0.05


def _put(q: queue.Queue, stop: threading.Event, message) -> bool:
    while not stop.is_set():
        try:
            q.put(message, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


def _produce(source: Iterable, q: queue.Queue, stop: threading.Event) -> None:
    iterator = iter(source)
    try:
        for item in iterator:
            if not _put(q, stop, (_ITEM, item)):
                return
        _put(q, stop, (_END, None))
    except BaseException as exc:  # handed to the consumer, not lost in the thread
        _put(q, stop, (_ERROR, exc))
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:
            close()


class Prefetcher(Generic[T], Iterator[T]):
    """Iterate ``source`` on a daemon thread, at most ``depth`` items ahead."""

    def __init__(self, source: Iterable[T], depth: int = 2, name: str = "prefetch"):
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._finished = False
        self._thread = threading.Thread(target=_produce, args=(source, self._queue, self._stop), name=name, daemon=True)
        self._thread.start()

    def __iter__(self) -> "Prefetcher[T]":
        return self

    def __next__(self) -> T:
        if self._finished:
            raise StopIteration
        kind, value = self._queue.get()
        if kind == _ITEM:
            return value
        self._finished = True
        self._thread.join()
        if kind == _ERROR:
            raise value
        raise StopIteration

    def ready(self) -> bool:
        """Whether ``next()`` returns without waiting (an item, the end or an error is queued, or the
        iteration is over): a consumer about to wait can say so first."""
        return self._finished or not self._queue.empty()

    def close(self) -> None:
        """Stop the producer and wait for it (it finishes the item it is working on)."""
        self._finished = True
        self._stop.set()
        while True:  # unblock a producer waiting on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing left to clean
            pass
