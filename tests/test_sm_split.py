"""The adaptive compute/communication split (meld.distributed.sm_split) on the CPU: the controller's estimate,
the slot protocol's invariants in modelled time, adaptive against every fixed split on workloads whose best
fixed split differs, and a GEMM + reduce-scatter replayed on emulated ranks through the transport."""
import numpy as np
import pytest

from meld.distributed.sm_split import (COMM, COMPUTE, Counters, SlotCosts, SplitController, SplitWorkload,
                                       best_fixed, run_split_gemm_rs, simulate)
from meld.distributed.transport import EmulatedTransport

SLOTS = 16
# (tiles, compute µs a tile, KiB a tile, dependency, link GB/s): compute-bound to link-bound, both dependency
# directions and none
CASES = [(256, 20.0, 32, "produce", 100), (256, 2.0, 128, "produce", 100), (512, 8.0, 32, "produce", 100),
         (256, 20.0, 32, "consume", 100), (512, 8.0, 64, "consume", 100), (256, 4.0, 16, "consume", 60),
         (256, 10.0, 32, "none", 100), (256, 30.0, 8, "consume", 400)]


def _costs(compute_us: float, link_gbs: float = 100) -> SlotCosts:
    # a slot moves 20 GB/s; 2 µs a transfer's round trip
    return SlotCosts(compute_us * 1e-6, 2e-6, 20e9, link_gbs * 1e9)


def _work(tiles: int, kib: int, dep: str) -> SplitWorkload:
    order = tuple(range(tiles))
    return SplitWorkload(tiles, (kib << 10,) * tiles, comm_after=order if dep == "produce" else None,
                         compute_after=order if dep == "consume" else None)


def test_controller_moves_halfway_to_equal_finish_times():
    ctl = SplitController(slots=10, target=1, period=4)
    c = Counters(left=[10, 30])
    for _ in range(4):
        c.finish(COMPUTE, 1.0)
    for _ in range(2):
        c.finish(COMM, 0.5)
    ctl.update(1.0, c)   # compute 6 x 1 s, communication 28 x 0.5 s: 10 x 14 / 20 = 7 slots; halfway from 1: 4
    assert ctl.target == 4 and ctl.history == [(1.0, 4)]
    assert c.recent_comm == 0 and c.recent_time == 0.0
    ctl.update(2.0, c)   # no communication sample this period: the target stays
    assert ctl.target == 4
    c.left[COMM] = 10_000
    for _ in range(6):   # communication is nearly everything left: the target climbs to 9, never every slot
        c.finish(COMM, 1.0)
        ctl.update(3.0, c)
    assert [t for _, t in ctl.history[2:]] == [7, 8, 9, 9, 9, 9]


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("case", CASES[:2] + CASES[3:5] + CASES[6:7])
def test_every_task_once_in_dependency_order_one_at_a_time_a_slot(case, adaptive):
    tiles, us, kib, dep, link = case
    work, costs = _work(tiles, kib, dep), _costs(us, link)
    run = simulate(work, costs, SLOTS, 3, adaptive=adaptive)
    for kind, n in ((COMPUTE, work.compute), (COMM, work.comm)):
        assert sorted(t.index for t in run.runs if t.kind == kind) == list(range(n))
    end = {(t.kind, t.index): t.end for t in run.runs}
    start = {(t.kind, t.index): t.start for t in run.runs}
    for j, i in enumerate(work.comm_after or ()):
        assert start[(COMM, j)] >= end[(COMPUTE, i)]
    for i, j in enumerate(work.compute_after or ()):
        assert start[(COMPUTE, i)] >= end[(COMM, j)]
    for s in range(SLOTS):
        mine = sorted((t.start, t.end) for t in run.runs if t.slot == s)
        assert all(a[1] <= b[0] for a, b in zip(mine, mine[1:]))
    assert run.makespan == max(t.end for t in run.runs)
    # no faster than the compute spread over every slot, or the bytes over the link
    assert run.makespan >= work.compute * costs.compute_s / SLOTS * (1 - 1e-12)
    assert run.makespan >= sum(work.comm_bytes) / costs.link_rate * (1 - 1e-12)
    assert [t for _, t in run.targets][0] == 3 and all(1 <= t < SLOTS for _, t in run.targets)
    assert adaptive or len(run.targets) == 1
    # replaying the finish order meets every dependency
    seen = set()
    for t in run.order():
        if t.kind == COMM and work.comm_after is not None:
            assert (COMPUTE, work.comm_after[t.index]) in seen
        if t.kind == COMPUTE and work.compute_after is not None:
            assert (COMM, work.compute_after[t.index]) in seen
        seen.add((t.kind, t.index))


def test_adaptive_is_near_the_best_fixed_split_from_any_start():
    """Adaptive against the best of all 15 fixed splits, started from 1, 4, 8 and 15 communication slots:
    within 5% in the geomean and 16% in every case, where staying at the start costs up to 44%. Started high
    in a link-bound case with a dependent GEMM (16 KiB tiles over a 60 GB/s link) it stays 14-15% off: on a full
    link each transfer takes longer the more slots share it, which the estimate reads as more to move.
    And the best fixed split differs between the cases (what a fixed split would have to be tuned for)."""
    bests, ratios = [], []
    for tiles, us, kib, dep, link in CASES:
        work, costs = _work(tiles, kib, dep), _costs(us, link)
        best, span, spans = best_fixed(work, costs, SLOTS)
        bests.append(best)
        for start in (1, 4, 8, SLOTS - 1):
            ratios.append(simulate(work, costs, SLOTS, start).makespan / span)
            assert ratios[-1] <= 1.16, ((tiles, us, kib, dep, link), start, ratios[-1], spans[start] / span)
    assert np.exp(np.mean(np.log(ratios))) <= 1.05, ratios
    assert max(bests) - min(bests) >= 10, bests


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="link_rate"):
        SlotCosts(1e-6, 0.0, 1e9, 0.0)
    with pytest.raises(ValueError, match="latency_s"):
        SlotCosts(1e-6, -1.0, 1e9, 1e9)
    with pytest.raises(ValueError, match="compute_s"):
        SlotCosts(float("nan"), 0.0, 1e9, 1e9)
    with pytest.raises(ValueError, match="comm_after"):
        SplitWorkload(2, (8, 8), comm_after=(0, 2))
    with pytest.raises(ValueError, match="not both"):
        SplitWorkload(1, (8,), comm_after=(0,), compute_after=(0,))
    with pytest.raises(ValueError, match="comm_bytes"):
        SplitWorkload(1, (-8,))
    with pytest.raises(ValueError, match="target"):
        simulate(_work(4, 1, "none"), _costs(1.0), 4, 4)
    with pytest.raises(TypeError, match="work"):
        simulate((4, 4), _costs(1.0), 4, 1)
    with pytest.raises(ValueError, match="slots"):
        simulate(_work(4, 1, "none"), _costs(1.0), 1, 1)
    with pytest.raises(TypeError, match="costs"):
        simulate(_work(4, 1, "none"), 1.0, 4, 1)


@pytest.mark.parametrize("world", [2, 3])
def test_gemm_reduce_scatter_on_emulated_ranks_does_not_depend_on_the_split(world):
    """Each rank runs its tasks in its simulated finish order and moves partials through the transport
    (unordered landings); each owner's tiles match float64's product, and fixed and adaptive splits give the
    same bits (the parts are summed in rank order)."""
    rng = np.random.default_rng(world)
    m, k, n, cols = 5, 24, 70, 16   # 5 tiles, the last one partial
    x = [rng.standard_normal((m, k)) for _ in range(world)]
    w = [rng.standard_normal((n, k)) for _ in range(world)]
    ref = sum(xr @ wr.T for xr, wr in zip(x, w))
    outs = []
    for adaptive, target in ((False, 1), (False, 6), (True, 1)):
        tr = EmulatedTransport(world, ordered=False, seed=world, max_delay=0.0)
        try:
            y = run_split_gemm_rs(x, w, cols, _costs(1.0), 8, target, adaptive, transport=tr)
        finally:
            tr.close()
        for r in range(world):
            own = np.zeros(n, dtype=bool)
            for t in range(r, -(-n // cols), world):
                own[t * cols:(t + 1) * cols] = True
            np.testing.assert_allclose(y[r][:, own], ref[:, own], rtol=1e-12, atol=1e-12)
            assert np.isnan(y[r][:, ~own]).all()
        outs.append(y)
    for y in outs[1:]:
        for r in range(world):
            assert np.array_equal(y[r], outs[0][r], equal_nan=True)
