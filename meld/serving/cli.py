"""`meld serve-bench`'s arguments and their checks against this machine, registered by meld.cli.

Bad arguments, an unusable device or backend, and a pool the trace cannot fit end in one line on stderr
and exit status 2 (meld.cli's convention), before any measurement; a failed --check is exit status 1.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from .backends import BACKENDS, FLASHMLA_PAGE_SIZE, BackendUnavailable, unavailable
from .bench import CHECK_TOL, CHECK_TOL_FP8, BenchConfig, model_config, serve_bench as run, write_json
from .models import MODELS, MOE_DTYPES

MAX_BATCH = 1024


def _int_in(low: int, high: int):
    from meld.cli import _int_in

    return _int_in(low, high)


def _list_of(parse, what: str):
    """argparse type: a comma-separated list, each item through `parse`."""
    def parse_list(text: str) -> list:
        items = [t.strip() for t in text.split(",")]
        if not any(items):
            raise argparse.ArgumentTypeError(f"{text!r} names no {what}")
        if not all(items):   # ('1,,2' is not read as [1, 2]: an empty item is a typo, not nothing)
            raise argparse.ArgumentTypeError(f"{text!r} has an empty item (item {items.index('') + 1}); "
                                             f"give one {what} between each two commas")
        return [parse(t) for t in items]
    return parse_list


def _backend_name(text: str) -> str:
    if text not in BACKENDS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a backend ({', '.join(BACKENDS)})")
    return text


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number")
    return value


def add_parser(sub) -> argparse.ArgumentParser:
    """The serve-bench subcommand on meld's subparsers."""
    s = sub.add_parser("serve-bench", help="continuous-batching decode loop on a request trace, per attention backend",
                       description="A decode loop as serving engines run it (meld.serving): a Llama-, "
                                   "Qwen3-MoE- or DeepSeek-V3-style (MLA + MoE) model with random weights, a paged "
                                   "KV pool, continuous batching "
                                   "of a log-normal trace, plan() once per step, run() per layer, one CUDA graph "
                                   "per batch bucket. Prints tokens/s, step latency p50/p99 and attention's share "
                                   "of the step for each backend and max batch.")
    s.add_argument("--model", choices=list(MODELS), default="llama",
                   help="deepseek: MLA attention (backends meld, flashinfer, flashmla, sdpa) and MoE")
    s.add_argument("--backend", type=_list_of(_backend_name, "backend"), default=["meld"],
                   help="comma-separated: meld, flashinfer, flashinfer-tc (its tensor-core decode; not MLA), sdpa, "
                        "flashmla (MLA only); one whose package does not import is skipped, the reason printed")
    s.add_argument("--page-size", type=_int_in(0, 4096),
                   help=f"KV page size in tokens (default 16; {FLASHMLA_PAGE_SIZE} with flashmla, which runs no other)")
    s.add_argument("--max-batch", type=_list_of(_int_in(0, MAX_BATCH), "batch size"),
                   help="comma-separated max batch sizes (default 64 on a GPU, 4 on the CPU)")
    s.add_argument("--requests", type=_int_in(0, 1 << 20), help="requests in the trace (default 2 x max batch)")
    s.add_argument("--steps", type=_int_in(0, 1 << 20), help="decode steps measured (default 200; 12 on the CPU)")
    s.add_argument("--layers", type=_int_in(0, 1024), help="decoder layers (default 4, deepseek 2; 2 for --size tiny)")
    s.add_argument("--arrival-rate", type=_positive_float, help="requests arriving per step (default max batch / 4)")
    s.add_argument("--kv-pages", type=_int_in(1, 2 ** 31 - 1), help="KV pool pages (default 8192 tokens per batch slot)")
    s.add_argument("--moe", choices=["auto", "meld", "torch"], default="auto",
                   help="MoE layers: auto = meld's fused MoE on the meld backend, torch's grouped GEMM on the others")
    s.add_argument("--moe-dtype", choices=list(MOE_DTYPES), default="bf16",
                   help="the MoE models' experts: bf16, or fp8 (e4m3 with a float32 scale per 128 x 128 block, "
                        "DeepSeek-V3's): meld's MoE reads them as they are, torch's MoE their dequantised bf16")
    s.add_argument("--size", choices=["full", "tiny"], help="full: published shapes (GPU); tiny: for the CPU executor")
    s.add_argument("--eager", action="store_true", help="no CUDA graphs")
    s.add_argument("--check", action="store_true", help="compare the first steps' logits with the reference backend")
    s.add_argument("--check-steps", type=_int_in(0, 1000), default=4, help="steps compared by --check")
    s.add_argument("--check-tol", type=_positive_float,
                   help=f"largest relative L2 error of a step's logits (default {CHECK_TOL:g}; {CHECK_TOL_FP8:g} with "
                        "--moe-dtype fp8, whose MoE quantises its activations)")
    s.add_argument("--samples", type=_int_in(-1, 100000), default=16, help="steps whose attention is timed alone")
    s.add_argument("--seed", type=_int_in(-2 ** 63 - 1, 2 ** 64 - 2), default=1,   # seed and seed + 1 seed torch generators
                   help="trace seed (1: prompts are BENCH.md's skewed batch)")
    s.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda if a Hopper GPU is present)")
    s.add_argument("--json", type=Path, metavar="PATH", help="also write the rows as JSON")
    return s


def serve_bench(parser: argparse.ArgumentParser, args: argparse.Namespace, device: str) -> int:
    """Check the arguments against this machine (size, backends, files) before any work, then run.
    `device` is --device as meld.cli checked it."""
    size = args.size or ("full" if device != "cpu" else "tiny")
    if size == "full" and device == "cpu":
        parser.error("argument --size: 'full' needs a GPU (the CPU executor computes in float64, for tiny models); "
                     "use --size tiny")
    page_size = args.page_size or (FLASHMLA_PAGE_SIZE if "flashmla" in args.backend else 16)
    cfg = BenchConfig(model=args.model, size=size, layers=args.layers, backends=args.backend,
                      max_batches=args.max_batch or [64 if device != "cpu" else 4], requests=args.requests,
                      steps=args.steps, arrival_rate=args.arrival_rate, kv_pages=args.kv_pages, page_size=page_size,
                      graphs=not args.eager, moe=args.moe, moe_dtype=args.moe_dtype, check=args.check, check_steps=args.check_steps,
                      check_tol=args.check_tol, samples=args.samples, seed=args.seed, device=device)
    if args.moe_dtype != "bf16" and not MODELS[args.model]().is_moe:
        parser.error(f"argument --moe-dtype: {args.moe_dtype} experts need an MoE model (qwen3-moe, deepseek), "
                     f"got --model {args.model}")
    mc = model_config(cfg)
    for name in args.backend:
        why = unavailable(name, device, mc, page_size)   # a missing package: skipped
        if why:
            parser.error(f"argument --backend: {why}")
    if args.json is not None:
        from meld.cli import _check_output

        _check_output(parser, "argument --json", args.json)
    try:
        status, rows = run(cfg)
    except (BackendUnavailable, ValueError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    if args.json is not None:
        try:
            write_json(args.json, cfg, rows)
        except OSError as e:   # checked up front; this is what changed since (a full disk, a folder removed)
            parser.error(f"argument --json: cannot write {args.json}: {e.strerror or e}")
        print(f"wrote {args.json}")
    return status
