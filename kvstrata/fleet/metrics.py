"""The router's Prometheus metrics, in a registry of its own (edge: prometheus_client).

Every series names the server by its URL; request counts also by the policy that chose it, so
runs of several policies scraped into one Prometheus stay apart.

=====================================================  ============================================
``kvstrata_route_requests_total{server,policy,code}``  requests answered, by the HTTP status sent
``kvstrata_route_retries_total{server,reason}``        a request taken elsewhere after ``server``
                                                       failed it (``connect`` or ``5xx``)
``kvstrata_route_rejected_total{reason}``              refused: ``busy`` (429), ``no_server`` (503)
``kvstrata_route_server_up{server}``                   1 while its ``/health`` answers, else 0
``kvstrata_route_inflight{server}``                    requests sent and not ended
``kvstrata_route_queued_prefill_tokens{server}``       prompt tokens sent, not yet past a first token
``kvstrata_route_streamed_tokens_total{server}``      streamed tokens after each answer's first (the
                                                       pace's input: SSE events of tokens)
``kvstrata_route_tpot_seconds{server}``                the pace of its decoding requests' tokens (the
                                                       decayed mean gap; NaN while nothing decodes)
``kvstrata_route_ttft_seconds{server,kind}``           time to the first token: ``predicted`` by the
                                                       cost model at routing, ``measured`` (the first
                                                       byte of a streamed answer) by the router
``kvstrata_route_event_batches_total{server,outcome}`` KV event batches ``applied`` or ``refused``
=====================================================  ============================================
"""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvstrata.fleet.router import Health, Router

CONTENT_TYPE = CONTENT_TYPE_LATEST
TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class RouteMetrics:
    """The router's series; :meth:`render` refreshes the gauges from the router and exposes all."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvstrata_route_requests", "Requests answered", ["server", "policy", "code"], registry=r)
        self.retries = Counter("kvstrata_route_retries", "Requests taken elsewhere after a server failed them",
                               ["server", "reason"], registry=r)
        self.rejected = Counter("kvstrata_route_rejected", "Requests refused", ["reason"], registry=r)
        self.up = Gauge("kvstrata_route_server_up", "1 while the server answers /health", ["server"], registry=r)
        self.inflight = Gauge("kvstrata_route_inflight", "Requests in flight", ["server"], registry=r)
        self.queued = Gauge("kvstrata_route_queued_prefill_tokens", "Prompt tokens not yet past a first token",
                            ["server"], registry=r)
        self.streamed = Counter("kvstrata_route_streamed_tokens", "Streamed tokens after each answer's first",
                                ["server"], registry=r)
        self.tpot = Gauge("kvstrata_route_tpot_seconds", "Time per output token of the decoding requests (NaN: none)",
                          ["server"], registry=r)
        self.ttft = Histogram("kvstrata_route_ttft_seconds", "Time to the first token, predicted and measured",
                              ["server", "kind"], buckets=TTFT_BUCKETS_S, registry=r)
        self.event_batches = Counter("kvstrata_route_event_batches", "KV event batches taken",
                                     ["server", "outcome"], registry=r)

    def render(self, router: Router) -> bytes:
        """The exposition text, the gauges set from ``router`` now."""
        for view in router.view():
            self.up.labels(view.server).set(1 if view.health is Health.UP else 0)
            self.inflight.labels(view.server).set(view.inflight)
            self.queued.labels(view.server).set(view.queued_tokens)
            self.tpot.labels(view.server).set(math.nan if view.tpot_s is None else view.tpot_s)
        return generate_latest(self.registry)
