"""The stream numbering, in one place: stream ``s = r*K + w`` is DataLoader worker w of rank r.

Why one home: the packer (each stream's rank and worker: its slice of the data and its seed),
the loader (each rank's streams), and balanced samples (a step's streams, one per rank) all
number streams, and must agree.  ``K = 0`` in a config or pack identity (in-process iteration)
means one stream per rank: ``workers`` below is K or 1.
"""

from __future__ import annotations


def workers_per_rank(num_workers: int) -> int:
    """Streams per rank: K, or 1 for K = 0 (the reference iterated in the rank's own process)."""
    return max(1, int(num_workers))


def stream_of(rank: int, worker: int, num_workers: int) -> int:
    """The stream of DataLoader worker ``worker`` of rank ``rank``."""
    return rank * workers_per_rank(num_workers) + worker


def rank_and_worker(stream: int, num_workers: int) -> tuple[int, int]:
    """The rank and DataLoader worker whose packing stream ``stream`` is."""
    return divmod(stream, workers_per_rank(num_workers))


def rank_streams(rank: int, num_workers: int) -> list[int]:
    """Rank ``rank``'s own streams, in the order a K-worker DataLoader interleaves them."""
    k = workers_per_rank(num_workers)
    return list(range(rank * k, (rank + 1) * k))


def step_classes(world_size: int, num_workers: int) -> list[list[int]]:
    """The streams whose records j form one optimizer step at M = 1, per DataLoader worker w:
    ``r*K + w`` for r < W (a balanced-samples pack re-splits each such step among them)."""
    return [[stream_of(r, w, num_workers) for r in range(world_size)] for w in range(workers_per_rank(num_workers))]


def step_class(stream: int, world_size: int, num_workers: int) -> list[int]:
    """The streams of ``stream``'s step class (``step_classes``): every rank's stream of its worker."""
    _, worker = rank_and_worker(stream, num_workers)
    return [stream_of(r, worker, num_workers) for r in range(world_size)]
