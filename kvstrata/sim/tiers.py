"""Cache tiers of the simulator, the LRU of 512-token blocks each holds, and the architectures
as tier lists searched fastest first.

A tier holds chained block ids (see :mod:`kvstrata.sim.trace`): a request hits on the leading
run of its ids present, as in :mod:`kvstrata.sim.analyze`. Two write policies, as in the data
plane (:mod:`kvstrata.policies.write`):

* write-through (default): every request's blocks are inserted into (or refreshed in) every
  tier at arrival, so each tier is an independent LRU over the same access sequence, and a
  larger tier never holds fewer of a request's leading blocks (LRU is a stack algorithm).
* write-back: blocks enter HBM only; what HBM evicts is demoted into the next tier, what that
  evicts into the one after, and so on (an eviction cascade); a hit in a lower tier refreshes
  the block there and promotes a copy into HBM. Lower tiers then hold only what fell out of
  the faster ones, so they write far fewer bytes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from kvstrata.plan.architectures import Architecture
from kvstrata.plan.restore import RestorePath


class WritePolicy(enum.Enum):
    THROUGH = "through"
    BACK = "back"


class Tier(enum.Enum):
    HBM = "hbm"
    DRAM = "dram"
    POOL = "pool"
    NVME = "nvme"


_TIER_ALIASES = {
    "hbm": Tier.HBM,
    "dram": Tier.DRAM,
    "local-dram": Tier.DRAM,
    "pool": Tier.POOL,
    "remote": Tier.POOL,
    "nvme": Tier.NVME,
    "ssd": Tier.NVME,
}


@dataclass(frozen=True)
class ArchSpec:
    """What the simulator runs: tiers searched fastest first, and how KV moves.

    Attributes:
        name: as given (an architecture key or a ``+``-joined tier list).
        tiers: the tiers, fastest first; HBM always first.
        pool_path: how a pool hit reaches HBM (GDR, or two hops through local DRAM).
        pd_handoff: prefill on a separate GPU group, whose prompt KV moves to the decode GPUs.
        streaming: KV lives in DRAM and every decode step reads the batch's KV over PCIe.
        write: write-through or write-back (eviction cascade), see the module text.
    """

    name: str
    tiers: tuple[Tier, ...]
    pool_path: RestorePath = RestorePath.REMOTE_GDR
    pd_handoff: bool = False
    streaming: bool = False
    write: WritePolicy = WritePolicy.THROUGH

    @property
    def label(self) -> str:
        return self.name if self.write is WritePolicy.THROUGH else f"{self.name} (write-back)"

    def restore_path(self, tier: Tier) -> RestorePath | None:
        """The path a hit in ``tier`` takes into HBM; ``None`` when nothing moves."""
        if tier is Tier.HBM or (self.streaming and tier is Tier.DRAM):
            return None
        if tier is Tier.DRAM:
            return RestorePath.LOCAL_DRAM
        if tier is Tier.POOL:
            return self.pool_path
        return RestorePath.NVME


_SEVEN = {
    Architecture.HBM_RESIDENT: ArchSpec("hbm", (Tier.HBM,)),
    Architecture.LOCAL_DRAM: ArchSpec("local-dram", (Tier.HBM, Tier.DRAM)),
    Architecture.REMOTE_GDR: ArchSpec("remote-gdr", (Tier.HBM, Tier.POOL)),
    Architecture.REMOTE_STAGED: ArchSpec(
        "remote-staged", (Tier.HBM, Tier.DRAM, Tier.POOL), pool_path=RestorePath.REMOTE_TWO_HOP
    ),
    Architecture.PD_HANDOFF: ArchSpec("pd-handoff", (Tier.HBM,), pd_handoff=True),
    # The KV of running requests lives in DRAM; prefix hits there need no restore.
    Architecture.DRAM_STREAMING: ArchSpec("dram-streaming", (Tier.DRAM,), streaming=True),
    Architecture.NVME: ArchSpec("nvme", (Tier.HBM, Tier.NVME)),
}


def parse_arch(text: str, write: WritePolicy | str = WritePolicy.THROUGH) -> ArchSpec:
    """One of the seven keys (``remote-gdr``), or tiers joined by ``+`` (``hbm+pool+nvme``).

    A tier list is searched in the order given after HBM, which is always the first tier; pool
    hits go by GDR. ``write`` sets the write policy ("through" or "back").
    """
    try:
        write = WritePolicy(write)
    except ValueError:
        raise ValueError(f"unknown write policy {write!r}: expected 'through' or 'back'") from None
    key = text.strip().lower()
    for arch, spec in _SEVEN.items():
        if arch.value == key:
            return replace(spec, write=write)
    tiers: list[Tier] = [Tier.HBM]
    for part in key.split("+"):
        tier = _TIER_ALIASES.get(part.strip())
        if tier is None:
            known = ", ".join(a.value for a in Architecture)
            raise ValueError(
                f"unknown architecture {text!r}: expected one of {known}, or tiers "
                f"({', '.join(t.value for t in Tier)}) joined by '+'"
            )
        if tier not in tiers:
            tiers.append(tier)
    return ArchSpec(key, tuple(tiers), write=write)
