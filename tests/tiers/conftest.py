"""Fixtures the pool tier's test modules share: remote tiers on the session pool, a deployment
secret (a pool of a test's own: tests/conftest.py's ``private_pool``)."""

from __future__ import annotations


import pytest

from kvstrata.pool.config import PoolConfig, make_secret, read_secret
from kvstrata.tiers.remote import RemoteMode, RemoteTier, fresh_tag


@pytest.fixture
def make_remote_tier(pool):
    """``make(mode=TCP, pool_config=None, **RemoteTier options)``: a remote tier of 16 blocks of
    test_remote's layout on the session pool (or ``pool_config``), in a namespace of its own."""
    from tests.tiers.test_remote import LAYOUT

    made = []

    def make(mode: RemoteMode = RemoteMode.TCP, pool_config: PoolConfig | None = None, **kwargs) -> RemoteTier:
        config = pool_config or pool
        if mode is RemoteMode.SHM and not config.daemon:
            pytest.skip("the configured pool has no daemon on this host for SHM mode")
        kwargs.setdefault("namespace_tag", fresh_tag())
        tier = RemoteTier(LAYOUT, 16 * LAYOUT.block_bytes, config, mode, **kwargs)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


@pytest.fixture
def secret(tmp_path) -> bytes:
    """A deployment secret of this test's own."""
    path = tmp_path / "pool.key"
    make_secret(path)
    return read_secret(PoolConfig(master="127.0.0.1:1", secret_file=str(path)))

