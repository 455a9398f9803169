"""`kvtier top`'s arithmetic (kvtier.cli.top.frame) on hand-made Status snapshots: no cluster."""

from __future__ import annotations

import copy
import io

from kvtier.cli.ops import Progress, print_table
from kvtier.cli.top import _COLUMNS, _row, frame, plain_row

MiB = 1 << 20


def snapshot(**changes) -> dict:
    """A `status_dict`-shaped snapshot of a two-segment cluster at rest."""
    base = {
        "cluster_id": "c",
        "role": "leader",
        "epoch": 3,
        "objects": 10,
        "pending_puts": 0,
        "capacity": 128 * MiB,
        "used": 32 * MiB,
        "rpc_requests": {"GetReplicas": 100, "Heartbeat": 50},
        "rpc_failures": {},
        "lookup_keys": {"GetReplicas": 1000, "Exists": 10},
        "lookup_hits": {"GetReplicas": 900, "Exists": 10},
        "lookup_hits_disk_only": 100,
        "evictions": {"watermark": {"objects": 1, "bytes": MiB}},
        "tiering": {"promoted_bytes": 0},
        "segments": [
            {
                "name": name,
                "state": "ACTIVE",
                "dram_capacity": 64 * MiB,
                "dram_used": 16 * MiB,
                "ssd_capacity": ssd,
                "ssd_used": ssd // 4,
                "objects": 5,
                "ssd_objects": 1 if ssd else 0,
                "dram_bytes_served": 10 * MiB,
                "ssd_bytes_served": 0,
                "disk_bytes_read": 0,
                "ssd_bytes_offloaded": 0,
            }
            for name, ssd in (("s0", 256 * MiB), ("s1", 0))
        ],
    }
    for path, value in changes.items():
        *parents, leaf = path.split("__")
        target = base
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        target[leaf] = value
    return base


def test_rates_are_deltas_over_the_interval():
    before = snapshot()
    after = snapshot(
        segments__0__dram_bytes_served=30 * MiB,  # +20 MiB in 2 s
        segments__0__ssd_bytes_served=4 * MiB,
        segments__1__disk_bytes_read=2 * MiB,
        rpc_requests={"GetReplicas": 140, "Heartbeat": 60},
        evictions={"watermark": {"objects": 5, "bytes": 5 * MiB}},
    )
    f = frame(before, after, 2.0)
    assert f["rates"]["dram_bytes_served"] == 10 * MiB
    assert f["rates"]["ssd_bytes_served"] == 2 * MiB
    assert f["rates"]["disk_bytes_read"] == MiB
    assert f["rates"]["rpc_requests"] == 25
    assert f["rpcs"] == {"GetReplicas": 20, "Heartbeat": 5}
    assert (f["rates"]["evicted_objects"], f["rates"]["evicted_bytes"]) == (2, 2 * MiB)
    assert [s["rates"]["dram_bytes_served"] for s in f["segments"]] == [10 * MiB, 0]
    assert f["capacity"] == {"dram": 128 * MiB, "dram_used": 32 * MiB, "ssd": 256 * MiB, "ssd_used": 64 * MiB}
    assert f["interval_s"] == 2.0 and f["objects"] == 10


def test_hit_ratios_split_get_hits_by_tier_and_are_null_without_lookups():
    before = snapshot()
    after = snapshot(
        lookup_keys={"GetReplicas": 1100, "Exists": 110},  # +100 gets, +100 exists
        lookup_hits={"GetReplicas": 980, "Exists": 60},  # +80 get hits, +50 exists hits
        lookup_hits_disk_only=120,  # +20 of the get hits went to SSD
    )
    hits = frame(before, after, 1.0)["hit_ratio"]
    assert hits == {"lookup": 0.65, "dram": 0.6, "ssd": 0.2}
    idle = frame(before, copy.deepcopy(before), 1.0)
    assert idle["hit_ratio"] == {"lookup": None, "dram": None, "ssd": None}
    assert idle["rates"]["lookup_keys"] == 0 and idle["rpcs"] == {}


def test_direct_reads_the_segments_served_count_as_dram_reads_that_hit():
    """Repeated small reads go straight to the segment (no lookup): 200 DRAM hits and 10 SSD lookups
    read as 100% SSD before."""
    before = snapshot()
    after = snapshot(
        lookup_keys={"GetReplicas": 1010, "Exists": 10},
        lookup_hits={"GetReplicas": 910, "Exists": 10},
        lookup_hits_disk_only=110,  # the 10 lookups: all on SSD
        segments__0__direct_reads_served=150,
        segments__1__direct_reads_served=50,
    )
    refresh = frame(before, after, 2.0)
    assert refresh["hit_ratio"]["dram"] == round(200 / 210, 4) and refresh["hit_ratio"]["ssd"] == round(10 / 210, 4)
    assert refresh["rates"]["direct_reads"] == 100.0


def test_counters_that_went_down_count_from_zero_and_new_segments_from_their_next_refresh():
    before = snapshot()
    restarted = snapshot(rpc_requests={"Heartbeat": 4}, segments__0__dram_bytes_served=MiB)
    restarted["segments"][1]["name"] = "s2"  # s1 left, s2 came
    f = frame(before, restarted, 1.0)
    assert f["rates"]["rpc_requests"] == 4  # a restarted master: its count since the restart
    assert f["segments"][0]["rates"]["dram_bytes_served"] == MiB
    assert [s["name"] for s in f["segments"]] == ["s0", "s2"]
    assert f["segments"][1]["rates"]["dram_bytes_served"] == 0


def test_plain_rows_line_up_under_the_header():
    header = _row([name for name, _ in _COLUMNS])
    busy = snapshot(segments__0__dram_bytes_served=900 * (1 << 30), lookup_keys={"GetReplicas": 123_456_789})
    rows = [plain_row(frame(snapshot(), snapshot(), 1.0)), plain_row(frame(snapshot(), busy, 0.5))]
    starts = [header.index(name) for name, _ in _COLUMNS]
    for row in rows:
        for start in starts[1:]:
            assert row[start - 2 : start] == "  " and row[start] != " ", (header, row)


def test_tables_and_progress_write_where_they_should():
    out = io.StringIO()
    print_table([["A", "LONG HEADER"], ["wide cell", "x"]], out)
    assert out.getvalue() == "A          LONG HEADER\nwide cell  x\n"
    err = io.StringIO()  # not a terminal: one line per update
    progress = Progress(stream=err)
    progress.update("step 1")
    progress.update("step 2")
    progress.done()
    assert err.getvalue() == "step 1\nstep 2\n"
    quiet = io.StringIO()
    Progress(quiet=True, stream=quiet).update("nothing")
    assert quiet.getvalue() == ""


def test_a_new_master_incarnation_restarts_every_master_counter_together():
    before = snapshot(uptime_s=500.0)
    # The new master has served fewer lookups than the old one had hits, but more than its
    # GetReplicas hits: judged counter by counter, keys would look restarted and hits would not.
    after = snapshot(
        uptime_s=2.0,
        lookup_keys={"GetReplicas": 950},
        lookup_hits={"GetReplicas": 940},
        lookup_hits_disk_only=40,
    )
    hits = frame(before, after, 1.0)["hit_ratio"]
    assert hits == {"lookup": round(940 / 950, 4), "dram": round(900 / 950, 4), "ssd": round(40 / 950, 4)}
    assert all(0 <= ratio <= 1 for ratio in hits.values())
