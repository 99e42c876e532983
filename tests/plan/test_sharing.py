"""A prefix's pool bytes in a fleet of mixed TP sizes, TP-matched vs head-sliced."""

import pytest

from kvstrata.kv import load_geometry
from kvstrata.kv.fields import GeometryError
from kvstrata.plan.footprint import stored_bytes
from kvstrata.plan.planner import pool_capacity_bytes
from kvstrata.plan.sharing import KVSharing, fleet_sharing, pool_bytes


def test_a_fleet_of_one_size_stores_one_copy_either_way(llama70b, h200):
    fleet = fleet_sharing(llama70b, (4, 4), 8192, pool_capacity_bytes(h200))
    assert fleet.matched_bytes == fleet.sliced_bytes == stored_bytes(llama70b, 8192)
    assert fleet.prefixes(KVSharing.MATCHED) == fleet.prefixes(KVSharing.SLICED)


def test_replication_multiplies_the_matched_copies():
    tiny = load_geometry("tiny-llama")  # 2 KV heads
    fleet = fleet_sharing(tiny, (8, 4, 2, 1), 4096, 80 * stored_bytes(tiny, 4096))
    assert [s.replication for s in fleet.sizes] == [4, 2, 1, 1]
    assert fleet.matched_copies == 8 and (fleet.prefixes(KVSharing.SLICED), fleet.prefixes(KVSharing.MATCHED)) == (80, 10)


def test_a_hybrid_replicates_only_its_attention():
    qwen = load_geometry("qwen3-next-80b-a3b")  # 2 attention KV heads; its recurrent state splits over 32 heads
    one = pool_bytes(qwen, 4096, 1, KVSharing.SLICED)
    eight = pool_bytes(qwen, 4096, 8, KVSharing.MATCHED)
    assert one < eight < 4 * one


def test_no_pool_holds_no_prefix(llama70b, ws):
    assert pool_capacity_bytes(ws) is None or fleet_sharing(llama70b, (1,), 1024, None).prefixes(KVSharing.SLICED) is None


def test_a_tp_the_heads_do_not_fit_is_refused(llama70b):
    with pytest.raises(GeometryError):
        fleet_sharing(llama70b, (8, 3), 1024, None)
    with pytest.raises(ValueError):
        fleet_sharing(llama70b, (), 1024, None)
