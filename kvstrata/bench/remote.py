"""``kvstrata bench remote``: store and restore GB/s through the remote tier beside raw Mooncake
calls on the same bytes, in the same run, for each way into the pool; plus time to first byte.

The bytes: KV of a real model's geometry (Llama-3-8B by default, bf16, one TP rank), 256 MiB
as 8 blocks of 32 MiB (256 tokens of 32 layers each), random, verified bit-exact on every
restore. The pool: the one configured (``--pool FILE`` or ``$KVSTRATA_POOL``), else an embedded
one (a master and a pool daemon on loopback, in a temporary run directory, stopped at the end).

Cross-process: every object lives in the pool daemon's process. This process joins with a
segment of 0 bytes, ours and raw alike, so every byte stored or restored crosses into the
daemon and back: over the pool's transport in TCP mode (via the master), and in SHM mode by
the daemon on this host copying between its segment and shared memory this process maps.

Before the first mode, most of the pool's segment is faulted in (``RawPool.prefault``: the
daemon maps it lazily and places each round's objects at new offsets). Per mode (``tcp``,
``shm``), one warm-up round (untimed: it faults in the shared memory the daemon maps and every
buffer's first use), then ``repeats`` rounds of three phases, the competing steps of each in
an order that rotates from round to round (``kvstrata.rounds``):

==============  ===============================================  ===============================
phase           ours                                             raw (``kvstrata.pool.raw``)
==============  ===============================================  ===============================
store           ``RemoteTier.write_many`` of every block (batched one ``batch_put_from`` of every
                puts, pipelined), on the transfer worker, from   object, from registered memory
                a host tier's (unregistered) memory, copied
                through the tier's own registered staging
restore         ``RemoteTier.read_many_into`` (batched gets),    one ``batch_get_into`` of every
                the same way; and ``TieredCache.load`` of blocks object into registered memory
                in the pool only: direct (pool -> device) and
                staged (pool -> host -> device)
first byte      a one-block restore through the tier;            ``batch_get_into`` of one
                ``TieredCache.lookup`` that must ask the pool    object; ``batch_is_exist``
                ``exists`` (``latency_samples`` of each)         of every object
==============  ===============================================  ===============================

GB/s count the blocks' bytes (both sides also move a 128-byte value header per object).
During the warm-up round the bytes received on the loopback interface are counted per step
(``loopback_bytes``): every byte of a TCP-mode step crosses a socket, none of an SHM-mode step
(measured on the 2-vCPU development VM, Mooncake 0.3.13.post1: 256.3 to 256.9 MiB per 256 MiB
store or restore over TCP, ours and raw alike; 0.0 MiB over SHM).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass

import torch

from kvstrata.calibrate.kvdata import MIB, KVSetup, block_layout, block_of, random_kv
from kvstrata.calibrate.ours_remote import OursRemote
from kvstrata.calibrate.poolcache import PoolReader
from kvstrata.bench.remote_report import (
    ModeFigures,
    RemoteBenchReport,
    RemoteRun,
    mode_figures,
    remote_report,
)
from kvstrata.rounds import Environment, Rounds, Skipped, check_rounds, rotated
from kvstrata.cache import CacheConfig
from kvstrata.index.keys import block_keys
from kvstrata.kv.layout import KVLayout
from kvstrata.media import FetchPath
from kvstrata.pool.config import PoolConfig, RemoteMode, read_secret
from kvstrata.pool.raw import RawPool
from kvstrata.pool.scoped import scoped_pool
from kvstrata.progress import NoProgress, Progress

Step = tuple[str, Callable[[], float]]  # (figure name, timed step returning seconds)
PHASES = ("store", "restore", "first byte")


@dataclass(frozen=True)
class RemoteBenchConfig:
    """What ``kvstrata bench remote`` measures.

    Attributes:
        size_bytes: KV bytes moved by every store and restore.
        blocks: how many blocks (pool objects) they are cut into.
        model: a model preset or config (see ``kvstrata kv-size``).
        repeats: timed rounds per mode (a warm-up round runs first, untimed); at least 3.
        workers: the transfer worker's byte movers, ours (the cache's default is 2).
        modes: the ways into the pool to measure.
        latency_samples: one-block restores and lookups timed per round and side.
    """

    size_bytes: int = 256 * MIB
    blocks: int = 8
    model: str = "llama-3-8b"
    repeats: int = 5
    workers: int = 2
    modes: tuple[RemoteMode, ...] = (RemoteMode.TCP, RemoteMode.SHM)
    latency_samples: int = 5

    def __post_init__(self) -> None:
        check_rounds(self, "bench remote", ("size_bytes", "blocks", "workers", "latency_samples"))
        if not self.modes or any(not isinstance(m, RemoteMode) for m in self.modes):
            raise ValueError(f"bench remote: modes must be RemoteModes, got {self.modes!r}")

    def layout(self) -> KVLayout:
        return block_layout(self.model, self.size_bytes, self.blocks, "bench remote")

    def pool_segment_bytes(self) -> int:
        """An embedded pool's segment: the objects of ours (sealed, unsealed, encrypted) and raw's
        at once, with room to spare."""
        return 5 * self.size_bytes + 64 * MIB

    def prefault_bytes(self) -> int:
        """How much of the pool's segment to fault in before the first mode's warm-up: most
        of the embedded pool's, staying under the master's eviction watermark (0.9)."""
        return int(0.85 * self.pool_segment_bytes())


def run_remote_bench(
    config: RemoteBenchConfig, pool: PoolConfig | None = None, progress: Progress | None = None
) -> RemoteBenchReport:
    """Run the benchmark on ``pool`` (None: an embedded one); returns the report, goals judged.

    Raises:
        VerificationError: some restore moved other bytes than were stored.
        PoolUnavailable, PoolError: the pool could not be reached or started.
    """
    progress = progress or NoProgress()
    layout = config.layout()
    rounds_total = config.repeats + 1
    progress.start(1 + len(config.modes) * (2 + rounds_total * len(PHASES)))
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    tokens, kv_bytes = random_kv(layout, config.blocks, device)  # [layers, kv, tokens, kv_heads, hd * item]
    blocks = torch.stack([block_of(kv_bytes, layout, i).cpu() for i in range(config.blocks)])
    run_id = uuid.uuid4().hex[:12]  # object names of this run only: a shared pool has others
    modes: dict[RemoteMode, ModeFigures | Skipped] = {}
    prefault = config.prefault_bytes()  # once: every mode uses the same segment
    with scoped_pool(pool, config.pool_segment_bytes()) as source:
        progress.step("pool ready")
        for mode in config.modes:
            if mode is RemoteMode.SHM and not source.config.daemon:
                modes[mode] = Skipped("the pool has no daemon on this host (SHM mode needs one)")
                progress.step(f"{mode.value}: skipped")
                continue
            base = CacheConfig(
                layout=layout,
                model_id=f"kvstrata-bench-remote/{run_id}/{mode.value}",
                device_bytes=config.size_bytes,
                host_bytes=0,
                workers=config.workers,
                device=str(device),
                pool=source.config,
                remote_bytes=config.size_bytes,
                remote_mode=mode,
            )
            rounds, verified, faulted, loopback = _run_mode(
                config, mode, base, tokens, kv_bytes, blocks, prefault, progress
            )
            modes[mode] = mode_figures(rounds, verified, config, mode, faulted, loopback,
                                       sealed=read_secret(source.config) is not None)
            prefault = 0
    run = RemoteRun(config, KVSetup.of(layout, device), source, Environment.here())
    return remote_report(run, modes)


def _run_mode(
    config: RemoteBenchConfig,
    mode: RemoteMode,
    base: CacheConfig,
    tokens: list[int],
    kv_bytes: torch.Tensor,
    blocks: torch.Tensor,
    prefault: int,
    progress: Progress,
) -> tuple[Rounds, int, int, dict[str, int]]:
    """The rounds of one mode, the bytes verified, the bytes of the pool prefaulted, and the
    loopback bytes of each warm-up step."""
    namespace = base.namespace()
    with ExitStack() as sides:  # every side closed (objects removed, clients gone), however the run ends
        keys, secret = block_keys(tokens, namespace), read_secret(base.pool)
        # Ours seals with the pool's secret (a MAC; the cache reads ours' objects, whether it
        # encrypts or not: CacheConfig's default with a secret is to encrypt); the same tier
        # unsealed and encrypted, under names of their own, price the seal and the encryption.
        ours = OursRemote(base.layout, base.pool, mode, keys, blocks, namespace.tag, config.workers, secret)
        sides.callback(ours.close)
        plain = OursRemote(base.layout, base.pool, mode, keys, blocks, f"{namespace.tag}-plain", config.workers)
        sides.callback(plain.close)
        encrypted = OursRemote(base.layout, base.pool, mode, keys, blocks, f"{namespace.tag}-aead", config.workers,
                               secret or os.urandom(32), encrypt=True)
        sides.callback(encrypted.close)
        raw_names = [f"kvstrata-bench/raw/{namespace.tag}/{i}" for i in range(config.blocks)]
        raw = RawPool(base.pool, mode, raw_names, ours.values())
        sides.callback(raw.close)
        faulted = raw.prefault(prefault) if prefault else 0
        direct = PoolReader(base, FetchPath.DIRECT, tokens, kv_bytes)
        sides.callback(direct.close)
        staged = PoolReader(base, FetchPath.STAGED, tokens, kv_bytes)
        sides.callback(staged.close)
        progress.step(f"{mode.value}: set up")
        rounds = Rounds()
        loopback: dict[str, int] = {}  # bytes over the loopback interface per step, warm-up round
        for r in range(config.repeats + 1):
            kept = Rounds() if r == 0 else rounds  # round 0 warms up: its samples are dropped
            label = f"{mode.value} round {r}/{config.repeats}" if r else f"{mode.value} warm-up"
            stores = [("ours.store", ours.store_s), ("raw.store", raw.put_s), ("plain.store", plain.store_s),
                      ("encrypted.store", encrypted.store_s)]
            for name, step in rotated(stores, r):
                kept.add(name, _counted(step, loopback, name, base.pool.network) if r == 0 else step())
            progress.step(f"{label}: store")
            restores: list[Step] = [
                ("ours.restore", ours.restore_s),
                ("raw.restore", raw.get_s),
                ("plain.restore", plain.restore_s),
                ("encrypted.restore", encrypted.restore_s),
                ("cache.direct", direct.restore_s),
                ("cache.staged", staged.restore_s),
            ]
            for name, step in rotated(restores, r):
                kept.add(name, _counted(step, loopback, name, base.pool.network) if r == 0 else step())
            progress.step(f"{label}: restore")
            one_block: list[Step] = [("ours.ttfb", lambda: ours.restore_s(1)), ("raw.ttfb", lambda: raw.get_s(1))]
            lookups: list[Step] = [("cache.lookup", direct.lookup_s), ("raw.exists", raw.exists_s)]
            for i in range(config.latency_samples):
                for name, step in [*rotated(one_block, r + i), *rotated(lookups, r + i)]:
                    kept.add(name, step())
            progress.step(f"{label}: first byte")
        verified = sum(side.verified_bytes for side in (ours, raw, direct, staged, plain, encrypted))
    progress.step(f"{mode.value}: closed")
    return rounds, verified, faulted, loopback


def _loopback_bytes(network: str | None = None) -> int | None:
    """Bytes received on the loopback interface of the pool's network so far (Linux), or None."""
    from kvstrata.pool.network import NetworkError, run_in

    try:
        return run_in(network, _lo_received)
    except NetworkError:
        return None


def _lo_received() -> int | None:
    try:
        with open("/proc/thread-self/net/dev") as f:  # this thread's network
            for line in f:
                name, _, counters = line.partition(":")
                if name.strip() == "lo":
                    return int(counters.split()[0])
    except OSError:
        pass
    return None


def _counted(step: Callable[[], float], into: dict[str, int], name: str, network: str | None) -> float:
    """Run ``step``, recording the bytes that crossed the loopback interface meanwhile: the
    evidence that TCP mode moves every byte over sockets (and SHM mode none). Other traffic
    on the host counts too: an upper bound."""
    before = _loopback_bytes(network)
    seconds = step()
    after = _loopback_bytes(network)
    if before is not None and after is not None:
        into[name] = after - before
    return seconds
