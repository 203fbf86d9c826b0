"""Ablation of meld's decode kernel: thread-block cluster sizes and merge paths (meld only).

What it answers: does covering every SM with a mix of cluster sizes beat one fixed size, and do on-chip
merges (distributed shared memory inside a cluster) beat merges through global memory? Every variant
runs on the same inputs, checked against the first, and is timed with the same CUDA-graph replay timer
(cold L2) as bench/decode.py:

  c1       clusters of 1 on every SM; every split unit merges through global memory (the issue-2 kernel)
  c2       clusters of 2 (they cover every SM of an H200), on-chip merges
  c4-only  clusters of 4 only: the SMs they cannot cover stay idle, on-chip merges
  c4       clusters of 4 plus smaller ones on the SMs left (`Topology.cluster_mix(4)`), on-chip merges
  c4-flat  the same, but the planner ignores the clusters (no two-level placement: cluster_snap_tokens=0)
  c4-hbm   the same mix, every split unit merged through global memory
  c8       `Topology.cluster_mix(8)`, on-chip merges

For each variant: time, CTAs launched (one per SM), and KiB of partials written to global memory.

    PYTHONPATH=$PWD python3 bench/decode_ablation.py [--batch 8 64] [--json $OUT/ablation.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import meld  # noqa: E402
from bench.decode import BATCHES, DISTS, PAGE_SIZE, Case, make_inputs  # noqa: E402
from bench.decode_sweep import time_variants  # noqa: E402
from bench.harness import Column, Table, env_info  # noqa: E402
from meld.codegen import DecodeKernelConfig  # noqa: E402
from meld.scheduler import DecodeCost, Topology  # noqa: E402

VARIANTS = {  # name: (preferred cluster size, on-chip merges, only clusters of the preferred size, two-level)
    "c1": (1, False, False, True), "c2": (2, True, False, True), "c4-only": (4, True, True, True),
    "c4": (4, True, False, True), "c4-flat": (4, True, False, False), "c4-hbm": (4, False, False, True),
    "c8": (8, True, False, True),
}
HEAD_DIM = 128


def build(name: str, topo: Topology) -> meld.DecodeAttention:
    size, onchip, only, two_level = VARIANTS[name]
    if only:   # drop the smaller sizes: the planner then spreads the work over these CTAs alone
        n = topo.max_active_clusters[size]
        topo = Topology(topo.sm_count, {1: size * n, size: n})
    cfg = dataclasses.replace(DecodeKernelConfig.default("bfloat16", HEAD_DIM), onchip_merge=onchip)
    return meld.DecodeAttention(32, 8, HEAD_DIM, PAGE_SIZE, torch.bfloat16, "cuda", kernel_config=cfg,
                                topology=topo, cluster_size=size,
                                cost=DecodeCost() if two_level else DecodeCost(cluster_snap_tokens=0))


def hbm_partial_kib(attn: meld.DecodeAttention) -> float:
    onchip = attn.kernel_config.onchip_merge
    paths = attn.schedule.merge_paths(attn._launcher.cluster_of_cta() if onchip else None)
    return paths["hbm_partial_rows"] * (HEAD_DIM + 1) * 4 / 1024


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=list(BATCHES))
    p.add_argument("--dist", nargs="+", default=list(DISTS))
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    probe = meld.DecodeAttention(32, 8, HEAD_DIM, PAGE_SIZE, torch.bfloat16, "cuda")
    topo = probe.topology
    attns = {name: build(name, topo) for name in VARIANTS}
    print("env: " + ", ".join(f"{k}={v}" for k, v in env_info().items()))
    print(f"topology: {topo.sm_count} SMs, max active clusters {topo.max_active_clusters}")
    print("launches: " + "; ".join(f"{k} {a.cluster_mix} = {a.topology.num_ctas} CTAs" for k, a in attns.items()),
          flush=True)
    table = Table([Column("case", "case", align="<")] + [Column(k, f"{k} µs", ".1f") for k in VARIANTS]
                  + [Column("best", "best", align="<")] + [Column(f"{k} KiB", f"{k} KiB", ".0f") for k in VARIANTS])
    for b in args.batch:
        for dist in args.dist:
            row = {"case": f"B={b} {dist}", **time_variants(attns, make_inputs(Case(b, dist)))}
            row.update({f"{name} KiB": hbm_partial_kib(attn) for name, attn in attns.items()})
            row["best"] = min(VARIANTS, key=lambda k: row[k])
            table.add(row)
            print(f"  {row['case']}: " + ", ".join(f"{k} {row[k]:.1f}" for k in VARIANTS), flush=True)
    table.print()
    if args.json:
        table.dump_json(args.json, env=env_info(), topology=topo.max_active_clusters)
    return 0


if __name__ == "__main__":
    sys.exit(main())
