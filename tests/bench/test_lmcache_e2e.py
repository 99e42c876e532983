"""LMCache end to end on a tiny transformers model: restored prefixes decode as recomputed ones.

The LMCache tests need LMCache's own venv (``.venv-lmcache``; setup in kvstrata/bench/lmcache.py):
``.venv-lmcache/bin/python -m pytest tests/bench/test_lmcache_e2e.py -q``. Elsewhere they skip;
the side session's refusals are tested everywhere.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest

from kvstrata.bench.lmcache_e2e import synthetic_turns

BYTES_PER_TOKEN = 4 * 2 * 2 * 64 * 2  # tiny model: layers x (K, V) x kv_heads x head_dim x bf16
CHUNK = 64
NEW_TOKENS = 6
pytestmark = pytest.mark.server  # LMCache's side session: a process serving the model beside the test

needs_lmcache = pytest.mark.skipif(
    importlib.util.find_spec("lmcache") is None or importlib.util.find_spec("transformers") is None,
    reason="lmcache and transformers are not installed here (run in .venv-lmcache)",
)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    pytest.importorskip("lmcache")
    from kvstrata.integrations.tiny import make_tiny

    return str(make_tiny(tmp_path_factory.mktemp("tiny") / "model"))


def _prompts() -> list[list[int]]:
    # 2 conversations x 2 turns, turn-major, one shared system prompt of 150 tokens.
    return synthetic_turns(conversations=2, turns=2, system_tokens=150, turn_tokens=60, answer_tokens=NEW_TOKENS,
                           vocab=4096)


@needs_lmcache
def test_host_and_disk_restore_what_was_stored_and_decode_identically(tiny_model, tmp_path):
    from kvstrata.bench.lmcache_e2e import lmcache_e2e_tiers

    prompts = _prompts()
    result = lmcache_e2e_tiers(tiny_model, prompts, ("host", "disk"), NEW_TOKENS, CHUNK, disk_dir=tmp_path)
    assert result["bytes_per_token"] == BYTES_PER_TOKEN
    for tier in ("host", "disk"):
        res = result["tiers"][tier]
        turns = res["per_turn"]
        assert len(turns) == len(prompts)
        assert res["tokens_identical"], [t["tokens_identical"] for t in turns]
        assert res["kv_max_abs_diff"] < 0.5  # bf16 prefills of other lengths round differently
        assert turns[0]["hit_tokens"] == 0  # nothing stored yet
        assert turns[1]["hit_tokens"] == 128  # the shared system prompt's full chunks (150 -> 128)
        for earlier, later in ((0, 2), (1, 3)):  # turn 1 of each conversation: its turn 0's full chunks
            assert later >= 2 and turns[later]["hit_tokens"] == len(prompts[earlier]) // CHUNK * CHUNK > 0
        for t in turns:
            assert t["bytes_restored"] == t["hit_tokens"] * BYTES_PER_TOKEN
            assert t["hit_tokens"] % CHUNK == 0
        assert res["hit_tokens"] == sum(t["hit_tokens"] for t in turns)
        assert res["bytes_restored"] == res["hit_tokens"] * BYTES_PER_TOKEN
        assert res["hit_rate"] == pytest.approx(res["hit_tokens"] / sum(len(p) for p in prompts))
        assert res["restore_gbps"] > 0 and res["ttft_cold_s"] > 0 and res["ttft_warm_s"] > 0
    # The disk tier really read from the disk: its engine wrote chunk files.
    assert any(tmp_path.rglob("*.pt"))


@needs_lmcache
def test_a_prompt_restored_whole_recomputes_its_last_token(tiny_model):
    from kvstrata.bench.lmcache_e2e import lmcache_e2e

    prompt = synthetic_turns(1, 1, 2 * CHUNK, 0, 0, 4096)[0]  # exactly two chunks
    res = lmcache_e2e(tiny_model, [prompt, prompt], "host", NEW_TOKENS, CHUNK, repeats=2)
    assert [t["hit_tokens"] for t in res["per_turn"]] == [0, 2 * CHUNK]
    assert res["tokens_identical"]


def test_synthetic_turns_extend_each_conversation_and_share_the_system_prompt():
    prompts = synthetic_turns(conversations=3, turns=2, system_tokens=10, turn_tokens=4, answer_tokens=2, vocab=100)
    assert [len(p) for p in prompts] == [14] * 3 + [20] * 3
    assert prompts[0][:10] == prompts[1][:10] == prompts[2][:10]
    for c in range(3):
        assert prompts[3 + c][:14] == prompts[c]


def test_paired_ratios_are_per_turn_medians_with_their_spread():
    from kvstrata.bench.e2e import paired

    r = paired([1.0, 3.0, 2.0, 5.0], [2.0, 1.0, 2.0, 0.0])  # the last turn has no baseline
    assert (r.median, r.min, r.max, r.rounds) == (1.0, 0.5, 3.0, 3)
    assert paired([], []) is None
    with pytest.raises(ValueError):
        paired([1.0], [1.0, 2.0])


def test_a_side_session_without_lmcache_fails_with_its_stderr(tmp_path):
    from kvstrata.bench.lmcache_side import SideSession, SideSessionError

    if importlib.util.find_spec("lmcache") is not None:
        pytest.skip("this interpreter has lmcache")
    with pytest.raises(SideSessionError, match="exited") as err:
        SideSession(sys.executable, tmp_path, ["host"], capacity_tokens=1024)
    assert "lmcache" in str(err.value).lower()
    with pytest.raises(SideSessionError, match="no Python interpreter"):
        SideSession(tmp_path / "none" / "python", tmp_path, ["host"], capacity_tokens=1024)


@needs_lmcache
def test_a_side_session_answers_turn_by_turn_and_names_a_bad_request(tiny_model):
    from kvstrata.bench.lmcache_side import SideSession, SideSessionError

    prompts = _prompts()
    with SideSession(sys.executable, tiny_model, ["host"], capacity_tokens=4096, chunk_tokens=CHUNK) as side:
        assert side.about["chunk_tokens"] == CHUNK and side.about["bytes_per_token"] == BYTES_PER_TOKEN
        turns = [side.turn(i, p, NEW_TOKENS, ["host"])["host"] for i, p in enumerate(prompts)]
        with pytest.raises(SideSessionError, match="'disk'"):
            side.turn(9, prompts[0], NEW_TOKENS, ["disk"])
        again = side.turn(9, prompts[0], NEW_TOKENS)["host"]  # the session survives a bad request
    assert [t["hit_tokens"] for t in turns[:2]] == [0, 128]
    assert all(t["tokens_identical"] for t in turns) and again["tokens_identical"]
    assert again["hit_tokens"] == len(prompts[0]) // CHUNK * CHUNK
