"""Credentials shared by every kvtier process: secrets, principal tokens, data-plane capabilities.

Secrets. A cluster secret (and, for tenants, a secret per tenant) is read from a
file or from the `KVTIER_SECRET` environment variable, never from a command-line
argument (process listings show those). A secret file must not be open to every
user (group access is allowed: a Kubernetes Secret volume is group-readable by
the pod's fsGroup); a secret is at least 16 bytes (surrounding whitespace is cut).

Principals. Every gRPC call and fast-path connection to the master carries a
token `v1:<principal>:<tag>`, tag = HMAC-SHA256(secret, "kvtier-auth|" +
principal): the master recomputes it from the secret it holds for that
principal. `cluster` is the principal of the cluster secret (segment servers,
operators, engines trusted with every namespace); a tenant's token uses the
tenant's own secret and its name. The token is a bearer credential: anyone who
sees it can replay it, so put the master behind TLS (`tls_*` options) on any
network you do not trust.

Capabilities. A segment server reads or writes its region only for a frame that
carries, per range, a tag minted by the master for exactly that segment, range,
operation and expiry: blake2b(key=capability key, op | expiry_ms | offset |
length, 16 bytes). The capability key of a segment is derived from the cluster
secret, the segment's name and the master's epoch, so both sides compute it
without sending it, and a new master incarnation (or a remount) invalidates every
earlier tag. Expiry is the read lease's end (reads) or the put deadline
(writes), in the master's wall clock, milliseconds; the segment refuses a tag
past its expiry (with the clock skew allowance below).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
import struct
import time
from collections.abc import Sequence

MIN_SECRET_BYTES = 16
TOKEN_VERSION = "v1"
CLUSTER_PRINCIPAL = "cluster"
AUTH_METADATA = "authorization"  # gRPC metadata key (lower case, as gRPC requires)
TAG_BYTES = 16
# Clock skew tolerated between the master that mints a tag and the segment that checks it.
CLOCK_SKEW_MS = 2_000

_CAP = struct.Struct("<BQQQ")  # op, expiry_ms, offset, length


class SecretError(ValueError):
    """A secret that cannot be used (missing, unreadable, too short, too open): one line for the user."""


def read_secret(path: str = "", *, env: str = "KVTIER_SECRET") -> bytes | None:
    """The secret from `path` (a file only its owner can read), else from the environment variable
    `env`, else None (no secret configured)."""
    if path:
        try:
            info = os.stat(path)
            with open(path, "rb") as f:
                raw = f.read(1 << 16)
        except OSError as exc:
            raise SecretError(f"cannot read secret file {path}: {exc.strerror}") from None
        if info.st_mode & stat.S_IRWXO:  # group access is the service's business (Kubernetes fsGroup)
            raise SecretError(
                f"secret file {path} is open to every user (mode {stat.S_IMODE(info.st_mode):o}): chmod o-rwx "
                "(e.g. 600, or 640 for the service's group)"
            )
        secret = raw.strip()
        source = f"secret file {path}"
    elif os.environ.get(env):
        secret = os.environ[env].strip().encode()
        source = f"${env}"
    else:
        return None
    if len(secret) < MIN_SECRET_BYTES:
        raise SecretError(
            f"{source} holds {len(secret)} bytes; a secret needs at least {MIN_SECRET_BYTES} "
            "(e.g. `openssl rand -hex 32`)"
        )
    return secret


def principal_problem(name: str) -> str:
    if not name or len(name) > 64 or not all(c.isalnum() or c in "_-." for c in name):
        return f"principal {name!r} must be 1-64 of A-Za-z0-9_.-"
    return ""


def _tag(secret: bytes, principal: str) -> str:
    return hmac.new(secret, b"kvtier-auth|" + principal.encode(), hashlib.sha256).hexdigest()


def make_token(secret: bytes, principal: str = CLUSTER_PRINCIPAL) -> str:
    """The bearer token a process presents to the master as `principal`."""
    return f"{TOKEN_VERSION}:{principal}:{_tag(secret, principal)}"


def token_principal(token: str) -> str:
    """The principal a token claims ("" when it is not a kvtier token); not yet verified."""
    version, _, rest = token.partition(":")
    principal, sep, _tag_hex = rest.partition(":")
    return principal if version == TOKEN_VERSION and sep else ""


def verify_token(token: str, secrets_by_principal: dict[str, bytes]) -> str:
    """The principal `token` proves, or "" (unknown principal, wrong secret, malformed)."""
    principal = token_principal(token)
    secret = secrets_by_principal.get(principal)
    if secret is None:
        return ""
    expected = make_token(secret, principal)
    return principal if hmac.compare_digest(token.encode(), expected.encode()) else ""


# ------------------------------------------------------------------ capabilities


def capability_key(secret: bytes, segment_name: str, epoch: int, incarnation: str = "", session: int = 0) -> bytes:
    """The key of a segment's data-plane capability tags: per segment name, master epoch, segment
    incarnation (its region's nonce) and mount session (kvtier.proto.frames.mount_session), so
    neither a new master, nor a restarted segment under the same name, nor a segment mounted again
    accepts a tag minted before."""
    # session 0 (a segment or master from before mount sessions): the key as it was derived then
    suffix = f"|{session}" if session else ""
    return hmac.new(
        secret, f"kvtier-cap|{segment_name}|{epoch}|{incarnation}{suffix}".encode(), hashlib.sha256
    ).digest()


class CapabilityKey:
    """A segment's capability key, ready to mint and check tags (a keyed hash copied per tag:
    half the cost of keying a new one, ~0.8 us per range)."""

    __slots__ = ("_base",)

    def __init__(self, key: bytes) -> None:
        self._base = hashlib.blake2b(key=key, digest_size=TAG_BYTES)

    def tag(self, op: int, expiry_ms: int, offset: int, length: int) -> bytes:
        h = self._base.copy()
        h.update(_CAP.pack(op, expiry_ms, offset, length))
        return h.digest()

    def tags(self, op: int, expiry_ms: int, flat_ranges: Sequence[int]) -> bytes:
        """Tags of the (offset, length, offset, length, ...) ranges, concatenated, in order."""
        base, pack = self._base, _CAP.pack
        out = []
        for i in range(0, len(flat_ranges), 2):
            h = base.copy()
            h.update(pack(op, expiry_ms, flat_ranges[i], flat_ranges[i + 1]))
            out.append(h.digest())
        return b"".join(out)

    def check(
        self, op: int, expiry_ms: int, flat_ranges: Sequence[int], tags: bytes | memoryview, now_ms: int | None = None
    ) -> str:
        """ "" when every range carries its tag for `op` and the expiry has not passed; else why not."""
        if now_ms is None:
            now_ms = wall_ms()
        if expiry_ms + CLOCK_SKEW_MS < now_ms:
            return f"capability expired {now_ms - expiry_ms} ms ago"
        count = len(flat_ranges) // 2
        if count == 0:  # nothing granted: a block without ranges proves nothing (it would open a COMMIT)
            return "a capability block that names no range"
        if len(tags) != count * TAG_BYTES:
            return f"{len(tags)} bytes of tags for {count} ranges"
        if not hmac.compare_digest(self.tags(op, expiry_ms, flat_ranges), bytes(tags)):
            return "capability does not match the ranges (forged, or minted for another segment, range or operation)"
        return ""


def wall_ms() -> int:
    return int(time.time() * 1000)
