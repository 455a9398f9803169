"""Start-up failures a user fixes: one line on stderr naming the cause and the option, exit status 2.

A server's entry point runs its `serve()` under `run_main` (kvtier.common.service.run_service
does); anything that stops a start for a reason outside the program (a port in use, a directory it
cannot write, a region larger than /dev/shm, etcd unreachable) is raised as `StartupError` with
that one line. Exit status 2 is also what a bad flag or config key gets (kvtier.common.config), so
a service manager that does not restart on 2 (systemd RestartPreventExitStatus=2) does not loop on
either.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import socket
import sys
import uuid
from collections.abc import Callable

STARTUP_EXIT = 2


class StartupError(Exception):
    """The server cannot start; the message is one line naming the cause and the option to change."""


def run_main(prog: str, body: Callable[[], int]) -> int:
    """`body()`, with a StartupError reported as one line on stderr and exit status 2."""
    try:
        return body()
    except StartupError as exc:
        print(f"{prog}: {exc}", file=sys.stderr, flush=True)
        return STARTUP_EXIT


def describe_os_error(exc: OSError) -> str:
    """An OSError's reason in a few words ("address already in use"), without errno numbers."""
    if exc.errno is not None and exc.errno in errno.errorcode:
        return (exc.strerror or os.strerror(exc.errno)).lower()
    return str(exc)


def check_bindable(address: str, option: str) -> None:
    """StartupError unless a TCP listener could bind `address` (HOST:PORT) now.

    gRPC reports a bind failure as a C-core log line plus a RuntimeError that hides the reason; a
    plain socket bound first (with SO_REUSEADDR, as gRPC and asyncio bind) names it. Port 0 always binds.
    """
    from kvtier.common.units import parse_hostport

    host, port = parse_hostport(address)
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise StartupError(f"cannot listen on {address}: {exc.strerror}: change {option}") from None
    for family, kind, proto, _name, sockaddr in infos[:1]:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                raise StartupError(f"cannot listen on {address}: {describe_os_error(exc)}: change {option}") from None


def check_writable_dir(path: str, option: str) -> None:
    """Create `path` (and its parents) if missing, and prove it writable by creating and removing a
    file in it; StartupError naming `option` otherwise (a later write failing would lose state)."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        probe = os.path.join(path, f".kvtier-write-check-{uuid.uuid4().hex[:8]}")
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        where = exc.filename or path
        raise StartupError(f"cannot write {where}: {describe_os_error(exc)}: change {option}") from None


def raise_open_file_limit(needed: int, option: str, logger: logging.Logger) -> None:
    """Raise the soft RLIMIT_NOFILE to `needed` where the hard limit allows, so a server refuses
    connections at its own limit, with a reason, not at EMFILE; a warning naming `option` (what to
    lower) when the hard limit is short."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target < needed:
        logger.warning(
            "open file limit below max_connections soft=%d needed=%d: raise the hard limit (ulimit -Hn, "
            "systemd LimitNOFILE=) or lower %s",
            target,
            needed,
            option,
        )


def check_file_creatable(path: str, option: str) -> None:
    """StartupError unless a file can be written at `path` later (its directory exists and is
    writable, and `path` is not a directory): a ready file or a log written once serving, whose
    failure then was a traceback after the start had been announced."""
    directory = os.path.dirname(os.path.abspath(path)) or "."
    if os.path.isdir(path):
        raise StartupError(f"cannot write {path}: it is a directory: change {option}")
    if not os.path.isdir(directory):
        raise StartupError(f"cannot write {path}: {directory} is not a directory: change {option}")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise StartupError(f"cannot write {path}: {directory} is not writable: change {option}")


def check_tls_files(cert: str, key: str, ca: str, cert_option: str, key_option: str, ca_option: str) -> None:
    """StartupError naming the option unless the PEM files load (a certificate with its own key, a CA
    bundle). gRPC only finds out when it binds or connects: a garbage certificate was reported as
    "cannot listen: change --listen", a garbage CA made a segment retry its master for ever."""
    import ssl

    for path, option in ((cert, cert_option), (key, key_option), (ca, ca_option)):
        if path and not os.path.isfile(path):
            raise StartupError(f"cannot read {path}: no such file: change {option}")
        if path and not os.access(path, os.R_OK):
            raise StartupError(f"cannot read {path}: permission denied: change {option}")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if cert and key:
        try:
            context.load_cert_chain(cert, key)
        except ssl.SSLError as exc:
            raise StartupError(
                f"TLS certificate {cert} and key {key} do not load as a pair ({exc.reason or exc}): change "
                f"{cert_option} / {key_option}"
            ) from None
    if ca:
        try:
            context.load_verify_locations(ca)
        except ssl.SSLError as exc:
            raise StartupError(f"TLS CA file {ca} does not load ({exc.reason or exc}): change {ca_option}") from None


def same_address(first: str, second: str) -> bool:
    """Whether two HOST:PORT listen addresses are the same fixed one (port 0 picks a free one: never)."""
    from kvtier.common.units import parse_hostport

    (host1, port1), (host2, port2) = parse_hostport(first), parse_hostport(second)
    return port1 == port2 != 0 and host1.strip("[]") == host2.strip("[]")
