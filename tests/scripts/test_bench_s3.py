"""The latency proxy ``scripts/bench_s3.py`` puts before the store: it forwards every byte, holds
each request (not each chunk of its body) for the latency, and counts requests — in this
process and in the child process the bench uses."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from tests.helpers.latency_proxy import LatencyProxy, ProxyProcess


def _echo_server() -> tuple[socket.socket, int]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)

    def serve():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=_echo, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return srv, srv.getsockname()[1]


def _echo(conn: socket.socket) -> None:
    with conn:
        while data := conn.recv(65536):
            conn.sendall(b"re:" + data)


def _exchange(port: int, messages: list[bytes]) -> tuple[list[bytes], float]:
    with socket.create_connection(("127.0.0.1", port)) as c:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t = time.perf_counter()
        answers = []
        for m in messages:
            c.sendall(m)
            answers.append(c.recv(65536))
        return answers, time.perf_counter() - t


@pytest.mark.parametrize("in_child", [False, True])
def test_each_request_waits_once_and_is_counted(in_child):
    srv, port = _echo_server()
    proxy = (ProxyProcess if in_child else LatencyProxy)("127.0.0.1", port, 0.05)
    try:
        proxy_port = int(proxy.endpoint.rsplit(":", 1)[1])
        answers, elapsed = _exchange(proxy_port, [b"GET /a", b"GET /b", b"GET /c"])
        assert answers == [b"re:GET /a", b"re:GET /b", b"re:GET /c"]
        assert elapsed >= 3 * 0.05  # a lower bound only: each request waited at least once
        assert proxy.requests == 3
    finally:
        proxy.close()
        srv.close()


def _http_server() -> tuple[object, int, list[str]]:
    """A keep-alive HTTP server answering GET with the path and Range in the body; logs what it was asked."""
    import http.server

    asked: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def _answer(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            asked.append(f"GET {self.path} {self.headers.get('Range')}")
            if self.path.endswith("/missing"):
                return self._answer(404, b"no such key")
            body = f"{self.path}|{self.headers.get('Range')}|{len(asked)}|".encode() * 5000  # over one recv
            self._answer(206 if self.headers.get("Range") else 200, body)

        def do_PUT(self):
            asked.append(f"PUT {self.path}")
            self.rfile.read(int(self.headers["Content-Length"]))
            self._answer(200, b"")

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, srv.server_address[1], asked


@pytest.mark.parametrize("in_child", [False, True])
def test_repeated_gets_under_the_cache_prefix_are_answered_by_the_proxy_with_the_same_bytes(in_child):
    import http.client

    srv, port, asked = _http_server()
    proxy = (ProxyProcess if in_child else LatencyProxy)("127.0.0.1", port, 0.0, cache_prefix="/b/data/")
    try:
        conn = http.client.HTTPConnection("127.0.0.1", int(proxy.endpoint.rsplit(":", 1)[1]))

        def get(path: str, rng: "str | None" = None) -> tuple[int, bytes]:
            conn.request("GET", path, headers={"Range": rng} if rng else {})
            r = conn.getresponse()
            return r.status, r.read()

        first = [get("/b/data/x"), get("/b/data/x", "bytes=0-9"), get("/b/other"), get("/b/data/missing")]
        conn.request("PUT", "/b/data/y", body=b"z" * 100)
        assert conn.getresponse().read() == b""
        again = [get("/b/data/x"), get("/b/data/x", "bytes=0-9"), get("/b/other"), get("/b/data/missing")]
        assert [s for s, _ in first] == [s for s, _ in again] == [200, 206, 200, 404]
        assert again[:2] == first[:2]  # replayed: the same bytes, the server's count in them unchanged
        assert again[2] != first[2]  # outside the prefix: asked again
        assert asked == ["GET /b/data/x None", "GET /b/data/x bytes=0-9", "GET /b/other None", "GET /b/data/missing None",
                         "PUT /b/data/y", "GET /b/other None", "GET /b/data/missing None"]  # a 404 is not kept
        assert proxy.requests == 9 and proxy.replayed == 2
        conn.close()
    finally:
        proxy.close()
        srv.shutdown()
