"""meld's shared-prefix (cascade) decode against an earlier meld (a base tree), on bench/cascade.py's cases.

What it answers: what a change to the grouped-attention kernel or its planner costs or gains, measured side by
side in one run: the commit before it against the working tree, each in its own worker process (two copies of
the package cannot share one), in alternating rounds so drift hits both. Each side is checked against float64
(‖out − ref‖/‖ref‖ < 1e-2, no NaN, lse) in the first round before it is timed, with the harness's one timer
(CUDA-graph replay median, cold L2).

    git archive <base-commit> meld | tar -x -C .ab/base        # on the machine that has the history
    PYTHONPATH=$PWD python3 bench/cascade_ab.py --base .ab/base [--cases 0 1 5] [--new-op warps=4] [--json F]

`--new-op NAME=VALUE ...`: CascadeDecode keyword arguments of the new side only (a config the base may not know);
`--base .` then times this tree against itself with them.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.ab_tree import add_tree_arguments, report_new_over_base, run_rounds, worker_tree_first  # noqa: E402

worker_tree_first(REPO)


def op_kwargs(items: list[str]) -> dict[str, object]:
    """NAME=VALUE pairs as CascadeDecode keywords: integers, True/False, else strings."""
    out: dict[str, object] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.isidentifier():
            raise SystemExit(f"--new-op {item!r}: expected NAME=VALUE")
        out[name] = {"True": True, "False": False}.get(value, int(value) if value.lstrip("-").isdigit() else value)
    return out


def worker(cases: list[int], check: bool, seed: int, op_kw: dict[str, object]) -> dict[str, dict[str, float]]:
    """Time the meld on the path on bench/cascade.py's `cases` (µs, graph replay median), CascadeDecode(**op_kw)."""
    import torch

    from bench.cascade import CASES, build_meld_cascade, make_inputs, reference
    from bench.harness import check_output, graph_time_us

    times: dict[str, dict[str, float]] = {}
    for i in cases:
        inp = make_inputs(CASES[i], seed)
        impl = build_meld_cascade(inp, **op_kw)
        if check:
            ref = reference(inp)
            for label, out, lse in impl.outputs():
                _, _, problems = check_output(out, ref[0], lse, ref[1])
                if problems:
                    raise SystemExit(f"{CASES[i].name}, {label}: {'; '.join(problems)}")
        times[CASES[i].name] = {"cascade": graph_time_us(impl.run).median_us}
        inp = impl = None   # the next case's inputs need the memory
        torch.cuda.empty_cache()
    return times


def main() -> int:
    from bench.cascade import CASES   # (imports no meld)

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, nargs="+", default=list(range(len(CASES))),
                   help=f"indices into bench/cascade.py's cases (0..{len(CASES) - 1})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--new-op", nargs="*", default=[], metavar="NAME=VALUE",
                   help="CascadeDecode keyword arguments of the new side (module doc)")
    p.add_argument("--op", nargs="*", default=[], help=argparse.SUPPRESS)   # (a worker's: its side's keywords)
    add_tree_arguments(p)
    args = p.parse_args()
    if bad := [i for i in args.cases if not 0 <= i < len(CASES)]:
        p.error(f"--cases {bad}: the cases are 0..{len(CASES) - 1}")
    if args.worker:
        Path(args.out).write_text(json.dumps(worker(args.cases, args.check, args.seed, op_kwargs(args.op))))
        return 0
    op_kwargs(args.new_op)   # (a malformed pair fails here, before any worker starts)
    sides = {"base": args.base, "new": REPO}
    runs = run_rounds(list(sides), args.rounds, lambda side, r, out: [
        sys.executable, __file__, "--base", str(args.base), "--worker", str(sides[side]),
        "--cases", *map(str, args.cases),
        "--seed", str(args.seed), "--out", out, *(["--check"] if r == 0 else []),
        *(["--op", *args.new_op] if side == "new" and args.new_op else [])])
    if runs is None:
        return 1
    report_new_over_base(runs, "cascade", args.rounds, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
