"""The Mooncake store calls kvstrata makes, as typed values: ``PoolClient.call(what, op, *args)``
runs ``op.run(store, *args)`` on a worker, so a caller names an operation, never a method by a
string, and every call into the store is listed here.

The store is ``mooncake.store.MooncakeDistributedStore`` (loaded only through
``kvstrata.pool.native_log``); its methods answer Mooncake status codes (``kvstrata.pool.codes``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoreOp:
    """One store method: ``name`` (Mooncake's, for errors and logs) and ``run(store, *args)``."""

    name: str
    run: Callable[..., Any]

    def __str__(self) -> str:
        return self.name


# Data: [name], [[ptr, ...]], [[size, ...]] (, ReplicateConfig) -> per object bytes read or a code.
BATCH_PUT_MULTI = StoreOp("batch_put_from_multi_buffers", lambda store, *a: store.batch_put_from_multi_buffers(*a))
BATCH_GET_MULTI = StoreOp("batch_get_into_multi_buffers", lambda store, *a: store.batch_get_into_multi_buffers(*a))
# One buffer per object: [name], [ptr], [size] (, ReplicateConfig).
BATCH_PUT = StoreOp("batch_put_from", lambda store, *a: store.batch_put_from(*a))
BATCH_GET = StoreOp("batch_get_into", lambda store, *a: store.batch_get_into(*a))
# Metadata (the master): [name] -> 1 / 0 / a code; name -> size or a code; replicas of name.
BATCH_IS_EXIST = StoreOp("batch_is_exist", lambda store, *a: store.batch_is_exist(*a))
GET_SIZE = StoreOp("get_size", lambda store, *a: store.get_size(*a))
GET_REPLICA_DESC = StoreOp("get_replica_desc", lambda store, *a: store.get_replica_desc(*a))
# Removal: name, force -> code; [name], force -> a code per name.
REMOVE = StoreOp("remove", lambda store, *a: store.remove(*a))
BATCH_REMOVE = StoreOp("batch_remove", lambda store, *a: store.batch_remove(*a))
# Memory: address, bytes -> code; SHM mode: bytes -> an address the daemon maps (0: none).
REGISTER_BUFFER = StoreOp("register_buffer", lambda store, *a: store.register_buffer(*a))
UNREGISTER_BUFFER = StoreOp("unregister_buffer", lambda store, *a: store.unregister_buffer(*a))
ALLOC_FROM_MEM_POOL = StoreOp("alloc_from_mem_pool", lambda store, *a: store.alloc_from_mem_pool(*a))
HEALTH_CHECK = StoreOp("health_check", lambda store, *a: store.health_check(*a))
