"""Process-level settings for a packing worker: cheaper garbage collection and allocations.

Each cuts CPU that a packing process spends outside the packing itself (measured:
docs/performance.md, "Earlier steps"):

- ``gc.freeze()`` once start-up is over: a Ray worker holds ~270k GC-tracked objects from its
  imports (Ray, torch, transformers) and the tokenizer, none of which packing ever frees.  Without
  the freeze, each full collection that packing's allocations trigger walks all of them; frozen,
  collections only see what packing itself allocates.
- Arrow's system (malloc) memory pool instead of the default mimalloc: every record needs a fresh
  compression buffer of ~13 MB; mimalloc hands such blocks back to the OS within milliseconds,
  so each record faults them in again and the kernel zeroes the pages (system time), while
  glibc's malloc keeps them for the next record.
- glibc's malloc told to keep what is freed (``_keep_freed_memory``): blocks up to 32 MiB from
  the heap, which is trimmed only past 1 GiB free.  Packing stays at its peak memory instead of
  faulting every record's pictures and tables in again.

Call it in the worker process, after imports and tokenizer loading, before packing.  Only the
Ray task and ``prepack run --no-ray`` call it: a library caller (tests, audits, notebooks) keeps
its own process settings.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import sys

import pyarrow as pa

log = logging.getLogger(__name__)


def settle_worker_process() -> None:
    """Freeze start-up objects out of the GC; make Arrow and malloc reuse freed blocks (see module doc)."""
    gc.collect()  # what start-up (or an earlier task in this worker) left as garbage is not frozen
    gc.freeze()
    pa.set_memory_pool(pa.system_memory_pool())
    _keep_freed_memory()
    log.debug("packing worker: %d objects frozen out of the GC, Arrow pool %s", gc.get_freeze_count(),
              pa.default_memory_pool().backend_name)


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc's upper bound on 64-bit
_TRIM_THRESHOLD = 1 * 2**30


def _keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed blocks for the next record instead of returning them.

    Every record allocates the same large buffers again (decoded pictures, the pixel table, the
    compressed copy).  By default glibc serves blocks over its mmap threshold with fresh mappings
    and returns the top of the heap once 2x that threshold is free, so each record faults its
    pages in again and the kernel zeroes them (system time, and on a VM whose free pages go back
    to the host, far more).  Serving blocks up to 32 MiB from the heap and trimming it only past
    1 GiB free keeps them.  Returns whether glibc accepted the settings (other libcs: no-op).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
