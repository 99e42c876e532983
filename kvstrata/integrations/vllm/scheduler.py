"""The scheduler side: how much of each prompt kvstrata holds, and each step's load and save plans.

It holds no KV and moves no bytes. vLLM asks it how many tokens beyond its own prefix-cache hit
kvstrata can supply (``get_num_new_matched_tokens``: a lookup in the worker's caches, one per
KV cache group, through :class:`~kvstrata.integrations.vllm.channel.WorkerLookup`; the usable hit
is the longest prefix every group serves); once vLLM has allocated blocks for the grant
(``update_state_after_alloc``), ``build_connector_meta`` turns the grants and each request's
newly computed full prompt blocks into the step's :class:`LoadSpec` s and :class:`SaveSpec` s.

Per group. vLLM's block ids come per KV cache group; a sliding or chunked group's load fills,
and its save stores, only the blocks its windows reach (:mod:`~kvstrata.integrations.vllm.windows`).

Load or recompute. Of the hit beyond vLLM's own, only what pays is granted: the scheduler
weighs each tier's measured loads against the prefill's measured rate
(:class:`~kvstrata.policies.payoff.LoadOrRecompute`, fed by the workers' measurements through
``update_connector_output``: :mod:`~kvstrata.integrations.vllm.feedback`), so a slow or failing
tier stops being used without a restart, and is tried again with one block now and then. The
blocks held but not granted are counted (``declined_blocks``). A load whose blocks left
kvstrata between the lookup and the load (evicted meanwhile) is recomputed and says nothing of
its tier (``LoadOutcome.LEFT``): only a load given up or failed counts against it. A grant's load carries a budget,
a multiple of the prefill of its tokens (:class:`LoadSpec` ``budget_s``): a load that holds the
step up longer is given up by the workers and its blocks are computed.

Off the step. A grant that waits for a disk or the pool, where holding the other running
requests' steps up would cost more than its own request waiting a step (``Grant.off_step``),
and every grant of a model with more than one KV cache group (whose
failed loads vLLM takes only per request, as for an asynchronous load), is vLLM's asynchronous
load: vLLM allocates its blocks and keeps the request waiting while other requests' steps go on;
the load rides in ``async_loads`` and the workers report it through ``get_finished`` (a failed one as ``failed_recving``: vLLM recomputes
the request, which is then not offered the same load again). Its budget bounds how long its
request waits. vLLM caches such a load's blocks only once it has arrived, so a request whose hit
shares a block with a load off the step still in flight is not granted a load of its own: it is
asked again next step (``None`` to vLLM), and by then finds the blocks in vLLM's own cache (or,
had the load failed, loads them itself). One load per block, as with loads in the step, whose
blocks vLLM caches at once.

Save or skip. A store costs the workers CPU, on a CPU server taken from the forward; it pays
only where its blocks come back as kvstrata hits. Where this server can see that (it loads what
it stores, with no pool other servers read), the scheduler stores a request's prompt blocks only
while the blocks granted per block stored, times the prefill a granted block saves, outweigh a
stored block's measured CPU (:class:`~kvstrata.policies.saving.SaveOrSkip`, fed by the same
worker metadata); otherwise one request in 16, and the rest are counted (``save_skipped_blocks``).
It decides once per request, at its first full block. Blocks granted come back late (once vLLM
dropped them), so it also counts, as each request is admitted, how many of its prompt's blocks
an earlier prompt had (:class:`~kvstrata.index.seen.SeenBlocks`): no store can serve more than
repeats, and a workload whose prompts share nothing shows that from its first requests.

Misses answered here. A lookup crosses to the workers' process and waits for their caches (on
this 2-core host about 0.8 ms a request, the scheduler loop held up, and a thread of the worker's
taking the interpreter lock from its forward). Every cached block is keyed from its prompt's
first block's tokens on, and where the caches hold only what this scheduler stored (no pool, and
the workers' first report says they started empty: no blocks recovered from a disk), a prompt
whose first block it never sent to store can have none: that miss is answered here
(:class:`~kvstrata.index.stored.StoredFirstBlocks`), the rest by the workers. Every prompt of a
workload with no reuse is such a miss.

Writes that cannot pay. A block written down to a disk whose loads are declined would not be
read while they are: each step's metadata names such tiers (``unwritten``: the disk, while the
decision declines it and its next probe is not due), and the workers' caches drop what they would
have written there (counted, ``unwritten_blocks``). From when a probe is due, blocks go down again,
so the disk has blocks to be probed with, and once a probe finds it fast, it is written as before.

A hit never reaches the prompt's last token: vLLM must compute at least one, to give the next
token's logits. Only full blocks of prompt tokens are looked up and saved.

Lookups are counted (:class:`~kvstrata.integrations.vllm.prom.LookupCounts`) when vLLM admits the
request, as vLLM counts its own prefix cache's, preempted requests left out: of the full blocks
beyond vLLM's own hit, those kvstrata holds by the tier they load from, and those it lacks. The
same tiers split the hit's tokens for vLLM's ``prompt_tokens_cached_by_source``.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvstrata.index.seen import SeenBlocks
from kvstrata.index.stored import StoredFirstBlocks
from kvstrata.integrations.vllm.channel import WorkerLookup
from kvstrata.integrations.vllm.feedback import KVStrataWorkerMeta, LoadOutcome
from kvstrata.integrations.vllm.hooktimer import HookTimer
from kvstrata.integrations.vllm.keying import key_tokens
from kvstrata.integrations.vllm.metadata import KVStrataMetadata, LoadSpec, SaveSpec
from kvstrata.integrations.vllm.prom import KVStrataStats, LookupCounts
from kvstrata.integrations.vllm.verdicts import StepVerdicts
from kvstrata.integrations.vllm.windows import load_window, save_window
from kvstrata.media import Medium
from kvstrata.policies.payoff import BUDGET_FACTOR, LoadOrRecompute
from kvstrata.policies.saving import SaveOrSkip

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


SEEN_BLOCKS = 1 << 20  # prompt blocks remembered to tell repeats at most (about 100 MB): the tiers' capacity, up to this
_LOCAL_ONLY = frozenset((Medium.DISK,))  # tiers only this server reads (a disk directory is one process's)


@dataclass(frozen=True)
class _Lookup:
    """A request's last lookup: the tier of each block of its usable hit (from the prompt's
    first block), past ``computed`` tokens vLLM holds itself, of ``usable`` tokens looked up."""

    tiers: tuple[Medium, ...]
    computed: int
    usable: int
    declined: dict[Medium, int] = field(default_factory=dict)  # blocks held but not worth loading

    def tokens_by_tier(self, block_size: int) -> dict[Medium, int]:
        """The hit's tokens beyond vLLM's own, by tier."""
        out: Counter = Counter()
        for i, medium in enumerate(self.tiers):
            out[medium] += max(0, (i + 1) * block_size - max(i * block_size, self.computed))
        return {m: n for m, n in out.items() if n}


@dataclass(frozen=True)
class _Granted:
    """A request's grant: the tier its load waits for (the slowest of its blocks'), its blocks,
    how long the load may hold a step up (None: no budget), and whether it runs off the step."""

    medium: Medium
    blocks: int
    budget_s: float | None
    off_step: bool = False


class KVStrataConnectorScheduler:
    """The scheduler-side half of :class:`~kvstrata.integrations.vllm.KVStrataConnector`.

    Args:
        block_size: vLLM's block size in tokens (kvstrata's blocks are the same).
        engine_id: vLLM's engine id (whose worker's caches to ask).
        loads_enabled: the role loads KV (``kv_both``, ``kv_consumer``).
        saves_enabled: the role stores KV (``kv_both``, ``kv_producer``).
        horizon_blocks: vLLM's own KV capacity in blocks (how long a stored block waits to be asked for).
        judge_saves: store only what pays (:class:`SaveOrSkip`); False: store everything (a
            producer, or a server whose stores other servers read from a pool: their hits are not
            seen here).
        load_budget: a grant's budget in prefills of its tokens (None: none; ``ConnectorSettings``).
        ranks: the TP size (more than one: a step's saves wait for its loads' verdict).
        own_blocks_only: the caches can hold only blocks this server stores (no pool): a
            lookup of a prompt whose first block it never stored is a miss it answers itself,
            once the workers report their caches started empty.
        held_blocks: how many blocks the tiers hold at most (that many first blocks are remembered).
        block_hashes: each save carries vLLM's hashes of its blocks, for the workers' KV events
            (:mod:`~kvstrata.integrations.vllm.events`).
    """

    def __init__(self, block_size: int, engine_id: str, *, loads_enabled: bool, saves_enabled: bool,
                 spans: tuple[int | None, ...] = (None,), horizon_blocks: int = 0, judge_saves: bool = False,
                 load_budget: float | None = BUDGET_FACTOR, ranks: int = 1, own_blocks_only: bool = False,
                 held_blocks: int = 0, block_hashes: bool = False) -> None:
        self._block_size = block_size
        self._block_hashes = block_hashes
        self._spans = spans  # per KV cache group: its window or chunk in tokens, None for full attention
        self._windowed = any(span is not None for span in spans)
        # vLLM takes a failed load's blocks (invalid_block_ids) only from a model of one KV cache
        # group (block ids are per group); a hybrid model's failure is reported per request, as
        # vLLM allows only for a load off the step: every load of a hybrid model runs off it.
        self._all_off_step = len(spans) > 1
        self._lookup = WorkerLookup(engine_id)
        self._loads_enabled = loads_enabled
        self._saves_enabled = saves_enabled
        self._requests: dict[str, Request] = {}
        self._to_load: dict[str, int] = {}  # req_id -> external tokens granted this step
        self._to_fetch: dict[str, int] = {}  # req_id -> external tokens of a load off the step, to send
        self._no_reload: set[str] = set()  # requests whose load off the step failed: recomputed, not loaded again
        self._in_flight: dict[Any, str] = {}  # vLLM's block hash -> the request loading it off the step
        self._saved_blocks: dict[str, int] = {}  # req_id -> prompt blocks already sent to save
        self._lookups: dict[str, _Lookup] = {}  # req_id -> its last lookup, until vLLM admits it
        self._sources: dict[str, dict[Medium, int]] = {}  # req_id -> its admitted hit's tokens by tier
        self._counts = LookupCounts()
        self.decision = LoadOrRecompute(block_size, budget_factor=load_budget)
        self._granted: dict[str, _Granted] = {}  # req_id -> its grant, until its load's timing comes back
        self.saving = SaveOrSkip(block_size, horizon_blocks)
        self._judge_saves = judge_saves and loads_enabled and saves_enabled
        self._storing: dict[str, bool] = {}  # req_id -> whether its prompt blocks are stored (decided once)
        # the prompts' blocks seen: the share that repeats bounds what stores can serve, from the first requests
        self._seen = SeenBlocks(min(held_blocks, SEEN_BLOCKS) or SEEN_BLOCKS) if self._judge_saves else None
        self._step = 0
        # TP > 1: a step that loads and saves has its saves held by the workers until every
        # rank's loads of it are known to have arrived (verdicts.py)
        self._verdicts = StepVerdicts() if ranks > 1 else None
        # The misses it can answer itself: where it loads what it stores and the caches hold
        # nothing else (no pool other servers fill; they started empty, as the workers' first
        # report says: until then every lookup is the workers').
        self._firsts = (StoredFirstBlocks(block_size, held_blocks)
                        if own_blocks_only and loads_enabled and saves_enabled and held_blocks > 0 else None)
        self._caches_own_only = False
        self._hook_cpu = HookTimer(lambda cpu_s, _wall_s: self._counts.used_cpu(cpu_s))

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens kvstrata holds, in every group, beyond vLLM's ``num_computed_tokens``, and
        whether they load off the step (asynchronously); None: a load off the step brings some of
        them for another request, ask again next step."""
        if not self._loads_enabled or request.request_id in self._no_reload:
            return 0, False
        prompt = key_tokens(request, self._block_size)  # the ids its keys chain (see keying.py)
        if prompt is None:
            return 0, False
        # vLLM computes at least the last prompt token itself: look up full blocks before it.
        usable = (len(prompt) - 1) // self._block_size * self._block_size
        if usable <= num_computed_tokens:
            return 0, False
        own = -(-num_computed_tokens // self._block_size)  # blocks vLLM holds itself
        in_flight = self._in_flight
        if in_flight and any(h in in_flight for h in request.block_hashes[own : usable // self._block_size]):
            return None, False
        self._granted.pop(request.request_id, None)
        tiers = self._hit_tiers(prompt[:usable])
        # a sliding or chunked group keeps its windows only where a hit may end: all or none of it
        # the requests vLLM holds (self._requests): those a load in the step would hold up
        grant = self.decision.grant(tiers[own:], time.monotonic(), whole=self._windowed, running=len(self._requests))
        lookup = _Lookup(tiers[: own + grant.blocks], num_computed_tokens, usable, grant.declined)
        self._lookups[request.request_id] = lookup
        off_step = bool(grant.blocks) and (grant.off_step or self._all_off_step)
        if grant.blocks:
            granted = tiers[own : own + grant.blocks]
            self._granted[request.request_id] = _Granted(max(granted, key=lambda m: m.value), grant.blocks,
                                                         grant.budget_s, off_step)
        return max(0, len(lookup.tiers) * self._block_size - num_computed_tokens), off_step

    def _hit_tiers(self, tokens: list[int]) -> tuple[Medium, ...]:
        """The tier of each block of the usable hit: a miss the scheduler knows of is answered
        here (no block of a prompt whose first block it never sent to store can be cached, where
        the caches hold only what it stored), any other lookup by the workers."""
        firsts = self._firsts
        if firsts is not None and self._caches_own_only and not firsts.may_hold(tokens):
            self._counts.answered(by_scheduler=True)
            return ()
        self._counts.answered(by_scheduler=False)
        return self._lookup.hit_tiers(tokens, self._block_size)

    def update_state_after_alloc(self, request: Request, num_external_tokens: int) -> None:
        """Remember the request, and its grant when vLLM allocated blocks for one; count its lookup."""
        self._requests[request.request_id] = request
        lookup = self._lookups.pop(request.request_id, None)
        if num_external_tokens > 0:
            granted = self._granted.get(request.request_id)
            off_step = granted is not None and granted.off_step
            (self._to_fetch if off_step else self._to_load)[request.request_id] = num_external_tokens
            if off_step and lookup is not None:  # vLLM caches its blocks once it arrives: others wait for it
                end = len(lookup.tiers)
                for block_hash in request.block_hashes[end - num_external_tokens // self._block_size : end]:
                    self._in_flight[block_hash] = request.request_id
        if request.num_preemptions > 0:
            return
        if self._seen is not None:  # a block vLLM or kvstrata serves repeats an earlier prompt's
            hashes = request.block_hashes[: max(0, request.num_prompt_tokens - 1) // self._block_size]
            repeated = self._seen.observe(hashes)
            self.saving.observed(len(hashes), max(repeated, len(lookup.tiers) if lookup is not None else 0))
        if lookup is None:
            return
        bs = self._block_size
        beyond = lookup.tiers[-(-lookup.computed // bs):]  # blocks past vLLM's own hit
        missed = (lookup.usable - lookup.computed) // bs - len(beyond) - sum(lookup.declined.values())
        self._counts.admitted(beyond, max(0, missed), lookup.declined)
        self.saving.granted(len(beyond))
        self._sources[request.request_id] = lookup.tokens_by_tier(bs)

    def hit_sources(self, request: Request) -> dict[Medium, int]:
        """The admitted hit's tokens by the tier they load from (vLLM checks they add up)."""
        return self._sources.pop(request.request_id, {})

    def stats(self) -> KVStrataStats | None:
        """The lookups counted since the last call."""
        return self._counts.report()

    def counting_cpu(self) -> HookTimer:
        """Around a hook: its thread's CPU is the connector's (a lookup waiting on the worker costs none)."""
        return self._hook_cpu

    def measured(self, meta: KVStrataWorkerMeta) -> None:
        """A step's measurements from the workers: the prefill's rate and each granted load's time."""
        if meta.caches_started_empty is not None:  # said once, by the first report
            self._caches_own_only = meta.caches_started_empty
        self.decision.step_computed(meta.computed_tokens, meta.compute_s)
        self.saving.stored_cost(meta.saved_blocks, meta.save_cpu_s)
        for probe in meta.probes:
            outcome = (self.decision.probed(probe.medium, probe.seconds, probe.ok, time.monotonic()) if probe.read
                       else self.decision.unprobed(probe.medium))
            self._counts.probed(probe.medium, outcome)
        for timing in meta.loads:
            if self._verdicts is not None:
                self._verdicts.reported(timing.req_id, timing.ok)
            granted = self._granted.pop(timing.req_id, None)
            if not timing.ok:  # vLLM frees its blocks: each request loads what it needs itself
                self._landed(timing.req_id)
            if granted is None:
                continue
            if timing.outcome is LoadOutcome.ARRIVED:
                self.decision.loaded(granted.medium, granted.blocks, timing.seconds)
                continue
            if timing.outcome is LoadOutcome.FAILED:  # LEFT (evicted since the lookup) says nothing of the tier
                self.decision.failed(granted.medium, granted.blocks, timing.seconds, time.monotonic())
            if granted.off_step and timing.req_id in self._requests:  # vLLM looks it up again: recompute it
                self._no_reload.add(timing.req_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput, kv_cache_manager: KVCacheManager) -> KVStrataMetadata:
        """This step's loads (the grants) and saves (prompt blocks completed by this step)."""
        self._step += 1
        # a due probe is taken first: the workers read a block the tier holds, nothing need go down to it
        probes = self.decision.probes_due(time.monotonic()) if self._loads_enabled else ()
        meta = KVStrataMetadata(scheduled_tokens=scheduler_output.total_num_scheduled_tokens, step=self._step,
                                verdicts=self._verdicts.take() if self._verdicts is not None else {},
                                unwritten=self._unwritten(), probes=probes)
        null = kv_cache_manager.block_pool.null_block.block_id
        computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        for req_id, hit in computed.items():  # the hit's blocks (vLLM's, kvstrata's) are stored already
            self._saved_blocks.setdefault(req_id, hit // self._block_size)
            self._landed(req_id)  # a load off the step arrived: vLLM cached its blocks as it scheduled it
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            request = self._requests.get(req_id)
            if request is None:
                continue
            external = self._to_load.pop(req_id, 0)
            end = computed[req_id] + scheduled
            save = self._saves_enabled and self._saves_more(req_id, request, end) and self._stores(req_id, request, end)
            if not external and not save:
                continue  # a decode step, a prompt chunk short of a new full block, or a save skipped
            block_ids = kv_cache_manager.get_block_ids(req_id)  # one list per KV cache group
            prompt = key_tokens(request, self._block_size) or []  # keyed: it loads or saves
            if external:
                meta.loads.append(self._load_spec(req_id, prompt, block_ids, computed[req_id], external, null))
            if save:
                meta.saves.append(self._save_spec(req_id, request, prompt, block_ids, end, null))
        self._to_load.clear()  # a grant for a request not scheduled after all: asked again next time
        for req_id, external in self._to_fetch.items():  # vLLM set its computed tokens to the hit's end
            request = self._requests[req_id]
            meta.async_loads.append(self._load_spec(req_id, key_tokens(request, self._block_size) or [],
                                                    kv_cache_manager.get_block_ids(req_id),
                                                    request.num_computed_tokens, external, null))
        self._to_fetch.clear()
        if self._verdicts is not None and meta.loads and meta.saves:
            self._verdicts.track(self._step, [spec.req_id for spec in meta.loads])
        return meta

    def _unwritten(self) -> frozenset[Medium]:
        """The tiers nothing is written down to this step: a local disk whose loads are declined
        (only this server reads it; a pool serves others, so it is always written)."""
        if not self._saves_enabled:
            return frozenset()
        return self.decision.declined_tiers(time.monotonic()) & _LOCAL_ONLY

    def _landed(self, req_id: str) -> None:
        """The request's load off the step is over: its blocks are in vLLM's cache (it arrived,
        and vLLM scheduled the request), or nowhere (it failed, or the request ended)."""
        if self._in_flight:
            for block_hash in [h for h, r in self._in_flight.items() if r == req_id]:
                del self._in_flight[block_hash]

    def _saves_more(self, req_id: str, request: Request, end: int) -> bool:
        """Whether ``end`` completes a full prompt block not yet sent to save."""
        full = min(end, request.num_prompt_tokens) // self._block_size
        return full > self._saved_blocks.get(req_id, 0)

    def _stores(self, req_id: str, request: Request, end: int) -> bool:
        """Whether the new full prompt blocks up to ``end`` are stored (the request's decision,
        made at its first); skipped ones are counted and never offered again."""
        storing = self._storing.get(req_id)
        if storing is None:
            storing = self._storing[req_id] = key_tokens(request, self._block_size) is not None and (
                not self._judge_saves or self.saving.save(self.decision.per_token_s))
        full = min(end, request.num_prompt_tokens) // self._block_size
        new = full - self._saved_blocks.get(req_id, 0)
        self.saving.computed(new, stored=storing)
        if not storing:
            self._saved_blocks[req_id] = full
            self._counts.skipped(new)
        return storing

    def _load_spec(self, req_id: str, prompt: list[int], block_ids: tuple[list[int], ...], end: int,
                   external: int, null: int) -> LoadSpec:
        # num_computed_tokens already counts the hit: local blocks, then external ones
        bs = self._block_size
        first = (end - external) // bs
        return LoadSpec(req_id, prompt[:end], external,
                        [load_window(ids[first : end // bs], first, null) for ids in block_ids],
                        granted.budget_s if (granted := self._granted.get(req_id)) is not None else None)

    def _save_spec(self, req_id: str, request: Request, prompt: list[int], block_ids: tuple[list[int], ...],
                   end: int, null: int) -> SaveSpec:
        """The request's full prompt blocks up to ``end`` tokens (more than already sent to save:
        ``_saves_more``), and vLLM's hashes of them where the workers publish KV events."""
        bs = self._block_size
        full = min(end, len(prompt)) // bs
        self._saved_blocks[req_id] = full
        if self._firsts is not None:  # every block it stores is keyed from its first block's tokens on
            self._firsts.stored(prompt)
        hashes: list[bytes | int] = []
        if self._block_hashes and len(request.block_hashes) >= full:  # a model of one group: its block size
            from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash  # as vLLM's own events name them

            hashes = [maybe_convert_block_hash(h) for h in request.block_hashes[:full]]
        return SaveSpec(req_id, prompt[: full * bs], [save_window(ids[:full], span, bs, null)
                                                      for ids, span in zip(block_ids, self._spans)], hashes)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; vLLM may free its blocks now (nothing here holds them)."""
        # Saves are copied out of vLLM's blocks within the step that computed them: nothing
        # here holds the blocks, so vLLM may free them now. A load off the step still in flight
        # holds its request's blocks until the workers report it (vLLM waits for that itself).
        self._requests.pop(request.request_id, None)
        self._saved_blocks.pop(request.request_id, None)
        self._to_load.pop(request.request_id, None)
        self._to_fetch.pop(request.request_id, None)
        self._no_reload.discard(request.request_id)
        self._landed(request.request_id)
        self._lookups.pop(request.request_id, None)
        self._sources.pop(request.request_id, None)
        self._granted.pop(request.request_id, None)
        self._storing.pop(request.request_id, None)
        return False, None

    def shutdown(self) -> None:
        self._lookup.close()

