"""The chaos history checker (tests/chaos/checker.py) on small hand-made histories: it catches what it claims."""

from __future__ import annotations

import crc32c

from tests.chaos.checker import Checker
from tests.chaos.values import Identity, identify, make_value

KEY = "h/w0.0/1"


class History:
    """Records as workers write them: an invoke line, then (unless indeterminate) a completion line."""

    def __init__(self) -> None:
        self.records: list[dict] = []
        self.ids = 0

    def op(self, op, t0, t1, results, proc="w0.0", keys=(KEY,), **extra) -> None:
        self.ids += 1
        self.records.append({"k": "i", "p": proc, "id": self.ids, "op": op, "keys": list(keys), "t": t0, **extra})
        if t1 is not None:
            self.records.append({"k": "c", "p": proc, "id": self.ids, "t": t1, "r": results})

    def put(self, version, t0, t1, result="OK", size=100) -> None:
        crc = crc32c.crc32c(make_value(KEY, "w0", version, size))
        self.op("put", t0, t1, [result], versions=[version], crcs=[crc])

    def remove(self, t0, t1, result="OK") -> None:
        self.op("remove", t0, t1, [result])

    def read(self, t0, t1, result, proc="w1.0") -> None:
        self.op("get", t0, t1, [result], proc=proc)


def value(version: int) -> dict:
    return {"v": [KEY, "w0", version]}


def rules(history: History, events=(), faults=()) -> list[str]:
    return [v.rule for v in Checker(history.records, events, faults).check().violations]


def eviction(t: float, version: int = 1, reason: str = "evicted:watermark", segment: str = "seg0") -> dict:
    crc = crc32c.crc32c(make_value(KEY, "w0", version, 100))
    return {"t": t, "event": "object", "reason": reason, "key": KEY, "checksum": crc, "segment": segment}


def test_values_identify_their_put_and_tell_torn_and_foreign_bytes():
    data = make_value(KEY, "w0", 3, 5000)
    assert identify(data) == Identity(KEY, "w0", 3)
    torn = bytearray(data)
    torn[4000] ^= 1
    assert "torn" in identify(bytes(torn))
    assert "torn" in identify(data[:4096])
    assert "no header" in identify(b"\0" * 100)


def test_a_clean_history_passes():
    h = History()
    h.put(1, 1.0, 1.1)
    h.read(1.2, 1.3, value(1))
    h.remove(2.0, 2.1)
    h.read(2.2, 2.3, "miss")
    h.put(2, 3.0, 3.1)
    h.read(3.05, 3.2, "miss")  # concurrent with the put: either answer is right
    h.read(3.2, 3.3, value(2))
    h.read(3.4, 3.5, "TIMEOUT")  # a failed read claims nothing
    assert rules(h) == []


def test_a_stale_read_after_an_acknowledged_remove_is_caught():
    h = History()
    h.put(1, 1.0, 1.1)
    h.remove(2.0, 2.1)
    h.read(2.2, 2.3, value(1))  # removed before the read began: resurrected
    assert rules(h) == ["STALE"]


def test_a_read_concurrent_with_the_remove_may_see_the_value():
    h = History()
    h.put(1, 1.0, 1.1)
    h.remove(2.0, 2.1)
    h.read(2.05, 2.3, value(1))
    assert rules(h) == []


def test_torn_foreign_and_phantom_values_are_caught():
    h = History()
    h.put(1, 1.0, 1.1)
    h.read(1.2, 1.3, {"corrupt": "torn: differs from byte 4000"})
    h.read(1.2, 1.3, {"v": ["h/w3.0/9", "w3", 1]})
    h.read(1.2, 1.3, value(7))  # never put
    h.put(2, 5.0, 5.1)
    h.read(1.4, 1.5, value(2))  # put only after the read completed
    assert rules(h) == ["CORRUPT", "FOREIGN", "PHANTOM", "PHANTOM"]


def test_a_lost_acknowledged_put_is_caught():
    h = History()
    h.put(1, 1.0, 1.1)
    h.read(2.0, 2.1, "miss")
    assert rules(h) == ["LOST"]


def test_a_corrupt_stored_copy_of_an_acknowledged_put_is_a_loss():
    h = History()
    h.put(1, 1.0, 1.1)
    h.read(2.0, 2.1, "CHECKSUM_MISMATCH")
    (violation,) = Checker(h.records).check().violations
    assert violation.rule == "LOST" and "checksum mismatch" in violation.why


def test_an_eviction_the_master_recorded_explains_the_miss():
    h = History()
    h.put(1, 1.0, 1.1)
    h.read(2.0, 2.1, "miss")
    assert rules(h, [eviction(1.5)]) == []
    # ...but not an eviction of another version, one after the read, or of a corrupt copy
    assert rules(h, [eviction(1.5, version=9)]) == ["LOST"]
    assert rules(h, [eviction(2.5)]) == ["LOST"]
    assert rules(h, [eviction(1.5, reason="evicted:corrupt")]) == ["LOST"]


def test_a_segment_loss_explains_a_miss_only_when_the_harness_faulted_that_segment():
    h = History()
    h.put(1, 1.0, 1.1)
    h.read(2.0, 2.1, "miss")
    lost = eviction(1.5, reason="segment:heartbeat ttl expired", segment="seg0")
    assert rules(h, [lost]) == ["LOST"]  # expelled though nobody touched it
    killed = {"kind": "kill_segment", "target": "seg0", "t0": 1.2, "t1": 1.4}
    assert rules(h, [lost], [killed]) == []
    assert rules(h, [lost], [{**killed, "target": "seg1"}]) == ["LOST"]
    stopped_master = {"kind": "stop_master", "target": "master", "t0": 1.2, "t1": 1.4}
    (violation,) = Checker(h.records, [lost], [stopped_master]).check().violations
    assert "stop_master" in violation.explain() and "heartbeat ttl expired" in violation.explain()


def test_an_indeterminate_put_may_or_may_not_appear():
    h = History()
    h.remove(0.5, 0.6)
    h.put(1, 1.0, None)  # the writer was SIGKILLed mid-put
    h.read(2.0, 2.1, value(1))
    h.read(2.2, 2.3, "miss")
    assert rules(h) == []


def test_a_failed_put_is_no_promise_but_its_value_is_still_a_real_one():
    h = History()
    h.put(1, 1.0, 1.1, result="TIMEOUT")
    h.read(2.0, 2.1, "miss")
    h.read(2.2, 2.3, value(1))
    assert rules(h) == []


def test_a_miss_after_a_remove_was_invoked_is_no_loss_even_if_the_remove_failed():
    h = History()
    h.put(1, 1.0, 1.1)
    h.remove(2.0, 2.1, result="EXC:KvtierError:UNAVAILABLE")
    h.read(2.2, 2.3, "miss")
    assert rules(h) == []


def test_a_silent_loss_is_accepted_only_when_a_segment_died_while_the_master_was_rebuilding():
    h = History()
    h.put(1, 1.0, 1.1)
    h.read(9.0, 9.1, "miss")
    master = {"kind": "kill_master", "target": "master", "t0": 2.0, "t1": 2.5}
    segment = {"kind": "kill_segment", "target": "seg1", "t0": 3.0, "t1": 3.5}
    assert rules(h, [], [master, segment]) == []  # its objects were on no master's books
    assert rules(h, [], [master]) == ["LOST"]  # a restart alone loses nothing
    late = {**segment, "t0": 8.0, "t1": 8.5}  # killed long after recovery: the master records it
    assert rules(h, [], [master, late]) == ["LOST"]
