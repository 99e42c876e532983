"""Runs the conformance suite against every tier. A new tier joins by adding a TierSpec."""

from __future__ import annotations

import pytest

from kvstrata.manager.table import BlockTable
from kvstrata.policies.eviction import Eviction
from kvstrata.tiers.memory import DeviceTier, HostTier

from .conformance import SMALL, TierConformance, TierSpec


def _disk(layout, capacity_bytes, tmp_path):
    try:
        from kvstrata.tiers.disk import DiskTier
    except ModuleNotFoundError as error:
        if error.name != "kvstrata.tiers.disk":
            raise  # disk.py exists but is broken: fail, don't hide it
        pytest.skip("kvstrata.tiers.disk is not written yet")
    return DiskTier(layout, capacity_bytes, directory=tmp_path)


def _remote(mode_name):
    def build(layout, capacity_bytes, tmp_path, pool):
        from kvstrata.pool.config import RemoteMode
        from kvstrata.tiers.remote import RemoteTier, fresh_tag

        mode = RemoteMode[mode_name]
        if mode is RemoteMode.SHM and not pool.daemon:
            pytest.skip("the configured pool has no daemon on this host for SHM mode")
        # A fresh namespace per tier: tests never see each other's objects in the shared pool.
        return RemoteTier(layout, capacity_bytes, pool, mode, namespace_tag=fresh_tag())

    return build


SPECS = [
    TierSpec("device", lambda layout, capacity, _: DeviceTier(layout, capacity), True),
    TierSpec("host", lambda layout, capacity, _: HostTier(layout, capacity), True),
    TierSpec("disk", _disk, False),
    TierSpec("remote-tcp", _remote("TCP"), False, fixtures=("pool",)),
    TierSpec("remote-shm", _remote("SHM"), False, fixtures=("pool",)),
]


# A tier on the pool is marked so: it takes the pool at run time, where the fixture scan misses it.
@pytest.fixture(params=[pytest.param(spec, id=spec.name, marks=[pytest.mark.pool] if "pool" in spec.fixtures else [])
                        for spec in SPECS])
def tier_spec(request) -> TierSpec:
    return request.param


# Known failures, per (tier, test): strict, so a fix turns them into errors until removed here.
KNOWN_BUGS: dict[tuple[str, str], str] = {}  # (tier, test) -> "BUG: ..." marks a strict xfail


@pytest.fixture
def make_tier(tier_spec, tmp_path, request):
    bug = KNOWN_BUGS.get((tier_spec.name, request.function.__name__))
    if bug:
        request.node.add_marker(pytest.mark.xfail(reason=bug, strict=True))
    made = []

    def make(layout=SMALL, blocks=4, eviction=Eviction.LRU, extra_bytes=0):
        directory = tmp_path / f"tier{len(made)}"  # used by disk tiers only
        directory.mkdir()
        fixtures = {name: request.getfixturevalue(name) for name in tier_spec.fixtures}
        tier = tier_spec.build(layout, blocks * layout.block_bytes + extra_bytes, directory, **fixtures)
        # The block table the block manager keeps beside a tier: the suite drives both as the cache does.
        tier.table = BlockTable(tier.capacity_blocks, eviction.make(), tier.medium.label)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


class TestTiers(TierConformance):
    pass
