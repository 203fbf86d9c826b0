"""How well the decode planner's cost model predicts per-CTA time, today and after fitting it to traces.

For each BENCH.md case with B >= 64 (32/8/128, page 16), meld's kernel built with per-task timestamps
replays the case `--launches` times from a CUDA graph with a cold L2, after one untimed replay; each
launch's schedule and trace give one sample per CTA (`meld.tuning.cost_fit`). (The untimed replay: the
first launch after the process frees device memory runs 11-14% slower, every CTA alike, because
unmapping invalidates the GPU's address translations: bench/RESULTS.md 2026-11-30. It says nothing of
the plan.) Launches are split by index: every third one is held out, the rest fit. Per case, on the
held-out launches, the p50 and p90 of |predicted - measured| / measured per CTA for:
  today      the shipped model (tokens + item_overhead_tokens per item) with its time scale fitted
  fit        per-token, per-item, per-merge and fixed costs, fitted (Huber) on every case's training launches
  fit+mix    the same and the launch's mean tokens, items and merges per CTA (the CTAs share the bandwidth)
  fit+SM     `fit` with one speed factor per SM
The fitted constants are printed; `fit`'s item cost in tokens is what `DecodeCost.item_overhead_tokens`
would take.

    PYTHONPATH=$PWD python3 bench/cost_fit.py --json $OUT/cost_fit.json
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import meld  # noqa: E402
from bench.decode import PAGE_SIZE, Case, make_inputs  # noqa: E402
from bench.harness import Column, Table, env_info, env_line, flush_l2  # noqa: E402
from meld.codegen import DecodeKernelConfig  # noqa: E402
from meld.runtime.cuda_graphs import capture  # noqa: E402
from meld.tuning import concat, cta_samples, errors, fit_cost, today  # noqa: E402

CASES = [(b, d) for b in (64, 256) for d in ("uniform2k", "skewed", "one-long")]


def record(case: Case, launches: int):
    """(schedule, trace) of each launch of the case, replayed from a graph after an L2 flush."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()   # the previous case's memory (its graph's pool) unmapped now, not between launches
    inp = make_inputs(case)
    t = inp.table
    cfg = dataclasses.replace(DecodeKernelConfig.default("bfloat16", case.head_dim), profile=True)
    attn = meld.DecodeAttention(case.num_qo_heads, case.num_kv_heads, case.head_dim, PAGE_SIZE, torch.bfloat16,
                                "cuda", kernel_config=cfg)
    attn.plan(t.indptr, t.indices, t.last_page_len)
    out = torch.empty_like(inp.q)
    graph, _ = capture(lambda: attn.run(inp.q, inp.kv_cache, out=out))
    flush_l2()
    graph.replay()   # untimed: translations refilled after the frees before it (module docstring)
    runs = []
    for _ in range(launches):
        flush_l2()
        graph.replay()
        runs.append((attn.schedule, attn.last_trace()))
    return attn.cost, runs


def pct(e: np.ndarray) -> tuple[float, float]:
    return float(np.percentile(e, 50)) * 100, float(np.percentile(e, 90)) * 100


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--launches", type=int, default=9)
    p.add_argument("--json", type=Path)
    p.add_argument("--dry-run", action="store_true", help="list the cases; no GPU needed")
    a = p.parse_args(argv)
    print(f"cases: {', '.join(f'B={b} {d}' for b, d in CASES)}; {a.launches} launches each, every third held out")
    if a.dry_run:
        return 0
    env = env_info()
    print(env_line(env))
    per_case, cost = {}, None
    for b, d in CASES:
        cost, runs = record(Case(b, d), a.launches)
        per_case[(b, d)] = concat([cta_samples(s, tr, launch=i) for i, (s, tr) in enumerate(runs)])
    train = concat([s.where(s.launch % 3 != 0) for s in per_case.values()])
    fits = {"today": today(train, cost), "fit": fit_cost(train), "fit+mix": fit_cost(train, mix=True),
            "fit+SM": fit_cost(train, per_sm=True)}
    table = Table([Column("B", "B"), Column("dist", "dist", align="<"), Column("ctas", "CTA samples")]
                  + [c for k in fits for c in (Column(f"{k}_p50", f"{k} p50 %", ".1f"),
                                               Column(f"{k}_p90", f"{k} p90 %", ".1f"))])
    held = []
    for (b, d), s in per_case.items():
        test = s.where(s.launch % 3 == 0)
        held.append(test)
        row = dict(B=b, dist=d, ctas=len(test))
        for k, f in fits.items():
            row[f"{k}_p50"], row[f"{k}_p90"] = pct(errors(f, test))
        table.add(row)
    allheld = concat(held)
    row = dict(B="all", dist="", ctas=len(allheld))
    for k, f in fits.items():
        row[f"{k}_p50"], row[f"{k}_p90"] = pct(errors(f, allheld))
    table.add(row)
    print(table.render())
    for (b, d), s in per_case.items():   # a launch slower than the rest, every CTA alike, is not the plan's doing
        medians = [float(np.median(s.time_ns[s.launch == i])) / 1e3 for i in range(a.launches)]
        print(f"B={b} {d}: median CTA time per launch (µs) " + " ".join(f"{m:.1f}" for m in medians))
    for k, f in fits.items():
        speeds = sorted(f.sm_speed.values()) if f.sm_speed else []
        spread = f", SM speed p10 {np.percentile(speeds, 10):.3f} p90 {np.percentile(speeds, 90):.3f}" if speeds else ""
        mix = (f", launch means: {f.mix_token_ns:.3f} ns/token, {f.mix_item_ns:.0f} ns/item, {f.mix_merge_ns:.0f} "
               "ns/merge" if k == "fit+mix" else "")
        print(f"{k}: {f.per_token_ns:.3f} ns/token, {f.per_item_ns:.0f} ns/item ({f.item_overhead_tokens:.0f} tokens), "
              f"{f.per_merge_ns:.0f} ns/merge, {f.fixed_ns:.0f} ns fixed{mix}{spread}")
    if a.json:
        table.dump_json(a.json, env=env, fits={k: dataclasses.asdict(f) for k, f in fits.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
