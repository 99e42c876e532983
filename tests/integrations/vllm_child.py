"""One vLLM engine (CPU) with the KVStrata connector, run in a child process by test_vllm.py.

Usage: ``python vllm_child.py SPEC.json``. SPEC: model (a model directory), kv_role,
extra (kv_connector_extra_config), passes (a list of prompt batches, each a list of token id
lists or TokensPrompt dicts, generated one batch after the other), max_tokens, prefix_caching (vLLM's own),
multiprocessing (vLLM's engine core and worker in processes of their own; default true),
max_num_batched_tokens (tokens per step; fewer than a prompt's prefills it in chunks), max_model_len
(default 1024), copy_delay_s (each copy of saves out of vLLM's blocks starts this late), pauses
(pass index as text -> seconds to wait before it),
dtype (default bfloat16), max_num_seqs (default 4), kv_cache_bytes (vLLM's KV memory; default 64 MiB), block_size (default 32; vLLM's CPU MLA forces 16), attention_backend
(a vLLM attention backend by name; default: vLLM's choice), tensor_parallel_size (default 1; more runs
vLLM's CPU workers over gloo/shm, one process each, their OpenMP threads left unbound: the
automatic binding wants a NUMA node per rank).
Prints one JSON line last: per pass the output token ids and vLLM's cached-token counts,
the connector's worker stats (from extra.stats_path) and the engine's start/generate seconds.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(spec: dict) -> dict:
    # False: the engine core and its worker run in this process (vLLM's uniprocess executor),
    # so the scheduler-side connector finds the worker's cache in the per-process registry;
    # True (vLLM's default on CPU): three processes, and it asks over the worker's socket.
    tp = spec.get("tensor_parallel_size", 1)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if spec.get("multiprocessing", True) or tp > 1 else "0"
    if tp > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    from vllm import LLM, SamplingParams

    if spec.get("copy_delay_s"):  # test_vllm_copy_out.py: saves copied out late, the next forward must wait
        _slow_copies(spec["copy_delay_s"])
    start = time.perf_counter()
    # e.g. "CPU_MLA": a backend named, not vLLM's choice for this CPU (test_vllm_mla.py says why)
    named = {"attention_config": {"backend": spec["attention_backend"]}} if "attention_backend" in spec else {}
    llm = LLM(
        **named,
        model=spec["model"],
        dtype=spec.get("dtype", "bfloat16"),
        enforce_eager=True,  # no torch.compile / graphs on CPU
        block_size=spec.get("block_size", 32),  # the CPU attention backend needs a multiple of 32
        tensor_parallel_size=tp,
        kv_cache_memory_bytes=spec.get("kv_cache_bytes", 64 * 1024**2),  # else vLLM sizes it from host RAM
        max_model_len=spec.get("max_model_len", 1024),
        max_num_seqs=spec.get("max_num_seqs", 4),
        # fewer tokens per step than a prompt: vLLM prefills it in chunks (None: vLLM's default)
        max_num_batched_tokens=spec.get("max_num_batched_tokens"),
        enable_prefix_caching=spec.get("prefix_caching", False),
        # e.g. ["-rotary_embedding"]: vLLM's PyTorch op in place of its CPU kernel (test_vllm_mla.py says why)
        compilation_config={"custom_ops": spec["custom_ops"]} if "custom_ops" in spec else None,
        seed=0,
        kv_transfer_config={
            "kv_connector": "KVStrataConnector",
            "kv_connector_module_path": "kvstrata.integrations.vllm",
            "kv_role": spec.get("kv_role", "kv_both"),
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": spec["extra"],
        },
    )
    started = time.perf_counter() - start
    params = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 8), ignore_eos=True)
    passes = []
    for n, batch in enumerate(spec["passes"]):
        time.sleep(spec.get("pauses", {}).get(str(n), 0.0))  # before this pass: stores in flight end, probes fall due
        t0 = time.perf_counter()
        # a prompt is its token ids, or vLLM's TokensPrompt as a dict (with a cache_salt, say)
        outputs = llm.generate([p if isinstance(p, dict) else {"prompt_token_ids": p} for p in batch], params,
                               use_tqdm=False)
        passes.append(
            {
                "tokens": [list(o.outputs[0].token_ids) for o in outputs],
                "cached": [o.num_cached_tokens for o in outputs],
                "seconds": time.perf_counter() - t0,
                "stats": _stats(spec),
            }
        )
    return {"start_s": started, "passes": passes}


def _slow_copies(delay_s: float) -> None:
    """Each copy of saves out of vLLM's blocks starts ``delay_s`` late (the worker runs in this
    process: ``multiprocessing`` false)."""
    from kvstrata.integrations.vllm.saves import Saves

    copy_out = Saves._copy_out

    def late(self, specs):
        time.sleep(delay_s)
        return copy_out(self, specs)

    Saves._copy_out = late


def _stats(spec: dict) -> dict | None:
    path = spec["extra"].get("stats_path")
    if not path:
        return None
    with open(path) as f:
        return json.load(f)


if __name__ == "__main__":  # vLLM spawns its engine and workers: this must not rerun in them
    with open(sys.argv[1]) as f:
        result = main(json.load(f))
    print("KVSTRATA_RESULT " + json.dumps(result), flush=True)
