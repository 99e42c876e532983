"""This host's measured transfer paths and prefill rate: the calibrated half of the planner.

The seed's rule: plan capacity from specs, estimate latency from measured effective bandwidth.
``kvstrata calibrate`` measures each path kvstrata moves KV on (:mod:`kvstrata.plan.calpaths`)
at several sizes and fits each (:mod:`kvstrata.plan.fits`); a :class:`HostCalibration` holds the
fits by path and composes a restore's time from them, per source tier (a :class:`Medium`).

Everything here is arithmetic on numbers already measured (no I/O, no torch): a
:class:`HostCalibration` is read from and written to TOML text by the caller. A profile keys its
paths by their stable keys (``CalPath.value``); one written before keys were stable (keyed by the
paths' labels) still loads.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from kvstrata.media import Medium
from kvstrata.plan.calpaths import (
    FIXED_COST_PATHS,
    PATHS,
    RATE_PATHS,
    RESTORE_FIXED,
    TIERS,
    CalPath,
    restore_paths,
)
from kvstrata.plan.fits import GB, PathFit, PrefillFit, fit_path, fit_prefill
from kvstrata.plan.steps import ConnectorFit, DecodeFit, Stalls

__all__ = [
    "FIXED_COST_PATHS", "GB", "PATHS", "RATE_PATHS", "RESTORE_FIXED", "TIERS", "CalPath", "HostCalibration", "PathFit",
    "PrefillFit", "fit_path", "fit_prefill", "restore_paths",
]

RECALIBRATE = "run `kvstrata calibrate` again to write a new profile"


@dataclass(frozen=True)
class HostCalibration:
    """Everything ``kvstrata calibrate`` measured on one host.

    Attributes:
        host: the machine's name (as measured; informational).
        device: the torch device the device tier used ("cuda:0", or "cpu" without a GPU).
        threads: the N of "memcpy N threads".
        paths: fits per path (see ``PATHS``); absent paths were not measurable here.
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
    paths: dict[CalPath, PathFit] = field(default_factory=dict)
    prefill: dict[str, PrefillFit] = field(default_factory=dict)
    efficiency: dict[str, float] = field(default_factory=dict)
    decode: dict[str, DecodeFit] = field(default_factory=dict)
    connector: dict[str, ConnectorFit] = field(default_factory=dict)
    stalls: dict[str, Stalls] = field(default_factory=dict)

    def path(self, path: CalPath) -> PathFit:
        try:
            return self.paths[path]
        except KeyError:
            have = ", ".join(p.label for p in self.paths) or "none"
            raise KeyError(f"path {path.label!r} was not calibrated on {self.host} (have: {have})") from None

    def restore_s(self, tier: Medium, nbytes: int, blocks: int, workers: int = 1, cold: bool = False) -> float:
        """Predicted seconds for the tiered cache to restore ``nbytes`` in ``blocks`` blocks
        from ``tier`` (host, disk or remote) to the device tier, with ``workers`` transfer
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
        * every restore that moves bytes also pays kvstrata's dispatch
          (``CalPath.RESTORE_DISPATCH``), when calibrated.
        """
        paths = restore_paths(tier, cold, self.device.startswith("cuda"), max(1, workers))
        if CalPath.MEMCPY_ONE in paths:
            paths = (self._cpu_copy(workers),)
        if nbytes <= 0:
            return 0.0
        fixed = self.paths.get(RESTORE_FIXED[tier])
        if fixed is not None and all(p in self.paths for p in paths):
            return fixed.latency_s + sum(nbytes / (self.paths[p].gbps * GB) for p in paths)
        dispatch = self.paths[CalPath.RESTORE_DISPATCH].latency_s if CalPath.RESTORE_DISPATCH in self.paths else 0.0
        return dispatch + self._moved_s(tier, nbytes, blocks, workers, cold)

    def _moved_s(self, tier: Medium, nbytes: int, blocks: int, workers: int, cold: bool) -> float:
        workers = max(1, workers)
        cuda = self.device.startswith("cuda")
        to_device = self.path(CalPath.H2D_PINNED).seconds(nbytes) if cuda else 0.0
        if tier is Medium.HOST:
            return self._copy_path(workers).seconds(nbytes)
        if tier is Medium.DISK:
            blocks_path = CalPath.DISK_BLOCKS_COLD if cold else CalPath.DISK_BLOCKS_WARM
            if blocks_path in self.paths:  # the tier's own pattern, measured whole
                return self.paths[blocks_path].seconds(nbytes) + to_device
            one = self.path(CalPath.DISK_READ_COLD if cold else CalPath.DISK_READ_WARM)
            read = self._threaded(CalPath.DISK_READ_COLD_NT if cold else CalPath.DISK_READ_WARM_NT, one, workers, cold)
            per_file = math.ceil(max(1, blocks) / workers) * one.latency_s
            read_s = nbytes / (read.gbps * GB)
            check_s = 0.0
            if CalPath.CHECKSUM in self.paths:
                check = self._threaded(CalPath.CHECKSUM_NT, self.paths[CalPath.CHECKSUM], workers, False)
                check_s = nbytes / (check.gbps * GB)
            return per_file + read_s + check_s + to_device
        if tier is Medium.REMOTE:
            return self.path(CalPath.POOL_GET).seconds(nbytes) + to_device
        raise ValueError(f"no restore from tier {tier.label!r}: expected host, disk or remote")

    def _copy_path(self, workers: int) -> PathFit:
        if self.device.startswith("cuda"):
            return self.path(CalPath.H2D_PINNED)
        return self.path(self._cpu_copy(workers))

    def _cpu_copy(self, workers: int) -> CalPath:
        """The path a load into a CPU device copies on; in a profile from before those loads
        were one copy, the closest it has."""
        if CalPath.MEMCPY_ONE in self.paths:
            return CalPath.MEMCPY_ONE
        return CalPath.MEMCPY_NT if workers > 1 and CalPath.MEMCPY_NT in self.paths else CalPath.MEMCPY_1T

    def _threaded(self, name: CalPath, one: PathFit, workers: int, cold: bool) -> PathFit:
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
        for path, p in self.paths.items():  # keyed by the stable key; the label is for people reading it
            lines += _array_entry("calibration.path", {"path": path.value, "label": path.label, **asdict(p)})
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
    def from_mapping(cls, doc: Mapping[str, object]) -> HostCalibration:
        """From parsed TOML (``tomllib.loads``); errors name the field. A path is read by its
        stable key (``path``), or, in a profile written before those keys, by its label (``name``).

        Raises:
            ValueError: not a calibration, a field missing, or a path kvstrata does not know
                (the message says to calibrate again).
        """
        c = doc.get("calibration")
        if not isinstance(c, dict):
            raise ValueError("not a calibration: no [calibration] table (write one with `kvstrata calibrate`)")
        try:
            paths = {_path_key(p): PathFit(float(p["latency_s"]), float(p["gbps"]), float(p.get("spread", 0.0)),
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


def _path_key(entry: Mapping[str, object]) -> CalPath:
    """A ``[[calibration.path]]`` entry's path: its stable key, or an old profile's label."""
    if "path" in entry:
        try:
            return CalPath(entry["path"])
        except ValueError:
            raise ValueError(f"calibration path {entry['path']!r} is not one this kvstrata knows: "
                             f"{RECALIBRATE}") from None
    label = entry.get("name")
    if label is None:
        raise KeyError("path")
    path = CalPath.from_label(str(label))
    if path is None:
        raise ValueError(f"calibration path {label!r} (a profile from an older kvstrata) is not one this kvstrata "
                         f"knows: {RECALIBRATE}")
    return path


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
