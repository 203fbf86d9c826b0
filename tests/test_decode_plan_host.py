"""The host build of the decode planner (templates/decode_plan.h as one thread, shared with the GPU planner)
writes exactly the tables of the independent NumPy oracle `plan_decode`, over random batches, costs,
grids, cluster mixes and batch-invariant chunks."""
import dataclasses
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meld.runtime import host_helper
from meld.scheduler import DecodeCost, Topology, plan_decode, plan_decode_host
from meld.scheduler.decode_plan_host import plan_tables_host

length_lists = st.one_of(
    st.lists(st.integers(0, 3000), max_size=70),
    st.lists(st.sampled_from([0, 1, 15, 16, 17, 64, 65, 127, 128, 129, 1000, 1024, 1025, 65536]), max_size=40),
    st.builds(lambda n, big: [5] * n + [big], st.integers(0, 50), st.integers(1, 300000)),   # long skew
    st.builds(lambda n, big: [big] + [0] * n, st.integers(0, 20), st.integers(0, 100000)),
)
costs = st.builds(
    lambda tile, overhead, split, cta, rounds, snap, chunks: DecodeCost(
        item_overhead_tokens=overhead, min_split_tokens=split, min_cta_tokens=cta, tile_tokens=tile,
        round_tokens=tile * rounds, cluster_snap_tokens=snap, invariant_chunk_tokens=tile * chunks),
    st.sampled_from([16, 32]), st.sampled_from([1, 64, 128, 192]), st.sampled_from([1, 16, 128, 300]),
    st.sampled_from([1, 128, 1000]), st.sampled_from([1, 3, 8, 16]), st.sampled_from([0, 16, 64, 256]),
    st.sampled_from([1, 16, 64]))


def _page_table(lens, page_size, rng):
    """kv_indptr and kv_last_page_len of `lens`; empty requests get any last-page length (never read)."""
    pages = [-(-n // page_size) for n in lens]
    indptr = np.r_[0, np.cumsum(pages)].astype(np.int32)
    last = np.array([n - (p - 1) * page_size if p else rng.integers(-5, 100) for n, p in zip(lens, pages)],
                    dtype=np.int32)
    return indptr, last


def _assert_equal(lens, page_size, kv_heads, group, hpi, topo, cost, mix, chunk, seed=0):
    indptr, last = _page_table(lens, page_size, np.random.default_rng(seed))
    units = kv_heads * -(-group // hpi)
    oracle = plan_decode(np.asarray(lens, dtype=np.int64), indptr[:-1], kv_heads, group, topo, cost, hpi, mix, chunk)
    host = plan_decode_host(indptr, last, page_size, kv_heads, group, topo, cost, hpi, mix, chunk)
    tables = plan_tables_host(indptr, last, page_size, units, topo, cost, mix, chunk)
    assert np.array_equal(host.cta, oracle.cta), "CTA tables differ"
    assert np.array_equal(tables.cta, host.cta)
    assert np.array_equal(host.kv_len, oracle.kv_len) and np.array_equal(host.page_base, oracle.page_base)
    assert host.meta == oracle.meta and host.chunk_tokens == oracle.chunk_tokens
    assert np.array_equal(tables.slot_base, oracle.slot_base if chunk else np.zeros(len(lens), np.int32))
    assert (host.num_kv_heads, host.group_size, host.heads_per_item) == (kv_heads, group, hpi)
    host.validate()


@settings(max_examples=400, deadline=None)
@given(lens=length_lists, page_size=st.sampled_from([1, 16, 64]), kv_heads=st.sampled_from([1, 2, 8]),
       group=st.sampled_from([1, 3, 4, 8, 9, 16]), hpi=st.sampled_from([8, 16]), ctas=st.integers(1, 300),
       cost=costs, chunked=st.booleans(), seed=st.integers(0, 2 ** 32 - 1))
def test_equals_the_oracle(lens, page_size, kv_heads, group, hpi, ctas, cost, chunked, seed):
    chunk = cost.invariant_chunk_tokens if chunked else 0
    _assert_equal(lens, page_size, kv_heads, group, hpi, Topology(ctas), cost, [], chunk, seed)


@settings(max_examples=300, deadline=None)
@given(lens=length_lists, preferred=st.sampled_from([1, 2, 4, 8, 16]), table=st.dictionaries(
       st.sampled_from([2, 4, 8, 16]), st.integers(0, 40)), ctas=st.integers(1, 200), h200=st.booleans(), cost=costs,
       group=st.sampled_from([4, 16]), chunked=st.booleans())
def test_equals_the_oracle_with_clusters(lens, preferred, table, ctas, h200, cost, group, chunked):
    """Two-level placement over cluster mixes (the H200's, and random occupancy tables)."""
    topo = Topology.h200() if h200 else Topology(ctas, {1: ctas, **table})
    mix = topo.cluster_mix(preferred)
    chunk = cost.invariant_chunk_tokens if chunked else 0
    _assert_equal(lens, 16, 8, group, 8, topo, cost, mix, chunk)


@pytest.mark.parametrize("ctas", [1, 132, 1000, 9000])
def test_equals_the_oracle_on_large_batches_and_grids(ctas):
    """Batches longer than a GPU planner block (1024 requests) and grids near the planner's limit."""
    rng = np.random.default_rng(ctas)
    lens = np.minimum(rng.lognormal(7.5, 1.5, size=3000).astype(np.int64), 200000)
    lens[rng.random(3000) < 0.1] = 0
    for chunk in (0, 1024):
        _assert_equal(lens.tolist(), 16, 8, 4, 8, Topology(ctas), DecodeCost(), [], chunk)


@settings(max_examples=200, deadline=None)
@given(lens=length_lists, n=st.integers(1, 8), page_size=st.sampled_from([1, 16, 64]), ctas=st.integers(1, 300),
       cost=costs, chunked=st.booleans(), clustered=st.booleans(), seed=st.integers(0, 2 ** 32 - 1))
def test_token_requests_plan_each_new_token_as_a_request(lens, n, page_size, ctas, cost, chunked, clustered, seed):
    """token_requests n (DecodeMLA's multi-token decode): request b's new token t planned as the oracle plans a
    request b * n + t of b's pages whose keys end n - 1 - t before b's (none when it has fewer)."""
    indptr, last = _page_table(lens, page_size, np.random.default_rng(seed))
    topo = Topology.h200() if clustered else Topology(ctas)
    mix = topo.cluster_mix(4) if clustered else []
    chunk = cost.invariant_chunk_tokens if chunked else 0
    expanded = np.maximum(0, np.repeat(np.asarray(lens, dtype=np.int64), n) - np.tile(np.arange(n - 1, -1, -1), len(lens)))
    oracle = plan_decode(expanded, np.repeat(indptr[:-1], n), 1, 64, topo, cost, 64, mix, chunk)
    host = plan_decode_host(indptr, last, page_size, 1, 64, topo, cost, 64, mix, chunk, token_requests=n)
    assert np.array_equal(host.cta, oracle.cta), "CTA tables differ"
    assert np.array_equal(host.kv_len, oracle.kv_len) and np.array_equal(host.page_base, oracle.page_base)
    assert host.meta == oracle.meta
    host.validate()


def test_concurrent_plans_keep_their_own_scratch():
    """Each host thread runs the planner as its own block (thread_local shared memory)."""
    batches = [np.random.default_rng(i).integers(0, 40000, size=200).tolist() for i in range(16)]
    args = [(*_page_table(lens, 16, np.random.default_rng(0)), 16, 8, 4, Topology(132)) for lens in batches]
    alone = [plan_decode_host(*a).cta for a in args]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda a: plan_decode_host(*a).cta, args * 4))
    assert all(np.array_equal(t, alone[i % len(args)]) for i, t in enumerate(together))


def test_rejects_what_the_gpu_planner_cannot_plan():
    indptr, last = _page_table([100, 7], 16, np.random.default_rng(0))
    with pytest.raises(ValueError, match="70000 CTA slots, but the planner serves grids of at most"):
        plan_decode_host(indptr, last, 16, 8, 4, Topology(70000))
    with pytest.raises(ValueError, match="cover 120 CTAs, the grid has 132"):
        plan_decode_host(indptr, last, 16, 8, 4, Topology(132), clusters=[(4, 30)])
    with pytest.raises(ValueError, match="expected B \\+ 1 and B"):
        plan_decode_host(indptr, last[:1], 16, 8, 4, Topology(132))


def test_no_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(host_helper, "_decode_lib", None)
    monkeypatch.setattr(host_helper, "_build", lambda *a, **k: None)
    indptr, last = _page_table([100], 16, np.random.default_rng(0))
    with pytest.raises(RuntimeError, match="system C\\+\\+ compiler"):
        plan_decode_host(indptr, last, 16, 8, 4, Topology(132))


def test_a_snapped_cut_never_passes_a_neighbouring_cluster_boundary():
    """Found by the property test above: with a snap tolerance far above the CTAs' shares, a cluster
    boundary rounded to a unit boundary past the next (unsnapped) boundary made that cluster's segments
    run backwards, in both planners, and their head/tail parts disagree."""
    cost = DecodeCost(item_overhead_tokens=1, min_split_tokens=1, min_cta_tokens=1, tile_tokens=16, round_tokens=16,
                      cluster_snap_tokens=256, invariant_chunk_tokens=16)
    topo, mix = Topology(52, {1: 52, 2: 6}), [(2, 6), (1, 40)]
    _assert_equal([0, 0, 1000], 16, 8, 4, 8, topo, cost, mix, 0)   # equal, and valid


def test_a_cluster_whose_snaps_leave_two_cuts_on_one_token_is_cut_unsnapped():
    """Found by the property test above: with very small costs a cluster's moved span left two interior cuts on
    one token, so a split unit counted an empty piece among its parts (3 parts, 2 pieces). Both planners now
    undo that cluster's snaps, and only its: the plan still differs from the unsnapped one."""
    lens = np.maximum(np.repeat([0, 0, 0, 0, 0, 0, 0, 0, 0, 2484, 21, 1841], 2) - np.tile([1, 0], 12), 0)
    cost = DecodeCost(item_overhead_tokens=1, min_split_tokens=1, min_cta_tokens=1, tile_tokens=16, round_tokens=16,
                      cluster_snap_tokens=64, invariant_chunk_tokens=16)
    topo = Topology.h200()
    mix = topo.cluster_mix(4)
    _assert_equal(lens, 16, 1, 64, 64, topo, cost, mix, 0)   # equal, and valid
    page_base = np.zeros(len(lens), dtype=np.int64)
    snapped = plan_decode(lens, page_base, 1, 64, topo, cost, 64, mix, 0)
    unsnapped = plan_decode(lens, page_base, 1, 64, topo, dataclasses.replace(cost, cluster_snap_tokens=0), 64, mix, 0)
    assert not np.array_equal(snapped.cta, unsnapped.cta)


@settings(max_examples=200, deadline=None)
@given(lens=length_lists, n=st.integers(1, 4), units=st.integers(1, 3), page_size=st.sampled_from([1, 16, 64]),
       ctas=st.integers(1, 300), cost=costs, clustered=st.booleans(), seed=st.integers(0, 2 ** 32 - 1))
def test_head_major_lays_each_head_block_of_every_request_in_turn(lens, n, units, page_size, ctas, cost, clustered,
                                                                  seed):
    """head_major (DecodeMLA): the line holds every planned request's first unit, then every one's second, ...:
    the oracle's plan of the planned requests repeated `units` times, one unit each; kv_len and page_base stay
    one per planned request."""
    indptr, last = _page_table(lens, page_size, np.random.default_rng(seed))
    topo = Topology.h200() if clustered else Topology(ctas)
    mix = topo.cluster_mix(4) if clustered else []
    planned = np.maximum(0, np.repeat(np.asarray(lens, dtype=np.int64), n) - np.tile(np.arange(n - 1, -1, -1), len(lens)))
    bases = np.repeat(indptr[:-1], n)
    oracle = plan_decode(np.tile(planned, units), np.tile(bases, units), 1, 64, topo, cost, 64, mix, 0)
    host = plan_decode_host(indptr, last, page_size, 1, 64 * units, topo, cost, 64, mix, 0, token_requests=n,
                            head_major=True)
    assert np.array_equal(host.cta, oracle.cta), "CTA tables differ"
    assert np.array_equal(host.kv_len, planned) and np.array_equal(host.page_base, bases)
    assert host.head_major and host.units_per_request == units
    host.validate()


def test_head_major_cuts_no_chunks():
    indptr, last = _page_table([100, 3000], 16, np.random.default_rng(0))
    with pytest.raises(ValueError, match="head_major plans cut no chunks"):
        plan_decode_host(indptr, last, 16, 1, 128, Topology(132), DecodeCost(), 64, [], 1024, head_major=True)
