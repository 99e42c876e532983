"""``kvstrata doctor`` through the real command-line entry point: findings on the terminal and as
JSON, a calibrated profile's predictions, and bad sources as one line with exit code 2."""

from __future__ import annotations

import json
import math
from pathlib import Path

from kvstrata.calibrate import base_profile_text, profile_text
from kvstrata.cli import main
from kvstrata.plan.calpaths import CalPath
from kvstrata.plan.host import RESTORE_FIXED, HostCalibration, PathFit, PrefillFit
from kvstrata.media import Medium

DATA = Path(__file__).parents[1] / "doctor" / "data"
VLLM_DUMP = DATA / "vllm_0.32_connector_without_series.txt"
# A disk tier that served the 54 repeated blocks slowly (2 s for 3.5 MB).
DISK_TEXT = """\
kvstrata_connector_lookup_hit_blocks_total{engine="0",model_name="/tmp/dscratch/tiny",tier="disk"} 54.0
kvstrata_connector_lookup_miss_blocks_total{engine="0",model_name="/tmp/dscratch/tiny"} 54.0
kvstrata_connector_loaded_blocks_total{engine="0",model_name="/tmp/dscratch/tiny",tier="disk"} 54.0
kvstrata_connector_loaded_bytes_total{engine="0",model_name="/tmp/dscratch/tiny",tier="disk"} 3538944.0
kvstrata_connector_loads_total{engine="0",model_name="/tmp/dscratch/tiny"} 6.0
kvstrata_connector_load_seconds_total{engine="0",model_name="/tmp/dscratch/tiny"} 0.3
kvstrata_connector_tier_used_bytes{engine="0",model_name="/tmp/dscratch/tiny",tier="disk"} 3538944.0
kvstrata_connector_tier_capacity_bytes{engine="0",model_name="/tmp/dscratch/tiny",tier="disk"} 268435456.0
"""


def doctor_json(capsys, *argv):
    assert main(["doctor", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def calibrated_profile(tmp_path: Path) -> Path:
    cal = HostCalibration("vm", "cpu", 2, {CalPath.DISK_BLOCKS_COLD: PathFit(0.0, 1.1),
                                           RESTORE_FIXED[Medium.DISK]: PathFit(3e-4, math.inf)},
                          {"tiny": PrefillFit(0.02, 4000.0)})
    path = tmp_path / "calibrated.toml"
    path.write_text(profile_text(cal, base_profile_text("workstation")))
    return path


def test_a_server_without_the_connectors_series(capsys):
    doc = doctor_json(capsys, str(VLLM_DUMP))
    assert doc["verdict"] == "unknown" and doc["calibrated"] is False
    assert [f["cause"] for f in doc["findings"]] == ["no_connector"]
    assert doc["summary"]["vllm_kv_cache_tokens"] == 1280
    assert main(["doctor", str(VLLM_DUMP)]) == 0
    out = capsys.readouterr().out
    assert "kvstrata's connector reports nothing" in out and "-> Start vLLM with --kv-transfer-config" in out


def test_a_slow_disk_against_a_calibrated_profile(capsys, tmp_path):
    dump = tmp_path / "metrics.txt"
    dump.write_text(VLLM_DUMP.read_text() + DISK_TEXT)
    profile = calibrated_profile(tmp_path)
    doc = doctor_json(capsys, str(dump), "--profile", str(profile))
    assert doc["calibrated"] is True and doc["prefill_basis"] == "server"
    (disk,) = doc["tiers"]
    assert disk["tier"] == "disk" and disk["predicted_basis"] == "calibrated" and "nvme0" in disk["bottleneck"]
    causes = {f["cause"]: f for f in doc["findings"]}
    assert causes["below_prediction"]["change"]["kind"] == "faster_path"
    # the profile's prefill (tiny: 4,000 tokens/s after 20 ms) by name, when asked for
    assert doctor_json(capsys, str(dump), "--profile", str(profile), "--prefill", "profile")["prefill_basis"] == "profile"
    assert main(["doctor", str(dump), "--profile", str(profile)]) == 0
    out = capsys.readouterr().out
    assert "per tier" in out and "disk restores run at" in out


def test_a_bench_report_gives_one_diagnosis_per_server(capsys, tmp_path):
    report = tmp_path / "bench.json"
    report.write_text(json.dumps({"metrics_text": {"baseline": VLLM_DUMP.read_text(),
                                                   "kvstrata": VLLM_DUMP.read_text() + DISK_TEXT},
                                  "kvstrata": {"requests": [{"prompt_tokens": 301, "ttft_s": 0.05}]}}))
    baseline, ours = doctor_json(capsys, str(report))
    assert (baseline["source"], ours["source"]) == (f"{report} [baseline]", f"{report} [kvstrata]")
    assert baseline["verdict"] == "unknown" and ours["summary"]["ttft_p50_s"] == 0.05
    (finding,) = baseline["findings"]  # vLLM alone on purpose: said so, not a problem
    assert finding["cause"] == "no_connector" and finding["severity"] == "info"


def test_bad_sources_are_one_line_and_exit_2(capsys, tmp_path):
    for argv, named in ((["http://127.0.0.1:9", "--timeout", "2"], "http://127.0.0.1:9/metrics: no answer"),
                        ([str(tmp_path / "none.txt")], "no such file"),
                        ([str(VLLM_DUMP), "--profile", "no-such-profile"], "no-such-profile"),
                        ([str(VLLM_DUMP), "--profile", str(calibrated_profile(tmp_path)), "--model", "other"],
                         "--model other: the profile has no prefill fit for it (have: tiny)")):
        assert main(["doctor", *argv]) == 2
        err = capsys.readouterr().err
        assert named in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
