"""FlashInfer 0.6.18's decode tests, ported: the tests of its tests/attention/test_batch_decode_kernels.py and
test_tensor_cores_decode.py, and the decode tests of test_non_contiguous_decode.py,
test_decode_fp8_calibration_scale.py and test_decode_prefill_lse.py (tag v0.6.18rc7, the newest 0.6.18 tag in
the mirror this was read from), with their parametrization and tolerances, run through `meld.compat.flashinfer` and checked against a float64
reference written here (FlashInfer checks against its own kernels: single decode, the other tensor-core
setting, batch prefill). Beyond FlashInfer's checks: outputs are NaN-filled before each run, lse is checked
wherever a case returns it, and a second run must give the same bits.

Each FlashInfer test is a suite below (SUITES: its parameters, values and runner). A case meld refuses
(NotImplementedError from meld.compat) xfails with the refusal, which must be in ALLOWED;
test_refusals_are_the_allow_list plans every case of every suite and checks the refusals, counted per option,
against ALLOWED exactly.

Cases: 6,192 in all (289 of them refused: ALLOWED). GPU (marker gpu): a pairwise cover of each suite (every
value of every parameter, every pair of values, and each suite's first case) by default, 179 cases; the other
6,013 under -m full_matrix (collected only then). CPU (reference executor, CPU tensors): a pairwise cover of
each suite's smaller values, 103 cases. Both also run test_nan_in_nan_out_for_exactly_the_affected_rows (4 cases
each); the GPU also test_single_decode_torch_compile_cuda_graph.
"""
from __future__ import annotations

import collections
import functools
import itertools
import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from meld.compat import flashinfer as fi
from tests.kernel_matrix import pairwise

LOG2E = 1.4426950408889634
F16 = torch.float16
E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
NVFP4 = torch.uint8   # FlashInfer's packed FP4 cache (two values a byte, scale factors in kv_cache_sf)

# Every refusal the port meets, as "option=value" of meld.compat's NotImplementedError, and the number of
# cases it refuses. test_refusals_are_the_allow_list requires this exact set and these counts.
ALLOWED = {
    # nvfp4 KV (FlashInfer's test_batch_decode_with_paged_kv_cache_nvfp4 and its large-head case): refused, and
    # may stay so (issue 42).
    "kv_data_type=torch.uint8": 289,
}
_REFUSAL = re.compile(r"^meld\.compat\.flashinfer: (\w+)=(.+?) is not supported")

TOL = dict(rtol=1e-3, atol=1e-3)        # FlashInfer's, for every float16 case
TOL_BF16 = dict(rtol=1e-2, atol=1e-2)   # FlashInfer's, for its bfloat16 multi-token case
# The tensor cores take P in the MMA type (f16 at best, unit roundoff 2^-11), so an output that cancels (|ref| far
# below sum p |v|) is off by up to about 2^-11 sum p |v| however the kernel sums: a float64 reference sees it (e.g.
# a request of two or three keys, and page size 1), FlashInfer's tests, kernel against kernel, do not.
P_ROUND = 2.0 ** -11


# --- the float64 reference --------------------------------------------------------------------------------
def _table(kv_lens: list[int], page_size: int, device="cpu"):
    """FlashInfer's page table (int32) for requests of `kv_lens` tokens on consecutive pages."""
    pages = [(n + page_size - 1) // page_size for n in kv_lens]
    indptr = torch.tensor([0] + list(itertools.accumulate(pages)), dtype=torch.int32, device=device)
    indices = torch.arange(sum(pages), dtype=torch.int32, device=device)
    last = torch.tensor([(n - 1) % page_size + 1 for n in kv_lens], dtype=torch.int32, device=device)
    return indptr, indices, last


def _rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Llama's rotate-half embedding of x [n, heads, D] (float64) at positions pos [n]: FlashInfer's ROPE_LLAMA
    with its defaults (rope_scale 1, rope_theta 1e4)."""
    h = x.shape[-1] // 2
    freq = 1e4 ** (-2.0 * torch.arange(h, dtype=torch.float64, device=x.device) / x.shape[-1])
    angle = pos.to(torch.float64)[:, None, None] * freq
    cos, sin = angle.cos(), angle.sin()
    return torch.cat([x[..., :h] * cos - x[..., h:] * sin, x[..., h:] * cos + x[..., :h] * sin], dim=-1)


def _reference(q, k_pages, v_pages, table, q_len=1, rope=False):
    """float64 (out [rows, Hq, D], lse [rows, Hq] base 2, and sum p |v| [rows, Hq, D], the scale of P's rounding
    in out) of query rows q [B * q_len, Hq, D] over K and V pages
    [num_pages, page_size, Hkv, D] (NHD views, any dtype). Row j of a request of L keys attends to keys
    0 .. L - q_len + j (FlashInfer's causal multi-token decode; with q_len 1 to all L), scaled by
    1/sqrt(D); ROPE_LLAMA rotates each query and key at its own position."""
    indptr, indices, last = (t.cpu().long() for t in table)
    P, Hkv, D = k_pages.shape[1:]
    Hq = q.shape[1]
    out, lse, spread = [], [], []
    for b in range(len(last)):
        pages = indices[indptr[b]:indptr[b + 1]].to(k_pages.device)
        L = (len(pages) - 1) * P + int(last[b]) if len(pages) else 0   # (an empty request: zeros, lse -inf)
        k, v = (_gather(t, pages).reshape(-1, Hkv, D)[:L].double() for t in (k_pages, v_pages))
        qb = q[b * q_len:(b + 1) * q_len].double()
        qpos = torch.arange(L - q_len, L, device=q.device)
        if rope:
            qb, k = _rope(qb, qpos), _rope(k, torch.arange(L, device=q.device))
        s = torch.einsum("qhgd,khd->qhgk", qb.view(q_len, Hkv, Hq // Hkv, D), k) / math.sqrt(D)
        future = torch.arange(L, device=q.device)[None, :] > qpos[:, None]
        s = s.masked_fill(future[:, None, None, :], -math.inf)
        m = s.logsumexp(-1, keepdim=True)
        out.append(torch.einsum("qhgk,khd->qhgd", (s - m).exp(), v).reshape(q_len, Hq, D))
        spread.append(torch.einsum("qhgk,khd->qhgd", (s - m).exp(), v.abs()).reshape(q_len, Hq, D))
        lse.append(m.reshape(q_len, Hq) * LOG2E)
    return torch.cat(out), torch.cat(lse), torch.cat(spread)


def _gather(pages: torch.Tensor, which: torch.Tensor) -> torch.Tensor:
    """pages[which], through a byte view for one-byte (FP8) caches, which not every indexing kernel takes."""
    if pages.element_size() != 1:
        return pages[which]
    return pages.view(torch.uint8)[which].view(pages.dtype)


def _nhd(kv: torch.Tensor, kv_layout: str) -> torch.Tensor:
    """A cache [pages, 2, page_size, Hkv, D] (NHD) or [pages, 2, Hkv, page_size, D] (HND) as an NHD view."""
    return kv if kv_layout == "NHD" else kv.transpose(2, 3)


def _check(out, lse, ref, tol=TOL):
    """out (and lse, when not None) against the reference (out, lse[, spread]), at FlashInfer's tolerance (out's
    widened by P_ROUND x spread where the reference gives it)."""
    _close("out", out, ref[0], tol, ref[2] if len(ref) > 2 else None)
    if lse is not None:
        _close("lse", lse, ref[1], tol)


def _close(what, actual, expected, tol, spread=None):
    """torch.testing.assert_close's rule, |actual - expected| <= atol + rtol |expected| (+ P_ROUND spread, where
    given; a NaN fails), without the import of torch.distributed that its first call costs each test process."""
    err = (actual.double() - expected).abs().masked_fill(actual.double() == expected, 0)   # (equal infinities)
    bound = tol["atol"] + tol["rtol"] * expected.abs()
    bad = ~(err <= (bound if spread is None else bound + P_ROUND * spread))
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} elements off by more than atol + rtol |ref| "
                           f"({tol}); largest error {err.nan_to_num(math.inf).max().item():.3e}")


# --- running a case ---------------------------------------------------------------------------------------
def _workspace(device):
    """FlashInfer's float workspace (meld holds it and never reads it, so it need not be FlashInfer's size)."""
    return torch.empty(1 << 10, dtype=torch.uint8, device=device)


def _run(wrapper, q, kv, return_lse=True, **scales):
    """run() into NaN-filled out (and lse), then again allocating its own: the two must be the same bits, as
    FlashInfer's user-allocated-output check. Returns (out, lse or None)."""
    B, Hq, _ = q.shape
    out = torch.full(q.shape, math.nan, dtype=q.dtype, device=q.device)   # (q may be a strided view)
    lse = torch.full((B, Hq), math.nan, device=q.device) if return_lse else None
    wrapper.run(q, kv, out=out, lse=lse, return_lse=return_lse, **scales)
    again = wrapper.run(q, kv, **scales)
    assert torch.equal(again.view(torch.int16), out.view(torch.int16)), "a second run gave other bits"
    return out, lse


def _graph(fn: Callable[[], tuple], device: str) -> Callable[[], tuple]:
    """fn() (returning output tensors) captured in a CUDA graph after FlashInfer's three warm-up runs on a side
    stream, as a replay that NaN-fills the outputs first; on the CPU, where nothing is captured, fn itself."""
    if device == "cpu":
        return fn
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        res = fn()

    def replay():
        for t in res:
            t.fill_(math.nan)
        g.replay()
        return res
    return replay


def _cache(shape, dtype, device, scale=1.0):
    """A random cache: float32 normals (FlashInfer's; its tensor-core tests divide them by 10) in `dtype`."""
    return (torch.randn(*shape, device=device) * scale).to(dtype)


def _kv_shape(pages, page_size, num_kv_heads, head_dim, kv_layout, tuple_=False):
    inner = [page_size, num_kv_heads] if kv_layout == "NHD" else [num_kv_heads, page_size]
    return [pages] + ([] if tuple_ else [2]) + inner + [head_dim]


def _options(num_qo_heads, num_kv_heads, head_dim, page_size, pos_encoding_mode="NONE", q_dtype=torch.float16,
             kv_dtype=torch.float16, **more):
    """plan()'s arguments after the page table, as a case of FlashInfer's passes them (`data_type=` its kv type)."""
    return dict(num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
                pos_encoding_mode=pos_encoding_mode, data_type=kv_dtype, q_data_type=q_dtype, **more)


# test_batch_decode_with_paged_kv_cache, _with_fast_plan and test_batch_decode_with_tuple_paged_kv_cache (NHD,
# 4 kv heads, soft cap 0, return_lse, float16 q, contiguous cache).
BATCH_NAMES = ("batch_size", "kv_len", "page_size", "num_qo_heads", "head_dim", "pos_encoding_mode", "kv_dtype")


def _batch_options(p):
    return _options(p["num_qo_heads"], 4, p["head_dim"], p["page_size"], p["pos_encoding_mode"],
                    kv_dtype=p["kv_dtype"], logits_soft_cap=0.0)


def _run_batch(device, p, fast_plan=False, tuple_=False):
    B, L, P, D = p["batch_size"], p["kv_len"], p["page_size"], p["head_dim"]
    q = torch.randn(B, p["num_qo_heads"], D, device=device, dtype=torch.float16)
    table = _table([L] * B, P, device)
    num_pages = int(table[0][-1])
    shape = _kv_shape(num_pages, P, 4, D, "NHD", tuple_)
    kv = (_cache(shape, p["kv_dtype"], device), _cache(shape, p["kv_dtype"], device)) if tuple_ else \
        _cache(shape, p["kv_dtype"], device)
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(_workspace(device), "NHD")
    wrapper.plan(*table, **_batch_options(p))
    if fast_plan:   # FlashInfer's idiom: plan() once, then the fast re-plan bound in its place
        wrapper.plan = functools.partial(fi.fast_decode_plan, wrapper)
        indptr_cpu = torch.arange(B + 1, dtype=torch.int32) * (num_pages // B)
        wrapper.plan(*table, **_batch_options(p), non_blocking=True, global_override_indptr_cpu=indptr_cpu)
    out, lse = _run(wrapper, q, kv)
    k, v = kv if tuple_ else (kv[:, 0], kv[:, 1])
    _check(out, lse, _reference(q, k, v, table, rope=p["pos_encoding_mode"] == "ROPE_LLAMA"))


# test_cuda_graph_batch_decode_with_paged_kv_cache: capture at one page per request, replay after re-plans.
def _run_cuda_graph(device, p):
    B, L, P, D, Hq = p["batch_size"], p["kv_len"], p["page_size"], p["head_dim"], p["num_qo_heads"]
    rope = p["pos_encoding_mode"] == "ROPE_LLAMA"
    q = torch.randn(B, Hq, D, device=device, dtype=torch.float16)
    pages_per_seq = (L + P - 1) // P
    kv = _cache(_kv_shape(pages_per_seq * B, P, 4, D, "NHD"), p["kv_dtype"], device)
    buffers = [torch.empty(n, dtype=torch.int32, device=device) for n in (B + 1, pages_per_seq * B, B)]
    wrapper = fi.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(_workspace(device), *buffers, "NHD")
    options = _options(Hq, 4, D, P, p["pos_encoding_mode"], kv_dtype=p["kv_dtype"])
    warmup = _table([P] * B, P, device)   # FlashInfer's warm-up plan: indptr and indices on the GPU, last on the CPU
    wrapper.plan(warmup[0], warmup[1], warmup[2].cpu(), **options)
    replay = _graph(lambda: (wrapper.run(q, kv),), device)
    for lens in [[i * P] * B for i in range(1, min(4, pages_per_seq))] + [[L] * B]:
        table = _table(lens, P)
        wrapper.plan(*table, **options)
        _check(replay()[0], None, _reference(q, kv[:, 0], kv[:, 1], table, rope=rope))


# test_batch_decode_with_paged_kv_cache_nvfp4 (and its large-head case): meld has no FP4 cache.
NVFP4_NAMES = ("batch_size", "kv_len", "page_size", "num_kv_heads", "num_qo_heads", "head_dim", "q_dtype")


def _nvfp4_options(p):
    return _options(p["num_qo_heads"], p["num_kv_heads"], p["head_dim"], p["page_size"], q_dtype=p["q_dtype"],
                    kv_dtype=NVFP4)


def _run_nvfp4(device, p):
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(_workspace(device), "NHD")
    wrapper.plan(*_table([p["kv_len"]] * p["batch_size"], p["page_size"], device), **_nvfp4_options(p))
    pytest.fail("meld planned an nvfp4 cache: port FlashInfer's nvfp4 data and its dequantised reference here")


# test_batch_decode_rejects_unequal_kv_strides_nvfp4_contract: separate K and V pools padded alike run; padded
# differently (one shape, other strides) they are refused by name.
def _run_unequal_strides(device, p):
    B, L, P, Hkv, Hq, D = 4, 54, 8, 4, 4, 128
    table = _table([L] * B, P, device)

    def pool(padding_heads):
        return torch.randn(int(table[0][-1]), P, Hkv + padding_heads, D, device=device).half()[:, :, :Hkv]

    q = torch.randn(B, Hq, D, device=device, dtype=torch.float16)
    k, v = pool(1), pool(1)
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(_workspace(device), "NHD")
    wrapper.plan(*table, **_unequal_strides_options(p))
    out, _ = _run(wrapper, q, (k, v), return_lse=False)
    _check(out, None, _reference(q, k, v, table))
    v_other = pool(2)
    v_other.copy_(v)
    with pytest.raises(ValueError, match="stride"):
        wrapper.run(q, (k, v_other))


def _unequal_strides_options(p):
    return _options(4, 4, 128, 8, kv_dtype=torch.float16, q_dtype=torch.float16)


# test_cuda_graph_uniform_multi_token_decode_with_paged_kv_cache: q_len_per_req query rows a request, causal
# among them, captured once and replayed over re-planned lengths (bfloat16, page 16, head_dim 128).
MULTI_NAMES = ("batch_size", "q_len_per_req", "num_kv_heads", "gqa_group_size")


def _multi_options(p):
    return _options(p["num_kv_heads"] * p["gqa_group_size"], p["num_kv_heads"], 128, 16, q_dtype=torch.bfloat16,
                    kv_dtype=torch.bfloat16, q_len_per_req=p["q_len_per_req"])


def _run_multi_token(device, p):
    B, n, Hkv = p["batch_size"], p["q_len_per_req"], p["num_kv_heads"]
    Hq = Hkv * p["gqa_group_size"]
    table = _table([129] * B, 16, device)
    kv = torch.randn(int(table[0][-1]), 2, 16, Hkv, 128, device=device, dtype=torch.bfloat16)
    q = torch.randn(B * n, Hq, 128, device=device, dtype=torch.bfloat16)
    buffers = dict(paged_kv_indptr_buffer=torch.empty(B + 1, dtype=torch.int32, device=device),
                   paged_kv_indices_buffer=torch.empty(int(table[0][-1]), dtype=torch.int32, device=device),
                   paged_kv_last_page_len_buffer=torch.empty(B, dtype=torch.int32, device=device))
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(_workspace(device), "NHD", use_cuda_graph=True,
                                                    use_tensor_cores=True, **buffers)
    wrapper.plan(*table, **_multi_options(p))
    out = wrapper.run(q, kv)
    replay = _graph(lambda: (wrapper.run(q, kv, out=out),), device)
    for lens in ([129] * B, [[33, 17, 65, 129][i % 4] for i in range(B)],
                 [[n, 128, 64, 100][i % 4] for i in range(B)]):   # FlashInfer's: the shortest legal is q_len_per_req
        table = _table(lens, 16, device)
        wrapper.plan(*table, **_multi_options(p))
        _check(replay()[0], None, _reference(q, kv[:, 0], kv[:, 1], table, q_len=n), TOL_BF16)


# test_tensor_core_decode_rejects_mismatched_q_len, where its rules are meld's too: planned for q_len_per_req=2,
# a run() with 3 query rows a request is a ValueError. (Its others are FlashInfer's kernel choices: meld takes
# use_tensor_cores and backend either way, and fast_decode_plan is plan(), which needs no plan before it.)
def _q_len_options(p):
    return _options(8, 2, 128, 16, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, q_len_per_req=2)


def _run_q_len_rejects(device, p):
    B = 4
    table = _table([16] * B, 16, device)
    kv = torch.randn(B, 2, 16, 2, 128, device=device, dtype=torch.bfloat16)
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(_workspace(device), "NHD", use_tensor_cores=True)
    wrapper.plan(*table, **_q_len_options(p))
    with pytest.raises(ValueError, match="q"):
        wrapper.run(torch.randn(B * 3, 8, 128, device=device, dtype=torch.bfloat16), kv)


# test_single_decode_tensor_cores: single_decode_with_kv_cache with use_tensor_cores False and True (FlashInfer
# compares the two; here each goes against float64).
SINGLE_NAMES = ("kv_len", "num_kv_heads", "group_size", "head_dim", "kv_layout", "pos_encoding_mode")


def _single_options(p):
    return _options(p["num_kv_heads"] * p["group_size"], p["num_kv_heads"], p["head_dim"], 1,
                    p["pos_encoding_mode"])


def _run_single(device, p):
    L, Hkv, D = p["kv_len"], p["num_kv_heads"], p["head_dim"]
    q = torch.randn(Hkv * p["group_size"], D, device=device, dtype=torch.float16)
    shape = (L, Hkv, D) if p["kv_layout"] == "NHD" else (Hkv, L, D)
    k, v = (torch.randn(*shape, device=device, dtype=torch.float16) for _ in range(2))
    nhd = [t if p["kv_layout"] == "NHD" else t.transpose(0, 1) for t in (k, v)]
    ref = _reference(q[None], *(t[:, None] for t in nhd), _table([L], 1), rope=p["pos_encoding_mode"] == "ROPE_LLAMA")
    for tensor_cores in (False, True):
        out, lse = fi.single_decode_with_kv_cache(q, k, v, p["kv_layout"], p["pos_encoding_mode"],
                                                  use_tensor_cores=tensor_cores, return_lse=True)
        _check(out[None], lse[None], ref)


# test_batch_decode_tensor_cores, _tensor_cores_cuda_graph and test_batch_fast_decode_tensor_cores_cuda_graph:
# the wrapper with use_tensor_cores False and True (FlashInfer compares the two, out and lse; here each goes
# against float64), 4 kv heads, float16, the cache's normals divided by 10.
TC_NAMES = ("batch_size", "kv_len", "page_size", "group_size", "head_dim", "kv_layout", "pos_encoding_mode")


def _tc_options(p):
    return _options(4 * p["group_size"], 4, p["head_dim"], p["page_size"], p["pos_encoding_mode"])


def _tc_case(device, p):
    B, D = p["batch_size"], p["head_dim"]
    q = torch.randn(B, 4 * p["group_size"], D, device=device, dtype=torch.float16)
    table = _table([p["kv_len"]] * B, p["page_size"], device)
    kv = _cache(_kv_shape(int(table[0][-1]), p["page_size"], 4, D, p["kv_layout"]), torch.float16, device, 0.1)
    nhd = _nhd(kv, p["kv_layout"])
    ref = _reference(q, nhd[:, 0], nhd[:, 1], table, rope=p["pos_encoding_mode"] == "ROPE_LLAMA")
    return q, table, kv, ref


def _run_tc(device, p, graph=False, fast_plan=False):
    q, table, kv, ref = _tc_case(device, p)
    for tensor_cores in (False, True):
        buffers = dict(use_cuda_graph=True, paged_kv_indptr_buffer=table[0], paged_kv_indices_buffer=table[1],
                       paged_kv_last_page_len_buffer=table[2]) if graph else {}
        wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(_workspace(device), p["kv_layout"],
                                                        use_tensor_cores=tensor_cores, **buffers)
        wrapper.plan(*table, **_tc_options(p))
        if fast_plan:   # FlashInfer re-plans the tensor-core wrapper only, with the host indptr
            wrapper.plan = functools.partial(fi.fast_decode_plan, wrapper)
            if tensor_cores:
                wrapper.plan(*table, **_tc_options(p), global_override_indptr_cpu=table[0].cpu())
        if graph:
            _check(*_graph(lambda: wrapper.run(q, kv, return_lse=True), device)(), ref)
        else:
            _check(*_run(wrapper, q, kv), ref)


# test_batch_decode_tensor_cores_with_fast_plan: batch-invariant plans (fixed_split_size 2048, or
# disable_split_kv) re-planned for the first 4 requests give their rows bit for bit.
TC_FAST_NAMES = ("batch_size", "kv_len", "disable_split_kv", "page_size", "group_size", "head_dim", "kv_layout",
                 "pos_encoding_mode")


def _tc_fast_options(p):
    return _tc_options(p) | dict(fixed_split_size=None if p["disable_split_kv"] else 2048,
                                 disable_split_kv=p["disable_split_kv"])


def _run_tc_fast_plan(device, p):
    q, table, kv, ref = _tc_case(device, p)
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(_workspace(device), p["kv_layout"], use_tensor_cores=True)
    wrapper.plan(*table, **_tc_fast_options(p))
    wrapper.plan = functools.partial(fi.fast_decode_plan, wrapper)
    indptr_cpu = table[0].cpu()
    wrapper.plan(*table, **_tc_fast_options(p), global_override_indptr_cpu=indptr_cpu)
    out, lse = _run(wrapper, q, kv)
    _check(out, lse, ref)
    n = 4   # FlashInfer's invariant_bs
    wrapper.plan(table[0][:n + 1], table[1], table[2][:n], **_tc_fast_options(p),
                 global_override_indptr_cpu=indptr_cpu[:n + 1])
    part, part_lse = _run(wrapper, q[:n], kv)
    assert torch.equal(part, out[:n]) and torch.equal(part_lse, lse[:n]), "a smaller batch changed a request's bits"


# tests/attention/test_non_contiguous_decode.py, test_batch_paged_decode_packed_input: q a strided view of a
# packed qkv projection (one token a request, (k_cache, v_cache) pages, FlashInfer's default dtypes); the same
# bits as from a contiguous copy of q.
PACKED_NAMES = ("batch_size", "page_size", "seq_len", "num_kv_heads", "num_qo_heads", "head_dim")


def _packed_options(p):
    return dict(num_qo_heads=p["num_qo_heads"], num_kv_heads=p["num_kv_heads"], head_dim=p["head_dim"],
                page_size=p["page_size"])


def _run_packed_q(device, p):
    B, P, L, Hkv, Hq, D = (p[name] for name in PACKED_NAMES)
    table = _table([L] * B, P, device)
    k, v = (torch.randn(int(table[0][-1]), P, Hkv, D, device=device, dtype=F16) for _ in range(2))
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(_workspace(device))
    wrapper.plan(*table, **_packed_options(p))
    q = torch.randn(B * L, (Hq + 2 * Hkv) * D, device=device, dtype=F16)[:, :Hq * D].view(-1, Hq, D)
    out, _ = _run(wrapper, q, (k, v), return_lse=False)
    assert torch.equal(wrapper.run(q.contiguous(), (k, v)).view(torch.int16), out.view(torch.int16))
    _check(out, None, _reference(q, k, v, table))


# tests/attention/test_decode_fp8_calibration_scale.py: an FP8 copy of a float16 cache scaled by amax / 256, run
# with k_scale and v_scale. FlashInfer holds the FP8 run to its tolerance of the float16 run; that bounds the
# quantisation as much as the kernel (its seed's data passes), so here the FP8 run meets that tolerance against
# float64 attention over the dequantised cache (FP8 x scale), and the float16 run meets TOL against its own.
FP8_SCALE_TOL_SINGLE = dict(rtol=2e-2, atol=1e-2)
FP8_SCALE_TOL_BATCH = dict(rtol=2e-1, atol=1e-2)
FP8_SINGLE_NAMES = ("kv_len", "num_kv_heads", "num_qo_heads", "head_dim", "kv_layout", "pos_encoding_mode",
                    "fp8_dtype")


def _fp8_single_options(p):
    return _options(p["num_qo_heads"], p["num_kv_heads"], p["head_dim"], 1, p["pos_encoding_mode"],
                    kv_dtype=p["fp8_dtype"])


def _run_fp8_scale_single(device, p):
    L, Hkv, Hq, D = p["kv_len"], p["num_kv_heads"], p["num_qo_heads"], p["head_dim"]
    q = torch.randn(Hq, D, device=device, dtype=F16)
    k = torch.randn(L, Hkv, D, device=device, dtype=F16)   # (NHD: FlashInfer runs that layout only)
    v = 0.1 * torch.randn(L, Hkv, D, device=device, dtype=F16)
    ref = _reference(q[None], k[:, None], v[:, None], _table([L], 1))
    options = dict(kv_layout=p["kv_layout"], pos_encoding_mode=p["pos_encoding_mode"])
    _check(fi.single_decode_with_kv_cache(q, k, v, **options)[None], None, ref)
    k_scale, v_scale = k.amax().item() / 256, v.amax().item() / 256
    k8, v8 = (k / k_scale).to(p["fp8_dtype"]), (v / v_scale).to(p["fp8_dtype"])
    out = fi.single_decode_with_kv_cache(q, k8, v8, k_scale=k_scale, v_scale=v_scale, **options)
    ref8 = _reference(q[None], (k8.double() * k_scale)[:, None], (v8.double() * v_scale)[:, None], _table([L], 1))
    _check(out[None], None, ref8, FP8_SCALE_TOL_SINGLE)


FP8_BATCH_NAMES = ("batch_size", "kv_len", "page_size", "num_qo_heads", "head_dim", "kv_layout",
                   "pos_encoding_mode", "dtype")


def _fp8_batch_options(p):
    return _options(p["num_qo_heads"], 4, p["head_dim"], p["page_size"], p["pos_encoding_mode"], kv_dtype=p["dtype"])


def _run_fp8_scale_batch(device, p):
    B, D, P = p["batch_size"], p["head_dim"], p["page_size"]
    q = torch.randn(B, p["num_qo_heads"], D, device=device, dtype=F16)
    table = _table([p["kv_len"]] * B, P, device)
    kv = _cache(_kv_shape(int(table[0][-1]), P, 4, D, p["kv_layout"]), F16, device, 0.1)
    nhd = _nhd(kv, p["kv_layout"])
    ref = _reference(q, nhd[:, 0], nhd[:, 1], table, rope=p["pos_encoding_mode"] == "ROPE_LLAMA")
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(_workspace(device), p["kv_layout"])
    wrapper.plan(*table, **(_fp8_batch_options(p) | dict(data_type=F16)))
    _check(_run(wrapper, q, kv, return_lse=False)[0], None, ref)
    k_scale, v_scale = kv[:, 0].amax().item() / 256, kv[:, 1].amax().item() / 256
    kv8 = torch.stack([kv[:, 0] / k_scale, kv[:, 1] / v_scale], dim=1).to(p["dtype"])
    wrapper.plan(*table, **_fp8_batch_options(p))
    out, _ = _run(wrapper, q, kv8, return_lse=False, k_scale=k_scale, v_scale=v_scale)
    nhd8 = _nhd(kv8, p["kv_layout"]).double()
    ref8 = _reference(q, nhd8[:, 0] * k_scale, nhd8[:, 1] * v_scale, table, rope=p["pos_encoding_mode"] == "ROPE_LLAMA")
    _check(out, None, ref8, FP8_SCALE_TOL_BATCH)


# tests/attention/test_decode_prefill_lse.py, test_mlc_failed_case: an empty request (no pages, last_page_len 0)
# beside one of 9 pages (HND, 32 heads, page 16), run_return_lse with use_tensor_cores False and True.
def _mlc_options(p):
    return _options(32, 32, 128, 16)


def _run_mlc_empty_request(device, p):
    table = tuple(torch.tensor(t, dtype=torch.int32, device=device) for t in
                  ([0, 0, 9], [3, 4, 5, 6, 7, 8, 9, 10, 11], [0, 1]))
    q = torch.randn(2, 32, 128, device=device, dtype=F16)
    kv = torch.randn(12, 2, 32, 16, 128, device=device, dtype=F16)
    nhd = _nhd(kv, "HND")
    ref = _reference(q, nhd[:, 0], nhd[:, 1], table)
    for tensor_cores in (False, True):
        wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(_workspace(device), "HND", use_tensor_cores=tensor_cores)
        wrapper.plan(*table, **_mlc_options(p))
        _check(*wrapper.run_return_lse(q, kv), ref)


# --- the suites ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Suite:
    """One FlashInfer test: its parameters, their values (the product is its parametrization, plus `extra`
    cases), the values the CPU executor runs (a pairwise cover of their product), its runner, and its
    plan() options after the page table (for counting refusals)."""
    names: tuple[str, ...]
    values: tuple[tuple, ...]
    cpu_values: tuple[tuple, ...]
    run: Callable
    options: Callable
    extra: tuple[tuple, ...] = ()
    valid: Callable = lambda case: True   # the cases FlashInfer runs (it skips the others)

    def cases(self, cpu=False) -> list[tuple]:
        product = itertools.product(*(self.cpu_values if cpu else self.values))
        return [c for c in product if self.valid(c)] + ([] if cpu else list(self.extra))


_BATCH = ((12, 17, 128), (54, 97, 512, 2048, 16384), (1, 8, 16), (4, 32), (128, 256), ("NONE", "ROPE_LLAMA"),
          (F16, E4M3))
_BATCH_CPU = ((12,), (54, 97), (1, 8, 16), (4, 32), (128, 256), ("NONE", "ROPE_LLAMA"), (F16, E4M3))
_TC = ((12, 17), (54, 97, 512), (1, 8, 16), (1, 4, 8), (128, 256), ("HND", "NHD"), ("NONE", "ROPE_LLAMA"))
_TC_CPU = ((12,), (54, 97), (1, 8, 16), (1, 4, 8), (128, 256), ("HND", "NHD"), ("NONE", "ROPE_LLAMA"))

SUITES = {
    "batch_decode": Suite(BATCH_NAMES, _BATCH[:4] + ((128, 256, 512),) + _BATCH[5:], _BATCH_CPU, _run_batch,
                          _batch_options),
    "batch_decode_fast_plan": Suite(BATCH_NAMES, _BATCH, _BATCH_CPU, functools.partial(_run_batch, fast_plan=True),
                                    _batch_options),
    "batch_decode_tuple": Suite(BATCH_NAMES, _BATCH, _BATCH_CPU, functools.partial(_run_batch, tuple_=True),
                                _batch_options),
    "cuda_graph": Suite(BATCH_NAMES, _BATCH[:1] + ((54, 2048, 16384),) + _BATCH[2:],
                        ((12,), (54,)) + _BATCH_CPU[2:], _run_cuda_graph, _batch_options),
    "nvfp4": Suite(NVFP4_NAMES, ((12, 17, 128), (54, 97, 512, 2048), (1, 8, 16), (4,), (4, 32), (128, 256),
                                 (F16, torch.bfloat16)),
                   ((12,), (54,), (1, 16), (4,), (4, 32), (128,), (F16, torch.bfloat16)), _run_nvfp4,
                   _nvfp4_options, extra=((4, 128, 16, 1, 1, 512, F16),)),
    "unequal_strides": Suite(("case",), ((0,),), ((0,),), _run_unequal_strides, _unequal_strides_options),
    "multi_token": Suite(MULTI_NAMES, ((4, 8), (2, 3), (2, 8), (4, 8)), ((4,), (2, 3), (2,), (4,)),
                         _run_multi_token, _multi_options),
    "q_len_rejects": Suite(("case",), ((0,),), ((0,),), _run_q_len_rejects, _q_len_options),
    "single_tensor_cores": Suite(SINGLE_NAMES, ((54, 128, 999, 32789), (4, 8), (1, 4, 8), (64, 128, 256),
                                                ("HND", "NHD"), ("NONE", "ROPE_LLAMA")),
                                 ((54, 128), (4,), (1, 8), (64, 256), ("HND", "NHD"), ("NONE", "ROPE_LLAMA")),
                                 _run_single, _single_options),
    "tensor_cores": Suite(TC_NAMES, _TC, _TC_CPU, _run_tc, _tc_options),
    "tensor_cores_cuda_graph": Suite(TC_NAMES, _TC, _TC_CPU, functools.partial(_run_tc, graph=True), _tc_options),
    "tensor_cores_fast_plan": Suite(TC_FAST_NAMES, ((5, 12), (4096, 8192, 5000), (True, False)) + _TC[2:],
                                    ((5,), (4096,), (False,), (16,), (1,), (128,), ("NHD",), ("NONE",)),
                                    _run_tc_fast_plan, _tc_fast_options),
    "fast_tensor_cores_cuda_graph": Suite(TC_NAMES, _TC, _TC_CPU,
                                          functools.partial(_run_tc, graph=True, fast_plan=True), _tc_options),
    "packed_q": Suite(PACKED_NAMES, ((1, 19, 99), (1, 5), (1,), (1, 4, 8), (4, 8), (64, 128, 256)),
                      ((1, 19), (1, 5), (1,), (1, 4), (4, 8), (64, 128)), _run_packed_q, _packed_options,
                      valid=lambda case: case[4] % case[3] == 0),
    "fp8_scale_single": Suite(FP8_SINGLE_NAMES, ((7, 19, 39, 1170, 39275), (4,), (4, 32), (128,), ("NHD",),
                                                 ("NONE",), (E4M3,)),
                              ((7, 39), (4,), (4, 32), (128,), ("NHD",), ("NONE",), (E4M3,)), _run_fp8_scale_single,
                              _fp8_single_options),
    "fp8_scale_batch": Suite(FP8_BATCH_NAMES, ((12, 17), (54, 97), (1, 8, 16), (4, 32), (128, 256), ("HND", "NHD"),
                                               ("NONE", "ROPE_LLAMA"), (E4M3, E5M2)),
                             ((12,), (54,), (1, 16), (4, 32), (128,), ("HND", "NHD"), ("NONE", "ROPE_LLAMA"),
                              (E4M3, E5M2)), _run_fp8_scale_batch, _fp8_batch_options),
    "mlc_empty_request": Suite(("case",), ((0,),), ((0,),), _run_mlc_empty_request, _mlc_options),
}


def _params(cpu: bool, full: bool = False) -> list:
    """(suite, case) params: on the GPU the pairwise cover of every case, and with `full` the rest too (marked
    full_matrix); on the CPU the pairwise cover of the smaller values."""
    params = []
    for name, suite in SUITES.items():
        cases = suite.cases(cpu)
        for param in pairwise(cases, keep=lambda case: case == cases[0]):   # (a suite of one case has no pairs)
            if param.marks and not full:
                continue
            case = param.values
            params.append(pytest.param(name, case, marks=param.marks,
                                       id=f"{name}-" + "-".join(map(_id, case))))
    return params


def pytest_generate_tests(metafunc):
    """test_gpu's cases: the rest of the matrix only when `-m full_matrix` asks for it (collecting 6,013 cases
    only to skip them would cost the CPU suite more than the port's CPU cases do)."""
    if metafunc.definition.name == "test_gpu":
        metafunc.parametrize("suite, case", _params(False, "full_matrix" in (metafunc.config.getoption("-m") or "")))


def _id(value) -> str:
    return str(value).removeprefix("torch.")


def _refusal(e: NotImplementedError) -> str:
    """The "option=value" meld.compat names in its refusal (any other NotImplementedError is not one)."""
    m = _REFUSAL.match(str(e))
    if m is None:
        raise e
    return f"{m[1]}={m[2]}"


def _run_case(suite_name: str, case: tuple, device: str) -> None:
    suite = SUITES[suite_name]
    try:
        suite.run(device, dict(zip(suite.names, case)))
    except NotImplementedError as e:
        refused = _refusal(e)
        assert refused in ALLOWED, f"meld refused a case outside ALLOWED: {e}"
        pytest.xfail(f"refused ({refused}): {e}")


@pytest.mark.gpu
def test_gpu(suite, case):
    try:
        _run_case(suite, case, "cuda")
    finally:   # the full matrix's largest caches (8 GiB) run beside other workers: hand the memory back
        torch.cuda.empty_cache()


@pytest.mark.parametrize("suite, case", _params(True))
def test_cpu(suite, case):
    _run_case(suite, case, "cpu")


def test_refusals_are_the_allow_list():
    """Every case of every suite planned with its options on a one-request table (a refusal depends on the
    options, not on the table): the refusals, counted per option, are ALLOWED exactly."""
    refused = collections.Counter()
    for suite in SUITES.values():
        for options in (suite.options(dict(zip(suite.names, case))) for case in suite.cases()):
            try:
                _probe(tuple(sorted(options.items(), key=str)))
            except NotImplementedError as e:
                refused[_refusal(e)] += 1
    assert dict(refused) == ALLOWED, f"refusals {dict(refused)}, ALLOWED {ALLOWED}"


@functools.lru_cache(maxsize=None)
def _probe(options: tuple) -> None:
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(_workspace("cpu"), "NHD", use_tensor_cores=True)
    options = dict(options)
    wrapper.plan(*_table([options.get("q_len_per_req", 1)], options["page_size"]), **options)   # (kv_len >= q_len)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("tuple_", [False, True])
@pytest.mark.parametrize("pos_encoding_mode", ["NONE", "ROPE_LLAMA"])
def test_nan_in_nan_out_for_exactly_the_affected_rows(device, tuple_, pos_encoding_mode):
    """A NaN in q[b, h] makes out[b, h] NaN; a NaN in one key of request c's kv head g makes out[c, the q heads
    of g] NaN (and their lse); every other row is finite and right (a batch of 17 requests of 97 tokens, 32 q
    heads over 4 kv heads, page size 16, float16)."""
    B, L, P, Hkv, Hq, D = 17, 97, 16, 4, 32, 128
    table = _table([L] * B, P)
    q = torch.randn(B, Hq, D, dtype=F16, device=device)
    shape = _kv_shape(int(table[0][-1]), P, Hkv, D, "NHD", tuple_)
    kv = (_cache(shape, F16, device), _cache(shape, F16, device)) if tuple_ else _cache(shape, F16, device)
    k, v = kv if tuple_ else (kv[:, 0], kv[:, 1])
    ref = _reference(q, k, v, table, rope=pos_encoding_mode == "ROPE_LLAMA")
    q[3, 5, 7] = math.nan
    k[int(table[0][11]) + 2, 4, 1, 9] = math.nan   # request 11, its third page's fifth token, kv head 1
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(_workspace(device), "NHD")
    wrapper.plan(*table, **_options(Hq, Hkv, D, P, pos_encoding_mode))
    out, lse = _run(wrapper, q, kv)
    bad = torch.zeros(B, Hq, dtype=torch.bool, device=device)
    bad[3, 5] = bad[11, 8:16] = True
    assert torch.equal(out.isnan().any(-1), bad) and torch.equal(out.isnan().all(-1), bad)
    assert torch.equal(lse.isnan(), bad)
    _check(out[~bad], lse[~bad], tuple(r[~bad] for r in ref))


_COMPILED_SINGLE_DECODE = """
import math, torch
from meld.compat.flashinfer import single_decode_with_kv_cache

@torch.library.custom_op("meld_port::single_decode", mutates_args=())
def single_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return single_decode_with_kv_cache(q, k, v)

@single_decode.register_fake
def _(q, k, v):
    return torch.empty_like(q)

compiled = torch.compile(lambda q, k, v: single_decode(q, k, v), mode="reduce-overhead", fullgraph=True)
for _ in range(3):   # cudagraph trees: a warm-up call, a recorded one, a replay
    q = torch.randn(8, 128, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(256, 8, 128, device="cuda", dtype=torch.float16) for _ in range(2))
    out = compiled(q, k, v).clone()
    s = torch.einsum("hd,khd->hk", q.double(), k.double()) / math.sqrt(128)
    ref = torch.einsum("hk,khd->hd", s.softmax(-1), v.double())
    assert ((out.double() - ref).abs() <= 1e-3 + 1e-3 * ref.abs()).all(), (out.double() - ref).abs().max()
print("PASS")
"""


@pytest.mark.gpu
def test_single_decode_torch_compile_cuda_graph():
    """FlashInfer's test_single_decode_torch_compile_cuda_graph (its issue 541): single decode inside a custom op
    under torch.compile(mode="reduce-overhead", fullgraph=True), three calls on fresh inputs, in a child process
    as FlashInfer's (a module-level op); here each output is also checked against float64. (It failed until
    single decode planned on a thread of its own: the trees' warm-up had put the plan's buffers in their pool.)"""
    env = dict(os.environ, USER=os.environ.get("USER", "ci"))   # (inductor's cache dir asks for a user name)
    r = subprocess.run([sys.executable, "-c", _COMPILED_SINGLE_DECODE], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0 and "PASS" in r.stdout, f"stdout: {r.stdout[-2000:]}\nstderr: {r.stderr[-4000:]}"
