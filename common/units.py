"""Human sizes and durations for flags and config: `512MiB`, `4GiB`, `1.5GB`, `4096`."""

from __future__ import annotations

import re
import struct

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Parse a byte size; raise ValueError with a readable message when malformed."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must not be negative: {text}")
        return text
    match = _SIZE_RE.match(text)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _SIZE_UNITS:
        raise ValueError(f"invalid size {text!r}: use bytes or a unit like 512MiB, 4GiB, 1GB")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def format_size(n: int) -> str:
    """Render bytes with a binary unit, e.g. 1.5 GiB."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def parse_hostport(text: str, *, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """Parse `HOST:PORT` (or `[v6]:PORT`, or `:PORT`); raise ValueError when malformed."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"invalid address {text!r}: expected HOST:PORT")
    host = host.strip("[]") or default_host
    return host, int(port)


def check_master_spec(spec: str) -> str:
    """Validate a `--master` value: HOST:PORT, a comma list of them, or etcd://HOST:PORT[,...]/CLUSTER
    (see kvtier.common.discovery); raise ValueError when malformed."""
    if spec.startswith("etcd://"):
        from kvtier.common.etcd_client import parse_etcd_url  # the etcd stubs load only when used

        parse_etcd_url(spec)
        return spec
    addresses = [a.strip() for a in spec.split(",") if a.strip()]
    if not addresses:
        raise ValueError("a master address is required, e.g. 127.0.0.1:50051")
    for address in addresses:
        parse_hostport(address)
    return spec


WILDCARD_HOSTS = frozenset(("0.0.0.0", "::", ""))


def is_wildcard(host: str) -> bool:
    """Whether binding `host` listens on every interface (then it is no address to advertise)."""
    return host.strip("[]") in WILDCARD_HOSTS


def check_field(name: str, check, value):
    """`check(value)`, with a ValueError's message prefixed by the option's name."""
    try:
        return check(value)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address (or `localhost`): reachable from this machine only."""
    import ipaddress

    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: assume it is reachable from elsewhere


def timeval(seconds: float) -> bytes:
    """`seconds` as the kernel's struct timeval, for SO_RCVTIMEO / SO_SNDTIMEO (0 = wait forever)."""
    whole = int(seconds)
    return struct.pack("@ll", whole, int((seconds - whole) * 1_000_000))
