"""The segment's DRAM index (kvtier.segment_server.dram_index): notices in, verified inventory out."""

from __future__ import annotations

import tracemalloc

import crc32c

from kvtier.proto import master_pb2 as pb
from kvtier.segment_server.dram_index import DramIndex, report_dram_inventory

_SEQ = [0]  # the last sequence number handed out: each reply comes after the one before, as a feed's


def notices(*items: tuple) -> pb.PollCommitsResponse:
    """items: (drop, offset, key, value_or_size[, pin, pin_ttl_ms]), numbered after the last reply's."""
    reply = pb.PollCommitsResponse(first_seq=_SEQ[0] + 1)
    _SEQ[0] += len(items)
    for drop, offset, key, value, *pin in items:
        size = value if isinstance(value, int) else len(value)
        reply.drops.append(drop)
        reply.offsets.append(offset)
        reply.sizes.append(size)
        reply.checksums.append(0 if isinstance(value, int) else crc32c.crc32c(value))
        reply.names.append("ns\x00" + key)
        reply.instances.append("eng")
        reply.ranks.append(3)
        reply.pins.append(pin[0] if pin else pb.PIN_NONE)
        reply.pin_ttl_ms.append(pin[1] if pin else 0)
    return reply


def test_inventory_reports_verified_entries_by_offset_and_drops_what_no_longer_verifies():
    region = bytearray(4096)
    index = DramIndex(memoryview(region), clock=lambda: 100.0)
    a, b, c = b"a" * 100, b"b" * 64, b"c" * 10
    region[0:100], region[128:192], region[512:522] = a, b, c
    reply = notices((False, 512, "c", c), (False, 0, "a", a), (False, 128, "b", b))
    assert index.apply(reply, (0, 0)) == reply.first_seq + 2  # the last notice applied
    index.apply(notices((False, 1024, "gone", b"x" * 8), (True, 1024, "gone", b"x" * 8)), (0, 0))
    index.apply(notices((False, 0, "empty", b"", pb.PIN_SOFT, 5000), (False, 0, "empty2", b"")), (0, 0))
    region[130] = 0  # b's bytes were overwritten (its drop notice was lost with a master)
    inventory = index.inventory()
    expected = [(0, "empty"), (0, "empty2"), (0, "a"), (512, "c")]
    assert [(offset, entry[0][3:]) for offset, entry in inventory] == expected
    assert inventory[0][1][5] == pb.PIN_SOFT and index.pin_ttl_ms(inventory[0][1]) == 5000
    assert inventory[2][1][3:5] == ("eng", 3)
    assert len(index) == 4, "the entry that failed verification left the index"


def test_of_two_overlapping_entries_the_newer_is_kept_and_a_drop_removes_by_offset():
    region = bytearray(4096)
    index = DramIndex(memoryview(region))
    old, new = b"o" * 256, b"n" * 64
    region[0:256] = old
    index.apply(notices((False, 0, "old", old)), (0, 0))
    region[128:192] = new  # reused without the old one's drop: both could be checked...
    index.apply(notices((False, 128, "new", new)), (0, 0))
    assert [entry[0][3:] for _, entry in index.inventory()] == ["new"]
    index.apply(notices((True, 128, "new", new)), (0, 0))
    assert index.inventory() == [] and len(index) == 0


def test_an_entry_past_the_region_is_never_reported():
    index = DramIndex(memoryview(bytearray(1024)))
    index.apply(notices((False, 1000, "far", 100)), (0, 0))
    assert index.inventory() == [] and len(index) == 0


def test_notices_of_an_old_mount_are_not_applied_once_the_session_changed():
    region = bytearray(1024)
    region[0:1] = b"v"
    index = DramIndex(memoryview(region))
    index.set_session((1, 7))
    reply = notices((False, 0, "k", b"v"))
    assert index.apply(reply, (1, 7)) == reply.first_seq  # the last notice applied
    index.set_session((0, 0))  # the link ends the mount (to snapshot and mount again)
    assert index.apply(notices((False, 64, "late", b"w")), (1, 7)) == -1
    assert index.apply_relayed(notices((False, 64, "late", b"w")), (1, 7)) is False
    assert [entry[0][3:] for _, entry in index.inventory()] == ["k"]
    assert index.applied == 0  # a new session numbers its notices from 1


def seq_notices(first_seq: int, *items: tuple) -> pb.PollCommitsResponse:
    reply = notices(*items)
    reply.first_seq = first_seq
    return reply


def test_notices_arrive_by_two_roads_and_each_is_applied_once_in_order():
    """The feed's polls and RelayPutEnd answers carry the same numbered notices: a notice already
    applied is skipped (re-applying a commit after its drop would bring a removed object back), and
    a relayed answer whose earlier notices are not applied yet is not applied out of order."""
    region = bytearray(1024)
    region[0:2], region[64:66] = b"v1", b"v2"
    index = DramIndex(memoryview(region))
    index.set_session((3, 9))
    assert index.apply(seq_notices(1, (False, 0, "a", b"v1")), (3, 9)) == 1
    # Relayed: commit b at 64 (seq 2) then drop it (seq 3), both from one answer.
    assert index.apply_relayed(seq_notices(2, (False, 64, "b", b"v2"), (True, 64, "b", b"v2")), (3, 9)) is True
    assert index.applied == 3
    # The feed's poll, answered before the relay's, brings seq 2 alone late: it must not revive b.
    assert index.apply(seq_notices(2, (False, 64, "b", b"v2")), (3, 9)) == 3
    assert [entry[0][3:] for _, entry in index.inventory()] == ["a"]
    # A relayed answer starting at seq 6 while 4 and 5 are not applied: refused, nothing changes.
    assert index.apply_relayed(seq_notices(6, (False, 64, "c", b"v2")), (3, 9)) is False
    assert index.applied == 3 and len(index) == 1
    # The feed brings 4..6 (6 among them): applied in order; the relayed answer is then done already.
    feed = seq_notices(4, (True, 0, "a", b"v1"), (False, 0, "d", b"v1"), (False, 64, "c", b"v2"))
    assert index.apply(feed, (3, 9)) == 6
    assert index.apply_relayed(seq_notices(6, (False, 64, "c", b"v2")), (3, 9)) is True
    assert sorted(entry[0][3:] for _, entry in index.inventory()) == ["c", "d"]
    assert index.session_and_applied() == ((3, 9), 6)


def test_totals_follow_commits_replacements_drops_forgets_and_clears():
    """What the master's accounting is checked against (kvtier_segment_indexed_objects / _bytes)."""
    region = bytearray(4096)
    index = DramIndex(memoryview(region))
    a, b = b"a" * 100, b"b" * 64
    region[0:100], region[128:192] = a, b
    index.apply(notices((False, 0, "a", a), (False, 128, "b", b), (False, 0, "empty", b"")), (0, 0))
    assert index.totals() == (3, 164)
    index.apply(notices((False, 128, "b2", 32)), (0, 0))  # the same offset committed anew
    assert index.totals() == (3, 132)
    index.apply(notices((True, 0, "a", a), (True, 0, "gone", 8)), (0, 0))  # a drop of nothing changes nothing
    assert index.totals() == (2, 32)
    index.inventory()  # b2's bytes do not verify (checksum 0): forgotten
    assert index.totals() == (1, 0)
    index.clear()
    assert index.totals() == (0, 0)


def test_entries_keep_owner_pin_and_deadline_and_forget_spares_a_newer_commit():
    region = bytearray(4096)
    index = DramIndex(memoryview(region), clock=lambda: 100.0)
    value = b"p" * 32
    region[0:32] = region[64:96] = value
    pinned = notices((False, 0, "soft", value, pb.PIN_SOFT, 2500), (False, 64, "hard", value, pb.PIN_HARD, 0))
    pinned.instances[1] = "other"
    index.apply(pinned, (0, 0))
    older = index.plan()
    (_, soft), (_, hard) = index.inventory()
    assert soft[0] == "ns\x00soft" and soft[1:6] == (32, crc32c.crc32c(value), "eng", 3, pb.PIN_SOFT)
    assert index.pin_ttl_ms(soft) == 2500 and hard[3] == "other" and index.pin_ttl_ms(hard) == 0
    index.apply(notices((False, 0, "soft", value)), (0, 0))  # committed again, unpinned: no deadline left
    newer = index.plan()
    (_, again), _ = index.inventory()
    assert again[5] == pb.PIN_NONE and index.pin_ttl_ms(again) == 0 and again[7] > soft[7]
    index.forget_planned([(0, older.packed[0])])  # the older entry: the newer commit at that offset stays
    assert [entry[0] for _, entry in index.inventory()] == ["ns\x00soft", "ns\x00hard"]
    index.forget_planned([(0, newer.packed[0])])
    assert [entry[0] for _, entry in index.inventory()] == ["ns\x00hard"]


def test_an_entry_costs_at_most_130_bytes_beside_its_name():
    """Issue 19: the index was a tuple of eight objects per entry (about 360 B traced beside the
    name); packed, one bytes object (24-byte header + name) in one dict keyed by offset."""
    count = 20_000
    index = DramIndex(memoryview(bytearray(64)))
    reply = pb.PollCommitsResponse(first_seq=1)
    reply.offsets.extend(i << 20 for i in range(1, count + 1))  # offsets past the small-int cache
    reply.sizes.extend([65536] * count)
    reply.checksums.extend(0x9E37_79B9 * (i + 1) & 0xFFFF_FFFF for i in range(count))  # not a cached int
    reply.drops.extend([False] * count)
    names = [f"ns\x00{i:016x}" for i in range(count)]
    reply.names.extend(names)
    reply.instances.extend(["engine-instance-0"] * count)
    reply.ranks.extend([1] * count)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index.apply(reply, (0, 0))
        per_entry = (tracemalloc.get_traced_memory()[0] - before) / count - len(names[0])
    finally:
        tracemalloc.stop()
    assert len(index) == count and per_entry <= 130, per_entry


def test_every_field_reads_back_beside_entries_that_fail_and_zero_size_ones():
    """The inventory is read column-wise from the packed headers: the columns stay aligned when
    entries in the middle fail, for several owners and pins, zero-size entries among them."""
    region = bytearray(8192)
    index = DramIndex(memoryview(region), clock=lambda: 100.0)
    values = [bytes([65 + i]) * (16 + i) for i in range(8)]
    reply = notices(*((False, 512 * i, f"k{i}", value) for i, value in enumerate(values)))
    for i, value in enumerate(values):
        region[512 * i : 512 * i + len(value)] = value
        reply.instances[i] = f"engine-{i % 3}"
        reply.ranks[i] = i
        reply.pins[i] = (pb.PIN_NONE, pb.PIN_SOFT, pb.PIN_HARD)[i % 3]
        reply.pin_ttl_ms[i] = 1000 * (i + 1) if i % 3 == 1 else 0
    index.apply(reply, (0, 0))
    index.apply(notices((False, 0, "zero", b"", pb.PIN_SOFT, 7000)), (0, 0))
    region[512 * 2] ^= 1  # k2 and k5 no longer verify
    region[512 * 5 + 3] ^= 1
    inventory = index.inventory()
    kept = [0, 1, 3, 4, 6, 7]
    assert [entry[0] for _, entry in inventory] == ["ns\x00zero"] + [f"ns\x00k{i}" for i in kept]
    (zero_offset, zero), *rest = inventory
    assert zero_offset == 0 and zero[1:6] == (0, 0, "eng", 3, pb.PIN_SOFT) and index.pin_ttl_ms(zero) == 7000
    for i, (offset, entry) in zip(kept, rest, strict=True):
        name, size, checksum, instance, rank, pin, _, _ = entry
        assert (offset, size, checksum) == (512 * i, len(values[i]), crc32c.crc32c(values[i]))
        assert (instance, rank, pin) == (f"engine-{i % 3}", i, (pb.PIN_NONE, pb.PIN_SOFT, pb.PIN_HARD)[i % 3])
        assert index.pin_ttl_ms(entry) == (1000 * (i + 1) if i % 3 == 1 else 0)
    assert index.totals() == (7, sum(len(values[i]) for i in kept)), "the failed entries left the index"


def test_entries_that_touch_each_other_and_the_region_end_are_kept():
    """Planning's fast check: an entry may end exactly where the next begins, or at the region's end."""
    region = bytearray(256)
    region[:] = bytes(range(256))
    index = DramIndex(memoryview(region))
    first, last = bytes(region[0:192]), bytes(region[192:256])
    index.apply(notices((False, 192, "last", last), (False, 0, "first", first)), (0, 0))
    assert [(offset, entry[0][3:]) for offset, entry in index.inventory()] == [(0, "first"), (192, "last")]
    index.apply(notices((False, 191, "overlaps both", bytes(region[191:193]))), (0, 0))
    assert [entry[0][3:] for _, entry in index.inventory()] == ["overlaps both"], "the newest wins, older neighbours go"
    assert len(index) == 1


def test_the_last_mounted_session_and_how_far_it_applied_outlive_resets_until_the_next_mount():
    """What the next MountSegmentRequest says (previous_segment_id, previous_epoch, previous_applied_seq):
    the master releases from the segment's fence the names whose notices its index applied. A mount may
    take several tries, each resetting the session and maybe clearing the index: the last *mounted*
    session is kept."""
    region = bytearray(1024)
    region[0:2] = b"v1"
    index = DramIndex(memoryview(region))
    assert index.previous_session() == ((0, 0), 0)
    index.set_session((4, 9))
    index.apply(seq_notices(1, (False, 0, "a", b"v1"), (False, 64, "b", 2)), (4, 9))
    index.set_session((0, 0))  # the heartbeat heard SEGMENT_NOT_FOUND
    index.set_session((0, 0))  # each mount try resets again
    index.clear()  # and a refused mount may empty the index
    assert index.previous_session() == ((4, 9), 2)
    index.set_session((5, 9))  # mounted again: nothing applied under it yet
    assert index.previous_session() == ((4, 9), 2)
    index.set_session((0, 0))
    assert index.previous_session() == ((5, 9), 0)


class _Master:
    """Takes ReportDramObjects requests (a unit test's stand-in for the master's stub)."""

    def __init__(self) -> None:
        self.requests: list[pb.DramObjectsRequest] = []

    def ReportDramObjects(self, request, timeout):  # noqa: N802 (the RPC's name)
        self.requests.append(request)
        return pb.KeyStatusResponse(status=0, statuses=[0] * len(request.keys))


def test_a_group_members_tag_is_kept_reported_and_leaves_with_its_entry():
    """A commit notice naming a group (kvtier.master.groups) leaves its id and member count in the
    index; the inventory reports them beside the entry, so a new master forms the group again. A drop,
    a newer commit at the same place, a failed check or a clear take the tag with the entry."""
    region = bytearray(8192)
    index = DramIndex(memoryview(region), clock=lambda: 100.0)
    values = [bytes([65 + i]) * 32 for i in range(5)]
    for i, value in enumerate(values):
        region[512 * i : 512 * i + 32] = value
    reply = notices(*((False, 512 * i, f"k{i}", value) for i, value in enumerate(values)))
    reply.group_ids.extend([77, 77, 0, 99, 99])
    reply.group_sizes.extend([2, 2, 0, 3, 3])
    index.apply(reply, (0, 0))
    index.apply(notices((False, 0, "zero", b"")), (0, 0))  # untagged, zero-size: reported with (0, 0)
    tagged = notices((False, 0, "zero2", b""))
    tagged.group_ids.append(99)
    tagged.group_sizes.append(3)
    index.apply(tagged, (0, 0))
    index.apply(notices((True, 512 * 4, "k4", values[4])), (0, 0))  # k4 dropped
    region[512] ^= 1  # k1 fails its check
    master = _Master()
    report_dram_inventory(master, 1, 1, index, index.plan())
    (request,) = master.requests
    reported = dict(zip(request.keys, zip(request.group_ids, request.group_sizes, strict=True), strict=True))
    assert reported == {"zero": (0, 0), "zero2": (99, 3), "k0": (77, 2), "k2": (0, 0), "k3": (99, 3)}
    # a newer commit at k0's place, naming no group, replaces the tag with its entry
    region[0:32] = b"z" * 32
    index.apply(notices((False, 0, "new", b"z" * 32)), (0, 0))
    master = _Master()
    report_dram_inventory(master, 1, 1, index, index.plan())
    (request,) = master.requests
    assert dict(zip(request.keys, request.group_ids, strict=True))["new"] == 0
    assert len(index._groups) == 2, "k0's, k1's and k4's tags left with their entries"
    index.clear()
    assert not index._groups


def test_an_inventory_of_no_group_member_sends_no_group_columns():
    region = bytearray(4096)
    index = DramIndex(memoryview(region))
    region[0:8] = b"x" * 8
    index.apply(notices((False, 0, "k", b"x" * 8)), (0, 0))
    master = _Master()
    report_dram_inventory(master, 1, 1, index, index.plan())
    assert not master.requests[0].group_ids and not master.requests[0].group_sizes
