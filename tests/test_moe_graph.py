"""MoE task graph: the builder (no TVM) equals the capture of the TVM definition, survives JSON and prints
its tile dependencies; wrong formulas, bad edges and bad arguments are rejected with the reason; the TVM
definition itself computes the MoE expert FFN (compiled for the CPU, checked against torch)."""
import pytest

from meld.ir import Axis, GraphError, Reduction, TaskGraph, TaskTemplate
from meld.ops import decode_attention_graph, moe_graph

WEIGHTED = Reduction("weighted_sum", "k")
CFGS = [
    (16, 8, 4, 2, True), (16, 8, 4, 2, False),
    (32, 16, 8, 1, True), (32, 16, 8, 1, False),      # top_k = 1: renormalised weights are all 1
    (16, 8, 4, 4, True), (16, 8, 4, 4, False),        # top_k = E: renormalising changes nothing
    (64, 32, 8, 3, True, "float16"), (4096, 14336, 8, 2, True),
]


# --- the builder -----------------------------------------------------------------------------------------

def test_graph_tasks_edges_and_attrs():
    g = moe_graph(4096, 14336, 8, 2)
    assert [(t.name, t.kind) for t in g.tasks] == [
        ("route", "map"), ("dispatch", "map"), ("gemm1", "tile"), ("gemm2", "tile"), ("combine", "combine")]
    edges = {(s, d): (r["reduction"], r["depends"]) for s, d, r in g.graph.edges(data=True)}
    assert edges == {("route", "dispatch"): (None, None), ("dispatch", "gemm1"): (None, "expert"),
                     ("gemm1", "gemm2"): (None, "row_block"), ("gemm2", "combine"): (WEIGHTED, None)}
    rows = Axis("row_block", "expert_tokens", dynamic=True)
    assert g.task("gemm1").domain == (Axis("expert", 8), rows, Axis("col_block", 14336))
    assert g.task("gemm2").domain == (Axis("expert", 8), rows, Axis("col_block", 4096))
    assert g.task("combine").reduction == WEIGHTED and g.task("combine").domain == (Axis("token", "num_tokens"),)
    assert g.attrs == {"hidden_size": 4096, "intermediate_size": 14336, "num_experts": 8, "top_k": 2,
                       "renormalize": True, "dtype": "bfloat16", "activation": "silu"}
    text = str(g)
    assert "gemm1: tile [expert<8>, row_block<expert_tokens>, col_block<14336>]" in text
    assert "gemm1 -> gemm2 depends=row_block" in text and "route -> dispatch\n" in text


def test_renormalize_is_recorded_where_it_changes_the_weights():
    assert moe_graph(64, 32, 8, 2, renormalize=True).attrs["renormalize"] is True
    assert moe_graph(64, 32, 8, 8, renormalize=True) == moe_graph(64, 32, 8, 8, renormalize=False)


@pytest.mark.parametrize("cfg", CFGS)
def test_json_round_trip(cfg):
    g = moe_graph(*cfg)
    back = TaskGraph.from_json(g.to_json())
    assert back == g and back.graph.edges["gemm1", "gemm2"]["depends"] == "row_block"
    assert g != moe_graph(cfg[0], cfg[1], cfg[2] * 2, cfg[3])
    spread = moe_graph(*cfg, transport="peer")   # (expert parallelism: the outputs cross ranks to the combine)
    assert TaskGraph.from_json(spread.to_json()) == spread != g
    assert spread.transport("combine") == "peer" and g.transport("combine") is None


def test_decode_json_keeps_its_old_form():
    """An edge without a tile dependency writes no "depends" key, so decode graphs dump as before."""
    assert [set(e) for e in decode_attention_graph(32, 8, 128, 16).to_dict()["edges"]] == [
        {"src", "dst", "reduction"}]


@pytest.mark.parametrize("edit, message", [
    (lambda g: g.graph.edges["gemm1", "gemm2"].update(depends="col_block"), "differ up to it"),
    (lambda g: g.graph.edges["gemm1", "gemm2"].update(depends="token"), "not in both domains"),
    (lambda g: g.add_edge("dispatch", "gemm2", depends="row_block"), "not in both domains"),
    (lambda g: g.graph.edges["gemm2", "combine"].update(reduction=Reduction("sum", "k")), "not the one 'combine'"),
    (lambda g: g.graph.edges["gemm2", "combine"].update(reduction=None), "no incoming edge brings the partials"),
    (lambda g: g.add_edge("route", "gemm1", WEIGHTED), "not the one 'gemm1' merges"),
])
def test_validate_catches_bad_edges(edit, message):
    g = moe_graph(64, 32, 8, 2)
    edit(g)
    with pytest.raises(GraphError, match=message):
        g.validate()


@pytest.mark.parametrize("task, message", [
    (TaskTemplate("t", "tile", (Axis("expert", 8),), reduction=WEIGHTED), "tile task has no range axis"),
    (TaskTemplate("t", "map", (Axis("token", "T"),), range_axis=Axis("k", 2)), "map task has no range axis"),
    (TaskTemplate("t", "combine", (Axis("token", "T"),)), "combine task needs a reduction"),
    (TaskTemplate("t", "tile", (Axis("row_block", 64, dynamic=True),)), "dynamic axis needs a symbolic extent"),
    (TaskTemplate("t", "gemm", (Axis("token", "T"),)), "not one of"),
])
def test_validate_checks_the_new_kinds(task, message):
    g = TaskGraph("bad")
    g.add_task(task)
    with pytest.raises(GraphError, match=message):
        g.validate()


@pytest.mark.parametrize("args, message", [
    ((0, 32, 8, 2), "hidden_size must be a positive int, got 0"),
    ((64, -32, 8, 2), "intermediate_size must be a positive int, got -32"),
    ((64, 32.0, 8, 2), "intermediate_size must be a positive int, got 32.0"),
    ((64, 32, 0, 1), "num_experts must be a positive int, got 0"),
    ((64, 1 << 40, 8, 1), "intermediate_size must be at most 2147483647"),
    ((64, 32, 8, 2, "yes"), "renormalize must be True or False, got 'yes'"),
    ((64, 32, 8, 2, True, None), "dtype must be a name such as 'bfloat16', got None"),
    ((64, 32, 8, 0), r"top_k=0 must be an integer in 1\.\.num_experts=8"),
    ((64, 32, 8, 9), r"top_k=9 must be an integer in 1\.\.num_experts=8"),
])
def test_argument_errors_name_the_argument(args, message):
    with pytest.raises(ValueError, match=message):
        moe_graph(*args)


# --- the TVM definition and its capture --------------------------------------------------------------------

@pytest.fixture
def fe():
    """meld.frontend's MoE modules and tvm.te; skips where TVM is not installed."""
    pytest.importorskip("tvm")
    from tvm import te

    from meld.frontend import capture_moe, moe
    return capture_moe.capture_moe, moe, te


@pytest.mark.parametrize("cfg", CFGS)
def test_capture_equals_builder(fe, cfg):
    capture_moe, moe, _ = fe
    assert capture_moe(moe.moe_primfunc(*cfg)) == moe_graph(*cfg)


def _variant(fe, route=None, activation=None, combine=None):
    """moe_primfunc(16, 8, 4, 2) with one part replaced."""
    _, moe, te = fe
    x, logits, w13, w2 = moe.moe_inputs(16, 8, 4, "float16")
    ids, weights = (route or moe.topk_softmax)(logits, 2, True)
    y = moe.expert_ffn(x, ids, w13, w2, activation or moe.silu_and_mul)
    out = (combine or moe.weighted_combine)(weights, y, "float16")
    return te.create_prim_func([x, logits, w13, w2, out])


def _combine_of(fe, summand, reducer="sum"):
    te = fe[2]

    def combine(weights, y, dtype):
        k = te.reduce_axis((0, 2), "k")
        acc = te.compute(y.shape[::2], lambda t, h: getattr(te, reducer)(summand(weights, y, t, k, h), axis=k),
                         name="moe_sum")
        return te.compute(acc.shape, lambda t, h: acc[t, h].astype(dtype), name="out")
    return combine


def _route_of(fe, which):
    """topk_softmax with its ids or its weights replaced."""
    _, moe, te = fe

    def route(logits, top_k, renormalize):
        ids, weights = moe.topk_softmax(logits, top_k, renormalize)
        shape = (logits.shape[0], top_k)
        if which == "first_experts":
            return te.compute(shape, lambda t, j: j, name="topk_ids"), weights
        return ids, te.compute(shape, lambda t, j: logits[t, ids[t, j]].astype("float32"), name="topk_weights")
    return route


@pytest.mark.parametrize("part, message", [
    ("activation:gate*up", "SiLU is missing"),
    ("activation:silu(up)*gate", "gate and up are swapped"),
    ("combine:unweighted", "unweighted sum of the expert outputs"),
    ("combine:first_weight", r"is not sum_k w\[t, k\] \* expert_out"),
    ("combine:max", "matches no known combiner"),
    ("route:first_experts", "are not the top 2 experts by softmax probability"),
    ("route:raw_logits", "neither the softmax probabilities"),
])
def test_wrong_formula_is_rejected_with_the_reason(fe, part, message):
    te = fe[2]
    variants = {
        "activation:gate*up": {"activation": lambda g, u: g * u},
        "activation:silu(up)*gate": {"activation": lambda g, u: u * te.sigmoid(u) * g},
        "combine:unweighted": {"combine": _combine_of(fe, lambda w, y, t, k, h: y[t, k, h])},
        "combine:first_weight": {"combine": _combine_of(fe, lambda w, y, t, k, h: w[t, 0] * y[t, k, h])},
        "combine:max": {"combine": _combine_of(fe, lambda w, y, t, k, h: w[t, k] * y[t, k, h], "max")},
        "route:first_experts": {"route": _route_of(fe, "first_experts")},
        "route:raw_logits": {"route": _route_of(fe, "raw_logits")},
    }
    with pytest.raises(ValueError, match=message):
        fe[0](_variant(fe, **variants[part]))


def test_the_right_variant_is_accepted(fe):
    """The variant builder itself is sound: with no part replaced it captures to the builder's graph."""
    assert fe[0](_variant(fe)) == moe_graph(16, 8, 4, 2, True, "float16")


def test_a_function_without_expert_gemms_is_rejected(fe):
    from meld.frontend import decode_attention_primfunc
    with pytest.raises(ValueError, match="expected two expert GEMMs"):
        fe[0](decode_attention_primfunc(8, 8, 64, 16))


@pytest.mark.parametrize("top_k, renormalize, dtype", [
    (2, True, "float32"), (2, False, "float16"), (1, True, "float32"), (4, False, "bfloat16"),
])
def test_definition_matches_torch(fe, top_k, renormalize, dtype):
    tvm = pytest.importorskip("tvm")
    torch = pytest.importorskip("torch")
    hidden, inter, num_experts, num_tokens = 16, 8, 4, 6
    func = fe[1].moe_primfunc(hidden, inter, num_experts, top_k, renormalize, dtype)
    fn = tvm.compile(tvm.IRModule({"main": func}), target="llvm")["main"]
    gen = torch.Generator().manual_seed(0)
    td = getattr(torch, dtype)
    x = torch.randn(num_tokens, hidden, generator=gen).to(td)
    logits = torch.randn(num_tokens, num_experts, generator=gen).to(td)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / 4).to(td)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / 4).to(td)
    out = torch.empty(num_tokens, hidden, dtype=td)
    fn(x, logits, w13, w2, out)

    probs = logits.float().softmax(-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    ref = torch.zeros(num_tokens, hidden)
    for t in range(num_tokens):
        for j in range(top_k):
            e = int(ids[t, j])
            gate, up = (w13[e].float() @ x[t].float()).split(inter)
            act = (torch.nn.functional.silu(gate) * up).to(td).float()
            ref[t] += weights[t, j] * (w2[e].float() @ act)
    tol = 1e-5 if dtype == "float32" else 2e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_lowering_selects_the_family_and_merge_from_the_graph():
    from meld.codegen.lowering import lower
    from meld.ir.task_graph import GraphError
    from meld.ops import decode_attention_graph

    low = lower(moe_graph(64, 32, 8, 2))
    assert (low.family, low.combiner) == ("moe", "weighted_sum")
    assert low.waits == (("gemm1", "gemm2", "row_block"),)
    assert lower(decode_attention_graph(32, 8, 128, 16)).family == "decode_attention"
    g = moe_graph(64, 32, 8, 2)
    g.graph.edges["gemm1", "gemm2"]["depends"] = "expert"   # a family that waits per expert does not exist
    with pytest.raises(GraphError, match="row-block dependency"):
        lower(g)
