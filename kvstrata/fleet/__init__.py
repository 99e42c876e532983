"""A fleet of servers for one model: which blocks each can reach, and which should take a request.

* :mod:`~kvstrata.fleet.events`: kvstrata's tiers as vLLM's KV events (pure records).
* :mod:`~kvstrata.fleet.wire`: those events as bytes, vLLM's msgpack format (msgspec; edge).
* :mod:`~kvstrata.fleet.publisher`: published over ZMQ as vLLM publishes its own (edge).
* :mod:`~kvstrata.fleet.index`: a per-server map of block hash -> tiers held, from the events (pure).
* :mod:`~kvstrata.fleet.cost`: one server's predicted restore and prefill, the connector's model (pure).
* :mod:`~kvstrata.fleet.scorer`: routing policies behind one Protocol (pure).

This package's ``__init__`` imports nothing: the pure modules load without msgspec or zmq.
"""
