"""The hashing/lookup micro-benchmark: shape of its result and the honesty of its baselines."""

from __future__ import annotations

import dataclasses
import hashlib
import pickle

import numpy as np
import pytest

from kvstrata.bench.lookup import hash_and_lookup_ms, index_scaling, sha256_pickle_keys, xxh3_loop_keys
from kvstrata.rounds import Rounds, Spread
from kvstrata.index.keys import Namespace, block_keys


def test_result_has_every_figure_and_they_are_positive():
    result = dataclasses.asdict(hash_and_lookup_ms(tokens=1024, block_size=16, repeats=3))
    assert set(result) == {"block_size", "tokens", "ours_ms", "hash_only_ms", "cache_ms", "sha256_pickle_ms",
                           "xxh3_loop_ms", "ours_of_xxh3", "hash_of_xxh3", "cache_of_xxh3", "ours_of_sha256"}
    assert (result["block_size"], result["tokens"]) == (16, 1024)
    assert all(result[k] > 0 for k in result if k.endswith("_ms"))
    for name in ("ours_of_xxh3", "hash_of_xxh3", "cache_of_xxh3", "ours_of_sha256"):
        spread = result[name]
        assert spread["rounds"] == 3
        assert 0 < spread["min"] <= spread["median"] <= spread["max"], name


def test_scaling_looks_up_the_same_prompt_against_both_indexes():
    scaling = index_scaling(tokens=1024, block_size=16, small=64, large=640, repeats=3)
    assert (scaling.blocks, scaling.small, scaling.large) == (64, 64, 640)
    for spread in (scaling.lookup, scaling.match):
        assert spread.rounds == 3 and 0 < spread.min <= spread.median <= spread.max
    assert min(scaling.lookup_small_ms, scaling.lookup_large_ms, scaling.match_small_ms, scaling.match_large_ms) > 0


@pytest.mark.parametrize(("small", "large"), [(63, 640), (64, 32)])
def test_scaling_refuses_an_index_smaller_than_the_prompt_or_than_the_small_one(small, large):
    with pytest.raises(ValueError, match="prompt's blocks"):
        index_scaling(tokens=1024, block_size=16, small=small, large=large, repeats=3)


def test_a_spread_is_the_median_and_extremes_of_the_per_round_ratios():
    rounds = Rounds()
    for ours, base in ((2.0, 1.0), (3.0, 1.0), (1.0, 2.0)):
        rounds.add("ours", ours)
        rounds.add("base", base)
    assert rounds.time_ratio_spread("ours", "base") == Spread(2.0, 0.5, 3.0, 3)


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
