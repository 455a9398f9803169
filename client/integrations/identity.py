"""The identity of a KV-cache block: what must match for one engine to reuse another's bytes.

Two engine instances may share a block only when every field below is equal:
the model and its revision, the KV dtype (a bf16 deployment must never read an
fp8 one's bytes), the memory layout, tokens per block, the parallel layout and
rank (a TP rank holds only its heads; MLA models keep the same latent KV on
every rank and say `rankless`), the engine whose format the block is in, the
hash scheme and its seed, and kvtier's block format version. The identity
becomes the namespace (`kvtier.client.Client(namespace=...)`): a readable
prefix plus a digest of every field, so blocks of another identity are in
another namespace and can never be read, even when the block hashes collide.

Unseeded hashes are refused: an engine that hashes with Python's randomised
`hash` (or a per-process random seed) gives every instance different keys for
the same prefix, so nothing is ever shared; an adapter that sees one raises
`IdentityError` with the fix (e.g. set PYTHONHASHSEED, or choose sha256).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass

FORMAT_VERSION = 1
# Hash schemes whose block keys are the same in every process given the same seed.
SEEDED_SCHEMES = frozenset(("sha256", "sha256_cbor", "sha256-chain", "xxhash", "xxhash_cbor", "blake3", "builtin"))
# Schemes that depend on a process-wide seed which must then be pinned (e.g. PYTHONHASHSEED).
NEEDS_SEED = frozenset(("builtin",))


class IdentityError(ValueError):
    """An identity that cannot give correct or shareable keys; the message says how to fix it."""


@dataclass(frozen=True, slots=True)
class Identity:
    engine: str  # "sglang", "lmcache", "vllm": the block format
    model: str
    kv_dtype: str  # e.g. "bfloat16", "float8_e4m3fn"
    layout: str  # the engine's memory layout of a block, e.g. "layer_first", "page_first", "NHD"
    tokens_per_block: int
    hash_scheme: str  # e.g. "sha256", "sha256_cbor", "builtin"
    hash_seed: str = ""  # what the scheme is seeded with ("" for schemes without one)
    revision: str = ""  # model revision (commit), when known
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    rankless: bool = False  # MLA: every TP rank holds the same KV (tp_rank is left out of the key)
    extra: str = ""  # anything else the engine's block bytes depend on, as text
    format_version: int = FORMAT_VERSION

    def validate(self) -> Identity:
        for name in ("engine", "model", "kv_dtype", "layout", "hash_scheme"):
            if not getattr(self, name):
                raise IdentityError(f"identity needs {name}: blocks without it could be read by the wrong deployment")
        if self.tokens_per_block < 1:
            raise IdentityError(f"tokens_per_block must be at least 1, got {self.tokens_per_block}")
        if not (0 <= self.tp_rank < self.tp_size and 0 <= self.pp_rank < self.pp_size):
            raise IdentityError(
                f"rank tp={self.tp_rank}/{self.tp_size} pp={self.pp_rank}/{self.pp_size} is outside its group"
            )
        if self.hash_scheme in NEEDS_SEED and not self.hash_seed:
            raise IdentityError(
                f"hash scheme {self.hash_scheme!r} is unseeded here (Python's hash is randomised per process): "
                "every instance would compute other keys for the same prefix and share nothing. "
                "Set PYTHONHASHSEED (the same value on every instance) or choose a sha256 scheme."
            )
        return self

    def fields(self) -> dict:
        fields = asdict(self)
        if self.rankless:
            fields["tp_rank"] = -1  # the same KV on every TP rank: one copy serves them all
        return fields

    def digest(self) -> str:
        canonical = json.dumps(self.fields(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:32]

    def namespace(self, prefix: str = "") -> str:
        """`[prefix.]<engine>.<model>.<dtype>.tp<r>of<n>.pp<r>of<n>.<digest>`: readable for operators
        (kvtier keys --namespace), unique per identity through the digest (128 bits)."""
        model = re.sub(r"[^A-Za-z0-9_.-]+", "_", self.model)[-80:]
        tp = "tpall" if self.rankless else f"tp{self.tp_rank}of{self.tp_size}"
        name = f"{self.engine}.{model}.{self.kv_dtype}.{tp}.pp{self.pp_rank}of{self.pp_size}.{self.digest()}"
        return f"{prefix}.{name}" if prefix else name


def block_key(block_hash: bytes | str | int) -> str:
    """An engine's block hash as a kvtier key (hex for bytes and ints, as is for text)."""
    if isinstance(block_hash, bytes):
        return block_hash.hex()
    if isinstance(block_hash, int):
        return format(block_hash & ((1 << 256) - 1), "x")
    return str(block_hash)
