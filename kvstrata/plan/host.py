"""This host's measured transfer paths and prefill rate: the calibrated half of the planner.

The seed's rule: plan capacity from specs, estimate latency from measured effective bandwidth.
``kvstrata calibrate`` measures each path kvstrata moves KV on, at several sizes, and fits

    seconds(bytes) = latency_s + bytes / (gbps * 1e9)

per path by least squares on the medians (latency clipped at 0). A model's prefill is fitted the
same way on tokens, with the attention term of :mod:`kvstrata.sim.model`:

    seconds(new, cached) = latency_s + new / tokens_per_s + attn_s * new * (cached + new / 2)

Everything here is arithmetic on numbers already measured (no I/O, no torch): a
:class:`HostCalibration` is read from and written to TOML text by the caller.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from kvstrata.plan.steps import ConnectorFit, DecodeFit, Stalls

GB = 1e9

# Path names, as ``calibrate`` measures them and ``validate`` checks them.
MEMCPY_1T = "memcpy 1 thread"
MEMCPY_NT = "memcpy N threads"
# One torch copy of all the bytes, on torch's own intra-op threads: how a load into a CPU
# stand-in for the device copies (one dispatch: ranges on parallel threads contend for the
# cores; see CacheConfig.layer_ranges).
MEMCPY_ONE = "memcpy (one torch copy)"
H2D_PINNED = "host -> device (pinned)"
H2D_PAGEABLE = "host -> device (pageable)"
D2H_PINNED = "device -> host (pinned)"
DISK_READ_COLD = "disk read (cold)"
DISK_READ_WARM = "disk read (page cache)"
DISK_READ_COLD_NT = "disk read (cold, N threads)"
DISK_READ_WARM_NT = "disk read (page cache, N threads)"
DISK_WRITE = "disk write"
CHECKSUM = "checksum (xxh3)"
CHECKSUM_NT = "checksum (xxh3, N threads)"
POOL_GET = "pool get"
POOL_PUT = "pool put"
# The disk tier's restore without the cache: blocks of the cache's size, each read by a
# ``DiskTier``'s own ``read_into`` (header verified, each layer's checksum checked as it lands),
# the blocks spread over N threads (cold: page cache dropped first).
DISK_BLOCKS_COLD = "disk block reads + xxh3 (cold, N threads)"
DISK_BLOCKS_WARM = "disk block reads + xxh3 (page cache, N threads)"
# kvstrata's own fixed cost per restore: planning, pins, handing copy tasks to the transfer
# engine's threads and waiting for them (measured as a restore of tiny blocks: latency only).
RESTORE_DISPATCH = "restore dispatch (kvstrata)"
# The same, per source tier: a restore through the cache of two tiny blocks from that tier (a
# disk restore also opens, reads and verifies two files; a pool restore makes its batched get).
# What a restore costs beyond moving its bytes along the tier's path.
RESTORE_FIXED = {
    "host": "restore fixed cost (kvstrata, from host)",
    "disk": "restore fixed cost (kvstrata, from disk)",
    "remote": "restore fixed cost (kvstrata, from remote)",
}
TIERS = tuple(RESTORE_FIXED)
# The paths a restore's bytes move along (``restore_paths``): fitted as a rate alone, through
# the origin (``fit_path``'s ``origin``). A restore's fixed cost is measured on its own (the
# tier's RESTORE_FIXED), so these need only a rate; a latency fitted through noisy points takes
# time away from the sizes that matter (measured on a loaded 2-core VM: a 3.3 ms latency fitted
# to memcpy probes whose own fixed cost is ~0.1 ms put the 64 MiB predictions ~20% low).
RATE_PATHS = frozenset({MEMCPY_1T, MEMCPY_NT, MEMCPY_ONE, H2D_PINNED, DISK_BLOCKS_WARM, DISK_BLOCKS_COLD, POOL_GET})
# Paths whose measured bytes take no measurable time: fitted as a latency alone (``fit_path``'s
# ``fixed``), their bandwidth infinite.
FIXED_COST_PATHS = frozenset({RESTORE_DISPATCH, *RESTORE_FIXED.values()})
PATHS = (
    MEMCPY_1T, MEMCPY_NT, MEMCPY_ONE, H2D_PINNED, H2D_PAGEABLE, D2H_PINNED,
    DISK_READ_COLD, DISK_READ_WARM, DISK_READ_COLD_NT, DISK_READ_WARM_NT, DISK_WRITE,
    CHECKSUM, CHECKSUM_NT, POOL_GET, POOL_PUT, DISK_BLOCKS_COLD, DISK_BLOCKS_WARM, RESTORE_DISPATCH,
    *RESTORE_FIXED.values(),
)


def restore_paths(tier: str, cold: bool, cuda: bool, workers: int) -> tuple[str, ...]:
    """The paths whose bytes a restore from ``tier`` moves, in order, when each is measured the
    way the tier moves them (see ``HostCalibration.restore_s``): what a calibration must probe
    to predict that restore from per-byte rates and the tier's ``RESTORE_FIXED`` cost.

    Raises:
        ValueError: an unknown tier.
    """
    to_device = (H2D_PINNED,) if cuda else ()
    if tier == "host":
        return (H2D_PINNED,) if cuda else (MEMCPY_ONE,)
    if tier == "disk":
        return (DISK_BLOCKS_COLD if cold else DISK_BLOCKS_WARM, *to_device)
    if tier == "remote":
        return (POOL_GET, *to_device)
    raise ValueError(f"unknown tier {tier!r}: expected {', '.join(TIERS)}")


@dataclass(frozen=True)
class PathFit:
    """``seconds = latency_s + bytes / (gbps * 1e9)`` for one path.

    Attributes:
        latency_s: the fixed cost of one operation.
        gbps: effective bandwidth, decimal GB/s; ``math.inf`` for a fixed cost (the bytes
            take no measurable time).
        spread: the largest relative half-range (max - min) / 2 / median among the sizes'
            repeats: how far one measurement strays.
        sizes: the sizes measured, bytes.
    """

    latency_s: float
    gbps: float
    spread: float = 0.0
    sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ValueError(f"latency_s must be finite and >= 0, got {self.latency_s}")
        if not self.gbps > 0:
            raise ValueError(f"gbps must be > 0 (inf for a fixed cost), got {self.gbps}")

    def seconds(self, nbytes: int, ops: int = 1) -> float:
        """Time for ``nbytes`` moved in ``ops`` operations (each pays the latency)."""
        return ops * self.latency_s + nbytes / (self.gbps * GB)


def fit_path(sizes: Sequence[int], seconds: Sequence[float], spread: float = 0.0, fixed: bool = False,
             relative: bool = False, origin: bool = False) -> PathFit:
    """Least-squares ``latency + bytes / bandwidth`` through (size, seconds) points.

    One size, or a negative fitted latency, gives the bandwidth through the origin of the
    largest size's point (``relative``: through all points, on relative error), the fixed
    cost then unmeasurable, taken as 0. ``fixed``: the bytes take no measurable time (see
    ``FIXED_COST_PATHS``): the latency is the mean time, the bandwidth infinite.
    ``relative``: each point weighted by 1 / seconds, so every size's time is fitted to the
    same relative accuracy (unweighted, the largest size's noise sets the smaller ones'
    predictions). ``origin``: a rate alone, through the origin (see ``RATE_PATHS``).
    """
    if len(sizes) != len(seconds) or not sizes:
        raise ValueError(f"fit needs as many sizes as times, at least one; got {len(sizes)} and {len(seconds)}")
    if any(s <= 0 for s in sizes) or any(not t > 0 for t in seconds):
        raise ValueError("fit needs positive sizes and times")
    n = len(sizes)
    if fixed:
        return PathFit(sum(seconds) / n, math.inf, spread, tuple(sizes))
    w = [1 / t**2 if relative else 1.0 for t in seconds]
    if n >= 2 and len(set(sizes)) >= 2 and not origin:
        sw = sum(w)
        mx = sum(wi * x for wi, x in zip(w, sizes)) / sw
        my = sum(wi * y for wi, y in zip(w, seconds)) / sw
        sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, sizes))
        slope = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, sizes, seconds)) / sxx
        latency = my - slope * mx
        if slope > 0 and latency >= 0:
            return PathFit(latency, 1 / slope / GB, spread, tuple(sizes))
    if relative:  # through the origin: slope = sum(w x y) / sum(w x^2)
        slope = sum(wi * x * y for wi, x, y in zip(w, sizes, seconds)) / sum(wi * x * x for wi, x in zip(w, sizes))
        return PathFit(0.0, 1 / slope / GB, spread, tuple(sizes))
    i = max(range(n), key=lambda k: sizes[k])
    return PathFit(0.0, sizes[i] / seconds[i] / GB, spread, tuple(sizes))


@dataclass(frozen=True)
class PrefillFit:
    """A model's prefill seconds on this host (see the module text)."""

    latency_s: float
    tokens_per_s: float
    attn_s: float = 0.0  # seconds per (new token x attended token)

    def seconds(self, new_tokens: int, cached_tokens: int = 0) -> float:
        if new_tokens <= 0:
            return 0.0
        n = new_tokens
        return self.latency_s + n / self.tokens_per_s + self.attn_s * n * (cached_tokens + n / 2)


def fit_prefill(points: Sequence[tuple[int, int, float]]) -> PrefillFit:
    """Least squares of ``a + b * n + c * n * (cached + n / 2)`` through (new, cached, seconds),
    on relative error (each point weighted by 1 / seconds).

    Why relative: prefill times span orders of magnitude across prompt sizes, and an absolute
    fit lets the largest prompts' noise set the small ones' predictions (measured on the tiny
    model, 2 shared cores: a fitted latency of 31 ms where a 128-token prefill takes 4 ms, or a
    per-token term of zero or less); load-or-recompute needs C(k) right for every k. A negative
    latency or attention term is dropped (refitted without it): every term is a cost, and the
    per-token term must stay.
    """
    import numpy as np

    if len(points) < 3:
        raise ValueError(f"a prefill fit needs at least 3 points, got {len(points)}")
    if any(n <= 0 or c < 0 or not t > 0 for n, c, t in points):
        raise ValueError("prefill fit needs positive sizes and times")
    weight = np.array([1 / t for _, _, t in points])
    rows = np.array([[1.0, n, n * (c + n / 2)] for n, c, _ in points]) * weight[:, None]
    keep = [0, 1, 2]
    while True:
        coef, *_ = np.linalg.lstsq(rows[:, keep], np.ones(len(points)), rcond=None)
        values = dict(zip(keep, coef))
        drop = next((k for k in (0, 2) if k in values and (values[k] < 0 or values[1] <= 0)), None)
        if drop is None:
            break
        keep.remove(drop)
    if values[1] <= 0:
        raise ValueError("prefill fit: time does not grow with tokens; measure larger prompts")
    return PrefillFit(float(values.get(0, 0.0)), float(1 / values[1]), float(values.get(2, 0.0)))


@dataclass(frozen=True)
class HostCalibration:
    """Everything ``kvstrata calibrate`` measured on one host.

    Attributes:
        host: the machine's name (as measured; informational).
        device: the torch device the device tier used ("cuda:0", or "cpu" without a GPU).
        threads: the N of "memcpy N threads".
        paths: fits per path name (see ``PATHS``); absent paths were not measurable here.
        prefill: per model id, its prefill fit.
        decode: per model id, its serving engine's decode step fit (``--engine vllm``).
        efficiency: derived link efficiencies for a hardware profile (e.g. pcie = measured
            pinned H2D GB/s over the PCIe payload bandwidth), when a GPU was present.
        connector: per model id, what the KVStrata connector adds to a served request
            (``--engine vllm``).
        stalls: per model id, how often and how long its served requests stall on this host
            (``--engine vllm``).
    """

    host: str
    device: str
    threads: int
    paths: dict[str, PathFit] = field(default_factory=dict)
    prefill: dict[str, PrefillFit] = field(default_factory=dict)
    efficiency: dict[str, float] = field(default_factory=dict)
    decode: dict[str, DecodeFit] = field(default_factory=dict)
    connector: dict[str, ConnectorFit] = field(default_factory=dict)
    stalls: dict[str, Stalls] = field(default_factory=dict)

    def path(self, name: str) -> PathFit:
        try:
            return self.paths[name]
        except KeyError:
            have = ", ".join(self.paths) or "none"
            raise KeyError(f"path {name!r} was not calibrated on {self.host} (have: {have})") from None

    def restore_s(self, tier: str, nbytes: int, blocks: int, workers: int = 1, cold: bool = False) -> float:
        """Predicted seconds for the tiered cache to restore ``nbytes`` in ``blocks`` blocks
        from ``tier`` ("host", "disk", "remote") to the device tier, with ``workers`` transfer
        threads (``CacheConfig.workers``); ``cold``: disk blocks not in the page cache.

        With the tier's fixed cost (``RESTORE_FIXED``) and every path of ``restore_paths``
        calibrated: that fixed cost plus each path's bytes at its rate. The fixed cost was
        measured through the cache, so it already holds what one operation of each path costs
        (a thread hand-off, a batched call): the paths' own latencies are not added again.
        Per-block costs (a file opened, its header read and verified) are in the block-read
        paths' rates, measured in blocks of the cache's size.

        Otherwise (a profile from before per-tier fixed costs) the composition follows
        ``TieredCache.load`` step by step:

        * host: one copy of every byte host -> device, layer ranges spread over the workers:
          the N-thread memcpy on a CPU-only host (the "device" is host memory), pinned H2D on
          a GPU host.
        * disk: the measured block-read pattern (``DISK_BLOCKS_*``) when calibrated; else
          composed: each block is one file, opened and read (1 MiB pieces, each checksummed with
          xxh3 as it lands) by one worker; blocks spread over the workers. Per block the
          file's fixed cost (the one-thread read's latency), per byte the N-thread read rate
          and the N-thread checksum rate, in sequence: a worker reads a piece, then hashes it
          (measured cold on a 2-core VM: the hashing does not hide behind the other worker's
          disk wait). On a GPU host the blocks land in the host tier first (the "auto" disk
          path stages them), then one pinned H2D copy.
        * remote: one batched pool get per worker's share, straight into the device slots on
          a CPU-only host (the pool path), then a pinned H2D copy on a GPU host.
        * every restore that moves bytes also pays kvstrata's dispatch (``RESTORE_DISPATCH``),
          when calibrated.
        """
        paths = restore_paths(tier, cold, self.device.startswith("cuda"), max(1, workers))
        if MEMCPY_ONE in paths:
            paths = (self._cpu_copy(workers),)
        if nbytes <= 0:
            return 0.0
        fixed = self.paths.get(RESTORE_FIXED[tier])
        if fixed is not None and all(p in self.paths for p in paths):
            return fixed.latency_s + sum(nbytes / (self.paths[p].gbps * GB) for p in paths)
        dispatch = self.paths[RESTORE_DISPATCH].latency_s if RESTORE_DISPATCH in self.paths else 0.0
        return dispatch + self._moved_s(tier, nbytes, blocks, workers, cold)

    def _moved_s(self, tier: str, nbytes: int, blocks: int, workers: int, cold: bool) -> float:
        workers = max(1, workers)
        cuda = self.device.startswith("cuda")
        to_device = self.path(H2D_PINNED).seconds(nbytes) if cuda else 0.0
        if tier == "host":
            return self._copy_path(workers).seconds(nbytes)
        if tier == "disk":
            blocks_path = DISK_BLOCKS_COLD if cold else DISK_BLOCKS_WARM
            if blocks_path in self.paths:  # the tier's own pattern, measured whole
                return self.paths[blocks_path].seconds(nbytes) + to_device
            one = self.path(DISK_READ_COLD if cold else DISK_READ_WARM)
            read = self._threaded(DISK_READ_COLD_NT if cold else DISK_READ_WARM_NT, one, workers, cold)
            per_file = math.ceil(max(1, blocks) / workers) * one.latency_s
            read_s = nbytes / (read.gbps * GB)
            check_s = 0.0
            if CHECKSUM in self.paths:
                check = self._threaded(CHECKSUM_NT, self.paths[CHECKSUM], workers, False)
                check_s = nbytes / (check.gbps * GB)
            return per_file + read_s + check_s + to_device
        if tier == "remote":
            return self.path(POOL_GET).seconds(nbytes) + to_device
        raise ValueError(f"unknown tier {tier!r}: expected host, disk or remote")

    def _copy_path(self, workers: int) -> PathFit:
        if self.device.startswith("cuda"):
            return self.path(H2D_PINNED)
        return self.path(self._cpu_copy(workers))

    def _cpu_copy(self, workers: int) -> str:
        """The path a load into a CPU device copies on; in a profile from before those loads
        were one copy, the closest it has."""
        if MEMCPY_ONE in self.paths:
            return MEMCPY_ONE
        return MEMCPY_NT if workers > 1 and MEMCPY_NT in self.paths else MEMCPY_1T

    def _threaded(self, name: str, one: PathFit, workers: int, cold: bool) -> PathFit:
        """The N-thread fit of a path when measured and ``workers`` > 1, else the one-thread
        fit scaled by ``_parallel`` (an uncalibrated guess)."""
        if workers > 1 and name in self.paths:
            return self.paths[name]
        return PathFit(one.latency_s, one.gbps * (_parallel(workers, cold) if workers > 1 else 1.0))

    # --- TOML ---------------------------------------------------------------------------------

    def to_toml(self) -> str:
        lines = [
            "# Written by `kvstrata calibrate`: this host's measured paths, seconds = latency_s + bytes / (gbps * 1e9).",
            "[calibration]",
            f"host = {_q(self.host)}",
            f"device = {_q(self.device)}",
            f"threads = {self.threads}",
        ]
        for name, p in self.paths.items():
            lines += _array_entry("calibration.path", {"name": name, **asdict(p)})
        for model, f in self.prefill.items():
            lines += _array_entry("calibration.prefill", {"model": model, **asdict(f)})
        for model, d in self.decode.items():
            lines += _array_entry("calibration.decode", {"model": model, **asdict(d)})
        for model, k in self.connector.items():
            lines += _array_entry("calibration.connector", {"model": model, **asdict(k)})
        for model, st in self.stalls.items():
            lines += _array_entry("calibration.stalls", {"model": model, **asdict(st)})
        if self.efficiency:
            lines += ["", "[efficiency]"] + [f"{_q(k)} = {v!r}" for k, v in self.efficiency.items()]
        return "\n".join(lines) + "\n"

    @classmethod
    def from_mapping(cls, doc: dict) -> HostCalibration:
        """From parsed TOML (``tomllib.loads``); errors name the field."""
        c = doc.get("calibration")
        if not isinstance(c, dict):
            raise ValueError("not a calibration: no [calibration] table (write one with `kvstrata calibrate`)")
        try:
            paths = {p["name"]: PathFit(float(p["latency_s"]), float(p["gbps"]), float(p.get("spread", 0.0)),
                                        tuple(int(s) for s in p.get("sizes", ()))) for p in c.get("path", [])}
            prefill = {f["model"]: PrefillFit(float(f["latency_s"]), float(f["tokens_per_s"]), float(f.get("attn_s", 0.0)))
                       for f in c.get("prefill", [])}
            decode = {d["model"]: DecodeFit(float(d["latency_s"]), float(d["per_request_s"]), float(d.get("per_token_s", 0.0)),
                                            float(d.get("together", 1.0)), float(d.get("spin_s", 0.0)),
                                            float(d.get("beside_spin", 1.0)))
                      for d in c.get("decode", [])}
            connector = {k["model"]: ConnectorFit(float(k["request_s"]), float(k.get("load_s", 0.0)),
                                                      float(k.get("remote_load_s", 0.0)))
                         for k in c.get("connector", [])}
            stalls = {st["model"]: Stalls(float(st["alone"]), tuple(float(x) for x in st["alone_s"]),
                                          float(st["beside"]), tuple(float(x) for x in st["beside_s"]))
                      for st in c.get("stalls", [])}
            return cls(str(c["host"]), str(c["device"]), int(c["threads"]), paths, prefill,
                       {str(k): float(v) for k, v in doc.get("efficiency", {}).items()}, decode, connector, stalls)
        except KeyError as e:
            raise ValueError(f"calibration is missing field {e.args[0]!r}") from None


def _parallel(workers: int, cold: bool) -> float:
    """How much faster several readers are than one: page-cache reads are memory copies that
    scale with threads up to the cores; a cold device read is taken as not scaling (conservative)."""
    return 1.0 if cold else float(max(1, workers))


def _array_entry(table: str, fields: dict[str, object]) -> list[str]:
    """One ``[[table]]`` entry's lines, a blank line first; values are str, int, float or tuples of them."""
    return ["", f"[[{table}]]"] + [f"{k} = {_value(v)}" for k, v in fields.items()]


def _value(v: object) -> str:
    if isinstance(v, str):
        return _q(v)
    if isinstance(v, tuple):
        return f"[{', '.join(_value(x) for x in v)}]"
    return repr(v)  # int, float (inf as TOML's inf)


def _q(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
