"""`meld.DecodeAttention`: paged GQA decode attention with FlashInfer's plan()/run() split.

plan() runs once per batch: it validates the page table and hands it to the GPU planner, which cuts
the work into one balanced segment per CTA (the cut of `meld.scheduler.plan_decode`) and rewrites the
work tables in place. run() only launches the one persistent kernel, so it can be captured in a CUDA
graph and replayed after later plans for other batches (within the capacities given at construction).
"""
from __future__ import annotations

import ctypes
import dataclasses
import itertools
import math

import numpy as np
import torch

from .. import config
from ..runtime import host_helper
from ..codegen import (DECODE_PARAMS, PLAN_PARAMS, TILE_TOKENS, DecodeKernelConfig,
                       DecodePlanKernelConfig, TensorMap, compile_source)
from ..ir import Schedule, TaskGraph
from ..scheduler import DecodeCost, Topology, cluster_rows, plan_decode
from .checks import check_positive, expect, same_device
from .decode_graph import decode_attention_graph

def _host(t: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(t, np.ndarray):
        return t
    return t.numpy() if t.device.type == "cpu" else t.cpu().numpy()


def _max_page(indices: np.ndarray) -> int:
    """Largest page index, in one pass (negative indices wrap above 2**31 as uint32); -1 if empty."""
    if not len(indices):
        return -1
    top = int(indices.view(np.uint32).max())
    if top >= 2 ** 31:
        _page_table_error(5, int(np.flatnonzero(indices < 0)[0]), None, None, 0, indices)
    return top


def _page_table_error(code: int, where: int, indptr, last, num_indices: int, indices=None, page_size: int = 0):
    """Raise the ValueError for a page-table problem found by the NumPy checks or the C helper
    (codes as in meld/runtime/host/stage_page_table.c)."""
    if code in (1, 2):
        raise ValueError(f"kv_indptr must start at 0 and never decrease, got kv_indptr[{where}:{where + 2}]="
                         f"{np.asarray(indptr[where:where + 2]).tolist() if code == 2 else [int(indptr[0])]}")
    if code == 3:
        raise ValueError(f"kv_indptr[-1]={int(indptr[-1])} exceeds len(kv_indices)={num_indices}")
    if code == 4:
        raise ValueError(f"kv_last_page_len[{where}]={int(last[where])} is outside [1, page_size={page_size}]")
    raise ValueError(f"kv_indices[{where}]={int(indices[where])} is a negative page index")


_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
_LOG2E = 1.4426950408889634
# Measured on the H200 (bench/decode_ablation.py, bench/RESULTS.md): no cluster variant beats clusters of
# one by more than 0.4 us below B = 64 or 0.3% above (none at all since the grids are PDL-ordered,
# 280e7d9), and those with on-chip merges are 0.3-3 us slower at B <= 8.
DEFAULT_CLUSTER_SIZE = 1
_trace_seq = itertools.count()


class DecodeAttention:
    """Decode attention over a paged KV cache (FlashInfer NHD layout) for variable-length batches.

    Args:
        num_qo_heads, num_kv_heads: query and KV heads (num_qo_heads % num_kv_heads == 0).
        head_dim: 64, 128 or 256.
        page_size: tokens per KV page (any >= 1).
        dtype: torch.bfloat16 or torch.float16 (q, KV cache and output).
        device: "cuda[:i]" runs the generated kernel; "cpu" runs the same schedule on the CPU reference
            executor (float64), for machines without a GPU.
        sm_scale: softmax scale, default 1/sqrt(head_dim).
        max_batch_size, max_num_pages: capacities of the work tables. Give them when run() is captured
            in a CUDA graph: plans within them rewrite the tables in place and the graph stays valid.
            Without them the tables grow as needed (which invalidates captured graphs).
        cost: the planner's cost model (default `DecodeCost.default` for the kernel's unit size).
        topology: override the persistent grid (default: `Topology.discover` of the kernel; on the CPU
            an H200 with one CTA per SM, as the shipped kernel runs there).
        cluster_size: the preferred thread-block cluster size. The launch covers every SM with the
            mix `topology.cluster_mix(cluster_size)` (e.g. 30 clusters of 4 + 6 of 2 on an H200); the
            pieces of a split unit that land in one cluster merge through distributed shared memory,
            and the planner moves cuts between clusters to unit boundaries where that costs little
            (`DecodeCost.cluster_snap_tokens`).
            Default 1 (no clusters): the fastest on the H200 for every batch measured.
        MELD_PROFILE=1 builds the kernel with per-task timestamps; `last_trace()` returns them, and
            every eager run() writes a Chrome/Perfetto trace to MELD_PROFILE_DIR.

    Example:
        >>> attn = meld.DecodeAttention(32, 8, 128, 16, torch.bfloat16, "cuda")
        >>> attn.plan(kv_indptr, kv_indices, kv_last_page_len)   # int32, CPU tensors: no device sync
        >>> out, lse = attn.run(q, kv_cache, return_lse=True)
    """

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cuda", *,
                 sm_scale: float | None = None, max_batch_size: int | None = None,
                 max_num_pages: int | None = None, topology: Topology | None = None,
                 cost: DecodeCost | None = None, kernel_config: DecodeKernelConfig | None = None,
                 cluster_size: int = DEFAULT_CLUSTER_SIZE):
        for name, v in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads), ("page_size", page_size)):
            check_positive(name, v)
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads={num_qo_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        if head_dim not in (64, 128, 256):
            raise ValueError(f"head_dim must be 64, 128 or 256, got {head_dim!r}")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be torch.bfloat16 or torch.float16, got {dtype}")
        if cluster_size not in (1, 2, 4, 8, 16):
            raise ValueError(f"cluster_size must be 1, 2, 4, 8 or 16, got {cluster_size!r}")
        self.cluster_size = cluster_size
        for name, v in (("max_batch_size", max_batch_size), ("max_num_pages", max_num_pages)):
            if v is not None:
                check_positive(name, v)
        self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size = num_qo_heads, num_kv_heads, head_dim, page_size
        self.group_size = num_qo_heads // num_kv_heads
        self.dtype = dtype
        self.device = torch.device(device)
        self.sm_scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(head_dim)
        self.graph: TaskGraph = decode_attention_graph(num_qo_heads, num_kv_heads, head_dim, page_size, _DTYPES[dtype])
        self.kernel_config = kernel_config or DecodeKernelConfig.default(
            _DTYPES[dtype], head_dim, onchip_merge=cluster_size > 1, group_size=self.group_size)
        self.heads_per_unit = self.kernel_config.heads_per_unit
        cost = cost or DecodeCost.default(self.heads_per_unit)
        if cost.tile_tokens != TILE_TOKENS:
            raise ValueError(f"cost.tile_tokens={cost.tile_tokens} must equal the kernel's KV tile {TILE_TOKENS}")
        self.cost = cost
        self.head_blocks = -(-self.group_size // self.heads_per_unit)   # units per kv head
        self.units_per_request = num_kv_heads * self.head_blocks
        if config.profile() and not self.kernel_config.profile:
            self.kernel_config = dataclasses.replace(self.kernel_config, profile=True)
        if self.kernel_config.tma and page_size % TILE_TOKENS:
            raise ValueError(f"page_size={page_size}: a kernel with TMA rings needs pages that hold whole "
                             f"{TILE_TOKENS}-token tiles (a multiple of {TILE_TOKENS})")
        self._fixed_capacity = max_batch_size is not None and max_num_pages is not None
        self._cap = (max_batch_size or 64, max_num_pages or 4096)
        self._schedule: Schedule | None = None
        self._planned: tuple[torch.Tensor, torch.Tensor] | None = None
        self._max_page = -1
        self._helper_out = (ctypes.c_int(-1), ctypes.c_longlong(0))   # the C helper's max page and error index
        self._helper_out_ptrs = tuple(ctypes.byref(v) for v in self._helper_out)
        config.dump("decode_attention.taskgraph.json", self.graph.to_json())
        if self.device.type == "cuda":
            self._init_cuda(topology)
        elif self.device.type == "cpu":
            self.topology = topology or Topology.h200()
            self.cluster_mix = self.topology.cluster_mix(self.cluster_size)
            self._kv_indices_cpu = torch.zeros(0, dtype=torch.int32)
        else:
            raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")

    # --- setup ----------------------------------------------------------------------------------
    def _init_cuda(self, topology: Topology | None) -> None:
        from ..runtime.driver import Kernel, device_info
        from ..runtime.tensor_map import TensorMapCache

        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        info = device_info(self.device)
        if info.capability < (9, 0):
            raise ValueError(f"device {self.device} ({info.name}, sm_{info.capability[0]}{info.capability[1]}) "
                             "is not supported: meld's kernels need sm_90 (Hopper) or newer")
        kc = self.kernel_config
        self.kernel = Kernel(compile_source(kc.render(), kc.name), kc.entry, self.device, kc.threads, kc.smem_bytes)
        self.topology = topology or Topology.discover(self.kernel)
        self.cluster_mix = self.topology.cluster_mix(self.cluster_size)
        self._cluster_rows = torch.from_numpy(cluster_rows(self.cluster_mix)).to(self.device) \
            if self._plan_clusters else None
        self._tensor_maps = TensorMapCache() if kc.tma else None
        pc = DecodePlanKernelConfig()
        self.planner = Kernel(compile_source(pc.render(), pc.name), pc.entry, self.device, pc.threads,
                              pc.smem_bytes(self.topology.num_ctas))
        self._alloc(*self._cap)

    def _alloc(self, max_batch: int, max_pages: int) -> None:
        from ..runtime.tables import Capacity, WorkTables

        if hasattr(self, "tables"):           # growing: the GPU may still read the old staging buffers
            torch.cuda.synchronize(self.device)
        self._cap = (max_batch, max_pages)
        W = self.topology.num_ctas
        self.tables = WorkTables(self.device, W, Capacity(max_batch, max_pages))
        units = max_batch * self.units_per_request
        slots = units + W
        f32 = dict(dtype=torch.float32, device=self.device)
        self.part_o = torch.empty(slots * self.heads_per_unit * self.head_dim, **f32)
        self.part_lse = torch.empty(slots * self.heads_per_unit, **f32)
        self.counters = torch.zeros(units, dtype=torch.int32, device=self.device)
        t, c = self.tables, self.cost
        self._plan_params = PLAN_PARAMS.pack(     # one struct for every plan(): only `batch` changes
            kv_indptr=0, last_page_len=0, kv_len=t.ptr(t.off_kv_len), page_base=t.ptr(t.off_page_base),
            cta_table=t.ptr(0), line=t.line.data_ptr(), src_indices=0, dst_indices=t.ptr(t.off_indices),
            done_flag=0, arrive=t.arrive.data_ptr(), done_seq=0, batch=0,
            cluster_rows=self._cluster_rows.data_ptr() if self._cluster_rows is not None else 0,
            cluster_snap=c.cluster_snap_tokens,
            page_size=self.page_size, units_per_request=self.units_per_request, num_ctas=W,
            item_overhead=c.item_overhead_tokens, min_split=c.min_split_tokens, tile=c.tile_tokens,
            round=c.round_tokens, min_cta_tokens=c.min_cta_tokens)
        self._prof_cap = units + 3 if self.kernel_config.profile else 0   # every unit, 2 merges, the exit wait
        self._prof = torch.zeros(W, 1 + self._prof_cap, 4, dtype=torch.int64, device=self.device) \
            if self._prof_cap else None
        from ..runtime.driver import PersistentLaunch

        self._launcher = PersistentLaunch(self.kernel, self.cluster_mix, DECODE_PARAMS.pack(
            q=0, kv=0, out=0, lse=0, kv_indices=t.ptr(t.off_indices), kv_len=t.ptr(t.off_kv_len),
            page_base=t.ptr(t.off_page_base), cta_table=t.ptr(0), part_o=self.part_o.data_ptr(),
            part_lse=self.part_lse.data_ptr(), counters=self.counters.data_ptr(),
            prof=self._prof.data_ptr() if self._prof is not None else 0, kv_map=TensorMap(),   # set by run()
            q_stride_b=0, q_stride_h=0,
            num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads, group_size=self.group_size,
            head_blocks=self.head_blocks, units_per_request=self.units_per_request, page_size=self.page_size,
            num_ctas=W, cta_offset=0, prof_cap=self._prof_cap, sm_scale_log2=self.sm_scale * _LOG2E))

    # --- plan -----------------------------------------------------------------------------------
    @property
    def _plan_clusters(self) -> list[tuple[int, int]]:
        """The cluster mix the planner places for: only where pieces in one cluster merge on chip."""
        return self.cluster_mix if self.kernel_config.onchip_merge and self.cluster_size > 1 else []

    @property
    def schedule(self) -> Schedule:
        """The `meld.ir.Schedule` of the last plan() (on a GPU: the host planner's copy of the tables the
        GPU planner wrote, computed when first asked for)."""
        if self._schedule is None:
            if self._planned is None:
                raise RuntimeError("DecodeAttention.schedule: call plan() first")
            indptr, last = (_host(t).astype(np.int64) for t in self._planned)
            pages = indptr[1:] - indptr[:-1]
            kv_len = (pages * self.page_size + (last - self.page_size)) * (pages > 0)
            self._schedule = plan_decode(kv_len, indptr[:-1], self.num_kv_heads, self.group_size, self.topology,
                                         self.cost, self.heads_per_unit, self._plan_clusters)
        return self._schedule

    def plan(self, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor,
             *, check: bool = True) -> None:
        """Plan a batch from FlashInfer's paged layout (int32 tensors, CPU or this op's device).

        Args:
            kv_indptr: [B + 1] page-table offsets of each request in kv_indices.
            kv_indices: [>= kv_indptr[-1]] page indices into the KV cache.
            kv_last_page_len: [B] tokens in each request's last page (1..page_size; any for empty requests).
            check: validate the values (page indices, last-page lengths). CPU inputs are always checked
                and never synchronise with the device. GPU inputs are planned on the GPU; checking them
                reads them on the host (a synchronisation) — pass check=False to plan with no host
                involvement at all (then plan() can itself be captured in a CUDA graph).
        The schedule is at `self.schedule`.
        """
        expect("kv_indptr", kv_indptr, torch.int32, (None,), "B + 1 offsets", contiguous=True)
        B = kv_indptr.shape[0] - 1
        if B < 0:
            raise ValueError("kv_indptr must have B + 1 entries, got an empty tensor")
        expect("kv_indices", kv_indices, torch.int32, (None,), "page indices", contiguous=True)
        expect("kv_last_page_len", kv_last_page_len, torch.int32, (B,), "one entry per request, B = len(kv_indptr) - 1",
               contiguous=True)
        on_host = kv_indptr.is_cpu and kv_indices.is_cpu and kv_last_page_len.is_cpu
        if not on_host:
            for name, t in (("kv_indptr", kv_indptr), ("kv_indices", kv_indices),
                            ("kv_last_page_len", kv_last_page_len)):
                if t.device.type != "cpu" and not same_device(t.device, self.device):
                    raise ValueError(f"{name} must be on the CPU or on {self.device}, got {t.device}")
        self._schedule = None
        self._batch = B
        if self.device.type == "cpu":
            indptr, last = kv_indptr.numpy(), kv_last_page_len.numpy()
            nnz = self._check_page_table(indptr, last, kv_indices.numel())
            self._planned = (indptr.copy(), last.copy())
            self._kv_indices_cpu = kv_indices[:nnz].clone()
            self._max_page = _max_page(self._kv_indices_cpu.numpy())
        elif on_host:
            indptr = kv_indptr.numpy()
            nnz = int(indptr[-1])
            self._ensure_capacity(B, max(0, min(nnz, kv_indices.numel())))   # bad tables copy no more
            t = self.tables
            staged = t.stage()
            host = t.staging_ptr()
            raw = staged[t.off_raw:t.off_raw + 2 * B + 1]
            helper = host_helper.load()
            if helper is not None:   # validate and stage in one pass (C)
                top, where = self._helper_out
                err = helper.meld_stage_page_table(
                    kv_indptr.data_ptr(), kv_last_page_len.data_ptr(), kv_indices.data_ptr(), B, kv_indices.numel(),
                    self.page_size, host + 4 * t.off_raw, host + 4 * t.off_indices, self._helper_out_ptrs[0],
                    self._helper_out_ptrs[1])
                if err:
                    _page_table_error(err, where.value, indptr, kv_last_page_len.numpy(), kv_indices.numel(),
                                      kv_indices, self.page_size)
                self._max_page = top.value
            else:                    # NumPy: the same checks, more passes
                self._check_page_table(indptr, kv_last_page_len.numpy(), kv_indices.numel())
                ctypes.memmove(host + 4 * t.off_raw, kv_indptr.data_ptr(), 4 * (B + 1))
                ctypes.memmove(host + 4 * (t.off_raw + B + 1), kv_last_page_len.data_ptr(), 4 * B)
                ctypes.memmove(host + 4 * t.off_indices, kv_indices.data_ptr(), 4 * nnz)
                self._max_page = _max_page(staged[t.off_indices:t.off_indices + nnz])
            # The lazy `schedule` replans from these views: this staging buffer is rewritten two plans
            # later, when `_planned` already points at the newer one.
            self._planned = (raw[:B + 1], raw[B + 1:])
            flag, seq = t.commit()
            raw_ptr, src, copy_ctas = host + 4 * t.off_raw, host + 4 * t.off_indices, -(-nnz // (4 * 4 * 1024))
        else:
            if check:
                nnz = self._check_page_table(_host(kv_indptr), _host(kv_last_page_len), kv_indices.numel())
                self._max_page = _max_page(_host(kv_indices[:nnz]))
            else:          # trust the values: no host involvement at all
                nnz, self._max_page = kv_indices.numel(), -1
            self._ensure_capacity(B, nnz)
            t = self.tables
            # Mixed placements (say kv_indptr on the CPU, kv_indices on the GPU) move to the device first.
            t.copy_from_device(*(x.to(self.device).contiguous()
                                 for x in (kv_indptr, kv_last_page_len, kv_indices[:nnz])))
            self._planned = (kv_indptr, kv_last_page_len)
            flag, seq, src, copy_ctas = 0, 0, 0, 0
            raw_ptr = t.ptr(t.off_raw)
        if self.device.type == "cuda":
            p = self._plan_params
            p.batch, p.kv_indptr, p.last_page_len = B, raw_ptr, raw_ptr + 4 * (B + 1)
            p.src_indices, p.done_flag, p.done_seq = src, flag, seq
            self.planner.launch(1 + min(copy_ctas, 64), p)
        if config.dump_dir():
            config.dump("decode_attention.schedule.json", self.schedule.to_json())

    def _check_page_table(self, indptr: np.ndarray, last: np.ndarray, num_indices: int) -> int:
        """Validate kv_indptr / kv_last_page_len in a handful of vector ops; returns nnz = kv_indptr[-1]."""
        nnz = int(indptr[-1])
        pages = indptr[1:] - indptr[:-1]
        if indptr[0] != 0:
            _page_table_error(1, 0, indptr, last, num_indices)
        if len(last) and pages.min() < 0:
            _page_table_error(2, int(np.flatnonzero(pages < 0)[0]), indptr, last, num_indices)
        if nnz > num_indices:
            _page_table_error(3, 0, indptr, last, num_indices)
        # last - 1 must lie in [0, page_size) for non-empty requests; below 0 wraps to >= 2**31 as uint32.
        if len(last) and ((last - 1) * (pages > 0)).view(np.uint32).max() >= self.page_size:
            b = int(np.flatnonzero(((last < 1) | (last > self.page_size)) & (pages > 0))[0])
            _page_table_error(4, b, indptr, last, num_indices, page_size=self.page_size)
        return nnz

    def _ensure_capacity(self, batch: int, pages: int) -> None:
        cb, cp = self._cap
        if batch <= cb and pages <= cp:
            return
        if self._fixed_capacity:
            raise ValueError(f"batch of {batch} requests / {pages} pages exceeds the capacity given at construction "
                             f"(max_batch_size={cb}, max_num_pages={cp})")
        self._alloc(max(batch, 2 * cb if batch > cb else cb), max(pages, 2 * cp if pages > cp else cp))

    # --- run ------------------------------------------------------------------------------------
    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, *, return_lse: bool = False,
            out: torch.Tensor | None = None, lse: torch.Tensor | None = None):
        """Attention of q over the planned batch.

        Args:
            q: [B, num_qo_heads, head_dim] (last dim contiguous).
            kv_cache: [num_pages, 2, page_size, num_kv_heads, head_dim], contiguous; [:, 0] is K, [:, 1] is V.
            return_lse: also return the log-sum-exp [B, num_qo_heads] (float32, natural log).
            out, lse: optional preallocated outputs.
        Returns:
            out [B, num_qo_heads, head_dim] (and lse if return_lse). A request with no KV tokens gives
            zeros and lse = -inf.
        """
        if self._planned is None:
            raise RuntimeError("DecodeAttention.run: call plan() first")
        B = self._batch
        Hq, D = self.num_qo_heads, self.head_dim
        expect("q", q, self.dtype, (B, Hq, D), "batch of the last plan(), num_qo_heads, head_dim", self.device)
        expect("kv_cache", kv_cache, self.dtype, (None, 2, self.page_size, self.num_kv_heads, D),
               "num_pages, K/V, page_size, num_kv_heads, head_dim", self.device, contiguous=True)
        num_pages = kv_cache.shape[0]
        if self._max_page >= num_pages:
            raise ValueError(f"kv_indices of the last plan() reference page {self._max_page}, but kv_cache has "
                             f"only {num_pages} pages")
        if num_pages * 2 * self.page_size >= 2 ** 31:
            raise ValueError(f"kv_cache has {num_pages} pages of {self.page_size}: more than 2**31 token rows")
        if out is None:
            out = torch.empty(B, Hq, D, dtype=self.dtype, device=self.device)
        else:
            expect("out", out, self.dtype, (B, Hq, D), "like q", self.device, contiguous=True)
        if return_lse or lse is not None:
            if lse is None:
                lse = torch.empty(B, Hq, dtype=torch.float32, device=self.device)
            expect("lse", lse, torch.float32, (B, Hq), "batch, num_qo_heads", self.device, contiguous=True)
        if self.device.type == "cpu":
            self._run_cpu(q, kv_cache, out, lse)
        elif B:
            self._launch(q, kv_cache, out, lse)
        return (out, lse) if return_lse else out

    def _launch(self, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None) -> None:
        sb, sh, sd = q.stride()
        if sd != 1 or sb % 8 or sh % 8 or q.data_ptr() % 16:
            q = q.contiguous()
            sb, sh, _ = q.stride()
        if self._tensor_maps is not None:
            self._launcher.set(kv_map=self._tensor_maps.get(kv_cache))
        self._launcher.set(q=q.data_ptr(), kv=kv_cache.data_ptr(), out=out.data_ptr(),
                           lse=lse.data_ptr() if lse is not None else 0, q_stride_b=sb, q_stride_h=sh)
        self._launcher.launch()
        if self._prof is not None and not torch.cuda.is_current_stream_capturing():
            d = config.profile_dir()
            d.mkdir(parents=True, exist_ok=True)
            self.last_trace().write_chrome(d / f"decode_attention-{next(_trace_seq):04d}.trace.json")

    def last_trace(self):
        """Per-task timestamps of the last launch (waits for it): a `meld.runtime.profile.Trace`.
        Needs a kernel built with profiling (MELD_PROFILE=1 or kernel_config.profile)."""
        if self._prof is None:
            raise RuntimeError("DecodeAttention.last_trace: the kernel was built without profiling "
                               "(set MELD_PROFILE=1 or pass a kernel_config with profile=True)")
        from ..runtime.profile import Trace

        torch.cuda.synchronize(self.device)
        return Trace.from_buffer(self._prof.cpu().numpy(), self.units_per_request, self.head_blocks,
                                 cluster=self._launcher.cluster_of_cta(), grid=self._launcher.grid_of_cta())

    def _run_cpu(self, q, kv_cache, out, lse) -> None:
        from ..runtime.reference import execute_decode

        o, l = execute_decode(self.schedule, q, kv_cache, self._kv_indices_cpu, self.sm_scale)
        out.copy_(o.to(self.dtype))
        if lse is not None:
            lse.copy_(l.float())
