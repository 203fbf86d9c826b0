"""Per-layer decode attention inside a captured decode step, against the pure read of its KV bytes.

A serving engine replays one CUDA graph per step: in every layer the attention kernel follows the kernel
that writes the new token's K/V and precedes the output projection. What attention costs there is not
its time alone: launch latency and its first dependent loads (work table, lengths, page indices) either
add to the step or hide under the previous kernel's tail. This measures it where it runs.

For each small-batch BENCH case (B <= 8 by default), one Llama-3-8B-shaped model (`meld.serving`, random
weights, `--layers` layers) and one paged KV cache holding the case's lengths. One graph of a whole decode
step is captured per attention variant:
  meld          meld.DecodeAttention as shipped (a plain launch)
  meld-overlap  the same with overlap=True (a programmatic dependent launch of the KV-append kernel)
  flashinfer   FlashInfer's CUDA-graph decode wrapper (when flashinfer imports)
  none         attention replaced by a preallocated tensor (the step without attention)
The graphs are replayed in interleaved rounds, each replay bracketed by CUDA events (no L2 flush: the
layers' weights stream through L2 between two layers' attention, as in a real step). Then:
  in-step µs = (median step of the variant - median step of `none`) / layers
  alone µs   = a graph of the variant's attention in every layer (each its own cache), median / layers
  read µs    = `bench.harness.read_floor_us` of one layer's KV bytes (a Triton streaming read, L2 flushed)
  over read  = in-step µs - read µs
`err` columns: each variant's logits against meld's (relative L2); meld-overlap must equal meld bit for
bit. The exit status is 1 if an error is above 2e-2 or meld-overlap's is not 0.

    PYTHONPATH=/tmp/site:$PWD python3 bench/serve_layer.py --json $OUT/serve_layer.json
"""
from __future__ import annotations

import os

os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.harness import (  # noqa: E402
    Column, Table, Timing, _queue_ahead, env_info, env_line, read_floor_us,
)
from meld import workloads  # noqa: E402
from meld.runtime.cuda_graphs import capture  # noqa: E402
from meld.serving.backends import AttentionBackend, BackendUnavailable, make_backend  # noqa: E402
from meld.serving.kv_cache import PagedKVCache  # noqa: E402
from meld.serving.models import DecoderModel, llama_config  # noqa: E402

CASES = [(1, "uniform2k"), (1, "skewed"), (4, "skewed"), (8, "uniform2k"), (8, "skewed"), (8, "one-long")]
VARIANTS = ("meld", "meld-overlap", "flashinfer", "none")
PAGE = 16
LOGITS_TOL = 2e-2


class NoAttention(AttentionBackend):
    """The step without attention: run() returns one preallocated tensor (the output projection still reads it)."""

    name = "none"
    supports_graphs = True

    def __init__(self, out: torch.Tensor):
        self.out = out

    def plan(self, table) -> None:
        pass

    def run(self, layer, q, kv_cache):
        return self.out


def backend_for(variant: str, mc, B: int, pages: int, device) -> AttentionBackend:
    if variant == "none":
        return NoAttention(torch.zeros(B, mc.num_qo_heads, mc.head_dim, dtype=mc.dtype, device=device))
    backend = make_backend("meld" if variant.startswith("meld") else variant, mc, PAGE, device, B, pages)
    if variant == "meld-overlap":
        backend.attn.overlap = True
    backend.prepare_graphs([B])
    return backend


def interleaved_us(graphs: dict[str, torch.cuda.CUDAGraph], rounds: int, reps: int) -> dict[str, Timing]:
    """Each graph replayed `reps` times per round, the graphs in turn, `rounds` rounds: per-replay µs."""
    samples: dict[str, list[float]] = {k: [] for k in graphs}
    for _ in range(rounds):
        for name, g in graphs.items():
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
            _queue_ahead()
            for start, end in events:
                start.record()
                g.replay()
                end.record()
            torch.cuda.synchronize()
            samples[name] += [s.elapsed_time(e) * 1e3 for s, e in events]
    return {k: Timing.of(v) for k, v in samples.items()}


def run_case(model: DecoderModel, B: int, dist: str, variants: list[str], rounds: int, reps: int) -> dict:
    mc, dev = model.config, model.device
    lens = workloads.lengths(dist, B)
    pages = sum(-(-n // PAGE) for n in lens) + 2
    cache = PagedKVCache(mc.num_layers, pages, PAGE, mc.num_kv_heads, mc.head_dim, mc.dtype, dev)
    cache.pool.normal_()
    rids = list(range(B))
    for rid, n in zip(rids, lens):
        cache.add(rid, n)
        cache.extend(rid, n - 1)
    slots = torch.from_numpy(cache.append(rids)).to(dev)           # the step's new token: position n - 1
    positions = torch.tensor([n - 1 for n in lens], device=dev)
    tokens = torch.randint(0, mc.vocab_size, (B,), device=dev, generator=torch.Generator(dev).manual_seed(B))
    table = cache.page_table(rids)
    kv_bytes = sum(lens) * mc.num_kv_heads * mc.head_dim * 2 * mc.dtype.itemsize
    steps, alone, logits, backends = {}, {}, {}, {}   # backends: the graphs point into their buffers
    q = torch.randn(B, mc.num_qo_heads, mc.head_dim, device=dev).to(mc.dtype)
    for v in variants:
        try:
            backend = backend_for(v, mc, B, pages + B, dev)
        except BackendUnavailable as e:
            print(f"  {v}: skipped ({e})")
            continue
        backends[v] = backend
        backend.plan(table)
        steps[v], logits[v] = capture(lambda b=backend: model.decode(tokens, positions, slots, b, cache))
        if v != "none":
            alone[v] = capture(lambda b=backend: [b.run(i, q, cache.layer(i)) for i in range(mc.num_layers)])[0]
    t_step = interleaved_us(steps, rounds, reps)
    t_alone = interleaved_us(alone, rounds, reps)
    read = read_floor_us(kv_bytes)   # one layer's KV
    L = mc.num_layers
    row = dict(B=B, dist=dist, kv_mib=kv_bytes / 2**20, read_us=read, step_none_us=t_step["none"].median_us)
    for v in variants:
        if v == "none" or v not in steps:
            continue
        in_step = (t_step[v].median_us - t_step["none"].median_us) / L
        row[f"{v}_step_us"] = in_step
        row[f"{v}_over_read"] = in_step - read if read else None
        row[f"{v}_alone_us"] = t_alone[v].median_us / L
        if v != "meld" and "meld" in logits:
            ref = logits["meld"].float()
            row[f"{v}_err"] = ((logits[v].float() - ref).norm() / ref.norm()).item()
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--cases", default=",".join(f"{b}:{d}" for b, d in CASES), help="B:dist,... (BENCH dists)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=40, help="timed replays per graph per round")
    p.add_argument("--json", type=Path)
    p.add_argument("--dry-run", action="store_true", help="list the cases and variants; no GPU needed")
    a = p.parse_args(argv)
    cases = [(int(b), d) for b, d in (c.split(":") for c in a.cases.split(","))]
    variants = a.variants.split(",")
    if "none" not in variants:
        variants.append("none")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"argument --variants: unknown {unknown}; expected some of {', '.join(VARIANTS)}")
    mc = llama_config(num_layers=a.layers)
    print(f"{mc.describe()}; page size {PAGE}; variants {', '.join(variants)}; {a.rounds} rounds x {a.reps} replays")
    for B, d in cases:
        print(f"  B={B} {d}: {sum(workloads.lengths(d, B))} tokens")
    if a.dry_run:
        return 0
    env = env_info()
    print(env_line(env))
    model = DecoderModel(mc, "cuda")
    table = Table([Column("B", "B"), Column("dist", "dist", align="<"), Column("kv_mib", "KV MiB/layer", ".1f"),
                   Column("read_us", "read µs", ".1f"), Column("step_none_us", "step w/o attn µs", ".0f")]
                  + [c for v in variants if v != "none" for c in (
                      Column(f"{v}_step_us", f"{v} in-step", ".1f"), Column(f"{v}_over_read", "over read", "+.1f"),
                      Column(f"{v}_alone_us", f"{v} alone", ".1f"))]
                  + [Column(f"{v}_err", f"{v} err", ".1e") for v in variants if v not in ("meld", "none")])
    for B, d in cases:
        table.add(run_case(model, B, d, variants, a.rounds, a.reps))
        torch.cuda.empty_cache()
    print(table.render())
    bad = [r for r in table.rows if any(r.get(f"{v}_err", 0) > LOGITS_TOL for v in variants)
           or r.get("meld-overlap_err", 0) != 0]
    if a.json:
        table.dump_json(a.json, env=env, args={**vars(a), "json": str(a.json)})
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
