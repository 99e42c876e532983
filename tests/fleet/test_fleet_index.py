"""The fleet index: per server, which tiers hold each block, the pool reached by every server;
scripted scenarios, bad input, and a property against a plain model."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.fleet.events import Batch, Cleared, Removed, Stored
from kvstrata.fleet.index import Applied, FleetIndex, UnknownServer
from kvstrata.fleet.wire import decode_batch, encode_batch
from kvstrata.media import Medium

D, H, S, P = Medium.DEVICE, Medium.HOST, Medium.DISK, Medium.REMOTE


def batch(*events) -> Batch:
    return Batch(0.0, tuple(events))


def test_a_server_holds_each_block_on_its_tiers_fastest_first():
    index = FleetIndex(["a", "b"])
    applied = index.apply("a", batch(Stored((1, 2, 3), S), Stored((1,), D), Stored((1,), S)))
    assert applied == Applied(stored=4)  # block 1 on disk again: nothing new
    assert index.held("a", 1) == (D, S)
    assert index.held("a", 2) == (S,)
    assert index.held("b", 1) == ()
    assert index.reach("a", [1, 2, 3, 4]) == (D, S, S)
    assert index.count("a", S) == 3 and index.count("a", D) == 1


def test_reach_is_a_prefix_it_stops_at_the_first_block_missing():
    index = FleetIndex(["a"])
    index.apply("a", batch(Stored((1, 3), H)))
    assert index.reach("a", [1, 2, 3]) == (H,)
    assert index.reach("a", [2, 3]) == ()


def test_the_pool_is_reached_by_every_server_whoever_stored_it_and_dropped_for_all():
    index = FleetIndex(["a", "b", "c"])
    index.apply("a", batch(Stored((1, 2), P), Stored((1,), H)))
    assert index.reach("b", [1, 2]) == (P, P)
    assert index.reach("c", [1, 2]) == (P, P)
    assert index.reach("a", [1, 2]) == (H, P)  # its own host copy is faster
    assert index.count("c", P) == 2
    index.apply("b", batch(Removed((2,), P)))  # whoever sees the pool drop it says so for all
    assert index.reach("a", [1, 2]) == (H,)
    assert index.reach("c", [1, 2]) == (P,)


def test_removal_drops_one_tier_and_a_removal_of_what_is_not_held_is_nothing():
    index = FleetIndex(["a"])
    index.apply("a", batch(Stored((1,), H), Stored((1,), S)))
    assert index.apply("a", batch(Removed((1,), H), Removed((9,), H), Removed((1,), D))) == Applied(removed=1)
    assert index.held("a", 1) == (S,)
    index.apply("a", batch(Removed((1,), S)))
    assert index.held("a", 1) == () and index.count("a", S) == 0


def test_vllms_all_blocks_cleared_empties_the_device_tier_only():
    index = FleetIndex(["a", "b"])
    index.apply("a", batch(Stored((1, 2), D), Stored((2,), H), Stored((3,), P)))
    index.apply("b", batch(Stored((1,), D)))
    assert index.apply("a", batch(Cleared())) == Applied(cleared=2)
    assert (index.held("a", 1), index.held("a", 2), index.held("a", 3)) == ((), (H,), (P,))
    assert index.held("b", 1) == (D,)


def test_a_server_that_restarted_or_left_holds_nothing_and_the_pool_stays():
    index = FleetIndex(["a", "b"])
    index.apply("a", batch(Stored((1,), H), Stored((2,), P)))
    index.reset("a")
    assert index.held("a", 1) == () and index.held("a", 2) == (P,)
    index.apply("a", batch(Stored((1,), H)))
    index.remove_server("a")
    assert index.servers == ("b",)
    assert index.reach("b", [2]) == (P,)
    index.add_server("a")
    assert index.held("a", 1) == ()


def test_an_unknown_server_is_one_clear_error_naming_the_known_ones():
    index = FleetIndex(["a", "b"])
    for call in (lambda: index.apply("z", batch(Stored((1,), H))), lambda: index.reach("z", [1]),
                 lambda: index.held("z", 1), lambda: index.reset("z"), lambda: index.remove_server("z")):
        with pytest.raises(UnknownServer, match=r"unknown server 'z' \(known: a, b\)"):
            call()
    assert index.held("a", 1) == ()
    with pytest.raises(ValueError, match="already"):
        index.add_server("a")
    with pytest.raises(ValueError, match="non-empty"):
        index.add_server("")


def test_a_malformed_batch_is_refused_before_the_index_and_the_index_goes_on():
    index = FleetIndex(["a"])
    index.apply("a", decode_batch(encode_batch(batch(Stored((1,), H)))))
    good = encode_batch(batch(Stored((2,), H)))
    bad = good.replace(b"CPU", b"TPU")
    with pytest.raises(ValueError, match="unknown KV event medium 'TPU'"):
        index.apply("a", decode_batch(bad))
    with pytest.raises(ValueError, match="malformed KV event batch"):
        index.apply("a", decode_batch(good[:-5]))
    assert index.reach("a", [1, 2]) == (H,)  # nothing of the bad batches applied
    index.apply("a", decode_batch(good))
    assert index.reach("a", [1, 2]) == (H, H)


SERVERS = ("a", "b")
_events = st.lists(st.tuples(
    st.sampled_from(SERVERS),
    st.sampled_from(("store", "remove", "clear")),
    st.sampled_from(tuple(Medium)),
    st.lists(st.integers(0, 5), max_size=4).map(tuple),
), max_size=30)


@settings(max_examples=150, deadline=None)
@given(_events)
def test_the_index_holds_what_a_plain_model_of_the_events_holds(events):
    index = FleetIndex(SERVERS)
    local: dict[tuple[str, int], set[Medium]] = {}
    pool: set[int] = set()
    for server, kind, medium, hashes in events:
        if kind == "store":
            index.apply(server, batch(Stored(hashes, medium)))
            for h in hashes:
                pool.add(h) if medium is P else local.setdefault((server, h), set()).add(medium)
        elif kind == "remove":
            index.apply(server, batch(Removed(hashes, medium)))
            for h in hashes:
                pool.discard(h) if medium is P else local.get((server, h), set()).discard(medium)
        else:
            index.apply(server, batch(Cleared()))
            for (s, _), media in local.items():
                if s == server:
                    media.discard(D)
    for server in SERVERS:
        for h in range(6):
            expected = local.get((server, h), set()) | ({P} if h in pool else set())
            assert index.held(server, h) == tuple(sorted(expected, key=lambda m: m.value))
        for medium in (D, H, S):
            assert index.count(server, medium) == sum(1 for (s, _), m in local.items() if s == server and medium in m)
        hashes = list(range(6))
        reach = index.reach(server, hashes)
        assert all(index.held(server, h)[0] is reach[i] for i, h in enumerate(hashes[: len(reach)]))
        assert len(reach) == len(hashes) or index.held(server, hashes[len(reach)]) == ()
