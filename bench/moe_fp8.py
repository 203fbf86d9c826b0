"""Block-scaled FP8 MoE (`bench/moe.py --fp8`): meld.MoE(weight_dtype=torch.float8_e4m3fn) against a
graph-captured `torch._scaled_grouped_mm` pipeline, on BENCH's three shapes in one run.

    PYTHONUNBUFFERED=1 PYTHONPATH=$PWD python3 bench/moe.py --fp8 [--shapes S] [--tokens T,..] [--json PATH]

Method: per shape, bench/moe.py's bf16 weights quantised once to DeepSeek-V3's format (e4m3, a float32 scale
per 128 x 128 block: `meld.runtime.moe_reference.quantize_blocks`), meld's input. torch's FP8 grouped GEMM takes
row-wise scales only (scale_a [M] per activation row, scale_b [G, N] per weight output row; a scale multiplies
its row back), so the peer runs on the same weights re-quantised per output row from the dequantised blocks
(once, outside the timing). A peer call: softmax top-k, pairs sorted by expert, x's rows quantised (a scale per
row), grouped gate/up into bf16, SiLU(gate) * up, quantised per row, grouped down into bf16, the weighted
index_add (float32): the whole layer, as bench/moe.py's bf16 peer, graph-captured. Both start from the logits.
Timing: median of CUDA-graph replays with a cold L2 (`bench.harness.graph_time_us`). Ceilings in the same run,
plus the FP8 matmul ceiling (`torch._scaled_mm`, 8192^3, row-wise scales). At T <= 16, `floor` is
`read_floor_us` of the touched experts' e4m3 bytes and their block scales.
Correctness before timing: both against float64 over the dequantised weights with unquantised activations,
‖out − ref‖/‖ref‖ < 8e-2 and max|out − ref| / max|ref| < 1.5e-1 (each quantises its activations to e4m3, 2.6%
a tensor: tests/test_moe_fp8.py states meld's), and meld against the peer (< 1.2e-1 and < 2e-1: per 128 channels
against per row, the two quantisations differ by about 6% and 7% on a qwen3-shaped expert, measured in float64
on the CPU). Without
`torch._scaled_grouped_mm` the run stops with an error naming it: there is no FP8 peer to compare with.
"""
from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from bench.harness import (Column, Table, ceilings_line, env_info, env_line, failure_head, free_cuda, graph_time_us,
                           measure_ceilings, read_floor_us, speedup_span)
from bench.moe import RENORMALIZE, SHAPES, Shape, errors, make_weights, route, router_logits
from meld.runtime.moe_reference import E4M3_MAX, FP8_MIN_AMAX, GROUP, dequantize_blocks, quantize_blocks

FP8 = torch.float8_e4m3fn
REL_TOL, MAX_TOL = 8e-2, 1.5e-1      # against float64
AGREE_REL, AGREE_MAX = 1.2e-1, 2e-1  # meld against the peer
SCALED_GROUPED_MM = getattr(torch, "_scaled_grouped_mm", None)


def fp8_bytes(shape: Shape) -> int:
    """e4m3 bytes of one expert's gate, up and down weights, with their float32 block scales."""
    H, I, c = shape.hidden, shape.inter, lambda n: -(-n // GROUP)
    return 3 * H * I + 4 * (c(2 * I) * c(H) + c(H) * c(I))


def rowwise(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a [..., K] quantised per row: (e4m3, float32 scales [...]) with scale = max |row| / 448."""
    scale = a.abs().amax(dim=-1).float().clamp_min(FP8_MIN_AMAX) / E4M3_MAX
    return (a.float() / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8), scale


def peer_weights(w: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-scaled e4m3 w [E, N, K] re-quantised per output row (an expert at a time): the peer's operands."""
    q, scale = torch.empty_like(w), torch.empty(w.shape[:2], dtype=torch.float32, device=w.device)
    for e in range(w.shape[0]):
        q[e], scale[e] = rowwise(dequantize_blocks(w[e:e + 1], s[e:e + 1])[0].float())
    return q, scale


def torch_fp8_moe(x, w13, s13, w2, s2, logits, top_k: int) -> torch.Tensor:
    """The peer (module docstring): w13 [E, 2I, H] e4m3 with s13 [E, 2I], w2 [E, H, I] with s2 [E, H]."""
    T, H = x.shape
    E, I = w13.shape[0], w2.shape[-1]
    weights, ids = route(logits, top_k, RENORMALIZE)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    token = order // top_k
    counts = torch.zeros(E, dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)
    q, sa = rowwise(x[token])
    gate_up = SCALED_GROUPED_MM(q, w13.transpose(1, 2), sa, s13, offs=offs, out_dtype=torch.bfloat16)
    qh, sh = rowwise(F.silu(gate_up[:, :I]) * gate_up[:, I:])
    y = SCALED_GROUPED_MM(qh, w2.transpose(1, 2), sh, s2, offs=offs, out_dtype=torch.bfloat16)
    y = y.float() * weights.flatten()[order, None]
    return torch.zeros(T, H, dtype=torch.float32, device=x.device).index_add_(0, token, y).to(x.dtype)


def reference(x, w13, s13, w2, s2, logits, top_k: int) -> torch.Tensor:
    """float64 over the dequantised weights (an expert at a time), activations unquantised."""
    I = w2.shape[-1]
    _, ids = route(logits, top_k, RENORMALIZE)
    weights = torch.softmax(logits.double(), dim=-1).gather(1, ids)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        gate, up = (x[tok].double() @ dequantize_blocks(w13[e:e + 1], s13[e:e + 1])[0].T).split(I, dim=-1)
        y = (F.silu(gate) * up) @ dequantize_blocks(w2[e:e + 1], s2[e:e + 1])[0].T
        out.index_add_(0, tok, y * weights[tok, slot, None])
    return out


def fp8_matmul_ceiling_tflops(n: int = 8192, reps: int = 30) -> float:
    """Dense e4m3 tensor-core rate (TFLOP/s) of an n x n x n `torch._scaled_mm` (row-wise scales, bf16 out)."""
    a = torch.randn(n, n, device="cuda").to(FP8)
    b = torch.randn(n, n, device="cuda").to(FP8).t()
    sa, sb = torch.ones(n, 1, device="cuda"), torch.ones(1, n, device="cuda")
    t = graph_time_us(lambda: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16), reps=reps, flush=False)
    return 2 * n ** 3 / (t.median_us * 1e-6) / 1e12


COLUMNS = [
    Column("shape", "shape", align="<"), Column("T", "T"), Column("routing", "routing", align="<"),
    Column("touched", "experts"), Column("meld_us", "meld µs", ".1f"), Column("torch_us", "torch fp8 µs", ".1f"),
    Column("speedup", "speedup", ".2f"), Column("meld_tflops", "meld TFLOP/s", ".1f"),
    Column("pct_mma", "%fp8 mma", ".0f"), Column("floor_us", "floor µs", ".1f"),
    Column("floor_ratio", "meld/floor", ".2f"), Column("rel_err", "rel err", ".1e"), Column("agree", "vs torch", ".1e"),
]


def check(what: str, out: torch.Tensor, target: torch.Tensor, problems: list[str], rel_tol: float = REL_TOL,
          max_tol: float = MAX_TOL) -> float:
    rel, mx = errors(out, target)
    if not (rel < rel_tol and mx < max_tol):
        problems.append(f"{what}: rel err {rel:.2e} (< {rel_tol:.0e}), max err {mx:.2e} (< {max_tol:.0e})")
    return rel


def run_shape(shape: Shape, args: argparse.Namespace, ceilings: dict[str, Any], table: Table,
              failures: list[str]) -> None:
    """Every case of one shape (its weights freed with the call's frame: run() frees the memory after)."""
    import meld

    w13b, w2b = make_weights(shape, args.seed, "cuda")
    (w13, s13), (w2, s2) = quantize_blocks(w13b), quantize_blocks(w2b)
    del w13b, w2b
    (p13, ps13), (p2, ps2) = peer_weights(w13, s13), peer_weights(w2, s2)
    moe = meld.MoE(shape.hidden, shape.inter, shape.experts, shape.top_k, device="cuda",
                   max_num_tokens=max(args.tokens), weight_dtype=FP8)
    for T in args.tokens:
        for routing in args.routing:
            name = f"{shape.name} T={T} {routing}"
            logits = router_logits(shape, T, routing, args.seed).cuda()
            g = torch.Generator(device="cuda").manual_seed(args.seed + 1 + T)
            x = torch.randn(T, shape.hidden, generator=g, dtype=torch.bfloat16, device="cuda")
            _, ids = route(logits, shape.top_k, RENORMALIZE)
            touched = int(ids.unique().numel())
            runs: dict[str, Callable[[], torch.Tensor]] = {
                "meld": lambda: moe(x, logits, w13, w2, w13_scale=s13, w2_scale=s2),
                "torch": lambda: torch_fp8_moe(x, p13, ps13, p2, ps2, logits, shape.top_k)}
            ref = reference(x, w13, s13, w2, s2, logits, shape.top_k)
            row: dict[str, Any] = {"case": name, "shape": shape.name, "T": T, "routing": routing, "touched": touched}
            problems: list[str] = []
            outs = {k: f() for k, f in runs.items()}
            row["rel_err"] = check("meld vs float64", outs["meld"], ref, problems)
            check("torch vs float64", outs["torch"], ref, problems)
            row["agree"] = check("meld vs torch", outs["meld"], outs["torch"].double(), problems, AGREE_REL, AGREE_MAX)
            if problems:
                failures.append(f"{name}: " + "; ".join(problems))
                print(f"!!! FAIL {failures[-1]}", flush=True)
            else:
                for k, f in runs.items():
                    row[f"{k}_us"] = graph_time_us(f, warmup=args.warmup, reps=args.reps,
                                                   flush=not args.no_flush).median_us
                flops = shape.flops(T)
                row["speedup"] = row["torch_us"] / row["meld_us"]
                row["meld_tflops"] = flops / (row["meld_us"] * 1e-6) / 1e12
                row["pct_mma"] = 100 * row["meld_tflops"] / ceilings["matmul_fp8_tflops"]
                if T <= 16:
                    row["floor_us"] = read_floor_us(touched * fp8_bytes(shape))
                    row["floor_ratio"] = row["meld_us"] / row["floor_us"] if row["floor_us"] else None
            print("  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                  flush=True)
            table.add(row)
            del outs, ref
            free_cuda()
            if args.json:
                table.dump_json(args.json, ceilings=ceilings, args=vars(args), failures=failures)


def run(args: argparse.Namespace) -> int:
    """`bench/moe.py --fp8`: every shape and T of `args` (uniform routing unless --routing)."""
    if not torch.cuda.is_available():
        print("moe.py --fp8 needs a CUDA GPU", flush=True)
        return 2
    if SCALED_GROUPED_MM is None:
        print(f"moe.py --fp8: torch {torch.__version__} has no torch._scaled_grouped_mm, the FP8 peer; "
              "nothing to compare meld's FP8 MoE with", flush=True)
        return 2
    env = env_info()
    print(env_line(env), flush=True)
    ceilings = measure_ceilings()
    ceilings["matmul_fp8_tflops"] = fp8_matmul_ceiling_tflops()
    free_cuda()
    print(ceilings_line(ceilings) + f"; fp8 matmul (torch._scaled_mm 8192^3) {ceilings['matmul_fp8_tflops']:.0f} "
          "TFLOP/s", flush=True)
    table, failures = Table(COLUMNS), []
    for name in args.shapes:
        run_shape(SHAPES[name], args, ceilings, table, failures)
        free_cuda()
    print()
    table.print()
    print("speedup = torch._scaled_grouped_mm pipeline µs / meld µs; %fp8 mma = meld TFLOP/s / fp8 matmul ceiling; "
          "floor (T <= 16) = read_floor_us of the touched experts' e4m3 bytes and block scales; rel err = "
          "‖out − ref‖/‖ref‖ against float64 over the dequantised weights (activations unquantised)")
    span = speedup_span(table.rows)
    print(f"summary: meld FP8 vs torch FP8 {span or 'not measured'}; {failure_head(failures)}")
    return 1 if failures else 0


def fp8_cases_line(shape: Shape) -> str:
    """One shape's FP8 sizes, for --dry-run."""
    return (f"{shape.name}: {fp8_bytes(shape) / (1 << 20):.1f} MiB of e4m3 weights and scales an expert, "
            f"{shape.experts * fp8_bytes(shape) / (1 << 30):.2f} GiB a layer; "
            f"{math.ceil(shape.hidden / GROUP)} x 128-channel groups of x")
