"""How the seven architectures rank for a sliding-window and a hybrid model against dense ones.

A closing-note check for issue 12, not a test: ``make_plan`` (the ``kvstrata plan`` table) for
each model at a few contexts on one profile, each architecture ranked by its first wait, by the
requests its store holds, by its decode step, and under the simulator's SLOs (first wait within
the TTFT p90 SLO and step within the TPOT p99 SLO first, then by requests held); then the
simulator's own ranking (``kvstrata simulate``) of the seven on one synthetic agent-heavy
trace. The models are the presets: gemma-3-27b (sliding window), qwen3-next-80b-a3b (gated
delta net + full attention), each beside its all-full twin (every layer full attention of the
same heads), and the dense llama-3-70b and llama-3-8b.

    python benchmarks/group_rankings.py [--hardware h200-cx7-gen5] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from kvstrata.cli.plan import resolve_profile
from kvstrata.kv.presets import load_geometry
from kvstrata.plan.planner import make_plan
from kvstrata.plan.architectures import Architecture
from kvstrata.sim.config import SimConfig
from kvstrata.sim.results import TPOT_P99_SLO_S, TTFT_P90_SLO_S
from kvstrata.sim.run import simulate
from kvstrata.sim.synthetic import Mix, SyntheticConfig, generate

CONTEXTS = (32_768, 131_072)


def dense_twin(geometry):
    """``geometry`` with one FULL group over every layer: what it would hold without windows or states."""
    return dataclasses.replace(geometry, name=f"{geometry.name} (all full)", groups=(), max_context=None)


def rows(geometry, profile, context):
    plan = make_plan(geometry, profile, context)
    archs = [a for a in plan.architectures if a.first_wait_s is not None]
    return {
        "model": geometry.name, "context": context, "gpus": plan.tp,
        "restore_gb": plan.restore_bytes / 1e9, "context_gb_per_gpu": geometry.kv_bytes(context, plan.tp) / 1e9,
        "by_first_wait": [(a.arch.value, round(a.first_wait_s * 1e3, 2)) for a in sorted(archs, key=lambda a: a.first_wait_s)],
        "by_requests": [(a.arch.value, a.concurrent_requests) for a in
                        sorted(archs, key=lambda a: -(a.concurrent_requests or 0))],
        "by_step": [(a.arch.value, round(a.per_step_s * 1e3, 2)) for a in sorted(archs, key=lambda a: a.per_step_s)],
        "under_slo": [(a.arch.value, a.concurrent_requests if meets(a) else "misses") for a in
                      sorted(archs, key=lambda a: (not meets(a), -(a.concurrent_requests or 0)))],
    }


def meets(a) -> bool:
    return a.first_wait_s <= TTFT_P90_SLO_S and a.per_step_s <= TPOT_P99_SLO_S


def sim_rank(geometry, profile, trace):
    summaries, _ = simulate(trace, SimConfig(geometry, profile), [a.value for a in Architecture])
    return [(s.arch, round(s.throughput_per_gpu, 1), "ok" if s.meets_slo else "misses") for s in summaries]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hardware", default="h200-cx7-gen5")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    profile = resolve_profile(args.hardware)
    gemma, qwen = load_geometry("gemma-3-27b"), load_geometry("qwen3-next-80b-a3b")
    models = [gemma, dense_twin(gemma), qwen, dense_twin(qwen), load_geometry("llama-3-70b"), load_geometry("llama-3-8b")]
    out = [rows(g, profile, n) for g in models for n in CONTEXTS]
    trace = generate(SyntheticConfig(requests=300, rate=1.0, seed=3, mix=Mix(chat=1, system=1, agent=2)))
    sims = {g.name: sim_rank(g, profile, trace) for g in models}
    if args.json:
        print(json.dumps({"plan": out, "simulate": sims}, indent=1))
        return 0
    for r in out:
        print(f"{r['model']} @ {r['context']:,} tok, {r['gpus']} GPU(s): restore {r['restore_gb']:.2f} GB, "
              f"{r['context_gb_per_gpu']:.2f} GB/GPU held")
        for key in ("by_first_wait", "by_requests", "by_step", "under_slo"):
            print(f"  {key:14s} " + " > ".join(f"{a} {v}" for a, v in r[key]))
    print(f"simulated ({len(trace)} requests; tok/s per GPU, SLO):")
    for name, ranked in sims.items():
        print(f"  {name}: " + " > ".join(f"{a} {t} {ok}" for a, t, ok in ranked))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
