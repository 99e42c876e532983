"""Block keys: 16-byte chained xxh3-128 digests over full blocks, namespaced, stable everywhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.index.keys import KEY_BYTES, Namespace, block_keys, slice_keys, token_bytes

NS = Namespace("meta-llama/Llama-3.1-8B", "bfloat16", "layer-major LKTHD:32x2x16x8x128:bfloat16", 16)


def ns(**overrides) -> Namespace:
    fields = {"model_id": "m", "kv_dtype": "bfloat16", "kv_layout": "lkthd", "block_size": 16}
    fields.update(overrides)
    return Namespace(**fields)


def tokens(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 200_000, n).tolist()


# --- the documented construction, written out independently of the package -----------------------


def reference_keys(token_ids: list[int], namespace_fields: dict, block_size: int) -> list[bytes]:
    """Namespace digest = xxh3_128(b"kvstrata-ns-v1:" + compact, key-sorted JSON of the fields);
    key of block i = xxh3_128(key of block i-1 || block i's ids as little-endian uint32)."""
    canonical = json.dumps(namespace_fields, sort_keys=True, separators=(",", ":"))
    parent = xxhash.xxh3_128_digest(b"kvstrata-ns-v1:" + canonical.encode())
    keys = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = b"".join(t.to_bytes(4, "little") for t in token_ids[start : start + block_size])
        parent = xxhash.xxh3_128_digest(parent + block)
        keys.append(parent)
    return keys


NS_FIELDS = {
    "model_id": "meta-llama/Llama-3.1-8B",
    "kv_dtype": "bfloat16",
    "kv_layout": "layer-major LKTHD:32x2x16x8x128:bfloat16",
    "block_size": 16,
    "tp_rank": 0,
    "tp_size": 1,
    "tenant": "",
}
# Computed once from reference_keys(list(range(48)), NS_FIELDS, 16): pins the format itself, so a
# change to the construction (or to xxh3) shows up even if package and reference drift together.
GOLDEN_NS_DIGEST = "959d07690621c688fe24e33cde42d368"
GOLDEN_KEYS_0_TO_47 = [
    "34e8a388a90683cb04a5c95347963cd4",
    "43f07730d63fa2078bed756097e6b85e",
    "574a9587e615bd4ae9f080b7c5ed4eb1",
]


def test_keys_match_the_documented_construction():
    ids = tokens(1000, seed=3)
    assert block_keys(ids, NS) == reference_keys(ids, NS_FIELDS, 16)


def test_golden_values_are_pinned():
    assert reference_keys(list(range(48)), NS_FIELDS, 16) == [bytes.fromhex(h) for h in GOLDEN_KEYS_0_TO_47]
    assert NS.digest.hex() == GOLDEN_NS_DIGEST
    assert [k.hex() for k in block_keys(list(range(48)), NS)] == GOLDEN_KEYS_0_TO_47


def test_keys_are_stable_across_processes_and_hash_seeds():
    script = (
        "from kvstrata.index.keys import Namespace, block_keys\n"
        "ns = Namespace('meta-llama/Llama-3.1-8B', 'bfloat16', 'layer-major LKTHD:32x2x16x8x128:bfloat16', 16)\n"
        "print(' '.join(k.hex() for k in block_keys(list(range(48)), ns)))\n"
    )
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.split() == GOLDEN_KEYS_0_TO_47


# --- shape of the output ---------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [16, 32, 256])
def test_every_key_is_16_bytes_and_distinct(block_size):
    keys = block_keys(tokens(10 * block_size), ns(block_size=block_size))
    assert KEY_BYTES == 16
    assert len(keys) == 10
    assert all(isinstance(k, bytes) and len(k) == 16 for k in keys)
    assert len(set(keys)) == 10


@pytest.mark.parametrize("block_size", [16, 32, 256])
@pytest.mark.parametrize("extra", [0, 1, 7])
def test_only_full_blocks_are_keyed(block_size, extra):
    full = 3 * block_size
    keys = block_keys(tokens(full + extra * (block_size // 8)), ns(block_size=block_size))
    assert len(keys) == 3
    assert len(keys) == (full + extra * (block_size // 8)) // block_size


@pytest.mark.parametrize("block_size", [16, 32, 256])
def test_a_partial_tail_adds_no_key_and_changes_none(block_size):
    namespace = ns(block_size=block_size)
    ids = tokens(2 * block_size)
    assert block_keys(ids + [5] * (block_size - 1), namespace) == block_keys(ids, namespace)
    assert block_keys(ids[: block_size - 1], namespace) == []
    assert block_keys([], namespace) == []


@pytest.mark.parametrize("block_size", [16, 32, 256])
def test_changing_token_zero_changes_every_key(block_size):
    namespace = ns(block_size=block_size)
    ids = tokens(6 * block_size)
    changed = [ids[0] + 1] + ids[1:]
    before, after = block_keys(ids, namespace), block_keys(changed, namespace)
    assert all(a != b for a, b in zip(before, after, strict=True))


@pytest.mark.parametrize("block_size", [16, 32, 256])
@pytest.mark.parametrize("block", [0, 2, 5])
def test_changing_a_token_in_block_k_keeps_earlier_keys(block_size, block):
    namespace = ns(block_size=block_size)
    ids = tokens(6 * block_size)
    changed = list(ids)
    changed[block * block_size + block_size // 2] ^= 1
    before, after = block_keys(ids, namespace), block_keys(changed, namespace)
    assert before[:block] == after[:block]
    assert all(a != b for a, b in zip(before[block:], after[block:], strict=True))


def test_block_zero_depends_on_the_namespace_not_only_its_tokens():
    # The same tokens as the first block and as a later block give different keys (chaining).
    ids = [7] * 32
    keys = block_keys(ids, ns())
    assert keys[0] != keys[1]


@pytest.mark.parametrize(
    "override",
    [
        {"model_id": "other"},
        {"kv_dtype": "float8_e4m3fn"},
        {"kv_layout": "lkthd-v2"},
        {"tp_rank": 1, "tp_size": 2},
        {"tp_size": 2},
        {"tenant": "acme"},
    ],
    ids=lambda o: ",".join(o),
)
def test_every_namespace_field_changes_every_key(override):
    ids = tokens(8 * 16)
    base, other = block_keys(ids, ns()), block_keys(ids, ns(**override))
    assert len(base) == len(other) == 8
    assert not set(base) & set(other)


def test_block_size_changes_every_key():
    # 16-token and 32-token blocks over the same tokens never share a key, not even the tokens
    # both blockings cover (the namespace digest differs).
    ids = tokens(256)
    assert not set(block_keys(ids, ns(block_size=16))) & set(block_keys(ids, ns(block_size=32)))


def test_equal_namespaces_give_equal_keys():
    ids = tokens(64)
    assert block_keys(ids, ns(tenant="a")) == block_keys(ids, ns(tenant="a"))


# --- accepted inputs -------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [16, 32, 256])
def test_lists_tuples_and_numpy_arrays_give_identical_keys(block_size):
    namespace = ns(block_size=block_size)
    ids = tokens(4 * block_size + 3) + [2**32 - 1] * block_size  # the largest id fits every dtype but int32
    expected = block_keys(ids, namespace)
    assert block_keys(tuple(ids), namespace) == expected
    assert block_keys(np.array(ids, dtype=np.int64), namespace) == expected
    assert block_keys(np.array(ids, dtype=np.uint32), namespace) == expected
    assert block_keys(np.array(ids, dtype=np.uint64), namespace) == expected
    assert block_keys(np.array(ids, dtype=">u4"), namespace) == expected  # big-endian input
    small = ids[: 4 * block_size]
    assert block_keys(np.array(small, dtype=np.int32), namespace) == block_keys(small, namespace)


def test_non_contiguous_arrays_are_keyed_by_their_values():
    wide = np.arange(256, dtype=np.int64)
    assert block_keys(wide[::2], ns()) == block_keys(list(range(0, 256, 2)), ns())


def test_token_bytes_are_little_endian_uint32():
    assert token_bytes([1, 2**32 - 1]) == b"\x01\x00\x00\x00\xff\xff\xff\xff"
    assert token_bytes(np.array([258], dtype=">u4")) == b"\x02\x01\x00\x00"


# --- rejected inputs -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (np.zeros((2, 16), dtype=np.int64), "one-dimensional"),
        ([[1] * 16, [2] * 16], "one-dimensional"),
        (5, "one-dimensional"),
        ([1.0] * 16, "integers"),
        (np.ones(16, dtype=np.float32), "integers"),
        ([True] * 16, "integers"),
        (["a"] * 16, "integers"),
        ([0] * 15 + [-1], r"\[0, 2\*\*32\)"),
        (np.array([0] * 15 + [-1], dtype=np.int32), r"\[0, 2\*\*32\)"),
        ([0] * 15 + [2**32], r"\[0, 2\*\*32\)"),
        ([0] * 15 + [2**64], "integers"),
    ],
    ids=[
        "2d-array",
        "2d-list",
        "scalar",
        "float-list",
        "float32-array",
        "bool",
        "str",
        "negative",
        "negative-int32",
        "2**32",
        "2**64",
    ],
)
def test_bad_tokens_raise_value_error_naming_the_problem(bad, message):
    with pytest.raises(ValueError, match=message):
        block_keys(bad, ns())


def test_a_bad_id_in_the_partial_tail_is_still_rejected():
    with pytest.raises(ValueError, match="2\\*\\*32"):
        block_keys([0] * 16 + [-1], ns())


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"model_id": ""}, "model_id"),
        ({"model_id": 7}, "model_id"),
        ({"kv_dtype": ""}, "kv_dtype"),
        ({"kv_layout": None}, "kv_layout"),
        ({"block_size": 0}, "block_size"),
        ({"block_size": -16}, "block_size"),
        ({"block_size": 16.0}, "block_size"),
        ({"block_size": True}, "block_size"),
        ({"tp_size": 0}, "tp_size"),
        ({"tp_rank": 2, "tp_size": 2}, "tp_rank"),
        ({"tp_rank": -1}, "tp_rank"),
        ({"tp_size": 2.0}, "tp_size"),
        ({"tenant": None}, "tenant"),
    ],
    ids=repr,
)
def test_bad_namespace_fields_raise_value_error_naming_the_field(override, field):
    with pytest.raises(ValueError, match=field):
        ns(**override)


@pytest.mark.parametrize(
    "override",
    [
        {"tp_rank": 0.5, "tp_size": 2},
        {"tp_rank": True, "tp_size": 2},
        {"tp_size": True},
        {"tp_rank": "0"},
        {"tp_rank": np.int64(0)},
    ],
    ids=repr,
)
def test_non_integer_tp_fields_raise_value_error(override):
    with pytest.raises(ValueError, match="tp_"):
        ns(**override)


def test_namespace_tag_is_a_printable_prefix_of_the_digest():
    assert len(NS.digest) == 16
    assert NS.tag == NS.digest.hex()[:16]


# --- properties ------------------------------------------------------------------------------------

token_lists = st.lists(st.integers(0, 3), max_size=80)  # a small alphabet makes shared prefixes common
block_sizes = st.integers(1, 9)


@settings(max_examples=200, deadline=None)
@given(ids=token_lists, cut=st.integers(0, 80), block_size=block_sizes)
def test_keys_of_a_prefix_are_a_prefix_of_the_keys(ids, cut, block_size):
    namespace = ns(block_size=block_size)
    keys = block_keys(ids, namespace)
    assert len(keys) == len(ids) // block_size
    assert block_keys(ids[:cut], namespace) == keys[: min(cut, len(ids)) // block_size]


@settings(max_examples=200, deadline=None)
@given(a=token_lists, b=token_lists, block_size=block_sizes)
def test_two_sequences_share_exactly_their_common_full_block_prefix(a, b, block_size):
    namespace = ns(block_size=block_size)
    common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    shared = common // block_size
    keys_a, keys_b = block_keys(a, namespace), block_keys(b, namespace)
    assert keys_a[:shared] == keys_b[:shared]
    assert set(keys_a) & set(keys_b) == set(keys_a[:shared])


def test_a_slice_key_is_xxh3_of_the_block_key_and_the_slice_whichever_slices_are_asked_for():
    """One slice at a time (a rank holding one head) and all at once give the same keys."""
    keys = block_keys(np.arange(64, dtype=np.uint32), Namespace("m", "bf16", "x", 16))
    every = slice_keys(keys, range(8))
    assert every[8 * 2 + 5] == xxhash.xxh3_128_digest(keys[2] + b"kvstrata-slice:" + (5).to_bytes(4, "little"))
    for j in range(8):
        assert slice_keys(keys, range(j, j + 1)) == every[j::8]
    assert slice_keys(keys, range(2, 4)) == [k for pair in zip(every[2::8], every[3::8]) for k in pair]
    assert len(set(every)) == 32 and slice_keys([], range(3)) == []


def test_extras_folded_into_the_first_block_key_every_block_apart():
    from kvstrata.index.keys import FOLD_BITS, fold_extras

    ns = Namespace("m", "float16", "kv", 16)
    plain = list(range(100, 100 + 64))
    a, again, b = fold_extras(plain, 16, b"tenant-a"), fold_extras(plain, 16, b"tenant-a"), fold_extras(plain, 16, b"b")
    assert a == again != b and a[16:] == plain[16:] and all((1 << FOLD_BITS) <= t < 1 << 32 for t in a[:16])
    keys = {name: block_keys(t, ns) for name, t in (("plain", plain), ("a", a), ("b", b))}
    assert all(x != y for n, m in (("plain", "a"), ("a", "b"), ("plain", "b"))
               for x, y in zip(keys[n], keys[m], strict=True))  # every block keyed apart, not only the first
    assert fold_extras([1 << FOLD_BITS] + plain[1:], 16, b"a") is None  # no room left to fold into
