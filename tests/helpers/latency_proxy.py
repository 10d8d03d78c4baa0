"""A loopback TCP proxy that adds a fixed latency to every request: a far-away store on this machine.

Listens on 127.0.0.1 only and forwards each connection to one target (the S3 test server).  A
request is what a client sends after the server has answered (HTTP/1.1 keep-alive without
pipelining, as S3 clients speak): the proxy holds the first bytes of each request for
``latency_s`` before forwarding them, on each connection independently, so concurrent requests
each wait once (latency, not bandwidth) and a request's body is not delayed again.  It counts
the requests it delayed and keeps the first line of each, and how long the store took to answer
them (first byte forwarded to first byte back: the server's own time, on a loaded machine its
wait for a core too).  Its threads are daemons; ``close()`` ends them and every connection.

``cache_prefix`` (a path such as ``/bucket/data/``): GETs under it that the store answered with
200 or 206 and a ``Content-Length`` are kept, by path and ``Range``, and the same GET later is
answered with the same bytes by the proxy itself, after the same latency.  For objects nobody
writes after they are read (a benchmark's source data), that takes the store's CPU off this
machine, as it is off a packing node on a cluster: SeaweedFS spends ~1.3 ms of CPU per GET.

``ProxyProcess`` runs one in a child process of its own, so that pumping bytes costs the process
being measured no CPU and no GIL; it is stopped by its PID.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import re
import socket
import threading
import time

_RANGE = re.compile(rb"\r\nrange:[ \t]*([^\r]*)", re.IGNORECASE)
_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*([0-9]+)", re.IGNORECASE)


class _Replay:
    """Answers kept by (path, Range) for GETs under one prefix; a GET's answer is recorded as it passes."""

    def __init__(self, prefix: str, counter=None):
        self._prefix = prefix.encode()
        self._answers: dict[tuple[bytes, bytes], bytes] = {}
        self._counter = counter  # a multiprocessing.Value when another process reads the count
        self.hits = 0

    def key(self, head: bytes) -> "tuple[bytes, bytes] | None":
        """The key of a request whose first bytes are ``head``, if it is a whole GET under the prefix."""
        end = head.find(b"\r\n\r\n")
        if end < 0 or not head.startswith(b"GET " + self._prefix) or end + 4 != len(head):
            return None
        head = head[:end]
        length = _LENGTH.search(head)
        if length and int(length.group(1)):
            return None
        rng = _RANGE.search(head)
        return head.split(b" ", 2)[1], rng.group(1).strip() if rng else b""

    def get(self, key) -> "bytes | None":
        answer = self._answers.get(key)
        if answer is not None:
            self.hits += 1
            if self._counter is not None:
                self._counter.value = self.hits
        return answer

    @staticmethod
    def complete(answer: bytearray) -> "int | None":
        """The length of a whole 200/206 answer with a Content-Length in ``answer``; 0 if it cannot be kept; None: not yet."""
        end = answer.find(b"\r\n\r\n")
        if end < 0:
            return None if len(answer) < 1 << 16 else 0
        status = answer[:end].split(b" ", 2)
        length = _LENGTH.search(answer[:end])
        if len(status) < 2 or status[1] not in (b"200", b"206") or length is None:
            return 0
        total = end + 4 + int(length.group(1))
        return total if len(answer) >= total else None

    def keep(self, key, answer: bytes) -> None:
        self._answers[key] = answer


class LatencyProxy:
    def __init__(self, target_host: str, target_port: int, latency_s: float, counter=None, served=None, *,
                 cache_prefix: "str | None" = None, replayed=None):
        self.target = (target_host, target_port)
        self._replay = _Replay(cache_prefix, replayed) if cache_prefix else None
        self.latency_s = latency_s
        self._counter = counter  # a multiprocessing.Value when another process reads the count
        self._served = served  # the same for the store's time (seconds, all requests together)
        self._requests = 0
        self._served_s = 0.0
        self.request_lines: list[str] = []  # each request's first line ("PUT /bucket/key HTTP/1.1"), in order
        self._lock = threading.Lock()
        self._closed = False
        self._conns: list[socket.socket] = []
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self.port = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, name="latency-proxy", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def requests(self) -> int:
        return self._requests

    @property
    def served_s(self) -> float:
        """Seconds the store took to answer, all requests together (the added latency not included)."""
        return self._served_s

    @property
    def replayed(self) -> int:
        """Requests the proxy answered itself (``cache_prefix``)."""
        return self._replay.hits if self._replay else 0

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns += [client, upstream]
            turn = {"answered": True, "sent": 0.0, "record": None}  # the client's first bytes start a request
            threading.Thread(target=self._pump, args=(client, upstream, turn, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, turn, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, turn: dict, requests: bool) -> None:
        replay = self._replay
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if requests and turn["answered"]:  # a new request: it waits once, its body does not
                    turn["answered"] = False
                    with self._lock:
                        self._requests += 1
                        self.request_lines.append(data.split(b"\r\n", 1)[0].decode("latin-1"))
                        if self._counter is not None:
                            self._counter.value = self._requests
                    time.sleep(self.latency_s)
                    key = replay.key(data) if replay else None
                    answer = replay.get(key) if key else None
                    if answer is not None:  # the store is not asked again: the proxy answers
                        turn["answered"] = True
                        src.sendall(answer)
                        continue
                    turn["record"] = None if key is None else (key, bytearray())
                    turn["sent"] = time.perf_counter()
                elif not requests:
                    if not turn["answered"]:  # the first bytes of the answer
                        turn["answered"] = True
                        with self._lock:
                            self._served_s += time.perf_counter() - turn["sent"]
                            if self._served is not None:
                                self._served.value = self._served_s
                    if turn["record"] is not None:  # kept before the client has all of it (and asks again)
                        key, answer = turn["record"]
                        answer += data
                        total = replay.complete(answer)
                        if total is not None:
                            if total:
                                replay.keep(key, bytes(answer[:total]))
                            turn["record"] = None
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread (close alone does not)
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            with contextlib.suppress(OSError):
                s.close()
        self._thread.join(timeout=5)

    def __enter__(self) -> "LatencyProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _serve(target_host: str, target_port: int, latency_s: float, port, counter, served, replayed, ready,
           cache_prefix: "str | None") -> None:
    proxy = LatencyProxy(target_host, target_port, latency_s, counter, served, cache_prefix=cache_prefix, replayed=replayed)
    port.value = proxy.port
    ready.set()
    threading.Event().wait()  # until the parent terminates this process


class ProxyProcess:
    """A ``LatencyProxy`` in a child process (spawned: no state of the parent is copied)."""

    def __init__(self, target_host: str, target_port: int, latency_s: float, cache_prefix: "str | None" = None):
        ctx = multiprocessing.get_context("spawn")
        self._port, self._counter, ready = ctx.Value("i", 0), ctx.Value("q", 0, lock=False), ctx.Event()
        self._served, self._replayed = ctx.Value("d", 0.0, lock=False), ctx.Value("q", 0, lock=False)
        self._proc = ctx.Process(target=_serve, args=(target_host, target_port, latency_s, self._port, self._counter,
                                                      self._served, self._replayed, ready, cache_prefix), daemon=True)
        self._proc.start()
        if not ready.wait(60):
            self.close()
            raise RuntimeError("the latency proxy did not start")
        self.endpoint = f"http://127.0.0.1:{self._port.value}"

    @property
    def requests(self) -> int:
        return int(self._counter.value)

    @property
    def served_s(self) -> float:
        return float(self._served.value)

    @property
    def replayed(self) -> int:
        return int(self._replayed.value)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def close(self) -> None:
        if self._proc.is_alive():
            self._proc.terminate()  # SIGTERM to this child's PID
        self._proc.join(10)
