"""FP8 KV caches (issue 41, items 1 and 4): `DecodeAttention(kv_dtype=torch.float8_e4m3fn)` reads e4m3 K and V at one
byte a value with FlashInfer's per-tensor scales (`run(..., k_scale=, v_scale=)`: K = cache x k_scale, V = cache x
v_scale), through the operator, the torch op and the FlashInfer wrapper (plan(kv_data_type=torch.float8_e4m3fn)).

The reference is float64 attention over the dequantised cache, computed independently of meld's executor; the
kernel and the executor apply the scales where the template says (k_scale on the scores, v_scale on the output),
so each is compared with it as tightly as its own arithmetic allows, never as loosely as e4m3 quantisation would.
CPU: the executor and the operator on fresh random e4m3 data (both layouts, page sizes off the tile, K and V apart),
every e4m3 code through K and V, NaN codes, the op (opcheck, torch.compile, fake), the wrapper, and bad inputs
named. GPU (`gpu`): the kernel (cp.async and TMA rings, head_dim 64/128/256, both MMA types) against the same
references, every code bit for bit, against FlashInfer's FP8 decode, and replayed from a CUDA graph. The helpers
take the FP8 format (`fmt`): tests/test_e5m2_kv.py runs e5m2 caches through them."""
import dataclasses
import math

import pytest
import torch

import meld
from meld.codegen import DecodeKernelConfig
from meld.compat.flashinfer import BatchDecodeWithPagedKVCacheWrapper
from meld.ops import torch_ops
from meld.runtime.reference import attention_reference, execute_decode
from meld.scheduler import Topology
from meld.workloads import paged

FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16
LENS = [37, 0, 250, 1, 1003, 115]   # no length a multiple of the 16-token tile or of the page
K_SCALE, V_SCALE = 0.37, 2.5        # per-tensor scales as calibration gives them (not powers of two)
# Every finite code of each FP8 format: e4m3fn's all but NaN (it has no Inf), e5m2's all but Inf and NaN.
FINITE_CODES = {FP8: [c for c in range(256) if c & 0x7F != 0x7F],
                torch.float8_e5m2: [c for c in range(256) if c & 0x7F < 0x7C]}


def _fp8(*shape, device="cpu", fmt=FP8) -> torch.Tensor:
    """Fresh random values of FP8 format `fmt`: normal draws times 8 rounded to it, so normal and subnormal codes
    alike."""
    return (torch.randn(*shape, device=device) * 8).to(fmt)


def _layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A K or V cache given NHD [pages, page_size, Hkv, D], contiguous in `layout`."""
    return t if layout == "NHD" else t.transpose(1, 2).contiguous()


def _reference(q, k, v, pb, k_scale=K_SCALE, v_scale=V_SCALE, sm_scale=None):
    """float64 attention over the values an NHD e4m3 cache stands for (K = k k_scale, V = v v_scale)."""
    kv = torch.stack([k.double() * k_scale, v.double() * v_scale], dim=1)
    return attention_reference(q, kv, *(t.to(q.device) for t in (pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)),
                               sm_scale)


def _assert_rounded(out, lse, ref, ref_lse):
    """out is the float64 result rounded once to q's dtype (half an ulp: 2**-9 of bf16), lse float32's rounding."""
    torch.testing.assert_close(out.double(), ref, rtol=2 ** -8, atol=1e-30)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-6, atol=1e-6)


def _op(layout="NHD", P=16, lens=LENS, Hq=8, Hkv=2, D=64, dtype=BF16, device="cpu", fmt=FP8, **kw):
    """A planned operator over an FP8 cache of format `fmt`, and fresh q, K and V (NHD) for it."""
    pb = paged(lens, P)
    if device == "cpu":
        kw.setdefault("topology", Topology(24, {1: 48}))
    attn = meld.DecodeAttention(Hq, Hkv, D, P, dtype, device, kv_dtype=fmt, kv_layout=layout, **kw)
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    k, v = (_fp8(pb.num_pages, P, Hkv, D, device=device, fmt=fmt) for _ in range(2))
    return attn, pb, torch.randn(len(lens), Hq, D, device=device).to(dtype), k, v


# --- the CPU executor ------------------------------------------------------------------------------------------
def test_executor_dequantises_where_the_kernel_does():
    """execute_decode on e4m3 K and V: the exact float64 result of the dequantised cache; the same run with the
    scales swapped (each applied where the other belongs) is far from it, so the comparison tells them apart."""
    attn, pb, q, k, v = _op()
    ref, ref_lse = _reference(q, k, v, pb)
    out, lse = execute_decode(attn.schedule, q, k, v, pb.kv_indices, attn.sm_scale, k_scale=K_SCALE, v_scale=V_SCALE)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-12
    finite = ref_lse.isfinite()
    assert torch.equal(lse.isfinite(), finite) and (lse - ref_lse)[finite].abs().max().item() < 1e-12
    assert (attn.schedule.items()["slot"] >= 0).any(), "the test must exercise split units and merges"
    swapped, swapped_lse = execute_decode(attn.schedule, q, k, v, pb.kv_indices, attn.sm_scale, k_scale=V_SCALE,
                                          v_scale=K_SCALE)
    assert ((swapped - ref).norm() / ref.norm()).item() > 0.5
    assert (swapped_lse - ref_lse)[finite].abs().max().item() > 1.0


# --- the operator ------------------------------------------------------------------------------------------------
def _forms(form, k, v, layout):
    """(what run() takes, the same K and V in one contiguous cache) for NHD e4m3 k, v in `layout`."""
    lk, lv = _layout(k, layout), _layout(v, layout)
    one = torch.stack([lk, lv], dim=1)
    if form == "one-cache":
        return one, one
    if form == "two-allocations":
        return (lk.clone(), lv.clone()), one
    if form == "halves":
        return (one[:, 0], one[:, 1]), one
    other = "HND" if layout == "NHD" else "NHD"   # the layout asked for as a transposed view of the other
    return tuple(_layout(t, other).transpose(1, 2) for t in (k, v)), one


@pytest.mark.parametrize("form", ["one-cache", "two-allocations", "halves", "other-layout-views"])
@pytest.mark.parametrize("layout,P", [("NHD", 16), ("HND", 16), ("NHD", 5), ("HND", 7), ("NHD", 1)])
def test_operator_matches_float64(form, layout, P):
    attn, pb, q, k, v = _op(layout, P)
    cache, one = _forms(form, k, v, layout)
    out = torch.full_like(q, math.nan)
    _, lse = attn.run(q, cache, out=out, return_lse=True, k_scale=K_SCALE, v_scale=V_SCALE)
    _assert_rounded(out, lse, *_reference(q, k, v, pb))
    want, want_lse = attn.run(q, one, return_lse=True, k_scale=K_SCALE, v_scale=V_SCALE)
    assert torch.equal(out, want) and torch.equal(lse, want_lse), "the same K and V read from elsewhere"


def _every_code_case(dtype=BF16, device="cpu", fmt=FP8, **kw):
    """Every finite code of `fmt` through K and V: two one-token requests whose K and V rows (Hkv = 1, D = 128)
    hold its finite codes (e4m3: 254, e5m2: 248; the rest zeros of both signs) in random order, q head h the
    one-hot row of channel h, sm_scale 1. Softmax over one token is 1, so out[b, h] = v_scale V[b] and lse[b, h] = k_scale K[b, h], each exact in float64;
    with v_scale a power of two, out is exact in bf16 and fp16 too. The rest of each page is random bytes,
    NaN (and Inf) codes included, which a kernel must neither read nor let through."""
    finite = FINITE_CODES[fmt]
    codes = torch.tensor(finite + [0x00, 0x80] * ((256 - len(finite)) // 2), dtype=torch.uint8)[torch.randperm(256)]
    pb = paged([1, 1], 16)
    cache = torch.randint(0, 256, (pb.num_pages, 2, 16, 1, 128), dtype=torch.uint8)
    for b in range(2):
        page = int(pb.kv_indices[int(pb.kv_indptr[b])])
        cache[page, :, 0, 0] = codes[128 * b:128 * (b + 1)]
    cache = cache.view(fmt).to(device)
    attn = meld.DecodeAttention(128, 1, 128, 16, dtype, device, kv_dtype=fmt, sm_scale=1.0, **kw)
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    q = torch.eye(128, dtype=dtype, device=device).expand(2, 128, 128)
    k_scale, v_scale = 0.3, 0.5
    rows = torch.stack([cache[int(pb.kv_indices[int(pb.kv_indptr[b])]), :, 0, 0] for b in range(2)]).double()
    want = (rows[:, 1] * v_scale)[:, None, :].expand(2, 128, 128)
    want_lse = rows[:, 0] * k_scale
    out, lse = attn.run(q, cache, return_lse=True, k_scale=k_scale, v_scale=v_scale)
    return out, lse, want, want_lse


def test_every_code_on_the_executor():
    out, lse, want, want_lse = _every_code_case()
    assert torch.equal(out.double(), want)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-30)


# Non-finite codes written into K ("k") or V ("v"): (cache, request, token, kv head, code). e4m3fn has NaN only;
# e5m2 has Inf too, of either sign.
NON_FINITE = {FP8: (("k", 1, 100, 0, 0x7F), ("v", 2, 700, 1, 0xFF)),
              torch.float8_e5m2: (("k", 1, 100, 0, 0x7E), ("v", 2, 700, 1, 0x7C), ("k", 0, 20, 1, 0xFC),
                                  ("v", 1, 249, 1, 0xFF))}


def _nan_case(device="cpu", fmt=FP8, **kw):
    """NON_FINITE[fmt]'s codes in K and V (requests of 37, 250 and 1003 tokens, 4 q heads per kv head): NaN out
    and lse for exactly the q heads of a kv head with one in K, NaN out and finite lse for those with one in V
    only (the template's IEEE rules); the rest as float64."""
    attn, pb, q, k, v = _op(lens=[37, 250, 1003], device=device, fmt=fmt, **kw)
    nan_out = torch.zeros(3, 8, dtype=torch.bool, device=device)
    nan_lse = torch.zeros_like(nan_out)
    for which, b, pos, h, code in NON_FINITE[fmt]:
        page = int(pb.kv_indices[int(pb.kv_indptr[b]) + pos // 16])
        (k if which == "k" else v).view(torch.uint8)[page, pos % 16, h, 5] = code
        nan_out[b, 4 * h:4 * h + 4] = True
        if which == "k":
            nan_lse[b, 4 * h:4 * h + 4] = True
    out, lse = attn.run(q, (k, v), return_lse=True, k_scale=K_SCALE, v_scale=V_SCALE)
    ref, ref_lse = _reference(q, k, v, pb)
    assert torch.equal(out.isnan().all(-1), nan_out) and torch.equal(out.isnan().any(-1), nan_out)
    assert torch.equal(lse.isnan(), nan_lse)
    return out, lse, ref, ref_lse, nan_out, nan_lse


def test_nan_codes_on_the_executor():
    out, lse, ref, ref_lse, nan_out, nan_lse = _nan_case()
    _assert_rounded(out[~nan_out], lse[~nan_lse], ref[~nan_out], ref_lse[~nan_lse])


# --- the op and torch.compile ----------------------------------------------------------------------------------
# opcheck's test_schema compares every input before and after the op with torch.allclose, which torch 2.13 has no
# float8 kernel for: the other checks run, and the cache's bytes are compared here instead.
OPCHECK_UTILS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _opcheck(attn, q, cache, lse, v_cache):
    before = [t.view(torch.uint8).clone() for t in (cache, v_cache) if t is not None]
    torch.library.opcheck(torch.ops.meld.decode_attention.default,
                          (q, cache, torch.empty_like(q), lse, attn.handle, v_cache, K_SCALE, V_SCALE),
                          test_utils=OPCHECK_UTILS)
    after = [t.view(torch.uint8) for t in (cache, v_cache) if t is not None]
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "the op wrote its cache"


@pytest.mark.parametrize("layout,with_lse,apart", [("NHD", True, False), ("HND", False, True)])
def test_opcheck(layout, with_lse, apart):
    attn, pb, q, k, v = _op(layout)
    k, v = _layout(k, layout), _layout(v, layout)
    cache, v_cache = (k, v) if apart else (torch.stack([k, v], dim=1), None)
    _opcheck(attn, q, cache, torch.empty(len(LENS), 8) if with_lse else None, v_cache)


def test_op_and_compiled_model_take_the_scales():
    attn, pb, q, k, v = _op()
    want, want_lse = attn.run(q, (k, v), return_lse=True, k_scale=K_SCALE, v_scale=V_SCALE)
    out, lse = torch_ops.decode_attention(attn, q, (k, v), return_lse=True, k_scale=K_SCALE, v_scale=V_SCALE)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    buf = torch.empty_like(q)
    torch.ops.meld.decode_attention(q, k, buf, None, attn.handle, v, K_SCALE, V_SCALE)
    assert torch.equal(buf, want)
    step = torch.compile(lambda q, k, v: attn.run(q, (k, v), k_scale=K_SCALE, v_scale=V_SCALE) * 2, fullgraph=True,
                         backend="aot_eager")
    assert torch.equal(step(q, k, v), want * 2)
    with pytest.raises(ValueError, match="v_scale must be positive"):
        torch_ops.decode_attention(attn, q, (k, v), v_scale=0.0)


def test_fake_implementation_checks_the_cache_dtype_and_scales():
    from torch._subclasses.fake_tensor import FakeTensorMode

    attn, pb, q, k, v = _op()
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        q, k, v = (mode.from_tensor(t) for t in (q, k, v))
        torch.ops.meld.decode_attention(q, k, torch.empty_like(q), None, attn.handle, v, K_SCALE, V_SCALE)
        with pytest.raises(ValueError, match="v_cache must have dtype torch.float8_e4m3fn, got torch.bfloat16"):
            torch.ops.meld.decode_attention(q, k, torch.empty_like(q), None, attn.handle, v.to(BF16))
        with pytest.raises(ValueError, match="k_scale must be a finite number, got inf"):
            torch.ops.meld.decode_attention(q, k, torch.empty_like(q), None, attn.handle, v, math.inf)


# --- the FlashInfer wrapper -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("P,apart", [(16, False), (16, True), (1, True)])
def test_wrapper_takes_fp8_plans_and_scales(layout, P, apart):
    """plan(kv_data_type=torch.float8_e4m3fn) and run(k_scale=, v_scale=) as FlashInfer takes them (lse base 2;
    page_size 1 as FlashInfer's 3-D parts); scales left None are 1."""
    pb = paged(LENS, P)
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(16, dtype=torch.uint8), layout)
    w.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len, 8, 2, 64, P, q_data_type=BF16, kv_data_type=FP8)
    assert w._op.kv_dtype is FP8
    k, v = (_fp8(pb.num_pages, P, 2, 64) for _ in range(2))
    lk, lv = _layout(k, layout), _layout(v, layout)
    if apart:
        cache = (lk.squeeze(-3 if layout == "NHD" else -2), lv.squeeze(-3 if layout == "NHD" else -2)) if P == 1 \
            else (lk, lv)
    else:
        cache = torch.stack([lk, lv], dim=1)
    q = torch.randn(len(LENS), 8, 64).to(BF16)
    out, lse = w.run(q, cache, k_scale=K_SCALE, v_scale=V_SCALE, return_lse=True)
    _assert_rounded(out, lse / math.log2(math.e), *_reference(q, k, v, pb))
    assert torch.equal(w.run(q, cache), w.run(q, cache, k_scale=1.0, v_scale=None))
    with pytest.raises(NotImplementedError, match="q_scale=2.0 is not supported"):
        w.run(q, cache, q_scale=2.0)
    with pytest.raises(ValueError, match="paged_kv_cache must have dtype torch.float8_e4m3fn, got torch.bfloat16"):
        w.run(q, torch.stack([lk, lv], dim=1).to(BF16))


# --- bad inputs --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,match", [
    (dict(kv_dtype=torch.float8_e4m3fnuz), r"kv_dtype must be None \(the dtype, torch.bfloat16\) or an FP8 type "
                                           r"\(torch.float8_e4m3fn or torch.float8_e5m2\), got torch.float8_e4m3fnuz"),
    (dict(kv_dtype=torch.float16), "kv_dtype must be None"),
    (dict(kv_dtype="float8_e4m3fn"), "kv_dtype must be None"),
    (dict(kernel_config=DecodeKernelConfig.default("bfloat16", 64)), "kernel_config is for bfloat16, .*kv_dtype=''; "
                                                                     "the operator is .*kv_dtype='float8_e4m3fn'"),
])
def test_constructor_errors(kwargs, match):
    args = dict(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16, dtype=BF16, device="cpu", kv_dtype=FP8)
    with pytest.raises(ValueError, match=match):
        meld.DecodeAttention(**{**args, **kwargs})


BAD_RUNS = {
    "bf16-cache": (dict(cache="bf16"), "kv_cache must have dtype torch.float8_e4m3fn, got torch.bfloat16"),
    "k-zero": (dict(k_scale=0.0), r"k_scale must be positive \(a dequantisation scale\), got 0.0"),
    "v-negative": (dict(v_scale=-1.0), "v_scale must be positive"),
    "k-nan": (dict(k_scale=math.nan), "k_scale must be a finite number, got nan"),
    "v-inf": (dict(v_scale=math.inf), "v_scale must be a finite number"),
    "k-bool": (dict(k_scale=True), "k_scale must be a finite number, got True"),
    "v-string": (dict(v_scale="2"), "v_scale must be a finite number, got '2'"),
    "k-tensor": (dict(k_scale=torch.tensor(0.5)), "k_scale must be a finite number, got tensor"),
    "v-float32-overflow": (dict(v_scale=1e39), "v_scale must have a magnitude below 3.40282e\\+38"),
    "k-float32-overflow": (dict(k_scale=1e40), "k_scale must have a magnitude below 1.88"),   # sm_scale 1/8: 1.88e39
}


@pytest.mark.parametrize("case", list(BAD_RUNS))
def test_bad_runs_are_named_and_change_nothing(case):
    attn, pb, q, k, v = _op()
    kv = torch.stack([k, v], dim=1)
    kwargs, match = BAD_RUNS[case]
    kwargs = dict(kwargs)
    cache = kv.to(BF16) if kwargs.pop("cache", None) else kv
    out = torch.zeros_like(q)
    with pytest.raises(ValueError, match=match):
        attn.run(q, cache, out=out, **kwargs)
    assert not out.any(), "a run() that raises must not write out="


def test_a_16_bit_cache_takes_no_scales():
    attn = meld.DecodeAttention(8, 2, 64, 16, BF16, "cpu")
    pb = paged([40], 16)
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    q, kv = torch.randn(1, 8, 64).to(BF16), torch.randn(pb.num_pages, 2, 16, 2, 64).to(BF16)
    assert torch.equal(attn.run(q, kv, k_scale=1, v_scale=1.0), attn.run(q, kv))
    with pytest.raises(ValueError, match=r"k_scale=0.5 and v_scale=1.0: the scales dequantise an FP8 cache \(kv_dtype "
                                         r"torch.float8_e4m3fn or torch.float8_e5m2\), but this operator reads a "
                                         r"torch.bfloat16 cache"):
        attn.run(q, kv, k_scale=0.5)
    with pytest.raises(ValueError, match="kv_cache must have dtype torch.bfloat16, got torch.float8_e4m3fn"):
        attn.run(q, kv.to(FP8))


# --- GPU --------------------------------------------------------------------------------------------------------
def _tma(dtype="bfloat16", head_dim=128, kv_dtype="float8_e4m3fn", **kw):
    return dataclasses.replace(DecodeKernelConfig.default(dtype, head_dim, kv_dtype=kv_dtype), tma=True, **kw)


def _gpu_check(lens, layout="NHD", P=16, Hq=32, Hkv=8, D=128, dtype=BF16, **op):
    """The kernel against float64 over the dequantised cache, outputs poisoned first. Its differences from that
    reference are its own arithmetic, as the 16-bit kernel's are: P rounded to the MMA type and the output to q's
    dtype (about 2**-9 each, so ~1e-3 relative in norm), float32 accumulation; e4m3 quantisation (~3e-2 here)
    is not among them. Two runs bit-identical."""
    attn, pb, q, k, v = _op(layout, P, lens, Hq, Hkv, D, dtype, "cuda", **op)
    cache = torch.stack([_layout(k, layout), _layout(v, layout)], dim=1)
    out = torch.full_like(q, math.nan)
    lse = torch.full(q.shape[:2], math.nan, device="cuda")
    attn.run(q, cache, out=out, lse=lse, k_scale=K_SCALE, v_scale=V_SCALE)
    again, again_lse = attn.run(q, cache, return_lse=True, k_scale=K_SCALE, v_scale=V_SCALE)
    ref, ref_lse = _reference(q, k, v, pb)
    assert not out.isnan().any() and not lse.isnan().any()
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < 5e-3, f"relative error {err:.2e}"
    finite = ref_lse.isfinite()
    assert torch.equal(lse.isfinite(), finite) and (lse.double() - ref_lse)[finite].abs().max().item() < 2e-3
    assert torch.equal(out, again) and torch.equal(lse, again_lse), "results differ between two identical runs"
    assert (out[torch.tensor([n == 0 for n in lens], device="cuda")] == 0).all()
    return attn


GPU_LENS = [37, 0, 250, 1, 1003, 115, 5000, 17, 64]


@pytest.mark.gpu
@pytest.mark.usefixtures("fp8_math")
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("P", [1, 5, 16, 64])
@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_gpu_matches_float64(D, layout, P, dtype):
    _gpu_check(GPU_LENS, layout, P, D=D, dtype=dtype)


@pytest.mark.gpu
@pytest.mark.usefixtures("fp8_math")
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("layout,P", [("NHD", 16), ("HND", 16), ("NHD", 64)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gpu_tma_rings(D, layout, P, dtype):
    _gpu_check(GPU_LENS, layout, P, D=D, dtype=getattr(torch, dtype), kernel_config=_tma(dtype, D))


@pytest.mark.gpu
@pytest.mark.usefixtures("fp8_math")
@pytest.mark.parametrize("options", ["group-16", "group-1", "clusters", "batch-invariant", "tma-clusters-h16"])
def test_gpu_options(options):
    lens = GPU_LENS + [20000, 3]
    if options == "group-16":
        assert _gpu_check(lens, Hq=128).heads_per_unit == 16
    elif options == "group-1":
        _gpu_check(lens, Hq=8)
    elif options == "clusters":
        _gpu_check(lens, cluster_size=4)
    elif options == "batch-invariant":
        _gpu_check(lens, batch_invariant=True)
    else:
        cfg = dataclasses.replace(DecodeKernelConfig.default("bfloat16", 128, onchip_merge=True, group_size=16,
                                                             kv_dtype="float8_e4m3fn"), tma=True)
        _gpu_check(lens, Hq=128, cluster_size=4, kernel_config=cfg)


@pytest.mark.gpu
@pytest.mark.usefixtures("fp8_math")
@pytest.mark.parametrize("dtype", [BF16, torch.float16])
@pytest.mark.parametrize("tma", [False, True], ids=["cp.async", "tma"])
def test_gpu_every_code(dtype, tma):
    """Every e4m3 code through the kernel's K and V paths: out bit for bit, lse to float32's rounding (this pins
    the fragment mapping: each channel of K reaches its own q head, each channel of V its own output column)."""
    kw = dict(kernel_config=_tma("bfloat16" if dtype is BF16 else "float16", 128, heads_per_unit=16)) if tma else {}
    out, lse, want, want_lse = _every_code_case(dtype, "cuda", **kw)
    assert torch.equal(out.double(), want)
    # (atol: lg2.approx of the one token's l = 1; still far below the 6e-4 between the closest codes' scores)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.usefixtures("fp8_math")
@pytest.mark.parametrize("tma", [False, True], ids=["cp.async", "tma"])
def test_gpu_nan_codes(tma):
    kw = dict(kernel_config=_tma(head_dim=64)) if tma else {}
    out, lse, ref, ref_lse, nan_out, nan_lse = _nan_case("cuda", **kw)
    err = ((out[~nan_out].double() - ref[~nan_out]).norm() / ref[~nan_out].norm()).item()
    assert err < 5e-3 and (lse[~nan_lse].double() - ref_lse[~nan_lse]).abs().max().item() < 2e-3


@pytest.mark.gpu
@pytest.mark.usefixtures("fp8_math")
@pytest.mark.parametrize("form", ["two-allocations", "halves", "other-layout-views"])
@pytest.mark.parametrize("tma", [False, True], ids=["cp.async", "tma"])
def test_gpu_k_and_v_apart_bit_for_bit(form, tma):
    attn, pb, q, k, v = _op("HND", 16, GPU_LENS, 32, 8, 128, BF16, "cuda", kernel_config=_tma() if tma else None)
    cache, one = _forms(form, k, v, "HND")
    want = attn.run(q, one, k_scale=K_SCALE, v_scale=V_SCALE)
    assert torch.equal(attn.run(q, cache, k_scale=K_SCALE, v_scale=V_SCALE), want)


@pytest.mark.gpu
@pytest.mark.usefixtures("fp8_math")
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("tensor_cores", [False, True])
def test_gpu_against_flashinfer(layout, tensor_cores):
    """FlashInfer 0.6.18's FP8 decode on the same cache and scales: both close to float64 over the dequantised
    cache, and to each other (FlashInfer rounds its output before `out *= v_scale`, meld after: one rounding
    apart)."""
    flashinfer = pytest.importorskip("flashinfer", reason="flashinfer is not installed: the comparison needs its "
                                                           "FP8 decode (bench/decode.py's peer wheels)")
    pb = paged(GPU_LENS, 16)
    k, v = (_fp8(pb.num_pages, 16, 8, 128, device="cuda") for _ in range(2))
    cache = torch.stack([_layout(k, layout), _layout(v, layout)], dim=1)
    q = torch.randn(len(GPU_LENS), 32, 128, device="cuda").to(BF16)
    outs = []
    for w in (BatchDecodeWithPagedKVCacheWrapper(torch.empty(1, dtype=torch.uint8, device="cuda"), layout),
              flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"),
                                                            layout, use_tensor_cores=tensor_cores)):
        w.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len, 32, 8, 128, 16, q_data_type=BF16, kv_data_type=FP8)
        outs.append(w.run(q, cache, k_scale=K_SCALE, v_scale=V_SCALE, return_lse=True))
    ref, ref_lse = _reference(q, k, v, pb)
    (meld_out, meld_lse), (fi_out, fi_lse) = outs
    for out in (meld_out, fi_out):
        assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2
    assert ((meld_out.double() - fi_out.double()).norm() / fi_out.double().norm()).item() < 1e-2
    finite = ref_lse.isfinite()
    assert (meld_lse.double() - fi_lse.double())[finite].abs().max().item() < 5e-3


@pytest.mark.gpu
@pytest.mark.usefixtures("fp8_math")
@pytest.mark.parametrize("tma", [False, True], ids=["cp.async", "tma"])
def test_gpu_cuda_graph_replay_across_replans(tma):
    """Plan once per batch, every layer's FP8 run() (its own cache and scales) captured in one graph, replayed
    after re-plans: each replay uses the scales captured with its layer."""
    from meld.workloads import lengths

    Hq, Hkv, D, P, B, layers = 32, 8, 128, 16, 16, 3
    plans = [paged(lengths("skewed", B), P), paged([n + 5 for n in lengths("ragged", B)], P)]
    num_pages = max(p.num_pages for p in plans)
    caches = [tuple(_fp8(num_pages, P, Hkv, D, device="cuda") for _ in range(2)) for _ in range(layers)]
    scales = [(0.5 + layer, 2.0 / (layer + 1)) for layer in range(layers)]
    qs = [torch.randn(B, Hq, D, device="cuda").to(BF16) for _ in range(layers)]
    outs = [torch.empty(B, Hq, D, dtype=BF16, device="cuda") for _ in range(layers)]
    attn = meld.DecodeAttention(Hq, Hkv, D, P, BF16, "cuda", kv_dtype=FP8, max_batch_size=B,
                                max_num_pages=max(p.kv_indices.numel() for p in plans),
                                kernel_config=_tma() if tma else None)
    attn.plan(plans[0].kv_indptr, plans[0].kv_indices, plans[0].kv_last_page_len)

    def step():
        for q, kv, (ks, vs), out in zip(qs, caches, scales, outs):
            attn.run(q, kv, out=out, k_scale=ks, v_scale=vs)

    from meld.runtime.cuda_graphs import capture

    g, _ = capture(step)
    for p in plans:
        attn.plan(p.kv_indptr, p.kv_indices, p.kv_last_page_len)
        for out in outs:
            out.fill_(math.nan)
        g.replay()
        torch.cuda.synchronize()
        for q, (k, v), (ks, vs), out in zip(qs, caches, scales, outs):
            ref, _ = _reference(q, k, v, p, ks, vs)
            assert not out.isnan().any() and ((out.double() - ref).norm() / ref.norm()).item() < 5e-3


@pytest.mark.gpu
def test_gpu_opcheck():
    attn, pb, q, k, v = _op("HND", 16, GPU_LENS, 32, 8, 128, BF16, "cuda", max_batch_size=16, max_num_pages=4096)
    _opcheck(attn, q, _layout(k, "HND"), torch.empty(q.shape[:2], device="cuda"), _layout(v, "HND"))


def test_decode_sweep_fp8_variants_are_distinct_builds_that_fit_and_compile():
    """bench/decode_sweep.py --kv-dtype fp8: the default FP8 build first (the one DecodeAttention builds), then distinct
    ones the operator takes, each within a CTA's shared memory and compiled for sm_90a without spills (so the GPU
    sweep spends its time timing, not failing)."""
    import shutil

    from bench.decode_sweep import fp8_configs
    from meld.codegen.compiler import compile_nvcc

    from bench.decode_sweep import FP8_COSTS
    from meld.scheduler import DecodeCost

    cfgs = fp8_configs()
    assert list(cfgs)[0] == "default" and cfgs["default"].kv_dtype == "float8_e4m3fn"
    assert len({c.name for c in cfgs.values()}) == len(cfgs)
    for cfg in cfgs.values():
        meld.DecodeAttention(32, 8, 128, 16, BF16, "cpu", kv_dtype=FP8, kernel_config=cfg)
    costs = [dataclasses.replace(DecodeCost(), **f) for f in FP8_COSTS.values()]   # (the cost variants' models)
    assert len({*costs, DecodeCost()}) == len(costs) + 1
    for cost in costs:
        meld.DecodeAttention(32, 8, 128, 16, BF16, "cpu", kv_dtype=FP8, kernel_config=cfgs["default"], cost=cost)
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH")
    for name in ("w8 s5", "w12 s3"):   # the deepest ring and the most warps
        cubin, log = compile_nvcc(cfgs[name].render(), cfgs[name].name, "sm_90a")
        assert cubin[:4] == b"\x7fELF" and "0 bytes spill stores" in log and "0 bytes stack frame" in log, log
