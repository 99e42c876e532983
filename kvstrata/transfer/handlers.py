"""Handlers: how a batch of legs moves between two tiers, chosen by ``(source medium, destination medium)``.

Memory tiers (device, host) expose their slots in place through ``view()``, so a leg that
touches one needs no staging copy: into a memory tier the source reads straight into the
destination slots (``read_many_into``: one batched copy for memory sources, a batch get for the
pool, file reads for disk); out of one, the destination writes from the source slots. Only a
leg between two tiers without views (disk, pool) goes through a bounce buffer.

A handler returns, per leg in order, None (moved) or the exception that leg met, and may raise
for the whole batch; the worker times it, runs it on a CUDA stream where a tier is on the GPU,
and classifies the errors.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from kvstrata.manager.plans import Leg
from kvstrata.media import Medium
from kvstrata.tiers.base import Tier

Handler = Callable[[Tier, Tier, Sequence[Leg], slice], list[BaseException | None]]
"""(source tier, destination tier, legs, layers) -> per leg None or its error."""


def _view(tier: Tier, slot: int) -> torch.Tensor:
    view = tier.view(slot)
    if view is None:
        raise TypeError(f"{type(tier).__name__} ({tier.medium.label}) has no view() for its slots")
    return view


def read_into_views(src: Tier, dst: Tier, legs: Sequence[Leg], layers: slice) -> list[BaseException | None]:
    """Any tier -> a memory tier: the source reads straight into the destination slots."""
    targets = [_view(dst, leg.dst.index)[layers] for leg in legs]  # each [n_layers, layer_bytes]
    return src.read_many_into([leg.src.index for leg in legs], [leg.key for leg in legs], targets, layers)


def write_from_views(src: Tier, dst: Tier, legs: Sequence[Leg], layers: slice) -> list[BaseException | None]:
    """A memory tier -> a tier without views: the destination writes from the source slots."""
    _require_whole(src.layout.num_layers, layers, dst)
    blocks = [_view(src, leg.src.index) for leg in legs]  # each [layers, layer_bytes]
    return dst.write_many([leg.dst.index for leg in legs], [leg.key for leg in legs], blocks)


_bounce = threading.local()  # per thread: {(layers, layer_bytes): uint8 tensor}


def bounce(src: Tier, dst: Tier, legs: Sequence[Leg], layers: slice) -> list[BaseException | None]:
    """Between two tiers without views (disk, pool): block by block through a per-thread host buffer."""
    shape = (src.layout.num_layers, src.layout.layer_bytes)
    _require_whole(shape[0], layers, dst)
    buffers = _bounce.__dict__.setdefault("buffers", {})
    buffer = buffers.get(shape)
    if buffer is None:
        buffer = buffers[shape] = torch.empty(shape, dtype=torch.uint8)
    out: list[BaseException | None] = []
    for leg in legs:
        try:
            src.read_into(leg.src.index, leg.key, buffer)
            dst.write(leg.dst.index, leg.key, buffer)
        except Exception as error:  # noqa: BLE001 - per leg, classified by the worker
            out.append(error)
        else:
            out.append(None)
    return out


def _require_whole(num_layers: int, layers: slice, dst: Tier) -> None:
    if layers.indices(num_layers) != (0, num_layers, 1):
        raise ValueError(
            f"{dst.medium.label} tier stores whole blocks; layers {layers} needs a destination with view()"
        )


_HAS_VIEW = {Medium.DEVICE: True, Medium.HOST: True, Medium.DISK: False, Medium.REMOTE: False}


def _default_handler(src: Medium, dst: Medium) -> Handler:
    if _HAS_VIEW[dst]:
        return read_into_views
    return write_from_views if _HAS_VIEW[src] else bounce


HANDLERS: dict[tuple[Medium, Medium], Handler] = {(s, d): _default_handler(s, d) for s in Medium for d in Medium}
