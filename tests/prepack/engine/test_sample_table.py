"""Images coded straight into the pixel table (``SampleImage.code_into``): the same table as coding
Pillow's resize, whichever way each image comes (a decoded picture, a video frame, a checkpoint's
pixels, an earlier table's coded pixels or frame), through the C kernel's fused coding and through
the Python coding of the other resizers; one resize counted per image, and ``pixels()`` right
after."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from prepack.engine.decode import ImagePolicy
from prepack.engine.reuse.source_pictures import PictureStore, ReuseCounts
from prepack.engine.resize import PINNED_PILLOW, pillow_resize, router
from prepack.engine.resize.router import Resizer
from prepack.engine.sample import SampleImage
from schemas.pixel_table import StoredImage, encode_rows, image_digest, image_table
from tests.helpers import datagen as dg

NORM = (0.5,) * 6


class _Provider:
    """Earlier pixels for some targets: coded pixels or a (fake) frame, by (width, height)."""

    def __init__(self, stored: dict[tuple[int, int], StoredImage]):
        self.counts = ReuseCounts()
        self.stored = stored

    def facts(self, key):
        return None  # every picture is decoded

    def fetch(self, source, width, height):
        return self.stored.get((width, height))

    def prefetch(self, source, width, height):
        pass


def _resizers() -> dict[str, Resizer]:
    out = {"pillow": Resizer(None, "test")}
    if Image.__version__ == PINNED_PILLOW:
        try:
            out["native"] = Resizer(router.native_kernel(), "test", "native")  # codes as it resizes
        except Exception as exc:  # no compiler here: the Python coding is still checked
            print(f"no C kernel: {exc}")
        out["plain kernel"] = Resizer(pillow_resize, "test", "plain")  # a kernel without ``coded``
    return out


@pytest.fixture(params=sorted(_resizers()))
def resizer(request, monkeypatch) -> Resizer:
    chosen = _resizers()[request.param]
    monkeypatch.setattr(router, "default_resizer", lambda: chosen)
    return chosen


def _photo(i: int, w: int, h: int) -> Image.Image:
    return dg.photo(i, np.random.RandomState(i), min(w, h), max(w, h) + 1).resize((w, h))


def test_every_kind_of_image_codes_into_the_table_as_encode_rows_of_pillow(resizer):
    jpegs = [dg.jpeg(_photo(i, w, h)) for i, (w, h) in enumerate([(300, 200), (180, 260), (97, 61)])]
    earlier_img = _photo(7, 120, 90)
    earlier = encode_rows(pillow_resize(earlier_img, 64, 48))
    stored = StoredImage(64, 48, image_digest(earlier), coded=earlier)
    frame = StoredImage(40, 32, 123, frame=b"a frame", frame_format="zstd:1")
    provider = _Provider({(64, 48): stored, (40, 32): frame})
    store = PictureStore(ImagePolicy(10**9), lambda kind: None, provider)
    pictures = [store.rgb(data) for data in jpegs]
    decoded = [p.image() for p in pictures]
    video_frame = _photo(9, 150, 100)
    restored = pillow_resize(_photo(11, 90, 90), 30, 30)  # a checkpoint's pixels
    images = [SampleImage(pictures[0], 160, 112, NORM), SampleImage(pictures[1], 98, 140, NORM),
              SampleImage(pictures[2], 33, 71, NORM),  # up in y, down in x
              SampleImage(pictures[0], 300, 200, NORM),  # its own size: a copy, coded
              SampleImage(pictures[1], 64, 48, NORM),  # earlier coded pixels
              SampleImage(pictures[2], 40, 32, NORM),  # an earlier frame, passed through
              SampleImage(video_frame, 75, 50, NORM), SampleImage(None, 30, 30, NORM, pixels=restored)]
    want = [pillow_resize(decoded[0], 160, 112), pillow_resize(decoded[1], 98, 140), pillow_resize(decoded[2], 33, 71),
            pillow_resize(decoded[0], 300, 200), stored, frame, pillow_resize(video_frame, 75, 50), restored]
    garbage = np.full(sum(int(np.prod(im.shape)) for im in images), 0xA5, np.uint8)  # a reused buffer's old bytes
    got = image_table(images, alloc=lambda n: garbage[:n])
    expected = image_table(want)
    assert got["image_pixels"] is not None and np.shares_memory(got["image_pixels"], garbage)
    for name in ("image_heights", "image_widths", "image_offsets"):
        np.testing.assert_array_equal(got[name], expected[name])
    a, b = int(got["image_offsets"][5]), int(got["image_offsets"][6])
    keep = np.ones(len(garbage), bool)
    keep[a:b] = False  # the frame's slot is left unwritten, in both
    np.testing.assert_array_equal(got["image_pixels"][keep], expected["image_pixels"][keep])
    assert got["image_stored"] == [None, None, None, None, stored, frame, None, None] == expected["image_stored"]
    assert provider.counts.images == 6 and provider.counts.reused == 2 and provider.counts.frames_passed == 1
    # pixels() after the table: the decoded view, with no second fetch or count
    for image, w in zip(images, want):
        plain = w if isinstance(w, np.ndarray) else pillow_resize(earlier_img, 64, 48) if w is stored else None
        if plain is not None:
            np.testing.assert_array_equal(image.pixels(), plain)
    assert provider.counts.images == 6


def test_pixels_made_first_are_coded_once_into_the_table(resizer):
    img = _photo(3, 211, 157)
    image = SampleImage(img, 98, 73, NORM)
    before = image.pixels()  # a checkpoint before the batch: made and kept
    np.testing.assert_array_equal(before, pillow_resize(img, 98, 73))
    got = image_table([image])
    np.testing.assert_array_equal(got["image_pixels"], encode_rows(before).reshape(-1))


def test_a_stored_image_of_another_shape_is_refused():
    class Wrong:
        shape = (4, 4, 3)

        def code_into(self, out):
            return StoredImage(5, 4, 0, coded=np.zeros((4, 5, 3), np.uint8))

    with pytest.raises(ValueError, match="shape"):
        image_table([Wrong()])
