"""The C kernel (``native.c``): compiled once per machine with its own C compiler, loaded with ctypes.

Why compiled here and not shipped: ``-march=native`` lets the compiler use the vector units this
CPU has (AVX-512 where present), and a packing worker's start-up stays at a library load (~ms)
instead of a JIT of several seconds (measured: docs/performance.md, "Why C and not numba").  The
shared library is cached under a key of everything that shapes it — the source, the compiler
command, the flags and this CPU's architecture and features — so a cluster with a shared home and
mixed CPUs keeps one build per kind of machine, and a changed source is rebuilt.  Concurrent
workers build under a file lock, so one compiles and the others load its result.  Nothing here
decides whether the kernel is used: the router self-tests whatever this module loads against Pillow
first.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, Mapping

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native.c")
# -ffp-contract=off: no fused multiply-add in the double-precision weight table (Pillow has none)
FLAGS = ("-O2", "-march=native", "-ffp-contract=off", "-Wno-psabi", "-fPIC", "-shared")
PORTABLE_FLAGS = ("-O2", "-ffp-contract=off", "-Wno-psabi", "-fPIC", "-shared")  # a compiler that refuses -march=native
CACHE_ENV = "PREPACK_CACHE_DIR"
# extra compiler flags after the default ones, e.g. "-mno-avx512f" to run a pack on the AVX2 build
# of an AVX-512 machine (how the other ISA levels are timed end to end); part of the build's key
EXTRA_FLAGS_ENV = "PREPACK_KERNEL_CFLAGS"
BUILD_TIMEOUT_S = 120

# int prepack_resize_rgbx(const uint8_t *src, int in_w, int in_h, uint8_t *dst, int out_w, int out_h,
#                         int vertical_first)  (and prepack_resize_rows, with const uint8_t *const *rows;
# the _coded variants of both write the result row-delta coded, as the record's pixel table stores it)
ResizeFn = Callable[[int, int, int, int, int, int, int], int]


class BuildError(RuntimeError):
    """No compiler, or the compiler failed: the router falls back (this is never a user error)."""


def cache_dir(env: Mapping[str, str]) -> Path:
    """Where built kernels live: $PREPACK_CACHE_DIR, else the user's cache folder, else (no
    writable home, as in some containers) a per-user temporary folder."""
    if env.get(CACHE_ENV):
        bases = [Path(env[CACHE_ENV])]
    else:
        home = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        bases = [Path(home) / "bagel-prepack", Path(tempfile.gettempdir()) / f"bagel-prepack-{os.getuid()}"]
    for base in bases:
        try:
            (base / "resize").mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(base / "resize", os.W_OK):
            return base / "resize"
    raise BuildError("no writable cache folder for the compiled kernel")


def compiler(env: Mapping[str, str]) -> list[str]:
    """$CC if set, else the first of cc, gcc, clang on PATH."""
    if env.get("CC"):
        return shlex.split(env["CC"])
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name, path=env.get("PATH"))
        if path:
            return [path]
    raise BuildError("no C compiler (cc, gcc or clang) on PATH")


def machine_features() -> str:
    """This CPU's architecture and instruction-set features: what -march=native compiles for."""
    features = ""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    features = " ".join(sorted(line.split(":", 1)[1].split()))
                    break
    except OSError:
        pass
    return f"{platform.machine()} {features}"


def effective_flags(env: Mapping[str, str], flags: tuple[str, ...]) -> tuple[str, ...]:
    """``flags``, with $PREPACK_KERNEL_CFLAGS after the default ones."""
    extra = tuple(shlex.split(env.get(EXTRA_FLAGS_ENV, "")))
    return flags + extra if flags == FLAGS and extra else flags


def library_path(env: Mapping[str, str], flags: tuple[str, ...] = FLAGS) -> Path:
    flags = effective_flags(env, flags)
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(compiler(env)).encode(), " ".join(flags).encode(),
                 machine_features().encode()):
        key.update(part)
        key.update(b"\0")
    return cache_dir(env) / f"resize-{key.hexdigest()[:20]}.so"


def build(target: Path, env: Mapping[str, str], flags: tuple[str, ...] = FLAGS) -> None:
    """Compile SOURCE into ``target`` (atomically: a temporary file renamed into place)."""
    cc = compiler(env)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    last = ""
    try:
        for attempt in ((FLAGS, PORTABLE_FLAGS) if flags == FLAGS else (flags,)):
            cmd = [*cc, *attempt, "-o", str(tmp), str(SOURCE), "-lm"]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
                                      env=dict(env))
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise BuildError(f"{shlex.join(cmd)}: {exc}") from exc
            if done.returncode == 0:
                os.replace(tmp, target)
                log.info("built the resize kernel: %s", shlex.join(cmd))
                return
            last = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        raise BuildError(f"{cc[0]} could not compile {SOURCE.name}: {last}")
    finally:
        tmp.unlink(missing_ok=True)


def library(env: Mapping[str, str] | None = None, flags: tuple[str, ...] = FLAGS) -> ctypes.CDLL:
    """The built kernel, building it first if this machine has no build of this source.
    ``flags``: other compiler flags (tests and the bench build the narrower x86 variants)."""
    env = os.environ if env is None else env
    path = library_path(env, flags)
    if not path.exists():
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one worker compiles; the others wait and load its build
            if not path.exists():
                build(path, env, effective_flags(env, flags))
    return ctypes.CDLL(str(path))


def isa(lib: ctypes.CDLL) -> str:
    """The vector path the build took: "avx512-vnni", "avx512", "avx2-vnni", "avx2" ("avx2-madd"
    with -DPREPACK_RESIZE_MADD), "neon" or "portable"."""
    fn = lib.prepack_resize_isa
    fn.restype = ctypes.c_char_p
    return fn().decode()


def load(env: Mapping[str, str] | None = None, flags: tuple[str, ...] = FLAGS,
         entry: str = "prepack_resize_rgbx") -> ResizeFn:
    """The kernel's entry point (see ``library``): ``prepack_resize_rgbx`` takes the RGBX picture,
    ``prepack_resize_rows`` a table of its row pointers (Pillow's own, read in place); their
    ``_coded`` variants write the result row-delta coded (``schemas.pixel_table.encode_rows``)."""
    fn = getattr(library(env, flags), entry)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                   ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn
