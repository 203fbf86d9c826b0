"""How much accuracy FP8 tensor cores would cost decode attention over an e4m3 KV cache (CPU only).

    python tools/fp8_mma_error.py

The cache is e4m3 with a per-tensor scale (amax / 448, as bench/decode.py draws it); the reference is float64
attention over the dequantised cache. Against it, the relative error (||out - ref|| / ||ref||, the worst of a few
fresh draws) of: q in bf16 with f16/bf16 math (what meld's kernels do); q quantised to e4m3 with a scale per head
(the scores as e4m3 MMAs); q as two e4m3 terms of one scale, hi = e4m3(q) and lo = e4m3(q - hi) (the scores as two
e4m3 MMAs into one accumulator, at the tensor time of one bf16 MMA: FP8 runs K = 32 where bf16 runs 16); and for
MLA also P alone in e4m3 (the P.V as an e4m3 MMA, q in bf16) and P as two terms, with exact sums and with the sums
kept to 14 bits of mantissa after every 32-wide K step (DeepSeek-V3's report: Hopper's FP8 MMAs accumulate with about
14 bits; `chunked`). Issue 41's bar is 2e-2. GQA: 4 q heads a kv head, head_dim 128. MLA: 128 heads, the 576-wide
latent (V its first 512 channels), softmax scale 1/sqrt(192).
"""
from __future__ import annotations

import math

import torch


def e4m3(x: torch.Tensor, scale) -> torch.Tensor:
    """x rounded to e4m3 codes of `scale` and back (float64)."""
    return (x / scale).to(torch.float8_e4m3fn).double() * scale


def two_terms(x: torch.Tensor, scale) -> torch.Tensor:
    """x as hi + lo, both e4m3 codes of `scale` (hi = x rounded, lo = the remainder rounded): what two e4m3 MMAs
    into one accumulator see. The remainder is about 1/16 of x, still in e4m3's normal range for one scale."""
    hi = e4m3(x, scale)
    return hi + e4m3(x - hi, scale)


def chunked(a: torch.Tensor, b: torch.Tensor, bits: int, k: int = 32) -> torch.Tensor:
    """a @ b summed k at a time into an accumulator truncated to `bits` bits of mantissa after each step."""
    acc = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float64)
    for k0 in range(0, a.shape[1], k):
        m, e = torch.frexp(acc + a[:, k0:k0 + k] @ b[k0:k0 + k])
        acc = torch.ldexp(torch.trunc(m * 2 ** bits) / 2 ** bits, e)
    return acc


def rel(o: torch.Tensor, ref: torch.Tensor) -> float:
    return ((o - ref).norm() / ref.norm()).item()


def gqa(L: int, heads: int = 4, D: int = 128, draws: int = 20) -> dict[str, float]:
    worst: dict[str, float] = {}
    for _ in range(draws):
        q, k, v = (torch.randn(n, D, dtype=torch.float64) for n in (heads, L, L))
        k8, v8 = e4m3(k, k.abs().max() / 448), e4m3(v, v.abs().max() / 448)
        sm = 1 / math.sqrt(D)
        ref = torch.softmax(q @ k8.T * sm, -1) @ v8
        qb = q.to(torch.bfloat16).double()
        now = torch.softmax(qb.half().double() @ k8.T * sm, -1).half().double() @ v8
        scale = qb.abs().amax(-1, keepdim=True) / 448
        fp8_q = torch.softmax(e4m3(qb, scale) @ k8.T * sm, -1).half().double() @ v8
        two_q = torch.softmax(two_terms(qb, scale) @ k8.T * sm, -1).half().double() @ v8
        for name, o in (("bf16 q", now), ("e4m3 q", fp8_q), ("e4m3 q hi+lo", two_q)):
            worst[name] = max(worst.get(name, 0.0), rel(o, ref))
    return worst


def mla(L: int, heads: int = 128, D: int = 576, DV: int = 512, draws: int = 6) -> dict[str, float]:
    worst: dict[str, float] = {}
    for _ in range(draws):
        q, kv = torch.randn(heads, D, dtype=torch.float64), torch.randn(L, D, dtype=torch.float64)
        kv8 = e4m3(kv, kv.abs().max() / 448)
        sm = 1 / math.sqrt(192)
        ref = torch.softmax(q @ kv8.T * sm, -1) @ kv8[:, :DV]
        qb = q.to(torch.bfloat16).double()
        p = torch.softmax(qb @ kv8.T * sm, -1)
        scale, p_scale = qb.abs().amax(-1, keepdim=True) / 448, p.amax(-1, keepdim=True) / 448
        q2 = two_terms(qb, scale)
        p2 = torch.softmax(q2 @ kv8.T * sm, -1)
        outs = {"bf16 q": p.to(torch.bfloat16).double() @ kv8[:, :DV],
                "e4m3 q": torch.softmax(e4m3(qb, scale) @ kv8.T * sm, -1).to(torch.bfloat16).double() @ kv8[:, :DV],
                "e4m3 P only": e4m3(p, p_scale) @ kv8[:, :DV],
                "e4m3 q hi+lo": p2.to(torch.bfloat16).double() @ kv8[:, :DV],
                "e4m3 q and P hi+lo": two_terms(p2, p2.amax(-1, keepdim=True) / 448) @ kv8[:, :DV]}
        p14 = torch.softmax(chunked(q2, kv8.T, 14) * sm, -1)
        outs["e4m3 q and P hi+lo, 14-bit sums"] = chunked(two_terms(p14, p14.amax(-1, keepdim=True) / 448), kv8[:, :DV], 14)
        for name, o in outs.items():
            worst[name] = max(worst.get(name, 0.0), rel(o, ref))
    return worst


def main() -> int:
    torch.manual_seed(0)
    for family, fn, lengths in (("GQA", gqa, (64, 512, 2048, 8192)), ("MLA", mla, (64, 1024, 4096))):
        for L in lengths:
            print(f"{family} L={L:5d}: " + "  ".join(f"{k} {v:.4f}" for k, v in fn(L).items()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
