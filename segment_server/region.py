"""A segment's DRAM region: a sealed memfd, mapped for the process's life, plus a lock file naming it.

Region layout: a 64 KiB header (format in `kvtier.proto.region`, shared with the
shm connector that reads it: identity, mount session, writer slots), then the data area the master allocates from
(offsets on the wire are relative to the data area).

The bytes live in an anonymous memfd (`memfd_create`, MFD_ALLOW_SEALING),
sized once and sealed with F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL before
anyone sees it. Same-host clients get it only through the grant socket
(kvtier.segment_server.shm_grant); the seals are on the file itself, so no
process holding it, granted or not, can shrink it (which would SIGBUS every
process mapping it, this one included) or grow it, and nobody can remove the
seals. The client refuses a region without them (kvtier.client.transport.shm).

The name: `<shm_dir>/kvtier.<cluster>.<segment>.region` is a small lock file
(0600) holding a copy of the header, no data. Ownership: the live owner holds
an exclusive `flock` on it. A lock file of our cluster whose lock can be taken
has no live owner (the process died without cleaning up; its memfd died with
it, or with the last client mapping it) and is removed at start, with the
segment's grant socket next to it (`grant_socket_path`); a file whose lock is
held belongs to a live process and is never touched. Files without our magic
are never deleted. Space is reserved with `posix_fallocate` on the memfd, so
memory the host cannot give is an error at start, and the mapping is populated
up front. The region's memory is shmem charged to the segment's memory cgroup;
it is no longer in /dev/shm (nothing there counts against that mount's size).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import mmap
import os
import secrets
import socket
import stat

from kvtier.proto.region import FORMAT, HEADER, HEADER_SIZE, MAGIC, boot_id

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
# `kvtier.<cluster>.<segment>.region`: cluster ids contain no '.', so names never collide.
_FILE_PREFIX = "kvtier."


# What a region's memfd is sealed with: its size is fixed for good, and the seals too.
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL

# A Unix socket path is at most 107 bytes (sun_path, NUL included).
MAX_SOCKET_PATH = 107


def region_path(directory: str, cluster_id: str, segment_name: str) -> str:
    return os.path.join(directory, f"{_FILE_PREFIX}{cluster_id}.{segment_name}.region")


def grant_socket_path(directory: str, cluster_id: str, segment_name: str) -> str:
    """The segment's shm grant socket, next to its region: `kvtier.<cluster>.<segment>.sock`.

    A name that would not fit a Unix socket path is replaced by a hash of it
    (`kvtier.<cluster>.h<16 hex>.sock`); whether even that fits depends on the
    directory only (SegmentConfig.validate checks it).
    """
    path = os.path.join(directory, f"{_FILE_PREFIX}{cluster_id}.{segment_name}.sock")
    if len(os.fsencode(path)) <= MAX_SOCKET_PATH:
        return path
    digest = hashlib.sha256(segment_name.encode()).hexdigest()[:16]
    return os.path.join(directory, f"{_FILE_PREFIX}{cluster_id}.h{digest}.sock")


class DramRegion:
    """Creates, maps, owns and finally removes one segment's region file."""

    def __init__(self, path: str, capacity: int, cluster_id: str, segment_name: str) -> None:
        self.path = path
        self.capacity = capacity
        self.cluster_id = cluster_id
        self.segment_name = segment_name
        self.nonce = secrets.token_bytes(16)
        self._fd = -1  # the memfd
        self._lock = -1  # the lock file, flocked
        self._map: mmap.mmap | None = None
        self.view: memoryview  # the data area, writable
        self.header: memoryview  # the header, writable (kvtier.proto.region)

    def open(self) -> DramRegion:
        remove_if_orphaned(self.path)
        header = HEADER.pack(
            MAGIC,
            FORMAT,
            HEADER_SIZE,
            self.capacity,
            self.nonce,
            self.cluster_id.encode(),
            self.segment_name.encode(),
            boot_id().encode(),
        )
        lock = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        memfd = -1
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(lock, header)  # operators' tooling and orphan cleanup read the header by name
            memfd = os.memfd_create(os.path.basename(self.path), os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            size = HEADER_SIZE + self.capacity
            try:
                os.posix_fallocate(memfd, 0, size)
            except OSError as exc:
                raise OSError(exc.errno, f"cannot reserve {size} bytes for {self.path}: {exc.strerror}") from None
            fcntl.fcntl(memfd, fcntl.F_ADD_SEALS, SEALS)
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._map = mmap.mmap(memfd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            if memfd >= 0:
                os.close(memfd)
            os.close(lock)
            os.unlink(self.path)
            raise
        self._lock = lock
        self._fd = memfd
        self._map[: HEADER.size] = header
        self.view = memoryview(self._map)[HEADER_SIZE:]
        self.header = memoryview(self._map)[:HEADER_SIZE]  # mount session and writer slots live there
        logger.info("region created path=%s capacity=%d", self.path, self.capacity)
        return self

    def fileno(self) -> int:
        """The region's sealed memfd (what the grant socket hands out, reopened)."""
        if self._fd < 0:
            raise ValueError(f"region {self.path} is not open")
        return self._fd

    def close(self) -> None:
        """Unmap, close the memfd and delete the lock file. Safe to call twice."""
        if self._fd < 0:
            return
        assert self._map is not None
        try:
            self.view.release()
            self.header.release()
            self._map.close()
        except BufferError:  # a transport still holds a slice; the mapping dies with the process
            logger.warning("region still referenced at close path=%s", self.path)
        os.close(self._fd)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self._lock)  # drops the lock last: nobody may take over a name we still use
        self._fd = self._lock = -1
        logger.info("region removed path=%s", self.path)


def read_header(path: str) -> dict | None:
    """Parsed header of a region file, or None if it is not one of ours."""
    try:
        with open(path, "rb") as f:
            raw = f.read(HEADER.size)
    except OSError:
        return None
    if len(raw) < HEADER.size or not raw.startswith(MAGIC):
        return None
    magic, fmt, data_offset, capacity, nonce, cluster, name, boot = HEADER.unpack(raw)
    return {
        "format": fmt,
        "data_offset": data_offset,
        "capacity": capacity,
        "nonce": nonce,
        "cluster_id": cluster.rstrip(b"\0").decode(errors="replace"),
        "segment_name": name.rstrip(b"\0").decode(errors="replace"),
        "boot_id": boot.rstrip(b"\0").decode(errors="replace"),
    }


def remove_if_orphaned(path: str) -> bool:
    """Delete `path` if it is a kvtier region file whose owner is gone. True if removed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FileExistsError(
                f"{path} is held by a live process: is another segment server using this name?"
            ) from None
        header = read_header(path)
        if header is None:
            raise FileExistsError(f"{path} exists and is not a kvtier region file; not touching it")
        os.unlink(path)
        logger.warning("removed stale region file left by a dead process path=%s", path)
        # Its grant socket died with the same process (a live server removes its socket before
        # its region); still, only a socket nobody listens on is removed.
        sock = grant_socket_path(os.path.dirname(path), header["cluster_id"], header["segment_name"])
        try:
            remove_stale_socket(sock)
        except OSError as exc:
            logger.warning("grant socket of a stale region kept path=%s reason=%s", sock, exc)
        return True
    finally:
        os.close(fd)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def socket_is_live(path: str) -> bool:
    """Whether a process accepts connections on the Unix socket `path` (a refused connect: nobody does).

    A live grant server sees the probe as a peer that hung up without asking (counted as an error).
    """
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:  # EAGAIN (a live listener's full backlog), a timeout, EACCES...: assume live, touch nothing
        return True
    finally:
        probe.close()
    return True


def remove_stale_socket(path: str) -> bool:
    """Delete the Unix socket `path` if nobody listens on it; True if removed.

    FileExistsError when a live process listens there or the path is not a socket: never ours to delete.
    """
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return False
    if not stat.S_ISSOCK(mode):
        raise FileExistsError(f"{path} exists and is not a socket; not touching it")
    if socket_is_live(path):
        raise FileExistsError(f"{path} is served by a live process: is another segment server using this name?")
    _unlink_quietly(path)
    logger.warning("removed stale grant socket path=%s", path)
    return True


def remove_orphans(directory: str, cluster_id: str) -> int:
    """Remove every orphaned region file of `cluster_id` in `directory`, and their grant sockets;
    live ones stay. Returns the number of region files removed.

    A grant socket whose region file is gone (deleted by hand) is removed when nobody listens on it.
    """
    removed = 0
    prefix = f"{_FILE_PREFIX}{cluster_id}."
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    paired: set[str] = set()  # grant sockets of region files still present (their lock decides)
    for name in names:
        if name.startswith(prefix) and name.endswith(".region"):
            path = os.path.join(directory, name)
            header = read_header(path)
            if header is None or header["cluster_id"] != cluster_id:
                continue  # not a region, or one of a cluster whose id merely starts with ours
            paired.add(grant_socket_path(directory, cluster_id, header["segment_name"]))
            try:
                removed += remove_if_orphaned(path)
            except (FileExistsError, OSError):
                continue
    for name in names:
        path = os.path.join(directory, name)
        if name.startswith(prefix) and name.endswith(".sock") and path not in paired:
            try:
                remove_stale_socket(path)
            except OSError:  # FileExistsError included: live, or not a socket
                continue
    return removed
