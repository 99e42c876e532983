"""Properties of the hardware model, checked with hypothesis.

- More bytes never take less time along any path of a built-in profile.
- A wider link (more lanes, a newer generation, a higher efficiency) never makes a path slower.
- Max-min shares never exceed a resource's capacity; every flow has a full bottleneck on which
  no other flow gets more; adding a flow never raises the smallest rate of the others.

Max-min fairness does NOT promise that adding a flow lowers (or keeps) every other flow's rate:
taking bandwidth from a flow B can free a resource B shared with a third flow A, which then
speeds up. ``test_adding_a_flow_can_speed_up_another`` pins that textbook case down, so the
weaker, true property is the one checked with random flows.
"""

from __future__ import annotations

import copy
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstrata.hardware.flows import Flow, Resource, estimate, flow_along, max_min_share, run_concurrently
from kvstrata.hardware.pcie import VALID_LANES, PcieLink
from kvstrata.hardware.profile import builtin_text, load_profile, parse_profile

from . import BUILTINS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PROFILES = {name: load_profile(name) for name in BUILTINS}
MEMORIES = {name: sorted(n.name for n in p.topology.nodes.values() if n.kind.is_memory) for name, p in PROFILES.items()}
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# --- more bytes, more time ----------------------------------------------------------------------


@FAST
@given(data=st.data(), a=st.integers(0, 10**12), b=st.integers(0, 10**12))
def test_more_bytes_never_take_less_time(data, a, b):
    name = data.draw(st.sampled_from(sorted(PROFILES)))
    src, dst = data.draw(st.lists(st.sampled_from(MEMORIES[name]), min_size=2, max_size=2, unique=True))
    t = PROFILES[name].topology
    path = t.route(src, dst)
    small, large = sorted((a, b))
    assert estimate(t, path, small).seconds <= estimate(t, path, large).seconds


# --- wider links are never slower --------------------------------------------------------------

GENS = st.integers(3, 6)
LANES = st.sampled_from(VALID_LANES)


@given(g1=GENS, g2=GENS, l1=LANES, l2=LANES)
def test_pcie_bandwidth_is_monotone_in_generation_and_lanes(g1, g2, l1, l2):
    lo, hi = PcieLink(min(g1, g2), min(l1, l2)), PcieLink(max(g1, g2), max(l1, l2))
    assert lo.payload_gbps <= hi.payload_gbps
    assert lo.spec_gbps <= hi.spec_gbps
    assert lo.raw_gbps <= hi.raw_gbps


# One knob per link on the h200 server's paths into gpu0: the switch uplink, the GPU's slot,
# the NIC's slot (gen, lanes each), and a measured efficiency for PCIe.
KNOBS = st.tuples(GENS, LANES, GENS, LANES, GENS, LANES, st.floats(0.05, 1.0))
H200_DOC = tomllib.loads(builtin_text("h200-cx7-gen5"))
PATHS = [("cpu0.dram", "gpu0"), ("pool.dram", "gpu0"), ("gpu0", "cpu0.dram"), ("cpu1.dram", "gpu1"), ("peer.gpu0", "gpu0")]


def _h200_with(knobs):
    up_gen, up_lanes, gpu_gen, gpu_lanes, nic_gen, nic_lanes, eff = knobs
    doc = copy.deepcopy(H200_DOC)
    doc["switch"][0]["uplink"] = {"gen": up_gen, "lanes": up_lanes}
    doc["gpu"][0]["link"] = {"gen": gpu_gen, "lanes": gpu_lanes}
    doc["gpu"][1]["link"] = {"gen": gpu_gen, "lanes": gpu_lanes}
    doc["nic"][0]["link"] = {"gen": nic_gen, "lanes": nic_lanes}
    doc["efficiency"] = {"pcie": eff}
    return parse_profile(doc).topology


@settings(max_examples=40, deadline=None)
@given(a=KNOBS, b=KNOBS)
def test_a_wider_link_never_makes_a_path_slower(a, b):
    lo = tuple(min(x, y) for x, y in zip(a, b))
    hi = tuple(max(x, y) for x, y in zip(a, b))
    narrow, wide = _h200_with(lo), _h200_with(hi)
    for src, dst in PATHS:
        slow = estimate(narrow, narrow.route(src, dst), 10**9)
        fast = estimate(wide, wide.route(src, dst), 10**9)
        assert fast.seconds <= slow.seconds * (1 + 1e-12), (src, dst, slow.bottleneck, fast.bottleneck)


@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from(["pcie", "pcie uplink", "nic port", "socket", "dram", "hbm"]),
    e1=st.floats(0.05, 1.0),
    e2=st.floats(0.05, 1.0),
)
def test_a_higher_efficiency_never_makes_a_path_slower(kind, e1, e2):
    def topology(eff):
        doc = copy.deepcopy(H200_DOC)
        doc["efficiency"] = {kind: eff}
        return parse_profile(doc).topology

    low, high = topology(min(e1, e2)), topology(max(e1, e2))
    for src, dst in PATHS:
        fast = estimate(high, high.route(src, dst), 10**9)
        slow = estimate(low, low.route(src, dst), 10**9)
        assert fast.seconds <= slow.seconds


# --- max-min fair sharing ----------------------------------------------------------------------


@st.composite
def flow_sets(draw, min_flows=1, max_flows=6):
    caps = draw(st.lists(st.floats(0.5, 1000.0), min_size=1, max_size=5))
    resources = [Resource(f"r{i}", f"r{i}", c) for i, c in enumerate(caps)]
    n = draw(st.integers(min_flows, max_flows))
    flows = []
    for i in range(n):
        used = draw(st.lists(st.sampled_from(resources), min_size=1, unique_by=lambda r: r.key))
        uses = tuple((r, draw(st.integers(1, 3))) for r in used)
        flows.append(Flow(f"f{i}", uses, size_bytes=draw(st.integers(0, 10**11))))
    return resources, flows


def _load(shares):
    load: dict[str, float] = {}
    for s in shares:
        for r, w in s.flow.uses:
            load[r.key] = load.get(r.key, 0.0) + s.gbps * w
    return load


@given(flow_sets())
def test_shares_never_exceed_any_capacity(case):
    resources, flows = case
    shares = max_min_share(flows)
    assert [s.flow for s in shares] == flows
    load = _load(shares)
    for r in resources:
        assert load.get(r.key, 0.0) <= r.gbps * (1 + 1e-9)
    for s in shares:
        assert s.gbps > 0
        assert s.gbps <= min(r.gbps / w for r, w in s.flow.uses) * (1 + 1e-9)


@given(flow_sets())
def test_every_flow_has_a_full_bottleneck_where_nobody_gets_more(case):
    _, flows = case
    shares = max_min_share(flows)
    load = _load(shares)
    for s in shares:
        b = s.bottleneck
        assert any(r.key == b.key for r, _ in s.flow.uses)
        assert load[b.key] == pytest.approx(b.gbps, rel=1e-9)
        others = [o.gbps for o in shares if any(r.key == b.key for r, _ in o.flow.uses)]
        assert s.gbps >= max(others) * (1 - 1e-9)


@given(flow_sets(max_flows=5), st.data())
def test_adding_a_flow_never_raises_the_smallest_rate(case, data):
    resources, flows = case
    used = data.draw(st.lists(st.sampled_from(resources), min_size=1, unique_by=lambda r: r.key))
    extra = Flow("extra", tuple((r, 1) for r in used))
    before = [s.gbps for s in max_min_share(flows)]
    after = [s.gbps for s in max_min_share(flows + [extra])][:-1]
    assert min(after) <= min(before) * (1 + 1e-9)


@given(st.floats(0.5, 1000.0), st.lists(st.integers(1, 3), min_size=1, max_size=6), st.integers(1, 3))
def test_on_one_shared_resource_adding_a_flow_slows_every_other(cap, weights, extra_weight):
    r = Resource("r", "r", cap)
    flows = [Flow(f"f{i}", ((r, w),)) for i, w in enumerate(weights)]
    before = [s.gbps for s in max_min_share(flows)]
    after = [s.gbps for s in max_min_share(flows + [Flow("x", ((r, extra_weight),))])]
    for old, new in zip(before, after):
        assert new <= old * (1 + 1e-9)


def test_adding_a_flow_can_speed_up_another():
    # L1 (cap 2) carries A and B; L2 (cap 1) carries B. Alone: A = B = 1. Add C on L2: B drops to
    # 1/2, and A takes the 3/2 that B left on L1. Max-min is not monotone per flow.
    l1, l2 = Resource("L1", "L1", 2.0), Resource("L2", "L2", 1.0)
    a, b, c = Flow("A", ((l1, 1),)), Flow("B", ((l1, 1), (l2, 1))), Flow("C", ((l2, 1),))
    assert [s.gbps for s in max_min_share([a, b])] == pytest.approx([1.0, 1.0])
    assert [s.gbps for s in max_min_share([a, b, c])] == pytest.approx([1.5, 0.5, 0.5])


@settings(max_examples=60, deadline=None)
@given(flow_sets())
def test_all_flows_complete_no_sooner_than_alone(case):
    _, flows = case
    done = run_concurrently(flows)
    assert [c.flow for c in done] == flows
    for c in done:
        alone = c.flow.size_bytes / (min(r.gbps / w for r, w in c.flow.uses) * 1e9)
        assert c.finish_s >= alone * (1 - 1e-9)
        assert c.finish_s < float("inf")


@FAST
@given(data=st.data())
def test_concurrent_restores_on_a_built_in_server_respect_every_link(data):
    name = data.draw(st.sampled_from(["h200-cx7-gen5", "b200-cx8-gen6", "gen5-cx8-socket-direct"]))
    t = PROFILES[name].topology
    memory = st.sampled_from(MEMORIES[name])
    pairs = data.draw(st.lists(st.tuples(memory, memory).filter(lambda p: p[0] != p[1]), min_size=1, max_size=6))
    flows = [flow_along(t, t.route(s, d)) for s, d in pairs]
    shares = max_min_share(flows)
    load = _load(shares)
    caps = {r.key: r.gbps for f in flows for r, _ in f.uses}
    for key, used in load.items():
        assert used <= caps[key] * (1 + 1e-9)
    for s, f in zip(shares, flows):
        assert s.gbps <= estimate(t, f.path, 0).gbps * (1 + 1e-9)  # never faster than alone
