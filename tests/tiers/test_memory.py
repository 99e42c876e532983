"""Memory tiers beyond the conformance suite: construction, device choice, slot bounds."""

from __future__ import annotations

import pytest
import torch

from kvstrata.media import Medium
from kvstrata.tiers.memory import DeviceTier, HostTier, copy_bytes

from .conformance import SMALL

CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("cls", [DeviceTier, HostTier])
def test_pool_is_preallocated_and_zeroed(cls):
    tier = cls(SMALL, 3 * SMALL.block_bytes + 7)
    try:
        assert tier.slots == 3
        views = [tier.view(slot) for slot in range(3)]
        assert all(not v.any() for v in views)  # touched at construction: every page faulted in
        assert views[1].data_ptr() - views[0].data_ptr() == SMALL.block_bytes  # one contiguous pool
    finally:
        tier.close()


def test_device_tier_picks_cuda_when_there_is_one():
    tier = DeviceTier(SMALL, SMALL.block_bytes)
    assert tier.medium is Medium.DEVICE
    assert tier.device.type == ("cuda" if CUDA else "cpu")
    assert tier.view(0).device == tier.device
    tier.close()


def test_host_tier_pins_only_with_cuda():
    tier = HostTier(SMALL, SMALL.block_bytes)
    assert tier.medium is Medium.HOST
    assert tier.device.type == "cpu"
    assert tier.pinned is CUDA
    if CUDA:
        assert tier.view(0).is_pinned()
    tier.close()
    assert not tier.pinned
    assert not HostTier(SMALL, SMALL.block_bytes, pin=False).pinned


@pytest.mark.skipif(CUDA, reason="checks the error raised where CUDA is missing")
def test_cuda_requests_without_cuda_are_clear_errors():
    with pytest.raises(ValueError, match="CUDA is not available"):
        DeviceTier(SMALL, SMALL.block_bytes, device="cuda")
    with pytest.raises(ValueError, match="pin=True needs CUDA"):
        HostTier(SMALL, SMALL.block_bytes, pin=True)


@pytest.mark.parametrize("cls", [DeviceTier, HostTier])
def test_negative_capacity_is_an_error(cls):
    with pytest.raises(ValueError, match="capacity_bytes must be >= 0"):
        cls(SMALL, -1)


@pytest.mark.parametrize("slot", [-1, 2, 100])
def test_slots_out_of_range_raise(slot):
    tier = HostTier(SMALL, 2 * SMALL.block_bytes)
    block = torch.zeros((SMALL.num_layers, SMALL.layer_bytes), dtype=torch.uint8)
    with pytest.raises(IndexError, match="out of range"):
        tier.view(slot)
    with pytest.raises(IndexError, match="out of range"):
        tier.write(slot, b"k" * 16, block)
    with pytest.raises(IndexError, match="out of range"):
        tier.read_into(slot, b"k" * 16, block)
    tier.close()


def test_copy_bytes_refuses_to_broadcast_or_convert():
    dst = torch.zeros((2, 8), dtype=torch.uint8)
    with pytest.raises(ValueError):
        copy_bytes(dst, torch.ones((1, 8), dtype=torch.uint8))
    with pytest.raises(ValueError):
        copy_bytes(dst, torch.ones((2, 8), dtype=torch.float32))
    copy_bytes(dst, torch.full((2, 8), 3, dtype=torch.uint8))
    assert dst.eq(3).all()
