"""Profiles: built-ins, loading by path, validation errors that name the field, overrides."""

from __future__ import annotations

import copy
import shutil
import sys
from importlib import resources

import pytest

from kvstrata.hardware.flows import estimate
from kvstrata.hardware.profile import (
    ProfileError,
    builtin_profiles,
    builtin_text,
    load_profile,
    parse_profile,
)
from kvstrata.hardware.topology import LinkKind

from . import BUILTINS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@pytest.fixture
def h200_doc() -> dict:
    """The h200 profile as a parsed TOML document, to break one field at a time."""
    return tomllib.loads(builtin_text("h200-cx7-gen5"))


def _error(doc: dict) -> str:
    with pytest.raises(ProfileError) as info:
        parse_profile(doc).topology  # noqa: B018 - building the graph is part of loading
    return str(info.value)


# --- built-ins ------------------------------------------------------------------------------


def test_builtin_profiles_are_listed():
    assert builtin_profiles() == list(BUILTINS)


@pytest.mark.parametrize("name", BUILTINS)
def test_every_builtin_loads_and_builds(name):
    profile = load_profile(name)
    assert profile.name == name
    assert profile.origin == f"built-in:{name}"
    assert profile.description
    assert profile.topology.nodes


@pytest.mark.parametrize(
    "name, gpus, nics, switches, sockets, gpu_model, nic_model",
    [
        ("h200-cx7-gen5", 8, 8, 4, 2, "H200-SXM", "CX-7"),
        ("b200-cx8-gen6", 8, 8, 4, 2, "B200-SXM", "CX-8"),
        ("gen5-cx8-socket-direct", 8, 8, 4, 2, "H200-SXM", "CX-8"),
        ("workstation", 1, 0, 0, 1, "H100-PCIE", None),
    ],
)
def test_builtin_shapes(profiles, name, gpus, nics, switches, sockets, gpu_model, nic_model):
    p = profiles[name]
    assert (len(p.gpus), len(p.nics), len(p.switches), len(p.sockets)) == (gpus, nics, switches, sockets)
    assert {g.model for g in p.gpus} == {gpu_model}
    assert {n.model for n in p.nics} == ({nic_model} if nic_model else set())
    # Two GPUs and two NICs per switch.
    for s in p.switches:
        assert sum(g.attach == s.name for g in p.gpus) == 2
        assert sum(n.attach[0] == s.name for n in p.nics) == 2


def test_socket_direct_profile_gives_every_nic_two_links_to_both_sockets(socket_direct):
    for nic in socket_direct.nics:
        assert len(nic.attach) == 2
        assert {socket_direct.socket_of(a) for a in nic.attach} == {"cpu0", "cpu1"}
    assert socket_direct.pool.host_links == 2


def test_profile_copied_to_a_path_loads_by_path(tmp_path):
    source = resources.files("kvstrata.hardware") / "profiles" / "h200-cx7-gen5.toml"
    target = tmp_path / "mine.toml"
    with resources.as_file(source) as src:
        shutil.copy(src, target)
    mine = load_profile(target)
    assert mine.origin == str(target)
    assert mine.name == "h200-cx7-gen5"
    t = mine.topology
    assert estimate(t, t.route("cpu0.dram", "gpu0"), 10**9).gbps == pytest.approx(32 * 16 / 8 * 128 / 130 * 256 / 280)
    assert load_profile(str(target)).name == mine.name


def test_an_edited_copy_changes_the_model(tmp_path):
    gpu_in_gen4_slot = 'attach = "cpu0"\nlink = { gen = 4 }\n\n[[nvme]]'
    text = builtin_text("workstation").replace('attach = "cpu0"\n\n[[nvme]]', gpu_in_gen4_slot)
    assert gpu_in_gen4_slot in text
    path = tmp_path / "gen4.toml"
    path.write_text(text)
    t = load_profile(path).topology
    est = estimate(t, t.route("cpu0.dram", "gpu0"), 10**9)
    assert "Gen4 x16" in est.bottleneck
    assert est.gbps == pytest.approx(16 * 16 / 8 * 128 / 130 * 256 / 280)


def test_unknown_profile_name_lists_builtins():
    with pytest.raises(ProfileError) as info:
        load_profile("dgx-h999")
    for name in BUILTINS:
        assert name in str(info.value)
    with pytest.raises(ProfileError, match="built-in"):
        builtin_text("dgx-h999")


def test_missing_profile_path_is_reported(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.toml"):
        load_profile(tmp_path / "nope.toml")


def test_invalid_toml_is_a_profile_error(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('name = "x"\n[[socket]\n')
    with pytest.raises(ProfileError, match="invalid TOML"):
        load_profile(path)


# --- validation: every error names its field ------------------------------------------------


def test_missing_name(h200_doc):
    del h200_doc["name"]
    assert "profile.name is missing" in _error(h200_doc)


def test_gpu_attached_to_unknown_switch(h200_doc):
    h200_doc["gpu"][3]["attach"] = "sw9"
    message = _error(h200_doc)
    assert "gpu 'gpu3'" in message and "'sw9'" in message


def test_nic_attached_to_unknown_socket(h200_doc):
    h200_doc["nic"][0]["attach"] = ["sw0", "cpu7"]
    assert "nic 'nic0'" in _error(h200_doc)


def test_nic_with_three_host_links(h200_doc):
    h200_doc["nic"][0]["attach"] = ["sw0", "cpu0", "cpu1"]
    assert "nic 'nic0': attach must name one or two" in _error(h200_doc)


def test_switch_on_unknown_socket(h200_doc):
    h200_doc["switch"][1]["socket"] = "cpu5"
    assert "switch 'sw1'" in _error(h200_doc)


@pytest.mark.parametrize(
    "section, index, bad, field",
    [("gpu", 0, "A100", "gpu[0].model"), ("nic", 2, "CX-9", "nic[2].model"), ("nvme", 1, "gen9-x4", "gen9-x4")],
)
def test_unknown_model(h200_doc, section, index, bad, field):
    h200_doc[section][index]["model"] = bad
    message = _error(h200_doc)
    assert field in message and "unknown" in message


def test_unknown_pool_nic(h200_doc):
    h200_doc["pool"]["nic"] = "CX-6"
    assert "unknown NIC model 'CX-6'" in _error(h200_doc)


@pytest.mark.parametrize("lanes", [3, 0, 32])
def test_lanes_not_a_pcie_width(h200_doc, lanes):
    h200_doc["nic"][1]["link"] = {"gen": 5, "lanes": lanes}
    message = _error(h200_doc)
    assert "nic[1].link" in message and "lanes" in message


def test_gen_7_uplink(h200_doc):
    h200_doc["switch"][0]["uplink"] = {"gen": 7, "lanes": 16}
    message = _error(h200_doc)
    assert "switch[0].uplink" in message and "gen" in message


@pytest.mark.parametrize("field", ["channels", "mt_s", "capacity_gb"])
def test_non_positive_dram(h200_doc, field):
    h200_doc["socket"][1]["dram"][field] = -8
    assert f"socket[1].dram.{field} must be positive" in _error(h200_doc)


def test_pool_dram_is_checked_too(h200_doc):
    h200_doc["pool"]["dram"]["channels"] = 0
    assert "pool.dram.channels" in _error(h200_doc)


def test_wrong_type(h200_doc):
    h200_doc["socket"][0]["dram"]["channels"] = "eight"
    assert "socket[0].dram.channels must be an integer" in _error(h200_doc)


def test_duplicate_and_reserved_names(h200_doc):
    dup = copy.deepcopy(h200_doc)
    dup["gpu"][1]["name"] = "gpu0"
    assert "'gpu0' is duplicated or reserved" in _error(dup)
    reserved = copy.deepcopy(h200_doc)
    reserved["nic"][0]["name"] = "pool-nic"
    assert "'pool-nic' is duplicated or reserved" in _error(reserved)


def test_no_sockets(h200_doc):
    h200_doc["socket"] = []
    assert "[[socket]]" in _error(h200_doc)


def test_pool_host_links_is_one_or_two(h200_doc):
    h200_doc["pool"]["host_links"] = 3
    assert "pool.host_links" in _error(h200_doc)


def test_efficiency_override_of_unknown_key(h200_doc):
    h200_doc["efficiency"] = {"warp-drive": 0.5}
    assert "efficiency.warp-drive" in _error(h200_doc)


@pytest.mark.parametrize("value", [0, -0.5, 1.5])
def test_efficiency_override_outside_zero_to_one_names_the_field(h200_doc, value):
    h200_doc["efficiency"] = {"pcie": value}
    assert "efficiency.pcie must be positive and at most 1" in _error(h200_doc)


def test_link_name_override_in_either_order(h200_doc):
    h200_doc["efficiency"] = {"gpu0<->sw0": 0.5}
    t = parse_profile(h200_doc).topology
    (link,) = [l for l in t.links if {l.a, l.b} == {"sw0", "gpu0"}]
    assert link.forward.efficiency == 0.5


@pytest.mark.parametrize("key", ["gpu0<->nic7", "nic0"])
def test_override_that_matches_nothing_is_an_error(h200_doc, key):
    h200_doc["efficiency"] = {key: 0.5}
    assert f"efficiency.{key}" in _error(h200_doc)


# --- efficiency overrides change what they name, and only that ------------------------------


def _effective(profile) -> dict[tuple[str, str, str], float]:
    """Effective GB/s of every constrained link direction and memory, by (kind, a, b)."""
    out = {}
    for link in profile.topology.links:
        for src, dst in ((link.a, link.b), (link.b, link.a)):
            bw = link.capacity(src)
            if bw is not None:
                out[(link.kind.value, src, dst)] = bw.effective_gbps
    for node in profile.topology.nodes.values():
        if node.bandwidth is not None:
            out[(node.kind.value, node.name, "")] = node.bandwidth.effective_gbps
    return out


@pytest.mark.parametrize("kind", [k.value for k in LinkKind if k is not LinkKind.INTERNAL] + ["hbm", "dram"])
def test_efficiency_override_by_kind_changes_that_kind_only(h200, h200_doc, kind):
    h200_doc["efficiency"] = {kind: 0.25}
    before, after = _effective(h200), _effective(parse_profile(h200_doc))
    assert before.keys() == after.keys()
    changed = {key for key in before if before[key] != pytest.approx(after[key])}
    # "pcie" is the family: it covers switch uplinks ("pcie uplink") as well.
    family = {"pcie", "pcie uplink"} if kind == "pcie" else {kind}
    assert changed == {key for key in before if key[0] in family}
    assert changed  # the kind exists in this profile
    for key in changed:
        spec = after[key] / 0.25
        assert spec >= before[key]  # the override replaces the payload model, from the same spec


def test_link_name_override_changes_that_link_only(h200, h200_doc):
    h200_doc["efficiency"] = {"sw0<->gpu0": 0.5}
    before, after = _effective(h200), _effective(parse_profile(h200_doc))
    changed = {key for key in before if before[key] != pytest.approx(after[key])}
    assert changed == {("pcie", "sw0", "gpu0"), ("pcie", "gpu0", "sw0")}
    assert after[("pcie", "sw0", "gpu0")] == pytest.approx(32 * 16 / 8 * 128 / 130 * 0.5)


def test_nic_port_override_moves_the_gdr_bottleneck(h200_doc):
    h200_doc["efficiency"] = {"nic port": 0.5}
    t = parse_profile(h200_doc).topology
    est = estimate(t, t.route("pool.dram", "gpu0"), 10**9)
    assert est.gbps == pytest.approx(25.0)  # 400 Gb/s / 8 x 0.5 measured
    assert "port" in est.bottleneck
