"""The row-parallel linear against an earlier meld (a base tree), on the GPUs of one host.

What it answers: what a change to `RowParallelLinear` (templates/tp_linear.cuh) costs or gains, measured
side by side in one run: the base tree and the working tree each in their own worker processes (two copies
of the package cannot share one), in alternating rounds so that drift hits both. Each worker times, on
`--world` GPUs, meld, the same kernel on a group of one rank, and `matmul` + NCCL `all_reduce`, with the
harness's one timer (CUDA-graph replay median, cold L2, the slowest rank), after checking meld's output
against float64 in the first round (relative error < 1e-2, no NaN).

    git archive <base-commit> meld | tar -x -C .ab/base        # on the machine that has the history
    PYTHONPATH=$PWD python3 bench/tp_ab.py --base .ab/base [--shapes llama70b-o ...] [--tokens 1 16 ...]

`--world 1 --slices 2` times one GPU's share of a two-GPU layer (K cut in two) on a group of one rank: the
GEMM and the kernel's own merges without the link, where no second GPU is lent.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.ab_tree import add_tree_arguments, medians, run_rounds, worker_tree_first, write_runs  # noqa: E402

worker_tree_first(REPO)


def _rank(rank: int, world: int, slices: int, shapes: list[str], tokens: list[int], reps: int, check: bool,
          out: str) -> None:
    import torch
    import torch.distributed as dist

    from bench.dist import _warm_rank, tp_weights
    from bench.harness import graph_time_us
    from meld.distributed import RowParallelLinear

    dev = torch.device("cuda", rank)
    slowest = _warm_rank(dev)
    alone = [dist.new_group([r]) for r in range(world)]   # the same kernel on a group of one rank
    times: dict[str, dict[str, float]] = {}
    for shape in shapes:
        k, n, w_all, w, g = tp_weights(shape, rank, world, dev, slices)
        op = RowParallelLinear(k, n, max_tokens=max(tokens))
        solo = RowParallelLinear(k, n, max_tokens=max(tokens), group=alone[rank])
        for m in tokens:
            x_all = torch.randn(m, w_all.shape[1], generator=g, device=dev).to(torch.bfloat16)
            x = x_all[:, rank * k:(rank + 1) * k].contiguous()
            if check:
                op.output(m).fill_(math.nan)
                torch.cuda.synchronize()
                dist.barrier()
                y = op(x, w).clone()
                ref = x_all[:, :world * k].double() @ w_all[:, :world * k].double().T
                err = ((y.double() - ref).norm() / ref.norm()).item()
                if math.isnan(err) or err > 1e-2:
                    raise AssertionError(f"{shape} M={m} rank {rank}: relative error {err}")
                del ref
            base = torch.empty(m, n, dtype=torch.bfloat16, device=dev)

            def unfused():
                torch.matmul(x, w.T, out=base)
                dist.all_reduce(base)

            dist.barrier()
            t = {"meld": slowest(graph_time_us(lambda: op(x, w), reps=reps).median_us),
                 "one rank": slowest(graph_time_us(lambda: solo(x, w), reps=reps).median_us)}
            dist.barrier()
            t["unfused"] = slowest(graph_time_us(unfused, reps=reps).median_us)
            times[f"{shape} M={m}"] = t
        op.close()
        solo.close()
    if rank == 0:
        Path(out).write_text(json.dumps(times))


def worker(tree: Path, world: int, slices: int, shapes: list[str], tokens: list[int], reps: int, check: bool,
           out: str) -> None:
    from meld.distributed import spawn

    spawn(_rank, world, slices, shapes, tokens, reps, check, out)


def main() -> int:
    from bench.dist import TP_SHAPES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--slices", type=int, help="K cut into this many ranks' slices (default: --world)")
    p.add_argument("--shapes", nargs="+", default=list(TP_SHAPES), choices=list(TP_SHAPES))
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128, 200, 512, 1024])
    p.add_argument("--reps", type=int, default=30)
    add_tree_arguments(p)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.world, args.slices or args.world, args.shapes, args.tokens, args.reps, args.check,
               args.out)
        return 0
    from bench.harness import print_aligned   # (not in a worker: it imports meld before the worker's tree)

    trees = {"base": args.base, "new": REPO}
    runs = run_rounds(list(trees), args.rounds, lambda side, r, out: [
        sys.executable, __file__, "--base", str(args.base), "--worker", str(trees[side]), "--out", out,
        "--world", str(args.world), "--slices", str(args.slices or args.world), "--reps", str(args.reps),
        "--shapes", *args.shapes,
        "--tokens", *map(str, args.tokens), *(["--check"] if r == 0 else [])])
    if runs is None:
        return 1
    med = medians(runs)
    head = ["case", "base µs (1 rank)", "new µs (1 rank)", "unfused µs", "new/base", "unfused/new"]
    rows = []
    for case, new in med["new"].items():
        old = med["base"][case]
        unf = statistics.median([new["unfused"], old["unfused"]])
        rows.append([case, f"{old['meld']:.1f} ({old['one rank']:.1f})", f"{new['meld']:.1f} ({new['one rank']:.1f})",
                     f"{unf:.1f}", f"{new['meld'] / old['meld']:.3f}", f"{unf / new['meld']:.2f}"])
    print_aligned(head, rows)
    print(f"medians over {args.rounds} alternating rounds, {args.world} GPUs; new/base < 1: faster than base")
    write_runs(args.json, runs, med)
    return 0


if __name__ == "__main__":
    sys.exit(main())
