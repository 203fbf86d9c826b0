"""The wgmma instructions a kernel uses, generated per shape: an m64nNk16 instruction names all N/2
accumulator registers of a thread in its operand list, which is long and regular — written by code,
not by hand."""
from __future__ import annotations

WGMMA_N = tuple(range(8, 257, 8))   # the N a bf16 m64nNk16 instruction accepts


def wgmma_bf16(n: int) -> str:
    """`wgmma_bf16(acc, desc_a, desc_b)`: acc[n/2] += A (64 x 16, shared) * B (n x 16, shared, K-major),
    bf16 inputs, fp32 accumulators, both operands K-major (no transpose)."""
    if n not in WGMMA_N:
        raise ValueError(f"wgmma N={n}: expected a multiple of 8 in 8..256")
    regs = n // 2
    acc = ", ".join(f"%{i}" for i in range(regs))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
    return (
        f"__device__ __forceinline__ void wgmma_bf16(float (&d)[{regs}], unsigned long long a, "
        "unsigned long long b) {\n"
        f'  asm volatile("{{ .reg .pred p; setp.ne.b32 p, %{regs + 2}, 0; "\n'
        f'               "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{acc}}}, %{regs}, %{regs + 1}, '
        f'p, 1, 1, 0, 0; }}"\n'
        f'               : {outs}\n'
        f'               : "l"(a), "l"(b), "r"(1));\n'
        "}\n")
