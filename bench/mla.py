"""Paged MLA decode attention (DeepSeek-V3, absorbed form): meld against FlashInfer's MLA (fa2, fa3) and FlashMLA.

Setup on the GPU machine (it has no network; the peers travel as wheels in `.whl/`, see
`../shared/tools/peer-wheels.sh`), from the repository root:

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD:$PYTHONPATH FLASHINFER_CUDA_ARCH_LIST=9.0a
    PYTHONUNBUFFERED=1 python3 bench/mla.py --quick --json $OUT/mla.json

Multi-token decode (`--q-len N`, 1 to 4; default 1): every request decodes N new tokens, causal among them
(token t of a request of L keys sees keys 0 .. L - N + t; the lengths below count the new tokens, as FlashMLA's
cache_seqlens): meld's `DecodeMLA(q_len=N)` against FlashMLA at s_q = N (q [B, N, H, 576], causal=True).
FlashInfer's MLA peer runs N = 1 only here (it is skipped, with the reason printed, for N > 1).

FP8 latent cache (`--kv-dtype fp8`, issue 41): the case's caches are quantised to one e4m3 cache [pages, 64, 576]
with a per-tensor power-of-two scale (kv_scale = 2^ceil(log2(amax / 448)), so the dequantised values are exact in
bf16), and three implementations read the same values: meld-fp8 (`DecodeMLA(kv_dtype=torch.float8_e4m3fn)`, run
with kv_scale), meld (the bf16 build over the dequantised bf16 cache: the A/B of the FP8 build) and flashmla-fp8
(FlashMLA's dense FP8 path, `flash_mla_with_kvcache(..., is_fp8_kvcache=True, use_legacy=True)` with metadata from
`get_mla_decoding_metadata(..., is_fp8_kvcache=True, use_legacy=True)`: the same [pages, 64, 1, 576] e4m3 cache and
descale_k = kv_scale, its q quantised to e4m3 with a per-tensor power-of-two descale_q, as its kernel takes it). A
wheel without that path is reported (the import fails, the run goes on without it). Each is checked against float64
over the dequantised cache at issue 41's 2e-2: meld's with bf16 q, FlashMLA's with the dequantised e4m3 q it is
given (against bf16 q its error is q's quantisation, 3.3e-2 on the H200).

FlashInfer JIT-compiles each MLA backend with nvcc on its first plan() (`fa2` and the SM90 `fa3`: 27 s and
24 s on the H200 machine's 16 cores, 2026-12-01), so a fresh machine spends about a minute compiling. This
script sets FLASHINFER_CUDA_ARCH_LIST=9.0a itself when it is unset. `--dry-run` lists the cases, their sizes
and what will run, without a GPU (and without FlashInfer or meld's DecodeMLA).

Workloads (BENCH.md, "MLA decode workloads"): 128 heads, compressed KV 512 (`ckv`) + rope 64 (`kpe`), one
latent KV row per token shared by every head, bf16, page_size 64, B in {16, 64, 128} x the GQA length
distributions uniform2k / skewed / one-long (`meld.workloads.lengths`), pages of all requests drawn from one
random permutation (`meld.workloads.paged`). sm_scale = 1/sqrt(128 + 64) (DeepSeek's head dim before
absorption).

Method (BENCH.md): every implementation gets the same random inputs (caches randn, q randn / sqrt(3), so a
score has standard deviation ~1: softmax neither uniform nor one-hot) and is checked against the float64
`meld.runtime.reference.mla_reference` before it is timed: ‖out − ref‖/‖ref‖ < 1e-2, no NaN, outputs poisoned
with NaN first wherever the implementation writes into a given buffer (meld's out= and lse=, FlashInfer's
out=); meld's lse (natural log) too; FlashInfer's lse is not checked (its timed call does not write one), nor
FlashMLA's (`sgl-flash-mla`'s SM90 dense path, which allocates its output; its lse's base is not documented).
Device time is the median of CUDA-graph replays with a cold L2 (`bench.harness.graph_time_us`); meld's eager
latency and its host-side `plan()` are reported beside it. The read, copy and bf16 matmul ceilings are
measured in the same run (`bench.harness.measure_ceilings`; 128-head MLA is compute-heavy: B=128 uniform2k
takes ~94 µs at 774 TFLOP/s against ~66 µs of reading at 4.57 TB/s; with N new tokens the FLOPs grow about
N-fold and the bytes stay).

Columns:
  tokens       Σlen of the batch;   meld / fi-fa2 / fi-fa3 / FlashMLA µs: CUDA-graph replay medians ("FAIL",
               "skip" or "-" where there is no number);
  speedup      best FlashInfer backend's time / meld time, per case (> 1: meld faster);
  vs FlashMLA  FlashMLA's time / meld time (> 1: meld faster);
  meld TB/s    Σlen·576·2 bytes / meld time (the KV read once, shared by all heads and new tokens);
  meld TFLOP/s Σkeys·H·(576 + 512)·2 / meld time (QK over 576 dims, PV over 512; Σkeys: the keys each new
               token sees, summed: Σlen at N = 1);   FlashMLA TFLOP/s: the same FLOPs / FlashMLA's time;
  %read        meld TB/s / the pure-read ceiling;   %mma: meld TFLOP/s / the bf16 matmul ceiling;
  eager µs     meld's eager latency (host launch cost included);   plan µs: meld's host plan() median;
  fp8 µs       with --kv-dtype fp8: meld-fp8's time; fp8/bf16: meld's bf16 time / it (> 1: the FP8 build faster);
               FlashMLA-fp8 µs and vs FlashMLA-fp8: FlashMLA's dense FP8 time / meld-fp8's;
  seesaw µs    with --schedule seesaw or both: meld's seesaw build (`MlaKernelConfig(schedule="seesaw")`) on the
               same inputs in the same run; seesaw vs FlashMLA: FlashMLA's time / its time; seesaw/default: the
               default build's time / its time (> 1: the seesaw faster).
The exit status is 1 if any check or any implementation failed (the run still goes through every case).
"""
from __future__ import annotations

import os

os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")  # read when flashinfer is imported (lazily below)

import argparse
import importlib
import math
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `bench` and `meld` import as-is
from meld import workloads  # noqa: E402
from bench.harness import (  # noqa: E402
    LSE_TOL, REL_TOL,
    Column, Impl, Table, add_timing_args, ceilings_line, env_info, env_line, failure_head, free_cuda, host_time_us,
    keep_available, measure, measure_ceilings, median_us, progress, result_cell, speedup_span,
    timed_reps,
)

NUM_HEADS = 128
HEAD_DIM_CKV = 512
HEAD_DIM_KPE = 64
PAGE_SIZE = 64
DTYPE = torch.bfloat16
SM_SCALE = 1.0 / math.sqrt(128 + 64)  # DeepSeek-V3: qk_nope_head_dim 128 + qk_rope_head_dim 64
Q_SCALE = 1.0 / math.sqrt(3.0)  # score std = Q_SCALE * sqrt(576) * SM_SCALE = 1 with randn caches
BATCHES = (16, 64, 128)
QUICK_BATCHES = (16, 128)
MAX_Q_LEN = 4   # --q-len: FlashMLA's s_q range that issue 39 asks for
DISTS = ("uniform2k", "skewed", "one-long")
# Opt-in (--dists), not BENCH.md cases: every request this long, so a CTA's blocks outnumber its fixed costs (its
# first Q and KV at the launch, its unit ends) and the ratio to FlashMLA is the steady block's; B = 66 gives each of
# 132 SMs one whole 64-head unit.
LONG_DISTS = {"uniform8k": 8192, "uniform32k": 32768}
ALL_DISTS = DISTS + tuple(LONG_DISTS)
IMPLS = ("meld", "fi-fa2", "fi-fa3", "flashmla")
SEESAW = "meld-seesaw"   # meld's seesaw build: in place of or beside "meld", as --schedule says
SCHEDULE_IMPLS = {"default": ["meld"], "seesaw": [SEESAW], "both": ["meld", SEESAW]}
FI_BACKENDS = {"fi-fa2": "fa2", "fi-fa3": "fa3"}
KV_DTYPES = ("bf16", "fp8")
FP8_IMPLS = {"meld-fp8": "meld", "meld": "meld", "flashmla-fp8": "flashmla"}   # --kv-dtype fp8: name -> --impls name
FP8_REL_TOL = 2e-2   # issue 41's bar for FP8 caches (against float64 over the dequantised cache)
E4M3_MAX = 448.0
FI_WORKSPACE_BYTES = 128 << 20
KV_ROW_BYTES = (HEAD_DIM_CKV + HEAD_DIM_KPE) * 2  # one token's latent row, bf16


# ------------------------------------------------------------------------------------------- workloads

@dataclass(frozen=True)
class Case:
    """One workload: batch size and length distribution (the head shape is fixed: DeepSeek-V3's)."""

    batch: int
    dist: str
    q_len: int = 1   # new tokens per request (FlashMLA's s_q)

    @property
    def name(self) -> str:
        return f"B={self.batch} {self.dist}" + (f" q{self.q_len}" if self.q_len > 1 else "")


def select_cases(batches: Sequence[int], dists: Sequence[str], q_len: int = 1) -> list[Case]:
    return [Case(b, d, q_len) for b in batches for d in dists]


def request_lengths(dist: str, batch: int) -> list[int]:
    """KV lengths of the batch, exactly as BENCH.md defines them for GQA (`meld.workloads`); LONG_DISTS' all alike."""
    if dist in LONG_DISTS:
        return [LONG_DISTS[dist]] * batch
    if dist not in DISTS:
        raise ValueError(f"unknown length distribution {dist!r}; expected one of {ALL_DISTS}")
    return workloads.lengths(dist, batch)


@dataclass
class PageTable:
    """FlashInfer's CSR page table on the host (int32): meld's plan() takes it as is, FlashInfer's MLA plan()
    takes the lengths (`kv_len`) instead of the last-page lengths."""

    lengths: list[int]
    indptr: torch.Tensor  # [B + 1], in pages
    indices: torch.Tensor  # [indptr[-1]]: page ids from one random permutation (scattered pages)
    last_page_len: torch.Tensor  # [B], in 1..page_size

    @property
    def num_pages(self) -> int:
        return int(self.indptr[-1])

    @property
    def kv_len(self) -> torch.Tensor:
        return torch.tensor(self.lengths, dtype=torch.int32)


def page_table(lengths: Sequence[int], seed: int = 0) -> PageTable:
    pb = workloads.paged(list(lengths), PAGE_SIZE, spare_pages=0, generator=torch.Generator().manual_seed(seed))
    return PageTable(list(lengths), pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)


def kv_bytes(table: PageTable) -> int:
    """Bytes attention must read: Σlen x (512 + 64) x 2 (one latent row per token, shared by all heads)."""
    return sum(table.lengths) * KV_ROW_BYTES


def flops(table: PageTable, q_len: int = 1) -> int:
    """Σkeys x H x (576 (QK) + 512 (PV)) x 2, Σkeys the keys each of a request's q_len new tokens sees (L - q_len +
    1 + t for token t), summed over tokens and requests."""
    keys = sum(q_len * n - q_len * (q_len - 1) // 2 for n in table.lengths)
    return keys * NUM_HEADS * (HEAD_DIM_CKV + HEAD_DIM_KPE + HEAD_DIM_CKV) * 2


def cache_mib(table: PageTable) -> float:
    return table.num_pages * PAGE_SIZE * KV_ROW_BYTES / (1 << 20)


@dataclass
class Inputs:
    """One case's device inputs, shared by meld and every peer."""

    case: Case
    table: PageTable
    q_nope: torch.Tensor  # [B * q_len, H, 512]: request b's new token t at row b * q_len + t
    q_pe: torch.Tensor  # [B * q_len, H, 64]
    ckv_cache: torch.Tensor  # [num_pages, page_size, 512]; exactly the pages the table uses
    kpe_cache: torch.Tensor  # [num_pages, page_size, 64]
    cache8: Optional[torch.Tensor] = None  # --kv-dtype fp8: [num_pages, page_size, 576] e4m3 (the caches above are
    kv_scale: float = 1.0                  # its values x kv_scale, exact in bf16)

    @property
    def kv_bytes(self) -> int:
        return kv_bytes(self.table)

    @property
    def flops(self) -> int:
        return flops(self.table, self.case.q_len)


def pow2_scale(t: torch.Tensor) -> float:
    """A per-tensor e4m3 scale: the power of two at or above amax / 448 (dequantised values stay exact in bf16)."""
    return 2.0 ** math.ceil(math.log2(max(float(t.abs().max()), 1e-30) / E4M3_MAX))


def make_inputs(case: Case, seed: int = 0, device: str = "cuda", kv_dtype: str = "bf16") -> Inputs:
    table = page_table(request_lengths(case.dist, case.batch), seed)
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float32, device=device)

    q_nope = (randn(case.batch * case.q_len, NUM_HEADS, HEAD_DIM_CKV) * Q_SCALE).to(DTYPE)
    q_pe = (randn(case.batch * case.q_len, NUM_HEADS, HEAD_DIM_KPE) * Q_SCALE).to(DTYPE)
    ckv = torch.randn(table.num_pages, PAGE_SIZE, HEAD_DIM_CKV, generator=g, dtype=DTYPE, device=device)
    kpe = torch.randn(table.num_pages, PAGE_SIZE, HEAD_DIM_KPE, generator=g, dtype=DTYPE, device=device)
    if kv_dtype == "bf16":
        return Inputs(case, table, q_nope, q_pe, ckv, kpe)
    both = torch.cat([ckv, kpe], dim=-1)
    scale = pow2_scale(both)
    cache8 = (both.float() / scale).to(torch.float8_e4m3fn)
    deq = cache8.to(DTYPE) * scale
    return Inputs(case, table, q_nope, q_pe, deq[..., :HEAD_DIM_CKV].contiguous(), deq[..., HEAD_DIM_CKV:].contiguous(),
                  cache8, scale)


# ------------------------------------------------------------------------------------------ correctness

def reference(inp: Inputs, q_e4m3: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 out [B * q_len, H, 512] and lse [B * q_len, H] (natural log), causal among a request's new tokens,
    one request at a time on the device. `q_e4m3`: of the queries FlashMLA's FP8 path is given (quantised_q's,
    dequantised), so that peer is held to the same tolerance over what it computes."""
    from meld.runtime.reference import mla_reference

    t = inp.table
    q_nope, q_pe = inp.q_nope, inp.q_pe
    if q_e4m3:
        q8, q_scale = quantised_q(inp)
        q = q8.double().flatten(0, 1) * q_scale
        q_nope, q_pe = q[..., :HEAD_DIM_CKV], q[..., HEAD_DIM_CKV:]
    return mla_reference(q_nope, q_pe, inp.ckv_cache, inp.kpe_cache, t.indptr, t.indices,
                         t.last_page_len, SM_SCALE, inp.case.q_len)


def quantised_q(inp: Inputs) -> tuple[torch.Tensor, float]:
    """The queries as FlashMLA's FP8 path takes them: e4m3 [B, q_len, H, 576] with a per-tensor power-of-two
    scale (q ≈ q8 * scale)."""
    c = inp.case
    q = torch.cat([inp.q_nope, inp.q_pe], dim=-1).view(c.batch, c.q_len, NUM_HEADS, -1)
    q_scale = pow2_scale(q)
    return (q.float() / q_scale).to(torch.float8_e4m3fn).contiguous(), q_scale




# ------------------------------------------------------------------------------------- implementations

def build_meld(inp: Inputs, schedule: str = "", fp8: bool = False, block_tokens: int | None = None,
               num_stages: int = 0, phases: bool = False, cost=None) -> Impl:
    """meld.DecodeMLA with fixed table capacities, so the captured graph stays valid across plans; `schedule`:
    its kernel build (`MlaKernelConfig.schedule`; "": the default, left to the build, whose tree may predate "");
    `fp8`: the e4m3 build over inp.cache8 (its default schedule);
    `block_tokens`: the bf16 build's KV block (MlaKernelConfig.block_tokens; None: its default); `num_stages`:
    the build's bf16 ring stages (MlaKernelConfig.num_stages; 0: its default); `phases`: the profiled build with
    phase stamps (tools/mla_phases.py reads them from the Impl's op); `cost`: the planner's DecodeCost (None: the
    op's default)."""
    import meld
    from meld.codegen.mla_kernel import MlaKernelConfig

    c, t, dev = inp.case, inp.table, inp.q_nope.device
    t0 = time.perf_counter()
    mla = meld.DecodeMLA(NUM_HEADS, PAGE_SIZE, dtype=DTYPE, device=str(dev), sm_scale=SM_SCALE,
                         head_dim_ckv=HEAD_DIM_CKV, head_dim_kpe=HEAD_DIM_KPE,
                         max_batch_size=c.batch, max_num_pages=t.num_pages,
                         kernel_config=MlaKernelConfig.for_cache("float8_e4m3fn", num_stages=num_stages, profile=phases,
                                                                 phases=phases) if fp8 else
                         MlaKernelConfig(num_stages=num_stages, profile=phases, phases=phases,
                                         **({"block_tokens": block_tokens} if block_tokens else {}),
                                         **({"schedule": schedule} if schedule else {})),
                         q_len=c.q_len, cost=cost,
                         kv_dtype=torch.float8_e4m3fn if fp8 else None)
    init_us = (time.perf_counter() - t0) * 1e6

    def plan() -> None:
        mla.plan(t.indptr, t.indices, t.last_page_len)

    first = host_time_us(plan, reps=1, min_reps=1)  # may include compilation
    timing = host_time_us(plan, reps=200)  # the last of these calls is the plan that is run and captured
    caches = (inp.cache8[..., :HEAD_DIM_CKV], inp.cache8[..., HEAD_DIM_CKV:]) if fp8 else (inp.ckv_cache, inp.kpe_cache)
    args = (inp.q_nope, inp.q_pe, *caches)
    run = partial(mla.run, kv_scale=inp.kv_scale) if fp8 else mla.run
    out = torch.empty_like(inp.q_nope)  # like FlashInfer below: the timed call writes a preallocated output

    def outputs() -> list[tuple[str, torch.Tensor, Optional[torch.Tensor]]]:
        # Poisoned outputs: an element the kernel does not write stays NaN and fails the check.
        alloc = run(*args)  # the allocating paths, as a user calls them
        alloc_o, alloc_lse = run(*args, return_lse=True)
        o1 = torch.full_like(inp.q_nope, math.nan)
        run(*args, out=o1)
        o2 = torch.full_like(inp.q_nope, math.nan)
        lse = torch.full(inp.q_nope.shape[:2], math.nan, dtype=torch.float32, device=dev)
        run(*args, return_lse=True, out=o2, lse=lse)
        return [("run", alloc, None), ("run(return_lse=True)", alloc_o, alloc_lse), ("run(out=)", o1, None),
                ("run(return_lse=True, out=, lse=)", o2, lse)]

    return Impl(lambda: run(*args, out=out), outputs, timing, first.median_us, init_us, op=mla)


def build_flashinfer(inp: Inputs, backend: str) -> Impl:
    """FlashInfer 0.6.18 `flashinfer.mla.BatchMLAPagedAttentionWrapper` in CUDA-graph mode: plan() copies the
    page table into the fixed device buffers given to the constructor, so captured pointers stay valid."""
    import flashinfer.mla

    c, t, dev = inp.case, inp.table, inp.q_nope.device
    i32 = dict(dtype=torch.int32, device=dev)
    wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(
        torch.empty(FI_WORKSPACE_BYTES, dtype=torch.uint8, device=dev), use_cuda_graph=True,
        qo_indptr=torch.empty(c.batch + 1, **i32), kv_indptr=torch.empty(c.batch + 1, **i32),
        kv_indices=torch.empty(t.num_pages, **i32), kv_len_arr=torch.empty(c.batch, **i32), backend=backend,
    )
    qo_indptr = torch.arange(c.batch + 1, dtype=torch.int32)  # decode: one query token per request
    kv_len = t.kv_len

    def plan() -> None:
        wrapper.plan(qo_indptr, t.indptr, t.indices, kv_len, NUM_HEADS, HEAD_DIM_CKV, HEAD_DIM_KPE, PAGE_SIZE,
                     False, SM_SCALE, DTYPE, DTYPE)  # causal=False, q_data_type, kv_data_type

    first = host_time_us(plan, reps=1, min_reps=1)  # includes the JIT build on first use
    timing = host_time_us(plan, reps=20, max_s=1.0)
    args = (inp.q_nope, inp.q_pe, inp.ckv_cache, inp.kpe_cache)
    out = torch.empty_like(inp.q_nope)

    def outputs() -> list[tuple[str, torch.Tensor, Optional[torch.Tensor]]]:
        out.fill_(math.nan)  # FlashInfer writes into `out`: every element must be overwritten
        wrapper.run(*args, out=out)
        return [("run(out=)", out.clone(), None)]

    return Impl(lambda: wrapper.run(*args, out=out), outputs, timing, first.median_us)


def build_flashmla(inp: Inputs) -> Impl:
    """FlashMLA (the `sgl-flash-mla` 1.0.0 wheel's SM90 dense path, `use_legacy=True`), as BENCH.md calls it:
    q [B, s_q, H, 576] (s_q = the case's q_len, causal when above 1), the cache as one [pages, 64, 1, 576] tensor
    (meld's two caches side by side, a copy), a block table padded to the longest request. Its scheduling
    metadata is filled by the first call (from q's shape: s_q x H query rows per KV head) and kept for this
    batch (the "plan"; a FlashMLASchedMeta serves one batch shape)."""
    import flash_mla

    c = inp.case
    q = torch.cat([inp.q_nope, inp.q_pe], dim=-1).view(c.batch, c.q_len, NUM_HEADS, -1).contiguous()
    cache = torch.cat([inp.ckv_cache, inp.kpe_cache], dim=-1).unsqueeze(2).contiguous()
    table, seqlens = block_table(inp)
    meta, _ = flash_mla.get_mla_metadata()

    def call() -> tuple[torch.Tensor, torch.Tensor]:
        return flash_mla.flash_mla_with_kvcache(q, cache, table, seqlens, HEAD_DIM_CKV, meta, softmax_scale=SM_SCALE,
                                                causal=c.q_len > 1, use_legacy=True)

    first = host_time_us(call, reps=1, min_reps=1)   # fills the metadata (and loads the kernels)

    def outputs() -> list[tuple[str, torch.Tensor, Optional[torch.Tensor]]]:
        # [B, s_q, H, 512] as meld's rows (its lse is not compared: base unstated)
        return [("flash_mla_with_kvcache", call()[0].flatten(0, 1), None)]

    return Impl(call, outputs, None, first.median_us)


def block_table(inp: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's block table (padded to the longest request) and cache_seqlens, on q's device."""
    c, t = inp.case, inp.table
    pages = torch.diff(t.indptr)
    table = torch.zeros(c.batch, max(1, int(pages.max())), dtype=torch.int32)
    for b in range(c.batch):
        table[b, :int(pages[b])] = t.indices[int(t.indptr[b]):int(t.indptr[b + 1])]
    return table.to(inp.q_nope.device), t.kv_len.to(inp.q_nope.device)


def build_flashmla_fp8(inp: Inputs) -> Impl:
    """FlashMLA's dense FP8 decode (the wheel's legacy SM90 path): q quantised to e4m3 (its kernel's input) with a
    per-tensor power-of-two descale_q (checked against reference(q_e4m3=True)), the e4m3 cache as [pages, 64, 1, 576] with descale_k = kv_scale, metadata
    from get_mla_decoding_metadata(..., is_fp8_kvcache=True, use_legacy=True) for this batch (the "plan")."""
    import flash_mla

    c, dev = inp.case, inp.q_nope.device
    q8, q_scale = quantised_q(inp)
    cache = inp.cache8.unsqueeze(2)
    table, seqlens = block_table(inp)
    descale_q = torch.tensor([q_scale], dtype=torch.float32, device=dev)
    descale_k = torch.tensor([inp.kv_scale], dtype=torch.float32, device=dev)
    meta, _ = flash_mla.get_mla_metadata()

    def plan() -> None:
        meta.tile_scheduler_metadata, meta.num_splits = flash_mla.get_mla_decoding_metadata(
            seqlens, c.q_len * NUM_HEADS, 1, is_fp8_kvcache=True, use_legacy=True)

    first = host_time_us(plan, reps=1, min_reps=1)

    def call() -> tuple[torch.Tensor, torch.Tensor]:
        return flash_mla.flash_mla_with_kvcache(q8, cache, table, seqlens, HEAD_DIM_CKV, meta, softmax_scale=SM_SCALE,
                                                causal=c.q_len > 1, is_fp8_kvcache=True, use_legacy=True,
                                                descale_q=descale_q, descale_k=descale_k)

    def outputs() -> list[tuple[str, torch.Tensor, Optional[torch.Tensor]]]:
        return [("flash_mla_with_kvcache(is_fp8_kvcache=True)", call()[0].flatten(0, 1), None)]

    return Impl(call, outputs, None, first.median_us)


BUILDERS: dict[str, Callable[[Inputs], Impl]] = {
    "meld": build_meld,
    SEESAW: partial(build_meld, schedule="seesaw"),
    "meld-fp8": partial(build_meld, fp8=True),
    "flashmla-fp8": build_flashmla_fp8,
    "fi-fa2": lambda inp: build_flashinfer(inp, "fa2"),
    "fi-fa3": lambda inp: build_flashinfer(inp, "fa3"),
    "flashmla": build_flashmla,
}


# ------------------------------------------------------------------------------------------------ run

def skip_reason(name: str, q_len: int = 1) -> Optional[str]:
    """Why an implementation does not run here (None: it does): FlashInfer's fa3 MLA kernel and FlashMLA's
    dense path are SM90-only; FlashInfer's MLA runs one new token per request here."""
    if name in FI_BACKENDS and q_len > 1:
        return f"{name} runs q_len 1 only in this benchmark (got --q-len {q_len})"
    if name in ("fi-fa3", "flashmla", "flashmla-fp8") and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9:
        major, minor = torch.cuda.get_device_capability()
        return f"{name} needs SM90, this GPU is sm_{major}{minor}"
    return None


def summarise(case: Case, table: PageTable, results: dict[str, dict[str, Any]],
              ceilings: dict[str, Any]) -> dict[str, Any]:
    """One table row: the headline numbers and ratios, plus every raw result for the JSON dump."""
    nbytes, nflops = kv_bytes(table), flops(table, case.q_len)
    cell = partial(result_cell, results)  # a time, or why there is none
    m = results.get("meld", {})
    meld_us = median_us(m) if not m.get("errors") else None
    fi = {k: median_us(results[k]) for k in FI_BACKENDS if isinstance(cell(k), float)}
    fi_best = min(fi, key=lambda k: fi[k]) if fi else None
    fi_us = fi[fi_best] if fi_best else None
    ss = results.get(SEESAW, {})
    seesaw_us = median_us(ss) if not ss.get("errors") else None
    fmla_us = median_us(results["flashmla"]) if isinstance(cell("flashmla"), float) else None
    fp8_us = median_us(results["meld-fp8"]) if isinstance(cell("meld-fp8"), float) else None
    fmla8_us = median_us(results["flashmla-fp8"]) if isinstance(cell("flashmla-fp8"), float) else None
    tbps = nbytes / (meld_us * 1e-6) / 1e12 if meld_us else None
    tflops = nflops / (meld_us * 1e-6) / 1e12 if meld_us else None
    fmla_tflops = nflops / (fmla_us * 1e-6) / 1e12 if fmla_us else None
    mma = ceilings["matmul_bf16_tflops"]
    return {
        "case": case.name, "B": case.batch, "dist": case.dist, "q_len": case.q_len,
        "sum_len": sum(table.lengths), "max_len": max(table.lengths), "pages": table.num_pages,
        "kv_bytes": nbytes, "flops": nflops, "cache_mib": cache_mib(table),
        "meld_us": cell("meld"), "meld_eager_us": median_us(m, "eager"),
        "fa2_us": cell("fi-fa2"), "fa3_us": cell("fi-fa3"), "fi_us": fi_us, "fi_backend": fi_best,
        "fi_tbps": nbytes / (fi_us * 1e-6) / 1e12 if fi_us else None,
        "speedup": fi_us / meld_us if fi_us and meld_us else None,
        "flashmla_us": cell("flashmla"),
        "vs_flashmla": fmla_us / meld_us if meld_us and fmla_us else None,
        "flashmla_tflops": fmla_tflops,
        "seesaw_us": cell(SEESAW), "seesaw_vs_flashmla": fmla_us / seesaw_us if seesaw_us and fmla_us else None,
        "seesaw_vs_default": meld_us / seesaw_us if seesaw_us and meld_us else None,
        "fp8_us": cell("meld-fp8"), "fp8_vs_bf16": meld_us / fp8_us if fp8_us and meld_us else None,
        "flashmla_fp8_us": cell("flashmla-fp8"), "fp8_vs_flashmla_fp8": fmla8_us / fp8_us if fp8_us and fmla8_us else None,
        "meld_tbps": tbps, "meld_tflops": tflops,
        "pct_read": 100 * tbps / ceilings["read_tbps"] if tbps else None,
        "pct_mma": 100 * tflops / mma if tflops else None,
        "pct_mma_flashmla": 100 * fmla_tflops / mma if fmla_tflops else None,
        "plan_us": median_us(m, "plan"),
        "rel_err": m.get("rel_err"),
        "results": results,
    }


COLUMNS = [  # the headline table; every raw number (spreads, FI plan times, errors) is in the JSON
    Column("B", "B"), Column("dist", "dist", align="<"), Column("sum_len", "tokens", "d"),
    Column("meld_us", "meld µs", ".1f"), Column("fa2_us", "fi-fa2 µs", ".1f"), Column("fa3_us", "fi-fa3 µs", ".1f"),
    Column("speedup", "speedup", ".2f"),
    Column("flashmla_us", "FlashMLA µs", ".1f"), Column("vs_flashmla", "vs FlashMLA", ".2f"),
    Column("seesaw_us", "seesaw µs", ".1f"), Column("seesaw_vs_flashmla", "seesaw vs FlashMLA", ".2f"),
    Column("seesaw_vs_default", "seesaw/default", ".2f"),
    Column("meld_tbps", "meld TB/s", ".2f"), Column("meld_tflops", "meld TFLOP/s", ".0f"),
    Column("flashmla_tflops", "FlashMLA TFLOP/s", ".0f"),
    Column("pct_read", "%read", ".0f"), Column("pct_mma", "%mma", ".0f"),
    Column("meld_eager_us", "eager µs", ".1f"), Column("plan_us", "plan µs", ".0f"),
    Column("rel_err", "rel err", ".1e"),
]
FP8_COLUMNS = [   # --kv-dtype fp8: after meld's
    Column("fp8_us", "fp8 µs", ".1f"), Column("fp8_vs_bf16", "fp8/bf16", ".2f"),
    Column("flashmla_fp8_us", "FlashMLA-fp8 µs", ".1f"), Column("fp8_vs_flashmla_fp8", "vs FlashMLA-fp8", ".2f"),
]
DRY_COLUMNS = [
    Column("B", "B"), Column("dist", "dist", align="<"), Column("sum_len", "tokens", "d"),
    Column("max_len", "max len", "d"), Column("pages", "pages", "d"), Column("kv_mib", "KV MiB", ".1f"),
    Column("gflop", "GFLOP", ".1f"), Column("read_us", "read µs*", ".1f"), Column("mma_us", "mma µs*", ".1f"),
    Column("impls", "runs", align="<"),
]
# BENCH.md's ceilings measured on the H200 (2026-11-29), for the dry run's rough bounds only.
BENCH_READ_TBPS, BENCH_MMA_TFLOPS = 4.57, 774.0


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", "--batch", dest="batches", type=int, nargs="+",
                   help=f"batch sizes (default {BATCHES})")
    p.add_argument("--dists", "--dist", dest="dists", nargs="+", choices=ALL_DISTS,
                   help=f"length distributions (default {DISTS}; {', '.join(LONG_DISTS)}: every request that long)")
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS), help="implementations to run")
    p.add_argument("--schedule", choices=tuple(SCHEDULE_IMPLS), default="default",
                   help="meld's kernel build(s): the default (the halves), the seesaw, or both (a same-run A/B)")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="bf16",
                   help="fp8: meld's e4m3 build, meld's bf16 build over the same values and FlashMLA's dense FP8 "
                        "(module docstring)")
    p.add_argument("--q-len", type=int, default=1,
                   help=f"new tokens per request, 1 to {MAX_Q_LEN} (FlashMLA's s_q; causal among them)")
    p.add_argument("--quick", action="store_true", help=f"B in {QUICK_BATCHES} (unless --batches), 30 replays")
    add_timing_args(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--commit", help="git commit to record when the repo's .git is not at hand")
    p.add_argument("--json", type=Path, help="write env, ceilings and every row here (rewritten after each case)")
    p.add_argument("--dry-run", action="store_true", help="list the cases and their sizes; no GPU needed")
    args = p.parse_args(argv)
    if args.batches and any(b < 1 for b in args.batches):
        p.error("--batches: every batch size must be >= 1")
    if not 1 <= args.q_len <= MAX_Q_LEN:
        p.error(f"--q-len must be from 1 to {MAX_Q_LEN}, got {args.q_len}")
    if args.quick:
        args.batches = args.batches or list(QUICK_BATCHES)
    args.batches = args.batches or list(BATCHES)
    args.dists = args.dists or list(DISTS)
    if args.kv_dtype == "fp8":
        args.impls = [name for name, base in FP8_IMPLS.items() if base in args.impls]
    else:
        args.impls = list(dict.fromkeys(x for i in args.impls for x in (SCHEDULE_IMPLS[args.schedule] if i == "meld" else [i])))
    args.reps = timed_reps(args.reps, args.quick)
    return args


def preflight(impls: Sequence[str], env: dict[str, Any], failures: list[str]) -> list[str]:
    """Import meld's DecodeMLA and FlashInfer's MLA wrapper once: one that fails is reported once (not once
    per case) and dropped."""
    imports = {"meld": ("meld", "DecodeMLA"), SEESAW: ("meld", "DecodeMLA"), "meld-fp8": ("meld", "DecodeMLA"),
               "flashmla-fp8": ("flash_mla", "get_mla_decoding_metadata"), "fi-fa2": ("flashinfer", "mla.BatchMLAPagedAttentionWrapper"),
               "fi-fa3": ("flashinfer", "mla.BatchMLAPagedAttentionWrapper"),
               "flashmla": ("flash_mla", "flash_mla_with_kvcache")}

    def probe(name: str) -> None:
        module, attr = imports[name]
        env[module] = "import failed"  # until the imports below succeed
        mod = importlib.import_module(module)
        owner = importlib.import_module(f"{module}.mla") if attr.startswith("mla.") else mod
        getattr(owner, attr.rsplit(".", 1)[-1])
        env[module] = getattr(mod, "__version__", "?")

    return keep_available(impls, probe, failures,
                          why=lambda name: f"import {'.'.join(imports[name])} failed")


def dry_run(cases: Sequence[Case], args: argparse.Namespace) -> None:
    print(f"MLA decode: H={NUM_HEADS}, ckv {HEAD_DIM_CKV} + kpe {HEAD_DIM_KPE}, bf16, page_size {PAGE_SIZE}, "
          f"{args.q_len} new token{'s' if args.q_len > 1 else ''} per request, "
          f"sm_scale 1/sqrt(192) = {SM_SCALE:.5f}; q randn x {Q_SCALE:.3f}, caches randn; pages shuffled "
          f"(seed {args.seed})")
    print(f"bytes = tokens x {KV_ROW_BYTES}; FLOPs = keys seen x {NUM_HEADS} x "
          f"{2 * HEAD_DIM_CKV + HEAD_DIM_KPE} x 2")
    t = Table(DRY_COLUMNS)
    for c in cases:
        pt = page_table(request_lengths(c.dist, c.batch), args.seed)
        t.add({"B": c.batch, "dist": c.dist, "sum_len": sum(pt.lengths), "max_len": max(pt.lengths),
               "pages": pt.num_pages, "kv_mib": kv_bytes(pt) / (1 << 20), "gflop": flops(pt, c.q_len) / 1e9,
               "read_us": kv_bytes(pt) / (BENCH_READ_TBPS * 1e12) * 1e6,
               "mma_us": flops(pt, c.q_len) / (BENCH_MMA_TFLOPS * 1e12) * 1e6,
               "impls": ", ".join(i for i in args.impls if skip_reason(i, c.q_len) is None)})
    t.print()
    print(f"* the KV read at {BENCH_READ_TBPS} TB/s and the FLOPs at {BENCH_MMA_TFLOPS:.0f} TFLOP/s (BENCH.md's "
          "H200 ceilings of 2026-11-29; a real run measures its own)")
    print(f"would run: ceilings (pure read, copy, bf16 matmul 8192^3); then per case and implementation: "
          f"build, plan() host-timed, check against the float64 mla_reference (rel err < "
          f"{FP8_REL_TOL if args.kv_dtype == 'fp8' else REL_TOL:.0e}, no NaN, "
          f"outputs poisoned; meld's lse < {LSE_TOL:.0e}), CUDA-graph replay x {args.reps} with "
          f"{'a warm' if args.no_flush else 'a cold'} L2 (+ meld eager)")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    cases = select_cases(args.batches, args.dists, args.q_len)
    if args.dry_run:
        dry_run(cases, args)
        return 0
    if not torch.cuda.is_available():
        print("mla.py needs a CUDA GPU (use --dry-run to list the cases)", file=sys.stderr)
        return 2

    env = env_info()
    env["commit"] = args.commit or env["commit"]
    failures: list[str] = []
    args.impls = preflight(args.impls, env, failures)
    print(env_line(env), flush=True)

    ceilings = measure_ceilings()
    print(ceilings_line(ceilings, matmul="bf16 matmul 8192^3"), flush=True)

    table = Table(COLUMNS[:4] + FP8_COLUMNS + COLUMNS[4:] if args.kv_dtype == "fp8" else COLUMNS)
    rel_tol = FP8_REL_TOL if args.kv_dtype == "fp8" else REL_TOL
    for i, case in enumerate(cases, 1):
        torch.manual_seed(args.seed)
        inp = make_inputs(case, args.seed, kv_dtype=args.kv_dtype)
        print(f"[{i}/{len(cases)}] {case.name}: Σlen {sum(inp.table.lengths)}, max {max(inp.table.lengths)}, "
              f"{inp.table.num_pages} pages, KV {inp.kv_bytes / (1 << 20):.0f} MiB, "
              f"{inp.flops / 1e9:.1f} GFLOP", flush=True)
        ref = reference(inp)
        results: dict[str, dict[str, Any]] = {}
        for name in args.impls:
            skip = skip_reason(name, case.q_len)
            results[name] = {"skipped": skip} if skip else measure(
                partial(BUILDERS[name], inp), f"{inp.case.name} {name}",
                reference(inp, q_e4m3=True) if name == "flashmla-fp8" else ref, args, failures,
                eager=name in ("meld", SEESAW, "meld-fp8"), rel_tol=rel_tol)
            print(f"  {name:7s} {progress(results[name])}", flush=True)
        table.add(summarise(case, inp.table, results, ceilings))
        del inp, ref
        free_cuda()
        if args.json:
            table.dump_json(args.json, env=env, ceilings=ceilings, args=vars(args), failures=failures)

    print()
    table.print()
    print("speedup = best FlashInfer backend µs / meld µs, vs FlashMLA = FlashMLA µs / meld µs (> 1: meld faster); TB/s = Σlen·576·2 bytes / time; "
          "TFLOP/s = Σkeys·H·1088·2 / time (Σkeys: keys seen, summed over new tokens); %read = of the pure-read ceiling, %mma = of the bf16 matmul ceiling; "
          "times are CUDA-graph replay medians (cold L2), plan µs is meld's host plan() median")
    print(summary_line(table.rows, failures))
    return 1 if failures else 0


def summary_line(rows: Sequence[dict[str, Any]], failures: Sequence[str]) -> str:
    """The run in one line: meld's ratios to each peer, and where meld and FlashMLA peak against the read and the
    bf16 matmul ceilings (TFLOP/s and their share of the measured matmul ceiling: with several new tokens per
    request the work is compute-bound)."""
    head, span, fmla = failure_head(failures), speedup_span(rows), speedup_span(rows, "vs_flashmla")
    parts = [f"meld vs best FlashInfer {span}" if span else "no meld-vs-FlashInfer ratio measured"]
    parts += [f"meld vs FlashMLA {fmla}"] if fmla else []
    for key, what in (("seesaw_vs_flashmla", "meld's seesaw vs FlashMLA"), ("seesaw_vs_default", "seesaw vs the default build"),
                      ("fp8_vs_bf16", "meld fp8 vs meld bf16"), ("fp8_vs_flashmla_fp8", "meld fp8 vs FlashMLA fp8")):
        parts += [f"{what} {speedup_span(rows, key)}"] if speedup_span(rows, key) else []

    def peak(key: str) -> dict[str, Any] | None:
        return max((r for r in rows if isinstance(r.get(key), float)), key=lambda r: r[key], default=None)

    if (rd := peak("pct_read")) is not None:
        parts.append(f"meld peaks at {rd['pct_read']:.0f}% of the read ceiling ({rd['case']})")
    for who, key, pct in (("meld", "meld_tflops", "pct_mma"), ("FlashMLA", "flashmla_tflops", "pct_mma_flashmla")):
        if (r := peak(key)) is not None and isinstance(r.get(pct), float):
            parts.append(f"{who} peaks at {r[key]:.0f} TFLOP/s, {r[pct]:.0f}% of the bf16 matmul ceiling ({r['case']})")
    return f"summary: {'; '.join(parts)}; {head}"


if __name__ == "__main__":
    sys.exit(main())
