"""One entry point for the packer's bicubic resizes: the fastest way on this machine that has
matched Pillow in this process.

Two kernels do the same arithmetic: the C one (``native.c``, built once per machine with its C
compiler: a library load at start-up) and the numba one (``kernel.py``: a JIT, ~1 s to import and a
few seconds to compile the first time per machine).  Which is faster depends on the machine (the C
kernel's vector paths differ per instruction set; one AVX2-only machine ran numba faster and the C
kernel slower than Pillow: docs/performance.md, "Which kernel runs: timed, per machine"), so the
first process on a machine self-tests every candidate, times those that pass and Pillow on the
self-test's pictures, and takes the fastest; a kernel slower than Pillow is never used.  The choice
is cached beside the C kernel's build, keyed by what it depends on (CPU, kernel sources and builds,
Pillow), so later processes time nothing and load only the chosen kernel, which still self-tests in
each process.  Any doubt — another Pillow release than the one the kernels mirror, no kernel
loading, one differing value — means Pillow, with one warning.  ``PREPACK_FAST_RESIZE``: ``0``
turns the kernels off, ``native`` or ``numba`` asks for one of them (self-tested, not timed),
anything else (the default) chooses as above.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Protocol, Sequence

import numpy as np
import PIL
from PIL import Image

from prepack.engine.decode import raw_pixels, rgb_array
from prepack.engine.resize import inplace, native, selftest
from schemas.pixel_table import encode_rows

log = logging.getLogger(__name__)

PINNED_PILLOW = "13.0.0"  # the release whose Resample.c arithmetic the kernel mirrors (pyproject pins it)
ENV_SWITCH = "PREPACK_FAST_RESIZE"

Kernel = Callable[[Image.Image, int, int], np.ndarray]  # may also code as it resizes: see ``CodingKernel``
Timer = Callable[[Mapping[str, Kernel]], Mapping[str, float]]  # kernels -> seconds (selftest.timings)
CHOICE_VERSION = 1  # of the cached choice's format and rule
TIE = 0.05  # a candidate this close to a faster later one is kept: it starts cheaper (C loads in ms, numba imports in ~1 s)


class CodingKernel(Protocol):
    """A kernel that also writes its resize row-delta coded into a given array (the C kernel):
    the self-test proves both, and ``Resizer.resize_coded`` uses ``coded`` where it exists."""

    def __call__(self, img: Image.Image, width: int, height: int) -> np.ndarray: ...

    def coded(self, img: Image.Image, width: int, height: int, out: np.ndarray) -> None: ...


def pillow_resize(img: Image.Image, width: int, height: int) -> np.ndarray:
    """Bicubic (antialiased) PIL resize -> (h, w, 3) uint8, the pixels the reference normalises."""
    return rgb_array(img.resize((width, height), Image.Resampling.BICUBIC))


def vertical_first(in_w: int, in_h: int, out_w: int, out_h: int) -> bool:
    """Pillow 13's pass order: vertical first when the height shrinks by more than twice the width."""
    return in_h - out_h > 0 and in_h - out_h > 2 * (in_w - out_w)


def _import_kernel():
    """The kernel module; its functions are cached on disk by numba.  numba looks for a writable
    cache directory (NUMBA_CACHE_DIR, the package's __pycache__, the user's cache folder) and
    refuses to build cached functions when it finds none: then a per-user temporary folder is
    used, so a read-only install in a worker with no home still caches across processes."""
    try:  # here, not at the top: importing it loads numba's cached functions (seconds), and may fail
        from prepack.engine.resize import kernel
    except RuntimeError as exc:  # "cannot cache function ...: no locator available"
        import numba

        fallback = os.path.join(tempfile.gettempdir(), f"prepack-numba-{os.getuid()}")
        log.info("numba cache: %s; using %s", exc, fallback)
        numba.config.CACHE_DIR = fallback
        from prepack.engine.resize import kernel  # again, with the cache folder numba can write
    return kernel


class NativeKernel:
    """The C kernel as the packer calls it: an RGB picture in, (h, w, 3) uint8 out (``__call__``),
    or the same pixels row-delta coded straight into a given array (``coded``: the record's
    pixel-table slot, so no plain pixels are made and the table does not code them again).  It
    reads Pillow's rows in place where ``inplace`` finds them as expected (``in_place``), else a
    copy of the picture.  ``flags``: another build, for the bench and the tests."""

    def __init__(self, env: Mapping[str, str] | None = None, flags: tuple[str, ...] | None = None,
                 in_place: bool = True):
        flags = native.FLAGS if flags is None else flags

        def entries(name: str) -> dict[bool, native.ResizeFn]:  # by coded
            return {False: native.load(env, flags, name), True: native.load(env, flags, f"{name}_coded")}

        self._from_copy = entries("prepack_resize_rgbx")  # the RGBX copy
        self._from_rows = entries("prepack_resize_rows") if in_place and inplace.probe() else None  # Pillow's rows

    def __call__(self, img: Image.Image, width: int, height: int) -> np.ndarray:
        out = np.empty((height, width, 3), np.uint8)
        self._run(img, width, height, out, False)
        return out

    def coded(self, img: Image.Image, width: int, height: int, out: np.ndarray) -> None:
        """``encode_rows`` of this resize, written into ``out`` (a C-contiguous, writable
        (height, width, 3) uint8 array)."""
        if (out.shape != (height, width, 3) or out.dtype != np.uint8 or not out.flags.c_contiguous
                or not out.flags.writeable):
            raise ValueError(f"coded resize to {width}x{height}: out must be a writable C-contiguous "
                             f"({height}, {width}, 3) uint8 array, not {out.dtype} {out.shape}")
        self._run(img, width, height, out, True)

    def _run(self, img: Image.Image, width: int, height: int, out: np.ndarray, coded: bool) -> None:
        in_w, in_h = img.size
        vfirst = int(vertical_first(in_w, in_h, width, height))
        held = inplace.rows(img) if self._from_rows is not None else None  # the capsule keeps the rows alive
        if held is not None:
            rc = self._from_rows[coded](held[1], in_w, in_h, out.ctypes.data, width, height, vfirst)
        else:
            src = raw_pixels(img, "RGBX", 4)  # held: only its address goes to C
            rc = self._from_copy[coded](src.ctypes.data, in_w, in_h, out.ctypes.data, width, height, vfirst)
        if rc:
            raise MemoryError(f"resize {in_w}x{in_h} -> {width}x{height}: out of memory")


def native_kernel(env: Mapping[str, str] | None = None, flags: tuple[str, ...] | None = None,
                  in_place: bool = True) -> NativeKernel:
    """The C kernel as the packer calls it (``NativeKernel``)."""
    return NativeKernel(env, flags, in_place)


def numba_kernel() -> Kernel:
    """The numba kernel as the packer calls it: an RGB picture in, (h, w, 3) uint8 out."""
    kernel = _import_kernel()

    def resize(img: Image.Image, width: int, height: int) -> np.ndarray:
        in_w, in_h = img.size
        src = raw_pixels(img, "RGBX", 4).view(np.int32).reshape(in_h, in_w)
        return kernel.resize_rgbx(src, width, height, vertical_first(in_w, in_h, width, height))

    return resize


@dataclass(frozen=True)
class Candidate:
    """A kernel the router may choose: ``make`` loads it, ``identity`` names the build it loads
    (what a cached timing of it depends on besides the CPU and Pillow), cheaply, without loading."""

    name: str
    make: Callable[[], Kernel]
    identity: Callable[[], str]


def _source_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def default_candidates(env: Mapping[str, str]) -> list[Candidate]:
    """The C kernel, then numba: the order of preference where they time alike."""

    def native_identity() -> str:
        try:  # the build (source, compiler, flags, CPU) and how pictures reach it
            return f"{native.library_path(env).name} {_source_digest(Path(__file__).with_name('inplace.py'))}"
        except native.BuildError as exc:
            return f"unavailable: {exc}"

    def numba_identity() -> str:
        try:
            version = importlib.metadata.version("numba")
        except importlib.metadata.PackageNotFoundError:
            version = "absent"
        return f"numba {version} {_source_digest(Path(__file__).with_name('kernel.py'))}"

    return [Candidate("native", lambda: native_kernel(env), native_identity),
            Candidate("numba", numba_kernel, numba_identity)]


def choose(times: Mapping[str, float], order: Sequence[str]) -> str:
    """The fastest of the kernels in ``order`` that beat ``times["pillow"]`` ("pillow" if none
    does); of kernels within TIE of the fastest, the first in ``order``."""
    faster = [name for name in order if times[name] < times["pillow"]]
    if not faster:
        return "pillow"
    best = min(times[name] for name in faster)
    return next(name for name in faster if times[name] <= best * (1 + TIE))


def _times_text(times: Mapping[str, float]) -> str:
    return ", ".join(f"{name} {secs * 1e3:.1f} ms" for name, secs in sorted(times.items(), key=lambda kv: kv[1]))


class _ChoiceCache:
    """The machine's timed choice: one small JSON file beside the C kernel's builds, named by a
    digest of its key and holding the key itself; written atomically, timed under a file lock so
    workers that start together time once.  ``path`` is None where no folder is writable."""

    def __init__(self, env: Mapping[str, str], candidates: Sequence[Candidate], pillow_version: str):
        self.key = {"version": CHOICE_VERSION, "machine": native.machine_features(), "pillow": pillow_version,
                    "cases": repr(selftest.TIMING_CASES), "candidates": {c.name: c.identity() for c in candidates}}
        digest = hashlib.sha256(json.dumps(self.key, sort_keys=True).encode()).hexdigest()[:20]
        try:
            self.path: Path | None = native.cache_dir(env) / f"choice-{digest}.json"
        except native.BuildError as exc:
            log.info("fast resize: the timed choice is not cached (%s)", exc)
            self.path = None

    def read(self) -> dict | None:
        """The cached choice, or None where there is none or it is unreadable, of another key
        (an older format, a hash collision) or names no candidate: then it is timed and rewritten."""
        if self.path is None or not self.path.exists():
            return None
        try:
            entry = json.loads(self.path.read_text())
            if (isinstance(entry, dict) and entry.get("key") == self.key and isinstance(entry.get("times"), dict)
                    and entry.get("choice") in [*self.key["candidates"], "pillow"]):
                return entry
        except (OSError, ValueError):
            pass
        log.info("fast resize: ignoring the cached choice %s (unreadable or of another key)", self.path)
        return None

    def write(self, choice: str, times: Mapping[str, float]) -> None:
        if self.path is None:
            return
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps({"key": self.key, "choice": choice, "times": dict(times)}, indent=1))
            os.replace(tmp, self.path)
        except OSError as exc:
            log.info("fast resize: could not cache the timed choice in %s (%s)", self.path, exc)
        finally:
            tmp.unlink(missing_ok=True)

    def lock(self):
        """An exclusive lock on the key's lock file (a no-op without a cache folder)."""
        if self.path is None:
            return open(os.devnull, "w")
        lock = open(self.path.with_suffix(".lock"), "w")
        fcntl.flock(lock, fcntl.LOCK_EX)
        return lock


class Resizer:
    """Resizes RGB pictures with ``kernel`` where it applies, with Pillow everywhere else."""

    def __init__(self, kernel: Kernel | None, reason: str, name: str = "pillow"):
        self.kernel = kernel
        self.reason = reason  # why this one, for logs and tests
        self.name = name  # "native", "numba", or "pillow" (no kernel)

    @property
    def fast(self) -> bool:
        return self.kernel is not None

    def _applies(self, img: Image.Image, width: int, height: int) -> bool:
        return self.kernel is not None and img.mode == "RGB" and width > 0 and height > 0 and img.width > 0 and img.height > 0

    def resize(self, img: Image.Image, width: int, height: int) -> np.ndarray:
        if self._applies(img, width, height):
            return self.kernel(img, width, height)
        return pillow_resize(img, width, height)

    def resize_coded(self, img: Image.Image, width: int, height: int, out: np.ndarray) -> None:
        """``resize``, row-delta coded (``encode_rows``) into ``out``, a (height, width, 3) uint8
        array (a pixel-table slot): coded by the kernel as it resizes where it can (the C kernel),
        else coded here from the resized pixels."""
        coded = getattr(self.kernel, "coded", None)
        if coded is not None and self._applies(img, width, height):
            coded(img, width, height, out)
        else:
            encode_rows(self.resize(img, width, height), out=out)

    @classmethod
    def create(cls, env: Mapping[str, str] | None = None, pillow_version: str | None = None,
               make_kernel: Callable[[], Kernel] | None = None, candidates: Sequence[Candidate] | None = None,
               timer: Timer = selftest.timings) -> "Resizer":
        """Decide for this process: a kernel only if enabled, on the pinned Pillow, self-tested, and
        (unless one is asked for) the fastest of those and Pillow on this machine.  The arguments
        default to this process's environment, installed Pillow and kernels (``make_kernel``: the
        only candidate, not timed; ``candidates`` and ``timer``: for tests)."""
        env = os.environ if env is None else env
        pillow_version = PIL.__version__ if pillow_version is None else pillow_version
        setting = env.get(ENV_SWITCH, "1").strip().lower()

        if setting in ("0", "false", "no", "off"):
            log.info("fast resize off (%s=%s): Pillow resizes", ENV_SWITCH, env[ENV_SWITCH])
            return cls(None, "disabled")
        if pillow_version != PINNED_PILLOW:
            log.warning("fast resize off: Pillow %s is installed, the kernel mirrors Pillow %s; Pillow resizes",
                        pillow_version, PINNED_PILLOW)
            return cls(None, f"pillow {pillow_version}")
        if make_kernel is not None:
            candidates = [Candidate("kernel", make_kernel, lambda: "kernel")]
        elif candidates is None:
            candidates = default_candidates(env)
        forced = [c for c in candidates if c.name == setting]
        if make_kernel is not None or forced:
            tested, failure, reason = cls._self_tested(forced or candidates, pillow_version, first_only=True)
            if tested:
                name, kernel = next(iter(tested.items()))
                return cls(kernel, "self-tested", name)
            log.warning("fast resize off: %s; Pillow resizes", failure)
            return cls(None, reason)
        return cls._timed(candidates, env, pillow_version, timer)

    @classmethod
    def _self_tested(cls, candidates: Sequence[Candidate], pillow_version: str,
                     first_only: bool = False) -> tuple[dict[str, Kernel], str, str]:
        """The candidates that load and match Pillow here (the first such only, with
        ``first_only``), and the last failure's message and short reason."""
        passed: dict[str, Kernel] = {}
        failure, reason = "no kernel", "no kernel"
        for c in candidates:
            try:
                kernel = c.make()
                bad = selftest.mismatches(kernel)
            except Exception as exc:  # no compiler, numba missing or broken: never fatal, Pillow is always right
                failure = f"the {c.name} kernel failed to load or run ({type(exc).__name__}: {exc})"
                log.info("fast resize: %s", failure)
                reason = f"kernel error: {type(exc).__name__}"
                continue
            if bad:
                failure = f"the {c.name} kernel differs from Pillow {pillow_version} in its self-test ({', '.join(bad[:3])})"
                log.info("fast resize: %s", failure)
                reason = "self-test mismatch"
                continue
            log.info("fast resize: the %s kernel matched Pillow %s in its self-test", c.name, pillow_version)
            passed[c.name] = kernel
            if first_only:
                break
        return passed, failure, reason

    @classmethod
    def _timed(cls, candidates: Sequence[Candidate], env: Mapping[str, str], pillow_version: str,
               timer: Timer) -> "Resizer":
        """The machine's cached choice, self-tested here; else (first use on this machine, or the
        cached kernel fails here) every candidate self-tested and timed with Pillow, and the
        fastest cached."""
        cache = _ChoiceCache(env, candidates, pillow_version)
        by_name = {c.name: c for c in candidates}
        entry = cache.read()
        if entry is None:
            with cache.lock():
                entry = cache.read()  # another worker may have timed while this one waited
                if entry is None:
                    return cls._time_all(candidates, pillow_version, timer, cache)
        times = _times_text(entry["times"])
        if entry["choice"] == "pillow":
            log.info("fast resize: Pillow resizes (fastest when timed on this machine: %s)", times)
            return cls(None, "timed: pillow fastest")
        tested, _, _ = cls._self_tested([by_name[entry["choice"]]], pillow_version)
        if tested:
            log.info("fast resize: the %s kernel resizes (fastest when timed on this machine: %s)", entry["choice"], times)
            return cls(tested[entry["choice"]], "self-tested, timed fastest", entry["choice"])
        log.info("fast resize: the cached choice %s does not pass here; timing again", entry["choice"])
        with cache.lock():
            return cls._time_all(candidates, pillow_version, timer, cache)

    @classmethod
    def _time_all(cls, candidates: Sequence[Candidate], pillow_version: str, timer: Timer,
                  cache: _ChoiceCache) -> "Resizer":
        tested, failure, reason = cls._self_tested(candidates, pillow_version)
        if not tested:  # not cached: a failed build may be transient, and costs each process only its try
            log.warning("fast resize off: %s; Pillow resizes", failure)
            return cls(None, reason)
        times = dict(timer({name: _as_packed(k) for name, k in {"pillow": pillow_resize, **tested}.items()}))
        choice = choose(times, list(tested))
        cache.write(choice, times)
        log.info("fast resize: timed the resize candidates on this machine (CPU time to resize and row-delta code the self-test's "
                 "pictures, best of %d): %s; %s resizes", selftest.TIMING_REPS, _times_text(times), choice)
        if choice == "pillow":
            return cls(None, "timed: pillow fastest")
        return cls(tested[choice], "self-tested, timed fastest", choice)


def _as_packed(kernel: Kernel) -> Callable[[Image.Image, int, int], None]:
    """What the packer asks of ``kernel``: ``Resizer.resize_coded``, the resize row-delta coded into
    a slot; so the timing weighs the C kernel's fused coding against the others' extra pass."""
    resizer = Resizer(kernel, "timed")
    return lambda img, w, h: resizer.resize_coded(img, w, h, np.empty((h, w, 3), np.uint8))


@functools.lru_cache(maxsize=1)
def default_resizer() -> Resizer:
    """This process's resizer, decided at its first use (one self-test, at most one warning)."""
    return Resizer.create()


def resize_pixels(img: Image.Image, width: int, height: int) -> np.ndarray:
    """Pillow's bicubic resize of an RGB picture -> (h, w, 3) uint8, through this process's resizer."""
    return default_resizer().resize(img, width, height)


def resize_coded(img: Image.Image, width: int, height: int, out: np.ndarray) -> None:
    """``resize_pixels``, row-delta coded into ``out`` ((h, w, 3) uint8), through this process's resizer."""
    default_resizer().resize_coded(img, width, height, out)
