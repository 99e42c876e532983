"""A server's recent time per output token, as its decoding requests see it (pure).

What a router knows of a server's decode load is the pace its streams come back at: the gaps
between tokens. Every gap counts, the decode step itself and whatever the server ran in between
(a prefill of another request stalls every decode on it), which is what a request's TPOT is made
of. :class:`TokenPace` keeps a time-decayed mean of those gaps, so a server that piled work up a
minute ago is judged by what it does now:

    pace = sum(gap * tokens * decay) / sum(tokens * decay),   decay = exp(-age / window_s)

and a gap still open (no token since ``last_s`` while requests decode: a long prefill under way)
counts as one token's gap once it is longer than the mean. The caller says when nothing decodes
there (the pace is then no one's). ``kvstrata route`` feeds it from the
streams' chunks, the simulator from its instances' decode steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PACE_WINDOW_S = 10.0  # a gap's weight falls by e each 10 s: about one long answer's decode


@dataclass
class TokenPace:
    """The decayed mean time per output token of one server (see the module text)."""

    window_s: float = PACE_WINDOW_S
    _seconds: float = 0.0  # decayed sum of gap x tokens
    _tokens: float = 0.0  # decayed sum of tokens
    _at: float = 0.0  # when the sums were last decayed
    last_s: float | None = None  # when the last token came

    def __post_init__(self) -> None:
        if not self.window_s > 0:
            raise ValueError(f"a pace's window must be > 0 s, got {self.window_s}")

    def start(self, now_s: float) -> None:
        """Requests begin decoding on a server where none did: a gap left open counts from ``now_s``."""
        self.last_s = now_s

    def add(self, now_s: float, gap_s: float, count: int = 1) -> None:
        """``count`` tokens came at ``now_s``, each ``gap_s`` after its request's last (a step's
        batch: every running request's token, after the step's gap)."""
        if count < 1 or not (math.isfinite(gap_s) and gap_s >= 0):
            raise ValueError(f"a pace adds tokens (got {count}) after a gap of >= 0 s (got {gap_s})")
        self._decay(now_s)
        self._seconds += gap_s * count
        self._tokens += count
        self.last_s = now_s

    def seconds_per_token(self, now_s: float) -> float | None:
        """The pace now (None: no gap seen yet), the open gap counted once it exceeds the mean."""
        if self._tokens <= 0.0:
            return None
        self._decay(now_s)
        mean = self._seconds / self._tokens
        open_s = now_s - self.last_s if self.last_s is not None else 0.0
        return (self._seconds + open_s) / (self._tokens + 1.0) if open_s > mean else mean

    def _decay(self, now_s: float) -> None:
        if now_s > self._at:
            keep = math.exp(-(now_s - self._at) / self.window_s)
            self._seconds *= keep
            self._tokens *= keep
            self._at = now_s
