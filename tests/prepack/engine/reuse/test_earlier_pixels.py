"""``prepack.engine.reuse.earlier_pixels.PixelReuse`` on its own: what it refuses to replay."""

from __future__ import annotations

import numpy as np

from prepack.engine.decode import ImagePolicy, decode_observed
from prepack.engine.reuse.source_pictures import PictureStore
from prepack.engine.reuse.earlier_pixels import PixelReuse, _Where
from schemas.pixel_index import DecodeFacts, content_key
from tests.helpers import datagen as dg


def test_a_damage_kind_this_code_does_not_declare_means_decoding_not_a_failed_run():
    """An index of another version may name a damage kind this code has no rule for: the picture is
    decoded (its damage learnt under this code's rules), counted, and nothing raises."""
    data = dg.jpeg(dg.photo(0, np.random.RandomState(1)))
    _, facts = decode_observed(data, ImagePolicy(10**9))
    reuse = PixelReuse()
    key = content_key(data)
    reuse._add(key, "rgb", DecodeFacts(facts.width, facts.height, ("a_kind_from_the_future",)), 8, 8,
               _Where(0, 0, 1, 192, "none", 0, 0))
    assert reuse.facts((key, "rgb")) is None
    assert reuse.counts.fallbacks == {"pixel_index_unknown_damage": 1}
    warned = []
    picture = PictureStore(ImagePolicy(10**9), warned.append, reuse).rgb(data)
    assert picture._image is not None and picture.size == (facts.width, facts.height) and not warned
    assert reuse.counts.decodes_saved == 0


def test_declared_damage_is_replayed():
    data = dg.jpeg(dg.photo(1, np.random.RandomState(2)))
    reuse = PixelReuse()
    known = DecodeFacts(10, 20, ("truncated_image",))
    reuse._add(content_key(data), "rgb", known, 8, 8, _Where(0, 0, 1, 192, "none", 0, 0))
    assert reuse.facts((content_key(data), "rgb")) == known and not reuse.counts.fallbacks
