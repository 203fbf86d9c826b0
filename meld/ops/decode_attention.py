"""`meld.DecodeAttention`: paged GQA decode attention with FlashInfer's plan()/run() split.

plan() (meld/ops/paged_decode.py, shared with `DecodeMLA`) runs once per batch: it validates the page table
and hands it to the GPU planner, which cuts the work into one balanced segment per CTA (the cut of
`meld.scheduler.plan_decode`) and rewrites the work tables in place. run() only launches the one persistent
kernel, so it can be captured in a CUDA graph and replayed after later plans for other batches (within the
capacities given at construction).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import torch

from .. import config
from ..codegen import DECODE_PARAMS, TILE_TOKENS, DecodeKernelConfig, TensorMap
from ..scheduler import DecodeCost, Topology, cluster_rows
from .checks import check_finite, check_positive, expect, is_int
from .decode_graph import decode_attention_graph
from .paged_decode import PagedDecode, _Planned


_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
KV_LAYOUTS = ("NHD", "HND")
_LOG2E = 1.4426950408889634
_FLOAT32_MAX = 3.4028234663852886e38
# No clusters: no cluster size or merge path beats clusters of one beyond the noise, and merging on chip
# costs time at small batches (bench/decode_ablation.py; bench/RESULTS.md, "cluster sizes and merge paths",
# and "Figures moved from code comments").
DEFAULT_CLUSTER_SIZE = 1


def _describe_unit(units_per_request: int, head_blocks: int, group_size: int, heads_per_unit: int, unit: int) -> str:
    req, hb = divmod(unit, units_per_request)
    kv, qb = divmod(hb, head_blocks)
    first = kv * group_size + qb * heads_per_unit
    last = min(first + heads_per_unit, (kv + 1) * group_size) - 1
    return f"request {req}, kv head {kv}, q heads {first}-{last}"


class DecodeAttention(PagedDecode):
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
            step (bench/serve_layer.py) the kernel before attention, the KV append, is a tiny copy that
            leaves nothing to overlap, and the change stayed within the noise (bench/RESULTS.md, "the
            decode loop end to end; attention inside a captured step; dependent-launch overlap").
        MELD_PROFILE=1 builds the kernel with per-task timestamps; `last_trace()` returns them, and
            every eager run() writes a Chrome/Perfetto trace to MELD_PROFILE_DIR.

    Inputs that require grad, and tensor subclasses (nn.Parameter), are read as plain tensors; meld has
    no backward, and asking for one raises NotImplementedError. NaN or Inf in q or K gives NaN in out
    and lse for exactly the (request, q head) rows they reach; in V, NaN in out only (lse depends on the
    scores alone); other rows are unaffected.

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
        self.partial_width = head_dim
        self.group_size = num_qo_heads // num_kv_heads
        self.dtype, self.kv_layout, self.batch_invariant = dtype, kv_layout, batch_invariant
        # The kernel takes sm_scale * log2(e) as a float32: it must stay finite there.
        self.sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else \
            check_finite("sm_scale", sm_scale, _FLOAT32_MAX / _LOG2E)
        self._setup(self._graph(_DTYPES[dtype]), device)
        # The tuning database's entry for this shape on this GPU (MELD_TUNING_DB), unless cost or kernel is given.
        self.tuning = self._tuned(_DTYPES[dtype], self.shape_bucket) if cost is None and kernel_config is None else None
        xrank = self.lowering.transport or ""   # the graph's combine edge: partials crossing ranks, and how
        self.kernel_config = kernel_config or self._tuned_config("kernel", dataclasses.replace(
            DecodeKernelConfig.default(_DTYPES[dtype], head_dim, onchip_merge=cluster_size > 1,
                                       group_size=self.group_size, batch_invariant=batch_invariant), xrank=xrank))
        kc = self.kernel_config
        if (kc.dtype, kc.head_dim, kc.batch_invariant, kc.xrank) != (_DTYPES[dtype], head_dim, batch_invariant, xrank):
            raise ValueError(f"kernel_config is for {kc.dtype}, head_dim {kc.head_dim}, batch_invariant="
                             f"{kc.batch_invariant}, xrank={kc.xrank!r}; the operator is {_DTYPES[dtype]}, head_dim "
                             f"{head_dim}, batch_invariant={batch_invariant}, and its graph's partials "
                             + (f"cross ranks by {xrank!r}" if xrank else "stay on one GPU (xrank='')"))
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
        self._init_plan_state(functools.partial(_describe_unit, self.units_per_request, self.head_blocks,
                                                self.group_size, self.heads_per_unit))
        if self.device.type == "cuda":
            self._init_cuda(topology)
        else:
            self.topology = self._servable(topology or Topology.h200())
            self.cluster_mix = self.topology.cluster_mix(self.cluster_size)

    # --- setup ----------------------------------------------------------------------------------
    def _graph(self, dtype: str):
        """The task graph this operator runs (a composer over ranks puts its rank dimension in it)."""
        return decode_attention_graph(self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size, dtype)

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
        self._init_device()

    def _kv_strides(self) -> dict[str, int]:
        """The cache's strides in rows of head_dim elements, for the kernel's loads."""
        P, H = self.page_size, self.num_kv_heads
        slot, head = (H, 1) if self.kv_layout == "NHD" else (1, P)
        return dict(kv_page_stride=2 * P * H, kv_slot_stride=slot, kv_head_stride=head, kv_v_rows=P * H,
                    kv_hnd=int(self.kv_layout == "HND"))

    def _kernel_launch(self, tables, fields: dict[str, int]):
        from ..runtime.driver import PersistentLaunch

        params_struct = self.kernel_config.params
        return PersistentLaunch(self.kernel, self.cluster_mix, params_struct.pack(
            q=0, kv=0, out=0, lse=0, slot_base=tables.ptr(tables.off_slot_base), chunk=self._chunk,
            kv_map=TensorMap(), q_stride_b=0, q_stride_h=0, **self._kv_strides(), **fields,   # (set by run())
            num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads, group_size=self.group_size,
            head_blocks=self.head_blocks, units_per_request=self.units_per_request, page_size=self.page_size,
            sm_scale_log2=self.sm_scale * _LOG2E,   # (meld.distributed sets the fields DECODE_PARAMS lacks)
            **{f.name: 0 for f in params_struct.fields if f not in DECODE_PARAMS.fields}))

    @property
    def _chunk(self) -> int:
        """The chunk of batch-invariant plans (0: plans balance freely)."""
        return self.cost.invariant_chunk_tokens if self.batch_invariant else 0

    # --- plan -----------------------------------------------------------------------------------
    @property
    def _plan_clusters(self) -> list[tuple[int, int]]:
        """The cluster mix the planner places for: only where pieces in one cluster merge on chip."""
        return self.cluster_mix if self.kernel_config.onchip_merge and self.cluster_size > 1 else []

    # --- run ------------------------------------------------------------------------------------
    _run_inputs, _lse_meaning = ("q", "kv_cache"), "batch, num_qo_heads"

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
        return self._run((q, kv_cache), return_lse, out, lse)

    def _check_run(self, planned: _Planned, q: torch.Tensor, kv_cache: torch.Tensor) -> tuple[int, int, int]:
        shape = (planned.batch, self.num_qo_heads, self.head_dim)
        expect("q", q, self.dtype, shape, "batch of the last plan(), num_qo_heads, head_dim", self.device)
        self._check_kv_cache(kv_cache, planned)
        return shape

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
        self._launched()

    def _execute_cpu(self, planned: _Planned, q: torch.Tensor, kv_cache: torch.Tensor):
        nhd = kv_cache if self.kv_layout == "NHD" else kv_cache.transpose(2, 3)
        return self.lowering.executor(self.schedule, q, nhd, planned.kv_indices, self.sm_scale, self.lowering.combiner)
