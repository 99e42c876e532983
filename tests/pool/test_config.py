"""Where a pool config came from travels with it (to read it again on reconnect), and the
budgets for waiting on a pool are refused in one line when they cannot work."""

from __future__ import annotations

import json

import pytest

from kvstrata.pool.config import PoolConfig, check_budgets, load_pool_config


def test_a_config_read_from_a_file_remembers_the_file_but_not_in_its_identity_or_json(tmp_path):
    toml = tmp_path / "pool.toml"
    toml.write_text('[pool]\nmaster = "10.0.0.1:50051"\ndaemon = "127.0.0.1:50052"\n')
    state = tmp_path / "pool.json"
    state.write_text(json.dumps({"config": {"master": "10.0.0.1:50051", "daemon": "127.0.0.1:50052"}}))
    from_toml, from_state = load_pool_config(toml), load_pool_config(state)
    assert (from_toml.config_file, from_state.config_file) == (toml, state)
    plain = PoolConfig("10.0.0.1:50051", "127.0.0.1:50052")
    assert from_toml == from_state == plain and hash(from_toml) == hash(plain)  # the same pool
    assert from_toml.to_json() == plain.to_json() and "config_file" not in plain.to_json()


@pytest.mark.parametrize("text", ['[pool]\nmaster = "10.0.0.1:1"\nconfig_file = "/x"\n', "{half a file"])
def test_a_file_that_is_no_pool_config_is_refused_in_one_line(tmp_path, text):
    path = tmp_path / ("pool.toml" if "[pool]" in text else "pool.json")
    path.write_text(text)
    with pytest.raises(ValueError, match=str(path)):
        load_pool_config(path)


@pytest.mark.parametrize(("seconds", "message"), [
    ({"op_timeout_s": 0}, "op_timeout_s must be a number of seconds > 0, got 0"),
    ({"op_timeout_s": True}, "op_timeout_s must be a number of seconds > 0"),
    ({"op_timeout_s": "1"}, "op_timeout_s must be a number of seconds > 0"),
    ({"op_timeout_s": float("inf")}, "op_timeout_s must be a number of seconds > 0"),
    ({"backoff_s": 2.0, "backoff_max_s": 1.0}, "backoff_max_s must be >= backoff_s, got 1.0 < 2.0"),
])
def test_budgets_that_cannot_work_are_refused_in_one_line(seconds, message):
    with pytest.raises(ValueError, match=f"^pool client: {message}"):
        check_budgets("pool client:", **seconds)


def test_segments_round_trip_through_toml_json_and_the_state_file(tmp_path):
    segments = ("10.0.0.2:17001", "10.0.0.3:17001")
    toml = tmp_path / "pool.toml"
    toml.write_text('[pool]\nmaster = "10.0.0.1:50051"\nsegments = ["10.0.0.2:17001", "10.0.0.3:17001"]\n')
    from_toml = load_pool_config(toml)
    assert from_toml.segments == segments  # a tuple: the config stays hashable
    assert from_toml.to_json()["segments"] == list(segments)
    state = tmp_path / "pool.json"
    state.write_text(json.dumps({"config": from_toml.to_json()}))
    from_state = load_pool_config(state)
    assert from_state == from_toml == PoolConfig("10.0.0.1:50051", segments=segments)
    assert hash(from_state) == hash(from_toml) != hash(PoolConfig("10.0.0.1:50051"))  # part of the pool's identity
    assert PoolConfig("10.0.0.1:50051").to_json()["segments"] == []


@pytest.mark.parametrize(("segments", "message"), [
    (["10.0.0.2"], "pool segments must each be host:port, got '10.0.0.2'"),
    (["10.0.0.2:1", ":2"], "pool segments must each be host:port, got ':2'"),
    ("10.0.0.2:1", "pool segments must be a list of host:port, got '10.0.0.2:1'"),
    (["10.0.0.2:1", "10.0.0.2:1"], "pool segments must name each segment once"),
])
def test_segments_that_are_not_host_port_are_refused_in_one_line(segments, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        PoolConfig("10.0.0.1:50051", segments=segments)
