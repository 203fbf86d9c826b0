"""Rail-aware hierarchical movement on the CPU (meld.distributed.rails): the transport protocol routed over a
modelled 2-node x 2-GPU topology. Its modelled makespan against the closed-form cost model, hierarchical
against flat, the chunk-size trade-off, gathering at the relay, the ordering guarantee across relays (and a
broken relay caught), and the emulated operators through it against one rank."""
import dataclasses

import numpy as np
import pytest

from meld.distributed import row_parallel_matmul
from meld.distributed.ep_moe import expert_parallel_moe, single_rank_reference
from meld.distributed.rails import RailTransport, all_to_all_time
from meld.distributed.reduce import run_ranks
from meld.distributed.topology import Link, Topology
from meld.distributed.transport import FakeClock

from tests.test_dist_emulation import _moe_inputs, _tp_case

# A modelled cluster: NVLink faster than a rail, the spine (the cross-rail path) a 2:1 oversubscribed one.
TOPO = Topology(2, 2, nvlink=Link(1e-6, 100e9), rail=Link(1e-6, 50e9), spine=Link(1.5e-6, 25e9))


def _rails(topology=TOPO, **kw):
    return RailTransport(topology, clock=FakeClock(), **kw)


def _exchange(tr, counts, seed=0):
    """Rank s puts counts[s][d] random float64 values to every rank d, all issued at modelled time 0; checks
    that each landed whole and once. The modelled makespan."""
    rng = np.random.default_rng(seed)
    pairs = [(s, d) for s in range(tr.world) for d in range(tr.world) if s != d and counts[s][d]]
    pairs.sort(key=lambda p: -len(TOPO.route(*p, tr.hierarchical)))   # relayed transfers first
    wins = {p: tr.window(f"x{p}", (int(counts[p[0]][p[1]]),), np.float64, np.nan) for p in pairs}
    vals = {p: rng.standard_normal(len(wins[p][0])) for p in pairs}
    try:
        with tr.hold():
            for s, d in pairs:
                tr.put(s, d, f"x{(s, d)}", (), vals[(s, d)])
        run_ranks(tr.world, tr.quiet)
    finally:
        tr.close()
    landed = tr.landed()
    for s, d in pairs:   # whole, once, at d only
        assert np.array_equal(wins[(s, d)][d], vals[(s, d)]), (s, d)
        assert (landed[f"x{(s, d)}"] == np.eye(tr.world, dtype=np.int64)[:, [d]]).all(), (s, d)
    return tr.makespan


def _uniform(n):
    return np.full((4, 4), n) - np.diag([n] * 4)


def _random(seed):
    counts = np.random.default_rng(seed).integers(500, 20000, (4, 4))
    np.fill_diagonal(counts, 0)
    return counts


@pytest.mark.parametrize("ordered", [True, False])
def test_cost_model_predicts_the_emulated_all_to_all_and_hierarchical_beats_flat(ordered):
    """Uniform (128 KB a pair) and random per-pair sizes (4 to 160 KB, not multiples of the chunk), hierarchical
    and flat, 16 and 64 KB chunks: the emulated makespan is at least the closed form's and at most one rail
    chunk above it (a relay's stream that goes out in one more chunk than the model's full ones; measured,
    both orders: exact in 18 of the 24 cases, 1.24x the model at worst); the spine oversubscribed 2:1,
    hierarchical is at least 1.3x faster than flat in every case (measured 1.52x to 2.14x)."""
    for counts in (_uniform(16384), _random(1), _random(2)):
        for chunk in (16 << 10, 64 << 10):
            got = {}
            for hier in (True, False):
                got[hier] = _exchange(_rails(hierarchical=hier, chunk_bytes=chunk, ordered=ordered), counts)
                model = all_to_all_time(TOPO, counts * 8, chunk, hier)
                assert model * (1 - 1e-9) <= got[hier] <= model + TOPO.rail.time(chunk), (hier, chunk, got[hier], model)
            assert got[False] >= 1.3 * got[True], (chunk, got)


def test_flat_wins_where_the_spine_is_not_the_bottleneck():
    """The other side of the trade: a spine as fast as NVLink makes the relay's extra hop and its doubled rail
    load pure cost, and flat beats hierarchical (measured 1.14x to 1.40x here), in the emulation and in the model."""
    fast = dataclasses.replace(TOPO, spine=Link(1e-6, 100e9))
    for counts in (_uniform(16384), _random(1)):
        for chunk in (16 << 10, 64 << 10):
            got = {h: _exchange(_rails(fast, hierarchical=h, chunk_bytes=chunk), counts) for h in (True, False)}
            model = {h: all_to_all_time(fast, counts * 8, chunk, h) for h in (True, False)}
            assert got[True] > 1.1 * got[False] and model[True] > 1.1 * model[False], (chunk, got, model)


def test_chunk_size_trades_latency_against_pipelining():
    """Only cross-rail traffic (rank s to the other node's other GPU, 2 MB each, so every byte takes two
    hops): small chunks pay the rail's latency per chunk, a chunk as large as the transfer waits for the
    whole of it on NVLink before the rail starts; 512 KB beats both, in the emulation and in the model, which
    agree within 1%."""
    counts = np.zeros((4, 4), dtype=np.int64)
    for s in range(4):
        counts[s, (s + 3) % 4 if s % 2 == 0 else (s + 1) % 4] = 1 << 18
    assert all(TOPO.route(s, int(d)) == [s, TOPO.relay(s, int(d)), int(d)] for s, d in zip(*np.nonzero(counts)))
    got = {c: _exchange(_rails(chunk_bytes=c), counts) for c in (32 << 10, 512 << 10, 2 << 20)}
    for c, t in got.items():
        assert t == pytest.approx(all_to_all_time(TOPO, counts * 8, c), rel=0.01), c
    assert got[512 << 10] < 0.9 * min(got[32 << 10], got[2 << 20]), got


def test_relay_gathers_its_nodes_data_into_one_rail_stream():
    """Rank 1 sends rank 3 (its rail peer) 5.5 chunks, then rank 0 sends rank 3 half a chunk through relay 1:
    it arrives while rank 1's last, half-full chunk still waits for the rail and fills it, so the rail
    carries 6 chunks, one with both ranks' data (flat: 6 on the rail and 1 on the spine)."""
    chunk = 4096
    counts = np.zeros((4, 4), dtype=np.int64)
    counts[1, 3], counts[0, 3] = 11 * chunk // 16, chunk // 16
    tr = _rails(chunk_bytes=chunk)
    _exchange(tr, counts)
    assert tr.chunks[("rail", 1)] == 6 and tr.gathered[("rail", 1)] == 1 and tr.bytes[("rail", 1)] == 6 * chunk
    flat = _rails(hierarchical=False, chunk_bytes=chunk)
    _exchange(flat, counts)
    assert flat.chunks[("rail", 1)] == 6 and flat.chunks[("spine", 0)] == 1 and sum(flat.gathered.values()) == 0


def _signalled_blocks(tr, n=1500, seed=0):
    """Every rank puts a block of n values to every other, then a signal behind it, all issued at one modelled
    instant (`hold`: the schedule is the transport's, not the threads' timing). An observer registered before
    anything lands looks at every state the windows pass through: the (source, destination) pairs whose block
    was not all there when its signal landed."""
    W = tr.world
    rng = np.random.default_rng(seed)
    vals = rng.standard_normal((W, n))
    blk = tr.window("blk", (W, n), np.float64, np.nan)
    sig = tr.window("sig", (W,), np.int64, 0)
    early, open_pairs = [], {(s, d) for s in range(W) for d in range(W) if s != d}

    def seen() -> bool:   # (under the lock, right after each landing: the windows as they are at that instant)
        for s, d in sorted(open_pairs):
            if sig[d][s]:
                open_pairs.discard((s, d))
                if not np.array_equal(blk[d][s], vals[s]):
                    early.append((s, d))
        return not open_pairs
    try:
        with tr.hold():
            for r in range(W):
                for d in range(W):
                    if d != r:
                        tr.put(r, d, "blk", r, vals[r])
                        tr.signal(r, d, "sig", r, 1)
            tr.observe(seen)   # (held: nothing has landed yet)
        run_ranks(W, tr.quiet)
    finally:
        tr.close()
    assert not open_pairs, f"signals that never landed: {sorted(open_pairs)}"
    return early


@pytest.mark.parametrize("ordered", [True, False])
def test_a_signal_lands_behind_its_data_across_relays_and_a_broken_relay_is_caught(ordered):
    """Every signal lands after the whole block before it, relayed or not (hierarchical and flat). A relay that
    sends a signal ahead of the data it still holds for that peer lets it land first: some cross-rail pair
    reads a block still in flight, and only those. (Rails slower than NVLink, so a relay holds data when the
    signal reaches it; unordered, the signal then lands anywhere among it.) The observer sees every landing, so
    the outcome is the transport's seeded schedule's alone, the same in every run."""
    slow = dataclasses.replace(TOPO, rail=Link(1e-6, 5e9))
    cross = {(s, d) for s in range(4) for d in range(4) if len(TOPO.route(s, d)) == 3}
    for seed in range(2):
        for hier in (True, False):
            assert _signalled_blocks(_rails(slow, hierarchical=hier, chunk_bytes=512, ordered=ordered, seed=seed)) == []
        early = _signalled_blocks(_rails(slow, chunk_bytes=512, ordered=ordered, seed=seed, relay_fence=False))
        assert early and set(early) <= cross


@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("ordered", [True, False])
def test_expert_parallel_moe_over_rails_equals_single_rank(ordered, compact):
    """EP MoE (4 ranks on 2 nodes, one rank with no tokens, a hot expert) through relays, whole blocks or
    compacted ones: bit-identical to one rank; every count once on every other rank; every put landed once."""
    xs, ids, wts, w13, w2 = _moe_inputs(4, [7, 3, 0, 9])
    for seed in range(2):
        tr = _rails(chunk_bytes=256, ordered=ordered, seed=seed, max_delay=1e-5)
        try:
            ys = expert_parallel_moe(tr, xs, ids, wts, w13, w2, compact=compact)
        finally:
            tr.close()
        for r in range(4):
            assert np.array_equal(ys[r], single_rank_reference(xs[r], ids[r], wts[r], w13, w2)), (seed, r)
        for name in ("ep.back",) if compact else ("ep.sent", "ep.back"):   # (compact counts carry the rows + 1)
            counts = np.array([[int(tr.get(0, r, name, s)) for s in range(4)] for r in range(4)])
            assert np.array_equal(counts, 1 - np.eye(4, dtype=np.int64)), (name, counts)
        assert all(c.max() <= 1 for c in tr.landed().values())


def test_expert_parallel_moe_over_a_broken_relay_is_caught():
    """relay_fence=False: a count overtakes the rows it follows at the relay; the expert rank reads rows still
    in flight (NaN) or the source sums expert rows still in flight."""
    xs, ids, wts, w13, w2 = _moe_inputs(4, [8, 8, 8, 8], seed=1)
    slow = dataclasses.replace(TOPO, rail=Link(1e-6, 5e9))
    caught = 0
    # Whether a rank reads before the overtaken rows land depends on the threads' timing. Ordered delivery over
    # rails slower than NVLink (the relay holds the rows when the count reaches it) made it certain in every run
    # measured: 32 of 32 with four processes at once on a 2-core host (2026-12-05); unordered over the plain
    # topology it missed 4 of 32 there. Up to eight runs are still tried for two catches.
    for seed in range(8):
        if caught >= 2:
            break
        tr = _rails(slow, chunk_bytes=256, ordered=True, seed=seed, max_delay=1e-5, relay_fence=False, timeout=2.0)
        try:
            ys = expert_parallel_moe(tr, xs, ids, wts, w13, w2)
            caught += any(not np.array_equal(ys[r], single_rank_reference(xs[r], ids[r], wts[r], w13, w2)) for r in range(4))
        except TimeoutError:
            caught += 1
        finally:
            tr.close()
    assert caught >= 2


@pytest.mark.parametrize("ordered", [True, False])
def test_row_parallel_matmul_over_rails_equals_single_rank(ordered):
    """The row-parallel GEMM's owner merge (a fetch-add per part, through relays) on 4 ranks of 2 nodes."""
    from meld.distributed.tp_matmul import single_rank_reference as tp_reference

    xs, ws, sched = _tp_case(4, 70, 150, 133, 132, seed=4)
    want = tp_reference(xs, ws, sched)
    tr = _rails(chunk_bytes=4096, ordered=ordered, max_delay=1e-5)
    try:
        ys = row_parallel_matmul(tr, xs, ws, sched)
    finally:
        tr.close()
    assert all(np.array_equal(y, want) for y in ys)
    assert all(c.max() <= 1 for c in tr.landed().values())


def test_topology_routes_and_validation():
    assert [TOPO.route(0, d) for d in range(4)] == [[0, 0], [0, 1], [0, 2], [0, 1, 3]]
    assert TOPO.route(0, 3, hierarchical=False) == [0, 3] and TOPO.route(3, 0) == [3, 2, 0]
    assert [TOPO.link(0, 1)[0], TOPO.link(1, 3)[0], TOPO.link(0, 3)[0]] == [("nvlink", 0), ("rail", 1), ("spine", 0)]
    with pytest.raises(ValueError, match="bandwidth .* got 0"):
        Link(1e-6, 0)
    with pytest.raises(ValueError, match="latency .* got -1"):
        Link(-1, 1e9)
    with pytest.raises(ValueError, match="gpus_per_node must be an int >= 1, got 0"):
        Topology(2, 0, TOPO.nvlink, TOPO.rail, TOPO.spine)
    with pytest.raises(TypeError, match="spine must be a Link"):
        Topology(2, 2, TOPO.nvlink, TOPO.rail, 25e9)
    with pytest.raises(ValueError, match=r"dst must be a rank in \[0, 4\), got 4"):
        TOPO.route(0, 4)
    with pytest.raises(ValueError, match="chunk_bytes must be an int >= 1, got 0"):
        RailTransport(TOPO, chunk_bytes=0)
    with pytest.raises(ValueError, match=r"nbytes must be a \[4, 4\] array"):
        all_to_all_time(TOPO, np.ones((3, 3)), 1024)
