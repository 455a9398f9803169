"""Read-only views for ops tooling (kvtier.master.inspection): scenarios on a fake clock.

Given objects put, pending, pinned, leased or offloaded, when they are listed
or inspected, then the answer says what the tables hold, and nothing changed:
no lease, no recency, no promotion read. Every scenario ends by checking the
books (`assert_consistent`). The handlers' plumbing of ListKeys, StatKeys
and the new Status counters is checked at the end, without sockets.
"""

from __future__ import annotations

import pytest

from kvtier.master.handlers import MasterHandlers
from kvtier.master.inspection import (
    DEFAULT_LIST_LIMIT,
    MAX_LIST_LIMIT,
    disk_only_hits,
    list_keys,
    stat_keys,
)
from kvtier.master.records import PIN_HARD, PIN_NONE, PIN_SOFT, TIER_DRAM, TIER_SSD, replica_offset
from kvtier.master.state import MasterState, PutOptions
from kvtier.proto import master_pb2 as pb
from kvtier.proto.status import Status
from tests.unit.master.accounting import assert_consistent
from tests.unit.master.test_eviction import LEASE_S, NS, KiB, make_state, put, read
from tests.unit.master.test_state import FakeClock, mount
from tests.unit.master.test_tiering import offloaded_k0

OK = Status.OK


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def state(clock: FakeClock) -> MasterState:
    state = make_state(clock)
    mount(state, "a", 1 << 20)
    mount(state, "b", 1 << 20)
    return state


def keys_of(page) -> list[str]:
    return [entry.key for entry in page.entries]


def untouched(state: MasterState):
    """What reading must not change: recency order, leases, promotion reads, pins."""
    return (
        list(state._objects),
        list(state._disk_only),
        [(r.lease_until, r.pin_until) for r in state.records()],
        dict(state.tiering._disk_reads),
    )


def pending(state: MasterState, key: str, namespace: str = NS) -> None:
    assert state.put_start(namespace, [key], [KiB], 1).statuses == [OK]


# ---------------------------------------------------------------- list_keys


def test_listing_gives_exactly_the_prefix_of_one_namespace_in_key_order(state):
    # given keys under a prefix, next to it, and under the same prefix in another namespace
    for key in ("p/3", "p/1", "p/10", "p/2", "q/1", "p", "pp/1"):
        put(state, key)
    started = state.put_start("other", ["p/4"], [KiB], 1)
    state.put_end("other", ["p/4"], [1], started.put_id)
    before = untouched(state)
    # when the prefix is listed
    page = list_keys(state, NS, "p/")
    # then exactly its keys come, in code point order, and the listing is done
    assert keys_of(page) == ["p/1", "p/10", "p/2", "p/3"]
    assert page.next_start_after == ""
    assert keys_of(list_keys(state, NS)) == ["p", "p/1", "p/10", "p/2", "p/3", "pp/1", "q/1"]
    assert keys_of(list_keys(state, "other", "p/")) == ["p/4"]
    assert keys_of(list_keys(state, NS, "nothing/")) == []
    # and listing changed nothing
    assert untouched(state) == before
    assert_consistent(state)


def test_entries_carry_size_tiers_and_the_pin_in_force(state, clock):
    put(state, "plain", size=1000, replicas=2)
    put(state, "hard", pin=PIN_HARD)
    put(state, "soft", pin=PIN_SOFT, pin_ttl_s=10.0)
    entries = {e.key: e for e in list_keys(state, NS).entries}
    assert (entries["plain"].size, entries["plain"].dram_replicas, entries["plain"].ssd_replicas) == (1000, 2, 0)
    assert not entries["plain"].pending
    assert [entries[k].pin for k in ("plain", "hard", "soft")] == [PIN_NONE, PIN_HARD, PIN_SOFT]
    # a soft pin past its TTL protects nothing: it lists as none
    clock.advance(11)
    assert {e.key: e.pin for e in list_keys(state, NS).entries}["soft"] == PIN_NONE


def test_paging_lists_every_key_present_throughout_exactly_once(state):
    # given 25 keys
    keys = sorted(f"k/{i:02d}" for i in range(25))
    for key in keys:
        put(state, key)
    # when they are listed 4 at a time while other keys come and go between pages
    seen, start_after, pages = [], "", 0
    while True:
        page = list_keys(state, NS, "k/", start_after, limit=4)
        assert len(page.entries) <= 4
        seen += keys_of(page)
        pages += 1
        state.remove(NS, [f"k/{pages:02d}x"])  # harmless: absent
        put(state, f"k/{pages:02d}x")  # a key appearing mid-listing, before or after the cursor
        if not page.next_start_after:
            break
        start_after = page.next_start_after
    # then each key present throughout came exactly once, in order
    originals = [k for k in seen if k in keys]
    assert originals == keys
    assert len(seen) == len(set(seen))
    assert_consistent(state)


def test_a_full_last_page_says_the_listing_is_done(state):
    for i in range(4):
        put(state, f"k{i}")
    page = list_keys(state, NS, "k", limit=4)
    assert keys_of(page) == ["k0", "k1", "k2", "k3"] and page.next_start_after == ""
    page = list_keys(state, NS, "k", limit=3)
    assert page.next_start_after == "k2"
    assert keys_of(list_keys(state, NS, "k", "k2", limit=3)) == ["k3"]


def test_pending_puts_are_listed_only_when_asked_and_never_break_paging(state):
    put(state, "k1")
    pending(state, "k2")
    put(state, "k3")
    assert keys_of(list_keys(state, NS)) == ["k1", "k3"]
    page = list_keys(state, NS, include_pending=True)
    assert [(e.key, e.pending) for e in page.entries] == [("k1", False), ("k2", True), ("k3", False)]
    # a page whose last name is pending: fewer entries, but the cursor still moves past it
    page = list_keys(state, NS, limit=2)
    assert keys_of(page) == ["k1"] and page.next_start_after == "k2"
    assert keys_of(list_keys(state, NS, start_after="k2")) == ["k3"]
    assert_consistent(state)


def test_a_page_out_of_time_is_shorter_and_paging_still_lists_every_key_once(state):
    # given 10 keys, one of them pending (a page may visit a name and list nothing)
    keys = [f"k{i}" for i in range(10)]
    for key in keys:
        put(state, key) if key != "k4" else pending(state, key)
    # when every page runs out of time at once (a budget already spent)
    seen, start_after, pages = [], "", 0
    while True:
        page = list_keys(state, NS, "k", start_after, limit=1000, budget_s=1e-12)
        assert len(page.entries) <= 1  # one name visited per page: the loop is held that long only
        seen += keys_of(page)
        pages += 1
        if not page.next_start_after:
            break
        start_after = page.next_start_after
    # then the pages together list every complete key exactly once, in order; the last one says done
    assert seen == [k for k in keys if k != "k4"] and pages == 10
    # and a page with time to spare is whole
    assert keys_of(list_keys(state, NS, "k", limit=1000, budget_s=60.0)) == seen


def test_the_listing_handler_gives_a_page_list_page_ms_of_time(clock):
    state = make_state(clock, list_page_ms=1e-9)  # a budget no page fits in: one name a page
    mount(state, "a", 1 << 20)
    for i in range(3):
        put(state, f"k{i}")
    handlers = MasterHandlers(state, epoch=7)
    reply = handlers.ListKeys(pb.ListKeysRequest(namespace=NS, prefix="k", limit=100))
    assert reply.status == OK
    assert [e.key for e in reply.entries] == ["k0"] and reply.next_start_after == "k0"


def test_the_page_size_defaults_and_is_clamped(state):
    for i in range(3):
        put(state, f"k{i}")
    # 0 means the default, a huge limit is clamped: neither fails
    assert keys_of(list_keys(state, NS, limit=0)) == ["k0", "k1", "k2"]
    assert keys_of(list_keys(state, NS, limit=10 * MAX_LIST_LIMIT)) == ["k0", "k1", "k2"]
    assert DEFAULT_LIST_LIMIT <= MAX_LIST_LIMIT


def test_disk_only_objects_are_listed_with_their_ssd_copy(clock):
    state = make_state(clock, promote_after_reads=2)
    offloaded_k0(state)
    entries = {e.key: e for e in list_keys(state, NS).entries}
    assert set(entries) == {f"k{i}" for i in range(8)}
    assert (entries["k0"].dram_replicas, entries["k0"].ssd_replicas) == (0, 1)
    assert (entries["k7"].dram_replicas, entries["k7"].ssd_replicas) == (1, 0)


# ---------------------------------------------------------------- stat_keys


def test_stat_reports_the_whole_record_and_changes_nothing(state, clock):
    # given an object with two replicas, owned by a rank, soft-pinned, read a moment ago
    state.register_instance("llm", 2, 1, 1 << 20)
    options = PutOptions(instance="llm", rank=1, pin=PIN_SOFT, pin_ttl_s=60.0)
    started = state.put_start(NS, ["k"], [1000], 2, options)
    assert state.put_end(NS, ["k"], [0xDEADBEEF], started.put_id) == [OK]
    clock.advance(2)
    read(state, "k")
    clock.advance(1)
    before = untouched(state)
    # when it is inspected
    statuses, infos = stat_keys(state, NS, ["k"])
    # then every field says what the tables hold
    assert statuses == [OK]
    info = infos[0]
    assert (info.key, info.size, info.checksum, info.pending) == ("k", 1000, 0xDEADBEEF, False)
    assert sorted((r.segment, r.tier, r.location) for r in info.replicas) == sorted(
        (state.segments[s].name, TIER_DRAM, offset)
        for s, offset in zip(started.replica_segments, started.replica_offsets, strict=True)
    )
    assert info.lease_ms == (LEASE_S - 1) * 1000
    assert (info.pin, info.pin_ttl_ms) == (PIN_SOFT, 57_000)
    assert (info.instance, info.rank) == ("llm", 1)
    assert info.age_ms == 3000
    assert all(r.task == "" for r in info.replicas)
    # and nothing changed: no lease renewed, no recency refreshed
    assert untouched(state) == before
    assert_consistent(state)


def test_stat_of_pending_missing_and_invalid_keys(state, clock):
    pending(state, "p")
    put(state, "hard", pin=PIN_HARD)
    clock.advance(100)  # a lease never taken, a soft pin never set: zeros
    statuses, infos = stat_keys(state, NS, ["p", "missing", "", "hard"])
    assert statuses == [OK, Status.NOT_FOUND, Status.INVALID_KEY, OK]
    assert infos[0].pending and infos[0].checksum == 0 and len(infos[0].replicas) == 1
    assert infos[1] is None and infos[2] is None
    assert (infos[3].pin, infos[3].pin_ttl_ms, infos[3].lease_ms) == (PIN_HARD, 0, 0)
    assert stat_keys(state, "other", ["hard"])[0] == [Status.NOT_FOUND]


def test_stat_shows_the_ssd_copy_its_disk_reads_and_tier_tasks_in_flight(clock):
    # given k0 offloaded to SSD (disk-only), read once (promotion after 2 reads)
    state = make_state(clock, promote_after_reads=2)
    seg, disk = offloaded_k0(state)
    read(state, "k0")
    before = untouched(state)
    info = stat_keys(state, NS, ["k0"])[1][0]
    assert [(r.segment, r.tier, r.task) for r in info.replicas] == [("a", TIER_SSD, "")]
    assert info.replicas[0].location == replica_offset(state.record(NS, "k0").replicas[0])
    assert info.disk_reads == 1
    assert untouched(state) == before  # inspecting is not a read toward promotion
    # when a second read queues its promotion, the disk copy shows the task in flight
    read(state, "k0")
    info = stat_keys(state, NS, ["k0"])[1][0]
    assert [(r.tier, r.task) for r in info.replicas] == [(TIER_SSD, "promoting")]
    assert info.disk_reads == 0
    # and an object being offloaded shows it on its DRAM copy
    assert state.tiering.offload(state.record(NS, "k7"), state.segments[seg])
    info = stat_keys(state, NS, ["k7"])[1][0]
    assert [(r.tier, r.task) for r in info.replicas] == [(TIER_DRAM, "offloading")]
    disk.complete(disk.poll())
    assert_consistent(state)


# ---------------------------------------------------------------- lookup counters


@pytest.mark.parametrize(
    ("counts", "tiers", "expected"),
    [
        ([], [], 0),
        ([1, 0, 2], [TIER_DRAM, TIER_DRAM, TIER_DRAM], 0),
        ([1, 0, 1], [TIER_SSD, TIER_DRAM], 1),
        ([2, 1, 2], [TIER_DRAM, TIER_SSD, TIER_SSD, TIER_SSD, TIER_SSD], 2),
        ([0, 0], [], 0),
    ],
)
def test_disk_only_hits_counts_keys_whose_replicas_are_all_on_ssd(counts, tiers, expected):
    assert disk_only_hits(counts, tiers) == expected


# ---------------------------------------------------------------- servicer plumbing


def test_the_handlers_answer_list_and_stat_and_count_disk_only_lookups(clock):
    state = make_state(clock, promote_after_reads=0)
    offloaded_k0(state)
    handlers = MasterHandlers(state, epoch=7)
    reply = handlers.ListKeys(pb.ListKeysRequest(namespace=NS, prefix="k", limit=3))
    assert reply.status == OK
    assert [(e.key, e.ssd_replicas) for e in reply.entries] == [("k0", 1), ("k1", 1), ("k2", 0)]
    assert reply.next_start_after == "k2"
    reply = handlers.StatKeys(pb.KeysRequest(namespace=NS, keys=["k0", "nope"]))
    assert list(reply.statuses) == [OK, Status.NOT_FOUND]
    assert [(r.segment, r.tier) for r in reply.objects[0].replicas] == [("a", pb.SSD)]
    assert reply.objects[0].size == KiB and reply.objects[1] == pb.ObjectInfo()
    # lookups: k0 is found on SSD only, k7 with its DRAM copy, k9 not at all
    handlers.GetReplicas(pb.KeysRequest(namespace=NS, keys=["k0", "k7", "k9"]))
    handlers.Exists(pb.ExistsRequest(namespace=NS, keys=["k0"]))
    status = handlers.Status(pb.StatusRequest())
    assert dict(status.lookup_keys) == {"GetReplicas": 3, "Exists": 1}
    assert dict(status.lookup_hits) == {"GetReplicas": 2, "Exists": 1}
    assert status.lookup_hits_disk_only == 1
    assert handlers.requests["ListKeys"] == 1 and "StatKeys" in handlers.latency


def test_the_handlers_refuse_inspection_while_recovering_and_bad_input(clock):
    state = make_state(clock, max_batch_keys=2)
    handlers = MasterHandlers(state, epoch=7)
    reply = handlers.ListKeys(pb.ListKeysRequest(namespace=""))
    assert reply.status == Status.INVALID_KEY
    assert handlers.StatKeys(pb.KeysRequest(namespace=NS, keys=["a", "b", "c"])).status == Status.BATCH_TOO_LARGE
    state.begin_recovery({"gone"}, timeout_s=60.0)
    assert handlers.ListKeys(pb.ListKeysRequest(namespace=NS)).status == Status.UNAVAILABLE
    assert handlers.StatKeys(pb.KeysRequest(namespace=NS, keys=["a"])).status == Status.UNAVAILABLE
