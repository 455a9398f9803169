"""Every listener binds exactly the address it is given (issue 8): checked from the kernel's own
socket tables for every process of a cluster, never from what the processes report."""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from pathlib import Path

import pytest

LISTEN = "0A"  # TCP state in /proc/net/tcp


def _hex_address(text: str) -> tuple[str, int]:
    host, port = text.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        address = socket.inet_ntop(socket.AF_INET, struct.pack("<I", int(host, 16)))
    else:  # four little-endian 32-bit words
        words = struct.unpack("<4I", raw)
        v6 = ipaddress.IPv6Address(struct.pack(">4I", *words))
        # gRPC listens on an AF_INET6 socket bound to the v4-mapped address: the same single address.
        address = str(v6.ipv4_mapped or v6)
    return address, int(port, 16)


def _socket_inodes(pid: int) -> set[str]:
    """The inodes of the process's sockets, each fd read once: one closed meanwhile is skipped (CI drew
    a FileNotFoundError when a second read of an fd came after its close)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def listening_addresses(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket the process has in LISTEN state."""
    inodes = _socket_inodes(pid)
    found = set()
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == LISTEN and fields[9] in inodes:
                found.add(_hex_address(fields[1]))
    return found


def udp_sockets(pid: int) -> int:
    inodes = _socket_inodes(pid)
    count = 0
    for table in ("udp", "udp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        if path.exists():
            count += sum(1 for line in path.read_text().splitlines()[1:] if line.split()[9] in inodes)
    return count


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2"])
def test_every_listener_of_a_cluster_binds_exactly_the_given_address(bare_cluster, host):
    bare_cluster.start_master("--listen", f"{host}:0", "--metrics", f"{host}:0")
    bare_cluster.start_segment("seg0", "16MiB", "--listen", f"{host}:0", "--metrics", f"{host}:0")
    with bare_cluster.client() as client:  # exercise every path once: listeners opened lazily would show
        client.put("k", b"v")
        assert client.get("k") == b"v"
        master, segment = bare_cluster.master, bare_cluster.segments["seg0"]
        master_listeners = listening_addresses(master.popen.pid)
        segment_listeners = listening_addresses(segment.popen.pid)
    expected_master = {
        ("ip", master.info["address"]),
        ("ip", master.info["fast_endpoint"].split("://")[-1]),
        ("ip", master.info["metrics"]),
    }
    assert {("ip", f"{a}:{p}") for a, p in master_listeners} == expected_master
    tcp_endpoints = [e.split("://", 1)[1] for e in segment.info["endpoints"] if e.startswith("tcp://")]
    expected_segment = {("ip", e) for e in tcp_endpoints} | {("ip", segment.info["metrics"])}
    assert {("ip", f"{a}:{p}") for a, p in segment_listeners} == expected_segment
    for address, _port in master_listeners | segment_listeners:
        assert ipaddress.ip_address(address) == ipaddress.ip_address(host), "bound to another address"
    assert udp_sockets(master.popen.pid) == 0 and udp_sockets(segment.popen.pid) == 0


def test_a_wildcard_listener_is_advertised_under_the_given_host(bare_cluster):
    insecure = ("--allow-insecure", "true")  # every interface, no secret: only on a trusted network
    bare_cluster.start_master("--listen", "0.0.0.0:0", "--advertise", "127.0.0.1:1", *insecure)  # fast path: that host
    assert bare_cluster.master.info["fast_endpoint"].startswith("tcp://127.0.0.1:")
    seg = bare_cluster.start_segment("seg0", "16MiB", "--listen", "0.0.0.0:0", "--advertise", "127.0.0.1", *insecure)
    tcp = [e for e in seg.info["endpoints"] if e.startswith("tcp://")]
    assert len(tcp) == 1 and tcp[0].startswith("tcp://127.0.0.1:")
    assert ("0.0.0.0", int(tcp[0].rsplit(":", 1)[1])) in listening_addresses(seg.popen.pid)
    with bare_cluster.client(transport="tcp") as client:  # reaches the data plane at the advertised host
        client.put("k", b"v" * 1000)
        assert client.get("k", with_source=True) == (b"v" * 1000, "dram/tcp")
