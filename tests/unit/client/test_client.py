"""`Client` without a cluster (kvtier.client.client): what it refuses before sending anything, how a
batch is cut and encoded, and what an unreachable master becomes for each kind of call.

The client points at 127.0.0.1:1, where nothing listens: a call that reached the network would come
back UNAVAILABLE, so an exception raised instead proves nothing was sent. Everything that needs a
master and segments (placement, transports, verification, leases, retries across a restart) is in
tests/integration/: test_put_get.py, test_batch.py, test_round_trips.py, test_errors.py,
test_transports.py, test_namespaces.py, test_damaged_copies.py and test_master_restart.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvtier.client import Client, Status
from kvtier.client.client import _pin_ttl_ms, as_bytes_view, as_writable_view
from kvtier.client.reads import COPY_PART_MIN_BYTES, _caps, _split, split_copy
from kvtier.proto.errors import InvalidKeyError, KvtierError

NOWHERE = "127.0.0.1:1"


@pytest.fixture
def client():
    with Client(NOWHERE, timeout=0.5) as client:
        yield client


BAD_KEYS = ["", "a\x00b", "k" * 1025, "é" * 600]  # empty, NUL, over 1 KiB, over 1 KiB of UTF-8
BAD_KEY_IDS = ["empty", "nul", "long", "long-utf8"]


@pytest.mark.parametrize("key", BAD_KEYS, ids=BAD_KEY_IDS)
def test_an_invalid_key_is_refused_by_every_call_before_anything_is_sent(client: Client, key: str):
    calls = [
        lambda: client.put(key, b"v"),
        lambda: client.batch_put(["ok", key], [b"v", b"v"]),
        lambda: client.get(key),
        lambda: client.batch_get(["ok", key]),
        lambda: client.get_into(key, bytearray(8)),
        lambda: client.exists(key),
        lambda: client.longest_prefix(["ok", key]),
        lambda: client.remove(key),
        lambda: client.stat(key),
        lambda: client.locate(key),
    ]
    for call in calls:
        with pytest.raises(InvalidKeyError) as raised:
            call()
        assert raised.value.status == Status.INVALID_KEY and isinstance(raised.value, ValueError)
    assert client.stats() == {}, "nothing was counted: nothing was tried"


@pytest.mark.parametrize("prefix", BAD_KEYS[1:], ids=BAD_KEY_IDS[1:])
def test_a_prefix_no_key_can_have_is_refused_before_anything_is_sent(client: Client, prefix: str):
    """A prefix with NUL or longer than any key listed, removed and watched nothing, silently (the
    master was asked, and answered 0). "" stays every key."""
    calls = [
        lambda: client.list_keys(prefix),
        lambda: next(client.iter_keys(prefix)),
        lambda: client.remove_prefix(prefix),
        lambda: client.watch_events(prefix),
    ]
    for call in calls:
        with pytest.raises(InvalidKeyError, match="prefix"):
            call()


def test_a_key_that_is_not_a_string_is_invalid(client: Client):
    with pytest.raises(InvalidKeyError):
        client.batch_put([b"bytes"], [b"v"])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"pin": "forever"}, "pin must be one of"),
        ({"pin_ttl": -1.0}, "pin_ttl must be between"),
        ({"pin_ttl": math.nan}, "pin_ttl must be between"),
        ({"pin_ttl": 5e6}, "pin_ttl must be between"),  # past the wire's uint32 of milliseconds
        ({"replicas": 0}, "replicas must be at least 1"),
    ],
    ids=["pin", "negative-ttl", "nan-ttl", "huge-ttl", "no-replica"],
)
def test_put_options_are_checked_before_anything_is_sent(client: Client, options: dict, message: str):
    with pytest.raises(ValueError, match=message):
        client.batch_put(["k"], [b"v"], **options)
    assert client.stats() == {}


def test_batches_must_pair_keys_with_values_and_buffers(client: Client):
    with pytest.raises(ValueError, match="2 keys but 1 values"):
        client.batch_put(["a", "b"], [b"v"])
    with pytest.raises(ValueError, match="2 keys but 1 buffers"):
        client.batch_get_into(["a", "b"], [bytearray(4)])


def test_buffers_must_be_contiguous_and_read_buffers_writable(client: Client):
    with pytest.raises(TypeError, match="read-only"):
        client.get_into("k", b"immutable")
    column = np.zeros((4, 4), dtype=np.uint8)[:, 1]  # bytes, one dimension, but a stride of 4
    with pytest.raises(ValueError, match="C-contiguous"):
        client.get_into("k", column)
    with pytest.raises(ValueError, match="C-contiguous"):
        client.put("k", column)
    with pytest.raises(ValueError, match="C-contiguous"):
        client.put("k", np.zeros((4, 4), dtype=np.uint16).T)
    assert client.stats() == {}


def test_constructor_arguments_are_checked(client: Client):
    with pytest.raises(ValueError, match="rank"):
        Client(NOWHERE, rank=-1)
    with pytest.raises(ValueError, match="instance"):
        client.register_instance(1, 1, 1 << 30)  # a client without instance= has no quota to register


def test_empty_batches_answer_at_once_without_the_master(client: Client):
    assert client.batch_put([], []) == []
    assert client.batch_get([]) == [] and client.batch_get_into([], []) == []
    assert client.batch_exists([]) == [] and client.batch_remove([]) == [] and client.batch_stat([]) == []
    assert client.longest_prefix([]) == 0
    assert client.stats() == {}


def test_an_unreachable_master_is_a_status_per_key_for_puts_and_a_miss_for_reads(client: Client):
    assert client.batch_put(["a", "b"], [b"1", b"2"]) == [Status.UNAVAILABLE] * 2
    with pytest.raises(KvtierError) as raised:
        client.put("a", b"1")
    assert raised.value.status == Status.UNAVAILABLE
    assert "put of 'a' failed" in str(raised.value) and "PutStart" in str(raised.value), "it says why"
    assert client.get("a") is None
    assert client.batch_get(["a", "b"], with_source=True) == [(None, None)] * 2
    assert client.get_into("a", bytearray(8)) == int(Status.UNAVAILABLE)
    stats = client.stats()
    assert stats["gets"] == stats["misses"] == 4 and stats["master_failures"] == 3


def test_an_unreachable_master_raises_for_calls_whose_answer_is_not_a_miss(client: Client):
    # "Not there" and "could not ask" must not look alike for exists/remove: an engine would recompute
    # or believe a key removed.
    for call in (lambda: client.exists("a"), lambda: client.remove("a"), lambda: client.cluster_status()):
        with pytest.raises(KvtierError) as raised:
            call()
        assert raised.value.status == Status.UNAVAILABLE


def test_a_batch_is_cut_into_contiguous_chunks_one_per_thread_for_four_keys_or_more():
    assert _split(list(range(3)), 8) == [[0, 1, 2]], "small batches stay whole"
    assert _split(list(range(10)), 4) == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]], "two parts: 10 // 4"
    assert _split(list(range(16)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    for n in (1, 4, 7, 16, 33, 100):
        for parts in (1, 2, 4, 8):
            chunks = _split(list(range(n)), parts)
            assert [i for chunk in chunks for i in chunk] == list(range(n)), "every key once, in order"
            assert len(chunks) <= max(1, min(parts, n // 4)), "no more parts than threads, nor than n // 4"


@pytest.mark.parametrize(
    ("seconds", "ms"),
    [(0.0, 0), (0.0001, 1), (1.1, 1100), (2.5, 2500), (4294967.295, 4294967295)],
    ids=["default", "never-rounds-to-default", "float-noise", "half", "max"],
)
def test_pin_ttl_goes_on_the_wire_as_milliseconds(seconds: float, ms: int):
    assert _pin_ttl_ms(seconds) == ms


def test_any_contiguous_buffer_is_sent_as_its_bytes_without_a_copy():
    array = np.arange(6, dtype=np.uint16).reshape(2, 3)
    view = as_bytes_view(array)
    assert view.format == "B" and view.ndim == 1 and len(view) == 12
    assert view.tobytes() == array.tobytes()
    array[0, 0] = 0xFFFF
    assert view[0] == 0xFF, "a view of the caller's memory, not a copy"
    target = bytearray(4)
    as_writable_view(target)[:2] = b"ab"
    assert target == b"ab\x00\x00"


def test_a_zero_size_multidimensional_array_is_an_empty_value_not_an_internal_error():
    """memoryview.cast refuses zeros in a shape: a (0, 8) array raised TypeError from inside the client."""
    for array in (np.zeros((0, 8), dtype=np.float32), np.zeros((3, 0), dtype=np.uint8)):
        assert len(as_bytes_view(array)) == 0
        assert len(as_writable_view(array)) == 0
    readonly = np.zeros((0, 4))
    readonly.flags.writeable = False
    with pytest.raises(TypeError, match="read-only"):
        as_writable_view(readonly)


def test_capability_tags_are_handed_to_each_replica_by_position():
    tags = bytes(range(48))  # three 16-byte tags
    assert _caps(tags, 1234, [2, 0], 77) == (1234, [tags[32:48], tags[0:16]], 77)
    assert _caps(b"", 1234, [0], 77) == (1234, [], 77), "no tags: the expiry still bounds the frames"
    assert _caps(b"", 0, [0], 77) is None


# ------------------------------------------------------------------ same-host copies shared by io threads


def test_a_large_copy_is_cut_in_contiguous_runs_of_about_equal_bytes():
    mib = 1 << 20
    items = list(range(32))
    runs = split_copy(items, [mib] * 32, 2)
    assert runs == [items[:16], items[16:]]
    runs = split_copy(items, [mib] * 32, 3)
    assert [x for run in runs for x in run] == items and len(runs) == 3
    assert max(map(len, runs)) - min(map(len, runs)) <= 1
    # Unequal sizes: the cut follows bytes, not counts.
    sizes = [4 * mib] + [mib] * 4
    assert split_copy(list(range(5)), sizes, 2) == [[0], [1, 2, 3, 4]]


def test_every_run_of_a_shared_copy_keeps_the_minimum_and_the_order():
    import random

    rng = random.Random(7)
    mib = 1 << 20
    assert split_copy([0, 1, 2], [3 * mib, 128 << 10, 128 << 10], 2) == [[0, 1, 2]]  # 256 KiB after the cut
    assert split_copy(list(range(5)), [128 << 10] * 4 + [8 * mib], 2) == [list(range(5))]  # no cut leaves both
    for _ in range(500):
        n = rng.randint(1, 40)
        sizes = [rng.choice([128 << 10, 300_000, mib, 3 * mib, 9 * mib]) for _ in range(n)]
        parts = rng.randint(1, 5)
        runs = split_copy(list(range(n)), sizes, parts)
        assert [x for run in runs for x in run] == list(range(n)) and 1 <= len(runs) <= parts
        if len(runs) > 1:
            assert min(sum(sizes[i] for i in run) for run in runs) >= COPY_PART_MIN_BYTES, (sizes, parts, runs)


def test_a_copy_too_small_to_share_stays_whole():
    half = COPY_PART_MIN_BYTES
    assert split_copy([1, 2], [half, half - 1], 2) == [[1, 2]]  # a part would be under the minimum
    assert split_copy([1, 2], [half, half], 2) == [[1], [2]]
    assert split_copy([1], [64 * half], 4) == [[1]]  # one object is never cut: its CRC is one pass
    assert split_copy([1, 2, 3], [half] * 3, 1) == [[1, 2, 3]]
    assert split_copy([], [], 2) == [[]]


def test_a_client_shares_copies_only_with_a_made_same_host_connector(client):
    from kvtier.proto import master_pb2 as pb

    segment = pb.SegmentEndpoint(name="seg0", endpoints=["shm:///nowhere"])
    # No connector made yet: never connects to ask, the call stays whole.
    assert client._split_copy(segment, [1, 2, 3, 4], lambda item: 1 << 20) == [[1, 2, 3, 4]]
    with Client(NOWHERE, copy_threads=3, io_threads=2) as other:
        assert other.config.copy_threads == 3
    with pytest.raises(ValueError, match="copy_threads"):
        Client(NOWHERE, copy_threads=0)


def test_parallel_jobs_answer_in_order_the_first_on_the_calling_thread_copies_on_their_pool():
    import threading

    copy_started = threading.Event()

    def first() -> tuple[int, str]:
        assert copy_started.wait(10)  # so the copy part is not taken back by this (calling) thread
        return 0, threading.current_thread().name

    def copy_part() -> tuple[int, str]:
        copy_started.set()
        return 2, threading.current_thread().name

    with Client(NOWHERE, copy_threads=2, io_threads=2) as client:
        where = threading.current_thread().name

        def on_io_pool(n: int):
            return lambda: (n, threading.current_thread().name)

        jobs = [(first,), (on_io_pool(1),), (copy_part,), (on_io_pool(3),)]
        results = client._run_parallel(jobs, {2})
        assert [n for n, _ in results] == [0, 1, 2, 3]
        assert results[0][1] == where
        assert results[1][1].startswith("kvtier-io") and results[3][1].startswith("kvtier-io")
        assert results[2][1].startswith("kvtier-copy")
    assert client._pool is None and client._copy_pool is None  # closed with the client
    with pytest.raises(KvtierError) as closed:
        client._run_parallel(jobs, {2})
    assert closed.value.status == Status.CANCELLED
    assert client._pool is None and client._copy_pool is None, "a call racing close() made a pool nobody shuts"


def test_a_copy_part_queued_behind_other_calls_is_copied_by_its_caller():
    import threading

    held, release = threading.Event(), threading.Event()

    def wait_until_held() -> None:
        assert held.wait(10)  # the other part runs on the copy pool's only thread, not on this one

    def hold_the_copy_thread() -> None:
        held.set()
        release.wait(60)

    with Client(NOWHERE, copy_threads=2) as client:
        other = threading.Thread(target=client._run_parallel, args=([(wait_until_held,), (hold_the_copy_thread,)], {1}))
        other.start()
        try:
            assert held.wait(10)
            answers: list = []
            caller = threading.Thread(
                target=lambda: answers.extend(
                    client._run_parallel([(lambda: "first",), (lambda: threading.current_thread().name,)], {1})
                ),
                name="the-caller",
            )
            caller.start()
            caller.join(30)
            assert not caller.is_alive(), "the part waited for the busy copy thread"
            assert answers == ["first", "the-caller"]
        finally:
            release.set()
            other.join(10)


def test_a_failed_job_raises_only_once_the_others_have_ended():
    import threading

    ended: list[str] = []
    go = threading.Event()

    def fails() -> None:
        go.set()
        raise ValueError("the first job failed")

    def writes_late() -> None:
        assert go.wait(10)
        threading.Event().wait(0.2)  # still writing into the caller's buffers when the first one failed
        ended.append("late")

    with Client(NOWHERE) as client:
        with pytest.raises(ValueError, match="the first job failed"):
            client._run_parallel([(fails,), (writes_late,)])
        assert ended == ["late"]


def test_a_call_racing_close_is_cancelled_and_runs_nothing():
    import threading

    ran: list[int] = []
    held, release = threading.Event(), threading.Event()

    def hold_the_copy_thread() -> None:
        held.set()
        release.wait(60)

    with Client(NOWHERE, copy_threads=2) as client:
        client._run_parallel([(lambda: None,), (lambda: None,), (lambda: None,)], {1})  # makes both pools
        client._copy_pool.submit(hold_the_copy_thread)
        assert held.wait(10)
        client._pool.shutdown()  # what close() does right after a call passed its check
        try:
            jobs = [(lambda: ran.append(0),), (lambda: ran.append(1),), (lambda: ran.append(2),)]
            raised: list[BaseException] = []

            def call() -> None:
                try:
                    client._run_parallel(jobs, {1})  # part 1 queued on the copy pool, part 2 refused
                except BaseException as exc:
                    raised.append(exc)

            caller = threading.Thread(target=call)
            caller.start()
            caller.join(20)
            assert not caller.is_alive(), "the call waited for a part it had cancelled"
            assert [getattr(exc, "status", exc) for exc in raised] == [Status.CANCELLED]
            assert ran == [], "a cancelled part ran anyway"
        finally:
            release.set()
