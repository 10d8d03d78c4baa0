"""What a pack asks of an object store: each small file one PUT, no folder marker objects.

(pyarrow itself PUTs a folder's marker after deleting a file in it, so that the folder lives on;
those follow the few deletes of a run: a released lease, a finished stream's shard lineage.)

Every request during a small pack to ``s3://`` goes through a loopback proxy that keeps its
first line.  A store's latency is paid per request, in a row on the stream's path (a shard
commit writes its lineage, two checkpoint files and the index), so a small file that costs a
HEAD, four folder-marker PUTs and a three-request multipart upload is nine round trips where
one will do.
"""

from __future__ import annotations

import os
import re

import pytest

from prepack.run.commit.atomic_files import write_bytes_atomic
from schemas.location import resolve_location
from tests.helpers.latency_proxy import LatencyProxy
from tests.helpers.packs import pack_in_process, small_dataset
from tests.helpers.s3checks import local_files, same_pack_objects

pytestmark = pytest.mark.slow  # needs the S3 server

_LINE = re.compile(r"(GET|PUT|POST|HEAD|DELETE) /([^? ]*)(\?\S*)? HTTP")


@pytest.fixture
def proxied(s3, monkeypatch):
    host, port = s3.endpoint.split("://", 1)[1].rsplit(":", 1)
    with LatencyProxy(host, int(port), 0.0) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        yield proxy


def _requests(proxy: LatencyProxy) -> list[tuple[str, str, str]]:
    """(method, bucket/key, query) of every request so far (a body sent after the server's
    ``100 Continue`` also starts a turn of the proxy's; it is not a request line)."""
    return [(m[1], m[2], m[3] or "") for m in map(_LINE.match, proxy.request_lines) if m]


def test_a_small_file_is_one_put(s3, proxied):
    loc = resolve_location(s3.new_prefix("one-put"))
    write_bytes_atomic(loc, "stream-00000/index.arrow", b"x" * 1000)  # the location's first write
    before = len(_requests(proxied))
    write_bytes_atomic(loc, "stream-00001/ckpt-00002.json", b"{}")
    assert _requests(proxied)[before:] == [("PUT", loc.path("stream-00001/ckpt-00002.json"), "")]
    assert loc.read_bytes("stream-00001/ckpt-00002.json") == b"{}"


def test_a_pack_writes_each_small_object_with_one_put_and_no_folder_markers(s3, proxied, tokenizer_and_special, tmp_path):
    config = small_dataset(str(tmp_path), batches=4, edit=True)
    local = pack_in_process(config, str(tmp_path / "local"), tokenizer_and_special)
    uri = s3.new_prefix("requests")
    base = uri.split("://", 1)[1]
    pack_in_process(config, uri, tokenizer_and_special)
    objects = s3.objects(uri)
    assert same_pack_objects(objects, local_files(local)) == []  # the same pack as on a local disk
    requests = [(m, k, q) for m, k, q in _requests(proxied) if k.startswith(base + "/")]
    writes = [(m, k, q) for m, k, q in requests if m in ("PUT", "POST")]
    deleted: set[str] = set()  # parents of the keys deleted so far
    for m, k, _ in requests:
        if m == "DELETE":
            deleted.add(k.rsplit("/", 1)[0] + "/")
        elif m == "PUT" and k.endswith("/"):  # a folder marker: the run's first probe of the location, or
            assert k == base + "/" or k in deleted, k  # pyarrow keeping a folder after a delete in it
    for name, data in objects.items():
        key = f"{base}/{name}"
        mine = [(m, q) for m, k, q in writes if k == key]
        if len(data) <= 1 << 20:
            assert [m for m, q in mine if not q] and not [q for _, q in mine if "uploads" in q], (name, mine)
