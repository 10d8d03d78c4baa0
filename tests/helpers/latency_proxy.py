"""A loopback TCP proxy that adds a fixed latency to every request: a far-away store on this machine.

Listens on 127.0.0.1 only and forwards each connection to one target (the S3 test server).  A
request is what a client sends after the server has answered (HTTP/1.1 keep-alive without
pipelining, as S3 clients speak): the proxy holds the first bytes of each request for
``latency_s`` before forwarding them, on each connection independently, so concurrent requests
each wait once (latency, not bandwidth) and a request's body is not delayed again.  It counts
the requests it delayed and keeps the first line of each.  Its threads are daemons; ``close()``
ends them and every connection.

``ProxyProcess`` runs one in a child process of its own, so that pumping bytes costs the process
being measured no CPU and no GIL; it is stopped by its PID.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import socket
import threading
import time


class LatencyProxy:
    def __init__(self, target_host: str, target_port: int, latency_s: float, counter=None):
        self.target = (target_host, target_port)
        self.latency_s = latency_s
        self._counter = counter  # a multiprocessing.Value when another process reads the count
        self._requests = 0
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
            turn = {"answered": True}  # the client's first bytes start a request
            threading.Thread(target=self._pump, args=(client, upstream, turn, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, turn, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, turn: dict, requests: bool) -> None:
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
                elif not requests:
                    turn["answered"] = True
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._closed = True
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


def _serve(target_host: str, target_port: int, latency_s: float, port, counter, ready) -> None:
    proxy = LatencyProxy(target_host, target_port, latency_s, counter)
    port.value = proxy.port
    ready.set()
    threading.Event().wait()  # until the parent terminates this process


class ProxyProcess:
    """A ``LatencyProxy`` in a child process (spawned: no state of the parent is copied)."""

    def __init__(self, target_host: str, target_port: int, latency_s: float):
        ctx = multiprocessing.get_context("spawn")
        self._port, self._counter, ready = ctx.Value("i", 0), ctx.Value("q", 0, lock=False), ctx.Event()
        self._proc = ctx.Process(target=_serve, args=(target_host, target_port, latency_s, self._port,
                                                      self._counter, ready), daemon=True)
        self._proc.start()
        if not ready.wait(60):
            self.close()
            raise RuntimeError("the latency proxy did not start")
        self.endpoint = f"http://127.0.0.1:{self._port.value}"

    @property
    def requests(self) -> int:
        return int(self._counter.value)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def close(self) -> None:
        if self._proc.is_alive():
            self._proc.terminate()  # SIGTERM to this child's PID
        self._proc.join(10)
