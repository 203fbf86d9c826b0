"""Does `meld tune` hold on workloads unlike BENCH's, and does its pruned search find what a sweep finds?

(i) Batches of 64 and 160 requests from two distributions BENCH.md does not have (log-normal lengths
around 400 tokens; a Zipf-like mix of a few very long requests and many short ones) are planned and run
by `meld.DecodeAttention` with MELD_RECORD on (every plan recorded), and `meld.tuning.tune.tune` tunes on
the recorded batches (`recorded_batches`, as `meld tune --workload recorded:FILE` does) into a database in
a temporary folder. Where it adopts a candidate, the operator built from that database (MELD_TUNING_DB) is
measured again against the default, on fresh data in another replay order: the tuning run's own intervals
cannot show it is never slower, since it adopted by them. The check fails where a batch's 95% interval of
tuned / default lies above 1, or where the entry does not apply. The entry's evidence (its gains) is
printed and saved.
(ii) With --sweep (needs --fit): `meld.tuning.tune.sweep` on BENCH's batches, the pruned search against
the exhaustive sweep of the same space (within 2% of its fastest, in at most 10% of its time).

    PYTHONPATH=$PWD python3 bench/tune_check.py --fit cf.json --sweep --json $OUT/tc.json
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import meld  # noqa: E402
from bench.harness import Column, Table, env_info, env_line, failure_head, record_failure  # noqa: E402
from meld import config  # noqa: E402
from meld.scheduler import DecodeCost  # noqa: E402
from meld.tuning.db import TuningDB  # noqa: E402
from meld.tuning.tune import (SHAPE, Candidate, bench_batches, load_fit, measure, recorded_batches,  # noqa: E402
                              sweep, sweep_report, table, tune)
from meld.workloads import paged  # noqa: E402


def lognormal(b: int, rng: np.random.Generator) -> list[int]:
    """Chat-like: median e^6 = 403 tokens, few past 4k (BENCH's skewed: median e^7.5 = 1808, sigma 1.2)."""
    return np.clip(np.exp(rng.normal(6.0, 1.0, b)), 16, 32768).astype(int).tolist()


def zipf(b: int, rng: np.random.Generator) -> list[int]:
    """The r-th longest request about 64k / r^1.3 tokens (at B=64: 65k, 26k, 15k, ... and half under 800),
    in random order."""
    ranks = rng.permutation(b) + 1
    return np.maximum(32, 65536 * rng.uniform(0.6, 1.0, b) / ranks ** 1.3).astype(int).tolist()


DISTS = {"lognormal": lognormal, "zipf": zipf}


def record(path: Path, device: str) -> None:
    """Plan (and on a GPU run) three batches of each distribution at B = 64 and 160 with every plan recorded."""
    with config.scope(MELD_RECORD=str(path), MELD_RECORD_EVERY="1"):
        attn = meld.DecodeAttention(*SHAPE.values(), torch.bfloat16, device)
        for b in (64, 160):
            for i, dist in enumerate(DISTS.values()):
                for seed in range(3):
                    lens = dist(b, np.random.default_rng(1000 * i + 10 * b + seed))
                    t = paged(lens, SHAPE["page_size"])
                    attn.plan(t.kv_indptr, t.kv_indices, t.kv_last_page_len)
                    if device != "cpu":
                        bf16 = dict(device=device, dtype=torch.bfloat16)
                        q = torch.randn(b, SHAPE["num_qo_heads"], SHAPE["head_dim"], **bf16)
                        attn.run(q, torch.randn(t.num_pages, 2, SHAPE["page_size"], SHAPE["num_kv_heads"],
                                                SHAPE["head_dim"], **bf16))


def never_slower(db_path: Path, batches, rounds: int, failures: list[str]) -> Table:
    """The operator as MELD_TUNING_DB=db_path builds it, measured again against the default (seed 1: other
    data, another replay order) and printed; a batch where it is slower beyond the noise is a failure."""
    with config.scope(MELD_TUNING_DB=str(db_path)):
        op = meld.DecodeAttention(*SHAPE.values(), torch.bfloat16, "cuda")
    rows = Table([Column("batch", "batch", align="<"), Column("default_us", "default µs", ".1f"),
                  Column("tuned_us", "tuned µs", ".1f"), Column("ratio", "tuned/default", ".3f"),
                  Column("lo", "CI low", ".3f"), Column("hi", "CI high", ".3f")])
    if op.tuning is None:
        record_failure(failures, f"the entry tune recorded in {db_path} does not apply to the operator here")
        return rows
    tuned = Candidate(op.cost, op.tuning.config.get("kernel", {}))
    for b in measure({"default": Candidate(DecodeCost.default()), "tuned": tuned}, batches, rounds=rounds, seed=1):
        r, lo, hi = b.ratio["tuned"]
        rows.add(dict(batch=b.name, default_us=b.median_us["default"], tuned_us=b.median_us["tuned"], ratio=r, lo=lo,
                      hi=hi))
    print("the tuned operator measured again (another replay order, other data):")
    rows.print()
    for r in rows.rows:
        if r["lo"] > 1.0:
            record_failure(failures, f"{r['batch']}: the tuned operator is slower than the default: {r['ratio']:.3f} "
                                     f"[{r['lo']:.3f}, {r['hi']:.3f}]")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fit", type=Path, help="a fitted cost model (bench/cost_fit.py --json): tune prunes with it")
    p.add_argument("--keep", type=int, default=2, help="with --fit: planner candidates measured")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds of replays per batch")
    p.add_argument("--sweep", action="store_true", help="with --fit: also compare with the sweep on BENCH's batches")
    p.add_argument("--json", type=Path)
    p.add_argument("--dry-run", action="store_true", help="record on the CPU and list the batches; no GPU needed")
    a = p.parse_args(argv)
    if a.sweep and a.fit is None:
        p.error("--sweep needs --fit")
    fit = load_fit(a.fit) if a.fit else None
    failures: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        workload = Path(tmp) / "workload.jsonl"
        record(workload, "cpu" if a.dry_run else "cuda")
        batches = recorded_batches(workload)
        for name, lens in batches:
            print(f"{name}: median {int(np.median(lens))}, max {max(lens)} tokens")
        if a.dry_run:
            return 0
        env = env_info()
        print(env_line(env))
        db_path = Path(tmp) / "tuning.json"
        result = tune(db_path, batches, f"recorded:{workload}", rounds=a.rounds, fit=fit, keep=a.keep)
        print(table(result))
        evidence = None
        rows = Table([])
        if result.adopted is None:
            print("never slower: nothing adopted, the default stays")
        else:
            (entry,) = TuningDB.load(db_path).entries
            evidence = entry.evidence
            print(f"recorded: {entry.config}, geometric mean {evidence['geomean_ratio']:.3f} of the default")
            rows = never_slower(db_path, batches, a.rounds, failures)
    compared = None
    if a.sweep:
        compared = sweep(bench_batches(), fit, rounds=a.rounds, keep=a.keep)
        print("BENCH's batches, the pruned search (then the sweep of its whole space):")
        print(table(compared.pruned))
        print(sweep_report(compared))
        if not compared.passed:
            record_failure(failures, "the pruned search against the sweep: see the acceptance row above")
    print(f"summary: {failure_head(failures)}")
    if a.json:
        rows.dump_json(a.json, env=env, tune=result, evidence=evidence, failures=failures,
                       sweep=compared and {**dataclasses.asdict(compared), "quality": compared.quality,
                                           "time_ratio": compared.time_ratio, "passed": compared.passed})
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
