"""The wgmma instructions a kernel uses, generated per shape: an m64nNk16 instruction names all N/2
accumulator registers of a thread in its operand list, which is long and regular — written by code,
not by hand."""
from __future__ import annotations

WGMMA_N = tuple(range(8, 257, 8))   # the N a bf16 m64nNk16 (or e4m3 m64nNk32) instruction accepts
_TYPES = {"bfloat16": "bf16", "float16": "f16"}


def _wgmma(name: str, n: int, op: str, modifiers: str, a_regs: bool = False) -> str:
    """The device function `name(acc, a, desc_b[, accumulate])` around wgmma instruction `op` (its shape and
    types, N = n) whose operands after the scale-d predicate are `modifiers`; A is a shared-memory descriptor,
    or with `a_regs` four registers of 16-bit pairs (mma.m16n8k16's A fragment of the warp's 16 rows)."""
    if n not in WGMMA_N:
        raise ValueError(f"wgmma N={n}: expected a multiple of 8 in 8..256")
    regs = n // 2
    acc = ", ".join(f"%{i}" for i in range(regs))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
    if a_regs:
        a_param, a_op, a_in, b = "const u32 (&a)[4]", f"{{%{regs}, %{regs + 1}, %{regs + 2}, %{regs + 3}}}", \
            '"r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3])', regs + 4
    else:
        a_param, a_op, a_in, b = "unsigned long long a", f"%{regs}", '"l"(a)', regs + 1
    return (
        f"__device__ __forceinline__ void {name}(float (&d)[{regs}], {a_param}, "
        "unsigned long long b, int accumulate = 1) {\n"
        f'  asm volatile("{{ .reg .pred p; setp.ne.b32 p, %{b + 1}, 0; "\n'
        f'               "wgmma.mma_async.sync.aligned.{op} {{{acc}}}, {a_op}, %{b}, '
        f'p, {modifiers}; }}"\n'
        f'               : {outs}\n'
        f'               : {a_in}, "l"(b), "r"(accumulate));\n'
        "}\n")


def wgmma_bf16(n: int, trans_b: bool = False) -> str:
    """`wgmma_bf16(acc, desc_a, desc_b[, accumulate])`: acc[n/2] = A (64 x 16, shared, K-major) * B (n x 16,
    shared) + (accumulate ? acc : 0), bf16 inputs, fp32 accumulators. B is K-major, or with `trans_b` MN-major
    (its n channels contiguous, as the value rows of attention lie): that variant is named `wgmma_bf16_tb`.
    accumulate = 0 starts a sum without zeroing the registers first (writes to an accumulator between
    wgmmas serialise them)."""
    return _wgmma("wgmma_bf16_tb" if trans_b else "wgmma_bf16", n, *_ss("bfloat16", n, trans_b))


def wgmma_ss(dtype: str, n: int, trans_b: bool = False) -> str:
    """`wgmma_ss(acc, desc_a, desc_b[, accumulate])` (`wgmma_ss_tb` with `trans_b`): wgmma_bf16 for `dtype`
    "bfloat16" or "float16", under one name for both, so a kernel built for either calls the same function."""
    return _wgmma("wgmma_ss_tb" if trans_b else "wgmma_ss", n, *_ss(dtype, n, trans_b))


def _ss(dtype: str, n: int, trans_b: bool) -> tuple[str, str]:
    """The op and modifiers of an m64nNk16 wgmma with both operands in shared memory (B MN-major: trans_b)."""
    return f"m64n{n}k16.f32.{_type(dtype)}.{_type(dtype)}", f"1, 1, 0, {int(trans_b)}"


def _type(dtype: str) -> str:
    if dtype not in _TYPES:
        raise ValueError(f"wgmma dtype={dtype!r}: expected one of {sorted(_TYPES)}")
    return _TYPES[dtype]


def wgmma_rs(dtype: str, n: int, trans_b: bool = False) -> str:
    """`wgmma_rs(acc, a, desc_b[, accumulate])`: as wgmma_bf16 with A from registers (`a`: each warp's 16 rows
    of the 64 as mma.m16n8k16's A fragment), for `dtype` "bfloat16" or "float16"; `wgmma_rs_tb` with B
    MN-major. Overloads of one name differ in N (the accumulator's length)."""
    t = _type(dtype)
    return _wgmma("wgmma_rs_tb" if trans_b else "wgmma_rs", n, f"m64n{n}k16.f32.{t}.{t}", f"1, 1, {int(trans_b)}",
                  a_regs=True)


def wgmma_e4m3(n: int) -> str:
    """`wgmma_e4m3(acc, desc_a, desc_b[, accumulate])`: as wgmma_bf16 for e4m3 inputs, K = 32 an instruction
    (the same 32 bytes of a 128-byte swizzled row as bf16's K = 16); both operands K-major (FP8 wgmma has no
    transposed form)."""
    return _wgmma("wgmma_e4m3", n, f"m64n{n}k32.f32.e4m3.e4m3", "1, 1")
