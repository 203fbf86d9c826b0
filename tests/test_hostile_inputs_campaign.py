"""Hostile inputs of the second campaign (CPU, no GPU, no nvcc): what the first pass (test_hostile_inputs*.py,
test_robustness_cpu.py) left open.

  * MELD_* settings with bad values are ValueErrors naming the setting and its value, read before an
    operator changes anything: a plan() that fails on MELD_DUMP_DIR or MELD_RECORD_EVERY leaves the previous
    plan in place (it used to install the new plan and then raise FileExistsError);
  * meld.ir's JSON readers (TaskGraph, Schedule, RankedSchedule) answer malformed text with their ValueError
    (GraphError / ScheduleError) naming what is wrong, never KeyError, AttributeError, ZeroDivisionError or
    RecursionError, and a schedule read back is validated;
  * the constructors take NumPy ints where they take ints and refuse configuration objects of other types;
  * the torch custom ops' Python callers name their arguments before torch's dispatcher sees them, and the
    fake implementations refuse what the real kernels refuse;
  * the FlashInfer wrapper checks v_scale and its CUDA-graph buffers before it writes anything;
  * meld serve-bench refuses a --seed no generator takes, as a one-line error.
"""
import json

import numpy as np
import pytest
import torch

import meld
import meld.cli
from meld import config
from meld.ir import CTA_FIELDS
from meld.runtime.reference import attention_reference
from meld.workloads import paged

BF16 = torch.bfloat16
HQ, HKV, D, P = 8, 2, 64, 16


def _attention(lens=(40, 300)):
    attn = meld.DecodeAttention(HQ, HKV, D, P, BF16, "cpu")
    pb = paged(list(lens), P)
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(len(lens), HQ, D, generator=g).to(BF16)
    kv = torch.randn(pb.num_pages, 2, P, HKV, D, generator=g).to(BF16)
    return attn, pb, q, kv


def _close_to_reference(out, q, kv, pb):
    ref, _ = attention_reference(q, kv, pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    assert (out.double() - ref).abs().max().item() < 2e-2


# =====================================================================================================
# 1. MELD_* settings
# =====================================================================================================

@pytest.mark.parametrize("env,match", [
    (dict(MELD_RECORD_EVERY="0"), r"MELD_RECORD_EVERY must be >= 1, got 0"),
    (dict(MELD_RECORD_EVERY="abc"), r"MELD_RECORD_EVERY must be an integer, got 'abc'"),
    (dict(MELD_DUMP_DIR="FILE"), r"MELD_DUMP_DIR='.*afile' is not a directory"),
    (dict(MELD_DUMP_DIR="FILE/below"), r"MELD_DUMP_DIR='.*afile/below': cannot create the directory"),
], ids=["record-every-0", "record-every-abc", "dump-dir-a-file", "dump-dir-below-a-file"])
def test_a_plan_failing_on_a_setting_changes_nothing(env, match, tmp_path):
    """The settings plan() acts on are read before it changes anything: the previous plan stays, and run()
    still answers for it (the dump directory used to be made after the new plan was installed)."""
    afile = tmp_path / "afile"
    afile.write_text("")
    env = {k: v.replace("FILE", str(afile)) for k, v in env.items()}
    attn, pb, q, kv = _attention()
    other = paged([5, 6, 7], P)
    with config.scope(MELD_RECORD=str(tmp_path / "rec.jsonl"), **env):
        with pytest.raises(ValueError, match=match):
            attn.plan(other.kv_indptr, other.kv_indices, other.kv_last_page_len)
    assert attn.schedule.kv_len.tolist() == [40, 300]
    _close_to_reference(attn.run(q, kv), q, kv, pb)


@pytest.mark.parametrize("value", ["yes", "true", "false", "no", "2", " 1"])
def test_meld_profile_takes_0_or_1(value):
    """MELD_PROFILE=false used to switch profiling on (anything but '' and '0' did)."""
    with config.scope(MELD_PROFILE=value), pytest.raises(ValueError, match=rf"MELD_PROFILE={value!r}: expected 1"):
        meld.DecodeAttention(HQ, HKV, D, P, BF16, "cpu")
    for ok, on in (("1", True), ("0", False), ("", False)):
        with config.scope(MELD_PROFILE=ok):
            assert config.profile() is on


@pytest.mark.parametrize("value", ["0", "-1", "abc"])
def test_moe_reads_profile_every_on_the_cpu_too(value):
    """A CPU layer takes no setting the GPU refuses (MoE read MELD_PROFILE_EVERY only on the GPU)."""
    with config.scope(MELD_PROFILE_EVERY=value), pytest.raises(ValueError, match=r"MELD_PROFILE_EVERY="):
        meld.MoE(64, 32, 8, 2, BF16, "cpu", max_num_tokens=4)


@pytest.mark.parametrize("value", ["sm_80", "", "90a", "sm_9x", "hopper"])
def test_meld_arch_is_checked_before_compiling(value):
    from meld.codegen import compile_source

    with config.scope(MELD_ARCH=value), pytest.raises(ValueError, match=rf"MELD_ARCH={value!r}: expected sm_90a"):
        compile_source("this is not CUDA", "never_compiled")
    for ok in ("sm_90a", "sm_90", "sm_100a"):
        with config.scope(MELD_ARCH=ok):
            assert config.arch() == ok


def test_a_cache_dir_that_is_a_file_is_named(tmp_path):
    """The host planners are built into MELD_CACHE_DIR: a file there was a FileExistsError from pathlib."""
    from meld.runtime import host_helper

    afile = tmp_path / "afile"
    afile.write_text("")
    with config.scope(MELD_CACHE_DIR=str(afile)), \
            pytest.raises(ValueError, match=r"MELD_CACHE_DIR='.*afile' is not a directory"):
        host_helper._build("never_built", ["int meld_never_built(void) { return 0; }"])


def test_a_dump_dir_that_is_a_file_fails_the_constructor_by_name(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    with config.scope(MELD_DUMP_DIR=str(afile)), pytest.raises(ValueError, match=r"MELD_DUMP_DIR=.* is not a directory"):
        meld.DecodeAttention(HQ, HKV, D, P, BF16, "cpu")


# =====================================================================================================
# 2. constructor argument types
# =====================================================================================================

@pytest.mark.parametrize("kernel_config,match", [
    ("fast", r"kernel_config must be a meld\.codegen\.moe_kernel\.MoeKernelConfig, got str"),
    ({}, r"kernel_config must be a meld\.codegen\.moe_kernel\.MoeKernelConfig, got dict"),   # ({} or default) hid it
])
def test_moe_refuses_a_kernel_config_of_another_type(kernel_config, match):
    with pytest.raises(ValueError, match=match):
        meld.MoE(64, 32, 8, 2, BF16, "cpu", max_num_tokens=4, kernel_config=kernel_config)


def test_numpy_ints_are_ints_to_the_constructors():
    layer = meld.MoE(64, 32, 8, 2, BF16, "cpu", max_num_tokens=4, first_expert=np.int64(0))
    assert type(layer.first_expert) is int
    with pytest.raises(ValueError, match=r"first_expert must be a non-negative int, got np\.int64\(-1\)"):
        meld.MoE(64, 32, 8, 2, BF16, "cpu", max_num_tokens=4, first_expert=np.int64(-1))
    mla = meld.DecodeMLA(16, 16, BF16, "cpu", sm_scale=0.1, head_dim_ckv=np.int64(512), head_dim_kpe=np.int32(64))
    assert (type(mla.head_dim_ckv), type(mla.head_dim_kpe)) == (int, int)


# =====================================================================================================
# 3. meld.ir JSON readers
# =====================================================================================================

def _schedule_dict():
    attn, _, _, _ = _attention([40, 7, 300, 0])
    return attn, json.loads(attn.schedule.to_json())


def _with(d, **changes):
    d = json.loads(json.dumps(d))
    for k, v in changes.items():
        if v is None:
            d.pop(k)
        else:
            d[k] = v
    return json.dumps(d)


SCHEDULE_TEXTS = {   # (what a reader met) -> the message it must give
    "empty": (lambda d: "", r"a Schedule: not JSON"),
    "deep": (lambda d: "[" * 100000 + "]" * 100000, r"nested too deeply"),
    "not-text": (lambda d: None, r"a Schedule JSON must be str or bytes, got NoneType"),
    "a-list": (lambda d: "[]", r"a Schedule must be a JSON object, got list"),
    "no-cta": (lambda d: _with(d, cta=None), r"a Schedule has no 'cta'"),
    "no-meta": (lambda d: _with(d, meta=None), r"a Schedule has no 'meta'"),
    "unknown-key": (lambda d: _with(d, bogus=1), r"unknown keys \['bogus'\]"),
    "heads-per-item-0": (lambda d: _with(d, heads_per_item=0), r"heads_per_item must be an integer in \[1, "),
    "num-kv-heads-str": (lambda d: _with(d, num_kv_heads="2"), r"num_kv_heads must be an integer .*got '2'"),
    "meta-list": (lambda d: _with(d, meta=[]), r"meta must be a JSON object, got list"),
    "kv-len-beyond-int32": (lambda d: _with(d, kv_len=[2 ** 40, 7, 300, 0]), r"kv_len must be a list of int32"),
    "kv-len-negative": (lambda d: _with(d, kv_len=[-40, 7, 300, 0]), r"kv_len must not be negative, got -40"),
    "cta-ragged": (lambda d: _with(d, cta=[[0, 1], [2]]), r"cta must have rows of one length"),
    "cta-no-ctas": (lambda d: _with(d, cta=[[]] * len(d["cta"])),
                    rf"cta must have {len(CTA_FIELDS)} rows .* got shape \({len(CTA_FIELDS)}, 0\)"),
    "chunk-negative": (lambda d: _with(d, chunk_tokens=-1), r"chunk_tokens must be an integer in \[0, "),
    "kv-len-short": (lambda d: _with(d, kv_len=[40]), r"table shapes"),
    "kv-len-below-a-cut": (lambda d: _with(d, kv_len=[40, 7, 100, 0]), r"outside \[0, kv_len\)"),
}


@pytest.mark.parametrize("case", list(SCHEDULE_TEXTS))
def test_schedule_from_malformed_json_is_a_schedule_error(case):
    """Used to end in KeyError, ZeroDivisionError, AttributeError, OverflowError, RecursionError or json's own
    errors; a schedule whose tables do not fit its lengths was read back without validation."""
    from meld.ir import Schedule, ScheduleError

    attn, d = _schedule_dict()
    make, match = SCHEDULE_TEXTS[case]
    with pytest.raises(ScheduleError, match=match):
        Schedule.from_json(make(d))
    assert Schedule.from_json(attn.schedule.to_json()) == attn.schedule


GRAPH_TEXTS = {
    "empty": (lambda d: "", r"a TaskGraph: not JSON"),
    "deep": (lambda d: '{"a":' * 100000 + "1" + "}" * 100000, r"nested too deeply"),
    "no-tasks": (lambda d: _with(d, tasks=None), r"a TaskGraph has no 'tasks'"),
    "tasks-none": (lambda d: _with(d, tasks=False), r"tasks must be a list, got bool"),
    "attrs-list": (lambda d: _with(d, attrs=[1]), r"attrs must be a JSON object, got list"),
    "task-no-kind": (lambda d: _with(d, tasks=[{k: v for k, v in d["tasks"][0].items() if k != "kind"}]),
                     r"tasks\[0\] has no 'kind'"),
    "task-name-list": (lambda d: _with(d, tasks=[{**d["tasks"][0], "name": [1]}]), r"tasks\[0\]\.name must be a string"),
    "axis-extent-float": (lambda d: _with(d, tasks=[{**d["tasks"][0], "domain": [{"name": "b", "extent": 1.5}]}]),
                          r"tasks\[0\]\.domain\[0\]\.extent must be a symbol or an int, got 1\.5"),
    "edge-no-dst": (lambda d: _with(d, edges=[{"src": "a"}]), r"edges\[0\] has no 'dst', 'reduction'"),
    "graph-name-int": (lambda d: _with(d, name=5), r"name must be a string, got 5"),
}


@pytest.mark.parametrize("case", list(GRAPH_TEXTS))
def test_task_graph_from_malformed_json_is_a_graph_error(case):
    from meld.ir import GraphError, TaskGraph

    attn, _, _, _ = _attention()
    make, match = GRAPH_TEXTS[case]
    with pytest.raises(GraphError, match=match):
        TaskGraph.from_json(make(json.loads(attn.graph.to_json())))
    assert TaskGraph.from_json(attn.graph.to_json()) == attn.graph


@pytest.mark.parametrize("text,match", [
    ("", r"a RankedSchedule: not JSON"),
    (json.dumps({"schedules": []}), r"a RankedSchedule has no 'world'"),
    (json.dumps({"world": "2", "num_items": 0, "combiner": "online_softmax", "schedules": [], "key": [], "part": []}),
     r"world must be an integer .*got '2'"),
    (json.dumps({"world": 2, "num_items": 0, "combiner": "online_softmax", "schedules": 5, "key": [], "part": []}),
     r"schedules must be a list of one entry per rank \(world 2\)"),
    (json.dumps({"world": 1, "num_items": 0, "combiner": "online_softmax", "schedules": [{}], "key": [[]],
                 "part": [[]]}), r"schedules\[0\]: a Schedule has no"),
], ids=["empty", "no-world", "world-str", "schedules-int", "schedule-empty"])
def test_ranked_schedule_from_malformed_json_is_a_schedule_error(text, match):
    from meld.ir import RankedSchedule, ScheduleError

    with pytest.raises(ScheduleError, match=match):
        RankedSchedule.from_json(text)


# =====================================================================================================
# 4. the torch custom ops' callers and fake implementations
# =====================================================================================================

def _layer():
    from tests.test_moe import weights

    layer = meld.MoE(64, 32, 8, 2, BF16, "cpu", max_num_tokens=16)
    w13, w2 = weights(8, 64, 32)
    g = torch.Generator().manual_seed(3)
    return layer, torch.randn(4, 64, generator=g).to(BF16), torch.randn(4, 8, generator=g), w13, w2


def test_decode_attention_caller_names_its_arguments():
    """torch_ops.decode_attention took any attn (AttributeError on None) and handed lists to torch's dispatcher
    (a RuntimeError from its schema check)."""
    from meld.ops import torch_ops

    attn, pb, q, kv = _attention()
    for args, kw, match in [
        ((None, q, kv), {}, r"attn must be a meld\.DecodeAttention, got NoneType"),
        ((meld.MoE(64, 32, 8, 2, BF16, "cpu", max_num_tokens=4), q, kv), {}, r"attn must be a meld\.DecodeAttention, got MoE"),
        ((attn, q, kv.tolist()), {}, r"kv_cache must be a torch\.Tensor or a \(k_cache, v_cache\) tuple, got list"),
        ((attn, q, kv), dict(out=[0.0]), r"out must be a torch\.Tensor or None, got list"),
        ((attn, q, kv), dict(lse=np.zeros((2, 8), np.float32), return_lse=True), r"lse must be a torch\.Tensor or None, got ndarray"),
        ((attn, q[0, 0], kv), dict(return_lse=True), r"q must have shape \('\*', 8, 64\).*got \(64,\)"),
    ]:
        with pytest.raises(ValueError, match=match):
            torch_ops.decode_attention(*args, **kw)
    _close_to_reference(torch_ops.decode_attention(attn, q, kv), q, kv, pb)


def test_moe_caller_names_its_arguments():
    from meld.ops import torch_ops

    layer, x, logits, w13, w2 = _layer()
    for args, kw, match in [
        ((None, x, logits, w13, w2), {}, r"layer must be a meld\.MoE, got NoneType"),
        ((layer, x[0, 0], logits, w13, w2), {}, r"x must have shape \('\*', 64\).*got \(\)"),   # was IndexError
        ((layer, x, logits.tolist(), w13, w2), {}, r"router_logits must be a torch\.Tensor or None, got list"),
        ((layer, x, logits, w13, None), {}, r"w2 must be a torch\.Tensor, got NoneType"),
        ((layer, x, None, w13, w2), dict(topk_weights=torch.rand(4, 2), topk_ids=[[0, 1]] * 4),
         r"topk_ids must be a torch\.Tensor or None, got list"),
        ((layer, x, logits, w13, w2), dict(out=[0]), r"out must be a torch\.Tensor or None, got list"),
    ]:
        with pytest.raises(ValueError, match=match):
            torch_ops.moe(*args, **kw)
    assert torch.equal(torch_ops.moe(layer, x, logits, w13, w2), layer(x, logits, w13, w2))


def test_moe_fake_refuses_more_tokens_than_the_layer_holds():
    """The fake implementation traced a call of more than max_num_tokens tokens that the kernel then refused."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    layer, _, _, w13, w2 = _layer()
    x, logits, out = torch.randn(17, 64).to(BF16), torch.randn(17, 8), torch.empty(17, 64, dtype=BF16)
    with FakeTensorMode() as mode:
        args = [mode.from_tensor(t) for t in (x, logits, w13, w2)]
        with pytest.raises(ValueError, match=r"x has 17 tokens, more than max_num_tokens=16"):
            torch.ops.meld.moe(*args, None, None, mode.from_tensor(out), layer.handle)


# =====================================================================================================
# 5. the FlashInfer wrapper
# =====================================================================================================

def _wrapper(lens=(40, 300)):
    from meld.compat.flashinfer import BatchDecodeWithPagedKVCacheWrapper

    _, pb, q, kv = _attention(lens)
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(8, dtype=torch.uint8))
    w.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len, HQ, HKV, D, P, q_data_type=BF16)
    return w, pb, q, kv


@pytest.mark.parametrize("v_scale,match", [
    (torch.ones(3), r"one-element real tensor on cpu, got a tensor of shape \(3,\)"),       # was a RuntimeError after the run
    (torch.full((1,), 2.0, device="meta"), r"got a tensor of shape \(1,\), dtype torch\.float32 on meta"),   # scaled nothing
    (torch.tensor([True]), r"dtype torch\.bool"),
    (torch.tensor(2j), r"dtype torch\.complex64"),
])
def test_flashinfer_v_scale_is_checked_before_the_kernel(v_scale, match):
    w, pb, q, kv = _wrapper()
    out, lse = torch.full((2, HQ, D), 7.0, dtype=BF16), torch.full((2, HQ), 7.0)
    with pytest.raises(ValueError, match=match):
        w.run(q, kv, v_scale=v_scale, out=out, lse=lse, return_lse=True)
    assert (out == 7).all() and (lse == 7).all(), "a run() that raises must not write out= or lse="
    half = w.run(q, kv, v_scale=torch.tensor(0.5))     # a 0-d tensor (and a one-element one) still scale
    assert torch.equal(half, w.run(q, kv, v_scale=torch.full((1,), 0.5)))
    _close_to_reference(half.double() * 2, q, kv, pb)


def test_flashinfer_cuda_graph_buffers_must_not_overlap():
    """plan() copies the table into these buffers: overlapping ones corrupted each other silently."""
    from meld.compat.flashinfer import CUDAGraphBatchDecodeWithPagedKVCacheWrapper

    ws = torch.empty(8, dtype=torch.uint8)
    b = torch.zeros(100, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"paged_kv_last_page_len_buffer .*shares memory with paged_kv_indptr_buffer"):
        CUDAGraphBatchDecodeWithPagedKVCacheWrapper(ws, b[:3], b[10:], b[:2])
    with pytest.raises(ValueError, match=r"paged_kv_indices_buffer .*shares memory with paged_kv_indptr_buffer"):
        CUDAGraphBatchDecodeWithPagedKVCacheWrapper(ws, b[:3], b, b[3:5])
    _, pb, q, kv = _attention()
    w = CUDAGraphBatchDecodeWithPagedKVCacheWrapper(ws, b[:3], b[10:], b[3:5])
    w.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len, HQ, HKV, D, P, q_data_type=BF16)
    assert b[:3].tolist() == pb.kv_indptr.tolist() and b[3:5].tolist() == pb.kv_last_page_len.tolist()
    _close_to_reference(w.run(q, kv), q, kv, pb)


# =====================================================================================================
# 6. the CLI
# =====================================================================================================

@pytest.mark.parametrize("seed", ["99999999999999999999", str(2 ** 64 - 1), str(-2 ** 63 - 1)])
def test_serve_bench_refuses_a_seed_no_generator_takes(seed, monkeypatch, capsys):
    """Was "error: Overflow when unpacking long long", from torch, once the trace was built: one line that did
    not name --seed. Now argparse's check, before any work."""
    from meld.serving import cli as serving_cli

    monkeypatch.setattr(serving_cli, "run", lambda cfg: pytest.fail("the benchmark ran"))
    with pytest.raises(SystemExit) as e:
        meld.cli.main(["serve-bench", "--size", "tiny", "--seed", seed])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert f"argument --seed: '{seed}' must be" in err


# =====================================================================================================
# 7. meld.distributed's CPU-reachable planning
# =====================================================================================================

@pytest.mark.parametrize("args,match", [
    (([10.7, 20], 16, 2), r"kv_len must be a 1-D list of integer lengths >= 0, got \[10\.7, 20\]"),   # was cut to 10
    (([10], 16.5, 2), r"page_size must be a positive int, got 16\.5"),                           # was used as a float
    (([10], 16, 2, 1.5), r"min_split_tokens must be a positive int, got 1\.5"),
    (([2 ** 70], 16, 2), r"kv_len must be a 1-D list of integer lengths"),                       # was an OverflowError
    (([10], 16, True), r"world must be a positive int, got True"),
])
def test_shard_batch_refuses_lengths_and_sizes_that_are_not_ints(args, match):
    from meld.distributed import shard_batch

    with pytest.raises(ValueError, match=match):
        shard_batch(*args)
    plan = shard_batch(np.array([10, 20000], dtype=np.int32), np.int64(16), 2, 4096)
    assert plan.num_parts.tolist() == [1, 2]
