"""Finding the leading master: `MasterLocator` for clients and segment servers.

`--master` is one of
  "host:port"                      a single master;
  "h1:p1,h2:p2"                    masters tried in turn (the first until told otherwise);
  "etcd://h1:2379[,h2:2379]/CLUSTER"
                                   the leader named by the election key in etcd.

The election key `/kvtier/<cluster>/leader` and its JSON value (see
`leader_key`, `parse_leader_value`) are the contract between
`kvtier.master.election`, which writes it, and this module, which reads it.

A standby master refuses requests with gRPC UNAVAILABLE and the error text
"not the leader; leader=HOST:PORT" (HOST:PORT empty when it knows no leader);
`leader_hint` extracts the address so a caller can go straight there. Match
only on this `leader=` field, which is part of the contract, never on the rest
of the message.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time

from kvtier.common.config import EtcdSecurity
from kvtier.common.etcd_client import ETCD_SCHEME, EtcdClient, EtcdError, parse_etcd_url

logger = logging.getLogger(__name__)

# Lookups in etcd after failures are at least this far apart: a client whose
# every call fails must not turn into a load test of etcd.
MIN_LOOKUP_INTERVAL_S = 0.1

_LEADER_HINT_RE = re.compile(r"\bleader=([^\s;,]*)")


def leader_key(cluster: str) -> str:
    """The etcd key the leading master of `cluster` holds (attached to its lease)."""
    return f"/kvtier/{cluster}/leader"


def leader_value(info: dict) -> bytes:
    """Encode the leader's info ({"address", "fast_endpoint", "pid", "name"}) as stored in etcd."""
    return json.dumps(info, sort_keys=True, separators=(",", ":")).encode()


def parse_leader_value(raw: bytes) -> dict:
    """Decode the leader key's value; {} when it is not a JSON object (written by something else)."""
    try:
        info = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def leader_hint(error: str) -> str:
    """The "HOST:PORT" of `leader=HOST:PORT` in a standby's error text; "" when absent or empty."""
    match = _LEADER_HINT_RE.search(error)
    return match.group(1) if match else ""


def _check_address(address: str, spec: str) -> str:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"master address {address!r} in {spec!r} must be host:port")
    return address


class MasterLocator:
    """The current best guess of the leading master's address, and how to improve it after a failure.

    Thread-safe. Concurrent `refresh()` calls after one failure are merged: a
    refresh returns at once if the address was updated after it was called, so
    a list is rotated once, not once per failing thread, and etcd is read once.
    """

    def __init__(self, spec: str, timeout: float = 2.0, security: EtcdSecurity | None = None) -> None:
        self.spec = spec.strip()
        self._lock = threading.Lock()  # guards _address, _updated_at and the rotation
        self._updated_at = float("-inf")  # time.monotonic() of the last lookup start or rotation
        self._etcd: EtcdClient | None = None
        self._key = ""
        self._candidates: list[str] = []
        if self.spec.startswith(ETCD_SCHEME):
            endpoints, cluster = parse_etcd_url(self.spec)
            self._etcd = EtcdClient(endpoints, timeout, security)
            self._key = leader_key(cluster)
            self._address = ""
            self._looked_up = False
        else:
            self._candidates = [_check_address(a.strip(), spec) for a in self.spec.split(",") if a.strip()]
            if not self._candidates:
                raise ValueError(f"--master {spec!r} names no master")
            self._address = self._candidates[0]
            self._looked_up = True

    @property
    def is_multi(self) -> bool:
        """True when the master can move: etcd discovery or more than one listed address."""
        return self._etcd is not None or len(self._candidates) > 1

    @property
    def address(self) -> str:
        """The address to try, "" when etcd names no leader (none elected, or etcd unreachable).

        With etcd, the first access reads the leader key; later ones return the
        cached answer until `refresh()`.
        """
        if not self._looked_up:
            with self._lock:
                if not self._looked_up:
                    self._lookup()
        return self._address

    def refresh(self, hint: str = "") -> str:
        """Pick a new address after a failure with the current one, and return it.

        A `hint` (the leader a standby named, see `leader_hint`) wins. Otherwise
        etcd is read again (at most every MIN_LOOKUP_INTERVAL_S: a call sooner
        waits), or the next listed address is taken. A single address stays.
        """
        called_at = time.monotonic()
        with self._lock:
            if hint:
                self._address = hint
                self._updated_at = time.monotonic()
                return hint
            if self._updated_at >= called_at:
                return self._address  # another thread refreshed after our failure: its answer is fresh
            if self._etcd is not None:
                wait = self._updated_at + MIN_LOOKUP_INTERVAL_S - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                self._lookup()
            elif len(self._candidates) > 1:
                index = self._candidates.index(self._address) if self._address in self._candidates else -1
                self._address = self._candidates[(index + 1) % len(self._candidates)]
                self._updated_at = time.monotonic()
            return self._address

    def _lookup(self) -> None:
        """Read the leader key into `_address`; keep the old guess if etcd fails. Holds `_lock`."""
        assert self._etcd is not None
        self._updated_at = time.monotonic()
        self._looked_up = True
        try:
            current = self._etcd.get(self._key)
        except EtcdError as e:
            logger.warning("master lookup in etcd failed key=%s error=%s", self._key, e)
            return
        address = parse_leader_value(current.value).get("address", "") if current else ""
        address = address if isinstance(address, str) else ""
        if address != self._address:
            logger.info("master leader key=%s address=%s", self._key, address or "(none)")
        self._address = address

    def close(self) -> None:
        if self._etcd is not None:
            self._etcd.close()

    def __repr__(self) -> str:
        return f"MasterLocator({self.spec!r}, address={self._address!r})"
