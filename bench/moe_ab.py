"""meld.MoE under two kernel configurations, side by side in one run (a same-run A/B).

What it answers: what a change to the MoE kernel's static choices (`meld.codegen.moe_kernel.MoeKernelConfig`)
costs or gains. Both modules time every case in alternating rounds (the order flips each round, so drift
hits both) with the harness's one timer (CUDA-graph replay median, cold L2), after checking both outputs
against bench/moe.py's float64 reference; the weights-read floor (experts touched x their bytes / the
pure-read ceiling measured in the same run) puts each time against BENCH.md's bound.

    PYTHONPATH=$PWD python3 bench/moe_ab.py --new k_boxes=2 [--base k_boxes=1] [--shapes qwen3-30b-a3b ...]
                                            [--tokens 1 16 128] [--routing uniform] [--rounds 2]
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.harness import graph_time_us, print_aligned, read_ceiling_tbps
from bench.moe import DTYPE, RENORMALIZE, ROUTINGS, SHAPES, Case, errors, make_inputs, make_weights, reference_moe


def kernel_config(assignments: list[str]):
    """A MoeKernelConfig from `field=value` strings (ints and bools by the field's default)."""
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


def main() -> None:
    import meld

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", nargs="*", default=[], metavar="FIELD=VALUE")
    p.add_argument("--new", nargs="+", required=True, metavar="FIELD=VALUE")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128])
    p.add_argument("--routing", nargs="+", default=["uniform"], choices=ROUTINGS)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args()
    configs = {"base": kernel_config(args.base), "new": kernel_config(args.new)}
    read_tbps, _ = read_ceiling_tbps()
    rows = []
    for shape in (SHAPES[s] for s in args.shapes):
        w13, w2 = make_weights(shape, 0, "cuda")
        mods = {name: meld.MoE(shape.hidden, shape.inter, shape.experts, shape.top_k, dtype=DTYPE, device="cuda",
                               max_num_tokens=max(args.tokens), kernel_config=cfg) for name, cfg in configs.items()}
        for t in args.tokens:
            for routing in args.routing:
                inp = make_inputs(Case(shape, t, routing), w13, w2, 0, "cuda")
                ref = reference_moe(inp.x, w13, w2, inp.logits, shape.top_k, RENORMALIZE)
                for name, moe in mods.items():
                    rel, worst = errors(moe(inp.x, inp.logits, w13, w2), ref)
                    if not rel < 1e-2 or not worst < 2e-2:
                        raise SystemExit(f"{name} {inp.case.name}: relative error {rel:.2e}, max {worst:.2e}")
                del ref
                times: dict[str, list[float]] = {name: [] for name in mods}
                for r in range(args.rounds):
                    for name in (list(mods) if r % 2 == 0 else list(mods)[::-1]):
                        moe = mods[name]
                        times[name].append(graph_time_us(lambda: moe(inp.x, inp.logits, w13, w2),
                                                         reps=args.reps).median_us)
                base, new = (statistics.median(times[n]) for n in ("base", "new"))
                floor = inp.touched * shape.expert_bytes / (read_tbps * 1e12) * 1e6
                rows.append([inp.case.name, f"{base:.1f}", f"{new:.1f}", f"{new / base:.3f}", f"{floor:.1f}",
                             f"{base / floor:.2f}", f"{new / floor:.2f}"])
                print(f"{inp.case.name}: done", flush=True)
        del mods
        torch.cuda.empty_cache()
    print(f"base {configs['base']}\nnew  {configs['new']}\nread ceiling {read_tbps:.2f} TB/s")
    print_aligned(["case", "base µs", "new µs", "new/base", "floor µs", "base/floor", "new/floor"], rows)
    print(f"medians over {args.rounds} alternating rounds; new/base < 1: new faster")


if __name__ == "__main__":
    main()
