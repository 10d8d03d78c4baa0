"""``Distribution``: percentiles of a non-negative integer quantity in fixed memory.

Why: ``prepack stats`` walks 10^7 records or more and must not keep a value per record.  Values
below ``2**EXACT_BITS`` (2,048) are counted exactly; a larger value is counted in the bucket of
its 11 leading bits (as HdrHistogram does), so a percentile over any number of values is within
0.1% of the true one, and a distribution never holds more than ~1,024 buckets per power of two
it reaches (about 12,000 for values up to 2^21).  Minimum, maximum, count and sum are exact.
Distributions merge by adding their buckets, so one per stream (or per process) can be combined.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np

EXACT_BITS = 11


def bucket_floor(values: np.ndarray) -> np.ndarray:
    """The lower edge of each value's bucket (the value itself below ``2**EXACT_BITS``)."""
    v = np.asarray(values, dtype=np.int64)
    if v.size and int(v.min()) < 0:
        raise ValueError("a Distribution counts non-negative integers")
    # frexp's exponent is the bit length, exactly for integers below 2**53
    bits = np.maximum(np.frexp(v.astype(np.float64))[1].astype(np.int64) - EXACT_BITS, 0)
    return (v >> bits) << bits


class Distribution:
    """Counts of integer values in buckets (see module doc); ``add`` takes arrays."""

    __slots__ = ("buckets", "count", "total", "min", "max")

    def __init__(self) -> None:
        self.buckets: Counter = Counter()
        self.count = 0
        self.total = 0
        self.min: int | None = None
        self.max: int | None = None

    def add(self, values) -> None:
        v = np.asarray(values, dtype=np.int64).reshape(-1)
        if not v.size:
            return
        lo, hi = int(v.min()), int(v.max())
        self.min = lo if self.min is None else min(self.min, lo)
        self.max = hi if self.max is None else max(self.max, hi)
        self.count += int(v.size)
        self.total += int(v.sum())
        edges, counts = np.unique(bucket_floor(v), return_counts=True)
        self.buckets.update(dict(zip(edges.tolist(), counts.tolist())))

    def merge(self, other: "Distribution") -> None:
        if not other.count:
            return
        self.buckets.update(other.buckets)
        self.count += other.count
        self.total += other.total
        self.min = other.min if self.min is None else min(self.min, other.min)
        self.max = other.max if self.max is None else max(self.max, other.max)

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else math.nan

    def quantile(self, q: float) -> int | None:
        """The nearest-rank ``q`` quantile: the least value with at least ``q * count`` values at
        or below it (exact below ``2**EXACT_BITS``; above, its bucket's middle, within min..max)."""
        if not self.count:
            return None
        rank = max(1, math.ceil(q * self.count))
        seen = 0
        for edge in sorted(self.buckets):
            seen += self.buckets[edge]
            if seen >= rank:
                width = 1 << max(0, edge.bit_length() - EXACT_BITS)
                return int(min(max(edge + (width - 1) // 2, self.min), self.max))
        return self.max

    def summary(self) -> dict:
        """min, p50, p90, max, mean, total and count (None for the statistics of no value)."""
        return {"min": self.min, "p50": self.quantile(0.5), "p90": self.quantile(0.9), "max": self.max,
                "mean": self.mean if self.count else None, "total": self.total, "count": self.count}
