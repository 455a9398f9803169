"""The test-host harness itself (tests/hosts.py, tests/faultproxy.py): the faults do what they say.

Needs root and `ip` (skipped outside CI without them, failed in CI).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.faultproxy import FaultProxy
from tests.hosts import Network

ECHO = (
    "import socket,sys\n"
    "s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);s.bind((sys.argv[1],7000));s.listen()\n"
    "print('ready',flush=True)\n"
    "while True:\n"
    "  c,_=s.accept()\n"
    "  while (d:=c.recv(65536)): c.sendall(d)\n"
    "  c.close()\n"
)
PROBE = (
    "import socket,sys\n"
    "try:\n"
    "  c=socket.create_connection((sys.argv[1],7000),timeout=1); c.sendall(b'x'); print(c.recv(1).decode())\n"
    "except OSError as e: print('cut', type(e).__name__)\n"
)


def start_echo(host) -> subprocess.Popen:
    popen = subprocess.Popen([*host.prefix(), sys.executable, "-c", ECHO, host.address], stdout=subprocess.PIPE)
    assert popen.stdout is not None and popen.stdout.readline().strip() == b"ready"
    return popen


def stop(*popens: subprocess.Popen) -> None:
    for popen in popens:
        popen.kill()
        popen.wait()
        if popen.stdout is not None:
            popen.stdout.close()


def reaches(net: Network, src: str, dst: str) -> bool:
    out = net[src].run(sys.executable, "-c", PROBE, net[dst].address, check=False).stdout
    return out.strip() == "x"


@pytest.fixture
def net():
    with Network(["a", "b", "c"]) as network:
        yield network


def test_hosts_reach_each_other_and_each_is_a_machine_of_its_own(net):
    echoes = [start_echo(net[h]) for h in "abc"]
    try:
        assert reaches(net, "a", "b") and reaches(net, "b", "c") and reaches(net, "c", "a")
        ids = {net[h].run("cat", "/etc/machine-id").stdout for h in "abc"}
        assert len(ids) == 3, "hosts share a machine id: kvtier would take shm between them"
        assert Path("/etc/machine-id").read_text() not in ids
        # the test process (the bridge's address) reaches every host too
        with socket.create_connection((net["a"].address, 7000), timeout=2) as c:
            c.sendall(b"y")
            assert c.recv(1) == b"y"
    finally:
        stop(*echoes)


def test_a_partition_cuts_exactly_one_pair_and_heals(net):
    echoes = [start_echo(net[h]) for h in "abc"]
    try:
        net.partition("a", "b")
        assert not reaches(net, "a", "b") and not reaches(net, "b", "a")
        assert reaches(net, "a", "c") and reaches(net, "c", "b") and reaches(net, "b", "c")
        net.heal_partition("a", "b")
        assert reaches(net, "a", "b") and reaches(net, "b", "a")
        net.cut("c")
        assert not reaches(net, "a", "c") and reaches(net, "a", "b")
        net.restore("c")
        assert reaches(net, "a", "c")
    finally:
        stop(*echoes)


def test_a_network_left_by_a_killed_run_is_removed_before_its_block_is_reused():
    code = (
        "import os,sys; sys.path.insert(0, '.')\n"
        "from tests.hosts import Network\n"
        "n = Network(2); print(n.block, n.tag, flush=True); os._exit(0)\n"  # no close(): like a SIGKILLed run
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    block, tag = int(out[0]), out[1]
    assert f"{tag}-h1" in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    with Network(1, block=block) as again:  # the block the killed run held
        assert again.tag == tag
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert f"{tag}-h1" not in listed
    assert tag not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_the_fault_proxy_delays_and_drops_connections(net):
    echo = start_echo(net["a"])
    try:
        with FaultProxy((net.root_address, 0), (net["a"].address, 7000), seed=1, delay_s=0.05) as proxy:
            with socket.create_connection(proxy.address, timeout=5) as c:
                t0 = time.monotonic()
                c.sendall(b"z")
                assert c.recv(1) == b"z"
                assert time.monotonic() - t0 >= 0.1  # both directions delayed
            proxy.set(loss=1.0, loss_mode="drop")
            with socket.create_connection(proxy.address, timeout=5) as c:
                c.sendall(b"z")
                try:
                    assert c.recv(1) == b""  # aborted
                except ConnectionResetError:
                    pass
            assert proxy.dropped == 1
    finally:
        stop(echo)


SEND_MIB = (
    "import socket,sys,time\n"
    "c=socket.create_connection((sys.argv[1],7000),timeout=30); data=b'x'*(1<<20); t=time.monotonic()\n"
    "c.sendall(data); got=0\n"
    "while got<len(data): got+=len(c.recv(1<<20))\n"
    "print(time.monotonic()-t)\n"
)


def test_a_rate_limit_caps_what_a_host_sends(net):
    echo = start_echo(net["b"])
    try:
        net.rate_limit("a", rate="4mbit", burst="32kb")
        assert "tbf" in net["a"].run("tc", "qdisc", "show", "dev", net["a"].ns_if).stdout
        seconds = float(net["a"].run(sys.executable, "-c", SEND_MIB, net["b"].address).stdout)
        assert seconds >= 1.5, f"1 MiB at 4 Mbit/s (2.1 s at best) took {seconds:.2f}s: not capped"
        net.heal()
        assert "tbf" not in net["a"].run("tc", "qdisc", "show", "dev", net["a"].ns_if).stdout
    finally:
        stop(echo)
