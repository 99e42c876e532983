"""``kvstrata bench cache``: store and restore GB/s of each tier of ``TieredCache``, beside
plain copies, plain file I/O and (when importable) LMCache, all in one run on the same bytes.

The bytes: KV of a real model's geometry (Llama-3-8B by default, bf16, one TP rank) split into
``blocks`` blocks; 512 MiB as 16 blocks is 256 tokens of 32 layers per block, 32 MiB. The KV
is random, so nothing compresses or dedupes, and every restore is verified bit-exact.

Each round runs these phases, in order (the cache's state carries from one to the next); the
steps within a phase run in an order that rotates from round to round (``kvstrata.bench.timing``):

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

Where there is no CUDA the device tier, and the "device" side of every copy, is CPU memory.
"""

from __future__ import annotations

import os
import platform
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kvstrata.bench import lmcache as lmcache_side
from kvstrata.bench.baselines import Buffers, RawFile, copy_s
from kvstrata.bench.goals import as_json, cache_goals
from kvstrata.bench.kvdata import block_layout, random_kv
from kvstrata.bench.ours import OursCache
from kvstrata.bench.timing import NoProgress, Progress, Rounds, rotated
from kvstrata.bench.lookup import hash_and_lookup_ms
from kvstrata.kv.layout import KVLayout

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
        workers: the cache's transfer engine threads.
        directory: where scratch files go (a temporary directory inside it, removed after);
            None: the system's temporary directory.
        lmcache: measure LMCache too, when it imports.
        lookup_repeats: timed runs of each hash+lookup variant.
    """

    size_bytes: int = 512 * MIB
    blocks: int = 16
    model: str = "llama-3-8b"
    repeats: int = 5
    workers: int = 2
    directory: str | None = None
    lmcache: bool = True
    lookup_repeats: int = 50

    def __post_init__(self) -> None:
        for name in ("size_bytes", "blocks", "workers", "lookup_repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"bench cache: {name} must be >= 1, got {getattr(self, name)}")
        if self.repeats < 3:
            raise ValueError(f"bench cache: repeats must be >= 3 (a median and a spread), got {self.repeats}")


def bench_layout(config: CacheBenchConfig) -> KVLayout:
    """The block layout: ``config.blocks`` equal blocks of the model's KV make ``size_bytes``.

    Raises:
        ValueError: the size is not a whole number of tokens per block.
    """
    return block_layout(config.model, config.size_bytes, config.blocks, "bench cache")


def run_cache_bench(config: CacheBenchConfig, progress: Progress | None = None) -> dict[str, Any]:
    """Run the benchmark; returns the report (JSON-ready), goals evaluated.

    Raises:
        VerificationError: some step moved other bytes than it was given.
    """
    progress = progress or NoProgress()
    layout = bench_layout(config)
    lmcache_ok, lmcache_note = lmcache_side.availability() if config.lmcache else (False, "not requested")
    rounds_total = config.repeats + 1
    progress.start(rounds_total * len(PHASES) + len(LOOKUP_BLOCK_SIZES) + 1)

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
        progress.step("set up")
        rounds = Rounds()
        for r in range(rounds_total):
            kept = Rounds() if r == 0 else rounds  # round 0 warms up: its samples are dropped
            for phase in PHASES:
                for name, step in rotated(phase.steps(ours, buffers, raw, lmc), r):
                    kept.add(name, step())
                progress.step(f"round {r}/{config.repeats}: {phase.name}" if r else f"warm-up: {phase.name}")
            ours.reset()
            if lmc is not None:
                lmc.reset()
        lookups = {}
        for block_size in LOOKUP_BLOCK_SIZES:
            lookups[block_size] = hash_and_lookup_ms(LOOKUP_TOKENS, block_size, config.lookup_repeats)
            progress.step(f"hash+lookup, block {block_size}")
        verified = {"ours_bytes": ours.verified_bytes, "lmcache_bytes": lmc.verified_bytes if lmc else 0}
    finally:
        if lmc is not None:
            lmc.close()
        if ours is not None:
            ours.close()
        shutil.rmtree(scratch, ignore_errors=True)

    report = _report(config, layout, device, rounds, lookups, verified, lmcache_ok, lmcache_note)
    report["goals"] = as_json(cache_goals(report))
    return report


# --- phases -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Phase:
    name: str
    steps: Callable[[OursCache, Buffers, RawFile, Any], list[Step]]


def _lmc(lmc: Any, name: str, fn: Callable[[], float]) -> list[Step]:
    return [] if lmc is None else [(name, fn)]


PHASES = (
    Phase("device store", lambda o, b, raw, lmc: [
        ("ours.device.store", o.device_store_s),
        ("copy.device_to_device", lambda: copy_s(b.device_dst, b.device_data)),
    ]),
    Phase("device hit", lambda o, b, raw, lmc: [("ours.device.hit", o.device_hit_s)]),
    Phase("host store", lambda o, b, raw, lmc: [
        ("ours.host.store", o.host_store_s),
        ("copy.device_to_host", lambda: copy_s(b.host_dst, b.device_data)),
        *_lmc(lmc, "lmcache.host.store", lambda: lmc.host_store_s()),
    ]),
    Phase("host restore", lambda o, b, raw, lmc: [
        ("ours.host.restore", o.host_restore_s),
        ("copy.host_to_device", lambda: copy_s(b.device_dst, b.host_data)),
        *_lmc(lmc, "lmcache.host.retrieve", lambda: lmc.host_retrieve_s(b.device_dst)),
    ]),
    Phase("disk store", lambda o, b, raw, lmc: [
        ("ours.disk.store", o.disk_store_s),
        ("raw.write", raw.write_s),
        *_lmc(lmc, "lmcache.disk.store", lambda: lmc.disk_store_s()),
    ]),
    Phase("disk restore, cold", lambda o, b, raw, lmc: [
        ("ours.disk.restore_cold", lambda: o.disk_restore_s(cold=True)),
        ("raw.read_cold", lambda: raw.read_s(cold=True)),
        *_lmc(lmc, "lmcache.disk.retrieve_cold", lambda: lmc.disk_retrieve_s(b.device_dst, cold=True)),
    ]),
    Phase("disk restore, warm", lambda o, b, raw, lmc: [
        ("ours.disk.restore_warm", lambda: o.disk_restore_s(cold=False)),
        ("raw.read_warm", lambda: raw.read_s(cold=False)),
        ("copy.host_to_device.disk_warm", lambda: copy_s(b.device_dst, b.host_data)),
        *_lmc(lmc, "lmcache.disk.retrieve_warm", lambda: lmc.disk_retrieve_s(b.device_dst, cold=False)),
    ]),
    Phase("disk tier alone", lambda o, b, raw, lmc: [
        ("ours.disk.tier_read_cold", lambda: o.disk_read_s(cold=True, dst=b.host_dst)),
        ("ours.disk.tier_read_warm", lambda: o.disk_read_s(cold=False, dst=b.host_dst)),
    ]),
)
# Rotation runs the disk tier's warm read first on odd rounds: it is warm all the same (the
# phase before read every file), and the cold read drops the page cache itself.


# --- the report ---------------------------------------------------------------------------------


def _report(
    config: CacheBenchConfig,
    layout: KVLayout,
    device: torch.device,
    rounds: Rounds,
    lookups: dict[int, dict],
    verified: dict[str, int],
    lmcache_ok: bool,
    lmcache_note: str,
) -> dict[str, Any]:
    size = config.size_bytes

    def gbps(name: str) -> float:
        return rounds.gbps(name, size)["gbps"]

    def runs(*names: str) -> dict[str, list[float]]:
        return {name: rounds.gbps(name, size)["runs_gbps"] for name in names}

    host = {
        "store_gbps": gbps("ours.host.store"),
        "restore_gbps": gbps("ours.host.restore"),
        "baseline_gbps": gbps("copy.host_to_device"),
        "store_baseline_gbps": gbps("copy.device_to_host"),
        "store_ratio": rounds.ratio("ours.host.store", "copy.device_to_host"),
        "restore_ratio": rounds.ratio("ours.host.restore", "copy.host_to_device"),
        "baseline": "plain torch copy device<->host into a pre-faulted buffer",
        "runs_gbps": runs("ours.host.store", "ours.host.restore", "copy.device_to_host", "copy.host_to_device"),
    }
    host["ratio"] = host["restore_ratio"]
    cold = {
        "restore_gbps": gbps("ours.disk.restore_cold"),
        "baseline_gbps": gbps("raw.read_cold"),
        "ratio": rounds.ratio("ours.disk.restore_cold", "raw.read_cold"),
        "tier_read_gbps": gbps("ours.disk.tier_read_cold"),
        "tier_read_ratio": rounds.ratio("ours.disk.tier_read_cold", "raw.read_cold"),
        "baseline": "plain readinto of one file, page cache dropped",
    }
    warm = {
        "restore_gbps": gbps("ours.disk.restore_warm"),
        "baseline_gbps": gbps("copy.host_to_device.disk_warm"),
        "ratio": rounds.ratio("ours.disk.restore_warm", "copy.host_to_device.disk_warm"),
        "raw_read_gbps": gbps("raw.read_warm"),
        "raw_read_ratio": rounds.ratio("ours.disk.restore_warm", "raw.read_warm"),
        "tier_read_gbps": gbps("ours.disk.tier_read_warm"),
        "tier_read_ratio": rounds.ratio("ours.disk.tier_read_warm", "raw.read_warm"),
        "baseline": "plain torch copy host -> device (raw_read: plain readinto from the page cache)",
    }
    disk = {
        "restore_gbps": cold["restore_gbps"],
        "baseline_gbps": cold["baseline_gbps"],
        "ratio": cold["ratio"],
        "store_gbps": gbps("ours.disk.store"),
        "store_baseline_gbps": gbps("raw.write"),
        "store_ratio": rounds.ratio("ours.disk.store", "raw.write"),
        "cold": cold,
        "warm": warm,
        "note": "restore = load() of blocks on disk only (disk -> host -> device); tier_read = "
        "DiskTier.read_into alone (disk -> host); top-level restore figures are the cold ones",
        "runs_gbps": runs(*(n for n in rounds.seconds if n.startswith(("ours.disk.", "raw.")))),
    }
    device_tier = {
        "store_gbps": gbps("ours.device.store"),
        "baseline_gbps": gbps("copy.device_to_device"),
        "ratio": rounds.ratio("ours.device.store", "copy.device_to_device"),
        "hit_ms": rounds.ms("ours.device.hit")["ms"],
        "note": "store = store() into the device tier; hit = load() of blocks already there (pins, no copy)",
        "runs_gbps": runs("ours.device.store", "copy.device_to_device"),
    }
    report: dict[str, Any] = {
        "config": {
            **asdict(config),
            "device": str(device),
            "layout": layout.describe(),
            "block_tokens": layout.block_tokens,
            "block_bytes": layout.block_bytes,
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
            "units": "GB/s, 1 GB = 1e9 bytes; ratio = median over rounds of ours / baseline in the same round",
        },
        "tiers": {"host": host, "disk": disk, "device": device_tier},
        "baselines": {
            name: rounds.gbps(name, size) for name in rounds.seconds if name.startswith(("copy.", "raw."))
        },
        "lmcache": _lmcache_report(rounds, size, lmcache_ok, lmcache_note),
        "lookup_128k_ms": {str(bs): lookups[bs]["ours_ms"] for bs in LOOKUP_BLOCK_SIZES},
        "lookup_128k": {str(bs): lookups[bs] for bs in LOOKUP_BLOCK_SIZES},
        "verified": {
            **verified,
            "bit_exact": True,  # a mismatch raises VerificationError: a report exists only if all matched
            "what": "every restore (ours and LMCache's) and plain read compared byte for byte with the KV stored",
        },
    }
    return report


def _lmcache_report(rounds: Rounds, size: int, ok: bool, note: str) -> dict[str, Any]:
    if not ok:
        return {"available": False, "reason": note}

    def figure(name: str, baseline: str, ours: str) -> dict[str, Any]:
        return {
            **rounds.gbps(name, size),
            "baseline_ratio": rounds.ratio(name, baseline),
            "ours_over_lmcache": rounds.ratio(ours, name),
        }

    return {
        "available": True,
        "version": note,
        "host": {
            "store": figure("lmcache.host.store", "copy.device_to_host", "ours.host.store"),
            "retrieve": figure("lmcache.host.retrieve", "copy.host_to_device", "ours.host.restore"),
        },
        "disk": {
            "store": figure("lmcache.disk.store", "raw.write", "ours.disk.store"),
            "retrieve_cold": figure("lmcache.disk.retrieve_cold", "raw.read_cold", "ours.disk.restore_cold"),
            "retrieve_warm": figure(
                "lmcache.disk.retrieve_warm", "copy.host_to_device.disk_warm", "ours.disk.restore_warm"
            ),
        },
        "setup": "standalone LMCacheEngine on CPU, chunk = one block, a CPU-tensor GPUConnectorInterface adapter",
    }

