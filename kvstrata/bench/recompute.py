"""Load or recompute on the tiny model: the auto plan's TTFT against load-only and recompute-only,
across storage speeds.

Setup. The tiny model (:func:`~kvstrata.integrations.tiny.make_tiny`), one long prompt of seeded
random tokens whose first ``cached_tokens`` are cached on the disk tier only (a device tier above
it, no host tier; the device copy is evicted before every run). For each read cap of the disk
tier (``CacheConfig.disk_read_gbps``, emulating slower storage) a fresh cache opens the same
directory, then rounds of three runs (load-only, recompute-only, auto; one warm-up round, then
``repeats``, the order rotating per round) time TTFT (lookup, load and/or compute, first token)
of :meth:`KVStrataLM.generate`. Reported per cap: the medians, auto's plan and k, the ratio
auto / min(load, recompute) (of medians), pass when <= ``goal_ratio``, and whether every run's
first token equals the cold run's.

What the decision knows. The prefill fit is measured once on this host
(:func:`~kvstrata.integrations.recompute.measure_prefill`). The load side is measured per cap,
never read from the cap: a probe times single-threaded reads of 1, 2 and 8 blocks from the
capped disk tier (``DiskTier.read_into``, verified, median of 3 after a warm-up) and fits
``latency + bytes / bandwidth``; that fit becomes the ``disk read (cold)`` path of a
:class:`HostCalibration` handed to the model (cold: the cap does not scale with readers), and
the same reads on the thread's CPU clock its ``disk read (page cache)`` path: the work a load
puts on the cores the model computes on (the contention term of the decision on a CPU host).
"""

from __future__ import annotations

import platform
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvstrata.rounds import check_rounds, rotated
from kvstrata.cache import CacheConfig, TieredCache
from kvstrata.media import Medium
from kvstrata.plan.calpaths import CalPath
from kvstrata.plan.host import HostCalibration, PathFit, PrefillFit, fit_path
from kvstrata.plan.recompute import PlanKind, Strategy
from kvstrata.progress import NoProgress, Progress
from kvstrata.report import FLATTEN

PLANS = (Strategy.LOAD, Strategy.RECOMPUTE, Strategy.AUTO)
PROBE_BLOCKS = (1, 2, 8)
LOAD_MODEL = ("probe of the capped disk tier (DiskTier.read_into of 1, 2, 8 blocks, one thread, median of 3) fitted "
              "as HostCalibration path 'disk read (cold)'; its CPU time as 'disk read (page cache)', the load's "
              "contention with the model's compute on this CPU-only host")


@dataclass(frozen=True)
class RecomputeBenchConfig:
    """What ``kvstrata bench recompute`` runs.

    Attributes:
        cached_tokens: the prompt's cached prefix (a multiple of ``block_tokens``).
        tail_tokens: prompt tokens after it (computed by every plan).
        block_tokens: tokens per block (the split's granularity).
        rates_gbps: disk read caps, decimal GB/s.
        repeats: timed rounds per cap after one warm-up, >= 3.
        goal_ratio: pass when auto / min(load, recompute) <= this.
        work_dir: where the model and the disk tier go (default: a temp directory).
    """

    cached_tokens: int = 4096
    tail_tokens: int = 64
    block_tokens: int = 64
    rates_gbps: tuple[float, ...] = (0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 2.0)
    repeats: int = 9  # at ~25 ms TTFTs, 5 rounds left medians 10% apart for the same plan
    goal_ratio: float = 1.1
    work_dir: str | None = None

    def __post_init__(self) -> None:
        if self.block_tokens < 1 or self.cached_tokens < self.block_tokens or self.cached_tokens % self.block_tokens:
            raise ValueError(f"bench recompute: cached_tokens {self.cached_tokens} must be a positive multiple of "
                             f"block_tokens {self.block_tokens}")
        if not self.rates_gbps or any(not r > 0 for r in self.rates_gbps):
            raise ValueError(f"bench recompute: rates_gbps must be positive, got {list(self.rates_gbps)}")
        check_rounds(self, "bench recompute", ("tail_tokens",))


@dataclass(frozen=True)
class RecomputeRun:
    model: str
    prompt_tokens: int
    cached_tokens: int
    tail_tokens: int
    block_tokens: int
    block_bytes: int
    cached_bytes: int
    repeats: int
    goal_ratio: float
    torch_threads: int
    load_model: str = LOAD_MODEL


@dataclass(frozen=True)
class PrefillTiming:
    """The prefill fit measured on this host, and how long measuring it took."""

    fit: PrefillFit = field(metadata=FLATTEN)
    measure_s: float


@dataclass(frozen=True)
class Probe:
    """The capped disk tier's reads, fitted: the load side of the auto decision."""

    gbps: float
    latency_s: float
    spread: float
    cpu_gbps: float


@dataclass(frozen=True)
class RateRow:
    """One read cap: TTFT medians per strategy, the auto plan chosen, and the verdict."""

    gbps: float
    probe: Probe
    ttft_s: dict[Strategy, float]
    ttft_range_s: dict[Strategy, tuple[float, float]]
    plan: PlanKind
    k: int  # tokens computed from scratch by the auto plan
    predicted_s: dict[Strategy, float]
    ratio: float  # auto / min(load, recompute), of medians
    passed: bool
    tokens_match: bool


@dataclass(frozen=True)
class RecomputeBenchReport:
    """Every rate's row; ``passed`` and ``tokens_match`` when every row's are."""

    config: RecomputeRun
    prefill: PrefillTiming
    rates: tuple[RateRow, ...]
    passed: bool = field(init=False)
    tokens_match: bool = field(init=False)
    wall_s: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "passed", all(r.passed for r in self.rates))
        object.__setattr__(self, "tokens_match", all(r.tokens_match for r in self.rates))


def run_recompute_bench(config: RecomputeBenchConfig, progress: Progress | None = None) -> RecomputeBenchReport:
    import transformers

    from kvstrata.integrations.hf import KVStrataLM, model_layout
    from kvstrata.integrations.recompute import measure_prefill
    from kvstrata.integrations.tiny import make_tiny

    progress = progress or NoProgress()
    started = time.perf_counter()
    rounds = config.repeats + 1
    progress.start(2 + len(config.rates_gbps) * (1 + rounds))
    with tempfile.TemporaryDirectory(dir=config.work_dir, prefix="kvstrata-bench-recompute-") as tmp:
        work = Path(tmp)
        progress.step("tiny model")
        model = transformers.AutoModelForCausalLM.from_pretrained(make_tiny(work / "model"))
        model.eval()
        progress.step("measuring prefill")
        prefill_started = time.perf_counter()
        prefill = measure_prefill(model)
        prefill_s = time.perf_counter() - prefill_started
        layout = model_layout(model.config, config.block_tokens, model.dtype)
        prompt_tokens = config.cached_tokens + config.tail_tokens
        generator = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, model.config.vocab_size, (prompt_tokens,), generator=generator).tolist()
        hit_blocks = config.cached_tokens // config.block_tokens
        model_id = f"tiny-{uuid.uuid4().hex[:8]}"

        def cache_config(gbps: float | None) -> CacheConfig:
            b = layout.block_bytes
            return CacheConfig(layout, model_id, device_bytes=2 * hit_blocks * b, host_bytes=0,
                               disk_bytes=2 * hit_blocks * b, disk_dir=work / "disk", device="cpu",
                               disk_read_gbps=gbps)

        with TieredCache(cache_config(None)) as cache:  # the prefix, computed once, on disk
            lm = KVStrataLM(model, cache)
            cold = lm.generate(prompt, 1, reuse=False, store=False)
            lm.generate(prompt[: config.cached_tokens], 1, reuse=False, store=True)
            _wait_on_disk(cache, prompt[: config.cached_tokens], hit_blocks)
        rows = [_run_rate(gbps, cache_config(gbps), model, prefill, prompt, cold.tokens[0], config, progress)
                for gbps in config.rates_gbps]
    run = RecomputeRun(
        model="tiny (kvstrata.integrations.tiny: 4 layers, 2 KV heads, head_dim 64, bf16)",
        prompt_tokens=prompt_tokens, cached_tokens=config.cached_tokens, tail_tokens=config.tail_tokens,
        block_tokens=config.block_tokens, block_bytes=layout.block_bytes, cached_bytes=hit_blocks * layout.block_bytes,
        repeats=config.repeats, goal_ratio=config.goal_ratio, torch_threads=torch.get_num_threads(),
    )
    return RecomputeBenchReport(run, PrefillTiming(prefill, prefill_s), tuple(rows), time.perf_counter() - started)


def _run_rate(
    gbps: float, cache_config: CacheConfig, model: Any, prefill: Any, prompt: list[int], cold_token: int,
    config: RecomputeBenchConfig, progress: Progress,
) -> RateRow:
    from kvstrata.integrations.hf import KVStrataLM

    with TieredCache(cache_config) as cache:
        keys = cache.keys(prompt[: config.cached_tokens])
        if cache.lookup(prompt[:-1]).count(Medium.DISK) != len(keys):
            raise RuntimeError(f"the cached prefix is not on the disk tier alone at {gbps} GB/s")
        progress.step(f"{gbps:g} GB/s: probe")
        probe, cpu = _probe_disk(cache, keys)
        paths = {CalPath.DISK_READ_COLD: probe, CalPath.DISK_READ_WARM: cpu}
        calibration = HostCalibration(platform.node(), "cpu", cache_config.workers, paths)
        lm = KVStrataLM(model, cache, calibration=calibration, prefill=prefill)
        ttft: dict[Strategy, list[float]] = {p: [] for p in PLANS}
        match = True
        decision = None
        for r in range(config.repeats + 1):
            progress.step(f"{gbps:g} GB/s: round {r + 1}")
            for plan in rotated(PLANS, r):
                cache.evict(Medium.DEVICE, 10_000)  # the prefix on disk only
                got = lm.generate(prompt, 1, store=False, strategy=plan)
                match &= got.tokens[0] == cold_token
                if r:
                    ttft[plan].append(got.ttft_s)
                if plan is Strategy.AUTO:
                    decision = got.decision
    med = {p: statistics.median(v) for p, v in ttft.items()}
    ratio = med[Strategy.AUTO] / min(med[Strategy.LOAD], med[Strategy.RECOMPUTE])
    return RateRow(
        gbps=gbps,
        probe=Probe(probe.gbps, probe.latency_s, probe.spread, cpu.gbps),
        ttft_s=med,
        ttft_range_s={p: (min(v), max(v)) for p, v in ttft.items()},
        plan=decision.kind,
        k=decision.compute_tokens,
        predicted_s={Strategy.AUTO: decision.predicted_s, Strategy.LOAD: decision.load_only_s,
                     Strategy.RECOMPUTE: decision.recompute_s},
        ratio=ratio,
        passed=ratio <= config.goal_ratio,
        tokens_match=match,
    )


def _probe_disk(cache: TieredCache, keys: list[bytes]) -> tuple[PathFit, PathFit]:
    """``latency + bytes / bandwidth`` of single-threaded verified reads from the disk tier, on
    the wall clock (the storage's rate) and on the thread's CPU clock (the work a read puts on
    the cores: copying and checksumming, the path "disk read (page cache)")."""
    tier = cache.tier(Medium.DISK)
    layout = cache.layout
    dst = torch.empty(layout.num_layers, layout.layer_bytes, dtype=torch.uint8)

    def read(n: int) -> tuple[float, float]:
        start, cpu = time.perf_counter(), time.thread_time()
        for key in keys[:n]:
            tier.read_into(0, key, dst)  # the file is named by the key: no slot
        return time.perf_counter() - start, time.thread_time() - cpu

    read(1)  # warm-up
    sizes, seconds, cpu_seconds, spread = [], [], [], 0.0
    for n in PROBE_BLOCKS:
        runs = [read(n) for _ in range(3)]
        times = [wall for wall, _ in runs]
        mid = statistics.median(times)
        sizes.append(n * layout.block_bytes)
        seconds.append(mid)
        cpu_seconds.append(max(1e-6, statistics.median(c for _, c in runs)))
        spread = max(spread, (max(times) - min(times)) / 2 / mid)
    return fit_path(sizes, seconds, spread), fit_path(sizes, cpu_seconds)


def _wait_on_disk(cache: TieredCache, tokens: list[int], blocks: int, timeout_s: float = 60.0) -> None:
    """Wait for the write-through of ``tokens``' ``blocks`` blocks to the disk tier (it runs
    behind the store). A device copy stays pinned until it is written down, so emptying the
    device tier drops only the copies already on disk: once it can drop them all, the lookup
    finds every block on disk (and the device tier is empty, as every run below wants it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        cache.evict(Medium.DEVICE, blocks)
        if cache.lookup(tokens).count(Medium.DISK) == blocks:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the prefix did not reach the disk tier in {timeout_s} s")
        time.sleep(0.01)
