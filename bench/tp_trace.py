"""Where a row-parallel linear call's time goes, CTA by CTA, on every rank.

Runs `RowParallelLinear` built with per-CTA timestamps (`TpKernelConfig(profile=True)`, what MELD_PROFILE=1
builds) on a TP_SHAPES shape, each launch after an L2 flush with every rank started together, keeps the
launch with the median span per rank, prints per kind of record (a piece's GEMM, its partial staged, sent
and stamped, a merge team waiting for a chunk's partials and merging them, the direct path's exchange)
how many there were, their median and longest durations and when the last one ended, and writes each
rank's Chrome/Perfetto trace and PNG timeline. `--world 1 --slices 2` runs one GPU's share of a two-GPU
layer on a group of one rank (no link).

    PYTHONPATH=$PWD python3 bench/tp_trace.py --shape llama70b-o --tokens 1 512 --out $OUT/tp
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _rank(rank: int, world: int, slices: int, shape: str, tokens: list[int], runs: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from bench.dist import _warm_rank, tp_weights
    from bench.harness import flush_l2, print_aligned
    from meld.codegen.tp_kernel import TpKernelConfig
    from meld.distributed import RowParallelLinear
    from meld.runtime.profile import render_png

    dev = torch.device("cuda", rank)
    _warm_rank(dev)
    k, n, w_all, w, g = tp_weights(shape, rank, world, dev, slices)
    op = RowParallelLinear(k, n, max_tokens=max(tokens), kernel_config=TpKernelConfig(profile=True))
    for m in tokens:
        x = torch.randn(m, w_all.shape[1], generator=g, device=dev).to(torch.bfloat16)[:, rank * k:(rank + 1) * k]
        x = x.contiguous()
        traces = []
        for _ in range(runs):
            flush_l2()
            torch.cuda.synchronize()
            dist.barrier()
            op(x, w)
            traces.append(op.last_trace())
        trace = sorted(traces, key=lambda t: t.span_ns)[len(traces) // 2]
        sched, _, _, grid, direct = op._calls[m]
        rows = []
        for kind in sorted({t.kind for t in trace.tasks}, key=lambda k: min(t.end_ns for t in trace.tasks if t.kind == k)):
            ts = [t for t in trace.tasks if t.kind == kind]
            d = [(t.end_ns - t.start_ns) / 1e3 for t in ts]
            rows.append([kind, str(len(ts)), f"{statistics.median(d):.2f}", f"{max(d):.2f}",
                         f"{(max(t.end_ns for t in ts) - trace.start_ns) / 1e3:.2f}"])
        prefix = f"{out}-{shape}-M{m}-rank{rank}"
        Path(prefix).parent.mkdir(parents=True, exist_ok=True)
        trace.write_chrome(prefix + ".trace.json")
        render_png(trace, prefix + ".png")
        lines = [f"== {shape} M={m} rank {rank}/{world}: {sched.block_tokens} x {sched.cols} tiles, K in {sched.k_splits}, "
                 f"{sched.pieces} pieces on {grid} CTAs, {'direct' if direct else 'general'} path; span "
                 f"{trace.span_ns / 1e3:.2f} µs (median of {runs}); {prefix}.png"]
        for r in range(world):   # ranks print in turn
            dist.barrier()
            if r == rank:
                print("\n".join(lines), flush=True)
                print_aligned(["kind", "records", "median µs", "longest µs", "last ends at µs"], rows)
                sys.stdout.flush()
    dist.barrier()
    op.close()


def main() -> int:
    from bench.dist import TP_SHAPES
    from meld.distributed import spawn

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama70b-o", choices=list(TP_SHAPES))
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 512])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--slices", type=int, help="K cut into this many ranks' slices (default: --world)")
    p.add_argument("--runs", type=int, default=9)
    p.add_argument("--out", required=True, help="path prefix of the .trace.json and .png files")
    args = p.parse_args()
    if args.runs < 1 or min(args.tokens) < 1:
        p.error("--runs and --tokens must be positive")
    spawn(_rank, args.world, args.slices or args.world, args.shape, args.tokens, args.runs, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
