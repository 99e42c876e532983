"""A fleet of servers for one model: which blocks each can reach, and which should take a request.

* :mod:`~kvstrata.fleet.events`: kvstrata's tiers as vLLM's KV events (pure records).
* :mod:`~kvstrata.fleet.wire`: those events as bytes, vLLM's msgpack format (msgspec; edge).
* :mod:`~kvstrata.fleet.recorder`: a server's stores and drops per tier, heard from its block managers, as batches (pure).
* :mod:`~kvstrata.fleet.publisher`: published over ZMQ as vLLM publishes its own (edge).
* :mod:`~kvstrata.fleet.feed`: received messages into the index, a bad one one line (edge).
* :mod:`~kvstrata.fleet.hashes`: a prompt's vLLM block hashes, as a router computes them (edge: vLLM).
* :mod:`~kvstrata.fleet.index`: a per-server map of block hash -> tiers held, from the events (pure).
* :mod:`~kvstrata.fleet.cost`: one server's predicted restore and prefill, the connector's model (pure).
* :mod:`~kvstrata.fleet.scorer`: routing policies behind one Protocol (pure).
* :mod:`~kvstrata.fleet.router`: the router's fleet state: queues, in-flight limits, health (pure).
* :mod:`~kvstrata.fleet.prompt`: what of an OpenAI request to tokenize, and how to ask a server (pure).
* :mod:`~kvstrata.fleet.front`: ``kvstrata route``, the OpenAI-compatible HTTP front (edge: aiohttp).
* :mod:`~kvstrata.fleet.health`: servers' ``/health`` polled, their KV events subscribed (edge).
* :mod:`~kvstrata.fleet.metrics`: the router's Prometheus series (edge: prometheus_client).

This package's ``__init__`` imports nothing: the pure modules load without msgspec or zmq.
"""
