"""``bench serve``'s concurrency part: bursts of requests that share one prefix (pure: plans and figures).

Each round, on the kvstrata server, one prompt (the prefix and a suffix) is computed and stored;
then two bursts of ``requests`` prompts, each the prefix and a suffix of its own, all sent at
once: one while only kvstrata holds the prefix (prompts of their own evicted it from vLLM's KV
first), one while vLLM's own prefix cache holds it. The rounds alternate which burst comes
first (kvstrata's first: seed, evict, kvstrata's burst, then vLLM's, which finds the prefix the
first burst loaded; vLLM's first: seed, vLLM's burst, evict, kvstrata's burst).

What it shows: the prefix is loaded once per burst, not once per request (vLLM caches the blocks
it allocates for a load at once, so a request scheduled after the one that loads them finds
them in its own cache), and the burst that loads it from kvstrata gets its first tokens about
as soon as the one that finds it in vLLM: TTFT p90 over the two, per round.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvstrata.rounds import Spread
from kvstrata.calibrate.serving.servers import Instance
from kvstrata.calibrate.serving.workload import ServeWorkload, draw
from kvstrata.bench.serve_report import PhaseRun
from kvstrata.calibrate.serving.measured import Measured, measure, percentile, total

BURST_REQUESTS = 16


class BurstPhase(enum.Enum):
    """A round's phases after its seed (the value: what the progress line says)."""

    FILL = "prompts of their own, evicting the prefix from vLLM"
    FROM_KVSTRATA = "all at once, the prefix in kvstrata only"
    FROM_VLLM = "all at once, the prefix in vLLM's cache"


@dataclass(frozen=True)
class BurstPlan:
    """One round's prompts (token ids).

    Attributes:
        index: the round.
        prefix_tokens: the shared prefix's tokens (whole blocks).
        seed: the prefix and a suffix: computed (and stored) first.
        fillers: prompts of their own, together more than vLLM's KV: they evict the prefix from it.
        from_kvstrata: the burst sent while only kvstrata holds the prefix.
        from_vllm: the burst sent while vLLM's own cache holds it.
        kvstrata_first: kvstrata's burst comes first this round.
    """

    index: int
    prefix_tokens: int
    seed: tuple[int, ...]
    fillers: tuple[tuple[int, ...], ...]
    from_kvstrata: tuple[tuple[int, ...], ...]
    from_vllm: tuple[tuple[int, ...], ...]
    kvstrata_first: bool

    @property
    def order(self) -> tuple[BurstPhase, ...]:
        """The phases after the seed, in the order sent: vLLM's burst finds the prefix that
        kvstrata's loaded, or kvstrata's finds it after the fillers evicted vLLM's."""
        if self.kvstrata_first:
            return BurstPhase.FILL, BurstPhase.FROM_KVSTRATA, BurstPhase.FROM_VLLM
        return BurstPhase.FROM_VLLM, BurstPhase.FILL, BurstPhase.FROM_KVSTRATA

    def prompts(self, phase: BurstPhase) -> tuple[tuple[int, ...], ...]:
        return {BurstPhase.FILL: self.fillers, BurstPhase.FROM_KVSTRATA: self.from_kvstrata,
                BurstPhase.FROM_VLLM: self.from_vllm}[phase]


def plan_bursts(workload: ServeWorkload, vocab: int, rounds: int, vllm_kv_tokens: int,
                requests: int = BURST_REQUESTS) -> tuple[BurstPlan, ...]:
    """Each round's prompts: a prefix of the workload's opening length (at most half of vLLM's
    KV, so a burst's requests fit beside it), suffixes shorter than a block (a request's hit is
    the prefix), and fillers of the opening length that together hold more than vLLM's KV."""
    bt = workload.block_tokens
    opener = max(bt, workload.opener_max_tokens)
    prefix_tokens = max(bt, min(opener, vllm_kv_tokens // 2) // bt * bt)
    suffix = max(1, bt // 2)
    fillers = vllm_kv_tokens // opener + 2

    def tokens(r: int, what: str, count: int) -> tuple[int, ...]:
        return tuple(draw(workload.seed, vocab, -2, f"burst/{r}/{what}", count))

    plans = []
    for r in range(rounds):
        prefix = tokens(r, "prefix", prefix_tokens)
        plans.append(BurstPlan(
            r, prefix_tokens, prefix + tokens(r, "seed", suffix),
            tuple(tokens(r, f"filler/{i}", opener) for i in range(fillers)),
            tuple(prefix + tokens(r, f"kvstrata/{i}", suffix) for i in range(requests)),
            tuple(prefix + tokens(r, f"vllm/{i}", suffix) for i in range(requests)),
            kvstrata_first=r % 2 == 0))
    return tuple(plans)


@dataclass(frozen=True)
class BurstRun:
    """One round as it ran: the two bursts, and the seed and fillers' phases (their answers
    checked against the reference too)."""

    plan: BurstPlan
    from_kvstrata: PhaseRun
    from_vllm: PhaseRun
    others: tuple[PhaseRun, ...]

    def runs(self) -> list[PhaseRun]:
        return [self.from_kvstrata, self.from_vllm, *self.others]


@dataclass(frozen=True)
class Concurrency:
    """The bursts over every round.

    Attributes:
        requests: requests per burst (all sent at once).
        prefix_blocks: the shared prefix's blocks.
        from_kvstrata, from_vllm: every round's bursts, by where the prefix was.
        setup: every round's seed and fillers.
        ttft_p90, ttft_p50: kvstrata's burst over vLLM's, per round then the median.
        loaded_blocks: blocks the connector loaded in kvstrata's bursts, every round's; one
            load per block: ``prefix_blocks`` a round.
        load_requests: the loads (requests kvstrata served KV to) in them.
    """

    requests: int
    prefix_blocks: int
    from_kvstrata: Measured
    from_vllm: Measured
    setup: Measured
    ttft_p90: Spread
    ttft_p50: Spread
    loaded_blocks: int
    load_requests: int

    @property
    def loaded_once(self) -> bool:
        """No block of a burst's prefix was loaded twice."""
        return self.loaded_blocks <= self.prefix_blocks * self.ttft_p90.rounds


def concurrency(runs: Sequence[BurstRun], server: Instance, block_tokens: int) -> Concurrency:
    """The figures of ``runs`` on ``server``, their records already checked against the reference."""

    def pooled(phases: Sequence[PhaseRun]) -> Measured:
        return measure([rec for p in phases for rec in p.records], total(p.counters[server] for p in phases),
                       block_tokens)

    def ratio(q: float) -> Spread:
        values = []
        for r in runs:
            ours, vllm = (percentile([rec.ttft_s for rec in p.records], q) for p in (r.from_kvstrata, r.from_vllm))
            values.append(ours / vllm if vllm > 0 else math.nan)
        return Spread.of(values)

    loads = total(r.from_kvstrata.counters[server] for r in runs)
    return Concurrency(len(runs[0].plan.from_kvstrata), runs[0].plan.prefix_tokens // block_tokens,
                       pooled([r.from_kvstrata for r in runs]), pooled([r.from_vllm for r in runs]),
                       pooled([o for r in runs for o in r.others]), ratio(90), ratio(50),
                       sum(loads.loaded_blocks.values()), loads.load_requests)
