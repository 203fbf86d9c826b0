"""FP8 KV decode with bf16 q on f16 tensor cores (issue 41: `DecodeKernelConfig(fp8_math="f16")`, MELD_Q_TO_F16, the
default build's for FP8 caches with bf16 q since 2026-12-03's sixth session): K and
V convert to f16 in one instruction, P is f16, and each q row is scaled by a power of two 2^e into f16's range, the
scores unscaled exactly (templates/decode_attention.cuh's header says how and what it costs in precision).

CPU: the option's validation, name and defines, and the operator taking it as kernel_config (tests/test_codegen.py
compiles its builds for sm_90a without spills; tools/same_code.py shows every other build unchanged). GPU (`gpu`):
the q scaling's edge cases against float64 over the dequantised cache, outputs NaN-filled first: rows of tiny
(~1e-6), huge (~1e30) and bf16-subnormal entries, rows mixing them, zero rows, and NaN and Inf rows, which must make
exactly their rows NaN; on both builds (the `fp8_math` fixture), both formats, cp.async and TMA rings, 8- and
16-head units, head_dim 64, 128 and 512 and q_len 2. The FP8 tests' every float64 check runs the bf16-math builds
too (tests/test_fp8_kv.py, test_e5m2_kv.py, test_rope_fp8.py: `-k math-bf16`)."""
import dataclasses
import math

import pytest
import torch

import meld
from meld.codegen import DecodeKernelConfig
from meld.runtime.reference import attention_reference
from meld.workloads import paged
from tests.test_fp8_kv import K_SCALE, V_SCALE, _fp8, _layout

BF16 = torch.bfloat16
E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"


def test_config():
    """Its own kernel (name and defines: f16 MMAs, bf16 out, q converted), the default build's for FP8 caches with
    bf16 q (not for float16 q, nor a 16-bit cache); FP8 caches with bf16 q only, named."""
    f16 = DecodeKernelConfig.default("bfloat16", 128, kv_dtype=E4M3)
    base = dataclasses.replace(f16, fp8_math="")
    assert f16.fp8_math == "f16" and DecodeKernelConfig.default("bfloat16", 512, kv_dtype=E5M2).fp8_math == "f16"
    assert not DecodeKernelConfig.default("float16", 128, kv_dtype=E4M3).fp8_math
    assert not DecodeKernelConfig.default("bfloat16", 128).fp8_math
    assert f16.name == base.name + "_f16m" and f16.smem_bytes == base.smem_bytes
    src = f16.render()
    for line in ('#define MELD_MMA_TYPE "f16"', '#define MELD_OUT_TYPE "bf16"', "#define MELD_Q_TO_F16 1"):
        assert line in src
    assert "#define MELD_Q_TO_F16 0" in base.render() and '#define MELD_MMA_TYPE "bf16"' in base.render()
    with pytest.raises(ValueError, match=r"fp8_math='bf16': expected '' \(the dtype's MMA type\) or 'f16'"):
        dataclasses.replace(base, fp8_math="bf16")
    for dtype, kv in (("float16", E4M3), ("bfloat16", "")):
        with pytest.raises(ValueError, match=f"fp8_math='f16' with dtype='{dtype}', kv_dtype='{kv}': f16 math is "
                                             "for FP8 caches with bfloat16 q"):
            DecodeKernelConfig(dtype, 128, kv_dtype=kv, fp8_math="f16")


def test_operator_takes_it():
    """DecodeAttention(kernel_config=) keeps the option (the CPU executor computes in float64 either way)."""
    cfg = dataclasses.replace(DecodeKernelConfig.default("bfloat16", 64, kv_dtype=E5M2), fp8_math="f16")
    attn = meld.DecodeAttention(8, 2, 64, 16, BF16, "cpu", kv_dtype=torch.float8_e5m2, kernel_config=cfg)
    assert attn.kernel_config.fp8_math == "f16"


# (format, layout, page size, num_qo_heads, num_kv_heads, head_dim, q_len, TMA rings)
EDGE_CASES = [(E4M3, "NHD", 5, 32, 8, 128, 1, False), (E5M2, "HND", 16, 64, 4, 128, 1, True),
              (E4M3, "NHD", 16, 32, 8, 512, 1, False), (E5M2, "HND", 7, 32, 8, 64, 2, False)]


def _edge_q(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q (bf16, [rows, Hq, D], fresh normal draws) with edge rows written in, and the rows that must come out NaN.
    Rows of request 0: heads 0-5 tiny (1e-6), huge (1e30), bf16-subnormal (1e-39), mixed 1e30 / 1e-6 (the small
    entries flush: 2^-120 of the row's largest), spanning 10^-7 .. 1 (exact in f16 once scaled: within 2^31 of its
    largest), zero; head 6
    one NaN, head 7 one Inf; the other requests' rows: every fourth head tiny or huge, NaN in one."""
    q = q.float()
    D = q.shape[-1]
    scale = torch.tensor([1e-6, 1e30, 1e-39])
    q[0, :3] *= scale[:, None]
    q[0, 3] *= torch.where(torch.arange(D) % 2 == 0, 1e30, 1e-6)
    q[0, 4] *= 10.0 ** -torch.linspace(0, 7, D)
    q[0, 5] = 0
    q[0, 6, 3] = math.nan
    q[0, 7, D - 1] = math.inf
    q[1:, ::4] *= torch.where(torch.arange(q.shape[0] - 1) % 2 == 0, 1e-6, 1e30)[:, None, None]
    q[-1, 9, 0] = math.nan
    nan = torch.zeros(q.shape[:2], dtype=torch.bool)
    nan[0, 6] = nan[0, 7] = nan[-1, 9] = True
    return q.to(BF16), nan


@pytest.mark.gpu
@pytest.mark.usefixtures("fp8_math")
@pytest.mark.parametrize("fmt,layout,P,Hq,Hkv,D,q_len,tma", EDGE_CASES)
def test_gpu_q_scaling_edge_cases(fmt, layout, P, Hq, Hkv, D, q_len, tma):
    """Every row without NaN or Inf as float64 (relative error of its output < 1e-2, lse to 1e-5 relative + 2e-3:
    huge rows' lse is ~1e30); NaN out and lse for exactly the rows holding NaN or Inf; two runs bit-identical."""
    lens = [37, 250, 2, 1003, 115, 5000, 17]   # none a multiple of the tile or the page; 5000 splits
    pb = paged(lens, P)
    dtype = getattr(torch, fmt)
    cfg = dataclasses.replace(DecodeKernelConfig.default("bfloat16", D, group_size=Hq // Hkv, kv_dtype=fmt,
                                                         q_len=q_len), tma=tma)
    attn = meld.DecodeAttention(Hq, Hkv, D, P, BF16, "cuda", kv_dtype=dtype, kv_layout=layout, q_len=q_len,
                                kernel_config=cfg)
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    k, v = (_fp8(pb.num_pages, P, Hkv, D, device="cuda", fmt=dtype) for _ in range(2))
    q, nan = _edge_q(torch.randn(len(lens) * q_len, Hq, D).to(BF16))
    q, nan = q.cuda(), nan.cuda()
    cache = torch.stack([_layout(k, layout), _layout(v, layout)], dim=1)
    runs = []
    for _ in range(2):
        out = torch.full_like(q, math.nan)
        lse = torch.full(q.shape[:2], math.nan, device="cuda")
        attn.run(q, cache, out=out, lse=lse, k_scale=K_SCALE, v_scale=V_SCALE)
        runs.append((out, lse))
    (out, lse), (again, again_lse) = runs
    assert torch.equal(out.isnan().all(-1), nan) and torch.equal(out.isnan().any(-1), nan)
    assert torch.equal(lse.isnan(), nan)
    kv = torch.stack([k.double() * K_SCALE, v.double() * V_SCALE], dim=1)
    ref, ref_lse = attention_reference(q, kv, *(t.cuda() for t in (pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)),
                                       q_len=q_len)
    good = ~nan
    err = (out.double() - ref).norm(dim=-1)[good] / ref.norm(dim=-1)[good]
    assert err.max().item() < 1e-2, f"largest row error {err.max().item():.2e}"
    lse_err = (lse.double() - ref_lse).abs()[good] - 1e-5 * ref_lse.abs()[good]
    assert lse_err.max().item() < 2e-3
    assert torch.equal(out.nan_to_num(), again.nan_to_num()) and torch.equal(lse.nan_to_num(), again_lse.nan_to_num())
