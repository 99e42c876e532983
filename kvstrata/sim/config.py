"""What one simulation runs: the model, the hardware, how many instances of how many GPUs, and how
requests are routed among them (:mod:`kvstrata.sim.engine` runs it).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvstrata.fleet.scorer import Policy
from kvstrata.hardware.specs import HardwareProfile
from kvstrata.kv.geometry import KVGeometry
from kvstrata.media import Medium
from kvstrata.plan.sharing import KVSharing
from kvstrata.plan.sizing import size_instances
from kvstrata.slo import Slo


class Routing(enum.Enum):
    """Which instance a request goes to (see :mod:`kvstrata.sim.engine`)."""

    SESSION = "session"  # hash_ids[0] % instances
    ROUND_ROBIN = "round-robin"  # arrival index % instances


@dataclass(frozen=True)
class SimConfig:
    """One simulation's setting.

    Attributes:
        geometry: the model.
        profile: the hardware; instance ``i`` uses GPUs ``i*K .. i*K+K-1`` of it.
        gpus_per_instance: K (tensor parallel); default (None) the fewest GPUs that hold the
            weights with room for KV (:func:`kvstrata.plan.sizing.size_instances`).
        instances: how many; default all the profile's GPUs allow.
        tier_tokens: capacity overrides per tier in tokens (per instance; the pool is shared).
        max_batch: most requests decoding together on one instance.
        restore_slots: most requests restoring at once on one instance.
        record_events: keep every event's time (for tests).
        fleet_tp: one TP size per instance of a mixed fleet (then ``gpus_per_instance`` and
            ``instances`` stay None); empty: ``instances`` of ``gpus_per_instance`` GPUs.
        sharing: how pool blocks are keyed and sized; head-sliced (one copy per block id, which
            any instance hits) is what the pool modelled before fleets.
        routing: which instance each request goes to.
        policy: a fleet routing policy (:mod:`kvstrata.sim.fleet`); when set, it routes, not ``routing``.
        slo: the targets the policy routes to meet, where it takes them
            (:class:`~kvstrata.fleet.scorer.PredictedTTFT`); None: none.
    """

    geometry: KVGeometry
    profile: HardwareProfile
    gpus_per_instance: int | None = None
    instances: int | None = None
    tier_tokens: tuple[tuple[Medium, int], ...] = ()
    max_batch: int = 256
    restore_slots: int = 4
    record_events: bool = False
    fleet_tp: tuple[int, ...] = ()
    sharing: KVSharing = KVSharing.SLICED
    routing: Routing = Routing.SESSION
    policy: Policy | None = None
    slo: Slo | None = None

    def __post_init__(self) -> None:
        # A model whose weights overflow its GPUs' HBM is refused, never simulated.
        if self.fleet_tp:
            if self.gpus_per_instance is not None or self.instances is not None:
                raise ValueError("a fleet sets each instance's GPUs: give fleet_tp or gpus_per_instance/instances")
            for tp in dict.fromkeys(self.fleet_tp):
                size_instances(self.geometry, self.profile, tp, 1).check_fits()
        else:
            sizing = size_instances(self.geometry, self.profile, self.gpus_per_instance, self.instances)
            sizing.check_fits()
            object.__setattr__(self, "gpus_per_instance", sizing.gpus_per_instance)  # resolved defaults
            object.__setattr__(self, "instances", sizing.instances)
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {self.max_batch}")
        if self.restore_slots < 1:
            raise ValueError(f"restore_slots must be at least 1, got {self.restore_slots}")

    @property
    def instance_count(self) -> int:
        return len(self.fleet_tp) or self.instances

    @property
    def instance_tps(self) -> tuple[int, ...]:
        """Each instance's TP size (GPUs), in instance order."""
        return self.fleet_tp or (self.gpus_per_instance,) * self.instances
