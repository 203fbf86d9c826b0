"""RoPE over FP8 KV caches (issue 42, item 3, over issue 41's caches): `DecodeAttention(kv_dtype=torch.float8_e4m3fn
or torch.float8_e5m2, pos_encoding_mode="ROPE_LLAMA")`, through the operator, the torch op and the FlashInfer wrapper.
Each key is rotated as the cache stores it and k_scale scales the scores after, FlashInfer's order (its decode rotates
the values it loads and folds k_scale into sm_scale); the kernel rotates in registers, the executor in float64.

The reference is float64 attention over the dequantised cache with q rotated at its request's last position and each
key at its own (tests/test_decode_variants.py's `reference`), computed independently of meld's executor. CPU: the
executor (the float64 result rounded once to q's dtype) for both formats and layouts, page sizes off the tile, split
units, a cap and a window; NaN and Inf codes reach exactly their rows; the op and the wrapper; q_len > 1 with RoPE
stays refused. GPU (`gpu`): the kernel (cp.async and TMA rings, head_dim 64/128/256, both MMA types and formats,
16-head units, batch-invariant walks) against the same reference, e5m2's largest keys with f16 MMAs, NaN rows, and
two runs bit-identical."""
import dataclasses
import math

import pytest
import torch

import meld
from meld.codegen import DecodeKernelConfig, DecodeVariant
from meld.compat.flashinfer import BatchDecodeWithPagedKVCacheWrapper
from meld.ops import torch_ops
from meld.scheduler import Topology
from meld.workloads import paged
from tests.test_decode_variants import reference

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
BF16, F16 = torch.bfloat16, torch.float16
LENS = [37, 0, 250, 1, 1003, 115, 18]   # no length a multiple of the 16-token tile or of the page
K_SCALE, V_SCALE = 0.37, 2.5            # per-tensor scales as calibration gives them (not powers of two)
NAN_CODE = 0x7F                         # a NaN of both formats; 0x7C is e5m2's +Inf


def _case(fmt, layout, P, D, dtype, rope, device="cpu", Hq=8, Hkv=2, lens=LENS, cap=None, window=-1, **kw):
    """A planned RoPE operator over an FP8 cache of format `fmt`, fresh q and FP8 K and V (NHD: normal draws times 8
    rounded to the format, subnormal codes included), and the cache as run() takes it in `layout`."""
    pb = paged(lens, P)
    if device == "cpu":
        kw.setdefault("topology", Topology(24, {1: 48}))   # few CTAs: the long requests split
    attn = meld.DecodeAttention(Hq, Hkv, D, P, dtype, device, kv_dtype=fmt, kv_layout=layout, logits_soft_cap=cap,
                                window_left=window, pos_encoding_mode="ROPE_LLAMA", rope_theta=rope[0],
                                rope_scale=rope[1], **kw)
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    k, v = ((torch.randn(pb.num_pages, P, Hkv, D, device=device) * 8).to(fmt) for _ in range(2))
    q = torch.randn(len(lens), Hq, D, device=device).to(dtype)
    return attn, pb, q, k, v


def _cache(k, v, layout):
    kv = torch.stack([k, v], dim=1)
    return kv if layout == "NHD" else kv.transpose(2, 3).contiguous()


def _reference(attn, pb, q, k, v, cap=None, window=-1):
    """float64 (out, lse natural log) over K = k K_SCALE, V = v V_SCALE (NHD), attn's RoPE."""
    var = attn.variant
    return reference(q.cpu(), k.cpu().double() * K_SCALE, v.cpu().double() * V_SCALE, pb, attn.sm_scale, cap or 0.0,
                     window, (var.rope_theta, var.rope_scale))


def _run(attn, q, cache):
    """out and lse (natural log) of a run whose outputs were NaN-filled first."""
    out = torch.full_like(q, math.nan)
    lse = torch.full(q.shape[:2], math.nan, device=q.device)
    attn.run(q, cache, out=out, lse=lse, k_scale=K_SCALE, v_scale=V_SCALE)
    return out, lse


def _assert_rounded(out, lse, ref, ref_lse):
    """The executor's out is the float64 result rounded once to q's dtype (bf16: 2**-9), lse float32's rounding."""
    torch.testing.assert_close(out.double(), ref, rtol=2 ** -8, atol=1e-9)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-6, atol=1e-6)


# --- the CPU executor ------------------------------------------------------------------------------------------
# (format, layout, page_size, head_dim, q dtype, (rope_theta, rope_scale), logits_soft_cap, window_left)
CPU_CASES = [(E4M3, "NHD", 16, 64, BF16, (1e4, 1.0), None, -1), (E4M3, "HND", 5, 128, F16, (5e5, 8.0), None, -1),
             (E5M2, "NHD", 7, 64, F16, (1e6, 1.0), None, -1), (E5M2, "HND", 1, 128, BF16, (1e4, 2.0), None, -1),
             (E4M3, "NHD", 16, 64, BF16, (1e4, 1.0), 3.0, 37)]


@pytest.mark.parametrize("fmt,layout,P,D,dtype,rope,cap,window", CPU_CASES)
def test_executor_matches_float64(fmt, layout, P, D, dtype, rope, cap, window):
    attn, pb, q, k, v = _case(fmt, layout, P, D, dtype, rope, cap=cap, window=window)
    if window < 0:
        assert (attn.schedule.items()["slot"] >= 0).any(), "the test must exercise split units and merges"
    out, lse = _run(attn, q, _cache(k, v, layout))
    ref, ref_lse = _reference(attn, pb, q, k, v, cap, window)
    _assert_rounded(out, lse, ref, ref_lse)
    unrotated = reference(q, k.double() * K_SCALE, v.double() * V_SCALE, pb, attn.sm_scale, cap or 0.0, window)[0]
    assert ((unrotated - ref).norm() / ref.norm()).item() > 0.1, "the rotation must change the result"


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_nan_and_inf_codes_reach_exactly_their_rows(fmt):
    """A NaN code in K (and e5m2's Inf) makes its request's rows of that kv head NaN in out and lse; a NaN in V,
    those rows' out only; every other row is the reference's."""
    attn, pb, q, k, v = _case(fmt, "NHD", 16, 64, BF16, (1e4, 1.0))
    first = [int(pb.kv_indices[int(pb.kv_indptr[b])]) for b in range(len(LENS))]
    k, v = k.view(torch.uint8).clone(), v.view(torch.uint8).clone()
    k[first[2], 5, 1, 3] = NAN_CODE               # request 2, kv head 1: q heads 4-7
    v[first[4], 9, 0, 60] = NAN_CODE              # request 4, kv head 0: q heads 0-3 (out only)
    if fmt is E5M2:
        k[first[5], 0, 0, 40] = 0x7C             # request 5, kv head 0: +Inf, rotated into Inf and NaN
    k, v = k.view(fmt), v.view(fmt)
    out, lse = _run(attn, q, _cache(k, v, "NHD"))
    bad_k = {(2, h) for h in range(4, 8)} | ({(5, h) for h in range(4)} if fmt is E5M2 else set())
    bad_v = {(4, h) for h in range(4)}
    ref, ref_lse = _reference(attn, pb, q, k, v)
    for b in range(len(LENS)):
        for h in range(8):
            row_nan, lse_nan = out[b, h].isnan().all().item(), lse[b, h].isnan().item()
            assert (row_nan, lse_nan) == ((b, h) in bad_k | bad_v, (b, h) in bad_k), (b, h)
            if not row_nan:
                torch.testing.assert_close(out[b, h].double(), ref[b, h], rtol=2 ** -8, atol=1e-9)


def test_op_and_wrapper_take_rope_over_fp8():
    """The torch op gives the operator's bits; the FlashInfer wrapper (plan(kv_data_type=e4m3,
    pos_encoding_mode="ROPE_LLAMA"), run(k_scale=, v_scale=)) the reference's, lse in base 2."""
    rope = (5e5, 8.0)
    attn, pb, q, k, v = _case(E4M3, "HND", 16, 64, BF16, rope)
    cache = _cache(k, v, "HND")
    out, lse = _run(attn, q, cache)
    op_out, op_lse = torch_ops.decode_attention(attn, q, (cache[:, 0], cache[:, 1]), return_lse=True,
                                                k_scale=K_SCALE, v_scale=V_SCALE)
    assert torch.equal(op_out, out) and torch.equal(op_lse, lse)
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(16, dtype=torch.uint8), "HND")
    w.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len, 8, 2, 64, 16, q_data_type=BF16, kv_data_type=E4M3,
           pos_encoding_mode="ROPE_LLAMA", rope_theta=rope[0], rope_scale=rope[1])
    w_out, w_lse = w.run(q, cache, k_scale=K_SCALE, v_scale=V_SCALE, return_lse=True)
    _assert_rounded(w_out, w_lse / math.log2(math.e), *_reference(attn, pb, q, k, v))


def test_multi_token_rope_stays_refused():
    with pytest.raises(ValueError, match="q_len=2 with pos_encoding_mode='ROPE_LLAMA'"):
        meld.DecodeAttention(8, 2, 64, 16, BF16, "cpu", kv_dtype=E5M2, pos_encoding_mode="ROPE_LLAMA", q_len=2)
    with pytest.raises(ValueError, match="q_len=2: multi-token builds take no xrank, sliding window or RoPE"):
        DecodeKernelConfig(kv_dtype="float8_e4m3fn", variant=DecodeVariant(rope_theta=1e4), q_len=2)


# --- GPU ----------------------------------------------------------------------------------------------------------
GPU_LENS = [37, 0, 250, 1, 1003, 115, 5000, 17, 64]


def _gpu_check(attn, pb, q, k, v, layout, cap=None, window=-1):
    """The kernel against float64, outputs NaN-filled first, two runs bit-identical. Its differences from the
    reference are its own arithmetic: the rotated keys, P and the output rounded to the MMA type, float32 sums (the
    16-bit RoPE build's tolerances, tests/test_decode_variants.py)."""
    cache = _cache(k, v, layout)
    out, lse = _run(attn, q, cache)
    again, again_lse = _run(attn, q, cache)
    ref, ref_lse = _reference(attn, pb, q, k, v, cap, window)
    assert not out.isnan().any() and not lse.isnan().any()
    err = ((out.double().cpu() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, f"relative error {err:.2e}"
    finite = ref_lse.isfinite()
    assert torch.equal(lse.isfinite().cpu(), finite)
    assert (lse.double().cpu() - ref_lse)[finite].abs().max().item() < 2e-2
    assert torch.equal(out, again) and torch.equal(lse, again_lse), "results differ between two identical runs"


def _tma(fmt, dtype, D, rope, **kw):
    """The default build of that operator with TMA rings (as kernel_config=)."""
    build = DecodeKernelConfig.default({BF16: "bfloat16", F16: "float16"}[dtype], D,
                                       kv_dtype=str(fmt).removeprefix("torch."),
                                       variant=DecodeVariant(rope_theta=rope[0], rope_scale=rope[1]), **kw)
    return dict(kernel_config=dataclasses.replace(build, tma=True))


@pytest.mark.gpu
@pytest.mark.usefixtures("fp8_math")
@pytest.mark.parametrize("fmt,dtype,D,layout,P,tma", [
    (E4M3, BF16, 128, "NHD", 16, False), (E4M3, F16, 64, "HND", 5, False), (E4M3, BF16, 256, "HND", 16, True),
    (E5M2, F16, 128, "HND", 16, True), (E5M2, BF16, 64, "NHD", 7, False), (E5M2, F16, 256, "NHD", 1, False)])
def test_gpu_matches_float64(fmt, dtype, D, layout, P, tma):
    rope = (5e5, 8.0) if D == 128 else (1e4, 1.0)
    attn, pb, q, k, v = _case(fmt, layout, P, D, dtype, rope, "cuda", 32, 8, GPU_LENS,
                              **(_tma(fmt, dtype, D, rope, group_size=4) if tma else {}))
    _gpu_check(attn, pb, q, k, v, layout)


@pytest.mark.gpu
@pytest.mark.usefixtures("fp8_math")
@pytest.mark.parametrize("options", ["group-16-cap-window", "batch-invariant"])
def test_gpu_options(options):
    kw = {"group-16-cap-window": dict(Hq=64, Hkv=4, cap=4.0, window=77),
          "batch-invariant": dict(batch_invariant=True)}[options]
    kw.setdefault("Hq", 32)
    kw.setdefault("Hkv", 8)
    attn, pb, q, k, v = _case(E4M3, "NHD", 16, 128, BF16, (1e4, 1.0), "cuda", lens=GPU_LENS, **kw)
    _gpu_check(attn, pb, q, k, v, "NHD", kw.get("cap"), kw.get("window", -1))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F16, BF16])
def test_gpu_e5m2_largest_keys_with_f16(dtype):
    """e5m2 reaches 57344, f16 65504, and a rotated pair's norm sqrt(2) x 57344: keys whose channel pairs are both
    near the top of the range rotate past f16's, which the f16 builds' halved keys must survive (no Inf, no NaN):
    float16 q's, and bf16 q's computing in f16 (fp8_math="f16", their default). (Not on the bf16-math build: it
    keeps 8 bits of q, and over keys this large its lse missed the 2e-2 bar, 2.16e-2 on the H200, 2026-12-03.)"""
    attn, pb, q, k, v = _case(E5M2, "NHD", 16, 128, dtype, (1e4, 1.0), "cuda", 32, 8, GPU_LENS)
    k = k.float()
    big = torch.rand(k.shape[:-1], device="cuda") < 0.25   # a quarter of the keys: every channel pair at the top
    k[big] = torch.where(torch.rand_like(k[big]) < 0.5, -1.0, 1.0) * torch.where(
        torch.rand_like(k[big]) < 0.5, 57344.0, 49152.0)
    k = k.to(E5M2)
    q = (q.float() / 2 ** 12).to(dtype)   # scores of the usual size over keys this large
    _gpu_check(attn, pb, q, k, v, "NHD")


@pytest.mark.gpu
@pytest.mark.usefixtures("fp8_math")
def test_gpu_nan_and_inf_codes_reach_exactly_their_rows():
    attn, pb, q, k, v = _case(E5M2, "HND", 16, 128, BF16, (1e4, 1.0), "cuda", 32, 8, GPU_LENS)
    first = [int(pb.kv_indices[int(pb.kv_indptr[b])]) for b in range(len(GPU_LENS))]
    k, v = k.view(torch.uint8).clone(), v.view(torch.uint8).clone()
    k[first[4], 3, 6, 100] = NAN_CODE    # request 4, kv head 6: q heads 24-27
    k[first[6], 0, 1, 2] = 0x7C          # request 6, kv head 1: q heads 4-7 (+Inf)
    v[first[2], 7, 0, 9] = NAN_CODE      # request 2, kv head 0: q heads 0-3 (out only)
    k, v = k.view(E5M2), v.view(E5M2)
    out, lse = _run(attn, q, _cache(k, v, "HND"))
    bad_k = {(4, h) for h in range(24, 28)} | {(6, h) for h in range(4, 8)}
    bad_v = {(2, h) for h in range(4)}
    out, lse = out.cpu(), lse.cpu()
    for b in range(len(GPU_LENS)):
        for h in range(32):
            want = ((b, h) in bad_k | bad_v, (b, h) in bad_k)
            assert (out[b, h].isnan().all().item(), lse[b, h].isnan().item()) == want, (b, h)
            assert want[0] or not out[b, h].isnan().any()
