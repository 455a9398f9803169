"""Runs a segment server: region, SSD tier, listeners, master link, tier worker, clean shutdown."""

from __future__ import annotations

import asyncio
import logging
import os
import resource

from kvtier.common.channels import Credentials
from kvtier.common.config import write_ready_file
from kvtier.common.discovery import MasterLocator
from kvtier.common.service import stop_on_signals
from kvtier.common.startup import (
    StartupError,
    check_bindable,
    check_file_creatable,
    check_tls_files,
    check_writable_dir,
    raise_open_file_limit,
    same_address,
)
from kvtier.common.units import format_size, parse_size
from kvtier.proto import master_pb2 as pb
from kvtier.proto.region import host_id
from kvtier.segment_server.bucket_format import ALIGN
from kvtier.segment_server.bucket_space import file_system_room
from kvtier.segment_server.buckets import BucketStore
from kvtier.segment_server.buffer_pool import BufferPool
from kvtier.segment_server.commit_relay import CommitRelay
from kvtier.segment_server.config import MIN_SSD_BUCKETS, SegmentConfig
from kvtier.segment_server.data_plane_stats import ConnectionLimits, DataPlaneStats
from kvtier.segment_server.disk_reads import DiskReader
from kvtier.segment_server.diskio_probe import open_engine
from kvtier.segment_server.dram_index import CommitFeed, DramIndex
from kvtier.segment_server.group_writer import GroupWriter
from kvtier.segment_server.keyed_reads import DirectReadLease, KeyedReads
from kvtier.segment_server.listeners import ShmListener, TcpListener
from kvtier.segment_server.master_clock import MasterClock
from kvtier.segment_server.master_link import MasterChannels, MasterLink
from kvtier.segment_server.mount_session import CapabilityCheck, MountSession
from kvtier.segment_server.region import (
    HEADER_SIZE,
    DramRegion,
    grant_socket_path,
    region_path,
    remove_if_orphaned,
    remove_orphans,
    remove_stale_socket,
)
from kvtier.segment_server.shm_grant import GrantStats, parse_uids
from kvtier.segment_server.shm_writers import WriterTable
from kvtier.segment_server.tier_worker import TierWorker
from kvtier.segment_server.verifier import Verifier

logger = logging.getLogger(__name__)

FD_RESERVE = 1024  # file descriptors kept for sockets, the disk engine, logs and the rest


class FdLimitError(ValueError):
    """RLIMIT_NOFILE cannot cover the SSD tier's bucket files; the message is one line for the user."""


async def serve(config: SegmentConfig) -> int:
    """Serve until SIGINT/SIGTERM; return the process exit code."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    fatal: list[tuple[str, int]] = []  # (why, exit code) when the master will not have us
    stop_on_signals(stop)

    check_startup(config)
    orphans = remove_orphans(config.shm_dir, config.cluster_id)
    if orphans:
        logger.warning("removed orphaned region files count=%d", orphans)
    region = _open_region(config)
    stats = DataPlaneStats()
    grants = GrantStats()
    store = engine = disk = worker = feed = verifier = None
    link = channels = relay = None
    listeners: list = []
    try:
        if config.ssd_dir:
            store, engine, disk = _open_ssd_tier(config)
        index = DramIndex(region.view)
        secret = config.secret()
        # With a cluster secret the data plane serves only ranges the master granted (capabilities),
        # keyed by the epoch of the current mount (the index's session).
        mount = MountSession(region.header)  # the master link's mount, as grants name it
        writers = WriterTable(region.header)  # same-host copies in progress (kvtier.segment_server.shm_writers)
        caps = CapabilityCheck(secret, config.name, mount, region.nonce.hex()) if secret else None
        clock = MasterClock()  # grants are judged on the master's clock (kvtier.segment_server.master_clock)
        credentials = config.credentials()
        # COMMIT frames go to the master's fast path the commit feed found (none with TLS: it has none).
        relay = CommitRelay(index, lambda: feed.endpoint if feed is not None else "", _fast_token(credentials))
        keyed = KeyedReads(index, region.view, DirectReadLease())  # its lease: renewed by the master link
        listeners = [
            TcpListener(
                config.listen,
                region.view,
                stats,
                disk,
                config.advertise,
                ConnectionLimits(config.max_connections, config.idle_timeout_s, config.request_timeout_s),
                caps,
                clock,
                relay,
                keyed,
                mount,
            ),
            ShmListener(
                grant_socket_path(config.shm_dir, config.cluster_id, config.name),
                region.fileno(),
                host_id(),
                region.nonce,
                parse_uids(config.shm_allowed_uids),
                grants,
                writers=writers,
            ),
        ]
        endpoints = []
        for listener, option in zip(listeners, ("--listen", "--shm-dir or --name"), strict=True):
            try:
                endpoints.append(await listener.start())
            except OSError as exc:  # taken since check_startup, or a grant socket in use
                raise StartupError(f"{exc.strerror or exc}: change {option}") from None
        mounted = asyncio.Event()

        def on_mounted(_segment_id: int) -> None:
            loop.call_soon_threadsafe(mounted.set)

        def on_fatal(message: str, exit_code: int) -> None:
            fatal.append((message, exit_code))
            loop.call_soon_threadsafe(stop.set)

        channels = MasterChannels(MasterLocator(config.master, security=config.etcd_security), credentials)
        link = MasterLink(
            channels,
            pb.MountSegmentRequest(
                cluster_id=config.cluster_id,
                name=config.name,
                host_id=host_id(),
                endpoints=endpoints,
                dram_capacity=region.capacity,
                incarnation=region.nonce.hex(),
                ssd_capacity=store.capacity if store is not None else 0,
                offload=config.offload,
                disk_engine=engine.name if engine is not None else "",
                # a record is read whole into one read buffer: larger objects could not be served; and
                # one over a quarter of the tier would have a full tier delete most of itself for it
                ssd_max_object=min(parse_size(config.ssd_read_buffers) - 2 * 4096, store.capacity // 4)
                if store is not None
                else 0,
                keyed_reads=True,  # READ_KEYED on the tcp listener (kvtier.segment_server.keyed_reads)
                lease_grants=True,  # serves under the lease granted once the master saved it
                mount_sessions=True,  # judges grants by their mount (kvtier.segment_server.mount_session)
                writer_slots=True,  # reports same-host copies in progress (kvtier.segment_server.shm_writers)
            ),
            index=index,
            lease=keyed.lease,
            on_mounted=on_mounted,
            on_fatal=on_fatal,
            report=lambda: _report(stats, store, worker, keyed, writers),
            writers=lambda: list(writers.sample().ranges),
            report_disk=lambda stub, segment_id, epoch: (
                worker.report_inventory(stub, segment_id, epoch) if worker is not None else None
            ),
            clock=clock,
            mount=mount,
        )
        mount.attach(loop, listeners[0].mount_ended)
        if store is not None:
            # Mounting read record headers only: payloads are verified in the background.
            verifier = Verifier(store, parse_size(config.ssd_verify_rate))
            writer = GroupWriter(
                store, buffer_bytes=parse_size(config.ssd_write_buffers), threads=config.ssd_write_threads
            )
            worker = TierWorker(channels.stub, store, region.view, link.session, writer, verifier, clock)
            worker.write_limit.rate = config.ssd_write_limit_bytes
            worker.start()
            verifier.start()
        # The fast path has no TLS: with TLS the commit feed polls over gRPC.
        feed = CommitFeed(channels.stub, index, link.session, _fast_token(credentials))
        feed.start()
        metrics_address = ""
        if config.metrics:
            from kvtier.common.metrics import serve_metrics
            from kvtier.segment_server.metrics import SegmentCollector

            collector = SegmentCollector(
                config.name,
                stats,
                _disk_bytes_read,
                region.capacity,
                store,
                lambda: worker,
                lambda: feed,
                grants,
                relay,
                keyed,
                writers,
            )
            try:
                metrics_address = serve_metrics(config.metrics, collector, readiness=link.readiness)
            except OSError as exc:
                fatal.append((f"cannot bind metrics {config.metrics}: {exc.strerror}", 1))
                stop.set()
            logger.info("metrics listening address=%s", metrics_address)
        link.start()
        print(f"kvtier-segment {config.name} serving {', '.join(endpoints)} dram={region.capacity}", flush=True)
        waiter = asyncio.create_task(mounted.wait())
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if mounted.is_set() and config.ready_file:
            write_ready_file(
                config.ready_file,
                {
                    "name": config.name,
                    "endpoints": endpoints,
                    "region": region.path,
                    "pid": os.getpid(),
                    "metrics": metrics_address,
                },
            )
        await stopper
        waiter.cancel()
    finally:
        logger.info("segment server stopping name=%s", config.name)
        if verifier is not None:
            verifier.stop()
        if worker is not None:
            worker.stop()
        if feed is not None:
            feed.stop()
        if relay is not None:
            relay.close()
        if link is not None:
            link.stop(unmount=not fatal)
            channels.close()
        for listener in listeners:
            await listener.stop()
        if engine is not None:
            engine.close()
        if store is not None:
            store.close()
        region.close()
    if fatal:
        message, exit_code = fatal[0]
        (logger.info if exit_code == 0 else logger.error)("segment server exiting: %s", message)
        return exit_code
    return 0


def _fast_token(credentials: Credentials) -> str | None:
    """The token for the master's fast path (the commit feed, the commit relay); None with TLS,
    which the fast path does not have: both then stay on gRPC (the relay answers UNAVAILABLE)."""
    return None if credentials.tls else credentials.token


def check_startup(config: SegmentConfig) -> None:
    """What would stop this start half-way, checked before anything is created (StartupError, one
    line naming the option): the addresses to listen on, the SSD directory, the region's room."""
    check_bindable(config.listen, "--listen")
    if config.metrics:
        if same_address(config.metrics, config.listen):
            raise StartupError(f"--metrics {config.metrics} is the data plane's --listen address: change --metrics")
        check_bindable(config.metrics, "--metrics")
    tls = (config.tls_cert_file, config.tls_key_file, config.tls_ca_file)
    check_tls_files(*tls, "--tls-cert-file", "--tls-key-file", "--tls-ca-file")
    if config.ready_file:
        check_file_creatable(config.ready_file, "--ready-file")
    if not os.path.isdir(config.shm_dir) or not os.access(config.shm_dir, os.W_OK | os.X_OK):
        raise StartupError(
            f"cannot use {config.shm_dir} (lock file, grant socket): not a writable directory: change --shm-dir"
        )
    free = available_memory()
    if HEADER_SIZE + config.dram_bytes > free:
        raise StartupError(
            f"--dram {config.dram} is larger than the memory available to this process ({format_size(free)}): "
            "lower --dram, or give the service more memory (its cgroup's memory.max)"
        )
    # This name's region file and grant socket: stale ones (their server is gone) are removed; a
    # live one, or a file that is not ours, is a name in use.
    try:
        remove_if_orphaned(region_path(config.shm_dir, config.cluster_id, config.name))
        remove_stale_socket(grant_socket_path(config.shm_dir, config.cluster_id, config.name))
    except FileExistsError as exc:
        raise StartupError(f"{exc}: change --name (or --shm-dir)") from None
    buckets = 0
    if config.ssd_dir:
        check_writable_dir(config.ssd_dir, "--ssd-dir")
        if config.ssd_bucket_bytes < parse_size(config.ssd_bucket_size):
            logger.warning(
                "ssd bucket size lowered so the tier holds at least %d buckets (the open one is never "
                "evicted) ssd_size=%s ssd_bucket_size=%s used=%s",
                MIN_SSD_BUCKETS,
                config.ssd_size,
                config.ssd_bucket_size,
                format_size(config.ssd_bucket_bytes),
            )
        try:  # (it logs the limit it set): raise the open file limit for the bucket files
            _raise_fd_limit(config.ssd_bytes, config.ssd_bucket_bytes, config.ssd_bucket_keys)
        except FdLimitError as exc:
            raise StartupError(str(exc)) from None
        buckets = max_buckets(config.ssd_bytes, config.ssd_bucket_bytes, config.ssd_bucket_keys)
    _raise_for_connections(config.max_connections, buckets)


def available_memory() -> int:
    """Bytes a new region could take: the kernel's MemAvailable, capped by this cgroup's room under
    memory.max. The region is a memfd (charged to the cgroup, not limited by /dev/shm's size), so
    reserving more than this would push the host or the container into the OOM killer."""
    available = 1 << 62
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    try:  # cgroup v2: "0::/path"
        with open("/proc/self/cgroup") as cgroup:
            group = next((line.split("::", 1)[1].strip() for line in cgroup if line.startswith("0::")), None)
        if group is not None:
            base = os.path.join("/sys/fs/cgroup", group.lstrip("/"))
            with open(os.path.join(base, "memory.max")) as limit_file:
                limit = limit_file.read().strip()
            if limit != "max":
                with open(os.path.join(base, "memory.current")) as current_file:
                    available = min(available, int(limit) - int(current_file.read()))
    except (OSError, ValueError):
        pass
    return available


def _open_region(config: SegmentConfig) -> DramRegion:
    path = region_path(config.shm_dir, config.cluster_id, config.name)
    try:
        return DramRegion(path, config.dram_bytes, config.cluster_id, config.name).open()
    except FileExistsError as exc:  # created since check_startup
        raise StartupError(f"{exc}: change --name (or --shm-dir)") from None
    except OSError as exc:
        raise StartupError(f"{exc.strerror or exc}: lower --dram or change --shm-dir") from None


def _open_ssd_tier(config: SegmentConfig) -> tuple[BucketStore, object, DiskReader]:
    """Recover the bucket files, choose the disk engine, and build the READ_DISK server."""
    bucket_size = config.ssd_bucket_bytes  # the open file limit: raised in check_startup
    store = BucketStore(
        config.ssd_dir,
        config.ssd_bytes,
        config.cluster_id,
        bucket_size=bucket_size,
        bucket_keys=config.ssd_bucket_keys,
        high_watermark=config.ssd_high_watermark,
        low_watermark=config.ssd_low_watermark,
        direct_io=config.ssd_direct_io,
    )
    records = store.recover()
    room = store.used + file_system_room(config.ssd_dir)[1]
    if room < store.capacity:
        logger.warning(
            "the SSD tier's file system has room for %s of --ssd-size %s (used and free): the tier keeps its "
            "watermarks to what it can hold dir=%s",
            format_size(room),
            format_size(store.capacity),
            config.ssd_dir,
        )
    engine, reason = open_engine(config.ssd_io, queue_depth=config.ssd_queue_depth, threads=config.ssd_threads)
    logger.info(
        "ssd tier dir=%s capacity=%d used=%d objects=%d engine=%s",
        config.ssd_dir,
        store.capacity,
        store.used,
        len(records),
        reason,
    )
    pool = BufferPool(parse_size(config.ssd_read_buffers))
    return (
        store,
        engine,
        DiskReader(
            store,
            engine,
            pool,
            window=config.ssd_read_ahead,
            send_timeout_s=config.ssd_send_timeout_s,
            coalesce_bytes=parse_size(config.ssd_read_coalesce),
        ),
    )


def max_buckets(capacity: int, bucket_size: int, bucket_keys: int | None = None) -> int:
    """The most bucket files an SSD tier of `capacity` bytes can hold: capacity // (smallest sealed
    bucket) + 2 (the open bucket and slack). A bucket is sealed at `bucket_size` bytes, or earlier at
    `bucket_keys` records, which take at least 4096 bytes each after the 4096-byte bucket header."""
    smallest = bucket_size if bucket_keys is None else min(bucket_size, (bucket_keys + 1) * ALIGN)
    return capacity // smallest + 2


def fd_budget(capacity: int, bucket_size: int, soft: int, hard: int, *, bucket_keys: int | None = None) -> int:
    """The soft RLIMIT_NOFILE to run with, given the current `soft` and `hard` limits.

    The bucket store keeps one read fd per bucket file, so the process needs `max_buckets` fds plus
    FD_RESERVE. `soft` when it covers that, else the hard limit (just the need when the hard limit is
    unlimited). FdLimitError (a ValueError) when even the hard limit is short.
    """
    buckets = max_buckets(capacity, bucket_size, bucket_keys)
    needed = buckets + FD_RESERVE
    unlimited = resource.RLIM_INFINITY
    if soft == unlimited or soft >= needed:
        return soft
    if hard == unlimited:
        return needed
    if hard >= needed:
        return hard
    keys = ""
    if bucket_keys is not None and (bucket_keys + 1) * ALIGN < bucket_size:
        keys = f" (or --ssd-bucket-keys {bucket_keys}: buckets of {format_size((bucket_keys + 1) * ALIGN)})"
    raise FdLimitError(
        f"--ssd-size {format_size(capacity)} with --ssd-bucket-size {format_size(bucket_size)}{keys} "
        f"can mean {buckets} bucket files, one open file each, plus {FD_RESERVE} for sockets and the rest: "
        f"{needed} file descriptors, but the hard RLIMIT_NOFILE (open file limit) is {hard}; raise it "
        f"(ulimit -Hn, systemd LimitNOFILE=) or use a larger --ssd-bucket-size or a smaller --ssd-size"
    )


def _raise_fd_limit(capacity: int, bucket_size: int, bucket_keys: int) -> None:
    """Raise the soft RLIMIT_NOFILE for the SSD tier's bucket files (see fd_budget); FdLimitError if it cannot."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = fd_budget(capacity, bucket_size, soft, hard, bucket_keys=bucket_keys)
    if limit != soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
        except (ValueError, OSError) as exc:
            raise FdLimitError(
                f"cannot raise the open file limit RLIMIT_NOFILE from {soft} to {limit}: {exc}"
            ) from None
    logger.info(
        "open file limit soft=%s hard=%s previous_soft=%s ssd_buckets_max=%d reserve=%d",
        *(("unlimited" if n == resource.RLIM_INFINITY else n) for n in (limit, hard, soft)),
        max_buckets(capacity, bucket_size, bucket_keys),
        FD_RESERVE,
    )


def _raise_for_connections(max_connections: int, buckets: int) -> None:
    """Raise the soft RLIMIT_NOFILE to cover `max_connections` client connections too, where the hard
    limit allows (as the master does), so the data plane refuses a connection past its limit with
    TOO_MANY_CONNECTIONS, not a reset at EMFILE; a warning when the hard limit is short."""
    raise_open_file_limit(max_connections + buckets + FD_RESERVE, "--max-connections", logger)


def _disk_bytes_read() -> int:
    """Physical bytes this process read from storage: the kernel's own count (/proc/self/io)."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _report(
    stats: DataPlaneStats,
    store: BucketStore | None,
    worker: TierWorker | None,
    keyed: KeyedReads,
    writers: WriterTable,
) -> dict[str, object]:
    """Heartbeat fields: SSD usage, the per-tier byte counters, kept apart, direct reads served, and
    the copies same-host writers have in progress (kvtier.segment_server.shm_writers)."""
    sample = writers.sample()
    writers.last = sample
    return {
        "writers_sampled_ms": sample.sampled_ms,
        "writer_offsets": [offset for offset, _ in sample.ranges],
        "writer_lengths": [length for _, length in sample.ranges],
        "writer_cutoffs_ms": list(sample.cutoffs),
        "direct_reads_served": keyed.stats.served,
        "ssd_used": store.used if store is not None else 0,
        "ssd_usable": store.usable if store is not None else 0,
        "dram_bytes_served": stats.bytes_read,
        "ssd_bytes_served": stats.ssd_bytes_served,
        "disk_bytes_read": _disk_bytes_read(),
        "ssd_bytes_offloaded": worker.offloaded_bytes if worker is not None else 0,
    }
