"""Wiring a master into etcd-based HA: election, leadership checks, and saved state in etcd.

`start_election` gives the server three things: the `Leadership` the
handlers consult on every RPC, the runner that owns the election thread, and
the state store. Leadership is held only while both are true: the election
still believes this master leads (lease valid, see kvtier.master.election),
and the event loop has switched to the tables of that same epoch. So a
leader that wakes from SIGSTOP after a new election refuses its first
request, before any etcd round trip; and a new leader refuses data RPCs
until its tables are rebuilt from the segments' inventories.

Saved state (kvtier.master.persist) lives in `/kvtier/<cluster>/state`,
written in a transaction guarded by the leader key's create revision (our
epoch): a deposed leader can never overwrite its successor's state.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import TYPE_CHECKING

from kvtier.common.discovery import leader_key
from kvtier.common.etcd_client import EtcdClient, EtcdError, parse_etcd_url
from kvtier.master.config import MasterConfig
from kvtier.master.election import LeaderElection
from kvtier.master.handlers import Leadership
from kvtier.master.persist import SavedState, StateUnreadable

if TYPE_CHECKING:
    from kvtier.master.server import Roles

logger = logging.getLogger(__name__)


def etcd_endpoints(config: MasterConfig) -> list[str]:
    """Endpoints from `--etcd` (etcd://H:P[,H:P]/CLUSTER, CLUSTER = cluster_id, or H:P[,H:P])."""
    spec = config.etcd
    if spec.startswith("etcd://"):
        endpoints, cluster = parse_etcd_url(spec)
        if cluster != config.cluster_id:
            raise ValueError(f"--etcd names cluster {cluster!r} but --cluster-id is {config.cluster_id!r}")
        return endpoints
    return [e.strip() for e in spec.split(",") if e.strip()]


class EtcdLeadership(Leadership):
    def __init__(self, election: LeaderElection) -> None:
        self.election = election
        self.active_epoch = 0  # the epoch whose tables the handlers hold; 0 = standby

    def is_leader(self) -> bool:
        election = self.election
        return self.active_epoch != 0 and election.is_leader() and election.epoch == self.active_epoch

    def leader(self) -> str:
        info = self.election.leader_info()
        return str(info.get("address", "")) if info else ""

    def following(self) -> str:
        return self.election.following()


class EtcdStateStore:
    def __init__(self, etcd: EtcdClient, cluster: str, leadership: EtcdLeadership) -> None:
        self._etcd = etcd
        self._key = f"/kvtier/{cluster}/state"
        self._leader_key = leader_key(cluster)
        self._leadership = leadership

    def load(self) -> SavedState | None:
        """None on a first start; StateUnreadable when etcd fails or the value is not ours."""
        try:
            value = self._etcd.get(self._key)
        except EtcdError as exc:
            raise StateUnreadable(f"etcd key {self._key}: {exc}") from None
        if value is None:
            return None
        try:
            return SavedState.from_json(value.value)
        except (ValueError, TypeError, AttributeError) as exc:
            raise StateUnreadable(f"etcd key {self._key}: {exc}") from None

    def save(self, saved: SavedState) -> None:
        # The snapshot's own epoch: one taken before this process lost and won leadership again must
        # not overwrite what the leader in between saved (its longer lease, say).
        epoch = saved.epoch
        if epoch != self._leadership.active_epoch or not self._etcd.put_if_created_at(
            self._leader_key, epoch, self._key, saved.to_json()
        ):
            raise EtcdError(f"not saved: epoch {saved.epoch} no longer leads")


class HaRunner:
    """Owns the election; switches the master's role on the event loop as it wins and loses."""

    def __init__(
        self,
        config: MasterConfig,
        address: str,
        roles: Roles,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self._config = config
        self._address = address
        self._roles = roles
        self._loop = loop
        self.etcd = EtcdClient(etcd_endpoints(config), security=config.etcd_security)
        self.election: LeaderElection | None = None
        self.leadership: EtcdLeadership | None = None
        self.store: EtcdStateStore | None = None

    def prepare(self) -> None:
        # etcd unreachable at start is most likely a wrong --etcd: one line now, not a standby that
        # waits forever (once started, a master rides out etcd outages as before).
        try:
            self.etcd.get(leader_key(self._config.cluster_id))
        except EtcdError as exc:
            reason = " ".join(str(exc).split())
            if exc.code is None or exc.code.name in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
                hint = "change --etcd, start etcd first, or set etcd_ca_file (etcd_cert_file, etcd_key_file) for TLS"
            else:  # it answered and refused: credentials, a client certificate, permissions
                hint = "etcd refused this master: check etcd_credentials_file, etcd_cert_file and the etcd user's roles"
            raise ValueError(f"cannot reach etcd at {','.join(self.etcd.endpoints)} ({reason}): {hint}") from None
        self.election = LeaderElection(
            self.etcd,
            self._config.cluster_id,
            {"address": self._address, "pid": os.getpid(), "name": os.uname().nodename},
            ttl_s=self._config.etcd_lease_ttl_s,
            on_elected=self._elected,
            on_deposed=self._deposed,
        )
        self.leadership = EtcdLeadership(self.election)
        self.store = EtcdStateStore(self.etcd, self._config.cluster_id, self.leadership)

    def start(self, fast_endpoint: str) -> None:
        assert self.election is not None
        info = {"address": self._address, "fast_endpoint": fast_endpoint, "pid": os.getpid()}
        self.election.update_info(info | {"name": os.uname().nodename})  # no lease yet: used at the campaign
        self.election.start()
        logger.info(
            "campaigning for leadership etcd=%s ttl_s=%.1f grace_s=%.1f",
            ",".join(self.etcd.endpoints),
            self._config.etcd_lease_ttl_s,
            self.election.grace_s,
        )

    def stop(self) -> None:
        if self.election is not None:
            self.election.stop(resign=True)
        self.etcd.close()

    # -------------------------------------------------------- election thread

    def _elected(self, epoch: int) -> None:
        assert self.store is not None and self.election is not None
        saved, loaded = None, False
        for _ in range(3):  # etcd just answered the campaign: a failure here is most likely brief
            try:
                saved, loaded = self.store.load(), True
                break
            except StateUnreadable as exc:
                logger.error("cannot read the saved state (%s)", exc)
                time.sleep(0.1)
        if not loaded:
            logger.error("leading without recovery: saved state unreadable, and it will not be overwritten")
        self._loop.call_soon_threadsafe(self._lead, epoch, saved, loaded)

    def _deposed(self, reason: str) -> None:
        self._loop.call_soon_threadsafe(self._stand_by, reason)

    # -------------------------------------------------------- event loop

    def _lead(self, epoch: int, saved: SavedState | None, loaded: bool) -> None:
        assert self.election is not None and self.leadership is not None
        if self.election.epoch != epoch or not self.election.is_leader():
            return  # lost again before the loop got here
        self._roles.lead(epoch, saved, loaded)
        self.leadership.active_epoch = epoch

    def _stand_by(self, reason: str) -> None:
        assert self.leadership is not None
        if self.leadership.active_epoch:
            self.leadership.active_epoch = 0
            self._roles.stand_by(reason)


def start_election(
    config: MasterConfig, address: str, roles: Roles, loop: asyncio.AbstractEventLoop
) -> tuple[EtcdLeadership, HaRunner, EtcdStateStore]:
    runner = HaRunner(config, address, roles, loop)
    runner.prepare()
    assert runner.leadership is not None and runner.store is not None
    return runner.leadership, runner, runner.store
