"""Cache tiers of the simulator, the LRU of 512-token blocks each holds, and the architectures
as tier lists searched fastest first.

A tier is a :class:`kvstrata.media.Medium`; an architecture gives its own search order (the pool
before NVMe in ``hbm+pool+nvme``, whatever ``Medium``'s value order). Users name the media by
their hardware (``hbm``, ``dram``, ``pool``, ``nvme``): :func:`parse_arch` reads those names and
reports print them (:data:`HARDWARE_NAME`); inside the simulator a tier is only ever a ``Medium``.

A tier holds chained block ids (see :mod:`kvstrata.sim.trace`): a request hits on the leading
run of its ids present, as in :mod:`kvstrata.sim.analyze`. Two of the data plane's write
policies (:class:`kvstrata.policies.write.WritePolicy`; selective is not modelled):

* write-through (default): every request's blocks are inserted into (or refreshed in) every
  tier at arrival, so each tier is an independent LRU over the same access sequence, and a
  larger tier never holds fewer of a request's leading blocks (LRU is a stack algorithm).
* write-back: blocks enter HBM only; what HBM evicts is demoted into the next tier, what that
  evicts into the one after, and so on (an eviction cascade); a hit in a lower tier refreshes
  the block there and promotes a copy into HBM. Lower tiers then hold only what fell out of
  the faster ones, so they write far fewer bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvstrata.media import Medium
from kvstrata.plan.architectures import Architecture
from kvstrata.plan.restore import RestorePath
from kvstrata.policies.write import WritePolicy

HARDWARE_NAME: dict[Medium, str] = {
    Medium.DEVICE: "hbm",
    Medium.HOST: "dram",
    Medium.REMOTE: "pool",
    Medium.DISK: "nvme",
}
"""What users call each medium here: read by :func:`parse_arch`, printed by reports; never a key."""

_MEDIUM_ALIASES = {
    **{name: medium for medium, name in HARDWARE_NAME.items()},
    "local-dram": Medium.HOST,
    "remote": Medium.REMOTE,
    "ssd": Medium.DISK,
}

WRITE_NAMES: dict[str, WritePolicy] = {"through": WritePolicy.WRITE_THROUGH, "back": WritePolicy.WRITE_BACK}
"""The write policies the simulator models, by the names ``kvstrata simulate --write`` takes."""


@dataclass(frozen=True)
class ArchSpec:
    """What the simulator runs: tiers searched fastest first, and how KV moves.

    Attributes:
        name: as given (an architecture key or a ``+``-joined tier list).
        tiers: the tiers, in the order searched; the device (HBM) first unless KV lives in DRAM.
        pool_path: how a pool hit reaches HBM (GDR, or two hops through local DRAM).
        pd_handoff: prefill on a separate GPU group, whose prompt KV moves to the decode GPUs.
        streaming: KV lives in DRAM and every decode step reads the batch's KV over PCIe.
        write: write-through or write-back (eviction cascade), see the module text.
    """

    name: str
    tiers: tuple[Medium, ...]
    pool_path: RestorePath = RestorePath.REMOTE_GDR
    pd_handoff: bool = False
    streaming: bool = False
    write: WritePolicy = WritePolicy.WRITE_THROUGH

    def __post_init__(self) -> None:
        if self.write not in WRITE_NAMES.values():
            raise ValueError(f"the simulator models write-through and write-back, not {self.write.value}")

    @property
    def label(self) -> str:
        return self.name if self.write is WritePolicy.WRITE_THROUGH else f"{self.name} ({self.write.value})"

    def restore_path(self, tier: Medium) -> RestorePath | None:
        """The path a hit in ``tier`` takes into HBM; ``None`` when nothing moves."""
        if tier is Medium.DEVICE or (self.streaming and tier is Medium.HOST):
            return None
        if tier is Medium.HOST:
            return RestorePath.LOCAL_DRAM
        if tier is Medium.REMOTE:
            return self.pool_path
        return RestorePath.NVME


_SEVEN = {
    Architecture.HBM_RESIDENT: ArchSpec("hbm", (Medium.DEVICE,)),
    Architecture.LOCAL_DRAM: ArchSpec("local-dram", (Medium.DEVICE, Medium.HOST)),
    Architecture.REMOTE_GDR: ArchSpec("remote-gdr", (Medium.DEVICE, Medium.REMOTE)),
    Architecture.REMOTE_STAGED: ArchSpec(
        "remote-staged", (Medium.DEVICE, Medium.HOST, Medium.REMOTE), pool_path=RestorePath.REMOTE_TWO_HOP
    ),
    Architecture.PD_HANDOFF: ArchSpec("pd-handoff", (Medium.DEVICE,), pd_handoff=True),
    # The KV of running requests lives in DRAM; prefix hits there need no restore.
    Architecture.DRAM_STREAMING: ArchSpec("dram-streaming", (Medium.HOST,), streaming=True),
    Architecture.NVME: ArchSpec("nvme", (Medium.DEVICE, Medium.DISK)),
}


def parse_write(write: WritePolicy | str) -> WritePolicy:
    """``write`` itself, or the policy it names ("through" or "back")."""
    if isinstance(write, WritePolicy):
        return write
    policy = WRITE_NAMES.get(write)
    if policy is None:
        raise ValueError(f"unknown write policy {write!r}: expected {' or '.join(map(repr, WRITE_NAMES))}")
    return policy


def parse_arch(text: str, write: WritePolicy | str = WritePolicy.WRITE_THROUGH) -> ArchSpec:
    """One of the seven keys (``remote-gdr``), or tiers joined by ``+`` (``hbm+pool+nvme``).

    A tier list is searched in the order given after HBM, which is always the first tier; pool
    hits go by GDR. ``write`` sets the write policy (see :func:`parse_write`).
    """
    policy = parse_write(write)
    key = text.strip().lower()
    for arch, spec in _SEVEN.items():
        if arch.value == key:
            return replace(spec, write=policy)
    tiers: list[Medium] = [Medium.DEVICE]
    for part in key.split("+"):
        tier = _MEDIUM_ALIASES.get(part.strip())
        if tier is None:
            known = ", ".join(a.value for a in Architecture)
            raise ValueError(
                f"unknown architecture {text!r}: expected one of {known}, or tiers "
                f"({', '.join(HARDWARE_NAME.values())}) joined by '+'"
            )
        if tier not in tiers:
            tiers.append(tier)
    return ArchSpec(key, tuple(tiers), write=policy)
