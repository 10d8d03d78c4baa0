"""The object-store lock (a lease) against a real S3 server, in process: who gets it, who is
refused, when a dead holder's lease is taken over, and that a run whose lease was taken over
finds out.  Other hosts are simulated with ``PREPACK_LOCK_HOST``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from prepack.run.lock import HOST_ENV, LOCK_NAME, LeaseLock, LeaseTiming, acquire_lock, lock_host
from schemas.errors import LockLost, PackRefused
from schemas.location import resolve_location

pytestmark = pytest.mark.slow  # needs the S3 server (started once per session)

FAST = LeaseTiming(lease_s=2.0)


def _loc(s3, name):
    loc = resolve_location(s3.new_prefix(name))
    loc.fs.create_dir(loc.base, recursive=True)
    return loc


def _write_lock(loc, doc) -> None:
    with loc.fs.open_output_stream(loc.path(LOCK_NAME)) as f:
        f.write(doc if isinstance(doc, bytes) else json.dumps(doc).encode())


def _read_lock(loc) -> dict | None:
    try:
        return json.loads(loc.read_bytes(LOCK_NAME))
    except FileNotFoundError:
        return None


def _timed_acquire(loc) -> tuple[LeaseLock, float]:
    t = time.monotonic()
    lock = acquire_lock(loc, FAST)
    return lock, time.monotonic() - t


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_live_holder_on_this_host_is_refused_at_once(s3):
    loc = _loc(s3, "lock-live")
    held = acquire_lock(loc, FAST)
    try:
        t = time.monotonic()
        with pytest.raises(PackRefused, match=r"another prepack run .* holds .*\.prepack\.lock"):
            acquire_lock(loc, FAST)
        assert time.monotonic() - t < 1.0  # same host, live pid: no need to watch
        assert _read_lock(loc)["holder"] == held.holder
    finally:
        held.release()
    assert _read_lock(loc) is None


def test_live_holder_on_another_host_is_refused_once_it_renews(s3, monkeypatch):
    loc = _loc(s3, "lock-other-live")
    held = acquire_lock(loc, FAST)
    try:
        monkeypatch.setenv(HOST_ENV, "another-host")
        t = time.monotonic()
        with pytest.raises(PackRefused, match="another prepack run"):
            acquire_lock(loc, FAST)
        assert time.monotonic() - t < FAST.lease_s  # refused at the first renewal seen, not after a lease
        held.check()  # the holder keeps its lock
        assert _read_lock(loc)["holder"] == held.holder
    finally:
        held.release()


def test_dead_holder_on_another_host_is_taken_over_after_a_lease(s3, monkeypatch):
    loc = _loc(s3, "lock-takeover")
    monkeypatch.setenv(HOST_ENV, "host-a")
    first = acquire_lock(loc, FAST)
    first.stop_renewing()  # host a is lost: the lock stays, nobody renews it
    monkeypatch.setenv(HOST_ENV, "host-b")
    second, waited = _timed_acquire(loc)
    try:
        assert FAST.lease_s <= waited < FAST.lease_s + 3, waited
        assert _read_lock(loc)["host"] == "host-b"
        # host a comes back (it was only paused): its next renewal finds the lock taken
        first.renew()
        with pytest.raises(LockLost, match="lost its lock"):
            first.check()
        first.release()  # must not delete host b's lock
        assert _read_lock(loc)["holder"] == second.holder
        second.check()
    finally:
        second.release()


def test_dead_process_on_this_host_is_taken_over_at_once(s3):
    loc = _loc(s3, "lock-deadpid")
    now = time.time()
    _write_lock(loc, {"holder": "x", "host": lock_host(),
                      "pid": _dead_pid(), "since": now, "renewed": now, "expires": now + 3600, "lease_s": 3600})
    lock, waited = _timed_acquire(loc)
    lock.release()
    assert waited < 2.0


def test_long_expired_lease_is_taken_over_at_once(s3, monkeypatch):
    loc = _loc(s3, "lock-expired")
    _write_lock(loc, {"holder": "x", "host": "gone-host", "pid": 1, "expires": time.time() - 3600, "lease_s": 30})
    lock, waited = _timed_acquire(loc)
    lock.release()
    assert waited < 2.0


def test_damaged_lock_object_is_taken_over_after_a_lease(s3):
    loc = _loc(s3, "lock-damaged")
    _write_lock(loc, b"\x00not json")
    lock, waited = _timed_acquire(loc)
    lock.release()
    assert waited >= FAST.lease_s


def test_simultaneous_claims_one_wins(s3):
    loc = _loc(s3, "lock-race")
    got: list[LeaseLock] = []
    refused: list[PackRefused] = []
    go = threading.Barrier(4)

    def claim():
        go.wait()
        try:
            got.append(acquire_lock(loc, FAST))
        except PackRefused as e:
            refused.append(e)

    threads = [threading.Thread(target=claim) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert len(got) == 1 and len(refused) == 3, (len(got), [str(e) for e in refused])
        assert _read_lock(loc)["holder"] == got[0].holder
    finally:
        for lock in got:
            lock.release()


def test_lease_is_renewed_while_held(s3):
    loc = _loc(s3, "lock-renew")
    lock = acquire_lock(loc, FAST)
    try:
        first = _read_lock(loc)
        time.sleep(FAST.lease_s * 1.2)
        later = _read_lock(loc)
        assert later["holder"] == first["holder"] and later["seq"] > first["seq"]
        assert later["expires"] > first["expires"]
    finally:
        lock.release()
