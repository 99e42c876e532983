"""A router's hashes of a prompt are the ones vLLM's scheduler gives the request (and its events carry)."""

from __future__ import annotations

import pytest

from kvstrata.fleet.hashes import prompt_block_hashes

pytest.importorskip("vllm")


def _vllms_own(tokens: list[int], block_size: int) -> list:
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, maybe_convert_block_hash
    from vllm.v1.request import Request

    hasher = get_request_block_hasher(block_size, get_hash_fn_by_name("sha256"))
    request = Request("r", tokens, SamplingParams(max_tokens=1), None, block_hasher=hasher)
    return [maybe_convert_block_hash(h) for h in request.block_hashes]


def test_a_prompts_hashes_are_the_requests_block_hashes_in_vllm():
    tokens = list(range(1000, 1000 + 16 * 5 + 7))  # five full blocks and a partial one
    ours = prompt_block_hashes(tokens, 16)
    assert len(ours) == 5
    assert list(ours) == _vllms_own(tokens, 16)
    assert prompt_block_hashes(tokens[:16 * 2], 16) == ours[:2]  # a prefix's hashes are a prefix
    assert prompt_block_hashes(tokens[:15], 16) == ()


def test_one_algo_per_process_and_a_block_size_of_at_least_one():
    prompt_block_hashes([1] * 16, 16)
    with pytest.raises(ValueError, match="cannot also use 'sha256_cbor'"):
        prompt_block_hashes([1] * 16, 16, algo="sha256_cbor")
    with pytest.raises(ValueError, match="block_size"):
        prompt_block_hashes([1], 0)
