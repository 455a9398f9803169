"""Per-rank quotas of engine deployments.

An engine deployment (instance) registers its tensor- and pipeline-parallel
sizes and one byte budget; each of its TP x PP ranks may hold budget / (TP x
PP) bytes of DRAM (every replica counted), because a store budget quoted per
deployment is shared by all of its ranks: 256 GiB at 32 ranks is 8 GiB per
rank, not 256 GiB per node. Ranks of instances that never registered are
tracked (for `kvtier quotas`) while they hold objects, with no limit (an account of an unregistered
instance goes with its last object: accounts are bounded by the objects, not by the names ever
used; instance names are at most MAX_INSTANCE_BYTES). Plain Python, owned by
`MasterState`.
"""

from __future__ import annotations

from dataclasses import dataclass

# Ranks of one deployment (TP x PP): far above any real one (8 x 64 = 512), and low enough that the
# accounts registration creates stay small: a request for 2^32 x 2^32 must not allocate them all.
MAX_RANKS = 1 << 16
# An instance name names an account and a metrics label: bounded like a key.
MAX_INSTANCE_BYTES = 256


def instance_problem(instance: str) -> str:
    """Why `instance` cannot name an account ("" = it can)."""
    size = len(instance.encode(errors="replace"))
    return f"instance name of {size} bytes; at most {MAX_INSTANCE_BYTES}" if size > MAX_INSTANCE_BYTES else ""


@dataclass(slots=True, eq=False)
class Owner:
    """One engine rank's account."""

    instance: str
    rank: int
    quota: int = 0  # bytes; 0 = unlimited (instance not registered)
    used: int = 0  # DRAM bytes held by this rank's objects, pending and complete, every replica
    objects: int = 0
    tp_size: int = 0
    pp_size: int = 0

    def over_by(self, extra: int) -> int:
        """Bytes that must be freed before `extra` more fit in the quota (0 = it fits)."""
        if not self.quota:
            return 0
        return max(0, self.used + extra - self.quota)


class QuotaTable:
    def __init__(self) -> None:
        self._owners: dict[tuple[str, int], Owner] = {}
        self._instances: dict[str, tuple[int, int, int]] = {}  # instance -> (tp, pp, budget)

    def register(self, instance: str, tp_size: int, pp_size: int, budget: int) -> int:
        """(Re-)register a deployment; returns the per-rank quota. Raises ValueError when invalid.

        Re-registering with other sizes or budget updates every rank's quota;
        objects already stored stay (a rank over its new quota evicts on its
        next put).
        """
        if not instance:
            raise ValueError("instance must not be empty")
        if problem := instance_problem(instance):
            raise ValueError(problem)
        if tp_size < 1 or pp_size < 1:
            raise ValueError(f"tp_size and pp_size must be at least 1, got {tp_size} x {pp_size}")
        ranks = tp_size * pp_size
        if ranks > MAX_RANKS:
            raise ValueError(f"tp_size x pp_size = {ranks} ranks; at most {MAX_RANKS} are allowed")
        if budget < ranks:
            raise ValueError(f"budget of {budget} bytes is less than one byte per rank ({ranks} ranks)")
        quota = budget // ranks
        self._instances[instance] = (tp_size, pp_size, budget)
        for (name, rank), owner in self._owners.items():
            if name == instance and rank >= ranks:
                owner.quota, owner.tp_size, owner.pp_size = 0, tp_size, pp_size  # rank gone: no new puts
        for rank in range(ranks):
            owner = self._owners.setdefault((instance, rank), Owner(instance, rank))
            owner.quota, owner.tp_size, owner.pp_size = quota, tp_size, pp_size
        return quota

    def owner(self, instance: str, rank: int) -> Owner | None:
        """The account for (instance, rank), created on first use; None when no instance is named."""
        if not instance:
            return None
        owner = self._owners.get((instance, rank))
        if owner is None:
            owner = self._owners[(instance, rank)] = Owner(instance, rank)
            registered = self._instances.get(instance)
            if registered:
                owner.tp_size, owner.pp_size = registered[0], registered[1]
        return owner

    def forget_idle(self, owner: Owner) -> None:
        """An account of an unregistered instance that holds nothing goes (it comes back with its
        next object): accounts are bounded by the objects stored, not by the names ever used."""
        if not owner.objects and not owner.used and owner.instance not in self._instances:
            if self._owners.get((owner.instance, owner.rank)) is owner:
                del self._owners[(owner.instance, owner.rank)]

    def charged(self, owner: Owner) -> None:
        """`owner` holds an object (again): it is in the table, even if it went idle meanwhile (its
        last object left within the call that charges it: a reclaimed put, an eviction for room)."""
        if self._owners.get((owner.instance, owner.rank)) is not owner:
            self._owners[(owner.instance, owner.rank)] = owner

    def rank_allowed(self, instance: str, rank: int) -> bool:
        """False for a rank beyond a registered instance's TP x PP."""
        registered = self._instances.get(instance)
        return registered is None or rank < registered[0] * registered[1]

    def registrations(self) -> dict[str, list[int]]:
        """instance -> [tp, pp, budget]: what a restarted master needs to rebuild the quotas."""
        return {name: list(sizes) for name, sizes in self._instances.items()}

    def snapshot(self) -> list[Owner]:
        return sorted(self._owners.values(), key=lambda o: (o.instance, o.rank))
