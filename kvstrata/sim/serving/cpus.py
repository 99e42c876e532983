"""The host's CPUs as the simulated servers share them (pure).

On a host with few CPUs the servers do not run apart. A serving server keeps more than its
engine worker's CPUs busy: its engine core schedules every step, its HTTP server streams every
token, the client reads them. That work runs on the CPUs no worker holds. A vLLM worker holds
its CPUs while it steps and for ``spin_s`` after its last step: it busy-polls its input queue
(vLLM's shared-memory reader keeps spinning a while before it sleeps), measured on this host
from ``/proc`` by ``kvstrata calibrate --engine vllm``.

The model, stated: a step, or a request's way in or out, on a server runs ``together`` times
slower while a worker bound to other CPUs than its own steps, and ``beside_spin`` times slower
while one only spins (done stepping less than ``spin_s`` ago); alone it runs as fitted. Servers bound to the same CPUs
(``bench serve``'s baseline and kvstrata, never busy at once) take turns on them and leave the
rest free, so they do not slow each other this way. Judged when the step starts.
Both are measured as a server's decode step beside the other server, over the same step alone
(``DecodeFit.together``, ``DecodeFit.beside_spin``): while the other decodes, and just after it
answered a request. On this 2-core host, four calibrations in one hour measured a step 1.5-2.2x
slower beside a neighbour stepping, 1.2-1.8x beside one spinning (a day earlier, 1.0-1.75x).

Means leave the tail out: now and then a request's first token comes 100 ms or more late, on
a plain server as on one with the connector, more often beside another server
(:class:`~kvstrata.plan.steps.Stalls`, measured by calibrate). A request sent to a server
stalls on its way in with the measured share, by one of the measured stalls, taken in turn
rather than drawn: of every run of requests alone (or beside) the measured share stalls, within
one request, and the stalls' sizes come spread over those measured (the median first, then the
quartiles, ...). A phase of a few dozen requests has few stalls, and a seeded draw made every
phase of every replay the same lucky or unlucky one: with 13% measured, a generator seeded 0
gave none in a 24-request phase's 23 draws.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, field

from kvstrata.plan.steps import Stalls, check_beside


@dataclass
class HostCpus:
    """The CPUs every simulated server on this host shares (see the module text).

    Attributes:
        together: how much slower a server's work runs while another's worker steps on other CPUs.
        spin_s: how long a worker holds its CPUs after its last step.
        beside_spin: how much slower while another's worker only spins on other CPUs.
        stalls: how often a request's way in stalls, and by how much.
    """

    together: float = 1.0
    spin_s: float = 0.0
    beside_spin: float = 1.0
    stalls: Stalls = Stalls()
    _bound: dict[int, Hashable] = field(default_factory=dict)
    _held_until: dict[int, float] = field(default_factory=dict)  # inf while stepping
    _owed: dict[bool, float] = field(default_factory=lambda: {False: 0.5, True: 0.5})  # by beside: stalls due
    _stalled: dict[bool, int] = field(default_factory=lambda: {False: 0, True: 0})

    def __post_init__(self) -> None:
        check_beside(self.together, self.spin_s, self.beside_spin)

    def bind(self, server: int, cpus: Hashable) -> None:
        """``server``'s worker runs on ``cpus`` (any label: servers with equal labels share CPUs;
        a server never bound shares its CPUs with none)."""
        self._bound[server] = cpus

    def stretch(self, server: int, now: float) -> float:
        """How much slower ``server``'s work started at ``now`` runs (1: not at all)."""
        stretch = 1.0
        for until in self._others_held(server, now):
            stretch = max(stretch, self.together if until == math.inf else self.beside_spin)
        return stretch

    def stall_s(self, server: int, now: float) -> float:
        """How long a request sent to ``server`` at ``now`` stalls on its way in (mostly 0): the
        next in turn, beside another server's worker holding CPUs or alone (see the module text)."""
        beside = any(True for _ in self._others_held(server, now))
        share, sizes = (self.stalls.beside, self.stalls.beside_s) if beside else (self.stalls.alone, self.stalls.alone_s)
        self._owed[beside] += share
        if self._owed[beside] < 1:
            return 0.0
        self._owed[beside] -= 1
        self._stalled[beside] += 1
        return sizes[int(_spread(self._stalled[beside]) * len(sizes))]

    def _others_held(self, server: int, now: float):
        """When each worker bound to other CPUs than ``server``'s and holding them at ``now`` lets go."""
        mine = self._bound.get(server, server)
        return (until for other, until in self._held_until.items()
                if other != server and until > now and self._bound.get(other, other) != mine)

    def leave(self, server: int) -> None:
        """``server``'s process has stopped: its worker holds nothing."""
        self._held_until.pop(server, None)

    def stepping(self, server: int, busy: bool, now: float) -> None:
        """``server`` starts stepping (``busy``) or has stopped at ``now``."""
        self._held_until[server] = math.inf if busy else now + self.spin_s


def _spread(n: int) -> float:
    """The ``n``-th point (from 1) of the base-2 van der Corput sequence: 0.5, 0.25, 0.75,
    0.125, ...: each prefix spread evenly over [0, 1)."""
    point, scale = 0.0, 0.5
    while n:
        n, bit = divmod(n, 2)
        point += bit * scale
        scale /= 2
    return point
