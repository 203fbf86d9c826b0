"""meld.ir: task graphs and schedules validate, print and survive a JSON round trip."""
import numpy as np
import pytest

from meld.ir import COMBINERS, Axis, GraphError, Reduction, Schedule, ScheduleError, TaskGraph, TaskTemplate
from meld.ops import decode_attention_graph
from meld.scheduler import Topology, plan_decode


def test_task_graph_round_trip_and_text():
    g = decode_attention_graph(32, 8, 128, 16)
    assert TaskGraph.from_json(g.to_json()) == g
    assert g != decode_attention_graph(32, 4, 128, 16)
    text = str(g)
    assert "attention_partial: split_reduce [request<batch_size>, kv_head<8>] over kv<kv_len>" in text
    assert g.task("attention_partial").reduction.identity == (-np.inf, 0.0, 0.0)


def test_task_graph_rejects_broken_graphs():
    g = TaskGraph("bad")
    g.add_task(TaskTemplate("p", "split_reduce", (Axis("request", "B"),)))
    with pytest.raises(GraphError, match="needs a range axis"):
        g.validate()
    g = TaskGraph("bad")
    g.add_task(TaskTemplate("p", "combine", (Axis("request", "B"),), affinity=("kv_head",)))
    with pytest.raises(GraphError, match="affinity"):
        g.validate()
    g = TaskGraph("bad")
    g.add_task(TaskTemplate("p", "combine", (Axis("request", "B"),), reduction=Reduction("nope", "kv")))
    with pytest.raises(GraphError, match="unknown combiner"):
        g.validate()
    with pytest.raises(GraphError, match="already"):
        g.add_task(TaskTemplate("p", "combine", ()))
    with pytest.raises(GraphError, match="no task named"):
        g.add_edge("p", "q")


def test_online_softmax_combiner_merges_like_one_softmax():
    rng = np.random.default_rng(0)
    s, v = rng.normal(size=10), rng.normal(size=(10, 3))
    merge = COMBINERS["online_softmax"].merge

    def state(idx):
        m = s[idx].max()
        p = np.exp(s[idx] - m)
        return m, p.sum(), p @ v[idx]

    m, l, acc = merge(*state(slice(0, 4)), *state(slice(4, 10)))
    full = state(slice(0, 10))
    assert np.isclose(m, full[0]) and np.isclose(l, full[1]) and np.allclose(acc, full[2])
    ident = COMBINERS["online_softmax"].identity
    m2, l2, acc2 = merge(*ident[:2], np.zeros(3), *ident[:2], np.zeros(3))   # two empty sides stay empty
    assert m2 == -np.inf and l2 == 0 and not np.isnan(acc2).any()


def _schedule(lens=np.array([0, 5000, 17, 300, 2048])):
    return plan_decode(lens, np.r_[0, np.cumsum(-(-lens // 16))][:-1], 8, 4, Topology(16, {1: 32}))


def test_schedule_round_trip():
    s = _schedule().validate()
    assert Schedule.from_json(s.to_json()) == s
    assert "items on" in str(s)


@pytest.mark.parametrize("field,row,delta,message", [
    ("s_end", 3, 16, "contiguous"),
    ("head_parts", 5, 1, "part count"),
    ("head_first", 4, 1, "contiguous from its parts_begin"),
    ("u_end", 2, -1, "contiguous|backwards"),
])
def test_schedule_validation_catches_corruption(field, row, delta, message):
    s = _schedule()
    col = int(np.flatnonzero(s.cta[row])[0]) if field.startswith("head") else 3
    s.cta[row, col] += delta
    with pytest.raises(ScheduleError, match=message):
        s.validate()


def test_merge_paths_follow_the_clusters():
    lens = np.array([5000, 40, 3000, 700, 0, 12000], dtype=np.int64)
    s = _schedule(lens)
    W = s.num_ctas
    alone = s.merge_paths()
    assert alone["split_units"] > 0 and alone["onchip_units"] == 0 and alone["hbm_pieces"] > 0
    everyone = s.merge_paths([0] * W)                      # one cluster holds every CTA: all on chip
    assert everyone["onchip_units"] == everyone["split_units"] == alone["split_units"]
    assert everyone["hbm_pieces"] == everyone["hbm_partial_rows"] == 0
    pairs = s.merge_paths([c // 2 for c in range(W)])
    it = s.items()
    expect = sum(1 for i in np.flatnonzero((it["slot"] >= 0) & (it["cta"] == it["parts_begin"] - it["unit"]))
                 if (it["cta"][i] // 2) == (it["cta"][i] + it["num_parts"][i] - 1) // 2)
    assert pairs["onchip_units"] == expect
    assert pairs["onchip_pieces"] + pairs["hbm_pieces"] == alone["hbm_pieces"]
    assert pairs["hbm_partial_rows"] == 4 * pairs["hbm_pieces"]    # group 4: four q heads per piece


def test_batch_invariant_schedule_keeps_pieces_on_chunks():
    """A batch-invariant schedule validates, survives JSON, and a cut moved off a chunk boundary is caught
    (it cuts a chunk in two: the unit then has one piece more than its chunks)."""
    L = np.array([3000, 700, 0, 5000])
    s = plan_decode(L, np.zeros(4, dtype=np.int64), 2, 4, Topology(8), chunk_tokens=1024).validate()
    assert Schedule.from_json(s.to_json()) == s and s.chunk_tokens == 1024
    assert s.num_slots == 2 * (3 + 5)                      # 2 units per request; 700 and 0 take no slot
    c = int(np.flatnonzero(s.cta[3] % 1024 == 0)[0])    # a segment that ends on a chunk boundary inside a unit
    assert s.cta[3, c] > 0
    s.cta[3, c] += 16
    s.cta[1, c + 1] += 16
    with pytest.raises(ScheduleError, match="part count differs"):
        s.validate()


def test_a_combine_edge_carries_how_partials_cross_ranks():
    import dataclasses

    import meld
    from meld.codegen.lowering import lower
    from meld.codegen.params import SEQ_PARALLEL_DECODE_PARAMS
    from meld.ops import mla_decode_graph
    from meld.ops.tp_linear_graph import tp_linear_graph

    g = decode_attention_graph(32, 8, 128, 16, transport="proxy")
    assert TaskGraph.from_json(g.to_json()) == g and "transport=proxy" in str(g)
    assert lower(g).transport == "proxy" and lower(g).family == "decode_attention"
    assert lower(decode_attention_graph(32, 8, 128, 16)).transport is None
    assert "transport" not in decode_attention_graph(32, 8, 128, 16).to_json()   # old JSON unchanged
    assert lower(tp_linear_graph(64, 64, 2, transport="peer")).transport == "peer"
    with pytest.raises(GraphError, match="transport 'rdma'"):
        decode_attention_graph(32, 8, 128, 16, transport="rdma")
    m = mla_decode_graph(128, 512, 64, 64)
    m.graph.edges["attention_partial", "merge"]["transport"] = "peer"
    with pytest.raises(GraphError, match="only in the decode_attention"):
        lower(m)

    class Ranked(meld.DecodeAttention):   # a composer puts its rank dimension in the graph; the kernel follows
        def _graph(self, dtype):
            return decode_attention_graph(self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size,
                                          dtype, transport="peer")

    op = Ranked(32, 8, 128, 16, device="cpu")
    assert op.kernel_config.xrank == "peer" and op.kernel_config.params is SEQ_PARALLEL_DECODE_PARAMS
    plain = meld.DecodeAttention(32, 8, 128, 16, device="cpu")
    with pytest.raises(ValueError, match="stay on one GPU"):
        meld.DecodeAttention(32, 8, 128, 16, device="cpu",
                             kernel_config=dataclasses.replace(plain.kernel_config, xrank="peer"))


def test_numpy_integer_sizes_make_json_graphs():
    import meld
    from meld.ops import cascade_decode_graph, mla_decode_graph, moe_graph

    n = np.int64
    for g in (decode_attention_graph(n(8), n(2), n(64), n(16)), cascade_decode_graph(n(8), n(2), n(64), n(16), n(2)),
              moe_graph(n(64), n(32), n(4), n(2)), mla_decode_graph(n(16), n(512), n(64), n(64))):
        assert TaskGraph.from_json(g.to_json()) == g
    assert meld.CascadeDecode(n(8), n(2), n(64), n(16), n(2)).graph.attrs["num_levels"] == 2


def test_a_second_edge_between_two_tasks_is_refused_and_lower_needs_a_graph():
    from meld.codegen.lowering import lower

    g = decode_attention_graph(8, 2, 128, 16, transport="peer")
    with pytest.raises(GraphError, match="already in graph"):
        g.add_edge("attention_partial", "merge", Reduction("online_softmax", "kv"))
    assert lower(g).transport == "peer", "the first edge stays"
    doc = g.to_dict()
    doc["edges"].append({**doc["edges"][0], "transport": "proxy"})
    with pytest.raises(GraphError, match="already in graph"):
        TaskGraph.from_json(__import__("json").dumps(doc))
    for bad in ("x", None, g.to_dict()):
        with pytest.raises(TypeError, match="graph must be a meld.ir.TaskGraph"):
            lower(bad)


def test_head_major_schedule_survives_json_and_names_its_units():
    """DecodeMLA's head-major schedule: unit u is head block u // B of request u % B; it round-trips through
    JSON, and a head_major that is not a bool, or one with chunks, is refused."""
    import json

    from meld.scheduler import plan_decode_host

    lens = [300, 0, 2000]
    indptr = np.r_[0, np.cumsum([-(-n // 16) for n in lens])].astype(np.int32)
    last = np.array([300 - 18 * 16, 5, 2000 - 124 * 16], dtype=np.int32)
    s = plan_decode_host(indptr, last, 16, 1, 128, Topology(8), heads_per_item=64, head_major=True).validate()
    assert Schedule.from_json(s.to_json()) == s and s.head_major
    it = s.items()
    assert np.array_equal(it["req"], it["unit"] % 3) and np.array_equal(it["q_head"], it["unit"] // 3 * 64)
    assert np.array_equal(s.unit_lengths(), np.tile(lens, 2))
    doc = json.loads(s.to_json())
    with pytest.raises(ScheduleError, match="head_major must be true or false"):
        Schedule.from_json(json.dumps({**doc, "head_major": 1}))
    with pytest.raises(ScheduleError, match="cuts no chunks"):
        Schedule.from_json(json.dumps({**doc, "chunk_tokens": 1024}))
