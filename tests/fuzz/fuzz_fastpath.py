"""atheris harness: the master's fast-path parser (kvtier.master.fastpath) on coverage-guided input.

Run by `make fuzz`; its seeds run in the default suite (tests/fuzz/test_seeds.py).
`python -m tests.fuzz.fuzz_fastpath -max_total_time=60`
(any libFuzzer flag works). Each input is a byte stream and the read sizes it arrives in (tests/fuzz/seeds.py); the
harness feeds it to a FastPathProtocol with a fake transport and checks what
tests/unit/master/test_fastpath_fuzz.py checks (its `check`, against its reference reading of
the stream): answers in order, one error frame and the close for an untrusted frame, bounded
buffers, the shared budget given back. Any exception is a finding: libFuzzer saves the input.
"""

from __future__ import annotations

import contextlib
import logging

try:
    import atheris
except ImportError:  # the default suite runs the seeds without atheris (tests/fuzz/test_seeds.py)
    atheris = None

with atheris.instrument_imports(include=["kvtier"]) if atheris else contextlib.nullcontext():
    from kvtier.master import fastpath  # noqa: F401  (instrumented for coverage)
    from tests.unit.master.fastpath_fakes import connect, make_handlers
    from tests.unit.master.test_fastpath_fuzz import LIMITS, SECRET, check

from kvtier.proto import rpcframe
from kvtier.proto.auth import make_token
from tests.fuzz.seeds import corpus_args, split

TOKEN = make_token(SECRET).encode()
HANDLERS = make_handlers()  # no segments: every handler answers at once
SECURED = make_handlers(SECRET)


def seeds() -> list[bytes]:
    out = []
    for method, (_, request_type, _) in sorted(rpcframe.METHODS.items()):
        fields = request_type.DESCRIPTOR.fields_by_name  # PollCommits (a segment's call) has neither
        seed = {"namespace": "ns", "keys": ["k0", "k1"]}
        payload = request_type(**{k: v for k, v in seed.items() if k in fields}).SerializeToString()
        out.append(rpcframe.HEADER.pack(rpcframe.MAGIC, method, method, len(payload)) + payload)
    out.append(rpcframe.HEADER.pack(rpcframe.MAGIC, rpcframe.AUTH_METHOD, 9, len(TOKEN)) + TOKEN + out[0])
    return out


def test_one_input(data: bytes) -> None:
    reads, stream = split(data)
    secured = stream.startswith(b"KM\xfe\xff")  # begins with an AUTH frame: credentials required
    conn = connect(SECURED if secured else HANDLERS, limits=LIMITS)
    conn.feed(stream, reads)
    check(conn, stream, TOKEN if secured else None)


def main() -> None:
    logging.disable(logging.CRITICAL)  # a protocol error is logged per bad frame
    atheris.Setup(corpus_args("fastpath", seeds()), test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
