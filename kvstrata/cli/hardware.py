"""``kvstrata hardware``: the catalog's link figures, the built-in profiles, one profile's graph.

Every figure printed here comes from ``kvstrata.hardware``; this module only formats it.
Bandwidths are decimal GB/s (1e9 bytes per second). ``--json`` prints the data the tables
are drawn from, at full precision; the tables round to four significant figures. Tables fit
120 columns: rules and public sources are numbered notes under them, each said once.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.table import Table
from rich.text import Text

from kvstrata import cli
from kvstrata.cli import CliError
from kvstrata.hardware import catalog
from kvstrata.hardware.figures import Bandwidth, Figure
from kvstrata.hardware.pcie import GENERATIONS, PCI_SIG, PcieLink
from kvstrata.hardware.profile import HardwareProfile, Slot, builtin_profiles, builtin_text, load_profile
from kvstrata.hardware.whatif import apply_upgrades

PCIE_LANES = (1, 4, 8, 16)
DRAM_EXAMPLE = catalog.DramSpec(channels=8, mt_s=4800, capacity_gb=512)  # one DDR5-4800 socket
PEER = "peer."  # prefix of the identical peer server the profile builder adds
SHARED = "shared"  # both ways of a memory: reads and writes share one total


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``hardware links``, ``hardware list`` and ``hardware show``."""
    parser = subparsers.add_parser(
        "hardware",
        help="link bandwidths, built-in profiles, one profile's topology",
        description="Inspect the hardware model: the catalog's bandwidths with their bases "
        "and sources, the built-in server profiles, and the graph a profile builds.",
    )
    actions = parser.add_subparsers(dest="hardware_command", metavar="ACTION", required=True)
    links = actions.add_parser("links", help="every catalog bandwidth, one way and both ways")
    links.set_defaults(func=run_links)
    listing = actions.add_parser("list", help="the built-in hardware profiles")
    listing.set_defaults(func=run_list)
    show = actions.add_parser("show", help="one profile's devices, links and memories")
    show.add_argument("profile", metavar="NAME_OR_FILE", help="a built-in profile or a .toml path")
    show.add_argument("--upgrade", metavar="+UPGRADES", help="what-if upgrades, e.g. +cx8+gen6")
    show.add_argument("--toml", action="store_true", help="print the profile's TOML to copy")
    show.set_defaults(func=run_show)
    for sub in (links, listing, show):
        sub.add_argument("--json", action="store_true", help="print JSON instead of tables")


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.4g}"  # never an exponent


def _table(title: str, columns: list[str], rows: list[list[Any]]) -> Table:
    """A table whose first column never wraps."""
    table = Table(title=title, title_justify="left")
    for i, column in enumerate(columns):
        table.add_column(column, no_wrap=i == 0)
    for row in rows:
        table.add_row(*(v if isinstance(v, str) else _num(v) for v in row))
    return table


class Notes:
    """Numbered notes under tables, each text said once: ``ref(text)`` gives its number
    (the same for the same text), ``take()`` the lines not printed yet."""

    def __init__(self) -> None:
        self._numbers: dict[str, int] = {}
        self._printed = 0

    def ref(self, *texts: str) -> str:
        return ",".join(str(self._numbers.setdefault(t, len(self._numbers) + 1)) for t in texts if t)

    def take(self) -> list[str]:
        lines = [f"[{n}] {t}" for t, n in self._numbers.items() if n > self._printed]
        self._printed = len(self._numbers)
        return lines


def _emit(report: dict[str, Any], as_json: bool, items: Sequence[Table | str]) -> int:
    """``--json``: the report; else each table, and each line (a note) unstyled."""
    if as_json:
        print(json.dumps(report, indent=2))
        return 0
    console = cli.console()
    for item in items:
        console.print(Text(item) if isinstance(item, str) else item)
    return 0


def _figure(figure: Figure | None) -> dict[str, Any] | None:
    if figure is None:
        return None
    return {"value": figure.value, "unit": figure.unit, "basis": figure.basis.value, "source": figure.source}


def _bandwidth(bw: Bandwidth) -> dict[str, Any]:
    return {"spec_gbps": bw.spec_gbps, "basis": bw.basis.value, "efficiency": bw.efficiency,
            "effective_gbps": bw.effective_gbps, "source": bw.source}


def links_report() -> dict[str, Any]:
    """The catalog's figures: the hardware table, PCIe by generation and width, the devices."""
    links = [
        {"resource": r.resource, "capacity": _figure(r.capacity),
         "one_way_gbps": r.one_way.value, "one_way_basis": r.one_way.basis.value,
         "both_ways_gbps": None if r.both_ways is None else r.both_ways.value,
         "duplex_rule": r.duplex_rule, "efficiency": r.efficiency,
         "effective_gbps": r.effective_gbps, "source": r.one_way.source, "cites": r.cites}
        for r in catalog.seed_table()
    ]
    pcie = [
        {"gen": link.gen, "lanes": link.lanes, "raw_gbps": link.raw_gbps,
         "after_encoding_gbps": link.after_encoding_gbps, "payload_gbps": link.payload_gbps,
         "both_ways_gbps": link.both_ways_gbps, "quoted_basis": link.spec_basis.value}
        for link in (PcieLink(gen, lanes) for gen in sorted(GENERATIONS) for lanes in PCIE_LANES)
    ]
    nvme = [
        {"name": m.name, "read": _bandwidth(m.read()), "write": _bandwidth(m.write()),
         "capacity_tb": m.capacity_tb, "link": m.link.name, "read_latency_s": m.read_latency_s,
         "cites": m.source}
        for m in catalog.NVMES.values()
    ]
    gpus = [
        {"name": m.name, "hbm_gb": m.hbm_gb, "hbm": _bandwidth(m.hbm()), "nvlink": _bandwidth(m.nvlink()),
         "host_link": m.host_link.name, "bf16_dense_tflops": m.bf16_dense_tflops, "cites": m.source}
        for m in catalog.GPUS.values()
    ]
    nics = [
        {"name": m.name, "protocol": m.protocol, "port_gbit": list(m.port_gbit),
         "ports": [_bandwidth(m.port(i)) for i in range(len(m.port_gbit))],
         "one_way_gbps": m.one_way_gbps, "both_ways_gbps": m.both_ways_gbps,
         "host_link": m.host_link.name, "cites": m.source}
        for m in catalog.NICS.values()
    ]
    upi = catalog.SocketLinkSpec()
    return {
        "links": links, "pcie": pcie, "nvme": nvme, "gpus": gpus, "nics": nics,
        "dram_example": {"channels": DRAM_EXAMPLE.channels, "mt_s": DRAM_EXAMPLE.mt_s,
                         **_bandwidth(DRAM_EXAMPLE.bandwidth())},
        "socket_link": {"links": upi.links, "gt_s": upi.gt_s, **_bandwidth(upi.one_way())},
    }


def _pcie_lines() -> list[str]:
    """How each generation's figures are made: lane rate, line code, what payload leaves."""
    lines = ["quoted: the figure datasheets quote; both ways: twice it; raw = GT/s x lanes / 8"]
    for gen, g in sorted(GENERATIONS.items()):
        one_way = PcieLink(gen, 16).one_way()
        lines.append(f"Gen{gen}: {g.lane_rate_gtps} GT/s a lane, {g.encoding_name}; "
                     f"payload = after encoding x {one_way.efficiency_basis}")
    return lines


def run_links(args: argparse.Namespace) -> int:
    report = links_report()
    notes = Notes()
    links = _table(
        "Links (GB/s = 1e9 B/s; one way is what a one-direction copy gets; shared: reads and writes share one total)",
        ["resource", "capacity", "one way", "basis", "both ways", "eff.", "effective", "notes"],
        [[r["resource"], f"{_num(r['capacity']['value'])} {r['capacity']['unit']}" if r["capacity"] else "-",
          r["one_way_gbps"], r["one_way_basis"], SHARED if r["both_ways_gbps"] is None else r["both_ways_gbps"],
          r["efficiency"], r["effective_gbps"], notes.ref(r["duplex_rule"], r["cites"])]
         for r in report["links"]],
    )
    link_notes = notes.take()
    pcie = _table(
        f"PCIe, GB/s one direction (note {notes.ref(PCI_SIG)})",
        ["link", "raw", "after encoding", "payload", "both ways", "quoted"],
        [[f"Gen{p['gen']} x{p['lanes']}", p["raw_gbps"], p["after_encoding_gbps"], p["payload_gbps"],
          p["both_ways_gbps"], p["quoted_basis"]] for p in report["pcie"]],
    )
    rows = [[g["name"], f"HBM {_num(g['hbm_gb'])} GB", g["hbm"]["spec_gbps"], SHARED, g["host_link"],
             notes.ref(g["cites"])] for g in report["gpus"]]
    rows += [[n["name"], f"{n['protocol']} " + " + ".join(f"{p}G" for p in n["port_gbit"]),
              n["one_way_gbps"], n["both_ways_gbps"], n["host_link"], notes.ref(n["cites"])]
             for n in report["nics"]]
    rows += [[d["name"], f"NVMe {_num(d['capacity_tb'])} TB", f"read {_num(d['read']['spec_gbps'])}",
              f"write {_num(d['write']['spec_gbps'])}", d["link"], notes.ref(d["cites"])]
             for d in report["nvme"]]
    dram, upi = report["dram_example"], report["socket_link"]
    rows.append(["DRAM example", dram["basis"], dram["spec_gbps"], SHARED, "-", notes.ref(dram["source"])])
    rows.append(["UPI default", upi["basis"], upi["spec_gbps"], 2 * upi["spec_gbps"], "-", notes.ref(upi["source"])])
    devices = _table("Devices (GB/s; shared: reads and writes share one total)",
                     ["device", "what", "one way", "both ways", "host link", "notes"], rows)
    return _emit(report, args.json, [links, *link_notes, pcie, *_pcie_lines(), devices, *notes.take()])


def _models(names: list[str]) -> str | None:
    return ", ".join(sorted(set(names))) or None


def profile_summary(profile: HardwareProfile) -> dict[str, Any]:
    pool = profile.pool
    return {
        "name": profile.name, "description": profile.description,
        "gpus": len(profile.gpus), "gpu_model": _models([g.model for g in profile.gpus]),
        "nics": len(profile.nics), "nic_model": _models([n.model for n in profile.nics]),
        "sockets": len(profile.sockets), "switches": len(profile.switches),
        "pool": None if pool is None else {"nic_model": pool.nic_model, "nics": pool.nics,
                                          "host_links": pool.host_links, "dram_gb": pool.dram.capacity_gb},
    }


def run_list(args: argparse.Namespace) -> int:
    report = {"profiles": [profile_summary(load_profile(name)) for name in builtin_profiles()]}
    rows = [[p["name"], p["description"], f"{p['gpus']} x {p['gpu_model']}" if p["gpus"] else "none",
             f"{p['nics']} x {p['nic_model']}" if p["nics"] else "none", p["sockets"], p["switches"],
             f"{p['pool']['nic_model']} x {p['pool']['nics']}" if p["pool"] else "none"]
            for p in report["profiles"]]
    table = _table("Built-in hardware profiles (pass a name, or the path of an edited copy)",
                   ["name", "description", "GPUs", "NICs", "sockets", "switches", "pool"], rows)
    return _emit(report, args.json, [table])


def _direction_json(side: str, bw: Bandwidth | None) -> dict[str, Any]:
    """One direction of a link; every value None when that direction is not a constraint."""
    keys = (f"{side}_gbps", f"{side}_spec_gbps", f"{side}_basis",
            f"efficiency_{side}", f"efficiency_basis_{side}")
    if bw is None:
        return dict.fromkeys(keys)
    values = (bw.effective_gbps, bw.spec_gbps, bw.basis.value, bw.efficiency, bw.efficiency_basis)
    return dict(zip(keys, values))


def show_report(profile: HardwareProfile) -> dict[str, Any]:
    """Every node and link of the profile's topology, the peer server and the pool included."""
    topo = profile.topology
    nodes = [
        {"name": n.name, "kind": n.kind.value, "capacity_bytes": n.capacity_bytes,
         "bandwidth_gbps": None if n.bandwidth is None else n.bandwidth.effective_gbps, "socket": n.socket}
        for n in topo.nodes.values()
    ]
    links = [
        {"a": x.a, "b": x.b, "kind": x.kind.value, "label": x.label,
         **_direction_json("forward", x.forward), **_direction_json("backward", x.backward),
         "latency_s": x.latency_s}
        for x in topo.links
    ]
    return {"name": profile.name, "description": profile.description, "origin": profile.origin,
            "nodes": nodes, "links": links}


def _device_rows(p: HardwareProfile) -> list[list[str]]:
    """[name, kind, model, attached to, host link] for each device the profile declares."""
    def link(slot: Slot, device_max: PcieLink, links: int = 1) -> str:
        return slot.link_for(device_max).name + (f" x {links}" if links > 1 else "")

    rows = [[s.name, "socket", f"DRAM {s.dram.channels} x {s.dram.mt_s} MT/s, {_num(s.dram.capacity_gb)} GB",
             "-", "-"] for s in p.sockets]
    rows += [[s.name, "pcie switch", "-", s.socket, PcieLink(s.uplink.gen, s.uplink.lanes).name]
             for s in p.switches]
    rows += [[g.name, "gpu", g.model, g.attach, link(g.slot, catalog.gpu_model(g.model).host_link)]
             for g in p.gpus]
    rows += [[n.name, "nic", n.model, " + ".join(n.attach),
              link(n.slot, catalog.nic_model(n.model).host_link, len(n.attach))] for n in p.nics]
    rows += [[d.name, "nvme", d.model, d.attach, catalog.nvme_model(d.model).link.name] for d in p.nvmes]
    if p.pool is not None:
        what = f"{p.pool.nics} x {p.pool.nic_model}, {_num(p.pool.dram.capacity_gb)} GB DRAM"
        host_link = link(p.pool.slot, catalog.nic_model(p.pool.nic_model).host_link, p.pool.host_links)
        rows.append(["pool", "remote DRAM pool", what, "fabric", host_link])
    return rows


def _effective(link: dict[str, Any], side: str) -> str:
    return _num(link[f"{side}_gbps"])


def _spec_x_eff(link: dict[str, Any]) -> str:
    """``spec x efficiency`` of both directions, once when they are the same (most links)."""
    def one(side: str) -> str:
        if link[f"{side}_gbps"] is None:
            return "-"
        return f"{_num(link[f'{side}_spec_gbps'])} x {_num(link[f'efficiency_{side}'])}"

    forward, backward = one("forward"), one("backward")
    return forward if forward == backward else f"{forward} / {backward}"


def run_show(args: argparse.Namespace) -> int:
    profile = load_profile(args.profile)
    if args.toml:
        if args.upgrade:
            raise CliError("--toml prints the profile file as written; it cannot apply --upgrade")
        name = profile.origin.removeprefix("built-in:")
        print(builtin_text(name) if name != profile.origin else Path(profile.origin).read_text(), end="")
        return 0
    if args.upgrade:
        profile = apply_upgrades(profile, args.upgrade)
    report = show_report(profile)
    local = [x for x in report["links"] if not (x["a"].startswith(PEER) or x["b"].startswith(PEER))]
    links = _table(
        "Links: effective GB/s each way = spec x efficiency; - = not a constraint; latency in µs",
        ["link (a<->b)", "kind", "label", "a->b", "b->a", "spec x eff.", "µs"],
        [[f"{x['a']}<->{x['b']}", x["kind"], x["label"], _effective(x, "forward"), _effective(x, "backward"),
          _spec_x_eff(x), x["latency_s"] * 1e6] for x in local],
    )
    memories = _table(
        "Memories (bandwidth shared by reads and writes)", ["name", "kind", "capacity GB", "GB/s", "socket"],
        [[n["name"], n["kind"], n["capacity_bytes"] / 1e9, n["bandwidth_gbps"], n["socket"] or "-"]
         for n in report["nodes"]
         if profile.topology.nodes[n["name"]].kind.is_memory and not n["name"].startswith(PEER)],
    )
    origin = f"{profile.origin} with {args.upgrade}" if args.upgrade else profile.origin
    heading = f"{profile.name}: {profile.description} ({origin})"
    devices = _table("Devices", ["name", "kind", "model", "attached to", "host link"], _device_rows(profile))
    peers = sum(1 for n in report["nodes"] if n["name"].startswith(PEER))
    notes = [f"peer server: identical, {peers} nodes (named {PEER}*, listed by --json)"] if peers else []
    return _emit(report, args.json, [heading, devices, links, memories, *notes])
