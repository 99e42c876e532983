"""A tenant's cache salt in one vLLM engine with the connector: kvstrata serves a salted prompt
only to requests of the same salt, never to another tenant's or to an unsalted request of the
same tokens, and each gets the tokens computed from scratch (``keying.py``)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from tests.integrations.test_vllm import BLOCK, MiB, PROMPTS, run_children, spec  # noqa: E402

PROMPT = PROMPTS[0]  # 100 tokens: a hit of 3 blocks
HIT = (len(PROMPT) - 1) // BLOCK * BLOCK


def test_a_salted_prompt_is_served_to_its_own_tenant_only(tiny_model_dir, tmp_path):
    salted = {"prompt_token_ids": PROMPT, "cache_salt": "tenant-a"}
    passes = [[salted], [salted, {"prompt_token_ids": PROMPT, "cache_salt": "tenant-b"}, PROMPT]]
    run = run_children({"salt": spec(tiny_model_dir, tmp_path, "salt", passes=passes, host_bytes=16 * MiB)},
                       tmp_path)["salt"]
    first, second = run["passes"]
    assert first["cached"] == [0]
    assert second["cached"] == [HIT, 0, 0]  # tenant a's blocks to tenant a only
    assert second["stats"]["loaded_tokens"] == HIT
    assert second["tokens"] == [first["tokens"][0]] * 3  # every answer is the one computed from scratch
