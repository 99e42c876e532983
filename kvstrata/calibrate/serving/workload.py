"""``bench serve``'s workload as data: a Mooncake-format trace turned into multi-turn
conversations of token ids, and when each turn may be sent (pure: no I/O, no randomness
beyond seeded generators).

From the trace. Conversation ``i`` opens with trace request ``i`` (in arrival order): its
``hash_ids`` (chained ids of 512-token blocks) become blocks of ``block_tokens`` token ids each,
drawn from a generator seeded by the id, so two requests that share a leading id run share that
many blocks of prompt, as the trace says (a system prompt shared across users stays shared).
Lengths scale by ``block_tokens / 512`` (one trace block becomes one vLLM block), and an opening
prompt is cut at ``opener_max_tokens`` so the last turn still fits ``max_model_len``:
``opener + (turns - 1) x (answer + user text) + answer``. Cutting keeps the leading blocks,
which is what a chained id names.

Later turns. Turn ``t`` sends the previous turn's prompt, its answer (the token ids the server
returned) and ``user_tokens`` new token ids, so every turn extends the one before. Prompts are
token ids, which the completions API takes as they are: a text round trip through the tokenizer
could merge tokens across the seam and change the prefix the next turn was meant to reuse.

Arrivals. Requests are numbered turn by turn (every conversation's first turn, then every
second turn, ...); request ``n`` may be sent ``n / rate`` seconds after the start, and a turn is
never sent before its conversation's previous answer is back (a closed loop per conversation).

``variant`` draws other token ids for the same shapes: rounds and phases of one run use the same
conversations with fresh content, so none finds another's KV cached.

No reuse (:attr:`WorkloadKind.NO_REUSE`). The same conversations' shapes and pace, but every
turn's prompt is new: turn ``t`` of a conversation is ``opener + t x (max_tokens + user_tokens)``
token ids long, the length its conversations twin has (every answer is ``max_tokens`` long), all
of them drawn afresh, so there is nothing for any cache to serve and the connector can only
store: what it costs a server that never hits. No request shares a prefix block with another of
the run, across rounds and servers too (:func:`round_plans` gives each round's servers streams of
their own): every prompt opens with a tag, its number in the run (stream, conversation, turn)
written in base ``vocab - FIRST_TOKEN_ID`` over as many tokens as the run's count needs, all
within the first block. Two prompts' first blocks therefore differ, and since a block's key
chains every block before it (vLLM's and kvstrata's, :mod:`kvstrata.index.keys`), so do all
their blocks. A prompt shorter than a block has no full block, which no cache keeps. The rest
of each prompt is seeded draws. Only the interleaved rounds run this workload: the later phases
(two servers on one pool, restart, P/D) exist to reuse KV.
"""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvstrata.sim.synthetic import TraceKind
from kvstrata.sim.trace import BLOCK_TOKENS as TRACE_BLOCK_TOKENS
from kvstrata.sim.trace import Request, sort_by_time

FIRST_TOKEN_ID = 16  # ids below are left out: tokenizers put their special tokens first


class WorkloadKind(enum.Enum):
    """What the prompts are (its value: the ``--workload`` flag's and the JSON's)."""

    CONVERSATIONS = "conversations"  # each turn extends the last: reuse beyond vLLM's own KV
    NO_REUSE = "no-reuse"  # every prompt new: nothing to hit, the connector's cost alone


@dataclass(frozen=True)
class ServeWorkload:
    """The conversations' shape and pace.

    Attributes:
        conversations: conversations at once (each opens with one trace request).
        turns: turns per conversation.
        max_tokens: answer tokens per turn (greedy, end-of-sequence ignored: every answer has
            exactly this many).
        user_tokens: new user tokens each later turn adds.
        block_tokens: tokens one 512-token trace block becomes (vLLM's block size).
        max_model_len: the server's longest prompt plus answer.
        rate_per_s: requests a second the schedule allows (see the module text).
        seed: the token ids' seed.
        kind: conversations, or the same shapes with every prompt new (see the module text).
        traffic: the generated trace's traffic (``kvstrata trace generate --kind``): chat
            sessions, requests behind a few shared system prompts, agents looping over one long
            prefix of tools and documents (RAG-like), or their mix; a given ``--trace`` is its own.
    """

    conversations: int = 8
    turns: int = 3
    max_tokens: int = 16
    user_tokens: int = 48
    block_tokens: int = 32
    max_model_len: int = 512
    rate_per_s: float = 4.0
    seed: int = 0
    kind: WorkloadKind = WorkloadKind.CONVERSATIONS
    traffic: TraceKind = TraceKind.MIX

    def __post_init__(self) -> None:
        if not isinstance(self.kind, WorkloadKind):
            raise ValueError(f"bench serve: the workload must be a WorkloadKind, got {self.kind!r}")
        if not isinstance(self.traffic, TraceKind):
            raise ValueError(f"bench serve: the traffic must be a TraceKind, got {self.traffic!r}")
        for name in ("conversations", "turns", "max_tokens", "user_tokens", "block_tokens", "max_model_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"bench serve: {name} must be a whole number >= 1, got {value!r}")
        if not (isinstance(self.rate_per_s, (int, float)) and math.isfinite(self.rate_per_s) and self.rate_per_s > 0):
            raise ValueError(f"bench serve: rate must be a number of requests/s > 0, got {self.rate_per_s!r}")
        if self.opener_max_tokens < self.block_tokens:
            grow = (self.turns - 1) * (self.max_tokens + self.user_tokens) + self.max_tokens + self.block_tokens
            raise ValueError(
                f"bench serve: {self.turns} turns of {self.max_tokens} answer + {self.user_tokens} user tokens leave "
                f"no room for one {self.block_tokens}-token block of opening prompt in max_model_len "
                f"{self.max_model_len} (needs >= {grow}): fewer turns or tokens, or a longer max_model_len")

    @property
    def opener_max_tokens(self) -> int:
        """The longest opening prompt, whole blocks, that leaves room for every later turn."""
        room = self.max_model_len - (self.turns - 1) * (self.max_tokens + self.user_tokens) - self.max_tokens
        return max(0, room) // self.block_tokens * self.block_tokens

    @property
    def requests(self) -> int:
        return self.conversations * self.turns

    @property
    def longest_prompt_tokens(self) -> int:
        return self.opener_max_tokens + (self.turns - 1) * (self.max_tokens + self.user_tokens)


@dataclass(frozen=True)
class ConversationPlan:
    """One conversation: its opening prompt and each later turn's new user tokens.

    Attributes:
        index: its number (arrival order of its trace request).
        opener: turn 0's prompt, token ids.
        user: turn ``t``'s new user tokens at ``user[t - 1]``.
        trace_input_tokens: its trace request's input_length, before scaling.
        shared_blocks: leading blocks of its opener whose trace ids an earlier opener had too.
    """

    index: int
    opener: tuple[int, ...]
    user: tuple[tuple[int, ...], ...]
    trace_input_tokens: int
    shared_blocks: int = 0

    @property
    def turns(self) -> int:
        return len(self.user) + 1

    def prompt(self, turn: int, answers: Sequence[Sequence[int]]) -> tuple[int, ...]:
        """Turn ``turn``'s prompt given the answers of turns ``0 .. turn - 1``."""
        if len(answers) < turn:
            raise ValueError(f"turn {turn} needs {turn} earlier answers, got {len(answers)}")
        prompt = list(self.opener)
        for t in range(1, turn + 1):
            prompt += [*answers[t - 1], *self.user[t - 1]]
        return tuple(prompt)


@dataclass(frozen=True)
class FreshPlan:
    """One conversation of the no-reuse workload: a prompt of its own each turn.

    Attributes:
        index: its number (arrival order of its trace request).
        prompts: turn ``t``'s prompt at ``prompts[t]``, token ids (answers are not part of it).
    """

    index: int
    prompts: tuple[tuple[int, ...], ...]

    @property
    def turns(self) -> int:
        return len(self.prompts)

    @property
    def opener(self) -> tuple[int, ...]:
        return self.prompts[0]

    def prompt(self, turn: int, answers: Sequence[Sequence[int]]) -> tuple[int, ...]:
        """Turn ``turn``'s prompt (the answers are not in it; the client still waits for them)."""
        return self.prompts[turn]


class TurnPlan(Protocol):
    """What the client sends a conversation from: a :class:`ConversationPlan` or a :class:`FreshPlan`."""

    @property
    def index(self) -> int: ...

    @property
    def turns(self) -> int: ...

    @property
    def opener(self) -> tuple[int, ...]: ...

    def prompt(self, turn: int, answers: Sequence[Sequence[int]]) -> tuple[int, ...]: ...


def workload_of(doc: Mapping[str, Any]) -> ServeWorkload:
    """A workload from its JSON (a ``bench serve --json`` report's ``config.workload``; a report
    from before ``kind`` existed ran conversations).

    Raises:
        ValueError: an unknown kind, or a field the workload refuses.
        TypeError: a field it does not have.
    """
    fields = dict(doc)
    kind = fields.pop("kind", WorkloadKind.CONVERSATIONS.value)
    traffic = fields.pop("traffic", TraceKind.MIX.value)  # a report from before it: the mix, the only trace then
    try:
        parsed = WorkloadKind(kind)
    except ValueError:
        known = ", ".join(k.value for k in WorkloadKind)
        raise ValueError(f"bench serve: workload kind must be one of {known}, got {kind!r}") from None
    try:
        made = TraceKind(traffic)
    except ValueError:
        known = ", ".join(k.value for k in TraceKind)
        raise ValueError(f"bench serve: workload traffic must be one of {known}, got {traffic!r}") from None
    return ServeWorkload(**fields, kind=parsed, traffic=made)


def generated_trace(workload: ServeWorkload) -> list[Request]:
    """The trace ``bench serve`` generates when given none: ``kvstrata trace generate``'s, seeded
    with the workload's seed, one request per conversation at its rate."""
    from kvstrata.sim.synthetic import Mix, SyntheticConfig, generate

    return generate(SyntheticConfig(requests=workload.conversations, seed=workload.seed, rate=workload.rate_per_s,
                                    mix=Mix.of(workload.traffic)))


def opener_tokens(request: Request, workload: ServeWorkload) -> int:
    """An opening prompt's length: the trace's, scaled to ``block_tokens`` a trace block, cut to fit."""
    scaled = -(-request.input_length * workload.block_tokens // TRACE_BLOCK_TOKENS)
    return max(1, min(scaled, workload.opener_max_tokens))


def plan_conversations(trace: Sequence[Request], workload: ServeWorkload, vocab: int,
                       variant: int = 0) -> tuple[ConversationPlan, ...]:
    """The first ``workload.conversations`` requests of ``trace`` (arrival order) as conversations
    of token ids in ``[FIRST_TOKEN_ID, vocab)``.

    Raises:
        ValueError: the trace has fewer requests than conversations, or the vocabulary is too small.
    """
    ordered = _openers(trace, workload, vocab)
    seen: set[int] = set()
    plans = []
    for index, request in enumerate(ordered):
        length = opener_tokens(request, workload)
        full, tail = divmod(length, workload.block_tokens)
        opener: list[int] = []
        shared = 0
        for b in range(full):
            if b < len(request.hash_ids):
                trace_id = request.hash_ids[b]
                if trace_id in seen and shared == b:  # a leading run another opener had
                    shared += 1
                opener += draw(workload.seed, vocab, variant, f"block/{trace_id}", workload.block_tokens)
            else:  # the trace left this block unhashed: it is this request's own
                opener += draw(workload.seed, vocab, variant, f"own/{index}/{b}", workload.block_tokens)
        opener += draw(workload.seed, vocab, variant, f"tail/{index}", tail)
        seen.update(request.hash_ids[:full])
        user = tuple(tuple(draw(workload.seed, vocab, variant, f"user/{index}/{t}", workload.user_tokens))
                     for t in range(1, workload.turns))
        plans.append(ConversationPlan(index, tuple(opener), user, request.input_length, shared))
    return tuple(plans)


def plan_no_reuse(trace: Sequence[Request], workload: ServeWorkload, vocab: int,
                  streams: int) -> tuple[tuple[FreshPlan, ...], ...]:
    """``streams`` sets of the no-reuse workload's conversations (see the module text), each
    shaped as :func:`plan_conversations`' conversations are; no prompt of any set shares a
    block with another prompt of any set.

    Raises:
        ValueError: as :func:`plan_conversations`, or the vocabulary cannot tell the run's prompts
            apart within one block.
    """
    ordered = _openers(trace, workload, vocab)
    base = vocab - FIRST_TOKEN_ID
    count = streams * workload.conversations * workload.turns
    width = 1
    while base > 1 and base ** width < count:
        width += 1
    if base < 2 or width > workload.block_tokens:
        raise ValueError(f"bench serve: {count} new prompts cannot be told apart within a "
                         f"{workload.block_tokens}-token block with a vocabulary of {vocab}: fewer rounds, "
                         "conversations or turns")
    grow = workload.max_tokens + workload.user_tokens  # what each later turn adds: an answer and user tokens
    out = []
    for stream in range(streams):
        plans = []
        for index, request in enumerate(ordered):
            prompts = []
            for turn in range(workload.turns):
                length = opener_tokens(request, workload) + turn * grow
                number = (stream * workload.conversations + index) * workload.turns + turn
                tag = _digits(number, base, width)
                rest = draw(workload.seed, vocab, stream, f"fresh/{index}/{turn}", max(0, length - width))
                prompts.append(tuple([*tag, *rest][:length]))
            plans.append(FreshPlan(index, tuple(prompts)))
        out.append(tuple(plans))
    return tuple(out)


def round_plans(trace: Sequence[Request], workload: ServeWorkload, vocab: int, rounds: int,
                servers: int = 2) -> tuple[tuple[tuple[TurnPlan, ...], ...], ...]:
    """What each of ``servers`` is sent in each of ``rounds`` interleaved rounds, ``[round][server]``:
    conversations, the same for every server of a round (variant = the round), or no-reuse
    conversations, a stream of their own for every server of every round.

    Raises:
        ValueError: as :func:`plan_conversations` or :func:`plan_no_reuse`.
    """
    if workload.kind is WorkloadKind.CONVERSATIONS:
        return tuple((plan_conversations(trace, workload, vocab, r),) * servers for r in range(rounds))
    streams = plan_no_reuse(trace, workload, vocab, rounds * servers)
    return tuple(streams[r * servers: (r + 1) * servers] for r in range(rounds))


def replay_plans(prompts: Sequence[Sequence[int]]) -> tuple[ConversationPlan, ...]:
    """Prompts sent again as they were, each a one-turn conversation (a restarted server's replay)."""
    return tuple(ConversationPlan(i, tuple(p), (), len(p)) for i, p in enumerate(prompts))


def warm_prompts(workload: ServeWorkload, vocab: int, count: int, tag: str) -> list[tuple[int, ...]]:
    """Prompts of their own (two blocks and a token) to warm a fresh server up with."""
    return [tuple(draw(workload.seed, vocab, -1, f"warm/{tag}/{i}", 2 * workload.block_tokens + 1))
            for i in range(count)]


def arrival_s(conversation: int, turn: int, conversations: int, rate_per_s: float) -> float:
    """When turn ``turn`` of conversation ``conversation`` may be sent, seconds after the start."""
    return (turn * conversations + conversation) / rate_per_s


def alternate(conversation: int, turn: int, servers: int = 2) -> int:
    """Which of ``servers`` a turn goes to, round robin turn by turn (no affinity: a conversation's
    next turn always lands on another server than its last, conversations staggered)."""
    return (conversation + turn) % servers


def hit_blocks(prompt_tokens: int, block_tokens: int) -> int:
    """Full blocks before a prompt's last token: the most a cache can serve (the engine computes
    at least the last token itself, for the next token's logits)."""
    return max(0, prompt_tokens - 1) // block_tokens


def _openers(trace: Sequence[Request], workload: ServeWorkload, vocab: int) -> list[Request]:
    """The trace requests the conversations open with (arrival order), after the checks."""
    if vocab <= FIRST_TOKEN_ID:
        raise ValueError(f"bench serve: the model's vocabulary ({vocab}) is too small to draw prompts from")
    if len(trace) < workload.conversations:
        raise ValueError(f"bench serve: the trace has {len(trace)} requests; {workload.conversations} conversations "
                         "need one each")
    return sort_by_time(trace)[: workload.conversations]


def _digits(number: int, base: int, width: int) -> list[int]:
    """``number`` in ``base`` over ``width`` token ids (most significant first), each >= FIRST_TOKEN_ID."""
    out = []
    for _ in range(width):
        number, digit = divmod(number, base)
        out.append(FIRST_TOKEN_ID + digit)
    return out[::-1]


def draw(seed: int, vocab: int, variant: int, what: str, count: int) -> list[int]:
    """``count`` token ids for ``what``, the same for the same seed, variant and name."""
    rng = random.Random(f"{seed}/{variant}/{what}")  # a str seed: stable across processes
    return [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(count)]
