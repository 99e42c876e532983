"""The bytes a measured restore moves (``kvstrata lab``'s workers, the benchmarks): KV of a real
model's geometry, random, cut into blocks; and the check that a restore brought back exactly
those bytes.

Random bytes, so nothing compresses or dedupes; a fixed seed, so two runs move the same bytes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from kvstrata.cache import LoadResult, TieredCache
from kvstrata.index.prefix import Match
from kvstrata.kv import load_geometry
from kvstrata.kv.layout import KVLayout
from kvstrata.timing import VerificationError

MIB = 1 << 20
VOCAB = 128_256  # Llama 3's vocabulary: ids need the full 17 bits, as real prompts do


@dataclass(frozen=True)
class KVSetup:
    """Where a benchmark's KV lives and how it is cut, for its report."""

    device: str
    layout: str  # KVLayout.describe()
    block_tokens: int
    block_bytes: int

    @staticmethod
    def of(layout: KVLayout, device: torch.device) -> KVSetup:
        return KVSetup(str(device), layout.describe(), layout.block_tokens, layout.block_bytes)


def block_layout(model: str, size_bytes: int, blocks: int, what: str = "bench") -> KVLayout:
    """The layout of ``blocks`` equal blocks of ``model``'s KV that make ``size_bytes``.

    Raises:
        ValueError: the size is not a whole number of tokens per block (``what`` names the
            benchmark in the message).
    """
    geometry = load_geometry(model)
    token_bytes = KVLayout.from_geometry(geometry, 1).block_bytes  # one token, every layer
    per_block = size_bytes // blocks
    if size_bytes % blocks or per_block % token_bytes:
        raise ValueError(
            f"{what}: {size_bytes / MIB:g} MiB in {blocks} blocks is not a whole number of "
            f"{model} tokens ({token_bytes} bytes each) per block"
        )
    return KVLayout.from_geometry(geometry, per_block // token_bytes)


def random_kv(layout: KVLayout, blocks: int, device: torch.device, seed: int = 0) -> tuple[list[int], torch.Tensor]:
    """Token ids for ``blocks`` full blocks and random KV bytes for them.

    Returns:
        ``(tokens, kv_bytes)``: ``blocks * block_tokens`` ids, and uint8
        ``[layers, kv, tokens, kv_heads, head_dim * itemsize]`` on ``device`` (a byte view of
        the model-dtype KV).
    """
    count = blocks * layout.block_tokens
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, size=count, dtype=np.int64).tolist()
    item = layout.dtype.size_bytes
    shape = (layout.num_layers, layout.kv_tensors, count, layout.kv_heads, layout.head_dim * item)
    kv_bytes = torch.from_numpy(rng.integers(0, 256, size=shape, dtype=np.uint8)).to(device)
    return tokens, kv_bytes


def kv_block(kv_bytes: torch.Tensor, layout: KVLayout, i: int) -> torch.Tensor:
    """Block ``i`` of ``kv_bytes``: a view ``[layers, kv, block_tokens, kv_heads, head_dim * itemsize]``."""
    bs = layout.block_tokens
    return kv_bytes[:, :, i * bs : (i + 1) * bs]


def block_of(kv_bytes: torch.Tensor, layout: KVLayout, i: int) -> torch.Tensor:
    """Block ``i`` of ``kv_bytes`` as the tiers hold it: contiguous uint8 ``[layers, layer_bytes]``."""
    return kv_block(kv_bytes, layout, i).contiguous().view(layout.num_layers, layout.layer_bytes)


def timed_restore(cache: TieredCache, match: Match, kv_bytes: torch.Tensor, what: str = "load") -> tuple[LoadResult, float]:
    """``cache.load(match)``, timed from the call to the last byte landing; then, untimed, every
    matched block must have been restored and equal its block of ``kv_bytes`` byte for byte
    (a restore that moved nothing or the wrong bytes fails the run instead of looking fast).

    Returns:
        The load's result and its seconds.

    Raises:
        VerificationError: fewer blocks restored, or other bytes (``what`` names the restore).
    """
    start = time.perf_counter()
    handle = cache.load(match)
    result = handle.wait()
    seconds = time.perf_counter() - start
    try:
        if result.blocks != match.blocks:
            raise VerificationError(f"{what} restored {result.blocks} of {match.blocks} blocks ({result.stopped})")
        for i in range(match.blocks):
            got = handle.block(i).view(torch.uint8)  # [layers, kv, block_tokens, kv_heads, head_dim * itemsize]
            if not torch.equal(got, kv_block(kv_bytes, cache.layout, i)):
                raise VerificationError(f"{what}: restored block {i} differs from the block stored")
    finally:
        handle.release()
    return result, seconds
