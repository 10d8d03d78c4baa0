"""Pillow's own rows of an RGB picture, for the C kernel to read in place instead of a copy.

Copying a decoded picture out of Pillow as RGBX (``decode.raw_pixels``) cost a packing worker CPU
for bytes the kernel can read where they are (measured: docs/performance.md, "Reading Pillow's rows
in place"): Pillow stores an RGB pixel in 4 bytes, one row pointer per line (``image32``).
``Image.getim()`` hands out the image's memory as a capsule (which keeps it alive); its layout is
Pillow's C struct ``ImagingMemoryInstance``, mirrored here for the pinned release only as far as
the row pointers.  A picture is read in place only when the struct's own fields agree with the
picture (size, bands, 4-byte pixels, the row table aliased as Pillow aliases it), and ``probe``
checks the bytes of real pictures at the kernel's load; anything else, and the caller copies as
before.
"""

from __future__ import annotations

import ctypes
import logging

import numpy as np
from PIL import Image

from prepack.engine.decode import raw_pixels

log = logging.getLogger(__name__)

CAPSULE_NAME = b"Pillow Imaging"  # IMAGING_MAGIC


class _Imaging(ctypes.Structure):
    """The head of Pillow 13.0.0's ``struct ImagingMemoryInstance`` (libImaging/Imaging.h), up to
    ``linesize``: every field before the row table, so its offset is Pillow's."""

    _fields_ = [("mode", ctypes.c_int), ("type", ctypes.c_int), ("depth", ctypes.c_int), ("bands", ctypes.c_int),
                ("xsize", ctypes.c_int), ("ysize", ctypes.c_int), ("palette", ctypes.c_void_p),
                ("image8", ctypes.c_void_p), ("image32", ctypes.c_void_p), ("image", ctypes.c_void_p),
                ("block", ctypes.c_void_p), ("blocks", ctypes.c_void_p), ("pixelsize", ctypes.c_int),
                ("linesize", ctypes.c_int)]


_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_is_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]
_is_valid.restype = ctypes.c_int
_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_get_pointer.restype = ctypes.c_void_p


def rows(img: Image.Image) -> tuple[object, int] | None:
    """(the capsule, which keeps the memory alive while held; the address of the picture's row
    pointer table), or None where this picture's memory is not laid out as expected."""
    if img.mode != "RGB" or not img.width or not img.height:
        return None
    try:
        capsule = img.getim()
    except (AttributeError, ValueError, OSError):
        return None
    if not _is_valid(capsule, CAPSULE_NAME):
        return None
    im = _Imaging.from_address(_get_pointer(capsule, CAPSULE_NAME))
    if ((im.xsize, im.ysize, im.bands, im.pixelsize, im.linesize) != (img.width, img.height, 3, 4, 4 * img.width)
            or not im.image32 or im.image32 != im.image or im.image8):
        return None
    return capsule, im.image32


def probe() -> bool:
    """Whether ``rows`` reads these pictures' bytes: every row of a few pictures, compared with
    Pillow's own RGBX copy (the kernel's self-test then proves it through the kernel itself)."""
    rng = np.random.default_rng(7)
    try:
        for w, h in ((1, 1), (7, 5), (64, 48), (333, 17)):
            img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
            got = rows(img)
            if got is None:
                log.info("fast resize: Pillow's rows are not as expected (%dx%d); the picture is copied", w, h)
                return False
            table = (ctypes.c_void_p * h).from_address(got[1])
            want = raw_pixels(img, "RGBX", 4)[..., :3]
            read = np.stack([np.frombuffer(ctypes.string_at(table[y], 4 * w), np.uint8).reshape(w, 4)
                             for y in range(h)])[..., :3]
            if not np.array_equal(read, want):
                log.info("fast resize: Pillow's rows hold other bytes than expected; the picture is copied")
                return False
    except (ValueError, OSError, TypeError) as exc:
        log.info("fast resize: Pillow's rows could not be read (%s); the picture is copied", exc)
        return False
    return True
