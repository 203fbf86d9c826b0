"""`meld tune`: search decode attention's planner constants and kernel configurations on a workload
(BENCH's B >= 64 batches, or batches recorded from production by MELD_RECORD); adopt a candidate only
where it is faster beyond the noise and slower on no batch, and record it in the tuning database.

A candidate is a `DecodeCost` and the `DecodeKernelConfig` fields it changes (warps, stages, TMA rings);
the kernels of all candidates compile at once, on a thread pool, before anything is timed. Each batch of
the workload is planned by every candidate and run from its own CUDA graph. Rounds replay the candidates in a shuffled order,
each replay after a read of a buffer larger than L2 (a cold L2, as a decode step finds it) and timed by
CUDA events. Per batch, a candidate's time ratio against the default is the median of its replays over
the default's, with a 95% bootstrap interval (replays resampled); in a search, a candidate already slower
beyond that noise after a round is not replayed on the batch again (racing: it can no longer be adopted).
A candidate is adopted when it is faster beyond the noise on at least one batch (the interval's upper end
below 1) and slower beyond it on none (no interval's lower end above 1), with the best geometric mean
among such candidates; otherwise the default stays.

With a fitted cost model (`meld.tuning.cost_fit`, e.g. `bench/cost_fit.py --json`'s), the planner
constants are searched on a finer grid and pruned before anything runs: each batch is planned on the host
by every cost candidate, the fit predicts each plan's slowest CTA, and only the `keep` candidates it
predicts fastest (by geometric mean over the batches) are measured, beside the default and the kernel
variants (which the fit knows nothing of).

`sweep` checks the pruning against the exhaustive sweep of the same space (every cost of the finer grid
with every kernel, every candidate replayed every round): how close the pruned search's choice comes to
the sweep's fastest, measured in the sweep's own run, and what share of the sweep's time it takes (the
issue's acceptance row: within 2%, in at most 10%).
"""
from __future__ import annotations

import dataclasses
import math
import random
import time
from dataclasses import dataclass

import numpy as np
import torch

from .. import jsonfile
from ..codegen import DecodeKernelConfig
from ..runtime.cuda_graphs import capture
from ..scheduler import DecodeCost, Topology, plan_decode_host
from ..workloads import lengths, paged
from .cost_fit import CostFit, predicted_launch_ns

SHAPE = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16)   # BENCH.md's GQA shape
SHAPE_BUCKET = "Hq32/Hkv8/D128/P16/C1"                                       # DecodeAttention.shape_bucket of it


def bench_batches() -> list[tuple[str, list[int]]]:
    """BENCH.md's decode batches with B >= 64."""
    return [(f"B={b} {d}", lengths(d, b)) for b in (64, 256) for d in ("uniform2k", "skewed", "one-long")]


def recorded_batches(path, most: int = 6) -> list[tuple[str, list[int]]]:
    """Up to `most` batches recorded for BENCH's shape (MELD_RECORD), spread over their total tokens: the
    smallest, the largest and quantiles between."""
    from .recorder import load

    got = load(path, "decode_attention", SHAPE_BUCKET)
    got = [lens for lens in got if sum(lens) > 0]
    if not got:
        raise ValueError(f"{path} holds no recorded decode_attention batch of {SHAPE_BUCKET} with KV tokens")
    order = sorted(range(len(got)), key=lambda i: sum(got[i]))
    picks = sorted({order[round(q * (len(order) - 1))] for q in np.linspace(0, 1, most)}, key=lambda i: sum(got[i]))
    return [(f"recorded #{i} B={len(got[i])} {sum(got[i])} tokens", got[i]) for i in picks]


@dataclass(frozen=True)
class BatchResult:
    name: str
    median_us: dict[str, float]                        # per candidate
    ratio: dict[str, tuple[float, float, float]]       # per candidate: (median ratio to default, CI low, CI high)


@dataclass(frozen=True)
class TuneResult:
    batches: list[BatchResult]
    geomean: dict[str, float]                          # per candidate, of the median ratios
    adopted: str | None


@dataclass(frozen=True)
class Candidate:
    """A planner cost model and the kernel configuration fields that differ from the default kernel's."""

    cost: DecodeCost
    kernel: dict = dataclasses.field(default_factory=dict)

    def kernel_config(self) -> DecodeKernelConfig | None:
        """The kernel of BENCH's shape with these fields (None: the default kernel)."""
        if not self.kernel:
            return None
        return dataclasses.replace(DecodeKernelConfig.default("bfloat16", SHAPE["head_dim"]), **self.kernel)


# Kernel variants of the default (eight warps, two stages, cp.async rings): one more stage, TMA rings, and
# four warps with four stages (the configurations the hand sweeps of bench/decode_sweep.py found close).
KERNEL_VARIANTS = ({"num_stages": 3}, {"tma": True}, {"num_warps": 4, "num_stages": 4})


def _kernel_name(kernel: dict) -> str:
    return ",".join(f"{f}={v}" for f, v in kernel.items())


def candidates(default: DecodeCost, item_overheads=(64, 96, 192, 256), kernels=KERNEL_VARIANTS) -> dict[str, Candidate]:
    """The default, one candidate per item overhead (the constant the fit finds furthest off), and one per
    kernel variant with the default cost."""
    out = {"default": Candidate(default)}
    for v in item_overheads:
        if v != default.item_overhead_tokens:
            out[f"item_overhead_tokens={v}"] = Candidate(dataclasses.replace(default, item_overhead_tokens=v))
    for k in kernels:
        out[_kernel_name(k)] = Candidate(default, dict(k))
    return out


FINE_ITEM_OVERHEADS = tuple(range(32, 257, 16))   # the grid a fitted model prunes


def sweep_candidates(default: DecodeCost) -> dict[str, Candidate]:
    """The space the pruned search samples, whole: every cost of the finer grid (and the default's) with
    the default kernel and with each kernel variant. Named as `candidates` names their parts, joined
    ("item_overhead_tokens=80,num_stages=3"), so that a candidate of the pruned search has the same name
    here and its time in the sweep can be looked up."""
    costs = candidates(default, FINE_ITEM_OVERHEADS, kernels=())
    return {",".join(n for n in (cost_name, _kernel_name(k)) if n and n != "default") or "default":
            Candidate(c.cost, dict(k)) for k in ({}, *KERNEL_VARIANTS) for cost_name, c in costs.items()}


def predicted_ratios(fit: CostFit, cands: dict[str, Candidate], batches: list[tuple[str, list[int]]],
                     sm_count: int) -> dict[str, float]:
    """Each planner-only candidate's predicted launch time over the default's, geometric mean over the
    batches (every batch planned on the host for a grid of `sm_count` CTAs)."""
    costs = {k: c for k, c in cands.items() if not c.kernel}
    logs = {k: 0.0 for k in costs}
    for _, lens in batches:
        pt = paged(lens, SHAPE["page_size"])   # planned by the GPU planner's own source, built for the host
        t = {k: predicted_launch_ns(fit, plan_decode_host(pt.kv_indptr.numpy(), pt.kv_last_page_len.numpy(),
                                                          SHAPE["page_size"], SHAPE["num_kv_heads"],
                                                          SHAPE["num_qo_heads"] // SHAPE["num_kv_heads"],
                                                          Topology(sm_count), c.cost))
             for k, c in costs.items()}
        for k in costs:
            logs[k] += math.log(t[k] / t["default"])
    return {k: math.exp(v / len(batches)) for k, v in logs.items()}


def prune(cands: dict[str, Candidate], fit: CostFit, batches: list[tuple[str, list[int]]], keep: int = 2,
          sm_count: int = 132) -> dict[str, Candidate]:
    """The default, the `keep` planner candidates `fit` predicts fastest, and every kernel variant."""
    if keep < 1:
        raise ValueError(f"keep={keep}: expected at least 1")
    pred = predicted_ratios(fit, cands, batches, sm_count)
    best = sorted((k for k in pred if k != "default"), key=pred.get)[:keep]
    return {k: c for k, c in cands.items() if k == "default" or k in best or c.kernel}


def load_fit(path) -> CostFit:
    """A fitted model from a JSON file: `bench/cost_fit.py --json`'s (its "fit+mix", else its "fit"), or one
    `CostFit` as a dict."""
    d = jsonfile.read(path)
    if isinstance(d, dict) and "fits" in d:
        fits = d["fits"]
        d = fits.get("fit+mix") or fits.get("fit") if isinstance(fits, dict) else None
        if d is None:
            raise ValueError(f"{path}: its fits hold neither 'fit+mix' nor 'fit'")
    try:
        return CostFit.from_dict(d)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def compile_all(cands: dict[str, Candidate], workers: int = 8) -> None:
    """Compile every candidate's kernel into the on-disk cache at once (operators then load them)."""
    from concurrent.futures import ThreadPoolExecutor

    from ..codegen import compile_source

    configs = {c.name: c for c in (cand.kernel_config() for cand in cands.values()) if c is not None}
    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(lambda c: compile_source(c.render(), c.name), configs.values()))


def bootstrap_ratio(a: np.ndarray, b: np.ndarray, n: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """median(b) / median(a) and its 95% bootstrap interval."""
    rng = np.random.default_rng(seed)
    ra = np.median(rng.choice(a, (n, len(a))), axis=1)
    rb = np.median(rng.choice(b, (n, len(b))), axis=1)
    r = rb / ra
    return float(np.median(b) / np.median(a)), float(np.percentile(r, 2.5)), float(np.percentile(r, 97.5))


def decide(batches: list[BatchResult]) -> tuple[dict[str, float], str | None]:
    """Geometric means of the ratios, and the adopted candidate (see the module docstring) or None."""
    names = [k for k in batches[0].ratio if k != "default"]
    geo = {k: math.exp(sum(math.log(b.ratio[k][0]) for b in batches) / len(batches)) for k in names}
    ok = [k for k in names if any(b.ratio[k][2] < 1.0 for b in batches) and not any(b.ratio[k][1] > 1.0 for b in batches)]
    return geo, min(ok, key=geo.get) if ok else None


def racing(samples: dict[str, list[float]], names: list[str]) -> list[str]:
    """The candidates still worth replaying on a batch after a round: the default, and every one not yet
    slower than it beyond the noise (its interval's lower end above 1 — `decide` never adopts such a one)."""
    base = np.array(samples["default"])
    return [n for n in names if n == "default" or bootstrap_ratio(base, np.array(samples[n]), n=500)[1] <= 1.0]


def measure(cands: dict[str, Candidate], batches: list[tuple[str, list[int]]], rounds: int = 5, reps: int = 10,
            device: str = "cuda", seed: int = 0, race: bool = False) -> list[BatchResult]:
    """Each (name, KV lengths) batch of BENCH's shape, planned and run by every candidate, timed (module
    docstring). `race`: after each round, stop replaying a batch's candidates that are already slower than
    the default beyond the noise (`racing`); their ratios then rest on fewer replays."""
    import meld

    compile_all(cands)
    dev = torch.device(device)
    l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 0) or 64 << 20
    flush = torch.ones(l2, dtype=torch.float32, device=dev)   # 4x the L2, read before each replay
    rng, results = random.Random(seed), []
    for batch_name, lens in batches:
        b = len(lens)
        t = paged(lens, SHAPE["page_size"], generator=torch.Generator().manual_seed(seed))
        g = torch.Generator(device=dev).manual_seed(seed)
        q = torch.randn(b, SHAPE["num_qo_heads"], SHAPE["head_dim"], generator=g, device=dev, dtype=torch.bfloat16)
        kv = torch.randn(t.num_pages, 2, SHAPE["page_size"], SHAPE["num_kv_heads"], SHAPE["head_dim"], generator=g,
                         device=dev, dtype=torch.bfloat16)
        graphs, ops, outs = {}, {}, {}   # (a graph writes into its out: outs keeps every one alive)
        for name, cand in cands.items():
            op = ops[name] = meld.DecodeAttention(*SHAPE.values(), torch.bfloat16, dev, cost=cand.cost,
                                                  kernel_config=cand.kernel_config())
            op.plan(t.kv_indptr, t.kv_indices, t.kv_last_page_len)
            out = outs[name] = torch.empty_like(q)
            graphs[name] = capture(lambda op=op, out=out, kv=kv: op.run(q, kv, out=out), device=dev)[0]
        samples: dict[str, list[float]] = {k: [] for k in cands}
        order = list(cands)
        for _ in range(rounds):
            rng.shuffle(order)
            for name in order:
                events = []
                for _ in range(reps):
                    flush.sum()
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    graphs[name].replay()
                    e1.record()
                    events.append((e0, e1))
                torch.cuda.synchronize(dev)
                samples[name] += [e0.elapsed_time(e1) * 1e3 for e0, e1 in events]
            if race:
                order = racing(samples, order)
        base = np.array(samples["default"])
        results.append(BatchResult(batch_name, {k: float(np.median(v)) for k, v in samples.items()},
                                   {k: bootstrap_ratio(base, np.array(v)) for k, v in samples.items()}))
        del graphs, ops, outs, kv
        torch.cuda.empty_cache()
    return results


def search(batches: list[tuple[str, list[int]]], rounds: int = 5, reps: int = 10, device: str = "cuda",
           fit: CostFit | None = None, keep: int = 2,
           sm_count: int | None = None) -> tuple[dict[str, Candidate], TuneResult]:
    """The candidates (with `fit`: the finer grid, pruned to `keep` planner candidates first), measured on
    `batches` and decided: `tune` without the database, which `sweep` times."""
    if fit is None:
        cands = candidates(DecodeCost.default())
    else:
        sms = sm_count or torch.cuda.get_device_properties(torch.device(device)).multi_processor_count
        cands = prune(candidates(DecodeCost.default(), FINE_ITEM_OVERHEADS), fit, batches, keep, sms)
    measured = measure(cands, batches, rounds=rounds, reps=reps, device=device, race=True)
    return cands, TuneResult(measured, *decide(measured))


def tune(db_path, batches: list[tuple[str, list[int]]], workload: str, rounds: int = 5, reps: int = 10,
         device: str = "cuda", fit: CostFit | None = None, keep: int = 2, sm_count: int | None = None) -> TuneResult:
    """`search`, and record an adopted candidate in the tuning database at `db_path` under this machine's
    key (its evidence: the workload, every batch's times and ratios)."""
    import meld

    from .db import TuningDB, TuningEntry, TuningKey

    cands, result = search(batches, rounds, reps, device, fit, keep, sm_count)
    geo, adopted, measured = result.geomean, result.adopted, result.batches
    if adopted is not None:
        op = meld.DecodeAttention(*SHAPE.values(), torch.bfloat16, device)
        key = TuningKey.here(op.graph.name, "bfloat16", op.shape_bucket, op.device)
        best, default = cands[adopted], cands["default"]
        changed = {f.name: getattr(best.cost, f.name) for f in dataclasses.fields(DecodeCost)
                   if getattr(best.cost, f.name) != getattr(default.cost, f.name)}
        evidence = {"workload": workload, "geomean_ratio": geo[adopted], "batches": {
            b.name: {"default_us": b.median_us["default"], "tuned_us": b.median_us[adopted],
                     "ratio_ci95": list(b.ratio[adopted])} for b in measured}}
        db = TuningDB.load(db_path)
        db.put(TuningEntry(key, {"cost": changed, **({"kernel": best.kernel} if best.kernel else {})}, evidence))
        db.save()
    return result


def table(result: TuneResult) -> str:
    """The before/after table: per batch, the default's µs and each candidate's ratio [95% interval]."""
    names = list(result.batches[0].median_us)
    lines = [" | ".join(["batch"] + [f"{n} µs" if n == "default" else n for n in names])]
    for b in result.batches:
        cells = [b.name]
        for n in names:
            r, lo, hi = b.ratio[n]
            cells.append(f"{b.median_us[n]:.1f}" if n == "default" else f"{r:.3f} [{lo:.3f}, {hi:.3f}]")
        lines.append(" | ".join(cells))
    lines.append(" | ".join(["geomean", "1"] + [f"{result.geomean[n]:.3f}" for n in names if n != "default"]))
    lines.append(f"adopted: {result.adopted or 'none (the default stays)'}")
    return "\n".join(lines)


QUALITY_MAX, TIME_MAX = 1.02, 0.10   # the acceptance row: within 2% of the sweep's fastest, in <= 10% of its time


@dataclass(frozen=True)
class SweepResult:
    """The pruned search against the exhaustive sweep of the same space, on the same batches."""

    pruned: TuneResult
    swept: list[BatchResult]
    geomean: dict[str, float]   # per sweep candidate, the default's 1 included
    tuned: str                  # what the pruned search adopted, or "default"
    best: str                   # the sweep's fastest by geometric mean
    pruned_s: float             # wall times, each with the same kernels compiled and the GPU started before
    sweep_s: float
    warmup_s: float             # that compiling and starting, done once before both

    @property
    def quality(self) -> float:
        """The tuned candidate's geometric mean over the fastest's, both as the sweep measured them (the
        pruned run's own numbers are of another run, with other noise)."""
        return self.geomean[self.tuned] / self.geomean[self.best]

    @property
    def time_ratio(self) -> float:
        return self.pruned_s / self.sweep_s

    @property
    def passed(self) -> bool:
        return self.quality <= QUALITY_MAX and self.time_ratio <= TIME_MAX


def summarize(pruned: TuneResult, swept: list[BatchResult], pruned_s: float, sweep_s: float,
              warmup_s: float) -> SweepResult:
    """The comparison of a pruned search and a sweep already measured and timed."""
    geo = {"default": 1.0, **decide(swept)[0]}
    tuned = pruned.adopted or "default"
    if tuned not in geo:
        raise ValueError(f"the pruned search adopted {tuned!r}, which the sweep did not measure")
    return SweepResult(pruned, swept, geo, tuned, min(geo, key=geo.get), pruned_s, sweep_s, warmup_s)


def sweep(batches: list[tuple[str, list[int]]], fit: CostFit, rounds: int = 5, reps: int = 10, device: str = "cuda",
          keep: int = 2, sm_count: int | None = None) -> SweepResult:
    """The pruned search (`search`, as `tune` runs it; nothing recorded) and the exhaustive sweep of
    `sweep_candidates`, each timed by the wall clock, compile and planning included. Before both, every
    kernel of the space is compiled (the two need the same four) and the GPU runs one captured launch (its
    context, the first module loads), so that neither run pays a one-time cost the other does not."""
    space = sweep_candidates(DecodeCost.default())
    t0 = time.perf_counter()
    compile_all(space)
    measure({"default": space["default"]}, batches[:1], rounds=1, reps=1, device=device)
    t1 = time.perf_counter()
    _, pruned = search(batches, rounds, reps, device, fit, keep, sm_count)
    t2 = time.perf_counter()
    swept = measure(space, batches, rounds=rounds, reps=reps, device=device)
    t3 = time.perf_counter()
    return summarize(pruned, swept, t2 - t1, t3 - t2, t1 - t0)


def sweep_report(r: SweepResult) -> str:
    """The comparison in a few lines, each check with its threshold and verdict."""
    def verdict(ok: bool) -> str:
        return "pass" if ok else "FAIL"

    rank = sorted(r.geomean, key=r.geomean.get).index(r.tuned) + 1
    return "\n".join([
        f"sweep: {len(r.geomean)} candidates on {len(r.swept)} batches; fastest {r.best} at "
        f"{r.geomean[r.best]:.4f} of the default (geometric mean)",
        f"tuned: {r.tuned} at {r.geomean[r.tuned]:.4f} in the sweep (rank {rank} of {len(r.geomean)}): "
        f"{r.quality:.4f} of the fastest (<= {QUALITY_MAX}: {verdict(r.quality <= QUALITY_MAX)})",
        f"time: pruned search {r.pruned_s:.1f} s, sweep {r.sweep_s:.1f} s: {r.time_ratio:.4f} of the sweep's "
        f"(<= {TIME_MAX}: {verdict(r.time_ratio <= TIME_MAX)}); before both, compiling the kernels and a first "
        f"launch: {r.warmup_s:.1f} s",
        f"acceptance row: {verdict(r.passed)}"])
