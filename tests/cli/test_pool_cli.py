"""``kvstrata pool``: sizes in decimal units, a readable status, and file errors that name the file."""

from __future__ import annotations

import importlib.util
import json

import pytest

from kvstrata.cli import build_parser, main
from kvstrata.pool import embedded

needs_pool = pytest.mark.skipif(importlib.util.find_spec("mooncake") is None, reason="the pool engine is not installed")


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")


def segment_size(*argv: str) -> int:
    return build_parser().parse_args(["pool", "start", *argv]).segment_size


def test_segment_size_gb_is_decimal_and_gib_binary():
    assert segment_size("--segment-size", "2GB") == 2_000_000_000
    assert segment_size("--segment-size", "2GiB") == 2 * 2**30
    assert segment_size() == 2_000_000_000  # the default, "2GB" in --help, is decimal too


def test_a_bad_segment_size_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["pool", "start", "--segment-size", "2XB"])
    assert exc.value.code == 2
    assert "--segment-size: not a size: '2XB'" in capsys.readouterr().err


def test_status_of_no_pool_says_so_in_one_line(capsys, tmp_path):
    assert main(["pool", "status", "--dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert out.strip() == f"not running: no embedded pool started in {tmp_path}"


def test_status_of_a_configured_pool_that_does_not_answer_is_a_table(capsys, tmp_path):
    config = tmp_path / "pool.toml"
    port = embedded.free_port()  # nothing listens there
    config.write_text(f'[pool]\nmaster = "127.0.0.1:{port}"\ndaemon = "127.0.0.1:{port}"\n')
    assert main(["pool", "status", "--config", str(config)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"pool not running (configured by {config})"
    assert lines[1].split() == ["process", "address", "pid", "answers"]
    assert lines[2].split() == ["master", f"127.0.0.1:{port}", "-", "no"]
    assert lines[3].split() == ["daemon", f"127.0.0.1:{port}", "-", "no"]
    assert lines[4] == "protocol: tcp, metadata: P2PHANDSHAKE, secret: none (values not sealed nor encrypted)"
    assert not any("{" in line for line in lines)  # no Python dict


@pytest.mark.pool  # starts a pool
@needs_pool
def test_start_and_status_print_decimal_sizes_and_a_table(capsys, tmp_path):
    run_dir = tmp_path / "pool"
    assert main(["pool", "start", "--segment-size", "64MB", "--dir", str(run_dir)]) == 0
    try:
        started = capsys.readouterr().out
        assert "64 MB segment" in started and "GiB" not in started
        assert main(["pool", "status", "--dir", str(run_dir)]) == 0
        out = capsys.readouterr().out
        state = json.loads((run_dir / embedded.STATE).read_text())
        assert state["segment_bytes"] == 64_000_000
        assert f"pool running (embedded, run directory {run_dir})" in out
        for name in ("master", "daemon"):
            row = next(line for line in out.splitlines() if line.startswith(name))
            assert row.split() == [name, state["config"][name], str(state[f"{name}_pid"]), "yes"]
        assert "segment: 64 MB (64000000 bytes)" in out
        assert f"use it with KVSTRATA_POOL={run_dir / embedded.STATE}" in out
        assert "{" not in out
        assert main(["pool", "status", "--dir", str(run_dir), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["segment_bytes"] == 64_000_000
    finally:
        embedded.stop(run_dir)


@pytest.mark.pool  # starts a pool
@pytest.mark.parametrize("choice", ["host", "auto"])
def test_start_says_which_network_the_pool_listens_in_and_status_says_it_again(capsys, tmp_path, choice):
    from kvstrata.pool import network as netns

    run_dir = tmp_path / "pool"
    assert main(["pool", "start", "--segment-size", "64MB", "--dir", str(run_dir), "--network", choice]) == 0
    try:
        started = " ".join(capsys.readouterr().out.split())
        private = choice == "auto" and netns.unavailable() is None  # auto: private where it can be
        network = json.loads((run_dir / embedded.STATE).read_text())["config"]["network"]
        assert network == (netns.name_for_user() if private else None)
        assert (f"in network namespace {network}" if private else "on the host's loopback") in started
        assert main(["pool", "status", "--dir", str(run_dir)]) == 0
        out = " ".join(capsys.readouterr().out.split())
        assert (f"network: namespace {network} (root only)" if private else "network: the host's loopback") in out
    finally:
        embedded.stop(run_dir)


@pytest.mark.pool  # starts a pool
def test_metrics_are_the_masters_own_fetched_from_inside_its_network(capsys, tmp_path):
    run_dir = tmp_path / "pool"
    assert main(["pool", "metrics", "--dir", str(run_dir)]) == 1
    assert f"no embedded pool started in {run_dir}" in capsys.readouterr().err
    assert main(["pool", "start", "--segment-size", "64MB", "--dir", str(run_dir)]) == 0
    try:
        capsys.readouterr()
        assert main(["pool", "metrics", "--dir", str(run_dir)]) == 0
        out = capsys.readouterr().out
        capacity = next(line for line in out.splitlines() if line.startswith("master_total_capacity_bytes"))
        assert float(capacity.split()[-1]) == 64_000_000  # the daemon's segment, as the master counts it
    finally:
        embedded.stop(run_dir)


def test_a_network_that_is_no_choice_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["pool", "start", "--network", "everywhere"])
    assert "invalid choice: 'everywhere'" in capsys.readouterr().err


def run_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return " ".join(err.split())  # rich folds long lines


@pytest.mark.parametrize(
    ("name", "text", "why"),
    [
        ("bad.json", "{bad", "invalid JSON (Expecting property name"),
        ("empty.json", "", "invalid JSON"),
        ("other.json", '{"segment_bytes": 1}', "no 'config' entry"),
        ("number.json", '{"config": {"master": 5}}', "pool master must be host:port, got 5"),
        ("bad.toml", "master = [", "invalid TOML"),
        ("unknown.toml", '[pool]\nmaster = "127.0.0.1:1"\nmastr = 2\n', "unknown pool setting(s) ['mastr']"),
    ],
)
def test_a_bad_config_file_is_named_in_the_error(capsys, tmp_path, name, text, why):
    path = tmp_path / name
    path.write_text(text)
    err = run_error(capsys, "pool", "status", "--config", str(path))
    assert f"{path}:" in err and why in err


def test_a_bad_state_file_in_the_run_directory_is_named(capsys, tmp_path):
    (tmp_path / embedded.STATE).write_text("{half a file")
    for action in ("status", "start", "stop"):
        err = run_error(capsys, "pool", action, "--dir", str(tmp_path))
        assert f"{tmp_path / embedded.STATE}: not a pool state file: invalid JSON" in err


def test_a_bad_pool_file_in_the_environment_is_named(capsys, tmp_path, monkeypatch):
    path = tmp_path / "pool.json"
    path.write_text("[]")
    monkeypatch.setenv("KVSTRATA_POOL", str(path))
    from kvstrata.pool.config import pool_from_env

    with pytest.raises(ValueError, match=f"{path}: not a pool state file"):
        pool_from_env()


@pytest.mark.parametrize(("text", "why"), [("{half a file", "invalid JSON"),
                                           ('{"token": "ab"}', "its token is not 32 hex digits")])
def test_a_bad_start_record_in_the_run_directory_is_named(capsys, tmp_path, text, why):
    (tmp_path / embedded.STARTING).write_text(text)
    for action in ("start", "stop"):  # refused before a process starts or is signalled
        err = run_error(capsys, "pool", action, "--dir", str(tmp_path))
        assert f"{tmp_path / embedded.STARTING}: not a pool start record: {why}" in err
