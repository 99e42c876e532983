"""A disk tier trusts only its user's directories: one another user owns (with blocks they planted
that verify), or a symlink in place of the tier's directory or of a namespace's, is refused in one
line naming path and owner, and nothing in it is served, deleted, chmodded or written.

Another user is emulated as root does it: the test chowns what it made to ``nobody``."""

from __future__ import annotations

import os
import pwd
import stat
import uuid

import pytest
import torch

from kvstrata.cache import CacheConfig, TieredCache
from kvstrata.tiers.disk import DiskTier
from kvstrata.trust import Untrusted
from tests.tiers.test_disk import SMALL, block_files, content, load, make_key, store

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="handing a directory to another user needs root")
CAPACITY = 16 * SMALL.block_bytes


def give_to_nobody(*paths) -> None:
    nobody = pwd.getpwnam("nobody")
    for path in paths:
        os.chown(path, nobody.pw_uid, nobody.pw_gid, follow_symlinks=False)


def planted(directory, tag: str = "", count: int = 4) -> list[bytes]:
    """``count`` blocks that verify (header, xxh3 of each layer) written into ``directory``
    (``directory/tag`` with a tag), then handed to ``nobody``: what they could plant."""
    tier = DiskTier(SMALL, CAPACITY, directory, namespace_tag=tag or None)
    keys = [make_key(i, "planted") for i in range(count)]
    for key in keys:
        store(tier, key)
    tier.close()
    where = directory / tag if tag else directory
    give_to_nobody(where, *where.iterdir())
    return keys


@as_root
def test_a_directory_another_user_owns_is_refused_and_their_blocks_never_served(tmp_path):
    directory = tmp_path / "disk"
    keys = planted(directory)
    directory.chmod(0o755)
    before = block_files(directory)
    with pytest.raises(Untrusted, match=f"^disk tier directory {directory} is owned by nobody, not root"):
        DiskTier(SMALL, CAPACITY, directory)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o755  # not chmodded: not the tier's to change
    assert block_files(directory) == before == {f"{k.hex()}.kvb" for k in keys}  # nor deleted


@as_root
def test_a_namespace_directory_another_user_owns_is_refused(tmp_path):
    tag = "tenant-a"
    planted(tmp_path / "disk", tag)  # the tier's directory stays this user's; the namespace's is nobody's
    with pytest.raises(Untrusted, match=f"disk tier directory {tmp_path / 'disk' / tag} is owned by nobody"):
        DiskTier(SMALL, CAPACITY, tmp_path / "disk", namespace_tag=tag)


@pytest.mark.parametrize("which", ["tier", "namespace"])
def test_a_symlink_in_place_of_a_directory_is_refused_and_nothing_written_through_it(tmp_path, which):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o755)
    directory = tmp_path / "disk"
    tag = "tenant-a"
    if which == "tier":
        directory.symlink_to(elsewhere)
        link = directory
    else:
        directory.mkdir(mode=0o700)
        link = directory / tag
        link.symlink_to(elsewhere)
    with pytest.raises(Untrusted, match=f"^disk tier directory {link} is a symlink"):
        DiskTier(SMALL, CAPACITY, directory, namespace_tag=tag if which == "namespace" else None)
    assert list(elsewhere.iterdir()) == [] and stat.S_IMODE(elsewhere.stat().st_mode) == 0o755


def test_this_users_own_wide_directories_are_tightened_and_used(tmp_path):
    directory, tag = tmp_path / "disk", "tenant-a"
    (directory / tag).mkdir(mode=0o777, parents=True)
    (directory / tag).chmod(0o777)
    directory.chmod(0o755)
    tier = DiskTier(SMALL, CAPACITY, directory, namespace_tag=tag)
    try:
        assert stat.S_IMODE(directory.stat().st_mode) == stat.S_IMODE((directory / tag).stat().st_mode) == 0o700
        key = make_key(0)
        store(tier, key)
        assert torch.equal(load(tier, key), content(SMALL, key))
    finally:
        tier.close()


@as_root
def test_a_cache_on_another_users_disk_directory_is_refused_in_one_line(tmp_path):
    planted(tmp_path / "disk")
    b = SMALL.block_bytes
    config = CacheConfig(SMALL, f"trust-{uuid.uuid4().hex[:8]}", device_bytes=4 * b, host_bytes=0,
                         disk_bytes=CAPACITY, disk_dir=tmp_path / "disk", device="cpu")
    with pytest.raises(ValueError, match=f"^disk tier directory {tmp_path / 'disk'} is owned by nobody") as refused:
        TieredCache(config)
    assert "\n" not in str(refused.value)
