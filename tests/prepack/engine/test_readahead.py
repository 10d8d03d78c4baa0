"""The read-ahead machinery on its own: order, the bounds, errors where they belong, clean shutdown.

Fetches here are plain functions (no store), so the tests see exactly what the window does: the
plan walks keys in order, the consumer takes them in that order, never more than ``depth``
objects are outstanding, no fetch starts while ``max_bytes`` are held, a failed fetch raises
when its object is taken (and the next ones still come), and closing leaves no thread behind.
"""

from __future__ import annotations

import threading
import time

import pytest

from prepack.engine.sources.readahead import (
    DIRECT,
    INITIAL_WINDOW,
    IOPool,
    Prefetched,
    ReadAheadOutOfStep,
    ReadAheadSettings,
    nbytes,
)


def _wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.005)


def _keys_in_order(fetch):
    """A plan over the keys 0, 1, 2, ... fetching each with ``fetch(key)``."""
    def plan(submit):
        k = 0
        while True:
            submit(k, lambda k=k: fetch(k))
            k += 1

    return plan


def _io_threads(prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix) and t.is_alive()]


def test_values_come_in_plan_order_whatever_order_fetches_finish():
    pool = IOPool(ReadAheadSettings(depth=6, threads=4), name="ra-order")

    def fetch(k):
        time.sleep(0.002 * ((k * 7) % 5))  # later keys often finish first
        return k * k

    try:
        ra = pool.read_ahead(_keys_in_order(fetch), "t")
        assert [ra.take(k).result() for k in range(60)] == [k * k for k in range(60)]
    finally:
        pool.close()


def test_threads_start_as_fetches_wait_for_one_up_to_the_setting():
    release = threading.Event()
    pool = IOPool(ReadAheadSettings(depth=INITIAL_WINDOW, threads=5), name="ra-grow")
    try:
        assert pool.threads == 0  # none before a fetch is queued
        ra = pool.read_ahead(_keys_in_order(lambda k: release.wait(10) and k), "slow")
        _wait_for(lambda: ra.outstanding == INITIAL_WINDOW)  # every fetch blocks: one thread each, up to 5
        _wait_for(lambda: len(_io_threads("ra-grow_")) == 5)
        time.sleep(0.1)
        assert pool.threads == 5
        release.set()
        assert [ra.take(k).result() for k in range(30)] == list(range(30))
        assert pool.threads == 5
    finally:
        pool.close()
    assert _io_threads("ra-grow_") == []
    quick = IOPool(ReadAheadSettings(depth=INITIAL_WINDOW, threads=32), name="ra-few")
    try:
        ra = quick.read_ahead(_keys_in_order(lambda k: k), "quick")
        for k in range(200):
            fut = ra.take(k)
            _wait_for(fut.done)
            assert fut.result() == k
        assert 1 <= quick.threads <= 2 * INITIAL_WINDOW  # instant fetches: about as many threads as fetches queue at once, not 32
    finally:
        quick.close()


def test_never_more_than_depth_objects_outstanding():
    depth = 3
    pool = IOPool(ReadAheadSettings(depth=depth, threads=2), name="ra-depth")
    seen = []
    holder = {}
    ready = threading.Event()

    def plan(submit):
        ready.wait(10)  # the planner starts before read_ahead() returns the object it reports on
        k = 0
        while True:
            submit(k, lambda k=k: k)
            seen.append(holder["ra"].outstanding)
            k += 1

    try:
        holder["ra"] = ra = pool.read_ahead(plan, "t")
        ready.set()
        _wait_for(lambda: len(seen) == depth)
        time.sleep(0.2)  # the planner must now be waiting for room
        assert len(seen) == depth
        for k in range(20):
            assert ra.take(k).result() == k
            _wait_for(lambda: len(seen) >= depth + k + 1)
        assert max(seen) <= depth and len(seen) <= depth + 20
    finally:
        pool.close()


def test_the_window_starts_short_and_grows_only_while_the_source_waits():
    pool = IOPool(ReadAheadSettings(depth=20, threads=4), name="ra-window")
    try:
        quick = pool.read_ahead(_keys_in_order(lambda k: k), "quick")
        for k in range(40):  # each object is fetched before it is asked for: the source never waits
            fut = quick.take(k)
            _wait_for(fut.done)
            assert fut.result() == k and quick.outstanding <= INITIAL_WINDOW
        assert quick.window == INITIAL_WINDOW
        slow = pool.read_ahead(_keys_in_order(lambda k: time.sleep(0.02) or k), "slow")
        windows = []
        for k in range(40):  # asked for at once: the source waits, the window deepens, up to depth
            assert slow.take(k).result() == k
            windows.append(slow.window)
        assert windows == sorted(windows) and windows[0] > INITIAL_WINDOW and windows[-1] == 20
        grown = sorted(set(windows))
        assert all(b == min(20, 2 * a) for a, b in zip([INITIAL_WINDOW] + grown, grown))  # doubles at each wait
    finally:
        pool.close()


def test_a_plan_waiting_for_its_own_fetch_does_not_deepen_the_window():
    pool = IOPool(ReadAheadSettings(depth=20, threads=2), name="ra-window-plan")

    def plan(submit):
        k = 0
        while True:
            submit(k, lambda k=k: time.sleep(0.01) or k).result()  # a footer the plan needs first
            k += 1

    try:
        ra = pool.read_ahead(plan, "t")
        for k in range(10):
            fut = ra.take(k)
            _wait_for(fut.done)
            assert fut.result() == k
        assert ra.window == INITIAL_WINDOW
    finally:
        pool.close()


def test_no_fetch_starts_while_max_bytes_are_held():
    mb = 1 << 20
    pool = IOPool(ReadAheadSettings(depth=100, max_bytes=int(2.5 * mb), threads=2), name="ra-bytes")
    started = []

    def plan(submit):
        k = 0
        while True:
            fut = submit(k, lambda k=k: (started.append(k), bytes(mb))[1])
            fut.result()  # one at a time, so what is held is exact when the next submit looks
            k += 1

    try:
        ra = pool.read_ahead(plan, "t")
        _wait_for(lambda: len(started) == 3)  # 0, 1, 2 MiB held when each started; 3 MiB stops it
        time.sleep(0.2)
        assert started == [0, 1, 2]
        assert len(ra.take(0).result()) == mb  # 2 MiB held now: one more may start
        _wait_for(lambda: len(started) == 4)
        time.sleep(0.2)
        assert started == [0, 1, 2, 3]
    finally:
        pool.close()


def test_a_full_window_takes_new_fetches_once_a_quarter_of_it_is_free():
    pool = IOPool(ReadAheadSettings(depth=INITIAL_WINDOW, threads=2), name="ra-refill")
    submitted = []

    def plan(submit):
        k = 0
        while True:
            submit(k, lambda k=k: k)
            submitted.append(k)
            k += 1

    try:
        ra = pool.read_ahead(plan, "t")
        _wait_for(lambda: len(submitted) == INITIAL_WINDOW)
        quarter = INITIAL_WINDOW // 4
        for k in range(quarter - 1):  # the planner sleeps on while less than a quarter is free
            assert ra.take(k).result() == k
        time.sleep(0.2)
        assert len(submitted) == INITIAL_WINDOW
        assert ra.take(quarter - 1).result() == quarter - 1
        _wait_for(lambda: len(submitted) == INITIAL_WINDOW + quarter)  # then it fills the window again
        time.sleep(0.2)
        assert len(submitted) == INITIAL_WINDOW + quarter and ra.outstanding == INITIAL_WINDOW
    finally:
        pool.close()


def test_a_fetch_smaller_than_its_estimate_frees_the_byte_bound_without_a_take():
    mb = 1 << 20
    pool = IOPool(ReadAheadSettings(depth=100, max_bytes=3 * mb, threads=4), name="ra-estimate")
    release = threading.Event()
    submitted = []

    def plan(submit):
        k = 0
        while True:
            submit(k, lambda k=k: release.wait(10) and b"x", size=2 * mb)  # the footer said 2 MiB; it holds 1 byte
            submitted.append(k)
            k += 1

    try:
        ra = pool.read_ahead(plan, "t")
        _wait_for(lambda: len(submitted) == 2)  # 4 MiB estimated ahead: the third waits
        time.sleep(0.2)
        assert len(submitted) == 2
        release.set()  # the fetches come back small: the planner goes on with nothing taken
        _wait_for(lambda: len(submitted) >= 3)
        assert [ra.take(k).result() for k in range(3)] == [b"x"] * 3
    finally:
        pool.close()


def test_a_failed_fetch_raises_where_its_object_is_taken_and_the_rest_still_come():
    pool = IOPool(ReadAheadSettings(depth=4, threads=2), name="ra-err")

    def fetch(k):
        if k == 3:
            raise FileNotFoundError(f"object {k} is missing")
        return k

    try:
        ra = pool.read_ahead(_keys_in_order(fetch), "t")
        assert [ra.take(k).result() for k in range(3)] == [0, 1, 2]
        with pytest.raises(FileNotFoundError, match="object 3 is missing"):
            ra.take(3).result()
        assert [ra.take(k).result() for k in range(4, 10)] == list(range(4, 10))
    finally:
        pool.close()


def test_a_source_out_of_step_with_its_plan_is_an_error_not_a_wrong_value():
    pool = IOPool(ReadAheadSettings(depth=2, threads=1), name="ra-step")

    def plan(submit):
        submit("a", lambda: 1)
        submit("b", lambda: 2)
        raise ValueError("plan bug")

    try:
        ra = pool.read_ahead(plan, "t")
        with pytest.raises(ReadAheadOutOfStep, match="'a'.*'x'"):
            ra.take("x")
        assert ra.take("b").result() == 2
        with pytest.raises(ReadAheadOutOfStep, match="plan bug"):
            ra.take("c")
    finally:
        pool.close()


def test_close_ends_the_planner_and_the_io_threads():
    pool = IOPool(ReadAheadSettings(depth=4, threads=3), name="ra-close")
    release = threading.Event()

    def plan(submit):
        k = 0
        while True:
            opened = submit(("open", k), lambda: release.wait(10) and "footer")
            opened.result()  # a plan waiting on a fetch (a parquet footer) must unwind too
            submit(("rg", k), lambda: b"x" * 10)
            k += 1

    ra = pool.read_ahead(plan, "t")
    _wait_for(lambda: ra.outstanding >= 1)
    assert _io_threads("ra-close")
    release.set()
    assert ra.take(("open", 0)).result() == "footer"
    pool.close()
    assert ra.closed
    _wait_for(lambda: not _io_threads("ra-close"))
    pool.close()  # twice is harmless
    with pytest.raises(ReadAheadOutOfStep):
        ra.take(("rg", 0))


def test_settings_from_the_environment():
    assert ReadAheadSettings.from_env({}) == ReadAheadSettings()
    s = ReadAheadSettings.from_env({"PREPACK_READ_AHEAD": "0", "PREPACK_READ_AHEAD_MB": "1.5", "PREPACK_IO_THREADS": "2"})
    assert (s.depth, s.max_bytes, s.threads) == (0, 3 << 19, 2)
    assert not IOPool(s).enabled
    from schemas.errors import ConfigError

    with pytest.raises(ConfigError, match="PREPACK_READ_AHEAD"):
        ReadAheadSettings.from_env({"PREPACK_READ_AHEAD": "many"})


def test_prefetched_answers_in_fetch_order_and_reads_the_rest_directly(tmp_path):
    from concurrent.futures import Future

    def done(v):
        f = Future()
        f.set_result(v)
        return f

    local = tmp_path / "a.bin"
    local.write_bytes(b"local")
    p = Prefetched({("read", "s3://b/x"): [done(b"one"), done(b"two")], ("list", "s3://b/d/"): [done(["f1"])]})
    assert p.read_bytes("s3://b/x") == b"one" and p.media("s3://b/x") == b"two"
    assert p.list_names("s3://b/d/") == ["f1"]
    assert p.media(str(local)) == str(local)  # a local path goes to the decoder as the reference does
    assert DIRECT.read_bytes(str(local)) == b"local"
    assert nbytes({"a": b"xy", "b": [b"z", "names"]}) == 3  # names are metadata: not counted


# -- one description of a source's reads, walked by the read-ahead and by the source ---------------
def _described(log: list):
    """A description like a parquet source's: per file a footer (needed: it says how many row
    groups follow), then its row groups; file 1's footer fails, so it has none; a mark per pass."""
    from prepack.engine.sources.readahead import Read

    footers = {0: 2, 1: None, 2: 1}

    def footer(f):
        if footers[f] is None:
            raise OSError(f"file {f}: not parquet")
        return footers[f]

    def reads():
        while True:
            for f in footers:
                try:
                    n = yield Read(("open", f), lambda f=f: footer(f), needed=True)
                except OSError as e:
                    log.append(("skipped", f, str(e)))
                    n = 0
                for rg in range(n):
                    yield Read(("rg", f, rg), lambda f=f, rg=rg: f"data {f}.{rg}", size=10)
            yield Read(("pass",))

    return reads()


def _walked(pairs, steps: int) -> list:
    out = []
    for read, fut in pairs:
        try:
            out.append((read.key, fut.result()))
        except OSError as e:
            out.append((read.key, f"error: {e}"))
        if len(out) == steps:
            return out
    return out


def test_the_source_and_its_read_ahead_walk_one_description_to_the_same_values():
    from prepack.engine.sources.readahead import plan_of, read_along

    want = [(("open", 0), 2), (("rg", 0, 0), "data 0.0"), (("rg", 0, 1), "data 0.1"),
            (("open", 1), "error: file 1: not parquet"), (("open", 2), 1), (("rg", 2, 0), "data 2.0"),
            (("pass",), None), (("open", 0), 2)]
    direct_log: list = []
    assert _walked(read_along(_described(direct_log), None), len(want)) == want
    assert direct_log == [("skipped", 1, "file 1: not parquet")]  # the failure was thrown into the description
    pool = IOPool(ReadAheadSettings(depth=4, threads=2), name="ra-described")
    try:
        planner_log: list = []
        ra = pool.read_ahead(plan_of(_described(planner_log)), "t")
        walker_log: list = []
        assert _walked(read_along(_described(walker_log), ra), len(want)) == want
        assert walker_log[0] == planner_log[0] == ("skipped", 1, "file 1: not parquet")
    finally:
        pool.close()


def test_without_a_read_ahead_each_object_is_read_when_the_walk_gets_there():
    from prepack.engine.sources.readahead import Read, read_along

    fetched = []

    def reads():
        for k in range(3):
            yield Read(k, lambda k=k: fetched.append(k) or k)

    walk = read_along(reads(), None)
    assert next(walk)[0].key == 0 and fetched == [0]
    assert next(walk)[1].result() == 1 and fetched == [0, 1]  # nothing read ahead of the walk


def test_a_walk_out_of_step_with_the_read_ahead_is_an_error():
    from prepack.engine.sources.readahead import plan_of, read_along

    pool = IOPool(ReadAheadSettings(depth=4, threads=1), name="ra-step")
    try:
        ra = pool.read_ahead(plan_of(_described([])), "t")
        ra.take(("open", 0))  # the walk below starts one object late
        with pytest.raises(ReadAheadOutOfStep):
            next(read_along(_described([]), ra))
    finally:
        pool.close()
