"""The wgmma instructions a kernel uses, generated per shape: an m64nNk16 instruction names all N/2
accumulator registers of a thread in its operand list, which is long and regular — written by code,
not by hand."""
from __future__ import annotations

WGMMA_N = tuple(range(8, 257, 8))   # the N a bf16 m64nNk16 (or e4m3 m64nNk32) instruction accepts


def _wgmma(name: str, n: int, op: str, modifiers: str) -> str:
    """The device function `name(acc, desc_a, desc_b[, accumulate])` around wgmma instruction `op` (its shape
    and types, N = n) whose operands after the scale-d predicate are `modifiers`."""
    if n not in WGMMA_N:
        raise ValueError(f"wgmma N={n}: expected a multiple of 8 in 8..256")
    regs = n // 2
    acc = ", ".join(f"%{i}" for i in range(regs))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
    return (
        f"__device__ __forceinline__ void {name}(float (&d)[{regs}], unsigned long long a, "
        "unsigned long long b, int accumulate = 1) {\n"
        f'  asm volatile("{{ .reg .pred p; setp.ne.b32 p, %{regs + 2}, 0; "\n'
        f'               "wgmma.mma_async.sync.aligned.{op} {{{acc}}}, %{regs}, %{regs + 1}, '
        f'p, {modifiers}; }}"\n'
        f'               : {outs}\n'
        f'               : "l"(a), "l"(b), "r"(accumulate));\n'
        "}\n")


def wgmma_bf16(n: int, trans_b: bool = False) -> str:
    """`wgmma_bf16(acc, desc_a, desc_b[, accumulate])`: acc[n/2] = A (64 x 16, shared, K-major) * B (n x 16,
    shared) + (accumulate ? acc : 0), bf16 inputs, fp32 accumulators. B is K-major, or with `trans_b` MN-major
    (its n channels contiguous, as the value rows of attention lie): that variant is named `wgmma_bf16_tb`.
    accumulate = 0 starts a sum without zeroing the registers first (writes to an accumulator between
    wgmmas serialise them)."""
    return _wgmma("wgmma_bf16_tb" if trans_b else "wgmma_bf16", n, f"m64n{n}k16.f32.bf16.bf16",
                  f"1, 1, 0, {int(trans_b)}")


def wgmma_e4m3(n: int) -> str:
    """`wgmma_e4m3(acc, desc_a, desc_b[, accumulate])`: as wgmma_bf16 for e4m3 inputs, K = 32 an instruction
    (the same 32 bytes of a 128-byte swizzled row as bf16's K = 16); both operands K-major (FP8 wgmma has no
    transposed form)."""
    return _wgmma("wgmma_e4m3", n, f"m64n{n}k32.f32.e4m3.e4m3", "1, 1")
