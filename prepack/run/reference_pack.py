"""A balanced-samples pack's reference: whether a pack has one, and where it is.

One home for what the balancing (``prepack.run.sample_balance``), the bounded pack's restore check
(``prepack.run.bounded.restorable``) and the tools (verify, audit) all ask of such a pack, so that
none of them imports another for it.
"""

from __future__ import annotations

from loader.reader import Pack
from schemas.layout import REFERENCE_DIR
from schemas.location import PackLocation


def balances_samples(pack: Pack) -> bool:
    """Whether ``pack`` is a balanced-samples pack (its streams re-split from ``OUT/reference``)."""
    return pack.info.stored_config().prepack.balance == "samples"


def open_reference(pack: Pack) -> Pack:
    """The reference pack inside a balanced-samples pack."""
    loc = pack.location
    return Pack.open(PackLocation(loc.fs, loc.path(REFERENCE_DIR)))
