"""The vLLM connector's extra config: parsed into typed settings at the edge, each bad key or
value refused in one line that names it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvstrata.integrations.vllm import ConnectorSettings, KVSharing  # noqa: E402
from kvstrata.kv.geometry import DType  # noqa: E402
from kvstrata.kv.layout import KVLayout  # noqa: E402
from kvstrata.policies.write import WritePolicy  # noqa: E402
from kvstrata.pool.config import RemoteMode  # noqa: E402
from kvstrata.transfer.placement import io_cpus_for  # noqa: E402

MiB = 1024**2


def test_no_extra_config_is_every_default():
    assert ConnectorSettings.from_extra(None) == ConnectorSettings.from_extra({}) == ConnectorSettings()


def test_json_values_become_typed_settings():
    s = ConnectorSettings.from_extra({
        "disk_dir": "/var/kv", "disk_bytes": 8e9, "remote_mode": "shm", "stats_path": "/tmp/s.json",
        "model_id": "m", "sync_save": False,
    })
    assert s.disk_dir == Path("/var/kv") and s.stats_path == Path("/tmp/s.json")
    assert s.disk_bytes == 8_000_000_000 and isinstance(s.disk_bytes, int)
    assert s.remote_mode is RemoteMode.SHM
    assert (s.model_id, s.sync_save) == ("m", False)
    assert s.kv_sharing is KVSharing.SLICED  # the default: any TP size reads the blocks
    assert ConnectorSettings.from_extra({"kv_sharing": "tp-matched"}).kv_sharing is KVSharing.MATCHED
    assert ConnectorSettings().load_budget == 2.0 and ConnectorSettings.from_extra({"load_budget": None}).load_budget is None


def test_saves_never_wait_by_default_and_io_threads_leave_the_compute_cpus(monkeypatch):
    assert io_cpus_for(ConnectorSettings().io_cpus) is None  # by default: where vLLM puts them
    s = ConnectorSettings.from_extra({"io_cpus": "auto"})
    assert ConnectorSettings().sync_save is False and s.save_backlog_bytes > 0
    assert io_cpus_for(ConnectorSettings.from_extra({"io_cpus": "4-5,7"}).io_cpus) == frozenset({4, 5, 7})
    mine = frozenset(os.sched_getaffinity(0)) | frozenset(os.sched_getaffinity(os.getppid()))
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{min(mine)}")
    assert io_cpus_for(s.io_cpus) == ((mine - {min(mine)}) or None)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(c) for c in sorted(mine)))  # every CPU computes
    assert io_cpus_for(s.io_cpus) is None


def test_empty_strings_mean_not_given():
    s = ConnectorSettings.from_extra({"disk_dir": "", "stats_path": "", "model_id": ""})
    assert (s.disk_dir, s.stats_path, s.model_id) == (None, None, None)


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"hostbytes": 1}, "unknown extra config \\['hostbytes'\\]"),
        ({"remote_mode": "rdma"}, "remote_mode must be one of \\['tcp', 'shm'\\], got 'rdma'"),
        ({"host_bytes": "1GB"}, "host_bytes must be a number of bytes >= 0, got '1GB'"),
        ({"device_bytes": -1}, "device_bytes must be a number of bytes >= 0"),
        ({"remote_bytes": 1.5}, "remote_bytes must be a number of bytes"),
        ({"disk_bytes": True}, "disk_bytes must be a number of bytes"),
        ({"disk_dir": 5}, "disk_dir must be a path, got 5"),
        ({"pool": ""}, "pool must be a non-empty string"),
        ({"sync_save": "yes"}, "sync_save must be true or false"),
        ({"kv_sharing": "sliced"}, "kv_sharing must be one of \\['tp-matched', 'head-sliced'\\], got 'sliced'"),
        ({"pool_timeout_s": 0}, "pool_timeout_s must be a number of seconds > 0, got 0"),
        ({"pool_backoff_s": 5, "pool_backoff_max_s": 1}, "pool_backoff_max_s must be >= pool_backoff_s, got 1 < 5"),
        ({"disk_read_gbps": 0}, "disk_read_gbps must be a positive number of GB/s, got 0"),
        ({"disk_read_gbps": "fast"}, "disk_read_gbps must be a positive number of GB/s, got 'fast'"),
        ({"io_cpus": "3-1"}, "io_cpus must be \"auto\", \"none\" or a CPU list such as \"6-7\", got '3-1'"),
        ({"io_cpus": 2}, "io_cpus must be"),
        ({"save_backlog_bytes": -5}, "save_backlog_bytes must be a number of bytes >= 0"),
        ({"load_budget": 0}, "load_budget must be a number > 0 \\(times the prefill\\) or null, got 0"),
        ({"load_budget": "2x"}, "load_budget must be a number > 0"),
        ({"write": "back"}, "write must be one of \\['write-through', 'write-back', 'selective'\\], got 'back'"),
        ({"write_back_flush_s": -1}, "write_back_flush_s must be a number of seconds >= 0, got -1"),
    ],
)
def test_a_bad_key_or_value_is_one_line_naming_it(extra, named):
    with pytest.raises(ValueError, match=f"^KVStrataConnector: {named}") as info:
        ConnectorSettings.from_extra(extra)
    assert "\n" not in str(info.value)


def test_the_cache_config_carries_the_settings(tmp_path):
    layout = KVLayout(4, 32, 2, 64, DType.BF16, name="vllm-cpu opaque")
    s = ConnectorSettings.from_extra({"host_bytes": 16 * MiB, "disk_dir": str(tmp_path), "disk_bytes": 64 * MiB})
    config = s.cache_config(layout, "vllm-model", "cpu", tp_rank=1, tp_size=2)
    assert (config.model_id, config.host_bytes, config.disk_bytes) == ("vllm-model", 16 * MiB, 64 * MiB)
    assert config.disk_dir == tmp_path / "rank1" and config.pool is None  # a rank is a process: a directory each
    assert s.cache_config(layout, "vllm-model", "cpu", tp_rank=0, tp_size=2).disk_dir == tmp_path
    assert (config.layout, config.device, config.tp_rank, config.tp_size) == (layout, "cpu", 1, 2)
    assert config.remote_mode is RemoteMode.TCP
    named = ConnectorSettings(model_id="mine").cache_config(layout, "vllm-model", "cpu", 0, 1)
    assert named.model_id == "mine"
    budgets = {"pool_timeout_s": 0.25, "pool_connect_timeout_s": 2, "pool_backoff_s": 0.1, "pool_backoff_max_s": 3.0}
    config = ConnectorSettings.from_extra(budgets).cache_config(layout, "vllm-model", "cpu", 0, 1)
    assert {name: getattr(config, name) for name in budgets} == budgets
    assert config.disk_read_gbps is None
    slow = ConnectorSettings.from_extra({"disk_read_gbps": 0.2, "disk_dir": str(tmp_path), "disk_bytes": MiB})
    assert slow.cache_config(layout, "vllm-model", "cpu", 0, 1).disk_read_gbps == 0.2  # the disk tier's read cap


def test_blocks_go_below_the_host_on_eviction_unless_a_tp_matched_pool_shares_them(tmp_path):
    """Write-back by default: a block served from the host never costs a disk write. Other
    instances read a TP-matched cache's pool at once, so it writes through; head-sliced slices
    have a cache of their own, written through (``rank_configs``), so the packs write back."""
    layout = KVLayout(4, 32, 2, 64, DType.BF16, name="vllm-cpu opaque")
    assert ConnectorSettings().write_policy is WritePolicy.WRITE_BACK
    assert ConnectorSettings(pool="/p.json").write_policy is WritePolicy.WRITE_BACK  # head-sliced
    assert ConnectorSettings(pool="/p.json", kv_sharing=KVSharing.MATCHED).write_policy is WritePolicy.WRITE_THROUGH
    chosen = ConnectorSettings.from_extra({"write": "write-through", "write_back_flush_s": 2.5})
    config = chosen.cache_config(layout, "vllm-model", "cpu", 0, 1)
    assert (config.write.policy, config.write_back_flush_s) == (WritePolicy.WRITE_THROUGH, 2.5)
    assert ConnectorSettings().cache_config(layout, "m", "cpu", 0, 1).write.policy is WritePolicy.WRITE_BACK


def test_a_pool_from_an_unset_environment_is_refused(monkeypatch):
    monkeypatch.delenv("KVSTRATA_POOL", raising=False)
    with pytest.raises(ValueError, match="pool='env' but \\$KVSTRATA_POOL is not set"):
        ConnectorSettings.from_extra({"pool": "env"}).pool_config()


def test_a_stop_that_would_lose_the_host_tier_is_said_once_where_it_would():
    """vLLM's default stop (``--shutdown-timeout 0``) kills the workers before a write-back host
    tier goes down to disk: said for such a server, not where nothing would be lost."""
    disk = ConnectorSettings(disk_dir=Path("/d"), disk_bytes=1 << 30)
    said = disk.stop_loses_host(0)
    assert said is not None and "--shutdown-timeout 10" in said and "\n" not in said
    assert disk.stop_loses_host(10) is None  # given time, the cache closes and writes down
    assert ConnectorSettings().stop_loses_host(0) is None  # no disk: nothing to write down
    assert ConnectorSettings(disk_dir=Path("/d"), disk_bytes=1 << 30,
                             write=WritePolicy.WRITE_THROUGH).stop_loses_host(0) is None  # already down
