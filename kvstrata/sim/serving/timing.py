"""The serving simulator's time model: one engine step, one load, one store, on this host (pure).

Every figure comes from one calibrated profile (``kvstrata calibrate --model-dir DIR --engine
vllm``): the engine's prefill and decode-step fits for the model, and the host's restore paths.

Both fits were measured as a client of ``vllm serve`` sees them (:mod:`kvstrata.calibrate.serving.steps`):
a decode step as the time between tokens (as the client read them, or as the engine stamped
them where the client read a burst), a prefill as the time to the first token.
So a request's first token pays, beyond one engine step, what serving adds around it:

    prefill.latency - decode.latency

taken as half on the way in (the HTTP server, the hand-off to the engine: ``request_in_s``)
and half on the way out (the token detokenized and streamed back: ``response_out_s``); every
later token pays the way out too, so the time between tokens is the engine's step. A step of
vLLM's scheduler runs its decodes and its prefill chunks in one forward pass. Its time:

    decode.latency + decode.per_request x decodes + decode.per_token x tokens they hold
      + per prefill chunk of n new tokens after c computed:
            n / prefill.tokens_per_s + prefill.attn x n x (c + n / 2)

so a step of decodes alone is the decode fit, and a request alone, sent to an idle server, sees
the prefill fit as its time to first token. Loads run inside the step (the connector's layer
hooks wait for them): a step carrying loads takes their time too, each tier's from
``HostCalibration.restore_s``, and the connector's own cost per request it admits and per load
(``ConnectorFit``, measured through ``vllm serve`` with the connector). A store runs behind the engine: a tier can serve the stored
block after its path's time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvstrata.media import Medium
from kvstrata.plan.calpaths import CalPath
from kvstrata.plan.host import HostCalibration, PrefillFit
from kvstrata.plan.steps import ConnectorFit, DecodeFit, Stalls
from kvstrata.sim.serving.store import StoreHit

LOAD_TIER = {Medium.DEVICE: Medium.HOST, Medium.HOST: Medium.HOST, Medium.DISK: Medium.DISK, Medium.REMOTE: Medium.REMOTE}
STORE_PATH = {Medium.HOST: CalPath.MEMCPY_ONE, Medium.DISK: CalPath.DISK_WRITE, Medium.REMOTE: CalPath.POOL_PUT}


@dataclass(frozen=True)
class Chunk:
    """A prefill chunk in a step: ``new`` tokens computed after ``cached`` already held."""

    new: int
    cached: int


@dataclass(frozen=True)
class ServingTimes:
    """Seconds of a step, a load and a store on one host (see the module text).

    Attributes:
        prefill, decode: the engine's fits for the model.
        calibration: the host's paths (loads and stores); None: loads and stores take no time.
        block_bytes: one block's KV.
        workers: the cache's transfer threads.
        connector: what the connector adds to a request and a load.
        stalls: how often a request's way in stalls on this host, and by how much (taken in turn by
            :class:`~kvstrata.sim.serving.cpus.HostCpus`).
    """

    prefill: PrefillFit
    decode: DecodeFit
    calibration: HostCalibration | None
    block_bytes: int
    workers: int = 2
    connector: ConnectorFit = ConnectorFit(0.0)
    stalls: Stalls = Stalls()

    @classmethod
    def of(cls, calibration: HostCalibration, model: str, block_bytes: int, workers: int = 2,
           tiers: tuple[Medium, ...] = (Medium.HOST, Medium.DISK)) -> ServingTimes:
        """The profile's fits for ``model``, checked to time a load from each of ``tiers``.

        Raises:
            ValueError: the profile has no vLLM step fits for ``model`` (names what it has), or
                lacks a path a load from one of ``tiers`` takes (names it).
        """
        if model not in calibration.decode or model not in calibration.prefill:
            have = ", ".join(sorted(calibration.decode)) or "none"
            raise ValueError(f"the profile has no vLLM step fits for model {model!r} (have: {have}); run "
                             f"kvstrata calibrate --model-dir DIR --engine vllm")
        for tier in tiers:
            try:
                calibration.restore_s(LOAD_TIER[tier], block_bytes, 1, workers=workers)
            except KeyError as exc:
                pool = " (calibrate with --pool)" if tier is Medium.REMOTE else ""
                raise ValueError(f"the profile cannot time a load from {tier.label}{pool}: {exc.args[0]}") from None
        return cls(calibration.prefill[model], calibration.decode[model], calibration, block_bytes, workers,
                   calibration.connector.get(model, ConnectorFit(0.0)), calibration.stalls.get(model, Stalls()))

    @property
    def request_in_s(self) -> float:
        """From the client's send to the engine's queue (see the module text)."""
        return max(0.0, self.prefill.latency_s - self.decode.latency_s) / 2

    @property
    def response_out_s(self) -> float:
        """From a token sampled to the client's reading it (see the module text)."""
        return self.request_in_s

    def step_s(self, chunks: Sequence[Chunk], decodes: int, held_tokens: int) -> float:
        """One step running ``chunks`` and ``decodes`` requests holding ``held_tokens`` in all."""
        d, p = self.decode, self.prefill
        seconds = d.latency_s + d.per_request_s * decodes + d.per_token_s * held_tokens
        for c in chunks:
            seconds += c.new / p.tokens_per_s + p.attn_s * c.new * (c.cached + c.new / 2)
        return seconds

    def load_s(self, hit: StoreHit) -> float:
        """A load of ``hit``'s blocks: the connector's own cost of a load, and each tier's restore
        of its blocks, one after another (from the pool, with what a load from it took beyond its
        path as served: ``ConnectorFit.remote_load_s``)."""
        seconds = self.connector.load_s + (self.connector.remote_load_s if Medium.REMOTE in hit.tiers else 0.0)
        if self.calibration is None:
            return seconds
        for path in dict.fromkeys(LOAD_TIER[t] for t in hit.tiers):  # device and host blocks: one copy
            n = sum(1 for t in hit.tiers if LOAD_TIER[t] == path)
            seconds += self.calibration.restore_s(path, n * self.block_bytes, n, workers=self.workers)
        return seconds

    def store_s(self, tier: Medium, blocks: int) -> float:
        """A store of ``blocks`` written into ``tier`` (0 for the device tier: the step's own copy)."""
        path = STORE_PATH.get(tier)
        if self.calibration is None or path is None or path not in self.calibration.paths:
            return 0.0
        return self.calibration.paths[path].seconds(blocks * self.block_bytes)
