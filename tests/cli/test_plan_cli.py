"""``kvstrata plan`` through the real command-line entry point."""

from __future__ import annotations

import json

import pytest

from kvstrata.cli import main
from tests.config_support import TINY_LLAMA

PATHS = [
    "local DRAM -> HBM (CUDA copy)",
    "remote DRAM -> HBM (GPUDirect RDMA)",
    "remote DRAM -> local DRAM -> HBM (two hops)",
    "NVMe -> DRAM -> HBM",
]
SHORT_PATHS = ["DRAM -> HBM", "remote -> HBM (GDR)", "remote -> DRAM -> HBM", "NVMe -> DRAM -> HBM"]
ARCHS = ["hbm", "local-dram", "remote-gdr", "remote-staged", "pd-handoff", "dram-streaming", "nvme"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def plan_json(capsys, *argv):
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def plan_error(capsys, *argv):
    assert main(["plan", *argv]) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return captured.err


def strict(text):
    """Parse JSON as RFC 8259 says: no NaN or Infinity."""

    def refuse(constant):
        raise ValueError(f"non-standard JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


def test_bare_plan_json_uses_the_defaults(capsys):
    doc = plan_json(capsys)
    assert doc["model"] == "llama-3-70b"
    assert doc["hardware"] == "h200-cx7-gen5"
    assert doc["context_tokens"] == doc["cached_tokens"] == 32768
    assert doc["bytes_per_token"] == 2 * 80 * 8 * 128 * 2
    assert doc["gpus"] == ["gpu0", "gpu1", "gpu2", "gpu3"]
    assert doc["restore_bytes"] == 32768 * doc["bytes_per_token"]
    assert [r["path"] for r in doc["restore"]] == PATHS
    for r in doc["restore"]:
        assert {"path", "bottleneck", "gbps", "seconds"} <= r.keys()
        assert r["unavailable"] is None
        assert r["seconds"] > 0 and r["gbps"] > 0 and r["bottleneck"]
        # gbps is the restore's bytes over its time, end to end.
        assert r["gbps"] == pytest.approx(doc["restore_bytes"] / r["seconds"] / 1e9, rel=1e-9)
    assert [a["key"] for a in doc["architectures"]] == ARCHS
    assert "vs" not in doc


def test_json_marks_missing_paths_with_a_reason(capsys):
    doc = plan_json(capsys, "--model", "llama-3-8b", "--hardware", "workstation")
    by_path = {r["path"]: r for r in doc["restore"]}
    gdr = by_path[PATHS[1]]
    assert gdr["seconds"] is None and gdr["gbps"] is None and gdr["bottleneck"] is None
    assert "NIC" in gdr["unavailable"]
    assert by_path[PATHS[0]]["seconds"] > 0


def test_vs_upgrade_adds_the_other_plan_and_ratios(capsys):
    doc = plan_json(capsys, "--vs", "+cx8")
    vs = doc["vs"]
    assert vs["hardware"] == "h200-cx7-gen5+cx8"
    assert vs["gpus"] == doc["gpus"]  # same GPU count on both sides
    speedup = vs["ratios"]["restore_speedup"]
    assert set(speedup) == set(PATHS)
    assert 1 < speedup[PATHS[1]] <= 63 / 50
    assert speedup[PATHS[0]] == pytest.approx(1.0)
    mine = {r["path"]: r["seconds"] for r in doc["restore"]}
    theirs = {r["path"]: r["seconds"] for r in vs["restore"]}
    assert speedup[PATHS[1]] == pytest.approx(mine[PATHS[1]] / theirs[PATHS[1]])
    assert set(vs["ratios"]["first_wait_speedup"]) == set(ARCHS)


def test_vs_another_profile_by_name(capsys):
    doc = plan_json(capsys, "--vs", "b200-cx8-gen6", "--context", "8192")
    assert doc["vs"]["hardware"] == "b200-cx8-gen6"
    assert len(doc["vs"]["gpus"]) == len(doc["gpus"])


def test_plot_writes_a_png(tmp_path, capsys):
    out = tmp_path / "sub" / "x.png"
    assert main(["plan", "--context", "4096", "--plot", str(out)]) == 0
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC)
    assert len(data) > 1000
    assert str(out) in capsys.readouterr().out.replace("\n", "")


def test_plot_and_html_with_json_keep_stdout_json(tmp_path, capsys):
    png, page = tmp_path / "x.png", tmp_path / "x.html"
    assert main(["plan", "--context", "4096", "--json", "--plot", str(png), "--html", str(page)]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["context_tokens"] == 4096
    assert f"plot written to {png}" in out.err and f"report written to {page}" in out.err
    assert png.read_bytes().startswith(PNG_MAGIC)
    assert "h200-cx7-gen5" in page.read_text() and "data:image/png;base64," in page.read_text()


def test_human_output_names_every_path_and_architecture(capsys):
    assert main(["plan", "--context", "8192"]) == 0
    out = capsys.readouterr().out
    for name in SHORT_PATHS + ARCHS:
        assert name in out, name
    assert "llama-3-70b" in out and "h200-cx7-gen5" in out


def test_human_output_with_vs_shows_the_speedup_table(capsys):
    assert main(["plan", "--context", "8192", "--vs", "+cx8"]) == 0
    out = capsys.readouterr().out
    assert "speed-up" in out
    assert "h200-cx7-gen5+cx8" in out


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--model", "no-such-model"], "no-such-model"),
        (["--hardware", "no-such-box"], "no-such-box"),
        (["--vs", "+cx9"], "cx9"),
        (["--context", "0"], "context"),
        (["--cached", "99999"], "cached"),
        (["--gpus", "9"], "gpus"),
        (["--gpus", "3"], "3"),
        (["--dtype", "int3"], "int3"),
    ],
)
def test_bad_input_exits_2_naming_it(capsys, argv, named):
    assert named in plan_error(capsys, *argv)


def test_a_config_json_path_for_model(tmp_path, capsys):
    folder = tmp_path / "tiny-gqa"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    doc = plan_json(capsys, "--model", str(folder / "config.json"), "--context", "1000")
    assert doc["model"] == "tiny-gqa"
    head_dim = 256 // 4
    assert doc["bytes_per_token"] == 2 * 4 * 2 * head_dim * 2  # K+V, layers, KV heads, bf16
    assert doc["restore_bytes"] == 1000 * doc["bytes_per_token"]
    assert doc["gpus"] == ["gpu0"]  # a tiny model fits on one GPU


def test_plan_json_is_strict_json_with_nothing_cached(capsys):
    assert main(["plan", "--cached", "0", "--json"]) == 0
    doc = strict(capsys.readouterr().out)
    assert doc["restore_bytes"] == 0


def test_plan_json_is_strict_json_by_default(capsys):
    assert main(["plan", "--json", "--vs", "+cx8"]) == 0
    strict(capsys.readouterr().out)


def test_an_upgrade_alone_as_hardware_is_blamed_on_hardware(capsys):
    err = plan_error(capsys, "--hardware", "+cx8")
    assert "+cx8" in err
    assert "--hardware" in err


def test_weights_that_do_not_fit_are_said_once_before_the_tables(capsys):
    # llama-3-70b's 141.1 GB on one H200 (126.9 GB usable): the plan still shows restores.
    assert main(["plan", "--gpus", "1"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert out.count("do not fit") == 1
    assert out.index("do not fit") < out.index("KV restore per path")
    assert "llama-3-70b's 141.1 GB of bf16 weights do not fit on 1 x H200-SXM" in out
    assert "2 GPUs per instance would hold them" in out


def test_the_default_gpus_and_why_are_stated(capsys):
    assert main(["plan"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "4 GPU(s) per instance, the fewest leaving at least 50% of usable HBM for KV" in out
    assert "do not fit" not in out


def test_a_restore_over_several_nics_says_its_rate_is_their_sum(capsys):
    doc = plan_json(capsys)  # 4 GPUs, each behind its own CX-7
    gdr = next(r for r in doc["restore"] if r["path"] == PATHS[1])
    assert gdr["bottlenecks"] == 4 and "CX-7 port" in gdr["bottleneck"]
    assert main(["plan"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "│ remote -> HBM (GDR)" in line)
    assert f"{gdr['gbps']:,.1f}*" in row  # marked, and the note under the table says why
    note = next(line for line in out.splitlines() if line.startswith("* remote -> HBM (GDR)"))
    assert f"{gdr['gbps']:,.1f} GB/s over 4 links like {gdr['bottleneck']}, ~{gdr['gbps'] / 4:,.1f} each" in note
    # At 120 columns (piped) each path's name stays on one line (a staged path's second line
    # holds only its second stage).
    table = [line for line in out.splitlines() if line.startswith("│")]
    assert [line.split("│")[1].strip() for line in table if "->" in line.split("│")[1]] == SHORT_PATHS
    # One GPU, one NIC port: nothing to mark.
    assert main(["plan", "--gpus", "2", "--model", "llama-3-8b"]) == 0
    assert "over 2 links like CX-7 port" in capsys.readouterr().out
    assert main(["plan", "--gpus", "1", "--model", "llama-3-8b"]) == 0
    assert "links like" not in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--gpus", "3"], "--gpus 3: llama-3-70b's 8 KV heads do not split over 3 GPUs"),
        (["--gpus", "9"], "--gpus 9: 9 GPUs per instance, but the node has only 8 GPUs"),
        (["--gpus", "0"], "--gpus 0: an instance needs at least 1 GPU"),
        (["--context", "0"], "--context must be a positive number"),
        (["--cached", "99999"], "--cached must be between 0 and --context"),
        (["--gpus", "8", "--vs", "workstation"], "--vs workstation with --gpus 8: 8 GPUs per instance"),
    ],
)
def test_errors_name_the_flag_the_user_passed(capsys, argv, says):
    err = " ".join(plan_error(capsys, *argv).split())
    assert says in err
    assert "'tp'" not in err and "gpus=" not in err


def test_the_plan_says_which_weights_it_could_not_count(capsys):
    """gemma-3-27b's config sizes its text decoder but not its vision tower: the plan says the
    weight figure is a lower bound and why; a fully counted model says nothing of the kind."""
    assert plan_json(capsys, "--model", "gemma-3-27b", "--context", "8192")["weights_uncounted"] == ["vision_config"]
    assert main(["plan", "--model", "gemma-3-27b", "--context", "8192"]) == 0
    assert "a lower bound: assumed none in vision_config" in " ".join(capsys.readouterr().out.split())
    assert plan_json(capsys, "--model", "llama-3-8b", "--context", "8192")["weights_uncounted"] == []
