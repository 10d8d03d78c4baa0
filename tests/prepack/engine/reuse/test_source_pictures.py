"""Pictures whose decode facts come from an earlier pack count and drop exactly as a fresh decode.

Every kind of damaged-but-decodable input, in default and strict mode and under a lower pixel
limit: the warnings and the Rejected reason (and detail) of ``PictureStore`` with known facts are
those of a decode, and a known picture is not decoded until a target misses.
"""

from __future__ import annotations

import numpy as np
import pytest

from prepack.engine.accounting import Rejected
from prepack.engine.decode import ImagePolicy, decode_observed, decode_rgb
from prepack.engine.reuse.source_pictures import PictureStore
from prepack.engine.resize import pillow_resize
from schemas.pixel_index import DecodeFacts, PictureSource
from tests.helpers import badgen as bg
from tests.helpers import datagen as dg


class _Known:
    """A provider that knows every picture's facts (as recorded by a decode) and no pixels."""

    def __init__(self):
        from prepack.engine.reuse.source_pictures import ReuseCounts

        self.counts = ReuseCounts()
        self.table: dict = {}
        self.fetched = 0

    def facts(self, key):
        return self.table.get(key)

    def fetch(self, source, width, height):
        self.fetched += 1
        return None


def _outcome(fn):
    warned: list[str] = []
    try:
        fn(warned.append)
    except Rejected as r:
        return warned, (r.reason, r.detail)
    return warned, None


INPUTS = {
    "good": lambda rs: dg.jpeg(dg.photo(0, rs)),
    "truncated": bg.truncated_jpeg, "png16": bg.png16, "grey_alpha": bg.grey_alpha_png,
    "palette_alpha": bg.palette_alpha_png, "cmyk": bg.cmyk_jpeg, "animated": bg.animated_gif, "rgba": bg.rgba_png,
}


@pytest.mark.parametrize("kind", sorted(INPUTS))
@pytest.mark.parametrize("policy", [ImagePolicy(400_000_000), ImagePolicy(400_000_000, strict=True), ImagePolicy(64)],
                         ids=["default", "strict", "small-limit"])
def test_known_facts_count_and_drop_as_a_decode(kind, policy):
    data = INPUTS[kind](np.random.RandomState(3))
    fresh = _outcome(lambda warn: decode_rgb(data, policy, warn))
    provider = _Known()
    _, facts = decode_observed(data, ImagePolicy(400_000_000))  # what an earlier, lenient pack recorded
    from schemas.pixel_index import content_key

    provider.table[(content_key(data), "rgb")] = facts
    reused = _outcome(lambda warn: PictureStore(policy, warn, provider).rgb(data))
    assert reused == fresh


def test_a_known_picture_is_decoded_only_when_a_target_misses():
    rs = np.random.RandomState(0)
    data = dg.jpeg(dg.photo(1, rs))
    provider = _Known()
    img, facts = decode_observed(data, ImagePolicy(10**9))
    from schemas.pixel_index import content_key

    provider.table[(content_key(data), "rgb")] = facts
    store = PictureStore(ImagePolicy(10**9), lambda k: None, provider)
    pic = store.rgb(data)
    assert pic._image is None and pic.size == img.size and store.counts.decodes_saved == 1
    out = pic.resized(40, 30)  # the provider has no pixels: decoded now, resized as Pillow does
    assert isinstance(out, np.ndarray)
    np.testing.assert_array_equal(out, pillow_resize(img.convert("RGB"), 40, 30))
    assert provider.fetched == 1 and store.counts.decodes_saved == 0 and store.counts.reused == 0


def test_a_picture_whose_bytes_decode_otherwise_than_its_facts_is_a_bug_not_a_silent_byte():
    data = dg.jpeg(dg.photo(2, np.random.RandomState(0)))
    store = PictureStore(ImagePolicy(10**9), lambda k: None)
    wrong = PictureSource(b"\0" * 16, "rgb", DecodeFacts(7, 7))
    with pytest.raises(RuntimeError, match="decoded as"):
        store.decode_again(wrong, data)
