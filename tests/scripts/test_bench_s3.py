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
