"""The simulator's fluid network: a flow that ends before the rest of its stage."""

from __future__ import annotations

import pytest

from kvstrata.hardware.flows import GB, Flow, Resource
from kvstrata.sim.network import Network


def run_to_completion(net: Network, limit: int = 100) -> int:
    """Drive the network as the engine does (wake at the next event, advance); return the wakes."""
    for wakes in range(limit):
        t = net.next_event_s()
        if t is None:
            return wakes
        net.advance(t)
    raise AssertionError(f"still {net.active} job(s) after {limit} wake-ups: time no longer advances")


def link(key: str, gbps: float) -> Resource:
    return Resource(key, key, gbps)


def test_a_stage_whose_flows_end_apart_completes_at_the_last_ones_end():
    # Two shards on their own 10 GB/s links, 1 and 2 GB: the first ends at 0.1 s, the stage at 0.2 s.
    done = []
    net = Network()
    flows = [Flow("a", ((link("a", 10), 1),), 1 * 10**9), Flow("b", ((link("b", 10), 1),), 2 * 10**9)]
    net.start(0.0, [lambda: flows], done.append)
    run_to_completion(net)
    assert done == [pytest.approx(0.2)]
    assert net.moved_bytes == net.sent_bytes == {"a": 1e9, "b": 2e9}


def test_a_flow_that_ends_gives_its_share_to_the_flows_still_running():
    # 1 and 2 GB share one 10 GB/s link: 5 GB/s each until 0.2 s, then the 1 GB left of the
    # second runs alone at 10 GB/s: done at 0.3 s (0.4 s if the link stayed split).
    done = []
    shared = link("shared", 10)
    net = Network()
    net.start(0.0, [lambda: [Flow("a", ((shared, 1),), 10**9), Flow("b", ((shared, 1),), 2 * 10**9)]], done.append)
    run_to_completion(net)
    assert done == [pytest.approx(0.3)]


def test_float_dust_left_on_one_flow_does_not_stall_the_clock():
    # Late in a long trace one ulp of the clock (1e6 s: ~1.2e-10 s) moves a few bytes at
    # 30 GB/s, so a flow can be left with bytes it would finish in under one ulp: it must be
    # finished, not woken for at the same instant forever.
    done = []
    net = Network()
    start = 1e6
    flows = [Flow("a", ((link("a", 30), 1),), 10**9 + 1), Flow("b", ((link("b", 30), 1),), 2 * 10**9)]
    net.start(start, [lambda: flows], done.append)
    net.advance(start + 10**9 / (30 * GB))  # about a's end, a byte or so short of it
    run_to_completion(net)
    assert done == [pytest.approx(start + 2 / 30)]
