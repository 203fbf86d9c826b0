"""How much accuracy FP8 tensor cores would cost decode attention over an e4m3 KV cache (CPU only).

    python tools/fp8_mma_error.py

The cache is e4m3 with a per-tensor scale (amax / 448, as bench/decode.py draws it); the reference is float64
attention over the dequantised cache. Against it, the relative error (||out - ref|| / ||ref||, the worst of a few
fresh draws) of: q in bf16 with f16/bf16 math (what meld's kernels do); q quantised to e4m3 with a scale per head
(the scores as e4m3 MMAs); and for MLA also P alone in e4m3 (the P.V as an e4m3 MMA, q in bf16). Issue 41's bar is
2e-2. GQA: 4 q heads a kv head, head_dim 128. MLA: 128 heads, the 576-wide latent (V its first 512 channels),
softmax scale 1/sqrt(192).
"""
from __future__ import annotations

import math

import torch


def e4m3(x: torch.Tensor, scale) -> torch.Tensor:
    """x rounded to e4m3 codes of `scale` and back (float64)."""
    return (x / scale).to(torch.float8_e4m3fn).double() * scale


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
        q8 = e4m3(qb, qb.abs().amax(-1, keepdim=True) / 448)
        fp8_q = torch.softmax(q8 @ k8.T * sm, -1).half().double() @ v8
        for name, o in (("bf16 q", now), ("e4m3 q", fp8_q)):
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
        q8 = e4m3(qb, qb.abs().amax(-1, keepdim=True) / 448)
        outs = {"bf16 q": p.to(torch.bfloat16).double() @ kv8[:, :DV],
                "e4m3 q": torch.softmax(q8 @ kv8.T * sm, -1).to(torch.bfloat16).double() @ kv8[:, :DV],
                "e4m3 P only": e4m3(p, p.amax(-1, keepdim=True) / 448) @ kv8[:, :DV]}
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
