"""Self-describing values for the history checker: a torn, mixed or foreign value is told by content.

A value is `KVH1|<key>|<writer>|<version>|<length>|` followed by deterministic bytes
(SHAKE-256 of that header) up to `length` bytes in all. Reading it back, `identify` parses the
header and regenerates the whole value: equal bytes name exactly one put (key, writer, version);
anything else is corrupt, described well enough to tell torn from foreign from garbage.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

MAGIC = b"KVH1|"


def make_value(key: str, writer: str, version: int, length: int) -> bytes:
    head = b"%s%s|%s|%d|" % (MAGIC, key.encode(), writer.encode(), version)
    head += b"%d|" % max(length, 0)
    length = max(length, len(head))
    body = hashlib.shake_256(head).digest(length - len(head)) if length > len(head) else b""
    return head + body


@dataclass(frozen=True)
class Identity:
    key: str
    writer: str
    version: int


def identify(data: bytes | memoryview) -> Identity | str:
    """The put a value came from, or a short description of why it is no well-formed value."""
    data = bytes(data)
    if not data.startswith(MAGIC):
        return f"no header ({len(data)} bytes, starts {data[:16].hex()})"
    parts = data[len(MAGIC) :].split(b"|", 4)
    if len(parts) < 5:
        return f"truncated header ({len(data)} bytes)"
    key, writer, version, length = parts[0], parts[1], parts[2], parts[3]
    try:
        ident = Identity(key.decode(), writer.decode(), int(version))
        want = int(length)
    except ValueError:
        return f"garbled header {data[:80]!r}"
    expected = make_value(ident.key, ident.writer, ident.version, want)
    if len(data) != len(expected):
        return f"torn: {len(data)} bytes, header of {ident.key}@{ident.version} says {len(expected)}"
    if data != expected:
        first = next(i for i, (a, b) in enumerate(zip(data, expected, strict=True)) if a != b)
        return f"torn: {ident.key}@{ident.version} differs from byte {first} of {len(data)}"
    return ident
