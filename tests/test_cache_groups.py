"""The grouped cache of a hybrid model, scripted: which blocks of each group are written to each
tier (a window's dropped blocks never are), which prefix a lookup can resume from (a state
group's snapshot is needed), and what a load serves per group, bytes checked."""

from __future__ import annotations

import pytest
import torch

from kvstrata.cache.grouped import (
    GroupedCache,
    GroupedConfig,
    GroupKV,
    group_name,
    needed_blocks,
    state_layout,
)
from kvstrata.kv.dtypes import DType
from kvstrata.kv.groups import GroupKind, KVGroup
from kvstrata.media import Medium

BT = 4  # tokens per block
FULL = KVGroup(GroupKind.FULL, (1, 3), DType.FP32, kv_heads=1, head_dim=8)
SLIDING = KVGroup(GroupKind.SLIDING, (0, 2), DType.FP32, kv_heads=2, head_dim=4, span=8)
STATE = KVGroup(GroupKind.STATE, (4, 5, 6), DType.FP32, state_bytes=96, state_heads=2)
GROUPS = (FULL, SLIDING, STATE)
NAMES = tuple(group_name(i, g) for i, g in enumerate(GROUPS))
F, S, R = NAMES
TOKENS = list(range(100, 140))  # 40 tokens: 10 blocks


def make(tmp_path, groups=GROUPS, blocks=32, disk=True) -> GroupedCache:
    one = sum(layout.block_bytes for layout in GroupedConfig("m", groups, BT, 1 << 20, 0).layouts().values())
    return GroupedCache(GroupedConfig("hybrid", groups, BT, device_bytes=blocks * one, host_bytes=blocks * one,
                                      disk_bytes=blocks * one if disk else 0, disk_dir=tmp_path / "disk",
                                      device="cpu"))


def kv_of(group: KVGroup, tokens: int, start: int = 0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (group.num_layers, group.kv_tensors, tokens, group.kv_heads, group.head_dim)
    return torch.randn(shape, generator=g)


def state_of(seed: int) -> torch.Tensor:
    layer = state_layout(STATE).head_dim
    return torch.randint(0, 256, (STATE.num_layers, layer), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def ready(cache: GroupedCache, name: str, medium: Medium) -> int:
    return len(cache.cache(name).manager.table(medium).ready_keys())


def store_all(cache, full, sliding, snapshots, hits=()):
    return cache.store(TOKENS, {F: GroupKV(full), S: GroupKV(sliding)}, snapshots, hits).result()


def test_needed_blocks_per_kind():
    assert needed_blocks(FULL, 40, BT) == range(0, 10)
    assert needed_blocks(SLIDING, 40, BT) == range(8, 10)  # [32, 40): the window of 8
    assert needed_blocks(SLIDING, 38 // BT * BT, BT) == range(7, 9)  # 36: [28, 36)
    assert needed_blocks(SLIDING, 4, BT) == range(0, 1)
    assert needed_blocks(STATE, 40, BT) == range(9, 10)  # keyed by the last full block
    window = KVGroup(GroupKind.SLIDING, (0,), DType.FP32, kv_heads=1, head_dim=4, span=6)
    assert needed_blocks(window, 40, BT) == range(8, 10)  # [34, 40) overlaps blocks 8 and 9


def test_capacities_split_in_proportion_to_block_bytes(tmp_path):
    config = GroupedConfig("m", GROUPS, BT, device_bytes=10_000, host_bytes=0)
    layouts = config.layouts()
    one = sum(layout.block_bytes for layout in layouts.values())
    for name, group_config in config.configs().items():
        assert group_config.device_bytes == 10_000 // one * layouts[name].block_bytes
        assert group_config.host_bytes == 0 and group_config.kv_group == name
    assert layouts[R].block_bytes == STATE.state_bytes_per_gpu()  # one snapshot
    with pytest.raises(ValueError, match="device_bytes .* one block of every group"):
        GroupedConfig("m", GROUPS, BT, device_bytes=one - 1, host_bytes=0)


def test_capacities_split_for_a_context_give_a_window_only_its_blocks():
    """Split for sequences of 40 tokens (10 blocks): the full group takes 10 blocks a sequence,
    the 8-token window 3 (ceil(8/4) + 1), the state 2 snapshots; every tier holds whole sequences."""
    config = GroupedConfig("m", GROUPS, BT, device_bytes=100_000, host_bytes=0, context_tokens=40)
    assert config.sequence_blocks() == {F: 10, S: 3, R: 2}
    layouts, configs = config.layouts(), config.configs()
    sequence = sum(config.sequence_blocks()[n] * layouts[n].block_bytes for n in layouts)
    for name, group_config in configs.items():
        assert group_config.device_bytes == 100_000 // sequence * config.sequence_blocks()[name] * layouts[name].block_bytes
    assert sum(c.device_bytes for c in configs.values()) <= 100_000
    even = GroupedConfig("m", GROUPS, BT, device_bytes=100_000, host_bytes=0).configs()
    assert configs[F].device_bytes > even[F].device_bytes and configs[S].device_bytes < even[S].device_bytes
    with pytest.raises(ValueError, match="context_tokens"):
        GroupedConfig("m", GROUPS, BT, device_bytes=100_000, host_bytes=0, context_tokens=0)


def test_out_of_window_blocks_are_never_written_to_any_tier(tmp_path):
    with make(tmp_path) as cache:
        full, sliding = kv_of(FULL, 40), kv_of(SLIDING, 40, seed=1)
        result = store_all(cache, full, sliding, {40: {R: state_of(1)}, 36: {R: state_of(2)}}, hits=[36])
        # The window ending at 40 needs blocks 8-9, the one ending at 36 blocks 7-8.
        assert result.blocks == {F: 10, S: 3, R: 2}
        for medium in (Medium.DEVICE, Medium.HOST, Medium.DISK):
            assert (ready(cache, F, medium), ready(cache, S, medium), ready(cache, R, medium)) == (10, 3, 2)


def test_a_hit_needs_the_state_snapshot_and_the_window(tmp_path):
    with make(tmp_path) as cache:
        full, sliding = kv_of(FULL, 40), kv_of(SLIDING, 40, seed=1)
        store_all(cache, full, sliding, {40: {R: state_of(1)}})
        assert cache.lookup(TOKENS + [7, 8, 9]).tokens == 40
        # A prompt one token short resumes at 36 at best: no snapshot there, and no other: a miss.
        miss = cache.lookup(TOKENS[:39])
        assert miss.tokens == 0 and not miss.groups
        assert cache.lookup([1] + TOKENS[1:]).tokens == 0  # another prefix: other keys in every group
    with make(tmp_path / "b") as cache:
        store_all(cache, full, sliding, {40: {R: state_of(1)}, 36: {R: state_of(2)}}, hits=[36])
        hit = cache.lookup(TOKENS[:39])
        assert hit.tokens == 36 and hit.groups[S].first_block == 7 and hit.groups[R].first_block == 8


def test_a_hit_needs_the_window_blocks(tmp_path):
    with make(tmp_path, groups=(FULL, SLIDING)) as cache:
        full, sliding = kv_of(FULL, 40), kv_of(SLIDING, 40, seed=1)
        cache.store(TOKENS, {F: GroupKV(full), S: GroupKV(sliding)}).result()
        assert cache.lookup(TOKENS).tokens == 40
        # At 36 the window needs block 7, never written (it was out of the window at 40); so
        # is every shorter prefix's: a miss, though the full group has all its blocks.
        assert cache.lookup(TOKENS[:39]).tokens == 0
        assert cache.lookup(TOKENS[:12]).tokens == 0


@pytest.mark.parametrize("tier", ["device", "host", "disk"])
def test_a_load_serves_each_group_its_blocks_and_snapshot(tmp_path, tier):
    with make(tmp_path) as cache:
        full, sliding, state = kv_of(FULL, 40), kv_of(SLIDING, 40, seed=1), state_of(3)
        store_all(cache, full, sliding, {40: {R: state}})
        above = {"device": [], "host": [Medium.DEVICE], "disk": [Medium.DEVICE, Medium.HOST]}[tier]
        for name in NAMES:
            for medium in above:
                cache.cache(name).evict(medium, 1000)
        match = cache.lookup(TOKENS + [1])
        assert {name: part.match.media[0] for name, part in match.groups.items()} == dict.fromkeys(
            NAMES, Medium[tier.upper()])
        with cache.load(match) as load:
            result = load.wait(10)
            torch.testing.assert_close(load.kv(F), full, rtol=0, atol=0)
            torch.testing.assert_close(load.kv(S), sliding[:, :, 32:40], rtol=0, atol=0)
            assert torch.equal(load.state(R), state)
        layouts = cache.layouts
        assert result.loaded_bytes == {F: 10 * layouts[F].block_bytes, S: 2 * layouts[S].block_bytes,
                                       R: layouts[R].block_bytes}
        assert result.restored_bytes == ({n: 0 for n in NAMES} if tier == "device" else result.loaded_bytes)


def test_a_store_from_a_restored_window_keeps_only_what_it_holds(tmp_path):
    with make(tmp_path, groups=(FULL, SLIDING)) as cache:
        # The sliding group's KV starts at token 16 (restored from block 4 on): blocks before are not held.
        full, sliding = kv_of(FULL, 40), kv_of(SLIDING, 24, seed=1)
        result = cache.store(TOKENS, {F: GroupKV(full), S: GroupKV(sliding, start=16)}, hits=[20]).result()
        assert result.blocks[S] == 2 + 1  # blocks 8-9 for 40; of blocks 3-4 for 20, block 4
        with pytest.raises(ValueError, match="multiples of the block"):
            cache.store(TOKENS, {F: GroupKV(full), S: GroupKV(sliding, start=3)})
        with pytest.raises(ValueError, match="every per-token group"):
            cache.store(TOKENS, {F: GroupKV(full)})
