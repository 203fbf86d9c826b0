"""meld against an earlier meld (a base tree), and meld's own variants, on BENCH.md's decode grid.

What it answers: what a change costs or gains, measured side by side in one run — the commit before it
against the working tree, each in its own worker process (two copies of the package cannot share one),
in alternating rounds so drift hits both; and, inside the new tree's worker, variants of one operator
(the HND cache layout, K and V in two allocations, batch-invariant plans with several chunk sizes) against its default. Every
variant is checked against float64 (‖out − ref‖/‖ref‖ < 1e-2, no NaN) before it is timed, with the
harness's one timer (CUDA-graph replay median, cold L2).

    git archive <base-commit> meld | tar -x -C .ab/base        # on the machine that has the history
    PYTHONPATH=$PWD python3 bench/decode_ab.py --base .ab/base [--variants default hnd inv1024] [--kv-dtype fp8] [--json F]

`--kv-dtype fp8` (or e5m2) times an FP8 cache as bench/decode.py's does (per-tensor k_scale and v_scale; checked
against float64 over the dequantised cache).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.ab_tree import add_tree_arguments, medians, run_rounds, worker_tree_first, write_runs  # noqa: E402

worker_tree_first(REPO)
VARIANTS = {   # name: DecodeAttention options; "chunk" sets the cost model's invariant_chunk_tokens
    "default": {},
    "hnd": {"kv_layout": "HND"},
    "separate": {"separate": True},   # K and V in two allocations (SGLang's per-layer buffers): run(q, (k, v))
    "inv512": {"batch_invariant": True, "chunk": 512},
    "inv1024": {"batch_invariant": True, "chunk": 1024},
    "inv1536": {"batch_invariant": True, "chunk": 1536},
    "inv2048": {"batch_invariant": True, "chunk": 2048},
}
FP8_DTYPES = {"fp8": "float8_e4m3fn", "e5m2": "float8_e5m2"}   # --kv-dtype: torch's names (torch loads in the worker)
CASES = [(b, d) for b in (1, 8, 64, 256) for d in ("uniform2k", "skewed", "one-long") if (b, d) != (1, "one-long")]


def worker(tree: Path, variants: list[str], cases: list[tuple[int, str]], check: bool,
           q_len: int = 1, kv_dtype: str | None = None) -> dict[str, dict[str, float]]:
    """Time `variants` of the meld in `tree` on `cases` at `q_len` new tokens a request (µs, graph replay median),
    over a 16-bit cache or (`kv_dtype`) an FP8 one."""
    import torch

    import meld
    from bench.decode import KV_FP8, PAGE_SIZE, Q_LEN, Case, make_inputs, reference
    from bench.harness import check_output, graph_time_us

    Q_LEN[0] = q_len   # (make_inputs draws q for B * q_len rows; the reference masks causally)
    KV_FP8[0] = getattr(torch, FP8_DTYPES[kv_dtype]) if kv_dtype else None   # (make_inputs then draws the FP8 cache and its scales)

    times: dict[str, dict[str, float]] = {}
    for b, dist in cases:
        inp = make_inputs(Case(b, dist))
        c, t = inp.case, inp.table
        ref = reference(inp) if check else None
        hnd = None
        for name in variants:
            opts = dict(VARIANTS[name])
            chunk = opts.pop("chunk", None)
            separate = opts.pop("separate", False)
            make = lambda **kw: meld.DecodeAttention(c.num_qo_heads, c.num_kv_heads, c.head_dim, PAGE_SIZE,  # noqa: E731
                                                     torch.bfloat16, "cuda", max_batch_size=b,
                                                     max_num_pages=t.num_pages, q_len=q_len, kv_dtype=KV_FP8[0],
                                                     **opts, **kw)
            op = make()
            if chunk:
                op = make(cost=dataclasses.replace(op.cost, invariant_chunk_tokens=chunk))
            kv, scales = (inp.kv_fp8, dict(k_scale=inp.k_scale, v_scale=inp.v_scale)) if kv_dtype else (inp.kv_cache, {})
            if opts.get("kv_layout") == "HND":
                hnd = kv.transpose(2, 3).contiguous() if hnd is None else hnd
                kv = hnd
            if separate:
                kv = (inp.kv_cache[:, 0].contiguous(), inp.kv_cache[:, 1].contiguous())
            op.plan(t.indptr, t.indices, t.last_page_len)
            out = torch.full_like(inp.q, float("nan"))
            lse = torch.full(inp.q.shape[:2], float("nan"), device="cuda")
            op.run(inp.q, kv, out=out, lse=lse, **scales)
            if check:
                err, _, problems = check_output(out, ref[0], lse, ref[1])
                if problems:
                    raise SystemExit(f"{name} on B={b} {dist}: {'; '.join(problems)}")
            times.setdefault(f"B={b} {dist}", {})[name] = graph_time_us(partial(op.run, inp.q, kv, out=out,
                                                                                **scales)).median_us
        inp = ref = hnd = op = kv = None   # the next case's inputs need the memory
        torch.cuda.empty_cache()
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--batch", type=int, nargs="+", help="batch sizes (default: 1 8 64 256)")
    p.add_argument("--q-len", type=int, default=1, help="new tokens per request (multi-token decode)")
    p.add_argument("--kv-dtype", choices=list(FP8_DTYPES), help="an FP8 cache (default: bf16)")
    add_tree_arguments(p, required=False)
    args = p.parse_args()
    cases = [c for c in CASES if args.batch is None or c[0] in args.batch]
    args.variants = ["default"] + [v for v in args.variants if v != "default"]   # the ratios' denominator
    if args.kv_dtype and (bad := [v for v in args.variants if v in ("hnd", "separate")]):
        p.error(f"--kv-dtype {args.kv_dtype} times the NHD cache in one allocation: not the variants {bad}")
    if args.worker:
        Path(args.out).write_text(json.dumps(worker(args.worker, args.variants, cases, args.check, args.q_len,
                                                    args.kv_dtype)))
        return 0
    from bench.harness import print_aligned   # (not in a worker: it imports meld before the worker's tree)

    sides = {**({"base": (args.base, ["default"])} if args.base else {}), "new": (REPO, args.variants)}
    runs = run_rounds(list(sides), args.rounds, lambda side, r, out: [
        sys.executable, __file__, "--worker", str(sides[side][0]), "--variants", *sides[side][1], "--out", out,
        *(["--batch", *map(str, args.batch)] if args.batch else []), "--q-len", str(args.q_len),
        *(["--kv-dtype", args.kv_dtype] if args.kv_dtype else []),
        *(["--check"] if r == 0 else [])])
    if runs is None:
        return 1
    med = medians(runs)
    head = ["case"] + (["base µs"] if "base" in med else []) + [f"{v} µs" for v in args.variants]
    head += (["new/base"] if "base" in med else []) + [f"{v}/default" for v in args.variants if v != "default"]
    rows = []
    for case in med["new"]:
        new = med["new"][case]
        row = [case] + ([f"{med['base'][case]['default']:.1f}"] if "base" in med else [])
        row += [f"{new[v]:.1f}" for v in args.variants]
        row += [f"{new['default'] / med['base'][case]['default']:.3f}"] if "base" in med else []
        row += [f"{new[v] / new['default']:.3f}" for v in args.variants if v != "default"]
        rows.append(row)
    print_aligned(head, rows)
    print(f"q_len {args.q_len}, {args.kv_dtype or 'bf16'} cache; medians over {args.rounds} alternating rounds; ratios > 1: slower than base / than "
          "default")
    write_runs(args.json, runs, med)
    return 0


if __name__ == "__main__":
    sys.exit(main())
