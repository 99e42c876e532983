"""What the block manager decides, as small frozen values: why a load stopped short."""

from __future__ import annotations

import enum


class StopReason(enum.Enum):
    """Why a load brought fewer blocks than its match held (it stops at the first it cannot have)."""

    GONE = "gone"  # the block left every tier between the lookup and the load
    DEVICE_FULL = "device-full"  # no device slot: every one pinned or being written
    LOADING_ELSEWHERE = "loading-elsewhere"  # another request is bringing this block to the device
    NO_STAGING = "no-staging"  # a disk or pool block needs a host tier to stage in, and there is none
    STAGING_FULL = "staging-full"  # the host tier is full of pinned blocks
    STAGING_ELSEWHERE = "staging-elsewhere"  # another request is promoting this block to the host
    CORRUPT = "corrupt"  # the block failed verification and was dropped from its tier
    MISSING = "missing"  # the block was gone from its tier (a shared pool evicted it, say)
    UNAVAILABLE = "unavailable"  # the tier's service is down (nothing was exposed to it)
    ABANDONED = "abandoned"  # the tier stopped answering mid-transfer; the destination slot is retired
