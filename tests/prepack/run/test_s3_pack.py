"""A pack written to a real S3 server (SeaweedFS) is the pack written to a local disk.

One small config (t2i + edit + SFT, 2 streams, several shards each) is packed in process twice,
to a local folder and to ``s3://``.  Then: the objects are byte for byte the local files; every
stream read back through ``open_stream``, ``PackedShardDataset`` and a training DataLoader gives
what it gives locally; ``verify``, ``audit --shard``/``--all``, ``stats`` and ``inspect`` work
on the ``s3://`` pack and say what they say locally; the CLI works with the standard AWS
environment variables.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from tests.helpers.packs import pack_in_process, small_dataset
from tests.helpers.paths import REPO
from tests.helpers.s3checks import batch_fingerprint, local_files, same_pack_objects, stream_fingerprints

pytestmark = pytest.mark.slow  # needs the S3 server (started once per session)

STREAMS = 2


@pytest.fixture(scope="module")
def packs(s3_server, tokenizer_and_special, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("s3pack"))
    config = small_dataset(root, batches=6, edit=True)
    local = pack_in_process(config, os.path.join(root, "out"), tokenizer_and_special)
    uri = s3_server.new_prefix("pack")
    with pytest.MonkeyPatch.context() as mp:
        for k, v in s3_server.env.items():
            mp.setenv(k, v)
        followed = _followed_while_packed(config, uri, tokenizer_and_special)
    return {"config": config, "local": local, "uri": uri, "followed": followed}


def _followed_while_packed(config: str, uri: str, tokenizer_and_special) -> dict:
    """Pack ``config`` to ``uri`` in a thread while a follower reads rank 0 of it (``follow=True``):
    what it read, and whether the pack was still being written at its first batch."""
    from loader import PackedShardDataset
    from prepack.run.commit.writer import StreamWriter
    from tests.helpers.packs import pack_in_background

    append = StreamWriter.append
    with pytest.MonkeyPatch.context() as mp:  # a moment per batch: the follower starts well before the end
        mp.setattr(StreamWriter, "append", lambda self, batch: (time.sleep(0.1), append(self, batch))[1])
        job = pack_in_background(config, uri, tokenizer_and_special)
        read, packing = [], []
        for b in PackedShardDataset(uri, rank=0, world_size=1, follow=True, poll_s=0.05, timeout_s=300):
            read.append(batch_fingerprint(b))
            packing.append(job.is_alive())
        job.join(timeout=300)
    return {"batches": read, "packing_at_first": bool(packing and packing[0])}


def test_objects_are_the_local_files(s3, packs):
    assert same_pack_objects(s3.objects(packs["uri"]), local_files(packs["local"])) == []


def test_streams_read_back_as_on_local_disk(s3, packs):
    got = stream_fingerprints(packs["uri"], STREAMS)
    assert got == stream_fingerprints(packs["local"], STREAMS)
    assert all(len(v) == 6 for v in got.values())


def _dataset_prints(path: str, world_size: int, **loader_kw) -> list[list[str]]:
    from loader import PackedShardDataset

    ranks = []
    for r in range(world_size):
        ds = PackedShardDataset(path, rank=r, world_size=world_size)
        it = torch.utils.data.DataLoader(ds, batch_size=None, **loader_kw) if loader_kw else ds
        ranks.append([batch_fingerprint(b) for b in it])
    return ranks


def test_a_follower_reads_the_pack_while_it_is_written(s3, packs):
    """follow x S3: a reader started with the job waits for each batch on the store and reads what the
    local pack holds."""
    assert packs["followed"]["packing_at_first"], "the pack was done before the follower read (inconclusive)"
    assert packs["followed"]["batches"] == _dataset_prints(packs["local"], 1)[0]


def test_dataset_and_training_dataloader(s3, packs):
    want = _dataset_prints(packs["local"], 1)
    assert _dataset_prints(packs["uri"], 1) == want
    assert _dataset_prints(packs["uri"], 2) == _dataset_prints(packs["local"], 2)
    # DataLoader workers, forked after this process read the pack: each opens its own S3 client
    # (sharing the parent's connections reads other requests' bytes; the digest check caught it)
    via_workers = _dataset_prints(packs["uri"], 1, num_workers=2)
    assert sorted(via_workers[0]) == sorted(want[0])


def test_verify_audit_stats_inspect(s3, packs, tokenizer_and_special):
    from prepack.tools.audit import audit_pack
    from prepack.tools.inspect_record import inspect_record
    from prepack.tools.stats import pack_stats
    from prepack.tools.verify import verify_pack

    uri, local = packs["uri"], packs["local"]
    report = verify_pack(uri)
    assert report.ok, report.lines()
    assert audit_pack(uri, stream=1, shard=1).ok
    assert audit_pack(uri, all_streams=True).ok
    untimed = lambda text: text.split("\nstreams:")[0].split("\n", 1)[1]  # noqa: E731 (no path line, no timings)
    assert untimed(pack_stats(uri)) == untimed(pack_stats(local))
    tok = tokenizer_and_special[0]
    assert inspect_record(uri, stream=1, record=3, tokenizer=tok) == inspect_record(local, stream=1, record=3, tokenizer=tok)


def test_cli_on_s3(s3, packs):
    """The commands a user runs, in a fresh process that only has the AWS environment variables."""
    uri = packs["uri"]
    env = dict(os.environ, PYTHONPATH=REPO)
    r = subprocess.run([sys.executable, "-m", "prepack.cli", "verify", uri], env=env, cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip()
