"""Choosing the disk engine: `open_engine` and the io_uring probe it runs in a child process (the
engines are in kvtier.segment_server.diskio).

`open_engine()` is the entry point: it probes io_uring in a child process first, because a liburing
build for the wrong CPU dies with SIGILL and a seccomp profile can kill or refuse io_uring_setup;
neither may take the server down. The parent imports liburing only after a child proved it safe.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import logging
import signal
import subprocess
import sys
from dataclasses import dataclass

from kvtier.segment_server.diskio import DiskEngine, IoUringEngine, ThreadPoolEngine, _liburing

logger = logging.getLogger("kvtier.segment_server.diskio")  # the engines' logger: one name for their logs

_PROBE_PREAMBLE = """\
import resource
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crashing probe must not leave a core file
"""

# Exercises what IoUringEngine needs: import, ring setup, eventfd registration, one real 4 KiB read.
_PROBE_CHILD = """\
import errno, os, sys, tempfile
try:
    import liburing
except ImportError as exc:
    sys.exit(f"liburing not importable: {exc}")
ring = liburing.io_uring()
try:
    liburing.io_uring_queue_init(4, ring, 0)
except OSError as exc:
    name = errno.errorcode.get(exc.errno, str(exc.errno))
    if exc.errno in (errno.EPERM, errno.ENOSYS):
        sys.exit(f"{name}: io_uring_setup blocked by seccomp or the kernel.io_uring_disabled sysctl")
    sys.exit(f"{name}: io_uring_queue_init failed: {exc}")
efd = os.eventfd(0, os.EFD_CLOEXEC)
try:
    liburing.io_uring_register_eventfd(ring, efd)
    with tempfile.TemporaryFile() as f:
        payload = os.urandom(4096)
        f.write(payload)
        f.flush()
        buf = bytearray(4096)
        sqe = liburing.io_uring_get_sqe(ring)
        liburing.io_uring_prep_read(sqe, f.fileno(), buf, len(buf), 0)
        sqe.user_data = 1
        liburing.io_uring_submit(ring)
        cqe = liburing.io_uring_cqe()
        liburing.io_uring_wait_cqe(ring, cqe)
        res = cqe.res
        liburing.io_uring_cqe_seen(ring, cqe)
    if res < 0:
        sys.exit(f"{errno.errorcode.get(-res, -res)}: probe read failed: {os.strerror(-res)}")
    if res != len(payload) or bytes(buf) != payload:
        sys.exit(f"probe read returned {res} bytes, not the 4096 written")
    if os.eventfd_read(efd) < 1:
        sys.exit("eventfd was not signalled")
finally:
    liburing.io_uring_queue_exit(ring)
    os.close(efd)
"""


@dataclass(frozen=True, slots=True)
class ProbeResult:
    ok: bool
    reason: str  # why not, or a short description when ok


def probe_io_uring(child_code: str = _PROBE_CHILD, *, timeout: float = 20.0) -> ProbeResult:
    """Run `child_code` in a fresh interpreter; io_uring is usable iff it exits 0.

    A probe killed by a signal (SIGILL from a liburing built for another CPU, SIGSYS from seccomp)
    is reported as "probe killed by signal SIGILL"; otherwise the reason is the child's last line of
    stderr (the default probe writes e.g. "EPERM: io_uring_setup blocked by seccomp ..."). Blocks
    for the child's lifetime (~0.1 s). Not cached: see `io_uring_probe`.
    """
    if not sys.platform.startswith("linux"):
        return ProbeResult(False, f"io_uring needs Linux, this is {sys.platform}")
    if child_code is _PROBE_CHILD and importlib.util.find_spec("liburing") is None:
        return ProbeResult(False, "liburing is not installed")
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _PROBE_PREAMBLE + child_code],
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return ProbeResult(False, f"probe timed out after {timeout:g}s")
    except OSError as exc:
        return ProbeResult(False, f"cannot run probe: {exc}")
    lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
    detail = lines[-1][:300] if lines else ""
    if proc.returncode == 0:
        return ProbeResult(True, "probe passed")
    if proc.returncode < 0:
        try:
            sig = signal.Signals(-proc.returncode).name
        except ValueError:
            sig = str(-proc.returncode)
        return ProbeResult(False, f"probe killed by signal {sig}" + (f" ({detail})" if detail else ""))
    return ProbeResult(False, detail or f"probe exited with status {proc.returncode}")


@functools.cache
def io_uring_probe() -> ProbeResult:
    """`probe_io_uring()` with the default child, run at most once per process."""
    result = probe_io_uring()
    logger.info("io_uring probe ok=%s reason=%s", result.ok, result.reason)
    return result


def open_engine(
    kind: str = "auto",
    *,
    queue_depth: int = 32,
    threads: int = 4,
    loop: asyncio.AbstractEventLoop | None = None,
) -> tuple[DiskEngine, str]:
    """The disk engine to use and a one-line human reason for the choice.

    `kind`: "io_uring" (RuntimeError if unusable), "threads" (never probes) or "auto" (io_uring if
    the child-process probe passes and the ring can be set up, else threads). `threads` is the
    worker budget either way: pool threads for the thread engine, the io-wq kernel worker cap (at
    least 2) for io_uring. Call from the loop's thread with that loop running, or pass `loop`; the first call
    that probes blocks for the probe child (~0.1 s), later calls reuse its cached result.
    """
    if kind not in ("auto", "io_uring", "threads"):
        raise ValueError(f"unknown disk engine kind {kind!r}: expected 'auto', 'io_uring' or 'threads'")
    suffix = " (requested)"
    if kind != "threads":
        probe = io_uring_probe()
        why = probe.reason
        if probe.ok:
            try:
                engine = IoUringEngine(queue_depth=queue_depth, kernel_workers=max(2, threads), loop=loop)
            except (OSError, ImportError) as exc:
                why = f"ring setup failed: {exc}"
            else:
                version = getattr(_liburing(), "__version__", "?")
                workers = engine.kernel_workers
                reason = f"io_uring (liburing {version}), queue depth {queue_depth}, kernel workers <= {workers}"
                logger.info("disk engine kind=io_uring reason=%s", reason)
                return engine, reason
        if kind == "io_uring":
            raise RuntimeError(f"io_uring unavailable: {why}")
        suffix = f": io_uring unavailable: {why}"
    reason = f"threads x{threads}, queue depth {queue_depth}{suffix}"
    logger.info("disk engine kind=threads reason=%s", reason)
    return ThreadPoolEngine(queue_depth=queue_depth, threads=threads), reason
