"""``kvstrata doctor``: why kvstrata does or does not speed a vLLM server's workload up.

Reads a server's ``/metrics`` (a URL), a saved dump of it, or a ``kvstrata bench serve --json``
report, and the hardware profile (built-in or a ``kvstrata calibrate`` TOML); prints the
findings (or ``--json``). Decimal GB/s (1 GB = 1e9 bytes).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvstrata import cli
from kvstrata.doctor.analyze import diagnose
from kvstrata.doctor.expect import Expectations, PrefillSource
from kvstrata.doctor.findings import Diagnosis, Evidence, Severity, TierReport
from kvstrata.doctor.observation import Observation
from kvstrata.doctor.sources import FETCH_TIMEOUT_S, read
from kvstrata.plan.host import HostCalibration

DEFAULT_PROFILE = "workstation"

_STYLE = {Severity.OK: "bold green", Severity.INFO: "cyan", Severity.WARN: "bold yellow", Severity.PROBLEM: "bold red"}
_VERDICT = {
    "helps": "[bold green]kvstrata speeds this workload up[/]",
    "no_gain": "[bold yellow]kvstrata gains nothing here[/]",
    "hurts": "[bold red]kvstrata makes this workload slower[/]",
    "unknown": "[bold]cannot tell[/]",
}
# Evidence labels (keys are identifiers; tier-named keys get the tier put in front).
_LABELS = {
    "requests": "requests", "prompt_tokens": "prompt tokens", "mean_prompt_tokens": "mean prompt",
    "vllm_hit_rate": "vLLM prefix cache hit rate", "vllm_hit_tokens": "vLLM cache hits",
    "vllm_kv_cache_tokens": "vLLM KV memory", "connector_hit_tokens": "connector hits",
    "connector_token_share": "prompt tokens from kvstrata", "kvstrata_hit_rate": "kvstrata hit rate",
    "miss_blocks": "missed blocks", "store_seconds": "store time", "load_only_s": "load + compute tail",
    "recompute_s": "compute whole prompt", "hit_blocks": "typical hit", "achieved_gbps": "achieved",
    "predicted_gbps": "predicted", "spec_gbps": "spec path", "break_even_gbps": "break-even rate",
    "load_failed_blocks": "failed blocks", "recomputed_blocks": "recomputed blocks", "failed_share": "failed share",
    "recompute_lost_s": "prefill lost", "saved_s_per_load": "saved per load", "saved_s": "saved in all",
    "ttft_p50_s": "TTFT p50", "ttft_p90_s": "TTFT p90", "prefill_tokens_per_s": "prefill tokens/s",
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor",
        help="why kvstrata does or does not speed a vLLM server's workload up",
        description="Read a vLLM server's /metrics (URL), a saved dump, or a `kvstrata bench serve --json` report, "
        "and explain: hit rate per tier and what limits it (capacity or reuse), vLLM's own prefix cache beside it, "
        "restore GB/s per tier against the hardware model's prediction and bottleneck link, whether loading beat "
        "computing for the prompts seen, and time lost to failed loads; each finding with the one change most "
        "likely to help.",
    )
    p.add_argument("source", help="http://HOST:PORT[/metrics], a metrics dump file, or a bench serve --json report")
    p.add_argument("--profile", "--hardware", dest="profile", default=DEFAULT_PROFILE, metavar="NAME|FILE",
                   help=f"hardware profile: built-in name or .toml; a `kvstrata calibrate` profile adds measured "
                        f"rates and prefill (default {DEFAULT_PROFILE})")
    p.add_argument("--model", default=None,
                   help="the profile's prefill fit to use (default: the server's model name, its last path part)")
    p.add_argument("--prefill", choices=[s.value for s in PrefillSource], default=PrefillSource.AUTO.value,
                   help="prefill rate to weigh loads against: the server's own, the profile's, or auto (the "
                        "server's where its counters give one; default)")
    p.add_argument("--workers", type=int, default=2, help="the cache's transfer threads (default 2)")
    p.add_argument("--since", metavar="DUMP", default=None,
                   help="an earlier /metrics dump of the same server: diagnose only what happened after it")
    p.add_argument("--timeout", type=float, default=FETCH_TIMEOUT_S, help="seconds to wait for a URL (default 10)")
    cli.add_json_arg(p, "the diagnosis")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise cli.CliError(f"--workers must be at least 1, got {args.workers}")
    profile, calibration = _profile(args.profile)
    diagnoses = []
    for obs in read(args.source, args.timeout, args.since):
        hw = Expectations(profile, calibration, args.workers, _prefill_fit(calibration, obs, args.model),
                          PrefillSource(args.prefill))
        diagnoses.append(diagnose(obs, hw))
    if args.json:
        docs = [d.to_json() | {"profile": args.profile, "calibrated": calibration is not None} for d in diagnoses]
        print(json.dumps(docs[0] if len(docs) == 1 else docs, indent=2, allow_nan=False))
        return 0
    console = cli.console()
    for d in diagnoses:
        render(console, d, args.profile, calibration is not None)
    return 0


def _profile(name: str):
    """The profile's topology, and its calibration when it carries one."""
    from kvstrata.cli.plan import resolve_profile

    profile = resolve_profile(name, flag="--profile")
    calibration = None
    path = Path(name)
    if path.is_file():
        from kvstrata.calibrate import load_calibration

        try:
            calibration = load_calibration(path)
        except ValueError as exc:
            if "no [calibration]" not in str(exc):
                raise
    return profile, calibration


def _prefill_fit(calibration: HostCalibration | None, obs: Observation, model: str | None):
    if calibration is None:
        return None
    if model is not None:
        if model not in calibration.prefill:
            have = ", ".join(calibration.prefill) or "none"
            raise cli.CliError(f"--model {model}: the profile has no prefill fit for it (have: {have})")
        return calibration.prefill[model]
    name = Path(obs.model).name if obs.model else None
    return calibration.prefill.get(name) if name else None


# --- rendering -----------------------------------------------------------------------------


def render(console: Console, d: Diagnosis, profile: str, calibrated: bool) -> None:
    basis = "calibrated" if calibrated else "spec only"
    console.print(f"[bold]kvstrata doctor[/]: {d.source}  (profile {profile}, {basis})", highlight=False)
    console.print(f"verdict: {_VERDICT[d.verdict.value]}")
    if d.summary:
        console.print("  " + ", ".join(_evidence(e) for e in d.summary), highlight=False, style="dim")
    if d.tiers:
        console.print(_tier_table(d.tiers))
        for line in _bottlenecks(d.tiers):
            console.print(line, highlight=False, style="dim")
        if d.prefill_basis is not None:
            basis = "the server's own prefill time over the tokens it computed" if d.prefill_basis == "server" \
                else "the profile's prefill fit for this model"
            console.print(f"  compute: {basis}", highlight=False, style="dim")
    for i, f in enumerate(d.findings, 1):
        style = _STYLE[f.severity]
        console.print(f"\n[{style}]{i}. {f.severity.value.upper()}[/] [bold]{f.title}[/]", highlight=False)
        console.print(f"   {f.explanation}", highlight=False)
        if f.evidence:
            console.print("   [dim]evidence:[/] " + ", ".join(_evidence(e) for e in f.evidence), highlight=False)
        console.print(f"   [bold]-> {f.suggestion.text}[/]", highlight=False)
    console.print()


def _tier_table(tiers: tuple[TierReport, ...]) -> Table:
    table = Table(title="per tier: restore GB/s achieved, predicted and the spec path's; a block's load and compute")
    for col in ("tier", "hit rate", "loaded", "fill", "evicted", "GB/s", "predicted", "spec", "load", "compute"):
        table.add_column(col, justify="left" if col == "tier" else "right")
    for t in tiers:
        predicted = "-" if t.predicted_gbps is None else _rate(t.predicted_gbps) + \
            ("" if t.predicted_basis == "calibrated" else f" ({t.predicted_basis})")
        table.add_row(
            t.medium.label, f"{t.hit_rate:.0%}", f"{t.loaded_blocks:,.0f}",
            "-" if t.fill is None else f"{t.fill:.0%}",
            "-" if t.evicted_blocks is None else f"{t.evicted_blocks:,.0f}",
            _rate(t.achieved_gbps), predicted, _rate(t.spec_gbps), _ms(t.seconds_per_block),
            _ms(t.recompute_s_per_block),
        )
    return table


def _bottlenecks(tiers: tuple[TierReport, ...]) -> list[str]:
    return [f"  {t.medium.label}: {t.spec_path}, bottleneck {t.bottleneck} ({_gbps(t.spec_gbps)})"
            for t in tiers if t.spec_path is not None]


def _evidence(e: Evidence) -> str:
    key = e.key
    tier, _, rest = key.partition("_")
    if tier in ("device", "host", "disk", "remote") and rest:
        label = f"{tier} {_LABELS.get(rest, rest.replace('_', ' '))}"
    else:
        label = _LABELS.get(key, key.replace("_", " "))
    return f"{label} {_value(e, label)}"


def _value(e: Evidence, label: str) -> str:
    v = e.value
    if e.unit == "ratio":
        return f"{v:.0%}" if v >= 0.01 or v == 0 else f"{v:.1%}"
    if e.unit == "s":
        return _ms(v)
    if e.unit == "GB/s":
        return _gbps(v)
    if e.unit == "bytes":
        return f"{v / 1e6:,.1f} MB"
    return f"{v:,.0f}" + ("" if e.unit == "count" or label.endswith(e.unit) else f" {e.unit}")


def _rate(v: float | None) -> str:
    if v is None:
        return "-"
    return "inf" if not math.isfinite(v) else f"{v:.3g}"


def _gbps(v: float | None) -> str:
    if v is None:
        return "-"
    return "inf" if not math.isfinite(v) else f"{v:.3g} GB/s"


def _ms(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v * 1e3:.2f} ms" if v < 1 else f"{v:.2f} s"
