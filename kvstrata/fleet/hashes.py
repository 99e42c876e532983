"""A prompt's vLLM block hashes, as a router computes them to match servers' KV events (edge: vLLM).

Servers' events name blocks by vLLM's hashes (:mod:`kvstrata.fleet.events`); to ask the fleet
index what a prompt can reuse, a router hashes the prompt's tokens the same way, with vLLM's own
functions (imported here, so the two cannot drift): each full block of ``block_size`` tokens
hashed with its parent's hash (``hash_block_tokens``), the first block's parent a seed every
process derives alike (``init_none_hash``: a fixed seed for vLLM's default ``sha256``, or
``PYTHONHASHSEED`` where set: the router's must match the servers'). The servers' hash algorithm
(``--prefix-caching-hash-algo``) must be the router's ``algo``. ``sha256`` hashes a pickle,
reproducible by another Python process with vLLM; ``sha256_cbor`` hashes CBOR, reproducible in
any language (llm-d's indexer asks for it). The ``xxhash`` algos take a random seed per process
unless ``PYTHONHASHSEED`` is set: set it, the same, on the servers and the router.

Plain token prompts only: a LoRA adapter, multimodal inputs, a ``cache_salt`` or prompt embeds
add extra keys to vLLM's hashes, which a router that sees only tokens cannot add. Where the
servers publish int hashes (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``), so does this, from the
same environment variable.

vLLM keeps its first block's seed in one global, so a process computes hashes for one ``algo``:
asking for another raises ValueError.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence

from kvstrata.fleet.events import BlockHash

_lock = threading.Lock()
_algo: str | None = None  # the algo vLLM's seed was made for, in this process


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, algo: str = "sha256") -> tuple[BlockHash, ...]:
    """vLLM's hashes of the full blocks of ``token_ids`` (a partial last block has none), as its
    events carry them.

    Raises:
        ValueError: a block size below 1, an algo vLLM does not know, or a second algo in one process.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, maybe_convert_block_hash

    hash_fn = _hash_fn(algo)
    out: list[BlockHash] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(hash_fn, parent, tuple(token_ids[start:start + block_size]), None)
        out.append(maybe_convert_block_hash(parent))
    return tuple(out)


@functools.cache  # once per algo: each prompt is hashed with it (a second algo is refused, never cached)
def _hash_fn(algo: str):
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import init_none_hash

    global _algo
    try:
        hash_fn = get_hash_fn_by_name(algo)
    except ValueError:
        raise ValueError(f"unknown prefix-caching hash algo {algo!r} (vLLM's: sha256, sha256_cbor, ...)") from None
    with _lock:
        if _algo is None:
            init_none_hash(hash_fn)
            _algo = algo
        elif _algo != algo:
            raise ValueError(f"this process hashes blocks with {_algo!r}; vLLM keeps one seed: "
                             f"cannot also use {algo!r}")
    return hash_fn
