"""Master leader election on etcd: one leader per cluster, standbys waiting to take over.

The leader holds the key `/kvtier/<cluster>/leader` (see
`kvtier.common.discovery.leader_key`) attached to a lease it keeps alive; its
value is the leader's info as JSON. A candidate creates the key only if it does
not exist (one etcd transaction), so at most one holds it. When the leader
resigns its lease is revoked and the key vanishes at once; when it dies or is
cut off, etcd expires the lease after the TTL. Standbys poll the key every
`poll_interval_s` and campaign as soon as it is gone.

Epoch: the key's `create_revision`. etcd revisions only grow, and the key is
re-created at each election, so each leader's epoch is larger than every
earlier leader's. Whatever the master stamps with it can be fenced.

Believing one is leader (`is_leader()`): true only until `valid_until`, set at
each successful keep-alive to

    clock() read just before the keep-alive request was sent + ttl - margin

etcd restarts the TTL when it *receives* the request, later than we sent it, so
our belief always ends at least `margin` before etcd could expire the lease and
let a standby in. The margin, max(0.5 s, 10% of ttl), absorbs clock rate
differences and etcd's own expiry granularity. The monotonic clock keeps
running while the process is stopped (SIGSTOP, a long GC pause, a frozen VM on
the same host clock), so a leader that resumes after its lease lapsed reads
`is_leader()` False before any round trip. It is a point-in-time check: a write
already past it when the process freezes can still land late, which is what the
epoch is for.

Threads: the election runs on its own thread with a synchronous EtcdClient.
`is_leader()` is a single float compare, safe and cheap from any thread.
`on_elected` and `on_deposed` run on the election thread and must return
quickly (hand work to the event loop with `call_soon_threadsafe`): no
keep-alive is sent while they run.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

from kvtier.common.discovery import leader_key, leader_value, parse_leader_value
from kvtier.common.etcd_client import EtcdClient, EtcdError, EtcdValue
from kvtier.proto.keys import cluster_id_problem

logger = logging.getLogger(__name__)

NOT_LEADER = float("-inf")
# Shortest deadline for an etcd call near the end of the validity window: a call
# with almost no time left would fail even against a healthy etcd.
MIN_CALL_TIMEOUT_S = 0.2
# Pause between keep-alive attempts after a failure, until the validity runs out.
RETRY_INTERVAL_S = 0.1


def safety_margin(ttl_s: float) -> float:
    """How much earlier than etcd's lease expiry the leader stops believing it leads."""
    return max(0.5, ttl_s * 0.1)


class LeaderElection:
    """Campaign for, hold and give up the leadership of one cluster.

    `info` is what the leader publishes: {"address": "host:port",
    "fast_endpoint": ..., "pid": N, "name": ...}. `on_elected(epoch)` runs
    after each win (is_leader() is already True), `on_deposed(reason)` after
    each involuntary loss (is_leader() is already False), after which the
    election campaigns again with a fresh lease. `stop()` calls neither.

    `clock` must be monotonic and keep running while the process is stopped;
    it is injectable for tests.
    """

    def __init__(
        self,
        etcd: EtcdClient,
        cluster: str,
        info: dict,
        *,
        ttl_s: float = 5.0,
        on_elected: Callable[[int], None] | None = None,
        on_deposed: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        poll_interval_s: float = 0.25,
    ) -> None:
        problem = cluster_id_problem(cluster)
        if problem:
            raise ValueError(problem)
        if ttl_s < 1:
            raise ValueError(f"ttl_s={ttl_s}: etcd leases last whole seconds, at least 1")
        self.etcd = etcd
        self.cluster = cluster
        self.key = leader_key(cluster)
        self.ttl_s = ttl_s
        self.margin_s = safety_margin(ttl_s)
        # Three renewals per validity window (about ttl/3): two may fail or be late before it lapses.
        self.keepalive_interval_s = (ttl_s - self.margin_s) / 3
        self.poll_interval_s = poll_interval_s
        self._lease_ttl = math.ceil(ttl_s)  # etcd may grant more, never less: our belief stays the shorter
        self._info = dict(info)
        self._on_elected = on_elected
        self._on_deposed = on_deposed
        self._clock = clock
        # Written by the election thread only (and by stop() once it has joined it):
        self._leader_until = NOT_LEADER  # is_leader() reads this one float, nothing else
        self._lease = 0
        self._epoch = 0
        self._holder: dict | None = None  # replaced, never mutated: readers get a consistent dict
        self._holder_seen_at = float("-inf")  # clock() when a standby last read the leader key in etcd
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ public view

    def is_leader(self) -> bool:
        """True while we hold the key and our lease is surely alive in etcd."""
        return self._clock() < self._leader_until

    @property
    def epoch(self) -> int:
        """The epoch of our latest win (the leader key's create_revision), 0 before the first."""
        return self._epoch

    @property
    def grace_s(self) -> float:
        """How long a leader keeps serving after its last successful keep-alive with etcd unreachable."""
        return self.ttl_s - self.margin_s

    def leader_info(self) -> dict | None:
        """The leader's info as last seen in etcd (ours while we lead), None when unknown."""
        holder = self._holder
        return dict(holder) if holder is not None else None

    def following(self) -> str:
        """ "" while this standby follows a leader: etcd answered its last poll of the leader key within
        a lease TTL and the key names a leader; else why not (one line). A standby that follows can take
        over at the next election, which is what its readiness (/readyz) says."""
        age = self._clock() - self._holder_seen_at
        if age == float("inf"):
            return "standby; etcd not read yet"
        if age > self.ttl_s:
            return f"standby; etcd not heard from for {age:.1f}s"
        holder = self._holder
        if not holder or not holder.get("address"):
            return "standby; no leader elected"
        return ""

    def update_info(self, info: dict) -> bool:
        """Publish new info; True if written to etcd now (we hold the key), else it is used at the next campaign.

        Safe from any thread: etcd applies the write only while the key is still
        attached to our lease. Raises EtcdError if etcd cannot be reached.
        """
        self._info = dict(info)
        lease = self._lease
        if not lease:
            return False
        written = self.etcd.put_if_owner(self.key, leader_value(self._info), lease)
        if written:
            self._holder = dict(self._info)
        return written

    # -------------------------------------------------------------- lifecycle

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("LeaderElection.start() called twice")
        self._thread = threading.Thread(target=self._run, name=f"election-{self.cluster}", daemon=True)
        self._thread.start()

    def stop(self, resign: bool = True) -> None:
        """Stop campaigning or leading. Idempotent.

        With `resign` the lease is revoked, deleting the key so a standby takes
        over within its poll interval; without, the key lives until the lease
        expires (what a crash looks like to the others). is_leader() is False
        from the moment this is called.
        """
        self._leader_until = NOT_LEADER
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            # At most two etcd calls are in flight, each trying every endpoint once.
            self._thread.join(timeout=2 * len(self.etcd.endpoints) * self.etcd.timeout + 1)
        self._leader_until = NOT_LEADER  # the thread may have renewed it while we waited
        lease, self._lease = self._lease, 0
        if resign and lease:
            self._revoke_quietly(lease)
            logger.info("leader resigned key=%s epoch=%d", self.key, self._epoch)

    # ------------------------------------------------------- election thread

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self._campaign():
                    self._lead()
            except EtcdError as e:
                logger.warning("leader election key=%s: etcd error, retrying: %s", self.key, e)
                self._stop.wait(self.poll_interval_s)
            except Exception:
                logger.exception("leader election key=%s: unexpected error, retrying", self.key)
                self._stop.wait(self.poll_interval_s)

    def _campaign(self) -> bool:
        """Wait until the key is free, then try to take it; True once we lead, False when stopped."""
        while not self._stop.is_set():
            current = self.etcd.get(self.key)
            self._holder_seen_at = self._clock()
            if current is not None:
                self._holder = parse_leader_value(current.value)
                self._stop.wait(self.poll_interval_s)
                continue
            sent_at = self._clock()  # the lease's TTL runs from the grant, before the key exists
            lease = self.etcd.grant(self._lease_ttl)
            try:
                won, holder = self.etcd.create(self.key, leader_value(self._info), lease)
            except EtcdError:
                self._revoke_quietly(lease)  # if the create did land, this deletes the key again
                raise
            if holder is not None and holder.lease == lease:
                won = True  # our own create, applied before a retry on another endpoint
            if not won or holder is None:
                self._revoke_quietly(lease)
                self._holder = parse_leader_value(holder.value) if holder is not None else None
                continue
            if self._stop.is_set():
                self._revoke_quietly(lease)
                return False
            self._become_leader(lease, holder, sent_at)
            return True
        return False

    def _become_leader(self, lease: int, holder: EtcdValue, sent_at: float) -> None:
        self._lease = lease
        self._epoch = holder.create_revision
        self._holder = dict(self._info)
        self._leader_until = sent_at + self.ttl_s - self.margin_s
        logger.info("elected leader key=%s epoch=%d lease=%x", self.key, self._epoch, lease)
        self._callback(self._on_elected, self._epoch)

    def _lead(self) -> None:
        """Keep the lease alive until deposed or stopped."""
        valid_until = self._leader_until
        next_at = valid_until - self.grace_s + self.keepalive_interval_s
        late_since: float | None = None  # clock() of the first renewal in a row that came back too late
        while True:
            delay = next_at - self._clock()
            if self._stop.wait(max(delay, 0.0)):
                return
            sent_at = self._clock()
            timeout = min(self.etcd.timeout, max(valid_until - sent_at, MIN_CALL_TIMEOUT_S))
            try:
                ttl = self.etcd.keepalive(self._lease, timeout=timeout)
                holder = self.etcd.get(self.key, timeout=timeout) if ttl > 0 else None
            except EtcdError as e:
                if self._clock() >= valid_until:
                    self._depose(f"etcd unreachable for more than {self.grace_s:.1f}s: {e}")
                    return
                next_at = self._clock() + RETRY_INTERVAL_S
                continue
            if self._stop.is_set():
                return
            if ttl <= 0:
                self._depose("lease expired in etcd")
                return
            if holder is None or holder.lease != self._lease:
                if holder is None:
                    self._depose("leader key deleted from etcd")
                else:
                    self._holder = parse_leader_value(holder.value)
                    self._depose(f"leader key taken over by {self._holder.get('address', '?')}")
                return
            # A renewal after the belief lapsed (e.g. the clock jumped) is still safe to act on:
            # the lease never expired, so no one else can have held the key meanwhile.
            valid_until = max(valid_until, sent_at + min(self.ttl_s, ttl) - self.margin_s)
            self._leader_until = valid_until
            next_at = sent_at + self.keepalive_interval_s
            # A renewal that succeeds but returns after the belief it buys has lapsed keeps the key ours
            # in etcd while we never serve: a host too loaded (or an etcd too slow) for this TTL would
            # hold the whole cluster leaderless for as long as that lasts. After a TTL of nothing but
            # late renewals, give the key up and let a standby with quicker round trips take it.
            now = self._clock()
            if now < valid_until:
                late_since = None
                continue
            late_since = sent_at if late_since is None else late_since
            if now - late_since >= self.ttl_s:
                self._depose(
                    f"renewals came back too late for {now - late_since:.1f}s: etcd round trips outlast "
                    f"the grace of {self.grace_s:.1f}s (raise --etcd-lease-ttl-s on a loaded host)"
                )
                self._stop.wait(self.ttl_s)  # a standby campaigns first: it may be the healthier one
                return

    def _depose(self, reason: str) -> None:
        self._leader_until = NOT_LEADER
        lease, self._lease = self._lease, 0
        if self._holder == self._info:
            self._holder = None  # no longer true; the campaign reads the key again
        logger.warning("deposed as leader key=%s epoch=%d reason=%s", self.key, self._epoch, reason)
        self._callback(self._on_deposed, reason)
        self._revoke_quietly(lease)  # if the lease outlived our belief, free the key now rather than at expiry

    def _revoke_quietly(self, lease: int) -> None:
        try:
            self.etcd.revoke(lease, timeout=min(self.etcd.timeout, 1.0))
        except EtcdError as e:
            logger.info("could not revoke lease=%x (it expires by itself): %s", lease, e)

    def _callback(self, callback: Callable | None, argument: object) -> None:
        if callback is None:
            return
        try:
            callback(argument)
        except Exception:
            logger.exception("leader election callback %r failed", callback)
