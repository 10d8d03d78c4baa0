"""The source ledger's identities and their check (``prepack.engine.sources.ledger``).

A check must see every change a restore would trip on — a file deleted, grown, rewritten with the
same size even with its modification time put back, a directory's entries changed — and must not
cry wolf over a file merely touched.
"""

from __future__ import annotations

import os

from prepack.engine.sources.ledger import SETTLE_NS, SourceCheck, SourceLedger


def test_whole_files_ranges_and_listings(tmp_path):
    a, b = tmp_path / "a.jpg", tmp_path / "b.bin"
    a.write_bytes(b"x" * 1000)
    b.write_bytes(bytes(range(256)) * 8)
    ledger = SourceLedger()
    with ledger.starting():
        ledger.note_listing(str(tmp_path), os.listdir(tmp_path))  # the order the sources see
    ledger.note_bytes(str(a), a.read_bytes())
    ledger.note_file(str(b))
    first = ledger.take()
    assert [(i.kind, os.path.basename(i.path)) for i in first] == [("file", "a.jpg"), ("file", "b.bin"),
                                                                 ("listing", tmp_path.name)]
    second = ledger.take()  # the next shard read nothing new: only what every restore reads at the start
    assert [i.kind for i in second] == ["listing"]
    later = max(os.stat(a).st_ctime_ns, os.stat(b).st_ctime_ns) + 2 * SETTLE_NS
    check = SourceCheck(clock=lambda: later)  # lives long, as the running job's does: hashes each file once
    assert [check.problem(i) for i in first] == [None, None, None]

    # a file merely touched is hashed again and still the same
    os.utime(a, ns=(later + 5 * SETTLE_NS, later + 5 * SETTLE_NS))
    assert check.problem(first[0]) is None and SourceCheck().problem(first[0]) is None
    # the same size, other bytes, the modification time put back: still seen, by a fresh check and by
    # one that hashed it before (its ctime moved)
    st = os.stat(b)
    b.write_bytes(bytes(reversed(range(256))) * 8)
    os.utime(b, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert check.problem(first[1]) == "content changed"
    assert SourceCheck().problem(first[1]) == "content changed"
    a.write_bytes(b"x" * 1001)
    assert SourceCheck().problem(first[0]) == "size 1000 -> 1001 bytes"
    (tmp_path / "c.jpg").write_bytes(b"new")
    assert "entries changed" in SourceCheck().problem(first[2])
    os.remove(a)
    assert SourceCheck().problem(first[0]) == "deleted"


def test_a_file_hashed_right_as_it_changed_is_hashed_again(tmp_path):
    """Coarse file-system clocks: a stat that moved within the settle time of the hash is not trusted."""
    f = tmp_path / "f.bin"
    f.write_bytes(b"a" * 100)
    ledger = SourceLedger()
    ledger.note_file(str(f))
    (ident,) = ledger.take()
    check = SourceCheck(clock=lambda: os.stat(f).st_ctime_ns)  # hashed at the very moment of a write
    assert check.problem(ident) is None
    st = os.stat(f)
    with open(f, "r+b") as h:  # rewritten; its stat forced back to what the check saw where it can be
        h.write(b"b" * 100)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert check.problem(ident) == "content changed"


def test_a_held_row_group_is_listed_until_released(tmp_path):
    """Rows of one parquet row group packed over several shards: each shard that goes on reading it lists it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from prepack.engine.sources.parquet import open_parquet

    path = str(tmp_path / "t.parquet")
    pq.write_table(pa.table({"image": [b"x" * 3000] * 40, "captions": ["c"] * 40}), path, row_group_size=10)
    handle = open_parquet(path)
    ledger = SourceLedger()
    holder = object()
    ledger.hold_row_group(holder, handle.fetch_row_group(2, ["image"]))
    one = ledger.take()
    span = handle.fetch_row_group(2, ["image"]).chunk_span()
    assert (span[0], span[1] - span[0]) in {(i.offset, i.length) for i in one}
    assert ledger.take() == []  # a shard that asked the source for nothing: its restore does not read it
    ledger.touch(holder)  # asked again: a restore from the last checkpoint reads it to go on
    assert ledger.take() == one
    ledger.release(holder)
    ledger.touch(holder)
    assert ledger.take() == []
    assert all(SourceCheck().problem(i) is None for i in one)
    with open(path, "r+b") as f:  # a byte of that row group's column chunk changes, same size
        f.seek(span[0] + 100)
        byte = f.read(1)
        f.seek(span[0] + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert "content changed" in {SourceCheck().problem(i) for i in one}
