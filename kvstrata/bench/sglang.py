"""``kvstrata bench sglang``: kvstrata as SGLang's HiCache L3 storage beside SGLang's own file
backend (``HiCacheFile``) on the disk, and beside a raw Mooncake client on the pool, the same
pages in the same rounds.

The pages: ``pages`` pages (one SGLang storage batch is 128) of a model's KV on one rank, in a
real SGLang host pool (:mod:`kvstrata.integrations.sglang.harness`) of ``layout``, filled with
random bytes. Every backend is made by SGLang's own factory and driven by ``HiCacheController``'s
own backup and prefetch methods (``_page_backup``, ``_page_transfer``), so a page goes the way
SGLang sends it: kvstrata on the zero-copy interface (``batch_set_v1`` / ``batch_get_v1``),
``HiCacheFile`` on the generic one, the only one it has (flat pages: ``get_data_page`` out, a
dummy page in and ``set_from_flat_data_page``). Every prefetch lands in zeroed host pages that
are then compared with the pages backed up, byte for byte.

Disk, per round (a warm-up round, then ``repeats``), the two backends in an order that rotates
from round to round: **set** (a backup of the round's pages under keys of their own, so each is
written), **get, warm** (the files in the page cache) and **get, cold** (every file of both
backends written back and dropped from the page cache first). kvstrata has its disk tier
alone (no host DRAM tier of its own), so its pages come from its files as HiCacheFile's do.
Both backends are cleared after the round.

Pool: kvstrata with the pool as its only tier, against :class:`~kvstrata.pool.raw.RawPool`
(one ``batch_put_from`` and one ``batch_get_into`` of the same pages' bytes, from and into
registered memory, no kvstrata code on the path): **set** and **get**. The pool: ``--pool`` /
``$KVSTRATA_POOL``, else an embedded one for the run. Where the pool's deployment has a secret
(an embedded pool always does), kvstrata runs twice in the same rounds: sealed, as deployed (a
MAC over every byte each way: a Poly1305 pass, ~50 ms of CPU per 256 MiB, which the raw client
does not pay), and unsealed (the deployment without its secret: an xxh3 of every payload, checked).
SGLang's own Mooncake backend (``MooncakeStore``, zero-copy interface, no segment of its own)
runs in the same rounds too (not for MHA layer_first pools, which it refuses), shown beside
kvstrata for information (the goal is the raw client's); after a round its objects are removed by their prefix (its ``clear`` would remove
every object in the pool).

Goals: kvstrata at least 1.5x HiCacheFile's GB/s on the disk, at least 0.9x the raw client's
on the pool (paired ratios: the median over rounds of ours / theirs within a round).
"""

from __future__ import annotations

import dataclasses
import enum
import re
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvstrata.rounds import Environment, Rounds, Spread, check_rounds, rotated
from kvstrata.kv import load_geometry
from kvstrata.kv.groups import GroupKind
from kvstrata.pool.config import PoolConfig, RemoteMode
from kvstrata.pool.scoped import PoolSource, scoped_pool
from kvstrata.progress import NoProgress, Progress
from kvstrata.tensors import torch_dtype
from kvstrata.timing import VerificationError, drop_page_cache, warm_page_cache

DISK_GOAL = 1.5  # kvstrata / HiCacheFile, GB/s
POOL_GOAL = 0.9  # kvstrata / raw Mooncake, GB/s
LAYOUTS = ("page_first", "layer_first", "page_first_direct")


class Side(enum.Enum):
    DISK = "disk"
    POOL = "pool"


class Phase(enum.Enum):
    SET = "set"
    GET_WARM = "get, warm"
    GET_COLD = "get, cold"
    GET = "get"


class Subject(enum.Enum):
    OURS = "kvstrata"
    OURS_UNSEALED = "kvstrata, unsealed"  # the pool with no deployment secret: no MAC, a payload checksum
    FILE = "HiCacheFile"
    RAW = "raw Mooncake"
    SGLANG_MOONCAKE = "SGLang Mooncake"  # SGLang's own Mooncake backend (MooncakeStore), zero-copy interface


PHASES = {Side.DISK: (Phase.SET, Phase.GET_WARM, Phase.GET_COLD), Side.POOL: (Phase.SET, Phase.GET)}
BASELINE = {Side.DISK: Subject.FILE, Side.POOL: Subject.RAW}


@dataclass(frozen=True)
class SGLangBenchConfig:
    """What ``bench sglang`` moves.

    Attributes:
        model: a preset or config.json with one per-token KV group (MHA/GQA, or MLA).
        page_tokens: SGLang's page size (tokens a page; one kvstrata block).
        pages: pages a round moves (SGLang backs up and prefetches 128 at a time).
        layout: SGLang's host pool layout (``--hicache-mem-layout``).
        repeats: timed rounds after one warm-up, >= 3.
        workers: kvstrata's transfer threads.
        directory: where the disk backends' files go (None: the temp directory).
        pool: also the pool rows.
    """

    model: str = "llama-3-8b"
    page_tokens: int = 16
    pages: int = 128
    layout: str = "page_first"
    repeats: int = 5
    workers: int = 2
    directory: str | None = None
    pool: bool = True

    def __post_init__(self) -> None:
        check_rounds(self, "bench sglang", ("page_tokens", "pages", "workers"))
        if self.layout not in LAYOUTS:
            raise ValueError(f"bench sglang: layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")


@dataclass(frozen=True)
class Row:
    """One (side, phase): both subjects' median GB/s and pages/s, and the paired ratio."""

    side: Side
    phase: Phase
    ours_gbps: float
    theirs_gbps: float
    ours_pages_per_s: float
    theirs_pages_per_s: float
    ratio: Spread  # ours / theirs, GB/s, per round
    goal: float | None  # None: shown for information (no goal against this baseline)
    baseline: Subject
    subject: Subject = Subject.OURS

    @property
    def passed(self) -> bool:
        return self.goal is None or self.ratio.median >= self.goal

    @property
    def figure(self) -> str:
        """The row's name: its side (and kvstrata's configuration, if not the default) and phase."""
        sealed = "" if self.subject is Subject.OURS else f" ({self.subject.value.removeprefix('kvstrata, ')})"
        return f"{self.side.value}{sealed}: {self.phase.value}"


@dataclass(frozen=True)
class SGLangBenchReport:
    config: SGLangBenchConfig
    shape: str  # the pages, in words
    page_bytes: int
    rows: tuple[Row, ...]
    verified_bytes: int  # prefetched and compared byte for byte, every subject
    pool: PoolSource | None = None
    pool_skipped: str | None = None
    environment: Environment = field(default_factory=Environment.here)

    @property
    def goals_met(self) -> int:
        return sum(r.passed for r in self.rows if r.goal is not None)

    @property
    def goals(self) -> int:
        return sum(1 for r in self.rows if r.goal is not None)


def host_shape(config: SGLangBenchConfig) -> Any:
    """The host pool shape of ``config.model``'s one per-token group on one rank.

    Raises:
        ValueError: the model has several KV groups, or caches a state.
    """
    from kvstrata.integrations.sglang.harness import HostShape

    geometry = load_geometry(config.model)
    groups = geometry.groups
    if len(groups) != 1 or not groups[0].kind.per_token:
        raise ValueError(f"bench sglang: {config.model!r} needs one per-token KV group, it has "
                         f"{', '.join(g.kind.value for g in groups)}")
    group = groups[0]
    dtype = torch_dtype(group.dtype)
    if group.kind is GroupKind.MLA:
        rope = geometry.qk_rope_head_dim
        return HostShape.mla(group.num_layers, group.head_dim - rope, rope, config.page_tokens, dtype)
    return HostShape.mha(group.num_layers, group.kv_heads, group.head_dim, config.page_tokens, dtype)


class _Pages:
    """The host pool, its source pages (random) and destination pages (zeroed before each get)."""

    def __init__(self, shape: Any, layout: str, pages: int) -> None:
        from kvstrata.integrations.sglang import harness

        self.shape = shape
        self.harness = harness
        self.host = harness.host_pool(shape, layout, 2 * pages)
        self.pages = pages
        self.src = harness.fill_pages(self.host, pages, seed=7)
        self.dst = harness.zero_pages(self.host, pages)
        p = self.host.page_size
        self.src_slots = self.src[::p].tolist()
        self.dst_slots = self.dst[::p].tolist()
        self.want = [harness.page_bytes(self.host, s) for s in self.src_slots]
        self.page_bytes = self.want[0].numel()

    def zero_dst(self) -> None:
        for slot in self.dst_slots:
            self.host.get_data_page(slot, flat=False).zero_()

    def verify(self, who: Subject) -> int:
        for i, slot in enumerate(self.dst_slots):
            if not torch.equal(self.harness.page_bytes(self.host, slot), self.want[i]):
                raise VerificationError(f"bench sglang: {who.value} prefetched page {i} with other bytes than were "
                                        "backed up")
        return self.pages * self.page_bytes


def run_sglang_bench(config: SGLangBenchConfig, pool: PoolConfig | None = None,
                     progress: Progress | None = None) -> SGLangBenchReport:
    """Run the benchmark (see the module text); the pool rows on ``pool`` (None: an embedded one).

    Raises:
        VerificationError: a prefetch brought back other bytes than were backed up.
    """
    progress = progress or NoProgress()
    shape = host_shape(config)
    rounds_total = config.repeats + 1
    progress.start(1 + rounds_total * (len(PHASES[Side.DISK]) + (len(PHASES[Side.POOL]) if config.pool else 0)))
    pages = _Pages(shape, config.layout, config.pages)
    progress.step("host pool filled")
    rows: list[Row] = []
    verified = 0
    source: PoolSource | None = None
    skipped = None
    scratch = Path(tempfile.mkdtemp(prefix="kvstrata-bench-sglang-", dir=config.directory))
    try:
        rounds, moved = _disk_rounds(config, pages, scratch, progress)
        verified += moved
        rows += _rows(Side.DISK, rounds, config, pages)
        if config.pool:
            with scoped_pool(pool, _pool_segment_bytes(config, pages)) as source:
                rounds, moved = _pool_rounds(config, pages, source.config, progress)
                verified += moved
                rows += _rows(Side.POOL, rounds, config, pages)
        else:
            skipped = "not asked for (--no-pool)"
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    words = (f"{config.pages} pages of {config.page_tokens} tokens of {config.model} "
             f"({'MLA' if shape.is_mla else 'MHA'}, {shape.layers} layers), host layout {config.layout}")
    return SGLangBenchReport(config, words, pages.page_bytes, tuple(rows), verified, source, skipped)


def _disk_rounds(config: SGLangBenchConfig, pages: _Pages, scratch: Path, progress: Progress) -> tuple[Rounds, int]:
    h = pages.harness
    total = config.pages * pages.page_bytes
    ours_dir, file_dir = scratch / "kvstrata", scratch / "hicache-file"
    ours_extra = h.backend_extra(disk_dir=str(ours_dir), disk_bytes=2 * total + (1 << 20),
                                 workers=config.workers)
    with ExitStack() as stack:
        ours = h.create_backend(h.storage_config(pages.host, ours_extra, model_name="bench-sglang"), pages.host)
        stack.callback(ours.close)
        theirs = h.create_backend(h.storage_config(pages.host, {"file_storage_path": str(file_dir)},
                                                   model_name="bench-sglang"), pages.host, backend="file")
        backends = {Subject.OURS: (ours, h.Controller(ours, pages.host, True), _here),
                    Subject.FILE: (theirs, h.Controller(theirs, pages.host, False), _here)}

        def files() -> list[Path]:
            return [p for d in (ours_dir, file_dir) for p in d.rglob("*") if p.is_file() and not p.name.startswith(".")]

        return _rounds(config, pages, backends, PHASES[Side.DISK], progress, "disk", files)


def _pool_rounds(config: SGLangBenchConfig, pages: _Pages, pool: PoolConfig, progress: Progress) -> tuple[Rounds, int]:
    """kvstrata as the pool's deployment has it and, where that deployment seals values (a
    secret), also without the seal (the raw client's guarantees), beside the raw client and
    SGLang's own Mooncake backend."""
    from kvstrata.pool.network import Runner
    from kvstrata.pool.raw import RawPool

    h = pages.harness
    run = uuid.uuid4().hex[:12]
    configs = {Subject.OURS: pool}
    if pool.secret_file is not None:
        configs[Subject.OURS_UNSEALED] = dataclasses.replace(pool, secret_file=None)
    with ExitStack() as stack:
        backends = {}
        for subject, subject_pool in configs.items():
            pool_file = _pool_file(subject_pool)
            stack.callback(pool_file.unlink, missing_ok=True)
            extra = h.backend_extra(pool=str(pool_file), remote_bytes=2 * config.pages * pages.page_bytes,
                                    workers=config.workers)
            name = f"bench-sglang-{run}-{subject.name.lower()}"
            ours = h.create_backend(h.storage_config(pages.host, extra, model_name=name), pages.host)
            stack.callback(ours.close)
            backends[subject] = (ours, h.Controller(ours, pages.host, True), _here)
        raw = RawPool(pool, RemoteMode.TCP, [f"bench-sglang-raw-{run}-{i}" for i in range(config.pages)],
                      torch.stack(pages.want))
        stack.callback(raw.remove)
        backends[Subject.RAW] = (raw, None, _here)
        if not (config.layout == "layer_first" and not pages.shape.is_mla):  # SGLang's refuses MHA layer_first
            extra = {"master_server_address": pool.master, "protocol": pool.protocol, "global_segment_size": 0,
                     "metadata_server": pool.metadata_server, "local_hostname": pool.local_hostname,
                     "check_server": False}  # no segment of its own: its pages live in the pool's daemon, as ours
            # SGLang's client calls Mooncake on the caller's thread: in a pool of a network of its
            # own, every one of its calls runs on one thread that has entered it (timed there).
            net = Runner(pool.network)
            stack.callback(net.close)
            theirs = net.run(h.create_backend, h.storage_config(pages.host, extra, model_name=f"bench-sglang-{run}"),
                             pages.host, "mooncake")
            stack.callback(net.run, theirs.close)
            backends[Subject.SGLANG_MOONCAKE] = (theirs, h.Controller(theirs, pages.host, True), net.run)
        return _rounds(config, pages, backends, PHASES[Side.POOL], progress, "pool", lambda: [])


def _rounds(config: SGLangBenchConfig, pages: _Pages, backends: dict, phases: tuple[Phase, ...],
            progress: Progress, side: str, files: Callable[[], list[Path]]) -> tuple[Rounds, int]:
    rounds = Rounds()
    verified = 0
    subjects = list(backends)
    p = pages.host.page_size
    for r in range(config.repeats + 1):
        keys = pages.harness.page_keys(config.pages, p, seed=1000 + r)  # fresh: a set writes every page
        for phase in phases:
            for subject in rotated(subjects, r):
                backend, controller, run = backends[subject]
                seconds = run(_step, phase, subject, backend, controller, keys, pages, files)
                if phase is not Phase.SET:
                    verified += pages.verify(subject)
                if r:
                    rounds.add(f"{subject.name}.{phase.name}", seconds)
            progress.step(f"{side}: {phase.value}, " + (f"round {r}/{config.repeats}" if r else "warm-up"))
        for subject in subjects:
            backend, controller, run = backends[subject]
            if subject is Subject.SGLANG_MOONCAKE:  # its own clear() removes every object in the pool
                run(backend.store.remove_by_regex, f"^{re.escape(backend.config_prefix)}_", True)
            elif controller is not None:
                backend.clear()
    return rounds, verified


def _here(fn: Callable[..., Any], *args: Any) -> Any:
    """How a backend's calls run when nothing says where: on this thread."""
    return fn(*args)


def _step(phase: Phase, subject: Subject, backend: Any, controller: Any, keys: list[str], pages: _Pages,
          files: Callable[[], list[Path]]) -> float:
    """One subject's timed step (its preparation untimed)."""
    tokens = pages.pages * pages.host.page_size
    if subject is Subject.RAW:
        if phase is Phase.SET:
            return backend.put_s()
        pages.zero_dst()
        seconds = backend.get_s()  # verified by the raw client against the bytes it put
        _copy_raw(backend, pages)
        return seconds
    if phase is Phase.SET:
        start = time.perf_counter()
        done = controller.backup(keys, pages.src)
        seconds = time.perf_counter() - start
        if done != tokens:
            raise VerificationError(f"bench sglang: {subject.value} backed up {done} of {tokens} tokens")
        return seconds
    pages.zero_dst()
    if phase is Phase.GET_COLD:
        drop_page_cache(files())
    elif phase is Phase.GET_WARM:
        warm_page_cache(files())
    start = time.perf_counter()
    got = controller.prefetch(keys, pages.dst)
    seconds = time.perf_counter() - start
    if got != pages.pages:
        raise VerificationError(f"bench sglang: {subject.value} prefetched {got} of {pages.pages} pages")
    return seconds


def _copy_raw(raw: Any, pages: _Pages) -> None:
    """The raw client's bytes into the destination pages (untimed), so every subject is verified alike."""
    for i, slot in enumerate(pages.dst_slots):
        pages.host.set_from_flat_data_page(slot, raw.dst[i].view(pages.host.dtype))


def _rows(side: Side, rounds: Rounds, config: SGLangBenchConfig, pages: _Pages) -> list[Row]:
    pairs = [(ours, BASELINE[side]) for ours in (Subject.OURS, Subject.OURS_UNSEALED)]
    pairs += [(Subject.OURS, Subject.SGLANG_MOONCAKE)] if side is Side.POOL else []
    rows = []
    for subject, baseline in pairs:
        for phase in PHASES[side]:
            ours, theirs = rounds.seconds.get(f"{subject.name}.{phase.name}"), rounds.seconds.get(f"{baseline.name}.{phase.name}")
            if ours is None or theirs is None:
                continue
            ratios = [t / o for o, t in zip(ours, theirs)]  # GB/s ours over theirs: their time over ours
            o, t = statistics.median(ours), statistics.median(theirs)
            goal = None if baseline is Subject.SGLANG_MOONCAKE else DISK_GOAL if side is Side.DISK else POOL_GOAL
            size = config.pages * pages.page_bytes
            rows.append(Row(side, phase, size / o / 1e9, size / t / 1e9, config.pages / o, config.pages / t,
                            Spread.of(ratios), goal, baseline, subject))
    return rows


def _pool_segment_bytes(config: SGLangBenchConfig, pages: _Pages) -> int:
    return max(1 << 30, 6 * config.pages * pages.page_bytes + (256 << 20))  # four subjects' pages at once, and room


def _pool_file(pool: PoolConfig) -> Path:
    """``pool`` as a TOML file for the backend's ``kvstrata_pool`` option."""
    import json

    lines = [f"{k} = {json.dumps(v)}" for k, v in pool.to_json().items() if v is not None]
    handle = tempfile.NamedTemporaryFile("w", suffix=".toml", prefix="kvstrata-bench-sglang-pool-", delete=False)
    with handle:
        handle.write("[pool]\n" + "\n".join(lines) + "\n")
    return Path(handle.name)
