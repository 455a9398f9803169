"""SSD write admission: which objects are worth a disk write (the SSD wear gate).

Every offload costs disk bandwidth and flash wear. Objects that are small
(their disk write costs more in per-record overhead than they save in
recompute) or that nobody has read back yet (most KV blocks are written once
and never reused) can be left out of the SSD tier: eviction then drops them,
to be recomputed if they are ever wanted, as it does without an SSD tier.
This is the gate LMCache, vLLM's `FilterReusedOffloadingManager` and Dynamo
KVBM ship; kvtier's default admits everything.

Two optional rules, from the master's config:
- `ssd_admit_min_bytes`: an object smaller than this is never offloaded;
- `ssd_admit_after_reads`: an object read (GetReplicas hits while it held
  DRAM, `ObjectRecord.reads`) fewer than this many times is never offloaded.

The decision is pure; `Tiering.refusal` asks it and counts nothing. Vetoes
are counted when an offload is refused for them (kvtier.master.tiering).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.master.records import ObjectRecord

MIN_SIZE = "min_size"  # smaller than ssd_admit_min_bytes
READS = "reads"  # read fewer than ssd_admit_after_reads times
REASONS = (MIN_SIZE, READS)


@dataclass(frozen=True, slots=True)
class Admission:
    min_bytes: int = 0
    after_reads: int = 0  # at most records.READS_CAP (validated with the config)

    def veto(self, record: ObjectRecord) -> str | None:
        """Why `record` may not be written to an SSD tier (MIN_SIZE, READS), or None when it may."""
        if record.size < self.min_bytes:
            return MIN_SIZE
        if record.reads < self.after_reads:
            return READS
        return None
