"""Input layout and seed corpora shared by the atheris harnesses.

An input is one byte choosing the read sizes the stream arrives in, then the stream. Seeds are
valid frames of every kind, so the fuzzer starts past the magic numbers; they are written to
.kvtier/fuzz/<harness>/ (git-ignored) and given to libFuzzer as its corpus directory unless the
command line names one.
"""

from __future__ import annotations

import sys
from pathlib import Path

READS = [[1], [3], [7], [24], [100], [4096], [70_000], [5, 1, 300, 2]]


def split(data: bytes) -> tuple[list[int], bytes]:
    """(read sizes, stream) of one input."""
    if not data:
        return READS[-1], b""
    return READS[data[0] % len(READS)], data[1:]


def seed_input(i: int, seed: bytes) -> bytes:
    """Seed `i` as a harness input: read-size selector, then the stream."""
    return bytes([i % len(READS)]) + seed


def corpus_args(harness: str, seeds: list[bytes]) -> list[str]:
    """sys.argv with the seed corpus directory added when no corpus directory was given."""
    argv = list(sys.argv)
    if any(not arg.startswith("-") for arg in argv[1:]):
        return argv
    directory = Path(".kvtier") / "fuzz" / harness
    directory.mkdir(parents=True, exist_ok=True)
    for i, seed in enumerate(seeds):
        (directory / f"seed-{i}").write_bytes(seed_input(i, seed))
    return [*argv, str(directory)]
