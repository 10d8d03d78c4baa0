"""One run per output: the lock a ``prepack run`` holds on ``OUT/.prepack.lock``.

Two kinds, because the two kinds of storage offer different atomic operations:

* **Local folder**: the holder (pid, host) is written to a temporary file that is then hard-linked
  into place; ``link`` fails when the lock exists, so creation is atomic and the lock is never
  empty.  A lock whose process is gone from this host (or is a zombie) is taken over at once.
* **Object store** (``s3://``, ``gs://``, ...): there is no atomic create through pyarrow (no
  If-None-Match), and the holder may be on another machine whose PID means nothing here.  So the
  lock is a **lease**: an object naming the holder (a random id, host, pid) and an expiry, renewed
  by a background thread of the live driver every ``lease/3`` seconds.  A newcomer takes it over
  when (a) its holder ran on this host and that process is gone, (b) its expiry is further in the
  past than ``MAX_CLOCK_SKEW_S`` (wall clocks are trusted that far), or (c) it watched the object
  for one lease period and it was never renewed (needs no clock agreement at all).  A lock that
  is renewed while watched belongs to a live run: refused.  A claim is a PUT followed, after a
  settle delay, by a read-back: of several runs claiming at once, only the one whose PUT landed
  last reads back its own id; the others are refused.  The live driver checks on every renewal
  that the object still names it; if not (it was paused longer than a lease and another run took
  over), ``check`` raises ``LockLost`` and the run stops.

What the lease does not guarantee is written in docs/architecture.md (section "The lock").
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass

from schemas.errors import LockLost, PackRefused, UsageError
from schemas.location import PackLocation

log = logging.getLogger(__name__)

LOCK_NAME = ".prepack.lock"
HOST_ENV = "PREPACK_LOCK_HOST"  # the host name a lock records (tests simulate other machines with it)
LEASE_ENV = "PREPACK_LOCK_LEASE_S"
DEFAULT_LEASE_S = 30.0
MAX_CLOCK_SKEW_S = 60.0  # an expiry further in the past than this is stale without watching


def lock_host() -> str:
    return os.environ.get(HOST_ENV) or socket.gethostname()


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process on this host (a zombie, i.e. an exited process its parent
    has not reaped yet, holds no lock: it counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no procfs: trust kill(0)
    return state not in ("Z", "X")


def _holder_pid(held: dict) -> int | None:
    pid = held.get("pid")
    return pid if isinstance(pid, int) and not isinstance(pid, bool) else None


def _refusal(held: dict, path: str, extra: str = "",
             hint: str = "wait for it, or delete the lock file if that run is dead") -> PackRefused:
    return PackRefused(f"another prepack run (pid {held.get('pid')} on {held.get('host')}) holds {path}{extra}; {hint}")


LEASE_HINT = "wait for it; if it is dead, run again: its lease is taken over once it has gone a lease period unrenewed"


class RunLock:
    """A held lock: ``check`` raises ``LockLost`` once it is no longer ours; ``release`` drops it."""

    def check(self) -> None:
        pass

    def release(self) -> None:
        raise NotImplementedError


# -- local folders ----------------------------------------------------------------------------------
class LocalLock(RunLock):
    def __init__(self, path: str):
        self.path = path

    def release(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _acquire_local(loc: PackLocation) -> LocalLock:
    me = {"pid": os.getpid(), "host": lock_host(), "since": time.time()}
    path = loc.path(LOCK_NAME)
    for _ in range(2):
        # Write the holder first, then link it into place: the lock never exists empty, even
        # if this process dies between the two steps (link fails if a lock already exists).
        tmp = f"{path}.{me['pid']}.tmp"
        with open(tmp, "w") as f:
            json.dump(me, f)
        try:
            os.link(tmp, path)
            return LocalLock(path)
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
        try:
            with open(path) as f:
                held = json.loads(f.read() or "{}")
        except (OSError, ValueError):
            held = {}
        pid = _holder_pid(held)
        if held.get("host") == me["host"] and pid is not None and not pid_alive(pid):
            log.warning("removing stale lock of dead process %s", pid)
            os.unlink(path)
            continue
        raise _refusal(held, path)
    raise PackRefused(f"could not take the lock {path}")


# -- object stores ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class LeaseTiming:
    """How long a lease lasts unrenewed; renewal and claim settling follow from it."""

    lease_s: float = DEFAULT_LEASE_S

    @classmethod
    def from_env(cls) -> "LeaseTiming":
        raw = os.environ.get(LEASE_ENV)
        if not raw:
            return cls()
        try:
            value = float(raw)
        except ValueError:
            raise UsageError(f"{LEASE_ENV}={raw!r} is not a number of seconds") from None
        if not value >= 1.0:
            raise UsageError(f"{LEASE_ENV} must be at least 1 second, got {raw}")
        return cls(value)

    @property
    def renew_every_s(self) -> float:
        return self.lease_s / 3

    @property
    def settle_s(self) -> float:
        """Wait between a claim's PUT and its read-back: longer than a contender's read -> PUT."""
        return min(2.0, self.lease_s / 5)


def _read_raw(loc: PackLocation, path: str) -> bytes | None:
    try:
        with loc.fs.open_input_stream(path) as f:
            return f.read()
    except FileNotFoundError:
        return None


def _parse(raw: bytes) -> dict:
    try:
        held = json.loads(raw)
    except ValueError:
        return {}
    return held if isinstance(held, dict) else {}


class LeaseLock(RunLock):
    """A lease on an object-store lock object, renewed by a daemon thread until ``release``."""

    def __init__(self, loc: PackLocation, path: str, doc: dict, timing: LeaseTiming):
        self.loc, self.path, self.doc, self.timing = loc, path, doc, timing
        self._lost: str | None = None
        self._stop = threading.Event()
        self._last_ok = time.monotonic()
        self._thread = threading.Thread(target=self._renew_loop, name="prepack-lock-lease", daemon=True)
        self._thread.start()

    @property
    def holder(self) -> str:
        return self.doc["holder"]

    def _write(self) -> None:
        with self.loc.fs.open_output_stream(self.path) as f:
            f.write(json.dumps(self.doc, sort_keys=True).encode())

    def renew(self) -> None:
        """Extend the lease, after checking it is still ours (one renewal; the thread loops this)."""
        raw = _read_raw(self.loc, self.path)
        held = _parse(raw) if raw is not None else {}
        if held.get("holder") != self.holder:
            who = f"pid {held.get('pid')} on {held.get('host')}" if held else "nobody (it was deleted)"
            self._lost = (f"this run lost its lock {self.path}: it now names {who}; another run took over "
                          "(this driver was not heard from for a whole lease). Stopping; the other run owns the output")
            return
        now = time.time()
        self.doc.update(renewed=now, expires=now + self.timing.lease_s, seq=int(self.doc.get("seq", 0)) + 1)
        self._write()
        self._last_ok = time.monotonic()

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.timing.renew_every_s):
            try:
                self.renew()
            except OSError as e:  # a blip of the store: retry at the next period, give up after a lease
                log.warning("could not renew the lock %s: %s", self.path, e)
                if time.monotonic() - self._last_ok > self.timing.lease_s:
                    self._lost = f"could not renew the lock {self.path} for {self.timing.lease_s:.0f} s ({e})"
            if self._lost:
                log.error("%s", self._lost)
                return

    def check(self) -> None:
        if self._lost:
            raise LockLost(self._lost)

    def stop_renewing(self) -> None:
        """Stop the renewal thread without touching the lock (what a killed driver leaves)."""
        self._stop.set()
        self._thread.join()

    def release(self) -> None:
        self.stop_renewing()
        try:
            raw = _read_raw(self.loc, self.path)
            if raw is not None and _parse(raw).get("holder") == self.holder:
                self.loc.fs.delete_file(self.path)
        except OSError as e:  # the lease expires by itself; a rerun takes it over
            log.warning("could not remove the lock %s (%s); it expires in %.0f s", self.path, e, self.timing.lease_s)


def _held_lease(held: dict, timing: LeaseTiming) -> float:
    """The lease period the holder renews within (ours if its lock does not say)."""
    lease = held.get("lease_s")
    return float(lease) if isinstance(lease, (int, float)) and not isinstance(lease, bool) and lease > 0 else timing.lease_s


def _stale_reason(held: dict, raw: bytes, me: dict, watched: tuple[bytes, float] | None,
                  timing: LeaseTiming) -> tuple[str | None, bool]:
    """(why the lock ``held`` may be taken over or None, whether it is proven live)."""
    pid = _holder_pid(held)
    if held.get("host") == me["host"] and pid is not None:
        return (None, True) if pid_alive(pid) else (f"its process {pid} on this host is gone", False)
    expires = held.get("expires")
    if isinstance(expires, (int, float)) and time.time() > expires + MAX_CLOCK_SKEW_S:
        return f"its lease expired {time.time() - expires:.0f} s ago", False
    if watched is not None and watched[0] != raw:
        return None, True  # renewed (or claimed) while we watched: a live run
    lease = _held_lease(held, timing)
    if watched is not None and time.monotonic() - watched[1] >= lease:
        return f"not renewed for {lease:.0f} s", False
    return None, False


def _acquire_lease(loc: PackLocation, timing: LeaseTiming) -> LeaseLock:
    path = loc.path(LOCK_NAME)
    me = {"holder": uuid.uuid4().hex, "host": lock_host(), "pid": os.getpid(), "since": time.time(),
          "lease_s": timing.lease_s, "seq": 0}
    watched: tuple[bytes, float] | None = None  # (lock bytes, monotonic time first seen)
    announced = False
    while True:
        raw = _read_raw(loc, path)
        if raw is not None:
            held = _parse(raw)
            reason, live = _stale_reason(held, raw, me, watched, timing)
            if live:
                raise _refusal(held, path, hint=LEASE_HINT)
            if reason is None:  # looks live: watch it for a lease period
                if watched is None:
                    watched = (raw, time.monotonic())
                if not announced:
                    announced = True
                    log.warning("%s is held by pid %s on %s; waiting up to %.0f s to see whether that run renews it",
                                path, held.get("pid"), held.get("host"), _held_lease(held, timing))
                time.sleep(min(1.0, timing.renew_every_s / 2))
                continue
            log.warning("taking over the lock %s of pid %s on %s: %s", path, held.get("pid"), held.get("host"), reason)
        # claim: re-read right before the PUT (a contender may have claimed meanwhile), then read back
        if _read_raw(loc, path) != raw:
            watched = None
            continue
        now = time.time()
        doc = dict(me, renewed=now, expires=now + timing.lease_s)
        with loc.fs.open_output_stream(path) as f:
            f.write(json.dumps(doc, sort_keys=True).encode())
        time.sleep(timing.settle_s)
        back = _read_raw(loc, path)
        got = _parse(back) if back is not None else {}
        if got.get("holder") == me["holder"]:
            return LeaseLock(loc, path, doc, timing)
        raise _refusal(got, path, " (it claimed the lock at the same moment as this run)", LEASE_HINT)


def acquire_lock(loc: PackLocation, timing: LeaseTiming | None = None) -> RunLock:
    """Take the output's lock or raise ``PackRefused`` (see the module docstring for the rules)."""
    if loc.is_local:
        return _acquire_local(loc)
    return _acquire_lease(loc, timing or LeaseTiming.from_env())
