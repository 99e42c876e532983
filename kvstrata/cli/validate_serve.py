"""``kvstrata validate --serve BENCH.json --profile PROFILE.toml``: the serving simulator beside
what ``bench serve`` measured (:mod:`kvstrata.calibrate.serving.validate`); the files are read here."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from rich.table import Table

from kvstrata import cli

PLOT_FIGURES = ("ttft", "tpot")


def run_validate_serve(args: argparse.Namespace) -> int:
    from kvstrata.calibrate.serving.validate import (
        BadReport,
        compare,
        measured_figures,
        run_spreads,
        setup_of,
        simulated_figures,
        summary,
    )
    from kvstrata.calibrate import load_calibration
    from kvstrata.calibrate.serving.sim import simulate_serve

    if not args.profile:
        raise cli.CliError("--serve needs --profile PROFILE.toml: a profile from kvstrata calibrate --model-dir DIR "
                           "--engine vllm (the engine's step times on this host)")
    calibration = load_calibration(args.profile)
    validations, workloads = [], []
    for path in args.serve:
        doc = _read(path)
        try:
            measured = measured_figures(doc)
            model = Path(doc["config"]["model_dir"]).name
            setup = setup_of(doc, _trace(doc), calibration, model, args.workers)
        except BadReport as exc:
            raise cli.CliError(f"{path}: {exc}") from None
        except ValueError as exc:
            raise cli.CliError(f"--profile {args.profile}: {exc}") from None
        sim = simulate_serve(setup)
        validations.append((path, compare(measured, simulated_figures(sim)), sim))
        workloads.append(_workload(doc))
    spreads = run_spreads([(w, v) for w, (_, v, _) in zip(workloads, validations, strict=True)])
    if args.plot:
        _plot(validations, args.plot, args.json)
    if args.json:
        print(json.dumps({"profile": args.profile,
                          "summary": summary([v for _, v, _ in validations]) | {"spreads": _spreads_json(spreads)},
                          "reports": [_to_json(path, v, sim) for path, v, sim in validations]}, indent=2))
        return 0
    for path, v, sim in validations:
        _print(path, v, sim)
    if len(validations) > 1:
        s = summary([v for _, v, _ in validations])
        cli.console().print(f"{s['reports']} reports: ranking by TTFT p90 the same in {s['rankings_same']}; worst "
                            f"misses: {', '.join(s['misses']) or 'none'}", highlight=False)
    if spreads:
        _print_spreads(spreads, [v for _, v, _ in validations], workloads)
    return 0


def _workload(doc: dict) -> str:
    """What runs of one workload share, as a label: the rate, the conversations, the trace."""
    w, trace = doc["config"]["workload"], doc["config"].get("trace")
    label = f"{w['rate_per_s']:g} requests/s, {w['conversations']} conversations x {w['turns']} turns"
    return label + (f", trace {Path(trace).name}" if trace else "")


def _print_spreads(spreads, validations, workloads: list[str]) -> None:
    """How many goals no prediction could meet in every run, and how many of the misses they are."""
    apart = [x for x in spreads if not x.attainable]
    keys = {(x.workload, x.configuration, x.figure) for x in apart}
    missed = [(w, r) for w, v in zip(workloads, validations, strict=True) for r in v.misses]
    within = sum(1 for w, r in missed if (w, r.configuration, r.figure) in keys)
    shown = ", ".join(f"{x.configuration} {x.figure} at {x.workload.split(',')[0]} (x{x.ratio:.2f})" for x in apart)
    cli.console().print(f"runs of one workload: {len(apart)} of {len(spreads)} goals' figures differ between the runs by "
                        f"more than the goal's band, so no prediction meets them in every run"
                        f"{': ' + shown if apart else ''}; {within} of the {len(missed)} misses are among them",
                        highlight=False)


def _spreads_json(spreads) -> list[dict]:
    return [{"workload": x.workload, "configuration": x.configuration, "figure": x.figure,
             "measured": [_finite(m) for m in x.measured], "ratio": _finite(x.ratio), "attainable": x.attainable}
            for x in spreads]


def _read(path: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise cli.CliError(f"--serve {path}: no such file") from None
    except json.JSONDecodeError as exc:
        raise cli.CliError(f"--serve {path}: not JSON ({exc.msg} at line {exc.lineno}): a bench serve --json "
                           "report is expected") from None


def _trace(doc: dict) -> list:
    from kvstrata.calibrate.serving.workload import generated_trace
    from kvstrata.calibrate.serving.validate import report_workload
    from kvstrata.sim.traceio import read_trace

    trace = doc["config"].get("trace")
    if trace is None:
        return generated_trace(report_workload(doc["config"]["workload"]))
    if not Path(trace).is_file():
        raise cli.CliError(f"the report's trace {trace} is not here: the simulation needs the same trace")
    return read_trace(trace)


def _value(figure: str, x: float) -> str:
    if figure.startswith("hit"):
        return f"{x:.1%}"
    if figure == "requests/s":
        return f"{x:.2f}"
    if figure.startswith("load"):
        return f"{x * 1e3:.2f} ms"
    return f"{x * 1e3:.1f} ms"


def _print(path: str, v, sim) -> None:
    console = cli.console()
    table = Table(title=f"{path}: simulated vs measured (goals: hit rates +-2 points; TTFT/TPOT p50 +-15%, p90 +-25%)",
                  title_justify="left")
    for col in ("configuration", "figure", "measured", "simulated", "error", "goal"):
        table.add_column(col, justify="left" if col in ("configuration", "figure") else "right")
    for r in v.rows:
        error = f"{r.error * 100:+.1f} pt" if r.points else f"{r.error:+.0%}"
        verdict = {True: "[green]met[/]", False: "[bold red]MISS[/]", None: "[dim]-[/]"}[r.met]
        table.add_row(v.labels[r.configuration], r.figure, _value(r.figure, r.measured), _value(r.figure, r.simulated),
                      error, verdict)
    console.print(table)
    same = "[green]the same[/]" if v.ranking_same else "[bold red]different[/]"
    console.print(f"ranking by TTFT p90, measured: {' < '.join(v.labels[n] for n in v.ranking_measured)}", highlight=False)
    console.print(f"               simulated: {' < '.join(v.labels[n] for n in v.ranking_simulated)} ({same})",
                  highlight=False)
    pre = {i.value: n for i, n in sim.preemptions.items() if n}
    console.print(f"{len(v.misses)} of {sum(1 for r in v.rows if r.met is not None)} figures miss their goal; "
                  f"simulated preemptions: {pre or 'none'}", highlight=False)


def _to_json(path: str, v, sim) -> dict:
    return {"report": path, "ranking_measured": list(v.ranking_measured), "ranking_simulated": list(v.ranking_simulated),
            "ranking_same": v.ranking_same,
            "preemptions": {i.value: n for i, n in sim.preemptions.items()},
            "rows": [{"configuration": r.configuration, "figure": r.figure, "measured": _finite(r.measured),
                      "simulated": _finite(r.simulated), "error": _finite(r.error),
                      "error_unit": "points" if r.points else "relative", "goal": r.goal, "met": r.met}
                     for r in v.rows]}


def _finite(x: float) -> float | None:
    """``x``, or None where it is not a number (JSON has no NaN)."""
    return x if math.isfinite(x) else None


def _plot(validations: list, path: str, json_output: bool) -> None:
    from kvstrata.plots import png_bytes, save_png
    from kvstrata.plots.serving import validation_figure

    save_png(png_bytes(validation_figure([(p, v) for p, v, _ in validations])), path)
    cli.wrote("measured and simulated CDFs", path, json_output)
