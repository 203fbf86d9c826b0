"""meld.distributed on the CPU: sharding plans, the emulated transport, the ranked schedule, and the three
cross-rank operators over emulated ranks (sequence-parallel decode, the row-parallel GEMM's per-tile
all-reduce, expert-parallel MoE). Under random landing order and delays each result equals the
single-rank execution bit for bit and loses nothing; a transport that lets a count overtake its data is
caught."""
import threading

import numpy as np
import pytest
import torch

from meld.distributed import (EmulatedTransport, rank_partials, ranked_decode_schedule, row_parallel_matmul, run_ranks,
                              seq_parallel_decode, shard_batch)
from meld.distributed.transport import FakeClock
from meld.runtime.reference import attention_reference, merge_partials
from meld.workloads import paged

P, HQ, HKV, D = 4, 4, 2, 64
LENS = [0, 5, 50, 130, 7, 64, 1, 33]


def _transport(world, **kw):
    """An emulated transport whose random delays cost no wall-clock time (the landing order stays random)."""
    return EmulatedTransport(world, clock=FakeClock(), **kw)


def _inputs(lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = paged(lens, P, generator=g)
    q = torch.randn(len(lens), HQ, D, generator=g).bfloat16()
    kv = torch.randn(t.num_pages, 2, P, HKV, D, generator=g).bfloat16()
    return t, q, kv


def _single_rank(plan, t, q, kv):
    """The same parts computed rank by rank in one thread, each request merged in part order."""
    rs, indices = ranked_decode_schedule(plan, t.kv_indptr, t.kv_indices, HQ, HKV, D, P)
    parts = {}
    for r in range(plan.world):
        o, lse = rank_partials(rs, indices, r, q, kv)
        for k, i in enumerate(plan.on(r)):
            parts[int(i)] = (o[k], lse[k])
    out, lse = [], []
    for b in range(len(plan.kv_len)):
        idx = sorted(np.flatnonzero(plan.req == b), key=lambda i: plan.part[i])
        mo, ml = merge_partials(np.stack([parts[i][1] for i in idx]), np.stack([parts[i][0] for i in idx]))
        out.append(mo)
        lse.append(ml)
    return torch.from_numpy(np.stack(out)), torch.from_numpy(np.stack(lse))


# --- plans ---------------------------------------------------------------------------------------------------
def test_shard_plans_cover_every_request_and_split_the_long_ones():
    plan = shard_batch(LENS, P, 3, min_split_tokens=16)
    assert plan.world == 3 and plan.num_parts.tolist() == [1, 1, 3, 3, 1, 3, 1, 1]
    for b in (2, 3, 5):   # split over every rank, cuts on pages, owner = part 0's rank
        idx = np.flatnonzero(plan.req == b)
        assert sorted(plan.rank[idx].tolist()) == [0, 1, 2] and all(plan.begin[i] % P == 0 for i in idx)
    assert np.bincount(plan.rank, weights=plan.end - plan.begin, minlength=3).max() <= 120
    assert shard_batch(LENS, P, 1).num_parts.tolist() == [1] * len(LENS)
    with pytest.raises(ValueError, match="world must be a positive int, got 0"):
        shard_batch(LENS, P, 0)
    with pytest.raises(ValueError, match="lengths >= 0"):
        shard_batch([3, -1], P, 2)


# --- the transport -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ordered", [True, False])
def test_a_fetch_add_lands_behind_the_puts_before_it(ordered):
    """Puts staged in the sender's own window travel as 3-element chunks through its command ring; each
    fetch-add finds the row before it whole, in either landing order."""
    tr = _transport(2, ordered=ordered, seed=3, max_delay=1e-5, chunk=3, ring_capacity=4)
    try:
        w = tr.window("w", (4, 10), np.float64, np.nan)
        tr.window("n", (4,), np.int64, 0)
        for i in range(4):
            tr.put(0, 1, "w", i, np.arange(10) + 10 * i)
            assert tr.fetch_add(0, 1, "n", i, 5) == 0
            assert np.array_equal(tr.get(0, 1, "w", i), np.arange(10) + 10 * i)
        assert tr.fetch_add(0, 1, "n", 2, 1) == 5
        tr.quiet(0)
        assert np.array_equal(w[1], w[0]) and np.array_equal(w[1][3], np.arange(30, 40))   # w[0]: the staging
        landed = tr.landed()
        assert landed["w"].max() == 1 and np.count_nonzero(landed["w"]) == 40 and not landed["n"].any()
        assert tr.rings[0].tail == tr.rings[0].head == 9 and tr.rings[1].tail == 0   # 4 puts, 5 adds; the ring wrapped
    finally:
        tr.close()


def test_a_stuck_operation_names_itself():
    tr = _transport(2, timeout=0.2)
    tr.window("n", (1,), np.int64, 0)
    tr.close()   # no proxy: nothing lands
    with pytest.raises(TimeoutError, match=r"rank 1: fetch_add on rank 0's n\[0\] did not land in 0.2 s"):
        tr.fetch_add(1, 0, "n", 0, 1)
    with pytest.raises(TimeoutError, match="rank 1: 1 operations did not land"):
        tr.quiet(1)



def test_an_observer_sees_every_state_and_a_waits_condition_raises_in_its_rank():
    """observe: the condition runs right after each landing, whatever the threads' timing, so a counter that 50
    signals raise one at a time is seen at every value 0..50 (a condition evaluated when its thread wakes would
    skip values the proxy landed meanwhile). wait_for: what the condition raises is raised in the waiting rank,
    and the proxy goes on landing."""
    tr = _transport(2, seed=1, max_delay=1e-5)
    n = tr.window("n", (1,), np.int64, 0)
    seen: list[int] = []

    def count() -> bool:
        if not seen or seen[-1] != int(n[1][0]):
            seen.append(int(n[1][0]))
        return seen[-1] == 50
    try:
        tr.observe(count)
        for _ in range(50):
            tr.signal(0, 1, "n", 0, 1)
        tr.quiet(0)
        assert seen == list(range(51))
        raised, waiting = [], threading.Event()

        def ready():   # (first run in rank 1's thread as it starts waiting; it raises in the proxy's, at signal 51)
            waiting.set()
            return None if n[1][0] < 51 else 1 // 0

        def rank(r: int) -> None:
            if r == 0:   # (only once rank 1 waits: the landing, and so the raise, is the proxy thread's)
                waiting.wait()
                tr.signal(0, 1, "n", 0, 1)
                return
            try:
                tr.wait_for(1, ready, "a condition that raises")
            except ZeroDivisionError as e:
                raised.append(e)
        run_ranks(2, rank)
        assert len(raised) == 1
        tr.signal(0, 1, "n", 0, 1)
        assert tr.wait_for(1, lambda: int(n[1][0]) if n[1][0] == 52 else None, "the 52nd signal") == 52
    finally:
        tr.close()

# --- sequence-parallel decode ------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("ordered", [True, False])
def test_seq_parallel_equals_single_rank_under_any_landing_order(world, ordered):
    t, q, kv = _inputs(LENS)
    plan = shard_batch(LENS, P, world, min_split_tokens=16)
    want_o, want_lse = _single_rank(plan, t, q, kv)
    ref_o, ref_lse = attention_reference(q, kv, t.kv_indptr, t.kv_indices, t.kv_last_page_len)
    for seed in range(3):
        tr = _transport(world, ordered=ordered, seed=seed, max_delay=2e-5, chunk=64)
        try:
            out, lse = seq_parallel_decode(plan, tr, q, kv, t.kv_indptr, t.kv_indices)
        finally:
            tr.close()
        assert torch.equal(out, want_o) and torch.equal(lse, want_lse), f"seed {seed}: differs from one rank"
        assert torch.allclose(out, ref_o, atol=1e-12) and torch.allclose(lse[ref_lse > -np.inf],
                                                                        ref_lse[ref_lse > -np.inf], atol=1e-12)
        counts = [int(tr.get(0, int(plan.owner[b]), "attn.count", b)) for b in range(len(LENS))]
        assert counts == plan.num_parts.tolist()                             # every part counted once
        assert all(c.max() <= 1 for c in tr.landed().values())               # nothing landed twice
        most = int(plan.num_parts.max())
        landed = set(zip(*map(np.ndarray.tolist, np.nonzero(tr.landed()["attn.parts"]))))
        want = {(int(plan.owner[b]), (b * most + p) * HQ * (D + 1) + e)      # every partial whole at its owner
                for b, p in zip(plan.req.tolist(), plan.part.tolist()) for e in range(HQ * (D + 1))}
        assert landed == want


def test_a_count_that_overtakes_its_data_is_caught():
    """fence=False lets a fetch-add land before the puts before it: the last part then merges a partial
    that has not landed (NaN-poisoned), and the comparison above fails. With the fence it never does."""
    t, q, kv = _inputs(LENS)
    plan = shard_batch(LENS, P, 2, min_split_tokens=16)
    want_o, _ = _single_rank(plan, t, q, kv)
    caught = 0
    for seed in range(8):   # caught in 28 of 30 runs measured; 4 of 8 leaves about a 1-in-16000 chance of a false alarm
        tr = _transport(2, ordered=False, seed=seed, max_delay=2e-5, chunk=16, fence=False)
        try:
            out, _ = seq_parallel_decode(plan, tr, q, kv, t.kv_indptr, t.kv_indices)
        finally:
            tr.close()
        caught += not torch.equal(out, want_o)
    assert caught >= 4


def test_window_layout_places_do_not_overlap_and_are_aligned():
    from meld.distributed import WindowLayout

    L = WindowLayout.of(max_batch=5, world=3, num_qo_heads=12, head_dim=64, units_per_request=6)
    places = [(L.out, 5 * 12 * 64 * 2), (L.lse, 5 * 12 * 4), (L.part_o, 5 * 3 * 12 * 64 * 4), (L.part_lse, 5 * 3 * 12 * 4),
              (L.counts, 5 * 6 * 8), (L.landed, 3 * 8), (L.started, 3 * 8)]
    for (a, n), (b, _) in zip(places, places[1:]):
        assert a % 256 == 0 and a + n <= b
    assert places[-1][0] + 8 <= L.nbytes


def test_seq_parallel_decode_needs_a_process_group():
    import torch.distributed as dist

    from meld.distributed import SeqParallelDecode

    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group exists in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        SeqParallelDecode(32, 8, 128, 16, max_batch_size=4, max_num_pages=64)


def test_local_tables_cover_each_ranks_token_ranges():
    """Every rank's local batch reads exactly the pages of its parts' token ranges, with the right last-page fill."""
    lens = [0, 5, 40000, 17, 9000, 33000]
    P = 16
    plan = shard_batch(lens, P, 3, min_split_tokens=1000)
    pages = [-(-n // P) for n in lens]
    indptr = np.r_[0, np.cumsum(pages)]
    indices = np.random.default_rng(0).permutation(indptr[-1]).astype(np.int32)
    for r in range(3):
        idx, ip, ind, last = plan.local_tables(r, indptr, indices, P)
        assert np.array_equal(idx, plan.on(r))
        for k, i in enumerate(idx):
            b, lo, hi = plan.req[i], plan.begin[i], plan.end[i]
            assert np.array_equal(ind[ip[k]:ip[k + 1]], indices[indptr[b] + lo // P:indptr[b] + -(-hi // P)])
            n = ip[k + 1] - ip[k]
            assert (n - 1) * P + last[k] == hi - lo if n else hi == lo


# --- row-parallel GEMM with a per-tile all-reduce ---------------------------------------------------------
def _tp_case(world, m, n, k, sm_count, seed=0):
    from meld.codegen.tp_kernel import TpKernelConfig, TpSchedule

    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal((m, k)) for _ in range(world)]
    ws = [rng.standard_normal((n, k)) for _ in range(world)]
    return xs, ws, TpSchedule.of(m, n, k, sm_count, TpKernelConfig())


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("m, n, k, sm_count", [(70, 150, 133, 132), (5, 136, 1000, 8), (300, 72, 200, 4)])
@pytest.mark.parametrize("merge", ["owner", "every_rank", "direct"])
def test_row_parallel_matmul_reduces_every_tile_once_in_order(world, ordered, m, n, k, sm_count, merge):
    """The GPU kernel's schedule (TpSchedule: token blocks, 64-column tiles, K split into pieces where
    tiles are few; sizes not multiples of any of them); pieces finishing in a different order on every
    rank; every rank's y bit-identical to the single-rank sum in (rank, split) order and close to the
    product; each tile counted once per part and every element of every partial landed once. (The direct
    path runs two launches, the second on 2 x: one in each parity slot.)"""
    from meld.distributed.tp_matmul import single_rank_reference

    xs, ws, sched = _tp_case(world, m, n, k, sm_count, seed=world)
    launches = 2 if merge == "direct" else 1
    xs_last = [x * launches for x in xs]
    want = single_rank_reference(xs_last, ws, sched)
    exact = sum(x @ w.T for x, w in zip(xs_last, ws))
    for seed in range(2):
        tr = _transport(world, ordered=ordered, seed=seed, max_delay=1e-5, chunk=500)
        try:
            ys = row_parallel_matmul(tr, xs, ws, sched, seed=seed, merge=merge, launches=launches)
        finally:
            tr.close()
        for r, y in enumerate(ys):
            assert np.array_equal(y, want), f"rank {r}, seed {seed}: differs from the single-rank sum"
            np.testing.assert_allclose(y, exact, rtol=1e-10, atol=1e-10)
        parts = world * sched.k_splits
        counts = tr.landed()
        assert all(c.max() <= 1 for c in counts.values())
        landed = np.count_nonzero(counts["y.ll" if merge == "direct" else "y.parts"])
        if merge == "owner":
            assert [int(tr.get(0, o % world, "y.count", o)) for o in range(sched.out_tiles)] == [parts] * sched.out_tiles
            assert landed == sched.out_tiles * parts * sched.block_tokens * sched.cols
        elif merge == "direct":   # every piece's partial in every rank's window, in both launches' slots
            assert landed == 2 * sched.pieces * world * world * sched.block_tokens * sched.cols
            assert all((tr.get(r, r, "y.ll", (launch % 2,))["tag"] == launch).all()
                       for r in range(world) for launch in (1, 2))
        else:   # every partial on every rank; each CTA's stamp on every rank counts its chunks
            assert landed == sched.out_tiles * parts * world * sched.block_tokens * sched.cols
            G = max(1, (sched.pieces + 2) // 3)
            sent = [len(range(c, sched.pieces, G)) * sched.merge_chunks[1] for c in range(G)]
            assert all([int(tr.get(r, r, "y.stamp", (s, c))) for c in range(G)] == sent
                       for r in range(world) for s in range(world))


def test_row_parallel_schedule_splits_k_where_tiles_are_few():
    """(The case above with 8 SMs cuts K in pieces: the emulation covers the kernel's split path.)"""
    _, _, sched = _tp_case(2, 5, 136, 1000, 8)
    assert sched.k_splits > 1 and sched.pieces > sched.out_tiles


@pytest.mark.parametrize("world, m, n, k, sm_count", [(2, 3, 136, 1000, 8), (3, 16, 200, 96, 132)])
def test_direct_path_ranks_a_launch_apart_read_only_their_launch(world, m, n, k, sm_count):
    """Five direct launches back to back (launch l on x * l), ranks never waiting for each other between them,
    deliveries delayed and reordered: a rank a launch ahead writes the other parity's slots, and a word is
    summed only once it carries its launch's tag (a stale word of launch l - 2 in the same slot would make
    the last launch's y differ from the single-rank sum)."""
    from meld.distributed.tp_matmul import single_rank_reference

    xs, ws, sched = _tp_case(world, m, n, k, sm_count, seed=7)
    want = single_rank_reference([x * 5 for x in xs], ws, sched)
    for seed in range(3):
        tr = _transport(world, ordered=False, seed=seed, max_delay=2e-5, chunk=64)
        try:
            ys = row_parallel_matmul(tr, xs, ws, sched, seed=seed, merge="direct", launches=5)
        finally:
            tr.close()
        assert all(np.array_equal(y, want) for y in ys), f"seed {seed}"


@pytest.mark.parametrize("merge", ["owner", "every_rank"])
def test_row_parallel_matmul_catches_a_sum_that_overtakes_its_parts(merge):
    """With fence=False a count or signal can land before its partial: the merge then sums a NaN-poisoned
    slot."""
    from meld.distributed.tp_matmul import single_rank_reference

    xs, ws, sched = _tp_case(2, 64, 128, 96, 132)
    want = single_rank_reference(xs, ws, sched)
    caught = 0
    for seed in range(6):   # caught in 30 of 30 runs measured, each merge
        tr = _transport(2, ordered=False, seed=seed, max_delay=2e-5, chunk=64, fence=False)
        try:
            ys = row_parallel_matmul(tr, xs, ws, sched, seed=seed, merge=merge)
        finally:
            tr.close()
        caught += any(not np.array_equal(y, want) for y in ys)
    assert caught >= 3


def test_ranked_schedule_edges_json_and_validation():
    """The rank dimension in the IR: every part of a split request is an edge to its owner (crossing ranks
    unless it is part 0), JSON round-trips, and a lost or doubled part is a ScheduleError."""
    import dataclasses

    from meld.ir import RankedSchedule, ScheduleError

    t, _, _ = _inputs(LENS)
    plan = shard_batch(LENS, P, 3, min_split_tokens=16)
    rs, _ = ranked_decode_schedule(plan, t.kv_indptr, t.kv_indices, HQ, HKV, D, P)
    split = plan.num_parts > 1
    assert split.any() and (~split).any()
    assert len(rs.edges) == int(plan.num_parts[split].sum())
    assert sum(e.crosses for e in rs.edges) == int((plan.num_parts[split] - 1).sum())   # part 0 is at its owner
    assert np.array_equal(rs.owner(), plan.owner) and np.array_equal(rs.parts_of(), plan.num_parts)
    assert RankedSchedule.from_json(rs.to_json()) == rs
    r = int(plan.rank[np.flatnonzero(plan.num_parts[plan.req] > 1)[0]])
    lost = dataclasses.replace(rs, key=[k if i != r else k[1:] for i, k in enumerate(rs.key)])
    with pytest.raises(ScheduleError):
        lost.validate()
    doubled = dataclasses.replace(rs, part=[np.zeros_like(p) for p in rs.part])
    with pytest.raises(ScheduleError, match="parts"):
        doubled.validate()


# --- expert-parallel MoE ----------------------------------------------------------------------------------
def _moe_inputs(world, tokens, seed=0, E=8, H=24, I=16, k=3):
    rng = np.random.default_rng(seed)
    w13, w2 = rng.standard_normal((E, 2 * I, H)) / 4, rng.standard_normal((E, H, I)) / 4
    xs, ids, wts = [], [], []
    for T in tokens:
        p = np.r_[8.0, np.ones(E - 1)]                     # expert 0 is hot
        ids.append(np.array([rng.choice(E, k, replace=False, p=p / p.sum()) for _ in range(T)], dtype=np.int64).reshape(T, k))
        wts.append(rng.random((T, k)))
        xs.append(rng.standard_normal((T, H)))
    return xs, ids, wts, w13, w2


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("ordered", [True, False])
def test_expert_parallel_moe_equals_single_rank_under_any_landing_order(world, ordered):
    """Uneven tokens per rank (one rank with none at 3 ranks), a hot expert: every rank's output is bit-identical
    to the single-rank MoE of its tokens; every rank's dispatch and return counted once on every other; nothing
    landed twice."""
    from meld.distributed.ep_moe import expert_parallel_moe, single_rank_reference

    tokens = [7, 3] if world == 2 else [5, 0, 9]
    xs, ids, wts, w13, w2 = _moe_inputs(world, tokens)
    for seed in range(2):
        tr = _transport(world, ordered=ordered, seed=seed, max_delay=1e-5, chunk=10)
        try:
            ys = expert_parallel_moe(tr, xs, ids, wts, w13, w2)
        finally:
            tr.close()
        for r in range(world):
            assert np.array_equal(ys[r], single_rank_reference(xs[r], ids[r], wts[r], w13, w2)), f"rank {r}"
        for name in ("ep.sent", "ep.back"):
            counts = np.array([[int(tr.get(0, r, name, s)) for s in range(world)] for r in range(world)])
            assert np.array_equal(counts, 1 - np.eye(world, dtype=np.int64)), (name, counts)
        counts = tr.landed()
        assert any(c.any() for c in counts.values()) and all(c.max() <= 1 for c in counts.values())


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("ordered", [True, False])
def test_compact_expert_parallel_moe_moves_only_the_rows_each_rank_needs(world, ordered):
    """compact=True (issue 43's compacted blocks): the same bits as the single-rank MoE (so as the whole-block
    protocol), with exactly the rows routed to another rank's experts crossing, there and back, against
    world - 1 whole blocks a rank before; every count once."""
    from meld.distributed.ep_moe import expert_owner, expert_parallel_moe, single_rank_reference

    tokens = [7, 3] if world == 2 else [5, 0, 9]
    xs, ids, wts, w13, w2 = _moe_inputs(world, tokens)
    H, owner = w13.shape[2], expert_owner(w13.shape[0], world)
    remote = sum(int((owner[ids[r]] != r).sum()) for r in range(world))   # pairs served by another rank
    moved = {}
    for compact in (False, True):
        tr = _transport(world, ordered=ordered, seed=1, max_delay=1e-5, chunk=10)
        try:
            ys = expert_parallel_moe(tr, xs, ids, wts, w13, w2, compact=compact)
        finally:
            tr.close()
        for r in range(world):
            assert np.array_equal(ys[r], single_rank_reference(xs[r], ids[r], wts[r], w13, w2)), (compact, r)
        landed = tr.landed()
        assert all(c.max() <= 1 for c in landed.values())
        moved[compact] = (int(landed["ep.rows"].sum()), int(landed["ep.ret"].sum()))
        if compact:
            sent = np.array([[int(tr.get(0, r, "ep.sent", s)) for s in range(world)] for r in range(world)])
            want = [[0 if r == s else int((owner[ids[s]] == r).sum()) + 1 for s in range(world)] for r in range(world)]
            assert np.array_equal(sent, want)   # each count: the rows plus one
    assert moved[True] == (remote * H, remote * H)
    assert moved[False][0] == world * (world - 1) * max(tokens) * ids[0].shape[1] * H > moved[True][0]


def test_expert_parallel_moe_catches_a_count_that_overtakes_its_rows():
    """fence=False: a count can land before the block it follows; the expert rank then reads rows still in
    flight (NaN), or a source sums expert rows still in flight: its outputs are wrong or NaN: caught."""
    from meld.distributed.ep_moe import expert_parallel_moe, single_rank_reference

    xs, ids, wts, w13, w2 = _moe_inputs(2, [8, 8], seed=1)
    caught = 0
    for seed in range(4):   # caught in 30 of 30 runs measured (by the outputs; no wait timed out)
        tr = _transport(2, ordered=False, seed=seed, max_delay=2e-5, chunk=4, fence=False, timeout=2.0)
        try:
            ys = expert_parallel_moe(tr, xs, ids, wts, w13, w2)
            caught += any(not np.array_equal(ys[r], single_rank_reference(xs[r], ids[r], wts[r], w13, w2))
                          for r in range(2))
        except TimeoutError:
            caught += 1
        finally:
            tr.close()
    assert caught >= 2


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("tile_rows", [2, 16])
def test_one_launch_ep_moe_equals_single_rank_and_moves_only_what_each_rank_needs(world, ordered, tile_rows):
    """Issue 43 item 1's protocol: ragged tokens per rank (none on one rank at 3), a hot expert; bit-identical to
    the single-rank MoE; exactly the remote pairs' rows cross each way; every count and every tile signalled
    once."""
    from meld.distributed.ep_moe import expert_owner, expert_tiles, one_launch_ep_moe, single_rank_reference

    tokens = [7, 3] if world == 2 else [5, 0, 9]
    xs, ids, wts, w13, w2 = _moe_inputs(world, tokens)
    H, owner = w13.shape[2], expert_owner(w13.shape[0], world)
    remote = sum(int((owner[ids[r]] != r).sum()) for r in range(world))
    tr = _transport(world, ordered=ordered, seed=2, max_delay=1e-5, chunk=10)
    try:
        ys = one_launch_ep_moe(tr, xs, w13, w2, topk=(ids, wts), tile_rows=tile_rows)
    finally:
        tr.close()
    for r in range(world):
        assert np.array_equal(ys[r], single_rank_reference(xs[r], ids[r], wts[r], w13, w2)), f"rank {r}"
    landed = tr.landed()
    assert all(c.max() <= 1 for c in landed.values())
    assert int(landed["ep1.rows"].sum()) == int(landed["ep1.ret"].sum()) == remote * H
    for r in range(world):
        for s in range(world):
            mine = ids[s].reshape(-1)[owner[ids[s].reshape(-1)] == r]
            done = tr.get(0, s, "ep1.done", r)
            assert done.sum() == len(expert_tiles(mine, tile_rows)[1]) and done.max(initial=0) <= 1, (r, s)
            if r != s:
                assert int(tr.get(0, r, "ep1.sent", s)) == len(mine) + 1


def test_one_launch_ep_moe_routes_router_logits_as_meld_moe_does():
    """The router_logits path: each rank's logits routed by meld.MoE's routing (softmax, top-k, renormalised),
    then the same protocol: equal to the single-rank MoE over those ids and weights."""
    from meld.distributed.ep_moe import one_launch_ep_moe, single_rank_reference
    from meld.runtime.moe_reference import route

    xs, _, _, w13, w2 = _moe_inputs(3, [6, 1, 4], seed=3)
    rng = np.random.default_rng(4)
    logits = [rng.standard_normal((len(x), w13.shape[0])).astype(np.float32) for x in xs]
    tr = _transport(3, ordered=False, seed=0, max_delay=1e-5)
    try:
        ys = one_launch_ep_moe(tr, xs, w13, w2, router_logits=logits, top_k=2)
    finally:
        tr.close()
    for r in range(3):
        i, w = route(torch.as_tensor(logits[r]), 2, True)
        assert np.array_equal(ys[r], single_rank_reference(xs[r], i.numpy(), w.double().numpy(), w13, w2))


def test_one_launch_ep_moe_serves_and_combines_without_waiting_for_a_late_rank():
    """Rank 2's launch is held back until rank 0 has combined token 0, whose experts live on ranks 0 and 1: rank 1
    serves rank 0's pairs and rank 0 combines that token before rank 2 has dispatched anything (a tile starts on
    its source's count, a token combines on its own tiles: no barrier); then every result is exact. (Rank 0's
    other tokens may combine earlier or later: only token 0's order is fixed, so nothing here depends on timing.)"""
    import threading

    from meld.distributed.ep_moe import one_launch_ep_moe, single_rank_reference

    xs, ids, wts, w13, w2 = _moe_inputs(3, [4, 3, 5], seed=5)
    ids[0][0] = [0, 3, 4]   # token 0 of rank 0: experts on ranks 0 and 1 only (owners 0,0,0,1,1,1,2,2)
    release = threading.Event()

    class Log(list):
        def append(self, item):
            super().append(item)
            if item[1:] == (0, "combine", 0):
                release.set()

    class HeldRank(EmulatedTransport):
        def _issue(self, src, *args, **kw):
            if src == 2:
                assert release.wait(10), "rank 0 did not combine token 0 while rank 2 was held"
            super()._issue(src, *args, **kw)

    log = Log()
    tr = HeldRank(3, ordered=False, seed=1, max_delay=1e-5, clock=FakeClock())
    try:
        ys = one_launch_ep_moe(tr, xs, w13, w2, topk=(ids, wts), tile_rows=2, log=log)
    finally:
        tr.close()
    events = [(r, what, d) for _, r, what, d in log]
    combined0 = events.index((0, "combine", 0))
    assert (0, "count", 2) in events[combined0:], "rank 0 heard rank 2 before it combined token 0"
    assert not any(e[:2] == (2, "tile") for e in events[:combined0]), "rank 2 served a tile while it was held"
    assert any(e[:2] == (1, "tile") and e[2][0] == 0 for e in events[:combined0]), "rank 1 served none of rank 0's"
    for r in range(3):
        assert np.array_equal(ys[r], single_rank_reference(xs[r], ids[r], wts[r], w13, w2)), f"rank {r}"


def test_one_launch_ep_moe_names_a_bad_routing_argument():
    from meld.distributed.ep_moe import one_launch_ep_moe

    xs, ids, wts, w13, w2 = _moe_inputs(2, [2, 2])
    tr = _transport(2)
    try:
        with pytest.raises(ValueError, match="either topk"):
            one_launch_ep_moe(tr, xs, w13, w2)
        with pytest.raises(ValueError, match="top_k=0"):
            one_launch_ep_moe(tr, xs, w13, w2, router_logits=[np.zeros((2, 8))] * 2)
    finally:
        tr.close()


def test_shard_plan_validation_names_the_broken_request():
    import dataclasses

    plan = shard_batch([40, 3, 90], 4, 2, min_split_tokens=10)
    assert plan.num_parts.tolist() == [2, 1, 2]
    i = int(np.flatnonzero((plan.req == 2) & (plan.part == 1))[0])
    broken = {
        "parts": dataclasses.replace(plan, part=np.where(np.arange(len(plan.part)) == i, 0, plan.part)),
        "cover": dataclasses.replace(plan, begin=np.where(np.arange(len(plan.begin)) == i, plan.begin + 4, plan.begin)),
        "owner": dataclasses.replace(plan, owner=np.where(np.arange(3) == 2, 1 - plan.owner, plan.owner)),
        "outside": dataclasses.replace(plan, rank=np.where(np.arange(len(plan.rank)) == i, 2, plan.rank)),
    }
    for what, bad in broken.items():
        with pytest.raises(ValueError, match="request 2|ranks outside") as e:
            bad.validate()
        assert what != "outside" or "ranks outside [0, 2)" in str(e.value)
    assert plan.validate() is plan


def test_a_put_of_a_blocks_first_rows_lands_them_alone():
    """A put's index may end in a unit-step slice (the first n rows of a block: compacted EP blocks); it lands
    those elements and no others, and a strided range is refused by name."""
    tr = _transport(2)
    try:
        win = tr.window("w", (2, 3, 4), np.float64, np.nan)
        tr.put(0, 1, "w", (1, slice(0, 2)), np.arange(8.0).reshape(2, 4))
        tr.quiet(0)
        assert np.array_equal(win[1][1, :2], np.arange(8.0).reshape(2, 4)) and np.isnan(win[1][1, 2]).all()
        assert np.isnan(win[1][0]).all() and tr.landed()["w"][1].sum() == 8
        with pytest.raises(ValueError, match="not a contiguous range"):
            tr.put(0, 1, "w", (1, 0, slice(0, 4, 2)), np.zeros(2))
    finally:
        tr.close()
