"""The lab's cluster description: addresses, rails, uplinks, shapers' arguments, and refusals."""

from __future__ import annotations

import pytest

from kvstrata.lab.spec import LabSpec, LinkShape, Host, Port, Role, Uplink, one_link, shared_uplink, tcp_efficiency, two_ports


def test_each_rail_is_a_subnet_of_its_own_and_a_host_reaches_a_peer_through_its_port_on_that_rail():
    spec = two_ports(1.0)
    assert spec.address("pool", "rail0") == "10.77.1.10"
    assert spec.address("inf", "rail1") == "10.77.2.11"
    assert spec.common_switches("inf", "pool") == ("rail0", "rail1")
    assert spec.reachable_switch("inf", "pool") == "rail0"


def test_switches_joined_by_an_uplink_are_one_network_with_one_subnet():
    spec = shared_uplink(1.0)
    assert spec.bridged("leaf") == {"leaf", "spine"}
    assert spec.address("pool", "spine").rsplit(".", 1)[0] == spec.address("inf1", "leaf").rsplit(".", 1)[0]
    assert spec.reachable_switch("inf0", "pool") == "leaf"


def test_a_host_on_a_network_the_pool_is_not_on_cannot_reach_it():
    spec = LabSpec("apart", ("a", "b"), (Host("pool", Role.POOL, (Port("a"),)), Host("inf", Role.INFERENCE, (Port("b"),))))
    with pytest.raises(ValueError, match="cannot reach 'pool'"):
        spec.reachable_switch("inf", "pool")


def test_the_shaper_bucket_never_caps_the_rate_and_its_queue_holds_its_time():
    args = dict(zip(*[iter(LinkShape(10.0).tbf_args())] * 2))
    assert args["rate"] == "10000mbit"
    burst, limit = int(args["burst"]), int(args["limit"])
    assert burst >= 10e9 / 8 * 0.002  # a timer tick's worth at the rate
    assert limit - burst == pytest.approx(10e9 / 8 * 0.05, rel=1e-6)
    small = dict(zip(*[iter(LinkShape(0.1).tbf_args())] * 2))
    assert int(small["burst"]) == 256 * 1024  # at least a GSO packet and some


def test_tcp_payload_efficiency_is_the_frames_payload_share():
    assert tcp_efficiency(1500) == pytest.approx(1448 / 1514)
    assert 0.99 < tcp_efficiency() < 1.0


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: LinkShape(0.0), "rate must be a number of Gbit/s"),
        (lambda: LinkShape(1.0, -1e-3), "delay must be 0 to 1 s"),
        (lambda: LabSpec("x", ("Sw",), (Host("pool", Role.POOL, (Port("Sw"),)),)), "switch name 'Sw'"),
        (lambda: LabSpec("x", ("sw",), (Host("pool", Role.POOL, (Port("sw"),)),)), "exactly one pool host"),
        (lambda: LabSpec("x", ("sw",), (Host("pool", Role.POOL, (Port("sw"),)), Host("i", Role.INFERENCE, (Port("no"),)))),
         "switch 'no' is not one of"),
        (lambda: LabSpec("x", ("sw",), (Host("pool", Role.POOL, (Port("sw"), Port("sw"))), Host("i", Role.INFERENCE, (Port("sw"),)))),
         "two ports on one switch"),
        (lambda: LabSpec("x", ("sw",), (Host("pool", Role.POOL, (Port("sw"),)), Host("i", Role.INFERENCE, (Port("sw"),))),
                         (Uplink("sw", "sw"),)), "joins switch 'sw' to itself"),
    ],
)
def test_a_bad_cluster_is_refused_in_one_line_naming_what(build, message):
    with pytest.raises(ValueError, match=message) as raised:
        build()
    assert "\n" not in str(raised.value)


def test_the_one_link_cluster_shapes_only_the_inference_hosts_port():
    spec = one_link(2.5)
    assert spec.host("inf").ports[0].shape == LinkShape(2.5)
    assert not spec.pool.ports[0].shape.shaped
