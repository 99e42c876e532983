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
