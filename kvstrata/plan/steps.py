"""A serving engine's decode step on this host, fitted to what the engine shows (pure arithmetic).

A decode step runs every request of the batch one token further; it reads the weights once and
each request's kept tokens, and computes per request. On a host whose engine was measured
(``kvstrata calibrate --model-dir DIR --engine vllm``) a step of ``b`` requests holding ``S``
tokens in all is fitted as

    seconds(b, S) = latency_s + b * per_request_s + S * per_token_s

by least squares on relative error (each point weighted by 1 / seconds, as the prefill fit in
:mod:`kvstrata.plan.host` is: step times span an order of magnitude across batch sizes); a term
fitted negative is dropped and the rest refitted (every term is a cost).

The connector's own cost per request and per load (:func:`connector_fit`) and a load from the
pool as served (:func:`remote_load_fit`) are fitted here too, from the points ``calibrate
--engine vllm`` measures (:mod:`kvstrata.calibrate.serving.steps`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstrata.plan.fits import PrefillFit


@dataclass(frozen=True)
class DecodeFit:
    """Seconds of one decode step (see the module text)."""

    latency_s: float
    per_request_s: float
    per_token_s: float = 0.0
    together: float = 1.0  # how much slower a step runs while another server (on the other CPUs) steps
    spin_s: float = 0.0  # how long a worker holds its CPUs after its last step (busy-polling for the next)
    beside_spin: float = 1.0  # how much slower while the other server's worker only spins (within spin_s)

    def __post_init__(self) -> None:
        for name in ("latency_s", "per_request_s", "per_token_s"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"decode fit {name} must be >= 0, got {value!r}")
        check_beside(self.together, self.spin_s, self.beside_spin, "decode fit ")

    def step_s(self, batch: int, held_tokens: int) -> float:
        """One step of ``batch`` requests holding ``held_tokens`` tokens in all (0 for no batch)."""
        if batch <= 0:
            return 0.0
        return self.latency_s + batch * self.per_request_s + held_tokens * self.per_token_s


def check_beside(together: float, spin_s: float, beside_spin: float, what: str = "") -> None:
    """Check the figures of a server's work beside another server's worker on the same host
    (:class:`DecodeFit`'s, and the simulator's ``HostCpus``): a step is no faster for another's
    (``together``, ``beside_spin`` >= 1), and a worker spins for no negative time.

    Raises:
        ValueError: naming the figure, after ``what``.
    """
    if not together >= 1:
        raise ValueError(f"{what}together must be >= 1 (a step no faster for another's), got {together!r}")
    if not beside_spin >= 1:
        raise ValueError(f"{what}beside_spin must be >= 1 (a step no faster for another's), got {beside_spin!r}")
    if not spin_s >= 0:
        raise ValueError(f"{what}spin_s must be >= 0, got {spin_s!r}")


@dataclass(frozen=True)
class ConnectorFit:
    """What the KVStrata connector adds to a request on a serving engine, beyond the cache's own
    restores and stores (its lookup asked of the worker, the metadata of each step, the copy of
    a load into the engine's blocks), measured through ``vllm serve``.

    Attributes:
        request_s: every request the connector looks up.
        load_s: a request that loads, beyond the restore's own time.
        remote_load_s: a load from the pool, beyond the pool's restore path, as the cache's own
            load time counts it on a server just after another server stored those blocks
            (``bench serve``'s two servers on one pool and its P/D pair): the pool's daemon and
            the cache's threads then share the CPUs two servers' workers hold.
    """

    request_s: float
    load_s: float = 0.0
    remote_load_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("request_s", "load_s", "remote_load_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"connector fit {name} must be >= 0, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class Stalls:
    """How often a served request's first token comes late for the host's own reasons, and by how
    much: what a step's mean leaves out. On a host with few CPUs a request now and then waits
    far past its server's usual time to first token (here 100-450 ms against ~60 ms), on a
    plain server as on one with the connector, most of all while another server's worker holds
    the other CPUs (``kvstrata calibrate --engine vllm`` sends a steady stream of requests to one
    server alone, then to two taking turns, and with a pool, prompts handed from one to the
    other through it, and counts what came ``STALL_MIN_S`` or more past its stream's median).

    Attributes:
        alone: the share of requests that stall while no other server's worker holds CPUs.
        alone_s: the stalls measured then, seconds past the median (any order).
        beside: the share while another server's worker on other CPUs steps or spins.
        beside_s: the stalls measured then.
    """

    alone: float = 0.0
    alone_s: tuple[float, ...] = ()
    beside: float = 0.0
    beside_s: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        for share, sizes, name in ((self.alone, self.alone_s, "alone"), (self.beside, self.beside_s, "beside")):
            if not 0 <= share <= 1:
                raise ValueError(f"stalls {name} must be a share in [0, 1], got {share!r}")
            if share > 0 and not sizes:
                raise ValueError(f"stalls {name} is {share!r} but no stall of that kind was measured ({name}_s is empty)")
            if any(not s > 0 for s in sizes):
                raise ValueError(f"stalls {name}_s must be seconds > 0, got {sizes!r}")


STALL_MIN_S = 0.04  # past its server's median: several decode steps here, well beyond a step's noise


def fit_stalls(ttfts: Sequence[Sequence[float]], min_s: float = STALL_MIN_S) -> tuple[float, tuple[float, ...]]:
    """The share of requests that stalled and their stalls, from the times to first token of a
    steady stream of like requests, one sequence per server: a stall is a time ``min_s`` or
    more past its server's median, by how much.

    Raises:
        ValueError: no times.
    """
    import statistics

    if not any(ttfts):
        raise ValueError("stalls need the times to first token of at least one request")
    stalls = []
    for times in ttfts:
        if times:
            median = statistics.median(times)
            stalls += [t - median for t in times if t - median >= min_s]
    return len(stalls) / sum(len(t) for t in ttfts), tuple(sorted(stalls))


def fit_decode(points: Sequence[tuple[int, int, float]]) -> DecodeFit:
    """The fit through ``(batch, held_tokens, seconds)`` points.

    Raises:
        ValueError: fewer than 3 points, a non-positive batch or time, or no term left that grows
            with the batch (measure larger batches).
    """
    import numpy as np

    if len(points) < 3:
        raise ValueError(f"a decode fit needs at least 3 points, got {len(points)}")
    if any(b <= 0 or s < 0 or not t > 0 for b, s, t in points):
        raise ValueError("decode fit needs positive batch sizes and times, and held tokens >= 0")
    weight = np.array([1 / t for _, _, t in points])
    rows = np.array([[1.0, b, s] for b, s, _ in points]) * weight[:, None]
    keep = [0, 1, 2]
    while True:
        coef, *_ = np.linalg.lstsq(rows[:, keep], np.ones(len(points)), rcond=None)
        values = dict(zip(keep, coef))
        negative = [k for k in keep if values[k] < 0]
        if not negative:
            break
        keep.remove(min(negative, key=lambda k: values[k]))
        if 1 not in keep and 2 not in keep:
            raise ValueError("decode fit: step time does not grow with the batch or its tokens; measure larger batches")
    return DecodeFit(float(values.get(0, 0.0)), float(values.get(1, 0.0)), float(values.get(2, 0.0)))


def connector_fit(plain: Sequence[float], ours: Sequence[float], points: Sequence[tuple[int, float, float]],
                  prefill: PrefillFit, restore_s: Callable[[int], float], store_s: Callable[[int], float],
                  block_size: int, prompt: int) -> ConnectorFit:
    """``request_s``: the median time to first token of ``ours`` (a stream of new ``prompt``-token
    prompts to the connector's server) beyond that of ``plain`` (the same pace to the plain
    server) and their store; ``load_s``: over ``(tokens, miss, hit)`` pairs, the median of
    what each repeat took beyond the prefill of what was left and the restore of its hit, less
    what its miss took beyond its prefill and store. Both at least 0.

    Raises:
        ValueError: either stream or the pairs empty.
    """
    if not (plain and ours and points):
        raise ValueError("the connector's cost needs a stream to each server and at least one pair")
    request = max(0.0, statistics.median(ours) - statistics.median(plain) - store_s(prompt // block_size))
    loads = []
    for n, miss, hit in points:
        cached = (n - 1) // block_size * block_size
        lone = miss - prefill.seconds(n, 0) - store_s(n // block_size)
        loads.append(hit - prefill.seconds(n - cached, cached) - restore_s(cached // block_size) - lone)
    return ConnectorFit(request, max(0.0, statistics.median(loads)))


def remote_load_fit(points: Sequence[tuple[int, float]], remote_restore_s: Callable[[int], float]) -> float:
    """What loads from the pool took beyond its restore path: the median over ``(blocks,
    seconds)`` points of ``seconds - remote_restore_s(blocks)``, at least 0."""
    return max(0.0, statistics.median(t - remote_restore_s(blocks) for blocks, t in points))
