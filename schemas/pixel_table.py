"""A record's pixel table: row-delta coded images, each image's digest, and images taken as an
earlier table stored them (``StoredImage``).

Why apart from ``schemas.record``: the table is built on the write side (the layout codes each
resized picture straight into it) and checked per image on both sides (reuse, the record digest);
the record module only stores it.  Coding (PNG's "Sub" filter, mod 256) is exact, and zstd then
compresses photographs to ~2/3 of the plain size at twice the speed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np
import xxhash

from schemas.compression import decompress_frame


def encode_rows(hwc: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Row-delta code an (h, w, 3) uint8 image: byte minus its left neighbour's, mod 256
    (into ``out``, an (h, w, 3) uint8 array, when given)."""
    out = np.empty(hwc.shape, np.uint8) if out is None else out
    out[:, :1] = hwc[:, :1]
    np.subtract(hwc[:, 1:], hwc[:, :-1], out=out[:, 1:], dtype=np.uint8, casting="unsafe")
    return out


def decode_rows(coded: np.ndarray) -> np.ndarray:
    """Inverse of ``encode_rows`` (a running sum along each row, mod 256)."""
    return np.cumsum(coded, axis=1, dtype=np.uint8)


def image_digest(coded: np.ndarray) -> int:
    """XXH3-64 of an image's row-delta coded bytes: what its frame decompresses to, what a pixel
    index checks reused pixels against, and the image's part of the record digest."""
    return xxhash.xxh3_64_intdigest(np.ascontiguousarray(coded).data)


def image_digests(pixels: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """``image_digest`` of every image of a coded pixel table (uint64, one per image)."""
    bounds = np.asarray(offsets, np.int64).tolist()
    return np.fromiter((image_digest(pixels[a:b]) for a, b in zip(bounds[:-1], bounds[1:])), np.uint64,
                       count=max(len(bounds) - 1, 0))


@dataclass(frozen=True)
class StoredImage:
    """An image as an earlier pack's table stored it, checked: its row-delta coded pixels
    (``coded``), or its compressed frame alone (``frame``, of ``frame_format``) when the writer at hand
    makes frames of that same format and so passes it through without decompressing it.
    ``digest`` is ``image_digest`` of the coded pixels (known from the pixel index)."""

    width: int
    height: int
    digest: int
    coded: "np.ndarray | None" = None  # (height, width, 3) uint8
    frame: "bytes | None" = None
    frame_format: str = "none"

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.height, self.width, 3)

    @property
    def size(self) -> int:
        return self.height * self.width * 3

    def coded_pixels(self) -> np.ndarray:
        """The coded (flat uint8) pixels, decompressed from the frame if that is all there is."""
        if self.coded is not None:
            return self.coded.reshape(-1)
        return np.frombuffer(decompress_frame(self.frame_format, self.frame, self.size), np.uint8)


class CodesItself(Protocol):
    """An image that writes itself into its table slot, row-delta coded (``SampleImage``: resized
    then, by the C kernel already coded, so no plain pixels are made and nothing codes them again),
    or hands back the earlier table's ``StoredImage`` it is instead (the slot then left to the table)."""

    @property
    def shape(self) -> tuple[int, int, int]: ...

    def code_into(self, out: np.ndarray) -> "StoredImage | None": ...


def image_table(images: "list[np.ndarray | StoredImage | CodesItself]",
                alloc: Callable[[int], np.ndarray] | None = None) -> dict[str, "np.ndarray | list"]:
    """The PackedBatch image-table fields for (h, w, 3) uint8 images, resized (coded here),
    ``StoredImage`` entries (coded pixels copied as they are; a frame leaves its slot unwritten and is
    listed in ``image_stored``, see ``PackedBatch``) or images that code themselves into their slot
    (``CodesItself``), each in turn, after the table is allocated.

    ``alloc(n)`` gives the uint8 array of n bytes the table is coded into (default: a new one).
    """
    shapes = [tuple(im.shape) for im in images]
    offsets = np.zeros(len(images) + 1, np.int64)
    if images:
        np.cumsum([h * w * c for h, w, c in shapes], out=offsets[1:])
    size = int(offsets[-1])
    pixels = np.empty(size, np.uint8) if alloc is None else alloc(size)  # coded straight into place
    stored: list = []
    for im, shape, a, b in zip(images, shapes, offsets[:-1], offsets[1:]):
        slot = pixels[a:b].reshape(shape)
        if isinstance(im, np.ndarray):
            encode_rows(im, out=slot)
            stored.append(None)
            continue
        got = im if isinstance(im, StoredImage) else im.code_into(slot)
        if got is not None:
            if got.shape != shape:
                raise ValueError(f"a stored image of shape {got.shape} for a slot of shape {shape}")
            if got.frame is None:
                pixels[a:b] = got.coded.reshape(-1)
        stored.append(got)
    return {
        "image_heights": np.asarray([s[0] for s in shapes], np.int32),
        "image_widths": np.asarray([s[1] for s in shapes], np.int32),
        "image_offsets": offsets,
        "image_pixels": pixels,
        "image_stored": stored,
    }
