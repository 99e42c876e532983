"""Publish kvstrata's KV events over ZMQ as vLLM's ``ZmqEventPublisher`` does (edge: zmq).

Same socket, same frames: a PUB socket sending ``(topic, seq, payload)`` per batch
(:func:`kvstrata.fleet.wire.to_frames`), ``seq`` counting from 0, so a subscriber written for
vLLM's events (llm-d's indexer, Dynamo's router, :func:`kvstrata.fleet.wire.from_frames`)
subscribes to kvstrata's too. The endpoint follows vLLM's rule: bind a wildcard (``tcp://*:5557``)
or an ``ipc://`` / ``inproc://`` endpoint, connect to the rest; ``bind`` overrides it.

Why not vLLM's class. ``ZmqEventPublisher`` can be built outside vLLM's engine, but it imports
vLLM's config, starts a thread per publisher, and keeps a replay buffer behind a ROUTER socket.
kvstrata publishes from the thread that stored or dropped the blocks: a PUB socket never blocks
a sender (past its high-water mark it drops, as vLLM's does), so no thread is needed; a batch
dropped there is counted (``dropped``). There is no replay: a subscriber that misses a seq
learns of the gap from the counter (as from vLLM's), and rebuilds from later events.

Privacy. A ``BlockStored`` may carry its blocks' token ids: users' prompts. An ``ipc://``
endpoint is bound only in a directory this user owns and no one else can write or read
(checked with ``lstat``: no symlinks); a ``tcp://`` one reaches whoever can reach the port, as
vLLM's does: bind it to a private network, or publish events without token ids.
"""

from __future__ import annotations

import threading
from pathlib import Path
from types import TracebackType

import zmq

from kvstrata.fleet.events import Batch
from kvstrata.fleet.wire import to_frames
from kvstrata.trust import check_private_dir

DEFAULT_HWM = 100_000  # vLLM's default high-water mark for its PUB socket


class EventPublisher:
    """A PUB socket that sends :class:`~kvstrata.fleet.events.Batch` es in vLLM's wire format.

    Thread-safe: one lock around the socket (ZMQ sockets are not), held for a send only.

    Args:
        endpoint: ``tcp://*:5557``, ``tcp://127.0.0.1:0`` (any free port; see :attr:`endpoint`),
            ``ipc:///run/user/1000/kvstrata/events`` ...
        topic: the first frame of every message (vLLM's ``KVEventsConfig.topic``).
        hwm: the socket's send high-water mark, in messages.
        bind: bind (True) or connect (False); None: vLLM's rule (see the module text).
        context: the ZMQ context (None: the process's shared one).
    """

    def __init__(self, endpoint: str, topic: str = "", hwm: int = DEFAULT_HWM, bind: bool | None = None,
                 context: zmq.Context | None = None) -> None:
        if hwm <= 0:
            raise ValueError(f"hwm must be positive, got {hwm}")
        self._topic = topic
        self._lock = threading.Lock()
        self._seq = 0
        self.dropped = 0
        if bind is None:
            bind = "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
        if bind and endpoint.startswith("ipc://"):
            check_private_dir(Path(endpoint.removeprefix("ipc://")).parent, "KV event socket directory")
        self._socket = (context or zmq.Context.instance()).socket(zmq.PUB)
        try:
            self._socket.set_hwm(hwm)
            if bind:
                self._socket.bind(endpoint)
            else:
                self._socket.connect(endpoint)
        except zmq.ZMQError as e:
            self._socket.close(linger=0)
            raise ValueError(f"cannot {'bind' if bind else 'connect'} KV event endpoint {endpoint!r}: {e}") from None
        self.endpoint: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT) if bind else endpoint

    def publish(self, batch: Batch) -> int:
        """Send ``batch``; returns its seq (the next batch's is one more, sent or dropped)."""
        with self._lock:
            if self._socket.closed:
                raise RuntimeError("the KV event publisher is closed")
            seq = self._seq
            self._seq += 1
            try:
                self._socket.send_multipart(to_frames(self._topic, seq, batch), flags=zmq.NOBLOCK)
            except zmq.Again:  # past the high-water mark: dropped, as vLLM's PUB socket drops
                self.dropped += 1
            return seq

    def close(self) -> None:
        """Close the socket, dropping what it had not sent (linger 0); idempotent."""
        with self._lock:
            self._socket.close(linger=0)

    def __enter__(self) -> EventPublisher:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

