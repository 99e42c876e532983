"""What a running decode batch holds, per KV group, as its requests grow one token a step.

Every request of the batch grows by one token per step. A FULL/MLA group keeps all its tokens;
a SLIDING/CHUNKED group of span ``s`` keeps ``min(length, s)``; a STATE group one state per
request. The sum over the batch is kept incrementally, O(log n) per join, leave and window
crossing, so a step costs O(spans) rather than O(batch): per span, the requests still shorter
than it (their count and token sum) and a heap of the steps at which each reaches it.

Bytes follow :func:`kvstrata.plan.footprint.held_bytes`, the planner's rule.
"""

from __future__ import annotations

import heapq
import itertools

from kvstrata.kv.geometry import KVGeometry
from kvstrata.plan.footprint import held_bytes


class _Window:
    """The batch's requests still shorter than ``span`` tokens."""

    def __init__(self, span: int) -> None:
        self.span = span
        self.count = 0
        self.tokens = 0
        self._reach: list[tuple[int, int]] = []  # (step at which it is ``span`` long, request id)
        self._left: set[int] = set()  # ids that left while shorter: skipped when popped

    def join(self, rid: int, tokens: int, step: int) -> None:
        if tokens < self.span:
            self.count += 1
            self.tokens += tokens
            heapq.heappush(self._reach, (step + self.span - tokens, rid))

    def grow(self, step: int) -> None:
        """Every request is one token longer; those now ``span`` long leave the short set."""
        self.tokens += self.count
        while self._reach and self._reach[0][0] <= step:
            _, rid = heapq.heappop(self._reach)
            if rid in self._left:
                self._left.discard(rid)
                continue
            self.count -= 1
            self.tokens -= self.span

    def leave(self, rid: int, tokens: int) -> None:
        if tokens < self.span:
            self.count -= 1
            self.tokens -= tokens
            self._left.add(rid)

    def kept(self, requests: int) -> int:
        """Tokens the group keeps of ``requests`` requests: the short ones' own, ``span`` of each other one."""
        return self.tokens + (requests - self.count) * self.span


class BatchKV:
    """The KV held by one instance's running batch.

    Attributes:
        requests: requests in the batch.
        tokens: their context tokens in all (what every FULL group keeps).
        steps: decode steps so far.
    """

    def __init__(self, geometry: KVGeometry) -> None:
        self.geometry = geometry
        self.requests = 0
        self.tokens = 0
        self.steps = 0
        spans = sorted({g.span for g in geometry.groups if g.kind.windowed})
        self._windows = {span: _Window(span) for span in spans}
        self._ids = itertools.count()

    def join(self, tokens: int) -> int:
        """A request of ``tokens`` tokens joins; returns its id for :meth:`leave`."""
        rid = next(self._ids)
        self.requests += 1
        self.tokens += tokens
        for window in self._windows.values():
            window.join(rid, tokens, self.steps)
        return rid

    def step(self) -> None:
        """Every request gains one token."""
        self.steps += 1
        self.tokens += self.requests
        for window in self._windows.values():
            window.grow(self.steps)

    def leave(self, rid: int, tokens: int) -> None:
        """Request ``rid``, now ``tokens`` long, leaves."""
        self.requests -= 1
        self.tokens -= tokens
        for window in self._windows.values():
            window.leave(rid, tokens)

    def held(self) -> tuple[int, ...]:
        """Per group, in the geometry's order: tokens a per-token group keeps, states a state group holds."""
        out = []
        for group in self.geometry.groups:
            if group.kind.windowed:
                out.append(self._windows[group.span].kept(self.requests))
            elif group.kind.per_token:
                out.append(self.tokens)
            else:
                out.append(self.requests)
        return tuple(out)

    def bytes(self, tp: int = 1) -> int:
        """Bytes held on one GPU of a ``tp``-way group (``tp=1``: the logical copy)."""
        return held_bytes(self.geometry, self.held(), tp)
