"""Where a cascade launch's time goes, task by task: per task class (a request's own suffix, at most 16 query
rows, against a shared level's slice of more), a least-squares fit of each task's duration as a fixed cost plus
a cost per KV token; the merges its tasks fired; each CTA's end and busy time. It is what the planner's cost
model (`meld.scheduler.split_reduce_plan`: item overhead, rows_per_tile, merge overhead) should agree with.

    MELD_PROFILE=1 python3 tools/cascade_tasks.py [--cases 0 3] [--split-stream warp|cta] [--prefix-mma mma|wgmma (default: the operator's)]
        [--json PATH]

On a GPU: bench/cascade.py's cases, each launch replayed in a CUDA graph with a cold L2, the median-span launch
of five analysed (`bench.harness.median_trace`; `summarise`, which the CPU tests exercise on synthetic traces).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@dataclass(frozen=True)
class ClassFit:
    name: str
    tasks: int
    fixed_us: float          # the fit's intercept
    ns_per_token: float      # and slope
    median_us: float
    total_us: float


def fit(durations_us: np.ndarray, tokens: np.ndarray) -> tuple[float, float]:
    """(fixed µs, ns a token) of duration = fixed + tokens * rate, least squares (rate 0 when every task has
    the same length)."""
    if len(set(tokens.tolist())) < 2:
        return float(np.median(durations_us)), 0.0
    a = np.vstack([np.ones_like(tokens, dtype=float), tokens.astype(float)]).T
    fixed, rate = np.linalg.lstsq(a, durations_us, rcond=None)[0]
    return float(fixed), float(rate * 1e3)


def summarise(trace, plan) -> dict:
    """The fits, merges and CTA times of one launch's `meld.runtime.profile.Trace` and its `SplitReducePlan`
    (a "piece" record's unit is its task's index; "merge-hbm" is the merging its arrival fired)."""
    t = plan.task_columns()
    rows = t["event_count"] * plan.group_size
    tokens = t["kv_end"] - t["kv_begin"]
    base = trace.start_ns
    pieces = [r for r in trace.tasks if r.kind == "piece"]
    out = {"span_us": trace.span_ns / 1e3, "tasks": int(plan.num_tasks), "classes": []}
    for name, keep in (("split (<= 16 rows)", rows <= 16), ("row block (> 16 rows)", rows > 16)):
        sel = [r for r in pieces if keep[r.unit]]
        if not sel:
            continue
        d = np.array([(r.end_ns - r.start_ns) / 1e3 for r in sel])
        n = np.array([tokens[r.unit] for r in sel])
        fixed, rate = fit(d, n)
        out["classes"].append(asdict(ClassFit(name, len(sel), fixed, rate, float(np.median(d)), float(d.sum()))))
    merges = np.array([(r.end_ns - r.start_ns) / 1e3 for r in trace.tasks if r.kind == "merge-hbm"])
    out["merges"] = {"n": int(merges.size), "median_us": float(np.median(merges)) if merges.size else 0.0,
                     "max_us": float(merges.max(initial=0.0)), "total_us": float(merges.sum())}
    ends = np.array(sorted((s.end_ns - base) / 1e3 for s in trace.cta_spans))
    busy: dict[int, float] = {}
    for r in trace.tasks:
        busy[r.cta] = busy.get(r.cta, 0.0) + (r.end_ns - r.start_ns) / 1e3
    b = np.array(list(busy.values()) or [0.0])
    out["cta_end_us"] = {"min": float(ends.min(initial=0.0)), "median": float(np.median(ends)) if ends.size else 0.0,
                         "max": float(ends.max(initial=0.0))}
    out["cta_busy_us"] = {"min": float(b.min()), "median": float(np.median(b)), "max": float(b.max())}
    return out


def report(name: str, s: dict) -> str:
    lines = [f"== {name}: span {s['span_us']:.1f} µs, {s['tasks']} tasks; CTAs end "
             f"{s['cta_end_us']['min']:.1f} / {s['cta_end_us']['median']:.1f} / {s['cta_end_us']['max']:.1f} µs "
             f"(min / median / max), busy median {s['cta_busy_us']['median']:.1f}"]
    for c in s["classes"]:
        lines.append(f"  {c['name']:22s} {c['tasks']:5d} tasks  {c['fixed_us']:6.2f} µs + {c['ns_per_token']:6.2f} ns/token"
                     f"  (median {c['median_us']:.2f} µs, total {c['total_us']:.0f} µs)")
    m = s["merges"]
    lines.append(f"  merges                 {m['n']:5d}        median {m['median_us']:.2f} µs, max {m['max_us']:.2f}, "
                 f"total {m['total_us']:.0f} µs")
    return "\n".join(lines)


def measure_case(op_and_args, inp, median_trace) -> dict:
    """One case planned and its median launch summarised (the operator goes when this returns)."""
    op, plan_args = op_and_args
    op.plan(*plan_args)
    return summarise(median_trace(lambda: op.run(inp.q, inp.kv_cache), op), op.plan_tables[2])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, nargs="+", default=[0, 3], help="indices into bench/cascade.py's cases")
    p.add_argument("--split-stream", choices=("warp", "cta"), default="warp")
    p.add_argument("--prefix-mma", choices=("mma", "wgmma"), default=None,
                   help="the build of a shared level's tasks (CascadeDecode(prefix_mma=))")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if os.environ.get("MELD_PROFILE") != "1":
        p.error("set MELD_PROFILE=1: the profiled build records the per-task times")
    from bench import cascade as bc
    from bench.harness import median_trace

    results = {}
    for i in args.cases:
        case = bc.CASES[i]
        inp = bc.make_inputs(case, 0)
        op = bc.meld_cascade(inp, split_stream=args.split_stream, prefix_mma=args.prefix_mma)
        results[case.name] = measure_case(op, inp, median_trace)
        print(report(f"{args.split_stream} {op[0].prefix_mma} {case.name}", results[case.name]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
