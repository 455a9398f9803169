"""DramRegion files in a tmp directory: creation, header, removal, and flock-based orphan cleanup."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
from pathlib import Path

import pytest

from kvtier.proto.region import HEADER, HEADER_SIZE
from kvtier.segment_server.region import (
    SEALS,
    DramRegion,
    read_header,
    region_path,
    remove_if_orphaned,
    remove_orphans,
)

CAPACITY = 1 << 20


@pytest.fixture
def shm(tmp_path: Path) -> Path:
    directory = tmp_path / "shm"
    directory.mkdir()
    return directory


@pytest.fixture
def regions():
    """Opened regions, closed at teardown whatever the test did."""
    opened: list[DramRegion] = []

    def open_region(directory: Path, cluster: str, name: str, capacity: int = CAPACITY) -> DramRegion:
        region = DramRegion(region_path(str(directory), cluster, name), capacity, cluster, name).open()
        opened.append(region)
        return region

    yield open_region
    for region in opened:
        region.close()


@contextlib.contextmanager
def flocked(path: Path):
    """Hold an exclusive flock on `path`, as a live segment server does."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield
    finally:
        os.close(fd)


def leftover(regions, directory: Path, cluster: str, name: str, template_dir: Path) -> Path:
    """A region file with a valid header and no live owner, as a killed server leaves it.

    Made by copying a live region's file: the copy has the header but nobody holds its lock.
    """
    template_dir.mkdir(exist_ok=True)
    live = regions(template_dir, cluster, name, capacity=4096)
    target = Path(region_path(str(directory), cluster, name))
    shutil.copyfile(live.path, target)
    return target


def test_region_path():
    assert region_path("/dev/shm", "c1", "seg0") == "/dev/shm/kvtier.c1.seg0.region"


def test_create_maps_a_private_file_with_a_readable_header(shm, regions):
    region = regions(shm, "c1", "seg0")
    path = Path(region.path)
    assert path.parent == shm
    info = path.stat()
    assert stat.S_IMODE(info.st_mode) == 0o600
    assert info.st_size == HEADER.size, "a lock file naming the region: the header, no data"
    region_info = os.fstat(region.fileno())
    assert region_info.st_size == HEADER_SIZE + CAPACITY and region_info.st_ino != info.st_ino
    assert fcntl.fcntl(region.fileno(), fcntl.F_GET_SEALS) == SEALS
    for size in (0, HEADER_SIZE, HEADER_SIZE + CAPACITY + 4096):  # nobody holding it can resize it
        with pytest.raises(PermissionError):
            os.ftruncate(region.fileno(), size)
    with pytest.raises(PermissionError):
        fcntl.fcntl(region.fileno(), fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)  # nor change its seals
    header = read_header(region.path)
    assert header is not None
    assert header["cluster_id"] == "c1"
    assert header["segment_name"] == "seg0"
    assert header["nonce"] == region.nonce
    assert len(region.nonce) == 16
    assert header["capacity"] == CAPACITY
    assert header["data_offset"] == HEADER_SIZE
    assert header["format"] == 3  # 2: the header publishes the mount session; 3: and writer slots


def test_view_is_the_writable_data_area_after_the_header(shm, regions):
    region = regions(shm, "c1", "seg0")
    assert len(region.view) == CAPACITY
    assert not region.view.readonly
    region.view[0:5] = b"hello"
    region.view[CAPACITY - 3 :] = b"end"
    with open(f"/proc/self/fd/{region.fileno()}", "rb") as f:  # the memfd, reopened as a granted peer would
        f.seek(HEADER_SIZE)
        assert f.read(5) == b"hello"
        f.seek(HEADER_SIZE + CAPACITY - 3)
        assert f.read() == b"end"
    assert read_header(region.path)["segment_name"] == "seg0"  # data writes leave the header alone


def test_each_region_gets_a_fresh_nonce(shm, regions):
    first = regions(shm, "c1", "a")
    second = regions(shm, "c1", "b")
    assert first.nonce != second.nonce


def test_close_removes_the_file_and_is_idempotent(shm):
    region = DramRegion(region_path(str(shm), "c1", "seg0"), CAPACITY, "c1", "seg0").open()
    assert os.path.exists(region.path)
    region.close()
    assert not os.path.exists(region.path)
    region.close()
    assert list(shm.iterdir()) == []


def test_close_with_a_slice_still_referenced(shm):
    region = DramRegion(region_path(str(shm), "c1", "seg0"), CAPACITY, "c1", "seg0").open()
    held = region.view[0:10]  # e.g. a READ response still queued in a transport
    region.close()
    assert not os.path.exists(region.path)
    held.release()


def test_open_refuses_a_path_held_by_a_live_region(shm, regions):
    live = regions(shm, "c1", "seg0")
    with pytest.raises(FileExistsError, match="held by a live process"):
        DramRegion(live.path, CAPACITY, "c1", "seg0").open()
    assert read_header(live.path)["nonce"] == live.nonce


def test_open_replaces_an_orphaned_file(shm, tmp_path, regions):
    stale = leftover(regions, shm, "c1", "seg0", tmp_path / "tpl")
    old_nonce = read_header(str(stale))["nonce"]
    region = regions(shm, "c1", "seg0")
    assert read_header(region.path)["nonce"] == region.nonce != old_nonce


def test_open_never_deletes_a_foreign_file(shm):
    path = Path(region_path(str(shm), "c1", "seg0"))
    path.write_bytes(b"somebody else's data")
    with pytest.raises(FileExistsError, match="not a kvtier region"):
        DramRegion(str(path), CAPACITY, "c1", "seg0").open()
    assert path.read_bytes() == b"somebody else's data"


# ---------------------------------------------------------------- read_header


def test_read_header_of_other_files(shm):
    assert read_header(str(shm / "missing")) is None
    (shm / "empty").write_bytes(b"")
    assert read_header(str(shm / "empty")) is None
    (shm / "text").write_text("hello world\n" * 1000)
    assert read_header(str(shm / "text")) is None
    (shm / "short").write_bytes(b"KVTREGN1" + bytes(10))  # our magic, truncated header
    assert read_header(str(shm / "short")) is None
    assert read_header(str(shm)) is None  # a directory


# ---------------------------------------------------------------- remove_if_orphaned


def test_orphaned_file_is_removed(shm, tmp_path, regions):
    stale = leftover(regions, shm, "c1", "seg0", tmp_path / "tpl")
    assert read_header(str(stale))["cluster_id"] == "c1"
    assert remove_if_orphaned(str(stale)) is True
    assert not stale.exists()


def test_missing_file_is_not_an_error(shm):
    assert remove_if_orphaned(str(shm / "kvtier.c1.none.region")) is False


def test_file_with_a_held_lock_is_kept(shm, tmp_path, regions):
    stale = leftover(regions, shm, "c1", "seg0", tmp_path / "tpl")
    with flocked(stale):
        with pytest.raises(FileExistsError, match="held by a live process"):
            remove_if_orphaned(str(stale))
        assert stale.exists()
    assert remove_if_orphaned(str(stale)) is True  # once its owner is gone


def test_live_region_is_kept(shm, regions):
    live = regions(shm, "c1", "seg0")
    with pytest.raises(FileExistsError):
        remove_if_orphaned(live.path)
    assert os.path.exists(live.path)
    live.view[0:1] = b"x"  # still mapped and usable


@pytest.mark.parametrize(
    "content", [b"", b"not a region", b"KVTREGN1", bytes(8192)], ids=["empty", "text", "magic-only", "zeros"]
)
def test_foreign_file_is_never_deleted(shm, content):
    path = shm / "kvtier.c1.seg0.region"
    path.write_bytes(content)
    with pytest.raises(FileExistsError, match="not a kvtier region"):
        remove_if_orphaned(str(path))
    assert path.read_bytes() == content


# ---------------------------------------------------------------- remove_orphans


def test_remove_orphans_only_touches_its_own_cluster(shm, tmp_path, regions):
    tpl = tmp_path / "tpl"
    mine = [leftover(regions, shm, "c1", name, tpl) for name in ("a", "b")]
    other = leftover(regions, shm, "c2", "a", tpl)
    prefixed = leftover(regions, shm, "c1-x", "a", tpl)  # a cluster id that extends "c1"
    live = regions(shm, "c1", "live")
    held = leftover(regions, shm, "c1", "held", tpl)
    foreign = shm / "kvtier.c1.foreign.region"
    foreign.write_bytes(b"not ours")
    unrelated = shm / "something-else"
    unrelated.write_bytes(b"x")
    with flocked(held):
        assert remove_orphans(str(shm), "c1") == 2
    assert not any(path.exists() for path in mine)
    assert other.exists()
    assert prefixed.exists(), "an orphan of cluster 'c1-x' was removed by cluster 'c1'"
    assert read_header(str(prefixed))["cluster_id"] == "c1-x"
    assert os.path.exists(live.path)
    assert held.exists()
    assert foreign.read_bytes() == b"not ours"
    assert unrelated.exists()
    # the other clusters clean up their own
    assert remove_orphans(str(shm), "c2") == 1
    assert remove_orphans(str(shm), "c1-x") == 1
    assert not other.exists() and not prefixed.exists()


def test_remove_orphans_of_a_missing_directory(tmp_path):
    assert remove_orphans(str(tmp_path / "missing"), "c1") == 0


def test_remove_orphans_with_nothing_to_do(shm, regions):
    live = regions(shm, "c1", "seg0")
    assert remove_orphans(str(shm), "c1") == 0
    assert os.path.exists(live.path)
