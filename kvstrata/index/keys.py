"""Block keys: a chained 128-bit xxh3 hash over the parent key and the block's token ids.

Key of block i = xxh3_128(key of block i-1 || token ids of block i as little-endian uint32),
and block 0's parent is the namespace digest. So a key stands for the whole prefix up to and
including its block, and two namespaces (model, KV dtype, layout, block size, TP rank/size
unless head-sliced, tenant) never produce the same key. A head-sliced block's slices have keys
of their own, each derived from the block's key (:func:`slice_keys`), and so does a rank's pack of
its slices of a block (:func:`pack_keys`). Keys are stable across processes and Python hash seeds.

Only full blocks are keyed: a partial tail (``len(tokens) % block_size`` tokens) has no key,
is never cached, and is recomputed by the model (vLLM and SGLang do the same).
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import operator
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Any

import numpy as np
import xxhash

KEY_BYTES = 16
BlockKey = bytes  # 16 bytes: the xxh3-128 digest
_UINT32 = np.dtype("<u4")  # what the hash reads: token ids as little-endian uint32


@dataclass(frozen=True)
class Namespace:
    """Everything that must match for two blocks of KV to be interchangeable."""

    model_id: str
    kv_dtype: str
    kv_layout: str
    block_size: int
    tp_rank: int | None = 0  # None, both: head-sliced blocks, the same at every TP (kvstrata.kv.heads)
    tp_size: int | None = 1
    tenant: str = ""  # an optional salt: tenants never see each other's blocks
    kv_group: str = ""  # a hybrid model's KV group (kvstrata.kv.groups); "" for a one-group model

    def __post_init__(self) -> None:
        for field in ("model_id", "kv_dtype", "kv_layout"):
            if not isinstance(getattr(self, field), str) or not getattr(self, field):
                raise ValueError(f"namespace {field} must be a non-empty string, got {getattr(self, field)!r}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"namespace block_size must be a positive integer, got {self.block_size!r}")
        for field in ("tp_rank", "tp_size"):
            value = getattr(self, field)
            if (isinstance(value, bool) or not isinstance(value, int)) and not (value is None and self.tp_free):
                raise ValueError(f"namespace {field} must be an integer (or both None: head-sliced), got {value!r}")
        if not self.tp_free and not (self.tp_size >= 1 and 0 <= self.tp_rank < self.tp_size):
            raise ValueError(f"namespace tp_rank/tp_size must satisfy 0 <= rank < size, got {self.tp_rank}/{self.tp_size}")
        for field in ("tenant", "kv_group"):
            if not isinstance(getattr(self, field), str):
                raise ValueError(f"namespace {field} must be a string, got {getattr(self, field)!r}")

    @property
    def tp_free(self) -> bool:
        """Blocks of this namespace are head-sliced: any TP size reads them."""
        return self.tp_rank is None and self.tp_size is None

    @cached_property
    def digest(self) -> bytes:
        """16 bytes naming this namespace: the parent of every first block."""
        fields = asdict(self)
        if not self.kv_group:  # one-group models keep the digests they had before groups existed
            del fields["kv_group"]
        if self.tp_free:
            del fields["tp_rank"], fields["tp_size"]
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return xxhash.xxh3_128_digest(b"kvstrata-ns-v1:" + canonical.encode())

    @property
    def tag(self) -> str:
        """Short printable id (for file names and remote keys)."""
        return self.digest.hex()[:16]


def token_array(tokens: Any) -> np.ndarray:
    """Token ids as a one-dimensional uint32 array: a sequence of ints (list, tuple, range), a
    numpy array or a CPU tensor; engines should pass a uint32 array, which is taken as it is
    (no copy, no range check: every uint32 is an id), or an int32 one (one pass to check signs).

    Raises:
        ValueError: anything else (bytes, text, a dict or set, an iterator, None, 2-D ids,
            negative or too large ids), named in one line.
    """
    if isinstance(tokens, np.ndarray) and tokens.dtype == _UINT32 and tokens.ndim == 1:
        return np.ascontiguousarray(tokens)  # the fast path: already what the hash reads
    if tokens is None or isinstance(tokens, (str, bytes, bytearray, memoryview, Mapping)) or not (
        isinstance(tokens, np.ndarray) or (hasattr(tokens, "__len__") and hasattr(tokens, "__getitem__"))
    ):
        raise ValueError(f"tokens must be a one-dimensional sequence of token ids (a list, tuple or integer array), "
                         f"got {type(tokens).__name__}")
    array = np.asarray(tokens)
    if array.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {array.shape}")
    if array.size and (array.dtype.kind not in "iu"):
        raise ValueError(f"tokens must be integers, got dtype {array.dtype}")
    if array.size and array.dtype.kind == "i" and array.min() < 0:
        raise ValueError("token ids must be in [0, 2**32)")
    if array.size and array.dtype.itemsize > 4 and array.max() > 0xFFFFFFFF:
        raise ValueError("token ids must be in [0, 2**32)")
    return np.ascontiguousarray(array, dtype=_UINT32)


def token_bytes(tokens: Any) -> bytes:
    """Token ids as little-endian uint32 bytes (see :func:`token_array` for what is taken)."""
    return token_array(tokens).tobytes()


def block_keys(tokens: Any, namespace: Namespace) -> list[BlockKey]:
    """The chained keys of every full block of ``tokens`` (the partial tail has none)."""
    ids = token_array(tokens)
    blocks = len(ids) // namespace.block_size
    # The blocks' bytes come out of a BytesIO by a C ``map`` (one bytes object a block, no
    # slice object or index arithmetic in Python), and the chain is a comprehension (no append
    # call): 0.7x the time of a plain loop over slices at 16 tokens a block, 0.85x at 256
    # (``kvstrata bench lookup``). A BytesIO of a bytes object shares it rather than copying.
    read = io.BytesIO(ids[: blocks * namespace.block_size].tobytes()).read
    digest = xxhash.xxh3_128_digest
    parent = namespace.digest
    return [parent := digest(parent + block) for block in map(read, itertools.repeat(namespace.block_size * 4, blocks))]


def slice_keys(keys: list[BlockKey], slices: range) -> list[BlockKey]:
    """The keys of slices ``slices`` of each of ``keys``' head-sliced blocks, block by block
    (``[b0 s0, b0 s1, ..., b1 s0, ...]``): xxh3_128 of the block's key and the slice's index,
    so a slice's key stands for its prefix and its heads, at whatever TP it was written."""
    digest = xxhash.xxh3_128_digest
    tags = [b"kvstrata-slice:" + j.to_bytes(4, "little") for j in slices]
    if len(tags) == 1:  # a rank of one slice (TP = KV heads): one C ``map``, 0.7x the comprehension's time
        return list(map(digest, map(operator.add, keys, itertools.repeat(tags[0]))))
    return [digest(key + tag) for key in keys for tag in tags]


def pack_keys(keys: list[BlockKey], slices: range) -> list[BlockKey]:
    """The key of one object per block of ``keys`` holding slices ``slices`` of it together (a
    rank's pack, :mod:`kvstrata.cache.sliced`): xxh3_128 of the block's key and the range, so a
    pack stands for its prefix and its heads, and differs from any one slice's key."""
    tag = b"kvstrata-pack:" + slices.start.to_bytes(4, "little") + slices.stop.to_bytes(4, "little")
    return list(map(xxhash.xxh3_128_digest, map(operator.add, keys, itertools.repeat(tag))))


FOLD_BITS = 20  # token ids below 2**20 (every vocabulary in use) leave the bits above free for a fold


def fold_extras(tokens: list[int], block_size: int, extras: bytes) -> list[int] | None:
    """``tokens`` with ``extras`` (what else its KV depends on: an adapter, a tenant's salt, an
    image) folded into its first block's ids, or None where it cannot be (an id of the first
    block at or above ``2**FOLD_BITS``).

    Each id of the first block gets 12 bits of a hash of ``extras`` above bit ``FOLD_BITS``
    (never all zero), so the chained keys of every block differ from a plain prompt's (whose ids
    are below ``2**FOLD_BITS``) and from another ``extras``' (12 bits an id: 192 at 16 tokens a
    block). Nothing but keys reads the ids: the KV moved is vLLM's, by block position."""
    first = tokens[:block_size]
    if any(t >= 1 << FOLD_BITS or t < 0 for t in first):
        return None
    stream = hashlib.shake_256(b"kvstrata-extras-v1:" + extras).digest(2 * len(first))
    folded = [t | ((int.from_bytes(stream[2 * i: 2 * i + 2], "little") % 4095 + 1) << FOLD_BITS)
              for i, t in enumerate(first)]
    return folded + tokens[block_size:]
