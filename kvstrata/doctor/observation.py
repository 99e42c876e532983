"""What a server was seen doing: kvstrata's connector counters and vLLM's own, as typed numbers.

An :class:`Observation` is what the doctor reasons about. It is built at the edge
(:mod:`kvstrata.doctor.sources`: a ``/metrics`` scrape, a saved dump, a ``bench serve`` report)
and holds totals since the server started, summed over its engines. Counters are floats because
Prometheus carries them as floats; blocks and tokens are whole numbers all the same.

Pure data: no I/O, no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvstrata.media import Medium


@dataclass(frozen=True)
class Histogram:
    """A Prometheus histogram: cumulative counts per upper bound (the last bound ``inf``).

    Attributes:
        buckets: ``(upper bound, observations <= it)``, bounds ascending.
        count: observations.
        total: their sum.
    """

    buckets: tuple[tuple[float, float], ...]
    count: float
    total: float

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count > 0 else None

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile as Prometheus' ``histogram_quantile`` estimates it: linear within
        the bucket it falls in (from 0 for the first bucket); in the ``inf`` bucket, the highest
        finite bound. None without observations."""
        if not 0 <= q <= 1:
            raise ValueError(f"quantile must be in [0, 1], got {q}")
        if self.count <= 0 or not self.buckets:
            return None
        rank = q * self.count
        lower, below = 0.0, 0.0
        for upper, cumulative in self.buckets:
            if cumulative >= rank:
                if math.isinf(upper):
                    return lower
                inside = cumulative - below
                return upper if inside <= 0 else lower + (upper - lower) * (rank - below) / inside
            lower, below = upper, cumulative
        return lower


@dataclass(frozen=True)
class TierCounters:
    """One kvstrata tier's counters (its Medium label on the ``tier`` label).

    Attributes:
        medium: the tier.
        hit_blocks: blocks a lookup found with this tier their fastest copy.
        loaded_blocks, loaded_bytes: blocks and bytes loaded from this tier.
        evicted_blocks: blocks evicted from it; None where the connector does not report them.
        used_bytes, capacity_bytes: its fill now; None where not reported.
        declined_blocks: blocks of hits held here that the scheduler did not load, loading them
            measured slower than computing them (vLLM computed them).
    """

    medium: Medium
    hit_blocks: float = 0.0
    loaded_blocks: float = 0.0
    loaded_bytes: float = 0.0
    evicted_blocks: float | None = None
    used_bytes: float | None = None
    capacity_bytes: float | None = None
    declined_blocks: float = 0.0


@dataclass(frozen=True)
class Leg:
    """Bytes moved between two media and the transfers' seconds (``moved_bytes_total`` and
    ``transfer_seconds_total`` of one ``{src, dst}``)."""

    src: Medium
    dst: Medium
    moved_bytes: float
    seconds: float


@dataclass(frozen=True)
class ConnectorCounters:
    """kvstrata's connector on one server, summed over its engines.

    Attributes:
        tiers: per tier its counters, fastest first.
        legs: per route leg, bytes and seconds.
        miss_blocks: blocks a lookup asked for and no tier held.
        loads, load_seconds: loads and their own time (planning and moving), summed.
        stored_blocks, store_seconds: new blocks stored (not held before) and the time storing took.
        load_failed_blocks: blocks whose load failed.
        recomputed_blocks: blocks vLLM computed again after a failed load.
    """

    tiers: tuple[TierCounters, ...] = ()
    legs: tuple[Leg, ...] = ()
    miss_blocks: float = 0.0
    loads: float = 0.0
    load_seconds: float = 0.0
    stored_blocks: float = 0.0
    store_seconds: float = 0.0
    load_failed_blocks: float = 0.0
    recomputed_blocks: float = 0.0

    def tier(self, medium: Medium) -> TierCounters | None:
        return next((t for t in self.tiers if t.medium is medium), None)

    @property
    def hit_blocks(self) -> float:
        return sum(t.hit_blocks for t in self.tiers)

    @property
    def asked_blocks(self) -> float:
        """Blocks lookups asked about: hits in any tier plus misses."""
        return self.hit_blocks + self.miss_blocks

    @property
    def loaded_blocks(self) -> float:
        return sum(t.loaded_blocks for t in self.tiers)


@dataclass(frozen=True)
class VllmCounters:
    """vLLM's own view of the same requests (tokens, summed over engines).

    Attributes:
        requests: finished prefills (``request_prompt_tokens``' count).
        prompt_tokens: prompt tokens of all requests.
        prefix_queries_tokens, prefix_hits_tokens: vLLM's own prefix cache: tokens asked, found.
        external_queries_tokens, external_hits_tokens: the same asked of the KV connector.
        block_tokens: tokens per vLLM block (``cache_config_info``); None: not reported.
        kv_cache_tokens: vLLM's own KV memory in tokens; None: not reported.
        prompt_tokens_hist: prompt lengths.
        computed_tokens_hist: prompt tokens computed per request (cached ones excluded).
        prefill_seconds_hist: per request, seconds in prefill.
        ttft_hist: per request, seconds to the first token.
    """

    requests: float = 0.0
    prompt_tokens: float = 0.0
    prefix_queries_tokens: float = 0.0
    prefix_hits_tokens: float = 0.0
    external_queries_tokens: float = 0.0
    external_hits_tokens: float = 0.0
    block_tokens: int | None = None
    kv_cache_tokens: int | None = None
    prompt_tokens_hist: Histogram | None = None
    computed_tokens_hist: Histogram | None = None
    prefill_seconds_hist: Histogram | None = None
    ttft_hist: Histogram | None = None


@dataclass(frozen=True)
class RequestSample:
    """One request as a client measured it (from a ``bench serve`` report)."""

    prompt_tokens: int
    ttft_s: float


@dataclass(frozen=True)
class Observation:
    """Everything seen of one server (or one benchmark configuration).

    Attributes:
        source: where it came from (a URL, a file, a configuration's name), for the report.
        model: vLLM's model name (its ``model_name`` label); None: not reported.
        vllm: vLLM's own counters; None: no ``vllm:`` series at all.
        connector: kvstrata's; None: no ``kvstrata_connector_`` series (the connector is not
            loaded there, or reports nothing).
        requests: per request, what a client measured (empty from a ``/metrics`` scrape).
        baseline: a benchmark ran this server without the connector on purpose, to compare
            the others with (a report where other servers have the connector's series).
    """

    source: str
    model: str | None = None
    vllm: VllmCounters | None = None
    connector: ConnectorCounters | None = None
    requests: tuple[RequestSample, ...] = field(default_factory=tuple)
    baseline: bool = False
