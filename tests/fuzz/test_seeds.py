"""The atheris harnesses' seeds, run in the default suite (no atheris needed): every seed under
every read split goes through the harness's own checks, so a harness that no longer imports, or a
parser change that breaks a valid frame, fails here and not only in `make fuzz`. Findings saved by
`make fuzz` under .kvtier/fuzz/ (crash-*, leak-*, ...) are replayed too, until fixed and removed."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fuzz import fuzz_fastpath, fuzz_segment_protocol
from tests.fuzz.seeds import READS, seed_input

HARNESSES = {"fastpath": fuzz_fastpath, "segment": fuzz_segment_protocol}
FINDINGS = Path(__file__).resolve().parents[2] / ".kvtier" / "fuzz"


@pytest.mark.parametrize("harness", sorted(HARNESSES))
def test_every_seed_passes_its_harness_under_every_read_split(harness: str) -> None:
    module = HARNESSES[harness]
    seeds = module.seeds()
    assert len(seeds) >= 6, "a seed per frame kind"
    for i, seed in enumerate(seeds):
        assert seed_input(i, seed)[1:] == seed
        for split in range(len(READS)):
            module.test_one_input(bytes([split]) + seed)
    module.test_one_input(b"")  # the empty input (nothing arrives) is fine too
    module.test_one_input(b"\x00" + b"".join(seeds))  # every frame kind in one stream, a byte a read


@pytest.mark.parametrize("harness", sorted(HARNESSES))
def test_saved_findings_replay_clean(harness: str) -> None:
    prefix = {"fastpath": "fastpath-", "segment": "segment-"}[harness]
    findings = sorted(FINDINGS.glob(f"{prefix}*")) if FINDINGS.is_dir() else []
    for path in findings:
        HARNESSES[harness].test_one_input(path.read_bytes())
