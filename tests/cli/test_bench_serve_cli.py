"""``kvstrata bench serve``'s bad input: one line on stderr naming what is wrong, exit code 2,
before any server or pool starts (no vLLM is run here)."""

from __future__ import annotations

import json

import pytest

from kvstrata.cli import main

# a model directory as far as the bench reads one before starting servers: its config.json
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 688,
          "num_attention_heads": 4, "num_hidden_layers": 4, "num_key_value_heads": 2, "head_dim": 64,
          "vocab_size": 4096, "max_position_embeddings": 8192, "dtype": "bfloat16"}


@pytest.fixture
def model_dir(tmp_path):
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(CONFIG))
    return path


def refused(capsys, argv: list[str]) -> str:
    assert main(["bench", "serve", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err, err
    return err


@pytest.mark.parametrize(("argv", "named"), [
    (["--rate", "0"], "rate must be a number of requests/s > 0, got 0.0"),
    (["--rate", "-3"], "rate must be a number of requests/s > 0"),
    (["--conversations", "0"], "conversations must be a whole number >= 1, got 0"),
    (["--turns", "40"], "40 turns of 16 answer + 64 user tokens leave no room"),
    (["--trace", "/no/such/trace.jsonl"], "--trace /no/such/trace.jsonl: no such file"),
    (["--host-mib", "0"], "--host-mib must be >= 1, got 0"),
    (["--server-cpus", "1-0"], "--server-cpus must be a CPU list such as '0-3' or '0,2', got '1-0'"),
    (["--server-cpus", "0,4095"], "--server-cpus 0,4095: CPU 4095 is not among this host's CPUs for this process"),
])
def test_bad_flags_are_one_line_before_anything_starts(capsys, argv, named):
    assert named in refused(capsys, argv)


def test_an_unknown_workload_is_one_line_naming_the_choices(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "serve", "--workload", "chat"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "argument --workload: invalid choice: 'chat'" in err and "'conversations', 'no-reuse'" in err


def test_a_model_and_sizes_that_do_not_fit_are_one_line(capsys, model_dir, tmp_path):
    assert "--model-dir" in refused(capsys, ["--model-dir", str(tmp_path / "nothing")])
    err = refused(capsys, ["--model-dir", str(model_dir), "--kv-blocks", "4", "--no-pool"])
    assert "--kv-blocks >= 17" in err  # 512 tokens in blocks of 32, and vLLM's null block


def test_the_defaults_follow_the_model_the_tiny_ones_for_the_tiny_model_and_flags_win(model_dir, tmp_path):
    import argparse

    from kvstrata.bench.cli.serve import DEFAULT_LIKE, SHAPED, TINY, sized
    from kvstrata.integrations.tiny import TINY_MARKER

    def args(**given) -> argparse.Namespace:
        flags = dict(model_dir=None, like=None, conversations=None, rate=None, user_tokens=None, max_model_len=None,
                     block_size=None, kv_blocks=None, dtype=None, host_mib=None)
        return argparse.Namespace(**{**flags, **given})

    default = args()
    assert sized(default) is SHAPED and default.like == DEFAULT_LIKE and default.block_size == 128
    assert default.dtype == "bfloat16"
    assert sized(args(model_dir=str(model_dir))) is SHAPED  # a model directory kvstrata did not make: a real one
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    (tiny / TINY_MARKER).write_text(json.dumps({"hidden": 256, "layers": 4}))
    mine = args(model_dir=str(tiny), kv_blocks=40)
    assert sized(mine) is TINY and (mine.block_size, mine.dtype, mine.kv_blocks, mine.like) == (32, "float32", 40, None)
    (tiny / TINY_MARKER).write_text(json.dumps({"like": "qwen2.5-0.5b", "dtype": "bfloat16"}))
    assert sized(args(model_dir=str(tiny))) is SHAPED  # kvstrata model make's: a real model's shape


def test_a_bad_or_short_trace_is_one_line_naming_it(capsys, model_dir, tmp_path):
    short = tmp_path / "short.jsonl"
    short.write_text('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n')
    err = refused(capsys, ["--model-dir", str(model_dir), "--trace", str(short), "--no-pool"])
    assert "the trace has 1 requests; 6 conversations need one each" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n{"timestamp": 1}\n')
    err = refused(capsys, ["--model-dir", str(model_dir), "--trace", str(bad), "--conversations", "1", "--no-pool"])
    assert str(bad) in err and "line 2" in err


def test_the_table_says_which_parts_were_skipped_and_why(capsys):
    from pathlib import Path

    from kvstrata.calibrate.serving.servers import Instance, ServeBenchConfig
    from kvstrata.calibrate.serving.counters import counters_of
    from kvstrata.calibrate.serving.workload import ServeWorkload
    from kvstrata.bench.serve_report import Restart, ServeBenchReport, ServeRound, versus
    from kvstrata.calibrate.serving.measured import RequestRecord, measure
    from kvstrata.rounds import Skipped
    from kvstrata.bench.cli.serve import _print_serve

    metrics = 'vllm:prefix_cache_queries_total 1000\nvllm:prefix_cache_hits_total 250\n'
    stats = {"load_paths": {"host -> device": 6, "disk -> device": 2}, "load_requests": 2, "load_seconds": 0.004}

    def measured(instance: Instance, same: bool = True):
        records = [RequestRecord(i, 0, instance, 128, (1, 2), 0.02 * (i + 1), 0.004, 0.03, 0.25 * i, identical=same)
                   for i in range(4)]
        return measure(records, counters_of(metrics, stats if instance is not Instance.BASELINE else None), 32)

    rounds = (ServeRound(0, (Instance.OURS, Instance.BASELINE), measured(Instance.BASELINE), measured(Instance.OURS)),)
    report = ServeBenchReport(
        ServeBenchConfig(ServeWorkload(), Path("/models/tiny"), 4096, 131072), "t.jsonl", (352, 96),
        measured(Instance.BASELINE), measured(Instance.OURS, same=False), rounds, versus(rounds), Skipped("--no-pool"),
        Restart(Instance.OURS, 19.0, measured(Instance.OURS), ""), Skipped("--no-pool"), Skipped("--no-pool"), None, 8,
        False,
        {Instance.BASELINE: 20.0}, {}, 60.0)
    _print_serve(report)
    out = capsys.readouterr().out
    assert out.count("skipped") == 3 and "--no-pool" in out
    assert "host 38% disk 12%" in out  # 6 and 2 blocks of 32 tokens over 4 x 128 prompt tokens
    assert "NO (4)" in out and "some differ" in out
    assert "P/D handoff" not in out
    assert "connector CPU" not in out  # its connector exports no CPU counter: no line


def test_a_no_reuse_table_skips_the_later_parts_and_prints_the_ratios_and_the_connectors_cpu(capsys):
    from pathlib import Path

    from kvstrata.calibrate.serving.servers import Instance, ServeBenchConfig
    from dataclasses import replace

    from kvstrata.calibrate.serving.counters import ByteRates, ConnectorCpu, Counters
    from kvstrata.calibrate.serving.workload import ServeWorkload, WorkloadKind
    from kvstrata.bench.serve_report import ServeBenchReport, ServeRound, versus
    from kvstrata.calibrate.serving.measured import RequestRecord, measure
    from kvstrata.rounds import Skipped
    from kvstrata.bench.cli.serve import _print_serve

    def measured(instance: Instance, tpot_s: float):
        records = [RequestRecord(i, 0, instance, 128, (1, 2), 0.02, tpot_s, 0.03, 0.25 * i, identical=True)
                   for i in range(4)]
        return measure(records, Counters(), 32)

    base, ours = measured(Instance.BASELINE, 0.004), measured(Instance.OURS, 0.005)
    ours = replace(ours, connector_cpu_per_request=ConnectorCpu(0.00011, 0.00051, 2e6, 1e6))
    rounds = (ServeRound(0, (Instance.OURS, Instance.BASELINE), base, ours),)
    why = Skipped("--workload no-reuse")
    report = ServeBenchReport(
        ServeBenchConfig(ServeWorkload(kind=WorkloadKind.NO_REUSE), Path("/models/tiny"), 4096, 131072), "t.jsonl",
        (352, 96), base, ours, rounds, versus(rounds), why, why, why, why, None, 8, True, {}, {}, 60.0,
        ByteRates(10.0, 5.0))
    _print_serve(report)
    out = " ".join(capsys.readouterr().out.split())
    assert out.count("skipped") == 4 and out.count("--workload no-reuse") == 4
    assert "no reuse: every prompt new" in out and "Restart:" not in out
    assert "TTFT p50 1.00x (1.00-1.00), p90 1.00x (1.00-1.00), TPOT p50 1.25x (1.25-1.25)" in out
    assert "connector CPU per request: 0.62 ms (scheduler 0.11, worker 0.51)" in out
    # 2 MB copied at 10 GB/s (0.2 ms), 1 MB hashed at 5 GB/s (0.2 ms): 0.22 ms beyond
    assert "Beyond its bytes: 0.22 ms (2.00 MB copied, 1.00 MB of it hashed, 0.40 ms at this host's 10.0 GB/s" in out
