"""The first-use check of the kernel against the installed Pillow, on synthetic pictures.

The cases cover what the arithmetic distinguishes: both pass orders (Pillow runs the vertical pass
first when the height shrinks by more than twice the width's shrink), down- and up-scaling on
each axis, one axis unchanged, 1-pixel inputs and outputs, a filter wider than the picture, and
contents that saturate the clip (a 0/255 checkerboard rings past both ends).  A kernel that
also writes its result row-delta coded (the C kernel's ``coded``) is checked in both forms.

The same pictures, with two photograph-sized ones, time the candidates once per machine
(``timings``): the router uses the fastest exact one.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator, Mapping

import numpy as np
from PIL import Image

from schemas.pixel_table import encode_rows

# (in_w, in_h, out_w, out_h)
CASES: tuple[tuple[int, int, int, int], ...] = (
    (64, 48, 32, 24),     # both down, horizontal first
    (48, 64, 24, 32),     # tall, both down, horizontal first (32 < 2*24)
    (40, 120, 36, 30),    # the height shrinks far more: vertical first
    (30, 20, 71, 45),     # both up
    (50, 40, 50, 17),     # vertical only
    (50, 40, 13, 40),     # horizontal only
    (37, 29, 64, 11),     # up in x, down in y (vertical first)
    (1, 1, 5, 3),         # 1-pixel input
    (7, 1, 1, 1),         # 1-pixel output
    (1, 9, 4, 2),
    (300, 7, 3, 7),       # filter wider than the output needs, one axis kept
    (17, 13, 17, 13),     # same size: a copy
    (211, 157, 98, 73),   # an odd, photo-like ratio
)
# what the timing adds: the packer's pictures are ~0.8 MP, where the per-call overheads vanish
TIMING_CASES = CASES + (
    (1024, 768, 512, 384),   # horizontal first
    (768, 1024, 672, 384),   # vertical first
)
TIMING_REPS = 5


def _pictures(w: int, h: int, rng: np.random.Generator) -> Iterator[Image.Image]:
    yield Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    checker = ((np.add.outer(np.arange(h), np.arange(w)) % 2) * 255).astype(np.uint8)
    yield Image.fromarray(np.stack([checker, 255 - checker, checker], axis=-1))


def timings(kernels: Mapping[str, Callable[[Image.Image, int, int], np.ndarray]],
            clock: Callable[[], float] = time.thread_time, reps: int = TIMING_REPS) -> dict[str, float]:
    """Seconds of ``clock`` (this thread's CPU time: the machine may be shared) each kernel takes
    for all of TIMING_CASES, best of ``reps`` runs, the kernels alternating (each run starts
    with the next one), so a busy spell on the machine hits all of them alike."""
    rng = np.random.default_rng(20260102)
    cases = [(next(_pictures(w, h, rng)), ow, oh) for w, h, ow, oh in TIMING_CASES]
    names = list(kernels)
    best = dict.fromkeys(names, float("inf"))
    for rep in range(reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            kernel = kernels[name]
            start = clock()
            for picture, ow, oh in cases:
                kernel(picture, ow, oh)
            best[name] = min(best[name], clock() - start)
    return best


GUARD = 64  # bytes either side of a coded result's slot that the kernel must leave as they were


def _coded_mismatch(coded: Callable[[Image.Image, int, int, np.ndarray], None], picture: Image.Image, ow: int,
                    oh: int, want: np.ndarray) -> bool:
    """Whether ``coded`` writes other bytes than ``encode_rows(want)`` into a slot of a larger
    buffer, or writes outside it."""
    buf = np.full(want.size + 2 * GUARD, 0xA5, np.uint8)
    coded(picture, ow, oh, buf[GUARD:GUARD + want.size].reshape(want.shape))
    return (not np.array_equal(buf[GUARD:GUARD + want.size], encode_rows(want).reshape(-1))
            or bool((buf[:GUARD] != 0xA5).any() or (buf[GUARD + want.size:] != 0xA5).any()))


def mismatches(kernel: Callable[[Image.Image, int, int], np.ndarray]) -> list[str]:
    """The cases where ``kernel`` differs from Pillow's ``Image.resize(..., BICUBIC)`` (empty: none);
    for a kernel that also codes as it resizes (``coded``), also those where its coded result
    differs from ``encode_rows`` of Pillow's."""
    rng = np.random.default_rng(20260101)
    coded = getattr(kernel, "coded", None)
    found = []
    for w, h, ow, oh in CASES:
        for i, picture in enumerate(_pictures(w, h, rng)):
            want = np.asarray(picture.resize((ow, oh), Image.Resampling.BICUBIC))
            got = kernel(picture, ow, oh)
            if got.shape != want.shape or got.dtype != want.dtype or not np.array_equal(got, want):
                found.append(f"{w}x{h}->{ow}x{oh} picture {i}")
            if coded is not None and _coded_mismatch(coded, picture, ow, oh, want):
                found.append(f"{w}x{h}->{ow}x{oh} picture {i} coded")
    return found
