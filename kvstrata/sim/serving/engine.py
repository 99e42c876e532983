"""One ``vllm serve`` process, simulated step by step (pure): vLLM v1's scheduler, its prefix
cache, and kvstrata's connector beside it.

Each step (vLLM's ``Scheduler.schedule``, as it runs on this host: chunked prefill on, one
engine step at a time):

1. Running requests first, in the order they were admitted: a decode is one token, a prompt
   not yet computed continues with as many tokens as the step's budget
   (``max_num_batched_tokens``) leaves. A request that needs a block none is free for
   preempts the latest admitted request (its blocks freed, computed again from the start).
2. Then waiting requests, oldest first, while fewer than ``max_num_seqs`` run and budget is
   left: vLLM's own prefix hit (:class:`~kvstrata.sim.serving.blocks.PrefixBlocks`), then with
   the connector's loads on, kvstrata's hit beyond it (the leading run the store holds from the
   prompt's first block, :class:`~kvstrata.sim.serving.store.ServerStore`). The first that finds
   no free blocks for itself stops the admissions (vLLM does not skip ahead).
3. The step takes :meth:`~kvstrata.sim.serving.timing.ServingTimes.step_s` plus its loads (and
   its saves, which the connector waits for by default: ``sync_save``). At
   its end every prompt computed whole samples its first token, every decode one more; with the
   connector's saves on, the prompt's full blocks are stored (all of them the first time, as the
   connector's save spec names them; the cache skips those its device tier holds). A block is
   cached in vLLM's prefix cache as soon as the tokens filling it are scheduled, as vLLM does.

Counted as the bench counts them: vLLM's prefix queries and hits in prompt tokens at admission
(preempted requests' re-admissions left out), and kvstrata's hit blocks beyond vLLM's by tier.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstrata.sim.serving.blocks import PrefixBlocks, chain_keys
from kvstrata.sim.serving.cpus import HostCpus
from kvstrata.sim.serving.store import ServerStore, StoreHit
from kvstrata.sim.serving.timing import Chunk, ServingTimes


class Clock:
    """The event loop every simulated server and client shares: callbacks at times, in order."""

    def __init__(self) -> None:
        self.now_s = 0.0
        self._heap: list = []
        self._seq = itertools.count()

    def at(self, t: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (max(t, self.now_s), next(self._seq), action))

    def run(self) -> None:
        while self._heap:
            t, _, action = heapq.heappop(self._heap)
            self.now_s = t
            action()


@dataclass
class SimRequest:
    """One completion request as a server sees it.

    Attributes:
        prompt: the prompt's token ids.
        answer: the token ids it will generate (``max_tokens`` of them).
        sent_s: when the client sent it.
        done: called with the request once its last token is out.
        first: called with it at its first token (None: nothing to call).
    """

    prompt: tuple[int, ...]
    answer: tuple[int, ...]
    sent_s: float
    done: Callable[[SimRequest], None]
    first: Callable[[SimRequest], None] | None = None  # called at its first token
    first_token_s: float | None = None
    first_out_s: float = 0.0  # the client's: its first token's way out
    finish_s: float | None = None
    computed: int = 0
    output: int = 0
    blocks: list[int] = field(default_factory=list)
    keys: tuple[int, ...] = ()
    stored_blocks: int = 0
    admitted: bool = False

    @property
    def tokens(self) -> tuple[int, ...]:
        """What the sequence holds so far: the prompt and the tokens generated."""
        return self.prompt + self.answer[: self.output]

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        n = len(self.answer)
        return (self.finish_s - self.first_token_s) / (n - 1) if n > 1 else None


@dataclass(frozen=True)
class EngineLimits:
    """A server's scheduler settings and KV memory."""

    kv_blocks: int  # --num-gpu-blocks-override (one is vLLM's null block)
    block_tokens: int
    max_num_seqs: int
    max_batched_tokens: int = 2048  # vLLM's default for an OpenAI server on a CPU

    def __post_init__(self) -> None:
        for name in ("kv_blocks", "block_tokens", "max_num_seqs", "max_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class ServerSim:
    """One server (see the module text).

    Args:
        clock: the shared event loop.
        limits: its scheduler settings.
        times: its time model.
        store: kvstrata's tiers behind it; None: vLLM alone.
        loads, saves: the connector's role (``kv_both``: both; a producer saves, a consumer loads).
        cpus: the host's CPUs, shared with the other servers (None: unlimited); bind the server's
            worker to its CPUs there (``cpus.bind(id(server), ...)``).
        sync_save: the step waits for its saves to be written down every tier (the connector's
            ``sync_save``, on by default); off: saves run behind the engine.
    """

    def __init__(self, clock: Clock, limits: EngineLimits, times: ServingTimes, store: ServerStore | None = None,
                 loads: bool = True, saves: bool = True, cpus: HostCpus | None = None, sync_save: bool = True) -> None:
        self.clock, self.limits, self.times = clock, limits, times
        self.sync_save = sync_save
        self.cpus = cpus if cpus is not None else HostCpus()
        self.store = store
        self.loads = loads and store is not None
        self.saves = saves and store is not None
        self.blocks = PrefixBlocks(limits.kv_blocks - 1)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.prefix_queries_tokens = self.prefix_hits_tokens = 0
        self.hit_blocks: Counter = Counter()  # kvstrata's, beyond vLLM's own hit, by tier
        self.load_requests, self.load_s = 0, 0.0
        self.preemptions = self.steps = 0
        self._busy = False

    def submit(self, request: SimRequest) -> None:
        """Queue ``request``.

        Raises:
            ValueError: it needs more KV blocks than the server has (vLLM refuses such a server).
        """
        need = -(-(len(request.prompt) + len(request.answer)) // self.limits.block_tokens)
        if need > self.blocks.usable:
            raise ValueError(f"a request of {len(request.prompt)} + {len(request.answer)} tokens needs {need} KV blocks; "
                             f"the server has {self.blocks.usable}")
        self.waiting.append(request)
        if not self._busy:
            self._step()

    def restarted(self, store: ServerStore | None) -> None:
        """A fresh process: vLLM's cache empty; ``store``: its tiers now (what survived)."""
        if self.waiting or self.running:
            raise ValueError("a server restarted with requests in flight")
        self.blocks = PrefixBlocks(self.limits.kv_blocks - 1)
        self.store = store

    # --- one step -----------------------------------------------------------------------------

    def _step(self) -> None:
        now = self.clock.now_s
        budget = self.limits.max_batched_tokens
        scheduled: list[tuple[SimRequest, int]] = []
        chunks: list[Chunk] = []
        decodes = held = 0
        load_s = 0.0
        preempted = False
        queue = list(self.running)
        while queue:
            r = queue.pop(0)
            need = len(r.prompt) + r.output - r.computed
            n = min(need, budget)
            if n <= 0:
                continue
            while not self._grow(r, r.computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim in queue:
                    queue.remove(victim)
                if victim is r:
                    break
            if r not in self.running:
                continue
            budget -= n
            scheduled.append((r, n))
            self._cache(r, r.computed + n)
            if need == 1 and r.output:
                decodes += 1
                held += r.computed
            else:
                chunks.append(Chunk(n, r.computed))
        while not preempted and self.waiting and len(self.running) < self.limits.max_num_seqs and budget > 0:
            r = self.waiting[0]
            admitted = self._admit(r, budget)
            if admitted is None:
                break
            n, seconds = admitted
            self.waiting.popleft()
            self.running.append(r)
            load_s += seconds
            budget -= n
            scheduled.append((r, n))
            self._cache(r, r.computed + n)
            chunks.append(Chunk(n, r.computed))
        if not scheduled:
            if self._busy:  # its worker spins on a while (see cpus)
                self.cpus.stepping(id(self), False, now)
            self._busy = False
            return
        self._busy = True
        self.steps += 1
        stretch = self.cpus.stretch(id(self), now)
        self.cpus.stepping(id(self), True, now)
        seconds = (self.times.step_s(chunks, decodes, held) + load_s + self._save_s(scheduled)) * stretch
        self.clock.at(now + seconds, lambda: self._stepped(scheduled))

    def _admit(self, r: SimRequest, budget: int) -> tuple[int, float] | None:
        """Admit ``r`` if its blocks fit: (tokens it computes this step, its load's seconds)."""
        bt = self.limits.block_tokens
        tokens = r.tokens
        keys = chain_keys(tokens, bt)
        usable = (len(tokens) - 1) // bt
        own = self.blocks.cached_run(keys[:usable])
        hit = StoreHit(())
        if self.loads:
            found = self.store.lookup(keys[:usable], self.clock.now_s)
            hit = StoreHit(found.tiers[own:]) if found.blocks > own else StoreHit(())
        computed = (own + hit.blocks) * bt
        n = min(len(tokens) - computed, budget)
        fresh = -(-(computed + n) // bt) - own
        if not self.blocks.can_take(self.blocks.blocks_of(keys[:own]), fresh):
            return None
        r.blocks = self.blocks.hit(keys[:own]) + self.blocks.take(fresh)
        r.keys, r.computed = keys, computed
        seconds = 0.0
        if not r.admitted:  # vLLM counts a request's first admission only
            self.prefix_queries_tokens += len(r.prompt)
            self.prefix_hits_tokens += own * bt
            self.hit_blocks.update(hit.tiers)
        r.admitted = True
        if self.store is not None:  # the connector's lookup and bookkeeping of every request
            seconds += self.times.connector.request_s
        if hit.blocks:
            load = self.times.load_s(hit)
            seconds += load
            self.load_requests += 1
            self.load_s += load - self.times.connector.load_s  # the cache's own time, as its stats count it
            self.store.loaded(keys[own:own + hit.blocks], hit, self.clock.now_s)  # in the device tier for this step's save
        return n, seconds

    def _cache(self, r: SimRequest, tokens: int) -> None:
        """The blocks ``tokens`` fill are cached as the step is scheduled (vLLM caches a block
        once the tokens filling it are scheduled, so a request admitted next can hit it)."""
        full = tokens // self.limits.block_tokens
        if len(r.keys) < full:
            r.keys = chain_keys(r.tokens, self.limits.block_tokens, r.keys)
        for block, key in zip(r.blocks[:full], r.keys[:full]):
            self.blocks.cache(block, key)

    def _grow(self, r: SimRequest, tokens: int) -> bool:
        """Give ``r`` blocks for ``tokens``; False when none are free."""
        more = -(-tokens // self.limits.block_tokens) - len(r.blocks)
        if more <= 0:
            return True
        if not self.blocks.can_take((), more):
            return False
        r.blocks += self.blocks.take(more)
        return True

    def _preempt(self, r: SimRequest) -> None:
        self.running.remove(r)
        self.blocks.release(r.blocks)
        r.blocks, r.computed = [], 0
        self.waiting.appendleft(r)
        self.preemptions += 1

    def _stepped(self, scheduled: list[tuple[SimRequest, int]]) -> None:
        now = self.clock.now_s
        for r, n in scheduled:
            if r not in self.running:
                continue
            r.computed += n
            if r.computed >= len(r.prompt) + r.output:  # every token in: one more sampled
                r.output += 1
                if r.first_token_s is None:
                    r.first_token_s = now
                    if r.first is not None:
                        r.first(r)
            self._save(r, now)
            if r.output >= len(r.answer):
                r.finish_s = now
                self.running.remove(r)
                self.blocks.release(r.blocks)
                r.blocks = []
                r.done(r)
        self._step()

    def _to_save(self, r: SimRequest, computed: int) -> tuple[int, ...]:
        """The keys a save of ``r`` with ``computed`` tokens computed names (its prompt's full
        blocks not yet sent to save; the connector names all of them the first time)."""
        full = min(computed, len(r.prompt)) // self.limits.block_tokens
        return r.keys[r.stored_blocks:full] if self.saves and full > r.stored_blocks else ()

    def _save_s(self, scheduled: list[tuple[SimRequest, int]]) -> float:
        """A synchronous save's time in the step: the blocks the device tier lacks, written into
        it and down every tier below, the tiers' write-downs side by side (the slowest counts)."""
        if not (self.saves and self.sync_save):
            return 0.0
        now = self.clock.now_s
        named = dict.fromkeys(k for r, n in scheduled for k in self._to_save(r, r.computed + n))  # two requests may share blocks
        fresh = len(self.store.fresh(list(named), now))
        if not fresh:
            return 0.0
        return max(self.times.store_s(tier, fresh) for tier in self.store.tiers)

    def _save(self, r: SimRequest, now: float) -> None:
        """Store the prompt's blocks newly computed whole (full blocks of prompt tokens only):
        readable at once after a synchronous save (the step waited for it), else after each
        tier's write-down, run behind the engine."""
        keys = self._to_save(r, r.computed)
        if not keys:
            return
        if self.sync_save:
            ready = dict.fromkeys(self.store.tiers, now)
        else:
            ready = {tier: now + self.times.store_s(tier, len(keys)) for tier in self.store.tiers}
        self.store.store(keys, ready, now)
        r.stored_blocks = min(r.computed, len(r.prompt)) // self.limits.block_tokens
