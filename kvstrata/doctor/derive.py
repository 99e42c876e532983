"""Numbers the doctor derives from an observation before judging it: tokens per block, the
prefill rate, each tier's share of the load time and its achieved and predicted restore rates,
and a typical request loaded against computed (the load-or-recompute model of
:mod:`kvstrata.plan.recompute`).

Pure: no I/O, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstrata.doctor.expect import Expectations, PrefillSource
from kvstrata.doctor.findings import Evidence, TierReport
from kvstrata.doctor.observation import ConnectorCounters, Observation, TierCounters, VllmCounters
from kvstrata.media import Medium
from kvstrata.plan.host import GB, PrefillFit
from kvstrata.plan.recompute import PlanKind, choose


@dataclass(frozen=True)
class TierTiming:
    """What a tier's loads took and what computing the same tokens would have taken."""

    seconds_per_block: float  # achieved
    load_only_s: float  # a typical request: load its hit, compute its tail
    recompute_s: float  # the same request computed whole
    tail_s: float  # computing the tail after the hit (in both)
    hit_blocks: int  # the typical hit, in blocks
    break_even_gbps: float | None  # the restore rate at which loading and computing tie
    best: PlanKind  # what load-or-recompute would choose for it
    best_s: float  # and its predicted time
    best_compute_tokens: int  # a split's k

    @property
    def recompute_s_per_block(self) -> float:
        """What computing one block of the hit costs (instead of loading it)."""
        return (self.recompute_s - self.tail_s) / self.hit_blocks


def block_tokens(vllm: VllmCounters | None, conn: ConnectorCounters) -> int | None:
    """Tokens per block: vLLM's block size, else the connector's hit tokens over its loaded blocks."""
    if vllm is not None and vllm.block_tokens:
        return vllm.block_tokens
    if vllm is not None and conn.loaded_blocks > 0 and vllm.external_hits_tokens > 0:
        return max(1, round(vllm.external_hits_tokens / conn.loaded_blocks))
    return None


def prefill_rate(hw: Expectations, vllm: VllmCounters | None, conn: ConnectorCounters) -> tuple[PrefillFit | None, str | None]:
    """The prefill rate to weigh loads against, and its basis ("server" or "profile"), as
    ``hw.prefill_source`` asks (see :class:`PrefillSource`).

    The server's: its prefill seconds less kvstrata's load time (loads run inside the prefill
    step) over the prompt tokens it computed, a rate through the origin. Per-step fixed costs
    count as per-token ones, and so does any part of a load outside kvstrata's own time (the
    copy into vLLM's blocks), so it errs on the side of computing costing more (loading
    looking better): a tier it finds slower than computing is so.
    """
    server = None
    if vllm is not None and vllm.prefill_seconds_hist is not None and vllm.computed_tokens_hist is not None:
        computed = vllm.computed_tokens_hist.total
        compute_s = vllm.prefill_seconds_hist.total - conn.load_seconds
        if computed > 0 and compute_s > 0:
            server = PrefillFit(0.0, computed / compute_s)
    if server is not None and hw.prefill_source is not PrefillSource.PROFILE:
        return server, "server"
    if hw.prefill is not None and hw.prefill_source is not PrefillSource.SERVER:
        return hw.prefill, "profile"
    return None, None


def tier_seconds(conn: ConnectorCounters) -> dict[Medium, float]:
    """Each tier's share of the load time (``load_seconds``, each load's own wall time).

    One tier moved everything: all of it. Several: in proportion to the time its bytes took
    along its legs (``transfer_seconds`` per byte of each leg from the tier to the device),
    else to its bytes. The device tier moves nothing (its blocks are there already): with
    other tiers it gets no share.
    """
    movers = [t for t in conn.tiers if t.loaded_blocks > 0]
    if conn.load_seconds <= 0 or not movers:
        return {}
    if len(movers) == 1:
        return {movers[0].medium: conn.load_seconds}
    weights = {}
    for t in movers:
        if t.medium is Medium.DEVICE:
            continue
        per_byte = _chain_s_per_byte(conn, t.medium)
        weights[t.medium] = t.loaded_bytes * (per_byte if per_byte is not None else 1.0 / GB)
    total = sum(weights.values())
    return {m: conn.load_seconds * w / total for m, w in weights.items()} if total > 0 else {}


def _chain_s_per_byte(conn: ConnectorCounters, medium: Medium) -> float | None:
    """Seconds per byte along the legs from ``medium`` to the device, following each leg's
    destination (disk -> host -> device: both legs); None where a leg is missing."""
    legs = {leg.src: leg for leg in conn.legs if leg.moved_bytes > 0}
    total, at, seen = 0.0, medium, set()
    while at is not Medium.DEVICE:
        leg = legs.get(at)
        if leg is None or at in seen:
            return None
        seen.add(at)
        total += leg.seconds / leg.moved_bytes
        at = leg.dst
    return total


def timings(obs: Observation, conn: ConnectorCounters, block_tokens: int | None, prefill: PrefillFit | None,
             seconds: dict[Medium, float]) -> dict[Medium, TierTiming]:
    """Per tier that loaded (``seconds``: its share of the load time): a typical request's
    load-then-compute against computing it whole, by :func:`kvstrata.plan.recompute.choose`.

    The typical request: the mean prompt, and the mean hit a load brought in (whole blocks,
    at least one). Its load time: the tier's achieved seconds per block, times the hit's blocks.
    """
    if prefill is None or block_tokens is None or conn.loads <= 0 or conn.loaded_blocks <= 0:
        return {}
    prompt = mean_prompt(obs)
    hit_blocks = max(1, round(conn.loaded_blocks / conn.loads))
    hit = hit_blocks * block_tokens
    tail = max(1, round(prompt - hit)) if prompt is not None else block_tokens
    tail_s = prefill.seconds(tail, hit)
    out = {}
    for medium, tier_s in seconds.items():
        tier = conn.tier(medium)
        if tier is None or tier.loaded_blocks <= 0:
            continue
        per_block = tier_s / tier.loaded_blocks
        plan = choose(hit, tail, block_tokens, 1, lambda blocks, s=per_block: blocks * s, prefill)
        saved_compute_s = plan.recompute_s - tail_s  # computing the hit's tokens, which loading spares
        block_bytes = tier.loaded_bytes / tier.loaded_blocks
        break_even = hit_blocks * block_bytes / saved_compute_s / GB if saved_compute_s > 0 else None
        out[medium] = TierTiming(per_block, plan.load_only_s, plan.recompute_s, tail_s, hit_blocks, break_even,
                                  plan.kind, plan.predicted_s, plan.compute_tokens)
    return out


def mean_prompt(obs: Observation) -> float | None:
    if obs.requests:
        return sum(r.prompt_tokens for r in obs.requests) / len(obs.requests)
    v = obs.vllm
    if v is None:
        return None
    if v.prompt_tokens_hist is not None and v.prompt_tokens_hist.mean is not None:
        return v.prompt_tokens_hist.mean
    return v.prompt_tokens / v.requests if v.requests > 0 else None


def tier_report(t: TierCounters, conn: ConnectorCounters, hw: Expectations, seconds: float | None,
                 timing: TierTiming | None) -> TierReport:
    asked = conn.asked_blocks
    fill = t.used_bytes / t.capacity_bytes if t.used_bytes is not None and t.capacity_bytes else None
    achieved = predicted = basis = spec_path = spec_gbps = bottleneck = per_block = recompute_per_block = None
    if seconds is not None and seconds > 0 and t.loaded_bytes > 0:
        achieved = t.loaded_bytes / seconds / GB
        per_block = seconds / t.loaded_blocks
        recompute_per_block = timing.recompute_s_per_block if timing is not None else None
        share = t.loaded_blocks / conn.loaded_blocks if conn.loaded_blocks > 0 else 1.0
        prediction = hw.restore(t.medium, t.loaded_bytes, t.loaded_blocks, max(1.0, conn.loads * share))
        if prediction is not None and prediction.seconds > 0:
            predicted, basis = t.loaded_bytes / prediction.seconds / GB, prediction.basis
    if t.medium is not Medium.DEVICE:
        mean_load = t.loaded_bytes / conn.loads if conn.loads > 0 and t.loaded_bytes > 0 else 64 * 2**20
        spec = hw.spec(t.medium, int(mean_load))
        if spec is not None and spec.available:
            spec_path, spec_gbps, bottleneck = spec.path.short, spec.gbps, spec.bottleneck
    return TierReport(t.medium, t.hit_blocks / asked if asked > 0 else 0.0, t.loaded_blocks, t.loaded_bytes, fill,
                      t.evicted_blocks, achieved, predicted, basis, spec_path, spec_gbps, bottleneck, per_block,
                      recompute_per_block)


def summary(obs: Observation) -> tuple[Evidence, ...]:
    out: list[Evidence] = []
    v, c = obs.vllm, obs.connector
    if v is not None:
        out.append(Evidence("requests", v.requests, "count"))
        out.append(Evidence("prompt_tokens", v.prompt_tokens, "tokens"))
        if v.prefix_queries_tokens > 0:
            out.append(Evidence("vllm_hit_rate", v.prefix_hits_tokens / v.prefix_queries_tokens, "ratio"))
        if v.prompt_tokens > 0:
            out.append(Evidence("connector_token_share", v.external_hits_tokens / v.prompt_tokens, "ratio"))
        if v.kv_cache_tokens:
            out.append(Evidence("vllm_kv_cache_tokens", v.kv_cache_tokens, "tokens"))
    if c is not None and c.asked_blocks > 0:
        out.append(Evidence("kvstrata_hit_rate", c.hit_blocks / c.asked_blocks, "ratio"))
    mean = mean_prompt(obs)
    if mean is not None:
        out.append(Evidence("mean_prompt_tokens", mean, "tokens"))
    if obs.requests:
        ttfts = sorted(r.ttft_s for r in obs.requests)
        out.append(Evidence("ttft_p50_s", ttfts[len(ttfts) // 2], "s"))
        out.append(Evidence("ttft_p90_s", ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))], "s"))
    elif v is not None and v.ttft_hist is not None and v.ttft_hist.count > 0:
        out.append(Evidence("ttft_p50_s", v.ttft_hist.quantile(0.5), "s"))
        out.append(Evidence("ttft_p90_s", v.ttft_hist.quantile(0.9), "s"))
    return tuple(out)
