"""The graph drives the runtime: a graph the library does not ship, built with `meld.ir` alone, lowers, is
planned by the planner its lowering names and runs on that family's CPU reference executor, with no
operator class, against float64 attention written here; operators ask their lowering for their planner."""
import math

import numpy as np
import pytest
import torch

import meld
from meld.codegen.lowering import lower
from meld.ir import Axis, Reduction, TaskGraph, TaskTemplate
from meld.ir.task_graph import GraphError
from meld.runtime.reference import execute_split_reduce
from meld.scheduler import GroupTable, Topology, plan_split_reduce

HQ, HKV, D, P = 12, 3, 40, 7    # four q heads per kv head; head_dim and page size off every tile
G = HQ // HKV
RED = Reduction("online_softmax", "kv")
SCALE = 0.3


def shared_then_own(levels=("system", "team")) -> TaskGraph:
    """Decode attention over three levels of KV merged in two levels: a system prompt shared by every request
    and a per-team context merge into `context` first, whose merged state then merges with each request's
    own tokens. `levels`: the shared levels the graph has."""
    point = (Axis("request", "batch_size"), Axis("kv_head", HKV))
    g = TaskGraph("shared_then_own", {"num_qo_heads": HQ, "num_kv_heads": HKV, "head_dim": D, "page_size": P})
    for name in levels:
        g.add_task(TaskTemplate(name, "split_reduce", (Axis("group", f"groups_{name}"), Axis("kv_head", HKV)),
                                range_axis=Axis("kv", f"len_{name}", dynamic=True), reduction=RED))
    g.add_task(TaskTemplate("own", "split_reduce", point, range_axis=Axis("kv", "len_own", dynamic=True),
                            reduction=RED))
    g.add_task(TaskTemplate("context", "combine", point, reduction=RED))
    g.add_task(TaskTemplate("merge", "combine", point, reduction=RED))
    for name in levels:
        g.add_edge(name, "context", RED)
    g.add_edge("context", "merge", RED)
    g.add_edge("own", "merge", RED)
    return g


def batch(levels: dict[str, tuple[list[int], list[int]]], seed: int):
    """Group tables of `levels` ({task: (requests per group, tokens per group)}) on shuffled pages of one
    NHD cache, q and the cache random float64 (no zeros)."""
    rng = np.random.default_rng(seed)
    tables, first = {}, 0
    for name, (sizes, lens) in levels.items():
        pages = [-(-n // P) for n in lens]
        indptr = np.array([0, *np.cumsum(pages)], dtype=np.int64)
        last = np.array([n - (p - 1) * P if p else 1 for n, p in zip(lens, pages)], dtype=np.int64)
        indices = first + rng.permutation(int(indptr[-1])).astype(np.int64)
        tables[name] = GroupTable(np.array([0, *np.cumsum(sizes)], dtype=np.int64), indptr, indices, last)
        first += int(indptr[-1])
    B = int(next(iter(tables.values())).qo_indptr[-1])
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, D, generator=gen, dtype=torch.float64) + 0.5
    kv = torch.randn(first + 2, 2, P, HKV, D, generator=gen, dtype=torch.float64) + 0.5
    return tables, q, kv


def attention(tables: dict[str, GroupTable], q: torch.Tensor, kv: torch.Tensor):
    """float64 softmax attention of each request over the tokens of its group at every level, as one sequence."""
    B = q.shape[0]
    out, lse = torch.zeros(B, HQ, D, dtype=torch.float64), torch.full((B, HQ), -math.inf, dtype=torch.float64)
    for b in range(B):
        pos = []
        for t in tables.values():
            grp = int(np.searchsorted(t.qo_indptr, b, side="right")) - 1
            n = int(t.kv_len(P)[grp])
            pages = t.kv_indices[t.kv_indptr[grp]:t.kv_indptr[grp + 1]]
            pos += [(int(pages[i // P]), i % P) for i in range(n)]
        if not pos:
            continue
        page, slot = (torch.tensor(x) for x in zip(*pos))
        k, v = kv[page, 0, slot], kv[page, 1, slot]                              # [n, HKV, D]
        s = torch.einsum("hgd,nhd->hgn", q[b].view(HKV, G, D), k) * SCALE
        lse[b] = torch.logsumexp(s, -1).reshape(HQ)
        out[b] = torch.einsum("hgn,nhd->hgd", torch.softmax(s, -1), v).reshape(HQ, D)
    return out, lse


def run(graph: TaskGraph, tables, q, kv, num_ctas: int):
    """Lower, plan with the lowering's planner, run its executor: nothing here knows the graph's shape."""
    low = lower(graph)
    plan = low.planner([tables[p] for p in low.producers], q.shape[0], HKV, G, P, num_ctas)
    return low.executor(graph, plan, tables, q, kv, SCALE)


LEVELS = [   # system: one group of all; team: groups of requests; own: one per request
    {"system": ([7], [123]), "team": ([3, 1, 3], [45, 0, 200]), "own": ([1] * 7, [1, 0, 19, 66, 5, 130, 8])},
    # No system prompt; request 3's team is empty too (its `context` merges nothing), and it has no tokens.
    {"system": ([7], [0]), "team": ([3, 1, 3], [300, 0, 9]), "own": ([1] * 7, [77, 2, 0, 0, 31, 64, 150])},
]


@pytest.mark.parametrize("case", range(len(LEVELS)))
@pytest.mark.parametrize("num_ctas", [1, 5, 13])
def test_three_levels_merged_in_two_run_from_the_graph(case, num_ctas):
    g = shared_then_own()
    low = lower(g)
    assert (low.family, low.combiner) == ("grouped_attention", "online_softmax")
    assert low.producers == ("own", "system", "team"), "depth first through the merge tree, in the graph's order"
    tables, q, kv = batch(LEVELS[case], seed=case * 31 + num_ctas)
    got_o, got_l = run(g, tables, q, kv, num_ctas)
    want_o, want_l = attention(tables, q, kv)
    torch.testing.assert_close(got_o, want_o, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got_l, want_l, rtol=1e-10, atol=1e-10)
    if case == 1:
        assert (got_o[3] == 0).all() and (got_l[3] == -math.inf).all(), "nothing at any level: zeros, lse -inf"


def test_each_level_counts():
    """The test above can fail: the same tables through a graph that drops the team level give another
    answer, and the right one only for the requests whose team has no tokens."""
    tables, q, kv = batch(LEVELS[0], seed=5)
    want_o, _ = attention(tables, q, kv)
    got_o, _ = run(shared_then_own(levels=("system",)), tables, q, kv, 5)
    without_team, _ = attention({n: t for n, t in tables.items() if n != "team"}, q, kv)
    torch.testing.assert_close(got_o, without_team, rtol=1e-10, atol=1e-10)
    differs = (got_o - want_o).abs().amax(dim=(1, 2)) > 1e-3
    assert differs.tolist() == [True, True, True, False, True, True, True]   # request 3's team is empty


def test_decode_attentions_graph_runs_on_the_split_reduce_executor_too():
    """Decode's shipped graph is the one-producer case: each request its own group. Its own family (the
    decode planner and executor) and the split-reduce planner and executor give the same float64 answer."""
    g = meld.ops.decode_attention_graph(HQ, HKV, D, P)
    low = lower(g)
    assert (low.family, low.producers) == ("decode_attention", ("attention_partial",))
    lens = [1, 90, 0, 17, 300]
    tables, q, kv = batch({"attention_partial": ([1] * len(lens), lens)}, seed=9)
    want_o, want_l = attention(tables, q, kv)
    t = tables["attention_partial"]
    plan = plan_split_reduce([t], len(lens), HKV, G, P, num_ctas=6)
    for o, l in (execute_split_reduce(g, plan, tables, q, kv, SCALE),
                 low.executor(low.planner(t.kv_indptr, t.kv_last_page_len, P, HKV, G, Topology(6)), q, kv[:, 0],
                              kv[:, 1], torch.from_numpy(t.kv_indices), SCALE)):
        torch.testing.assert_close(o, want_o, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(l, want_l, rtol=1e-10, atol=1e-10)


def test_graphs_no_planner_takes_are_refused_naming_what_they_ask_for():
    g = shared_then_own()
    g.add_task(TaskTemplate("normalise", "map", (Axis("request", "batch_size"),)))
    g.add_edge("merge", "normalise")
    with pytest.raises(GraphError, match=r"no planner takes task kinds \['combine', 'map', 'split_reduce'\]"):
        lower(g)
    scan = TaskGraph("scan", {})
    scan.add_task(TaskTemplate("prefix_sum", "scan", (Axis("token", "n"),)))
    with pytest.raises(GraphError, match="kind 'scan' is not one of"):
        lower(scan)
    two = shared_then_own()
    two.graph.remove_edge("context", "merge")   # two outputs: no tree merges into one
    with pytest.raises(GraphError, match=r"must form one tree .*'context': \[\]"):
        lower(two)
    both = shared_then_own()
    both.add_edge("system", "merge", RED)   # its partials would be counted at two levels
    with pytest.raises(GraphError, match="task 'system' feeds its partials to several combines"):
        lower(both)
    odd = shared_then_own()
    odd.graph.nodes["context"]["task"] = TaskTemplate("context", "combine", (Axis("group", "n"), Axis("kv_head", HKV)),
                                                      reduction=RED)
    with pytest.raises(GraphError, match=r"combine\(s\) \['context'\] merge over another domain"):
        lower(odd)


@pytest.mark.parametrize("op", ["decode", "mla", "cascade", "moe"])
def test_operators_plan_with_their_lowerings_planner(op, monkeypatch):
    """Each operator calls the planner its lowering names at call time (a spy put in its place is called)."""
    from meld.codegen.lowering import FAMILIES

    calls = []

    def spying(path):
        module, name = path.split(":")
        mod = __import__(module, fromlist=[name])
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, **k: calls.append(name) or real(*a, **k))
        return name

    if op in ("decode", "mla"):
        o = meld.DecodeAttention(8, 2, 64, 16, device="cpu") if op == "decode" else \
            meld.DecodeMLA(16, 64, device="cpu", sm_scale=0.1)
        name = spying(FAMILIES[o.lowering.family].planner)
        o.plan(torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
               torch.tensor([5], dtype=torch.int32))
        o.schedule
    elif op == "cascade":
        o = meld.CascadeDecode(8, 2, 64, 16, 2, device="cpu", num_ctas=3)
        name = spying(FAMILIES[o.lowering.family].planner)
        one = [torch.tensor([0, 1], dtype=torch.int32)] * 2
        o.plan(one, one, [torch.tensor([0], dtype=torch.int32)] * 2, [torch.tensor([3], dtype=torch.int32)] * 2)
    else:
        o = meld.MoE(64, 32, 4, 2, device="cpu", max_num_tokens=8)
        name = spying(FAMILIES[o.lowering.family].planner)
        o(torch.randn(3, 64).to(torch.bfloat16), torch.randn(3, 4),
          torch.randn(4, 64, 64).to(torch.bfloat16) / 8, torch.randn(4, 64, 32).to(torch.bfloat16) / 8)
    assert calls == [name]
