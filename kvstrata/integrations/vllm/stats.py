"""The worker's load and store counters, written as JSON to ``stats_path``.

vLLM's own metrics say how many prompt tokens an engine found cached, not what kvstrata moved:
these counters do (bytes per source route, seconds, failures), rewritten whole after every step
that loaded or saved and at shutdown, atomically (a reader never sees half a file). Tests and
benchmarks read the file; its keys are the fields below plus ``stored_bytes`` and ``media``.
"""

from __future__ import annotations

import json
import os
import threading
from collections import Counter
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstrata.media import route_text

if TYPE_CHECKING:
    from kvstrata.cache import LoadResult, TieredCache


@dataclass
class WorkerStats:
    """The worker's counters; stores may complete on the cache's threads, hence the lock."""

    block_bytes: int = 0
    vllm_block_shape: list[int] = field(default_factory=list)  # one layer's block in vLLM's cache
    load_requests: int = 0
    loaded_tokens: int = 0  # tokens copied into vLLM's blocks from kvstrata
    restored_bytes: int = 0  # bytes kvstrata brought to its device tier (not already there)
    load_seconds: float = 0.0  # kvstrata's own load time (to its device tier), summed
    load_paths: Counter = field(default_factory=Counter)
    store_requests: int = 0
    stored_blocks: int = 0  # full blocks offered to the cache
    new_blocks: int = 0  # blocks the cache did not hold yet
    store_seconds: float = 0.0  # copy out of vLLM + store + write-down, summed
    failed_blocks: int = 0
    last_failure: str | None = None
    remote_error: str | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def loaded(self, tokens: int, result: LoadResult) -> None:
        """A load whose ``tokens`` tokens were all copied into vLLM's blocks."""
        with self._lock:
            self.load_requests += 1
            self.loaded_tokens += tokens
            self.restored_bytes += result.restored_bytes
            self.load_seconds += result.seconds
            self.load_paths.update(result.paths)

    def stored(self, result: Any, seconds: float) -> None:
        """A store done (``result``: the cache's StoreResult) ``seconds`` after the copy began."""
        with self._lock:
            self.store_requests += 1
            self.stored_blocks += result.blocks
            self.new_blocks += result.new_blocks
            self.store_seconds += seconds

    def failed(self, blocks: int, why: str) -> None:
        with self._lock:
            self.failed_blocks += blocks
            self.last_failure = why

    def to_json(self, cache: TieredCache | None) -> dict[str, Any]:
        with self._lock:
            data = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
            data["load_paths"] = {route_text(r): n for r, n in self.load_paths.items()}
        data["stored_bytes"] = data["new_blocks"] * self.block_bytes
        if cache is not None:
            data["media"] = [m.label for m in cache.media]
            data["remote_error"] = cache.remote_error  # now: the pool may have gone down, or come back
        return data

    def write(self, path: Path, cache: TieredCache | None) -> None:
        """Rewrite ``path`` with the counters (and ``cache``'s media), atomically."""
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.to_json(cache), f, indent=1)
        os.replace(tmp, path)
