"""``prepack latents``: encode every committed shard's VAE canvases once, beside the shard (issue 51).

A stream at a time, a shard at a time: read the shard's records (every digest checked), run the
training's own encoder on each record's padded canvas (``prepack.run.latents.vae_encoder``), write
``shard-k.latents.arrow`` (``schemas.latents``) atomically, then the stream's ``latents.json``
with the file's size and digest: that listing is the commit marker, so a killed stage resumes
after the last listed shard and writes the same bytes again (the encoder is deterministic on one
device kind).  Shards trimmed behind training are skipped (``prepack restore`` packs a shard again,
and this stage encodes it again).  ``follow``: wait for shards still being packed until each
stream is done, so the stage runs beside ``prepack run``.

Where it runs: on Ray (``init_ray``: local by default, a cluster under ``ray job submit``), one
encoder actor per GPU the cluster has (each takes streams until none is left; a node lost takes
its stream back to the queue), or in this process (``inline``, and on a machine without GPUs
when ``--device cpu``): the same bytes either way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from loader.reader import Pack, read_shard
from prepack.run.latents.vae_encoder import VaeEncoder, weights_digest
from prepack.run.ray_init import init_ray
from prepack.run.commit.atomic_files import write_bytes_atomic, write_json_atomic
from schemas.documents import read_document
from schemas.errors import DamagedFile, UsageError
from schemas.latents import ShardLatents, StreamLatents, encode_latents, file_digest
from schemas.layout import shard_latents_file, stream_latents_file
from schemas.location import PackLocation
from schemas.manifest import ShardEntry
from schemas.record import record_to_batch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LatentsOptions:
    """What ``prepack latents`` was asked: the encoder and where to run it."""

    weights: str  # the VAE's ae.safetensors
    stack: str = "nemo"  # prepack.run.latents.vae_encoder.ENCODERS
    device: str = "auto"  # auto: cuda when there is one, else cpu
    streams: "tuple[int, ...] | None" = None
    follow: bool = False
    poll_s: float = 2.0
    inline: bool = False  # in this process, without Ray
    bar: bool = True


def read_listing(loc: PackLocation, stream: int) -> "StreamLatents | None":
    """A stream's ``latents.json``, or None before its first shard's latents."""
    return read_document(loc, stream_latents_file(stream), lambda data, where: StreamLatents.from_json(data, where))


def encode_shard(pack: Pack, shard: ShardEntry, encoder: VaeEncoder) -> tuple[bytes, ShardLatents]:
    """One shard's latents file and its listing entry."""
    per_record, digests = [], []
    for index, record in read_shard(pack, shard):
        per_record.append(encoder.record_moments(record_to_batch(record)))
        digests.append(shard.records[index - shard.first_record].digest)
    data = encode_latents(per_record, encoder.info, shard.xxh3, digests)
    entry = ShardLatents(shard=shard.shard, size=len(data), digest=file_digest(data), records=len(per_record),
                         images=sum(len(m) for m in per_record), device=encoder.info.device, dtype=encoder.info.dtype)
    return data, entry


def _check_listing(listing: StreamLatents, encoder: VaeEncoder, where: str) -> None:
    if (listing.encoder, listing.weights) != (encoder.info.encoder, encoder.info.weights):
        raise UsageError(f"{where}: its latents were made by {listing.encoder} with weights {listing.weights}, "
                         f"not {encoder.info.encoder} with {encoder.info.weights}: remove the stream's latents "
                         "files to encode them again")


def stream_latents(pack: Pack, stream: int, encoder: VaeEncoder, options: LatentsOptions,
                   on_shard: "Callable[[ShardLatents], None] | None" = None) -> int:
    """Encode every committed shard of ``stream`` not listed yet (with ``follow``: until the stream is
    done); returns the shards written."""
    loc = pack.location
    where = loc.path(stream_latents_file(stream))
    listing = read_listing(loc, stream)
    if listing is None:
        listing = StreamLatents(stream, encoder.info.encoder, encoder.info.weights)
    _check_listing(listing, encoder, where)
    written = 0
    while True:
        done = pack.done(stream) is not None
        index = pack.index(stream, refresh=True)
        trimmed = pack.trimmed(stream)
        for shard in index.shards:
            if listing.get(shard.shard) is not None or shard.shard in trimmed:
                continue
            t0 = time.perf_counter()
            data, entry = encode_shard(pack, shard, encoder)
            write_bytes_atomic(loc, shard_latents_file(stream, shard.shard), data)
            listing = listing.with_shard(entry)
            write_json_atomic(loc, stream_latents_file(stream), listing)  # the commit marker
            written += 1
            log.debug("stream %d shard %d: %d images of %d records in %.1f s", stream, shard.shard, entry.images,
                      entry.records, time.perf_counter() - t0)
            if on_shard is not None:
                on_shard(entry)
        if done or not options.follow:
            return written
        time.sleep(options.poll_s)
        pack.forget(stream)


def resolve_device(device: str) -> str:
    """``auto``: the first CUDA device torch sees, else the CPU."""
    if device != "auto":
        return device
    import torch  # noqa: PLC0415 (the stage's own dependency, resolved when it runs)

    return "cuda" if torch.cuda.is_available() else "cpu"


class LatentsWorker:
    """One encoder (on one GPU, or the CPU) taking whole streams: a Ray actor, or this process's."""

    def __init__(self, out: str, options: LatentsOptions, device: str):
        self.pack = Pack.open(out)
        self.options = options
        self.encoder = VaeEncoder.load(options.stack, options.weights, device)

    def run_stream(self, stream: int) -> tuple[int, str]:
        return stream_latents(self.pack, stream, self.encoder, self.options), self.encoder.info.device


def _bar(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm  # noqa: PLC0415 (the progress bar only when shown)

    return tqdm(total=total, unit="shard", desc="latents", dynamic_ncols=True)


def _todo(pack: Pack, streams: "list[int]") -> int:
    """Shards committed and not yet encoded (what the bar starts from)."""
    n = 0
    for s in streams:
        listing, trimmed = read_listing(pack.location, s), pack.trimmed(s)
        n += sum(1 for sh in pack.index(s).shards
                 if sh.shard not in trimmed and (listing is None or listing.get(sh.shard) is None))
        pack.forget(s)
    return n


def run_latents(out: str, options: LatentsOptions) -> dict[int, int]:
    """Encode the latents of every stream asked (all by default): shards written per stream."""
    pack = Pack.open(out)
    streams = list(options.streams) if options.streams is not None else list(range(pack.num_streams))
    for s in streams:
        pack.check_stream(s)
    bar = _bar(_todo(pack, streams), options.bar)
    written: dict[int, int] = {}
    try:
        if options.inline:
            worker = LatentsWorker(out, options, resolve_device(options.device))
            for s in streams:
                written[s], device = worker.run_stream(s)
                if bar is not None:
                    bar.update(written[s])
                    bar.set_postfix_str(f"stream {s} on {device}")
        else:
            written = _on_ray(out, options, streams, bar)
    finally:
        if bar is not None:
            bar.close()
    log.info("latents: %d shard(s) of %d stream(s) encoded", sum(written.values()), len(streams))
    return written


def _on_ray(out: str, options: LatentsOptions, streams: "list[int]", bar) -> dict[int, int]:
    """One encoder actor per GPU of the cluster (or per CPU worker with ``--device cpu``), each taking
    the next stream; a stream whose actor died goes back to the queue, on a new actor."""
    ray = init_ray(None)
    gpus = int(ray.cluster_resources().get("GPU", 0))
    device = options.device if options.device != "auto" else ("cuda" if gpus else "cpu")
    if device.startswith("cuda") and not gpus:
        raise UsageError("--device cuda: the Ray cluster has no GPU")
    actors_n = gpus if device.startswith("cuda") else 1
    actor = ray.remote(num_gpus=1 if device.startswith("cuda") else 0, num_cpus=1, max_restarts=0)(LatentsWorker)
    queue, running, written = list(streams), {}, {}
    idle = [actor.remote(out, options, device) for _ in range(min(actors_n, len(streams)))]
    while queue or running:
        while queue and idle:
            a = idle.pop()
            s = queue.pop(0)
            running[a.run_stream.remote(s)] = (a, s)
        ready, _ = ray.wait(list(running), num_returns=1)
        a, s = running.pop(ready[0])
        try:
            written[s], where = ray.get(ready[0])
        except ray.exceptions.RayActorError as e:  # its node went away: the stream again, on a new actor
            log.warning("latents: the encoder of stream %d was lost (%s); encoding it again", s, e)
            queue.insert(0, s)
            idle.append(actor.remote(out, options, device))
            continue
        idle.append(a)
        if bar is not None:
            bar.update(written[s])
            bar.set_postfix_str(f"stream {s} on {where}")
    return written


@dataclass(frozen=True)
class LatentsRestore:
    """Encoding a restored shard's latents again (``prepack restore --vae``): the same encoder,
    weights and device kind as the listing recorded, or a one-line reason before any work."""

    weights: "str | None"
    stack: str = "nemo"

    def why_not(self, pack: Pack, stream: int, shard: int) -> "str | None":
        """Why ``shard``'s latents could not be made again here (None: they can, or it has none)."""
        listing = read_listing(pack.location, stream)
        entry = listing.get(shard) if listing is not None else None
        if entry is None:
            return None
        if self.weights is None:
            return "it had VAE latents: give --vae, the weights they were encoded with"
        if weights_digest(self.weights) != listing.weights:
            return f"--vae {self.weights} is not the weights its latents were encoded with ({listing.weights})"
        here = _device_for(entry.device)
        if here is None:
            return f"its latents were encoded on {entry.device}, which this machine does not have"
        return None

    def encode(self, pack: Pack, stream: int, shard: ShardEntry) -> None:
        """Encode ``shard``'s latents again, on the device kind they were made on; writes the file only
        when it is byte for byte the one the listing recorded."""
        listing = read_listing(pack.location, stream)
        entry = listing.get(shard.shard) if listing is not None else None
        if entry is None:
            return
        encoder = VaeEncoder.load(self.stack, self.weights, _device_for(entry.device))
        data, again = encode_shard(pack, shard, encoder)
        name = shard_latents_file(stream, shard.shard)
        if (again.size, again.digest) != (entry.size, entry.digest):
            raise DamagedFile(f"{pack.location.path(name)}: encoded again, its latents differ from the ones recorded "
                              "(another encoder version or device); not written")
        write_bytes_atomic(pack.location, name, data)


def _device_for(recorded: str) -> "str | None":
    """A device of this machine of the kind ``recorded`` names ("cpu", or a CUDA device's name)."""
    if recorded == "cpu":
        return "cpu"
    import torch  # noqa: PLC0415 (the stage's own dependency)

    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        if torch.cuda.get_device_name(i) == recorded:
            return f"cuda:{i}"
    return None
