"""The workload (:mod:`kvstrata.workload.spec`) through each tier of a real model's cache, cold vs warm.

Per tier, each turn runs twice on a transformers model (:class:`~kvstrata.integrations.hf.KVStrataLM`):

* cold: the whole prompt computed, nothing reused;
* warm: the longest cached prefix restored from kvstrata, the rest computed; then prompt and
  answer stored for later turns. After each store every tier above the one under test is
  emptied, so each warm restore comes from that tier (``device``: stays on the device).

Reported per tier (:class:`~kvstrata.workload.report.TierReport`): TTFT cold and warm (medians
over turns), hit rate (reused / prompt tokens), bytes restored, restore seconds and GB/s (the
loads' own timing, while the model computes beside them; and the same restores again alone,
the median of a few after a warm-up, which is what the prediction describes), whether every warm run's tokens equal the cold run's,
and the routes the blocks took. Beside the measured restore time, the prediction for this host
of :meth:`kvstrata.plan.host.HostCalibration.restore_s` for every load (its bytes and blocks),
from a ``kvstrata calibrate`` profile or, by default, a quick calibration at the workload's
sizes run first - the seed's rule: estimate latency from measured effective bandwidth (and, at
these small sizes, measured fixed costs).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvstrata.extras import pip_command
from kvstrata.cache import CacheConfig, TieredCache
from kvstrata.errors import TierUnavailable
from kvstrata.index.prefix import Match
from kvstrata.media import Medium
from kvstrata.plan.calpaths import CalPath
from kvstrata.plan.host import HostCalibration
from kvstrata.pool.config import PoolConfig
from kvstrata.workload.report import Tally, TierReport, TurnFigures, WorkloadReport
from kvstrata.workload.spec import ALONE_REPEATS, TIERS, Texts, Workload

NO_POOL = f"no pool (start one with `kvstrata pool start`; the pool engine: {pip_command('mooncake')})"


def _above(tier: Medium) -> tuple[Medium, ...]:
    """The tiers emptied after every store, so that a warm restore comes from ``tier``."""
    return tuple(m for m in Medium if m.value < tier.value)


def _cache_config(tier: Medium, workload: Workload, layout: Any, work_dir: Path, pool: PoolConfig | None) -> CacheConfig:
    """A cache with every tier down to ``tier``, each sized for the whole workload."""
    size = workload.capacity_blocks() * layout.block_bytes
    on_disk = tier.value >= Medium.DISK.value
    return CacheConfig(
        layout,
        f"e2e-{uuid.uuid4().hex[:8]}",  # a fresh namespace: a shared pool may hold older runs
        device_bytes=size,
        host_bytes=size if tier is not Medium.DEVICE else 0,
        disk_bytes=size if on_disk else 0,
        disk_dir=work_dir / f"disk-{tier.label}" if on_disk else None,
        pool=pool if tier is Medium.REMOTE else None,
        remote_bytes=size if tier is Medium.REMOTE else 0,
    )


# A turn of another system on the same prompt, run beside ours: (tier, turn index, prompt).
Beside = Callable[[Medium, int, list[int]], None]


def run_tier(
    model: Any,
    tokenizer: Any,
    tier: Medium,
    workload: Workload,
    work_dir: Path,
    pool: PoolConfig | None = None,
    on_turn: Callable[[], None] | None = None,
    beside: Beside | None = None,
) -> TierReport:
    """The workload through one tier (see the module text); not yet predicted.

    ``beside`` (a benchmark's): each turn, plain transformers' cold TTFT on the same prompt is
    timed next to ours, and ``beside`` runs another system's turn next to our warm one, the
    order alternating from turn to turn, so both sides of each ratio share the machine's noise.
    """
    from kvstrata.integrations.hf import KVStrataLM, model_layout
    from kvstrata.integrations.hf.generate import plain_ttft

    if not isinstance(tier, Medium):
        raise ValueError(f"tier must be a Medium, got {tier!r}")
    if tier is Medium.REMOTE and pool is None:
        return TierReport(tier, skipped=NO_POOL)
    layout = model_layout(model.config, workload.block_tokens, next(model.parameters()).dtype)
    tally = Tally(tier)
    texts = Texts(workload)
    with TieredCache(_cache_config(tier, workload, layout, work_dir, pool)) as cache:
        lm = KVStrataLM(model, cache)
        for c in range(workload.conversations):
            history = tokenizer(texts.system(c)).input_ids
            for _ in range(workload.turns):
                prompt = history + tokenizer(texts.user_turn()).input_ids
                index = len(tally.prompts)
                ours_first = not index % 2  # the order alternates: neither side always goes first
                theirs = (lambda: beside(tier, index, prompt)) if beside is not None else None
                plain: list[float] = []

                def ours() -> tuple[Any, Any]:
                    # Cold, then warm, as the side beside it runs its turn: each warm run follows
                    # a prefill of its own process, none follows a pause.
                    cold = _next_to(ours_first, lambda: lm.generate(prompt, workload.answer_tokens, reuse=False,
                                                                    store=False),
                                    (lambda: plain.append(plain_ttft(model, prompt))) if beside is not None else None)
                    return cold, lm.generate(prompt, workload.answer_tokens)

                cold, warm = _next_to(ours_first, ours, theirs)
                tally.per_turn.append(TurnFigures(len(prompt), warm.hit_tokens, cold.ttft_s, warm.ttft_s,
                                                  plain[0] if plain else None))
                for medium in _above(tier):
                    cache.evict(medium, 1 << 30)
                tally.prompts.append(prompt)
                tally.prompt_tokens += len(prompt)
                tally.hit_tokens += warm.hit_tokens
                tally.ttft_cold.append(cold.ttft_s)
                tally.ttft_warm.append(warm.ttft_s)
                tally.tokens_identical &= warm.tokens == cold.tokens
                if warm.load is not None:
                    tally.restored_bytes += warm.load.restored_bytes
                    tally.restore_s += warm.load.seconds
                    tally.restore_alone_s += _restore_alone(cache, prompt, warm.load.blocks, tier)
                    tally.load_sizes.append((warm.load.restored_bytes, sum(warm.load.paths.values())))
                    tally.paths.update(warm.load.paths)
                history = prompt + warm.tokens
                if on_turn is not None:
                    on_turn()
        if tier is Medium.HOST and tally.prompts:
            # KV on the host, each layer fetched to the device just before it runs, every step.
            streamed = lm.generate(tally.prompts[-1], workload.answer_tokens, store=False, streaming=True)
            tally.stream_bytes_per_step = streamed.stream_bytes_per_step
            tally.stream_tokens_identical = streamed.tokens == warm.tokens
    return tally.report()


def _next_to(ours_first: bool, ours: Callable[[], Any], other: Callable[[], None] | None) -> Any:
    """``ours()`` and ``other()`` (if any) back to back, ours first or second; ours' result."""
    if other is not None and not ours_first:
        other()
    result = ours()
    if other is not None and ours_first:
        other()
    return result


def _restore_alone(cache: TieredCache, prompt: list[int], blocks: int, tier: Medium) -> float:
    """Seconds of the turn's restore repeated with no model computing beside it (during a
    prefill, on a CPU-only host, the model's threads and the copies share the cores): the
    median of ALONE_REPEATS after a warm-up, as the calibration measures its paths (the first
    restore after a prefill ran 1.5-3x slower on a 2-core VM: caches and threads cold)."""
    match = cache.lookup(prompt[:-1])
    if match.blocks < blocks:
        return 0.0
    runs = []
    for _ in range(1 + ALONE_REPEATS):
        handle = cache.load(Match(match.keys[:blocks], match.media[:blocks], match.block_size, match.total_blocks))
        try:
            runs.append(handle.wait().seconds)
        finally:
            handle.release()
        for medium in _above(tier):
            cache.evict(medium, 1 << 30)
    return statistics.median(runs[1:])


def run_e2e(
    model_dir: str | Path,
    workload: Workload = Workload(),
    tiers: tuple[Medium, ...] = TIERS,
    pool: PoolConfig | None = None,
    on_turn: Callable[[Medium], None] | None = None,
    calibration: HostCalibration | None = None,
    beside: Beside | None = None,
) -> WorkloadReport:
    """Every tier's report, each with the prediction of ``calibration`` (a profile from
    ``kvstrata calibrate``; None: a quick calibration of this host, run first); ``beside``: see
    :func:`run_tier`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    load_average = os.getloadavg()[0] if hasattr(os, "getloadavg") else None  # before ours adds to it
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    reports: dict[Medium, TierReport] = {}
    with tempfile.TemporaryDirectory(prefix="kvstrata-e2e-") as tmp:
        work = Path(tmp)
        if calibration is None:
            calibration = quick_calibration(_block_bytes(model, workload), work, pool)
        for tier in tiers:
            try:
                report = run_tier(model, tokenizer, tier, workload, work, pool, (lambda t=tier: on_turn(t)) if on_turn else None,
                                  beside)
            except TierUnavailable as exc:  # the pool went away: say so, the other tiers still run
                report = TierReport(tier, skipped=f"unavailable: {exc}")
            if report.skipped is None:
                report = dataclasses.replace(report, predicted_restore_s=_calibrated(calibration, tier, report.load_sizes))
            reports[tier] = report
    pool_get = calibration.paths.get(CalPath.POOL_GET)
    return WorkloadReport(Path(model_dir), workload, reports, load_average, os.cpu_count(),
                          pool_gbps=pool_get.gbps if pool_get is not None else None)


def quick_calibration(block_bytes: int, work_dir: Path, pool: PoolConfig | None) -> HostCalibration:
    """This host's paths at the workload's sizes (a few blocks per restore): a few seconds."""
    from kvstrata.calibrate.measure import CalibrateConfig, calibrate

    sizes = tuple(block_bytes * n for n in (1, 2, 4, 8, 16))
    config = CalibrateConfig(sizes=sizes, repeats=3, threads=CacheConfig.workers, directory=str(work_dir),
                             pool=pool, object_bytes=block_bytes)
    return calibrate(config).calibration


def _calibrated(calibration: HostCalibration, tier: Medium, loads: tuple[tuple[int, int], ...]) -> float | None:
    """Sum of the calibrated restore predictions of every load (None: a path not calibrated)."""
    if tier is Medium.DEVICE:
        return 0.0
    try:
        return sum(calibration.restore_s(tier, nbytes, blocks, workers=CacheConfig.workers) for nbytes, blocks in loads)
    except KeyError:
        return None


def _block_bytes(model: Any, workload: Workload) -> int:
    from kvstrata.integrations.hf import model_layout

    return model_layout(model.config, workload.block_tokens, next(model.parameters()).dtype).block_bytes
