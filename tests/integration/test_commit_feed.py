"""The segments' commit feed over the master's framed fast path (issue 19), and its gRPC fallback.

Every PutEnd waits for its segment to acknowledge the commit notice, so the
feed's door is on the path of every put. These tests check which door the
feed uses (the segment's `kvtier_segment_commit_polls_total{door}`) and that
what the door carries keeps its promises: an acknowledged put is in the
segment's index (it survives a master restart), with and without a secret,
and with the fast path off.
"""

from __future__ import annotations

import os
import secrets

import pytest

from kvtier.client import Status
from kvtier.proto import master_pb2 as pb
from kvtier.proto import rpcframe
from kvtier.proto.auth import make_token
from kvtier.segment_server.commit_link import FramedFeedLink
from tests.integration.test_metrics import scrape, value


def _polls(segment) -> tuple[float, float]:
    samples = scrape(segment.info["metrics"])
    name = "kvtier_segment_commit_polls_total"
    return value(samples, name, segment="seg0", door="fast"), value(samples, name, segment="seg0", door="grpc")


def _put_restart_get(bare_cluster, master_args: tuple[str, ...] = ()) -> None:
    client = bare_cluster.client()
    values = {f"feed/{i}": os.urandom(4096) for i in range(20)}
    for key, data in values.items():
        assert client.batch_put([key], [data]) == [Status.OK]
    bare_cluster.restart_master(*master_args)
    client = bare_cluster.client()
    assert bare_cluster.wait_for(lambda: client.exists("feed/0"), timeout=20)
    assert client.batch_get(list(values)) == list(values.values())


@pytest.mark.parametrize("secret", [False, True], ids=["open", "secret"])
def test_feed_polls_over_the_fast_path_and_acknowledged_puts_survive_a_master_restart(bare_cluster, tmp_path, secret):
    if secret:
        bare_cluster.use_secret(tmp_path / "secret")
    bare_cluster.start_master()
    segment = bare_cluster.start_segment("seg0", "32MiB", "--metrics", "127.0.0.1:0")
    client = bare_cluster.client()
    assert client.batch_put(["probe"], [b"x" * 4096]) == [Status.OK]
    assert _polls(segment)[0] > 0
    _put_restart_get(bare_cluster)
    # The restarted master listens on another fast port: the feed found it again.
    before = _polls(segment)[0]
    assert bare_cluster.client().batch_put(["probe2"], [b"y" * 4096]) == [Status.OK]
    assert bare_cluster.wait_for(lambda: _polls(segment)[0] > before, timeout=10)


def test_feed_falls_back_to_grpc_when_the_master_has_no_fast_path(bare_cluster):
    bare_cluster.start_master("--fast-listen", "off")
    segment = bare_cluster.start_segment("seg0", "32MiB", "--metrics", "127.0.0.1:0")
    client = bare_cluster.client()
    assert client.batch_put(["probe"], [b"x" * 4096]) == [Status.OK]
    fast, grpc_polls = _polls(segment)
    assert fast == 0 and grpc_polls > 0
    _put_restart_get(bare_cluster, ("--fast-listen", "off"))


def test_a_tenant_cannot_poll_commits_over_the_fast_path(bare_cluster, tmp_path):
    """PollCommits is a segment call: on the fast path, as on gRPC, only cluster credentials make it."""
    secret = secrets.token_hex(32)
    (tmp_path / "cluster").write_text(secret)
    (tmp_path / "cluster").chmod(0o600)
    (tmp_path / "tenant").write_text(secrets.token_hex(32))
    (tmp_path / "tenant").chmod(0o600)
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'[tenants.alice]\nsecret_file = "{tmp_path / "tenant"}"\nnamespaces = ["alice"]\n')
    bare_cluster.secret_file = str(tmp_path / "cluster")
    bare_cluster.start_master("--tenants-file", str(tenants))
    bare_cluster.start_segment("seg0", "32MiB")
    hello = bare_cluster.client()._master.hello()
    token = make_token((tmp_path / "tenant").read_text().strip().encode(), "alice")
    link = FramedFeedLink(hello.fast_endpoint, token, 5.0)
    try:
        reply = link.poll(pb.PollCommitsRequest(segment_id=1, epoch=hello.epoch, wait_ms=0), 5.0)
    finally:
        link.close()
    assert reply.status == Status.PERMISSION_DENIED
    assert rpcframe.METHOD_IDS["PollCommits"] == 7
