"""Numba kernels for Pillow's bicubic RGB resample, value for value.

What makes the bytes equal (Pillow 13.0.0, libImaging/Resample.c, read for its arithmetic):

- Filter weights are computed in double exactly in Pillow's order (window from the rounded
  ``center -/+ support``, weights through a precomputed ``1/filterscale``, a sequential sum, one
  division per weight), then turned into 22-bit fixed point rounded half away from zero.  Only
  this small table uses floating point; numba emits no fused multiply-add without fastmath.
- Each output value is ``clip((1 << 21) + sum(pixel * weight) >> 22)`` in int32; every partial
  sum fits in int32, so the order of the additions (vector lanes, tap order) cannot change it.
- The intermediate image between the two passes is uint8, so the pass order is Pillow's
  (``vertical_first``).

Why it is faster: pixels travel as one int32 per pixel (RGBX, Pillow's own storage, so reading
them is a memcpy) and every inner loop runs over contiguous int32 lanes: the vertical pass over a
row, the horizontal pass over a block of rows held transposed.
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np

PRECISION_BITS = 22
_HALF = 1 << (PRECISION_BITS - 1)
_ROWS = 16  # rows per horizontal-pass block: one AVX-512 vector (two AVX2) of int32 lanes

_jit = nb.njit(cache=True, nogil=True, boundscheck=False)
_inline = nb.njit(cache=True, nogil=True, boundscheck=False, inline="always")  # numba-level: constants propagate


@_jit
def _bicubic(x: float) -> float:
    a = -0.5
    if x < 0.0:
        x = -x
    if x < 1.0:
        return ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
    if x < 2.0:
        return (((x - 5.0) * x + 8.0) * x - 4.0) * a
    return 0.0


@_jit
def coefficients(in_size: int, out_size: int):
    """(first tap, tap count, int32 weights[out_size, ksize]) of one axis, as Pillow makes them."""
    scale = float(in_size) / out_size
    filterscale = scale if scale > 1.0 else 1.0
    support = 2.0 * filterscale
    ksize = int(math.ceil(support)) * 2 + 1
    first = np.empty(out_size, np.int32)
    count = np.empty(out_size, np.int32)
    weights = np.zeros((out_size, ksize), np.int32)
    w = np.empty(ksize, np.float64)
    inv = 1.0 / filterscale
    for xx in range(out_size):
        center = (xx + 0.5) * scale
        lo = int(center - support + 0.5)
        if lo < 0:
            lo = 0
        hi = int(center + support + 0.5)
        if hi > in_size:
            hi = in_size
        n = hi - lo
        total = 0.0
        for x in range(n):
            v = _bicubic((float(x + lo) - center + 0.5) * inv)
            w[x] = v
            total += v
        for x in range(n):
            v = w[x] / total if total != 0.0 else w[x]
            if v < 0.0:
                weights[xx, x] = int(-0.5 + v * (1 << PRECISION_BITS))
            else:
                weights[xx, x] = int(0.5 + v * (1 << PRECISION_BITS))
        first[xx] = lo
        count[xx] = n
    return first, count, weights


@_jit
def _clip(v):
    v >>= PRECISION_BITS
    return 0 if v < 0 else (255 if v > 255 else v)


@_inline
def _madd(acc, pixels, k, n):
    """acc[c, i] += channel c of pixels[i] * k, for i < n."""
    a0 = acc[0]
    a1 = acc[1]
    a2 = acc[2]
    for i in range(n):
        v = pixels[i]
        a0[i] += (v & 255) * k
        a1[i] += ((v >> 8) & 255) * k
        a2[i] += ((v >> 16) & 255) * k


@_inline
def _madd4(acc, lines, at, k, t, n):
    """Taps t..t+3 (of lines[at..at+3]) at once: each accumulator is loaded and stored once per four
    products."""
    p, q, r, s = lines[at], lines[at + 1], lines[at + 2], lines[at + 3]
    kp, kq, kr, ks = k[t], k[t + 1], k[t + 2], k[t + 3]
    a0 = acc[0]
    a1 = acc[1]
    a2 = acc[2]
    for i in range(n):
        u = p[i]
        v = q[i]
        w = r[i]
        x = s[i]
        a0[i] += (u & 255) * kp + (v & 255) * kq + (w & 255) * kr + (x & 255) * ks
        a1[i] += ((u >> 8) & 255) * kp + ((v >> 8) & 255) * kq + ((w >> 8) & 255) * kr + ((x >> 8) & 255) * ks
        a2[i] += ((u >> 16) & 255) * kp + ((v >> 16) & 255) * kq + ((w >> 16) & 255) * kr + ((x >> 16) & 255) * ks


@_inline
def _taps(acc, lines, lo, count, k, n):
    """acc += sum over t < count of lines[lo + t] * k[t]: the one inner loop of both passes.
    int32 sums are exact, so grouping the taps changes nothing."""
    t = 0
    while t + 4 <= count:
        _madd4(acc, lines, lo + t, k, t, n)
        t += 4
    while t < count:
        _madd(acc, lines[lo + t], k[t], n)
        t += 1


@_inline
def _store(acc, dst, n):
    """dst[i] = the clipped RGBX pixel of acc[:, i], for i < n."""
    for i in range(n):
        dst[i] = np.int32(_clip(acc[0, i]) | (_clip(acc[1, i]) << 8) | (_clip(acc[2, i]) << 16))


@_jit
def vertical_pass(src, first, count, weights):
    """(H, W) RGBX int32 -> (h, W) RGBX int32 along the columns; rows are contiguous lanes."""
    h = first.shape[0]
    width = src.shape[1]
    out = np.empty((h, width), np.int32)
    acc = np.empty((3, width), np.int32)
    for yy in range(h):
        acc[:] = _HALF
        lo = first[yy]
        _taps(acc, src, lo, count[yy], weights[yy], width)
        _store(acc, out[yy], width)
    return out


@_jit
def horizontal_pass(src, first, count, weights):
    """(H, W) RGBX int32 -> (H, w) RGBX int32 along the rows, _ROWS rows at a time held
    transposed so that the taps of one output column are contiguous lanes."""
    height, width = src.shape
    w = first.shape[0]
    out = np.empty((height, w), np.int32)
    tile = np.zeros((width, _ROWS), np.int32)
    res = np.empty((w, _ROWS), np.int32)
    acc = np.empty((3, _ROWS), np.int32)
    for y0 in range(0, height, _ROWS):
        rows = min(_ROWS, height - y0)
        for x in range(width):  # column-major reads, contiguous writes: the fast transpose order
            for r in range(rows):
                tile[x, r] = src[y0 + r, x]
        for xx in range(w):
            acc[:] = _HALF
            lo = first[xx]
            _taps(acc, tile, lo, count[xx], weights[xx], _ROWS)
            _store(acc, res[xx], _ROWS)
        for r in range(rows):
            line = out[y0 + r]
            for xx in range(w):
                line[xx] = res[xx, r]
    return out


@_jit
def to_rgb(src):
    """(h, w) RGBX int32 -> (h, w, 3) uint8."""
    h, w = src.shape
    out = np.empty((h, w, 3), np.uint8)
    for y in range(h):
        for x in range(w):
            v = src[y, x]
            out[y, x, 0] = v & 255
            out[y, x, 1] = (v >> 8) & 255
            out[y, x, 2] = (v >> 16) & 255
    return out


@_jit
def resize_rgbx(src, width, height, vertical_first):
    """Pillow's bicubic resize of an (H, W) RGBX int32 image to (height, width, 3) uint8."""
    in_h, in_w = src.shape
    img = src
    for vertical in (vertical_first, not vertical_first):  # Pillow's pass order, then the other pass
        if vertical and height != in_h:
            f, c, k = coefficients(in_h, height)
            img = vertical_pass(img, f, c, k)
        elif not vertical and width != in_w:
            f, c, k = coefficients(in_w, width)
            img = horizontal_pass(img, f, c, k)
    return to_rgb(img)
