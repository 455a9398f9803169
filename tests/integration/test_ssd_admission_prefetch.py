"""SSD write admission and prefetch on lookup (issue 17), against real master and segment processes.

A segment with 16 MiB of DRAM and an SSD tier (tests/integration/test_ssd_tier.py's helpers). Where a
replica lives is read with `stat` (StatKeys), which, unlike a get, neither counts as a read for
admission nor triggers a promotion.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.cli.ops import status_dict
from kvtier.client import Client
from tests.cluster import Cluster
from tests.integration.test_metrics import scrape, value
from tests.integration.test_ssd_tier import put_and_offload, segment_info, start_ssd_segment, value_for

KiB = 1 << 10
TASK_TTL_S = 5.0  # --put-timeout-s: the tier tasks' deadline, so the bound of every wait below


@pytest.fixture
def ssd_dir(tmp_path: Path) -> Path:
    path = tmp_path / "ssd"
    path.mkdir()
    return path


def tiers(client: Client, key: str) -> set[str]:
    info = client.stat(key)
    return {r.tier for r in info.replicas} if info is not None else set()


def fill(cluster: Cluster, client: Client, prefix: str, mib: int) -> None:
    """Push `mib` MiB of never-read objects through DRAM: everything older and not leased leaves DRAM."""
    put_and_offload(cluster, client, [f"{prefix}/{i:03d}" for i in range(mib)])


def fill_until_out_of_dram(cluster: Cluster, client: Client, keys: list[str]) -> None:
    """Push never-read objects through DRAM until none of `keys` has a DRAM copy: a read's lease
    (--lease-s) keeps an object from eviction until it ends, then the next pressure takes it."""
    for round_ in range(16):
        if not any("dram" in tiers(client, k) for k in keys):
            return
        fill(cluster, client, f"fill{round_}", 8)
    raise AssertionError({k: tiers(client, k) for k in keys})


def test_admission_vetoes_small_and_unread_objects_and_counts_them(bare_cluster, ssd_dir):
    bare_cluster.start_master(
        "--ssd-admit-min-bytes", "256KiB",
        "--ssd-admit-after-reads", "1",
        "--promote-after-reads", "0",
        "--lease-s", "0.5",
        "--metrics", "127.0.0.1:0",
    )  # fmt: skip
    start_ssd_segment(bare_cluster, ssd_dir)
    small = [f"small/{i}" for i in range(8)]  # read, but below the minimum size
    unread = [f"unread/{i}" for i in range(4)]  # large enough, never read
    read = [f"read/{i}" for i in range(4)]  # large enough and read once: admitted
    with bare_cluster.client() as client:
        assert client.batch_put(small, [value_for(k, 64 * KiB) for k in small]) == [0] * len(small)
        assert [v == value_for(k, 64 * KiB) for k, v in zip(small, client.batch_get(small), strict=True)] == [True] * 8
        put_and_offload(bare_cluster, client, unread)
        put_and_offload(bare_cluster, client, read)
        assert [v == value_for(k) for k, v in zip(read, client.batch_get(read), strict=True)] == [True] * 4
        fill_until_out_of_dram(bare_cluster, client, small + unread + read)

        assert [tiers(client, k) for k in read] == [{"ssd"}] * 4  # admitted: offloaded
        assert [tiers(client, k) for k in small + unread] == [set()] * 12  # vetoed: dropped (to recompute)
        got = client.batch_get(read + small + unread)
        assert got[:4] == [value_for(k) for k in read]
        assert got[4:] == [None] * 12

        vetoes = status_dict(client.cluster_status())["ssd_admission_vetoes"]
        assert vetoes["min_size"] == len(small)
        assert vetoes["reads"] >= len(unread)  # and the never-read fill that left DRAM
        assert client.cluster_status().tiering["offloaded_objects"] >= len(read)
        samples = scrape(bare_cluster.master.info["metrics"])
        metric = "kvtier_master_ssd_admission_vetoes_total"
        assert value(samples, metric, reason="min_size") == vetoes["min_size"]
        assert value(samples, metric, reason="reads") == vetoes["reads"]


def test_default_admission_offloads_unread_objects(bare_cluster, ssd_dir):
    bare_cluster.start_master("--promote-after-reads", "0")
    start_ssd_segment(bare_cluster, ssd_dir)
    with bare_cluster.client() as client:
        put_and_offload(bare_cluster, client, ["first"])
        fill(bare_cluster, client, "fill", 20)
        assert bare_cluster.wait_for(lambda: tiers(client, "first") == {"ssd"}, timeout=TASK_TTL_S * 4)
        assert client.get("first") == value_for("first")
        assert status_dict(client.cluster_status())["ssd_admission_vetoes"] == {"min_size": 0, "reads": 0}


@pytest.fixture
def disk_only(bare_cluster, ssd_dir) -> tuple[Cluster, list[str]]:
    """A cluster whose first 8 objects are on SSD only; promotion by reads is off (only prefetch
    promotes), so a get of them is served from SSD unless prefetched. DRAM is above the offload
    watermark; the test waits until the background offload has copied every DRAM object to SSD
    too, so a prefetch finds room by dropping such redundant copies (never an only copy)."""
    bare_cluster.start_master("--promote-after-reads", "0", "--put-timeout-s", str(TASK_TTL_S))
    start_ssd_segment(bare_cluster, ssd_dir)
    keys = [f"obj/{i:03d}" for i in range(8)]
    with bare_cluster.client() as client:
        put_and_offload(bare_cluster, client, keys)
        fill(bare_cluster, client, "fill", 20)
        assert bare_cluster.wait_for(lambda: all(tiers(client, k) == {"ssd"} for k in keys), timeout=TASK_TTL_S * 4)
        fills = [f"fill/{i:03d}" for i in range(20)]
        assert bare_cluster.wait_for(lambda: all("ssd" in tiers(client, k) for k in fills), timeout=TASK_TTL_S * 4)
    return bare_cluster, keys


def prefetch_counts(client: Client) -> dict[str, int]:
    return status_dict(client.cluster_status())["prefetch"]


def test_prefetch_on_lookup_turns_a_disk_hit_into_a_dram_hit(disk_only):
    cluster, keys = disk_only
    plain, fetched = keys[:2], keys[2:4]
    with cluster.client() as client:
        assert client.batch_exists(plain) == [True, True]
        assert [source.split("/")[0] for _, source in client.batch_get(plain, with_source=True)] == ["ssd", "ssd"]

        assert client.batch_exists([*fetched, "absent"], prefetch=True) == [True, True, False]
        assert cluster.wait_for(lambda: prefetch_counts(client).get("completed", 0) == 2, timeout=TASK_TTL_S * 2), (
            prefetch_counts(client)
        )
        got = client.batch_get(fetched, with_source=True)
        assert [value for value, _ in got] == [value_for(k) for k in fetched]
        assert [source.split("/")[0] for _, source in got] == ["dram", "dram"]
        assert all(tiers(client, k) == {"dram", "ssd"} for k in fetched)  # the disk copy stays
        counts = prefetch_counts(client)
        assert counts["started"] == 2 and counts.get("failed", 0) == 0

        # exists(key, prefetch=True) too, and a second prefetch of a key in DRAM starts nothing
        assert client.exists(keys[4], prefetch=True) and client.exists(fetched[0], prefetch=True)
        assert cluster.wait_for(lambda: prefetch_counts(client)["completed"] == 3, timeout=TASK_TTL_S * 2)
        assert prefetch_counts(client)["started"] == 3
        assert client.get(keys[4], with_source=True)[1].startswith("dram")


def test_longest_prefix_prefetches_only_the_present_prefix(disk_only):
    cluster, keys = disk_only
    with cluster.client() as client:
        assert client.longest_prefix([keys[5], keys[6], "absent", keys[7]], prefetch=True) == 2
        assert cluster.wait_for(lambda: prefetch_counts(client).get("completed", 0) == 2, timeout=TASK_TTL_S * 2)
        assert tiers(client, keys[5]) == tiers(client, keys[6]) == {"dram", "ssd"}
        assert tiers(client, keys[7]) == {"ssd"}  # beyond the prefix: the engine will not load it
        assert prefetch_counts(client)["started"] == 2
        info = segment_info(client)
        assert info.dram_used <= 0.9 * info.dram_capacity  # room came from copies already on SSD
