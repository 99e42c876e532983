"""``kvstrata validate --serve``: a bench serve report's figures read, the run set up for the
simulator, each figure compared with its goal, the rankings, and the command's output."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from kvstrata.calibrate.serving.workload import ServeWorkload
from kvstrata.calibrate.serving.validate import (
    BadReport,
    Figures,
    compare,
    measured_figures,
    run_spreads,
    setup_of,
    summary,
)
from kvstrata.cli import main
from kvstrata.media import Medium
from kvstrata.report import to_json
from kvstrata.plan.calpaths import CalPath
from kvstrata.plan.host import RESTORE_FIXED, HostCalibration, PathFit, PrefillFit
from kvstrata.plan.steps import DecodeFit

MODEL = "tiny-llama"
WORKLOAD = ServeWorkload(conversations=4, turns=2, max_tokens=8, user_tokens=16, block_tokens=16,
                         max_model_len=256, rate_per_s=8.0)
PATHS = {CalPath.MEMCPY_ONE: PathFit(0.0, 5.0), RESTORE_FIXED[Medium.HOST]: PathFit(0.001, math.inf),
         CalPath.DISK_BLOCKS_WARM: PathFit(0.0, 2.0), RESTORE_FIXED[Medium.DISK]: PathFit(0.002, math.inf),
         CalPath.DISK_WRITE: PathFit(0.0005, 1.0)}
POOL_PATHS = {CalPath.POOL_GET: PathFit(0.0, 1.0), RESTORE_FIXED[Medium.REMOTE]: PathFit(0.003, math.inf),
              CalPath.POOL_PUT: PathFit(0.0005, 1.0)}


def _calibration(paths: dict[str, PathFit] = PATHS) -> HostCalibration:
    return HostCalibration("test-host", "cpu", 2, dict(paths), {MODEL: PrefillFit(0.030, 20_000.0, 1e-8)},
                           decode={MODEL: DecodeFit(0.010, 0.001)})


def _configuration(ttft_s: list[float], tpot_s: float | None = 0.012, hits: dict[str, float] | None = None,
                   vllm: float | None = 0.3, requests_per_s: float = 4.0) -> dict:
    """One configuration as a bench serve --json report writes it (the keys read back)."""
    return {"requests": [{"ttft_s": t, "tpot_s": tpot_s} for t in ttft_s], "requests_per_s": requests_per_s,
            "vllm_prefix_hit_rate": vllm, "hits": {tier: {"rate": rate} for tier, rate in (hits or {}).items()}}


def _report(pool: bool = False) -> dict:
    """A small report: the rounds and the restart (and the pool's phases with ``pool``)."""
    n = WORKLOAD.requests
    doc = {
        "config": {"workload": to_json(WORKLOAD), "model_dir": f"/models/{MODEL}", "vocab": 4096,
                   "block_bytes": 65536, "trace": None, "rounds": 2, "kv_blocks": 32, "max_num_seqs": 8,
                   "host_bytes": 64 * 2**20, "disk_bytes": 128 * 2**20, "remote_bytes": 64 * 2**20},
        "baseline": _configuration([0.040 + 0.001 * i for i in range(2 * n)]),
        "kvstrata": _configuration([0.030 + 0.001 * i for i in range(2 * n)], hits={"device": 0.02, "host": 0.3}),
        "restart": {"server": "kvstrata", "replay": _configuration([0.035] * n, hits={"disk": 0.4})},
        "shared_pool": {"reason": "no pool"},
        "prefill_decode": {"reason": "no pool"},
    }
    if pool:
        doc["shared_pool"] = {"together": _configuration([0.032] * n, hits={"host": 0.1, "remote": 0.2})}
        doc["prefill_decode"] = {"decode": _configuration([0.025] * n, hits={"host": 0.2, "remote": 0.3})}
    return doc


def _figures(ttft_s: list[float], hits: dict[str, float] | None = None, tpot_s: float = 0.012) -> Figures:
    return Figures(len(ttft_s), tuple(ttft_s), (tpot_s,) * len(ttft_s), 4.0, {"vllm": 0.3, **(hits or {})})


def _row(validation, configuration: str, figure: str):
    return next(r for r in validation.rows if r.configuration == configuration and r.figure == figure)


TTFT = [0.010 * (i + 1) for i in range(10)]


# --- the report -----------------------------------------------------------------------------------


def test_measured_figures_reads_each_configuration_that_ran():
    figures = measured_figures(_report())
    assert set(figures) == {"baseline", "kvstrata", "restart"}  # the pool's phases were skipped
    k = figures["kvstrata"]
    assert k.requests == 2 * WORKLOAD.requests
    assert k.ttft_s[0] == 0.030 and k.requests_per_s == 4.0
    assert k.hit_rate == {"vllm": 0.3, "device": 0.02, "host": 0.3}
    assert figures["restart"].hit_rate == {"vllm": 0.3, "disk": 0.4}
    assert set(measured_figures(_report(pool=True))) == {"baseline", "kvstrata", "shared_pool", "restart",
                                                         "prefill_decode.decode"}


def test_one_token_answers_have_no_tpot_and_no_vllm_rate_reads_as_zero():
    doc = _report()
    doc["baseline"] = _configuration([0.04, 0.05], tpot_s=None, vllm=None)
    b = measured_figures(doc)["baseline"]
    assert b.tpot_s == () and b.hit_rate["vllm"] == 0.0


@pytest.mark.parametrize("doc", [{}, {"config": {}}, {"baseline": {}}, [1, 2]], ids=["empty", "no baseline",
                                                                                       "no config", "a list"])
def test_a_document_without_config_or_baseline_is_not_a_report(doc):
    with pytest.raises(BadReport, match="no 'config' or 'baseline'"):
        measured_figures(doc)


@pytest.mark.parametrize(("path", "named"), [
    (("kvstrata", "hits"), "kvstrata lacks 'hits'"),
    (("restart", "replay", "requests", 0, "ttft_s"), "restart.replay lacks 'ttft_s'"),
    (("baseline", "requests"), "baseline"),
])
def test_a_configuration_lacking_a_field_is_a_bad_report_naming_it(path, named):
    doc = _report()
    *parents, field = path
    holder = doc
    for step in parents:
        holder = holder[step]
    del holder[field]
    with pytest.raises(BadReport, match=named):
        measured_figures(doc)


def test_setup_of_takes_the_runs_config():
    setup = setup_of(_report(), [], _calibration(), MODEL, 2)
    assert setup.workload == WORKLOAD and setup.rounds == 2 and setup.vocab == 4096
    assert (setup.limits.kv_blocks, setup.limits.block_tokens, setup.limits.max_num_seqs) == (32, 16, 8)
    assert setup.device_bytes == 32 * 65536
    assert not setup.pool
    assert setup.times.decode == DecodeFit(0.010, 0.001)
    assert setup_of(_report(pool=True), [], _calibration({**PATHS, **POOL_PATHS}), MODEL, 2).pool


def test_setup_of_names_the_pool_path_a_profile_lacks_when_the_report_ran_the_pool():
    with pytest.raises(ValueError, match=r"remote.*--pool.*'pool get'"):
        setup_of(_report(pool=True), [], _calibration(), MODEL, 2)


def test_setup_of_names_a_config_field_the_report_lacks():
    doc = _report()
    del doc["config"]["vocab"]
    with pytest.raises(BadReport, match="config lacks 'vocab'"):
        setup_of(doc, [], _calibration(), MODEL, 2)


def test_setup_of_refuses_a_no_reuse_run_and_an_unknown_kind():
    doc = _report()
    doc["config"]["workload"]["kind"] = "no-reuse"
    with pytest.raises(BadReport, match="a --workload no-reuse run; the simulation replays the conversations"):
        setup_of(doc, [], _calibration(), MODEL, 2)
    doc["config"]["workload"]["kind"] = "chat"
    with pytest.raises(BadReport, match="workload kind must be one of conversations, no-reuse, got 'chat'"):
        setup_of(doc, [], _calibration(), MODEL, 2)


# --- rows, goals, rankings ------------------------------------------------------------------------


def test_a_simulation_equal_to_the_measurement_meets_every_goal():
    figures = {"baseline": _figures(TTFT), "kvstrata": _figures([t / 2 for t in TTFT], {"host": 0.3})}
    v = compare(figures, figures)
    assert v.misses == ()
    assert all(r.met is not False for r in v.rows)
    assert {r.figure for r in v.rows if r.configuration == "baseline"} == {
        "ttft_p50", "ttft_p90", "ttft_p99", "tpot_p50", "tpot_p90", "requests/s", "hit vllm"}
    assert _row(v, "kvstrata", "hit host").goal == 0.02
    assert v.ranking_same and v.ranking_measured == ("kvstrata", "baseline")


def test_twenty_percent_off_misses_p50_and_meets_p90():
    measured = {"baseline": _figures(TTFT)}
    v = compare(measured, {"baseline": _figures([t * 1.2 for t in TTFT], tpot_s=0.012 * 1.2)})
    for figure, met in (("ttft_p50", False), ("ttft_p90", True), ("tpot_p50", False), ("tpot_p90", True)):
        row = _row(v, "baseline", figure)
        assert row.error == pytest.approx(0.2) and row.met is met, figure
    assert _row(v, "baseline", "ttft_p99").met is None  # shown without a goal
    assert _row(v, "baseline", "requests/s").met is None
    assert {(r.configuration, r.figure) for r in v.misses} == {("baseline", "ttft_p50"), ("baseline", "tpot_p50")}


def test_ten_percent_off_meets_p50():
    v = compare({"baseline": _figures(TTFT)}, {"baseline": _figures([t * 0.9 for t in TTFT])})
    row = _row(v, "baseline", "ttft_p50")
    assert row.error == pytest.approx(-0.1) and row.met


@pytest.mark.parametrize(("simulated", "met"), [(0.33, False), (0.27, False), (0.32, True), (0.31, True)])
def test_a_hit_rate_more_than_two_points_off_misses(simulated, met):
    v = compare({"kvstrata": _figures(TTFT, {"host": 0.30})}, {"kvstrata": _figures(TTFT, {"host": simulated})})
    row = _row(v, "kvstrata", "hit host")
    assert row.points and row.error == pytest.approx(simulated - 0.30)
    assert row.met is met


def test_a_tier_only_one_side_has_counts_as_zero_on_the_other():
    v = compare({"restart": _figures(TTFT, {"disk": 0.4})}, {"restart": _figures(TTFT, {"disk": 0.39, "remote": 0.2})})
    assert _row(v, "restart", "hit remote").measured == 0.0
    assert _row(v, "restart", "hit remote").met is False
    assert _row(v, "restart", "hit disk").met is True


def test_one_token_answers_have_no_tpot_to_miss():
    one = Figures(3, (0.01, 0.02, 0.03), (), 4.0, {"vllm": 0.0})
    assert compare({"baseline": one}, {"baseline": one}).misses == ()


def test_only_configurations_both_sides_have_are_compared():
    v = compare({"baseline": _figures(TTFT), "restart": _figures(TTFT)},
                {"baseline": _figures(TTFT), "kvstrata": _figures(TTFT)})
    assert {r.configuration for r in v.rows} == {"baseline"}


def test_the_ranking_by_ttft_p90_same_or_different():
    slow, fast = _figures(TTFT), _figures([t / 2 for t in TTFT])
    measured = {"baseline": slow, "kvstrata": fast}
    assert compare(measured, {"baseline": slow, "kvstrata": fast}).ranking_same
    swapped = compare(measured, {"baseline": fast, "kvstrata": slow})
    assert not swapped.ranking_same
    assert swapped.ranking_measured == ("kvstrata", "baseline")
    assert swapped.ranking_simulated == ("baseline", "kvstrata")


def test_summary_keeps_each_rows_worst_error_over_the_reports():
    measured = {"baseline": _figures(TTFT)}
    near = compare(measured, {"baseline": _figures([t * 1.1 for t in TTFT])})
    far = compare(measured, {"baseline": _figures([t * 1.2 for t in TTFT])})
    s = summary([near, far])
    assert s["reports"] == 2 and s["rankings_same"] == 2
    assert s["misses"] == ["baseline ttft_p50"]
    # the worst time errors: ttft p50 and p90 20%, tpot p50 and p90 0%
    assert s["median_abs_time_error"] == pytest.approx(0.1)


def test_runs_apart_by_more_than_a_goals_band_have_no_prediction_within_it_in_every_run():
    simulated = {"baseline": _figures(TTFT)}

    def run(scale: float, vllm: float = 0.3):
        figures = _figures([t * scale for t in TTFT])
        return compare({"baseline": dataclasses.replace(figures, hit_rate={"vllm": vllm})}, simulated)

    # p50 +-15%: one value within it of runs 1.3x apart (1.35 at most), none for 1.4x; p90 +-25%: 1.67
    spreads = {(x.workload, x.figure): x for x in run_spreads([("a", run(1.0)), ("a", run(1.3)),
                                                               ("b", run(1.0)), ("b", run(1.4)),
                                                               ("c", run(1.0)), ("c", run(1.7)),
                                                               ("d", run(1.0, 0.30)), ("d", run(1.0, 0.35)),
                                                               ("alone", run(3.0))])}
    assert spreads[("a", "ttft_p50")].attainable and spreads[("a", "ttft_p50")].ratio == pytest.approx(1.3)
    assert not spreads[("b", "ttft_p50")].attainable and spreads[("b", "ttft_p90")].attainable
    assert not spreads[("c", "ttft_p90")].attainable and spreads[("c", "tpot_p50")].attainable  # TPOT: the same
    assert spreads[("c", "hit vllm")].attainable  # hit rates: within 2 points of both, 4 apart at most
    assert not spreads[("d", "hit vllm")].attainable
    assert not any(w == "alone" for w, _ in spreads)  # one run: nothing to say
    assert ("a", "ttft_p99") not in spreads  # shown without a goal


# --- the command ----------------------------------------------------------------------------------


@pytest.fixture
def files(tmp_path):
    report, profile = tmp_path / "serve.json", tmp_path / "profile.toml"
    report.write_text(json.dumps(_report()))
    profile.write_text(_calibration().to_toml())
    return report, profile


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    return lines[0]


def test_cli_a_missing_report_is_one_line(files, tmp_path, capsys):
    _, profile = files
    assert main(["validate", "--serve", str(tmp_path / "nope.json"), "--profile", str(profile)]) == 2
    assert "nope.json: no such file" in _one_error_line(capsys.readouterr().err)


def test_cli_serve_without_a_profile_is_one_line(files, capsys):
    report, _ = files
    assert main(["validate", "--serve", str(report)]) == 2
    assert "--serve needs --profile" in _one_error_line(capsys.readouterr().err)


def test_cli_a_file_that_is_not_json_or_not_a_report_is_one_line(files, tmp_path, capsys):
    _, profile = files
    text, other = tmp_path / "notes.json", tmp_path / "other.json"
    text.write_text("TTFT was fine\n")
    other.write_text(json.dumps({"architectures": []}))
    assert main(["validate", "--serve", str(text), "--profile", str(profile)]) == 2
    assert "not JSON" in _one_error_line(capsys.readouterr().err)
    assert main(["validate", "--serve", str(other), "--profile", str(profile)]) == 2
    assert "not a bench serve --json report" in _one_error_line(capsys.readouterr().err)


def test_cli_names_the_pool_path_the_profile_lacks(files, tmp_path, capsys):
    _, profile = files
    pooled = tmp_path / "pooled.json"
    pooled.write_text(json.dumps(_report(pool=True)))
    assert main(["validate", "--serve", str(pooled), "--profile", str(profile)]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"--profile {profile}" in line and "'pool get'" in line


def test_cli_a_report_whose_trace_is_not_here_is_one_line(files, tmp_path, capsys):
    report, profile = files
    doc = _report()
    doc["config"]["trace"] = str(tmp_path / "gone.jsonl")
    report.write_text(json.dumps(doc))
    assert main(["validate", "--serve", str(report), "--profile", str(profile)]) == 2
    assert "gone.jsonl is not here" in _one_error_line(capsys.readouterr().err)


def test_cli_json_has_rows_for_every_configuration_the_report_ran(files, capsys):
    report, profile = files
    assert main(["validate", "--serve", str(report), "--profile", str(profile), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["summary"]["reports"] == 1
    (one,) = doc["reports"]
    assert one["report"] == str(report)
    rows = {(r["configuration"], r["figure"]): r for r in one["rows"]}
    assert {c for c, _ in rows} == {"baseline", "kvstrata", "restart"}
    baseline = rows["baseline", "ttft_p50"]
    assert baseline["measured"] == pytest.approx(0.040 + 0.001 * 7.5)  # the median of 16 evenly spaced
    assert baseline["simulated"] > 0 and baseline["goal"] == 0.15 and baseline["error_unit"] == "relative"
    assert rows["restart", "hit disk"]["error_unit"] == "points"
    assert set(one["ranking_measured"]) == set(one["ranking_simulated"]) == {"baseline", "kvstrata", "restart"}
    assert set(one["preemptions"]) == {"baseline", "kvstrata"}


def test_cli_table_names_each_configuration(files, capsys):
    report, profile = files
    assert main(["validate", "--serve", str(report), "--profile", str(profile)]) == 0
    out = capsys.readouterr().out
    for label in ("vLLM alone", "vLLM + kvstrata", "restarted (disk)", "ranking by TTFT p90"):
        assert label in out


def test_cli_plot_writes_a_png(files, tmp_path, capsys):
    report, profile = files
    png = tmp_path / "plots" / "serve.png"
    assert main(["validate", "--serve", str(report), "--profile", str(profile), "--json", "--plot", str(png)]) == 0
    out = capsys.readouterr()
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert f"written to {png}" in out.err  # stdout stays JSON
    assert json.loads(out.out)["summary"]["reports"] == 1


def test_cli_plot_without_serve_is_refused(tmp_path, capsys):
    assert main(["validate", "--plot", str(tmp_path / "x.png")]) == 2
    assert "--plot goes with --serve" in _one_error_line(capsys.readouterr().err)


def test_hit_tiers_are_labelled_as_the_bench_labels_them():
    # the simulation's tiers and the report's keys must meet in one row, not two
    assert [m.label for m in Medium] == ["device", "host", "disk", "remote"]


def test_cli_two_runs_of_one_workload_say_which_goals_their_spread_allows(files, tmp_path, capsys):
    report, profile = files
    slower = tmp_path / "slower.json"
    doc = _report()
    doc["baseline"] = _configuration([2 * (0.040 + 0.001 * i) for i in range(2 * WORKLOAD.requests)])
    slower.write_text(json.dumps(doc))
    assert main(["validate", "--serve", str(report), str(slower), "--profile", str(profile), "--json"]) == 0
    spreads = {(x["configuration"], x["figure"]): x for x in json.loads(capsys.readouterr().out)["summary"]["spreads"]}
    assert spreads[("baseline", "ttft_p50")]["ratio"] == pytest.approx(2, rel=0.05)
    assert not spreads[("baseline", "ttft_p50")]["attainable"]
    assert spreads[("kvstrata", "ttft_p50")]["attainable"] and spreads[("kvstrata", "ttft_p50")]["ratio"] == 1
    assert {x["workload"] for x in spreads.values()} == {"8 requests/s, 4 conversations x 2 turns"}
    assert main(["validate", "--serve", str(report), str(slower), "--profile", str(profile)]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the console wraps at its width
    assert "no prediction meets them in every run" in out and "baseline ttft_p50 at 8 requests/s (x2.0" in out
