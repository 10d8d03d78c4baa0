"""Reuse: pictures taken from earlier packs (or a stream's own earlier shards) instead of decoded again.

``source_pictures`` keys each source picture by content and decodes it only when needed;
``earlier_pixels`` finds a keyed picture's resized pixels in earlier shards and checks them;
``earlier_packs`` reads an earlier pack's committed shards and pixel catalog for it.
"""
