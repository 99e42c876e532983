"""The tiers a CacheConfig describes, and which paths fetch straight into device slots.

On a pool, no tier's memory is registered with it (nor allocated in its shared memory): the
transfer engine exposes registered memory to anyone who reaches its port. Blocks move through
the remote tier's own staging, one copy to and from the tier (``kvstrata.tiers.remote``).

A configured pool that cannot be reached at start still gets its remote tier, DOWN: the cache
serves from its local tiers while the tier keeps trying in the background, and serves from the
pool once it is reached. Each time the pool is reached again (perhaps a restarted, empty pool,
perhaps at new addresses), the block manager's view of it is checked against what the pool
holds, and what it no longer holds is forgotten, so lookups never claim those blocks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence

from kvstrata.cache.config import CacheConfig
from kvstrata.errors import TierUnavailable
from kvstrata.manager.config import ManagerConfig
from kvstrata.manager.manager import BlockManager
from kvstrata.media import FetchPath, Medium
from kvstrata.pool.config import read_secret
from kvstrata.tiers.base import Tier
from kvstrata.tiers.memory import DeviceTier, HostTier

log = logging.getLogger("kvstrata.pool")


def build_tiers(config: CacheConfig) -> tuple[list[Tier], str | None]:
    """The configured tiers, fastest first, and why a configured pool is not among them (None
    when it is, or none was configured; a pool that is only unreachable is: its tier is DOWN
    and keeps trying): the cache then serves from its local tiers."""
    remote, remote_error = _connect_remote(config)
    tiers: list[Tier] = [DeviceTier(config.layout, config.device_bytes, config.device)]
    if config.host_bytes:
        tiers.append(HostTier(config.layout, config.host_bytes))
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

    secret = read_secret(config.pool)
    log.info("pool %s: values %s", config.pool.master, "sealed and encrypted (AES-GCM)" if config.pool_encrypted else
             "sealed (MAC); payloads NOT encrypted: any client of the pool reads them" if secret else
             "not sealed (no secret_file): checksummed against accidents only")
    try:
        tier = RemoteTier(config.layout, config.remote_bytes, config.pool, config.remote_mode,
                          namespace_tag=config.namespace().tag, op_timeout_s=config.pool_timeout_s,
                          connect_timeout_s=config.pool_connect_timeout_s, backoff_s=config.pool_backoff_s,
                          backoff_max_s=config.pool_backoff_max_s, required=False,
                          secret=secret, encrypt=config.pool_encrypted)
    except TierUnavailable as exc:  # the pool client is not installed: no tier at all
        return None, str(exc)
    return tier, None


def remote_error(tiers: Mapping[Medium, Tier], error: str | None) -> str | None:
    """Why the configured pool is not serving now: ``error`` (from ``build_tiers``) if it has no
    tier, else the remote tier's reason (down, or unreachable since the start), else None."""
    remote = tiers.get(Medium.REMOTE)
    return error if remote is None else remote.unavailable


def block_manager(tiers: Mapping[Medium, Tier], config: CacheConfig) -> BlockManager:
    """The block manager for these tiers; each reconnect of the remote tier reconciles the
    manager's view of the pool (``reconcile_remote``)."""
    manager = BlockManager(manager_config(tiers, config))
    remote = tiers.get(Medium.REMOTE)
    if remote is not None and hasattr(remote, "on_reconnect"):
        # Reads still waiting on the old pool end within two pool calls (a get, then a size).
        settle_s = 2 * config.pool_timeout_s + 1.0
        remote.on_reconnect(lambda tier, event: reconcile_remote(manager, tier, event.moved, settle_s))
    return manager


def reconcile_remote(manager: BlockManager, remote: Tier, moved: bool = False, settle_s: float = 0.0) -> int:
    """Forget the blocks of the manager's view of the pool that the pool does not hold now (all
    of them, for a pool restarted empty or another pool), so lookups never claim them; the
    objects still there stay known. A block a read holds (a read of the old pool, still
    waiting) is forgotten once that read ends, for up to ``settle_s``. Returns how many were
    forgotten."""
    keys = manager.ready_keys(Medium.REMOTE)
    present = remote.find(keys)  # False where the pool cannot say: forgotten too
    gone = [key for key, here in zip(keys, present, strict=True) if not here]
    forgotten = manager.forget(Medium.REMOTE, gone)
    busy = set(gone) & set(manager.ready_keys(Medium.REMOTE))
    waited = len(busy)
    deadline = time.monotonic() + settle_s
    while busy and time.monotonic() < deadline:
        time.sleep(0.02)
        forgotten += manager.forget(Medium.REMOTE, busy)
        busy &= set(manager.ready_keys(Medium.REMOTE))
    log.info("pool view reconciled after the reconnect%s: %d of %d known blocks still in the pool, %d forgotten%s%s",
             " to a pool at new addresses" if moved else "", len(keys) - len(gone), len(keys), forgotten,
             f" ({waited - len(busy)} once reads of the old pool ended)" if waited else "",
             f"; {len(busy)} still held by readers" if busy else "")
    return forgotten


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
    the direct paths."""
    capacities = {medium: tier.capacity_blocks for medium, tier in tiers.items()}
    ranges = config.layer_ranges
    if ranges is None:
        ranges = tiers[Medium.DEVICE].device.type == "cuda"
    return ManagerConfig(config.layout, capacities, config.eviction, config.write,
                         direct_media(list(tiers.values()), config), config.workers, config.small_load_bytes,
                         ranges)


def direct_media(tiers: Sequence[Tier], config: CacheConfig) -> frozenset[Medium]:
    """The media without a view whose blocks are read straight into device slots (from the
    pool: copied out of the remote tier's staging into the slot, verified there).

    ``auto``: disk blocks go straight into device slots the CPU can address (the CPU stand-in
    for HBM); into GPU memory they are staged in the host tier (GPUDirect Storage would lift
    that). Pool blocks go straight into a CPU stand-in; into GPU memory they are staged in the
    host tier (no GPU memory is registered with the pool: GPUDirect would expose it).
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
        if config.remote_path is FetchPath.DIRECT or on_cpu:
            direct.add(Medium.REMOTE)
    return frozenset(direct)
