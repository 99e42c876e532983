"""A seeded generator of Mooncake-format traces with the prefix reuse of real serving.

Three kinds of traffic, mixed by weight:

* chat: multi-turn sessions; each turn's prompt is the previous turn's prompt, its answer and a
  new user message, so it extends the previous turn's blocks.
* system: single-turn requests whose prompts start with one of a few system prompts shared across
  users (popularity skewed, 1/rank), followed by the user's own text.
* agent: loops over one long prefix (tools, documents) with short steps appended each iteration.

Arrivals are Poisson at ``rate`` requests per second. Everything draws from one
``random.Random(seed)``, so a seed fixes the trace.

Ids follow the chained convention: a continuing request reuses the ids of its predecessor's *full*
blocks only; the predecessor's partial last block changes when text is appended, so it, and every
block after it, gets a fresh id.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass, field

from kvstrata.sim.trace import BLOCK_TOKENS, Request, max_blocks


class TraceKind(enum.Enum):
    CHAT = "chat"
    SYSTEM = "system"
    AGENT = "agent"
    MIX = "mix"


@dataclass(frozen=True)
class Mix:
    """Relative weights of the traffic kinds; at least one positive."""

    chat: float = 0.4
    system: float = 0.3
    agent: float = 0.3

    def __post_init__(self) -> None:
        weights = (self.chat, self.system, self.agent)
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(
                f"mix weights must be non-negative with a positive sum, got {weights}"
            )

    @classmethod
    def of(cls, kind: TraceKind) -> Mix:
        """The mix for one kind alone, or the default blend for ``TraceKind.MIX``."""
        if kind is TraceKind.MIX:
            return cls()
        return cls(
            **{
                k.value: float(k is kind)
                for k in (TraceKind.CHAT, TraceKind.SYSTEM, TraceKind.AGENT)
            }
        )


@dataclass(frozen=True)
class SyntheticConfig:
    """Parameters of a synthetic trace.

    Attributes:
        requests: how many requests.
        seed: the random seed; equal configs give equal traces.
        rate: mean arrivals per second (Poisson).
        mix: weights of chat, system-prompt and agent traffic.
        system_prompts: distinct system prompts shared across users.
        new_session_prob: chance a chat/agent request starts a session rather than continuing one.
    """

    requests: int = 1000
    seed: int = 0
    rate: float = 1.0
    mix: Mix = field(default_factory=Mix)
    system_prompts: int = 8
    new_session_prob: float = 0.3

    def __post_init__(self) -> None:
        if self.requests < 0:
            raise ValueError(f"requests must be non-negative, got {self.requests}")
        if not self.rate > 0:
            raise ValueError(f"rate must be positive, got {self.rate}")
        if self.system_prompts < 1:
            raise ValueError(
                f"system_prompts must be at least 1, got {self.system_prompts}"
            )
        if not 0 <= self.new_session_prob <= 1:
            raise ValueError(
                f"new_session_prob must be in [0, 1], got {self.new_session_prob}"
            )


@dataclass
class _Session:
    """A chat or agent session's last request, to be extended by its next one (mutable state
    private to one generator run)."""

    hash_ids: tuple[int, ...]
    input_length: int
    output_length: int
    turns_left: int


class _Generator:
    def __init__(self, config: SyntheticConfig) -> None:
        self.config = config
        self.rng = random.Random(config.seed)
        self.next_id = 0
        self.sessions: dict[TraceKind, list[_Session]] = {
            TraceKind.CHAT: [],
            TraceKind.AGENT: [],
        }
        self.prompts: list[
            tuple[int, tuple[int, ...]]
        ] = []  # (tokens, ids of its full blocks)

    def fresh(self, n: int) -> tuple[int, ...]:
        ids = tuple(range(self.next_id, self.next_id + n))
        self.next_id += n
        return ids

    def extend(
        self, prefix_ids: tuple[int, ...], prefix_tokens: int, input_length: int
    ) -> tuple[int, ...]:
        """Ids of a prompt of ``input_length`` tokens that starts with a ``prefix_tokens`` prefix."""
        kept = prefix_ids[: prefix_tokens // BLOCK_TOKENS]
        return kept + self.fresh(max_blocks(input_length) - len(kept))

    def session_request(self, kind: TraceKind, timestamp_ms: int) -> Request:
        rng, open_ = self.rng, self.sessions[kind]
        chat = kind is TraceKind.CHAT
        if not open_ or rng.random() < self.config.new_session_prob:
            # chat opens with a short prompt; an agent with a long one (tools, documents, code)
            length = rng.randint(200, 3000) if chat else rng.randint(4000, 24000)
            session = _Session(
                (), 0, 0, rng.randint(2, 10) if chat else rng.randint(5, 30)
            )
            open_.append(session)
            ids, input_length = self.fresh(max_blocks(length)), length
        else:
            session = open_[rng.randrange(len(open_))]
            step = rng.randint(20, 1500) if chat else rng.randint(50, 600)
            input_length = session.input_length + session.output_length + step
            ids = self.extend(session.hash_ids, session.input_length, input_length)
        output_length = rng.randint(20, 800) if chat else rng.randint(10, 200)
        session.hash_ids, session.input_length, session.output_length = (
            ids,
            input_length,
            output_length,
        )
        session.turns_left -= 1
        if session.turns_left <= 0:
            open_.remove(session)
        return Request(timestamp_ms, input_length, output_length, ids)

    def system_request(self, timestamp_ms: int) -> Request:
        rng = self.rng
        n = self.config.system_prompts
        rank = rng.choices(range(n), weights=[1 / (i + 1) for i in range(n)])[0]
        while (
            len(self.prompts) <= rank
        ):  # prompts are created on first use, in rank order
            tokens = rng.randint(600, 4000)
            self.prompts.append((tokens, self.fresh(tokens // BLOCK_TOKENS)))
        prompt_tokens, prompt_ids = self.prompts[rank]
        input_length = prompt_tokens + rng.randint(20, 2000)
        ids = self.extend(prompt_ids, prompt_tokens, input_length)
        return Request(timestamp_ms, input_length, rng.randint(20, 500), ids)

    def run(self) -> list[Request]:
        mix = self.config.mix
        kinds = (TraceKind.CHAT, TraceKind.SYSTEM, TraceKind.AGENT)
        weights = (mix.chat, mix.system, mix.agent)
        t_s, out = 0.0, []
        for _ in range(self.config.requests):
            t_s += self.rng.expovariate(self.config.rate)
            timestamp_ms = round(t_s * 1000)
            kind = self.rng.choices(kinds, weights=weights)[0]
            if kind is TraceKind.SYSTEM:
                out.append(self.system_request(timestamp_ms))
            else:
                out.append(self.session_request(kind, timestamp_ms))
        return out


def generate(config: SyntheticConfig) -> list[Request]:
    """A synthetic trace in arrival order (timestamps non-decreasing), deterministic per config."""
    return _Generator(config).run()
