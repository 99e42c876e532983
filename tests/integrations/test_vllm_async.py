"""Loads off the step: a hit on disk is vLLM's asynchronous load, reported through get_finished.

A vLLM engine (CPU, tiny random-weight Llama, prefix caching off) whose kvstrata keeps blocks on
disk only stores six prompts, then is asked them again, all at once. The disk was never loaded
from: the first request, alone, loads in the step (it holds nobody up); the others, admitted
beside it before any load is measured, load off the step (an unmeasured tier below memory, with
requests running): vLLM allocates their blocks and keeps them waiting while the first computes,
and the workers report each load through ``get_finished`` once every layer is copied into
vLLM's blocks. Every completion is the one computed the first time, and nothing failed.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tests.integrations.test_vllm import BLOCK, MiB, run_children, spec  # noqa: E402

_rng = random.Random(31)
PROMPTS = [[_rng.randrange(10, 4000) for _ in range(n)] for n in (200, 260, 230, 290, 250, 270)]


@pytest.fixture(scope="module")
def run(tiny_model_dir, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("async")
    s = spec(Path(tiny_model_dir), tmp, "disk", passes=[PROMPTS, PROMPTS], max_tokens=4, host_bytes=0,
             disk_dir=str(tmp / "disk"), disk_bytes=64 * MiB)
    return run_children({"disk": s}, tmp)["disk"]


def test_a_hit_on_an_unmeasured_disk_loads_off_the_step_and_gives_the_same_tokens(run):
    first, again = run["passes"]
    stats = again["stats"]
    assert first["stats"]["load_requests"] == 0 and first["stats"]["async_loads"] == 0
    assert 1 <= stats["async_loads"] < len(PROMPTS)  # the first, alone, in the step; the others off it
    assert stats["load_requests"] == len(PROMPTS)  # every hit arrived, off the step or in it
    assert stats["loaded_tokens"] == sum((len(p) - 1) // BLOCK * BLOCK for p in PROMPTS)
    assert stats["failed_blocks"] == 0 and stats["recomputed_blocks"] == 0 and stats["last_failure"] is None
    assert again["tokens"] == first["tokens"]
