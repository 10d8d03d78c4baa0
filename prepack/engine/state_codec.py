"""StreamState <-> checkpoint payload (JSON + pixel bytes; format in ``schemas.checkpoint``).

Buffered samples are saved with their resized pixels.  A picture used twice in one sample (an edit
frame that is a VAE target and a VAE condition) stays one object after a restore, so a resumed
stream dedupes images exactly as an uninterrupted one and writes the same bytes.
"""

from __future__ import annotations

from dataclasses import asdict

from prepack.engine.accounting import Counters
from prepack.engine.packer import StreamState
from prepack.engine.sample import PlanItem, Sample, SampleImage
from schemas.checkpoint import (
    CHECKPOINT_VERSION,
    BufferedImage,
    BufferedSample,
    CheckpointDoc,
    decode_pixels,
    encode_pixels,
)
from schemas.pixel_index import DecodeFacts, PictureSource
from schemas.packed_batch import SampleOrigin


def _source_json(source: PictureSource | None) -> dict | None:
    if source is None:
        return None
    f = source.facts
    return {"content": source.content.hex(), "decode": source.decode, "width": f.width, "height": f.height,
            "damage": list(f.damage)}


def _source_from_json(d: dict | None) -> PictureSource | None:
    if d is None:
        return None
    return PictureSource(bytes.fromhex(d["content"]), str(d["decode"]),
                         DecodeFacts(int(d["width"]), int(d["height"]), tuple(map(str, d["damage"]))))


def state_to_payload(state: StreamState) -> tuple[CheckpointDoc, bytes]:
    """The checkpoint document and its pixel file bytes."""
    pixels = []
    buffer = []
    for sample in state.buffer:
        index: dict[int, int] = {}
        images = []
        for img in sample.images:
            if id(img) not in index:
                index[id(img)] = len(pixels)
                pixels.append(img.pixels())
            images.append(BufferedImage(index[id(img)], [float(x) for x in img.norm], _source_json(img.source)))
        buffer.append(BufferedSample(
            plan=[asdict(p) for p in sample.plan],
            texts=[list(map(int, t)) for t in sample.texts],
            images=images,
            num_tokens=int(sample.num_tokens),
            origin=asdict(sample.origin),
        ))
    doc = CheckpointDoc(
        version=CHECKPOINT_VERSION, stream=state.stream, batches=state.batches, tokens=state.tokens,
        py_rng=state.py_rng, np_rng=state.np_rng, sources=state.sources, buffer=buffer,
        counters=state.counters.to_json(), refused_in_row=state.refused_in_row,
    )
    return doc, encode_pixels(pixels)


def state_from_payload(doc: CheckpointDoc, pixel_bytes: bytes) -> StreamState:
    if doc.version != CHECKPOINT_VERSION:
        raise ValueError(f"unsupported checkpoint version {doc.version!r}")
    pixels = decode_pixels(pixel_bytes)
    buffer = []
    for s in doc.buffer:
        shared: dict[int, SampleImage] = {}
        images = []
        for im in s.images:
            if im.pixels not in shared:
                arr = pixels[im.pixels]
                shared[im.pixels] = SampleImage(None, arr.shape[1], arr.shape[0], tuple(im.norm), pixels=arr,
                                                source=_source_from_json(im.source))
            images.append(shared[im.pixels])
        buffer.append(Sample(
            plan=[PlanItem(**p) for p in s.plan],
            texts=s.texts,
            images=images,
            num_tokens=s.num_tokens,
            origin=SampleOrigin(**s.origin),
        ))
    return StreamState(
        stream=doc.stream, batches=doc.batches, tokens=doc.tokens, py_rng=doc.py_rng, np_rng=doc.np_rng,
        sources=doc.sources, buffer=buffer, counters=Counters.from_json(doc.counters),
        refused_in_row=doc.refused_in_row,
    )


def detached(state: StreamState) -> StreamState:
    """The state as a checkpoint holds it: its buffered pictures resized now, while the packer that
    made it still has its sources open (a packer that goes on from it reads none of them)."""
    doc, arrow = state_to_payload(state)
    return state_from_payload(doc, arrow)
