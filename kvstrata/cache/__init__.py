"""The tiered cache: a facade (``TieredCache``) over the block manager and the transfer worker;
a hybrid model's, one per KV group (``GroupedCache``)."""

from kvstrata.cache.config import CacheConfig
from kvstrata.cache.grouped import GroupedCache, GroupedConfig, GroupedMatch, GroupKV
from kvstrata.cache.results import LoadHandle, LoadResult, PrefetchFuture, PutResult, StoreResult
from kvstrata.cache.tiered import TieredCache

__all__ = ["CacheConfig", "GroupKV", "GroupedCache", "GroupedConfig", "GroupedMatch", "LoadHandle", "LoadResult",
           "PrefetchFuture", "PutResult", "StoreResult", "TieredCache"]
