"""What a serving run's client saw per request, and the figures of a set of requests (pure: built
from records and the servers' counters). ``bench serve`` reports them per configuration
(:mod:`kvstrata.bench.serve_report`); the serving simulator computes them the same way from
simulated records (:mod:`kvstrata.calibrate.serving.sim`).

Figures. TTFT is the time from sending a request to its first streamed token; TPOT the time
between its first and last token over the tokens after the first; throughput counts requests
and answer tokens over the span from the first request sent to the last answer back. Hit rates
are over the prompt tokens of the configuration's requests: vLLM's own prefix cache from its
``/metrics``, kvstrata's per tier from the connector (:mod:`kvstrata.calibrate.serving.counters`), a
block counting its ``block_tokens``. A completion is identical when its token ids equal those
the reference server (prefix caching off, no connector) gave for the same prompt.

Near-ties. In bf16 or fp16 a greedy choice whose runner-up trails it by less than the rounding of
the logits can flip between a prefill in one piece and one continuing cached KV: vLLM's own prefix
cache flips such ties against the reference as kvstrata's restored KV does, and random weights
make them common. The reference therefore reports, at every position of its answer, how far its
choice led the runner-up (log-probability); a completion that leaves the reference's where that
lead is under the dtype's margin (``bench serve``'s ``TIE_NATS``) is a near-tie, counted apart and
not as differing. Wrong KV moves logits by far more than rounding and shows as differing. In
float32 the margin is 0: only identical answers pass.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvstrata.calibrate.serving.counters import ConnectorCpu, Counters, HitsSource
from kvstrata.calibrate.serving.servers import Instance
from kvstrata.media import Medium
from kvstrata.report import OMIT, OMIT_NONE


@dataclass(frozen=True)
class RequestRecord:
    """One streamed completion as the client saw it.

    Attributes:
        conversation, turn: which turn of which conversation.
        server: the server that answered.
        prompt_tokens: the prompt's tokens.
        output_ids: the answer's token ids.
        ttft_s: sent to first token.
        tpot_s: first to last token over the tokens after the first (None: one token).
        latency_s: sent to the last byte of the answer.
        sent_s: when it was sent, seconds after its phase began.
        identical: its answer equals the reference's for the same prompt (None: not checked).
        near_tie: it is not identical, and left the reference's answer where the reference's
            choice led its runner-up by less than the dtype's rounding (see the module text).
        prompt: the prompt's token ids (kept for the reference, not in the JSON).
        leads: per answer token, how far the server's greedy choice led its runner-up (nats;
            asked of the reference only, not in the JSON).
    """

    conversation: int
    turn: int
    server: Instance
    prompt_tokens: int
    output_ids: tuple[int, ...]
    ttft_s: float
    tpot_s: float | None
    latency_s: float
    sent_s: float
    identical: bool | None = None
    near_tie: bool = False
    prompt: tuple[int, ...] = field(default=(), metadata=OMIT)
    leads: tuple[float, ...] = field(default=(), metadata=OMIT)

    @property
    def done_s(self) -> float:
        return self.sent_s + self.latency_s


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, linearly interpolated between the closest
    ranks (numpy's default); NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class TierHits:
    """kvstrata's hits from one tier: blocks, their tokens, and those over the prompt tokens."""

    blocks: int
    tokens: int
    rate: float


@dataclass(frozen=True)
class Measured:
    """One configuration's figures over a set of requests (see the module text).

    Attributes:
        requests: the requests, each with its prompt_tokens and ttft_s.
        ttft_s: every request's TTFT, in the order sent.
        hits: kvstrata's hits per tier (the tier a block came from); empty without a connector.
        hits_source: where kvstrata's hits were read (/metrics or the connector's stats file).
        vllm_prefix_hit_rate: vLLM's own prefix cache hits over queries (None: not asked).
        identical: no completion differs from the reference's, near-ties apart (None: not checked).
        differing: completions that differ (near-ties apart).
        near_ties: completions that left the reference's at a near-tie (see the module text).
        load_seconds_per_load: kvstrata's own time per load (None: no loads).
        connector_cpu_per_request: the connector's CPU seconds per side over the counters' span,
            over the requests (None, and not in the JSON: not exported, or no requests).
        server_cpu_per_request_s: the server's processes' CPU seconds over the counters' span,
            over the requests (None, and not in the JSON: not read, or no requests). A figure
            the host's noise moves little: what the requests cost, not when they were served.
    """

    requests: tuple[RequestRecord, ...]
    ttft_s: tuple[float, ...]
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    tpot_p50_s: float | None
    wall_s: float
    requests_per_s: float
    output_tokens_per_s: float
    prompt_tokens: int
    output_tokens: int
    hits: dict[Medium, TierHits]
    hit_rate: float
    hits_source: HitsSource
    vllm_prefix_hit_rate: float | None
    identical: bool | None
    differing: int
    load_seconds_per_load: float | None
    connector_cpu_per_request: ConnectorCpu | None = field(default=None, metadata=OMIT_NONE)
    near_ties: int = 0
    server_cpu_per_request_s: float | None = field(default=None, metadata=OMIT_NONE)


def measure(records: Sequence[RequestRecord], counters: Counters, block_tokens: int,
            wall_s: float | None = None) -> Measured:
    """The figures of ``records`` (in the order sent) with the servers' ``counters`` over them;
    ``wall_s``: the time they took (None: from the first sent to the last answer back; records
    of several phases pass the sum of the phases')."""
    records = tuple(records)
    ttft = tuple(r.ttft_s for r in records)
    tpot = [r.tpot_s for r in records if r.tpot_s is not None]
    if wall_s is not None:
        wall = wall_s
    else:
        wall = max(r.done_s for r in records) - min(r.sent_s for r in records) if records else 0.0
    prompt_tokens = sum(r.prompt_tokens for r in records)
    output_tokens = sum(len(r.output_ids) for r in records)
    hits = {m: TierHits(n, n * block_tokens, n * block_tokens / prompt_tokens if prompt_tokens else 0.0)
            for m, n in counters.hit_blocks.items()}
    checked = [r.identical or r.near_tie for r in records if r.identical is not None]
    return Measured(
        records, ttft, percentile(ttft, 50), percentile(ttft, 90), percentile(ttft, 99),
        statistics.median(tpot) if tpot else None, wall,
        len(records) / wall if wall > 0 else 0.0, output_tokens / wall if wall > 0 else 0.0,
        prompt_tokens, output_tokens, hits, sum(h.rate for h in hits.values()), counters.hits_source,
        counters.prefix_hit_rate, all(checked) if checked and len(checked) == len(records) else None,
        sum(1 for c in checked if not c),
        counters.load_seconds / counters.load_requests if counters.load_requests else None,
        counters.connector_cpu.per_request(len(records)) if counters.connector_cpu is not None and records else None,
        sum(1 for r in records if r.near_tie),
        counters.server_cpu_s / len(records) if counters.server_cpu_s is not None and records else None,
    )


def total(counters: Iterable[Counters]) -> Counters:
    out = Counters()
    for c in counters:
        out = out.plus(c)
    return out
