"""What a tier's byte movement can fail with (pure): the block manager decides per kind what
happens to the slots involved, so every part raises and classifies the same few errors."""

from __future__ import annotations


class CorruptBlock(Exception):
    """A stored block failed verification (checksum, size, header); it must not be served."""


class BlockMissing(CorruptBlock):
    """The block is gone (removed under a reader, evicted by a shared pool): a miss."""


class TierUnavailable(RuntimeError):
    """The service behind a tier cannot be reached (a pool master or daemon is down)."""


class LoadCancelled(Exception):
    """The load this leg belongs to was given up by its caller before the leg ran: nothing was
    read or written, both slots are as they were."""


class TransferAbandoned(TierUnavailable):
    """A transfer timed out; its bytes may still land in the destination later, so the
    caller must never reuse that destination (quarantine the slot) nor trust it.

    ``settled``: a future that completes once the stray transfer has ended one way or the other
    (the destination is then safe to reuse); None when that cannot be known (retire it for good).
    """

    def __init__(self, *args: object, settled=None) -> None:
        super().__init__(*args)
        self.settled = settled
