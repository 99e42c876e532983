"""The end-to-end workload and ``kvstrata demo`` / ``bench e2e`` on the tiny model."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from kvstrata.workload import Workload  # noqa: E402
from kvstrata.workload.runner import run_e2e  # noqa: E402
from kvstrata.cli import main  # noqa: E402
from kvstrata.media import Medium  # noqa: E402

D, H, K, R = Medium.DEVICE, Medium.HOST, Medium.DISK, Medium.REMOTE

SMALL = Workload(conversations=2, turns=2, system_words=200, user_words=60, answer_tokens=8, block_tokens=64)


def test_every_tier_serves_the_workload_with_cold_tokens(tiny_model_dir, pool):
    reports = run_e2e(tiny_model_dir, SMALL, pool=pool).tiers
    assert set(reports) == {D, H, K, R}
    assert all(r.tier is tier for tier, r in reports.items())
    route = {D: (D,), H: (H, D), K: (K, D), R: (R, D)}
    hits = {r.hit_tokens for r in reports.values()}
    assert len(hits) == 1 and hits.pop() > 0  # the same prompts hit the same prefixes on every tier
    for tier, r in reports.items():
        assert r.skipped is None and r.turns == 4
        assert r.tokens_identical, tier
        assert set(r.paths) == {route[tier]}, tier
        if tier is D:
            assert r.restored_bytes == 0
        else:
            assert r.restored_bytes == r.hit_tokens * 4 * 2 * 2 * 64 * 2  # layers x K,V x heads x dim x bf16
            assert r.predicted_restore_s and r.predicted_restore_s > 0
    # Later turns reuse the conversation so far; the second conversation's first turn the system prompt.
    assert 0 < reports[H].hit_rate < 1
    host = reports[H]
    assert host.stream_tokens_identical is True
    assert host.stream_bytes_per_step >= len(host.prompts[-1]) * 4 * 2 * 2 * 64 * 2


def test_demo_json(tiny_model_dir, capsys):
    rc = main(["demo", "--model-dir", str(tiny_model_dir), "--conversations", "1", "--turns", "2",
               "--tiers", "host,disk", "--no-pool", "--json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc["tiers"]) == {"host", "disk"}
    for tier in doc["tiers"].values():
        assert tier["tokens_identical"] is True and tier["hit_tokens"] > 0
        assert tier["ttft_cold_s"] > 0 and tier["ttft_warm_s"] > 0


def test_demo_names_bad_input(tmp_path, capsys):
    assert main(["demo", "--model-dir", str(tmp_path), "--no-pool"]) == 2
    assert "config.json" in capsys.readouterr().err
    assert main(["demo", "--tiers", "tape", "--no-pool"]) == 2
    assert "tape" in capsys.readouterr().err


def test_make_tiny_cli(tmp_path, capsys):
    assert main(["model", "make-tiny", str(tmp_path / "m"), "--layers", "2", "--hidden", "128"]) == 0
    assert "2 layers" in capsys.readouterr().out
    assert (tmp_path / "m" / "model.safetensors").is_file()
    assert main(["model", "make-tiny", str(tmp_path / "m"), "--layers", "3"]) == 2  # another spec: refused
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.txt").write_text("mine")
    assert main(["model", "make-tiny", str(tmp_path / "other")]) == 2


def test_calibrated_profile_feeds_the_demo_and_load_or_recompute(tiny_model_dir, tmp_path, capsys):
    from kvstrata.calibrate import load_calibration

    profile = tmp_path / "host.toml"
    assert main(["calibrate", "--quick", "--sizes-mib", "1", "2", "--repeats", "3", "--model-dir", str(tiny_model_dir),
                 "--out", str(profile)]) == 0
    calibration = load_calibration(profile)
    fit = calibration.prefill[tiny_model_dir.name]
    assert fit.tokens_per_s > 0 and fit.seconds(1024) > fit.seconds(64)
    capsys.readouterr()
    rc = main(["demo", "--model-dir", str(tiny_model_dir), "--conversations", "1", "--turns", "2",
               "--tiers", "device,host,disk", "--no-pool", "--profile", str(profile), "--json"])
    assert rc == 0
    tiers = json.loads(capsys.readouterr().out)["tiers"]
    assert tiers["device"]["predicted_restore_s"] == 0.0
    for tier in ("host", "disk"):
        assert tiers[tier]["predicted_restore_s"] > 0


def test_a_benchmark_beside_the_run_gets_every_turn_and_plain_transformers_is_timed_next_to_ours(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvstrata.workload.runner import run_tier

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    calls = []
    report = run_tier(model, tokenizer, H, SMALL, tmp_path, beside=lambda *call: calls.append(call))
    assert [(tier, index) for tier, index, _ in calls] == [(H, i) for i in range(SMALL.turns_total)]
    assert [tuple(prompt) for _, _, prompt in calls] == list(report.prompts)
    assert len(report.per_turn) == SMALL.turns_total
    for turn, prompt in zip(report.per_turn, report.prompts):
        assert turn.prompt_tokens == len(prompt) and turn.ttft_plain_s > 0 and turn.ttft_cold_s > 0
    assert sum(t.hit_tokens for t in report.per_turn) == report.hit_tokens > 0
    # Without a benchmark beside it, nothing extra is timed.
    plain = run_tier(model, tokenizer, H, SMALL, tmp_path / "again")
    assert all(t.ttft_plain_s is None for t in plain.per_turn)


def test_bench_e2e_pairs_each_turn_and_says_why_lmcache_did_not_run(tiny_model_dir, tmp_path, capsys):
    rc = main(["bench", "e2e", "--model-dir", str(tiny_model_dir), "--conversations", "1", "--turns", "2",
               "--tiers", "host", "--no-pool", "--lmcache-python", str(tmp_path / "nowhere" / "python"), "--json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert "no Python interpreter" in doc["lmcache"]["skipped"] and "nowhere" in doc["lmcache"]["skipped"]
    host = doc["versus"]["host"]
    assert host["cold_over_plain"]["rounds"] == 2
    assert host["cold_over_plain"]["min"] <= host["cold_over_plain"]["median"] <= host["cold_over_plain"]["max"]
    assert host["warm_over_lmcache"] is None
    assert [t["ttft_plain_s"] > 0 for t in doc["tiers"]["host"]["per_turn"]] == [True, True]


def test_the_remote_tier_is_paired_with_the_host_tier_plus_its_bytes_at_the_pool_rate(tiny_model_dir, pool):
    from kvstrata.bench.e2e import versus

    run = run_e2e(tiny_model_dir, SMALL, tiers=(H, R), pool=pool, beside=lambda *call: None)
    assert run.pool_gbps and run.pool_gbps > 0
    paired = versus(run, None)
    remote = paired[R].warm_over_host_and_pool
    assert remote is not None and remote.rounds == sum(1 for t in run.tiers[R].per_turn if t.hit_tokens) > 0
    assert remote.min <= remote.median <= remote.max
    assert paired[H].warm_over_host_and_pool is None and paired[H].cold_over_plain.rounds == SMALL.turns_total
