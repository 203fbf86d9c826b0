"""What sampled profiling costs decode attention (issue 15): profiling off, a profiled kernel recording one
launch in N (`MELD_PROFILE_EVERY=N`: the timed replays are almost all unsampled), and one recording every
launch, on the same plan, in interleaved rounds of CUDA-graph replays (bench/harness.py's timer, L2 flushed).
The overhead at 1-in-N is (unsampled - off) + (every - off) / N.

    python3 bench/profile_overhead.py [--every 100] [--rounds 5] [--reps 60]
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CASES = [("skewed", 64), ("uniform2k", 64), ("one-long", 64), ("skewed", 256), ("uniform2k", 256)]
HQ, HKV, D, P = 32, 8, 128, 16


def main() -> None:
    import meld
    from bench.harness import graph_time_us
    from meld import config
    from meld.codegen import DecodeKernelConfig
    from meld.workloads import lengths, paged

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=60)
    a = ap.parse_args()
    dev = "cuda"
    x = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    for _ in range(200):   # clocks up
        x @ x
    base = DecodeKernelConfig.default("bfloat16", D)
    print(f"decode attention, Hq={HQ} Hkv={HKV} D={D}, bf16; µs, median round of {a.rounds} (each the median of "
          f"{a.reps} graph replays)")
    print(f"case | off | profiled, unsampled (1 in {a.every}) | every launch | overhead at 1 in {a.every}")
    for name, B in CASES:
        pb = paged(lengths(name, B), P)
        kv = torch.randn(pb.num_pages, 2, P, HKV, D, device=dev).bfloat16()
        q = torch.randn(B, HQ, D, device=dev).bfloat16()
        ops = {}
        for label, profile, every in (("off", False, 1), ("sampled", True, a.every), ("every", True, 1)):
            with config.scope(MELD_PROFILE_EVERY=str(every)):
                op = meld.DecodeAttention(HQ, HKV, D, P, torch.bfloat16, dev,
                                          kernel_config=dataclasses.replace(base, profile=profile))
            op.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
            ops[label] = op
        t: dict[str, list[float]] = {k: [] for k in ops}
        for _ in range(a.rounds):
            for k, op in ops.items():
                t[k].append(graph_time_us(lambda op=op: op.run(q, kv), reps=a.reps).median_us)
        med = {k: sorted(v)[len(v) // 2] for k, v in t.items()}
        over = (med["sampled"] - med["off"]) + (med["every"] - med["off"]) / a.every
        print(f"{name} B={B} | {med['off']:.2f} | {med['sampled']:.2f} | {med['every']:.2f} | "
              f"{over / med['off']:+.2%}")


if __name__ == "__main__":
    main()
