"""The host's CPUs as the simulated servers share them (pure).

On a host with few CPUs the servers do not run apart: each serving server keeps more than its
engine's CPU busy (its HTTP server streams every token, the client reads them), and kvstrata's
stores copy, checksum and write on CPUs too. The model, stated:

* a server with a step in flight demands ``busy_per_server`` CPUs (measured while one server
  decodes: ``DecodeFit.busy_cpus``); an idle one, none;
* a store being written down demands one CPU per tier it is written to, for its path's time;
* while the demand exceeds the host's ``cpus``, everything runs slower by demand / cpus (the
  CPUs shared in proportion), judged when a step or a store starts.

A host whose CPUs were not measured (``busy_per_server`` 0) never slows anything.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

STORE_CPUS = 1.0  # a write-down to one tier: one of kvstrata's transfer threads, busy copying or hashing


@dataclass
class HostCpus:
    """The CPUs every simulated server on this host shares (see the module text)."""

    cpus: int
    busy_per_server: float
    _stepping: set[int] = field(default_factory=set)
    _stores: list[float] = field(default_factory=list)  # heap of the end times of stores being written

    @property
    def measured(self) -> bool:
        return self.cpus > 0 and self.busy_per_server > 0

    def demand(self, now_s: float) -> float:
        """CPUs demanded at ``now_s``."""
        while self._stores and self._stores[0] <= now_s:
            heapq.heappop(self._stores)
        return len(self._stepping) * self.busy_per_server + len(self._stores) * STORE_CPUS

    def stretch(self, now_s: float) -> float:
        """How much slower work started at ``now_s`` runs (1: not at all)."""
        if not self.measured:
            return 1.0
        return max(1.0, self.demand(now_s) / self.cpus)

    def stepping(self, server: int, busy: bool) -> None:
        if busy:
            self._stepping.add(server)
        else:
            self._stepping.discard(server)

    def store(self, now_s: float, seconds: float) -> float:
        """A write-down of ``seconds`` (alone) starting at ``now_s``: when it ends."""
        end = now_s + seconds * self.stretch(now_s)
        if self.measured and seconds > 0:
            heapq.heappush(self._stores, end)
        return end
