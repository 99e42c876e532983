"""HeadSlicing: which heads and slices each rank of a TP=t instance holds and writes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstrata.kv.dtypes import DType
from kvstrata.kv.fields import GeometryError
from kvstrata.kv.groups import GroupKind, KVGroup
from kvstrata.kv.heads import HeadSlicing


@st.composite
def instances(draw):
    """(slicing, tp): heads a power of two times an odd factor, a TP that fits them either way."""
    heads = draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 32, 64]))
    granularity = draw(st.sampled_from([g for g in (1, 2, 4) if heads % g == 0]))
    tp = draw(st.sampled_from([t for t in (1, 2, 3, 4, 8, 16, 32, 128) if heads % t == 0 or t % heads == 0]))
    return HeadSlicing(heads, granularity), tp


@given(instances())
def test_the_ranks_hold_every_head_and_write_each_slice_exactly_once(case):
    slicing, tp = case
    try:
        held = [slicing.rank_slices(tp, r) for r in range(tp)]
    except GeometryError as error:  # a rank holds part of a slice: only where the slice is wider than its heads
        assert "not whole slices" in str(error)
        assert (slicing.kv_heads // min(tp, slicing.kv_heads)) % slicing.granularity
        return
    assert sorted({j for r in held for j in r}) == list(range(slicing.slices))
    written = [j for r, slices in enumerate(held) if slicing.writes(tp, r) for j in slices]
    assert sorted(written) == list(range(slicing.slices))  # one copy of each slice, whoever holds it
    heads = [slicing.rank_heads(tp, r) for r in range(tp)]
    assert all(len(h) == max(1, slicing.kv_heads // tp) for h in heads)
    assert heads == sorted(heads, key=lambda h: h.start)  # contiguous, in rank order
    assert slicing.copies(tp) * slicing.kv_heads == max(tp, slicing.kv_heads)


def test_mla_is_one_latent_every_rank_holds_and_rank_0_writes():
    mla = HeadSlicing.for_group(KVGroup(GroupKind.MLA, (0,), DType.BF16, kv_heads=1, head_dim=576))
    assert mla.slices == 1 and [mla.rank_slices(8, r) for r in range(8)] == [range(0, 1)] * 8
    assert [mla.writes(8, r) for r in range(8)] == [True] + [False] * 7 and mla.copies(8) == 8


@pytest.mark.parametrize("tp, rank, message", [(3, 0, "must divide the 8 KV heads"), (12, 0, "not a multiple"),
                                               (2, 2, "'tp_rank' must be in"), (0, 0, "'tp_size' must be")])
def test_a_tp_the_heads_do_not_fit_is_one_line_naming_it(tp, rank, message):
    with pytest.raises(GeometryError, match=message):
        HeadSlicing(8).rank_heads(tp, rank)


def test_a_state_group_has_no_heads_to_slice():
    state = KVGroup(GroupKind.STATE, (0,), DType.BF16, state_bytes=64, state_heads=4)
    with pytest.raises(GeometryError, match="state group has no KV heads"):
        HeadSlicing.for_group(state)
