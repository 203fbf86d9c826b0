"""The grouped-attention kernel (meld.CascadeDecode on a GPU) against float64 on fresh random inputs, each of its
builds (split_stream "cta": split tasks through the CTA's ring; "warp": through each warp's own ring, with
prefix_mma="mma"; "wgmma": the warp build with a shared prefix's tasks of more than 16 rows on wgmma, the
operator's default at head_dim 64 and 128; every "warp" build counts a split task and runs the merges it completes
after the CTA's last task, defer_split_events, the operator's default there; "nodefer": the default counting after each
task instead; "warp-direct": the mma build with direct_single_part, a split task that is its event's one part writing
the output; "nodefer-direct": the default with direct_single_part and without defer_split_events; "w4", "w4-mma":
four warps a CTA, two CTAs an SM, wgmma and mma prefixes; "w4-stagger": w4 with the second half's CTAs walking last
to first)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import meld
from meld.runtime.reference import cascade_reference

pytestmark = pytest.mark.gpu

HKV, P = 2, 16
BUILDS = {"cta": dict(split_stream="cta"), "warp": dict(split_stream="warp", prefix_mma="mma"),
          "wgmma": dict(prefix_mma="wgmma"), "nodefer": dict(defer_split_events=False),
          "warp-direct": dict(prefix_mma="mma", direct_single_part=True),
          "nodefer-direct": dict(defer_split_events=False, direct_single_part=True),
          "w4": dict(warps=4), "w4-mma": dict(warps=4, prefix_mma="mma"), "w4-stagger": dict(warps=4, stagger=True)}
every_build = pytest.mark.parametrize("build", list(BUILDS.values()), ids=list(BUILDS))


def _levels(prefix_groups, prefix_lens, suffix_lens, seed):
    """Two levels (a prefix per group, a suffix per request) on shuffled fresh pages, FlashInfer's layout."""
    rng = np.random.default_rng(seed)
    out, nxt = [], 0
    for sizes, lens in [(prefix_groups, prefix_lens), ([1] * len(suffix_lens), suffix_lens)]:
        pages = [-(-n // P) for n in lens]
        out.append((torch.tensor([0, *np.cumsum(sizes)], dtype=torch.int32),
                    torch.tensor([0, *np.cumsum(pages)], dtype=torch.int32),
                    torch.from_numpy(nxt + rng.permutation(sum(pages))).int(),
                    torch.tensor([n - (k - 1) * P if k else 1 for n, k in zip(lens, pages)], dtype=torch.int32)))
        nxt += sum(pages)
    return out, nxt


def _check(prefix_groups, prefix_lens, suffix_lens, head_dim=128, group=4, seed=0, poison=None, **kw):
    levels, pages = _levels(prefix_groups, prefix_lens, suffix_lens, seed)
    g = torch.Generator().manual_seed(seed)
    B, Hq = len(suffix_lens), HKV * group
    q = torch.randn(B, Hq, head_dim, generator=g).bfloat16()
    kv = torch.randn(pages + 1, 2, P, HKV, head_dim, generator=g).bfloat16()
    if poison is not None:
        poison(q, kv, levels)
    op = meld.CascadeDecode(Hq, HKV, head_dim, P, 2, torch.bfloat16, "cuda", **kw)
    op.plan(*[[lv[i] for lv in levels] for i in range(4)])
    out = torch.full((B, Hq, head_dim), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((B, Hq), float("nan"), device="cuda")
    op.run(q.cuda(), kv.cuda(), out=out, lse=lse)
    again = op.run(q.cuda(), kv.cuda())   # the counters were reset: the same answer, bit for bit
    torch.cuda.synchronize()
    want_o, want_l = cascade_reference(q, kv, levels)
    torch.testing.assert_close(out.double().cpu(), want_o, rtol=2e-2, atol=2e-2, equal_nan=True)
    torch.testing.assert_close(lse.double().cpu(), want_l, rtol=1e-3, atol=1e-3, equal_nan=True)
    assert torch.equal(again.isnan(), out.isnan()) and torch.equal(again.nan_to_num(), out.nan_to_num())
    return out, lse


@pytest.mark.parametrize("groups,prefix,suffix", [
    ([4], [300], [5, 0, 17, 64]),                              # one group, an empty suffix
    ([3, 1, 4], [129, 16, 1000], [1, 2, 3, 4, 5, 6, 7, 70]),   # several groups, partial last pages
    ([2, 2], [0, 40], [0, 9, 0, 33]),                          # an empty prefix; a request with no KV
    ([64], [4099], [int(n) for n in np.random.default_rng(1).integers(1, 700, 64)]),   # 256 rows a kv head
    ([5, 7, 20], [2000, 1, 333], [int(n) for n in np.random.default_rng(2).integers(0, 300, 32)]),
])
@every_build
def test_two_levels_match_float64(groups, prefix, suffix, build):
    _check(groups, prefix, suffix, **build)


@every_build
def test_split_tasks_before_and_after_tasks_of_more_rows_in_one_cta(build):
    """Three CTAs over groups of 2, 6, 1 and 5 requests (8, 24, 4 and 20 rows: split tasks and tasks of more
    rows, one after another in a CTA) and short suffixes: the warp build's walk runs ahead into a CTA's next
    split task and stops at a task of more rows, whose CTA ring lies over the warps' rings."""
    suffix = [1, 2, 3, 4, 5, 6, 7, 70, 33, 0, 190, 15, 16, 17]
    _check([2, 6, 1, 5], [129, 16, 1000, 77], suffix, seed=8, num_ctas=3, **build)


def test_groups_larger_than_the_kernels_row_blocks_are_refused():
    with pytest.raises(ValueError, match=r"num_qo_heads=144 over num_kv_heads=1: groups of 144 q heads"):
        meld.CascadeDecode(144, 1, 128, P, 2, torch.bfloat16, "cuda")
    meld.CascadeDecode(128, 1, 128, P, 2, torch.bfloat16, "cuda")   # 128 rows: one task's row blocks


@every_build
def test_an_unaligned_q_view_is_copied_not_misread(build):
    B, Hq, D = 3, HKV * 4, 128
    levels, pages = _levels([3], [70], [5, 9, 33], seed=6)
    g = torch.Generator().manual_seed(6)
    kv = torch.randn(pages + 1, 2, P, HKV, D, generator=g).bfloat16()
    flat = torch.randn(B * Hq * D + 1, generator=g).bfloat16().cuda()
    q = flat[1:].view(B, Hq, D)   # contiguous, 2 bytes past a 16-byte boundary
    assert q.data_ptr() % 16 == 2
    op = meld.CascadeDecode(Hq, HKV, D, P, 2, torch.bfloat16, "cuda", **build)
    op.plan(*[[lv[i] for lv in levels] for i in range(4)])
    out = op.run(q, kv.cuda())
    want, _ = cascade_reference(q.cpu(), kv, levels)
    torch.testing.assert_close(out.double().cpu(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.racecheck
@every_build
def test_both_task_shapes_in_one_small_launch(build):
    """A group of 40 requests (160 rows: two slices, one of 32 requests with 8 warps of rows, one of 8 with
    2) and one-request suffixes (the warps split the chunks, then merge through the drained ring), on few
    CTAs so tasks follow each other in a CTA: small enough for racecheck."""
    _check([40, 2], [150, 70], [int(n) for n in np.random.default_rng(4).integers(0, 140, 42)], seed=4, num_ctas=6,
           **build)


@pytest.mark.parametrize("head_dim,group", [(64, 1), (64, 8), (256, 4), (128, 16)])
@every_build
def test_head_dims_and_groups(head_dim, group, build):
    if head_dim == 256 and build.get("prefix_mma") == "wgmma":   # (its accumulators do not fit the registers)
        with pytest.raises(ValueError, match="prefix_mma='wgmma' with head_dim=256"):
            meld.CascadeDecode(HKV * group, HKV, head_dim, P, 2, torch.bfloat16, "cuda", **build)
        return
    if head_dim == 256 and build.get("warps") == 4:   # (two CTAs an SM leave no room for two 64 KiB chunks)
        with pytest.raises(ValueError, match="warps=4 with head_dim=256"):
            meld.CascadeDecode(HKV * group, HKV, head_dim, P, 2, torch.bfloat16, "cuda", **build)
        return
    _check([3, 5], [500, 77], [int(n) for n in np.random.default_rng(3).integers(0, 200, 8)], head_dim, group,
           **build)


@every_build
def test_non_finite_inputs_reach_exactly_their_rows(build):
    def poison(q, kv, levels):
        prefix, suffix = levels
        kv[int(prefix[2][0]), 0, 2, 0, 7] = float("inf")                  # K of group 0's prefix, kv head 0
        kv[int(suffix[2][int(suffix[1][3])]), 1, 0, 1, 5] = float("nan")   # V of request 3's suffix, kv head 1
        q[2, 0, 3] = float("nan")                                          # request 2, q head 0

    out, lse = _check([2, 2], [100, 100], [20, 20, 20, 20], poison=poison, **build)
    G = 4
    assert out[0:2, :G].isnan().all() and lse[0:2, :G].isnan().all()
    assert out[3, G:].isnan().any(dim=-1).all() and lse[3, G:].isfinite().all()
    assert out[2, 0].isnan().all() and out[2, 1:].isfinite().all()
    assert math.isfinite(float(lse[2, 1]))


@every_build
def test_non_finite_inputs_in_a_large_groups_prefix_reach_exactly_their_rows(build):
    """A group of 20 requests (80 rows a kv head: a task of more rows; in the wgmma build two warpgroups, the
    second mostly padding) over a prefix of 300 tokens (its last chunk partial): Inf in the prefix's K makes every
    row of that kv head NaN, NaN in one q row (in the second warpgroup) only that row, NaN in a suffix's V only
    the P.V of that request's rows."""
    def poison(q, kv, levels):
        prefix, suffix = levels
        kv[int(prefix[2][18]), 0, 3, 0, 9] = float("inf")                  # K of the prefix's token 291, kv head 0
        kv[int(suffix[2][int(suffix[1][3])]), 1, 0, 1, 5] = float("nan")   # V of request 3's suffix, kv head 1
        q[18, 5, 3] = float("nan")                                         # request 18, q head 5 (row 73 of kv head 1)

    out, lse = _check([20], [300], [20] * 20, poison=poison, seed=11, **build)
    G = 4
    assert out[:, :G].isnan().all() and lse[:, :G].isnan().all()
    assert out[18, 5].isnan().all() and math.isnan(float(lse[18, 5]))
    assert out[3, G:].isnan().any(dim=-1).all() and lse[3, G:].isfinite().all()
    finite = torch.ones(20, 2 * G, dtype=torch.bool)
    finite[:, :G] = False
    finite[18, 5] = finite[3, G:] = False
    assert out[finite].isfinite().all() and lse[finite].isfinite().all()


@every_build
def test_a_captured_run_replays_later_plans_that_fit(build):
    """plan() rewrites the kernel's tables in place while the plan fits them, so a CUDA graph captured after
    one plan replays the next (same batch size; other groups, lengths and pages)."""
    B, Hq, D = 8, HKV * 4, 128
    first, pages1 = _levels([8], [900], [40] * B, seed=1)
    second, pages2 = _levels([3, 5], [64, 300], [0, 17, 5, 80, 1, 2, 3, 4], seed=2)
    g = torch.Generator().manual_seed(5)
    kv = torch.randn(max(pages1, pages2) + 1, 2, P, HKV, D, generator=g).bfloat16()
    q1, q2 = (torch.randn(B, Hq, D, generator=g).bfloat16() for _ in range(2))
    op = meld.CascadeDecode(Hq, HKV, D, P, 2, torch.bfloat16, "cuda", **build)
    q_buf, kv_gpu = q1.cuda(), kv.cuda()
    out = torch.empty(B, Hq, D, dtype=torch.bfloat16, device="cuda")
    op.plan(*[[lv[i] for lv in first] for i in range(4)])
    op.run(q_buf, kv_gpu, out=out)   # (warm: the kernel is loaded)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op.run(q_buf, kv_gpu, out=out)
    for levels, q in ((first, q1), (second, q2)):
        op.plan(*[[lv[i] for lv in levels] for i in range(4)])
        q_buf.copy_(q.cuda())
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want, _ = cascade_reference(q, kv, levels)
        torch.testing.assert_close(out.double().cpu(), want, rtol=2e-2, atol=2e-2)


@every_build
def test_a_profiled_launch_records_every_task_and_its_merges(build):
    from meld import config

    levels, pages = _levels([5, 3], [700, 90], [int(n) for n in np.random.default_rng(7).integers(0, 300, 8)], seed=7)
    g = torch.Generator().manual_seed(7)
    q = torch.randn(8, HKV * 4, 128, generator=g).bfloat16().cuda()
    kv = torch.randn(pages + 1, 2, P, HKV, 128, generator=g).bfloat16().cuda()
    with config.scope(MELD_PROFILE="1"):
        op = meld.CascadeDecode(HKV * 4, HKV, 128, P, 2, torch.bfloat16, "cuda", num_ctas=10, **build)
    op.plan(*[[lv[i] for lv in levels] for i in range(4)])
    op.run(q, kv)
    tr = op.last_trace()
    _, _, plan = op.plan_tables
    pieces = sorted(r.unit for r in tr.tasks if r.kind == "piece")
    assert pieces == list(range(plan.num_tasks)), "one attention record per task"
    merges = [r for r in tr.tasks if r.kind == "merge-hbm"]
    assert merges and all(r.end_ns >= r.start_ns for r in merges)
    cta = plan.task_columns()["cta"]
    assert tr.overflowed == 0
    assert all(r.cta == cta[r.unit] for r in tr.tasks), "each record on the CTA the plan gave its task"



@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_deferred_split_events_give_the_same_bits_over_many_rounds(head_dim):
    """Two CTAs over 40 one-request suffixes and two kv heads (80 split tasks: a CTA counts them in three or more
    rounds of 16 after its last task, the default) beside a shared prefix: the float64 check, and the same bits as
    counting after each task (defer_split_events=False) (an event's parts merge in the planner's order either way)."""
    suffix = [int(n) for n in np.random.default_rng(9).integers(1, 260, 40)]
    kw = dict(head_dim=head_dim, seed=9, num_ctas=2)
    out, lse = _check([40], [333], suffix, **kw)
    base_o, base_l = _check([40], [333], suffix, defer_split_events=False, **kw)
    assert torch.equal(out, base_o) and torch.equal(lse, base_l)


@pytest.mark.parametrize("end", [dict(defer_split_events=False, direct_single_part=True),
                                 dict(direct_single_part=True)], ids=["nodefer-direct", "defer-direct"])
def test_single_part_events_are_written_by_their_split_task(end):
    """One level (a group per request, as the fold probe runs it: each event's one part is its request's split task,
    or two where a request is cut between CTAs) and two levels with empty prefixes: the float64 check, NaN in one
    request's V reaching only its P.V rows, and the same outputs as the merge of one part (to a bf16 rounding)."""
    B, Hq, D = 24, HKV * 4, 128
    rng = np.random.default_rng(12)
    lens = [int(n) for n in rng.integers(1, 900, B)]
    levels, pages = _levels([B], [0], lens, seed=12)
    one = [levels[1]]
    g = torch.Generator().manual_seed(12)
    q = torch.randn(B, Hq, D, generator=g).bfloat16()
    kv = torch.randn(pages + 1, 2, P, HKV, D, generator=g).bfloat16()
    kv[int(one[0][2][int(one[0][1][5])]), 1, 3, 1, 7] = float("nan")   # V of request 5, kv head 1
    outs = []
    for kw in (end, {}):
        op = meld.CascadeDecode(Hq, HKV, D, P, 1, torch.bfloat16, "cuda", num_ctas=7, **kw)
        op.plan(*[[lv[i] for lv in one] for i in range(4)])
        out = torch.full((B, Hq, D), float("nan"), dtype=torch.bfloat16, device="cuda")
        lse = torch.full((B, Hq), float("nan"), device="cuda")
        op.run(q.cuda(), kv.cuda(), out=out, lse=lse)
        torch.cuda.synchronize()
        outs.append((out.cpu(), lse.cpu()))
    want_o, want_l = cascade_reference(q, kv, one)
    (out, lse), (base_o, base_l) = outs
    torch.testing.assert_close(out.double(), want_o, rtol=2e-2, atol=2e-2, equal_nan=True)
    torch.testing.assert_close(lse.double(), want_l, rtol=1e-3, atol=1e-3, equal_nan=True)
    bad = torch.zeros(B, Hq, dtype=torch.bool)
    bad[5, 4:] = True
    assert out[bad].isnan().any(dim=-1).all() and out[~bad].isfinite().all() and lse.isfinite().all()
    torch.testing.assert_close(out, base_o, rtol=2 ** -7, atol=0, equal_nan=True)
    torch.testing.assert_close(lse, base_l, rtol=1e-6, atol=1e-6)
    _check([B], [0], lens, seed=12, num_ctas=7, **end)   # two levels, the prefix empty
