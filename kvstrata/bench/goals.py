"""The benchmarks' goals, checked against their figures (``run_cache_bench``, ``run_remote_bench``;
``run_sim_bench`` judges its own rows against :data:`SIM_WALL_S`).

Ratio goals use the paired ratios of the report (ours over the baseline of the same round);
"at least LMCache" goals use ours over LMCache's figure of the same round, and are left out
when LMCache did not run.

A goal names the figure it judges with the benchmark's own key: a member of
:class:`CacheFigure`, :class:`LookupFigure` or :class:`RemoteFigure` (the JSON holds its value), or for ``bench sim``,
whose figures are data (a trace and an architecture), a ``"<trace> <arch>"`` id; for the head-sliced
rows of ``bench cache --tp-readers`` (a tier and a TP size), the id :func:`sliced_restore_figure`
or :func:`sliced_lookup_figure` makes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvstrata.pool.config import RemoteMode


class CacheFigure(enum.Enum):
    """The figures of ``bench cache`` that goals judge (values: their ids in the JSON)."""

    HOST_STORE = "host store"
    HOST_RESTORE = "host restore"
    DISK_STORE = "disk store"
    DISK_COLD = "disk restore, cold"
    DISK_WARM = "disk restore, warm"
    LOOKUP_256 = "hash+lookup 128K, block 256"
    LOOKUP_16 = "hash+lookup 128K, block 16"

    @staticmethod
    def lookup(block_size: int) -> CacheFigure:
        return CacheFigure(f"hash+lookup 128K, block {block_size}")


class LookupFigure(enum.Enum):
    """The figures of ``bench lookup`` and ``bench restart`` beside the hash+lookup ones of
    :class:`CacheFigure` (which ``bench lookup`` judges too)."""

    SCALING = "lookup, 1M blocks indexed of 1K"
    RESTART = "disk restart, first hit"


class RemoteFigure(enum.Enum):
    """The figures of ``bench remote`` that goals judge, per way into the pool."""

    TCP_RESTORE = "tcp restore"
    TCP_STORE = "tcp store"
    SHM_RESTORE = "shm restore"
    SHM_STORE = "shm store"
    TCP_SEALED_RESTORE = "tcp sealed restore"
    SHM_SEALED_RESTORE = "shm sealed restore"
    TCP_LOOKUP = "tcp lookup"
    SHM_LOOKUP = "shm lookup"

    @staticmethod
    def of(mode: RemoteMode, store: bool) -> RemoteFigure:
        return RemoteFigure(f"{mode.value} {'store' if store else 'restore'}")


@dataclass(frozen=True)
class Goal:
    """One target for one figure, judged on construction.

    Attributes:
        figure: the figure judged.
        goal: what it asks, in words.
        value: the figure's value.
        target: the bound.
        at_most: a time: ``value <= target`` passes; else ``value >= target``.
        passed: the verdict.
    """

    figure: CacheFigure | LookupFigure | RemoteFigure | str
    goal: str
    value: float
    target: float
    at_most: bool = False
    passed: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "passed", self.value <= self.target if self.at_most else self.value >= self.target)


HOST_STORE_OF_COPY = 0.95
HOST_RESTORE_OF_COPY = 0.98
DISK_WARM_OF_COPY = 0.80
DISK_COLD_OF_RAW_READ = 0.90
LOOKUP_OF_XXH3 = 1.2  # hash + lookup of 128K tokens, of the bare chained xxh3-128 loop (time, at most)
LOOKUP_1M_OF_1K = 1.2  # the lookup with 1M blocks indexed, of the same with 1K (time, at most)
RESTART_FIRST_HIT_S = 10.0  # open a disk tier of 100K blocks and serve a hit from it (at most)
REMOTE_OF_RAW = 0.90  # the remote tier's restore and store, of raw Mooncake calls on the same bytes
SEALED_OF_UNSEALED = 0.90  # restores of authenticated pool values, of unauthenticated ones
LOOKUP_OF_EXISTS = 1.5  # a lookup that asks the pool, at most this times the raw batch_is_exist (a time ratio)
SIM_WALL_S = 5.0  # one simulation of a trace, one architecture, on one core (kvstrata bench sim)
SLICED_OF_MATCHED = 0.90  # a head-sliced restore at any reader TP, of a TP-matched one of the same bytes (rate)
SLICED_LOOKUP_TP_OF_TP1 = 1.5  # hash+lookup of 128K tokens by a TP=8 head-sliced instance, of TP=1 (time, at most)


def sliced_restore_figure(source: str, tp: int) -> str:
    """The id of the goal of a ``bench cache --tp-readers`` restore row (``source``: its tier, in words)."""
    return f"head-sliced restore, {source}, TP={tp}"


def sliced_lookup_figure(block_size: int, tp: int) -> str:
    """The id of the goal of a ``bench cache --tp-readers`` lookup row."""
    return f"head-sliced hash+lookup 128K, block {block_size}, TP={tp} of TP=1"


def goals_for(figure: CacheFigure | LookupFigure | RemoteFigure, judged: tuple[Goal, ...]) -> list[Goal]:
    """The goals of ``figure``, in order."""
    return [g for g in judged if g.figure is figure]
