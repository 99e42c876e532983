"""``kvstrata bench cache``: store and restore GB/s of each tier of ``TieredCache``, beside
plain copies, plain file I/O and (when importable) LMCache, all in one run on the same bytes.

The bytes: KV of a real model's geometry (Llama-3-8B by default, bf16, one TP rank) split into
``blocks`` blocks; 512 MiB as 16 blocks is 256 tokens of 32 layers per block, 32 MiB. The KV
is random, so nothing compresses or dedupes, and every restore is verified bit-exact.

Each round runs these phases, in order (the cache's state carries from one to the next); the
steps within a phase run in an order that rotates from round to round (``kvstrata.rounds``):

============  =====================================  ==========================  =====================
phase         ours (``TieredCache``)                 baseline                    LMCache
============  =====================================  ==========================  =====================
device store  ``store()`` into the device tier       copy device -> device       -
device hit    ``load()`` of device blocks (pins)     -                           -
host store    device tier -> host (eviction)         copy device -> host         ``store()``
host restore  ``load()`` host -> device              copy host -> device         ``retrieve()``
disk store    host -> disk files (eviction)          plain ``write`` of a file   async write to disk
disk cold     ``load()`` disk -> host -> device      cold ``readinto``           ``retrieve()``, cold
disk warm     the same, page cache warm              copy host -> device;        ``retrieve()``, warm
                                                     warm ``readinto``
disk tier     ``DiskTier.read_into`` -> host,        (the reads above)           -
              cold then warm
============  =====================================  ==========================  =====================

Every disk step (a store to disk, a cold read) is given the ballast first, untimed
(``kvstrata.calibrate.ballast``): a file of its size read and dropped, so its page cache comes out
of memory freed a moment before whichever step ran before it. Without it, on the VM measured,
the second cold read of a round ran ~3x slower than the first, ours or the baseline.

Where there is no CUDA the device tier, and the "device" side of every copy, is CPU memory.

``tp_readers`` (``--tp-readers 1,2,4,8``): after the rounds above, the same KV restored at each
reader TP size as head-sliced and as TP-matched blocks, and the hash+lookup of a 128K-token
prompt by TP=1 and TP=t head-sliced instances (``kvstrata.bench.tpread``).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvstrata.bench import lmcache as lmcache_side
from kvstrata.bench import tpread
from kvstrata.bench.baselines import Buffers, RawFile, copy_s
from kvstrata.bench.cache_report import CacheBenchReport, CacheRun, CacheVerified, cache_report
from kvstrata.calibrate.kvdata import KVSetup, block_layout, random_kv
from kvstrata.bench.ours import OursCache
from kvstrata.bench.lookup import LookupTimes, hash_and_lookup_ms
from kvstrata.rounds import Environment, Rounds, check_rounds, rotated
from kvstrata.bench.tpread_report import tp_report
from kvstrata.calibrate.ballast import Ballast
from kvstrata.kv.layout import KVLayout
from kvstrata.progress import NoProgress, Progress
from kvstrata.report import OMIT

MIB = 1 << 20
LOOKUP_TOKENS = 131_072
LOOKUP_BLOCK_SIZES = (256, 16)

Step = tuple[str, Callable[[], float]]  # (figure name, timed step returning seconds)


@dataclass(frozen=True)
class CacheBenchConfig:
    """What ``kvstrata bench cache`` measures.

    Attributes:
        size_bytes: KV bytes moved by every step.
        blocks: how many blocks they are cut into (tokens per block follow from the model).
        model: a model preset or config (see ``kvstrata kv-size``).
        repeats: timed rounds (a warm-up round runs first, untimed); at least 3.
        workers: the cache's transfer worker threads.
        directory: where scratch files go (a temporary directory inside it, removed after);
            None: the system's temporary directory.
        lmcache: measure LMCache too, when it imports.
        lookup_repeats: timed rounds of the hash+lookup variants (interleaved: ``kvstrata.bench.lookup``).
        tp_readers: reader TP sizes to restore head-sliced blocks at, beside TP-matched ones
            (``kvstrata.bench.tpread``); empty: not measured. In the report's ``tp_readers``, not its config.
    """

    size_bytes: int = 512 * MIB
    blocks: int = 16
    model: str = "llama-3-8b"
    repeats: int = 5
    workers: int = 2
    directory: str | None = None
    lmcache: bool = True
    lookup_repeats: int = 50
    tp_readers: tuple[int, ...] = field(default=(), metadata=OMIT)

    def __post_init__(self) -> None:
        check_rounds(self, "bench cache", ("size_bytes", "blocks", "workers", "lookup_repeats"))
        bad = [tp for tp in self.tp_readers if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1]
        if bad or len(set(self.tp_readers)) != len(self.tp_readers):
            raise ValueError(f"bench cache: tp_readers must be distinct TP sizes >= 1, got {list(self.tp_readers)}")


def bench_layout(config: CacheBenchConfig) -> KVLayout:
    """The block layout: ``config.blocks`` equal blocks of the model's KV make ``size_bytes``.

    Raises:
        ValueError: the size is not a whole number of tokens per block.
    """
    return block_layout(config.model, config.size_bytes, config.blocks, "bench cache")


def run_cache_bench(config: CacheBenchConfig, progress: Progress | None = None) -> CacheBenchReport:
    """Run the benchmark; returns the report, goals judged.

    Raises:
        VerificationError: some step moved other bytes than it was given.
    """
    progress = progress or NoProgress()
    layout = bench_layout(config)
    slicing = tpread.check_readers(config.model, config.tp_readers) if config.tp_readers else None
    lmcache_ok, lmcache_note = lmcache_side.availability() if config.lmcache else (False, "not requested")
    rounds_total = config.repeats + 1
    tp_steps = tpread.progress_steps(config.tp_readers, config.repeats, LOOKUP_BLOCK_SIZES) if slicing else 0
    progress.start(rounds_total * len(PHASES) + len(LOOKUP_BLOCK_SIZES) + 1 + tp_steps)

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    # kv_bytes: [layers, kv, tokens, kv_heads, head_dim * itemsize], random.
    tokens, kv_bytes = random_kv(layout, config.blocks, device)

    scratch = Path(tempfile.mkdtemp(prefix="kvstrata-bench-", dir=config.directory))
    ours = lmc = None
    try:
        buffers = Buffers(kv_bytes)
        raw = RawFile(scratch / "plain.bin", buffers)
        ours = OursCache(layout, kv_bytes, tokens, scratch / "ours", config.workers, device)
        if lmcache_ok:
            lmc = lmcache_side.LMCacheSide(layout, kv_bytes, tokens, scratch / "lmcache", rounds_total)
        sides = Sides(ours, buffers, raw, lmc, Ballast(scratch / "ballast.bin", config.size_bytes))
        progress.step("set up")
        rounds = Rounds()
        for r in range(rounds_total):
            kept = Rounds() if r == 0 else rounds  # round 0 warms up: its samples are dropped
            for phase in PHASES:
                for name, step in rotated(phase.steps(sides), r):
                    kept.add(name, step())
                progress.step(f"round {r}/{config.repeats}: {phase.name}" if r else f"warm-up: {phase.name}")
            ours.reset()
            if lmc is not None:
                lmc.reset()
        lookups: dict[int, LookupTimes] = {}
        for block_size in LOOKUP_BLOCK_SIZES:
            lookups[block_size] = hash_and_lookup_ms(LOOKUP_TOKENS, block_size, config.lookup_repeats)
            progress.step(f"hash+lookup, block {block_size}")
        verified = CacheVerified(ours.verified_bytes, lmc.verified_bytes if lmc else 0)
        tp = None
        if slicing is not None:
            ours.close()  # its tiers' memory back before the ranks' caches take theirs
            data = tpread.TPData(tpread.model_group(config.model), slicing, layout.block_tokens, tokens, kv_bytes)
            tp_run = tpread.run_tp_readers(data, config.tp_readers, config.repeats, config.workers,
                                           config.lookup_repeats, LOOKUP_BLOCK_SIZES, LOOKUP_TOKENS, scratch,
                                           sides.ballast, device, progress)
            tp = tp_report(data, config.tp_readers, tp_run)
    finally:
        if lmc is not None:
            lmc.close()
        if ours is not None:
            ours.close()
        shutil.rmtree(scratch, ignore_errors=True)

    run = CacheRun(config, KVSetup.of(layout, device), Environment.here())
    return cache_report(run, rounds, lookups, verified, lmcache_note if lmcache_ok else None, lmcache_note, tp)


# --- phases -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sides:
    """What a phase's steps run on: ours, the plain baselines, LMCache (None when it does not
    run), and the ballast every disk step is given first."""

    ours: OursCache
    buffers: Buffers
    raw: RawFile
    lmc: Any
    ballast: Ballast

    def disk(self, step: Callable[[], float]) -> Callable[[], float]:
        """``step`` once the ballast has been read and dropped (untimed): its page cache comes
        out of memory freed a moment before, whichever step ran before it (``kvstrata.calibrate.ballast``)."""

        def after_release() -> float:
            self.ballast.release()
            return step()

        return after_release


@dataclass(frozen=True)
class Phase:
    name: str
    steps: Callable[[Sides], list[Step]]


def _lmc(lmc: Any, name: str, fn: Callable[[], float]) -> list[Step]:
    return [] if lmc is None else [(name, fn)]


PHASES = (
    Phase("device store", lambda s: [
        ("ours.device.store", s.ours.device_store_s),
        ("copy.device_to_device", lambda: copy_s(s.buffers.device_dst, s.buffers.device_data)),
    ]),
    Phase("device hit", lambda s: [("ours.device.hit", s.ours.device_hit_s)]),
    Phase("host store", lambda s: [
        ("ours.host.store", s.ours.host_store_s),
        ("copy.device_to_host", lambda: copy_s(s.buffers.host_dst, s.buffers.device_data)),
        *_lmc(s.lmc, "lmcache.host.store", lambda: s.lmc.host_store_s()),
    ]),
    Phase("host restore", lambda s: [
        ("ours.host.restore", s.ours.host_restore_s),
        ("copy.host_to_device", lambda: copy_s(s.buffers.device_dst, s.buffers.host_data)),
        *_lmc(s.lmc, "lmcache.host.retrieve", lambda: s.lmc.host_retrieve_s(s.buffers.device_dst)),
    ]),
    Phase("disk store", lambda s: [
        ("ours.disk.store", s.disk(s.ours.disk_store_s)),
        ("raw.write", s.disk(s.raw.write_s)),
        *_lmc(s.lmc, "lmcache.disk.store", s.disk(lambda: s.lmc.disk_store_s())),
    ]),
    Phase("disk restore, cold", lambda s: [
        ("ours.disk.restore_cold", s.disk(lambda: s.ours.disk_restore_s(cold=True))),
        ("raw.read_cold", s.disk(lambda: s.raw.read_s(cold=True))),
        *_lmc(s.lmc, "lmcache.disk.retrieve_cold",
              s.disk(lambda: s.lmc.disk_retrieve_s(s.buffers.device_dst, cold=True))),
    ]),
    Phase("disk restore, warm", lambda s: [
        ("ours.disk.restore_warm", lambda: s.ours.disk_restore_s(cold=False)),
        ("raw.read_warm", lambda: s.raw.read_s(cold=False)),
        ("copy.host_to_device.disk_warm", lambda: copy_s(s.buffers.device_dst, s.buffers.host_data)),
        *_lmc(s.lmc, "lmcache.disk.retrieve_warm", lambda: s.lmc.disk_retrieve_s(s.buffers.device_dst, cold=False)),
    ]),
    Phase("disk tier alone", lambda s: [
        ("ours.disk.tier_read_cold", s.disk(lambda: s.ours.disk_read_s(cold=True, dst=s.buffers.host_dst))),
        ("ours.disk.tier_read_warm", lambda: s.ours.disk_read_s(cold=False, dst=s.buffers.host_dst)),
    ]),
)
# Rotation runs the disk tier's warm read first on odd rounds: it is warm all the same (the
# phase before read every file), and the cold read drops the page cache itself. Warm steps get
# no ballast: they take no page cache.
