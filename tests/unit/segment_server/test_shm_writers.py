"""Writer slots: the grant socket hands each mapping client a block of them for as long as its
connection stays open, the real client announces every copy into the region in one, and the segment's
table reads them (kvtier.segment_server.shm_writers). Real listener, real region, real connector."""

from __future__ import annotations

import array
import os
import socket
import threading
from urllib.parse import quote, urlencode

import pytest

import kvtier.client.transport.shm as shm
from kvtier.client.config import ClientConfig
from kvtier.client.transport.shm import ShmConnector, request_region, request_writer_grant
from kvtier.proto.auth import CLOCK_SKEW_MS, wall_ms
from kvtier.proto.region import SLOTS_PER_BLOCK, WRITER_BLOCKS, WRITER_SLOT, WRITER_STATE, host_id, writer_slot
from kvtier.segment_server.shm_writers import WriterTable
from tests.grants import wait_until

CONFIG = ClientConfig(master="127.0.0.1:1", timeout=5.0)
ME = os.geteuid()
MiB = 1 << 20


def state_of(region, block: int, index: int = 0) -> int:
    return WRITER_STATE.unpack_from(region.header, writer_slot(block, index))[0]


# ------------------------------------------------------------------ the table


def test_blocks_go_to_one_client_each_and_come_back_idle(region):
    table = WriterTable(region.header, blocks=2)
    first, second = table.assign(), table.assign()
    assert {first, second} == {0, 1} and table.assign() is None, "two blocks, two clients"
    WRITER_SLOT.pack_into(region.header, writer_slot(first, 3), 7, 4096, 8192, 0)  # a copy left in progress
    assert table.sample().ranges == ((4096, 8192),)
    table.release(first)
    assert state_of(region, first, 3) == 0, "a released block's slots read idle: its client is gone"
    assert table.sample().ranges == () and table.assign() == first


def test_a_sample_names_copies_in_progress_and_those_past_their_grant(region):
    table = WriterTable(region.header)
    block = table.assign()
    now = wall_ms()
    WRITER_SLOT.pack_into(region.header, writer_slot(block, 0), 1, 0, 100, now + 60_000)  # within its grant
    WRITER_SLOT.pack_into(region.header, writer_slot(block, 1), 3, 4096, 200, now - 1)  # stopped past it
    WRITER_SLOT.pack_into(region.header, writer_slot(block, 2), 2, 8192, 300, now - 1)  # done: even
    sample = table.sample()
    assert sorted(sample.ranges) == [(0, 100), (4096, 200)] and sample.stalled == 1
    assert sample.sampled_ms >= now
    assert sorted(zip(sample.ranges, sample.cutoffs, strict=True)) == [((0, 100), now + 60_000), ((4096, 200), now - 1)]
    WRITER_SLOT.pack_into(region.header, writer_slot(block + 1, 0), 1, 0, 1, 0)  # a block nobody holds
    assert sorted(table.sample().ranges) == [(0, 100), (4096, 200)]


def test_a_table_starts_with_every_slot_idle_whatever_the_header_held(region):
    WRITER_SLOT.pack_into(region.header, writer_slot(5, 0), 9, 0, 4096, 0)
    table = WriterTable(region.header)
    assert state_of(region, 5) == 0 and table.capacity == WRITER_BLOCKS


# ------------------------------------------------------------------ the grant conversation


def test_a_writer_grant_holds_its_block_until_the_client_hangs_up(region, grants, sock_path):
    table = WriterTable(region.header)
    url, listener = grants.serve(sock_path, region.fileno(), region.nonce, writers=table)
    fd, connection, block = request_writer_grant(sock_path, region.nonce, ME, 5.0)
    os.close(fd)
    assert connection is not None and block == 0
    assert wait_until(lambda: listener.stats.held == 1 and table.assigned == 1)
    other_fd, other, second = request_writer_grant(sock_path, region.nonce, ME, 5.0)
    os.close(other_fd)
    assert other is not None and second == 1, "each client its own block"
    WRITER_STATE.pack_into(region.header, writer_slot(block, 0), 1)  # it dies in the middle of a copy
    connection.close()
    assert wait_until(lambda: listener.stats.held == 1 and table.assigned == 1)
    assert state_of(region, block) == 0, "the block of a client gone is idle again"
    os.close(request_region(sock_path, region.nonce, ME, 5.0))  # a reader (or an older client): no block
    # (counted on the grant loop's thread once the reply is sent: the client may read it first)
    assert wait_until(lambda: listener.stats.results["granted"] == 3) and table.assigned == 1
    other.close()
    assert wait_until(lambda: listener.stats.held == 0 and table.assigned == 0)


def test_when_every_block_is_held_a_client_is_refused_and_uses_its_next_transport(region, grants, sock_path):
    table = WriterTable(region.header, blocks=1)
    url, listener = grants.serve(sock_path, region.fileno(), region.nonce, writers=table)
    first = ShmConnector(url, CONFIG)
    try:
        with pytest.raises(shm.ConnectError, match="no_writer_slots: all 1 writer blocks are held"):
            ShmConnector(url, CONFIG)
        assert listener.stats.results["no_writer_slots"] == 1
    finally:
        first.close()
    assert wait_until(lambda: table.assigned == 0), "closing the connector gives its block back"
    ShmConnector(url, CONFIG).close()


# ------------------------------------------------------------------ the client's side


def test_every_copy_into_the_region_is_announced_from_before_its_grant_check_to_its_end(
    region, grants, sock_path, monkeypatch
):
    table = WriterTable(region.header)
    url, _ = grants.serve(sock_path, region.fileno(), region.nonce, writers=table)
    connector = ShmConnector(url, CONFIG)
    seen = []
    copy = shm._copy

    def watched(*args, **kwargs):
        seen.append(table.sample().ranges)  # what a heartbeat taken in the middle of the copy reports
        return copy(*args, **kwargs)

    monkeypatch.setattr(shm, "_copy", watched)
    expiry = wall_ms() + 60_000
    try:
        data = [os.urandom(4096), os.urandom(300 << 10)]
        assert connector.write([(0, data[0]), (1 * MiB, data[1])], caps=(expiry, [b""] * 2, 0)) == [0, 0]
        assert seen == [((0, 4096),), ((1 * MiB, 300 << 10),)], "each range is in a slot while it is copied"
        assert table.sample().ranges == (), "and no longer once copied"
        state, offset, length, cutoff = WRITER_SLOT.unpack_from(region.header, writer_slot(0, 0))
        assert (state, offset, length, cutoff) == (4, 1 * MiB, 300 << 10, expiry + CLOCK_SKEW_MS)
        # a range whose grant is over is announced too (a writer stopped before its check is seen), never copied
        seen.clear()
        assert connector.write([(0, data[0])], caps=(wall_ms() - CLOCK_SKEW_MS - 1000, [b""], 0)) == [shm._EXPIRED]
        assert seen == [] and state_of(region, 0) == 6 and table.sample().ranges == ()
        assert connector.read([(1 * MiB, 300 << 10)]) == [data[1]]
        assert seen == [], "reads announce nothing: they change no byte"
    finally:
        connector.close()


@pytest.fixture
def slotted(region, grants, sock_path):
    """A writer table served on the grant socket, and a connector holding its first block."""
    table = WriterTable(region.header)
    url, _ = grants.serve(sock_path, region.fileno(), region.nonce, writers=table)
    connector = ShmConnector(url, CONFIG)
    yield table, connector
    connector.close()


def test_writes_of_one_connector_share_its_slots_and_wait_when_all_are_in_use(region, slotted):
    _, connector = slotted
    slots = [connector._take_slot() for _ in range(SLOTS_PER_BLOCK)]  # as many threads' writes at once
    assert sorted(slots) == [writer_slot(0, i) for i in range(SLOTS_PER_BLOCK)]
    results: list[list[int]] = []
    late = threading.Thread(target=lambda: results.append(connector.write([(0, b"x" * 64)])))
    late.start()
    late.join(0.3)
    assert late.is_alive() and not results, "a ninth write waits for a slot"
    connector._give_slot(slots[3])
    late.join(5.0)
    assert results == [[0]] and state_of(region, 0, 3) == 2, "it took the slot given back"
    for slot in slots[:3] + slots[4:]:
        connector._give_slot(slot)


def test_a_copy_that_raises_leaves_no_slot_saying_it_is_still_copying(region, slotted):
    table, connector = slotted
    wrong = memoryview(array.array("i", [1, 2]))  # items of 4 bytes: not a byte buffer
    with pytest.raises((ValueError, TypeError)):
        connector.write([(0, wrong)])
    assert table.sample().ranges == () and state_of(region, 0) == 2
    assert connector.write([(0, b"ok")]) == [0] and state_of(region, 0) == 4, "the slot is in use again"


class EarlierGrantServer:
    """A grant socket as a segment of the release before writer slots answers: two words or malformed."""

    def __init__(self, path: str, region) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(4)
        self.region, self.requests = region, []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        for _ in range(2):
            conn, _ = self.listener.accept()
            with conn:
                line = conn.recv(128).partition(b"\n")[0]
                self.requests.append(line)
                if len(line.split()) != 2:
                    conn.sendall(b"ERR malformed request: expected KVTSHM1 <nonce hex>\n")
                else:
                    socket.send_fds(conn, [b"OK " + self.region.nonce.hex().encode() + b"\n"], [self.region.fileno()])

    def close(self) -> None:
        self.thread.join(10.0)
        self.listener.close()


def test_a_segment_of_an_earlier_release_is_asked_again_without_writer_slots(region, sock_path):
    earlier = EarlierGrantServer(sock_path, region)
    query = urlencode({"host": host_id(), "nonce": region.nonce.hex(), "uid": ME})
    connector = ShmConnector(f"shm://{quote(sock_path)}?{query}", CONFIG)
    try:
        assert earlier.requests == [
            b"KVTSHM1 " + region.nonce.hex().encode() + b" writer",
            b"KVTSHM1 " + region.nonce.hex().encode(),
        ]
        assert connector.write([(0, b"still same-host")]) == [0] and bytes(region.view[:15]) == b"still same-host"
        assert state_of(region, 0) == 0, "no block was granted: no slot is written"
    finally:
        connector.close()
        earlier.close()


def test_a_forked_child_does_not_keep_its_parents_block(region, slotted):
    table, connector = slotted
    assert table.assigned == 1
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # the child lives on, holding whatever it inherited, until the parent lets it go
        os.close(write_end)
        os.read(read_end, 1)
        os._exit(0)
    os.close(read_end)
    try:
        connector.close()
        assert wait_until(lambda: table.assigned == 0), "the child kept the block of a connector it cannot use"
    finally:
        os.close(write_end)
        os.waitpid(child, 0)
