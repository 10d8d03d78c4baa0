"""Synthetic RGB pictures for the resize kernels' comparisons with Pillow."""

from __future__ import annotations

import numpy as np
from PIL import Image

KINDS = ("noise", "checker", "extremes", "smooth")


def picture(kind: str, w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    if kind == "noise":
        arr = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    elif kind == "checker":  # rings past 0 and 255: exercises the clip
        c = ((np.add.outer(np.arange(h), np.arange(w)) % 2) * 255).astype(np.uint8)
        arr = np.stack([c, 255 - c, c], axis=-1)
    elif kind == "extremes":
        arr = rng.choice(np.array([0, 1, 254, 255], np.uint8), (h, w, 3))
    else:  # smooth gradient plus a little noise: photo-like
        y, x = np.mgrid[0:h, 0:w]
        base = (x * 255 // max(w - 1, 1) + y * 127 // max(h - 1, 1)) % 256
        arr = np.clip(base[..., None] + rng.integers(-8, 9, (h, w, 3)), 0, 255).astype(np.uint8)
    return Image.fromarray(arr)
