"""atheris harness: the segment server's data-plane parser (kvtier.segment_server.protocol).

Run by `make fuzz`; its seeds run in the default suite (tests/fuzz/test_seeds.py).
`python -m tests.fuzz.fuzz_segment_protocol -max_total_time=60`. Each input is a byte stream and the
read sizes it arrives in (tests/fuzz/seeds.py), fed to a DataProtocol over a 4 KiB region with a fake
transport (tests/unit/segment_server/test_protocol.py).
Checked: nothing raises, get_buffer never hands out an empty buffer, every response is a
well-formed frame, a PROTOCOL_ERROR is the last response and closes the connection, and
nothing outside the ranges written changes size (the region stays 4 KiB).
"""

from __future__ import annotations

import contextlib
import logging

try:
    import atheris
except ImportError:  # the default suite runs the seeds without atheris (tests/fuzz/test_seeds.py)
    atheris = None

with atheris.instrument_imports(include=["kvtier"]) if atheris else contextlib.nullcontext():
    from kvtier.proto.frames import Op, pack_disk_names
    from kvtier.proto.status import Status
    from tests.unit.segment_server.test_protocol import CAPACITY, make_conn, pack_request  # with a deadline

from tests.fuzz.seeds import corpus_args, split


def seeds() -> list[bytes]:
    return [
        pack_request(Op.PING, 1, []),
        pack_request(Op.READ, 2, [(0, 16), (100, 8)]),
        pack_request(Op.READ, 3, [(0, 16)], trace=7),
        pack_request(Op.READ, 4, [(0, 16)], caps=(1, b"t" * 16)),
        pack_request(Op.WRITE, 5, [(8, 4), (64, 2)], 6) + b"abcdef",
        pack_request(Op.READ_DISK, 6, [(0, 8)], 5) + pack_disk_names([b"n\x00k"]),
    ]


def test_one_input(data: bytes) -> None:
    reads, stream = split(data)
    conn = make_conn()
    conn.feed(stream, reads)
    responses = conn.responses()  # parses every frame; asserts each is whole and well-formed
    errors = [i for i, r in enumerate(responses) if r.status == Status.PROTOCOL_ERROR]
    if errors:
        assert errors == [len(responses) - 1], "a PROTOCOL_ERROR must be the last response"
        assert conn.transport.closed, "a PROTOCOL_ERROR closes the connection"
    assert len(conn.region) == CAPACITY


def main() -> None:
    logging.disable(logging.CRITICAL)
    atheris.Setup(corpus_args("segment_protocol", seeds()), test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
