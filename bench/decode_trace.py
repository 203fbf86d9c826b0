"""Per-SM timeline of one decode batch: where the kernel's time goes, SM by SM.

Replays meld's kernel built with per-task timestamps (`DecodeKernelConfig.profile`, what MELD_PROFILE=1
builds) in a CUDA graph on one BENCH.md case with a cold L2, keeps the launch with the median span, and
writes its Chrome/Perfetto trace and a PNG timeline (`meld timeline` renders the same from the JSON).
It also times the unprofiled kernel with the CUDA-graph timer, so the trace's span can be compared with
the time the benchmarks report (the difference is launch latency and the profiling itself).

    PYTHONPATH=$PWD python3 bench/decode_trace.py --batch 64 --dist skewed --out $OUT/b64-skewed

`--q-len N` traces the multi-token build of N new tokens a request instead (Hq 32 / Hkv 8: 4 N rows a kv head).
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import meld  # noqa: E402
from bench.decode import PAGE_SIZE, Q_LEN, Case, make_inputs  # noqa: E402
from bench.harness import flush_l2, graph_time_us  # noqa: E402
from meld.codegen import DecodeKernelConfig  # noqa: E402
from meld.runtime.cuda_graphs import capture  # noqa: E402
from meld.runtime.profile import render_png  # noqa: E402
from meld.scheduler import DecodeCost  # noqa: E402


def cfg_name(attn: meld.DecodeAttention) -> str:
    c = attn.kernel_config
    return f"{c.heads_per_unit}-row units, {c.num_warps} warps, {c.num_stages} stages"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--dist", default="skewed")
    p.add_argument("--cluster", type=int, default=meld.ops.decode_attention.DEFAULT_CLUSTER_SIZE)
    p.add_argument("--hbm", action="store_true", help="merge every split unit through global memory")
    p.add_argument("--item-overhead", type=int, help="the planner's item overhead in KV tokens (default: "
                   "DecodeCost.default for the build's unit size)")
    p.add_argument("--q-len", type=int, default=1, choices=range(1, 9), help="new tokens per request")
    p.add_argument("--runs", type=int, default=9)
    p.add_argument("--warm-code", action="store_true", help="before each traced launch, after the L2 flush, run the "
                   "same build on another batch of the case (its own cache and plan): the kernel's code is then in L2, "
                   "its data is not")
    p.add_argument("--out", type=Path, required=True, help="path prefix of the .trace.json and .png")
    args = p.parse_args()
    Q_LEN[0] = args.q_len   # (make_inputs draws q for B * q_len rows)
    inp = make_inputs(Case(args.batch, args.dist))
    t = inp.table

    def op(profile: bool, t=t) -> meld.DecodeAttention:
        cfg = dataclasses.replace(DecodeKernelConfig.default("bfloat16", 128, onchip_merge=args.cluster > 1 and not
                                                             args.hbm, group_size=4, q_len=args.q_len), profile=profile)
        cost = DecodeCost.default(cfg.heads_per_unit) if args.item_overhead is None else \
            DecodeCost(item_overhead_tokens=args.item_overhead)
        a = meld.DecodeAttention(32, 8, 128, PAGE_SIZE, torch.bfloat16, "cuda", kernel_config=cfg,
                                 cluster_size=args.cluster, cost=cost, q_len=args.q_len)
        a.plan(t.indptr, t.indices, t.last_page_len)
        return a

    plain, prof = op(False), op(True)
    out = torch.empty_like(inp.q)
    graph_us = graph_time_us(lambda: plain.run(inp.q, inp.kv_cache, out=out)).median_us
    # replay a CUDA graph, as the benchmarks time it (no host gaps between grids)
    graph, _ = capture(lambda: prof.run(inp.q, inp.kv_cache, out=out))
    if args.warm_code:
        other = make_inputs(Case(args.batch, args.dist))
        warm, other_out = op(True, other.table), torch.empty_like(other.q)
    traces = []
    for _ in range(args.runs):
        flush_l2()
        if args.warm_code:
            warm.run(other.q, other.kv_cache, out=other_out)
        graph.replay()
        traces.append(prof.last_trace())
    traces.sort(key=lambda tr: tr.span_ns)
    tr = traces[len(traces) // 2]
    print(f"B={args.batch} {args.dist}, q_len {args.q_len}, {cfg_name(prof)}, clusters {prof.cluster_mix}, "
          f"{'global-memory' if args.hbm else 'on-chip'} merges{', code warmed in L2' if args.warm_code else ''}")
    print(f"unprofiled kernel, CUDA-graph replay: {graph_us:.1f} µs; profiled spans over {args.runs} runs: "
          f"median {tr.span_ns / 1e3:.1f} µs (min {traces[0].span_ns / 1e3:.1f}, max {traces[-1].span_ns / 1e3:.1f})")
    starts = [c.begin_ns - tr.start_ns for c in tr.cta_spans]
    print(f"CTA start skew: median {statistics.median(starts) / 1e3:.2f} µs, max {max(starts) / 1e3:.2f} µs")
    print(tr.summary())
    print(tr.busy_table())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    print(f"wrote {tr.write_chrome(args.out.with_suffix('.trace.json'))} and "
          f"{render_png(tr, args.out.with_suffix('.png'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
