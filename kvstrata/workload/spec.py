"""The workload: conversations whose turns share growing prefixes.

Each turn's prompt is the conversation so far: a system prompt shared by several
conversations, earlier user turns and the model's earlier answers, then a new user turn.
Texts are seeded random words from a small vocabulary, so a run is repeatable and its
prompts tokenize to about the lengths asked for.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

from kvstrata.media import Medium

TIERS: tuple[Medium, ...] = tuple(Medium)  # the tiers a workload runs through by default, fastest first
ALONE_REPEATS = 3  # restores alone per turn, after a warm-up: their median is reported

_WORDS = (
    "cache block restore path prefix hit layer token memory device host disk pool network link "
    "switch plan answer question system user assistant turn tool agent result bandwidth latency"
).split()


@dataclass(frozen=True)
class Workload:
    """How many conversations of how many turns, and how long each part is.

    Attributes:
        conversations: conversations run one after another.
        turns: user turns per conversation.
        system_prompts: distinct system prompts; conversation ``i`` uses ``i % system_prompts``.
        system_words: words per system prompt.
        user_words: words per user turn.
        answer_tokens: tokens the model answers each turn with (greedy).
        block_tokens: tokens per cached block.
        seed: of the words drawn.
    """

    conversations: int = 4
    turns: int = 3
    system_prompts: int = 2
    system_words: int = 600
    user_words: int = 150
    answer_tokens: int = 16
    block_tokens: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if name != "seed" and (not isinstance(value, int) or value < 1):
                raise ValueError(f"workload {name} must be a positive integer, got {value!r}")

    @property
    def turns_total(self) -> int:
        return self.conversations * self.turns

    def capacity_blocks(self) -> int:
        """Blocks each tier is sized for: every conversation's text twice over, four times."""
        words = self.system_words + self.turns * (self.user_words + self.answer_tokens)
        return 4 * self.conversations * (words * 2 // self.block_tokens + 2)


class Texts:
    """The workload's texts, drawn in order from one seeded generator."""

    def __init__(self, workload: Workload) -> None:
        self._workload = workload
        self._rng = random.Random(workload.seed)
        self.systems = [self._words(workload.system_words) for _ in range(workload.system_prompts)]

    def system(self, conversation: int) -> str:
        return self.systems[conversation % self._workload.system_prompts]

    def user_turn(self) -> str:
        return " " + self._words(self._workload.user_words)

    def _words(self, count: int) -> str:
        return " ".join(self._rng.choice(_WORDS) for _ in range(count))
