"""The Mooncake store calls kvstrata makes, as typed values: ``PoolClient.call(what, op, *args)``
runs ``op.run(store, *args)`` on a worker, so a caller names an operation, never a method by a
string, and every call into the store is listed here.

The store is ``mooncake.store.MooncakeDistributedStore`` (loaded only through
``kvstrata.pool.native_log``); its methods answer Mooncake status codes (``kvstrata.pool.codes``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoreOp:
    """One store method, by its Mooncake name (the one place it is named; errors and logs say it)."""

    name: str

    def run(self, store: Any, *args: Any) -> Any:
        return getattr(store, self.name)(*args)

    def __str__(self) -> str:
        return self.name


# Data: [name], [[ptr, ...]], [[size, ...]] (, ReplicateConfig) -> per object bytes read or a code.
BATCH_PUT_MULTI = StoreOp("batch_put_from_multi_buffers")
BATCH_GET_MULTI = StoreOp("batch_get_into_multi_buffers")
# One buffer per object: [name], [ptr], [size] (, ReplicateConfig).
BATCH_PUT = StoreOp("batch_put_from")
BATCH_GET = StoreOp("batch_get_into")
# Metadata (the master): [name] -> 1 / 0 / a code; name -> size or a code; replicas of name.
BATCH_IS_EXIST = StoreOp("batch_is_exist")
GET_SIZE = StoreOp("get_size")
GET_REPLICA_DESC = StoreOp("get_replica_desc")
# Removal: name, force -> code; [name], force -> a code per name.
REMOVE = StoreOp("remove")
BATCH_REMOVE = StoreOp("batch_remove")
# Memory: address, bytes -> code; SHM mode: bytes -> an address the daemon maps (0: none).
REGISTER_BUFFER = StoreOp("register_buffer")
UNREGISTER_BUFFER = StoreOp("unregister_buffer")
ALLOC_FROM_MEM_POOL = StoreOp("alloc_from_mem_pool")
HEALTH_CHECK = StoreOp("health_check")
