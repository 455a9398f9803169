"""Network namespaces for tests: a process on its own "host" whose link can be cut.

`NetNs` creates a namespace joined to the root namespace by a veth pair, with
addresses from 198.51.100.0/24 (TEST-NET-2, never routed: nothing outside the
pair receives traffic), and deletes both on `close()`. `link_down()` /
`link_up()` cut and restore the link from the root side, which is what a
partition looks like to both ends: packets vanish, no connection is reset.

Needs root and `ip` (iproute2). `require_netns()` skips a test where they are
missing, and fails it under CI=true, where a skip would hide a broken setup.

Grows into a multi-host harness by creating more than one: each instance
takes its own /30 from the block (`index` 0..63).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid

import pytest

_PREFIX = "198.51.100."


def netns_unavailable() -> str:
    """Why namespaces cannot be made here ("" when they can)."""
    if os.geteuid() != 0:
        return "needs root (ip netns, veth pairs)"
    if shutil.which("ip") is None:
        return "needs the ip command (iproute2)"
    return ""


def require_netns() -> None:
    reason = netns_unavailable()
    if reason:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"network namespace tests cannot run in CI: {reason}")
        pytest.skip(reason)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


class NetNs:
    """One namespace and its veth link to the root namespace: host side .1, namespace side .2 of a /30."""

    def __init__(self, index: int = 0) -> None:
        if not 0 <= index < 64:
            raise ValueError("index must be in 0..63 (a /30 each in 198.51.100.0/24)")
        tag = uuid.uuid4().hex[:6]
        self.name = f"kvt-{tag}"
        self.host_if = f"kvh{tag}"  # interface names: at most 15 bytes
        self.ns_if = f"kvn{tag}"
        base = index * 4
        self.host_address = f"{_PREFIX}{base + 1}"
        self.address = f"{_PREFIX}{base + 2}"
        self._created = False
        try:
            _ip("netns", "add", self.name)
            self._created = True
            _ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
            _ip("link", "set", self.ns_if, "netns", self.name)
            _ip("addr", "add", f"{self.host_address}/30", "dev", self.host_if)
            _ip("link", "set", self.host_if, "up")
            self.exec_ip("addr", "add", f"{self.address}/30", "dev", self.ns_if)
            self.exec_ip("link", "set", self.ns_if, "up")
            self.exec_ip("link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def exec_ip(self, *args: str) -> None:
        _ip("netns", "exec", self.name, "ip", *args)

    def prefix(self) -> list[str]:
        """The command prefix that runs a program inside the namespace."""
        return ["ip", "netns", "exec", self.name]

    def link_down(self) -> None:
        _ip("link", "set", self.host_if, "down")

    def link_up(self) -> None:
        _ip("link", "set", self.host_if, "up")

    def close(self) -> None:
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True, timeout=10)
        if self._created:
            subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=10)
            self._created = False

    def __enter__(self) -> NetNs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
