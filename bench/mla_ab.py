"""meld's MLA decode against an earlier meld (a base tree), on bench/mla.py's cases.

What it answers: what a change to the MLA kernel or its planning costs or gains, measured side by side in one
run: the base tree's package against this tree's, each in its own worker process (two copies of the package
cannot share one), in alternating rounds so drift hits both. Each side is checked against float64 (the bench's
checks: ‖out − ref‖/‖ref‖ < 1e-2, no NaN, lse) in the first round before it is timed, with the harness's one
timer (CUDA-graph replay median, cold L2).

    git archive <base-commit> meld | tar -x -C .ab/base        # on the machine that has the history
    PYTHONPATH=$PWD python3 bench/mla_ab.py --base .ab/base [--batches 16 64 128] [--dists skewed] [--json F]
                                            [--kv-dtype fp8] [--schedule seesaw] [--block-tokens 32]
                                            [--new-schedule halves] [--also NAME=TREE ...]

`--kv-dtype fp8` times the e4m3 build (`DecodeMLA(kv_dtype=torch.float8_e4m3fn)`) on bench/mla.py's FP8 inputs,
checked against float64 over the dequantised cache. `--schedule seesaw` times the seesaw build on both sides,
`--block-tokens 32` the bf16 build of 32-token blocks. `--new-schedule halves` times that build on the new side and
the --also trees, the base side keeps --schedule's (`--base .`: the halves against the split in one tree).
`--also q=.ab/q box=.ab/box` times more trees in the same rounds against the same base, a column each: several
candidates for one base run a round.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.ab_tree import (add_also_argument, add_tree_arguments, also_trees, report_new_over_base,  # noqa: E402
                           run_rounds, worker_tree_first)

worker_tree_first(REPO)


def worker(batches: list[int], dists: list[str], check: bool, seed: int, kv_dtype: str = "bf16",
           schedule: str = "", block_tokens: int = 0, num_stages: int = 0) -> dict[str, dict[str, float]]:
    """Time the meld on the path on bench/mla.py's cases (µs, graph replay median)."""
    import torch

    from bench.harness import check_impl, graph_time_us
    from bench.mla import Case, build_meld, make_inputs, reference

    times: dict[str, dict[str, float]] = {}
    for b in batches:
        for dist in dists:
            inp = make_inputs(Case(b, dist), seed, kv_dtype=kv_dtype)
            impl = build_meld(inp, schedule=schedule, fp8=kv_dtype == "fp8", block_tokens=block_tokens or None,
                              num_stages=num_stages)
            if check:
                _, _, problems = check_impl(impl, reference(inp))
                if problems:
                    raise SystemExit(f"{inp.case.name}: {'; '.join(problems)}")
            times[inp.case.name] = {"meld": graph_time_us(impl.run).median_us}
            inp = impl = None   # the next case's inputs need the memory
            torch.cuda.empty_cache()
    return times


def main() -> int:
    from bench.mla import ALL_DISTS, BATCHES, DISTS, KV_DTYPES   # (imports no meld)

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    p.add_argument("--dists", nargs="+", choices=ALL_DISTS, default=list(DISTS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="bf16", help="fp8: the e4m3 build (module doc)")
    p.add_argument("--schedule", choices=("split", "seesaw", "halves"), default="",
                   help="the build both sides time (MlaKernelConfig(schedule=...); default: the kernel's default)")
    p.add_argument("--new-schedule", choices=("split", "seesaw", "halves"),
                   help="the new side's and the --also trees' build in place of --schedule's (the base keeps it)")
    p.add_argument("--block-tokens", type=int, choices=(0, 32, 64), default=0,
                   help="the bf16 build's KV block on both sides (0: its default)")
    p.add_argument("--new-num-stages", type=int, default=0,
                   help="the new side's bf16 ring stages (MlaKernelConfig.num_stages; 0: its default); the base side "
                        "keeps its default, so --base . times a stage count against the default")
    p.add_argument("--num-stages", type=int, default=0, help=argparse.SUPPRESS)   # (a worker's: its side's)
    add_tree_arguments(p)
    add_also_argument(p)
    args = p.parse_args()
    if args.worker:
        Path(args.out).write_text(json.dumps(worker(args.batches, args.dists, args.check, args.seed, args.kv_dtype,
                                                    args.schedule, args.block_tokens, args.num_stages)))
        return 0
    sides = {"base": args.base, "new": REPO, **also_trees(args.also)}
    runs = run_rounds(list(sides), args.rounds, lambda side, r, out: [
        sys.executable, __file__, "--base", str(args.base), "--worker", str(sides[side]),
        "--batches", *map(str, args.batches), "--dists", *args.dists,
        "--seed", str(args.seed), "--kv-dtype", args.kv_dtype,
        *(["--schedule", sched] if (sched := args.new_schedule if side != "base" and args.new_schedule
                                    else args.schedule) else []),
        "--block-tokens", str(args.block_tokens), "--out", out,
        *(["--num-stages", str(args.new_num_stages)] if side == "new" and args.new_num_stages else []),
        *(["--check"] if r == 0 else [])])
    if runs is None:
        return 1
    report_new_over_base(runs, "meld", args.rounds, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
