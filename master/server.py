"""Runs the master: a grpc.aio server on uvloop, the fast path, the periodic tick, and its role.

Standalone (no `etcd`): this process is the leader. Its epoch is larger than
any earlier incarnation's (kvtier.master.persist); in its `state_dir` (by
default a directory per cluster: kvtier.master.config.default_state_dir) it
saves the segments it must wait for after a restart and recovers from their
inventories (kvtier.master.recovery).

HA (`etcd`): every master campaigns for the leader key
(kvtier.master.election). The winner starts a new epoch with empty tables,
loads the saved state from etcd and recovers; the others are standbys
answering UNAVAILABLE with the leader's address. A leader that loses its
lease (etcd unreachable past the grace period, or paused past it) drops its
tables and becomes a standby: it can never accept a write once another
master may have been elected.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from kvtier.common.channels import read_file
from kvtier.common.config import write_ready_file
from kvtier.common.service import stop_on_signals
from kvtier.common.startup import (
    StartupError,
    check_bindable,
    check_file_creatable,
    check_tls_files,
    check_writable_dir,
    describe_os_error,
    raise_open_file_limit,
)
from kvtier.common.units import parse_hostport
from kvtier.master.auth import Authenticator, AuthInterceptor, load_tenants
from kvtier.master.capabilities import Minter
from kvtier.master.commit_wait import CommitWaiter
from kvtier.master.config import MasterConfig
from kvtier.master.fastpath import FastPathLimits, start_fast_path
from kvtier.master.handlers import MasterHandlers
from kvtier.master.long_lived import LongLivedFreezer
from kvtier.master.persist import (
    FileStateStore,
    NoStateStore,
    SavedState,
    StateStore,
    StateUnreadable,
    next_standalone_epoch,
)
from kvtier.master.servicer import MasterServicer
from kvtier.master.state import MasterState
from kvtier.master.sweeps import run_sweeper
from kvtier.proto import master_pb2_grpc
from kvtier.proto.auth import CLOCK_SKEW_MS, read_secret
from kvtier.proto.rpcframe import MESSAGE_LIMIT

logger = logging.getLogger(__name__)

# A call in progress keeps its connection checked: a ping every minute, and a peer that does not
# answer one within 20 s is gone (its calls are cancelled). Connections without calls are closed
# after idle_timeout_s instead (the client reconnects on its next call).
KEEPALIVE_TIME_MS = 60_000
KEEPALIVE_TIMEOUT_MS = 20_000
# Pings a client may send without data between them: one per 10 s at most; the third one faster is
# answered with GOAWAY (gRPC's ping strikes).
MIN_CLIENT_PING_INTERVAL_MS = 10_000


def grpc_options(config: MasterConfig) -> list[tuple[str, int]]:
    """The gRPC server's limits from the config: message size, streams per connection, keepalive."""
    return [
        ("grpc.max_receive_message_length", config.message_limit),
        ("grpc.max_send_message_length", MESSAGE_LIMIT),  # what clients accept (kvtier.common.channels)
        ("grpc.max_concurrent_streams", config.max_concurrent_streams),
        ("grpc.max_connection_idle_ms", int(config.idle_timeout_s * 1000)),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),  # the ping's own wait (default 60 s)
        ("grpc.http2.min_recv_ping_interval_without_data_ms", MIN_CLIENT_PING_INTERVAL_MS),
        ("grpc.http2.max_ping_strikes", 2),
        ("grpc.so_reuseport", 0),  # a second master on the same port must fail, not share it
    ]


class DecodeCheck(grpc.aio.ServerInterceptor):
    """A request that does not parse as its method's message is INVALID_ARGUMENT, naming the method.

    Without this grpc.aio answers UNKNOWN ("Unexpected DecodeError") and logs a traceback at ERROR
    for every such call: an unclear error for the caller and a log line per garbage request.
    """

    def __init__(self) -> None:
        self._checked: dict[str, grpc.RpcMethodHandler] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        checked = self._checked.get(details.method)
        if checked is not None:
            return checked
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler  # unknown methods stay UNIMPLEMENTED
        parse, method = handler.request_deserializer, details.method

        async def parsed(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            try:
                return parse(raw)
            except DecodeError:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"undecodable request for {method}")

        if handler.unary_unary is not None:
            behavior = handler.unary_unary

            async def parse_first(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
                return await behavior(await parsed(raw, context), context)

            checked = grpc.unary_unary_rpc_method_handler(
                parse_first, request_deserializer=None, response_serializer=handler.response_serializer
            )
        elif handler.unary_stream is not None:  # WatchEvents
            stream = handler.unary_stream

            async def parse_then_stream(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                async for message in stream(await parsed(raw, context), context):
                    yield message

            checked = grpc.unary_stream_rpc_method_handler(
                parse_then_stream, request_deserializer=None, response_serializer=handler.response_serializer
            )
        else:
            return handler
        self._checked[method] = checked
        return checked


FD_RESERVE = 1024  # gRPC connections, the state file, etcd, metrics: besides the fast path's


def raise_fd_limit(config: MasterConfig) -> None:
    """Raise the soft RLIMIT_NOFILE to max_connections + FD_RESERVE where the hard limit allows, so
    the fast path refuses connections at its own limit, with a reason, not at EMFILE."""
    raise_open_file_limit(config.max_connections + FD_RESERVE, "max_connections", logger)


def fast_path_limits(config: MasterConfig) -> FastPathLimits:
    return FastPathLimits(
        max_connections=config.max_connections,
        idle_timeout_s=config.idle_timeout_s,
        request_timeout_s=config.request_timeout_s,
        max_message_bytes=config.message_limit,
        max_buffered_bytes=config.buffered_limit,
    )


def serving_state(config: MasterConfig, minter: Minter) -> MasterState:
    """Empty tables for a server: each start, leadership and step-down makes new ones."""
    state = MasterState(config)
    state.capability_ttl_s = minter.ttl_s(config)
    state.reuse_margin_s = CLOCK_SKEW_MS / 1000  # a segment's clock may lag ours
    state.sweep_inline = False  # swept in slices between requests (run_sweeper)
    state.capabilities = minter.enabled
    return state


class Roles:
    """Switches the handlers between tables as leadership comes and goes (event loop thread)."""

    def __init__(self, config: MasterConfig, handlers: MasterHandlers, servicer: MasterServicer) -> None:
        self.config = config
        self.handlers = handlers
        self.servicer = servicer
        self.store: StateStore = NoStateStore()
        self._saving = asyncio.Lock()
        self._inherited_lease_s = 0.0  # the direct-read lease the saved state says may still run
        self._inherited_until = 0.0  # when it has run out at the latest (this epoch's state clock)
        servicer.save_state = self.save
        self.freezer = LongLivedFreezer(minimum=config.gc_freeze_min_objects)  # the ticker feeds it

    def lead(self, epoch: int, saved: SavedState | None, loaded: bool = True) -> None:
        """Start epoch `epoch` with empty tables. With a state store that loaded (`saved` None on a
        first start), recover: take the saved segments' inventories. `loaded` False (the store
        could not be read): take no inventories and save nothing this epoch, so the saved state
        (whom to expect, whom we expelled, registrations) is never overwritten by ignorance."""
        state = serving_state(self.config, self.handlers.minter)
        if saved is not None:
            for instance, (tp, pp, budget) in saved.instances.items():
                try:
                    state.quotas.register(instance, tp, pp, budget)
                except ValueError as exc:
                    logger.error("saved registration of instance %s is invalid: %s", instance, exc)
        if saved is not None:
            state.tiering.restore_owed(saved.owed_forgets)
            for name, incarnation in saved.drained:
                state.drainer.remember_drained(name, incarnation)
        if loaded and not isinstance(self.store, NoStateStore):
            state.begin_recovery(
                set(saved.segments) if saved else set(),
                self.config.recovery_timeout_s,
                set(saved.expelled) if saved else set(),
                self.config.recovery_max_s,
            )
        # The lease an earlier incarnation may have granted, as it saved it (kvtier.master.persist):
        # longer than ours when it ran with longer heartbeats.
        self._inherited_lease_s = saved.direct_read_lease_ms / 1000 if saved is not None else 0.0
        self._inherited_until = 0.0
        if not loaded or isinstance(self.store, NoStateStore) or saved is not None:
            # A segment may still serve direct reads under a lease from an earlier incarnation (it
            # learns otherwise at its next heartbeat), also one that incarnation dropped just before
            # it died, or one that cannot reach us: nothing that changes a key answers before that
            # lease ran out. A first start (a state store that holds nothing) had no such incarnation.
            lease_s = max(self.config.direct_read_lease_s, self._inherited_lease_s)
            if not loaded:  # its lease unknown: a lease is at most its master's segment_ttl_s (MasterConfig)
                lease_s = max(lease_s, self.config.segment_ttl_s)
            state.direct_read_fence = self._inherited_until = state.clock() + lease_s
        state.saved_state_stale = loaded  # save this epoch at once
        state.save_mounts = loaded and not isinstance(self.store, NoStateStore)
        if not loaded:  # saves nothing this epoch (`save`)
            state.unsaveable = (
                "this master could not read its saved state at start (see its log) and saves nothing until "
                "restarted: it cannot record that a segment left, so no change is acknowledged after one "
                "did; repair or move the state file (state_dir) and restart it"
            )
        self.servicer.attach(state)
        self.handlers.state = state
        self.freezer.reset()  # the old tables were frozen: unfrozen, they can be collected
        self.handlers.epoch = epoch
        logger.info(
            "leading epoch=%d waiting_for_segments=%s", epoch, ",".join(sorted(saved.segments)) if saved else "none"
        )

    def stand_by(self, reason: str) -> None:
        """Drop the tables (a new leader rebuilds them from the segments) and refuse everything."""
        logger.warning("no longer leading epoch=%d: %s", self.handlers.epoch, reason)
        state = serving_state(self.config, self.handlers.minter)
        self.servicer.attach(state)
        self.handlers.state = state
        self.freezer.reset()  # the old tables were frozen: unfrozen, they can be collected

    async def save(self) -> bool:
        """Save what changed, off the event loop; returns once it is durable (True; also with no
        state store, where nothing can be) or failed (False: not leading, a master that saves
        nothing this epoch, an error). RegisterInstance awaits it: a registration acknowledged is a
        registration kept; ReportDramObjects too: a direct-read lease granted is one the saved state
        holds."""
        async with self._saving:  # one save at a time: a later snapshot is never overwritten by an earlier
            state = self.handlers.state
            if not self.handlers.leadership.is_leader() or state.unsaveable:
                return False
            if not state.saved_state_stale:  # the last save holds everything (a failed one leaves it stale)
                return True
            state.saved_state_stale = False
            segments = {s.name for s in state.segments.values()}
            if state.recovery.active:  # those not back yet are still expected by the next incarnation
                segments |= state.recovery.expected
            generation = state.state_generation
            # Ours, and until our fence passed the one we inherited: a lease granted before us may
            # still run, and the next incarnation must wait for it too if we die before then.
            lease_s = self.config.direct_read_lease_s
            if state.clock() < self._inherited_until:
                lease_s = max(lease_s, self._inherited_lease_s)
            owed, overflowed = state.tiering.owed_forgets()
            saved = SavedState(
                epoch=self.handlers.epoch,
                segments=sorted(segments),
                instances=state.quotas.registrations(),
                expelled=sorted(state.expelled | overflowed),
                direct_read_lease_ms=math.ceil(lease_s * 1000),
                owed_forgets=owed,
                drained=list(state.drainer.drained),
            )
            try:
                await asyncio.get_running_loop().run_in_executor(None, self.store.save, saved)
                state.durable_generation = max(state.durable_generation, generation)
                state.granted_lease_ms = self.config.direct_read_lease_ms  # the store holds as long
                for segment in state.segments.values():
                    if segment.name in segments:
                        segment.saved = True
                if self.handlers.state is state:
                    self.servicer.waiter.wake()
                logger.info("saved master state segments=%d instances=%d", len(saved.segments), len(saved.instances))
                return True
            except Exception as exc:  # retried at the next tick; a restart meanwhile waits for fewer
                logger.error("saving master state failed: %s", exc)
                state.saved_state_stale = True
                return False


def _authenticator(config: MasterConfig) -> Authenticator:
    """The configured credentials (validated at start: kvtier.master.config)."""
    secret = read_secret(config.secret_file)
    tenants = load_tenants(config.tenants_file) if config.tenants_file else {}
    if secret is not None:
        logger.info("authentication on principals=%s", ",".join(["cluster", *sorted(tenants)]))
    return Authenticator(secret, tenants)


def _tls_credentials(config: MasterConfig) -> grpc.ServerCredentials:
    client_ca = read_file(config.tls_client_ca_file, "TLS client CA file") if config.tls_client_ca_file else None
    return grpc.ssl_server_credentials(
        [(read_file(config.tls_key_file, "TLS key"), read_file(config.tls_cert_file, "TLS certificate"))],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


def _leader_readiness(handlers: MasterHandlers) -> str:
    """`/readyz/leader`: ready only while this master answers data RPCs (the leader, recovered)."""
    role = handlers.role
    if role == "leader":
        return ""
    if role == "standby":
        return f"standby; leader={handlers.leadership.leader() or 'unknown'}"
    return f"recovering: master epoch {handlers.epoch} is waiting for segment inventories"


def _readiness(handlers: MasterHandlers) -> str:
    """`/readyz`: this master does its part: the leader once recovered, or a standby that follows a
    leader (etcd answers, a leader is named), so HA masters can roll one at a time and a
    PodDisruptionBudget counts standbys. Which one leads: /readyz/leader or kvtier_master_role."""
    if handlers.role == "standby":
        return handlers.leadership.following()
    return _leader_readiness(handlers)


def check_startup(config: MasterConfig) -> FileStateStore | None:
    """What would stop this start half-way, checked before anything is bound or saved: the addresses
    to listen on, then the state directory (StartupError, one line naming the option). Logs which
    directory keeps the state, or warns that none does (state_dir = "none"). Returns the directory's
    store, held for this process (FileStateStore.lock), when it saves to one."""
    check_bindable(config.listen, "--listen")
    if config.fast_path_listen not in ("auto", "off"):
        check_bindable(config.fast_path_listen, "--fast-listen")
    if config.metrics:
        check_bindable(config.metrics, "--metrics")
    check_tls_files(
        config.tls_cert_file,
        config.tls_key_file,
        config.tls_client_ca_file,
        "--tls-cert-file",
        "--tls-key-file",
        "--tls-client-ca-file",
    )
    if config.ready_file:
        check_file_creatable(config.ready_file, "--ready-file")
    if config.history_log:
        check_file_creatable(config.history_log, "--history-log")
    grant_s = min(config.put_timeout_s, config.lease_s)
    if config.dram_full_policy == "wait" and config.put_backpressure_s > grant_s / 2:
        logger.warning(
            "puts wait for offload at most %.3g s, not put_backpressure_s = %.3g: half their write grant, "
            "min(put_timeout_s, lease_s) = %.3g s (raise lease_s and put_timeout_s to wait longer)",
            grant_s / 2,
            config.put_backpressure_s,
            grant_s,
        )
    if config.etcd:
        return None
    if config.saves_state_to:  # last: a start that fails leaves no directory behind, and logs nothing else
        check_writable_dir(config.saves_state_to, "--state-dir")
        store = FileStateStore(config.saves_state_to)
        store.lock()  # one master per directory
        logger.info("master state directory state_dir=%s", config.saves_state_to)
        return store
    if config.state_dir:  # "none": an explicit opt-out
        logger.warning(
            "master state not saved, a restart loses every object in DRAM (set --state-dir DIR, or drop the "
            "opt-out for the default directory) state_dir=none"
        )


async def serve(config: MasterConfig, stop: asyncio.Event | None = None) -> None:
    """Serve until `stop` (or SIGINT/SIGTERM); StartupError when the start fails for a reason the
    user fixes (the caller prints it as one line)."""
    loop = asyncio.get_running_loop()
    state_store = check_startup(config)
    raise_fd_limit(config)
    auth = _authenticator(config)
    minter = Minter(auth.cluster_secret)
    handlers = MasterHandlers(serving_state(config, minter), 0)
    handlers.auth, handlers.minter = auth, minter
    # Expulsion of a silent segment (tick, at segment_ttl_s) ends every wait before this.
    waiter = CommitWaiter(handlers, config.segment_ttl_s + 2 * config.tick_interval_s + 1.0)
    servicer = MasterServicer(handlers, waiter)
    roles = Roles(config, handlers, servicer)
    # Credentials first: a caller without them learns nothing, not even that its request was garbage.
    interceptors = [AuthInterceptor(handlers.auth)] if handlers.auth.enabled else []
    interceptors.append(DecodeCheck())
    server = grpc.aio.server(
        options=grpc_options(config),
        interceptors=interceptors,
        maximum_concurrent_rpcs=config.max_concurrent_rpcs,  # beyond: RESOURCE_EXHAUSTED, shed at once
    )
    master_pb2_grpc.add_MasterServicer_to_server(servicer, server)
    try:
        if config.tls_cert_file:
            port = server.add_secure_port(config.listen, _tls_credentials(config))
        else:
            port = server.add_insecure_port(config.listen)
    except RuntimeError:  # taken since check_startup; gRPC hides the reason (and logs its own line)
        port = 0
    if port == 0:
        raise StartupError(f"cannot listen on {config.listen}: change --listen")
    host = config.listen.rpartition(":")[0]
    address = f"{host}:{port}"
    election = None
    if config.etcd:
        from kvtier.master.ha import start_election  # imported here: etcd stubs only when used

        try:
            handlers.leadership, election, roles.store = start_election(
                config, config.advertise or address, roles, loop
            )
        except ValueError as exc:
            await server.stop(grace=None)
            raise StartupError(str(exc)) from None
    else:
        roles.store = state_store or NoStateStore()
        try:
            saved, loaded = roles.store.load(), True
        except StateUnreadable as exc:
            logger.error("%s: serving without recovery, and leaving the file as it is", exc)
            saved, loaded = None, False
        roles.lead(next_standalone_epoch(saved), saved, loaded)
    await server.start()
    fast_server = None
    if config.fast_path_listen != "off":
        fast_listen = f"{host}:0" if config.fast_path_listen == "auto" else config.fast_path_listen
        try:
            advertise_host = parse_hostport(config.advertise)[0] if config.advertise else ""
            fast_server = await start_fast_path(fast_listen, handlers, waiter, advertise_host, fast_path_limits(config))
        except OSError as exc:
            await server.stop(grace=None)
            raise StartupError(
                f"cannot listen on {fast_listen} (fast path): {describe_os_error(exc)}: change --fast-listen"
            ) from None
    metrics_address = ""
    if config.metrics:
        from kvtier.common.metrics import serve_metrics
        from kvtier.master.metrics import MasterCollector

        try:
            metrics_address = serve_metrics(
                config.metrics,
                MasterCollector(handlers, loop, fast_server.stats if fast_server is not None else None),
                readiness=lambda: _readiness(handlers),
                more_probes={"/readyz/leader": lambda: _leader_readiness(handlers)},
            )
        except OSError as exc:
            await server.stop(grace=None)
            raise StartupError(
                f"cannot listen on {config.metrics} (metrics): {describe_os_error(exc)}: change --metrics"
            ) from None
        logger.info("metrics listening address=%s", metrics_address)
    if election is not None:
        election.start(handlers.fast_endpoint)
    logger.info("master serving address=%s cluster_id=%s epoch=%d", address, config.cluster_id, handlers.epoch)
    fast = f", fast path {handlers.fast_endpoint}" if handlers.fast_endpoint else ""
    print(f"kvtier-master listening on {address}{fast} (cluster {config.cluster_id})", flush=True)
    if config.ready_file:
        write_ready_file(
            config.ready_file,
            {
                "address": address,
                "fast_endpoint": handlers.fast_endpoint,
                "epoch": handlers.epoch,
                "pid": os.getpid(),
                "metrics": metrics_address,
            },
        )

    stop = stop or asyncio.Event()
    stop_on_signals(stop)

    async def ticker() -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(config.tick_interval_s)
            # Woken much later than asked: this process was not running (stopped, starved).
            deaf_s = time.monotonic() - before - config.tick_interval_s
            if not handlers.leadership.is_leader():
                continue
            try:
                if deaf_s > config.segment_ttl_s / 4:
                    handlers.state.forgive_deafness(deaf_s)
                handlers.state.tick()
                roles.freezer.observe(handlers.state.object_count)
                if handlers.state.saved_state_stale:
                    asyncio.create_task(roles.save())
            except Exception:  # a bug here must not stop expiry forever
                logger.exception("tick failed")

    tick_task = asyncio.create_task(ticker())
    sweep_task = asyncio.create_task(
        run_sweeper(lambda: handlers.state, config.sweep_slice_objects, config.sweep_slice_ms)
    )
    await stop.wait()
    logger.info("master stopping")
    tick_task.cancel()
    sweep_task.cancel()
    if election is not None:
        await loop.run_in_executor(None, election.stop)
    if fast_server is not None:
        fast_server.close()
    handlers.state.events.close("the master is stopping: reconnect (to the next leader)")  # streams end in the grace
    await server.stop(grace=1.0)
