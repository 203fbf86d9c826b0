"""Paged GQA decode attention: meld against FlashInfer (both decode backends) and torch SDPA, per BENCH.md.

Setup on the GPU machine (it has no network; the peers travel as wheels in `.whl/`, see
`../shared/tools/peer-wheels.sh`), from the repository root:

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD:$PYTHONPATH FLASHINFER_CUDA_ARCH_LIST=9.0a
    PYTHONUNBUFFERED=1 python3 bench/decode.py --quick --json $OUT/decode.json

`--kv-dtype fp8` times an e4m3 cache (per-tensor k_scale and v_scale): meld and FlashInfer read it at one byte a value,
and `meld-bf16` times meld on the bf16 cache of the same (dequantised) values, all in one run. `--kv-dtype e5m2` does
the same with an e5m2 cache. meld's FP8 build for bf16 q computes in f16 on the tensor cores
(`DecodeKernelConfig.fp8_math="f16"`, the default since 2026-12-03's sixth session); `meld-bf16math` times the same
build computing in bf16 (`fp8_math=""`): bf16m/fp8 = meld-bf16math µs / meld µs (> 1: the default is faster).

`--q-len N` (2 to 8) times multi-token decode: N new tokens per request, causal among themselves (q [B * N, Hq, D]):
meld's `DecodeAttention(q_len=N)`, FlashInfer's tensor-core decode with `plan(q_len_per_req=N)` (`fi-tc`; its
CUDA-core decode takes one token) and its `BatchPrefillWithPagedKVCacheWrapper` with causal=True and qo_indptr =
arange * N (`fi-prefill`); speedup is over the faster of the two. `meld-q1` times meld's q_len = 1 decode of the same
batch (each request's last token; the same KV bytes), and `q/q1` = meld µs / meld-q1 µs is what the extra rows cost.
`meld-h16` times meld's build with 16-row units (heads_per_unit=16), which reads a kv head's KV once per 16 rows;
h16/meld = meld-h16 µs / meld µs (> 1: the default is faster; the default takes 32-row units above 16 rows).
`--ragged` (with --q-len N) draws each request's new tokens n_b from 1..N (uniformly, from --seed): q has Σn_b rows
and meld runs `DecodeAttention(q_len=N, ragged=True)` with that qo_indptr, FlashInfer its batch prefill with the
same qo_indptr (`fi-tc` takes one q_len_per_req and is skipped); meld-q1 times each request's last token.

FlashInfer JIT-compiles each kernel family with nvcc on first use (~40 s each: the CUDA-core decode module
and the tensor-core (prefill) module, per head_dim), so a fresh machine spends ~2-3 min compiling before the
first numbers. This script sets FLASHINFER_CUDA_ARCH_LIST=9.0a itself when it is unset.
`--dry-run` lists the cases, their sizes and what will run, without a GPU.

Method (BENCH.md): every implementation gets the same random inputs (bf16, NHD paged cache
`[num_pages, 2, page_size, Hkv, D]`, page_size 16, pages of all requests drawn from one random permutation)
and is checked against a float64 reference before it is timed (‖out − ref‖/‖ref‖ < 1e-2, no NaN; meld's
lse too). Device time is the median of CUDA-graph replays with a cold L2 (`bench.harness.graph_time_us`);
meld's eager latency and its host-side `plan()` are reported beside it. Ceilings are measured in the same
run and every ratio in the table is taken side by side:
  meld TB/s = Σlen·Hkv·D·2(K,V)·2 bytes (fp8: 1 byte) / meld time;  speedup = best FlashInfer time / meld time (> 1: meld
  faster);  %read = meld TB/s / pure-read ceiling.
The exit status is 1 if any check or any implementation failed (the run still goes through every case).
"""
from __future__ import annotations

import os

os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")  # read when flashinfer is imported (lazily below)

import argparse
import dataclasses
import math
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `bench` and `meld` import as-is
from meld import workloads  # noqa: E402
from bench.harness import (  # noqa: E402
    GIB, Column, Impl, Table, add_timing_args, ceilings_line, env_info, env_line, failure_head, free_cuda,
    host_time_us, keep_available, measure, measure_ceilings, median_us, progress, read_floor_us, result_cell,
    speedup_span, timed_reps,
)

PAGE_SIZE = 16
DTYPE = torch.bfloat16
BATCHES = (1, 8, 64, 256)
DISTS = ("uniform2k", "skewed", "one-long")
IMPLS = ("meld", "fi-fa2", "fi-tc", "fi-prefill", "sdpa", "meld-bf16", "meld-q1", "meld-bf16math", "meld-h16")
FI_WORKSPACE_BYTES = 512 << 20   # fi-tc at q_len 8, B=256 asks for 256 MiB of it
MELD_OPTIONS: dict[str, Any] = {}  # extra DecodeAttention arguments (--cluster-size)
KV_LAYOUT = ["NHD"]  # --kv-layout: the cache layout meld and FlashInfer read (the reference keeps NHD)
KV_FP8: list[Optional[torch.dtype]] = [None]   # --kv-dtype fp8 / e5m2: the FP8 cache meld and FlashInfer read
Q_LEN = [1]          # --q-len: new tokens per request (q rows B * q_len)
RAGGED = [False]     # --ragged: 1..q_len new tokens per request, drawn per case


# ------------------------------------------------------------------------------------------- workloads

@dataclass(frozen=True)
class Case:
    """One workload: batch size, length distribution and head shape."""

    batch: int
    dist: str
    num_qo_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128

    @property
    def shape(self) -> str:
        return f"{self.num_qo_heads}/{self.num_kv_heads}/{self.head_dim}"

    @property
    def name(self) -> str:
        return f"B={self.batch} {self.dist} {self.shape}"


def select_cases(batches: Sequence[int], dists: Sequence[str], extra: bool, head_dim: int = 128) -> list[Case]:
    """The B x dist grid at `head_dim` (Hq=32 Hkv=8), plus BENCH.md's group-8 and D=64 cases (B=64 skewed) when
    that cell is selected, and group 16 (Hq=128 Hkv=8, Llama-3.1-405B's shape; not in BENCH.md) at B=64 for the
    selected uniform2k and skewed cells."""
    cases = [Case(b, d, head_dim=head_dim) for b in batches for d in dists]
    if extra and 64 in batches and "skewed" in dists:
        cases += [Case(64, "skewed", 64, 8, 128), Case(64, "skewed", 64, 8, 64)]
    if extra and 64 in batches:
        cases += [Case(64, d, 128, 8, 128) for d in ("uniform2k", "skewed") if d in dists]
    return cases


def request_lengths(dist: str, batch: int) -> list[int]:
    """KV lengths of the batch, exactly as BENCH.md defines them (`meld.workloads`)."""
    if dist not in DISTS:
        raise ValueError(f"unknown length distribution {dist!r}; expected one of {DISTS}")
    return workloads.lengths(dist, batch)


@dataclass
class PageTable:
    """FlashInfer's CSR page table on the host (int32), as both meld's and FlashInfer's `plan()` take it."""

    lengths: list[int]
    indptr: torch.Tensor  # [B + 1]
    indices: torch.Tensor  # [indptr[-1]]: page ids from one random permutation (scattered pages)
    last_page_len: torch.Tensor  # [B], in 1..page_size

    @property
    def num_pages(self) -> int:
        return int(self.indptr[-1])

    def pages_of(self, b: int) -> slice:
        return slice(int(self.indptr[b]), int(self.indptr[b + 1]))


def page_table(lengths: Sequence[int], page_size: int = PAGE_SIZE, seed: int = 0) -> PageTable:
    pb = workloads.paged(list(lengths), page_size, spare_pages=0, generator=torch.Generator().manual_seed(seed))
    return PageTable(list(lengths), pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)


def kv_elem_bytes() -> int:
    """Bytes per cached K or V value in this run (--kv-dtype)."""
    return 1 if KV_FP8[0] else 2


@dataclass
class Inputs:
    """One case's device inputs, shared by meld and every peer."""

    case: Case
    table: PageTable
    q: torch.Tensor  # [qo_indptr[-1], Hq, D]: request b's new tokens at rows qo_indptr[b] ... (--q-len, --ragged)
    qo_indptr: torch.Tensor  # [B + 1] int32 on the host: arange * q_len, or (--ragged) the drawn tokens' offsets
    kv_cache: torch.Tensor  # [num_pages, 2, page_size, Hkv, D], NHD; exactly the pages the table uses (fp8: the
                            # values the FP8 cache stands for, exactly: its scales are powers of two)
    kv_run: torch.Tensor  # the same cache in --kv-layout (HND: [num_pages, 2, Hkv, page_size, D]), as timed
    kv_fp8: Optional[torch.Tensor] = None  # --kv-dtype fp8/e5m2: kv_run's codes, K = codes k_scale, V = codes v_scale
    k_scale: float = 1.0
    v_scale: float = 1.0

    @property
    def kv_bytes(self) -> int:
        """KV bytes attention must read: Σlen x Hkv x D x (K and V) x 2 bytes (fp8: 1)."""
        return sum(self.table.lengths) * self.case.num_kv_heads * self.case.head_dim * 2 * kv_elem_bytes()


def _fp8(x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """x as codes of the run's FP8 format and the per-tensor scale (amax / the format's largest value, to a power of
    two, so that codes x scale are exactly bf16 values) they are read with."""
    scale = 2.0 ** math.ceil(math.log2(x.abs().max().item() / torch.finfo(KV_FP8[0]).max))
    return (x / scale).to(KV_FP8[0]), scale


def qo_offsets(batch: int, seed: int) -> torch.Tensor:
    """FlashInfer's qo_indptr of the case: q_len new tokens per request, or (--ragged) 1..q_len drawn per request."""
    tokens = torch.randint(1, Q_LEN[0] + 1, (batch,), generator=torch.Generator().manual_seed(seed)) if RAGGED[0] \
        else torch.full((batch,), Q_LEN[0])
    return torch.cat([torch.zeros(1, dtype=torch.int32), tokens.cumsum(0).int()])


def make_inputs(case: Case, seed: int = 0, device: str = "cuda") -> Inputs:
    table = page_table(request_lengths(case.dist, case.batch), PAGE_SIZE, seed)
    qo = qo_offsets(case.batch, seed)
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(int(qo[-1]), case.num_qo_heads, case.head_dim, generator=g, dtype=DTYPE, device=device)
    kv = torch.randn(table.num_pages, 2, PAGE_SIZE, case.num_kv_heads, case.head_dim, generator=g, dtype=DTYPE,
                     device=device)
    fp8 = {}
    if KV_FP8[0]:
        (k8, k_scale), (v8, v_scale) = _fp8(kv[:, 0]), _fp8(kv[:, 1])
        kv8 = torch.stack([k8, v8], dim=1)
        kv = torch.stack([k8.to(DTYPE) * k_scale, v8.to(DTYPE) * v_scale], dim=1)
        fp8 = dict(kv_fp8=kv8 if KV_LAYOUT[0] == "NHD" else kv8.transpose(2, 3).contiguous(), k_scale=k_scale,
                   v_scale=v_scale)
    return Inputs(case, table, q, qo, kv, kv if KV_LAYOUT[0] == "NHD" else kv.transpose(2, 3).contiguous(), **fp8)


def kv_cache_mib(case: Case, table: PageTable) -> float:
    return table.num_pages * 2 * PAGE_SIZE * case.num_kv_heads * case.head_dim * kv_elem_bytes() / (1 << 20)


def sdpa_padded_gib(case: Case, table: PageTable) -> float:
    max_pages = max(int(table.indptr[b + 1] - table.indptr[b]) for b in range(case.batch))
    return 2 * case.batch * case.num_kv_heads * max_pages * PAGE_SIZE * case.head_dim * 2 / GIB


# ------------------------------------------------------------------------------------------ correctness

def reference(inp: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention over each request's pages (`meld.runtime.reference.attention_reference`, causal among
    the --q-len new tokens): out [qo_indptr[-1], Hq, D] and lse [qo_indptr[-1], Hq] (natural log). One request at a time
    keeps the float64 copies of K and V small (<= 1 GiB for a 65536-token request)."""
    from meld.runtime.reference import attention_reference

    t, dev = inp.table, inp.q.device
    ragged = {"qo_indptr": inp.qo_indptr} if RAGGED[0] else {}   # (only then: bench/decode_ab.py's base tree may
    return attention_reference(inp.q, inp.kv_cache, t.indptr.to(dev), t.indices.to(dev),   # predate the argument)
                               t.last_page_len.to(dev), q_len=Q_LEN[0], **ragged)


def last_tokens(x: torch.Tensor, qo_indptr: torch.Tensor) -> torch.Tensor:
    """The rows of each request's last new token of a [qo_indptr[-1], ...] tensor: what a q_len = 1 decode of the
    same batch computes (that token sees every key)."""
    return x[qo_indptr[1:].long().to(x.device) - 1].contiguous()




# ------------------------------------------------------------------------------------- implementations

def build_meld(inp: Inputs, fp8: bool, one_token: bool = False, bf16_math: bool = False, rows16: bool = False) -> Impl:
    """meld.DecodeAttention with fixed table capacities: meld's docstring asks for them when run() is captured
    in a CUDA graph (plans within them rewrite the work tables in place, so the captured graph stays valid).
    `fp8`: on the FP8 cache with its scales; else on the bf16 cache. `one_token`: q_len = 1 on each request's
    last new token (meld-q1), else --q-len's. `bf16_math`: the FP8 build that meld builds, with fp8_math=""
    (meld-bf16math; its config read from the same operator on the CPU, which compiles nothing). `rows16`: the default
    build with 16-row units (meld-h16)."""
    import meld

    c, t = inp.case, inp.table
    q_len = 1 if one_token else Q_LEN[0]
    q = last_tokens(inp.q, inp.qo_indptr) if one_token else inp.q
    ragged = RAGGED[0] and not one_token
    op = dict(num_qo_heads=c.num_qo_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, page_size=PAGE_SIZE,
              dtype=DTYPE, kv_layout=KV_LAYOUT[0], kv_dtype=KV_FP8[0] if fp8 else None, max_batch_size=c.batch,
              max_num_pages=t.num_pages, q_len=q_len, ragged=ragged, **MELD_OPTIONS)
    if bf16_math:
        built = meld.DecodeAttention(device="cpu", **op).kernel_config
        op["kernel_config"] = dataclasses.replace(built, fp8_math="")
    if rows16:
        from meld.codegen import DecodeKernelConfig

        b = meld.DecodeAttention(device="cpu", **op).kernel_config
        op["kernel_config"] = DecodeKernelConfig.default(
            b.dtype, b.head_dim, onchip_merge=b.onchip_merge, group_size=c.num_qo_heads // c.num_kv_heads,
            batch_invariant=b.batch_invariant, kv_dtype=b.kv_dtype, variant=b.variant, q_len=q_len, heads_per_unit=16,
            ragged_q=ragged)
    t0 = time.perf_counter()
    attn = meld.DecodeAttention(device=str(inp.q.device), **op)
    init_us = (time.perf_counter() - t0) * 1e6
    cache, scales = (inp.kv_fp8, dict(k_scale=inp.k_scale, v_scale=inp.v_scale)) if fp8 else (inp.kv_run, {})

    qo = dict(qo_indptr=inp.qo_indptr) if ragged else {}

    def plan() -> None:
        attn.plan(t.indptr, t.indices, t.last_page_len, **qo)

    first = host_time_us(plan, reps=1, min_reps=1)  # may include compilation
    timing = host_time_us(plan, reps=200)  # the last of these calls is the plan that is run and captured
    out = torch.empty_like(q)  # like FlashInfer below: the timed call writes a preallocated output

    def outputs() -> list[tuple[str, torch.Tensor, Optional[torch.Tensor]]]:
        # Poisoned outputs: an element the kernel does not write stays NaN and fails the check.
        alloc = attn.run(q, cache, **scales)  # the allocating path, as a user calls it
        o1 = torch.full_like(q, math.nan)
        attn.run(q, cache, out=o1, **scales)
        o2 = torch.full_like(q, math.nan)
        lse = torch.full(q.shape[:2], math.nan, dtype=torch.float32, device=q.device)
        attn.run(q, cache, return_lse=True, out=o2, lse=lse, **scales)
        return [("run", alloc, None), ("run(out=)", o1, None), ("run(return_lse=True, out=, lse=)", o2, lse)]

    return Impl(lambda: attn.run(q, cache, out=out, **scales), outputs, timing, first.median_us, init_us)


def build_flashinfer(inp: Inputs, tensor_cores: bool) -> Impl:
    """FlashInfer 0.6.18 `BatchDecodeWithPagedKVCacheWrapper` in CUDA-graph mode (fixed buffers, fixed grid); with
    --kv-dtype fp8/e5m2 on the FP8 cache (kv_data_type at plan(), k_scale and v_scale at run())."""
    import flashinfer

    c, t, dev = inp.case, inp.table, inp.q.device
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        torch.zeros(FI_WORKSPACE_BYTES, dtype=torch.uint8, device=dev), kv_layout=KV_LAYOUT[0],
        use_cuda_graph=True, use_tensor_cores=tensor_cores,
        paged_kv_indptr_buffer=torch.empty(c.batch + 1, dtype=torch.int32, device=dev),
        paged_kv_indices_buffer=torch.empty(t.num_pages, dtype=torch.int32, device=dev),
        paged_kv_last_page_len_buffer=torch.empty(c.batch, dtype=torch.int32, device=dev),
    )

    fp8 = inp.kv_fp8 is not None
    cache, scales = (inp.kv_fp8, dict(k_scale=inp.k_scale, v_scale=inp.v_scale)) if fp8 else (inp.kv_run, {})

    multi = dict(q_len_per_req=Q_LEN[0]) if Q_LEN[0] > 1 else {}   # (tensor cores only: skip_reason)

    def plan() -> None:
        wrapper.plan(t.indptr, t.indices, t.last_page_len, c.num_qo_heads, c.num_kv_heads, c.head_dim, PAGE_SIZE,
                     pos_encoding_mode="NONE", q_data_type=DTYPE, kv_data_type=KV_FP8[0] if fp8 else DTYPE, **multi)

    first = host_time_us(plan, reps=1, min_reps=1)  # includes the JIT build on first use
    timing = host_time_us(plan, reps=20, max_s=1.0)
    out = torch.empty_like(inp.q)

    def outputs() -> list[tuple[str, torch.Tensor, Optional[torch.Tensor]]]:
        out.fill_(math.nan)  # FlashInfer writes into `out`: every element must be overwritten
        result = wrapper.run(inp.q, cache, out=out, **scales)   # (with v_scale, FlashInfer returns out * v_scale)
        return [("run", result.clone(), None)]

    return Impl(lambda: wrapper.run(inp.q, cache, out=out, **scales), outputs, timing, first.median_us)


def build_flashinfer_prefill(inp: Inputs) -> Impl:
    """FlashInfer 0.6.18 `BatchPrefillWithPagedKVCacheWrapper` (its default backend) on the --q-len new tokens of
    each request, causal (qo_indptr = arange * q_len, or --ragged's: the new tokens are the last of each request's
    keys), in
    CUDA-graph mode (fixed buffers); with --kv-dtype fp8/e5m2 on the FP8 cache."""
    import flashinfer

    c, t, dev = inp.case, inp.table, inp.q.device
    ints = dict(dtype=torch.int32, device=dev)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
        torch.zeros(FI_WORKSPACE_BYTES, dtype=torch.uint8, device=dev), kv_layout=KV_LAYOUT[0], use_cuda_graph=True,
        qo_indptr_buf=torch.empty(c.batch + 1, **ints), paged_kv_indptr_buf=torch.empty(c.batch + 1, **ints),
        paged_kv_indices_buf=torch.empty(t.num_pages, **ints), paged_kv_last_page_len_buf=torch.empty(c.batch, **ints))
    qo_indptr = inp.qo_indptr
    fp8 = inp.kv_fp8 is not None
    cache, scales = (inp.kv_fp8, dict(k_scale=inp.k_scale, v_scale=inp.v_scale)) if fp8 else (inp.kv_run, {})

    def plan() -> None:
        wrapper.plan(qo_indptr, t.indptr, t.indices, t.last_page_len, c.num_qo_heads, c.num_kv_heads, c.head_dim,
                     PAGE_SIZE, causal=True, q_data_type=DTYPE, kv_data_type=KV_FP8[0] if fp8 else DTYPE)

    first = host_time_us(plan, reps=1, min_reps=1)  # includes the JIT build on first use
    timing = host_time_us(plan, reps=20, max_s=1.0)
    out = torch.empty_like(inp.q)

    def outputs() -> list[tuple[str, torch.Tensor, Optional[torch.Tensor]]]:
        out.fill_(math.nan)
        return [("run", wrapper.run(inp.q, cache, out=out, **scales).clone(), None)]

    return Impl(lambda: wrapper.run(inp.q, cache, out=out, **scales), outputs, timing, first.median_us)


def build_sdpa(inp: Inputs) -> Impl:
    """torch SDPA on a padded cache [B, Hkv, maxlen, D] gathered once from the pages (bf16; with --kv-dtype fp8/e5m2
    the values the FP8 cache stands for), with a boolean mask.

    The q heads of a group are folded into SDPA's query-length axis (q as [B, Hkv, group, D]): the same
    math as GQA without repeating K/V, and it lets SDPA pick a fused backend despite the mask.
    """
    c, t, dev = inp.case, inp.table, inp.q.device
    group = c.num_qo_heads // c.num_kv_heads
    max_len = max(int(t.indptr[b + 1] - t.indptr[b]) for b in range(c.batch)) * PAGE_SIZE
    k = torch.zeros(c.batch, c.num_kv_heads, max_len, c.head_dim, dtype=DTYPE, device=dev)
    v = torch.zeros_like(k)
    indices = t.indices.to(dev, torch.long)
    for b in range(c.batch):
        kv = inp.kv_cache[indices[t.pages_of(b)]]
        n = kv.shape[0] * PAGE_SIZE
        k[b, :, :n] = kv[:, 0].reshape(n, c.num_kv_heads, c.head_dim).transpose(0, 1)
        v[b, :, :n] = kv[:, 1].reshape(n, c.num_kv_heads, c.head_dim).transpose(0, 1)
    lengths = torch.tensor(t.lengths, device=dev)
    mask = (torch.arange(max_len, device=dev) < lengths[:, None]).view(c.batch, 1, 1, max_len)
    q = inp.q.view(c.batch, c.num_kv_heads, group, c.head_dim)

    def run() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).reshape(c.batch, c.num_qo_heads, c.head_dim)

    return Impl(run, lambda: [("run", run(), None)])


BUILDERS: dict[str, Callable[[Inputs], Impl]] = {
    "meld": lambda inp: build_meld(inp, fp8=inp.kv_fp8 is not None),
    "meld-bf16": lambda inp: build_meld(inp, fp8=False),
    "meld-q1": lambda inp: build_meld(inp, fp8=inp.kv_fp8 is not None, one_token=True),
    "meld-bf16math": lambda inp: build_meld(inp, fp8=True, bf16_math=True),
    "meld-h16": lambda inp: build_meld(inp, fp8=inp.kv_fp8 is not None, rows16=True),
    "fi-fa2": lambda inp: build_flashinfer(inp, tensor_cores=False),
    "fi-tc": lambda inp: build_flashinfer(inp, tensor_cores=True),
    "fi-prefill": build_flashinfer_prefill,
    "sdpa": build_sdpa,
}


# ------------------------------------------------------------------------------------------------ run

# The group sizes FlashInfer's CUDA-core decode instantiates (DISPATCH_GQA_GROUP_SIZE, include/flashinfer/utils.cuh);
# any other raises at plan() (group 16 did on the H200).
FA2_GROUP_SIZES = (1, 2, 3, 4, 8)


def skip_reason(name: str, case: Case, table: PageTable, args: argparse.Namespace) -> Optional[str]:
    """Why a peer does not run a case (None: it does)."""
    group = case.num_qo_heads // case.num_kv_heads
    if name in ("meld-bf16", "meld-bf16math") and not KV_FP8[0]:
        return f"meld itself reads the bf16 cache ({name} is for --kv-dtype fp8 or e5m2)"
    if name in ("meld-q1", "fi-prefill", "meld-h16") and Q_LEN[0] == 1:
        return f"{name} is for --q-len > 1"
    if name == "fi-tc" and RAGGED[0]:
        return "fi-tc takes one q_len_per_req for the batch (--ragged)"
    if name in ("fi-fa2", "sdpa") and Q_LEN[0] > 1:
        return f"{name} decodes one token per request (--q-len {Q_LEN[0]})"
    if name == "fi-fa2" and group not in FA2_GROUP_SIZES:
        return f"group size {group} is not one of FlashInfer's CUDA-core decode sizes {FA2_GROUP_SIZES}"
    if name != "sdpa":
        return None
    if case.batch > args.sdpa_max_batch:
        return f"B > --sdpa-max-batch {args.sdpa_max_batch}"
    gib = sdpa_padded_gib(case, table)
    return f"padded cache {gib:.1f} GiB > {args.sdpa_max_gib} GiB" if gib > args.sdpa_max_gib else None


def summarise(case: Case, inp_bytes: int, table: PageTable, results: dict[str, dict[str, Any]],
              read_tbps: float, floor_us: Optional[float]) -> dict[str, Any]:
    """One table row: the headline numbers and ratios, plus every raw result for the JSON dump.
    `floor_us`: the pure read of the case's KV bytes (`read_floor_us`); best FlashInfer over it is about the
    largest speedup any kernel that reads the KV once could show on this case."""
    def tbps(t: Optional[float]) -> Optional[float]:
        return inp_bytes / (t * 1e-6) / 1e12 if t else None

    cell = partial(result_cell, results)  # a time, or why there is none
    m = results.get("meld", {})
    meld_us = median_us(m) if not m.get("errors") else None
    fi = {k: median_us(results[k]) for k in ("fi-fa2", "fi-tc", "fi-prefill") if isinstance(cell(k), float)}
    fi_best = min(fi, key=lambda k: fi[k]) if fi else None
    fi_us = fi[fi_best] if fi_best else None
    bf16_us, q1_us, bf16m_us, h16_us = cell("meld-bf16"), cell("meld-q1"), cell("meld-bf16math"), cell("meld-h16")
    return {
        "case": case.name, "B": case.batch, "dist": case.dist, "shape": case.shape,
        "sum_len": sum(table.lengths), "max_len": max(table.lengths), "kv_mib": kv_cache_mib(case, table),
        "kv_bytes": inp_bytes,
        "meld_us": cell("meld"), "meld_eager_us": median_us(m, "eager"), "meld_tbps": tbps(meld_us),
        "fa2_us": cell("fi-fa2"), "tc_us": cell("fi-tc"), "fi_us": fi_us, "fi_backend": fi_best,
        "fi_tbps": tbps(fi_us), "sdpa_us": cell("sdpa"), "meld_bf16_us": bf16_us,
        "fp8_gain": bf16_us / meld_us if isinstance(bf16_us, float) and meld_us else None,
        "prefill_us": cell("fi-prefill"), "meld_q1_us": q1_us,
        "bf16m_us": bf16m_us, "f16m_gain": bf16m_us / meld_us if isinstance(bf16m_us, float) and meld_us else None,
        "q1_ratio": meld_us / q1_us if isinstance(q1_us, float) and meld_us else None,
        "h16_us": h16_us, "h32_gain": h16_us / meld_us if isinstance(h16_us, float) and meld_us else None,
        "speedup": fi_us / meld_us if fi_us and meld_us else None,
        "floor_us": floor_us, "max_speedup": fi_us / floor_us if fi_us and floor_us else None,
        "pct_read": 100 * tbps(meld_us) / read_tbps if meld_us else None,
        "plan_us": median_us(m, "plan"),
        "rel_err": m.get("rel_err"),
        "results": results,
    }


COLUMNS = [  # the headline table; every raw number (spreads, FI plan times, errors) is in the JSON
    Column("B", "B"), Column("dist", "dist", align="<"), Column("shape", "Hq/Hkv/D"),
    Column("sum_len", "Σlen", "d"), Column("kv_mib", "KV MiB", ".0f"),
    Column("meld_us", "meld µs", ".1f"), Column("meld_eager_us", "eager µs", ".1f"),
    Column("meld_tbps", "meld TB/s", ".2f"),
    Column("fa2_us", "FI-fa2 µs", ".1f"), Column("tc_us", "FI-tc µs", ".1f"), Column("fi_us", "best-FI µs", ".1f"),
    Column("sdpa_us", "SDPA µs", ".1f"), Column("meld_bf16_us", "meld-bf16 µs", ".1f"),
    Column("fp8_gain", "bf16/fp8", ".2f"), Column("prefill_us", "FI-prefill µs", ".1f"),
    Column("meld_q1_us", "meld-q1 µs", ".1f"), Column("q1_ratio", "q/q1", ".2f"),
    Column("bf16m_us", "bf16m µs", ".1f"), Column("f16m_gain", "bf16m/fp8", ".2f"),
    Column("h16_us", "meld-h16 µs", ".1f"), Column("h32_gain", "h16/meld", ".2f"),
    Column("speedup", "speedup", ".2f"), Column("pct_read", "meld %read", ".0f"),
    Column("floor_us", "read µs", ".1f"), Column("max_speedup", "FI/read", ".2f"),
    Column("plan_us", "plan µs", ".0f"), Column("rel_err", "rel err", ".1e"),
]
DRY_COLUMNS = [
    Column("B", "B"), Column("dist", "dist", align="<"), Column("shape", "Hq/Hkv/D"),
    Column("sum_len", "Σlen", "d"), Column("max_len", "max len", "d"), Column("pages", "pages", "d"),
    Column("kv_mib", "KV MiB", ".0f"), Column("sdpa_gib", "SDPA pad GiB", ".1f"), Column("sdpa", "SDPA", align="<"),
]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", choices=BATCHES, help=f"batch sizes (default {BATCHES})")
    p.add_argument("--dist", nargs="+", choices=DISTS, help=f"length distributions (default {DISTS})")
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS), help="implementations to run")
    p.add_argument("--quick", action="store_true", help="B in (8, 64), no extra head shapes, 30 replays")
    p.add_argument("--no-extra", action="store_true", help="skip the group-8, D=64 and group-16 cases at B=64")
    p.add_argument("--head-dim", type=int, choices=(64, 128, 256, 512), default=128,
                   help="the grid's head_dim (the extra cases keep theirs; 512: FlashInfer's large-head decode)")
    add_timing_args(p)
    p.add_argument("--sdpa-max-batch", type=int, default=64, help="skip SDPA above this batch size")
    p.add_argument("--sdpa-max-gib", type=float, default=20.0, help="skip SDPA when its padded K+V exceeds this")
    p.add_argument("--cluster-size", type=int, help="meld's preferred cluster size (default: meld's default)")
    p.add_argument("--kv-layout", choices=("NHD", "HND"), default="NHD",
                   help="the cache layout meld and FlashInfer read (SDPA and the reference gather from NHD)")
    p.add_argument("--kv-dtype", choices=("bf16", "fp8", "e5m2"), default="bf16",
                   help="fp8 (e4m3) or e5m2: meld and FlashInfer read an FP8 cache with per-tensor scales; meld-bf16 "
                        "reads the bf16 cache of the same values (SDPA and the reference too)")
    p.add_argument("--q-len", type=int, choices=range(1, 9), default=1, metavar="N",
                   help="new tokens per request, 1-8 (causal among themselves): meld against FlashInfer's tensor-core "
                        "decode (q_len_per_req) and causal batch prefill, and meld's q_len = 1 time (meld-q1)")
    p.add_argument("--ragged", action="store_true",
                   help="with --q-len N: 1..N new tokens per request, drawn per request (meld's ragged build, "
                        "FlashInfer's batch prefill with that qo_indptr)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--commit", help="git commit to record when the repo's .git is not at hand")
    p.add_argument("--json", type=Path, help="write env, ceilings and every row here (rewritten after each case)")
    p.add_argument("--dry-run", action="store_true", help="list the cases and their sizes; no GPU needed")
    args = p.parse_args(argv)
    if args.quick:
        args.batch = args.batch or [8, 64]
        args.no_extra = True
    args.batch = args.batch or list(BATCHES)
    args.dist = args.dist or list(DISTS)
    args.reps = timed_reps(args.reps, args.quick)
    if args.ragged and args.q_len == 1:
        p.error("--ragged needs --q-len 2 to 8 (the most new tokens a request has)")
    return args


def preflight(impls: Sequence[str], env: dict[str, Any], failures: list[str]) -> list[str]:
    """Import meld and FlashInfer once: one that fails is reported once (not once per case) and dropped."""
    imports = {"meld": "meld", "fi-fa2": "flashinfer", "fi-tc": "flashinfer"}

    def probe(name: str) -> None:
        module = imports.get(name)
        if module is None:
            return
        env[module] = "import failed"  # until the import below succeeds
        mod = __import__(module)
        if module == "meld":
            getattr(mod, "DecodeAttention")
        env[module] = getattr(mod, "__version__", "?")

    return keep_available(impls, probe, failures, why=lambda name: f"import {imports[name]} failed")


def dry_run(cases: Sequence[Case], args: argparse.Namespace) -> None:
    t = Table(DRY_COLUMNS)
    for c in cases:
        pt = page_table(request_lengths(c.dist, c.batch), PAGE_SIZE, args.seed)
        skip = skip_reason("sdpa", c, pt, args) if "sdpa" in args.impls else "not selected"
        t.add({"B": c.batch, "dist": c.dist, "shape": c.shape, "sum_len": sum(pt.lengths), "max_len": max(pt.lengths),
               "pages": pt.num_pages, "kv_mib": kv_cache_mib(c, pt), "sdpa_gib": sdpa_padded_gib(c, pt),
               "sdpa": f"skip ({skip})" if skip else "run"})
    t.print()


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.cluster_size is not None:
        MELD_OPTIONS["cluster_size"] = args.cluster_size
    KV_LAYOUT[0] = args.kv_layout
    KV_FP8[0] = {"fp8": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}.get(args.kv_dtype)
    Q_LEN[0] = args.q_len
    RAGGED[0] = args.ragged
    cases = select_cases(args.batch, args.dist, extra=not args.no_extra, head_dim=args.head_dim)
    if args.dry_run:
        dry_run(cases, args)
        return 0
    if not torch.cuda.is_available():
        print("decode.py needs a CUDA GPU (use --dry-run to list the cases)", file=sys.stderr)
        return 2

    env = env_info()
    env["commit"] = args.commit or env["commit"]
    env["kv_layout"] = args.kv_layout
    env["kv_dtype"] = args.kv_dtype
    env["q_len"] = args.q_len
    env["ragged"] = args.ragged
    failures: list[str] = []
    args.impls = preflight(args.impls, env, failures)
    print(env_line(env), flush=True)

    ceilings = measure_ceilings()
    print(ceilings_line(ceilings), flush=True)

    table = Table(COLUMNS)
    for i, case in enumerate(cases, 1):
        torch.manual_seed(args.seed)
        inp = make_inputs(case, args.seed)
        print(f"[{i}/{len(cases)}] {case.name}: Σlen {sum(inp.table.lengths)}, max {max(inp.table.lengths)}, "
              f"KV cache {kv_cache_mib(case, inp.table):.0f} MiB", flush=True)
        ref = reference(inp)
        refs = {"meld-q1": tuple(last_tokens(x, inp.qo_indptr) for x in ref)}   # (q_len = 1 on the last tokens)
        results: dict[str, dict[str, Any]] = {}
        for name in args.impls:
            skip = skip_reason(name, case, inp.table, args)
            results[name] = {"skipped": skip} if skip else measure(
                partial(BUILDERS[name], inp), f"{inp.case.name} {name}", refs.get(name, ref), args, failures,
                eager=name == "meld")
            print(f"  {name:7s} {progress(results[name])}", flush=True)
        floor_us = read_floor_us(inp.kv_bytes, args.warmup, args.reps, not args.no_flush)
        table.add(summarise(case, inp.kv_bytes, inp.table, results, ceilings["read_tbps"], floor_us))
        del inp, ref
        free_cuda()
        if args.json:
            table.dump_json(args.json, env=env, ceilings=ceilings, args=vars(args), failures=failures)

    print()
    table.print()
    print("speedup = best FlashInfer µs / meld µs (> 1: meld faster); %read = meld TB/s / pure-read ceiling; "
          "read µs = a pure streaming read of the case's KV bytes, and FI/read about the largest speedup a kernel "
          "that reads them could show; times are CUDA-graph replay medians, plan µs is meld's host plan() median"
          + ("; bf16/fp8 = meld-bf16 µs / meld µs (the FP8 cache's gain)" if KV_FP8[0] else "")
          + ("; bf16m/fp8 = meld-bf16math µs / meld µs (> 1: the default f16 math is faster)"
             if "meld-bf16math" in args.impls and KV_FP8[0] else "")
          + (f"; q/q1 = meld µs at q_len {Q_LEN[0]} / meld-q1 µs (q_len 1, the same batch)" if Q_LEN[0] > 1 else "")
          + ("; h16/meld = meld-h16 µs / meld µs (> 1: the default's 32-row units are faster)"
             if "meld-h16" in args.impls and Q_LEN[0] > 1 else ""))
    print(summary_line(table.rows, failures))
    q1 = speedup_span([r for r in table.rows if r["B"] >= 64], "q1_ratio")
    if q1:
        print(f"q_len {Q_LEN[0]} against q_len 1 (meld µs / meld-q1 µs) at B >= 64 {q1}")
    return 1 if failures else 0


def summary_line(rows: Sequence[dict[str, Any]], failures: Sequence[str]) -> str:
    head, span = failure_head(failures), speedup_span(rows)
    if span is None:
        return f"summary: {head}; no meld-vs-FlashInfer ratio measured"
    best = max(((r["pct_read"], r["case"]) for r in rows if isinstance(r.get("pct_read"), float)),
               default=(math.nan, "-"))
    return (f"summary: meld vs best FlashInfer {span}; meld peaks at {best[0]:.0f}% of the read ceiling "
            f"({best[1]}); {head}")


if __name__ == "__main__":
    sys.exit(main())
