"""meld.MoE against another meld.MoE, side by side in one run (a same-run A/B): a base tree (an earlier
commit's package) or the same tree, each under its own kernel configuration.

What it answers: what a change to the MoE kernel (its source, or its static choices,
`meld.codegen.moe_kernel.MoeKernelConfig`) costs or gains. Each side runs in its own worker process (two
copies of the package cannot share one), in alternating rounds so that drift hits both, timing every case
with the harness's one timer (CUDA-graph replay median, cold L2) after checking its output against
bench/moe.py's float64 reference (first round). The weights-read floor (experts touched x their bytes /
the pure-read ceiling, measured in each worker) puts each time against BENCH.md's bound.

    git archive <base-commit> meld | tar -x -C .ab/base        # on the machine that has the history
    PYTHONPATH=$PWD python3 bench/moe_ab.py --base-tree .ab/base [--tokens 1 16 128] [--shapes ...]
    PYTHONPATH=$PWD python3 bench/moe_ab.py --base-tree .ab/base --new-tree .ab/new    # two other trees
    PYTHONPATH=$PWD python3 bench/moe_ab.py --new k_boxes=2 [--base k_boxes=1]     # configs, this tree
    PYTHONPATH=$PWD python3 bench/moe_ab.py --new packed_weights=1    # weights packed by meld.pack_moe_weights
    PYTHONPATH=$PWD python3 bench/moe_ab.py --base-tree .ab/base --fp8 --tokens 128 1024 8192   # block-scaled FP8

`--fp8`: both sides run block-scaled FP8 experts (bench/moe_fp8.py's: bench/moe.py's weights quantised once to
e4m3 with a float32 scale per 128 x 128 block), checked against float64 over the dequantised weights (bench/moe_fp8.py's
tolerances), the floor over the e4m3 bytes and their scales.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.ab_tree import add_round_arguments, medians, run_rounds, worker_tree_first  # noqa: E402

worker_tree_first(REPO)


def kernel_config(assignments: list[str]):
    """A MoeKernelConfig from `field=value` strings (ints and bools by the field's default)."""
    import dataclasses

    from meld.codegen.moe_kernel import MoeKernelConfig

    fields = {f.name: f for f in dataclasses.fields(MoeKernelConfig)}
    values = {}
    for a in assignments:
        name, _, text = a.partition("=")
        if name not in fields or not text:
            raise SystemExit(f"{a!r}: expected field=value with a field of {sorted(fields)}")
        default = fields[name].default
        values[name] = text.lower() in ("1", "true") if isinstance(default, bool) else type(default)(text)
    return MoeKernelConfig(**values)


def worker(tree: Path, config: list[str], shapes: list[str], tokens: list[int], routings: list[str], reps: int,
           check: bool, out: str, fp8: bool = False) -> None:
    """Time the meld in `tree` under `config` on every case; write {case: {"us", "floor_us"}} to `out`."""
    import torch

    import meld
    from bench.harness import graph_time_us, read_ceiling_tbps
    from bench.moe import DTYPE, RENORMALIZE, SHAPES, Case, errors, make_inputs, make_weights, reference_moe

    if fp8 and config:
        raise SystemExit("--fp8 compares trees under the layer's own FP8 builds: no --base / --new configs")
    cfg = None if fp8 else kernel_config(config)
    read_tbps, _ = read_ceiling_tbps()
    res = {}
    for shape in (SHAPES[s] for s in shapes):
        w13, w2 = make_weights(shape, 0, "cuda")
        if fp8:   # the layer's experts block-scaled e4m3 (its own variants' token blocks), the reference's dequantised
            from bench.moe_fp8 import FP8, MAX_TOL, REL_TOL, fp8_bytes, reference
            from meld.runtime.moe_reference import quantize_blocks

            (q13, s13), (q2, s2) = quantize_blocks(w13), quantize_blocks(w2)
            args, kw, tol, expert_bytes = (q13, q2), dict(w13_scale=s13, w2_scale=s2), (REL_TOL, MAX_TOL), fp8_bytes(shape)
            moe = meld.MoE(shape.hidden, shape.inter, shape.experts, shape.top_k, device="cuda",
                           max_num_tokens=max(tokens), weight_dtype=FP8)
            ref_of = lambda inp: reference(inp.x, q13, s13, q2, s2, inp.logits, shape.top_k)   # noqa: E731
        else:
            # packed_weights=1: the layer gets its weights packed (meld.pack_moe_weights), the reference plain
            args = meld.pack_moe_weights(w13, w2) if getattr(cfg, "packed_weights", False) else (w13, w2)
            kw, tol, expert_bytes = {}, (1e-2, 2e-2), shape.expert_bytes
            moe = meld.MoE(shape.hidden, shape.inter, shape.experts, shape.top_k, dtype=DTYPE, device="cuda",
                           max_num_tokens=max(tokens), kernel_config=cfg)
            ref_of = lambda inp: reference_moe(inp.x, w13, w2, inp.logits, shape.top_k, RENORMALIZE)   # noqa: E731
        for t in tokens:
            for routing in routings:
                inp = make_inputs(Case(shape, t, routing), w13, w2, 0, "cuda")
                if check:
                    rel, worst = errors(moe(inp.x, inp.logits, *args, **kw), ref_of(inp))
                    if not rel < tol[0] or not worst < tol[1]:
                        raise SystemExit(f"{inp.case.name}: relative error {rel:.2e}, max {worst:.2e}")
                us = graph_time_us(lambda: moe(inp.x, inp.logits, *args, **kw), reps=reps).median_us
                res[inp.case.name] = {"us": us, "floor_us": inp.touched * expert_bytes / (read_tbps * 1e6)}
        moe = args = None
        torch.cuda.empty_cache()
    Path(out).write_text(json.dumps(res))


def main() -> int:
    from bench.moe import ROUTINGS, SHAPES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-tree", type=Path, default=REPO, help="a tree holding the base commit's `meld` package")
    p.add_argument("--new-tree", type=Path, default=REPO, help="the new side's tree (default: this checkout)")
    p.add_argument("--base", nargs="*", default=[], metavar="FIELD=VALUE", help="the base side's kernel config")
    p.add_argument("--new", nargs="*", default=[], metavar="FIELD=VALUE", help="this tree's kernel config")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128])
    p.add_argument("--routing", nargs="+", default=["uniform"], choices=ROUTINGS)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--fp8", action="store_true", help="block-scaled FP8 experts on both sides (module doc)")
    p.add_argument("--config", nargs="*", default=[], help=argparse.SUPPRESS)
    add_round_arguments(p)
    args = p.parse_args()
    common = ["--shapes", *args.shapes, "--tokens", *map(str, args.tokens), "--routing", *args.routing,
              "--reps", str(args.reps), *(["--fp8"] if args.fp8 else [])]
    if args.worker:
        worker(args.worker, args.config, args.shapes, args.tokens, args.routing, args.reps, args.check, args.out,
               args.fp8)
        return 0
    if args.base_tree.resolve() == args.new_tree.resolve() and args.base == args.new:
        p.error("nothing to compare: give --base-tree, or --base / --new configs that differ")
    from bench.harness import print_aligned   # (not in a worker: it imports meld before the worker's tree)

    sides = {"base": (args.base_tree, args.base), "new": (args.new_tree, args.new)}
    runs = run_rounds(list(sides), args.rounds, lambda side, r, out: [
        sys.executable, __file__, "--worker", str(sides[side][0]), "--config", *sides[side][1], "--out", out, *common,
        *(["--check"] if r == 0 else [])])
    if runs is None:
        return 1
    med = medians(runs)
    rows = []
    for case in med["new"]:
        base, new = med["base"][case]["us"], med["new"][case]["us"]
        floor = statistics.median(run[case]["floor_us"] for n in runs for run in runs[n])
        rows.append([case, f"{base:.1f}", f"{new:.1f}", f"{new / base:.3f}", f"{floor:.1f}", f"{base / floor:.2f}",
                     f"{new / floor:.2f}"])
    print(f"base: {args.base_tree} {' '.join(args.base) or '(default config)'}; "
          f"new: {args.new_tree} {' '.join(args.new) or '(default config)'}")
    print_aligned(["case", "base µs", "new µs", "new/base", "floor µs", "base/floor", "new/floor"], rows)
    print(f"medians over {args.rounds} alternating rounds; new/base < 1: new faster")
    return 0


if __name__ == "__main__":
    sys.exit(main())
