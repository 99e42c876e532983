"""Servers' messages into the fleet index: applied whole, or refused with one line and counted;
batches missed and publishers restarted told from their sequence numbers."""

from __future__ import annotations

import pytest

from kvstrata.fleet.events import Batch, Stored
from kvstrata.fleet.feed import EventFeed
from kvstrata.fleet.index import Applied, FleetIndex, UnknownServer
from kvstrata.fleet.wire import to_frames
from kvstrata.media import Medium

H = Medium.HOST


def message(seq: int, *hashes: int) -> list[bytes]:
    return list(to_frames("kv", seq, Batch(0.0, (Stored(hashes, H),))))


def test_messages_apply_in_order_and_a_gap_is_counted():
    feed = EventFeed(FleetIndex(["a", "b"]))
    assert feed.take("a", message(0, 1)).applied == Applied(stored=1)
    taken = feed.take("a", message(3, 2))
    assert (taken.missed, taken.restarted) == (2, False)
    assert feed.take("b", message(5, 3)).missed == 5  # joined late
    assert feed.index.reach("a", [1, 2]) == (H, H)
    assert (feed.counts["a"].batches, feed.counts["a"].missed, feed.counts["b"].missed) == (2, 2, 5)


def test_a_publisher_that_starts_again_is_counted_and_its_blocks_kept():
    feed = EventFeed(FleetIndex(["a"]))
    feed.take("a", message(0, 1))
    feed.take("a", message(1, 2))
    taken = feed.take("a", message(0, 3))
    assert taken.restarted and taken.missed == 0
    assert feed.counts["a"].restarts == 1
    assert feed.index.reach("a", [1, 2, 3]) == (H, H, H)


@pytest.mark.parametrize(("frames", "says"), [
    ([b"kv", b"\x00" * 8], "2 frames"),
    ([b"kv", (1).to_bytes(8, "big"), b"\xc1junk"], "malformed KV event batch"),
    ([b"kv", (1).to_bytes(8, "big"), to_frames("kv", 1, Batch(0.0, (Stored((9,), H),)))[2].replace(b"CPU", b"TPU")],
     "unknown KV event medium 'TPU'"),
])
def test_a_malformed_message_is_one_line_naming_the_server_and_the_index_goes_on(frames, says):
    feed = EventFeed(FleetIndex(["a"]))
    feed.take("a", message(0, 1))
    taken = feed.take("a", frames)
    assert taken.applied is None and "\n" not in taken.error
    assert taken.error.startswith("KV events from 'a' refused: ") and says in taken.error
    assert feed.counts["a"].refused == 1 and feed.counts["a"].last_seq == 0
    assert feed.take("a", message(1, 2)).missed == 0  # the refused message's seq was not taken
    assert feed.index.reach("a", [1, 2, 9]) == (H, H)


def test_a_message_from_an_unknown_server_raises_naming_the_known_ones():
    feed = EventFeed(FleetIndex(["a"]))
    with pytest.raises(UnknownServer, match=r"unknown server 'z' \(known: a\)"):
        feed.take("z", message(0, 1))
