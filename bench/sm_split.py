"""The adaptive compute/communication split (meld.distributed.sm_split) against fixed splits, in modelled time
on the CPU: no GPU, and no measurement of one. Each case is one GPU's tasks of a fused kernel (GEMM tiles, and
one transfer of a tile's bytes each) on 132 CTA slots: `produce` (a tile is sent once computed: GEMM +
reduce-scatter), `consume` (a tile is computed once its data has landed: dispatch + GEMM) or `none`. The
costs are assumptions, printed with the table, not H200 measurements: a slot moves `--slot-gbs` (the bytes a
CTA keeps in flight over a round trip), every transfer pays `--latency-us`, the link carries `--link-gbs`.

    python3 bench/sm_split.py [--slots 132] [--link-gbs 300] [--slot-gbs 20] [--latency-us 2]
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.harness import print_aligned  # noqa: E402
from meld.distributed.sm_split import SlotCosts, SplitWorkload, best_fixed, simulate  # noqa: E402

# (tiles, compute µs a tile, KiB a tile, dependency)
CASES = [(1024, 20.0, 32, "produce"), (1024, 5.0, 128, "produce"), (4096, 8.0, 32, "produce"),
         (2048, 2.0, 64, "produce"), (1024, 20.0, 32, "consume"), (1024, 5.0, 128, "consume"),
         (4096, 8.0, 32, "consume"), (512, 40.0, 64, "consume"), (2048, 10.0, 32, "none")]
FIXED = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--slots", type=int, default=132)
    p.add_argument("--link-gbs", type=float, default=300.0)
    p.add_argument("--slot-gbs", type=float, default=20.0)
    p.add_argument("--latency-us", type=float, default=2.0)
    p.add_argument("--start", type=int, default=8, help="the adaptive runs' first target")
    args = p.parse_args()
    fixed = [n for n in FIXED if n < args.slots]
    rows, worst = [], {n: 1.0 for n in fixed}
    ratios = []
    t0 = time.perf_counter()
    for tiles, us, kib, dep in CASES:
        costs = SlotCosts(us * 1e-6, args.latency_us * 1e-6, args.slot_gbs * 1e9, args.link_gbs * 1e9)
        order = tuple(range(tiles))
        work = SplitWorkload(tiles, (kib << 10,) * tiles, comm_after=order if dep == "produce" else None,
                             compute_after=order if dep == "consume" else None)
        best, span, spans = best_fixed(work, costs, args.slots, fixed)
        for n, t in spans.items():
            worst[n] = max(worst[n], t / span)
        run = simulate(work, costs, args.slots, args.start)
        ratios.append(run.makespan / span)
        last = [t for _, t in run.targets]
        rows.append([f"{tiles} x {us:g} µs, {kib} KiB, {dep}", str(best), f"{span * 1e6:.1f}",
                     f"{spans[args.start] * 1e6:.1f}" if args.start in spans else "-", f"{run.makespan * 1e6:.1f}",
                     f"{run.makespan / span:.3f}", f"{min(last)}-{max(last)}"])
    print(f"model: {args.slots} slots, link {args.link_gbs:g} GB/s, a slot {args.slot_gbs:g} GB/s, "
          f"{args.latency_us:g} µs a transfer (assumed costs; modelled time, not measured)")
    print_aligned(["case", "best fixed", "its µs", f"fixed {args.start} µs", "adaptive µs", "adaptive/best",
                   "targets"], rows)
    print("each fixed split's worst over the cases (its µs / the best fixed µs): "
          + ", ".join(f"{n}: {w:.2f}" for n, w in worst.items()))
    print(f"adaptive (from {args.start}) / best fixed: geomean {math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f},"
          f" max {max(ratios):.3f}; fixed splits tried: {fixed}; {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
