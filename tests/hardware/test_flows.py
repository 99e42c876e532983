"""Flows: the direction rule, shared memories, max-min fair sharing and completion times."""

from __future__ import annotations

import pytest

from kvstrata.hardware.flows import (
    GB,
    Flow,
    Resource,
    estimate,
    flow_along,
    max_min_share,
    memory_read,
    memory_resource,
    run_concurrently,
)

GEN5_X16 = 32 * 16 / 8 * 128 / 130  # seed: ~63.0 GB/s one way
GEN5_PAYLOAD = GEN5_X16 * 256 / (256 + 24)  # less the stated 24 B per 256 B TLP


def _flow(topology, src, dst, size=0, via=()):
    return flow_along(topology, topology.route(src, dst, via), size)


def _rates(flows):
    return [s.gbps for s in max_min_share(flows)]


# --- the direction rule ----------------------------------------------------------------------


@pytest.mark.parametrize("profile", ["workstation", "h200-cx7-gen5"])
def test_dram_to_gpu_gets_one_direction_of_gen5(profiles, profile):
    t = profiles[profile].topology
    est = estimate(t, t.route("cpu0.dram", "gpu0"), 10**9)
    assert est.gbps <= 63.0  # the one-way spec ...
    assert est.gbps < 126 / 2 + 1e-9  # ... and nowhere near the both-ways 126
    assert est.gbps == pytest.approx(GEN5_PAYLOAD, rel=1e-9)
    assert "Gen5 x16" in est.bottleneck


@pytest.mark.parametrize("profile", ["workstation", "h200-cx7-gen5"])
def test_opposite_direction_does_not_slow_a_restore(profiles, profile):
    t = profiles[profile].topology
    alone = _rates([_flow(t, "cpu0.dram", "gpu0")])[0]
    restore, offload = _rates([_flow(t, "cpu0.dram", "gpu0"), _flow(t, "gpu0", "cpu0.dram")])
    assert restore == pytest.approx(alone)  # full duplex: each direction has its own 63
    assert offload == pytest.approx(alone)


@pytest.mark.parametrize("profile", ["workstation", "h200-cx7-gen5"])
def test_same_direction_flows_halve(profiles, profile):
    t = profiles[profile].topology
    alone = _rates([_flow(t, "cpu0.dram", "gpu0")])[0]
    a, b = _rates([_flow(t, "cpu0.dram", "gpu0"), _flow(t, "cpu0.dram", "gpu0")])
    assert a == pytest.approx(alone / 2) and b == pytest.approx(alone / 2)


# --- memories: reads and writes share one total ------------------------------------------------


@pytest.mark.parametrize("profile, gbps", [("h200-cx7-gen5", 4800), ("b200-cx8-gen6", 8000)])
def test_pure_read_gets_all_of_hbm(profiles, profile, gbps):
    (share,) = max_min_share([memory_read(profiles[profile].topology, "gpu0")])
    assert share.gbps == pytest.approx(gbps)  # the seed: "no need to divide by 2"


@pytest.mark.parametrize("profile, gbps", [("h200-cx7-gen5", 4800), ("b200-cx8-gen6", 8000)])
def test_read_and_write_share_hbm(profiles, profile, gbps):
    t = profiles[profile].topology
    read, write = _rates([memory_read(t, "gpu0", label="read"), memory_read(t, "gpu0", label="write")])
    assert read == pytest.approx(gbps / 2) and write == pytest.approx(gbps / 2)
    assert read + write == pytest.approx(gbps)  # not 4.8 read + 4.8 write


@pytest.mark.parametrize("profile, gbps", [("h200-cx7-gen5", 4800), ("b200-cx8-gen6", 8000)])
def test_copy_inside_one_hbm_reads_and_writes_each_byte(profiles, profile, gbps):
    t = profiles[profile].topology
    hbm = memory_resource(t, "gpu0")
    copy = Flow("copy gpu0->gpu0", ((hbm, 2),), size_bytes=10**9)
    (share,) = max_min_share([copy])
    assert share.gbps == pytest.approx(gbps / 2)
    (done,) = run_concurrently([copy])
    assert done.finish_s == pytest.approx(10**9 / (gbps / 2 * GB))


def test_decode_reads_share_hbm_with_a_restore_into_it(h200):
    t = h200.topology
    restore, decode = max_min_share([_flow(t, "cpu0.dram", "gpu0"), memory_read(t, "gpu0")])
    assert restore.gbps == pytest.approx(GEN5_PAYLOAD)  # PCIe-bound
    assert decode.gbps == pytest.approx(4800 - GEN5_PAYLOAD)  # HBM takes the rest
    assert decode.bottleneck.key == "mem:gpu0"


def test_flow_along_uses_both_end_memories_and_every_hop(h200):
    t = h200.topology
    f = _flow(t, "cpu0.dram", "gpu0")
    keys = [r.key for r, _ in f.uses]
    assert keys == ["mem:cpu0.dram", "cpu0->sw0", "sw0->gpu0", "mem:gpu0"]
    assert all(w == 1 for _, w in f.uses)


def test_a_path_staged_through_dram_writes_and_reads_it(h200):
    t = h200.topology
    f = _flow(t, "pool.dram", "gpu0", via=("cpu0.dram",))
    assert dict((r.key, w) for r, w in f.uses).get("mem:cpu0.dram") == 2


def test_memory_without_bandwidth_cannot_be_read(h200):
    with pytest.raises(ValueError, match="nvme0"):
        memory_read(h200.topology, "nvme0")  # flash is limited by its media link, not the node


# --- max-min fair sharing ----------------------------------------------------------------------


def _res(key: str, gbps: float) -> Resource:
    return Resource(key, key, gbps)


def test_max_min_textbook_three_flows_two_links():
    # L1 (cap 1) carries A and B, L2 (cap 2) carries A and C. L1 saturates first at 1/2 each;
    # C then takes what A leaves of L2: 2 - 1/2 = 3/2. (Bertsekas & Gallager, max-min fairness.)
    l1, l2 = _res("L1", 1.0), _res("L2", 2.0)
    a = Flow("A", ((l1, 1), (l2, 1)))
    b = Flow("B", ((l1, 1),))
    c = Flow("C", ((l2, 1),))
    shares = max_min_share([a, b, c])
    assert [s.gbps for s in shares] == pytest.approx([0.5, 0.5, 1.5])
    assert [s.bottleneck.key for s in shares] == ["L1", "L1", "L2"]


def test_max_min_single_resource_splits_equally():
    r = _res("R", 9.0)
    assert _rates([Flow(str(i), ((r, 1),)) for i in range(3)]) == pytest.approx([3.0, 3.0, 3.0])


def test_max_min_weights_count_each_use():
    # A flow drawing twice per byte (a copy inside one memory) and one drawing once: equal rates
    # x, and 2x + x = 6.
    r = _res("R", 6.0)
    shares = max_min_share([Flow("copy", ((r, 2),)), Flow("read", ((r, 1),))])
    assert [s.gbps for s in shares] == pytest.approx([2.0, 2.0])


def test_max_min_conservation_and_bottlenecks():
    l1, l2, l3 = _res("L1", 10.0), _res("L2", 4.0), _res("L3", 7.0)
    flows = [
        Flow("f0", ((l1, 1), (l2, 1))),
        Flow("f1", ((l1, 1), (l3, 1))),
        Flow("f2", ((l2, 1),)),
        Flow("f3", ((l3, 2),)),
        Flow("f4", ((l1, 1),)),
    ]
    shares = max_min_share(flows)
    # Hand computation: L2 fills first (2 flows, 4 -> 2 each: f0, f2); L3 next (weights 1 + 2,
    # 7/3 each: f1, f3); L1 left with 10 - 2 - 7/3 = 17/3 for f4.
    assert [s.gbps for s in shares] == pytest.approx([2.0, 7 / 3, 2.0, 7 / 3, 17 / 3])
    load = {r.key: 0.0 for r in (l1, l2, l3)}
    for s in shares:
        for r, w in s.flow.uses:
            load[r.key] += s.gbps * w
    for r in (l1, l2, l3):
        assert load[r.key] <= r.gbps * (1 + 1e-9)
    for s in shares:
        assert load[s.bottleneck.key] == pytest.approx(s.bottleneck.gbps)  # its bottleneck is full


def test_max_min_of_nothing_is_nothing():
    assert max_min_share([]) == []


# --- completion times --------------------------------------------------------------------------


def test_when_one_flow_finishes_the_other_speeds_up():
    # 10 GB and 30 GB share 10 GB/s: 5 each until the short one ends at 2 s; the long one has
    # 20 GB left alone at 10 GB/s: 2 s more, 4 s in all.
    r = _res("R", 10.0)
    short, long = Flow("short", ((r, 1),), 10 * 10**9), Flow("long", ((r, 1),), 30 * 10**9)
    a, b = run_concurrently([short, long])
    assert a.finish_s == pytest.approx(2.0)
    assert b.finish_s == pytest.approx(4.0)
    assert a.gbps == pytest.approx(5.0)
    assert b.gbps == pytest.approx(30 / 4)
    assert a.bottleneck.key == b.bottleneck.key == "R"


def test_three_flows_finish_in_size_order():
    r = _res("R", 3.0)
    sizes = [1, 2, 3]
    done = run_concurrently([Flow(str(s), ((r, 1),), s * 10**9) for s in sizes])
    # 1 each until 1 s (3 GB moved); then 1.5 each: the 2 GB flow has 1 GB left -> +2/3 s;
    # the 3 GB flow then has 3 - 1 - 1 = 1 GB alone at 3 -> +1/3 s.
    assert [c.finish_s for c in done] == pytest.approx([1.0, 1 + 2 / 3, 2.0])


def test_run_concurrently_adds_latency_and_handles_empty_flows():
    r = _res("R", 1.0)
    done = run_concurrently([Flow("x", ((r, 1),), 10**9, latency_s=0.5), Flow("empty", ((r, 1),), 0, latency_s=0.25)])
    assert done[0].finish_s == pytest.approx(1.5)
    assert done[1].finish_s == pytest.approx(0.25)


def test_every_flow_completes_on_a_real_topology(h200):
    t = h200.topology
    flows = [_flow(t, "pool.dram", f"gpu{i}", size=(i + 1) * 10**9, via=(f"pool.nic{i}", f"nic{i}")) for i in range(8)]
    flows += [_flow(t, "cpu0.dram", "gpu0", size=5 * 10**9), _flow(t, "gpu5", "cpu1.dram", size=10**9)]
    done = run_concurrently(flows)
    assert len(done) == len(flows)
    for c in done:
        assert c.finish_s > 0
        # Never faster than alone on its path.
        alone = estimate(t, c.flow.path, c.flow.size_bytes)
        assert c.finish_s >= alone.seconds * (1 - 1e-9)


def test_estimate_is_bytes_over_bottleneck_plus_latency(h200):
    t = h200.topology
    path = t.route("cpu0.dram", "gpu0")
    est = estimate(t, path, 8 * 10**9)
    assert est.seconds == pytest.approx(8 * 10**9 / (GEN5_PAYLOAD * GB) + path.latency_s)


def test_flow_rejects_negative_size_and_no_resources():
    with pytest.raises(ValueError, match="size_bytes"):
        Flow("neg", ((_res("R", 1.0), 1),), -1)
    with pytest.raises(ValueError, match="no constrained resource"):
        Flow("free", ())
