"""Process-level settings for a packing worker: cheaper garbage collection and Arrow allocations.

Both cut CPU that a packing process spends outside the packing itself (measured with
``scripts/bench_pack.py``, end to end through ``prepack run``):

- ``gc.freeze()`` once start-up is over: a Ray worker holds ~270k GC-tracked objects from its
  imports (Ray, torch, transformers) and the tokenizer, none of which packing ever frees.  Without
  the freeze, each full collection that packing's allocations trigger walks all of them (~0.14 s
  each here); frozen, collections only see what packing itself allocates.
- Arrow's system (malloc) memory pool instead of the default mimalloc: every record needs a fresh
  compression buffer of ~13 MB; mimalloc hands such blocks back to the OS within milliseconds,
  so each record faults them in again and the kernel zeroes the pages (system time), while
  glibc's malloc keeps them for the next record.

Call it in the worker process, after imports and tokenizer loading, before packing.  Only the
Ray task calls it: an in-process caller (tests, audits) keeps its own process settings.
"""

from __future__ import annotations

import gc
import logging

import pyarrow as pa

log = logging.getLogger(__name__)


def settle_worker_process() -> None:
    """Freeze start-up objects out of the GC and make Arrow reuse freed blocks (see module doc)."""
    gc.collect()  # what start-up (or an earlier task in this worker) left as garbage is not frozen
    gc.freeze()
    pa.set_memory_pool(pa.system_memory_pool())
    log.debug("packing worker: %d objects frozen out of the GC, Arrow pool %s", gc.get_freeze_count(),
              pa.default_memory_pool().backend_name)
