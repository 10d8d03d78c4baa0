"""Synthetic packed batches and complete fake pack directories, for tests.

``make_batch`` lays samples out the way the reference's ``pack_sequence`` does (BOS/EOS around
text, start/end markers around ViT patches and VAE latents, one rope id per image, causal text
splits, full ViT/condition splits, noise VAE-target splits, timesteps per latent slot, loss
indexes and weights) from random content: images of several sizes divisible by the patch
sizes, several normalisations.  ``write_pack`` writes batches with ``prepack.run.commit.writer`` into the
real output layout (pack.json, shards, stream indexes, done.json), so loader tests read what a
real pack run would leave.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np
import pytest

from prepack.run.commit.atomic_files import write_bytes_atomic
from prepack.run.commit.writer import ShardFormat, StreamWriter, write_index
from schemas.documents import dump_checked
from schemas.layout import PACK_INFO_NAME, done_file
from schemas.location import resolve_location
from schemas.manifest import StreamIndex, StreamSummary
from schemas.pack_info import FORMAT_VERSION
from schemas.pixel_table import image_table
from schemas.packed_batch import ATTN_MODE_CODES, PackedBatch, SampleOrigin
from schemas.record import RECORD_SCHEMA_VERSION

NORMS = [
    ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
    ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),  # ImageNet
    ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)),  # CLIP
]
VIT_PATCH = 14
VAE_DOWNSAMPLE = 16
MAX_PATCHES_PER_SIDE = 70
MAX_LATENT_SIZE = 64
BOS, EOS, SOI, EOI = 151644, 151645, 151652, 151653


@dataclass
class BatchSpec:
    """Which kinds of content a synthetic batch may contain."""

    use_flex: bool = True
    n_samples: int | None = None  # None: 1..3
    vit: bool = True
    vae: bool = True
    vae_targets: bool = True  # False: every VAE image is a condition (no mse indexes)
    labels: bool = True  # False: no text loss, no special-token loss
    max_side: int = 4  # images are up to max_side patches per side


class _Builder:
    def __init__(self, rng: np.random.Generator, spec: BatchSpec):
        self.rng, self.spec = rng, spec
        self.curr = 0
        self.a: dict[str, list] = {k: [] for k in _LIST_FIELDS}
        self.images: list[np.ndarray] = []
        self.norms: list[tuple] = []

    def image(self, stride: int) -> int:
        if (
            self.images
            and self.rng.random() < 0.2
            and self.images[-1].shape[0] % stride == 0
            and self.images[-1].shape[1] % stride == 0
        ):
            return len(self.images) - 1  # the same stored image used again
        h = stride * int(self.rng.integers(1, self.spec.max_side + 1))
        w = stride * int(self.rng.integers(1, self.spec.max_side + 1))
        self.images.append(self.rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8))
        mean, std = NORMS[int(self.rng.integers(len(NORMS)))]
        self.norms.append(mean + std)
        return len(self.images) - 1

    def text(self, rope: int) -> tuple[int, int]:
        ids = self.rng.integers(0, 150000, size=int(self.rng.integers(1, 12))).tolist()
        shifted = [BOS] + ids
        a, curr = self.a, self.curr
        a["packed_text_ids"] += shifted + [EOS]
        a["packed_text_indexes"] += list(range(curr, curr + len(shifted) + 1))
        if self.spec.labels and self.rng.random() < 0.7:
            a["ce_loss_indexes"] += list(range(curr, curr + len(shifted)))
            a["ce_loss_weights"] += [1.0 / math.sqrt(len(shifted))] * len(shifted)
            a["packed_label_ids"] += ids + [EOS]
        if self.spec.labels and self.rng.random() < 0.3:
            self._special_loss(curr + len(shifted))
        n = len(shifted) + 1
        a["packed_position_ids"] += list(range(rope, rope + n))
        self.curr += n
        return n, rope + n

    def _special_loss(self, pos: int) -> None:
        self.a["ce_loss_indexes"].append(pos)
        self.a["ce_loss_weights"].append(1.0)
        self.a["packed_label_ids"].append(EOS)

    def _framed_image(self, scale: int) -> tuple[int, int, int, int]:
        """A new image of ``scale``-divisible size framed by SOI/EOI at the cursor: (image, h, w, n)."""
        i = self.image(scale)
        h, w = self.images[i].shape[0] // scale, self.images[i].shape[1] // scale
        n = h * w
        self.a["packed_text_ids"] += [SOI, EOI]
        self.a["packed_text_indexes"] += [self.curr, self.curr + n + 1]
        return i, h, w, n

    def vit(self, rope: int) -> tuple[int, int]:
        i, h, w, n = self._framed_image(VIT_PATCH)
        a, curr = self.a, self.curr
        a["vit_image_ids"].append(i)
        a["vit_token_seqlens"].append(n)
        a["packed_vit_token_indexes"] += list(range(curr + 1, curr + 1 + n))
        a["packed_vit_position_ids"] += _grid(h, w, MAX_PATCHES_PER_SIDE)
        a["packed_position_ids"] += [rope] * (n + 2)
        self.curr += n + 2
        return n + 2, rope + 1

    def vae(self, rope: int, target: bool) -> tuple[int, int]:
        i, h, w, n = self._framed_image(VAE_DOWNSAMPLE)
        a, curr = self.a, self.curr
        a["vae_image_ids"].append(i)
        a["vae_latent_shapes"] += [h, w]
        a["packed_latent_position_ids"] += _grid(h, w, MAX_LATENT_SIZE)
        a["packed_vae_token_indexes"] += list(range(curr + 1, curr + 1 + n))
        if target:
            a["mse_loss_indexes"] += list(range(curr + 1, curr + 1 + n))
            a["packed_timesteps"] += [float(np.float32(self.rng.standard_normal()))] * n
        else:
            a["packed_timesteps"] += [float("-inf")] * n
        a["packed_position_ids"] += [rope] * (n + 2)
        self.curr += n + 2
        return n + 2, rope if target else rope + 1


_LIST_FIELDS = [
    "packed_text_ids", "packed_text_indexes", "packed_position_ids", "packed_label_ids", "ce_loss_indexes",
    "ce_loss_weights", "vit_image_ids", "vit_token_seqlens", "packed_vit_position_ids", "packed_vit_token_indexes",
    "vae_image_ids", "vae_latent_shapes", "packed_latent_position_ids", "packed_vae_token_indexes",
    "packed_timesteps", "mse_loss_indexes",
]  # fmt: skip


def _grid(h: int, w: int, side: int) -> list[int]:
    return (np.arange(h)[:, None] * side + np.arange(w)).reshape(-1).tolist()


def make_batch(seed: int, spec: BatchSpec | None = None, **overrides) -> PackedBatch:
    """A random but valid PackedBatch; same seed and spec, same batch."""
    spec = spec or BatchSpec()
    for k, v in overrides.items():
        setattr(spec, k, v)
    rng = np.random.default_rng(seed)
    b = _Builder(rng, spec)
    sample_lens, num_splits, split_lens, modes, origins, frames = [], [], [], [], [], []
    kinds = ["text"] + (["vit"] if spec.vit else []) + (["vae"] if spec.vae else [])
    n_samples = spec.n_samples or int(rng.integers(1, 4))
    for s in range(n_samples):
        rope, total, n_split = 0, 0, 0
        plan = ["text"] + [kinds[int(rng.integers(len(kinds)))] for _ in range(int(rng.integers(1, 5)))]
        for kind in plan:
            if kind == "text":
                n, rope = b.text(rope)
                mode = "causal"
            elif kind == "vit":
                n, rope = b.vit(rope)
                mode = "full"
            else:
                target = spec.vae_targets and rng.random() < 0.6
                n, rope = b.vae(rope, target)
                mode = "noise" if target else "full"
            split_lens.append(n)
            modes.append(ATTN_MODE_CODES[mode])
            total += n
            n_split += 1
        sample_lens.append(total)
        num_splits.append(n_split)
        frames.append(plan.count("vit") if s % 3 == 0 else 0)  # a vlm_sft sample's ViT images: a video's frames
        scalar = bool(rng.random() < 0.5)
        origins.append(
            SampleOrigin(
                group=["vlm_sft", "t2i_pretrain", "unified_edit"][s % 3],
                dataset=f"ds{s}",
                worker_id=int(rng.integers(0, 4)),
                data_indexes=[int(rng.integers(0, 1000))] if scalar else rng.integers(0, 1000, size=3).tolist(),
                scalar=scalar,
                source_file=f"/data/part-{s}.parquet",
                source_row_group=-1 if scalar else int(rng.integers(0, 9)),
                source_row=int(rng.integers(0, 10000)),
            )
        )
    seq = sum(sample_lens)
    a = b.a
    i32 = lambda k: np.asarray(a[k], dtype=np.int32)  # noqa: E731
    return PackedBatch(
        use_flex=spec.use_flex,
        max_num_tokens=seq + int(rng.integers(0, 64)),
        vit_patch_size=VIT_PATCH,
        sequence_length=seq,
        sample_lens=np.asarray(sample_lens, np.int32),
        sample_num_splits=np.asarray(num_splits, np.int32),
        sample_num_frames=np.asarray(frames, np.int32),
        split_lens=np.asarray(split_lens, np.int32),
        attn_modes=np.asarray(modes, np.uint8),
        packed_text_ids=i32("packed_text_ids"),
        packed_text_indexes=i32("packed_text_indexes"),
        packed_position_ids=i32("packed_position_ids"),
        packed_label_ids=i32("packed_label_ids"),
        ce_loss_indexes=i32("ce_loss_indexes"),
        ce_loss_weights=np.asarray(a["ce_loss_weights"], np.float32),
        **image_table(list(b.images)),
        image_norm=np.asarray(b.norms, np.float64).reshape(-1, 6),
        vit_image_ids=i32("vit_image_ids"),
        vit_token_seqlens=i32("vit_token_seqlens"),
        packed_vit_position_ids=i32("packed_vit_position_ids"),
        packed_vit_token_indexes=i32("packed_vit_token_indexes"),
        vae_image_ids=i32("vae_image_ids"),
        vae_latent_shapes=i32("vae_latent_shapes").reshape(-1, 2),
        packed_latent_position_ids=i32("packed_latent_position_ids"),
        packed_vae_token_indexes=i32("packed_vae_token_indexes"),
        packed_timesteps=np.asarray(a["packed_timesteps"], np.float32),
        mse_loss_indexes=i32("mse_loss_indexes"),
        origins=origins,
    )


def stream_batches(stream: int, count: int, spec: BatchSpec | None = None) -> list[PackedBatch]:
    """``count`` batches for one stream; content depends on (stream, index) only."""
    return [make_batch(stream * 100_003 + i, spec or BatchSpec(use_flex=bool((stream + i) % 2))) for i in range(count)]


def write_pack(
    out: str,
    batches: dict[int, list[PackedBatch]],
    *,
    world_size: int,
    num_workers: int,
    shard_bytes: int = 64 * 1024,
    compression: str = "zstd:3",
    done: bool = True,
) -> dict:
    """Write a pack (pack.json, shards, stream indexes, done.json) with the real writer; returns its identity.

    ``done=False`` leaves the streams unfinished (no done.json), as while a pack is being written.
    """
    identity = fake_identity(world_size, num_workers, max(len(b) for b in batches.values()))
    loc = resolve_location(out)
    loc.fs.create_dir(loc.base, recursive=True)
    write_bytes_atomic(loc, PACK_INFO_NAME, dump_checked(identity))
    for s in sorted(batches):
        writer = StreamWriter(out, s, ShardFormat(shard_bytes, compression, fake_metadata(identity)))
        index = StreamIndex(s, [])
        entries = [e for e in (writer.append(b) for b in batches[s]) if e is not None]
        last = writer.finish()
        for e in entries + ([last] if last is not None else []):
            commit_entry(loc, index, e)
        if done:
            mark_done(loc, identity, index, num_workers)
    return identity


def fake_identity(world_size: int, num_workers: int, batches_per_stream: int) -> dict:
    return {"format_version": FORMAT_VERSION, "record_schema_version": RECORD_SCHEMA_VERSION,
            "world_size": world_size, "num_workers": num_workers,
            "num_streams": world_size * max(num_workers, 1), "config_hash": "fake",
            "tokenizer_fingerprint": "fake", "stream_seeds": list(range(world_size * max(num_workers, 1))),
            "budget": {"batches_per_stream": batches_per_stream}}


def fake_metadata(identity: dict) -> dict[str, str]:
    return {"prepack.config_hash": identity["config_hash"],
            "prepack.tokenizer_fingerprint": identity["tokenizer_fingerprint"], "test": "fakepack"}


def commit_entry(loc, index: StreamIndex, entry) -> None:
    """Commit one written shard the way a stream job does (minus lineage and checkpoints)."""
    index.append(entry)
    write_index(loc, index)


def mark_done(loc, identity: dict, index: StreamIndex, num_workers: int) -> None:
    records = [r for sh in index.shards for r in sh.records]
    per_rank = max(num_workers, 1)
    summary = StreamSummary(
        stream=index.stream, rank=index.stream // per_rank, worker=index.stream % per_rank, seed=index.stream,
        num_shards=len(index.shards), num_records=len(records), num_tokens=sum(r.num_tokens for r in records),
        num_samples=sum(r.num_samples for r in records), root=index.root, budget=identity["budget"])
    write_bytes_atomic(loc, done_file(index.stream), summary.to_json().encode())


def make_pack(out: str, *, world_size: int, num_workers: int, lengths: list[int] | None = None, **kwargs) -> dict:
    """A fake pack with W*max(K,1) streams; stream s has ``lengths[s]`` batches (default 3 + s % 3)."""
    n = world_size * max(num_workers, 1)
    lengths = lengths or [3 + s % 3 for s in range(n)]
    return write_pack(
        out,
        {s: stream_batches(s, lengths[s]) for s in range(n)},
        world_size=world_size,
        num_workers=num_workers,
        **kwargs,
    )


def batch_id(batch) -> str:
    """Content identity of a batch (synthetic batches are all different)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(batch.packed_text_ids.numpy().tobytes())
    h.update(repr(batch.batch_data_indexes).encode())
    return h.hexdigest()


SMALL_LENGTHS = [5, 3, 4, 6]  # records per stream of ``small_pack``: W=2 ranks x K=2 workers


def small_pack_fixture():
    """A module fixture: a W=2, K=2 pack of ``SMALL_LENGTHS`` records, 40 KiB shards (several per stream)."""
    @pytest.fixture(scope="module")
    def pack(tmp_path_factory):
        out = str(tmp_path_factory.mktemp("pack"))
        make_pack(out, world_size=2, num_workers=2, lengths=SMALL_LENGTHS, shard_bytes=40 * 1024)
        return out

    return pack
