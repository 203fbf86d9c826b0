"""The lowering is where an operator gets its kernel config, parameter struct, planners, executor and merge:
graphs that differ select differently, and an operator runs what `FAMILIES` names (a patched entry changes
what it builds, plans with and executes), not what its class would pick."""
import dataclasses

import pytest
import torch

import meld
from meld.codegen import DecodeKernelConfig, DecodePlanKernelConfig
from meld.codegen import params as P
from meld.codegen.ep_kernel import EpKernelConfig
from meld.codegen.grouped_kernel import GroupedKernelConfig
from meld.codegen.lowering import FAMILIES, lower
from meld.codegen.mla_kernel import MlaKernelConfig
from meld.codegen.moe_kernel import MoeKernelConfig
from meld.codegen.tp_kernel import TpKernelConfig
from meld.ir.task_graph import GraphError
from meld.ops import cascade_decode_graph, decode_attention_graph, mla_decode_graph, moe_graph
from meld.ops.tp_linear_graph import tp_linear_graph
from meld.runtime.reference import attention_reference
from meld.workloads import paged


def test_the_graph_selects_config_params_planners_and_merge():
    one_gpu = lower(decode_attention_graph(32, 2, 64, 16, "float16"))
    assert one_gpu.kernel_config() == DecodeKernelConfig.default("float16", 64, group_size=16)
    assert one_gpu.kernel_config(batch_invariant=True).batch_invariant
    assert one_gpu.params is P.DECODE_PARAMS and isinstance(one_gpu.device_planner, DecodePlanKernelConfig)
    crossing = lower(decode_attention_graph(32, 8, 128, 16, transport="proxy"))
    assert crossing.kernel_config().xrank == "proxy" and crossing.params is P.SEQ_PARALLEL_DECODE_PARAMS
    assert crossing.kernel_config().params is crossing.params   # (the struct its render emits)

    mla = lower(mla_decode_graph(128, 512, 64, 64))
    assert (mla.kernel_config(), mla.params) == (MlaKernelConfig(), P.MLA_PARAMS)
    assert isinstance(mla.device_planner, DecodePlanKernelConfig)
    moe = lower(moe_graph(64, 32, 8, 2))
    assert (moe.kernel_config(profile=True), moe.params, moe.device_planner) == (
        MoeKernelConfig(profile=True), P.MOE_PARAMS, None)
    with pytest.raises(GraphError, match="the moe family has no cross-rank kernels for transport None"):
        moe.transport_config()
    experts_spread = lower(moe_graph(64, 32, 8, 2, transport="proxy"))   # (expert parallelism)
    assert (experts_spread.family, experts_spread.transport, experts_spread.params) == ("moe", "proxy", P.EP_PARAMS)
    assert experts_spread.transport_config(watchdog_ms=50) == EpKernelConfig("proxy", 50)
    assert experts_spread.kernel_config() == MoeKernelConfig()   # (each rank's expert GEMMs: the one-GPU build)
    tp = lower(tp_linear_graph(64, 64, 2, transport="proxy"))
    assert (tp.kernel_config(), tp.params, tp.device_planner) == (TpKernelConfig(transport="proxy"), P.TP_PARAMS, None)
    grouped = lower(cascade_decode_graph(8, 2, 256, 16, 2, "float16"))
    assert (grouped.kernel_config(), grouped.params) == (GroupedKernelConfig("float16", 256), P.GROUPED_PARAMS)

    merges = {low.family: low.device_merge for low in (one_gpu, mla, moe, tp, grouped)}
    assert merges == {"decode_attention": "split_kv.cuh", "mla_decode": "split_kv.cuh", "moe": "moe.cuh",
                      "tp_linear": "tp_linear.cuh", "grouped_attention": "grouped_attention.cuh"}
    with pytest.raises(GraphError, match="the moe family's kernel merges \\['weighted_sum'\\], not 'sum'"):
        dataclasses.replace(moe, combiner="sum").device_merge


def _patch(monkeypatch, family: str, **fields) -> None:
    monkeypatch.setitem(FAMILIES, family, dataclasses.replace(FAMILIES[family], **fields))


def eight_head_units(low, **options):
    """A decode config builder that ignores the group size: 8-head units, whatever the graph says."""
    return dataclasses.replace(DecodeKernelConfig.of(low, **options), heads_per_unit=8)


def test_an_operator_builds_and_plans_the_config_its_family_names(monkeypatch):
    lens = [700, 3, 0, 1500]
    pb = paged(lens, 16)
    q = torch.randn(len(lens), 16, 64).to(torch.bfloat16)
    kv = torch.randn(pb.num_pages, 2, 16, 1, 64).to(torch.bfloat16)
    shipped = meld.DecodeAttention(16, 1, 64, 16, device="cpu")
    _patch(monkeypatch, "decode_attention", config=f"{__name__}:eight_head_units")
    patched = meld.DecodeAttention(16, 1, 64, 16, device="cpu")
    assert (shipped.kernel_config.heads_per_unit, patched.kernel_config.heads_per_unit) == (16, 8)
    ref, _ = attention_reference(q, kv, pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    for attn in (shipped, patched):
        attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
        out = attn.run(q, kv)
        assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2
    # Two 8-head units per request (the group of 16 split in two) where the shipped config has one.
    assert patched.schedule.num_units == 2 * shipped.schedule.num_units == 2 * len(lens)


class _SmallPlanner(DecodePlanKernelConfig):
    max_ctas = 8


def test_the_device_planner_and_merge_are_the_familys(monkeypatch):
    _patch(monkeypatch, "decode_attention", device_planner=f"{__name__}:_SmallPlanner")
    with pytest.raises(ValueError, match="the planner serves grids of at most 8 CTAs"):
        meld.DecodeAttention(8, 2, 64, 16, device="cpu")   # (an H200's 132 CTAs)
    meld.DecodeAttention(8, 2, 64, 16, device="cpu", topology=meld.scheduler.Topology(8, {1: 8}))
    monkeypatch.undo()
    _patch(monkeypatch, "mla_decode", merges={})
    with pytest.raises(GraphError, match="the mla_decode family's kernel merges \\[\\], not 'online_softmax'"):
        meld.DecodeMLA(16, 64, device="cpu", sm_scale=0.1)


def test_the_struct_a_decode_kernel_renders_is_the_familys(monkeypatch):
    assert P.SEQ_PARALLEL_DECODE_PARAMS.c_source() in DecodeKernelConfig(xrank="peer").render()
    _patch(monkeypatch, "decode_attention", xrank_params="meld.codegen.params:DECODE_PARAMS")
    assert P.DECODE_PARAMS.c_source() in DecodeKernelConfig(xrank="peer").render()


def test_the_executor_merges_with_the_lowerings_combiner():
    attn = meld.DecodeAttention(8, 2, 64, 16, device="cpu")
    pb = paged([40], 16)
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    q, kv = torch.randn(1, 8, 64).to(torch.bfloat16), torch.randn(pb.num_pages, 2, 16, 2, 64).to(torch.bfloat16)
    attn.run(q, kv)
    attn.lowering = dataclasses.replace(attn.lowering, combiner="sum")
    with pytest.raises(GraphError, match="cannot merge with combiner 'sum'"):
        attn.run(q, kv)
