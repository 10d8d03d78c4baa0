"""PackLocation: listing a folder that another process may be creating at the same moment."""

from __future__ import annotations

import threading

import pyarrow.fs as pafs
import pytest

from schemas.location import PackLocation


class _RacedFolder:
    """A listing that fails as not-found the first ``fails`` times (pyarrow's local listing when the
    folder is created between its failed open and its existence check), then lists ``names``."""

    type_name = "local"

    def __init__(self, fails: int, names: list[str]):
        self.fails, self.names, self.listings = fails, names, 0

    def get_file_info(self, selector):
        self.listings += 1
        if self.listings <= self.fails:
            raise FileNotFoundError(f"Cannot list directory '{selector.base_dir}'")
        return [pafs.FileInfo(f"{selector.base_dir}/{n}", pafs.FileType.File) for n in self.names]


def test_a_folder_created_while_it_is_listed_is_listed_again():
    raced = _RacedFolder(fails=1, names=["a.json", "b.json"])
    infos = PackLocation(raced, "/pack").list(".prepack/leases")
    assert [i.path for i in infos] == ["/pack/.prepack/leases/a.json", "/pack/.prepack/leases/b.json"]
    assert raced.listings == 2
    broken = _RacedFolder(fails=5, names=[])
    with pytest.raises(FileNotFoundError):
        PackLocation(broken, "/pack").list("x")
    assert broken.listings == 3


def test_listing_a_folder_while_it_is_created_never_fails(tmp_path):
    """The real race, many times: one thread creates the folder while another lists it."""
    loc = PackLocation(pafs.LocalFileSystem(), str(tmp_path))
    failures: list[BaseException] = []
    for i in range(300):
        rel = f"r{i}/leases"

        def create():
            (tmp_path / rel).mkdir(parents=True)
            (tmp_path / rel / "x.json").write_bytes(b"{}")

        def list_it():
            try:
                infos = loc.list(rel)
                assert all(info.base_name == "x.json" for info in infos)
            except BaseException as e:  # noqa: BLE001 - reported below
                failures.append(e)

        threads = [threading.Thread(target=create), threading.Thread(target=list_it)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert failures == []
    assert loc.list("missing") == [] and [i.base_name for i in loc.list("r0/leases")] == ["x.json"]
