"""`meld.DecodeAttention`: paged GQA decode attention with FlashInfer's plan()/run() split.

plan() runs once per batch: it validates the page table and hands it to the GPU planner, which cuts
the work into one balanced segment per CTA (the cut of `meld.scheduler.plan_decode`) and rewrites the
work tables in place. run() only launches the one persistent kernel, so it can be captured in a CUDA
graph and replayed after later plans for other batches (within the capacities given at construction).

plan() is transactional: it validates everything before it changes anything, so a plan() that raises
leaves the previous plan, its tables and its buffers exactly as they were.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import itertools
import math
from dataclasses import dataclass

import numpy as np
import torch

from .. import config
from ..tuning.recorder import kv_lens, recorder
from ..runtime import host_helper
from ..codegen import DECODE_PARAMS, TILE_TOKENS, DecodeKernelConfig, DecodePlanKernelConfig, TensorMap
from ..ir import Schedule
from ..scheduler import DecodeCost, Topology, cluster_rows, plan_decode_host
from ..scheduler.decode_plan_host import plan_params
from .base import Operator
from .checks import check_finite, check_positive, expect, is_int, plain, same_device
from .decode_graph import decode_attention_graph
from .page_table import check_page_table, max_page, page_table_error


def _host(t: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(t, np.ndarray):
        return t
    return t.numpy() if t.device.type == "cpu" else t.cpu().numpy()


_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
KV_LAYOUTS = ("NHD", "HND")
_LOG2E = 1.4426950408889634
_FLOAT32_MAX = 3.4028234663852886e38
# Measured on the H200 (bench/decode_ablation.py, bench/RESULTS.md): no cluster variant beats clusters of
# one by more than 0.4 us below B = 64 or 0.3% above (none at all since the grids are PDL-ordered,
# 280e7d9), and those with on-chip merges are 0.3-3 us slower at B <= 8.
DEFAULT_CLUSTER_SIZE = 1
_DEFAULT_CAPACITY = (64, 4096)   # tables allocated before the first plan() when no capacity is given
_trace_seq = itertools.count()


@dataclass(frozen=True)
class _Planned:
    """What run() and `schedule` need of the last plan() that succeeded. Replaced whole, never edited."""

    batch: int
    indptr: np.ndarray | torch.Tensor   # kv_indptr and kv_last_page_len as planned, for `schedule`
    last: np.ndarray | torch.Tensor
    max_page: int                       # largest page index; -1: none, or not known (check=False)
    kv_indices: torch.Tensor | None     # the CPU executor's page indices


@dataclass
class _Buffers:
    """Everything on the device sized by the capacities: work tables, partials, counters, the kernel's
    launch (its parameter structs point into the others), the planner's parameters."""

    batch: int
    pages: int
    tables: object                      # meld.runtime.tables.WorkTables
    part_o: torch.Tensor
    part_lse: torch.Tensor
    counters: torch.Tensor
    prof: torch.Tensor | None
    prof_clock: torch.Tensor | None     # sampled profiles: the launch number and the exit tickets
    plan_params: ctypes.Structure
    launcher: object                    # meld.runtime.driver.PersistentLaunch


def _describe_unit(units_per_request: int, head_blocks: int, group_size: int, heads_per_unit: int, unit: int) -> str:
    req, hb = divmod(unit, units_per_request)
    kv, qb = divmod(hb, head_blocks)
    first = kv * group_size + qb * heads_per_unit
    last = min(first + heads_per_unit, (kv + 1) * group_size) - 1
    return f"request {req}, kv head {kv}, q heads {first}-{last}"


class _NoBackward(torch.autograd.Function):
    """Ties run()'s outputs to inputs that require grad, so that asking for a gradient reaches meld and
    gets a clear answer (meld computes attention for inference only)."""

    @staticmethod
    def forward(ctx, q, kv_cache, *outs):
        return tuple(o.view_as(o) for o in outs)

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError("meld.DecodeAttention has no backward: it is an inference kernel (run it under "
                                  "torch.no_grad(), or use a differentiable attention for training)")


class DecodeAttention(Operator):
    """Decode attention over a paged KV cache (FlashInfer's layouts) for variable-length batches.

    Args:
        num_qo_heads, num_kv_heads: query and KV heads (num_qo_heads % num_kv_heads == 0).
        head_dim: 64, 128 or 256.
        page_size: tokens per KV page (any >= 1).
        dtype: torch.bfloat16 or torch.float16 (q, KV cache and output).
        device: "cuda[:i]" runs the generated kernel; "cpu" runs the same schedule on the CPU reference
            executor (float64), for machines without a GPU.
        kv_layout: "NHD" (default): kv_cache is [num_pages, 2, page_size, num_kv_heads, head_dim]; "HND":
            [num_pages, 2, num_kv_heads, page_size, head_dim], as FlashInfer's. When num_kv_heads ==
            page_size the two shapes are the same: the cache is read as kv_layout says.
        sm_scale: softmax scale, a finite number; default 1/sqrt(head_dim).
        max_batch_size, max_num_pages: capacities of the work tables (requests per plan, entries of
            kv_indices used by a plan). Each one given is a limit: a plan() beyond it raises ValueError.
            Give both when run() is captured in a CUDA graph: plans within them rewrite the tables in
            place and the graph stays valid. A capacity not given grows as needed (which invalidates
            captured graphs).
        cost: the planner's cost model (default `DecodeCost.default` for the kernel's unit size; with
            MELD_TUNING_DB set and neither cost nor kernel_config given, the cost and kernel fields of the
            database's entry for this shape bucket, GPU and kernel source where there is one: `self.tuning`).
        topology: override the persistent grid (default: `Topology.discover` of the kernel; on the CPU
            an H200 with one CTA per SM, as the shipped kernel runs there).
        cluster_size: the preferred thread-block cluster size. The launch covers every SM with the
            mix `topology.cluster_mix(cluster_size)` (e.g. 30 clusters of 4 + 6 of 2 on an H200); the
            pieces of a split unit that land in one cluster merge through distributed shared memory,
            and the planner moves cuts between clusters to unit boundaries where that costs little
            (`DecodeCost.cluster_snap_tokens`).
            Default 1 (no clusters): the fastest on the H200 for every batch measured.
        batch_invariant: make each request's output bit-identical whatever else is in the batch and
            wherever it sits: a request's split points depend on its own length alone (every unit
            longer than `cost.invariant_chunk_tokens` is split into its chunks) and its pieces merge in
            a fixed order, through global memory. Costs speed (bench/RESULTS.md). Without it, results are
            bit-identical from run to run for the same batch, but not across batches.
        overlap: launch run() as a programmatic dependent of the kernel before it in the stream: the
            persistent CTAs start and read their work tables while that kernel ends, and wait for it
            before reading q and the KV cache. The first run() after a plan() is launched plainly, since
            the plan's own kernel writes those tables. Off by default: inside a captured Llama decode
            step at B <= 8 (bench/serve_layer.py) it changed attention's per-layer cost by -0.7 to
            +1.1 µs over two runs: no gain (the kernel before it there, the KV append, is a tiny copy).
        MELD_PROFILE=1 builds the kernel with per-task timestamps; `last_trace()` returns them, and
            every eager run() writes a Chrome/Perfetto trace to MELD_PROFILE_DIR.

    Inputs that require grad, and tensor subclasses (nn.Parameter), are read as plain tensors; meld has
    no backward, and asking for one raises NotImplementedError. NaN or Inf in q, K or V gives NaN in out
    and lse for exactly the (request, q head) rows they reach; other rows are unaffected.

    Example:
        >>> attn = meld.DecodeAttention(32, 8, 128, 16, torch.bfloat16, "cuda")
        >>> attn.plan(kv_indptr, kv_indices, kv_last_page_len)   # int32, CPU tensors: no device sync
        >>> out, lse = attn.run(q, kv_cache, return_lse=True)
    """

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cuda", *,
                 kv_layout: str = "NHD", sm_scale: float | None = None, max_batch_size: int | None = None,
                 max_num_pages: int | None = None, topology: Topology | None = None,
                 cost: DecodeCost | None = None, kernel_config: DecodeKernelConfig | None = None,
                 cluster_size: int = DEFAULT_CLUSTER_SIZE, batch_invariant: bool = False, overlap: bool = False):
        num_qo_heads, num_kv_heads, page_size = (check_positive(name, v) for name, v in (
            ("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads), ("page_size", page_size)))
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads={num_qo_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        if not is_int(head_dim) or head_dim not in (64, 128, 256):
            raise ValueError(f"head_dim must be 64, 128 or 256, got {head_dim!r}")
        head_dim = int(head_dim)
        if not isinstance(dtype, torch.dtype) or dtype not in _DTYPES:
            raise ValueError(f"dtype must be torch.bfloat16 or torch.float16, got {dtype}")
        if not isinstance(kv_layout, str) or kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
        if not is_int(cluster_size) or cluster_size not in (1, 2, 4, 8, 16):
            raise ValueError(f"cluster_size must be 1, 2, 4, 8 or 16, got {cluster_size!r}")
        cluster_size = int(cluster_size)
        if not isinstance(batch_invariant, bool):
            raise ValueError(f"batch_invariant must be True or False, got {batch_invariant!r}")
        if not isinstance(overlap, bool):
            raise ValueError(f"overlap must be True or False, got {overlap!r}")
        self.overlap = overlap
        self.max_batch_size = None if max_batch_size is None else check_positive("max_batch_size", max_batch_size)
        self.max_num_pages = None if max_num_pages is None else check_positive("max_num_pages", max_num_pages)
        if topology is not None and not isinstance(topology, Topology):
            raise ValueError(f"topology must be a meld.scheduler.Topology, got {type(topology).__name__}")
        if cost is not None and not isinstance(cost, DecodeCost):
            raise ValueError(f"cost must be a meld.scheduler.DecodeCost, got {type(cost).__name__}")
        if kernel_config is not None and not isinstance(kernel_config, DecodeKernelConfig):
            raise ValueError(f"kernel_config must be a meld.codegen.DecodeKernelConfig, got {type(kernel_config).__name__}")
        self.cluster_size = cluster_size
        self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size = num_qo_heads, num_kv_heads, head_dim, page_size
        self.group_size = num_qo_heads // num_kv_heads
        self.dtype, self.kv_layout, self.batch_invariant = dtype, kv_layout, batch_invariant
        # The kernel takes sm_scale * log2(e) as a float32: it must stay finite there.
        self.sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else \
            check_finite("sm_scale", sm_scale, _FLOAT32_MAX / _LOG2E)
        self._setup(decode_attention_graph(num_qo_heads, num_kv_heads, head_dim, page_size, _DTYPES[dtype]), device)
        # The tuning database's entry for this shape on this GPU (MELD_TUNING_DB), unless cost or kernel is given.
        self.tuning = self._tuned(_DTYPES[dtype], self.shape_bucket) if cost is None and kernel_config is None else None
        self.kernel_config = kernel_config or self._tuned_config("kernel", DecodeKernelConfig.default(
            _DTYPES[dtype], head_dim, onchip_merge=cluster_size > 1, group_size=self.group_size,
            batch_invariant=batch_invariant))
        kc = self.kernel_config
        if (kc.dtype, kc.head_dim, kc.batch_invariant) != (_DTYPES[dtype], head_dim, batch_invariant):
            raise ValueError(f"kernel_config is for {kc.dtype}, head_dim {kc.head_dim}, batch_invariant="
                             f"{kc.batch_invariant}; the operator is {_DTYPES[dtype]}, head_dim {head_dim}, "
                             f"batch_invariant={batch_invariant}")
        self.heads_per_unit = self.kernel_config.heads_per_unit
        if cost is None:
            cost = self._tuned_config("cost", DecodeCost.default(self.heads_per_unit))
        if cost.tile_tokens != TILE_TOKENS:
            raise ValueError(f"cost.tile_tokens={cost.tile_tokens} must equal the kernel's KV tile {TILE_TOKENS}")
        self.cost = cost
        self.head_blocks = -(-self.group_size // self.heads_per_unit)   # units per kv head
        self.units_per_request = num_kv_heads * self.head_blocks
        if config.profile() and not self.kernel_config.profile:
            self.kernel_config = dataclasses.replace(self.kernel_config, profile=True)
        self.profile_every = config.profile_every()
        if self.kernel_config.tma and page_size % TILE_TOKENS:
            raise ValueError(f"page_size={page_size}: a kernel with TMA rings needs pages that hold whole "
                             f"{TILE_TOKENS}-token tiles (a multiple of {TILE_TOKENS})")
        self._planned: _Planned | None = None
        self._plan_kernel_last = False   # the last kernel this op put on a stream was plan()'s
        self._schedule: Schedule | None = None   # of `_planned`, computed on first use
        self._buf: _Buffers | None = None
        self._watchdog = None
        self._helper_out = (ctypes.c_int(-1), ctypes.c_longlong(0))   # the C helper's max page and error index
        self._helper_out_ptrs = tuple(ctypes.byref(v) for v in self._helper_out)
        if self.device.type == "cuda":
            self._init_cuda(topology)
        else:
            self.topology = self._servable(topology or Topology.h200())
            self.cluster_mix = self.topology.cluster_mix(self.cluster_size)

    # --- setup ----------------------------------------------------------------------------------
    @property
    def shape_bucket(self) -> str:
        """What a tuned configuration of this operator is keyed by besides dtype and machine (meld.tuning.db)."""
        return (f"Hq{self.num_qo_heads}/Hkv{self.num_kv_heads}/D{self.head_dim}/P{self.page_size}/C{self.cluster_size}"
                + ("/invariant" if self.batch_invariant else ""))

    def _tuned_config(self, part: str, default):
        """`default` (a DecodeCost or DecodeKernelConfig) with the fields the tuning entry sets for `part`
        (`{"cost": {field: value}, "kernel": {field: value}}`)."""
        if self.tuning is None:
            return default
        fields_set = self.tuning.config.get(part, {})
        try:
            return dataclasses.replace(default, **fields_set)
        except (TypeError, ValueError) as e:
            raise ValueError(f"tuning database {config.tuning_db()}: the {self.shape_bucket} entry's {part} "
                             f"{fields_set!r} is not a {type(default).__name__}: {e}") from None

    @staticmethod
    def _servable(topology: Topology) -> Topology:
        limit = DecodePlanKernelConfig().max_ctas
        if topology.num_ctas > limit:
            raise ValueError(f"topology={topology}: {topology.num_ctas} CTA slots, but the planner serves grids of at "
                             f"most {limit} CTAs (its per-CTA scratch must fit one CTA's shared memory)")
        return topology

    def _init_cuda(self, topology: Topology | None) -> None:
        from ..runtime.tensor_map import TensorMapCache, kv_tensor_map

        self._require_hopper()
        kc = self.kernel_config
        self.kernel = self._kernels(kc, {kc.entry: (kc.threads, kc.smem_bytes)})[kc.entry]
        self.topology = self._servable(topology or Topology.discover(self.kernel))
        self.cluster_mix = self.topology.cluster_mix(self.cluster_size)
        self._cluster_rows = torch.from_numpy(cluster_rows(self.cluster_mix)).to(self.device) \
            if self._plan_clusters else None
        self._tensor_maps = TensorMapCache(functools.partial(kv_tensor_map, layout=self.kv_layout)) if kc.tma else None
        self._register_watchdog(kc.name, functools.partial(
            _describe_unit, self.units_per_request, self.head_blocks, self.group_size, self.heads_per_unit))
        pc = DecodePlanKernelConfig()
        self.planner = self._kernels(pc, {pc.entry: (pc.threads, pc.smem_bytes(self.topology.num_ctas))})[pc.entry]
        self._buf = self._make_buffers(self.max_batch_size or _DEFAULT_CAPACITY[0],
                                       self.max_num_pages or _DEFAULT_CAPACITY[1])

    def _kv_strides(self) -> dict[str, int]:
        """The cache's strides in rows of head_dim elements, for the kernel's loads."""
        P, H = self.page_size, self.num_kv_heads
        slot, head = (H, 1) if self.kv_layout == "NHD" else (1, P)
        return dict(kv_page_stride=2 * P * H, kv_slot_stride=slot, kv_head_stride=head, kv_v_rows=P * H,
                    kv_hnd=int(self.kv_layout == "HND"))

    def _make_buffers(self, max_batch: int, max_pages: int) -> _Buffers:
        from ..runtime.driver import PersistentLaunch
        from ..runtime.tables import Capacity, WorkTables

        W = self.topology.num_ctas
        t = WorkTables(self.device, W, Capacity(max_batch, max_pages))
        units = max_batch * self.units_per_request
        slots = self._chunk_slots(max_batch, max_pages) if self.batch_invariant else units + W
        f32 = dict(dtype=torch.float32, device=self.device)
        part_o = torch.empty(slots * self.heads_per_unit * self.head_dim, **f32)
        part_lse = torch.empty(slots * self.heads_per_unit, **f32)
        counters = torch.zeros(units, dtype=torch.int32, device=self.device)
        params = plan_params(   # one struct for every plan(): plan() sets the batch and the page table
            self.cost, self.page_size, self.units_per_request, W, self._chunk, kv_indptr=0, last_page_len=0,
            kv_len=t.ptr(t.off_kv_len), page_base=t.ptr(t.off_page_base), cta_table=t.ptr(0),
            line=t.line.data_ptr(), src_indices=0, dst_indices=t.ptr(t.off_indices), done_flag=0,
            arrive=t.arrive.data_ptr(), done_seq=0, batch=0, slot_base=t.ptr(t.off_slot_base),
            cluster_rows=self._cluster_rows.data_ptr() if self._cluster_rows is not None else 0)
        # Records per CTA: at most every piece (units, or with chunks up to every slot too), 2 merges, the exit wait.
        prof_cap = units + (slots if self.batch_invariant else 0) + 3 if self.kernel_config.profile else 0
        prof = torch.zeros(W, 1 + prof_cap, 4, dtype=torch.int64, device=self.device) if prof_cap else None
        clock = torch.zeros(2, dtype=torch.int32, device=self.device) if prof_cap and self.profile_every > 1 else None
        launcher = PersistentLaunch(self.kernel, self.cluster_mix, DECODE_PARAMS.pack(
            q=0, kv=0, out=0, lse=0, kv_indices=t.ptr(t.off_indices), kv_len=t.ptr(t.off_kv_len),
            page_base=t.ptr(t.off_page_base), cta_table=t.ptr(0), slot_base=t.ptr(t.off_slot_base),
            chunk=self._chunk, part_o=part_o.data_ptr(),
            part_lse=part_lse.data_ptr(), counters=counters.data_ptr(),
            prof=prof.data_ptr() if prof is not None else 0, kv_map=TensorMap(),   # set by run()
            prof_clock=clock.data_ptr() if clock is not None else 0, prof_every=self.profile_every,
            watchdog=self._watchdog.record_ptr, watchdog_claim=self._watchdog.claim_ptr,
            watchdog_kernel=self._watchdog_id, q_stride_b=0, q_stride_h=0, **self._kv_strides(),
            num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads, group_size=self.group_size,
            head_blocks=self.head_blocks, units_per_request=self.units_per_request, page_size=self.page_size,
            num_ctas=W, cta_offset=0, prof_cap=prof_cap, wait_inputs=0, sm_scale_log2=self.sm_scale * _LOG2E,
            **{f.name: 0 for f in DECODE_PARAMS.fields if f.name.startswith("x")}))   # set by meld.dist
        return _Buffers(max_batch, max_pages, t, part_o, part_lse, counters, prof, clock, params, launcher)

    @property
    def _chunk(self) -> int:
        """The chunk of batch-invariant plans (0: plans balance freely)."""
        return self.cost.invariant_chunk_tokens if self.batch_invariant else 0

    def _chunk_slots(self, max_batch: int, max_pages: int) -> int:
        """Partial slots a batch-invariant plan within the capacities can need: one per chunk of every unit
        of more than one chunk. With T tokens (at most max_pages full pages) that is at most
        min(2 T / (chunk + 1), T / chunk + B) chunks per unit position (a request of L > chunk tokens
        has ceil(L / chunk) <= 2 L / (chunk + 1) chunks)."""
        T, c = max_pages * self.page_size, self._chunk
        return self.units_per_request * min(2 * T // (c + 1), T // c + max_batch)

    def _capacity_for(self, batch: int, pages: int) -> tuple[int, int]:
        """The table capacities a plan of `batch` requests and `pages` page indices needs (the current ones
        when they suffice); a capacity given at construction is a limit."""
        if self.max_batch_size is not None and batch > self.max_batch_size:
            raise ValueError(f"batch of {batch} requests exceeds max_batch_size={self.max_batch_size} given at "
                             "construction")
        if self.max_num_pages is not None and pages > self.max_num_pages:
            raise ValueError(f"kv_indptr[-1]={pages} page indices exceed max_num_pages={self.max_num_pages} given "
                             "at construction")
        if self._buf is None:
            return batch, pages
        cb, cp = self._buf.batch, self._buf.pages
        return (cb if batch <= cb else max(batch, 2 * cb)), (cp if pages <= cp else max(pages, 2 * cp))

    def _buffers_for(self, batch: int, pages: int) -> _Buffers:
        """The current buffers, or larger ones (not yet installed: plan() installs them on success)."""
        cap = self._capacity_for(batch, pages)
        if cap == (self._buf.batch, self._buf.pages):
            return self._buf
        torch.cuda.synchronize(self.device)   # the GPU may still read the old buffers, staging included
        return self._make_buffers(*cap)

    # --- plan -----------------------------------------------------------------------------------
    @property
    def _plan_clusters(self) -> list[tuple[int, int]]:
        """The cluster mix the planner places for: only where pieces in one cluster merge on chip."""
        return self.cluster_mix if self.kernel_config.onchip_merge and self.cluster_size > 1 else []

    @property
    def tables(self):
        """The device work tables (`meld.runtime.tables.WorkTables`) the GPU planner writes."""
        if self._buf is None:
            raise RuntimeError("DecodeAttention.tables: the CPU executor has no device tables")
        return self._buf.tables

    @property
    def schedule(self) -> Schedule:
        """The `meld.ir.Schedule` of the last plan(), from the host build of the GPU planner (on a GPU: a
        copy of the tables the GPU planner wrote, computed when first asked for)."""
        if self._schedule is None:
            if self._planned is None:
                raise RuntimeError("DecodeAttention.schedule: call plan() first")
            self._schedule = plan_decode_host(_host(self._planned.indptr), _host(self._planned.last), self.page_size,
                                              self.num_kv_heads, self.group_size, self.topology, self.cost,
                                              self.heads_per_unit, self._plan_clusters, self._chunk)
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
        The schedule is at `self.schedule`. A plan() that raises changes nothing. Like FlashInfer's, the
        plan is written on torch's current stream: a run() on another stream must wait for it.
        """
        if self._watchdog is not None:
            self._watchdog.check()
        kv_indptr, kv_indices, kv_last_page_len = plain(kv_indptr), plain(kv_indices), plain(kv_last_page_len)
        expect("kv_indptr", kv_indptr, torch.int32, (None,), "B + 1 offsets", contiguous=True)
        B = kv_indptr.shape[0] - 1
        if B < 0:
            raise ValueError("kv_indptr must have B + 1 entries, got an empty tensor")
        expect("kv_indices", kv_indices, torch.int32, (None,), "page indices", contiguous=True)
        expect("kv_last_page_len", kv_last_page_len, torch.int32, (B,), "one entry per request, B = len(kv_indptr) - 1",
               contiguous=True)
        if not isinstance(check, bool):
            raise ValueError(f"check must be True or False, got {check!r}")
        on_host = kv_indptr.is_cpu and kv_indices.is_cpu and kv_last_page_len.is_cpu
        if not on_host:
            for name, t in (("kv_indptr", kv_indptr), ("kv_indices", kv_indices),
                            ("kv_last_page_len", kv_last_page_len)):
                if t.device.type != "cpu" and not same_device(t.device, self.device):
                    raise ValueError(f"{name} must be on the CPU or on {self.device}, got {t.device}")
        if self.device.type == "cpu":
            self._plan_cpu(B, kv_indptr, kv_indices, kv_last_page_len)
        elif on_host:
            self._plan_host(B, kv_indptr, kv_indices, kv_last_page_len)
        else:
            self._plan_device(B, kv_indptr, kv_indices, kv_last_page_len, check)
        if config.dump_dir():
            config.dump("decode_attention.schedule.json", self.schedule.to_json())

    def _commit(self, planned: _Planned, buf: _Buffers | None = None) -> None:
        """Install a validated plan (and grown buffers): the only place plan() changes the operator;
        and record the batch when MELD_RECORD samples it."""
        rec = recorder()
        if rec is not None and rec.due() and not any(isinstance(t, torch.Tensor) and t.device.type != "cpu"
                                                     for t in (planned.indptr, planned.last)):
            rec.record(self.graph.name, self.shape_bucket, kv_lens(_host(planned.indptr), _host(planned.last),
                                                                   self.page_size))
        self._planned, self._schedule = planned, None
        self._plan_kernel_last = True
        if buf is not None:
            self._buf = buf

    def _plan_cpu(self, B, kv_indptr, kv_indices, kv_last_page_len) -> None:
        indptr, last = kv_indptr.numpy(), kv_last_page_len.numpy()
        nnz = check_page_table(indptr, last, kv_indices.numel(), self.page_size)
        self._capacity_for(B, nnz)
        indices = kv_indices[:nnz].clone()
        self._commit(_Planned(B, indptr.copy(), last.copy(), max_page(indices.numpy()), indices))

    def _plan_host(self, B, kv_indptr, kv_indices, kv_last_page_len) -> None:
        """A page table on the host: validated and staged in pinned memory in one pass, then read from
        there by the GPU planner (one driver call, no wait for the device)."""
        indptr = kv_indptr.numpy()
        nnz = int(indptr[-1])
        buf = self._buffers_for(B, max(0, min(nnz, kv_indices.numel())))   # bad tables stage no more than that
        t = buf.tables
        staged = t.stage()    # the staging buffer the last plan did not use: the last plan keeps its own
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
                page_table_error(err, where.value, indptr, kv_last_page_len.numpy(), kv_indices.numel(),
                                 kv_indices, self.page_size)
            top = top.value
        else:                    # NumPy: the same checks, more passes
            check_page_table(indptr, kv_last_page_len.numpy(), kv_indices.numel(), self.page_size)
            top = max_page(kv_indices.numpy()[:nnz])
            ctypes.memmove(host + 4 * t.off_raw, kv_indptr.data_ptr(), 4 * (B + 1))
            ctypes.memmove(host + 4 * (t.off_raw + B + 1), kv_last_page_len.data_ptr(), 4 * B)
            ctypes.memmove(host + 4 * t.off_indices, kv_indices.data_ptr(), 4 * nnz)
        flag, seq = t.commit()
        host_raw = host + 4 * t.off_raw
        self._launch_planner(buf, B, host_raw, host_raw + 4 * (B + 1), host + 4 * t.off_indices, flag, seq,
                             copy_ctas=-(-nnz // (4 * 4 * 1024)))
        # `schedule` replans from these views: this staging buffer is rewritten two plans later, when
        # `_planned` already points at the newer one.
        self._commit(_Planned(B, raw[:B + 1], raw[B + 1:], top, None), buf)

    def _plan_device(self, B, kv_indptr, kv_indices, kv_last_page_len, check: bool) -> None:
        """A page table already on this GPU: device copies and the planner, no host staging; `check`
        reads it back to validate it first."""
        if check:
            nnz = check_page_table(_host(kv_indptr), _host(kv_last_page_len), kv_indices.numel(), self.page_size)
            top = max_page(_host(kv_indices[:nnz]))
        else:          # trust the values: no host involvement at all
            nnz, top = kv_indices.numel(), -1
        buf = self._buffers_for(B, nnz)
        # Mixed placements (say kv_indptr on the CPU, kv_indices on the GPU) move to the device first.
        parts = [x.to(self.device).contiguous() for x in (kv_indptr, kv_last_page_len, kv_indices[:nnz])]
        buf.tables.copy_from_device(*parts)
        raw = buf.tables.ptr(buf.tables.off_raw)
        self._launch_planner(buf, B, raw, raw + 4 * (B + 1), 0, 0, 0, copy_ctas=0)
        self._commit(_Planned(B, kv_indptr, kv_last_page_len, top, None), buf)

    def _launch_planner(self, buf: _Buffers, B: int, indptr: int, last: int, src_indices: int, flag: int,
                        seq: int, copy_ctas: int) -> None:
        p = buf.plan_params
        p.batch, p.kv_indptr, p.last_page_len = B, indptr, last
        p.src_indices, p.done_flag, p.done_seq = src_indices, flag, seq
        self.planner.launch(1 + min(copy_ctas, 64), p)

    def describe_unit(self, unit: int) -> str:
        """A unit of work in the terms of the batch: "request 3, kv head 1, q heads 4-7"."""
        return _describe_unit(self.units_per_request, self.head_blocks, self.group_size, self.heads_per_unit, unit)

    # --- run ------------------------------------------------------------------------------------
    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, *, return_lse: bool = False,
            out: torch.Tensor | None = None, lse: torch.Tensor | None = None):
        """Attention of q over the planned batch.

        Args:
            q: [B, num_qo_heads, head_dim] (last dim contiguous).
            kv_cache: [num_pages, 2, page_size, num_kv_heads, head_dim] (NHD) or [num_pages, 2, num_kv_heads,
                page_size, head_dim] (HND), as kv_layout says; contiguous; [:, 0] is K, [:, 1] is V.
            return_lse: also return the log-sum-exp [B, num_qo_heads] (float32, natural log).
            out, lse: optional preallocated outputs.
        Returns:
            out [B, num_qo_heads, head_dim] (and lse if return_lse). A request with no KV tokens gives
            zeros and lse = -inf.
        """
        if torch.compiler.is_dynamo_compiling():   # traced by torch.compile: one custom op, no graph break
            from .torch_ops import decode_attention
            return decode_attention(self, q, kv_cache, return_lse=return_lse, out=out, lse=lse)
        planned = self._planned
        if planned is None:
            raise RuntimeError("DecodeAttention.run: call plan() first")
        if return_lse is not True and return_lse is not False:
            raise ValueError(f"return_lse must be True or False, got {return_lse!r}")
        if self._watchdog is not None:
            self._watchdog.check()
        grad_inputs = None   # (the usual case, plain tensors that need no grad, tested first: run() is hot)
        if type(q) is not torch.Tensor or type(kv_cache) is not torch.Tensor or q.requires_grad or kv_cache.requires_grad:
            if torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in (q, kv_cache)):
                grad_inputs = (q, kv_cache)
            q, kv_cache = plain(q), plain(kv_cache)
        B = planned.batch
        Hq, D = self.num_qo_heads, self.head_dim
        expect("q", q, self.dtype, (B, Hq, D), "batch of the last plan(), num_qo_heads, head_dim", self.device)
        self._check_kv_cache(kv_cache, planned)
        if out is None:
            out = torch.empty(B, Hq, D, dtype=self.dtype, device=self.device)
        else:
            out = plain(out)
            expect("out", out, self.dtype, (B, Hq, D), "like q", self.device, contiguous=True)
        if return_lse or lse is not None:
            if lse is None:
                lse = torch.empty(B, Hq, dtype=torch.float32, device=self.device)
            else:
                lse = plain(lse)
            expect("lse", lse, torch.float32, (B, Hq), "batch, num_qo_heads", self.device, contiguous=True)
        if self.device.type == "cpu":
            self._run_cpu(q, kv_cache, out, lse)
        elif B:
            self._launch(q, kv_cache, out, lse)
        if grad_inputs:
            out, *rest = _NoBackward.apply(*grad_inputs, out, *([lse] if lse is not None else []))
            lse = rest[0] if rest else None
        return (out, lse) if return_lse else out

    def _check_kv_cache(self, kv_cache: torch.Tensor, planned: _Planned) -> None:
        """kv_cache's dtype, layout, device, and pages enough for the plan's page indices."""
        D, P, Hkv = self.head_dim, self.page_size, self.num_kv_heads
        if self.kv_layout == "NHD":
            expect("kv_cache", kv_cache, self.dtype, (None, 2, P, Hkv, D),
                   "num_pages, K/V, page_size, num_kv_heads, head_dim: kv_layout='NHD'", self.device, contiguous=True)
        else:
            expect("kv_cache", kv_cache, self.dtype, (None, 2, Hkv, P, D),
                   "num_pages, K/V, num_kv_heads, page_size, head_dim: kv_layout='HND'", self.device, contiguous=True)
        num_pages = kv_cache.shape[0]
        if planned.max_page >= num_pages:
            raise ValueError(f"kv_indices of the last plan() reference page {planned.max_page}, but kv_cache has "
                             f"only {num_pages} pages")
        if num_pages * 2 * P * Hkv >= 2 ** 31:
            raise ValueError(f"kv_cache has {num_pages} pages of {P} tokens x {Hkv} kv heads: more than 2**31 rows "
                             "of head_dim elements")

    def _launch(self, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None) -> None:
        sb, sh, sd = q.stride()
        if sd != 1 or sb % 8 or sh % 8 or q.data_ptr() % 16:
            q = q.contiguous()
            sb, sh, _ = q.stride()
        launcher = self._buf.launcher
        if self._tensor_maps is not None:
            launcher.set(kv_map=self._tensor_maps.get(kv_cache))
        launcher.set(q=q.data_ptr(), kv=kv_cache.data_ptr(), out=out.data_ptr(),
                     lse=lse.data_ptr() if lse is not None else 0, q_stride_b=sb, q_stride_h=sh)
        launcher.launch(overlap=self.overlap and not self._plan_kernel_last)
        self._plan_kernel_last = False
        if self._buf.prof is not None and self.profile_every == 1 and not torch.cuda.is_current_stream_capturing():
            d = config.profile_dir()
            d.mkdir(parents=True, exist_ok=True)
            self.last_trace().write_chrome(d / f"decode_attention-{next(_trace_seq):04d}.trace.json")

    def last_trace(self):
        """Per-task timestamps of the last launch (waits for it): a `meld.runtime.profile.Trace`; with
        MELD_PROFILE_EVERY=N, of the last launch sampled (the launch numbered 0, N, 2N, ... on the GPU).
        Needs a kernel built with profiling (MELD_PROFILE=1 or kernel_config.profile); raises RuntimeError
        otherwise, and on the CPU executor, which records no trace."""
        if self._buf is None:
            raise RuntimeError("DecodeAttention.last_trace: the CPU reference executor records no trace "
                               "(profiles come from the GPU kernel)")
        if self._buf.prof is None:
            raise RuntimeError("DecodeAttention.last_trace: the kernel was built without profiling "
                               "(set MELD_PROFILE=1 or pass a kernel_config with profile=True)")
        from ..runtime.profile import Trace

        torch.cuda.synchronize(self.device)
        launcher = self._buf.launcher
        return Trace.from_buffer(self._buf.prof.cpu().numpy(), self.units_per_request, self.head_blocks,
                                 cluster=launcher.cluster_of_cta(), grid=launcher.grid_of_cta())

    def _run_cpu(self, q, kv_cache, out, lse) -> None:
        from ..runtime.reference import execute_decode

        nhd = kv_cache if self.kv_layout == "NHD" else kv_cache.transpose(2, 3)
        o, l = execute_decode(self.schedule, q, nhd, self._planned.kv_indices, self.sm_scale)
        out.copy_(o.to(self.dtype))
        if lse is not None:
            lse.copy_(l.float())
