"""The transfer paths ``kvstrata calibrate`` measures, and which of them a restore from each tier moves along.

A path is a :class:`CalPath`: its ``value`` is the stable key a calibration profile is written
with (TOML, JSON), its ``label`` the text people read in tables and messages (and ``str()`` of
it). Labels may be reworded; keys may not. Pure: no I/O.
"""

from __future__ import annotations

import enum

from kvstrata.media import Medium


class CalPath(enum.Enum):
    """One measured path; the value is its stable key in a profile."""

    MEMCPY_1T = "memcpy_1t"
    MEMCPY_NT = "memcpy_nt"
    # One torch copy of all the bytes, on torch's own intra-op threads: how a load into a CPU
    # stand-in for the device copies (one dispatch: ranges on parallel threads contend for the
    # cores; see CacheConfig.layer_ranges).
    MEMCPY_ONE = "memcpy_one"
    H2D_PINNED = "h2d_pinned"
    H2D_PAGEABLE = "h2d_pageable"
    D2H_PINNED = "d2h_pinned"
    DISK_READ_COLD = "disk_read_cold"
    DISK_READ_WARM = "disk_read_warm"
    DISK_READ_COLD_NT = "disk_read_cold_nt"
    DISK_READ_WARM_NT = "disk_read_warm_nt"
    DISK_WRITE = "disk_write"
    CHECKSUM = "checksum"
    CHECKSUM_NT = "checksum_nt"
    POOL_GET = "pool_get"
    POOL_PUT = "pool_put"
    # The disk tier's restore without the cache: blocks of the cache's size, each read by a
    # ``DiskTier``'s own ``read_into`` (header verified, each layer's checksum checked as it lands),
    # the blocks spread over N threads (cold: page cache dropped first).
    DISK_BLOCKS_COLD = "disk_blocks_cold"
    DISK_BLOCKS_WARM = "disk_blocks_warm"
    # kvstrata's own fixed cost per restore: planning, pins, handing copy tasks to the transfer
    # engine's threads and waiting for them (measured as a restore of tiny blocks: latency only).
    RESTORE_DISPATCH = "restore_dispatch"
    # The same, per source tier: a restore through the cache of two tiny blocks from that tier (a
    # disk restore also opens, reads and verifies two files; a pool restore makes its batched get).
    # What a restore costs beyond moving its bytes along the tier's path.
    RESTORE_FIXED_HOST = "restore_fixed_host"
    RESTORE_FIXED_DISK = "restore_fixed_disk"
    RESTORE_FIXED_REMOTE = "restore_fixed_remote"

    @property
    def label(self) -> str:
        """How people read it (the name profiles were keyed by before keys were stable)."""
        return _LABELS[self]

    def __str__(self) -> str:
        return self.label

    @staticmethod
    def from_label(label: str) -> CalPath | None:
        """The path an old profile named by its label; None for a label no path has."""
        return _BY_LABEL.get(label)


_LABELS = {
    CalPath.MEMCPY_1T: "memcpy 1 thread",
    CalPath.MEMCPY_NT: "memcpy N threads",
    CalPath.MEMCPY_ONE: "memcpy (one torch copy)",
    CalPath.H2D_PINNED: "host -> device (pinned)",
    CalPath.H2D_PAGEABLE: "host -> device (pageable)",
    CalPath.D2H_PINNED: "device -> host (pinned)",
    CalPath.DISK_READ_COLD: "disk read (cold)",
    CalPath.DISK_READ_WARM: "disk read (page cache)",
    CalPath.DISK_READ_COLD_NT: "disk read (cold, N threads)",
    CalPath.DISK_READ_WARM_NT: "disk read (page cache, N threads)",
    CalPath.DISK_WRITE: "disk write",
    CalPath.CHECKSUM: "checksum (xxh3)",
    CalPath.CHECKSUM_NT: "checksum (xxh3, N threads)",
    CalPath.POOL_GET: "pool get",
    CalPath.POOL_PUT: "pool put",
    CalPath.DISK_BLOCKS_COLD: "disk block reads + xxh3 (cold, N threads)",
    CalPath.DISK_BLOCKS_WARM: "disk block reads + xxh3 (page cache, N threads)",
    CalPath.RESTORE_DISPATCH: "restore dispatch (kvstrata)",
    CalPath.RESTORE_FIXED_HOST: "restore fixed cost (kvstrata, from host)",
    CalPath.RESTORE_FIXED_DISK: "restore fixed cost (kvstrata, from disk)",
    CalPath.RESTORE_FIXED_REMOTE: "restore fixed cost (kvstrata, from remote)",
}
_BY_LABEL = {label: path for path, label in _LABELS.items()}

# Each source tier's fixed cost of one restore (see CalPath.RESTORE_FIXED_*).
RESTORE_FIXED: dict[Medium, CalPath] = {
    Medium.HOST: CalPath.RESTORE_FIXED_HOST,
    Medium.DISK: CalPath.RESTORE_FIXED_DISK,
    Medium.REMOTE: CalPath.RESTORE_FIXED_REMOTE,
}
TIERS: tuple[Medium, ...] = tuple(RESTORE_FIXED)
# The paths a restore's bytes move along (``restore_paths``): fitted as a rate alone, through
# the origin (``fit_path``'s ``origin``). A restore's fixed cost is measured on its own (the
# tier's RESTORE_FIXED), so these need only a rate; a latency fitted through noisy points takes
# time away from the sizes that matter (measured on a loaded 2-core VM: a 3.3 ms latency fitted
# to memcpy probes whose own fixed cost is ~0.1 ms put the 64 MiB predictions ~20% low).
RATE_PATHS = frozenset({CalPath.MEMCPY_1T, CalPath.MEMCPY_NT, CalPath.MEMCPY_ONE, CalPath.H2D_PINNED,
                        CalPath.DISK_BLOCKS_WARM, CalPath.DISK_BLOCKS_COLD, CalPath.POOL_GET})
# Paths whose measured bytes take no measurable time: fitted as a latency alone (``fit_path``'s
# ``fixed``), their bandwidth infinite.
FIXED_COST_PATHS = frozenset({CalPath.RESTORE_DISPATCH, *RESTORE_FIXED.values()})
PATHS: tuple[CalPath, ...] = tuple(CalPath)


def restore_paths(tier: Medium, cold: bool, cuda: bool, workers: int) -> tuple[CalPath, ...]:
    """The paths whose bytes a restore from ``tier`` moves, in order, when each is measured the
    way the tier moves them (see ``HostCalibration.restore_s``): what a calibration must probe
    to predict that restore from per-byte rates and the tier's ``RESTORE_FIXED`` cost.

    Raises:
        ValueError: a tier a restore does not come from (the device).
    """
    to_device = (CalPath.H2D_PINNED,) if cuda else ()
    if tier is Medium.HOST:
        return (CalPath.H2D_PINNED,) if cuda else (CalPath.MEMCPY_ONE,)
    if tier is Medium.DISK:
        return (CalPath.DISK_BLOCKS_COLD if cold else CalPath.DISK_BLOCKS_WARM, *to_device)
    if tier is Medium.REMOTE:
        return (CalPath.POOL_GET, *to_device)
    raise ValueError(f"no restore from tier {tier.label!r}: expected {', '.join(t.label for t in TIERS)}")
