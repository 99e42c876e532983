"""``kvstrata hardware``: links, list and show, through ``kvstrata.cli.main``."""

from __future__ import annotations

import io
import json
import re
import sys

import pytest
from rich.console import Console
from rich.table import Table

from kvstrata.cli import hardware, main
from kvstrata.hardware.profile import builtin_profiles, builtin_text, load_profile, parse_profile

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

BUILTINS = {"b200-cx8-gen6", "gen5-cx8-socket-direct", "h200-cx7-gen5", "workstation"}
GEN5_X16_PAYLOAD = 63.0154 * 256 / 280  # after encoding x TLP payload 256/(256 + 24)


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    # rich wraps to COLUMNS; wide enough that no name or message is folded mid-table.
    monkeypatch.setenv("COLUMNS", "250")


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["hardware", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def run_text(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(["hardware", *argv]) == 0
    return capsys.readouterr().out


def run_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(["hardware", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    return captured.err


def link_between(report: dict, a: str, b: str) -> dict:
    (link,) = [x for x in report["links"] if {x["a"], x["b"]} == {a, b}]
    return link


def test_links_json_has_the_seed_figures(capsys):
    rows = {r["resource"]: r for r in run_json(capsys, "links")["links"]}
    gen5 = rows["PCIe Gen5 x16"]
    assert gen5["one_way_gbps"] == pytest.approx(63.0, abs=0.05)
    assert gen5["both_ways_gbps"] == pytest.approx(126.0, abs=0.1)
    assert gen5["one_way_basis"] == "after encoding"
    assert gen5["effective_gbps"] == pytest.approx(GEN5_X16_PAYLOAD, rel=1e-3)
    gen6 = rows["PCIe Gen6 x16"]
    assert (gen6["one_way_gbps"], gen6["one_way_basis"]) == (128, "raw")
    assert gen6["effective_gbps"] < 128  # FLIT and TLP overheads come off the raw figure
    (cx7,) = [r for r in rows.values() if r["resource"].startswith("CX-7 ")]
    assert (cx7["one_way_gbps"], cx7["both_ways_gbps"]) == (50, 100)
    h200 = rows["H200-SXM HBM"]
    assert h200["one_way_gbps"] == 4800
    assert h200["both_ways_gbps"] is None  # reads and writes share one total
    assert h200["capacity"]["value"] == 141 and h200["capacity"]["unit"] == "GB"
    assert all(r["source"] for r in rows.values())


def test_links_json_pcie_generations_and_devices(capsys):
    report = run_json(capsys, "links")
    pcie = {(p["gen"], p["lanes"]): p for p in report["pcie"]}
    assert set(pcie) == {(g, n) for g in (3, 4, 5, 6) for n in (1, 4, 8, 16)}
    assert pcie[4, 16]["after_encoding_gbps"] == pytest.approx(31.5, abs=0.01)
    assert pcie[6, 16]["raw_gbps"] == 128
    assert pcie[5, 4]["after_encoding_gbps"] == pytest.approx(pcie[5, 16]["after_encoding_gbps"] / 4)
    for p in pcie.values():
        assert p["payload_gbps"] < p["after_encoding_gbps"] <= p["raw_gbps"]
    nics = {n["name"]: n for n in report["nics"]}
    assert nics["CX-8-ETH"]["port_gbit"] == [400, 400] and nics["CX-8-ETH"]["one_way_gbps"] == 100
    assert {g["name"]: g["hbm"]["spec_gbps"] for g in report["gpus"]}["B200-SXM"] == 8000
    assert {d["name"] for d in report["nvme"]} == {"gen4-x4", "gen5-x4"}
    assert report["dram_example"]["spec_gbps"] == pytest.approx(8 * 4800 * 8 / 1000)
    assert report["socket_link"]["spec_gbps"] == pytest.approx(4 * 16 * 20 / 8 * 64 / 80)


def test_links_tables(capsys):
    out = run_text(capsys, "links")
    for text in ("PCIe Gen5 x16", "Gen4 x16", "31.51", "shared: reads and writes share one total", "gen5-x4",
                 "UPI default"):
        assert text in out


def test_list_json_summarises_the_builtins(capsys):
    profiles = {p["name"]: p for p in run_json(capsys, "list")["profiles"]}
    assert set(profiles) == BUILTINS == set(builtin_profiles())
    h200 = profiles["h200-cx7-gen5"]
    assert (h200["gpus"], h200["gpu_model"], h200["nics"], h200["nic_model"]) == (8, "H200-SXM", 8, "CX-7")
    assert (h200["sockets"], h200["switches"]) == (2, 4)
    assert h200["pool"]["nic_model"] == "CX-7" and h200["pool"]["nics"] == 8
    ws = profiles["workstation"]
    assert (ws["gpus"], ws["nics"], ws["nic_model"], ws["pool"], ws["switches"]) == (1, 0, None, None, 0)
    assert profiles["gen5-cx8-socket-direct"]["pool"]["host_links"] == 2


def test_list_table(capsys):
    out = run_text(capsys, "list")
    assert all(name in out for name in BUILTINS)
    assert "8 x H200-SXM" in out and "CX-7 x 8" in out


def test_show_json_of_h200(capsys):
    report = run_json(capsys, "show", "h200-cx7-gen5")
    assert report["origin"] == "built-in:h200-cx7-gen5"
    gpu_link = link_between(report, "gpu0", "sw0")
    assert gpu_link["kind"] == "pcie" and gpu_link["label"] == "PCIe Gen5 x16"
    assert gpu_link["forward_spec_gbps"] == pytest.approx(63.0, abs=0.05)
    assert gpu_link["backward_spec_gbps"] == gpu_link["forward_spec_gbps"]  # full duplex
    assert gpu_link["forward_basis"] == "after encoding"
    assert gpu_link["forward_gbps"] == pytest.approx(GEN5_X16_PAYLOAD, rel=1e-3)
    assert gpu_link["latency_s"] == pytest.approx(1e-6)
    internal = link_between(report, "cpu0.dram", "cpu0")
    assert internal["forward_gbps"] is None and internal["efficiency_backward"] is None
    nodes = {n["name"]: n for n in report["nodes"]}
    assert nodes["gpu0"]["kind"] == "hbm" and nodes["gpu0"]["bandwidth_gbps"] == 4800
    assert nodes["gpu0"]["capacity_bytes"] == 141e9 and nodes["gpu0"]["socket"] == "cpu0"
    assert nodes["pool.dram"]["kind"] == "remote dram"
    assert "peer.gpu0" in nodes  # the peer server is in the JSON


def test_show_table_names_the_peer_without_listing_it(capsys):
    peers = sum(n["name"].startswith("peer.") for n in run_json(capsys, "show", "h200-cx7-gen5")["nodes"])
    out = run_text(capsys, "show", "h200-cx7-gen5")
    assert f"peer server: identical, {peers} nodes" in out
    assert "peer.gpu0" not in out
    assert "gpu0" in out and "pool.dram" in out and "nvme0" in out


def test_show_workstation_has_no_peer(capsys):
    out = run_text(capsys, "show", "workstation")
    assert "H100-PCIE" in out and "peer server" not in out


def test_upgrade_cx8_doubles_nic_ports(capsys):
    before = run_json(capsys, "show", "h200-cx7-gen5")
    after = run_json(capsys, "show", "h200-cx7-gen5", "--upgrade", "+cx8")
    assert link_between(before, "nic0.p0", "fabric")["forward_spec_gbps"] == 50
    assert link_between(after, "nic0.p0", "fabric")["forward_spec_gbps"] == 100
    assert link_between(after, "pool.nic0.p0", "fabric")["forward_spec_gbps"] == 100
    # A CX-8 in a Gen5 slot stays at Gen5 until the slots are upgraded too.
    assert link_between(after, "sw0", "nic0")["forward_spec_gbps"] == pytest.approx(63.0, abs=0.05)
    both = run_json(capsys, "show", "h200-cx7-gen5", "--upgrade", "+cx8+gen6")
    assert link_between(both, "sw0", "nic0")["forward_spec_gbps"] == 128
    assert link_between(both, "sw0", "gpu0")["forward_spec_gbps"] == pytest.approx(63.0, abs=0.05)  # H200: Gen5


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_toml_round_trips(capsys, name):
    out = run_text(capsys, "show", name, "--toml")
    assert out == builtin_text(name)
    assert parse_profile(tomllib.loads(out), f"built-in:{name}") == load_profile(name)


def test_toml_of_a_file_prints_the_file(capsys, tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text(builtin_text("workstation").replace('name = "workstation"', 'name = "mine"'))
    assert run_text(capsys, "show", str(path), "--toml") == path.read_text()


def test_edited_copy_overrides_pcie_efficiency(capsys, tmp_path):
    path = tmp_path / "measured.toml"
    path.write_text(builtin_text("h200-cx7-gen5") + "\n[efficiency]\npcie = 0.5\n")
    report = run_json(capsys, "show", str(path))
    assert report["origin"] == str(path)
    gpu_link = link_between(report, "sw0", "gpu0")
    assert gpu_link["efficiency_forward"] == 0.5
    assert gpu_link["forward_gbps"] == pytest.approx(gpu_link["forward_spec_gbps"] / 2)
    assert "efficiency.pcie" in gpu_link["efficiency_basis_forward"]
    uplink = link_between(report, "cpu0", "sw0")  # "pcie" covers switch uplinks too
    assert uplink["efficiency_forward"] == 0.5
    nic_port = link_between(report, "nic0.p0", "fabric")  # other kinds keep their model
    assert nic_port["efficiency_forward"] != 0.5
    row = next(line for line in run_text(capsys, "show", str(path)).splitlines() if "sw0<->gpu0" in line)
    assert [cell.strip() for cell in row.split("│")[4:7]] == ["31.51", "31.51", "63.02 x 0.5"]


def test_unknown_profile_lists_the_builtins(capsys):
    err = run_error(capsys, "show", "h300-imaginary")
    assert "unknown hardware profile 'h300-imaginary'" in err
    assert all(name in err for name in BUILTINS)
    assert "Traceback" not in err


def test_missing_toml_file(capsys, tmp_path):
    err = run_error(capsys, "show", str(tmp_path / "absent.toml"))
    assert "does not exist" in err and "absent.toml" in err


def test_unknown_upgrade(capsys):
    err = run_error(capsys, "show", "h200-cx7-gen5", "--upgrade", "+cx9", "--json")
    assert "unknown upgrade" in err and "+cx8" in err and "+gen6" in err


def test_invalid_profile_names_the_field(capsys, tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text(builtin_text("workstation") + "\n[efficiency]\nwarp = 0.5\n")
    assert "efficiency.warp" in run_error(capsys, "show", str(path))


def test_toml_refuses_upgrades(capsys):
    assert "--upgrade" in run_error(capsys, "show", "workstation", "--toml", "--upgrade", "+gen6")


def test_hardware_needs_an_action(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["hardware"])
    assert exc.value.code == 2


# --- what a user reads: 120 columns, public sources said once, the upgraded profile -----------

WIDE_COMMANDS = [
    ["links"],
    *(["show", name] for name in sorted(BUILTINS)),
    ["show", "h200-cx7-gen5", "--upgrade", "+cx8+gen6"],
    ["show", "h200-cx7-gen5", "--upgrade", "+cx8-eth+socket-direct"],
    ["show", "b200-cx8-gen6", "--upgrade", "+cx8-eth"],
]


def printed_items(monkeypatch: pytest.MonkeyPatch, *argv: str) -> list:
    """The tables and lines a ``hardware`` command prints, as it hands them to the console."""
    items: list = []
    monkeypatch.setattr(hardware, "_emit", lambda report, as_json, shown: items.extend(shown) or 0)
    assert main(["hardware", *argv]) == 0
    return items


def render(item, width: int = 120) -> list[str]:
    out = io.StringIO()
    Console(file=out, width=width, color_system=None).print(item)
    return out.getvalue().splitlines()


@pytest.mark.parametrize("argv", WIDE_COMMANDS, ids=" ".join)
def test_every_table_fits_120_columns_without_wrapping_or_cutting(monkeypatch, argv):
    tables = [item for item in printed_items(monkeypatch, *argv) if isinstance(item, Table)]
    assert tables
    for table in tables:
        lines = render(table)
        # title, top border, header, header rule, one line per row, bottom border: nothing wraps
        assert len(lines) == table.row_count + 5, "\n".join(lines)
        assert not any("…" in line for line in lines), "a cell was cut"
        assert all(len(line.rstrip()) <= 120 for line in lines)


@pytest.mark.parametrize("argv", WIDE_COMMANDS, ids=" ".join)
def test_at_120_columns_the_command_cuts_nothing(monkeypatch, capsys, argv):
    monkeypatch.setenv("COLUMNS", "120")
    out = run_text(capsys, *argv)
    assert "…" not in out
    assert max(len(line.rstrip()) for line in out.splitlines()) <= 120


def note_lines(out: str) -> dict[int, str]:
    return {int(m[1]): m[2] for m in re.finditer(r"^\[(\d+)\] (.*)$", out, re.MULTILINE)}


def test_links_notes_are_numbered_said_once_and_all_referenced(capsys):
    out = run_text(capsys, "links")
    notes = note_lines(out)
    assert sorted(notes) == list(range(1, len(notes) + 1))
    assert len(set(notes.values())) == len(notes)  # each text once
    referenced = set()
    for line in out.splitlines():
        cells = [c.strip() for c in line.split("│")]
        if len(cells) > 2 and re.fullmatch(r"\d+(,\d+)*", cells[-2]):
            referenced |= {int(n) for n in cells[-2].split(",")}
    referenced |= {int(n) for n in re.findall(r"\(note (\d+)\)", out)}
    assert referenced == set(notes)
    for text in notes.values():
        head = text.split(":")[0]
        assert not text.startswith(f"{head}: {head}")  # no "PCIe Gen3 x16: PCIe Gen3 x16: ..."


def test_links_cite_the_public_sources_not_a_document_users_never_saw(capsys):
    out = run_text(capsys, "links")
    report = run_json(capsys, "links")
    assert "seed" not in out.lower() and "seed" not in json.dumps(report).lower()
    notes = set(note_lines(out).values())
    for source in ("PCI-SIG PCI Express Base Specification 3.0-6.0", "NVIDIA H200 Tensor Core GPU datasheet",
                   "NVIDIA HGX B200 datasheet"):
        assert source in notes
    assert any(n.startswith("NVIDIA ConnectX-7 adapter cards user manual") for n in notes)
    assert any(n.startswith("NVIDIA ConnectX-8 SuperNIC user manual: C8180") for n in notes)
    rows = {r["resource"]: r for r in report["links"]}
    assert rows["PCIe Gen5 x16"]["cites"] == "PCI-SIG PCI Express Base Specification 3.0-6.0"
    assert rows["H200-SXM HBM"]["cites"] == "NVIDIA H200 Tensor Core GPU datasheet"


@pytest.mark.parametrize("argv", [["list"], *(["show", n] for n in sorted(BUILTINS))], ids=" ".join)
def test_no_output_names_the_seed(capsys, argv):
    assert "seed" not in (run_text(capsys, *argv) + json.dumps(run_json(capsys, *argv))).lower()


def test_show_with_upgrades_shows_the_upgraded_profile(capsys):
    out = run_text(capsys, "show", "h200-cx7-gen5", "--upgrade", "+cx8+gen6")
    heading = " ".join(out.split("Devices")[0].split())
    assert heading.startswith("h200-cx7-gen5+cx8+gen6: 8x H200-SXM on PCIe Gen5 x16, 8x CX-8 800G InfiniBand on "
                              "PCIe Gen6 x16, 4x PCIe Gen6 switch")
    assert heading.endswith("(built-in:h200-cx7-gen5 with +cx8+gen6)")
    assert "CX-7" not in out and "Gen5 switch" not in out  # names, links and figures: all the upgrade's
    assert "CX-8 port 0 (800G)" in out and "PCIe Gen6 x16" in out
    report = run_json(capsys, "show", "h200-cx7-gen5", "--upgrade", "+cx8+gen6")
    assert report["name"] == "h200-cx7-gen5+cx8+gen6" and "CX-7" not in report["description"]
    assert not any("CX-7" in x["label"] for x in report["links"])
