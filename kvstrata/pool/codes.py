"""Mooncake's status codes (``mooncake-store/include/types.h``, ``ErrorCode``) that kvstrata reads,
each with what it means here. A store call answers 0 for success, a negative code for a
failure; a batched call answers one per object (for a get: the bytes read, or a code).
"""

from __future__ import annotations

import enum


class Code(enum.IntEnum):
    """A Mooncake status code that says something about one object, not about the pool."""

    OK = 0
    NO_SPACE = -200  # the pool could not place the object now (full)
    INVALID_KEY = -400  # a name the master refuses
    BUFFERS_TOO_SMALL = -600  # a get whose buffers add up to less than the object
    REPLICA_NOT_READY = -703  # the object is still being written
    OBJECT_NOT_FOUND = -704  # no such object (never written, removed, or evicted)
    OBJECT_EXISTS = -705  # a put of a name the pool holds: the old value stays
    OBJECT_HAS_LEASE = -706  # a remove (or put) of an object a reader holds a lease on
    LEASE_EXPIRED = -707  # evicted while we read it: the bytes read are void
    TRANSFER_FAIL = -800  # a get whose buffers add up to more than the object, or a transport failure
    TENANT_QUOTA_EXCEEDED = -1700  # the tenant's share of the pool is full

    @classmethod
    def of(cls, rc: int) -> Code | int:
        """``rc`` as a Code where it is one kvstrata knows; else the int, as Mooncake gave it."""
        try:
            return cls(rc)
        except ValueError:
            return rc


# A get of one of these is a miss: the object is not (or no longer, or not yet) there.
MISSING = frozenset({Code.REPLICA_NOT_READY, Code.OBJECT_NOT_FOUND, Code.LEASE_EXPIRED})
# A put of one of these was refused for this object alone; the pool itself is fine.
PUT_REFUSED = frozenset({Code.NO_SPACE, Code.INVALID_KEY, Code.BUFFERS_TOO_SMALL, Code.REPLICA_NOT_READY,
                         Code.OBJECT_HAS_LEASE, Code.TENANT_QUOTA_EXCEEDED})
# A put that stored the object, or found it stored already (keys name content).
PUT_DONE = frozenset({Code.OK, Code.OBJECT_EXISTS})
