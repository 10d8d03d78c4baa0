"""One entry point for the packer's bicubic resizes: a kernel that has matched Pillow in this
process when one is enabled, Pillow otherwise.

Two kernels do the same arithmetic: the C one (``native.c``, built once per machine with its C
compiler: a library load at start-up, the fastest) and the numba one (``kernel.py``: for machines
with no C compiler; it JIT-compiles for a few seconds the first time per machine).  The decision is
taken once per process (``default_resizer``), at the first resize: the first kernel that loads and
passes the self-test against the installed Pillow is used.  Any doubt — another Pillow release
than the one the kernels mirror, no kernel loading, one differing value — means Pillow, with one
warning.  ``PREPACK_FAST_RESIZE``: ``0`` turns the kernels off, ``native`` or ``numba`` asks for
one of them only, anything else (the default) tries the C kernel and then numba.
"""

from __future__ import annotations

import functools
import logging
import os
import tempfile
from typing import Callable, Mapping

import numpy as np
import PIL
from PIL import Image

from prepack.engine.images import raw_pixels, rgb_array
from prepack.engine.resize import selftest

log = logging.getLogger(__name__)

PINNED_PILLOW = "13.0.0"  # the release whose Resample.c arithmetic the kernel mirrors (pyproject pins it)
ENV_SWITCH = "PREPACK_FAST_RESIZE"

Kernel = Callable[[Image.Image, int, int], np.ndarray]


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
    try:
        from prepack.engine.resize import kernel
    except RuntimeError as exc:  # "cannot cache function ...: no locator available"
        import numba

        fallback = os.path.join(tempfile.gettempdir(), f"prepack-numba-{os.getuid()}")
        log.info("numba cache: %s; using %s", exc, fallback)
        numba.config.CACHE_DIR = fallback
        from prepack.engine.resize import kernel
    return kernel


def native_kernel(env: Mapping[str, str] | None = None) -> Kernel:
    """The C kernel as the packer calls it: an RGB picture in, (h, w, 3) uint8 out."""
    from prepack.engine.resize import native

    fn = native.load(env)

    def resize(img: Image.Image, width: int, height: int) -> np.ndarray:
        in_w, in_h = img.size
        src = raw_pixels(img, "RGBX", 4)
        out = np.empty((height, width, 3), np.uint8)
        if fn(src.ctypes.data, in_w, in_h, out.ctypes.data, width, height,
              int(vertical_first(in_w, in_h, width, height))):
            raise MemoryError(f"resize {in_w}x{in_h} -> {width}x{height}: out of memory")
        return out

    return resize


def numba_kernel() -> Kernel:
    """The numba kernel as the packer calls it: an RGB picture in, (h, w, 3) uint8 out."""
    kernel = _import_kernel()

    def resize(img: Image.Image, width: int, height: int) -> np.ndarray:
        in_w, in_h = img.size
        src = raw_pixels(img, "RGBX", 4).view(np.int32).reshape(in_h, in_w)
        return kernel.resize_rgbx(src, width, height, vertical_first(in_w, in_h, width, height))

    return resize


class Resizer:
    """Resizes RGB pictures with ``kernel`` where it applies, with Pillow everywhere else."""

    def __init__(self, kernel: Kernel | None, reason: str, name: str = ""):
        self.kernel = kernel
        self.reason = reason  # why the kernel is (not) used, for logs and tests
        self.name = name  # which kernel: "native", "numba" (empty: Pillow)

    @property
    def fast(self) -> bool:
        return self.kernel is not None

    def resize(self, img: Image.Image, width: int, height: int) -> np.ndarray:
        if self.kernel is not None and img.mode == "RGB" and width > 0 and height > 0 and img.width and img.height:
            return self.kernel(img, width, height)
        return pillow_resize(img, width, height)

    @classmethod
    def create(cls, env: Mapping[str, str] | None = None, pillow_version: str | None = None,
               make_kernel: Callable[[], Kernel] | None = None) -> "Resizer":
        """Decide for this process: a kernel only if enabled, on the pinned Pillow, and self-tested.
        The arguments default to this process's environment, installed Pillow and kernels
        (``make_kernel``: the only candidate, for tests)."""
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
        kernels = {"native": lambda: native_kernel(env), "numba": numba_kernel}  # in order of preference
        if make_kernel is not None:
            candidates = [("kernel", make_kernel)]
        elif setting in kernels:
            candidates = [(setting, kernels[setting])]
        else:
            candidates = list(kernels.items())
        failure, reason = "no kernel", "no kernel"
        for name, make in candidates:
            try:
                kernel = make()
                bad = selftest.mismatches(kernel)
            except Exception as exc:  # no compiler, numba missing or broken: never fatal, Pillow is always right
                failure = f"the {name} kernel failed to load or run ({type(exc).__name__}: {exc})"
                log.info("fast resize: %s", failure)
                reason = f"kernel error: {type(exc).__name__}"
                continue
            if bad:
                failure = f"the {name} kernel differs from Pillow {pillow_version} in its self-test ({', '.join(bad[:3])})"
                log.info("fast resize: %s", failure)
                reason = "self-test mismatch"
                continue
            log.info("fast resize: the %s kernel matched Pillow %s in its self-test", name, pillow_version)
            return cls(kernel, "self-tested", name)
        log.warning("fast resize off: %s; Pillow resizes", failure)
        return cls(None, reason)


@functools.lru_cache(maxsize=1)
def default_resizer() -> Resizer:
    """This process's resizer, decided at its first use (one self-test, at most one warning)."""
    return Resizer.create()


def resize_pixels(img: Image.Image, width: int, height: int) -> np.ndarray:
    """Pillow's bicubic resize of an RGB picture -> (h, w, 3) uint8, through this process's resizer."""
    return default_resizer().resize(img, width, height)
