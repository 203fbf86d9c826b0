"""Shared-prefix (cascade) decode on the CPU: the graph composed from decode attention's parts, the planner
that balances every level's pieces together, and the reference executor that runs any such graph, against
float64 attention over each request's whole sequence."""
import math
import re
import shutil
import subprocess

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import meld
from meld.codegen.lowering import lower
from meld.compat.flashinfer import MultiLevelCascadeAttentionWrapper
from meld.ir import Axis, Reduction, TaskGraph, TaskTemplate
from meld.ir.task_graph import GraphError
from meld.ops.cascade_graph import level_task
from meld.runtime.reference import cascade_reference, execute_split_reduce
from meld.scheduler import GroupTable, plan_split_reduce
from meld.ir.work_table import EVENT, SPLIT_TASK
from meld.ops.base import grown
from meld.ops.cascade_decode import _launch_need
from meld.scheduler.split_reduce_plan import (SLICE_ROWS, LaunchLayout, launch_sizes, plan_split_reduce_numpy,
                                              write_launch_tables)
from tests.kernel_matrix import pairwise

HQ, HKV, D, P = 8, 2, 64, 16
BF16 = torch.bfloat16


def level(group_sizes, lens, first_page, page_size=P):
    """One level: groups of `group_sizes` requests, group g with lens[g] tokens on fresh pages from first_page.
    Returns (qo_indptr, kv_indptr, kv_indices, kv_last_page_len) int32 and the next free page."""
    pages = [-(-n // page_size) for n in lens]
    qo = torch.tensor([0, *np.cumsum(group_sizes)], dtype=torch.int32)
    indptr = torch.tensor([0, *np.cumsum(pages)], dtype=torch.int32)
    rng = np.random.default_rng(first_page)
    indices = torch.from_numpy(first_page + rng.permutation(sum(pages))).int()
    last = torch.tensor([n - (p - 1) * page_size if p else 1 for n, p in zip(lens, pages)], dtype=torch.int32)
    return (qo, indptr, indices, last), first_page + sum(pages)


def batch(prefix_groups, prefix_lens, suffix_lens, seed=0, extra_levels=()):
    """A two-level batch (shared prefixes, then one suffix per request), plus `extra_levels` of
    (group_sizes, lens) in between; q and an NHD cache of fresh random values."""
    torch.manual_seed(seed)
    levels, nxt = [], 0
    for sizes, lens in [(prefix_groups, prefix_lens), *extra_levels, ([1] * len(suffix_lens), suffix_lens)]:
        lv, nxt = level(sizes, lens, nxt)
        levels.append(lv)
    B = len(suffix_lens)
    q = torch.randn(B, HQ, D).to(BF16)
    kv = torch.randn(nxt + 3, 2, P, HKV, D).to(BF16)
    return levels, q, kv


def run_op(levels, q, kv, **kw):
    op = meld.CascadeDecode(HQ, HKV, D, P, len(levels), BF16, "cpu", **kw)
    op.plan(*[[lv[i] for lv in levels] for i in range(4)])
    return op, op.run(q, kv, return_lse=True)


def check(levels, q, kv, **kw):
    op, (out, lse) = run_op(levels, q, kv, **kw)
    want_o, want_l = cascade_reference(q, kv, levels)
    batch_, tables, plan = op.plan_tables
    got_o, got_l = execute_split_reduce(op.graph, plan, tables, q, kv, 1 / math.sqrt(D))
    torch.testing.assert_close(got_o, want_o, rtol=1e-9, atol=1e-9, equal_nan=True)   # the executor, exact
    torch.testing.assert_close(got_l, want_l, rtol=1e-9, atol=1e-9, equal_nan=True)
    torch.testing.assert_close(out.double(), want_o, rtol=2e-2, atol=2e-2, equal_nan=True)   # run(): bf16 out
    torch.testing.assert_close(lse.double(), want_l, rtol=1e-5, atol=1e-5, equal_nan=True)
    return op, plan


def test_graph_is_decode_attention_with_one_producer_per_level():
    g = meld.ops.cascade_decode_graph(HQ, HKV, D, P, 3)
    low = lower(g)
    assert (low.family, low.combiner, low.kernel) == ("grouped_attention", "online_softmax", "grouped_attention.cuh")
    assert low.producers == tuple(level_task(i) for i in range(3))
    assert lower(meld.ops.cascade_decode_graph(HQ, HKV, D, P, 1)).family == "grouped_attention", (
        "one level over groups of requests still reads a group's KV once for all of them")
    plain = meld.ops.decode_attention_graph(HQ, HKV, D, P)
    assert (lower(plain).family, lower(plain).producers) == ("decode_attention", ("attention_partial",))
    assert [t.name for t in g.tasks if t.kind == "split_reduce"] == [level_task(i) for i in range(3)]
    assert TaskGraph.from_json(g.to_json()) == g


@pytest.mark.parametrize("groups,prefix,suffix", [
    ([4], [300], [5, 0, 64, 17]),                     # one group, one empty suffix
    ([3, 1, 4], [129, 16, 1000], [1, 2, 3, 4, 5, 6, 7, 70]),   # several groups, partial last prefix pages
    ([2, 2], [0, 40], [0, 9, 0, 33]),                 # an empty prefix; a request with nothing at all
])
def test_two_levels_match_float64(groups, prefix, suffix):
    check(*batch(groups, prefix, suffix), num_ctas=8)


def test_three_levels_and_a_plan_per_batch():
    levels, q, kv = batch([6], [500], [3, 60, 0, 7, 100, 1], extra_levels=[([2, 4], [33, 250])])
    op, plan = check(levels, q, kv, num_ctas=16)
    levels2, q2, kv2 = batch([2, 1], [64, 65], [1, 1, 1], seed=3)
    assert len(levels2) == 2 and op.num_levels == 3
    with pytest.raises(ValueError, match="list of num_levels=3 tensors, got list of 2"):
        op.plan(*[[lv[i] for lv in levels2] for i in range(4)])
    assert op.plan_tables[2] is plan, "a plan() that raises changes nothing"


def test_pieces_cover_every_range_once_and_the_events_count_them():
    levels, q, kv = batch([40, 24], [4000, 2000], list(range(1, 65)))   # 160 rows: a group of two slices
    op = meld.CascadeDecode(HQ, HKV, D, P, 2, BF16, "cpu", num_ctas=32)
    op.plan(*[[lv[i] for lv in levels] for i in range(4)])
    _, tables, plan = op.plan_tables
    order = [tables[level_task(i)] for i in range(2)]
    t, ev = plan.task_columns(), plan.event_columns()
    covered, parts = {}, np.zeros(64 * HKV, dtype=int)
    slice_requests = SLICE_ROWS // (HQ // HKV)
    for i in range(plan.num_tasks):
        first, count = int(t["event_first"][i]), int(t["event_count"][i])
        key = (int(t["producer"][i]), int(t["group"][i]), int(t["kv_head"][i]), first)
        covered.setdefault(key, []).append((int(t["kv_begin"][i]), int(t["kv_end"][i])))
        grp = order[key[0]]
        q0, q1 = int(grp.qo_indptr[key[1]]), int(grp.qo_indptr[key[1] + 1])
        s0 = first - key[2] * 64   # the slice's first request: slices of whole requests cut from the group's first
        assert (s0 - q0) % slice_requests == 0 and count == min(slice_requests, q1 - s0) and count >= 1
        parts[first:first + count] += 1
    for (ti, g, h, _), ranges in covered.items():
        ranges.sort()
        assert ranges[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert ranges[-1][1] == order[ti].kv_len(P)[g]
    assert (parts == ev["parts"]).all() and (np.diff(ev["part_first"]) == ev["parts"][:-1]).all()
    assert sorted(plan.part_slot.tolist()) == sorted(set(plan.part_slot.tolist())), "every part has its own slot"
    assert (np.diff(t["cta"]) >= 0).all(), "tasks in CTA order"
    assert plan.num_tasks <= len(covered) + plan.num_ctas - 1, "an item splits only where a CTA boundary falls in it"
    assert all(b - a >= 64 for r in covered.values() for a, b in r if len(r) > 1), "no piece of a split item is short"
    cost = plan.cta_cost(order)
    assert cost.max() <= 1.5 * cost.mean(), "prefix and suffix pieces are balanced together"


def test_short_items_are_spread_over_every_cta_at_any_overhead():
    """64 groups of 4 requests with a 2048-token prefix each and 64-token suffixes (bench/cascade.py's case of
    many small groups). On one line for both levels the 2048 short suffix items crowded onto the line's last
    CTAs unless an item overhead priced them; on a line of their own every CTA holds its share of them, with
    or without one, and every CTA's modelled cost stays within one item of the mean."""
    B, groups, per = 256, 64, 4
    qo = np.arange(0, B + 1, per, dtype=np.int64)
    prefix = GroupTable(qo, np.arange(0, groups * 128 + 1, 128, dtype=np.int64), np.arange(groups * 128, dtype=np.int64),
                        np.full(groups, P, dtype=np.int64))
    own = GroupTable(np.arange(B + 1, dtype=np.int64), np.arange(0, B * 4 + 1, 4, dtype=np.int64),
                     np.arange(B * 4, dtype=np.int64), np.full(B, P, dtype=np.int64))
    for overhead in (0, 128):
        plan = plan_split_reduce([prefix, own], B, 8, 4, P, 132, SLICE_ROWS, overhead)
        t = plan.task_columns()
        short = np.bincount(t["cta"][t["producer"] == 1], minlength=132)
        assert short.min() >= 15 and short.max() <= 16, short
        cost = plan.cta_cost([prefix, own])
        assert cost.max() <= cost.mean() + overhead + 2048


def test_a_shared_level_opens_every_ctas_list():
    """B=128 with a 1024-token prefix and 2048-token suffixes (bench/cascade.py's case where the suffixes
    dominate). On one line for both levels the prefix's 32 slices filled the first CTAs one after another; the
    later ones arrived last and each merged its 32 requests on one CTA at the end of the launch. On a line per
    level the slices' pieces open the lists of (nearly) every CTA, so they arrive early and the requests' own
    pieces complete the events; each level's modelled cost per CTA stays within its share, an item's fixed cost
    and two short pieces."""
    B, n_pre, n_own, W = 128, 1024, 2048, 132
    prefix = GroupTable(np.array([0, B], dtype=np.int64), np.array([0, n_pre // P], dtype=np.int64),
                        np.arange(n_pre // P, dtype=np.int64), np.array([P], dtype=np.int64))
    own = GroupTable(np.arange(B + 1, dtype=np.int64), np.arange(0, B * (n_own // P) + 1, n_own // P, dtype=np.int64),
                     np.arange(B * (n_own // P), dtype=np.int64) + n_pre // P, np.full(B, P, dtype=np.int64))
    plan = plan_split_reduce([prefix, own], B, 8, 4, P, W, SLICE_ROWS, 256, 0)
    t = plan.task_columns()
    first = np.searchsorted(t["cta"], np.arange(W))
    opened = [c for c in range(W) if first[c] < plan.num_tasks and t["cta"][first[c]] == c and t["producer"][first[c]] == 0]
    assert len(opened) >= 0.9 * W
    tiles = -(-SLICE_ROWS // plan.rows_per_tile)
    for lv, bound in ((0, 256 + 2 * 64 * tiles), (1, 256 + 2 * 64)):
        cost = plan.cta_cost([prefix, own], lv)
        assert cost.max() <= cost.mean() + bound, (lv, cost.max(), cost.mean())


def test_non_finite_inputs_reach_exactly_their_rows():
    levels, q, kv = batch([2, 2], [100, 100], [20, 20, 20, 20])
    prefix_idx, sfx = levels[0][2], levels[1]
    kv[int(sfx[2][int(sfx[1][3])]), 1, 0, 1, 5] = float("nan")    # V of request 3's suffix, kv head 1
    kv[int(prefix_idx[0]), 0, 2, 0, 7] = float("inf")              # K of group 0's prefix (requests 0, 1), kv head 0
    _, (out, lse) = run_op(levels, q, kv, num_ctas=4)
    G = HQ // HKV
    assert out[3, G:].isnan().any(dim=-1).all() and lse[3, G:].isfinite().all()
    assert out[0:2, :G].isnan().all() and lse[0:2, :G].isnan().all()
    assert out[2].isfinite().all() and out[0:2, G:].isfinite().all() and out[3, :G].isfinite().all()


def test_a_graph_the_library_does_not_ship_runs_with_no_operator_class():
    """Three producers of partials with names of its own (a system prompt shared by all, few-shot examples
    shared by pairs, each request's own tokens): it lowers to the decode-attention family and the planner
    and executor run it from the graph alone."""
    red = Reduction("online_softmax", "kv")
    g = TaskGraph("three_sources", {"num_qo_heads": HQ, "num_kv_heads": HKV, "head_dim": D, "page_size": P})
    names = ("system_prompt", "few_shot", "own")
    for n in names:
        g.add_task(TaskTemplate(n, "split_reduce", (Axis("group", f"groups_{n}"), Axis("kv_head", HKV)),
                                range_axis=Axis("kv", f"len_{n}", dynamic=True), reduction=red))
    g.add_task(TaskTemplate("merge", "combine", (Axis("request", "B"), Axis("kv_head", HKV)), reduction=red))
    for n in names:
        g.add_edge(n, "merge", red)
    assert lower(g.validate()).family == "grouped_attention"
    levels, q, kv = batch([6], [200], [1, 50, 0, 3, 17, 80], extra_levels=[([2, 2, 2], [31, 0, 64])])
    tables = {n: GroupTable(*(t.numpy().astype(np.int64) for t in lv)) for n, lv in zip(names, levels)}
    plan = plan_split_reduce([tables[n] for n in names], 6, HKV, HQ // HKV, P, num_ctas=5)
    got_o, got_l = execute_split_reduce(g, plan, tables, q, kv, 0.125)
    want_o, want_l = cascade_reference(q, kv, levels, 0.125)
    torch.testing.assert_close(got_o, want_o, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(got_l, want_l, rtol=1e-9, atol=1e-9)
    with pytest.raises(ValueError, match=r"no group table for task\(s\) \['own'\]"):
        execute_split_reduce(g, plan, {n: tables[n] for n in names[:2]}, q, kv, 0.125)


def test_the_graphs_combiner_selects_the_family_and_merge():
    """The same tasks merged as sums are the row-parallel GEMM's family, not attention's: the executor of
    grouped attention refuses the graph, naming the family it lowers to."""
    red = Reduction("sum", "kv")
    g = TaskGraph("summed", {})
    g.add_task(TaskTemplate("part", "split_reduce", (Axis("group", "G"), Axis("kv_head", HKV)),
                            range_axis=Axis("kv", "n", dynamic=True), reduction=red))
    g.add_task(TaskTemplate("merge", "combine", (Axis("request", "B"), Axis("kv_head", HKV)), reduction=red))
    g.add_edge("part", "merge", red)
    assert lower(g.validate()).family == "tp_linear"
    levels, q, kv = batch([2], [20], [1, 2])
    t = GroupTable(*(x.numpy().astype(np.int64) for x in levels[0]))
    plan = plan_split_reduce([t], 2, HKV, HQ // HKV, P, num_ctas=2)
    with pytest.raises(GraphError, match="lowers to the tp_linear family, not paged attention"):
        execute_split_reduce(g, plan, {"part": t}, q, kv, 0.1)


@pytest.mark.parametrize("change,match", [
    (lambda L: L[0].__setitem__(0, torch.tensor([0, 2, 1], dtype=torch.int32)), "must start at 0 and never decrease"),
    (lambda L: L[0].__setitem__(1, torch.tensor([0, 1, 2, 4], dtype=torch.int32)),
     r"qo_indptr_arr\[1\]\[-1\]=4, but level 0 has 3 requests"),
    (lambda L: L[3].__setitem__(1, torch.tensor([1, 17, 1], dtype=torch.int32)), r"level 1: kv_last_page_len\[1\]=17"),
    (lambda L: L[1].__setitem__(0, torch.tensor([0, 1], dtype=torch.int32)), r"kv_indptr_arr\[0\] has 2 entries"),
    (lambda L: L[2].__setitem__(0, L[2][0].long()), r"kv_indices_arr\[0\] must have dtype torch.int32"),
])
def test_bad_plans_name_the_argument_and_change_nothing(change, match):
    levels, q, kv = batch([2, 1], [30, 40], [3, 4, 5])
    op, (out, _) = run_op(levels, q, kv, num_ctas=3)
    args = [[lv[i] for lv in levels] for i in range(4)]
    change(args)
    with pytest.raises(ValueError, match=match):
        op.plan(*args)
    assert torch.equal(op.run(q, kv), out)


def test_bad_runs_name_the_argument():
    levels, q, kv = batch([2], [30], [3, 4])
    op, _ = run_op(levels, q, kv)
    with pytest.raises(ValueError, match="references page .*, but kv_cache has only 2 pages"):
        op.run(q, kv[:2])
    with pytest.raises(ValueError, match=r"q must have shape \(2, 8, 64\)"):
        op.run(q[:1], kv)
    with pytest.raises(ValueError, match="out .* shares memory with q"):
        op.run(q, kv, out=q)
    with pytest.raises(RuntimeError, match="call plan"):
        meld.CascadeDecode(HQ, HKV, D, P, 2).run(q, kv)


# --- FlashInfer's MultiLevelCascadeAttentionWrapper -------------------------------------------------------


@pytest.mark.parametrize("layout,as_tuple", [("NHD", False), ("HND", False), ("NHD", True)])
def test_flashinfer_wrapper_matches_float64(layout, as_tuple):
    levels, q, kv = batch([3, 2], [100, 37], [4, 0, 9, 65, 2])
    w = MultiLevelCascadeAttentionWrapper(2, torch.empty(16, dtype=torch.uint8), layout)
    w.plan(*[[lv[i] for lv in levels] for i in range(4)], HQ, HKV, D, P, q_data_type=BF16)
    cache = kv if layout == "NHD" else kv.transpose(2, 3).contiguous()
    out = w.run(q, (cache[:, 0], cache[:, 1]) if as_tuple else cache)
    want, _ = cascade_reference(q, kv, levels)
    torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kw,err", [
    (dict(pos_encoding_mode="ROPE_LLAMA"), NotImplementedError), (dict(logits_soft_cap=30.0), NotImplementedError),
    (dict(use_fp16_qk_reduction=True), NotImplementedError), (dict(kv_data_type=torch.float16), NotImplementedError),
    (dict(q_data_type=torch.float32), NotImplementedError), (dict(sm_scale=float("nan")), ValueError),
])
def test_flashinfer_wrapper_refuses_what_meld_does_not_compute(kw, err):
    levels, q, kv = batch([2], [20], [1, 2])
    w = MultiLevelCascadeAttentionWrapper(2, torch.empty(16, dtype=torch.uint8))
    with pytest.raises(err):
        w.plan(*[[lv[i] for lv in levels] for i in range(4)], HQ, HKV, D, P, **({"q_data_type": BF16} | kw))
    with pytest.raises(RuntimeError, match="call plan"):
        w.run(q, kv)
    prefill = [lv for lv in levels]
    prefill[-1] = (torch.tensor([0, 2], dtype=torch.int32), *levels[-1][1:])   # two query rows in one last-level group
    with pytest.raises(NotImplementedError, match="causal=True"):
        w.plan(*[[lv[i] for lv in prefill] for i in range(4)], HQ, HKV, D, P, causal=True, q_data_type=BF16)
    with pytest.raises(NotImplementedError, match="use_cuda_graph"):
        MultiLevelCascadeAttentionWrapper(2, torch.empty(16, dtype=torch.uint8), use_cuda_graph=True)


def test_flashinfer_wrapper_errors_name_its_own_arguments():
    levels, q, kv = batch([3, 2], [100, 37], [4, 0, 9, 65, 2])
    args = [[lv[i] for lv in levels] for i in range(4)]
    w = MultiLevelCascadeAttentionWrapper(2, torch.empty(16, dtype=torch.uint8), "HND")
    w.plan(*args, HQ, HKV, D, P, q_data_type=BF16)
    with pytest.raises(ValueError, match=r"paged_kv_cache must have shape .*kv_layout='HND'.*got \(\d+, 2, 16, 2, 64\)"):
        w.run(q, kv)   # an NHD cache given to an HND wrapper: the shape it was given, in HND's terms
    with pytest.raises(ValueError, match="paged_kv_cache .* pages"):
        w.run(q, kv.transpose(2, 3).contiguous()[:3])
    bad = [list(a) for a in args]
    bad[3][1] = bad[3][1][:-1]
    with pytest.raises(ValueError, match=r"^paged_kv_last_page_len\[1\]"):
        w.plan(*bad, HQ, HKV, D, P, q_data_type=BF16)
    bad = [list(a) for a in args]
    bad[2][1] = bad[2][1].clone()
    bad[2][1][0] = -1
    with pytest.raises(ValueError, match="level 1: .*negative"):
        w.plan(*bad, HQ, HKV, D, P, q_data_type=BF16)
    zero_d = [list(a) for a in args]
    zero_d[0][1] = torch.tensor(5, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"qo_indptr_arr\[1\]"):
        w.plan(*zero_d, HQ, HKV, D, P, causal=True, q_data_type=BF16)
    with pytest.raises(ValueError, match="head_dim must be 64, 128 or 256, got 7"):
        meld.CascadeDecode(HQ, HKV, 7, P, 2)


def test_lowering_names_every_familys_kernel_planner_and_executor():
    from meld.codegen.lowering import FAMILIES, Lowering
    from meld.codegen.tp_kernel import TpSchedule
    from meld.runtime.reference import execute_split_reduce as grouped

    for family in FAMILIES:
        low = Lowering(family, "online_softmax")
        assert callable(low.planner) and callable(low.executor), family
    low = lower(meld.ops.cascade_decode_graph(HQ, HKV, D, P, 2))
    assert (low.planner, low.executor) == (plan_split_reduce, grouped)
    assert Lowering("tp_linear", "sum").planner == TpSchedule.of


# --- the planner's C source (host build) against its NumPy oracle ------------------------------------------



def _same_plan(a, b) -> bool:
    return (a.num_tasks, a.num_slots) == (b.num_tasks, b.num_slots) and np.array_equal(a.tasks, b.tasks) and \
        np.array_equal(a.events, b.events) and np.array_equal(a.part_slot, b.part_slot)


@st.composite
def _levels(draw):
    batch = draw(st.integers(0, 12))
    levels = []
    for _ in range(draw(st.integers(1, 3))):
        cuts = sorted(draw(st.lists(st.integers(0, batch), max_size=4)))
        qo = np.array([0, *cuts, batch], dtype=np.int64)
        lens = draw(st.lists(st.integers(0, 700), min_size=len(qo) - 1, max_size=len(qo) - 1))
        pages = [-(-n // P) for n in lens]
        indptr = np.array([0, *np.cumsum(pages)], dtype=np.int64)
        last = np.array([n - (p - 1) * P if p else 1 for n, p in zip(lens, pages)], dtype=np.int64)
        levels.append(GroupTable(qo, indptr, np.arange(indptr[-1], dtype=np.int64), last))
    return batch, levels, draw(st.integers(1, 40)), draw(st.sampled_from([1, 2, 4, 8])), \
        draw(st.sampled_from([1, 6, 128])), draw(st.sampled_from([0, 1, 128, 5000])), draw(st.sampled_from([0, 7, 48])), \
        draw(st.sampled_from([1, 16, 64]))


@settings(max_examples=60, deadline=None)
@given(st.integers(8, 127), st.integers(4, 132), st.sampled_from([0, 64, 256]), st.sampled_from([0, 48]),
       st.integers(0, 2 ** 31 - 1))
def test_no_cta_holds_more_than_its_share_and_a_piece(batch, ctas, overhead, merge, seed):
    """Requests' own KV of 100-4000 tokens on one line: a CTA holds at most its share of the cost plus one item's
    overhead and two short pieces (where a boundary falls near an item's start the item moves, or the cut moves
    up to a whole piece; before that the earlier CTA kept the whole item)."""
    lens = np.random.default_rng(seed).integers(100, 4000, batch)
    pages = -(-lens // P)
    own = GroupTable(np.arange(batch + 1, dtype=np.int64), np.r_[0, np.cumsum(pages)].astype(np.int64),
                     np.arange(pages.sum(), dtype=np.int64), (lens - (pages - 1) * P).astype(np.int64))
    cost = plan_split_reduce([own], batch, 8, 4, P, ctas, SLICE_ROWS, overhead, merge).cta_cost([own])
    assert cost.max() <= cost.sum() / ctas + overhead + 2 * 64 + 16


@settings(max_examples=150, deadline=None)
@given(_levels(), st.booleans())
def test_host_planner_is_its_numpy_oracle(case, stagger):
    batch, levels, ctas, heads, slice_rows, overhead, merge, rows = case   # (slice_rows 1 and 6: slices of one and of three requests)
    assert _same_plan(plan_split_reduce(levels, batch, heads, 2, P, ctas, slice_rows, overhead, merge, rows, stagger),
                      plan_split_reduce_numpy(levels, batch, heads, 2, P, ctas, slice_rows, overhead, merge, rows,
                                              stagger))


def test_a_staggered_plan_lists_the_second_halfs_tasks_last_to_first():
    """stagger: the same pieces and events; CTAs below num_ctas / 2 list theirs in line order (the shared level
    first), the others last to first (their own suffixes first), so an SM's two CTAs of the four-warp build start
    on different levels; the CPU executor's answer is the same, bit for bit."""
    levels, q, kv = batch([40, 24], [700, 300], [int(n) for n in np.random.default_rng(5).integers(1, 90, 64)])
    _, (out, lse) = run_op(levels, q, kv, warps=4)
    op, (out_s, lse_s) = run_op(levels, q, kv, warps=4, stagger=True)
    assert torch.equal(out, out_s) and torch.equal(lse, lse_s)
    plan = op.plan_tables[2]
    t, W = plan.task_columns(), plan.num_ctas
    both = [0, 0]   # CTAs holding both levels, in each half: where the order matters
    for c in range(W):
        prod = t["producer"][t["cta"] == c]
        step = np.diff(prod)
        assert (step <= 0).all() if 2 * c >= W else (step >= 0).all(), (c, prod)
        both[2 * c >= W] += len(set(prod.tolist())) == 2
    assert min(both) >= 10, both
    plain = meld.CascadeDecode(HQ, HKV, D, P, 2, BF16, "cpu", warps=4)
    plain.plan(*[[lv[i] for lv in levels] for i in range(4)])
    p0 = plain.plan_tables[2]
    key = lambda pl: sorted(zip(*(pl.task_columns()[f].tolist() for f in ("cta", "producer", "kv_head", "event_first",
                                                                            "kv_begin", "kv_end"))))
    assert key(p0) == key(plan) and np.array_equal(p0.part_slot, plan.part_slot)
    with pytest.raises(ValueError, match="stagger must be a bool"):
        meld.CascadeDecode(HQ, HKV, D, P, 2, BF16, "cpu", stagger=1)


def test_a_smaller_row_tile_charges_a_group_of_more_rows_more():
    """rows_per_tile prices a slice's token by its rows: at 16 a 64-request group's slice (128 rows of group
    size 2) costs 8 units a token against 1 for a 4-request group's (8 rows), instead of 2 against 1, so the
    plan gives the large group more of the level's CTAs."""
    batch = 68
    level = GroupTable(np.array([0, 64, batch]), np.array([0, 256, 512]), np.arange(512, dtype=np.int64),
                       np.array([P, P]))
    ctas_of_large = {}
    for rows in (64, 16):
        plan = plan_split_reduce([level], batch, 8, 2, P, 132, SLICE_ROWS, 256, 0, rows)
        t = plan.task_columns()
        ctas_of_large[rows] = len(set(t["cta"][t["group"] == 0].tolist()))
        assert plan.rows_per_tile == rows
    assert ctas_of_large[16] > ctas_of_large[64]
    with pytest.raises(ValueError, match="rows_per_tile"):
        meld.CascadeDecode(HQ, HKV, D, P, 2, BF16, "cpu", rows_per_tile=0)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_planner_source_compiles_for_sm90a(tmp_path):
    """The same text as a GPU block's (1024 threads; thread 0 walks the line)."""
    from importlib import resources

    from meld.codegen.params import SPLIT_PLAN_PARAMS
    from meld.ir.work_table import EVENT, SPLIT_TASK

    src = "\n".join(["#define PLAN_THREADS 1024", SPLIT_PLAN_PARAMS.c_source(), SPLIT_TASK.c_source(), EVENT.c_source(),
                     resources.files("meld.codegen").joinpath("templates/split_reduce_plan.h").read_text(),
                     'extern "C" __global__ void __launch_bounds__(1024) plan('
                     "const __grid_constant__ SplitPlanParams p) { meld::plan_split_reduce(p); }"])
    (tmp_path / "plan.cu").write_text(src)
    run = subprocess.run(["nvcc", "-arch=sm_90a", "-c", "-o", str(tmp_path / "plan.o"), str(tmp_path / "plan.cu")],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_the_reference_makes_every_row_with_a_non_finite_score_nan():
    """+Inf and -Inf scores alike (Inf in K against q of either sign): NaN out and lse, as the executor gives."""
    levels, q, kv = batch([2], [40], [3, 5])
    kv[int(levels[0][2][0]), 0, 1, 0, 7] = float("inf")
    q[0, 0, 7], q[0, 1, 7] = 1.0, -1.0   # +Inf and -Inf scores for request 0, heads 0 and 1
    want_o, want_l = cascade_reference(q, kv, levels)
    assert want_o[0, :2].isnan().all() and want_l[0, :2].isnan().all()
    assert want_o[0, 4:].isfinite().all() and want_l[0, 4:].isfinite().all()   # kv head 1 is untouched
    _, (out, lse) = run_op(levels, q, kv, num_ctas=4)
    torch.testing.assert_close(lse.double(), want_l, rtol=1e-5, atol=1e-5, equal_nan=True)
    torch.testing.assert_close(out.double(), want_o, rtol=2e-2, atol=2e-2, equal_nan=True)


def _launch_image(plan, order, caps):
    """The launch tables as plan() packs them for the GPU, in a zeroed image of capacities `caps`: the
    layout's views of it, and how many leading entries plan() copies to the device."""
    layout = LaunchLayout.of(caps)
    views = layout.views(np.zeros(layout.size, dtype=np.int32))
    write_launch_tables(views, plan, order)
    return views, layout.used(launch_sizes(plan, order))


def _kernel_walk(plan, order, q, kv, sm_scale):
    """templates/grouped_attention.cuh's indexing in float64 NumPy: the packed launch tables as the kernel
    reads them (rows field-major over capacities larger than the plan; each CTA's tasks, a task's page list
    from its row's `pages`, its rows r = request * G + head in 16-row blocks, row slots slot + r), the
    count-fired merge through part_slot, and the events with no part."""
    caps = grown({}, _launch_need(plan, order, profile=False))
    lt, _ = _launch_image(plan, order, caps)
    t, ev = SPLIT_TASK.unpack(lt["tasks"], caps["tasks"]), EVENT.unpack(lt["events"], caps["events"])
    assert lt["plan_info"][0] == q.shape[0]
    B, Hq, Dh = q.shape
    G, Pg = plan.group_size, kv.shape[2]
    q64, kv64 = q.double().numpy(), kv.double().numpy()
    part_o, part_lse = np.full((plan.num_slots, Dh), np.nan), np.full(plan.num_slots, np.nan)
    out, lse = np.full((B, Hq, Dh), np.nan), np.full((B, Hq), np.nan)
    counters = np.zeros(B * plan.num_kv_heads, dtype=np.int64)

    def merge(e):
        b, h = e % B, e // B
        slots = lt["part_slot"][ev["part_first"][e]:ev["part_first"][e] + ev["parts"][e]]
        for j in range(G):
            ls = part_lse[slots + j]
            if len(slots) == 0:
                out[b, h * G + j], lse[b, h * G + j] = 0.0, -np.inf
                continue
            m = np.max(ls)
            w = np.exp2(ls - m)
            out[b, h * G + j] = (w[:, None] * part_o[slots + j]).sum(0) / w.sum()
            lse[b, h * G + j] = (m + np.log2(w.sum())) * math.log(2)

    for e in np.flatnonzero(ev["parts"][:B * plan.num_kv_heads] == 0):
        merge(int(e))
    for cta in range(plan.num_ctas):
        for i in range(lt["cta_first"][cta], lt["cta_first"][cta + 1]):
            assert t["cta"][i] == cta
            rows, h = t["event_count"][i] * G, t["kv_head"][i]
            q0, pages = t["event_first"][i] - h * B, lt["kv_indices"][t["pages"][i]:]
            pos = np.arange(t["kv_begin"][i], t["kv_end"][i])
            page = pages[pos // Pg]
            k, v = kv64[page, 0, pos % Pg, h], kv64[page, 1, pos % Pg, h]
            for r in range(rows):
                s = (q64[q0 + r // G, h * G + r % G] @ k.T) * sm_scale * math.log2(math.e)
                m = np.max(s)
                p = np.exp2(s - m)
                part_o[t["slot"][i] + r] = p @ v / p.sum()
                part_lse[t["slot"][i] + r] = m + np.log2(p.sum())
            for e in range(t["event_first"][i], t["event_first"][i] + t["event_count"][i]):
                counters[e] += 1
                if counters[e] == ev["parts"][e]:
                    merge(e)
    return torch.from_numpy(out), torch.from_numpy(lse)


@pytest.mark.parametrize("groups,prefix,suffix,ctas", [
    ([4], [300], [5, 0, 17, 64], 8),
    ([3, 1, 4], [129, 16, 1000], [1, 2, 3, 4, 5, 6, 7, 70], 16),
    ([2, 2], [0, 40], [0, 9, 0, 33], 3),
    ([40, 2], [300, 70], [int(n) for n in np.random.default_rng(3).integers(0, 90, 42)], 12),   # sliced: 160 rows
])
def test_the_kernels_walk_of_its_launch_tables_is_the_reference(groups, prefix, suffix, ctas):
    levels, q, kv = batch(groups, prefix, suffix)
    op, _ = run_op(levels, q, kv, num_ctas=ctas)
    _, tables, plan = op.plan_tables
    order = [tables[level_task(lv)] for lv in range(len(levels))]
    got_o, got_l = _kernel_walk(plan, order, q, kv, 1 / math.sqrt(D))
    want_o, want_l = cascade_reference(q, kv, levels)
    torch.testing.assert_close(got_o, want_o, rtol=1e-9, atol=1e-9, equal_nan=True)
    torch.testing.assert_close(got_l, want_l, rtol=1e-9, atol=1e-9, equal_nan=True)


def _per_table_plan(plan, order, caps, profile):
    """plan()'s device tables before the packed image, verbatim: the capacities (grown as the operator shell
    grows them, `grown`) and one array per table (the task and event rows padded to their capacity), each
    copied into the first entries of a buffer of its own."""
    i32 = lambda a: np.ascontiguousarray(a, dtype=np.int32)   # noqa: E731
    host = {
        "cta_first": i32(np.searchsorted(plan.task_columns()["cta"], np.arange(plan.num_ctas + 1), side="left")),
        "kv_indices": i32(np.concatenate([t.kv_indices for t in order] + [np.zeros(1)])),
    }
    need = {**{k: len(a) for k, a in host.items()}, "tasks": plan.num_tasks, "events": plan.batch * plan.num_kv_heads,
            "part_slot": len(plan.part_slot), "slots": plan.num_slots, "plan_info": 1,
            "records": 2 * int(np.diff(host["cta_first"]).max(initial=0)) if profile else 0}
    caps = grown(caps, need) or caps
    task, event = plan.task_columns(), plan.event_columns()
    pad = lambda a, n: np.r_[a, np.zeros(n - len(a), dtype=np.int64)]   # noqa: E731
    rows = {**host, "plan_info": np.array([plan.batch]), "part_slot": plan.part_slot,
            "tasks": SPLIT_TASK.pack(caps["tasks"], **{f: pad(c, caps["tasks"]) for f, c in task.items()}),
            "events": EVENT.pack(caps["events"], **{f: pad(c, caps["events"]) for f, c in event.items()})}
    return caps, {k: np.ascontiguousarray(a, dtype=np.int32) for k, a in rows.items()}


@pytest.mark.parametrize("num_levels", [2, 3])
@pytest.mark.parametrize("profile", [False, True])
def test_the_packed_image_holds_what_the_per_table_copies_held(num_levels, profile):
    """plan() packs every launch table into one pinned image and copies its used part to one device buffer;
    before, it copied each table into a buffer of its own. Over plans that grow, shrink and grow the
    capacities (empty suffixes, several groups, one CTA up to more CTAs than tasks), the device tables are
    bit for bit what they were, the entries past each plan's (the last plans' leftovers) included."""
    rng = np.random.default_rng(num_levels)
    old_caps, old_dev, caps, dev, staging = {}, {}, {}, None, None
    for step in range(14):
        B = int(rng.integers(1, 5 + 6 * step))
        cuts = np.unique(rng.integers(0, B + 1, int(rng.integers(0, 4))))
        groups = np.diff([0, *cuts[(cuts > 0) & (cuts < B)], B]).tolist()
        suffix = [int(n) * int(rng.random() > 0.3) for n in rng.integers(0, 200, B)]
        extra = [([B], [int(rng.integers(0, 300))])] * (num_levels - 2)
        levels, _, _ = batch(groups, rng.integers(0, 2000, len(groups)).tolist(), suffix, extra_levels=extra)
        op = meld.CascadeDecode(HQ, HKV, D, P, num_levels, BF16, "cpu", num_ctas=int(rng.choice([1, 7, 132])))
        op.plan(*[[lv[i] for lv in levels] for i in range(4)])
        _, tables, plan = op.plan_tables
        order = [tables[level_task(lv)] for lv in range(num_levels)]
        grown_old, rows = _per_table_plan(plan, order, old_caps, profile)
        if grown_old != old_caps:
            width = {"tasks": SPLIT_TASK.width, "events": EVENT.width}
            old_caps, old_dev = grown_old, {k: np.zeros(grown_old[k] * width.get(k, 1), dtype=np.int32) for k in rows}
        for k, a in rows.items():
            old_dev[k][:len(a)] = a

        new_caps = grown(caps, _launch_need(plan, order, profile))
        if new_caps is not None:
            caps, layout = new_caps, LaunchLayout.of(new_caps)
            dev, staging = np.zeros(layout.size, dtype=np.int32), np.zeros(layout.size, dtype=np.int32)
        write_launch_tables(layout.views(staging), plan, order)
        used = layout.used(launch_sizes(plan, order))
        dev[:used] = staging[:used]
        assert caps == old_caps
        new = layout.views(dev)
        for k in old_dev:
            assert np.array_equal(new[k], old_dev[k]), (step, k)


GROUPED_BUILDS = [(stream, dtype, head_dim, profile) for stream in ("cta", "warp") for dtype in ("bfloat16", "float16")
                  for head_dim in (64, 128, 256) for profile in (False, True)]


# Every default build (the cta stream, unprofiled) and a pairwise cover of the rest; the others with -m full_matrix.
@pytest.mark.parametrize("split_stream,dtype,head_dim,profile",
                         pairwise(GROUPED_BUILDS, keep=lambda b: b[0] == "cta" and not b[3]),
                         ids=["-".join(map(str, b)) for b in GROUPED_BUILDS])
def test_grouped_kernel_compiles_for_sm90a(split_stream, dtype, head_dim, profile):
    """Every build of the grouped-attention kernel, both split-task streams: no spills, no stack, the shared
    memory within sm_90's 227 KiB a CTA. The profiled head_dim-256 builds are diagnostic: they may spill."""
    from meld.codegen.grouped_kernel import GroupedKernelConfig
    from tests.kernel_matrix import nvcc

    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not on PATH")
    cfg = GroupedKernelConfig(dtype, head_dim, profile=profile, split_stream=split_stream)
    _, log = nvcc(cfg.render(), cfg.name)
    if not (profile and head_dim == 256):
        assert "0 bytes spill stores" in log and "0 bytes stack frame" in log, log
    static = max(int(n) for n in re.findall(r"(\d+) bytes smem", log))
    assert cfg.smem_bytes + static <= 227 * 1024, (cfg.smem_bytes, static)
    assert ("MELD_PROFILE 1" in cfg.render()) == profile
    assert ("_warp" in cfg.name) == (split_stream == "warp") and ("_prof" in cfg.name) == profile


TWO_CTA_BUILDS = [(head_dim, prefix_mma) for head_dim in (64, 128) for prefix_mma in ("mma", "wgmma")]


# Two builds by default (~10 s of nvcc each); the others with -m full_matrix.
@pytest.mark.parametrize("head_dim,prefix_mma", [
    pytest.param(*b, marks=() if b in ((128, "wgmma"), (64, "mma")) else pytest.mark.full_matrix) for b in TWO_CTA_BUILDS],
    ids=["-".join(map(str, b)) for b in TWO_CTA_BUILDS])
def test_the_four_warp_build_fits_two_ctas_an_sm(head_dim, prefix_mma):
    """warps=4 (two CTAs an SM): no spills, no stack, no wgmma serialised, launch bounds of two CTAs (at most 255
    registers a thread), and two CTAs' shared memory, each with the 1 KiB the hardware keeps, within an SM's 228 KiB."""
    from meld.codegen.grouped_kernel import GroupedKernelConfig
    from tests.kernel_matrix import nvcc

    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not on PATH")
    cfg = GroupedKernelConfig("bfloat16", head_dim, prefix_mma=prefix_mma, defer_split_events=True, warps=4)
    assert (cfg.threads, cfg.ctas_per_sm, cfg.row_blocks) == (128, 2, 4) and cfg.name.endswith("_w4")
    assert "#define NUM_WARPS 4" in cfg.render() and "#define MIN_CTAS 2" in cfg.render()
    _, log = nvcc(cfg.render(), cfg.name)
    assert "0 bytes spill stores" in log and "0 bytes stack frame" in log, log
    assert "serializ" not in log, log
    static = max(int(n) for n in re.findall(r"(\d+) bytes smem", log))
    assert 2 * (cfg.smem_bytes + static + 1024) <= 228 * 1024, (cfg.smem_bytes, static)
    assert cfg.stages >= 3 and cfg.warp_stages >= 3, "a two-CTA build keeps two tiles in flight a ring"


def test_four_warps_slice_a_groups_rows_by_64_and_plan_twice_the_ctas():
    """CascadeDecode(warps=4) on the CPU executor: tasks of at most 64 query rows, 264 CTAs by default, the same
    answer as float64; the config's checks name warps and head_dim."""
    from meld.codegen.grouped_kernel import GroupedKernelConfig

    levels, q, kv = batch([40, 24], [700, 300], [int(n) for n in np.random.default_rng(4).integers(0, 90, 64)])
    op, plan = check(levels, q, kv, warps=4)
    assert op.num_ctas == 264 and op._slice_rows == 64
    t = plan.task_columns()
    assert int(t["event_count"].max()) * (HQ // HKV) <= 64 < 40 * (HQ // HKV)
    assert meld.CascadeDecode(HQ, HKV, D, P, 2, BF16, "cpu").num_ctas == 132
    with pytest.raises(ValueError, match="warps=3"):
        meld.CascadeDecode(HQ, HKV, D, P, 2, BF16, "cpu", warps=3)
    with pytest.raises(ValueError, match="warps=4 with head_dim=256"):
        meld.CascadeDecode(HQ, HKV, 256, P, 2, BF16, "cpu", warps=4)
    assert GroupedKernelConfig().render().count("#define MIN_CTAS 1") == 1


WGMMA_BUILDS = [(dtype, head_dim, profile) for dtype in ("bfloat16", "float16") for head_dim in (64, 128)
                for profile in (False, True)]


# Two builds by default (both dtypes, both head_dims: ~10 s of nvcc each); the others with -m full_matrix.
@pytest.mark.parametrize("dtype,head_dim,profile",
                         [pytest.param(*b, marks=() if b in (("bfloat16", 128, False), ("float16", 64, False))
                                       else pytest.mark.full_matrix) for b in WGMMA_BUILDS],
                         ids=["-".join(map(str, b)) for b in WGMMA_BUILDS])
def test_the_wgmma_prefix_build_compiles_for_sm90a(dtype, head_dim, profile):
    """prefix_mma="wgmma" (a shared prefix's tasks on wgmma): no spills, no stack, no wgmma serialised by ptxas,
    the shared memory (with its 1 KiB for the swizzle's alignment) within sm_90's 227 KiB a CTA."""
    from meld.codegen.grouped_kernel import GroupedKernelConfig
    from tests.kernel_matrix import nvcc

    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not on PATH")
    cfg = GroupedKernelConfig(dtype, head_dim, profile=profile, prefix_mma="wgmma")
    _, log = nvcc(cfg.render(), cfg.name)
    assert "0 bytes spill stores" in log and "0 bytes stack frame" in log, log
    assert "serializ" not in log, log
    static = max(int(n) for n in re.findall(r"(\d+) bytes smem", log))
    assert cfg.smem_bytes + static <= 227 * 1024, (cfg.smem_bytes, static)
    assert cfg.name.endswith("_warp_wgmma" + ("_prof" if profile else ""))


def test_the_operator_picks_wgmma_where_its_build_allows_and_the_config_names_bad_values():
    from meld.codegen.grouped_kernel import GroupedKernelConfig

    default, wg = GroupedKernelConfig(), GroupedKernelConfig(prefix_mma="wgmma")
    assert default.prefix_mma == "mma" and "#define MELD_PREFIX_WGMMA 1" not in default.render()
    assert "#define MELD_PREFIX_WGMMA 1" in wg.render() and "wgmma_rs_tb" in wg.render()
    assert "void wgmma_rs(" not in default.render() and "// meld: Hopper" not in default.render()
    assert wg.smem_bytes == default.smem_bytes + 1024 and wg.name != default.name
    for kw, match in [(dict(prefix_mma="mma.sync"), "prefix_mma='mma.sync'"),
                      (dict(prefix_mma="wgmma", split_stream="cta"), "split_stream='cta'"),
                      (dict(prefix_mma="wgmma", head_dim=256), "head_dim=256")]:
        with pytest.raises(ValueError, match=match):
            GroupedKernelConfig(**kw)
    picks = {(sp, d): meld.CascadeDecode(HQ, HKV, d, P, 2, BF16, "cpu", split_stream=sp).prefix_mma
             for sp in ("warp", "cta") for d in (64, 128, 256)}
    assert picks == {("warp", 64): "wgmma", ("warp", 128): "wgmma", ("warp", 256): "mma",
                     ("cta", 64): "mma", ("cta", 128): "mma", ("cta", 256): "mma"}
    with pytest.raises(ValueError, match="prefix_mma must be one of .*got 'tensor'"):
        meld.CascadeDecode(HQ, HKV, D, P, 2, BF16, "cpu", prefix_mma="tensor")
    with pytest.raises(ValueError, match="split_stream='cta'"):
        meld.CascadeDecode(HQ, HKV, D, P, 2, BF16, "cpu", split_stream="cta", prefix_mma="wgmma")
    with pytest.raises(ValueError, match="head_dim=256"):
        meld.CascadeDecode(HQ, HKV, 256, P, 2, BF16, "cpu", prefix_mma="wgmma")
    from meld.codegen.wgmma import wgmma_rs

    with pytest.raises(ValueError, match="dtype='float32'"):
        wgmma_rs("float32", 64)
    with pytest.raises(ValueError, match="N=260"):
        wgmma_rs("float16", 260)
    op = meld.CascadeDecode(HQ, HKV, D, P, 2, BF16, "cpu", prefix_mma="wgmma")   # (the CPU executor ignores it)
    levels, q, kv = batch([2], [40], [3, 5])
    op.plan(*[[lv[i] for lv in levels] for i in range(4)])
    torch.testing.assert_close(op.run(q, kv).double(), cascade_reference(q, kv, levels)[0], rtol=2e-2, atol=2e-2)


def test_the_grouped_builds_differ_in_name_and_the_warp_build_is_the_default():
    from meld.codegen.grouped_kernel import GroupedKernelConfig

    names = {GroupedKernelConfig(dt, d, profile=pr, split_stream=st).name for st, dt, d, pr in GROUPED_BUILDS}
    assert len(names) == len(GROUPED_BUILDS)   # both builds coexist in the compile cache
    assert GroupedKernelConfig().split_stream == "warp" and "#define MELD_SPLIT_WARP 1" in GroupedKernelConfig().render()
    assert "#define MELD_SPLIT_WARP 1" not in GroupedKernelConfig(split_stream="cta").render()
    warp = {d: GroupedKernelConfig("bfloat16", d, split_stream="warp") for d in (64, 128, 256)}
    assert [(warp[d].split_warps, warp[d].warp_stages) for d in (64, 128, 256)] == [(8, 4), (8, 3), (4, 2)]
    with pytest.raises(ValueError, match="split_stream='tile'"):
        GroupedKernelConfig(split_stream="tile")
    with pytest.raises(ValueError, match="split_stream must be one of"):
        meld.CascadeDecode(HQ, HKV, D, P, 2, BF16, "cpu", split_stream="tile")
    op = meld.CascadeDecode(HQ, HKV, D, P, 2, BF16, "cpu", split_stream="cta")   # (the CPU executor ignores it)
    levels, q, kv = batch([2], [40], [3, 5])
    op.plan(*[[lv[i] for lv in levels] for i in range(4)])
    torch.testing.assert_close(op.run(q, kv).double(), cascade_reference(q, kv, levels)[0], rtol=2e-2, atol=2e-2)



END_BUILDS = [(dtype, head_dim, prefix_mma, end, profile) for dtype in ("bfloat16", "float16") for head_dim in (64, 128, 256)
              for prefix_mma in ("mma", "wgmma") for end in ("defer", "direct", "defer-direct") for profile in (False, True)
              if not (head_dim == 256 and prefix_mma == "wgmma")]
_ENDS = {"defer": dict(defer_split_events=True), "direct": dict(direct_single_part=True),
         "defer-direct": dict(defer_split_events=True, direct_single_part=True)}
_END_DEFAULTS = (("bfloat16", 128, "wgmma", "defer", False), ("bfloat16", 128, "wgmma", "defer-direct", False),
                 ("float16", 256, "mma", "defer-direct", False))


# CascadeDecode's default build at the bench's head_dim (it defers), and two builds with both options (that
# head_dim, and 256, the tightest in registers) by default; the rest with -m full_matrix.
@pytest.mark.parametrize("dtype,head_dim,prefix_mma,end,profile",
                         [pytest.param(*b, marks=() if b in _END_DEFAULTS else pytest.mark.full_matrix) for b in END_BUILDS],
                         ids=["-".join(map(str, b)) for b in END_BUILDS])
def test_the_split_task_end_builds_compile_for_sm90a(dtype, head_dim, prefix_mma, end, profile):
    """defer_split_events (a split task's count and merges after the CTA's last task) and direct_single_part (a
    split task that is its event's one part writes the output): no spills, no stack (the profiled head_dim-256
    builds are diagnostic, as above), the shared memory within sm_90's 227 KiB a CTA."""
    from meld.codegen.grouped_kernel import GroupedKernelConfig
    from tests.kernel_matrix import nvcc

    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not on PATH")
    cfg = GroupedKernelConfig(dtype, head_dim, profile=profile, prefix_mma=prefix_mma, **_ENDS[end])
    _, log = nvcc(cfg.render(), cfg.name)
    if not (profile and head_dim == 256):
        assert "0 bytes spill stores" in log and "0 bytes stack frame" in log, log
    static = max(int(n) for n in re.findall(r"(\d+) bytes smem", log))
    assert cfg.smem_bytes + static <= 227 * 1024, (cfg.smem_bytes, static)
    assert ("_defer" in cfg.name) == ("defer" in end) and ("_direct" in cfg.name) == ("direct" in end)


def test_the_split_task_end_builds_defaults_and_bad_values_are_named():
    from meld.codegen.grouped_kernel import GroupedKernelConfig

    default = GroupedKernelConfig()
    assert not default.defer_split_events and not default.direct_single_part
    assert "#define MELD_DEFER_SPLIT_EVENTS 1" not in default.render()
    assert "#define MELD_DIRECT_SINGLE_PART 1" not in default.render()
    both = GroupedKernelConfig(defer_split_events=True, direct_single_part=True)
    assert both.name == default.name + "_defer_direct" and both.smem_bytes == default.smem_bytes
    assert "#define MELD_DEFER_SPLIT_EVENTS 1" in both.render() and "#define MELD_DIRECT_SINGLE_PART 1" in both.render()
    for name in ("defer_split_events", "direct_single_part"):
        with pytest.raises(ValueError, match=f"{name}=1: expected a bool"):
            GroupedKernelConfig(**{name: 1})
        with pytest.raises(ValueError, match=f"{name}=True with split_stream='cta': it needs split_stream='warp'"):
            GroupedKernelConfig(split_stream="cta", **{name: True})
        with pytest.raises(ValueError, match=f"{name} must be a bool, got 'yes'"):
            meld.CascadeDecode(HQ, HKV, D, P, 2, BF16, "cpu", **{name: "yes"})
        with pytest.raises(ValueError, match="needs split_stream='warp'"):
            meld.CascadeDecode(HQ, HKV, D, P, 2, BF16, "cpu", split_stream="cta", **{name: True})
    # The operator defers under the warp stream (its default), not under the CTA's; direct_single_part is opt-in.
    assert meld.CascadeDecode(HQ, HKV, D, P, 2, BF16, "cpu").defer_split_events
    assert not meld.CascadeDecode(HQ, HKV, D, P, 2, BF16, "cpu", split_stream="cta").defer_split_events
    assert not meld.CascadeDecode(HQ, HKV, D, P, 2, BF16, "cpu").direct_single_part
    op = meld.CascadeDecode(HQ, HKV, D, P, 2, BF16, "cpu", defer_split_events=True, direct_single_part=True)
    assert op.defer_split_events and op.direct_single_part   # (the CPU executor ignores them)
    levels, q, kv = batch([2], [40], [3, 5])
    op.plan(*[[lv[i] for lv in levels] for i in range(4)])
    torch.testing.assert_close(op.run(q, kv).double(), cascade_reference(q, kv, levels)[0], rtol=2e-2, atol=2e-2)
