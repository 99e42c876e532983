"""Each server's published KV events into a fleet index, bad messages one line each (edge: msgspec).

A router subscribes to every server's event socket and hands each message it receives, with the
id of the server it came from, to :meth:`EventFeed.take`. A message is decoded
(:func:`kvstrata.fleet.wire.from_frames`) and applied to the index whole, or not at all: a
malformed one (not vLLM's frames, not msgpack, an unknown event or medium) is refused with one
line saying which server sent what, counted, and the index goes on as it was.

Sequence numbers. Each publisher numbers its batches from 0, one apart (vLLM's and kvstrata's
alike). A jump forward means batches were missed (a PUB socket drops past its high-water mark; a
subscriber joins late): counted in ``missed``; the index may hold blocks since dropped, or lack
blocks since stored, until later events say so. A number not above the last one means the
publisher started again (its server restarted): counted in ``restarts``; what the server held
before is not known to be gone (its disk may have kept it), so nothing is reset here. A router
that knows a server restarted calls :meth:`FleetIndex.reset`.

A message from a server the index does not know raises
:class:`~kvstrata.fleet.index.UnknownServer`: which server a socket belongs to is the router's
configuration, not a sender's input.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstrata.fleet.index import Applied, FleetIndex, UnknownServer
from kvstrata.fleet.wire import from_frames


@dataclass(frozen=True)
class Taken:
    """What one message did.

    Attributes:
        applied: what its batch changed (None: refused).
        error: why it was refused, one line (None: applied).
        missed: batches skipped before it (its seq past the next expected).
        restarted: its seq was not above the last: the publisher started again.
    """

    applied: Applied | None
    error: str | None = None
    missed: int = 0
    restarted: bool = False


@dataclass
class FeedCounts:
    """Per server, since the feed started."""

    batches: int = 0
    refused: int = 0
    missed: int = 0
    restarts: int = 0
    last_seq: int | None = None


@dataclass
class EventFeed:
    """Applies servers' published messages to ``index``, counting what went wrong per server."""

    index: FleetIndex
    counts: dict[str, FeedCounts] = field(default_factory=dict)

    def take(self, server: str, frames: list[bytes]) -> Taken:
        """Decode and apply one message from ``server``.

        Raises:
            UnknownServer: ``server`` is not in the index.
        """
        if server not in self.index.servers:
            raise UnknownServer(server, self.index.servers)
        counts = self.counts.setdefault(server, FeedCounts())
        try:
            frame = from_frames(frames)
        except ValueError as e:
            counts.refused += 1
            return Taken(None, f"KV events from {server!r} refused: {e}")
        missed, restarted = 0, False
        if counts.last_seq is not None:
            if frame.seq <= counts.last_seq:
                restarted = True
                counts.restarts += 1
            else:
                missed = frame.seq - counts.last_seq - 1
        elif frame.seq > 0:
            missed = frame.seq  # joined late: what came before was not seen
        counts.missed += missed
        counts.last_seq = frame.seq
        counts.batches += 1
        return Taken(self.index.apply(server, frame.batch), None, missed, restarted)
