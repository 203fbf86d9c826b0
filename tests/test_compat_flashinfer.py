"""meld.compat.flashinfer.BatchDecodeWithPagedKVCacheWrapper: FlashInfer's documented usage pattern gives
meld's own outputs (CPU executor) and lse in FlashInfer's base 2; the cache forms FlashInfer accepts map
to meld's by views; unsupported options raise NotImplementedError naming them, bad inputs ValueError.
The `gpu` tests compare against FlashInfer itself on BENCH.md's batches when it is importable."""
import functools
import math
import os
import subprocess
import sys

import pytest
import torch

import meld
from meld.compat import flashinfer as compat
from meld.compat.flashinfer import BatchDecodeWithPagedKVCacheWrapper, CUDAGraphBatchDecodeWithPagedKVCacheWrapper
from meld.runtime.reference import attention_reference
from meld.workloads import lengths, paged

LOG2E = 1.4426950408889634
# FlashInfer's docstring example: 7 requests over 128 pages of 16 tokens.
DOC_INDPTR = [0, 17, 29, 44, 48, 66, 100, 128]
DOC_LAST = [1, 7, 14, 4, 3, 1, 16]


def _table(indptr=DOC_INDPTR, last=DOC_LAST, spare=5):
    n = indptr[-1]
    return (torch.tensor(indptr, dtype=torch.int32), torch.randperm(n + spare)[:n].to(torch.int32),
            torch.tensor(last, dtype=torch.int32), n + spare)


def _cache(num_pages, P, Hkv, D, dtype, layout="NHD", device="cpu"):
    """A random cache in `layout`, and the same values in NHD for the reference."""
    nhd = torch.randn(num_pages, 2, P, Hkv, D, device=device).to(dtype)
    return (nhd if layout == "NHD" else nhd.transpose(2, 3).contiguous()), nhd


def _planned(layout="NHD"):
    """A wrapper planned for the docstring's table (bf16, 8 q heads over 2 kv heads, head_dim 64), its
    table, a cache in `layout` and in NHD, and q."""
    indptr, indices, last, num_pages = _table()
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), layout)
    w.plan(indptr, indices, last, 8, 2, 64, 16, q_data_type=torch.bfloat16)
    kv, nhd = _cache(num_pages, 16, 2, 64, torch.bfloat16, layout)
    q = torch.randn(len(last), 8, 64).bfloat16()
    return w, (indptr, indices, last), kv, nhd, q


def _meld(table, layout, dtype=torch.bfloat16):
    """meld's own API on the same table: what the wrapper must give."""
    attn = meld.DecodeAttention(8, 2, 64, 16, dtype, "cpu", kv_layout=layout)
    attn.plan(*table)
    return attn


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_documented_usage_pattern(layout):
    """FlashInfer's docstring example: workspace, wrapper, plan() once (data_type=float16), run() per layer
    with that layer's cache: each output is meld's own for the same batch, and close to float64."""
    num_layers, Hq, Hkv, D, P = 3, 8, 2, 64, 16
    workspace = torch.zeros(128 * 1024 * 1024 // 64, dtype=torch.uint8)
    wrapper = BatchDecodeWithPagedKVCacheWrapper(workspace, layout)
    indptr, indices, last, num_pages = _table()
    wrapper.plan(indptr, indices, last, Hq, Hkv, D, P, pos_encoding_mode="NONE", data_type=torch.float16)
    caches = [_cache(num_pages, P, Hkv, D, torch.float16, layout) for _ in range(num_layers)]
    attn = _meld((indptr, indices, last), layout, torch.float16)
    for kv, nhd in caches:
        q = torch.randn(len(last), Hq, D).half()
        o = wrapper.run(q, kv)
        assert o.shape == (7, Hq, D) and o.dtype == torch.float16
        assert torch.equal(o, attn.run(q, kv))
        ref, _ = attention_reference(q, nhd, indptr, indices, last)
        assert ((o.double() - ref).norm() / ref.norm()).item() < 1e-2
    assert len(wrapper._ops) == 1, "one meld operator serves every plan of the same shapes"


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_return_lse_is_base_2(layout):
    w, table, kv, nhd, q = _planned(layout)
    attn = _meld(table, layout)
    ref_out, ref_lse = attn.run(q, kv, return_lse=True)
    out, lse = w.run(q, kv, return_lse=True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse * LOG2E)
    f64 = attention_reference(q, nhd, *table)[1] / math.log(2)
    assert torch.allclose(lse.double(), f64, atol=1e-4)
    o2, l2 = w.run_return_lse(q, kv)
    assert torch.equal(o2, out) and torch.equal(l2, lse)
    # Preallocated out and lse: written in place (lse too when return_lse is False, as FlashInfer's kernel does).
    o3, l3 = torch.full_like(out, math.nan), torch.full_like(lse, math.nan)
    assert w.run(q, kv, out=o3, lse=l3) is o3
    assert torch.equal(o3, out) and torch.equal(l3, lse)
    assert w.run(q, kv, out=o3, lse=l3, return_lse=True)[1] is l3 and torch.equal(l3, lse)


def test_deprecated_spellings():
    w, table, kv, _, q = _planned()
    out, lse = w.run(q, kv, return_lse=True)
    assert torch.equal(w.forward(q, kv), out)
    o, l = w.forward_return_lse(q, kv)
    assert torch.equal(o, out) and torch.equal(l, lse)
    w.begin_forward(*table, 8, 2, 64, 16, "NONE", -1, None, torch.bfloat16)   # old positional order
    assert torch.equal(w.run(q, kv), out)
    w.end_forward()
    with pytest.raises(NotImplementedError, match="sm_scale=0.5"):
        w.forward(q, kv, sm_scale=0.5)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_tuple_and_single_tensor_caches(layout):
    """FlashInfer's cache forms, read in place: one tensor (contiguous or a strided view), or (k_cache, v_cache)
    as its halves or as two allocations, all give the same output; a tuple is read as the K and V it names
    (V's values as keys when swapped)."""
    w, table, kv, _, q = _planned(layout)
    out = w.run(q, kv)
    k, v = kv.unbind(1)
    assert torch.equal(w.run(q, (k, v)), out)
    assert torch.equal(w.run(q, (kv[:, 0], kv[:, 1])), out)
    assert torch.equal(w.run(q, (k.clone(), v.clone())), out)
    strided = torch.stack([kv, torch.randn_like(kv)], dim=1).flatten(0, 1)[::2]   # a page stride of two pages
    assert not strided.is_contiguous() and torch.equal(w.run(q, strided), out)
    assert torch.equal(w.run(q, (strided[:, 0], strided[:, 1])), out)
    swapped = w.run(q, (v, k))
    assert torch.equal(swapped, w.run(q, torch.stack([v, k], dim=1))) and not torch.equal(swapped, out)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_page_size_1_caches_without_the_page_axis(layout):
    """FlashInfer takes a page_size-1 cache as [num_pages, 2, Hkv, D] (parts [num_pages, Hkv, D])."""
    lens = [5, 0, 40, 1]
    pb = paged(lens, 1)
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(16, dtype=torch.uint8), layout)
    w.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len, 8, 2, 64, 1, q_data_type="bfloat16")
    kv = torch.randn(pb.num_pages, 2, 2, 64).bfloat16()
    q = torch.randn(len(lens), 8, 64).bfloat16()
    out = w.run(q, kv)
    ref, _ = attention_reference(q, kv.unsqueeze(2), pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2
    assert torch.equal(w.run(q, (kv[:, 0], kv[:, 1])), out)
    assert (out[1] == 0).all(), "an empty request gives zeros"


def test_plan_reuses_operators_and_applies_sm_scale():
    w, table, kv, nhd, q = _planned()
    op = w._op
    w.plan(*_table()[:3], 8, 2, 64, 16, q_data_type=torch.bfloat16, sm_scale=1 / 8)   # 1/sqrt(64): the same op
    assert w._op is op
    indptr, indices, last, _ = _table([0, 3, 3, 9], [16, 16, 2], spare=0)
    indices = indices % kv.shape[0]
    w.plan(indptr, indices, last, 8, 2, 64, 16, q_data_type=torch.bfloat16, sm_scale=0.3)
    assert w._op is not op and len(w._ops) == 2
    q3 = q[:3]
    out, lse = w.run(q3, kv, return_lse=True)
    ref, ref_lse = attention_reference(q3, nhd, indptr, indices, last, sm_scale=0.3)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2
    assert torch.allclose(lse.double(), ref_lse / math.log(2), atol=1e-4)


def test_scales_and_batch_invariance():
    w, table, kv, _, q = _planned()
    out = w.run(q, kv)
    assert torch.equal(w.run(q, kv, q_scale=1.0, k_scale=1.0, v_scale=1.0), out)   # what vLLM passes
    assert torch.equal(w.run(q, kv, v_scale=0.5), out * 0.5)   # FlashInfer's `out *= v_scale`
    w2 = BatchDecodeWithPagedKVCacheWrapper(torch.empty(16, dtype=torch.uint8), use_tensor_cores=True)
    w2.plan(*table, 8, 2, 64, 16, q_data_type=torch.bfloat16, fixed_split_size=64)
    assert w2._op.batch_invariant
    w2.plan(*table, 8, 2, 64, 16, q_data_type=torch.bfloat16, disable_split_kv=True)
    assert w2._op.batch_invariant
    assert ((w2.run(q, kv).double() - out.double()).norm() / out.double().norm()).item() < 1e-2


def test_fast_decode_plan_bound_in_place_of_plan():
    """FlashInfer's idiom (its tests, and engines' multi-step drafts): `wrapper.plan = partial(fast_decode_plan,
    wrapper)`, then wrapper.plan(...) with the host indptr; it re-plans as plan() does (it used to recurse)."""
    w, table, kv, _, q = _planned()
    out = w.run(q, kv)
    w.plan = functools.partial(compat.fast_decode_plan, w)
    w.plan(*table, 8, 2, 64, 16, q_data_type=torch.bfloat16, non_blocking=True,
           global_override_indptr_cpu=table[0].clone())
    assert torch.equal(w.run(q, kv), out)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_single_decode_with_kv_cache(layout):
    """FlashInfer's single-request decode: K and V in either layout read in place, q_scale and k_scale folded
    into sm_scale, v_scale on the output, lse base 2; bad arguments named."""
    q, k, v = torch.randn(8, 64).half(), torch.randn(37, 2, 64).half(), torch.randn(37, 2, 64).half()
    kk, vv = (k, v) if layout == "NHD" else (k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous())
    out, lse = compat.single_decode_with_kv_cache(q, kk, vv, layout, q_scale=0.5, k_scale=0.5, v_scale=2.0,
                                                  return_lse=True)
    s = torch.einsum("hgd,khd->hgk", q.double().view(2, 4, 64), k.double()) / 8 / 4
    ref = torch.einsum("hgk,khd->hgd", s.softmax(-1), v.double()).reshape(8, 64) * 2
    assert (out.double() - ref).abs().max().item() < 2e-3
    assert (lse.double() - s.logsumexp(-1).reshape(8) * LOG2E).abs().max().item() < 1e-4
    with pytest.raises(ValueError, match=r"^v must have dtype torch.float16"):
        compat.single_decode_with_kv_cache(q, kk, vv.bfloat16(), layout)
    with pytest.raises(ValueError, match="k must be a 3-D"):
        compat.single_decode_with_kv_cache(q, k[0], v[0], layout)


def test_single_decode_plans_only_when_its_shapes_or_options_change(monkeypatch):
    """A call of the last call's shapes and options runs on the kept plan (so a CUDA graph can capture it: under
    torch.compile's reduce-overhead mode the op is recorded and replayed), on its own fresh k and v."""
    wrapper, _ = compat._single_request_wrapper(torch.device("cpu"))
    plans = []
    real = wrapper.plan
    monkeypatch.setattr(wrapper, "plan", lambda *a, **kw: (plans.append(a[0][-1].item()), real(*a, **kw)))

    def call(kv_len, **kw):
        q, k, v = torch.randn(8, 64).half(), torch.randn(kv_len, 2, 64).half(), torch.randn(kv_len, 2, 64).half()
        s = torch.einsum("hgd,khd->hgk", q.double().view(2, 4, 64), k.double()) * kw.get("sm_scale", 1 / 8)
        ref = torch.einsum("hgk,khd->hgd", s.softmax(-1), v.double()).reshape(8, 64)
        assert (compat.single_decode_with_kv_cache(q, k, v, **kw).double() - ref).abs().max().item() < 2e-3

    for kv_len, kw in ((41, {}), (41, {}), (41, {}), (42, {}), (42, {"sm_scale": 0.1}), (42, {"sm_scale": 0.1})):
        call(kv_len, **kw)
    assert plans == [41, 42, 42]   # (the first call, a new length, a new scale)


def test_cuda_graph_mode_fixed_buffers():
    """use_cuda_graph=True (CPU buffers here): plan() copies the table into the fixed buffers, the batch
    size is fixed, and meld's operator is sized to the buffers, so re-plans rewrite its tables in place."""
    B = 7
    bufs = [torch.zeros(B + 1, dtype=torch.int32), torch.zeros(200, dtype=torch.int32),
            torch.zeros(B, dtype=torch.int32)]
    w = CUDAGraphBatchDecodeWithPagedKVCacheWrapper(torch.empty(16, dtype=torch.uint8), *bufs)
    assert w.is_cuda_graph_enabled
    indptr, indices, last, num_pages = _table()
    w.plan(indptr, indices, last, 8, 2, 64, 16, q_data_type=torch.bfloat16)
    assert torch.equal(bufs[0], indptr) and torch.equal(bufs[2], last) and torch.equal(bufs[1][:128], indices)
    op = w._op
    assert (op.max_batch_size, op.max_num_pages) == (B, 200)
    kv, _ = _cache(num_pages, 16, 2, 64, torch.bfloat16)
    q = torch.randn(B, 8, 64).bfloat16()
    assert torch.equal(w.run(q, kv), _meld((indptr, indices, last), "NHD").run(q, kv))
    t2 = _table([0, 1, 2, 3, 4, 5, 6, 7], [3] * 7, spare=0)[:3]
    w.plan(*t2, 8, 2, 64, 16, q_data_type=torch.bfloat16)
    assert w._op is op and torch.equal(bufs[0], t2[0])
    with pytest.raises(ValueError, match="batch size should be fixed in cudagraph mode: len\\(last_page_len\\)=3"):
        w.plan(*_table([0, 1, 2, 3], [3] * 3, spare=0)[:3], 8, 2, 64, 16, q_data_type=torch.bfloat16)
    big = _table([0, 1, 2, 3, 4, 5, 6, 201], [3] * 7, spare=0)[:3]
    with pytest.raises(ValueError, match="indices has 201 entries, more than paged_kv_indices_buffer's 200"):
        w.plan(*big, 8, 2, 64, 16, q_data_type=torch.bfloat16)
    assert torch.equal(bufs[0], t2[0]), "a plan() that raises changes nothing"


def test_plan_that_raises_changes_nothing():
    w, table, kv, _, q = _planned()
    out = w.run(q, kv)
    bad = table[2].clone()
    bad[0] = 17
    with pytest.raises(ValueError, match=r"kv_last_page_len\[0\]=17"):
        w.plan(table[0], table[1], bad, 8, 2, 64, 16, q_data_type=torch.bfloat16)
    with pytest.raises(NotImplementedError):
        w.plan(*table, 8, 2, 96, 16, q_data_type=torch.bfloat16)
    assert torch.equal(w.run(q, kv), out)


@pytest.mark.parametrize("where,kwargs,match", [
    ("plan", dict(pos_encoding_mode="ALIBI"), "pos_encoding_mode='ALIBI' is not supported"),
    ("plan", dict(window_right=-1), "window_right=-1 is not supported"),
    ("plan", dict(q_data_type=torch.float32), "q_data_type=torch.float32 is not supported"),
    ("plan", dict(kv_data_type=torch.float8_e4m3fnuz), "kv_data_type=torch.float8_e4m3fnuz is not supported"),
    ("plan", dict(o_data_type=torch.float32), "o_data_type=torch.float32 is not supported"),
    ("plan", dict(q_data_type="float16", data_type=torch.bfloat16), "kv_data_type=torch.bfloat16 is not supported"),
    ("plan", dict(head_dim=96), "head_dim=96 is not supported"),
    ("plan", dict(seq_lens=torch.ones(7, dtype=torch.int32)), "seq_lens=tensor"),
    ("plan", dict(block_tables=torch.zeros(7, 4, dtype=torch.int32)), "block_tables=tensor"),
    ("run", dict(k_scale=0.5), "k_scale=0.5 is not supported"),
    ("run", dict(q_scale=2.0), "q_scale=2.0 is not supported"),
    ("run", dict(sinks=torch.zeros(8)), "sinks=tensor"),
    ("run", dict(skip_softmax_threshold_scale_factor=1.0), "skip_softmax_threshold_scale_factor=1.0"),
    ("run", dict(kv_cache_sf=torch.zeros(1)), "kv_cache_sf=tensor"),
])
def test_not_implemented_names_the_option(where, kwargs, match):
    w, table, kv, _, q = _planned()
    with pytest.raises(NotImplementedError, match=match):
        if where == "plan":
            args = dict(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16, q_data_type=torch.bfloat16)
            w.plan(*table, **{**args, **kwargs})
        else:
            w.run(q, kv, **kwargs)


def test_not_implemented_constructor_and_positional_run_args():
    with pytest.raises(NotImplementedError, match=r"jit_args=\['x'\] is not supported"):
        BatchDecodeWithPagedKVCacheWrapper(torch.empty(16, dtype=torch.uint8), jit_args=["x"])
    w, _, kv, _, q = _planned()
    with pytest.raises(NotImplementedError, match=r"\*args=\(1.0,\) is not supported"):
        w.run(q, kv, 1.0)


def _plan_args(**kw):
    indptr, indices, last, _ = _table()
    args = dict(indptr=indptr, indices=indices, last_page_len=last, num_qo_heads=8, num_kv_heads=2, head_dim=64,
                page_size=16, q_data_type=torch.bfloat16)
    args.update(kw)
    return args


@pytest.mark.parametrize("kwargs,match", [
    (dict(pos_encoding_mode="ROPE"), "pos_encoding_mode must be one of"),
    (dict(window_left=-2), "window_left must be -1"),
    (dict(logits_soft_cap=-1.0), r"logits_soft_cap must be None, 0 \(off\) or a positive number"),
    (dict(logits_soft_cap=math.nan), "logits_soft_cap must be a finite number"),
    (dict(q_data_type="float17"), "q_data_type must be a torch.dtype or the name of one, got 'float17'"),
    (dict(head_dim=0), "head_dim must be a positive int, got 0"),
    (dict(num_qo_heads=6, num_kv_heads=4), "num_qo_heads=6 must be a multiple of num_kv_heads=4"),
    (dict(num_kv_heads=0), "num_kv_heads must be a positive int"),
    (dict(page_size=2.5), "page_size must be a positive int"),
    (dict(sm_scale=math.inf), "sm_scale must be a finite number"),
    (dict(q_len_per_req=0), "q_len_per_req must be an int >= 1"),
    (dict(q_len_per_req=2), r"q_len_per_req > 1 requires tensor-core decode \(use_tensor_cores=True\)"),
    (dict(fixed_split_size=64), "fixed_split_size is only supported by tensor core decode"),
    (dict(disable_split_kv=1), "disable_split_kv must be True or False"),
    (dict(indptr=torch.tensor(DOC_INDPTR)), "kv_indptr must have dtype torch.int32, got torch.int64"),
    (dict(last_page_len=torch.tensor(DOC_LAST[:3], dtype=torch.int32)), r"kv_last_page_len must have shape \(7,\)"),
    (dict(check="yes"), "check must be True or False"),
])
def test_plan_errors_name_the_argument(kwargs, match):
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(16, dtype=torch.uint8))
    with pytest.raises(ValueError, match=match):
        w.plan(**_plan_args(**kwargs))


def test_run_errors_name_the_argument():
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(16, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="call plan\\(\\) first"):
        w.run(torch.zeros(7, 8, 64), torch.zeros(1))
    w, _, kv, _, q = _planned()
    cases = [
        (dict(q=q[:3]), r"q must have shape \(7, 8, 64\)"),
        (dict(q=q.half()), "q must have dtype torch.bfloat16"),
        (dict(paged_kv_cache=kv.half()), "paged_kv_cache must have dtype torch.bfloat16"),
        (dict(paged_kv_cache=kv[:, :, :8]), r"paged_kv_cache must have shape \('\*', 2, 16, 2, 64\)"),
        (dict(paged_kv_cache=[kv[:, 0], kv[:, 1]]), r"paged_kv_cache must be a torch.Tensor or a \(k_cache, v_c"),
        (dict(paged_kv_cache=(kv[:, 0],)), "paged_kv_cache as a tuple must be \\(k_cache, v_cache\\)"),
        (dict(paged_kv_cache=(kv[:, 0], kv[:, 1, :, :1])), r"v_cache must have shape \('\*', 16, 2, 64\)"),
        (dict(paged_kv_cache=(kv[:, 0], kv[:, 1].half())), "v_cache must have dtype torch.bfloat16, got torch.float16"),
        (dict(paged_kv_cache=(kv[:, 0], kv[:-1, 1])), "k_cache has 133 pages but v_cache 132"),
        (dict(paged_kv_cache=(kv[:, 0], kv[:, 1].clone())), r"k_cache and v_cache must have the same strides .*got "
                                                             r"\(4096, 128, 64, 1\) and \(2048, 128, 64, 1\)"),
        (dict(paged_kv_cache=kv[..., :32]), r"paged_kv_cache must have shape"),
        (dict(paged_kv_cache=kv[:2]), "reference page .* but paged_kv_cache has only 2 pages"),
        (dict(out=torch.empty(7, 8, 64)), "out must have dtype torch.bfloat16"),
        (dict(lse=torch.empty(7, 8, dtype=torch.float64)), "lse must have dtype torch.float32"),
        (dict(return_lse=1), "return_lse must be True or False"),
        (dict(window_left=5), "window_left must be None or plan\\(\\)'s window_left=-1"),
        (dict(enable_pdl="yes"), "enable_pdl must be None, True or False"),
        (dict(k_scale=math.nan), "k_scale must be a finite number"),
        (dict(v_scale="2"), "v_scale must be a number"),
    ]
    for kwargs, match in cases:
        args = {**dict(q=q, paged_kv_cache=kv), **kwargs}
        with pytest.raises(ValueError, match=match):
            w.run(**args)


@pytest.mark.parametrize("kwargs,match", [
    (dict(float_workspace_buffer=None), "float_workspace_buffer must be a torch.Tensor"),
    (dict(kv_layout="NDH"), "kv_layout must be 'NHD' or 'HND', got 'NDH'"),
    (dict(use_cuda_graph=1), "use_cuda_graph must be True or False"),
    (dict(backend="triton"), "backend must be one of"),
    (dict(use_cuda_graph=True), "paged_kv_indptr_buffer should be a torch.Tensor in cudagraph mode"),
    (dict(use_cuda_graph=True, paged_kv_indptr_buffer=torch.zeros(4, dtype=torch.int32),
          paged_kv_indices_buffer=torch.zeros(9, dtype=torch.int32),
          paged_kv_last_page_len_buffer=torch.zeros(2, dtype=torch.int32)),
     "paged_kv_indptr_buffer must have batch_size \\+ 1 = 3 entries"),
    (dict(use_cuda_graph=True, paged_kv_indptr_buffer=torch.zeros(3, dtype=torch.int32),
          paged_kv_indices_buffer=torch.zeros(9),
          paged_kv_last_page_len_buffer=torch.zeros(2, dtype=torch.int32)),
     "paged_kv_indices_buffer must have dtype torch.int32"),
])
def test_constructor_errors_name_the_argument(kwargs, match):
    args = dict(float_workspace_buffer=torch.empty(16, dtype=torch.uint8))
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        BatchDecodeWithPagedKVCacheWrapper(**args)


def test_import_meld_leaves_compat_out():
    code = "import sys, meld; assert not any(m.startswith('meld.compat') for m in sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


# --- against FlashInfer itself, on the GPU ------------------------------------------------------------
GPU_SHAPE = dict(Hq=32, Hkv=8, D=128, P=16)   # BENCH.md's decode shape, bf16


def _flashinfer():
    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")   # its JIT then builds for the H200 alone
    return pytest.importorskip("flashinfer")


def _gpu_batch(lens, layout="NHD"):
    s = GPU_SHAPE
    pb = paged(lens, s["P"])
    kv, nhd = _cache(pb.num_pages, s["P"], s["Hkv"], s["D"], torch.bfloat16, layout, "cuda")
    q = torch.randn(len(lens), s["Hq"], s["D"], device="cuda").bfloat16()
    return pb, kv, nhd, q


def _wrapper(module, layout="NHD", tensor_cores=False, graph_batch=0, max_pages=0):
    ws = torch.zeros(128 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    if not graph_batch:
        return module.BatchDecodeWithPagedKVCacheWrapper(ws, layout, use_tensor_cores=tensor_cores)
    i32 = dict(dtype=torch.int32, device="cuda")
    return module.BatchDecodeWithPagedKVCacheWrapper(
        ws, layout, use_cuda_graph=True, use_tensor_cores=tensor_cores,
        paged_kv_indptr_buffer=torch.zeros(graph_batch + 1, **i32),
        paged_kv_indices_buffer=torch.zeros(max_pages, **i32),
        paged_kv_last_page_len_buffer=torch.zeros(graph_batch, **i32))


def _plan(wrappers, pb):
    """As vLLM plans: indptr and last_page_len on the host, page indices on the GPU."""
    s = GPU_SHAPE
    for w in wrappers:
        w.plan(pb.kv_indptr, pb.kv_indices.cuda(), pb.kv_last_page_len, s["Hq"], s["Hkv"], s["D"], s["P"],
               pos_encoding_mode="NONE", q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)


def _reference(q, nhd, pb):
    return attention_reference(q, nhd, pb.kv_indptr.cuda(), pb.kv_indices.cuda(), pb.kv_last_page_len.cuda())[0]


def _assert_close(out, lse, fi_out, fi_lse, ref):
    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()

    assert rel(out, ref) < 1e-2 and rel(fi_out, ref) < 1e-2 and rel(out, fi_out) < 1e-2
    assert torch.isfinite(lse).all() and torch.isfinite(fi_lse).all()
    assert (lse - fi_lse).abs().max().item() < 1e-2, "lse must be FlashInfer's (base 2)"


@pytest.mark.gpu
@pytest.mark.parametrize("tensor_cores", [False, True])
@pytest.mark.parametrize("B,dist", [(1, "skewed"), (8, "uniform2k"), (8, "one-long"), (64, "skewed"),
                                    (64, "one-long"), (256, "uniform2k")])
def test_matches_flashinfer(B, dist, tensor_cores):
    flashinfer = _flashinfer()
    pb, kv, nhd, q = _gpu_batch(lengths(dist, B))
    fi, ours = _wrapper(flashinfer, tensor_cores=tensor_cores), _wrapper(compat, tensor_cores=tensor_cores)
    _plan([fi, ours], pb)
    fi_out, fi_lse = fi.run(q, kv, return_lse=True)
    out, lse = ours.run(q, kv, return_lse=True)
    _assert_close(out, lse, fi_out, fi_lse, _reference(q, nhd, pb))
    attn = meld.DecodeAttention(32, 8, 128, 16, torch.bfloat16, "cuda")
    attn.plan(pb.kv_indptr, pb.kv_indices.cuda(), pb.kv_last_page_len)
    meld_out, meld_lse = attn.run(q, kv, return_lse=True)
    assert torch.equal(out, meld_out) and torch.equal(lse, meld_lse * LOG2E), "the wrapper must give meld's result"


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_matches_flashinfer_layouts_and_tuple_caches(layout):
    """Odd lengths (FlashInfer documents last_page_len >= 1: no empty requests), both layouts, and the
    cache as a (k_cache, v_cache) tuple of its halves and of two separate allocations."""
    flashinfer = _flashinfer()
    pb, kv, nhd, q = _gpu_batch([n + 1 for n in lengths("ragged", 9)], layout)
    fi, ours = _wrapper(flashinfer, layout), _wrapper(compat, layout)
    _plan([fi, ours], pb)
    fi_out, fi_lse = fi.run(q, (kv[:, 0], kv[:, 1]), return_lse=True)
    out, lse = ours.run(q, (kv[:, 0], kv[:, 1]), return_lse=True)
    _assert_close(out, lse, fi_out, fi_lse, _reference(q, nhd, pb))
    assert torch.equal(ours.run(q, kv), out)
    apart = (kv[:, 0].clone(), kv[:, 1].clone())
    fi_out, fi_lse = fi.run(q, apart, return_lse=True)
    out2, lse2 = ours.run(q, apart, return_lse=True)
    _assert_close(out2, lse2, fi_out, fi_lse, _reference(q, nhd, pb))
    assert torch.equal(out2, out) and torch.equal(lse2, lse)


@pytest.mark.gpu
def test_cuda_graph_replay_across_replans_matches_flashinfer():
    """Both wrappers in CUDA-graph mode: run() captured once, replayed after plans of other batches of the
    same size; meld's plan from device tensors with check=False (no host sync) plans the same batch."""
    flashinfer = _flashinfer()
    B = 8
    tables = [paged(lengths(dist, B), 16) for dist in ("uniform2k", "skewed", "one-long")]
    kv = torch.randn(max(pb.num_pages for pb in tables), 2, 16, 8, 128, device="cuda").bfloat16()
    q = torch.randn(B, 32, 128, device="cuda").bfloat16()
    fi, ours = (_wrapper(m, graph_batch=B, max_pages=kv.shape[0]) for m in (flashinfer, compat))
    outs = {fi: torch.empty_like(q), ours: torch.empty_like(q)}
    graphs = {}
    _plan([fi, ours], tables[0])
    for w, o in outs.items():
        w.run(q, kv, out=o)   # warm-up outside capture
        torch.cuda.synchronize()
        graphs[w] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[w]):
            w.run(q, kv, out=o)
    for pb in tables:
        _plan([fi, ours], pb)
        for g in graphs.values():
            g.replay()
        eager_out, eager_lse = ours.run(q, kv, return_lse=True)
        fi_lse = fi.run(q, kv, return_lse=True)[1]
        torch.cuda.synchronize()
        _assert_close(outs[ours], eager_lse, outs[fi], fi_lse, _reference(q, kv, pb))
        assert torch.equal(outs[ours], eager_out), "graph replay after a re-plan must match eager"
        ours.plan(pb.kv_indptr.cuda(), pb.kv_indices.cuda(), pb.kv_last_page_len.cuda(), 32, 8, 128, 16,
                  q_data_type=torch.bfloat16, check=False)
        outs[ours].fill_(math.nan)
        graphs[ours].replay()
        torch.cuda.synchronize()
        assert torch.equal(outs[ours], eager_out), "plan(check=False) from device tensors plans the same batch"


# --- BatchMLAPagedAttentionWrapper (FlashInfer's MLA, decode) on meld.DecodeMLA ---------------------------------
def _mla_batch(lens, page_size=16, heads=64, seed=0, q_len=1):
    from meld.workloads import paged as paged_

    pb = paged_(lens, page_size)
    g = torch.Generator().manual_seed(seed)
    qn, qp = ((torch.randn(len(lens) * q_len, heads, d, generator=g) / 3 ** 0.5).bfloat16() for d in (512, 64))
    ckv, kpe = (torch.randn(pb.num_pages, page_size, d, generator=g).bfloat16() for d in (512, 64))
    return pb, torch.tensor(lens, dtype=torch.int32), qn, qp, ckv, kpe


def test_mla_wrapper_matches_float64_with_flashinfers_lse_base():
    from meld.compat.flashinfer import BatchMLAPagedAttentionWrapper
    from meld.runtime.reference import mla_reference

    lens, scale = [5, 0, 70, 33], 192 ** -0.5
    pb, kv_len, qn, qp, ckv, kpe = _mla_batch(lens)
    w = BatchMLAPagedAttentionWrapper(torch.empty(16, dtype=torch.uint8))
    w.plan(torch.arange(5, dtype=torch.int32), pb.kv_indptr, pb.kv_indices, kv_len, 64, 512, 64, 16, False, scale,
           torch.bfloat16, "bfloat16")
    out, lse2 = w.run(qn, qp, ckv, kpe, return_lse=True)
    o, lse_e = w.run(qn, qp, ckv, kpe, return_lse=True, return_lse_base_on_e=True)
    want_o, want_l = mla_reference(qn, qp, ckv, kpe, pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len, scale)
    torch.testing.assert_close(out.double(), want_o, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse_e.double(), want_l, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse2.double(), want_l * (1 / math.log(2)), rtol=1e-5, atol=1e-5)
    buf = torch.full_like(qn, float("nan"))
    assert w.run(qn, qp, ckv, kpe, out=buf) is buf and torch.equal(buf, out)


def test_mla_wrapper_decodes_several_causal_rows_per_request():
    """qo_indptr = 0, 2, 4, ... with causal=True: DecodeMLA(q_len=2), FlashInfer's causal mask; without causal, or
    with rows that differ per request, NotImplementedError naming the argument."""
    from meld.compat.flashinfer import BatchMLAPagedAttentionWrapper
    from meld.runtime.reference import mla_reference

    lens, scale = [5, 2, 70, 33], 192 ** -0.5
    pb, kv_len, qn, qp, ckv, kpe = _mla_batch(lens, q_len=2)
    w = BatchMLAPagedAttentionWrapper(torch.empty(16, dtype=torch.uint8))
    qo = 2 * torch.arange(5, dtype=torch.int32)
    args = [qo, pb.kv_indptr, pb.kv_indices, kv_len, 64, 512, 64, 16, True, scale, torch.bfloat16, torch.bfloat16]
    w.plan(*args)
    out, lse = w.run(qn, qp, ckv, kpe, return_lse=True, return_lse_base_on_e=True)
    want_o, want_l = mla_reference(qn, qp, ckv, kpe, pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len, scale, 2)
    torch.testing.assert_close(out.double(), want_o, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse.double(), want_l, rtol=1e-5, atol=1e-5)
    with pytest.raises(NotImplementedError, match="causal=False"):
        w.plan(*args[:8], False, *args[9:])
    with pytest.raises(NotImplementedError, match="qo_indptr"):
        w.plan(torch.tensor([0, 2, 4, 6, 9], dtype=torch.int32), *args[1:])
    assert torch.equal(w.run(qn, qp, ckv, kpe), out), "a plan() that raised changed the plan"


@pytest.mark.parametrize("where,kw,err,match", [
    ("plan", dict(head_dim_ckv=256), NotImplementedError, "head_dim_ckv=256"),
    ("plan", dict(q_data_type=torch.float16), NotImplementedError, "q_data_type"),
    ("plan", dict(kv_data_type=torch.float8_e4m3fn), NotImplementedError, "kv_data_type"),
    ("plan", dict(use_profiler=True), NotImplementedError, "use_profiler"),
    ("plan", dict(qo_indptr=torch.tensor([0, 2, 3, 4, 5], dtype=torch.int32)), NotImplementedError, "qo_indptr"),
    ("plan", dict(kv_len_arr=torch.tensor([5, 0, 200, 33], dtype=torch.int32)), ValueError, r"kv_len_arr\[2\]=200"),
    ("plan", dict(kv_len_arr=torch.tensor([5, 3, 70, 33], dtype=torch.int32)), ValueError, r"kv_len_arr\[1\]=3"),
    ("plan", dict(causal=1), ValueError, "causal"),
    ("run", dict(o_scale=1.0), NotImplementedError, "o_scale"),
    ("run", dict(ckv_scale=1.0), NotImplementedError, "ckv_scale"),
    ("run", dict(profiler_buffer=torch.empty(1)), NotImplementedError, "profiler_buffer"),
    ("run", dict(return_lse=1), ValueError, "return_lse"),
])
def test_mla_wrapper_names_what_it_does_not_take(where, kw, err, match):
    from meld.compat.flashinfer import BatchMLAPagedAttentionWrapper

    lens = [5, 0, 70, 33]
    pb, kv_len, qn, qp, ckv, kpe = _mla_batch(lens)
    w = BatchMLAPagedAttentionWrapper(torch.empty(16, dtype=torch.uint8))
    args = dict(qo_indptr=torch.arange(5, dtype=torch.int32), kv_indptr=pb.kv_indptr, kv_indices=pb.kv_indices,
                kv_len_arr=kv_len, num_heads=64, head_dim_ckv=512, head_dim_kpe=64, page_size=16, causal=False,
                sm_scale=0.07, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    if where == "plan":
        with pytest.raises(err, match=match):
            w.plan(**{**args, **kw})
        with pytest.raises(RuntimeError, match="call plan"):
            w.run(qn, qp, ckv, kpe)
        return
    w.plan(**args)
    with pytest.raises(err, match=match):
        w.run(qn, qp, ckv, kpe, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[2048] * 16, [1, 900, 4000, 64, 0, 65]])
def test_mla_wrapper_matches_flashinfers_mla(lens):
    """meld's BatchMLAPagedAttentionWrapper and FlashInfer's own (fa2) on one batch: the same plan() and run()
    arguments, out and base-2 lse against each other and float64."""
    flashinfer = _flashinfer()
    import flashinfer.mla   # noqa: F401
    from meld.compat.flashinfer import BatchMLAPagedAttentionWrapper
    from meld.runtime.reference import mla_reference

    pb, kv_len, qn, qp, ckv, kpe = _mla_batch(lens, page_size=64, heads=128)
    qn, qp, ckv, kpe = (t.cuda() for t in (qn, qp, ckv, kpe))
    scale, B = 192 ** -0.5, len(lens)
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    args = (torch.arange(B + 1, dtype=torch.int32).cuda(), pb.kv_indptr.cuda(), pb.kv_indices.cuda(), kv_len.cuda(),
            128, 512, 64, 64, False, scale, torch.bfloat16, torch.bfloat16)
    outs = []
    for w in (flashinfer.mla.BatchMLAPagedAttentionWrapper(ws, backend="fa2"), BatchMLAPagedAttentionWrapper(ws)):
        w.plan(*args)
        outs.append(w.run(qn, qp, ckv, kpe, return_lse=True))
    (fi_o, fi_l), (o, l) = outs
    ref, _ = mla_reference(qn, qp, ckv, kpe, pb.kv_indptr.cuda(), pb.kv_indices.cuda(), pb.kv_last_page_len.cuda(),
                           scale)
    rows = kv_len.cuda() > 0   # (an empty request: meld gives zeros and lse -inf, FlashInfer its own fill)
    for got in (o, fi_o):
        assert ((got[rows].double() - ref[rows]).norm() / ref[rows].norm()).item() < 1e-2
    assert (l[rows] - fi_l[rows]).abs().max().item() < 1e-2, "lse must be FlashInfer's (base 2)"


@pytest.mark.gpu
@pytest.mark.parametrize("q_len", [2, 4])
def test_mla_wrapper_matches_flashinfers_mla_with_several_rows_per_request(q_len):
    """qo_indptr of q_len rows per request with causal=True, meld's wrapper and FlashInfer's own (fa2): out and
    base-2 lse against each other and the float64 causal reference."""
    flashinfer = _flashinfer()
    import flashinfer.mla   # noqa: F401
    from meld.compat.flashinfer import BatchMLAPagedAttentionWrapper
    from meld.runtime.reference import mla_reference

    lens = [q_len, 900, 4000, 65, 2049]
    pb, kv_len, qn, qp, ckv, kpe = _mla_batch(lens, page_size=64, heads=128, q_len=q_len)
    qn, qp, ckv, kpe = (t.cuda() for t in (qn, qp, ckv, kpe))
    scale, B = 192 ** -0.5, len(lens)
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    args = (q_len * torch.arange(B + 1, dtype=torch.int32).cuda(), pb.kv_indptr.cuda(), pb.kv_indices.cuda(),
            kv_len.cuda(), 128, 512, 64, 64, True, scale, torch.bfloat16, torch.bfloat16)
    outs = []
    for w in (flashinfer.mla.BatchMLAPagedAttentionWrapper(ws, backend="fa2"), BatchMLAPagedAttentionWrapper(ws)):
        w.plan(*args)
        outs.append(w.run(qn, qp, ckv, kpe, return_lse=True))
    (fi_o, fi_l), (o, l) = outs
    ref, _ = mla_reference(qn, qp, ckv, kpe, pb.kv_indptr.cuda(), pb.kv_indices.cuda(), pb.kv_last_page_len.cuda(),
                           scale, q_len)
    for got in (o, fi_o):
        assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-2
    assert (l - fi_l).abs().max().item() < 1e-2, "lse must be FlashInfer's (base 2)"


@pytest.mark.gpu
def test_gpu_opcheck_decode_mla():
    mla = meld.DecodeMLA(128, 64, torch.bfloat16, "cuda", sm_scale=192 ** -0.5)
    pb, _, qn, qp, ckv, kpe = _mla_batch([100, 0, 3000], page_size=64, heads=128)
    mla.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    qn, qp, ckv, kpe = (t.cuda() for t in (qn, qp, ckv, kpe))
    torch.library.opcheck(torch.ops.meld.decode_mla.default,
                          (qn, qp, ckv, kpe, torch.empty_like(qn), torch.empty(3, 128, device="cuda"), mla.handle))


def test_mla_wrapper_checks_plan_arguments_before_reusing_an_operator():
    """128.0 == 128 and True == 1 in Python: the operator cache must not let a bad value in once a good one
    has planned (a campaign's find)."""
    from meld.compat.flashinfer import BatchMLAPagedAttentionWrapper

    pb, kv_len, *_ = _mla_batch([5, 0, 70, 33])
    w = BatchMLAPagedAttentionWrapper(torch.empty(16, dtype=torch.uint8))
    args = [torch.arange(5, dtype=torch.int32), pb.kv_indptr, pb.kv_indices, kv_len, 64, 512, 64, 16, False, 1.0,
            torch.bfloat16, torch.bfloat16]
    w.plan(*args)
    for i, bad, match in ((4, 64.0, "num_heads"), (4, [64], "num_heads"), (9, True, "sm_scale"),
                          (9, [1.0], "sm_scale"), (7, 16.0, "page_size")):
        with pytest.raises(ValueError, match=match):
            w.plan(*args[:i], bad, *args[i + 1:])
    with pytest.raises(ValueError, match="kv_len_arr must be on the CPU or a CUDA device, got meta"):
        w.plan(*args[:3], kv_len.to("meta"), *args[4:])
