"""Why kvstrata does or does not speed a workload up: an observation and the hardware model in,
findings out (:func:`diagnose`).

The questions, in the order a person debugging "no speedup" asks them:

1. Is kvstrata there at all? (no ``kvstrata_connector_`` series: not loaded, or stats off)
2. Is it asked? vLLM looks in its own prefix cache first; a working set that fits there is
   served by vLLM and kvstrata never sees the repeats.
3. What limits its hit rate? Capacity (the last tier is full and evicting: blocks seen before
   were dropped) or reuse (misses with room to spare: the prompts do not repeat a prefix; each
   first sight of a block misses whatever the tiers' size).
4. Do its restores run at the rate the hardware model predicts (the calibrated fit for the
   tier's path, and the spec path's bottleneck link)?
5. Did loading beat computing for the prompts seen? (the load-or-recompute model of
   :mod:`kvstrata.plan.recompute` with the tier's achieved load time and the prefill rate) And
   which tiers' hits did the scheduler itself decline as slower than computing? (nothing to
   change for speed: it computes them)
6. What did failed loads cost? (blocks vLLM computed again)

Each finding carries the one change most likely to help. Pure: no I/O, no torch.
"""

from __future__ import annotations

from kvstrata.doctor import derive
from kvstrata.doctor.derive import TierTiming
from kvstrata.doctor.expect import Expectations
from kvstrata.doctor.findings import (
    Cause,
    Change,
    Diagnosis,
    Evidence,
    Finding,
    Severity,
    Suggestion,
    TierReport,
    Verdict,
)
from kvstrata.doctor.observation import ConnectorCounters, Observation, TierCounters, VllmCounters
from kvstrata.media import Medium
from kvstrata.plan.host import GB, PrefillFit
from kvstrata.plan.recompute import PlanKind

# Misses worth explaining: under this share of the blocks asked, the hit rate is not the story.
MISS_NOTABLE = 0.2
# A tier this full is full: LRU keeps it near its capacity once it has evicted.
FULL = 0.9
# vLLM's own cache "serves the workload" when it found this share of the prompt tokens and
# kvstrata found at most KVSTRATA_MINOR of what vLLM found.
VLLM_SERVES = 0.3
KVSTRATA_MINOR = 0.1
# kvstrata "served nothing" below this share of the blocks it was asked about.
NOTHING_SERVED = 0.02
# A tier's restores are "below prediction" under this fraction of the predicted rate: calibrated
# predictions are validated within 10% (``kvstrata validate``); half is far outside noise.
RATE_SHORTFALL = 0.5
# A tier below its predicted rate that still loads a block this many times faster than computing
# it costs little: the shortfall is worth knowing, not fixing first.
CHEAP_ANYWAY = 2.0
# Failed loads matter more than a warning past this share of the blocks loaded.
FAILURES_SERIOUS = 0.05


def diagnose(obs: Observation, hw: Expectations) -> Diagnosis:
    """The doctor's answer for ``obs`` on the hardware ``hw`` (see the module text)."""
    vllm, conn = obs.vllm, obs.connector
    summary = derive.summary(obs)
    if conn is None:
        findings = [_no_connector(obs)]
        if vllm is not None and (served := _vllm_serves(vllm)) is not None:
            findings.append(served)
        return Diagnosis(obs.source, Verdict.UNKNOWN, _ordered(findings), (), summary)
    if vllm is not None and vllm.prompt_tokens <= 0 and conn.asked_blocks <= 0:
        no_traffic = Finding(Cause.NO_TRAFFIC, Severity.INFO, "No prompts yet", (),
                             "The server has finished no prefill since it started, so there is nothing to judge.",
                             Suggestion(Change.NONE, "Send the workload, then run the doctor again."))
        return Diagnosis(obs.source, Verdict.UNKNOWN, (no_traffic,), (), summary)

    block_tokens = derive.block_tokens(vllm, conn)
    prefill, prefill_basis = derive.prefill_rate(hw, vllm, conn)
    seconds = derive.tier_seconds(conn)
    timings = derive.timings(obs, conn, block_tokens, prefill, seconds)
    tiers = tuple(derive.tier_report(t, conn, hw, seconds.get(t.medium), timings.get(t.medium)) for t in conn.tiers)
    findings: list[Finding] = []
    served = _vllm_serves(vllm) if vllm is not None else None
    if served is not None:
        findings.append(served)
    limit = _limit(conn, tiers, reuse=served is None)
    if limit is not None:
        findings.append(limit)
    slow: list[Medium] = []
    for report in tiers:
        timing = timings.get(report.medium)
        if timing is not None and timing.load_only_s > timing.recompute_s:
            slow.append(report.medium)
            findings.append(_slower_than_recompute(report, timing))
        if report.achieved_gbps is not None and report.predicted_gbps is not None \
                and report.achieved_gbps < RATE_SHORTFALL * report.predicted_gbps:
            findings.append(_below_prediction(report, report.medium in slow))
    findings += [_declined(t) for t in conn.tiers if t.declined_blocks > 0 and t.medium not in slow]
    if conn.load_failed_blocks > 0:
        findings.append(_failures(conn, block_tokens, prefill))
    helped = _helps(obs, conn, tiers, timings, slow)
    if helped is not None:
        findings.append(helped)
    if prefill is not None:  # a rate through the origin, or a fit's marginal rate
        summary += (Evidence("prefill_tokens_per_s", prefill.tokens_per_s, "count"),)
    return Diagnosis(obs.source, _verdict(conn, slow, helped), _ordered(findings), tiers, summary, prefill_basis)


def _no_connector(obs: Observation) -> Finding:
    v = obs.vllm
    if obs.baseline:
        return Finding(
            Cause.NO_CONNECTOR, Severity.INFO, "vLLM alone: the benchmark's baseline", (),
            "The benchmark ran this server without kvstrata's connector, to compare the others with; its numbers "
            "are vLLM's own (its prefix cache, its TTFT).",
            Suggestion(Change.NONE, "Nothing: compare its TTFT with the servers that have the connector."),
        )
    if v is not None and v.external_hits_tokens > 0:  # some connector answered vLLM, silently
        evidence = (Evidence("connector_hit_tokens", v.external_hits_tokens, "tokens"),)
        why = (f"A KV connector served vLLM {v.external_hits_tokens:,.0f} prompt tokens, but this server has no "
               "kvstrata_connector_ series: it is not kvstrata's connector, or one that does not report to "
               "/metrics (log stats off: --disable-log-stats, or a kvstrata from before its metrics). Without "
               "them the doctor cannot say which tier served what, or how fast.")
    else:
        evidence = ()
        where = "This server" if v is not None else f"{obs.source} (no vLLM series either)"
        why = (f"{where} has no kvstrata_connector_ series: the KVStrata connector is not loaded in this vLLM, "
               "or its metrics are off. Nothing here was served by kvstrata, so it cannot have sped anything up.")
    return Finding(
        Cause.NO_CONNECTOR, Severity.PROBLEM, "kvstrata's connector reports nothing",
        evidence, why,
        Suggestion(Change.LOAD_CONNECTOR,
                   "Start vLLM with --kv-transfer-config '{\"kv_connector\": \"KVStrataConnector\", "
                   "\"kv_connector_module_path\": \"kvstrata.integrations.vllm\", \"kv_role\": \"kv_both\"}' "
                   "and without --disable-log-stats (the connector's series travel with vLLM's stats)."),
    )


def _vllm_serves(v: VllmCounters) -> Finding | None:
    """vLLM's own prefix cache found the repeats; kvstrata found (next to) nothing beyond."""
    if v.prompt_tokens <= 0:
        return None
    own = v.prefix_hits_tokens / v.prompt_tokens
    theirs = v.external_hits_tokens
    if own < VLLM_SERVES or theirs > KVSTRATA_MINOR * v.prefix_hits_tokens:
        return None
    room = f" ({v.kv_cache_tokens:,} tokens of KV memory)" if v.kv_cache_tokens else ""
    evidence = [Evidence("vllm_hit_rate", own, "ratio"), Evidence("vllm_hit_tokens", v.prefix_hits_tokens, "tokens"),
                Evidence("connector_hit_tokens", theirs, "tokens")]
    if v.kv_cache_tokens:
        evidence.append(Evidence("vllm_kv_cache_tokens", v.kv_cache_tokens, "tokens"))
    return Finding(
        Cause.VLLM_CACHE_SERVES, Severity.INFO, "vLLM's own prefix cache serves this workload",
        tuple(evidence),
        f"vLLM found {own:.0%} of the prompt tokens in its own prefix cache{room} and asks the connector only "
        f"for what it lacks; kvstrata served {theirs:,.0f} tokens beyond. The repeated prefixes fit in vLLM's "
        "KV memory, so there is nothing for kvstrata to restore: it pays off once they outgrow it.",
        Suggestion(Change.NONE, "Nothing to change in kvstrata: it gains when the repeated prefixes no longer "
                                "fit vLLM's KV memory (more or longer shared prefixes, more users)."),
    )


def _limit(conn: ConnectorCounters, tiers: tuple[TierReport, ...], reuse: bool) -> Finding | None:
    """Capacity or reuse, whichever limits the hit rate (``reuse``: report a reuse limit; not
    where vLLM's own cache took the repeats)."""
    asked = conn.asked_blocks
    if asked <= 0 or conn.miss_blocks / asked < MISS_NOTABLE:
        return None
    hit_rate, miss_rate = conn.hit_blocks / asked, conn.miss_blocks / asked
    last = _last_tier(tiers)
    evidence = [Evidence("kvstrata_hit_rate", hit_rate, "ratio"), Evidence("miss_blocks", conn.miss_blocks, "blocks")]
    if last is not None and last.fill is not None:
        evidence.append(Evidence(f"{last.medium.label}_fill", last.fill, "ratio"))
    if last is not None and last.evicted_blocks is not None:
        evidence.append(Evidence(f"{last.medium.label}_evicted_blocks", last.evicted_blocks, "blocks"))
    full = last is not None and last.fill is not None and last.fill >= FULL \
        and (last.evicted_blocks is None or last.evicted_blocks > 0)
    if full:
        tier = conn.tier(last.medium)
        size = f"{tier.capacity_bytes / GB:.3g} GB" if tier is not None and tier.capacity_bytes else "its size"
        return Finding(
            Cause.CAPACITY_LIMITED, Severity.WARN, f"Hit rate {hit_rate:.0%}: the {last.medium.label} tier is full",
            tuple(evidence),
            f"{miss_rate:.0%} of the blocks asked for were in no tier, while the {last.medium.label} tier (the "
            f"last) is {last.fill:.0%} full and evicting: blocks seen before were dropped for newer ones before they "
            "were asked for again. The working set is larger than the tiers.",
            Suggestion(Change.BIGGER_TIER, f"A bigger {last.medium.label} tier (now {size}), or another tier below it.",
                       last.medium),
            last.medium,
        )
    if not reuse:
        return None
    room = "no tier is full" if last is None or last.fill is None else \
        f"the last tier ({last.medium.label}) is {last.fill:.0%} full"
    if hit_rate < NOTHING_SERVED:
        stored = f" It stored {conn.stored_blocks:,.0f} blocks in {conn.store_seconds:.2f} s for nothing." \
            if conn.stored_blocks > 0 else ""
        evidence.append(Evidence("store_seconds", conn.store_seconds, "s"))
        return Finding(
            Cause.REUSE_LIMITED, Severity.PROBLEM, "No reuse: the prompts share no prefix kvstrata has seen",
            tuple(evidence),
            f"kvstrata found {hit_rate:.0%} of the blocks it was asked for, and {room}: the blocks were not "
            "evicted, they were never asked for again. Each prompt starts with a prefix no earlier prompt had, so "
            f"there is nothing to restore; a bigger tier would not change it.{stored}",
            Suggestion(Change.DISABLE_CONNECTOR, "Run this workload without the connector (it only stores); kvstrata "
                                                 "pays off when prompts repeat a prefix (system prompts, turns)."),
        )
    repeats = 1 / miss_rate
    return Finding(
        Cause.REUSE_LIMITED, Severity.INFO, f"Hit rate {hit_rate:.0%} is what the reuse allows",
        tuple(evidence),
        f"{miss_rate:.0%} of the blocks asked for were in no tier while {room}: those are first sights (a block "
        f"misses once before it can hit). Each prefix came about {repeats:.1f} times; a bigger tier would not "
        "raise the hit rate.",
        Suggestion(Change.NONE, "Nothing in kvstrata: the hit rate grows only with more repeats of the same prefixes."),
    )


def _last_tier(tiers: tuple[TierReport, ...]) -> TierReport | None:
    """The slowest tier with a capacity: where blocks are dropped rather than moved down."""
    with_room = [t for t in tiers if t.fill is not None]
    return max(with_room, key=lambda t: t.medium.value) if with_room else None


def _slower_than_recompute(t: TierReport, timing: TierTiming) -> Finding:
    name = t.medium.label
    evidence = [Evidence("load_only_s", timing.load_only_s, "s"), Evidence("recompute_s", timing.recompute_s, "s"),
                Evidence("hit_blocks", timing.hit_blocks, "blocks")]
    if t.achieved_gbps is not None:
        evidence.append(Evidence("achieved_gbps", t.achieved_gbps, "GB/s"))
    if timing.break_even_gbps is not None:
        evidence.append(Evidence("break_even_gbps", timing.break_even_gbps, "GB/s"))
    rate = f" at {t.achieved_gbps:.3g} GB/s" if t.achieved_gbps is not None else ""
    need = f"; loading wins above {timing.break_even_gbps:.3g} GB/s" if timing.break_even_gbps is not None else ""
    split = ""
    if timing.best is PlanKind.SPLIT:
        split = (f" Load-or-recompute would split it: compute the first {timing.best_compute_tokens} tokens while "
                 f"loading the rest, {timing.best_s * 1e3:.1f} ms.")
    if t.medium in (Medium.DEVICE, Medium.HOST):  # the fastest tiers: nothing to fall back on but a faster copy
        change = Suggestion(Change.FASTER_PATH, f"A faster {name} restore path (the copy into vLLM's blocks); until "
                                                "then, computing is the faster choice.", t.medium)
    else:
        change = Suggestion(Change.DISABLE_TIER, f"Disable the {name} tier (computing is faster than reading it), "
                                                 f"or give it a faster path{need}.", t.medium)
    return Finding(
        Cause.SLOWER_THAN_RECOMPUTE, Severity.PROBLEM, f"Loading from {name} is slower than computing",
        tuple(evidence),
        f"A typical request here loads {timing.hit_blocks} blocks from {name}{rate}: {timing.load_only_s * 1e3:.1f} ms "
        f"to its first token, where computing the whole prompt takes {timing.recompute_s * 1e3:.1f} ms{need}.{split}",
        change, t.medium,
    )


# What makes a tier's restores slower than its path measured, by tier (the explanation's words).
_SLOWER_BECAUSE = {
    Medium.HOST: "the copies share the cores and memory with other work (on a CPU host, the engine's own "
                 "threads), or pay per-restore costs the calibration did not see",
    Medium.DISK: "a slower drive than the one calibrated, a read cap, or other reads on the same drive",
    Medium.REMOTE: "a congested network, a busy pool, or a path staged through host memory",
}
_FASTER = {
    Medium.HOST: "Give host restores the path they were calibrated on: cores not busy with other work, pinned memory",
    Medium.DISK: "Put the disk tier on a drive that delivers the calibrated rate, with nothing else reading it "
                 "and no read cap",
    Medium.REMOTE: "Give pool restores the calibrated path: a NIC and pool not shared with other traffic",
}


def _below_prediction(t: TierReport, slower_than_compute: bool) -> Finding:
    """Achieved well below predicted. PROBLEM where loading from the tier also loses to computing;
    INFO where it still wins by ``CHEAP_ANYWAY`` (the shortfall costs little); else WARN."""
    name = t.medium.label
    evidence = [Evidence("achieved_gbps", t.achieved_gbps, "GB/s"), Evidence("predicted_gbps", t.predicted_gbps, "GB/s")]
    if t.spec_gbps is not None:
        evidence.append(Evidence("spec_gbps", t.spec_gbps, "GB/s"))
    link = f"; the spec path's bottleneck is {t.bottleneck} ({t.spec_gbps:.3g} GB/s)" if t.bottleneck else ""
    cheap = t.seconds_per_block is not None and t.recompute_s_per_block is not None \
        and t.seconds_per_block * CHEAP_ANYWAY <= t.recompute_s_per_block
    severity = Severity.PROBLEM if slower_than_compute else Severity.INFO if cheap else Severity.WARN
    anyway = (f" Loading still beats computing ({t.seconds_per_block * 1e3:.2f} ms a block against "
              f"{t.recompute_s_per_block * 1e3:.2f} ms), so this costs little here.") if cheap else ""
    return Finding(
        Cause.BELOW_PREDICTION, severity,
        f"{name} restores run at {100 * t.achieved_gbps / t.predicted_gbps:.2g}% of the predicted rate",
        tuple(evidence),
        f"Restores from {name} moved {t.loaded_bytes / 1e6:,.1f} MB at {t.achieved_gbps:.3g} GB/s; the "
        f"{t.predicted_basis} model predicts {t.predicted_gbps:.3g} GB/s for the same restores{link}. Likely: "
        f"{_SLOWER_BECAUSE.get(t.medium, 'other work on the same path')}.{anyway}",
        Suggestion(Change.FASTER_PATH, f"{_FASTER.get(t.medium, 'A faster path')} (predicted "
                                       f"{t.predicted_gbps:.3g} GB/s).", t.medium),
        t.medium,
    )


def _declined(t: TierCounters) -> Finding:
    """Hits in a tier the scheduler left to vLLM to compute: its loads measured slower than
    computing (or failed, or ran past their budget). Nothing to change for speed: kvstrata does
    not use the tier while it stays so, and tries it again now and then."""
    name = t.medium.label
    return Finding(
        Cause.DECLINED, Severity.INFO, f"Loading from {name} measured slower than computing: kvstrata computes instead",
        (Evidence("declined_blocks", t.declined_blocks, "blocks"),),
        f"{t.declined_blocks:,.0f} blocks of hits held in {name} were not loaded: the scheduler measured its loads "
        f"slower than computing those tokens (or they failed, or ran past their budget), so vLLM computed them. It "
        f"tries one block again now and then, and uses {name} again once it pays.",
        Suggestion(Change.NONE, f"Nothing, for speed: kvstrata already computes rather than wait on {name}. A faster "
                                f"{name} path would let these hits load.", t.medium),
        t.medium,
    )


def _failures(conn: ConnectorCounters, block_tokens: int | None, prefill: PrefillFit | None) -> Finding:
    share = conn.load_failed_blocks / conn.loaded_blocks if conn.loaded_blocks > 0 else 1.0
    evidence = [Evidence("load_failed_blocks", conn.load_failed_blocks, "blocks"),
                Evidence("recomputed_blocks", conn.recomputed_blocks, "blocks"),
                Evidence("failed_share", share, "ratio")]
    lost = ""
    if prefill is not None and block_tokens is not None and conn.recomputed_blocks > 0:
        lost_s = conn.recomputed_blocks * block_tokens / prefill.tokens_per_s
        evidence.append(Evidence("recompute_lost_s", lost_s, "s"))
        lost = f", about {lost_s:.2f} s of prefill spent computing them again"
    return Finding(
        Cause.LOAD_FAILURES, Severity.PROBLEM if share > FAILURES_SERIOUS else Severity.WARN,
        f"{conn.load_failed_blocks:,.0f} blocks failed to load",
        tuple(evidence),
        f"Loads of {conn.load_failed_blocks:,.0f} blocks failed ({share:.1%} of those loaded) and vLLM computed "
        f"{conn.recomputed_blocks:,.0f} blocks again{lost}, on top of the time the failed loads took.",
        Suggestion(Change.DISABLE_TIER, "Fix or disable the tier whose loads fail (the worker's log and its "
                                        "stats_path's last_failure name it; a pool timing out is the usual one)."),
    )


def _helps(obs: Observation, conn: ConnectorCounters, tiers: tuple[TierReport, ...],
           timings: dict[Medium, TierTiming], slow: list[Medium]) -> Finding | None:
    v = obs.vllm
    if conn.loaded_blocks <= 0 or any(conn.tier(m) is not None and conn.tier(m).loaded_blocks >= 0.5 * conn.loaded_blocks
                                      for m in slow):
        return None
    evidence = [Evidence(f"{t.medium.label}_hit_rate", t.hit_rate, "ratio") for t in tiers if t.hit_rate > 0]
    share = ""
    if v is not None and v.prompt_tokens > 0:
        evidence.append(Evidence("connector_token_share", v.external_hits_tokens / v.prompt_tokens, "ratio"))
        share = f" ({v.external_hits_tokens / v.prompt_tokens:.0%} of all prompt tokens)"
    saved = ""
    if timings and conn.loads > 0:  # each tier's typical gain, weighted by the blocks it served
        weights = {m: conn.tier(m).loaded_blocks for m in timings}
        per_load = sum((timings[m].recompute_s - timings[m].load_only_s) * w for m, w in weights.items()) \
            / (sum(weights.values()) or 1)
        evidence.append(Evidence("saved_s_per_load", per_load, "s"))
        evidence.append(Evidence("saved_s", per_load * conn.loads, "s"))
        saved = f"; each load saved about {per_load * 1e3:.1f} ms of prefill ({per_load * conn.loads:.2f} s in all)"
    per_tier = ", ".join(f"{t.medium.label} {t.hit_rate:.0%}" for t in tiers if t.hit_rate > 0) or "none"
    last = _last_tier(tiers)
    if last is not None and last.fill is not None and last.fill >= FULL and conn.miss_blocks > 0:
        change = Suggestion(Change.BIGGER_TIER, f"A bigger {last.medium.label} tier: it is full, and misses remain.",
                            last.medium)
    else:
        change = Suggestion(Change.NONE, "Nothing: kvstrata serves what repeats, faster than computing it.")
    return Finding(
        Cause.HELPS, Severity.OK, "kvstrata speeds this workload up",
        tuple(evidence),
        f"kvstrata served {conn.loaded_blocks:,.0f} blocks that vLLM's own cache no longer had{share}; hit rate "
        f"by tier: {per_tier}{saved}.",
        change,
    )


def _verdict(conn: ConnectorCounters, slow: list[Medium], helped: Finding | None) -> Verdict:
    if helped is not None:
        return Verdict.HELPS
    if slow:
        return Verdict.HURTS
    return Verdict.NO_GAIN if conn.asked_blocks > 0 or conn.stored_blocks > 0 else Verdict.UNKNOWN


def _ordered(findings: list[Finding]) -> tuple[Finding, ...]:
    return tuple(sorted(findings, key=lambda f: -f.severity.rank))
