"""One source sample before packing: its sequence plan, token ids and (lazily resized) images.

A sample is what the reference's per-dataset iterators yield, in our own types.  Images keep the
source picture (``prepack.engine.reuse.source_pictures.Picture``, or a decoded video frame) and their target
size; the bicubic resize runs only when the sample is actually packed (or checkpointed), and once
per (picture, size) even when the plan uses the same picture twice (an edit frame that is both a
VAE target and a VAE condition).  The packed table takes each image through ``code_into``:
resized straight into its slot, row-delta coded as it is made.  An image remembers its picture's
identity (``source``) after the resize, for the shard's pixel index.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image

from prepack.engine.reuse.source_pictures import Picture
from prepack.engine.resize import resize_coded, resize_pixels
from schemas.config import TransformArgs
from schemas.pixel_index import PictureSource
from schemas.pixel_table import StoredImage, decode_rows, encode_rows
from schemas.packed_batch import SampleOrigin


@dataclass
class PlanItem:
    """One split of a sequence plan (reference ``sequence_plan`` entry)."""

    kind: str  # "text" | "vit_image" | "vae_image"
    enable_cfg: int
    loss: int
    special_token_loss: int = 0
    special_token_label: int | None = None
    split_start: bool = True
    split_end: bool = True
    frame_delta: int | None = None
    video_frame: bool = False  # a ViT image that is one of an SFT video's frames (counted per sample)


class SampleImage:
    """A decoded picture bound to a resize target and a normalisation; pixels made on demand."""

    __slots__ = ("picture", "width", "height", "norm", "source", "_pixels")

    def __init__(self, picture: "Picture | Image.Image | None", width: int, height: int, norm: tuple[float, ...],
                 pixels: np.ndarray | None = None, source: PictureSource | None = None):
        self.picture = picture
        self.width = width
        self.height = height
        self.norm = norm  # mean rgb + std rgb
        self.source = picture.source if isinstance(picture, Picture) else source  # None: no key (video frames)
        self._pixels: "np.ndarray | StoredImage | None" = pixels
        if pixels is None and isinstance(picture, Picture):
            picture.will_resize(width, height)

    @classmethod
    def from_transform(cls, picture: "Picture | Image.Image", target: tuple[int, int], args: TransformArgs) -> "SampleImage":
        return cls(picture, target[0], target[1], tuple(args.image_mean) + tuple(args.image_std))

    @property
    def shape(self) -> tuple[int, int, int]:
        """(height, width, 3): the image's shape in the pixel table."""
        return (self.height, self.width, 3)

    def code_into(self, out: np.ndarray) -> "StoredImage | None":
        """Put this image into its pixel-table slot ``out`` ((h, w, 3) uint8), row-delta coded
        (``schemas.pixel_table.CodesItself``): resized now straight into it (the C kernel codes as
        it resizes: no plain pixels are made), coded from pixels made earlier (``pixels()``), or
        None written and an earlier table's ``StoredImage`` returned for the table to take.

        A picture resized here keeps its decoded image, not its pixels (the slot is the packer's
        table buffer, rewritten by the next batch): a later ``pixels()`` resizes it again."""
        if self._pixels is not None:
            if isinstance(self._pixels, StoredImage):
                return self._pixels
            encode_rows(self._pixels, out=out)
            return None
        picture = self.picture
        if isinstance(picture, Picture):
            got = picture.earlier(self.width, self.height)
            if got is not None:
                self._pixels, self.picture = got, None
                return got
            picture = picture.image()
        resize_coded(picture, self.width, self.height, out)
        self.picture = picture  # the decoded image only: a resize of it asks no provider and counts nothing
        return None

    def table_pixels(self) -> "np.ndarray | StoredImage":
        """What goes into the record's pixel table: the resized (h, w, 3) uint8 pixels, or an earlier
        table's (``StoredImage``: coded pixels, or a frame to pass through); computed once, the
        picture then released."""
        if self._pixels is None:
            if isinstance(self.picture, Picture):
                self._pixels = self.picture.resized(self.width, self.height)
            else:
                self._pixels = resize_pixels(self.picture, self.width, self.height)
            self.picture = None
        return self._pixels

    def pixels(self) -> np.ndarray:
        """(h, w, 3) uint8 after the NaViT resize."""
        table = self.table_pixels()
        if isinstance(table, StoredImage):
            return decode_rows(table.coded_pixels().reshape(table.shape))
        return table


@dataclass
class Sample:
    plan: list[PlanItem]
    texts: list[list[int]]  # one per text plan item, in order
    images: list[SampleImage]  # one per image plan item, in order (extra unused ones allowed)
    num_tokens: int  # the reference's estimate (before BOS/EOS/markers)
    origin: SampleOrigin

    @property
    def packed_len_estimate(self) -> int:
        """The length the packer budgets for: num_tokens + 2 per plan item (reference rule)."""
        return self.num_tokens + 2 * len(self.plan)
