"""What a prompt costs one server before its first token: the connector's own model (pure).

A server's kvstrata connector decides per request how much of a hit to load
(:class:`~kvstrata.policies.payoff.LoadOrRecompute`): each tier's loads as a line in blocks
(``fixed + per_block * blocks``, tiers summed, a conservative bound), the prefill as seconds per
token, and of a hit's blocks ``0 .. n-1`` the ``k`` whose loading saves the most prefill, if it
saves ``margin`` times what it costs. A router predicts the same decision with the same numbers
(:class:`ServerCost`), and from it the server's time to the first token:

    restore = load(k) + (prompt_tokens - k * block_tokens) * per_token_s

Blocks on the device (vLLM's own KV, GPU or CPU) cost nothing to load. A hit never reaches the
prompt's last token (vLLM computes at least one). A tier the server has no line for (never
measured, or not calibrated) ends what it can use: the router cannot price it, and a server
that has not measured it grants it only to measure it.

The numbers come from where the connector gets them: a live decision's fits
(:meth:`ServerCost.from_decision`), or before any request a host's calibration
(:meth:`ServerCost.from_calibration`, the load times of :mod:`kvstrata.plan.loadtime`).
"""

from __future__ import annotations

import math
import types
from collections.abc import Mapping
from dataclasses import dataclass

from kvstrata.media import Medium
from kvstrata.plan.calpaths import CalPath
from kvstrata.plan.host import HostCalibration
from kvstrata.policies.payoff import MARGIN, DecayingFit, LoadOrRecompute, best_prefix


@dataclass(frozen=True)
class RestoreLine:
    """``seconds = fixed_s + per_block_s * blocks`` for a load of ``blocks > 0`` from one tier."""

    fixed_s: float
    per_block_s: float
    cap_blocks: float = math.inf  # past this many blocks, no more time (a fit of one size: see from_fit)

    def __post_init__(self) -> None:
        for name in ("fixed_s", "per_block_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"a restore line's {name} must be finite and >= 0, got {value}")
        if not self.cap_blocks > 0:
            raise ValueError(f"a restore line's cap_blocks must be > 0, got {self.cap_blocks}")

    def seconds(self, blocks: int) -> float:
        return self.fixed_s + self.per_block_s * min(blocks, self.cap_blocks) if blocks > 0 else 0.0

    @classmethod
    def through(cls, one_s: float, two_s: float) -> RestoreLine:
        """The line through the restores of one block and of two."""
        per_block = max(0.0, two_s - one_s)
        return cls(max(0.0, one_s - per_block), per_block)

    @classmethod
    def from_fit(cls, fit: DecayingFit) -> RestoreLine | None:
        """The connector's prediction from a tier's fit (:meth:`DecayingFit.predict`; None before
        any sample). A fit of one size has no slope: in proportion below that size, as seen above
        it. A negative intercept is taken as 0 (an upper bound)."""
        if fit.n <= 0:
            return None
        mean_x, mean_y = fit.sx / fit.n, fit.sy / fit.n
        slope = fit.slope
        if slope is None:
            return cls(0.0, mean_y / mean_x, cap_blocks=mean_x) if mean_x > 0 else cls(max(0.0, mean_y), 0.0)
        return cls(max(0.0, mean_y - slope * mean_x), slope)


@dataclass(frozen=True)
class Restore:
    """One server's predicted start of one prompt, its queue aside.

    Attributes:
        reached_blocks: blocks of the prompt it can use (held, priced, short of the last token).
        loaded_blocks: of those, the prefix it would load (the connector's grant, as predicted).
        load_s: predicted time to load them.
        prefill_tokens: tokens it computes (the rest of the prompt).
        prefill_s: predicted time to compute them.
    """

    reached_blocks: int
    loaded_blocks: int
    load_s: float
    prefill_tokens: int
    prefill_s: float

    @property
    def seconds(self) -> float:
        return self.load_s + self.prefill_s


@dataclass(frozen=True)
class ServerCost:
    """One server's measured costs, as its connector weighs load against recompute.

    Attributes:
        block_tokens: tokens per block.
        per_token_s: prefill seconds per token.
        restore: per tier it loads from, its loads' line (the device tier needs none: free).
        margin: a load must save this many times what it costs (the connector's ``margin``).
    """

    block_tokens: int
    per_token_s: float
    restore: Mapping[Medium, RestoreLine]
    margin: float = MARGIN

    def __post_init__(self) -> None:
        if self.block_tokens <= 0:
            raise ValueError(f"block_tokens must be positive, got {self.block_tokens}")
        if not (math.isfinite(self.per_token_s) and self.per_token_s > 0):
            raise ValueError(f"per_token_s must be finite and positive, got {self.per_token_s}")
        if not self.margin >= 1:
            raise ValueError(f"margin must be >= 1, got {self.margin}")
        object.__setattr__(self, "restore", types.MappingProxyType(dict(self.restore)))

    @classmethod
    def from_decision(cls, decision: LoadOrRecompute) -> ServerCost:
        """The costs a server's live decision has measured (its prefill's slope, its tiers' fits).

        Raises:
            ValueError: its prefill is not measured yet (no slope to price tokens with).
        """
        per_token = decision.per_token_s
        if per_token is None or per_token <= 0:
            raise ValueError("the server's prefill is not measured yet: no seconds per token to predict with")
        lines = {m: line for m, fit in decision.loads.items() if (line := RestoreLine.from_fit(fit)) is not None}
        return cls(decision.block_tokens, per_token, lines, decision.margin)

    @classmethod
    def from_calibration(cls, calibration: HostCalibration, model_id: str, block_tokens: int, block_bytes: int,
                         workers: int = 1) -> ServerCost:
        """The costs a host's calibration predicts for ``model_id``: its prefill's per-token term
        and, per tier calibrated, :meth:`HostCalibration.restore_s` at one and two blocks (a
        tier whose paths were not measured is left out).

        Raises:
            ValueError: ``model_id``'s prefill was not calibrated on this host.
        """
        prefill = calibration.prefill.get(model_id)
        if prefill is None:
            raise ValueError(f"no prefill calibrated for {model_id!r} on {calibration.host}")
        cold = CalPath.DISK_READ_COLD in calibration.paths
        lines = {}
        for medium in (Medium.HOST, Medium.DISK, Medium.REMOTE):
            try:
                one, two = (calibration.restore_s(medium, n * block_bytes, n, workers, cold=cold) for n in (1, 2))
            except KeyError:
                continue
            lines[medium] = RestoreLine.through(one, two)
        return cls(block_tokens, 1.0 / prefill.tokens_per_s, lines)

    def queue_s(self, tokens: int) -> float:
        """Time to compute ``tokens`` waiting ahead of a request."""
        return max(0, tokens) * self.per_token_s

    def load_s(self, blocks_by_tier: Mapping[Medium, int]) -> float:
        """Predicted load of these blocks: per tier its line, tiers summed; device blocks free.

        Raises:
            KeyError: a tier with no line.
        """
        return sum(self.restore[m].seconds(n) for m, n in blocks_by_tier.items() if m is not Medium.DEVICE)

    def plan(self, reach: tuple[Medium, ...], prompt_tokens: int) -> Restore:
        """The load the connector would grant of a hit on ``reach`` (block i's fastest tier), and
        the predicted load and prefill of ``prompt_tokens`` after it (see the module text)."""
        if prompt_tokens < 1:
            raise ValueError(f"a prompt has at least one token, got {prompt_tokens}")
        usable = min(len(reach), (prompt_tokens - 1) // self.block_tokens)
        usable = next((i for i, m in enumerate(reach[:usable]) if m is not Medium.DEVICE and m not in self.restore),
                      usable)
        best, best_load = best_prefix(reach[:usable], self.block_tokens * self.per_token_s, self.margin, self.load_s)
        rest = prompt_tokens - best * self.block_tokens
        return Restore(usable, best, best_load, rest, rest * self.per_token_s)
