"""The conformance suite of a HiCache storage backend, against kvstrata's: SGLang's real host
pools, its storage factory (the dynamic loader) and its controller's own backup and prefetch,
on both interfaces (zero-copy v1, generic flat pages), every host layout, MHA and MLA, with the
disk tier and with the pool."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from sglang_support import LAYOUTS, MHA, MLA, PAGE, SHAPES, block_files, page_kv, pages_kv, same_pages

from kvstrata.integrations.sglang import KVStrataHiCacheStorage, harness
from kvstrata.kv.layout import KVLayout
from kvstrata.kv.presets import load_geometry
from kvstrata.media import Medium
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageExtraInfo
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
from sglang.srt.mem_cache.pool_host.mla import MLAHostAllocation, MLATokenToKVPoolHost

N = 8  # pages a test stores


def stored_pages(make, host, tier: dict, *, v1: bool = True, seed: int = 0, **kwargs):
    """A backend that backed up N random pages of ``host`` through SGLang's controller: the
    backend, the pages' keys and host indices."""
    backend = make(host, v1=v1, **tier, **kwargs)
    src, keys = harness.fill_pages(host, N, seed), harness.page_keys(N, PAGE, seed)
    assert harness.Controller(backend, host, v1).backup(keys, src) == N * PAGE
    return backend, keys, src


@pytest.mark.parametrize("v1", [True, False], ids=["v1", "generic"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_pages_backed_up_come_back_byte_for_byte_from_the_tier(backends, tier, kind, layout, v1):
    host = harness.host_pool(SHAPES[kind], layout, 4 * N)
    backend, keys, src = stored_pages(backends, host, tier, v1=v1)
    assert isinstance(backend, KVStrataHiCacheStorage) and isinstance(backend, HiCacheStorage)
    backend.close()  # a second backend reads what the first left in the tier
    again = backends(host, v1=v1, **tier)
    assert again.batch_exists(keys, HiCacheStorageExtraInfo()) == N
    dst = harness.zero_pages(host, N)
    assert harness.Controller(again, host, v1).prefetch(keys, dst) == N
    assert same_pages(host, src, host, dst)


@pytest.mark.parametrize("v1", [True, False], ids=["v1", "generic"])
def test_a_page_missing_mid_run_ends_the_run(backends, tmp_path, v1):
    host = harness.host_pool(MHA, "page_first", 4 * N)
    backend = backends(host, v1=v1, disk_dir=str(tmp_path), disk_bytes=1 << 24)
    src, keys = harness.fill_pages(host, N), harness.page_keys(N, PAGE)
    skip = [i for i in range(N) if i != 3]  # every page but page 3
    assert backend.batch_set_v1([keys[i] for i in skip], torch.cat([src[i * PAGE:(i + 1) * PAGE] for i in skip]))
    assert backend.batch_exists(keys) == 3
    assert backend.batch_exists(keys[4:]) == N - 4
    assert [backend.exists(k) for k in keys] == [i != 3 for i in range(N)]
    dst = harness.zero_pages(host, N)
    assert backend.batch_get_v1(keys, dst) == [True] * 3 + [False] * (N - 3)
    got = backend.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys])
    assert [page is not None for page in got] == [True] * 3 + [False] * (N - 3)
    assert harness.Controller(backend, host, v1).prefetch(keys, dst) == 3
    assert same_pages(host, src[: 3 * PAGE], host, dst[: 3 * PAGE])
    assert all(not page.any() for page in pages_kv(host, dst[3 * PAGE:]))  # left as they were


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_keys_never_stored_are_misses_everywhere(backends, tier, kind):
    host = harness.host_pool(SHAPES[kind], "page_first", 2 * N)
    backend = backends(host, **tier)
    keys = harness.page_keys(N, PAGE, seed=5)
    dst = harness.fill_pages(host, N, seed=9)
    before = pages_kv(host, dst)
    assert backend.batch_exists(keys) == 0 and not backend.exists(keys[0])
    assert backend.batch_get_v1(keys, dst) == [False] * N
    assert backend.get(keys[0], host.get_dummy_flat_data_page()) is None and backend.get(keys[0]) is None
    assert backend.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys]) == [None] * N
    assert harness.Controller(backend, host, True).prefetch(keys, dst) == 0
    assert all(torch.equal(a, b) for a, b in zip(before, pages_kv(host, dst)))


@pytest.mark.parametrize("v1", [True, False], ids=["v1", "generic"])
def test_setting_a_stored_key_succeeds_and_keeps_the_stored_page(backends, tier, tmp_path, v1):
    host = harness.host_pool(MHA, "layer_first", 4 * N)
    backend, keys, src = stored_pages(backends, host, tier, v1=v1)
    files = {p: os.stat(p) for p in block_files(tmp_path)}
    other = harness.fill_pages(host, N, seed=1)  # other bytes, the same keys
    if v1:
        assert backend.batch_set_v1(keys, other) == [True] * N
    else:
        assert backend.set(keys[0], host.get_data_page(int(other[0]))) is True
        assert backend.batch_set(keys, [host.get_data_page(int(s)) for s in other[::PAGE].tolist()]) is True
    assert {p: (s.st_ino, s.st_mtime_ns) for p, s in files.items()} == \
           {p: (s.st_ino, s.st_mtime_ns) for p, s in ((p, os.stat(p)) for p in block_files(tmp_path))}
    backend.close()
    dst = harness.zero_pages(host, N)
    assert harness.Controller(backends(host, v1=v1, **tier), host, v1).prefetch(keys, dst) == N
    assert same_pages(host, src, host, dst)


def test_clear_drops_every_page_from_every_tier(backends, tier, tmp_path):
    host = harness.host_pool(MLA, "page_first", 2 * N)
    backend, keys, _ = stored_pages(backends, host, tier)
    backend.clear()
    assert backend.batch_exists(keys) == 0
    assert block_files(tmp_path) == []
    backend.close()
    assert backends(host, **tier).batch_exists(keys) == 0  # gone from the tier (the pool: for every instance)


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("source_layout", LAYOUTS)
def test_pages_load_into_another_host_pool_of_the_same_order_and_never_into_another(backends, tmp_path, kind,
                                                                                   source_layout):
    """A page is stored in its flat page's order: layer_first and page_first_direct share theirs
    (and so their pages); page_first's is its own namespace, a miss for the others, never garbage."""
    disk = {"disk_dir": str(tmp_path), "disk_bytes": 1 << 24}
    source = harness.host_pool(SHAPES[kind], source_layout, 2 * N)
    backend, keys, src = stored_pages(backends, source, disk)
    backend.close()
    for layout in LAYOUTS:
        same_order = (layout == "page_first") == (source_layout == "page_first")
        for v1 in (True, False):
            host = harness.host_pool(SHAPES[kind], layout, 3 * N)
            harness.fill_pages(host, N // 2, seed=3)  # other slots than the source's
            dst = harness.zero_pages(host, N)
            reader = backends(host, v1=v1, **disk)
            assert harness.Controller(reader, host, v1).prefetch(keys, dst) == (N if same_order else 0), (layout, v1)
            if same_order:
                assert same_pages(source, src, host, dst), (layout, v1)
            reader.close()


@pytest.mark.parametrize("v1", [True, False], ids=["v1", "generic"])
def test_a_page_corrupted_on_disk_is_a_miss_and_the_prefix_stops_there(backends, tmp_path, v1):
    disk = {"disk_dir": str(tmp_path), "disk_bytes": 1 << 24}
    host = harness.host_pool(MLA, "page_first_direct", 4 * N)
    backend, keys, src = stored_pages(backends, host, disk, v1=v1)
    page3 = backend.block_keys([keys[3]])[0].hex() + ".kvb"
    backend.close()
    (path,) = [p for p in block_files(tmp_path) if p.name == page3]
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # a bit of its payload's last layer
    path.write_bytes(bytes(data))
    reader = backends(host, v1=v1, **disk)
    dst = harness.zero_pages(host, N)
    # pages are read in place, in parallel: those from the corrupt one on are not served (SGLang
    # frees them), whatever bytes reached them
    assert harness.Controller(reader, host, v1).prefetch(keys, dst) == 3
    assert same_pages(host, src[: 3 * PAGE], host, dst[: 3 * PAGE])
    assert reader.batch_exists(keys) == 3  # the corrupt copy is dropped


def test_a_page_file_gone_from_disk_is_a_miss(backends, tmp_path):
    disk = {"disk_dir": str(tmp_path), "disk_bytes": 1 << 24}
    host = harness.host_pool(MHA, "page_first", 4 * N)
    backend, keys, src = stored_pages(backends, host, disk)
    page2 = backend.block_keys([keys[2]])[0].hex() + ".kvb"
    (path,) = [p for p in block_files(tmp_path) if p.name == page2]
    path.unlink()
    dst = harness.zero_pages(host, N)
    assert backend.batch_get_v1(keys, dst) == [True] * 2 + [False] * (N - 2)
    assert same_pages(host, src[: 2 * PAGE], host, dst[: 2 * PAGE])
    assert backend.batch_exists(keys) == 2


@pytest.mark.parametrize("layouts", [("page_first", "page_first"), ("layer_first", "page_first_direct")])
def test_mla_pages_are_stored_once_for_every_tp_rank(backends, pool_file, tmp_path, layouts):
    pool = {"pool": pool_file, "remote_bytes": 1 << 22}
    hosts = [harness.host_pool(MLA, layout, 4 * N) for layout in layouts]
    ranks = [backends(hosts[r], tp_rank=r, tp_size=2, disk_dir=str(tmp_path), disk_bytes=1 << 24, **pool)
             for r in (0, 1)]
    assert [b.storage_config.is_storage_writer for b in ranks] == [True, False]
    src, keys = harness.fill_pages(hosts[0], N), harness.page_keys(N, PAGE)
    assert harness.Controller(ranks[0], hosts[0], True).backup(keys, src) == N * PAGE
    assert ranks[1].batch_exists(keys) == N  # rank 0's copy, found in the pool
    dst = harness.zero_pages(hosts[1], N)
    assert harness.Controller(ranks[1], hosts[1], True).prefetch(keys, dst) == N
    assert same_pages(hosts[0], src, hosts[1], dst)
    # a non-writer rank stores nothing (SGLang's controller does not even ask it)
    more, more_keys = harness.fill_pages(hosts[1], 2, seed=4), harness.page_keys(2, PAGE, seed=4)
    assert ranks[1].batch_set_v1(more_keys, more) == [True, True]
    assert ranks[0].batch_exists(more_keys) == 0 and ranks[1].batch_exists(more_keys) == 0


def test_mha_tp_ranks_keep_their_own_pages(backends, pool_file):
    pool = {"pool": pool_file, "remote_bytes": 1 << 22}
    hosts = [harness.host_pool(MHA, "page_first", 2 * N) for _ in range(2)]
    ranks = [backends(hosts[r], tp_rank=r, tp_size=2, **pool) for r in (0, 1)]
    src, keys = harness.fill_pages(hosts[0], N), harness.page_keys(N, PAGE)
    assert ranks[0].batch_set_v1(keys, src) == [True] * N
    assert ranks[0].batch_exists(keys) == N and ranks[1].batch_exists(keys) == 0


def test_mla_at_tp_above_one_without_the_pool_is_refused_in_one_line(backends, tmp_path):
    host = harness.host_pool(MLA, "page_first", N)
    with pytest.raises(ValueError, match="MLA at TP=2 needs kvstrata_pool") as error:
        backends(host, tp_rank=1, tp_size=2, disk_dir=str(tmp_path), disk_bytes=1 << 24)
    assert "\n" not in str(error.value)


def _mla_dcp() -> dict:
    return {"dcp_size": 2, "dcp_rank": 0, "logical_page_size": 2 * PAGE}


@pytest.mark.parametrize(("shape", "layout", "kwargs", "message"), [
    (MHA, "page_first", {"fields": {"should_split_heads": True}}, "should_split_heads"),
    (MHA, "page_first", {"fields": {"attn_cp_size": 2}}, "attention context parallel"),
    (MLA, "page_first", {"tp_size": 2, "fields": _mla_dcp()}, "decode context parallel"),
    (MHA, "page_head", {}, "host layout 'page_head' is not supported"),
    (harness.HostShape.mha(3, 2, 8, PAGE, torch.float8_e4m3fn), "page_first", {}, "uint8"),
    (MHA, "page_first", {"model_name": None}, "set kvstrata_model_id"),
    (MHA, "page_first", {"disk_size": 1}, "unknown extra config ['kvstrata_disk_size']"),
    (MHA, "page_first", {"disk_bytes": -1, "disk_dir": "/tmp/x"}, "kvstrata_disk_bytes must be"),
    (MHA, "page_first", {"write": "sometimes"}, "kvstrata_write must be one of"),
], ids=["split-heads", "attn-cp", "dcp", "page-head", "fp8-as-uint8", "no-model", "unknown-key", "bad-bytes",
        "bad-policy"])
def test_what_kvstrata_does_not_serve_is_refused_in_one_line(backends, shape, layout, kwargs, message):
    host = harness.host_pool(shape, layout, N)
    with pytest.raises(ValueError) as error:
        backends(host, **kwargs)
    assert message in str(error.value) and "\n" not in str(error.value)
    assert str(error.value).startswith("KVStrataHiCacheStorage:")


@pytest.mark.parametrize("v1", [True, False], ids=["v1", "generic"])
def test_storage_metrics_are_the_batches_since_the_last_read(backends, tmp_path, v1):
    host = harness.host_pool(MHA, "page_first", 4 * N)
    disk = {"disk_dir": str(tmp_path), "disk_bytes": 1 << 24}
    assert backends(host, **disk, v1=v1).get_stats() is None  # without --enable-hicache-storage-metrics
    backend = backends(host, **{**disk, "disk_dir": str(tmp_path / "m")}, v1=v1, metrics=True)
    src, keys = harness.fill_pages(host, N), harness.page_keys(N, PAGE)
    controller = harness.Controller(backend, host, v1)
    controller.backup(keys, src)
    controller.backup(keys, src)  # all stored already: nothing to record
    controller.prefetch(keys, harness.zero_pages(host, N))
    stats = backend.get_stats()
    assert stats.backup_pgs == [N] and stats.prefetch_pgs == [N]
    assert stats.backup_bandwidth[0] > 0 and stats.prefetch_bandwidth[0] > 0
    assert backend.get_stats().backup_pgs == []


def test_a_prefetch_and_a_backup_of_full_batches_run_at_once(backends, tmp_path):
    batch = 128  # SGLang's STORAGE_BATCH_SIZE: what its prefetch and backup threads hand over at once
    host = harness.host_pool(MHA, "page_first", 4 * batch)
    backend = backends(host, disk_dir=str(tmp_path), disk_bytes=1 << 24)
    first, first_keys = harness.fill_pages(host, batch, 1), harness.page_keys(batch, PAGE, 1)
    assert backend.batch_set_v1(first_keys, first) == [True] * batch
    second, second_keys = harness.fill_pages(host, batch, 2), harness.page_keys(batch, PAGE, 2)
    dst = harness.zero_pages(host, batch)
    results = {}
    setter = threading.Thread(target=lambda: results.setdefault("set", backend.batch_set_v1(second_keys, second)))
    setter.start()
    results["get"] = backend.batch_get_v1(first_keys, dst)
    setter.join()
    assert results == {"set": [True] * batch, "get": [True] * batch}
    assert same_pages(host, first, host, dst)
    assert backend.batch_exists(second_keys) == batch


def test_namespaces_keep_models_tenants_stages_and_dtypes_apart(backends, pool_file, model):
    pool = {"pool": pool_file, "remote_bytes": 1 << 22}  # one store every instance shares
    host = harness.host_pool(MHA, "page_first", 2 * N)
    _, keys, _ = stored_pages(backends, host, pool)
    fp16 = harness.host_pool(harness.HostShape.mha(3, 2, 8, PAGE, torch.float16), "page_first", N)
    others = {
        "model": backends(host, **pool, model_name=model + "-other"),
        "model id": backends(host, **pool, model_id="explicit"),
        "tenant": backends(host, **pool, tenant="another"),
        "pp stage": backends(host, **pool, fields={"pp_rank": 1, "pp_size": 2}),
        "tp rank": backends(host, **pool, tp_rank=1, tp_size=2),
        "dtype": backends(fp16, **pool),
        "page order": backends(harness.host_pool(MHA, "layer_first", N), **pool),
    }
    assert {name: b.batch_exists(keys) for name, b in others.items()} == dict.fromkeys(others, 0)


def test_a_pool_that_is_down_costs_one_bounded_wait(backends, tmp_path):
    down = tmp_path / "pool.toml"
    down.write_text('[pool]\nmaster = "127.0.0.1:1"\n')  # nothing listens there
    host = harness.host_pool(MHA, "page_first", 4 * N)
    backend = backends(host, disk_dir=str(tmp_path / "disk"), disk_bytes=1 << 24, pool=str(down),
                       pool_connect_timeout_s=0.5, pool_timeout_s=0.5)
    assert backend.cache.remote_error is not None
    src, keys = harness.fill_pages(host, N), harness.page_keys(N, PAGE)
    assert harness.Controller(backend, host, True).backup(keys, src) == N * PAGE  # into the local tiers
    assert backend.batch_exists(keys + harness.page_keys(2, PAGE, seed=8)) == N
    dst = harness.zero_pages(host, N)
    assert backend.batch_get_v1(keys, dst) == [True] * N and same_pages(host, src, host, dst)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_generic_flat_pages_are_read_in_their_host_layouts_order(backends, tmp_path, kind, layout):
    """A flat page of the generic interface is in its pool's own order (page_first_direct's is
    layer_first's, though SGLang's is_page_first_layout is False for it): one set through it
    loads through the zero-copy path, which reads the pool's buffer, as the same page."""
    host = harness.host_pool(SHAPES[kind], layout, 2 * N)
    backend = backends(host, disk_dir=str(tmp_path), disk_bytes=1 << 24)
    src = harness.fill_pages(host, 1)
    assert backend.set("k", host.get_data_page(int(src[0]))) is True
    dst = harness.zero_pages(host, 1)
    assert backend.batch_get_v1(["k"], dst) == [True]
    assert torch.equal(page_kv(host, int(src[0])), page_kv(host, int(dst[0])))
    fresh = backend.get("k")  # no target: a new flat page
    assert torch.equal(fresh.view(torch.uint8), host.get_data_page(int(src[0])).view(torch.uint8))
    with pytest.raises(ValueError, match="set needs the flat page to store"):
        backend.set("k2")


def test_write_back_keeps_pages_in_kvstratas_memory_until_evicted(backends, tmp_path):
    host = harness.host_pool(MHA, "page_first", 4 * N)
    backend = backends(host, disk_dir=str(tmp_path), disk_bytes=1 << 24, host_bytes=4 * MHA.page_bytes,
                       write="write-back")
    assert backend.cache.media == [Medium.DEVICE, Medium.HOST, Medium.DISK]
    src, keys = harness.fill_pages(host, 4), harness.page_keys(4, PAGE)
    assert backend.batch_set_v1(keys, src) == [True] * 4
    assert block_files(tmp_path) == []  # in kvstrata's host tier only
    more, more_keys = harness.fill_pages(host, N, 1), harness.page_keys(N, PAGE, 1)
    assert backend.batch_set_v1(more_keys, more) == [True] * N  # a batch larger than the host tier: in rounds
    assert len(block_files(tmp_path)) == N  # the host tier's evictions went down to disk
    for pages, page_keys in ((src, keys), (more, more_keys)):
        dst = harness.zero_pages(host, len(page_keys))
        assert backend.batch_get_v1(page_keys, dst) == [True] * len(page_keys)
        assert same_pages(host, pages, host, dst)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pages_scattered_over_the_host_pool_are_stored_each_as_itself(backends, tmp_path, layout):
    host = harness.host_pool(MLA if layout == "layer_first" else MHA, layout, 4 * N)
    backend = backends(host, disk_dir=str(tmp_path), disk_bytes=1 << 24)
    filled = harness.fill_pages(host, N).view(N, PAGE)
    src = filled[[0, 1, 2, 6, 3, 7, 5, 4]].flatten()  # runs of consecutive pages, and pages out of order
    keys = harness.page_keys(N, PAGE)
    assert backend.batch_set_v1(keys, src) == [True] * N
    dst = harness.zero_pages(host, N)
    assert backend.batch_get_v1(keys, dst) == [True] * N
    assert same_pages(host, src, host, dst)


def test_a_store_no_tier_has_room_for_is_refused_page_by_page(backends, tmp_path):
    host = harness.host_pool(MHA, "page_first", 4 * N)
    backend = backends(host, disk_dir=str(tmp_path), disk_bytes=2 * MHA.page_bytes)
    held, held_keys = harness.fill_pages(host, 2, 1), harness.page_keys(2, PAGE, 1)
    assert backend.batch_set_v1(held_keys, held) == [True, True]
    src, keys = harness.fill_pages(host, N, 2), harness.page_keys(N, PAGE, 2)
    manager = backend.cache.manager
    for key in backend.block_keys(held_keys):  # readers hold both disk pages: nothing can leave
        assert manager.pin(Medium.DISK, key) is not None
    assert backend.batch_set_v1(keys, src) == [False] * N
    assert harness.Controller(backend, host, True).backup(keys, src) == 0  # SGLang stops the backup
    assert backend.batch_exists(keys) == 0
    manager.unpin(Medium.DISK, backend.block_keys(held_keys))
    assert backend.batch_set_v1(keys, src) == [True] * N  # in rounds of two, each evicting the last
    assert backend.batch_exists(keys[-2:]) == 2


def test_an_allocator_only_mla_pool_is_refused_in_one_line(backends):
    """SGLang's MLA host dedup leaves ranks but one with no KV buffer (not with a dynamic backend, today)."""
    allocation = MLAHostAllocation(dtype=torch.bfloat16, kv_lora_rank=16, qk_rope_head_dim=8, kv_cache_dim=24,
                                   size_per_token=24 * 2 * 3)
    with host_memory_budget_scope(1 << 50):
        host = MLATokenToKVPoolHost(allocation, 2.0, 0, PAGE, "page_first", pin_memory=False, device="cpu",
                                    device_capacity_tokens=4 * PAGE, start_layer=0, end_layer=2, target_layer_num=3,
                                    host_token_capacity=N * PAGE)
    with pytest.raises(ValueError, match="no KV buffer on this rank") as error:
        backends(host)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("preset", ["qwen2.5-7b", "deepseek-v2-lite"])
def test_a_host_pool_of_a_presets_shape(backends, tmp_path, preset):
    """What a benchmark builds: a host pool and a backend for a model's shape (kvstrata's presets)."""
    layout = KVLayout.from_geometry(load_geometry(preset), 16)
    shape = harness.HostShape.from_layout(layout)
    host = harness.host_pool(shape, "page_first", 4)
    backend = backends(host, disk_dir=str(tmp_path), disk_bytes=16 * shape.page_bytes)
    assert backend.cache.layout.block_shape == layout.block_shape and shape.page_bytes == layout.block_bytes
    src, keys = harness.fill_pages(host, 2), harness.page_keys(2, 16)
    assert backend.batch_set_v1(keys, src) == [True, True]
    dst = harness.zero_pages(host, 2)
    assert backend.batch_get_v1(keys, dst) == [True, True] and same_pages(host, src, host, dst)
