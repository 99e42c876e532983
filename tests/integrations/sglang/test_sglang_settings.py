"""The ``kvstrata_`` keys of SGLang's storage extra config: parsed into typed settings, or refused
in one line naming the key; and the cache config a rank's backend builds from them."""

from __future__ import annotations

from pathlib import Path

import pytest
from sglang_support import MHA

from kvstrata.integrations.sglang import StorageSettings
from kvstrata.integrations.sglang.pages import PoolGeometry
from kvstrata.policies.eviction import Eviction
from kvstrata.policies.write import WritePolicy, WriteRule
from kvstrata.pool.config import RemoteMode

LAYOUT = PoolGeometry("page_first", False, MHA.layers, MHA.page_size, MHA.heads, MHA.head_dim, MHA.dtype).kv_layout()


def test_sglang_keys_and_other_tools_keys_are_left_alone():
    extra = {"backend_name": "kvstrata", "module_path": "kvstrata.integrations.sglang",
             "class_name": "KVStrataHiCacheStorage", "interface_v1": 1, "file_storage_path": "/x"}
    assert StorageSettings.from_extra(extra) == StorageSettings() == StorageSettings.from_extra(None)


def test_values_become_their_types():
    settings = StorageSettings.from_extra({
        "kvstrata_disk_dir": "/nvme/kv", "kvstrata_disk_bytes": 2e9, "kvstrata_host_bytes": 1e9,
        "kvstrata_remote_bytes": 512.0, "kvstrata_write": "write-back", "kvstrata_eviction": "lfu",
        "kvstrata_remote_mode": "shm", "kvstrata_pool": "env", "kvstrata_model_id": "", "kvstrata_tenant": "t1",
        "kvstrata_workers": 4, "kvstrata_pool_timeout_s": 2.5,
    })
    assert settings == StorageSettings(disk_dir=Path("/nvme/kv"), disk_bytes=2_000_000_000, host_bytes=1_000_000_000,
                                       remote_bytes=512, write=WritePolicy.WRITE_BACK, eviction=Eviction.LFU,
                                       remote_mode=RemoteMode.SHM, pool="env", model_id=None, tenant="t1", workers=4,
                                       pool_timeout_s=2.5)


@pytest.mark.parametrize(("extra", "message"), [
    ({"kvstrata_disk_size": 1}, "unknown extra config ['kvstrata_disk_size']"),
    ({"kvstrata_disk_bytes": -1, "kvstrata_disk_dir": "/x"}, "kvstrata_disk_bytes must be a number of bytes >= 0"),
    ({"kvstrata_host_bytes": True}, "kvstrata_host_bytes must be a number of bytes"),
    ({"kvstrata_staging_pages": 256}, "unknown extra config ['kvstrata_staging_pages']"),  # pages are not staged
    ({"kvstrata_workers": 1.5}, "kvstrata_workers must be a number of threads"),
    ({"kvstrata_disk_bytes": 1 << 30}, "kvstrata_disk_bytes > 0 needs a kvstrata_disk_dir"),
    ({"kvstrata_disk_dir": 3}, "kvstrata_disk_dir must be a path"),
    ({"kvstrata_write": "later"}, "kvstrata_write must be one of ['write-through', 'write-back', 'selective']"),
    ({"kvstrata_remote_mode": "rdma"}, "kvstrata_remote_mode must be one of"),
    ({"kvstrata_tenant": 7}, "kvstrata_tenant must be a string"),
    ({"kvstrata_pool": 7}, "kvstrata_pool must be a non-empty string"),
    ({"kvstrata_pool_timeout_s": 0}, "pool_timeout_s"),
])
def test_a_bad_key_or_value_is_refused_in_one_line(extra, message):
    with pytest.raises(ValueError) as error:
        StorageSettings.from_extra(extra)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_the_pool_from_the_environment_must_be_there(monkeypatch):
    monkeypatch.delenv("KVSTRATA_POOL", raising=False)
    with pytest.raises(ValueError, match=r"kvstrata_pool='env' but \$KVSTRATA_POOL is not set"):
        StorageSettings(pool="env").pool_config()


def test_a_ranks_cache_config():
    settings = StorageSettings(disk_dir=Path("/d"), disk_bytes=1 << 30, host_bytes=1 << 28,
                               write=WritePolicy.SELECTIVE, selective_hits=3, tenant="t")
    config = settings.cache_config(LAYOUT, "org/model", tp_rank=1, tp_size=2, kv_group="pp1of2", disk_subdir="dp1")
    assert (config.device, config.device_bytes, config.host_bytes) == ("cpu", LAYOUT.block_bytes, 1 << 28)
    assert (config.disk_dir, config.disk_bytes, config.pool, config.remote_bytes) == (Path("/d/dp1"), 1 << 30, None, 0)
    assert config.write == WriteRule(WritePolicy.SELECTIVE, 3)
    namespace = config.namespace("t")
    assert (namespace.model_id, namespace.tp_rank, namespace.tp_size, namespace.kv_group, namespace.block_size) == \
           ("org/model", 1, 2, "pp1of2", MHA.page_size)
    assert StorageSettings(model_id="mine").cache_config(LAYOUT, "org/model", 0, 1, "", "").model_id == "mine"
    assert StorageSettings().cache_config(LAYOUT, "m", 0, 1, "", "dp1").disk_dir is None  # no disk tier
