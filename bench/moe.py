"""Fused MoE layer: meld.MoE against the torch grouped_mm pipeline, per BENCH.md ("MoE workloads").

On the GPU machine, from the repository root:

    PYTHONUNBUFFERED=1 PYTHONPATH=$PWD python3 bench/moe.py --quick --json $OUT/moe.json

`--dry-run` lists the cases (experts touched, bytes, FLOPs) without a GPU; `--impls torch` runs the peer alone.
`--fp8`: block-scaled FP8 weights against torch's FP8 grouped GEMM instead (bench/moe_fp8.py says how).

Method (BENCH.md): per shape one set of bf16 weights, w13 [E, 2I, H] (gate rows, then up rows) and
w2 [E, H, I], scaled so activations stay O(1); per case x [T, H] bf16 and router logits [T, E] float32 drawn
from a seeded torch.Generator. `skewed` routing takes the same logits and forces one expert (seeded) to be
the first choice of half the tokens (ceil(T/2), seeded permutation; `hot`: 70%) by raising its logit to that token's
largest logit + SKEW_MARGIN: a fixed large constant would force it too, but would drive the other k-1
softmax weights to ~e^-C, where no check could see them. Both implementations start from the logits:
softmax top-k routing (renormalised) is inside every timed region. `power-law` and `few` concentrate the
routing as production routers do (router_logits says how).
  meld:  `meld.MoE(...)(x, router_logits, w13p, w2p)`, one module per shape with max_num_tokens = the run's
         largest T (construction time reported as init), on the weights packed once per shape by
         `meld.pack_moe_weights` (as an engine packs at load; `--weights plain` times w13 / w2 as given).
  torch: `torch_grouped_mm_moe` below: softmax, topk, renormalise -> sort the (token, expert) pairs by
         expert -> grouped_mm gate/up -> SiLU(gate)*up -> grouped_mm down -> weighted index_add_ (fp32).
Correctness before timing: every output against a float64 reference (routing selected on float32 softmax,
as both implementations do; weights and math in float64), ‖out − ref‖/‖ref‖ < 1e-2 and
max|out − ref| / max|ref| < 2e-2, no NaN; meld also against the peer (both < 2e-2), on each of its call
paths: logits, precomputed routing (topk_weights/topk_ids), the plain weights when timed on packed ones, and
`meld.fused_moe` where it exists. (Its
outputs are allocated by meld, so they cannot be poisoned first: the NaN check stands in.) Cases above
--check-max-tokens (default: none) are checked against the peer only. Device time: median of CUDA-graph replays with a
cold L2 (`bench.harness.graph_time_us`); meld's eager latency beside it. Ceilings measured in the same run.
  FLOPs = 2·T·k·(H·2I + I·H);  speedup = torch µs / meld µs (> 1: meld faster);  %mma = meld TFLOP/s /
  the bf16 matmul ceiling;  floor = experts touched × 3·H·I·2 bytes / the pure-read ceiling (the weights
  any implementation must read once);  meld/floor = meld µs / floor (1.0 is the bound);  roofline =
  max(floor, FLOPs / the bf16 matmul ceiling), meld/roofline likewise;  read (T <= 16) = `read_floor_us` of the
  touched bytes, what a plain streaming read of them takes as one launch here (issue 40's T = 1 bound is 1.3x
  it), meld/read likewise.
`--trace DIR` also writes a per-SM timeline (Chrome trace + PNG, as `meld timeline` renders) of each case
when the operator exposes `last_trace()`, from a second module built with MELD_PROFILE=1.
The exit status is 1 if any check or any implementation failed (the run still goes through every case).
"""
from __future__ import annotations

import argparse
import functools
import math
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `bench` and `meld` import as-is
from bench.harness import (
    Column,
    Table,
    add_timing_args,
    ceilings_line,
    env_info,
    env_line,
    failure_head,
    failure_recorder,
    write_trace as harness_write_trace,
    free_cuda,
    keep_available,
    measure_ceilings,
    median_us,
    read_floor_us,
    record_failure,
    result_cell,
    run_recorded,
    speedup_span,
    time_impl,
    timed_reps,
    timing_parts,
    worst,
)
from meld.serving.torch_moe import GROUPED_MM, torch_grouped_mm_moe
from meld.serving.torch_moe import topk_route as route

DTYPE = torch.bfloat16
TOKENS = (1, 16, 128, 1024, 8192)
QUICK_TOKENS = (1, 128, 8192)  # one decode step, the middle, a prefill chunk
ROUTINGS = ("uniform", "skewed", "hot", "power-law", "few")
HOT_SHARE = 0.7  # `hot`: the share of tokens whose first choice is the one hot expert
POWER_S = 1.2  # `power-law`: expert popularity ∝ rank^-s (the top 10% of experts: 55% of first choices at E = 32, 71% at 128)
FEW = 3  # `few`: the experts that take every first choice
IMPLS = ("meld", "torch")
SKEW_MARGIN = 2.0  # the forced expert's logit = the token's largest logit + this
REL_TOL = 1e-2  # ‖out − ref‖ / ‖ref‖ against float64
MAX_TOL = 2e-2  # max|out − ref| / max|ref|
AGREE_TOL = 2e-2  # meld against the peer, both measures
RENORMALIZE = True
DEVICE = "cuda"


@dataclass(frozen=True)
class Shape:
    """One MoE layer: hidden size H, intermediate size I (gate and up each), E experts, top-k."""

    name: str
    hidden: int
    inter: int
    experts: int
    top_k: int

    @property
    def expert_bytes(self) -> int:
        """bf16 bytes of one expert's gate, up and down weights."""
        return 3 * self.hidden * self.inter * 2

    def flops(self, tokens: int) -> int:
        return 2 * tokens * self.top_k * (self.hidden * 2 * self.inter + self.inter * self.hidden)


SHAPES = {s.name: s for s in (
    Shape("qwen3-30b-a3b", 2048, 768, 128, 8),
    Shape("deepseek-v3-ep32", 7168, 2048, 32, 8),
    Shape("gpt-oss-120b", 2880, 2880, 128, 4),
)}


@dataclass(frozen=True)
class Case:
    shape: Shape
    tokens: int
    routing: str

    @property
    def name(self) -> str:
        return f"{self.shape.name} T={self.tokens} {self.routing}"


# ----------------------------------------------------------------------------------------- workloads

def router_logits(shape: Shape, tokens: int, routing: str, seed: int = 0) -> torch.Tensor:
    """[T, E] float32 on the host, from a seeded generator: the same for every run, GPU and implementation.
    `uniform`: N(0, 1). `skewed` / `hot`: `uniform` with one expert forced first for ceil(T/2) / ceil(0.7 T)
    tokens (module docstring: why a margin). `power-law`: log p_e plus Gumbel noise, p_e ∝ rank_e^-POWER_S over
    a seeded ranking of the experts, so each token's top-k is drawn from p without replacement (the Gumbel
    top-k trick): popularity falls off as a power of the rank for every choice, not only the first. `few`:
    `uniform` with each token's first choice forced to one of FEW seeded experts, drawn uniformly."""
    if routing not in ROUTINGS:
        raise ValueError(f"unknown routing {routing!r}; expected one of {ROUTINGS}")
    g = torch.Generator().manual_seed(seed * 1_000_003 + tokens)
    E = shape.experts
    logits = torch.randn(tokens, E, generator=g, dtype=torch.float32)
    if routing in ("skewed", "hot"):
        hot = int(torch.randint(E, (1,), generator=g))
        rows = torch.randperm(tokens, generator=g)[:math.ceil(tokens * (0.5 if routing == "skewed" else HOT_SHARE))]
        logits[rows, hot] = logits[rows].amax(dim=1) + SKEW_MARGIN
    elif routing == "power-law":
        rank = torch.empty(E, dtype=torch.float32)
        rank[torch.randperm(E, generator=g)] = torch.arange(1, E + 1, dtype=torch.float32)
        gumbel = -torch.log(-torch.log(torch.rand(tokens, E, generator=g).clamp_min(1e-20)))
        logits = -POWER_S * torch.log(rank) + gumbel
    elif routing == "few":
        chosen = torch.randperm(E, generator=g)[:FEW]
        first = chosen[torch.randint(FEW, (tokens,), generator=g)]
        logits[torch.arange(tokens), first] = logits.amax(dim=1) + SKEW_MARGIN
    return logits


def make_weights(shape: Shape, seed: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [E, 2I, H] and w2 [E, H, I] bf16, N(0, 1/fan_in): gate, up and the output all stay O(1)."""
    g = torch.Generator(device=device).manual_seed(seed)
    E, H, I = shape.experts, shape.hidden, shape.inter
    w13 = torch.randn(E, 2 * I, H, generator=g, dtype=DTYPE, device=device).mul_(H ** -0.5)
    w2 = torch.randn(E, H, I, generator=g, dtype=DTYPE, device=device).mul_(I ** -0.5)
    return w13, w2


@dataclass
class Inputs:
    case: Case
    x: torch.Tensor  # [T, H] bf16
    logits: torch.Tensor  # [T, E] float32
    w13: torch.Tensor
    w2: torch.Tensor
    touched: int  # distinct experts the routing selects
    max_load: int  # (token, expert) pairs on the busiest expert
    meld_weights: tuple[torch.Tensor, torch.Tensor] | None = None  # (w13, w2) as meld is timed on them


def make_inputs(case: Case, w13: torch.Tensor, w2: torch.Tensor, seed: int, device: str,
                meld_weights: tuple[torch.Tensor, torch.Tensor] | None = None) -> Inputs:
    logits = router_logits(case.shape, case.tokens, case.routing, seed)
    _, ids = route(logits, case.shape.top_k, RENORMALIZE)
    load = torch.bincount(ids.flatten(), minlength=case.shape.experts)
    g = torch.Generator(device=device).manual_seed(seed + 1 + case.tokens)
    x = torch.randn(case.tokens, case.shape.hidden, generator=g, dtype=DTYPE, device=device)
    return Inputs(case, x, logits.to(device), w13, w2, int((load > 0).sum()), int(load.max()), meld_weights)


# ---------------------------------------------------------------------------------- the torch peer

# ------------------------------------------------------------------------------------- correctness

def reference_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, logits: torch.Tensor, top_k: int,
                  renormalize: bool = True, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Dense MoE in `dtype`, one expert at a time (only its weights converted). The experts are the float32
    softmax top-k (the selection both implementations make, so a near-tie cannot flip it); their weights are
    recomputed from the logits in `dtype`."""
    I = w2.shape[-1]
    _, ids = route(logits, top_k, renormalize)
    weights = torch.softmax(logits.to(dtype), dim=-1).gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    xd = x.to(dtype)
    out = torch.zeros(x.shape[0], x.shape[1], dtype=dtype, device=x.device)
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        gate, up = (xd[tok] @ w13[e].to(dtype).T).split(I, dim=-1)
        y = (F.silu(gate) * up) @ w2[e].to(dtype).T
        out.index_add_(0, tok, y * weights[tok, slot, None])
    return out


def errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(‖out − ref‖/‖ref‖, max|out − ref| / max|ref|), in float64."""
    d = out.double() - ref.double()
    return float(d.norm() / ref.double().norm()), float(d.abs().max() / ref.double().abs().max())


def check_against(out: torch.Tensor, ref: torch.Tensor, what: str, rel_tol: float, max_tol: float
                  ) -> tuple[float, float, list[str]]:
    """Both error measures of `out` against `ref`, and a problem for each one at or above its tolerance."""
    rel, mx = errors(out, ref)
    problems = [f"{name} err vs {what} {v:.2e} >= {tol:.0e}" for name, v, tol in
                (("rel", rel, rel_tol), ("max", mx, max_tol)) if not v < tol]
    return rel, mx, problems


# ---------------------------------------------------------------------------------- implementations

@dataclass
class Impl:
    """`run` is launch-only (graph-capturable); `paths` are the call paths checked before timing, as (label,
    call), each run on its own so one that raises is reported by name and the others are still checked."""

    run: Callable[[], Any]
    paths: list[tuple[str, Callable[[], torch.Tensor]]]


def build_torch(inp: Inputs) -> Impl:
    k = inp.case.shape.top_k

    def run() -> torch.Tensor:
        return torch_grouped_mm_moe(inp.x, inp.w13, inp.w2, inp.logits, k, RENORMALIZE)

    return Impl(run, [("grouped_mm pipeline", run)])


def new_meld_moe(shape: Shape, max_tokens: int, device: str) -> Any:
    import meld

    return meld.MoE(hidden_size=shape.hidden, intermediate_size=shape.inter, num_experts=shape.experts,
                    top_k=shape.top_k, dtype=DTYPE, device=device, max_num_tokens=max_tokens)


def build_meld(inp: Inputs, moe: Any) -> Impl:
    """Times the module with logits (routing inside) on `inp.meld_weights` (packed unless --weights plain);
    checks that path, the plain weights, precomputed routing and fused_moe."""
    import meld

    x, logits, w13, w2, k = inp.x, inp.logits, inp.w13, inp.w2, inp.case.shape.top_k
    mw13, mw2 = inp.meld_weights or (w13, w2)

    weights, ids = route(logits, k, RENORMALIZE)
    paths = [("moe(x, logits)", lambda: moe(x, logits, mw13, mw2)),  # ids as torch.topk makes them (int64)
             ("moe(x, None, topk_weights=, topk_ids=)",
              lambda: moe(x, None, mw13, mw2, topk_weights=weights, topk_ids=ids))]
    if mw13 is not w13:
        paths.append(("moe(x, logits), plain weights", lambda: moe(x, logits, w13, w2)))
    if hasattr(meld, "fused_moe"):
        paths.append(("fused_moe", lambda: meld.fused_moe(x, w13, w2, logits, k, renormalize=RENORMALIZE)))
    return Impl(lambda: moe(x, logits, mw13, mw2), paths)


# ---------------------------------------------------------------------------------------------- run

def measure(name: str, impl_of: Callable[[], Impl], ref: torch.Tensor | None, peer_out: torch.Tensor | None,
            args: argparse.Namespace, failures: list[str], case: Case) -> tuple[dict[str, Any], torch.Tensor | None]:
    """Build, check (float64 reference, then the peer's output), then time one implementation on one case.
    Errors are recorded, never raised. Returns the result and the first checked output (for agreement)."""
    res: dict[str, Any] = {}
    first: torch.Tensor | None = None
    fail = failure_recorder(f"{case.name} {name}", res, failures)

    def build_check_time() -> None:
        nonlocal first
        impl = impl_of()
        problems: list[str] = []
        for label, call in impl.paths:
            try:
                out = call()
            except Exception as e:  # noqa: BLE001 - report the path by name, check the others
                traceback.print_exc(limit=-3)
                problems.append(f"{label}: raised {type(e).__name__}: {e}")
                continue
            if tuple(out.shape) != (case.tokens, case.shape.hidden):
                problems.append(f"{label}: out shape {tuple(out.shape)} != {(case.tokens, case.shape.hidden)}")
                continue
            first = out if first is None else first
            nans = int(torch.isnan(out).sum())
            problems += [f"{label}: {nans} NaN in out"] if nans else []
            checks = [("ref", "float64 ref", ref, REL_TOL, MAX_TOL), ("torch", "torch", peer_out, AGREE_TOL, AGREE_TOL)]
            for key, what, target, rel_tol, max_tol in checks:
                if target is None:
                    continue
                rel, mx, probs = check_against(out, target, what, rel_tol, max_tol)
                res.setdefault(f"rel_err_{key}", {})[label] = rel
                res.setdefault(f"max_err_{key}", {})[label] = mx
                problems += [f"{label}: {p}" for p in probs]
        if problems:
            fail("correctness", "; ".join(problems))
            return
        first = first.clone()
        time_impl(impl.run, res, fail, warmup=args.warmup, reps=args.reps, flush=not args.no_flush,
                  eager=name == "meld")

    run_recorded(build_check_time, res, fail)
    return res, first


def write_trace(moe: Any, inp: Inputs, folder: Path) -> str:
    """Per-SM timeline of the profiled module on this case (bench.harness.write_trace)."""
    return harness_write_trace(lambda: moe(inp.x, inp.logits, *(inp.meld_weights or (inp.w13, inp.w2))), moe,
                               folder / f"moe-{inp.case.shape.name}-T{inp.case.tokens}-{inp.case.routing}")


@functools.lru_cache(maxsize=None)
def _plain_read_us(nbytes: int) -> float | None:
    """`read_floor_us` of `nbytes`, measured once per size (the five routings of a decode case touch the same
    experts' bytes, or nearly)."""
    return read_floor_us(nbytes)


def summarise(inp: Inputs, results: dict[str, dict[str, Any]], ceilings: dict[str, Any], init_us: float | None
              ) -> dict[str, Any]:
    """One table row: the headline numbers and ratios, plus every raw result for the JSON dump."""
    c, s = inp.case, inp.case.shape

    cell = partial(result_cell, results)  # a time, or why there is none
    meld_us = cell("meld") if isinstance(cell("meld"), float) else None
    peer_us = cell("torch") if isinstance(cell("torch"), float) else None
    flops = s.flops(c.tokens)
    floor_us = inp.touched * s.expert_bytes / (ceilings["read_tbps"] * 1e12) * 1e6
    roofline_us = max(floor_us, flops / (ceilings["matmul_bf16_tflops"] * 1e12) * 1e6)
    read_us = _plain_read_us(inp.touched * s.expert_bytes) if c.tokens <= 16 else None
    m = results.get("meld", {})

    def worst_err(key: str) -> float | None:
        v = m.get(key)
        return worst(list(v.values())) if v else None

    tflops = flops / (meld_us * 1e-6) / 1e12 if meld_us else None
    return {
        "case": c.name, "shape": s.name, "T": c.tokens, "routing": c.routing, "touched": inp.touched,
        "max_load": inp.max_load, "flops": flops, "touched_bytes": inp.touched * s.expert_bytes,
        "meld_us": cell("meld"), "meld_eager_us": median_us(m, "eager"), "torch_us": cell("torch"),
        "speedup": peer_us / meld_us if peer_us and meld_us else None,
        "meld_tflops": tflops, "torch_tflops": flops / (peer_us * 1e-6) / 1e12 if peer_us else None,
        "pct_mma": 100 * tflops / ceilings["matmul_bf16_tflops"] if tflops else None,
        "floor_us": floor_us, "floor_ratio": meld_us / floor_us if meld_us else None,
        "roofline_us": roofline_us, "roofline_ratio": meld_us / roofline_us if meld_us else None,
        "read_us": read_us, "read_ratio": meld_us / read_us if meld_us and read_us else None,
        "rel_err": worst_err("rel_err_ref"), "agree": worst_err("rel_err_torch"), "meld_init_us": init_us,
        "results": results,
    }


COLUMNS = [  # the headline table; spreads, every error measure and init times are in the JSON
    Column("shape", "shape", align="<"), Column("T", "T"), Column("routing", "routing", align="<"),
    Column("touched", "experts"), Column("max_load", "max load"),
    Column("meld_us", "meld µs", ".1f"), Column("meld_eager_us", "eager µs", ".1f"),
    Column("torch_us", "torch µs", ".1f"), Column("speedup", "speedup", ".2f"),
    Column("meld_tflops", "meld TFLOP/s", ".1f"), Column("pct_mma", "%mma", ".0f"),
    Column("floor_us", "floor µs", ".1f"), Column("floor_ratio", "meld/floor", ".2f"),
    Column("roofline_us", "roofline µs", ".1f"), Column("roofline_ratio", "meld/roofline", ".2f"),
    Column("read_us", "read µs", ".1f"), Column("read_ratio", "meld/read", ".2f"),
    Column("rel_err", "rel err", ".1e"), Column("agree", "vs torch", ".1e"),
]
DRY_COLUMNS = [
    Column("shape", "shape", align="<"), Column("T", "T"), Column("routing", "routing", align="<"),
    Column("touched", "experts"), Column("max_load", "max load"), Column("weights_mib", "weights MiB", ".0f"),
    Column("touched_mib", "touched MiB", ".0f"), Column("gflop", "GFLOP", ".2f"),
    Column("floor_us", "floor µs @4.57 TB/s", ".1f"), Column("roofline_us", "roofline µs @4.57 TB/s, 774 TFLOP/s", ".1f"),
]


def parse_list(p: argparse.ArgumentParser, values: Sequence[str] | None, flag: str, choices: Sequence[Any],
               kind: type = str) -> list[Any] | None:
    """`--flag a,b c` -> [a, b, c], each checked against `choices` (argparse's error on a bad one)."""
    if values is None:
        return None
    out = []
    for item in (v for value in values for v in value.split(",") if v):
        try:
            v = kind(item)
        except ValueError:
            p.error(f"argument {flag}: {item!r} is not a {kind.__name__}")
        if v not in choices:
            p.error(f"argument {flag}: {item!r} is not one of {', '.join(map(str, choices))}")
        out.append(v)
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", metavar="NAME[,NAME]", help=f"default: all of {', '.join(SHAPES)}")
    p.add_argument("--tokens", nargs="+", metavar="T[,T]", help=f"default {','.join(map(str, TOKENS))}")
    p.add_argument("--routing", nargs="+", metavar="R[,R]", help=f"default {','.join(ROUTINGS)}")
    p.add_argument("--impls", nargs="+", metavar="I[,I]", help=f"implementations to run (default {','.join(IMPLS)})")
    p.add_argument("--quick", action="store_true",
                   help=f"T in {','.join(map(str, QUICK_TOKENS))} (unless --tokens), 30 replays")
    p.add_argument("--check-max-tokens", type=int, default=max(TOKENS),
                   help="check against the float64 reference up to this T; above it, against the peer only")
    add_timing_args(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--weights", choices=("packed", "plain"), default="packed",
                   help="meld's weights: packed once per shape by meld.pack_moe_weights (default), or w13 / w2 "
                        "as given")
    p.add_argument("--commit", help="git commit to record when the repo's .git is not at hand")
    p.add_argument("--json", type=Path, metavar="PATH", help="write env, ceilings and every row here "
                   "(rewritten after each case)")
    p.add_argument("--trace", type=Path, metavar="DIR", help="also write a per-SM timeline (Chrome JSON + PNG) "
                   "per case here, if meld.MoE has last_trace(); otherwise a note says it was skipped")
    p.add_argument("--dry-run", action="store_true", help="list the cases and their sizes; no GPU needed")
    p.add_argument("--fp8", action="store_true", help="block-scaled FP8 weights: meld against a "
                   "torch._scaled_grouped_mm pipeline (bench/moe_fp8.py; routing uniform unless --routing)")
    args = p.parse_args(argv)
    args.shapes = parse_list(p, args.shapes, "--shapes", list(SHAPES)) or list(SHAPES)
    args.tokens = parse_list(p, args.tokens, "--tokens", TOKENS, int) or list(QUICK_TOKENS if args.quick else TOKENS)
    args.routing = parse_list(p, args.routing, "--routing", ROUTINGS) or (["uniform"] if args.fp8 else list(ROUTINGS))
    args.impls = parse_list(p, args.impls, "--impls", IMPLS) or list(IMPLS)
    args.reps = timed_reps(args.reps, args.quick)
    return args


def preflight(impls: Sequence[str], env: dict[str, Any], failures: list[str]) -> list[str]:
    """Import meld once: if it or meld.MoE is missing, that is one failure (not one per case) and the peer
    still runs. The same for torch's grouped GEMM."""

    def probe(name: str) -> None:
        if name == "meld":
            import meld

            meld.MoE  # noqa: B018 - the operator must exist
            env["meld"] = getattr(meld, "__version__", "?")
        elif GROUPED_MM is None:
            raise RuntimeError(f"torch {torch.__version__} has neither F.grouped_mm nor torch._grouped_mm")
        else:
            env["grouped_mm"] = ("F.grouped_mm" if GROUPED_MM is getattr(F, "grouped_mm", None)
                                 else "torch._grouped_mm")

    return keep_available(impls, probe, failures)


def cases_of(args: argparse.Namespace) -> list[Case]:
    return [Case(SHAPES[s], t, r) for s in args.shapes for t in args.tokens for r in args.routing]


def dry_run(args: argparse.Namespace) -> None:
    t = Table(DRY_COLUMNS)
    for c in cases_of(args):
        s = c.shape
        _, ids = route(router_logits(s, c.tokens, c.routing, args.seed), s.top_k, RENORMALIZE)
        load = torch.bincount(ids.flatten(), minlength=s.experts)
        touched = int((load > 0).sum())
        t.add({"shape": s.name, "T": c.tokens, "routing": c.routing, "touched": touched,
               "max_load": int(load.max()), "weights_mib": s.experts * s.expert_bytes / (1 << 20),
               "touched_mib": touched * s.expert_bytes / (1 << 20), "gflop": s.flops(c.tokens) / 1e9,
               "floor_us": touched * s.expert_bytes / 4.57e12 * 1e6,
               "roofline_us": max(touched * s.expert_bytes / 4.57e12, s.flops(c.tokens) / 774e12) * 1e6})
    t.print()


def run_shape(shape: Shape, args: argparse.Namespace, ceilings: dict[str, Any], table: Table, env: dict[str, Any],
              failures: list[str], done: list[int], total: int) -> None:
    """Every case of one shape on one set of weights (freed on return, so only one shape's weights live)."""
    device, max_tokens = DEVICE, max(args.tokens)
    w13, w2 = make_weights(shape, args.seed, device)
    moe, init_us, traced, trace_note, meld_weights = None, None, None, None, None
    if "meld" in args.impls:
        try:
            t0 = time.perf_counter()
            moe = new_meld_moe(shape, max_tokens, device)
            init_us = (time.perf_counter() - t0) * 1e6
            print(f"{shape.name}: meld.MoE(max_num_tokens={max_tokens}) built in {init_us / 1e3:.0f} ms", flush=True)
            if args.weights == "packed":   # once per shape, as an engine packs at load time
                import meld

                meld_weights = meld.pack_moe_weights(w13, w2)
        except Exception as e:  # noqa: BLE001 - the peer still runs on this shape
            traceback.print_exc(limit=-4)
            record_failure(failures, f"{shape.name} meld: constructor: {type(e).__name__}: {e}", indent="  ")
    for case in [c for c in cases_of(args) if c.shape == shape]:
        done[0] += 1
        inp = make_inputs(case, w13, w2, args.seed, device, meld_weights)
        print(f"[{done[0]}/{total}] {case.name}: {inp.touched} experts touched, busiest {inp.max_load} pairs",
              flush=True)
        ref = (reference_moe(inp.x, w13, w2, inp.logits, shape.top_k, RENORMALIZE)
               if case.tokens <= args.check_max_tokens else None)
        results: dict[str, dict[str, Any]] = {}
        peer_out = None
        if "torch" in args.impls:
            results["torch"], peer_out = measure("torch", partial(build_torch, inp), ref, None, args, failures, case)
            print(f"  torch  {progress(results['torch'])}", flush=True)
            peer_out = None if results["torch"].get("errors") else peer_out
        if "meld" in args.impls:
            if moe is None:
                results["meld"] = {"errors": ["constructor failed"]}
            else:
                results["meld"], _ = measure("meld", partial(build_meld, inp, moe), ref, peer_out, args, failures,
                                             case)
            print(f"  meld   {progress(results['meld'])}", flush=True)
        if args.trace and moe is not None and not results["meld"].get("errors"):
            traced, trace_note = trace_case(shape, inp, args.trace, max_tokens, traced, trace_note)
        table.add(summarise(inp, results, ceilings, init_us))
        del inp, ref, peer_out
        free_cuda()
        if args.json:
            table.dump_json(args.json, env=env, ceilings=ceilings, args=vars(args), failures=failures)
    del w13, w2, moe, traced, meld_weights
    free_cuda()


def trace_case(shape: Shape, inp: Inputs, folder: Path, max_tokens: int, traced: Any, note: str | None
               ) -> tuple[Any, str | None]:
    """Write one case's timeline from a profiled module (built once per shape); print why not, once, if the
    operator has no trace. Returns the module and the note, for the next case of the shape."""
    if note is not None:
        return traced, note
    from meld import config

    try:
        folder.mkdir(parents=True, exist_ok=True)
        with config.scope(MELD_PROFILE="1", MELD_PROFILE_DIR=str(folder)):
            traced = new_meld_moe(shape, max_tokens, DEVICE) if traced is None else traced
            if not hasattr(traced, "last_trace"):
                note = "meld.MoE has no last_trace(): no per-SM timeline (skipped)"
            else:
                print("  trace: " + write_trace(traced, inp, folder).replace("\n", "\n         "), flush=True)
    except Exception as e:  # noqa: BLE001 - a trace is an extra; the numbers stand without it
        note = f"no per-SM timeline: {type(e).__name__}: {e}"
    if note is not None:
        print(f"  note: {note}", flush=True)
    return traced, note


def progress(r: dict[str, Any]) -> str:
    """One line per implementation while the run goes, so a run cut short still shows its numbers."""
    parts = timing_parts(r)
    for key, label in (("rel_err_ref", "rel err"), ("max_err_ref", "max err"), ("rel_err_torch", "vs torch")):
        if r.get(key):
            parts.append(f"{label} {worst(list(r[key].values())):.1e}")
    return ", ".join(parts + (["FAIL"] if r.get("errors") else []))


def summary_line(rows: Sequence[dict[str, Any]], failures: Sequence[str]) -> str:
    head, span = failure_head(failures), speedup_span(rows)
    if span is None:
        return f"summary: {head}; no meld-vs-torch ratio measured"
    best = min(((r["floor_ratio"], r["case"]) for r in rows if isinstance(r.get("floor_ratio"), float)),
               default=(math.nan, "-"))
    return (f"summary: meld vs torch grouped_mm {span}; meld closest to the weights-read floor at {best[0]:.2f}x "
            f"({best[1]}); {head}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.fp8:
        from bench import moe_fp8

        if args.dry_run:
            print("\n".join(moe_fp8.fp8_cases_line(SHAPES[s]) for s in args.shapes))
            return 0
        return moe_fp8.run(args)
    if args.dry_run:
        dry_run(args)
        return 0
    if not torch.cuda.is_available():
        print("moe.py needs a CUDA GPU (use --dry-run to list the cases)", file=sys.stderr)
        return 2

    env = env_info()
    env["commit"] = args.commit or env["commit"]
    failures: list[str] = []
    args.impls = preflight(args.impls, env, failures)
    print(env_line(env), flush=True)

    ceilings = measure_ceilings()
    print(ceilings_line(ceilings, matmul="bf16 matmul 8192^3"), flush=True)

    table, done, total = Table(COLUMNS), [0], len(cases_of(args))
    for name in args.shapes:
        run_shape(SHAPES[name], args, ceilings, table, env, failures, done, total)

    print()
    table.print()
    print("speedup = torch grouped_mm µs / meld µs (> 1: meld faster); %mma = meld TFLOP/s / bf16 matmul ceiling; "
          "floor = experts touched x 3·H·I·2 bytes / pure-read ceiling, meld/floor = meld µs / floor; "
          "rel err = meld's worst ‖out − ref‖/‖ref‖ over its call paths against float64, vs torch = against the "
          "peer; times are CUDA-graph replay medians (routing included), eager = one meld call with host launch")
    print(summary_line(table.rows, failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
