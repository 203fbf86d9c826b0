"""meld's decode kernel under different static configs and cost models, on BENCH.md's decode grid.

What it answers: which kernel config (ring depth, TMA or cp.async loads) and which planner cost
parameters to ship as defaults (`DecodeKernelConfig.default`, `DecodeCost`). meld only — the peers are
in bench/decode.py; every variant runs on the same inputs in one process, timed with the same
CUDA-graph replay timer.

    PYTHONPATH=$PWD python3 bench/decode_sweep.py [--batch 64 256] [--json $OUT/sweep.json]

`--q-len N` (N > 1) sweeps the multi-token builds instead (Hq 32 / Hkv 8: 4 N rows a kv head; the 32-row variants
apply at N 5-8): 16-row units (two KV reads at N 8), and 32-row units of four, six and eight warps merging all
rows at once or 8 or 16 rows a pass (`DecodeKernelConfig.merge_rows`); the shipped default is `default`. With
`--costs` it sweeps the planner's cost model over the default build instead (`MULTI_COSTS`: fewer, longer pieces
where a batch is small, e.g. B = 1).

`--kv-dtype fp8` sweeps the builds over an e4m3 cache (per-tensor scales; `FP8_VARIANTS`: warps and ring depth
over the default FP8 build, whose rings hold as many bytes in flight per warp as the 16-bit build's and which was
never swept): whether more warps or deeper rings lift it towards the read ceiling; and (`FP8_COSTS`) the planner's
cost model with its token counts doubled: they were fitted on 16-bit caches, where a token is twice an FP8 one's
bytes, so over FP8 a piece's fixed cost is worth twice the tokens.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import meld  # noqa: E402
from bench.decode import BATCHES, DISTS, KV_FP8, PAGE_SIZE, Q_LEN, Case, Inputs, make_inputs  # noqa: E402
from bench.harness import Column, Table, env_info, graph_time_us  # noqa: E402
from meld.codegen import DecodeKernelConfig  # noqa: E402
from meld.scheduler import DecodeCost  # noqa: E402

VARIANTS = {  # name: (warps, stages, cost, TMA rings); o = item overhead tokens (shipped: o128, 2 stages)
    "o64": (8, 2, DecodeCost(item_overhead_tokens=64), False),
    "o96": (8, 2, DecodeCost(item_overhead_tokens=96), False),
    "o128": (8, 2, DecodeCost(), False),
    "o128 tma": (8, 2, DecodeCost(), True),
    "o128 tma s3": (8, 3, DecodeCost(), True),
}

# --q-len N: name -> DecodeKernelConfig fields over the default multi-token build (swept as "default" beside them)
MULTI_VARIANTS = {
    "h16": dict(heads_per_unit=16, num_warps=8, num_stages=2, merge_rows=0),
    "h32 s3": dict(heads_per_unit=32, num_warps=8, num_stages=3, merge_rows=8),
    "h32 w6 s3": dict(heads_per_unit=32, num_warps=6, num_stages=3, merge_rows=8),
    "h32 w4 s4": dict(heads_per_unit=32, num_warps=4, num_stages=4, merge_rows=0),
    "tma": dict(tma=True),
    "h16 tma": dict(heads_per_unit=16, num_warps=8, num_stages=2, merge_rows=0, tma=True),
}


# --kv-dtype fp8: name -> DecodeKernelConfig fields over the default FP8 build (swept as "default" beside them)
FP8_VARIANTS = {
    "w8 s4": dict(num_warps=8, num_stages=4),
    "w8 s5": dict(num_warps=8, num_stages=5),
    "w10 s3": dict(num_warps=10, num_stages=3),
    "w12 s2": dict(num_warps=12, num_stages=2),
    "w12 s3": dict(num_warps=12, num_stages=3),
    "w8 s3 tma": dict(num_warps=8, num_stages=3, tma=True),
}


# --kv-dtype fp8: name -> DecodeCost fields over the default cost model, on the default FP8 build
FP8_COSTS = {
    "o256": dict(item_overhead_tokens=256),
    "o256 m256": dict(item_overhead_tokens=256, min_split_tokens=256, min_cta_tokens=256),
}


def fp8_configs() -> dict[str, DecodeKernelConfig]:
    """The --kv-dtype fp8 sweep's builds: the default FP8 build (e4m3 cache, bf16 q: as DecodeAttention builds it,
    read on the CPU, which compiles nothing) and FP8_VARIANTS over it."""
    base = meld.DecodeAttention(32, 8, 128, PAGE_SIZE, torch.bfloat16, "cpu", kv_dtype=torch.float8_e4m3fn).kernel_config
    return {"default": base, **{name: dataclasses.replace(base, **f) for name, f in FP8_VARIANTS.items()}}


# --q-len N --costs: name -> DecodeCost fields over the default build's cost model (swept as "default" beside them)
MULTI_COSTS = {
    "cta256": dict(min_cta_tokens=256),
    "cta512": dict(min_cta_tokens=512),
    "cta1024": dict(min_cta_tokens=1024),
    "cta512 o512": dict(min_cta_tokens=512, item_overhead_tokens=512),
}


def multi_token_costs(q_len: int) -> dict[str, DecodeCost]:
    """The --costs sweep's cost models for the default build at `q_len`."""
    cfg = DecodeKernelConfig.default("bfloat16", 128, group_size=4, q_len=q_len)
    base = DecodeCost.default(cfg.heads_per_unit)
    return {"default": base, **{name: dataclasses.replace(base, **f) for name, f in MULTI_COSTS.items()}}


def multi_token_configs(q_len: int) -> dict[str, DecodeKernelConfig]:
    """The --q-len sweep's builds: 32-row variants only where a kv head has more than 16 rows, and none that is
    the default or an earlier variant again."""
    base = DecodeKernelConfig.default("bfloat16", 128, group_size=4, q_len=q_len)
    out = {"default": base}
    for name, fields in MULTI_VARIANTS.items():
        cfg = dataclasses.replace(base, **fields)
        if cfg not in out.values() and (fields.get("heads_per_unit") != 32 or 4 * q_len > 16):
            out[name] = cfg
    return out


def time_variants(attns: dict[str, meld.DecodeAttention], inp: Inputs) -> dict[str, float]:
    """Plan and run every variant on `inp`, check it computes what the first one does, and time it
    (CUDA-graph replay median, µs). The variants stay planned for `inp` afterwards."""
    base, times = None, {}
    for name, attn in attns.items():
        t = inp.table
        attn.plan(t.indptr, t.indices, t.last_page_len)
        out = torch.full_like(inp.q, float("nan"))
        cache, scales = ((inp.kv_fp8, dict(k_scale=inp.k_scale, v_scale=inp.v_scale)) if inp.kv_fp8 is not None
                         else (inp.kv_cache, {}))
        attn.run(inp.q, cache, out=out, **scales)
        base = out.double() if base is None else base   # every variant must compute the same thing
        err = ((out.double() - base).norm() / base.norm()).item()
        if not err < 1e-2:
            raise SystemExit(f"{name} on {inp.case.name}: differs from {next(iter(attns))} by {err:.1e}")
        times[name] = graph_time_us(lambda: attn.run(inp.q, cache, out=out, **scales)).median_us
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=list(BATCHES))
    p.add_argument("--json", type=Path)
    p.add_argument("--q-len", type=int, default=1, choices=range(1, 9), help="new tokens per request (module doc)")
    p.add_argument("--costs", action="store_true", help="with --q-len: sweep cost models, not builds")
    p.add_argument("--kv-dtype", choices=["bf16", "fp8"], default="bf16", help="fp8: sweep FP8_VARIANTS (module doc)")
    p.add_argument("--variants", nargs="+", help="only these variants (and the first, which the others are checked "
                   "against)")
    args = p.parse_args()
    Q_LEN[0] = args.q_len   # (make_inputs draws q for B * q_len rows)
    fp8 = args.kv_dtype == "fp8"
    KV_FP8[0] = torch.float8_e4m3fn if fp8 else None   # (make_inputs then adds the e4m3 cache and its scales)
    if fp8 and (args.q_len > 1 or args.costs):
        p.error("--kv-dtype fp8 sweeps q_len 1 builds only")
    if fp8:
        cfgs = fp8_configs()
        options = {name: dict(kernel_config=cfg) for name, cfg in cfgs.items()}
        options.update({name: dict(kernel_config=cfgs["default"], cost=dataclasses.replace(DecodeCost(), **f))
                        for name, f in FP8_COSTS.items()})
    elif args.q_len > 1 and args.costs:
        options = {name: dict(cost=cost) for name, cost in multi_token_costs(args.q_len).items()}
    elif args.q_len > 1:
        options = {name: dict(kernel_config=cfg) for name, cfg in multi_token_configs(args.q_len).items()}
    else:
        options = {name: dict(cost=cost, kernel_config=DecodeKernelConfig("bfloat16", 128, w, s, tma=tma))
                   for name, (w, s, cost, tma) in VARIANTS.items()}
    if args.variants:
        if unknown := set(args.variants) - set(options):
            p.error(f"--variants: {sorted(unknown)} are not among {list(options)}")
        first = next(iter(options))
        options = {k: o for k, o in options.items() if k == first or k in args.variants}
    attns = {name: meld.DecodeAttention(32, 8, 128, PAGE_SIZE, torch.bfloat16, "cuda", q_len=args.q_len,
                                        kv_dtype=KV_FP8[0], **o)
             for name, o in options.items()}
    names = list(attns)
    print("env: " + ", ".join(f"{k}={v}" for k, v in env_info().items()))
    print("CTAs/SM: " + ", ".join(f"{k} {a.topology.ctas_per_sm}" for k, a in attns.items()), flush=True)
    table = Table([Column("case", "case", align="<")] + [Column(k, f"{k} µs", ".1f") for k in names]
                  + [Column("best", "best", align="<")])
    for b in args.batch:
        for dist in DISTS:
            row = {"case": f"B={b} {dist}", **time_variants(attns, make_inputs(Case(b, dist)))}
            row["best"] = min(names, key=lambda k: row[k])
            table.add(row)
            print(f"  {row['case']}: " + ", ".join(f"{k} {row[k]:.1f}" for k in names), flush=True)
    table.print()
    if args.json:
        table.dump_json(args.json, env=env_info())
    return 0


if __name__ == "__main__":
    sys.exit(main())
