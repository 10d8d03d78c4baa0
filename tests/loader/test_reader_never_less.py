"""The reader yields exactly the records a pack's metadata promises, or raises naming the file.

A stream whose ``index.arrow`` is missing, empty or older than its ``done.json`` must never read
as a shorter (or empty) stream, through ``open_stream``, ``PackedShardDataset`` (with and
without ``follow``) and the tools; a stream that has left no trace of a commit is still "not
started yet".
"""

from __future__ import annotations

import os
import shutil

import pytest

from loader import PackedShardDataset, open_stream
from loader.reader import Pack
from prepack.cli import main
from prepack.run.commit.atomic_files import write_bytes_atomic
from schemas.errors import DamagedFile, FollowTimeout
from schemas.layout import MANIFEST_NAME, done_file, index_file, stream_dir, stream_lineage_file
from schemas.manifest import StreamIndex
from tests.helpers.packs import build_pack


@pytest.fixture(scope="module")
def pack(tmp_path_factory, tokenizer_and_special) -> str:
    return build_pack(str(tmp_path_factory.mktemp("pack")), tokenizer_and_special)


@pytest.fixture
def out(pack, tmp_path) -> str:
    dst = os.path.join(str(tmp_path), "out")
    shutil.copytree(pack, dst)
    return dst


def rm(out: str, *rels: str) -> None:
    for rel in rels:
        os.remove(os.path.join(out, rel))


def read_all(out: str, stream: int, **kw) -> int:
    return sum(1 for _ in open_stream(out, stream, **kw))


def later_files(out: str, stream: int) -> list[str]:
    """Files of the stream written only after its first commit (shard >= 1, checkpoint >= 2)."""
    names = sorted(os.listdir(os.path.join(out, stream_dir(stream))))
    return [f"{stream_dir(stream)}/{n}" for n in names
            if (n.startswith("shard-") and not n.startswith("shard-00000")) or
            (n.startswith("ckpt-") and n[5:10] not in ("00000", "00001"))]


def assert_names_index(exc: BaseException, out: str, stream: int) -> None:
    assert isinstance(exc, DamagedFile) and index_file(stream) in str(exc), exc


@pytest.mark.parametrize("left", ["done.json", "manifest", "lineage", "later shard files"])
def test_missing_index_with_any_trace_of_records_raises(out, left):
    """Each trace alone is enough: the others are deleted too."""
    assert read_all(out, 1) > 0
    rm(out, index_file(1))
    if left != "done.json":
        rm(out, done_file(1))
    if left != "manifest":
        rm(out, MANIFEST_NAME)
    if left != "lineage":
        rm(out, stream_lineage_file(1))
    if left != "later shard files":
        rm(out, *later_files(out, 1))
    with pytest.raises(DamagedFile) as e:
        read_all(out, 1)
    assert_names_index(e.value, out, 1)
    with pytest.raises(DamagedFile) as e:  # follow: an error at once, not a wait
        read_all(out, 1, follow=True, poll_s=0.05, timeout_s=30)
    assert_names_index(e.value, out, 1)


def test_missing_index_fails_the_dataset_and_the_tools(out, capsys):
    rm(out, index_file(1))
    for follow in (False, True):
        with pytest.raises(DamagedFile) as e:
            list(PackedShardDataset(out, rank=0, world_size=1, follow=follow, poll_s=0.05, timeout_s=30))
        assert_names_index(e.value, out, 1)
    for cmd in (["stats", out], ["inspect", out, "--stream", "1", "--record", "0"], ["verify", out]):
        capsys.readouterr()
        assert main(cmd) == 1, cmd
        cap = capsys.readouterr()
        assert index_file(1) in cap.err + cap.out, cmd


def test_a_stream_without_a_commit_is_not_started_and_is_waited_for(out):
    """What a crash before the first commit leaves (shard-00000, ckpt-00000/1) is no trace."""
    rm(out, index_file(1), done_file(1), MANIFEST_NAME, stream_lineage_file(1), *later_files(out, 1))
    assert read_all(out, 1) == 0
    assert read_all(out, 0) > 0
    with pytest.raises(FollowTimeout):  # waited for (polled) until the timeout, never called damaged
        read_all(out, 1, follow=True, poll_s=0.05, timeout_s=0.5)


def test_an_older_index_than_done_json_raises(out):
    index = Pack.open(out).index(1)
    assert len(index.shards) >= 2
    older = StreamIndex(1, index.shards[:-1], index.ckpt0_json_sha256, index.ckpt0_arrow_sha256)
    write_bytes_atomic(out, index_file(1), older.to_bytes())  # a valid, sealed index: one commit behind
    with pytest.raises(DamagedFile) as e:
        read_all(out, 1)
    assert_names_index(e.value, out, 1)
    assert done_file(1) in str(e.value)


@pytest.mark.parametrize("content", [b"", b"\0" * 64])
def test_an_empty_or_unreadable_index_raises(out, content):
    with open(os.path.join(out, index_file(1)), "wb") as f:
        f.write(content)
    with pytest.raises(DamagedFile) as e:
        read_all(out, 1)
    assert_names_index(e.value, out, 1)
