"""Stream leases: which live ``prepack run`` packs which streams of an output.

Ownership is per stream, so any number of jobs, from any hosts, pack disjoint streams of one
output side by side.  Each job writes ONE lease object, ``OUT/.prepack/leases/<holder>.json``,
naming the streams it packs, its host and pid, and an expiry; it renews that one object every
``lease_s/3`` whatever the number of streams, so lease traffic is O(jobs): per job and renewal one
LIST of the lease folder and one PUT (plus one GET of each lease that appeared since the last
renewal).  The same protocol runs on a local or shared folder and on an object store (pyarrow
offers no atomic create on stores; a local write is tmp + rename).

Acquiring ``streams``:

1. LIST the leases and read each; one that shares a stream with ours is *live* (refused, naming
   the stream and the holder), *stale* (taken over), or *unknown* (watched for one lease period:
   renewed -> live, unchanged -> stale).  A lease is stale when its holder ran on this host and
   that process is gone, when its expiry is more than ``MAX_CLOCK_SKEW_S`` in the past, or when
   it was watched for a lease period without a renewal (no clock agreement needed).
2. PUT our lease (``took_over`` names the stale holders) and delete the stale ones.
3. LIST again: any other lease sharing a stream that we did not take over means two jobs claimed
   at the same moment.  LIST after PUT is consistent, so of two such claimers at least one sees
   the other; each that sees one withdraws and is refused (both may be: run again).

A renewal that finds our lease gone, or a new lease that took ours over, means another job
decided we were dead (we were not heard from for a whole lease): ``check`` raises ``LeaseLost``
and the run stops.  What this does not guarantee is in docs/architecture/run.md ("Leases").
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

import pyarrow.fs as pafs

from prepack.run.commit.atomic_files import write_bytes_atomic
from schemas.errors import LeaseLost, PackRefused, UsageError
from schemas.layout import LEASE, LEASE_DIR, lease_file, parse
from schemas.location import PackLocation

log = logging.getLogger(__name__)

HOST_ENV = "PREPACK_LOCK_HOST"  # the host name a lease records (tests simulate other machines with it)
LEASE_ENV = "PREPACK_LOCK_LEASE_S"
DEFAULT_LEASE_S = 30.0
MAX_CLOCK_SKEW_S = 60.0  # an expiry further in the past than this is stale without watching

LEASE_HINT = ("wait for it, or pack other streams; if that run is dead, run again: its lease is taken over "
              "once it has gone a lease period unrenewed (at once on its own host)")


def lease_host() -> str:
    return os.environ.get(HOST_ENV) or socket.gethostname()


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process on this host (a zombie, i.e. an exited process its parent
    has not reaped yet, holds no lease: it counts as dead)."""
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


def format_streams(streams: "list[int] | set[int]") -> str:
    """``0-127,130`` for a set of stream ids."""
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in _ranges(streams))


def _ranges(streams: "list[int] | set[int]") -> list[list[int]]:
    """Streams as [first, last] ranges: a lease of 4,096 consecutive streams stays one pair."""
    out: list[list[int]] = []
    for s in sorted(streams):
        if out and s == out[-1][1] + 1:
            out[-1][1] = s
        else:
            out.append([s, s])
    return out


def _streams_of(held: dict) -> set[int]:
    out: set[int] = set()
    for pair in held.get("streams") or []:
        if isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, int) for x in pair):
            out.update(range(pair[0], pair[1] + 1))
    return out


@dataclass(frozen=True)
class LeaseTiming:
    """How long a lease lasts unrenewed; renewal follows from it."""

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


# -- the lease folder ---------------------------------------------------------------------------
def _lease_path(loc: PackLocation, holder: str) -> str:
    return loc.path(lease_file(holder))


def _list(loc: PackLocation) -> list[str]:
    """Holder ids of the leases present (one LIST)."""
    files = [parse(f"{LEASE_DIR}/{i.base_name}") for i in loc.list(LEASE_DIR) if i.type == pafs.FileType.File]
    return sorted(f.holder for f in files if f is not None and f.kind == LEASE)


def _read(loc: PackLocation, holder: str, attempts: int = 3) -> bytes | None:
    """A holder's lease, or None once it is gone.

    A lease deleted while it is read (its run withdrawing a claim at the same moment) can fail
    mid-body on a store rather than as not-found: that is "gone" too, if the object no longer
    exists; any other failure is retried, then raised.
    """
    path = _lease_path(loc, holder)
    for attempt in range(attempts):
        try:
            with loc.fs.open_input_stream(path) as f:
                return f.read()
        except FileNotFoundError:
            return None
        except OSError:
            if loc.fs.get_file_info(path).type == pafs.FileType.NotFound:
                return None
            if attempt == attempts - 1:
                raise
            time.sleep(0.05 * (attempt + 1))
    return None


def _parse(raw: bytes | None) -> dict:
    try:
        held = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return held if isinstance(held, dict) else {}


def _write(loc: PackLocation, doc: dict) -> None:
    """A reader never sees half a lease: tmp + rename locally, one PUT (an object appears whole) on a store."""
    write_bytes_atomic(loc, lease_file(doc["holder"]), json.dumps(doc, sort_keys=True).encode())


def _delete(loc: PackLocation, holder: str) -> None:
    try:
        loc.fs.delete_file(_lease_path(loc, holder))
    except FileNotFoundError:
        pass


def _who(held: dict) -> str:
    return (f"pid {held.get('pid')} on {held.get('host')}, packing streams "
            f"{format_streams(_streams_of(held)) or '?'}")


def _held_lease(held: dict, timing: LeaseTiming) -> float:
    lease = held.get("lease_s")
    return float(lease) if isinstance(lease, (int, float)) and not isinstance(lease, bool) and lease > 0 else timing.lease_s


def _stale_reason(held: dict, raw: bytes, me: dict, watched: "tuple[bytes, float] | None",
                  timing: LeaseTiming) -> tuple[str | None, bool]:
    """(why the lease ``held`` may be taken over or None, whether it is proven live)."""
    pid = held.get("pid")
    if held.get("host") == me["host"] and isinstance(pid, int) and not isinstance(pid, bool):
        return (None, True) if pid_alive(pid) else (f"its process {pid} on this host is gone", False)
    expires = held.get("expires")
    if isinstance(expires, (int, float)) and time.time() > expires + MAX_CLOCK_SKEW_S:
        return f"its lease expired {time.time() - expires:.0f} s ago", False
    if watched is not None and watched[0] != raw:
        return None, True  # renewed while we watched: a live run
    lease = _held_lease(held, timing)
    if watched is not None and time.monotonic() - watched[1] >= lease:
        return f"not renewed for {lease:.0f} s", False
    return None, False


# -- a held lease -------------------------------------------------------------------------------
class StreamLease:
    """This job's lease on its streams, renewed by a daemon thread until ``release``.

    ``check`` raises ``LeaseLost`` once another job has taken the streams over."""

    def __init__(self, loc: PackLocation, doc: dict, timing: LeaseTiming, seen: set[str]):
        self.loc, self.doc, self.timing = loc, doc, timing
        self.streams = _streams_of(doc)
        self._seen = set(seen)
        self._lost: str | None = None
        self._stop = threading.Event()
        self._last_ok = time.monotonic()
        self._thread = threading.Thread(target=self._renew_loop, name="prepack-stream-lease", daemon=True)
        self._thread.start()

    @property
    def holder(self) -> str:
        return self.doc["holder"]

    def renew(self) -> None:
        """One renewal: LIST, read only the leases new since the last one, PUT ours."""
        present = set(_list(self.loc))
        if self.holder not in present:
            self._lost = (f"this run's lease {_lease_path(self.loc, self.holder)} was deleted: another run took its "
                          "streams over (this driver was not heard from for a whole lease). Stopping")
            return
        for other in sorted(present - self._seen - {self.holder}):
            held = _parse(_read(self.loc, other))
            if self.holder in (held.get("took_over") or []) and _streams_of(held) & self.streams:
                self._lost = (f"another prepack run ({_who(held)}) took this run's streams over (this driver was not "
                              "heard from for a whole lease). Stopping; the other run owns them")
                return
        self._seen = present
        now = time.time()
        self.doc.update(renewed=now, expires=now + self.timing.lease_s, seq=int(self.doc.get("seq", 0)) + 1)
        _write(self.loc, self.doc)
        self._last_ok = time.monotonic()

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.timing.renew_every_s):
            try:
                self.renew()
            except OSError as e:  # a blip of the store: retry at the next period, give up after a lease
                log.warning("could not renew the lease %s: %s", _lease_path(self.loc, self.holder), e)
                if time.monotonic() - self._last_ok > self.timing.lease_s:
                    self._lost = f"could not renew the lease {_lease_path(self.loc, self.holder)} for " \
                                 f"{self.timing.lease_s:.0f} s ({e})"
            if self._lost:
                log.error("%s", self._lost)
                return

    def check(self) -> None:
        if self._lost:
            raise LeaseLost(self._lost)

    def stop_renewing(self) -> None:
        """Stop the renewal thread without touching the lease (what a killed driver leaves)."""
        self._stop.set()
        self._thread.join()

    def release(self) -> None:
        self.stop_renewing()
        try:
            if _parse(_read(self.loc, self.holder)).get("holder") == self.holder:
                _delete(self.loc, self.holder)
        except OSError as e:  # the lease expires by itself
            log.warning("could not remove the lease %s (%s); it expires in %.0f s",
                        _lease_path(self.loc, self.holder), e, self.timing.lease_s)


def live_leases(loc: PackLocation, timing: LeaseTiming | None = None, exclude: str = "") -> list[dict]:
    """Leases of other jobs that are not provably stale right now (no watching)."""
    timing = timing or LeaseTiming.from_env()
    me = {"host": lease_host()}
    out = []
    for holder in _list(loc):
        if holder == exclude:
            continue
        raw = _read(loc, holder)
        held = _parse(raw)
        if held and _stale_reason(held, raw, me, None, timing)[0] is None:
            out.append(held)
    return out


def remove_stale_leases(loc: PackLocation, timing: LeaseTiming | None = None) -> int:
    """Delete the leases that are provably stale now (a dead process on this host, or long
    expired); a run with nothing left to pack calls it so a killed job's lease does not linger."""
    timing = timing or LeaseTiming.from_env()
    me = {"host": lease_host()}
    removed = 0
    for holder in _list(loc):
        raw = _read(loc, holder)
        held = _parse(raw)
        reason = _stale_reason(held, raw, me, None, timing)[0] if held else None
        if reason:
            log.warning("removing the lease of pid %s on %s (%s)", held.get("pid"), held.get("host"), reason)
            _delete(loc, holder)
            removed += 1
    return removed


def acquire_streams(loc: PackLocation, streams: "list[int] | set[int]", timing: LeaseTiming | None = None) -> StreamLease:
    """Lease ``streams`` of the output at ``loc`` for this job, or raise ``PackRefused`` naming a
    stream another live job holds (see the module docstring for the rules)."""
    timing = timing or LeaseTiming.from_env()
    wanted = set(streams)
    me = {"holder": uuid.uuid4().hex, "host": lease_host(), "pid": os.getpid(), "since": time.time(),
          "lease_s": timing.lease_s, "seq": 0, "streams": _ranges(wanted)}
    watched: dict[str, tuple[bytes, float]] = {}
    announced: set[str] = set()
    while True:
        stale: dict[str, str] = {}
        waiting = False
        holders = _list(loc)
        for holder in holders:
            raw = _read(loc, holder)
            if raw is None:
                continue  # released meanwhile
            held = _parse(raw)
            shared = _streams_of(held) & wanted
            if not shared:
                continue
            reason, live = _stale_reason(held, raw, me, watched.get(holder), timing)
            if live:
                raise PackRefused(f"stream {min(shared)} is being packed by another prepack run ({_who(held)}); "
                                  f"{LEASE_HINT}")
            if reason is None:
                watched.setdefault(holder, (raw, time.monotonic()))
                if holder not in announced:
                    announced.add(holder)
                    log.warning("stream %d is leased by pid %s on %s; waiting up to %.0f s to see whether that run "
                                "renews its lease", min(shared), held.get("pid"), held.get("host"),
                                _held_lease(held, timing))
                waiting = True
            else:
                stale[holder] = f"stream {min(shared)}: taking over the lease of pid {held.get('pid')} on " \
                                f"{held.get('host')} ({reason})"
        if not waiting:
            break
        time.sleep(min(1.0, timing.renew_every_s / 2))
    now = time.time()
    doc = dict(me, renewed=now, expires=now + timing.lease_s, took_over=sorted(stale))
    loc.make_dirs(loc.path(LEASE_DIR))
    _write(loc, doc)
    for holder, why in sorted(stale.items()):
        log.warning("%s", why)
        _delete(loc, holder)
    present = _list(loc)
    for holder in present:
        if holder == doc["holder"] or holder in stale:
            continue
        held = _parse(_read(loc, holder))
        shared = _streams_of(held) & wanted
        if shared:
            _delete(loc, doc["holder"])
            raise PackRefused(f"another prepack run ({_who(held)}) claimed stream {min(shared)} at the same moment "
                              "as this one; run again (one of you will then proceed)")
    return StreamLease(loc, doc, timing, set(present))
