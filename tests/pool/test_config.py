"""Where a pool config came from travels with it (to read it again on reconnect), and the
budgets for waiting on a pool are refused in one line when they cannot work."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import stat

import pytest

from kvstrata.pool.config import DEFAULT_BUDGETS, PoolBudgets, PoolConfig, check_budgets, load_pool_config, make_secret, read_secret
from kvstrata.trust import Untrusted


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


def test_the_default_budgets_are_one_frozen_value_every_budget_taker_defaults_to():
    from dataclasses import FrozenInstanceError

    from kvstrata.cache.config import CacheConfig
    from kvstrata.pool.client import PoolClient
    from kvstrata.tiers.remote import RemoteTier

    assert DEFAULT_BUDGETS == PoolBudgets(op_timeout_s=1.0, connect_timeout_s=5.0, backoff_s=0.5, backoff_max_s=10.0)
    with pytest.raises(FrozenInstanceError):
        DEFAULT_BUDGETS.op_timeout_s = 2.0
    for taker in (PoolClient, RemoteTier):
        defaults = inspect.signature(taker).parameters
        assert PoolBudgets(*(defaults[name].default for name in BUDGET_NAMES)) == DEFAULT_BUDGETS
    defaults = {f.name: f.default for f in dataclasses.fields(CacheConfig)}
    assert PoolBudgets(*(defaults[name] for name in CACHE_BUDGET_NAMES)) == DEFAULT_BUDGETS
    with pytest.raises(ValueError, match="^pool budgets: backoff_max_s must be >= backoff_s"):
        PoolBudgets(backoff_s=2.0, backoff_max_s=1.0)


BUDGET_NAMES = ("op_timeout_s", "connect_timeout_s", "backoff_s", "backoff_max_s")
CACHE_BUDGET_NAMES = ("pool_timeout_s", "pool_connect_timeout_s", "pool_backoff_s", "pool_backoff_max_s")


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


KEY = "ab" * 32  # a deployment secret someone else knows


def planted_key(tmp_path, how: str):
    """A ``pool.key`` holding a valid secret that ``nobody`` planted: their own file, or a
    symlink to it."""
    import pwd

    theirs = tmp_path / "their.key"
    theirs.write_text(KEY + "\n")
    theirs.chmod(0o600)
    nobody = pwd.getpwnam("nobody")
    os.chown(theirs, nobody.pw_uid, nobody.pw_gid)
    if how == "owned":
        return theirs, theirs
    link = tmp_path / "pool.key"
    link.symlink_to(theirs)
    return link, theirs


@pytest.mark.skipif(os.geteuid() != 0, reason="handing a file to another user needs root")
@pytest.mark.parametrize(("how", "message"), [("owned", "is owned by nobody, not root"), ("symlink", "is a symlink")])
def test_a_secret_another_user_planted_is_neither_used_nor_written_through(tmp_path, how, message):
    path, theirs = planted_key(tmp_path, how)
    with pytest.raises(Untrusted, match=f"pool secret_file {path} {message}"):
        read_secret(PoolConfig(master="127.0.0.1:1", secret_file=str(path)))
    with pytest.raises(Untrusted, match=message):
        make_secret(path)  # the embedded pool's start: neither kept nor overwritten
    assert theirs.read_text() == KEY + "\n"


def test_a_secret_is_made_0600_and_kept_across_restarts(tmp_path):
    path = tmp_path / "pool.key"
    make_secret(path)
    made = path.read_text()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(bytes.fromhex(made.strip())) == 32
    make_secret(path)
    assert path.read_text() == made
