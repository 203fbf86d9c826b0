"""Hostile inputs, round 4: the planning and tuning tools (Topology, the tuning database, the cost fit).
Every bad input is a ValueError that names the argument and the value; valid inputs behave as before."""
from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from meld.scheduler import Topology


@pytest.mark.parametrize("make, match", [
    (lambda: Topology(10 ** 12), r"sm_count must be at most \d+, got 1000000000000"),
    (lambda: Topology(132, {1: 10 ** 9}), r"max_active_clusters\[1\] = 1000000000 clusters of 1 CTAs: more than the \d+ CTA slots"),
    (lambda: Topology(132, {1: 132, 2: 10 ** 12}), r"max_active_clusters\[2\] = 1000000000000"),
    (lambda: Topology(132, {1: 132, 2 ** 40: 1}), r"max_active_clusters\[1099511627776\]"),
])
def test_topology_refuses_grids_no_gpu_has(make, match):
    """Topology(sm_count=10**12) was accepted, and plan_decode then tried to allocate arrays per CTA slot
    (29.8 GiB for {1: 10**9})."""
    with pytest.raises(ValueError, match=match):
        make()


def test_topology_still_takes_the_tables_in_use():
    assert Topology.h200().cluster_mix(4) == [(4, 30), (2, 6)]
    assert Topology(70000).num_ctas == 70000
    assert Topology(24, {1: 48}).ctas_per_sm == 2
    assert Topology(1, {1: 1, 16: 80}).cluster_mix(16) == [(1, 1)]


@pytest.mark.parametrize("preferred", [3.5, "4", None, True, 0, 3])
def test_cluster_mix_names_a_preferred_size_that_is_no_power_of_two(preferred):
    """cluster_mix(3.5), ('4'), (None) raised TypeError from inside its bit test; True was taken as 1."""
    with pytest.raises(ValueError, match=r"preferred cluster size must be a power of two, got " + repr(preferred)):
        Topology.h200().cluster_mix(preferred)


# --- the tuning database --------------------------------------------------------------------------------

KEY = dict(operator="decode_attention", dtype="bfloat16", shape="Hq32/Hkv8/D128/P16", gpu="NVIDIA H200",
           sm_count=132, driver="12.8", cuda="12.8", source_hash="0123456789abcdef")


@pytest.mark.parametrize("raw, match", [
    ([1, 2], r"expected a JSON object, got list"),
    ({"version": True, "entries": []}, r"version True"),
    ({"version": 1, "entries": 5}, r"'entries' must be a list, got 5"),
    ({"version": 1, "entries": {"a": 1}}, r"'entries' must be a list"),
    ({"version": 1, "entries": [5]}, r"entry 0 must be an object"),
    ({"version": 1, "entries": [{"key": {**KEY, "sm_count": "132"}, "config": {}}]}, r"sm_count must be an int, got '132'"),
    ({"version": 1, "entries": [{"key": {**KEY, "sm_count": True}, "config": {}}]}, r"sm_count must be an int, got True"),
    ({"version": 1, "entries": [{"key": {**KEY, "operator": [1]}, "config": {}}]}, r"operator must be a str, got \[1\]"),
    ({"version": 1, "entries": [{"key": KEY, "config": [["a", 1]]}]}, r"config must be an object, got \[\['a', 1\]\]"),
    ({"version": 1, "entries": [{"key": KEY, "config": {}, "evidence": []}]}, r"evidence must be an object, got \[\]"),
    ({"version": 1, "entries": [{"key": KEY, "config": {}, "evidence": None}]}, r"evidence must be an object, got None"),
])
def test_tuning_db_load_refuses_entries_of_the_wrong_types(tmp_path, raw, match):
    """A key with sm_count '132' or operator [1] (unhashable), a config that is a list of pairs, an evidence
    list, version True: each was loaded as an entry (that never matched, or broke lookup) or failed with a
    message from dict() that named no field."""
    from meld.tuning.db import TuningDB

    path = tmp_path / "db.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=rf"tuning database .*db.json is not readable: .*{match}"):
        TuningDB.load(path)


def test_tuning_db_round_trip_and_a_save_that_cannot_be_written(tmp_path):
    from meld.tuning.db import TuningDB, TuningEntry, TuningKey

    db = TuningDB(tmp_path / "db.json", [TuningEntry(TuningKey(**KEY), {"cost": {"item_overhead_tokens": 68}},
                                                     {"default_us": 232.1})])
    db.save()
    assert TuningDB.load(db.path).entries == db.entries
    before = db.path.read_text()
    db.put(TuningEntry(TuningKey(**{**KEY, "shape": "other"}), {"cost": {1, 2}}))
    with pytest.raises(ValueError, match=r"cannot save the entry .*'other'.*set is not JSON serializable"):
        db.save()
    assert db.path.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["db.json"]


# --- the cost fit -----------------------------------------------------------------------------------------

def _samples(n, times, tokens=None):
    from meld.tuning.cost_fit import CtaSamples

    z = np.zeros(n)
    tokens = np.arange(n) * 100.0 + 1 if tokens is None else tokens
    return CtaSamples(tokens, 1.0 + np.arange(n) % 3, z, np.arange(n), np.asarray(times, dtype=float),
                      np.zeros(n, dtype=np.int64), z, z, z)


def test_cost_fit_refuses_what_it_cannot_fit():
    from meld.scheduler.cost_model import DecodeCost
    from meld.tuning.cost_fit import CostFit, fit_cost, today

    ok = _samples(10, np.arange(10) * 50.0 + 100)
    with pytest.raises(ValueError, match=r"rounds must be a positive int, got 0"):   # was UnboundLocalError
        fit_cost(ok, per_sm=True, rounds=0)
    with pytest.raises(ValueError, match=r"expected CtaSamples .*got list"):        # was "need at least 8 CTA samples"
        fit_cost([1.0] * 10)
    idle = replace(_samples(10, np.ones(10), tokens=np.zeros(10)), items=np.zeros(10))
    with pytest.raises(ValueError, match=r"needs planned work .*got 0\.0"):       # was a fit of per_token_ns=inf
        today(idle, DecodeCost())
    with pytest.raises(ValueError, match=r"positive per_token_ns, got 0\.0"):      # was ZeroDivisionError
        CostFit(0.0, 1.0, 0.0, 0.0).item_overhead_tokens
    assert fit_cost(ok).per_token_ns > 0 and today(ok, DecodeCost()).item_overhead_tokens == DecodeCost().item_overhead_tokens


@pytest.mark.parametrize("d, match", [
    ({"per_token_ns": "a", "per_item_ns": 1, "per_merge_ns": 1, "fixed_ns": 1}, r"CostFit.per_token_ns must be a finite number, got 'a'"),
    ({"per_token_ns": 1, "per_item_ns": float("nan"), "per_merge_ns": 1, "fixed_ns": 1}, r"CostFit.per_item_ns .*nan"),
    ({"per_token_ns": 1}, r"missing fields \['per_item_ns', 'per_merge_ns', 'fixed_ns'\]"),
    ({"per_token_ns": 1, "per_item_ns": 1, "per_merge_ns": 1, "fixed_ns": 1, "sm_speed": [1]}, r"sm_speed must be a dict"),
    ({"per_token_ns": 1, "per_item_ns": 1, "per_merge_ns": 1, "fixed_ns": 1, "sm_speed": {"x": 1}}, r"sm_speed must map"),
    ([1], r"expected a dict, got list"),
])
def test_cost_fit_from_dict_and_load_fit_name_a_bad_field(tmp_path, d, match):
    """from_dict took per_token_ns='a' (every prediction then a TypeError), and raised TypeError or
    AttributeError for a missing field or a list of speeds."""
    from meld.tuning.cost_fit import CostFit
    from meld.tuning.tune import load_fit

    with pytest.raises(ValueError, match=match):
        CostFit.from_dict(d)
    path = tmp_path / "fit.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"fit.json: "):
        load_fit(path)


def test_cost_fit_from_dict_round_trip():
    from dataclasses import asdict

    from meld.tuning.cost_fit import CostFit

    fit = CostFit(2.5, 900.0, 1500.0, 4000.0, {0: 1.0, 7: 1.25}, 0.5)
    assert CostFit.from_dict(json.loads(json.dumps(asdict(fit)))) == fit


# --- profile traces ---------------------------------------------------------------------------------------

def _raw():
    raw = np.zeros((2, 3, 4), dtype=np.int64)
    raw[0, 0], raw[0, 1] = [100, 200, 3, 1], [120, 150, 0, 0]
    raw[1, 0], raw[1, 1] = [100, 300, 5, 1], [110, 290, 0, 0]
    return raw


@pytest.mark.parametrize("make, match", [
    (lambda T: T.from_buffer(_raw().astype(np.float64) + 0.5, 1, 1), r"must hold integers .*got dtype float64"),
    (lambda T: T.from_buffer(np.full((2, 3, 4), "a"), 1, 1), r"must hold integers .*got dtype <U1"),
    (lambda T: T.from_buffer(_raw(), 1, 1, cluster=["a", "b"]), r"cluster must hold one int per CTA, got \['a', 'b'\]"),
    (lambda T: T.from_buffer(_raw(), 1, 1, grid=[0.5, 1]), r"grid must hold one int per CTA, got \[0\.5, 1\]"),
    (lambda T: T([], [], 0, "a", 1), r"units_per_request must be an int, got 'a'"),
    (lambda T: T([], [], 0, 2.0, 1), r"units_per_request must be an int, got 2\.0"),
    (lambda T: T([], [], None, 1, 1), r"overflowed must be an int, got None"),
])
def test_trace_names_a_buffer_or_count_of_the_wrong_type(make, match):
    """A float buffer raised 'slice indices must be integers' (a string one, str - int), cluster=['a', ...]
    int()'s message, Trace(units_per_request='a') '<' between str and int."""
    from meld.runtime.profile import Trace

    with pytest.raises(ValueError, match=match):
        make(Trace)


def test_trace_from_buffer_still_decodes_int_buffers():
    from meld.runtime.profile import Trace

    t = Trace.from_buffer(_raw().astype(np.int32), 1, 1, cluster=np.array([0, 0]), grid=(0, 0))
    assert [(s.cta, s.sm, s.cluster) for s in t.cta_spans] == [(0, 3, 0), (1, 5, 0)]
    assert Trace.from_chrome(t.to_chrome()).tasks == t.tasks


# --- MoE weight packing -----------------------------------------------------------------------------------

def _weights(E=2, H=72, I=100):
    import torch

    g = torch.Generator().manual_seed(0)
    return (torch.randn(E, 2 * I, H, generator=g).to(torch.bfloat16),
            torch.randn(E, H, I, generator=g).to(torch.bfloat16))


def test_pack_unpack_round_trip_is_exact():
    import torch

    from meld.ops.moe_weights import pack_moe_weights, unpack_moe_weights

    w13, w2 = _weights()
    for a, b in zip(unpack_moe_weights(*pack_moe_weights(w13.transpose(1, 2).contiguous().transpose(1, 2), w2),
                                       72, 100), (w13, w2)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("args, match", [
    (lambda p13, p2, w13, w2: (w13, w2, 72, 100), r"w13p \(2, 200, 72\) and w2p \(2, 72, 100\) are not the packed"),
    (lambda p13, p2, w13, w2: (p2, p13, 72, 100), r"w13p \(2, 2, 2, 64, 64\) .* are not the packed"),
    (lambda p13, p2, w13, w2: (p13, p2, 200, 100), r"hidden_size=200, intermediate_size=100"),
    (lambda p13, p2, w13, w2: (p13, p2, "72", 100), r"hidden_size must be a positive int, got '72'"),
    (lambda p13, p2, w13, w2: (p13, p2, 72, 0), r"intermediate_size must be a positive int, got 0"),
    (lambda p13, p2, w13, w2: ([1], p2, 72, 100), r"w13p must be a packed tensor .*got list"),
    (lambda p13, p2, w13, w2: (p13, p2.float(), 72, 100), r"w13p and w2p must share dtype"),
])
def test_unpack_moe_weights_names_what_is_not_packed(args, match):
    """Plain weights raised IndexError, swapped ones a RuntimeError from view, hidden_size '72' a TypeError
    from slicing, and hidden_size 200 for weights packed at 72 returned tensors of 72 columns."""
    from meld.ops.moe_weights import pack_moe_weights, unpack_moe_weights

    w13, w2 = _weights()
    p13, p2 = pack_moe_weights(w13, w2)
    with pytest.raises(ValueError, match=match):
        unpack_moe_weights(*args(p13, p2, w13, w2))


@pytest.mark.parametrize("cut", [lambda t: t[:0], lambda t: t[..., :0]])
def test_pack_moe_weights_refuses_empty_layers(cut):
    """E = 0 or H = 0 was packed into an empty tensor."""
    from meld.ops.moe_weights import pack_moe_weights

    w13, w2 = _weights()
    w2 = w2[:0] if w13.shape[0] != cut(w13).shape[0] else w2[:, :0]
    with pytest.raises(ValueError, match=r"w13 must be \[E, 2I, H\] with E, I, H >= 1"):
        pack_moe_weights(cut(w13), w2)


# --- task graph builders ----------------------------------------------------------------------------------

@pytest.mark.parametrize("args, match", [
    ((32, 0, 128, 16), r"num_kv_heads must be a positive int, got 0"),           # was ZeroDivisionError
    (("32", 8, 128, 16), r"num_qo_heads must be a positive int, got '32'"),      # was TypeError from %
    ((32.0, 8, 128, 16), r"num_qo_heads must be a positive int, got 32\.0"),     # was a graph of group_size 4.0
    ((0, 8, 128, 16), r"num_qo_heads must be a positive int, got 0"),            # was a graph of group_size 0
    ((True, 1, 128, 16), r"num_qo_heads must be a positive int, got True"),
    ((32, 8, -1, 16), r"head_dim must be a positive int, got -1"),
    ((32, 8, 128, 0), r"page_size must be a positive int, got 0"),
    ((2 ** 40, 8, 128, 16), r"num_qo_heads must be at most 2147483647"),
    ((32, 8, 128, 16, 5), r"dtype must be a name such as 'bfloat16', got 5"),
])
def test_decode_attention_graph_checks_its_sizes(args, match):
    """mla_decode_graph and moe_graph checked their sizes; decode_attention_graph took 0, -1, 32.0 and
    True, and raised ZeroDivisionError or a TypeError from '%' on the rest."""
    from meld.ops import decode_attention_graph

    with pytest.raises(ValueError, match=match):
        decode_attention_graph(*args)


def test_decode_attention_graph_takes_numpy_sizes_as_before():
    from meld.ops import decode_attention_graph

    assert decode_attention_graph(np.int64(32), 8, 128, 16) == decode_attention_graph(32, 8, 128, 16)


def test_tuning_db_put_and_lookup_name_a_wrong_type(tmp_path):
    from meld.tuning.db import TuningDB

    db = TuningDB(tmp_path / "db.json")
    with pytest.raises(TypeError, match="entry must be a TuningEntry, got int"):
        db.put(5)
    with pytest.raises(TypeError, match="key must be a TuningKey, got str"):
        db.lookup("x")
    assert db.entries == []
