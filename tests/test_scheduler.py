"""meld.scheduler: property tests of plan_decode over random batches (coverage, groups, bounds, balance)."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meld.scheduler import DecodeCost, Topology, plan_decode

from meld.workloads import lengths

length_lists = st.one_of(
    st.lists(st.integers(0, 3000), min_size=0, max_size=70),
    st.lists(st.sampled_from([0, 1, 15, 16, 17, 64, 65, 1000, 65536]), min_size=1, max_size=40),
    st.builds(lambda n, big: [5] * n + [big], st.integers(0, 50), st.integers(1, 200000)),
)


def _plan(lens, num_kv_heads=8, group=4, topo=Topology(132, 2), cost=DecodeCost()):
    L = np.asarray(lens, dtype=np.int64)
    return plan_decode(L, np.r_[0, np.cumsum(-(-L // 16))][:-1].astype(np.int64), num_kv_heads, group, topo, cost)


@settings(max_examples=300, deadline=None)
@given(lens=length_lists, kv_heads=st.sampled_from([1, 2, 8]), group=st.sampled_from([1, 3, 4, 8, 9, 16]),
       sms=st.integers(1, 140), per_sm=st.integers(1, 3))
def test_every_token_covered_once_and_groups_consistent(lens, kv_heads, group, sms, per_sm):
    s = _plan(lens, kv_heads, group, Topology(sms, per_sm)).validate()
    it = s.items()
    assert it["req"].max(initial=0) < max(len(lens), 1)
    assert np.all(it["slot"] < s.num_slots)
    assert np.all((it["cta"] >= 0) & (it["cta"] < s.num_ctas))
    covered = np.bincount(it["unit"], weights=it["kv_end"] - it["kv_begin"], minlength=s.num_units)
    assert np.array_equal(covered, np.repeat(np.asarray(lens, dtype=np.int64), s.units_per_request))


@settings(max_examples=200, deadline=None)
@given(lens=length_lists, sms=st.integers(8, 140))
def test_balance(lens, sms):
    cost = DecodeCost()
    s = _plan(lens, topo=Topology(sms, 2), cost=cost)
    per_cta = s.cta_cost(cost.item_overhead_tokens)
    active = s.meta["active_ctas"]
    mean = per_cta.sum() / active
    # A cut moves by at most one tile plus the smallest split (snapping) on each side of a segment.
    slack = 2 * (cost.min_split_tokens + cost.tile_tokens) + cost.item_overhead_tokens
    assert per_cta.max() <= mean + slack
    assert np.all(per_cta[active:] == 0)


@pytest.mark.parametrize("dist", ["uniform2k", "skewed", "one-long"])
@pytest.mark.parametrize("B", [1, 8, 64, 256])
def test_bench_workloads_use_the_whole_gpu(dist, B):
    if dist == "one-long" and B == 1:
        pytest.skip("one-long needs B >= 2")
    s = _plan(lengths(dist, B)).validate()
    busy = len(np.unique(s.items()["cta"]))
    if B >= 8:
        assert busy == 264
    else:   # a short batch: fewer CTAs of at least min_cta_tokens; snapping may empty a few
        assert 0.9 * s.meta["active_ctas"] <= busy <= s.meta["active_ctas"]


def test_splits_stay_on_neighbouring_ctas():
    s = _plan([65536] + [512] * 63).validate()
    it = s.items()
    for u in np.unique(it["unit"][it["slot"] >= 0]):
        ctas = it["cta"][it["unit"] == u]
        assert np.array_equal(ctas, np.arange(ctas[0], ctas[0] + len(ctas)))


def test_short_batch_uses_fewer_ctas():
    s = _plan([100]).validate()
    assert s.meta["active_ctas"] == -(-(100 + DecodeCost().item_overhead_tokens) * 8 // DecodeCost().min_cta_tokens)
