"""Where an MLA decode block's cycles go, role by role and phase by phase (issue 39: why meld's block takes 3.3 µs
where FlashMLA's takes 2.1; issue 41: why the FP8 build takes 1.8x the bf16 one).

    python3 tools/mla_phases.py [--batches 64 128] [--dists uniform2k] [--builds split seesaw halves fp8 fp8-s3] [--json PATH]

On a GPU, for each of bench/mla.py's cases and each build, the diagnostic build with phase stamps
(`MlaKernelConfig(profile=True, phases=True)`; templates/mla_decode.cuh, MLA_PHASES) is checked against float64,
replayed in a CUDA graph with a cold L2 (`bench.harness.median_trace`: the launch with the median span of five),
and its phase sums printed as cycles a block, the median over CTAs (`Trace.phase_table`), then as cycles a CTA,
min / median / max over CTAs, with the slowest CTA's, which bounds the launch (`Trace.phase_totals`). Roles: 0 the score
warpgroup (the seesaw's and the halves' warpgroup 0), 1 warpgroup 2 (their warpgroup 1), 2 the FP8 build's converting warps. Beside
them, the stamped build's graph time and the plain build's, which say what the stamps themselves cost.
Builds: split, seesaw, halves (the default bf16 build), fp8 (the e4m3 build), fp8-s3 (three converted stages).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BUILDS = {"split": {"schedule": "split"}, "seesaw": {"schedule": "seesaw"}, "halves": {"schedule": "halves"}, "fp8": {"fp8": True}, "fp8-s3": {"fp8": True, "num_stages": 3}}


def main(argv: list[str] | None = None) -> int:
    from bench.mla import ALL_DISTS, Case, build_meld, make_inputs, reference

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[64, 128])
    p.add_argument("--dists", nargs="+", default=["uniform2k"], choices=ALL_DISTS)
    p.add_argument("--builds", nargs="+", default=list(BUILDS), choices=list(BUILDS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write every case's phase sums and times here too")
    args = p.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("mla_phases: needs a GPU (the stamps are the kernel's)", file=sys.stderr)
        return 2
    from bench.harness import check_impl, graph_time_us, median_trace

    out = []
    for b in args.batches:
        for dist in args.dists:
            for build in args.builds:
                opts = BUILDS[build]
                inp = make_inputs(Case(b, dist), args.seed, kv_dtype="fp8" if opts.get("fp8") else "bf16")
                plain = build_meld(inp, **opts)
                plain_us = graph_time_us(plain.run).median_us
                plain = None
                stamped = build_meld(inp, **opts, phases=True)
                _, _, problems = check_impl(stamped, reference(inp))
                if problems:
                    raise SystemExit(f"{inp.case.name} {build}: {'; '.join(problems)}")
                stamped_us = graph_time_us(stamped.run).median_us
                tr = median_trace(stamped.run, stamped.op)
                print(f"== {inp.case.name} {build}: plain {plain_us:.1f} µs, stamped {stamped_us:.1f} µs, "
                      f"span {tr.span_ns / 1e3:.1f} µs")
                print(tr.phase_table())
                print(tr.phase_totals(), flush=True)
                out.append({"case": inp.case.name, "build": build, "plain_us": plain_us, "stamped_us": stamped_us,
                            "phases": [[x.cta, x.warpgroup, x.phase, x.cycles] for x in tr.phases]})
                inp = stamped = None
                torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
