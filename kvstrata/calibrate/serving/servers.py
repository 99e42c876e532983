"""``bench serve``'s configuration and the ``vllm serve`` processes it runs (pure: the specs are
data; :mod:`kvstrata.bench.serve` starts them).

Six servers, one at a time or two, all vLLM's own OpenAI server on the same model and the same
KV memory (``kv_blocks`` blocks of the workload's ``block_tokens``), vLLM's prefix caching on
except in the reference:

* baseline: vLLM alone.
* kvstrata: vLLM with the connector (``kv_both``): a device tier as large as vLLM's KV memory
  (where loads land before the copy into vLLM's blocks), host DRAM, a disk tier in a directory
  that outlives a restart, and the shared pool when there is one.
* second: another such server on the same pool (its own disk directory), for the two-server run.
* prefill and decode: ``kv_producer`` (stores, never loads) and ``kv_consumer`` (loads, never
  stores) on the pool, host DRAM each, no disk: the decode server's KV can only come from the pool.
* reference: vLLM alone with prefix caching off: every prompt computed from scratch, the
  completions every other server's are compared with.

Every connector server stores under one ``model_id`` made for the run, so a configured pool's
objects from earlier runs are never hits.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvstrata.calibrate.serving.workload import ServeWorkload
from kvstrata.transfer.placement import parse_cpu_list

if TYPE_CHECKING:
    from kvstrata.integrations.vllm.server import ServerSpec

MiB = 1 << 20
DTYPES = ("float32", "bfloat16", "float16")  # what vLLM's --dtype takes and its CPU backend runs


class Instance(enum.Enum):
    """A server of the bench (its value: the name reports and the JSON use)."""

    BASELINE = "baseline"
    OURS = "kvstrata"
    SECOND = "second"
    PREFILL = "prefill"
    DECODE = "decode"
    REFERENCE = "reference"


CONNECTED = (Instance.OURS, Instance.SECOND, Instance.PREFILL, Instance.DECODE)
# Which half of the host's CPUs a server's compute threads are bound to on a CPU-only host
# (vLLM's VLLM_CPU_OMP_THREADS_BIND; a GPU platform ignores it). Servers that run at the same time
# (the two on one pool, prefill and decode) get halves of their own: bound to the same cores,
# their spinning OpenMP threads starve each other. Baseline and kvstrata, never busy at once,
# share a half, so the rounds compare like with like; the client and the pool keep the rest.
CPU_HALF = {Instance.BASELINE: 0, Instance.OURS: 0, Instance.SECOND: 1, Instance.PREFILL: 0, Instance.DECODE: 1}
ROLES = {Instance.PREFILL: "kv_producer", Instance.DECODE: "kv_consumer"}  # the others: kv_both
HAS_DISK = (Instance.OURS, Instance.SECOND)


@dataclass(frozen=True)
class ServeBenchConfig:
    """What ``bench serve`` runs. Capacities in bytes (1 MiB = 2**20).

    Attributes:
        workload: the conversations (:mod:`kvstrata.calibrate.serving.workload`).
        model_dir: the model every server loads.
        vocab: its vocabulary size (prompts draw token ids below it).
        block_bytes: one block's KV (every layer, K and V) of that model at ``block_tokens``.
        trace: the Mooncake-format trace file; None: one generated (seeded, ``kvstrata trace generate``'s).
        rounds: interleaved rounds of baseline and kvstrata.
        kv_blocks: vLLM's KV memory, blocks (``--num-gpu-blocks-override``).
        max_num_seqs: requests vLLM batches at once.
        dtype: the servers' dtype (``--dtype``): the KV's too.
        connector_extra: more of the connector's ``kv_connector_extra_config`` for every connector
            server (``--connector-extra``), over the bench's own.
        disk_read_gbps: cap the disk tiers' reads at this many GB/s (a slow drive, unknown to the
            connector's decisions, which measure it); None: no cap.
        host_bytes, disk_bytes, remote_bytes: kvstrata's host DRAM and disk tiers, and how much of
            the pool each connector server tracks.
        pool: run the pool's parts (the pool tier, two servers on one pool, P/D).
        directory: where disk tiers, stats and logs go (None: a temporary directory, removed).
        start_timeout_s: how long a server may take to answer ``/health``.
        server_cpus: the CPUs (a vLLM CPU list, ``"0-3"``) the compute of vLLM alone and kvstrata's
            server is bound to in the rounds; None: half the host's (``CPU_HALF``). The servers
            that run beside another keep the other half.
    """

    workload: ServeWorkload
    model_dir: Path
    vocab: int
    block_bytes: int
    trace: Path | None = None
    rounds: int = 2
    kv_blocks: int = 32
    max_num_seqs: int = 8
    dtype: str = "float32"
    host_bytes: int = 64 * MiB
    disk_bytes: int = 256 * MiB
    remote_bytes: int = 128 * MiB
    disk_read_gbps: float | None = None
    connector_extra: tuple[tuple[str, object], ...] = ()
    pool: bool = True
    directory: Path | None = None
    start_timeout_s: float = 300.0
    server_cpus: str | None = None

    def __post_init__(self) -> None:
        if self.server_cpus is not None:
            try:
                server_cpu_set(self.server_cpus)
            except ValueError as error:
                raise ValueError(f"bench serve: server_cpus {error}") from None
        for name in ("rounds", "kv_blocks", "max_num_seqs", "block_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"bench serve: {name} must be a whole number >= 1, got {value!r}")
        fewest = -(-self.workload.max_model_len // self.workload.block_tokens) + 1  # vLLM keeps one as its null block
        if self.kv_blocks < fewest:
            raise ValueError(
                f"bench serve: vLLM's {self.kv_blocks} KV blocks of {self.workload.block_tokens} tokens hold less than "
                f"one request of max_model_len {self.workload.max_model_len} tokens and vLLM's null block (vLLM "
                f"refuses to start): --kv-blocks >= {fewest}")
        if self.dtype not in DTYPES:
            raise ValueError(f"bench serve: dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        for name in ("host_bytes", "disk_bytes", "remote_bytes"):
            value = getattr(self, name)
            if value < self.block_bytes:
                raise ValueError(f"bench serve: {name} must hold at least one block of {self.block_bytes} bytes, "
                                 f"got {value}")

    @property
    def vllm_kv_tokens(self) -> int:
        return self.kv_blocks * self.workload.block_tokens

    @property
    def device_bytes(self) -> int:
        """kvstrata's device tier: as many blocks as vLLM's KV memory, so one step's loads fit."""
        return self.kv_blocks * self.block_bytes


def server_specs(config: ServeBenchConfig, work_dir: Path, pool_file: Path | None, model_id: str,
                 env: dict[str, str], cpu_halves: tuple[str, str] | None = None) -> dict[Instance, ServerSpec]:
    """Each server's spec (no pool file: the connector servers have no pool tier, and there is
    no second, prefill or decode server). ``cpu_halves``: the host's CPUs in two lists (``"0-3"``,
    ``"4-7"``) to bind the servers' compute to (:data:`CPU_HALF`); None: vLLM's own binding."""
    from kvstrata.integrations.vllm.server import ServerSpec  # here: its package imports vLLM

    w = config.workload

    def spec(instance: Instance) -> ServerSpec:
        connector = _connector(config, instance, work_dir, pool_file, model_id) if instance in CONNECTED else None
        return ServerSpec(str(config.model_dir), kv_blocks=config.kv_blocks, block_size=w.block_tokens,
                          max_model_len=w.max_model_len, max_num_seqs=config.max_num_seqs, connector=connector,
                          kv_role=ROLES.get(instance, "kv_both"), prefix_caching=instance is not Instance.REFERENCE,
                          dtype=config.dtype, env=_env(env, instance, cpu_halves))

    pooled = (Instance.SECOND, Instance.PREFILL, Instance.DECODE)
    return {i: spec(i) for i in Instance if pool_file is not None or i not in pooled}


def server_cpu_set(text: str) -> frozenset[int]:
    """The CPUs of the list ``text`` (``"0-3"``), every one this process may run on.

    Raises:
        ValueError: not such a list, or a CPU outside this process's affinity.
    """
    try:
        cpus = parse_cpu_list(text)
    except ValueError:
        cpus = frozenset()
    if not cpus:
        raise ValueError(f"must be a CPU list such as '0-3' or '0,2', got {text!r}")
    allowed = os.sched_getaffinity(0)
    if not cpus <= allowed:
        raise ValueError(f"{text}: CPU {min(cpus - allowed)} is not among this host's CPUs for this process "
                         f"({', '.join(map(str, sorted(allowed)))})")
    return cpus


def cpu_halves(cpus: Sequence[int], first: str | None = None) -> tuple[str, str] | None:
    """``cpus`` in two halves as vLLM's CPU lists, or None when there are fewer than two;
    ``first``: the first half's list as given (``ServeBenchConfig.server_cpus``)."""
    ordered = sorted(cpus)
    if len(ordered) < 2:
        return None if first is None else (first, first)
    middle = len(ordered) // 2
    halves = ",".join(map(str, ordered[:middle])), ",".join(map(str, ordered[middle:]))
    return halves if first is None else (first, halves[1])


def _env(env: dict[str, str], instance: Instance, halves: tuple[str, str] | None) -> dict[str, str]:
    half = CPU_HALF.get(instance)
    if halves is None or half is None:
        return dict(env)
    return {**env, "VLLM_CPU_OMP_THREADS_BIND": halves[half]}


def stats_path(work_dir: Path, instance: Instance) -> Path:
    """Where a connector server's stats file goes."""
    return work_dir / f"stats-{instance.name.lower()}.json"


def _connector(config: ServeBenchConfig, instance: Instance, work_dir: Path, pool_file: Path | None,
               model_id: str) -> dict[str, object]:
    extra: dict[str, object] = {"device_bytes": config.device_bytes, "host_bytes": config.host_bytes,
                                "stats_path": str(stats_path(work_dir, instance)), "model_id": model_id}
    if instance in HAS_DISK:
        extra |= {"disk_dir": str(work_dir / f"disk-{instance.name.lower()}"), "disk_bytes": config.disk_bytes}
        if config.disk_read_gbps is not None:
            extra["disk_read_gbps"] = config.disk_read_gbps
    extra |= dict(config.connector_extra)
    if pool_file is not None:
        extra |= {"pool": str(pool_file), "remote_bytes": config.remote_bytes}
    return extra
