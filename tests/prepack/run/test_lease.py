"""Stream leases, in process, on a local folder and on a real S3 server: who gets which streams,
who is refused (naming the stream and the holder), when a dead holder's lease is taken over, that
a run whose lease was taken over finds out, and that renewal costs O(1) requests whatever the
number of streams.  Other hosts are simulated with ``PREPACK_LOCK_HOST``.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time

import pyarrow.fs as pafs
import pytest

from prepack.run import lease as leasemod
from prepack.run.lease import (
    HOST_ENV,
    LEASE_DIR,
    LeaseTiming,
    StreamLease,
    acquire_streams,
    format_streams,
    lease_host,
)
from schemas.errors import LeaseLost, PackRefused
from schemas.location import resolve_location

FAST = LeaseTiming(lease_s=2.0)


@pytest.fixture(params=["local", "s3"])
def loc(request, tmp_path):
    if request.param == "local":
        where = str(tmp_path / "out")
    else:
        s3 = request.getfixturevalue("s3")
        where = s3.new_prefix(f"lease-{request.node.name[-40:]}".replace("[", "-").replace("]", ""))
    loc = resolve_location(where)
    loc.fs.create_dir(loc.base, recursive=True)
    return loc


def _write_lease(loc, holder: str, doc) -> None:
    loc.fs.create_dir(loc.path(LEASE_DIR), recursive=True)
    with loc.fs.open_output_stream(loc.path(f"{LEASE_DIR}/{holder}.json")) as f:
        f.write(doc if isinstance(doc, bytes) else json.dumps(doc).encode())


def _holders(loc) -> list[str]:
    return leasemod._list(loc)


def _timed(loc, streams, caplog) -> tuple[StreamLease, float, bool]:
    """(the lease, seconds it took, whether another lease was watched for renewal on the way):
    the test asserts on the watching, not on a duration a loaded machine stretches."""
    caplog.clear()
    t = time.monotonic()
    with caplog.at_level(logging.WARNING, logger=leasemod.__name__):
        lease = acquire_streams(loc, streams, FAST)
    return lease, time.monotonic() - t, _watched(caplog)


def _watched(caplog) -> bool:
    return any("to see whether that run renews its lease" in r.getMessage() for r in caplog.records)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_format_streams():
    assert format_streams([5, 0, 1, 2, 3, 9, 10]) == "0-3,5,9-10" and format_streams([]) == ""


def test_disjoint_streams_are_leased_side_by_side_and_overlap_is_refused_naming_both(loc, caplog):
    a = acquire_streams(loc, range(0, 4), FAST)
    b = acquire_streams(loc, range(4, 8), FAST)
    try:
        with caplog.at_level(logging.WARNING, logger=leasemod.__name__):
            with pytest.raises(PackRefused, match=r"stream 3 is being packed by another prepack run \(pid \d+ on .*streams 0-3"):
                acquire_streams(loc, [3, 9], FAST)
        assert not _watched(caplog)  # same host, live pid: no need to watch
        assert sorted(_holders(loc)) == sorted([a.holder, b.holder])  # the refused one left nothing
        a.check(), b.check()
    finally:
        a.release(), b.release()
    assert _holders(loc) == []


def test_live_holder_on_another_host_is_refused_once_it_renews(loc, monkeypatch, caplog):
    # a longer lease than FAST: a holder starved for a whole FAST lease on a loaded machine would
    # rightly be taken over (and then seen claiming at the same moment), which is not this test
    live = LeaseTiming(lease_s=6.0)
    held = acquire_streams(loc, [0, 1], live)
    try:
        monkeypatch.setenv(HOST_ENV, "another-host")
        t = time.monotonic()
        with pytest.raises(PackRefused, match="stream 1 is being packed"):
            acquire_streams(loc, [1, 2], live)
        assert time.monotonic() - t < live.lease_s  # refused at the first renewal seen, not after a lease
        other, _, watched = _timed(loc, [2, 3], caplog)
        assert not watched  # disjoint: no watching at all
        other.release()
        held.check()
    finally:
        held.release()


def test_dead_holder_on_another_host_is_taken_over_after_a_lease(loc, monkeypatch, caplog):
    monkeypatch.setenv(HOST_ENV, "host-a")
    first = acquire_streams(loc, [0, 1, 2], FAST)
    first.stop_renewing()  # host a is lost: its lease stays, nobody renews it
    monkeypatch.setenv(HOST_ENV, "host-b")
    second, waited, watched = _timed(loc, [2], caplog)
    try:
        assert watched and waited >= FAST.lease_s, waited  # watched a whole lease before taking over
        assert any(f"not renewed for {FAST.lease_s:.0f} s" in r.getMessage() for r in caplog.records)
        assert first.holder not in _holders(loc)
        # host a comes back (it was only paused): its next renewal finds its lease taken over
        first.renew()
        with pytest.raises(LeaseLost):
            first.check()
        first.release()  # must not delete host b's lease
        assert second.holder in _holders(loc)
        second.check()
    finally:
        second.release()


def test_a_holder_revived_after_the_takeover_stops_at_its_next_renewal(loc, monkeypatch):
    """The takeover deleted the old lease, but the old holder's renewal wrote it back just after."""
    monkeypatch.setenv(HOST_ENV, "host-a")
    first = acquire_streams(loc, [0, 1], FAST)
    first.stop_renewing()
    monkeypatch.setenv(HOST_ENV, "host-b")
    second = acquire_streams(loc, [1], FAST)
    try:
        leasemod._write(loc, first.doc)  # the late renewal lands after the takeover
        first.renew()
        with pytest.raises(LeaseLost, match="took this run's streams over"):
            first.check()
        second.renew()
        second.check()  # the one that took over keeps going
    finally:
        first.release(), second.release()


def test_dead_process_on_this_host_is_taken_over_at_once(loc, caplog):
    now = time.time()
    _write_lease(loc, "x", {"holder": "x", "host": lease_host(), "pid": _dead_pid(), "streams": [[0, 3]],
                            "since": now, "renewed": now, "expires": now + 3600, "lease_s": 3600})
    lease, _, watched = _timed(loc, [1], caplog)
    lease.release()
    assert not watched and "x" not in _holders(loc)


def test_long_expired_lease_is_taken_over_at_once(loc, caplog):
    _write_lease(loc, "x", {"holder": "x", "host": "gone-host", "pid": 1, "streams": [[0, 0]],
                            "expires": time.time() - 3600, "lease_s": 30})
    lease, _, watched = _timed(loc, [0], caplog)
    lease.release()
    assert not watched and "x" not in _holders(loc)


def test_damaged_lease_object_holds_no_stream(loc, caplog):
    _write_lease(loc, "junk", b"\x00not json")
    lease, _, watched = _timed(loc, [0], caplog)
    lease.release()
    assert not watched


def test_simultaneous_claims_at_most_one_proceeds(loc):
    got: list[StreamLease] = []
    refused: list[PackRefused] = []
    go = threading.Barrier(4)

    def claim(streams):
        go.wait()
        try:
            got.append(acquire_streams(loc, streams, FAST))
        except PackRefused as e:
            refused.append(e)

    threads = [threading.Thread(target=claim, args=([0, 1],)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert len(got) <= 1 and len(got) + len(refused) == 4, (len(got), [str(e) for e in refused])
        assert sorted(_holders(loc)) == sorted(g.holder for g in got)
    finally:
        for lease in got:
            lease.release()


def test_simultaneous_claims_of_disjoint_streams_all_proceed(loc):
    got: list[StreamLease] = []
    go = threading.Barrier(4)

    def claim(k):
        go.wait()
        got.append(acquire_streams(loc, [k], FAST))

    threads = [threading.Thread(target=claim, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert len(got) == 4
    finally:
        for lease in got:
            lease.release()


def test_renewal_is_one_list_and_one_write_for_4096_streams(loc, monkeypatch):
    lease = acquire_streams(loc, range(4096), FAST)
    lease.stop_renewing()
    calls = {"list": 0, "read": 0, "write": 0}
    for name, key in (("_list", "list"), ("_read", "read"), ("_write", "write")):
        real = getattr(leasemod, name)

        def counted(*a, _real=real, _key=key):
            calls[_key] += 1
            return _real(*a)

        monkeypatch.setattr(leasemod, name, counted)
    try:
        seq = lease.doc["seq"]
        lease.renew()
        lease.check()
        assert calls == {"list": 1, "read": 0, "write": 1}, calls
        assert lease.doc["seq"] == seq + 1 and lease.doc["streams"] == [[0, 4095]]
    finally:
        lease.release()


def test_a_run_with_nothing_to_pack_removes_provably_stale_leases(loc):
    now = time.time()
    _write_lease(loc, "dead", {"holder": "dead", "host": lease_host(), "pid": _dead_pid(), "streams": [[0, 1]],
                               "expires": now + 3600, "lease_s": 30})
    live = acquire_streams(loc, [5], FAST)
    try:
        assert leasemod.remove_stale_leases(loc, FAST) == 1
        assert _holders(loc) == [live.holder]
    finally:
        live.release()


class _VanishingStore:
    """A store whose lease objects fail mid-body (as SeaweedFS did when one was deleted while read)."""

    def __init__(self, exists: bool):
        self.exists, self.reads = exists, 0

    def path(self, rel: str) -> str:
        return f"bucket/pack/{rel}"

    @property
    def fs(self):
        return self

    def open_input_stream(self, path):
        self.reads += 1
        raise OSError("AWS Error INTERNAL_FAILURE during GetObject operation: Failed to flush response stream")

    def get_file_info(self, path):
        return pafs.FileInfo(path, pafs.FileType.File if self.exists else pafs.FileType.NotFound)


def test_a_lease_deleted_while_it_is_read_is_gone_and_a_failing_store_is_an_error():
    from prepack.run import lease

    gone = _VanishingStore(exists=False)
    assert lease._read(gone, "h") is None and gone.reads == 1
    failing = _VanishingStore(exists=True)
    with pytest.raises(OSError, match="INTERNAL_FAILURE"):
        lease._read(failing, "h")
    assert failing.reads == 3  # retried, then raised

