"""vLLM (CPU) at tensor_parallel_size=2 with head-sliced blocks: KV stored at one TP size
served at another. Opt-in (``KVSTRATA_VLLM_TP=1``): a TP=2 engine is four processes (front,
engine core, two workers over gloo/shm) and takes about a minute to start and run on 2 cores.

Each TP rank is a process with caches of its own; what ranks of different TP sizes share is
the pool (every rank's slices) and rank 0's disk directory (a rank r > 0 has ``disk_dir/rank{r}``).
Round one: a TP=1 engine stores PROMPTS, a TP=2 engine stores FILLER (into the pool and its
ranks' disk directories), a TP=1 MLA engine stores PROMPTS' latents. Then rank 1's disk
directory is emptied. Round two: TP=2 loads what TP=1 stored and TP=1 what TP=2 stored, from
the pool, each with the tokens of a cold run at its own TP size (in fp32: in bf16, KV summed
over two ranks parts near-ties from KV summed on one a few tokens in); the MLA model at TP=2
loads the one stored copy of each latent block on both ranks, with the tokens of a cold TP=2
run and of TP=1 (and a TP=1 MLA engine what a TP=2 one stored, with the cold tokens) (vLLM's PyTorch rotary embedding, as ``test_vllm_mla.py`` says why); and a TP=2
engine on the disk directories alone, where rank 0 finds its packs and rank 1 none, reports
rank 1's blocks as load errors, so vLLM recomputes them: the cold tokens again.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import uuid
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvstrata.policies.payoff import BUDGET_FACTOR  # noqa: E402
from tests.integrations.test_vllm import BLOCK, FILLER, HIT_TOKENS, PROMPTS, run_children, spec  # noqa: E402
from tests.integrations.test_vllm_mla import ENGINE as MLA_ENGINE  # noqa: E402
from tests.integrations.test_vllm_mla import MLA_BLOCK  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("KVSTRATA_VLLM_TP") != "1",
                                reason="TP=2 vLLM engines are slow on 2 cores: set KVSTRATA_VLLM_TP=1")

MiB = 1024**2
FILLER_HITS = [96, 96]
_rng = random.Random(29)
SLOW = [[_rng.randrange(10, 4000) for _ in range(n)] for n in (200, 260, 230, 290)]  # test_vllm_budget's, at TP=2
CAP_GBPS = 0.0001  # 0.1 MB/s, a cap the connector is not told of
LONGER = [p + [11 + i for i in range(64)] for p in FILLER]  # FILLER's 3 blocks, then 2 new full ones


def rank_stats(run: dict, tmp: Path, name: str, rank: int) -> dict:
    """A rank's stats at the end: rank 0's are the run's, rank r's in ``NAME.stats.rank{r}.json``."""
    return run["passes"][-1]["stats"] if rank == 0 else json.loads((tmp / f"{name}.stats.rank{rank}.json").read_text())


@pytest.fixture(scope="module")
def tp_runs(tiny_model_dir, tiny_mla_dir, pool, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("vllm-tp")
    lines = [f"{k} = {json.dumps(v)}" for k, v in pool.to_json().items() if v is not None]  # as test_vllm's
    (tmp / "pool.toml").write_text("[pool]\n" + "\n".join(lines) + "\n")
    model, mla = Path(tiny_model_dir), Path(tiny_mla_dir)
    ns = uuid.uuid4().hex[:8]
    remote = {"host_bytes": 0, "pool": str(tmp / "pool.toml"), "remote_bytes": 16 * MiB}
    llama, mla_ns = {**remote, "model_id": f"vllm-tp-{ns}"}, {**remote, "model_id": f"vllm-tp-mla-{ns}"}
    mla_back = {**remote, "model_id": f"vllm-tp-mla-back-{ns}"}  # MLA the other way: TP=2 stores, TP=1 loads
    disk = {"disk_dir": str(tmp / "disk"), "disk_bytes": 64 * MiB}
    tp2 = {"tensor_parallel_size": 2}
    fp32 = {"dtype": "float32"}  # TP=1's and TP=2's sums part near-ties in bf16 (measured), not in fp32
    # cold references that store nothing (consumers, in namespaces nothing is stored under)
    cold = {**remote, "role": "kv_consumer"}
    runs = run_children({
        "l1": {**spec(model, tmp, "l1", **llama), **fp32},
        "l1_cold": {**spec(model, tmp, "l1_cold", passes=[FILLER], **cold, model_id=f"vllm-tp-cold-{ns}"), **fp32},
        "m2_cold": {**spec(mla, tmp, "m2_cold", **cold, model_id=f"vllm-tp-mla-cold-{ns}"), **MLA_ENGINE, **tp2},
        "l2": {**spec(model, tmp, "l2", passes=[FILLER], **llama, **disk), **tp2, **fp32},
        "m1": {**spec(mla, tmp, "m1", **mla_ns), **MLA_ENGINE},
        "m2w": {**spec(mla, tmp, "m2w", passes=[FILLER], **mla_back), **MLA_ENGINE, **tp2},
        "m1_cold": {**spec(mla, tmp, "m1_cold", passes=[FILLER], **cold, model_id=f"vllm-tp-mla-c1-{ns}"), **MLA_ENGINE},
    }, tmp)
    shutil.rmtree(tmp / "disk" / "rank1")  # rank 1's slices of FILLER: gone from disk
    runs |= run_children({
        "l2_from_1": {**spec(model, tmp, "l2_from_1", **llama), **tp2, **fp32},
        "l1_from_2": {**spec(model, tmp, "l1_from_2", passes=[FILLER], **llama), **fp32},
        "m2": {**spec(mla, tmp, "m2", **mla_ns), **MLA_ENGINE, **tp2},
        "m1_from_2": {**spec(mla, tmp, "m1_from_2", passes=[FILLER], **mla_back), **MLA_ENGINE},
    }, tmp)
    runs |= run_children({
        "l2_missing": {**spec(model, tmp, "l2_missing", passes=[FILLER, LONGER], model_id=f"vllm-tp-{ns}",
                              host_bytes=16 * MiB, **disk), **tp2, **fp32},
        "l2_slow": {**spec(model, tmp, "l2_slow", passes=[SLOW, SLOW], max_tokens=4, host_bytes=0,
                           disk_dir=str(tmp / "slow-disk"), disk_bytes=64 * MiB, disk_read_gbps=CAP_GBPS,
                           load_budget=BUDGET_FACTOR), **tp2, **fp32},
    }, tmp)
    for name, run in runs.items():
        print(f"{name}: start {run['start_s']:.1f} s, generate {sum(p['seconds'] for p in run['passes']):.1f} s")
    return {"runs": runs, "tmp": tmp}


def test_tp2_loads_what_tp1_stored_and_tp1_what_tp2_stored(tp_runs):
    runs, tmp = tp_runs["runs"], tp_runs["tmp"]
    cold_prompts, cold_filler = runs["l1"]["passes"][0], runs["l2"]["passes"][0]
    assert cold_prompts["cached"] == [0, 0] and cold_filler["cached"] == [0, 0]
    # TP=2's ranks each wrote their own head's slice: one copy of each head, none twice
    assert [rank_stats(runs["l2"], tmp, "l2", r)["new_blocks"] for r in (0, 1)] == [6, 6]
    assert [rank_stats(runs["l2"], tmp, "l2", r)["block_bytes"] for r in (0, 1)] == [4 * 2 * BLOCK * 64 * 4] * 2  # one head, fp32
    restored = runs["l2_from_1"]["passes"][0]
    assert restored["cached"] == HIT_TOKENS and restored["tokens"] == cold_prompts["tokens"]
    for rank in (0, 1):  # both ranks loaded their head of every hit block, from the pool
        stats = rank_stats(runs["l2_from_1"], tmp, "l2_from_1", rank)
        assert stats["loaded_tokens"] == sum(HIT_TOKENS) and stats["failed_blocks"] == 0
        assert stats["load_paths"] == {"remote -> device": sum(HIT_TOKENS) // BLOCK}
    back = runs["l1_from_2"]["passes"][0]
    assert back["cached"] == FILLER_HITS and back["tokens"] == runs["l1_cold"]["passes"][0]["tokens"]
    print(f"TP=2 cold vs TP=1 cold tokens of FILLER: {cold_filler['tokens']} vs {runs['l1_cold']['passes'][0]['tokens']}")
    assert back["stats"]["load_paths"] == {"remote -> device": sum(FILLER_HITS) // BLOCK}


def test_mla_at_tp2_loads_the_one_copy_tp1_stored(tp_runs):
    runs, tmp = tp_runs["runs"], tp_runs["tmp"]
    stored = runs["m1"]["passes"][0]
    assert stored["stats"]["new_blocks"] == sum(len(p) // MLA_BLOCK for p in PROMPTS)
    restored = runs["m2"]["passes"][0]
    assert restored["cached"] == HIT_TOKENS
    ranks = [rank_stats(runs["m2"], tmp, "m2", r) for r in (0, 1)]
    assert [s["writes"] for s in ranks] == [True, False]  # rank 1 shares rank 0's latent: it stores none
    assert ranks[1]["store_requests"] == 0
    for stats in ranks:  # each rank read the same stored copy of every hit block
        assert stats["loaded_tokens"] == sum(HIT_TOKENS) and stats["failed_blocks"] == 0
        assert stats["load_paths"] == {"remote -> device": sum(HIT_TOKENS) // MLA_BLOCK}
    cold = runs["m2_cold"]["passes"][0]["tokens"]
    print(f"MLA TP=2 restored vs TP=2 cold vs TP=1 cold tokens: {restored['tokens']} vs {cold} vs {stored['tokens']}")
    assert restored["tokens"] == cold == stored["tokens"]


def test_mla_at_tp1_loads_the_one_copy_tp2_stored(tp_runs):
    runs, tmp = tp_runs["runs"], tp_runs["tmp"]
    ranks = [rank_stats(runs["m2w"], tmp, "m2w", r) for r in (0, 1)]
    assert [s["writes"] for s in ranks] == [True, False] and ranks[1]["store_requests"] == 0
    assert ranks[0]["new_blocks"] == sum(len(p) // MLA_BLOCK for p in FILLER)  # rank 0 wrote each latent once
    back = runs["m1_from_2"]["passes"][0]
    assert back["cached"] == FILLER_HITS and back["stats"]["failed_blocks"] == 0
    assert back["stats"]["load_paths"] == {"remote -> device": sum(FILLER_HITS) // MLA_BLOCK}
    assert back["tokens"] == runs["m1_cold"]["passes"][0]["tokens"] == runs["m2w"]["passes"][0]["tokens"]


def test_a_rank_missing_its_slices_reports_load_errors_and_vllm_recomputes(tp_runs):
    runs, tmp = tp_runs["runs"], tp_runs["tmp"]
    run = runs["l2_missing"]["passes"][0]
    rank0, rank1 = run["stats"], rank_stats(runs["l2_missing"], tmp, "l2_missing", 1)  # rank 1's: after LONGER too
    # rank 0 answered the scheduler's lookup from its own disk: a hit
    assert rank0["loaded_tokens"] == sum(FILLER_HITS) and rank0["failed_blocks"] == 0
    # rank 1 found none of its slices: every block of both loads reported, never read as KV
    assert rank1["failed_blocks"] >= sum(FILLER_HITS) // BLOCK and rank1["loaded_tokens"] == 0
    assert "left kvstrata" in rank1["last_failure"]
    assert run["tokens"] == runs["l2"]["passes"][0]["tokens"]  # recomputed: the cold tokens


def test_no_rank_stores_the_new_blocks_of_a_step_in_which_another_ranks_load_failed(tp_runs):
    """LONGER: FILLER's 3 blocks (rank 1's slices gone again), then 2 new full blocks computed in
    the loading step over rank 1's missing KV. Rank 1 drops its saves of that step itself. Rank 0,
    whose own load arrived, holds its saves until the scheduler's verdict on the step's loads over
    both ranks, then drops them. So both ranks drop the same blocks and store the same ones
    (before the verdicts, rank 0 stored them: KV computed over rank 1's missing part)."""
    runs, tmp = tp_runs["runs"], tp_runs["tmp"]
    first = runs["l2_missing"]["passes"][0]["stats"]  # rank 0 after FILLER: nothing new to save
    rank0, rank1 = (rank_stats(runs["l2_missing"], tmp, "l2_missing", r) for r in (0, 1))
    assert first["dropped_blocks"] == 0 and first["stored_blocks"] == 0
    assert rank0["failed_blocks"] == 0 and rank0["loaded_tokens"] > sum(FILLER_HITS)  # LONGER loaded too
    assert rank1["failed_blocks"] > sum(FILLER_HITS) // BLOCK  # and failed on rank 1 again
    assert rank0["dropped_blocks"] == rank1["dropped_blocks"] >= (len(LONGER[0]) - len(FILLER[0])) // BLOCK  # held, dropped
    assert rank0["stored_blocks"] == rank1["stored_blocks"]


def test_a_load_past_its_budget_at_tp2_is_given_up_and_every_rank_computes_the_same_tokens(tp_runs):
    """A disk capped at 0.1 MB/s behind both ranks (each its own directory): each rank gives up
    the loads that held its step or its request past their budget, independently; vLLM
    recomputes a request any rank failed, on every rank. The pass takes far less than reading
    its hits would, and its tokens are the first pass's."""
    runs, tmp = tp_runs["runs"], tp_runs["tmp"]
    first, again = runs["l2_slow"]["passes"]
    ranks = [rank_stats(runs["l2_slow"], tmp, "l2_slow", r) for r in (0, 1)]
    assert first["stats"]["new_blocks"] > 0 and first["stats"]["load_requests"] == 0
    assert all(s["late_loads"] >= 1 and s["failed_blocks"] > 0 for s in ranks), ranks
    assert "budget" in ranks[0]["last_failure"] and ranks[0]["recomputed_blocks"] >= ranks[0]["failed_blocks"]
    one_block_s = 4 * 2 * BLOCK * 64 * 4 / (CAP_GBPS * 1e9)  # a rank's slice (one head) of one block, fp32
    one_hit_s = min((len(p) - 1) // BLOCK for p in SLOW) * one_block_s
    assert one_hit_s > 1.0 and again["seconds"] < len(SLOW) * one_hit_s / 2, (again["seconds"], one_hit_s)
    assert again["tokens"] == first["tokens"]
