"""Shared-prefix (cascade) decode attention: FlashInfer's MultiLevelCascadeAttentionWrapper, meld's non-cascade
decode of the same batch, meld's cascade (the grouped-attention kernel), and the read floor of the unique bytes,
per BENCH.md ("Shared-prefix (cascade) decode").

Setup on the GPU machine (the peers travel as wheels in `.whl/`, see `../shared/tools/peer-wheels.sh`), from
the repository root:

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD:$PYTHONPATH FLASHINFER_CUDA_ARCH_LIST=9.0a
    PYTHONUNBUFFERED=1 python3 bench/cascade.py --json $OUT/cascade.json

`--dry-run` lists the cases and their sizes without a GPU; `--plan-host` times meld's plan() on the host, phase by
phase, also without one.

Workloads: Hq 32 / Hkv 8 / D 128, bf16, page_size 16, two levels (`meld.workloads.shared_prefix`): B requests
in G equal groups, each group sharing `prefix` tokens, each request `suffix` tokens of its own, pages from one
random permutation. BENCH.md's four one-group cases, then several groups (4, 16 and 64 requests each).
Every implementation is checked against float64 attention over each request's whole sequence before it is
timed (‖out − ref‖/‖ref‖ < 1e-2, no NaN, outputs poisoned first where it writes into a given buffer); device
time is the median of CUDA-graph replays with a cold L2 (`bench.harness`).

Columns: unique MiB = (G·prefix + B·suffix)·Hkv·D·2·2 bytes; floor µs = a pure read of those bytes;
speedup = FlashInfer cascade / meld cascade; vs flat = meld non-cascade / meld cascade (>= 1 is the issue's
bar); /floor = meld cascade / floor; meld-cascade-cta is the same operator with `split_stream="cta"` (a
request's own suffix streamed through the CTA's ring, the default until 2026-12-03), and cta/warp compares it;
meld-cascade-mma is the same operator with `prefix_mma="mma"` (a shared prefix's tasks on mma.sync, a warp's 16
rows at once, where the default is wgmma's warpgroup of 64), and mma/default compares it with the default;
the default counts a request's own suffix at its events, and merges those it completes, after its CTA's last task
(`defer_split_events`, the default since 2026-12-03's sixth session); meld-cascade-nodefer (run only when --impls
names it) is the same operator with `defer_split_events=False` (counts and merges after each task), and
nodefer/default compares it with the default; meld-cascade-direct (likewise opt-in) adds `direct_single_part=True`
(a split task that is its event's one part writes the output), direct/default. `--trace DIR`
also writes meld's cascade kernel's per-SM timeline of each case (a task's attention as "piece", the merges it
fired as "merge-hbm"; Chrome JSON + PNG).
"""
from __future__ import annotations

import os

os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")  # read when flashinfer is imported (lazily below)

import argparse
import math
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `bench` and `meld` import as-is
from meld import workloads  # noqa: E402
from bench.harness import (  # noqa: E402
    Column, Impl, Table, add_timing_args, ceilings_line, env_info, env_line, failure_head, free_cuda,
    host_time_us, keep_available, measure, measure_ceilings, median_us, progress, read_floor_us, result_cell,
    timed_reps, write_trace,
)

HQ, HKV, D, PAGE_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
IMPLS = ("meld-cascade", "meld-cascade-cta", "meld-cascade-mma", "meld-flat", "fi-cascade")
OPT_IN_IMPLS = ("meld-cascade-nodefer", "meld-cascade-direct")   # (not in the default run)
NODEFER, DIRECT = dict(defer_split_events=False), dict(direct_single_part=True)
FI_WORKSPACE_BYTES = 128 << 20


@dataclass(frozen=True)
class Case:
    batch: int
    prefix: int
    suffix: int
    groups: int = 1

    @property
    def name(self) -> str:
        return f"B={self.batch} prefix {self.prefix} suffix {self.suffix} groups {self.groups}"


# BENCH.md's one-group cases, then several groups (groups of 4, 16 and 64 requests).
CASES = (Case(64, 8192, 512), Case(256, 4096, 256), Case(16, 32768, 1024), Case(128, 1024, 2048),
         Case(64, 8192, 512, 4), Case(256, 2048, 64, 64), Case(128, 16384, 256, 2))


def unique_bytes(c: Case) -> int:
    return (c.groups * c.prefix + c.batch * c.suffix) * HKV * D * 2 * 2


@dataclass
class Inputs:
    case: Case
    batch: workloads.SharedPrefixBatch
    q: torch.Tensor          # [B, HQ, D]
    kv_cache: torch.Tensor   # [pages, 2, PAGE_SIZE, HKV, D], NHD


def make_inputs(case: Case, seed: int) -> Inputs:
    b = workloads.shared_prefix(case.batch, case.prefix, case.suffix, case.groups, PAGE_SIZE,
                                torch.Generator().manual_seed(seed))
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(case.batch, HQ, D, generator=g, dtype=DTYPE, device="cuda")
    kv = torch.randn(b.num_pages, 2, PAGE_SIZE, HKV, D, generator=g, dtype=DTYPE, device="cuda")
    return Inputs(case, b, q, kv)


def reference(inp: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention over each request's whole sequence (its flat page table), on the GPU."""
    from meld.runtime.reference import attention_reference

    f = inp.batch.flat
    return attention_reference(inp.q, inp.kv_cache, f.kv_indptr, f.kv_indices.to(inp.q.device), f.kv_last_page_len)


def build_meld_flat(inp: Inputs) -> Impl:
    """meld.DecodeAttention over the flat page tables: meld's non-cascade decode of the same batch."""
    import meld

    f, c = inp.batch.flat, inp.case
    t0 = time.perf_counter()
    attn = meld.DecodeAttention(HQ, HKV, D, PAGE_SIZE, DTYPE, "cuda", max_batch_size=c.batch,
                                max_num_pages=max(1, int(f.kv_indptr[-1])))
    init_us = (time.perf_counter() - t0) * 1e6

    def plan() -> None:
        attn.plan(f.kv_indptr, f.kv_indices, f.kv_last_page_len)

    first = host_time_us(plan, reps=1, min_reps=1)
    timing = host_time_us(plan, reps=50)
    out = torch.empty_like(inp.q)

    def outputs() -> list[tuple[str, torch.Tensor, Optional[torch.Tensor]]]:
        o = torch.full_like(inp.q, math.nan)
        lse = torch.full((c.batch, HQ), math.nan, dtype=torch.float32, device=inp.q.device)
        attn.run(inp.q, inp.kv_cache, return_lse=True, out=o, lse=lse)
        return [("run(out=, lse=)", o, lse)]

    return Impl(lambda: attn.run(inp.q, inp.kv_cache, out=out), outputs, timing, first.median_us, init_us)


def meld_cascade(inp: Inputs, **op_kw: Any) -> tuple[Any, list]:
    """meld.CascadeDecode for the case's two levels (`op_kw`: its keyword arguments, such as
    item_overhead_tokens), and its plan() arguments."""
    import meld

    lv = inp.batch.levels
    return meld.CascadeDecode(HQ, HKV, D, PAGE_SIZE, 2, DTYPE, "cuda", **op_kw), [[level[i] for level in lv]
                                                                                for i in range(4)]


def build_meld_cascade(inp: Inputs, **op_kw: Any) -> Impl:
    """meld.CascadeDecode: the grouped-attention kernel over the plan's task and event tables."""
    op, args = meld_cascade(inp, **op_kw)
    first = host_time_us(lambda: op.plan(*args), reps=1, min_reps=1)
    timing = host_time_us(lambda: op.plan(*args), reps=50)
    out = torch.empty_like(inp.q)

    def outputs() -> list[tuple[str, torch.Tensor, Optional[torch.Tensor]]]:
        o = torch.full_like(inp.q, math.nan)
        lse = torch.full((inp.case.batch, HQ), math.nan, dtype=torch.float32, device=inp.q.device)
        op.run(inp.q, inp.kv_cache, out=o, lse=lse)
        return [("run(out=, lse=)", o, lse)]

    return Impl(lambda: op.run(inp.q, inp.kv_cache, out=out), outputs, timing, first.median_us)


def build_fi_cascade(inp: Inputs) -> Impl:
    """FlashInfer 0.6.18's MultiLevelCascadeAttentionWrapper, two levels (its run() returns a new output)."""
    import flashinfer

    lv = inp.batch.levels
    wrapper = flashinfer.MultiLevelCascadeAttentionWrapper(
        2, torch.zeros(FI_WORKSPACE_BYTES, dtype=torch.uint8, device="cuda"), "NHD")

    def plan() -> None:
        wrapper.plan([level[0].cuda() for level in lv], [level[1].cuda() for level in lv],
                     [level[2].cuda() for level in lv], [level[3].cuda() for level in lv], HQ, HKV, D, PAGE_SIZE,
                     q_data_type=DTYPE, kv_data_type=DTYPE)

    first = host_time_us(plan, reps=1, min_reps=1)   # includes the JIT build on first use
    timing = host_time_us(plan, reps=10, max_s=1.0)
    return Impl(lambda: wrapper.run(inp.q, inp.kv_cache), lambda: [("run", wrapper.run(inp.q, inp.kv_cache), None)],
                timing, first.median_us)


BUILDERS = {"meld-cascade": build_meld_cascade, "meld-cascade-cta": partial(build_meld_cascade, split_stream="cta"),
            "meld-cascade-mma": partial(build_meld_cascade, prefix_mma="mma"),
            "meld-cascade-nodefer": partial(build_meld_cascade, **NODEFER),
            "meld-cascade-direct": partial(build_meld_cascade, **DIRECT),
            "meld-flat": build_meld_flat, "fi-cascade": build_fi_cascade}


def summarise(case: Case, results: dict[str, dict[str, Any]], floor_us: Optional[float]) -> dict[str, Any]:
    cell = partial(result_cell, results)

    def us(name: str) -> Optional[float]:
        r = results.get(name, {})
        return median_us(r) if r and not r.get("errors") and not r.get("skipped") else None

    mc, mt, mf, fi = us("meld-cascade"), us("meld-cascade-cta"), us("meld-flat"), us("fi-cascade")
    mm, md, mdd = us("meld-cascade-mma"), us("meld-cascade-nodefer"), us("meld-cascade-direct")
    return {
        "case": case.name, "B": case.batch, "prefix": case.prefix, "suffix": case.suffix, "groups": case.groups,
        "unique_mib": unique_bytes(case) / (1 << 20),
        "meld_cascade_us": cell("meld-cascade"), "meld_cta_us": cell("meld-cascade-cta"),
        "meld_mma_us": cell("meld-cascade-mma"), "meld_nodefer_us": cell("meld-cascade-nodefer"),
        "meld_direct_us": cell("meld-cascade-direct"),
        "meld_flat_us": cell("meld-flat"), "fi_us": cell("fi-cascade"),
        "floor_us": floor_us,
        "speedup": fi / mc if fi and mc else None, "vs_flat": mf / mc if mf and mc else None,
        "per_floor": mc / floor_us if mc and floor_us else None,
        "fi_per_floor": fi / floor_us if fi and floor_us else None,
        "flat_vs_fi": fi / mf if fi and mf else None,
        "warp_vs_cta": mt / mc if mc and mt else None,
        "mma_vs_default": mm / mc if mc and mm else None,
        "nodefer_vs_default": md / mc if mc and md else None,
        "direct_vs_default": mdd / mc if mc and mdd else None,
        "results": results,
    }


COLUMNS = [
    Column("B", "B"), Column("prefix", "prefix", "d"), Column("suffix", "suffix", "d"), Column("groups", "G", "d"),
    Column("unique_mib", "unique MiB", ".0f"), Column("meld_cascade_us", "meld cascade µs", ".1f"),
    Column("meld_cta_us", "meld cta µs", ".1f"), Column("meld_mma_us", "meld mma µs", ".1f"),
    Column("meld_nodefer_us", "meld nodefer µs", ".1f"), Column("meld_direct_us", "meld direct µs", ".1f"),
    Column("meld_flat_us", "meld flat µs", ".1f"),
    Column("fi_us", "FI cascade µs", ".1f"),
    Column("floor_us", "floor µs", ".1f"), Column("speedup", "speedup", ".2f"), Column("vs_flat", "vs flat", ".2f"),
    Column("per_floor", "/floor", ".2f"), Column("fi_per_floor", "FI/floor", ".2f"),
    Column("flat_vs_fi", "FI/flat", ".2f"), Column("warp_vs_cta", "cta/warp", ".2f"),
    Column("mma_vs_default", "mma/default", ".2f"), Column("nodefer_vs_default", "nodefer/default", ".2f"),
    Column("direct_vs_default", "direct/default", ".2f"),
]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, nargs="+", help=f"indices into the case list (0..{len(CASES) - 1})")
    p.add_argument("--impls", nargs="+", choices=IMPLS + OPT_IN_IMPLS, default=list(IMPLS))
    p.add_argument("--quick", action="store_true", help="30 replays")
    add_timing_args(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--commit", help="git commit to record when the repo's .git is not at hand")
    p.add_argument("--json", type=Path, help="write env, ceilings and every row here (rewritten after each case)")
    p.add_argument("--dry-run", action="store_true", help="list the cases and their sizes; no GPU needed")
    p.add_argument("--trace", type=Path, metavar="DIR", help="also write meld's cascade timeline per case here")
    p.add_argument("--item-overhead", type=int, metavar="TOKENS",
                   help="meld cascade's planner overhead per work item (CascadeDecode(item_overhead_tokens=))")
    p.add_argument("--merge-overhead", type=int, metavar="TOKENS",
                   help="and per request of an item (CascadeDecode(merge_overhead_tokens=))")
    p.add_argument("--rows-per-tile", type=int, metavar="ROWS",
                   help="query rows a token of an item costs one unit for (CascadeDecode(rows_per_tile=))")
    p.add_argument("--plan-host", action="store_true",
                   help="time meld cascade plan()'s host phases on the CPU (the device copy excluded); no GPU needed")
    args = p.parse_args(argv)
    if args.cases is not None and not all(0 <= i < len(CASES) for i in args.cases):
        p.error(f"--cases must be indices in 0..{len(CASES) - 1}, got {args.cases}")
    args.reps = timed_reps(args.reps, args.quick)
    return args


def trace_case(inp: Inputs, folder: Path, **op_kw: Any) -> str:
    """meld's cascade timeline of one case from a profiled operator (bench.harness.write_trace), or why not."""
    from meld import config

    try:
        folder.mkdir(parents=True, exist_ok=True)
        with config.scope(MELD_PROFILE="1"):
            op, args = meld_cascade(inp, **op_kw)
        op.plan(*args)
        out = torch.empty_like(inp.q)
        return write_trace(lambda: op.run(inp.q, inp.kv_cache, out=out), op, folder / f"cascade-B{inp.case.batch}-p{inp.case.prefix}-s{inp.case.suffix}-g{inp.case.groups}")
    except Exception as e:  # noqa: BLE001 - a trace is an extra; the numbers stand without it
        return f"no per-SM timeline: {type(e).__name__}: {e}"


def plan_host(cases: Sequence[Case], reps: int = 500) -> Table:
    """meld cascade plan()'s host phases per case, on the CPU (median µs of `reps` calls): the checks of the
    levels (plan() with the planner stubbed by the plan it makes), the planner, the packing of the device
    tables' image (what plan() on a GPU does before its one copy), and plan() whole on the CPU plus that
    packing. The copy itself is not timed."""
    import numpy as np

    import meld
    import meld.scheduler.split_reduce_plan as srp
    from meld.ops.base import grown
    from meld.ops.cascade_decode import _launch_need

    t = Table([Column("B", "B"), Column("prefix", "prefix", "d"), Column("suffix", "suffix", "d"),
               Column("groups", "G", "d"), Column("validate", "validate µs", ".1f"),
               Column("planner", "planner µs", ".1f"), Column("pack", "pack µs", ".1f"),
               Column("whole", "plan()+pack µs", ".1f")])
    for c in cases:
        b = workloads.shared_prefix(c.batch, c.prefix, c.suffix, c.groups, PAGE_SIZE, torch.Generator().manual_seed(0))
        op = meld.CascadeDecode(HQ, HKV, D, PAGE_SIZE, 2, DTYPE, "cpu")
        args = [[level[i] for level in b.levels] for i in range(4)]
        op.plan(*args)
        _, tables, plan = op.plan_tables
        order = [tables[name] for name in op.lowering.producers]
        layout = srp.LaunchLayout.of(grown({}, _launch_need(plan, order, False)))
        views = layout.views(np.zeros(layout.size, dtype=np.int32))

        def pack() -> int:
            need = _launch_need(plan, order, False)
            assert grown(layout.capacity, need) is None
            srp.write_launch_tables(views, plan, order)
            return layout.used(need)

        planner = srp.plan_split_reduce
        us = {"planner": lambda: planner(order, plan.batch, HKV, HQ // HKV, PAGE_SIZE, op.num_ctas, srp.SLICE_ROWS),
              "pack": pack, "whole": lambda: (op.plan(*args), pack())}
        row = {k: host_time_us(fn, reps=reps, max_s=10.0).median_us for k, fn in us.items()}
        srp.plan_split_reduce = lambda *_, **__: plan   # (the lowering looks its planner up at each call)
        try:
            row["validate"] = host_time_us(lambda: op.plan(*args), reps=reps, max_s=10.0).median_us
        finally:
            srp.plan_split_reduce = planner
        t.add({"B": c.batch, "prefix": c.prefix, "suffix": c.suffix, "groups": c.groups, **row})
    return t


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    cases = [CASES[i] for i in args.cases] if args.cases is not None else list(CASES)
    if args.plan_host:
        plan_host(cases).print()
        return 0
    if args.dry_run:
        t = Table([Column("B", "B"), Column("prefix", "prefix", "d"), Column("suffix", "suffix", "d"),
                   Column("groups", "G", "d"), Column("pages", "pages", "d"), Column("unique_mib", "unique MiB", ".0f"),
                   Column("flat_mib", "flat MiB", ".0f"), Column("runs", "runs", align="<")])
        for c in cases:
            b = workloads.shared_prefix(c.batch, c.prefix, c.suffix, c.groups, PAGE_SIZE)
            t.add({"B": c.batch, "prefix": c.prefix, "suffix": c.suffix, "groups": c.groups, "pages": b.num_pages,
                   "unique_mib": unique_bytes(c) / (1 << 20),
                   "flat_mib": sum(b.lengths) * HKV * D * 4 / (1 << 20),
                   "runs": " ".join(args.impls)})
        t.print()
        return 0
    if not torch.cuda.is_available():
        print("cascade.py needs a CUDA GPU (use --dry-run to list the cases)", file=sys.stderr)
        return 2
    env = env_info()
    env["commit"] = args.commit or env["commit"]
    failures: list[str] = []
    imports = {"meld-cascade": "meld", "meld-cascade-cta": "meld", "meld-cascade-mma": "meld",
               "meld-cascade-nodefer": "meld", "meld-cascade-direct": "meld", "meld-flat": "meld",
               "fi-cascade": "flashinfer"}
    args.impls = keep_available(args.impls, lambda n: __import__(imports[n]), failures,
                                why=lambda n: f"import {imports[n]} failed")
    print(env_line(env), flush=True)
    ceilings = measure_ceilings()
    print(ceilings_line(ceilings), flush=True)
    table = Table(COLUMNS)
    op_kw = {k: v for k, v in (("item_overhead_tokens", args.item_overhead),
                                ("merge_overhead_tokens", args.merge_overhead),
                                ("rows_per_tile", args.rows_per_tile)) if v is not None}
    builders = {**BUILDERS, "meld-cascade": partial(build_meld_cascade, **op_kw),
                "meld-cascade-cta": partial(build_meld_cascade, split_stream="cta", **op_kw),
                "meld-cascade-mma": partial(build_meld_cascade, prefix_mma="mma", **op_kw),
                "meld-cascade-nodefer": partial(build_meld_cascade, **NODEFER, **op_kw),
                "meld-cascade-direct": partial(build_meld_cascade, **DIRECT, **op_kw)}
    for i, case in enumerate(cases, 1):
        inp = make_inputs(case, args.seed)
        print(f"[{i}/{len(cases)}] {case.name}: {inp.batch.num_pages} pages, unique "
              f"{unique_bytes(case) / (1 << 20):.0f} MiB", flush=True)
        ref = reference(inp)
        results: dict[str, dict[str, Any]] = {}
        for name in args.impls:
            results[name] = measure(partial(builders[name], inp), f"{case.name} {name}", ref, args, failures, eager=False)
            print(f"  {name:12s} {progress(results[name])}", flush=True)
        if args.trace and "meld-cascade" in args.impls:
            print("  trace: " + trace_case(inp, args.trace, **op_kw).replace("\n", "\n         "), flush=True)
        floor_us = read_floor_us(unique_bytes(case), args.warmup, args.reps, not args.no_flush)
        table.add(summarise(case, results, floor_us))
        del inp, ref
        free_cuda()
        if args.json:
            table.dump_json(args.json, env=env, ceilings=ceilings, args=vars(args), failures=failures)
    print()
    table.print()
    print("speedup = FlashInfer cascade µs / meld cascade µs; vs flat = meld non-cascade µs / meld cascade µs; "
          "/floor = meld cascade µs / a pure read of the unique bytes; FI/flat = FlashInfer cascade µs / meld "
          "non-cascade µs; cta/warp = meld cascade-cta µs / meld cascade µs (> 1: the default warp build, split tasks "
          "through the warps' own rings, is faster); mma/default = meld cascade-mma µs / meld cascade µs (> 1: "
          "the default, the prefix tasks on wgmma, is faster); nodefer/default = meld cascade-nodefer µs / meld cascade "
          "µs (> 1: the default, deferring the split tasks' counts, is faster); direct/default likewise with meld "
          "cascade-direct")
    print(f"summary: {failure_head(failures)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
