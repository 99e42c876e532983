"""``kvstrata bench lookup``: hash + lookup of a long prompt against the bare xxh3 chain it is
built on (per block size, through ``PrefixIndex`` and through ``TieredCache.lookup``), and the
lookup with 1M blocks indexed against 1K; the goals judged. Measured by
:mod:`kvstrata.bench.lookup`; serialized by :func:`kvstrata.report.to_json`; drawn by
``kvstrata.bench.cli.lookup``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstrata.bench.cache_report import lookup_goals
from kvstrata.bench.goals import LOOKUP_1M_OF_1K, Goal, LookupFigure
from kvstrata.bench.lookup import IndexScaling, LookupTimes, hash_and_lookup_ms, index_scaling
from kvstrata.rounds import Environment
from kvstrata.progress import NoProgress, Progress
from kvstrata.report import FLATTEN

GOAL_TOKENS = 131_072
GOAL_INDEXED = (1_000, 1_000_000)


@dataclass(frozen=True)
class LookupBenchConfig:
    """What ``kvstrata bench lookup`` measures.

    Attributes:
        tokens: the prompt's length.
        block_sizes: tokens per block, one hash+lookup figure each.
        repeats: timed rounds of each measurement; at least 3.
        small_blocks: blocks indexed in the scaling's small case (at least the prompt's blocks).
        large_blocks: blocks indexed in its large case.
        scaling_block_size: tokens per block of the scaling's prompt.
    """

    tokens: int = 131_072
    block_sizes: tuple[int, ...] = (256, 16)
    repeats: int = 30
    small_blocks: int = 1_000
    large_blocks: int = 1_000_000
    scaling_block_size: int = 256

    def __post_init__(self) -> None:
        if self.repeats < 3:
            raise ValueError(f"bench lookup: repeats must be >= 3 (a median and a spread), got {self.repeats}")
        if not self.block_sizes:
            raise ValueError("bench lookup: block_sizes must name at least one block size")


@dataclass(frozen=True)
class LookupBenchReport:
    config: LookupBenchConfig
    environment: Environment = field(metadata=FLATTEN)
    lookups: dict[int, LookupTimes]  # per block size
    scaling: IndexScaling
    goals: tuple[Goal, ...]
    method: str = ("rounds, the variants' calls alternating one by one in an order rotated per round; a sample = the "
                   "median of a variant's calls in its round; ratio = median over rounds of ours / baseline in the "
                   "same round, with the lowest and highest")


def run_lookup_bench(config: LookupBenchConfig, progress: Progress | None = None) -> LookupBenchReport:
    """Run the benchmark; returns the report, goals judged."""
    progress = progress or NoProgress()
    progress.start(len(config.block_sizes) + 1)
    lookups: dict[int, LookupTimes] = {}
    for block_size in config.block_sizes:
        lookups[block_size] = hash_and_lookup_ms(config.tokens, block_size, config.repeats)
        progress.step(f"hash+lookup, block {block_size}")
    scaling = index_scaling(config.tokens, config.scaling_block_size, config.small_blocks, config.large_blocks,
                            config.repeats)
    progress.step(f"lookup with {config.large_blocks} and {config.small_blocks} blocks indexed")
    # A goal names its case (128K tokens; 1M blocks of 1K): other sizes are measured, not judged.
    goals = [*lookup_goals(lookups)] if config.tokens == GOAL_TOKENS else []
    if (config.small_blocks, config.large_blocks) == GOAL_INDEXED:
        goals.append(Goal(LookupFigure.SCALING, f"<={LOOKUP_1M_OF_1K}x", scaling.lookup.median, LOOKUP_1M_OF_1K,
                          at_most=True))
    return LookupBenchReport(config, Environment.here(), lookups, scaling, tuple(goals))
