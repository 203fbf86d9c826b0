"""meld.scheduler: property tests of plan_decode over random batches (coverage, groups, bounds, balance)."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meld.scheduler import DecodeCost, Topology, cluster_rows, plan_decode

from meld.workloads import lengths

length_lists = st.one_of(
    st.lists(st.integers(0, 3000), min_size=0, max_size=70),
    st.lists(st.sampled_from([0, 1, 15, 16, 17, 64, 65, 1000, 65536]), min_size=1, max_size=40),
    st.builds(lambda n, big: [5] * n + [big], st.integers(0, 50), st.integers(1, 200000)),
)


def _plan(lens, num_kv_heads=8, group=4, topo=Topology(132, {1: 264}), cost=DecodeCost()):
    L = np.asarray(lens, dtype=np.int64)
    return plan_decode(L, np.r_[0, np.cumsum(-(-L // 16))][:-1].astype(np.int64), num_kv_heads, group, topo, cost)


@settings(max_examples=300, deadline=None)
@given(lens=length_lists, kv_heads=st.sampled_from([1, 2, 8]), group=st.sampled_from([1, 3, 4, 8, 9, 16]),
       sms=st.integers(1, 140), per_sm=st.integers(1, 3), round_=st.sampled_from([16, 48, 128, 256]))
def test_every_token_covered_once_and_groups_consistent(lens, kv_heads, group, sms, per_sm, round_):
    s = _plan(lens, kv_heads, group, Topology(sms, {1: sms * per_sm}), DecodeCost(round_tokens=round_)).validate()
    it = s.items()
    assert it["req"].max(initial=0) < max(len(lens), 1)
    assert np.all(it["slot"] < s.num_slots)
    assert np.all((it["cta"] >= 0) & (it["cta"] < s.num_ctas))
    covered = np.bincount(it["unit"], weights=it["kv_end"] - it["kv_begin"], minlength=s.num_units)
    assert np.array_equal(covered, np.repeat(np.asarray(lens, dtype=np.int64), s.units_per_request))


@settings(max_examples=200, deadline=None)
@given(lens=length_lists, sms=st.integers(8, 140), overhead=st.sampled_from([64, 128]))
def test_balance(lens, sms, overhead):
    cost = DecodeCost(item_overhead_tokens=overhead)
    s = _plan(lens, topo=Topology(sms, {1: 2 * sms}), cost=cost)
    per_cta = s.cta_cost(overhead)
    active = s.meta["active_ctas"]
    mean = per_cta.sum() / active
    # A cut moves by at most one tile plus the smallest split (snapping) on each side of a segment, and
    # the second cut may misjudge a segment's overheads by one piece.
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


@pytest.mark.parametrize("cost", [DecodeCost(), DecodeCost(item_overhead_tokens=64)])
@pytest.mark.parametrize("lens", [[65536], [65536, 40000], [30000] * 3])
@pytest.mark.parametrize("ctas", [100, 132, 264])
def test_every_piece_pays_its_overhead(lens, ctas, cost):
    """Every piece pays an item overhead, also one that starts a segment inside a unit: long requests
    cut over many CTAs give every CTA the same predicted cost."""
    s = _plan(lens, topo=Topology(ctas), cost=cost).validate()
    per_cta = s.cta_cost(cost.item_overhead_tokens)[:s.meta["active_ctas"]]
    inside = s.cta[1, :len(per_cta)] > 0
    assert inside.sum() > len(per_cta) // 2   # most segments start inside a unit; CTA 0 on token 0
    assert abs(np.median(per_cta[inside]) - per_cta[0]) <= cost.tile_tokens
    assert np.percentile(per_cta, 90) - np.percentile(per_cta, 10) <= cost.tile_tokens


def test_splits_stay_on_neighbouring_ctas():
    s = _plan([65536] + [512] * 63).validate()
    it = s.items()
    for u in np.unique(it["unit"][it["slot"] >= 0]):
        ctas = it["cta"][it["unit"] == u]
        assert np.array_equal(ctas, np.arange(ctas[0], ctas[0] + len(ctas)))


@pytest.mark.parametrize("round_", [16, 128])
def test_short_batch_uses_fewer_ctas(round_):
    """Short segments, more units than CTAs: each CTA gets at least min_cta_tokens (rounded up) and one round of
    the warps."""
    cost = DecodeCost(round_tokens=round_, item_overhead_tokens=16)
    s = _plan([20] * 20, cost=cost, topo=Topology(132)).validate()
    total = (20 + cost.item_overhead_tokens) * 8 * 20
    expected = min(-(-total // cost.min_cta_tokens), total // round_)
    assert s.meta["active_ctas"] == expected == 45


@pytest.mark.parametrize("lens,overhead,pieces", [([2048], 192, 128), ([2048], 128, 128), ([100], 128, 8),
                                                  ([300, 0, 1000], 128, 8 * (2 + 1 + 7))])
def test_one_piece_per_cta_where_the_pieces_fit(lens, overhead, pieces):
    """A short batch whose units, cut at every round of the warps (128 tokens, none shorter than min_split), give
    no more pieces than the grid has CTAs: each piece gets its own CTA, whatever the item overhead (on the line,
    an overhead of 192 left four CTAs two rounds and others none)."""
    s = _plan(lens, cost=DecodeCost(item_overhead_tokens=overhead), topo=Topology(132)).validate()
    it = s.items()
    assert s.meta["active_ctas"] == len(it["cta"]) == len(set(it["cta"].tolist())) == pieces
    size = it["kv_end"] - it["kv_begin"]
    assert size.max() < 256 and np.all(it["kv_begin"] % 128 == 0)


@pytest.mark.parametrize("B,dist,roomy", [(1, "uniform2k", False), (1, "skewed", False), (8, "skewed", True),
                                          (64, "one-long", True)])
def test_short_segments_cut_on_warp_rounds(B, dist, roomy):
    """Short segments split units on whole rounds of the 8 warps (128 tokens), long ones on tiles."""
    it = _plan(lengths(dist, B), topo=Topology(132)).validate().items()
    inner = it["kv_begin"][it["kv_begin"] > 0]
    assert len(inner) > 10
    assert np.all(inner % 16 == 0)
    assert np.all(inner % 128 == 0) != roomy


def test_round_must_be_whole_tiles():
    with pytest.raises(ValueError, match="round_tokens must be a positive multiple of tile_tokens"):
        DecodeCost(round_tokens=24)


# --- cluster mixes ---------------------------------------------------------------------------------
H200 = {1: 132, 2: 66, 4: 30, 8: 15, 16: 7}


def _gpc_table(gpcs: list[int], sizes=(1, 2, 4, 8, 16)) -> dict[int, int]:
    """The occupancy table of a GPU whose GPCs hold `gpcs` SMs (a cluster lives inside one GPC)."""
    return {s: sum(m // s for m in gpcs) for s in sizes}


def _placeable(gpcs: list[int], mix) -> bool:
    """Place the mix's clusters, largest first, each into the GPC with the most free SMs."""
    free = sorted(gpcs, reverse=True)
    for size, count in mix:
        for _ in range(count):
            i = max(range(len(free)), key=lambda k: free[k])
            if free[i] < size:
                return False
            free[i] -= size
    return True


def test_cluster_mix_h200():
    topo = Topology(132, H200)
    assert topo.cluster_mix(4) == [(4, 30), (2, 6)]
    assert topo.cluster_mix(8) == [(8, 15), (2, 6)]          # not (4, 3): the 12 SMs left are pairs
    assert topo.cluster_mix(2) == [(2, 66)]
    assert topo.cluster_mix(1) == [(1, 132)]
    assert topo.cluster_mix(16) == [(16, 7), (8, 1), (2, 6)]
    assert _gpc_table([18] * 6 + [16, 8]) == H200            # a GPC layout consistent with the table
    with pytest.raises(ValueError, match="power of two"):
        topo.cluster_mix(3)
    with pytest.raises(ValueError, match="powers of two"):
        Topology(132, {1: 132, 3: 40})


@settings(max_examples=300, deadline=None)
@given(gpcs=st.lists(st.integers(1, 20), min_size=1, max_size=12), preferred=st.sampled_from([1, 2, 4, 8, 16]))
def test_cluster_mix_covers_every_sm_and_fits_the_gpcs(gpcs, preferred):
    topo = Topology(sum(gpcs), _gpc_table(gpcs))
    mix = topo.cluster_mix(preferred)
    assert sum(s * n for s, n in mix) == sum(gpcs)
    assert [s for s, _ in mix] == sorted({s for s, _ in mix}, reverse=True) and all(s <= preferred for s, _ in mix)
    assert _placeable(gpcs, mix)
    # largest clusters first: every cluster of the largest possible size up to the preferred one
    s0 = max(s for s, n in topo.max_active_clusters.items() if n and s <= preferred)
    assert mix[0] == (s0, topo.max_active_clusters[s0])


@settings(max_examples=300, deadline=None)
@given(table=st.dictionaries(st.sampled_from([2, 4, 8, 16]), st.integers(0, 80)), slots=st.integers(1, 300),
       preferred=st.sampled_from([1, 2, 4, 8, 16]))
def test_cluster_mix_covers_every_slot_for_any_table(table, slots, preferred):
    topo = Topology(slots, {1: slots, **table})
    mix = topo.cluster_mix(preferred)
    assert sum(s * n for s, n in mix) == slots
    assert all(0 < n <= topo.max_active_clusters[s] for s, n in mix)


# --- two-level placement -----------------------------------------------------------------------------

def _plan_clusters(lens, mix, cost=DecodeCost(), num_ctas=132):
    L = np.asarray(lens, dtype=np.int64)
    return plan_decode(L, np.r_[0, np.cumsum(-(-L // 16))][:-1].astype(np.int64), 8, 4, Topology(num_ctas), cost,
                       clusters=mix)


def test_cluster_rows():
    rows = cluster_rows([(4, 2), (2, 1), (1, 2)])
    assert rows.tolist() == [[0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 10, 11], [4, 4, 4, 4, 8, 8, 8, 8, 10, 10, 11, 12]]


@settings(max_examples=300, deadline=None)
@given(lens=length_lists, preferred=st.sampled_from([2, 4, 8, 16]), snap=st.sampled_from([16, 64, 256]))
def test_two_level_placement_covers_every_token_and_stays_balanced(lens, preferred, snap):
    cost = DecodeCost(cluster_snap_tokens=snap)
    mix = Topology.h200().cluster_mix(preferred)
    s = _plan_clusters(lens, mix, cost).validate()
    covered = np.bincount(s.items()["unit"], weights=s.items()["kv_end"] - s.items()["kv_begin"],
                          minlength=s.num_units)
    assert np.array_equal(covered, np.repeat(np.asarray(lens, dtype=np.int64), s.units_per_request))
    per_cta = s.cta_cost(cost.item_overhead_tokens)
    # as test_balance, plus each of a cluster's two boundaries moving by <= snap tokens per CTA
    slack = 2 * (cost.min_split_tokens + cost.tile_tokens) + cost.item_overhead_tokens + 2 * snap + 1
    assert per_cta.max() <= per_cta.sum() / s.meta["active_ctas"] + slack


@pytest.mark.parametrize("dist", ["uniform2k", "skewed", "one-long"])
@pytest.mark.parametrize("B", [8, 64, 256])
def test_two_level_placement_sends_fewer_partials_through_hbm(dist, B):
    mix = Topology.h200().cluster_mix(4)
    cluster_of_cta = cluster_rows(mix)[0]
    plain = _plan_clusters(lengths(dist, B), []).merge_paths(cluster_of_cta)
    placed = _plan_clusters(lengths(dist, B), mix).validate().merge_paths(cluster_of_cta)
    assert placed["hbm_pieces"] <= plain["hbm_pieces"]
    if (B, dist) in {(8, "skewed"), (64, "one-long"), (256, "one-long")}:   # where it matters most
        assert placed["hbm_pieces"] <= 0.9 * plain["hbm_pieces"]


def test_clusters_must_cover_the_grid():
    with pytest.raises(ValueError, match="cover 120 CTAs, the grid has 132"):
        _plan_clusters(lengths("skewed", 64), [(4, 30)])


@pytest.mark.parametrize("mix", [[(1, 132)], [(4, 30), (2, 6)]])
def test_no_clusters_or_no_snap_is_the_plain_cut(mix):
    lens = lengths("skewed", 64)
    plain = _plan_clusters(lens, [])
    off = DecodeCost(cluster_snap_tokens=0)
    assert _plan_clusters(lens, mix, off) == _plan_clusters(lens, [], off)
    if mix[0][0] == 1:
        assert _plan_clusters(lens, mix) == plain
    else:
        assert _plan_clusters(lens, mix) != plain


@settings(max_examples=200, deadline=None)
@given(lens=length_lists, sms=st.integers(1, 140), chunk=st.sampled_from([16, 256, 1024]),
       group=st.sampled_from([1, 4, 16]))
def test_batch_invariant_plans_cut_on_chunks(lens, sms, chunk, group):
    """Chunked plans cover every token once, and a unit's pieces are exactly its chunks: their bounds
    depend on its length alone, whatever the batch and grid."""
    L = np.asarray(lens, dtype=np.int64)
    s = plan_decode(L, np.zeros(len(L), dtype=np.int64), 2, group, Topology(sms), chunk_tokens=chunk).validate()
    it = s.items()
    covered = np.bincount(it["unit"], weights=it["kv_end"] - it["kv_begin"], minlength=s.num_units)
    assert np.array_equal(covered, np.repeat(L, s.units_per_request))
    n = s.chunks[it["req"]]
    assert np.all(it["kv_begin"] % chunk == 0)
    assert np.all((it["kv_end"] == np.minimum(it["kv_begin"] + chunk, L[it["req"]])) | (n == 1))
    assert np.array_equal(it["num_parts"], np.where(n > 1, n, 0))


def test_resident_mixes():
    """A grid may wait on its own CTAs only when every one of them is resident at once (decode's sliced merges):
    each grid of the mix must fit the table for its cluster size."""
    h200 = Topology.h200()
    for preferred in (1, 2, 4, 8, 16):
        assert h200.resident(h200.cluster_mix(preferred))
    assert not h200.resident([(1, 2 * 132)])   # two CTAs an SM where one fits
    assert not h200.resident([(4, 31)])        # one cluster of four more than the GPCs hold
    assert not h200.resident([(32, 1)])        # a size the table does not have
    assert h200.resident([(4, 30), (2, 6)]) and Topology(132, {1: 264}).resident([(1, 264)])
