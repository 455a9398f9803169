"""The segment's DRAM index (kvtier.segment_server.dram_index): notices in, verified inventory out."""

from __future__ import annotations

import crc32c

from kvtier.proto import master_pb2 as pb
from kvtier.segment_server.dram_index import DramIndex


def notices(*items: tuple) -> pb.PollCommitsResponse:
    """items: (drop, offset, key, value_or_size[, pin, pin_ttl_ms])"""
    reply = pb.PollCommitsResponse(first_seq=1)
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
    assert index.apply(notices((False, 512, "c", c), (False, 0, "a", a), (False, 128, "b", b)), (0, 0)) == 3
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
    assert index.apply(notices((False, 0, "k", b"v")), (1, 7)) == 1
    index.set_session((0, 0))  # the link ends the mount (to snapshot and mount again)
    assert index.apply(notices((False, 64, "late", b"w")), (1, 7)) == -1
    assert [entry[0][3:] for _, entry in index.inventory()] == ["k"]


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
    (_, soft), (_, hard) = index.inventory()
    assert soft[0] == "ns\x00soft" and soft[1:6] == (32, crc32c.crc32c(value), "eng", 3, pb.PIN_SOFT)
    assert index.pin_ttl_ms(soft) == 2500 and hard[3] == "other" and index.pin_ttl_ms(hard) == 0
    index.apply(notices((False, 0, "soft", value)), (0, 0))  # committed again, unpinned: no deadline left
    (_, again), _ = index.inventory()
    assert again[5] == pb.PIN_NONE and index.pin_ttl_ms(again) == 0 and again[7] > soft[7]
    index.forget([(0, soft)])  # the older entry: the newer commit at that offset stays
    assert [entry[0] for _, entry in index.inventory()] == ["ns\x00soft", "ns\x00hard"]
    index.forget([(0, again)])
    assert [entry[0] for _, entry in index.inventory()] == ["ns\x00hard"]
