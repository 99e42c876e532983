"""The hashing/lookup micro-benchmark: shape of its result and the honesty of its baselines."""

from __future__ import annotations

import dataclasses
import hashlib
import pickle

import numpy as np
import pytest

from kvstrata.bench.lookup import hash_and_lookup_ms, sha256_pickle_keys, xxh3_loop_keys
from kvstrata.index.keys import Namespace, block_keys


def test_result_has_every_figure_and_they_are_positive():
    result = dataclasses.asdict(hash_and_lookup_ms(tokens=1024, block_size=16, repeats=3))
    assert set(result) == {"block_size", "tokens", "ours_ms", "hash_only_ms", "sha256_pickle_ms", "xxh3_loop_ms"}
    assert (result["block_size"], result["tokens"]) == (16, 1024)
    assert all(result[k] > 0 for k in result if k.endswith("_ms"))


def test_the_bare_xxh3_loop_computes_our_keys():
    # So the baseline measures the same work, minus input checks and the lookup.
    ids = np.random.default_rng(1).integers(0, 2**32, 1000, dtype=np.uint32)
    namespace = Namespace("m", "bf16", "lkthd", 16)
    assert xxh3_loop_keys(ids, 16, namespace.digest) == block_keys(ids, namespace)


def test_the_sha256_baseline_chains_pickled_blocks_like_vllm():
    ids = list(range(40))
    keys = sha256_pickle_keys(ids, 16)
    assert len(keys) == 2
    first = hashlib.sha256(pickle.dumps((b"", tuple(range(16))), protocol=pickle.HIGHEST_PROTOCOL)).digest()
    second = hashlib.sha256(pickle.dumps((first, tuple(range(16, 32))), protocol=pickle.HIGHEST_PROTOCOL)).digest()
    assert keys == [first, second]


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"tokens": 0}, "tokens"),
        ({"block_size": -1}, "block_size"),
        ({"repeats": 0}, "repeats"),
        ({"tokens": 8, "block_size": 16}, "at least one block"),
    ],
)
def test_bad_arguments_are_refused(kwargs, name):
    with pytest.raises(ValueError, match=name):
        hash_and_lookup_ms(**kwargs)
