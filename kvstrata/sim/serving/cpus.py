"""The host's CPUs as the simulated servers share them (pure).

On a host with few CPUs the servers do not run apart: each serving server keeps more than its
engine's CPU busy (its HTTP server streams every token, the client reads them). The model,
stated: a step that starts while another server on the host has a step in flight runs
``together`` times slower (``DecodeFit.together``, measured with two servers decoding at once,
each bound to its half of the CPUs, as ``bench serve`` binds them); a step alone runs as fitted.
Judged when the step starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class HostCpus:
    """The CPUs every simulated server on this host shares (see the module text)."""

    together: float = 1.0
    _stepping: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        if not self.together >= 1:
            raise ValueError(f"together must be >= 1, got {self.together!r}")

    def stretch(self, server: int) -> float:
        """How much slower a step ``server`` starts now runs (1: not at all)."""
        return self.together if self._stepping - {server} else 1.0

    def stepping(self, server: int, busy: bool) -> None:
        if busy:
            self._stepping.add(server)
        else:
            self._stepping.discard(server)
