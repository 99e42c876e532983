"""The tiered cache: a facade (``TieredCache``) over the block manager and the transfer worker."""

from kvstrata.cache.config import CacheConfig
from kvstrata.cache.results import LoadHandle, LoadResult, PrefetchFuture, StoreResult
from kvstrata.cache.tiered import TieredCache

__all__ = ["CacheConfig", "LoadHandle", "LoadResult", "PrefetchFuture", "StoreResult", "TieredCache"]
