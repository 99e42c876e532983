"""How many GPUs one instance of a model takes on a server, and how many instances it holds.

An instance is one tensor-parallel group of K GPUs of the node: each GPU holds a 1/K share of
every weight (a MoE's idle experts too) and 1/K of the KV heads (or whole heads, replicated,
when K exceeds them; MLA's latent whole on every GPU), as :meth:`KVGeometry.kv_heads_per_gpu`
rules. ``HBM_USABLE_FRACTION`` of each GPU's HBM is usable; the weights' share must fit in it.

The default K is the fewest GPUs whose usable HBM keeps at least ``KV_MARGIN_FRACTION`` of
itself for KV after the weights' share; when no degree of the node leaves that margin, the
fewest that hold the weights at all; when none holds them, the largest degree (and the
sizing says the weights do not fit, which :meth:`InstanceSizing.check_fits` refuses).
The default only considers degrees that split the query heads evenly too, as serving engines
require (vLLM and SGLang shard attention heads over the TP ranks); a degree asked for is held
to the KV rule alone, as everywhere else here.

Pure: no I/O; the CLI turns these results and errors into lines that name its flags.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvstrata.hardware.specs import HardwareProfile
from kvstrata.kv.fields import GeometryError
from kvstrata.kv.geometry import KVGeometry
from kvstrata.kv.groups import GroupKind
from kvstrata.plan.architectures import HBM_USABLE_FRACTION

# Share of each GPU's usable HBM the default keeps for KV after the weights. At a half, KV
# room is at least the weights' share, so a full decode batch reads at least as many KV bytes
# per step as weight bytes: the per-step weight read is spread over a real batch. With less
# room the batch (and so throughput per GPU) is cut to what the little KV space holds, and a
# long context may not fit at all.
KV_MARGIN_FRACTION = 0.5


class WeightsDoNotFit(ValueError):
    """The model's weights exceed the usable HBM of the GPUs asked for; one line says so."""


class Basis(enum.Enum):
    """Why an instance has the GPUs it has."""

    REQUESTED = "requested"  # the caller named K
    KV_MARGIN = "kv-margin"  # fewest leaving KV_MARGIN_FRACTION of usable HBM for KV
    WEIGHTS_ONLY = "weights-only"  # fewest that hold the weights; none leaves the margin
    NONE_FIT = "none-fit"  # no degree of the node holds the weights: the largest


@dataclass(frozen=True)
class InstanceSizing:
    """The GPUs of one instance and how many instances the node holds.

    Attributes:
        model: the model's name.
        weight_dtype: the weights' element type name (``"bf16"``).
        weight_bytes: all the model's weights, unsharded.
        gpus_per_instance: K, the tensor-parallel degree.
        instances: how many instances of K GPUs.
        node_gpus: GPUs of the node.
        gpu_model: the catalog model of the instance's GPUs (the first's).
        hbm_bytes_per_gpu: HBM of the smallest GPU used.
        basis: why K.
        fewest_that_fit: the fewest GPUs of a degree the default considers that hold the
            weights; None when none does.
        uncounted: weights the config gave no fields to count (``KVGeometry.uncounted_params``):
            the sizing assumes there are none, so ``weight_bytes`` is a lower bound.
    """

    model: str
    weight_dtype: str
    weight_bytes: int
    gpus_per_instance: int
    instances: int
    node_gpus: int
    gpu_model: str
    hbm_bytes_per_gpu: int
    basis: Basis
    fewest_that_fit: int | None
    uncounted: tuple[str, ...] = ()

    @property
    def usable_hbm_bytes_per_gpu(self) -> int:
        return int(self.hbm_bytes_per_gpu * HBM_USABLE_FRACTION)

    @property
    def weight_bytes_per_gpu(self) -> int:
        return self.weight_bytes // self.gpus_per_instance

    @property
    def kv_room_bytes_per_gpu(self) -> int:
        """Usable HBM left for KV on each GPU after the weights' share; negative: they do not fit."""
        return self.usable_hbm_bytes_per_gpu - self.weight_bytes_per_gpu

    @property
    def weights_fit(self) -> bool:
        return self.weight_bytes / self.gpus_per_instance < self.hbm_bytes_per_gpu * HBM_USABLE_FRACTION

    def check_fits(self) -> None:
        """Raise :class:`WeightsDoNotFit`, one line naming the model, its weight bytes, the GPUs
        and their memory, unless the weights fit."""
        if self.weights_fit:
            return
        k = self.gpus_per_instance
        if self.fewest_that_fit is not None:
            hint = f"{_gpus(self.fewest_that_fit)} per instance would hold them"
        else:
            hint = f"no tensor-parallel group of the node's {_gpus(self.node_gpus)} holds them"
        raise WeightsDoNotFit(
            f"{self.model}'s {self.weight_bytes / 1e9:,.1f} GB of {self.weight_dtype} weights do not fit on "
            f"{k} x {self.gpu_model} ({self.hbm_bytes_per_gpu / 1e9:,.1f} GB HBM each, "
            f"{HBM_USABLE_FRACTION:.0%} usable: {k * self.usable_hbm_bytes_per_gpu / 1e9:,.1f} GB); {hint}"
        )


def tp_degrees(geometry: KVGeometry, max_gpus: int, *, engine_heads: bool = False) -> tuple[int, ...]:
    """Tensor-parallel degrees from 1 to ``max_gpus`` the model's KV heads allow.

    Args:
        geometry: the model.
        max_gpus: the largest degree to consider.
        engine_heads: also require the query heads to split evenly (what engines run).
    """
    out = []
    for k in range(1, max_gpus + 1):
        try:
            geometry.kv_heads_per_gpu(k)
        except GeometryError:
            continue
        if engine_heads and geometry.num_attention_heads % k:
            continue
        out.append(k)
    return tuple(out)


def check_tp(geometry: KVGeometry, gpus: int, node_gpus: int | None = None) -> None:
    """Raise unless ``gpus`` is a degree the model's KV heads allow (and, given a node, it has).

    The message names no parameter and lists the degrees that work: a caller prefixes what the
    user set (a CLI flag).

    Raises:
        ValueError: fewer than 1 GPU, or more than the node has.
        GeometryError: the KV heads do not split over ``gpus``.
    """
    if gpus < 1:
        raise ValueError(f"an instance needs at least 1 GPU, not {gpus}")
    if node_gpus is not None and gpus > node_gpus:
        raise ValueError(f"{gpus} GPUs per instance, but the node has only {_gpus(node_gpus)}")
    kv = geometry.num_kv_heads
    if gpus in tp_degrees(geometry, gpus):
        return
    states = {group.state_heads for group in geometry.groups if group.kind is GroupKind.STATE}
    why = f"{geometry.name}'s {kv} KV heads do not split over {gpus} GPUs (a GPU holds whole heads)"
    if states and _heads_split(geometry, gpus):  # the attention heads fit: a state does not
        heads = ", ".join(map(str, sorted(states)))
        why = f"{geometry.name}'s recurrent state ({heads} heads) does not split over {gpus} GPUs"
    if node_gpus is not None or states:
        listed = ", ".join(map(str, tp_degrees(geometry, node_gpus or gpus)))
        where = f"on the node's {_gpus(node_gpus)}" if node_gpus is not None else f"up to {_gpus(gpus)}"
        raise GeometryError(f"{why}; {where} it runs on {listed}")
    listed = ", ".join(map(str, tp_degrees(geometry, kv)))
    raise GeometryError(f"{why}; it runs on {listed} or a multiple of {kv} GPUs")


def _heads_split(geometry: KVGeometry, gpus: int) -> bool:
    """Every per-token group's KV heads split over ``gpus`` (a STATE group may still refuse)."""
    try:
        for group in geometry.groups:
            if group.kind.per_token:
                group.heads_per_gpu(gpus)
    except GeometryError:
        return False
    return True


def size_instances(
    geometry: KVGeometry,
    profile: HardwareProfile,
    gpus_per_instance: int | None = None,
    instances: int | None = None,
) -> InstanceSizing:
    """Choose (or check) the GPUs per instance, and count the instances.

    Args:
        geometry: the model.
        profile: the server; instance ``i`` takes GPUs ``i*K .. i*K+K-1``.
        gpus_per_instance: K; None for the default (see the module docstring).
        instances: how many; None for as many as the node's GPUs hold.

    Returns:
        The sizing; ``weights_fit`` is False where no choice holds them (check with
        :meth:`InstanceSizing.check_fits`).

    Raises:
        ValueError: no GPU in the profile; ``instances`` below 1; ``instances`` of K GPUs
            exceed the node (the message names the counts, not a parameter).
        GeometryError: a K the model's KV heads do not split over (see :func:`check_tp`).
    """
    node = len(profile.gpus)
    if node == 0:
        raise ValueError(f"profile {profile.name!r} has no GPU")
    if instances is not None and instances < 1:
        raise ValueError(f"{instances} instances: at least 1 is needed")
    if gpus_per_instance is not None:
        check_tp(geometry, gpus_per_instance, node)
    per_instance_max = node // (instances or 1)
    if per_instance_max < 1:
        raise ValueError(f"{instances} instances need at least {instances} GPUs; profile {profile.name!r} has {node}")
    weights = geometry.weight_bytes()

    def hbm(k: int) -> int:
        used = profile.gpus[: k * (instances or node // k)]
        return min(profile.topology.node(g.name).capacity_bytes for g in used)

    def fits(k: int, weight_share: float = 1.0) -> bool:
        """The weights' 1/k share fits in ``weight_share`` of a GPU's usable HBM."""
        return weights / k < hbm(k) * HBM_USABLE_FRACTION * weight_share

    candidates = tp_degrees(geometry, per_instance_max, engine_heads=True) or tp_degrees(geometry, per_instance_max)
    engine_degrees = tp_degrees(geometry, node, engine_heads=True) or tp_degrees(geometry, node)
    fewest_fit = next((k for k in engine_degrees if fits(k)), None)
    if gpus_per_instance is not None:
        k, basis = gpus_per_instance, Basis.REQUESTED
    elif margin := [k for k in candidates if fits(k, 1 - KV_MARGIN_FRACTION)]:
        k, basis = margin[0], Basis.KV_MARGIN
    elif tight := [k for k in candidates if fits(k)]:
        k, basis = tight[0], Basis.WEIGHTS_ONLY
    elif candidates:
        k, basis = candidates[-1], Basis.NONE_FIT
    else:
        raise GeometryError(
            f"{geometry.name}'s {geometry.num_kv_heads} KV heads split over no group of {per_instance_max} GPUs"
        )
    n = instances if instances is not None else node // k
    if n * k > node:
        raise ValueError(f"{n} instances of {k} GPUs need {n * k} GPUs; profile {profile.name!r} has {node}")
    return InstanceSizing(
        model=geometry.name,
        weight_dtype=geometry.effective_weight_dtype.name.lower(),
        weight_bytes=weights,
        gpus_per_instance=k,
        instances=n,
        node_gpus=node,
        gpu_model=profile.gpus[0].model,
        hbm_bytes_per_gpu=hbm(k),
        basis=basis,
        fewest_that_fit=fewest_fit,
        uncounted=geometry.uncounted_params,
    )


def _gpus(n: int) -> str:
    return f"{n} GPU" if n == 1 else f"{n} GPUs"
