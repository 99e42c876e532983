"""End to end on a real model: a multi-turn workload through each tier, cold vs warm.

The workload: conversations whose turns share growing prefixes (each turn's prompt is the
conversation so far: a system prompt shared by several conversations, earlier user turns and
the model's earlier answers, then a new user turn). Per tier, each turn runs twice on a
transformers model (:class:`~kvstrata.integrations.hf.KVStrataLM`):

* cold: the whole prompt computed, nothing reused;
* warm: the longest cached prefix restored from kvstrata, the rest computed; then prompt and
  answer stored for later turns. After each store every tier above the one under test is
  emptied, so each warm restore comes from that tier (``device``: stays on the device).

Reported per tier: TTFT cold and warm (medians over turns), hit rate (reused / prompt tokens),
bytes restored, restore seconds and GB/s (the loads' own timing, while the model computes
beside them; and the same restores again alone, which is what the prediction describes), whether every warm run's
tokens equal the cold run's, and the routes the blocks took. Beside the measured restore time,
the prediction for this host of :meth:`kvstrata.plan.host.HostCalibration.restore_s` for every
load (its bytes and blocks), from a ``kvstrata calibrate`` profile or, by default, a quick
calibration at the workload's sizes run first - the seed's rule: estimate latency from measured
effective bandwidth (and, at these small sizes, measured fixed costs).
"""

from __future__ import annotations

import random
import statistics
import tempfile
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvstrata.cache import CacheConfig, TieredCache
from kvstrata.errors import TierUnavailable
from kvstrata.index.prefix import Match
from kvstrata.media import Medium, route_text
from kvstrata.plan.host import HostCalibration
from kvstrata.pool.config import PoolConfig

TIERS = ("device", "host", "disk", "remote")
_ABOVE = {
    "device": (),
    "host": (Medium.DEVICE,),
    "disk": (Medium.DEVICE, Medium.HOST),
    "remote": (Medium.DEVICE, Medium.HOST, Medium.DISK),
}
_WORDS = (
    "cache block restore path prefix hit layer token memory device host disk pool network link "
    "switch plan answer question system user assistant turn tool agent result bandwidth latency"
).split()


@dataclass(frozen=True)
class Workload:
    conversations: int = 4
    turns: int = 3
    system_prompts: int = 2  # conversation i uses system prompt i % system_prompts
    system_words: int = 600
    user_words: int = 150
    answer_tokens: int = 16
    block_tokens: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if name != "seed" and (not isinstance(value, int) or value < 1):
                raise ValueError(f"workload {name} must be a positive integer, got {value!r}")


@dataclass
class TierReport:
    tier: str
    turns: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    restored_bytes: int = 0
    restore_s: float = 0.0
    loads: int = 0
    restore_alone_s: float = 0.0  # the same restores again with nothing else running
    load_sizes: list[tuple[int, int]] = field(default_factory=list)  # (bytes, blocks) per restore
    ttft_cold: list[float] = field(default_factory=list)
    ttft_warm: list[float] = field(default_factory=list)
    tokens_identical: bool = True
    paths: Counter = field(default_factory=Counter)
    predicted_restore_s: float | None = None  # the calibrated model's, summed over the loads
    skipped: str | None = None
    prompts: list[list[int]] = field(default_factory=list)  # every turn's prompt, in order
    # Host tier only: the last turn again in per-step DRAM streaming decode.
    stream_bytes_per_step: float | None = None
    stream_tokens_identical: bool | None = None

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def restore_gbps(self) -> float:
        return self.restored_bytes / self.restore_s / 1e9 if self.restore_s > 0 else 0.0

    def to_json(self) -> dict:
        med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
        return {
            "tier": self.tier,
            "skipped": self.skipped,
            "turns": self.turns,
            "ttft_cold_s": med(self.ttft_cold),
            "ttft_warm_s": med(self.ttft_warm),
            "hit_rate": self.hit_rate,
            "hit_tokens": self.hit_tokens,
            "restored_bytes": self.restored_bytes,
            "restore_s": self.restore_s,
            "restore_alone_s": self.restore_alone_s,
            "restore_gbps": self.restore_gbps,
            "predicted_restore_s": self.predicted_restore_s,
            "tokens_identical": self.tokens_identical,
            "paths": {route_text(r): n for r, n in self.paths.items()},
            "stream_bytes_per_step": self.stream_bytes_per_step,
            "stream_tokens_identical": self.stream_tokens_identical,
        }


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def run_tier(
    model: Any,
    tokenizer: Any,
    tier: str,
    workload: Workload,
    work_dir: Path,
    pool: PoolConfig | None = None,
    on_turn: Callable[[], None] | None = None,
) -> TierReport:
    """The workload through one tier (see the module text)."""
    from kvstrata.integrations.hf import KVStrataLM, model_layout

    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}: expected one of {', '.join(TIERS)}")
    report = TierReport(tier)
    if tier == "remote" and pool is None:
        report.skipped = "no pool (start one with `kvstrata pool start`, or install mooncake)"
        return report
    layout = model_layout(model.config, workload.block_tokens, next(model.parameters()).dtype)
    blocks = 4 * workload.conversations * (
        (workload.system_words + workload.turns * (workload.user_words + workload.answer_tokens)) * 2 // workload.block_tokens + 2
    )
    config = CacheConfig(
        layout,
        f"e2e-{uuid.uuid4().hex[:8]}",  # a fresh namespace: a shared pool may hold older runs
        device_bytes=blocks * layout.block_bytes,
        host_bytes=blocks * layout.block_bytes if tier != "device" else 0,
        disk_bytes=blocks * layout.block_bytes if tier in ("disk", "remote") else 0,
        disk_dir=work_dir / f"disk-{tier}" if tier in ("disk", "remote") else None,
        pool=pool if tier == "remote" else None,
        remote_bytes=blocks * layout.block_bytes if tier == "remote" else 0,
    )
    rng = random.Random(workload.seed)
    systems = [_text(rng, workload.system_words) for _ in range(workload.system_prompts)]
    with TieredCache(config) as cache:
        lm = KVStrataLM(model, cache)
        for c in range(workload.conversations):
            history = tokenizer(systems[c % workload.system_prompts]).input_ids
            for _ in range(workload.turns):
                prompt = history + tokenizer(" " + _text(rng, workload.user_words)).input_ids
                warm = lm.generate(prompt, workload.answer_tokens)
                cold = lm.generate(prompt, workload.answer_tokens, reuse=False, store=False)
                for medium in _ABOVE[tier]:
                    cache.evict(medium, 1 << 30)
                report.turns += 1
                report.prompts.append(prompt)
                report.prompt_tokens += len(prompt)
                report.hit_tokens += warm.hit_tokens
                report.ttft_cold.append(cold.ttft_s)
                report.ttft_warm.append(warm.ttft_s)
                report.tokens_identical &= warm.tokens == cold.tokens
                if warm.load is not None:
                    report.restored_bytes += warm.load.restored_bytes
                    report.restore_s += warm.load.seconds
                    report.restore_alone_s += _restore_alone(cache, prompt, warm.load.blocks, tier)
                    report.loads += 1
                    report.load_sizes.append((warm.load.restored_bytes, sum(warm.load.paths.values())))
                    report.paths.update(warm.load.paths)
                history = prompt + warm.tokens
                if on_turn is not None:
                    on_turn()
        if tier == "host" and report.prompts:
            # KV on the host, each layer fetched to the device just before it runs, every step.
            streamed = lm.generate(report.prompts[-1], workload.answer_tokens, store=False, streaming=True)
            report.stream_bytes_per_step = streamed.stream_bytes_per_step
            report.stream_tokens_identical = streamed.tokens == warm.tokens
    return report


def _restore_alone(cache: TieredCache, prompt: list[int], blocks: int, tier: str) -> float:
    """Seconds of the turn's restore repeated with no model computing beside it (during a
    prefill, on a CPU-only host, the model's threads and the copies share the cores)."""
    match = cache.lookup(prompt[:-1])
    if match.blocks < blocks:
        return 0.0
    handle = cache.load(Match(match.keys[:blocks], match.media[:blocks], match.block_size, match.total_blocks))
    try:
        seconds = handle.wait().seconds
    finally:
        handle.release()
    for medium in _ABOVE[tier]:
        cache.evict(medium, 1 << 30)
    return seconds


def run_e2e(
    model_dir: str | Path,
    workload: Workload = Workload(),
    tiers: tuple[str, ...] = TIERS,
    pool: PoolConfig | None = None,
    on_turn: Callable[[str], None] | None = None,
    calibration: HostCalibration | None = None,
) -> list[TierReport]:
    """Every tier's report, each with the prediction of ``calibration`` (a profile from
    ``kvstrata calibrate``; None: a quick calibration of this host, run first)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    reports = []
    with tempfile.TemporaryDirectory(prefix="kvstrata-e2e-") as tmp:
        work = Path(tmp)
        if calibration is None:
            calibration = quick_calibration(_block_bytes(model, workload), work, pool)
        for tier in tiers:
            try:
                report = run_tier(model, tokenizer, tier, workload, work, pool, (lambda t=tier: on_turn(t)) if on_turn else None)
            except TierUnavailable as exc:  # the pool went away: say so, the other tiers still run
                report = TierReport(tier, skipped=f"unavailable: {exc}")
            if report.skipped is None:
                report.predicted_restore_s = _calibrated(calibration, tier, report.load_sizes)
            reports.append(report)
    return reports


def quick_calibration(block_bytes: int, work_dir: Path, pool: PoolConfig | None) -> HostCalibration:
    """This host's paths at the workload's sizes (a few blocks per restore): a few seconds."""
    from kvstrata.calibrate.measure import CalibrateConfig, calibrate

    sizes = tuple(block_bytes * n for n in (1, 2, 4, 8, 16))
    config = CalibrateConfig(sizes=sizes, repeats=3, threads=CacheConfig.workers, directory=str(work_dir),
                             pool=pool, object_bytes=block_bytes)
    return calibrate(config).calibration


def _calibrated(calibration: HostCalibration, tier: str, loads: list[tuple[int, int]]) -> float | None:
    """Sum of the calibrated restore predictions of every load (None: a path not calibrated)."""
    if tier == "device":
        return 0.0
    try:
        return sum(calibration.restore_s(tier, nbytes, blocks, workers=CacheConfig.workers) for nbytes, blocks in loads)
    except KeyError:
        return None


def _block_bytes(model: Any, workload: Workload) -> int:
    from kvstrata.integrations.hf import model_layout

    return model_layout(model.config, workload.block_tokens, next(model.parameters()).dtype).block_bytes

