"""The tiers a CacheConfig describes, wired for zero-copy paths, and which paths fetch straight in.

On a pool, the host tier lives in memory the pool can address (registered, or in the pool's
shared memory), so pool <-> host moves are zero-copy both ways; a CPU stand-in for HBM is
registered too (or, in SHM mode, allocated in the pool's memory), so pool -> device is direct.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kvstrata.cache.config import CacheConfig
from kvstrata.errors import TierUnavailable
from kvstrata.manager.manager import ManagerConfig
from kvstrata.media import FetchPath, Medium
from kvstrata.pool.config import RemoteMode, read_secret
from kvstrata.tiers.base import Tier
from kvstrata.tiers.memory import DeviceTier, HostTier, MemoryTier, default_device


def build_tiers(config: CacheConfig) -> tuple[list[Tier], str | None]:
    """The configured tiers, fastest first, and why a configured pool is not among them (None
    when it is, or none was configured): the cache then serves from its local tiers."""
    remote, remote_error = _connect_remote(config)
    slots = config.device_bytes // config.layout.block_bytes
    where = torch.device(config.device) if config.device else default_device()
    device_buffer = None
    if remote is not None and config.remote_mode is RemoteMode.SHM and where.type == "cpu" and slots:
        # A CPU stand-in for HBM on a shared-memory pool: in the pool's memory, so the direct
        # pool -> device path is zero-copy too.
        device_buffer = remote.allocate(slots * config.layout.block_bytes)
    tiers: list[Tier] = [DeviceTier(config.layout, config.device_bytes, config.device, buffer=device_buffer)]
    if config.host_bytes:
        slots = config.host_bytes // config.layout.block_bytes
        buffer = remote.allocate(slots * config.layout.block_bytes) if remote is not None and slots else None
        tiers.append(HostTier(config.layout, config.host_bytes, buffer=buffer))
    if config.disk_bytes:
        from kvstrata.tiers.disk import DiskTier

        tiers.append(DiskTier(config.layout, config.disk_bytes, config.disk_dir, namespace_tag=config.namespace().tag,
                              read_gbps=config.disk_read_gbps))
    if remote is not None:
        tiers.append(remote)
    return tiers, remote_error


def _connect_remote(config: CacheConfig) -> tuple[Tier | None, str | None]:
    if config.pool is None:
        return None, None
    from kvstrata.tiers.remote import RemoteTier

    try:
        tier = RemoteTier(config.layout, config.remote_bytes, config.pool, config.remote_mode,
                          namespace_tag=config.namespace().tag, secret=read_secret(config.pool),
                          encrypt=config.pool_encrypt)
    except TierUnavailable as exc:
        return None, str(exc)
    return tier, None


def check_tiers(tiers: Sequence[Tier], config: CacheConfig) -> dict[Medium, Tier]:
    """The tiers by medium, fastest first, refused (one line) unless each has the cache's layout,
    no medium comes twice, and a device tier is there."""
    by_medium: dict[Medium, Tier] = {}
    for tier in tiers:
        if tier.layout != config.layout:
            raise ValueError(f"{tier.medium.label} tier layout {tier.layout} differs from the cache's {config.layout}")
        if tier.medium in by_medium:
            raise ValueError(f"two {tier.medium.label} tiers given")
        by_medium[tier.medium] = tier
    if Medium.DEVICE not in by_medium:
        raise ValueError("the cache needs a device tier")
    return dict(sorted(by_medium.items(), key=lambda item: item[0].value))


def manager_config(tiers: Mapping[Medium, Tier], config: CacheConfig) -> ManagerConfig:
    """What the block manager plans for: these tiers' capacities, the config's policies, and
    the direct paths (registering memory with the pool where they need it)."""
    capacities = {medium: tier.capacity_blocks for medium, tier in tiers.items()}
    return ManagerConfig(config.layout, capacities, config.eviction, config.write,
                         direct_media(list(tiers.values()), config), config.workers, config.small_load_bytes)


def direct_media(tiers: Sequence[Tier], config: CacheConfig) -> frozenset[Medium]:
    """The media without a view whose blocks are read straight into device slots, registering
    the device tier's memory with the pool where that path needs it.

    ``auto``: disk blocks go straight into device slots the CPU can address (the CPU stand-in
    for HBM); into GPU memory they are staged in the host tier (GPUDirect Storage would lift
    that). Pool blocks go straight in where the pool can address device memory: a CPU stand-in
    here, or GPU memory over RDMA (GPUDirect) on GPU hosts.
    """
    by_medium = {t.medium: t for t in tiers}
    device = by_medium[Medium.DEVICE]
    on_cpu = device.device.type == "cpu"
    direct = set()
    if Medium.DISK in by_medium and (config.disk_path is FetchPath.DIRECT or
                                     (config.disk_path is FetchPath.AUTO and on_cpu)):
        direct.add(Medium.DISK)
    remote = by_medium.get(Medium.REMOTE)
    if remote is not None and config.remote_path is not FetchPath.STAGED:
        rdma = config.pool is not None and config.pool.protocol == "rdma"
        if config.remote_path is FetchPath.DIRECT or on_cpu or rdma:
            direct.add(Medium.REMOTE)
            if on_cpu and isinstance(device, MemoryTier) and hasattr(remote, "register"):
                remote.register(device.buffer)
    return frozenset(direct)
