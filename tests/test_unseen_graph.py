"""The graph drives the runtime: operators ask their lowering for their planner, and a graph no planner
takes is refused naming what it asks for."""
import pytest
import torch

import meld
from meld.codegen.lowering import lower
from meld.ir import Axis, TaskGraph, TaskTemplate
from meld.ir.task_graph import GraphError


def test_graphs_no_planner_takes_are_refused_naming_what_they_ask_for():
    g = meld.ops.decode_attention_graph(8, 2, 64, 16)
    g.add_task(TaskTemplate("normalise", "map", (Axis("request", "batch_size"),)))
    g.add_edge("merge", "normalise")
    with pytest.raises(GraphError, match=r"no planner takes task kinds \['combine', 'map', 'split_reduce'\]"):
        lower(g)
    scan = TaskGraph("scan", {})
    scan.add_task(TaskTemplate("prefix_sum", "scan", (Axis("token", "n"),)))
    with pytest.raises(GraphError, match="kind 'scan' is not one of"):
        lower(scan)


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
