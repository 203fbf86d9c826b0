"""e5m2 KV caches (issue 42: FlashInfer's kv_data_type=torch.float8_e5m2): `DecodeAttention(kv_dtype=
torch.float8_e5m2)` reads e5m2 K and V as the e4m3 build does (tests/test_fp8_kv.py, whose helpers run here with
fmt=E5M2): the same layout, scales and checks, only the kernel's conversion differs (MELD_KV_FP8 2). e5m2 has
infinities, which e4m3fn lacks: an Inf in K reaches exactly the rows whose scores it enters (out and lse NaN), one
in V exactly the rows it is summed into (out NaN, lse finite), as NaN does.

CPU: the executor through the operator (both layouts, a page size off the tile, K and V apart), every finite code,
NaN and Inf of both signs, the op, the wrapper, and bad inputs named. GPU (`gpu`): the kernel (cp.async and TMA
rings, both MMA types, BENCH's length distributions at B 8 and 64, head_dim 64/128/256) against float64 over the
dequantised cache with outputs poisoned first, every code bit for bit, NaN/Inf rows, and FlashInfer's e5m2 decode.
"""
import math

import pytest
import torch

import meld
from meld.codegen import DecodeKernelConfig
from meld.compat.flashinfer import BatchDecodeWithPagedKVCacheWrapper
from meld.ops import torch_ops
from meld.workloads import lengths, paged
from tests.test_fp8_kv import (BF16, K_SCALE, LENS, V_SCALE, _assert_rounded, _every_code_case, _forms, _fp8,
                               _gpu_check, _layout, _nan_case, _op, _reference, _tma)

E5M2 = torch.float8_e5m2
E5M2_BUILD = "float8_e5m2"


def test_build_is_its_own_kernel():
    """The e5m2 build: its own name and MELD_KV_FP8 2 (e4m3's stays 1), the same shared memory as e4m3's."""
    e4, e5 = (DecodeKernelConfig.default("bfloat16", 128, kv_dtype=kv) for kv in ("float8_e4m3fn", E5M2_BUILD))
    assert e5.name == e4.name.replace("_e4m3_", "_e5m2_") and "_e5m2_" in e5.name
    assert "#define MELD_KV_FP8 2" in e5.render() and "#define MELD_KV_FP8 1" in e4.render()
    assert e5.smem_bytes == e4.smem_bytes


# --- the CPU executor, through the operator ---------------------------------------------------------------------
@pytest.mark.parametrize("form,layout,P", [("one-cache", "NHD", 16), ("two-allocations", "HND", 7),
                                           ("other-layout-views", "NHD", 5)])
def test_operator_matches_float64(form, layout, P):
    attn, pb, q, k, v = _op(layout, P, fmt=E5M2)
    assert attn.kernel_config.kv_dtype == E5M2_BUILD and attn.shape_bucket.endswith("/kv-e5m2")
    cache, one = _forms(form, k, v, layout)
    out = torch.full_like(q, math.nan)
    _, lse = attn.run(q, cache, out=out, return_lse=True, k_scale=K_SCALE, v_scale=V_SCALE)
    _assert_rounded(out, lse, *_reference(q, k, v, pb))
    assert (attn.schedule.items()["slot"] >= 0).any(), "the test must exercise split units and merges"


def test_every_code_on_the_executor():
    out, lse, want, want_lse = _every_code_case(fmt=E5M2)
    assert torch.equal(out.double(), want)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-30)


def test_nan_and_inf_codes_on_the_executor():
    out, lse, ref, ref_lse, nan_out, nan_lse = _nan_case(fmt=E5M2)
    _assert_rounded(out[~nan_out], lse[~nan_lse], ref[~nan_out], ref_lse[~nan_lse])


# --- the op and the FlashInfer wrapper --------------------------------------------------------------------------
def test_op_takes_the_cache_and_scales():
    attn, pb, q, k, v = _op(fmt=E5M2)
    want = attn.run(q, (k, v), k_scale=K_SCALE, v_scale=V_SCALE)
    assert torch.equal(torch_ops.decode_attention(attn, q, (k, v), k_scale=K_SCALE, v_scale=V_SCALE), want)
    buf = torch.empty_like(q)
    torch.ops.meld.decode_attention(q, k, buf, None, attn.handle, v, K_SCALE, V_SCALE)
    assert torch.equal(buf, want)
    with pytest.raises(ValueError, match="v_cache must have dtype torch.float8_e5m2, got torch.float8_e4m3fn"):
        torch.ops.meld.decode_attention(q, k, buf, None, attn.handle, v.view(torch.uint8).view(torch.float8_e4m3fn))


@pytest.mark.parametrize("layout,P,kv_data_type", [("NHD", 16, E5M2), ("HND", 1, "float8_e5m2")])
def test_wrapper_takes_e5m2_plans_and_scales(layout, P, kv_data_type):
    """plan(kv_data_type=torch.float8_e5m2 or its name) and run(k_scale=, v_scale=) (lse base 2); an e4m3 cache
    given to an e5m2 plan is named."""
    pb = paged(LENS, P)
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(16, dtype=torch.uint8), layout)
    w.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len, 8, 2, 64, P, q_data_type=BF16, kv_data_type=kv_data_type)
    assert w._op.kv_dtype is E5M2
    k, v = (_fp8(pb.num_pages, P, 2, 64, fmt=E5M2) for _ in range(2))
    cache = torch.stack([_layout(k, layout), _layout(v, layout)], dim=1)
    q = torch.randn(len(LENS), 8, 64).to(BF16)
    out, lse = w.run(q, cache, k_scale=K_SCALE, v_scale=V_SCALE, return_lse=True)
    _assert_rounded(out, lse / math.log2(math.e), *_reference(q, k, v, pb))
    with pytest.raises(ValueError, match="paged_kv_cache must have dtype torch.float8_e5m2, got torch.float8_e4m3fn"):
        w.run(q, cache.view(torch.uint8).view(torch.float8_e4m3fn))


# --- bad inputs --------------------------------------------------------------------------------------------------
def test_bad_inputs_are_named_and_change_nothing():
    attn, pb, q, k, v = _op(fmt=E5M2)
    out = torch.zeros_like(q)
    with pytest.raises(ValueError, match="kv_cache must have dtype torch.float8_e5m2, got torch.float8_e4m3fn"):
        attn.run(q, torch.stack([k, v], dim=1).view(torch.uint8).view(torch.float8_e4m3fn), out=out)
    with pytest.raises(ValueError, match=r"k_scale must be positive \(a dequantisation scale\), got -1.0"):
        attn.run(q, (k, v), out=out, k_scale=-1.0)
    assert not out.any(), "a run() that raises must not write out="
    args = (8, 2, 64, 16, BF16, "cpu")
    with pytest.raises(ValueError, match="kernel_config is for .*kv_dtype='float8_e4m3fn'; the operator is .*"
                                         "kv_dtype='float8_e5m2'"):
        meld.DecodeAttention(*args, kv_dtype=E5M2,
                             kernel_config=DecodeKernelConfig.default("bfloat16", 64, kv_dtype="float8_e4m3fn"))


# --- GPU --------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.usefixtures("fp8_math")
@pytest.mark.parametrize("dist", ["skewed", "ragged", "one-long"])
@pytest.mark.parametrize("B", [8, 64])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("rings", ["cp.async-HND-P5", "tma-NHD-P16"])
def test_gpu_bench_batches_match_float64(dist, B, dtype, rings):
    """BENCH's length distributions (lengths + 3: none a multiple of the tile) against float64 over the
    dequantised cache (tests/test_fp8_kv.py's _gpu_check: outputs poisoned, relative error < 5e-3, lse, two runs
    bit-identical)."""
    tma = rings.startswith("tma")
    kw = dict(kernel_config=_tma(dtype, 128, E5M2_BUILD)) if tma else {}
    _gpu_check([n + 3 for n in lengths(dist, B)], "NHD" if tma else "HND", 16 if tma else 5,
               dtype=getattr(torch, dtype), fmt=E5M2, **kw)


@pytest.mark.gpu
@pytest.mark.usefixtures("fp8_math")
@pytest.mark.parametrize("D", [64, 256])
@pytest.mark.parametrize("tma", [False, True], ids=["cp.async", "tma"])
def test_gpu_head_dims(D, tma):
    kw = dict(kernel_config=_tma("bfloat16", D, E5M2_BUILD)) if tma else {}
    _gpu_check([37, 0, 250, 1, 1003, 115, 5000, 17, 64], D=D, fmt=E5M2, **kw)


@pytest.mark.gpu
@pytest.mark.usefixtures("fp8_math")
@pytest.mark.parametrize("dtype", [BF16, torch.float16])
@pytest.mark.parametrize("tma", [False, True], ids=["cp.async", "tma"])
def test_gpu_every_code(dtype, tma):
    """Every finite e5m2 code through the kernel's K and V paths: out bit for bit, lse to float32's rounding (the
    fragment mapping, and the prmt that converts and permutes V's bytes at once)."""
    name = "bfloat16" if dtype is BF16 else "float16"
    kw = dict(kernel_config=_tma(name, 128, E5M2_BUILD, heads_per_unit=16)) if tma else {}
    out, lse, want, want_lse = _every_code_case(dtype, "cuda", fmt=E5M2, **kw)
    assert torch.equal(out.double(), want)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.usefixtures("fp8_math")
@pytest.mark.parametrize("tma", [False, True], ids=["cp.async", "tma"])
def test_gpu_nan_and_inf_codes(tma):
    """NaN and +-Inf codes in K and V: NaN out (and lse, from K) for exactly the affected rows (_nan_case asserts
    it); the other rows as float64."""
    kw = dict(kernel_config=_tma(head_dim=64, kv_dtype=E5M2_BUILD)) if tma else {}
    out, lse, ref, ref_lse, nan_out, nan_lse = _nan_case("cuda", fmt=E5M2, **kw)
    err = ((out[~nan_out].double() - ref[~nan_out]).norm() / ref[~nan_out].norm()).item()
    assert err < 5e-3 and (lse[~nan_lse].double() - ref_lse[~nan_lse]).abs().max().item() < 2e-3


@pytest.mark.gpu
@pytest.mark.usefixtures("fp8_math")
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_gpu_against_flashinfer(layout):
    """FlashInfer's e5m2 decode on the same cache and scales: both close to float64 over the dequantised cache
    and to each other (one rounding apart: FlashInfer applies v_scale after rounding its output)."""
    flashinfer = pytest.importorskip("flashinfer", reason="flashinfer is not installed: the comparison needs its "
                                                           "FP8 decode (bench/decode.py's peer wheels)")
    lens = [n + 3 for n in lengths("skewed", 16)]
    pb = paged(lens, 16)
    k, v = (_fp8(pb.num_pages, 16, 8, 128, device="cuda", fmt=E5M2) for _ in range(2))
    cache = torch.stack([_layout(k, layout), _layout(v, layout)], dim=1)
    q = torch.randn(len(lens), 32, 128, device="cuda").to(BF16)
    outs = []
    for w in (BatchDecodeWithPagedKVCacheWrapper(torch.empty(1, dtype=torch.uint8, device="cuda"), layout),
              flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"),
                                                            layout)):
        w.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len, 32, 8, 128, 16, q_data_type=BF16, kv_data_type=E5M2)
        out = torch.full_like(q, math.nan)
        w.run(q, cache, k_scale=K_SCALE, v_scale=V_SCALE, out=out)
        outs.append(out)
    ref, _ = _reference(q, k, v, pb)
    for out in outs:
        assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-2
    assert ((outs[0].double() - outs[1].double()).norm() / outs[1].double().norm()).item() < 2e-2


def test_bench_times_an_e5m2_cache(capsys):
    """bench/decode.py --kv-dtype e5m2: lists its cases at one byte a value, and quantises to e5m2 with a
    power-of-two scale, so that the cache stands for bf16 values exactly (what its bf16 runs read)."""
    from bench import decode

    try:
        argv = ["--kv-dtype", "e5m2", "--dry-run", "--batch", "8", "--dist", "uniform2k", "--no-extra"]
        assert decode.main(argv) == 0
        assert decode.KV_FP8[0] is E5M2 and decode.kv_elem_bytes() == 1
        x = (torch.randn(4096) * 300).to(BF16)
        codes, scale = decode._fp8(x)
        assert codes.dtype is E5M2 and codes.isfinite().all() and math.log2(scale).is_integer()
        assert torch.equal((codes.to(BF16) * scale).double(), codes.double() * scale)
    finally:
        decode.KV_FP8[0] = None
    assert "uniform2k" in capsys.readouterr().out
