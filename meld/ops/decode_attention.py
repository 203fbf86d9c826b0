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
from typing import NamedTuple

import torch

from .. import config
from ..codegen import TILE_TOKENS, DecodeKernelConfig, TensorMap
from ..codegen.decode_kernel import KV_FP8, MAX_Q_LEN, DecodeVariant
from ..scheduler import DecodeCost, Topology, cluster_rows
from .checks import check_finite, check_positive, check_scale, expect, is_int, plain, usual
from .decode_graph import decode_attention_graph
from .page_table import check_page_table, window_page_table
from .paged_decode import PagedDecode, _Planned, _host


_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
# The FP8 caches meld reads (kv_dtype: FlashInfer's and vLLM's e4m3 and e5m2 KV caches) -> the kernel's kv_dtype
FP8 = {getattr(torch, name): name for name in KV_FP8}
FP8_NAMES = " or ".join(map(str, FP8))   # (for error messages)
KV_LAYOUTS = ("NHD", "HND")
_LOG2E = 1.4426950408889634
_FLOAT32_MAX = 3.4028234663852886e38
# No clusters: no cluster size or merge path beats clusters of one beyond the noise, and merging on chip
# costs time at small batches (bench/decode_ablation.py; bench/RESULTS.md, "cluster sizes and merge paths",
# and "Figures moved from code comments").
DEFAULT_CLUSTER_SIZE = 1
_ALIGN = 16                      # bytes: the kernel's cp.async and TMA copies read 16-byte aligned chunks


def kv_parts(kv_cache: object) -> dict[str, object]:
    """The tensors a run()'s kv_cache names, by argument name: {"kv_cache": kv} for one cache, {"k_cache": k,
    "v_cache": v} for a (k_cache, v_cache) tuple (FlashInfer's two paged_kv_cache forms); anything else is a
    ValueError. (Not checked further: `DecodeAttention._check_kv_shapes`.)"""
    if isinstance(kv_cache, tuple):
        if len(kv_cache) != 2:
            raise ValueError(f"kv_cache as a tuple must be (k_cache, v_cache), got {len(kv_cache)} items")
        return {"k_cache": kv_cache[0], "v_cache": kv_cache[1]}
    if not isinstance(kv_cache, torch.Tensor):
        raise ValueError(f"kv_cache must be a torch.Tensor or a (k_cache, v_cache) tuple, got "
                         f"{type(kv_cache).__name__}")
    return {"kv_cache": kv_cache}


class _KV(NamedTuple):
    """A KV cache as run() checked it and the kernel reads it: K and V at their own addresses, with one set of
    strides."""

    tensors: dict[str, torch.Tensor]   # what run() reads, by argument name (`kv_parts`), plain
    k: int                             # K's and V's addresses
    v: int
    rows: tuple[int, int, int]         # their page, token and head strides, in rows of head_dim elements
    k_scale: float                     # an FP8 cache's dequantisation scales (1.0 for 16-bit caches)
    v_scale: float


POS_ENCODING_MODES = ("NONE", "ROPE_LLAMA")


def decode_variant(logits_soft_cap: object = None, window_left: object = -1, pos_encoding_mode: object = "NONE",
                   rope_scale: object = None, rope_theta: object = None) -> DecodeVariant:
    """The `DecodeVariant` of an operator's arguments, each checked with an error that names it and its value:
    logits_soft_cap None or 0 (off, as FlashInfer's 0.0) or a positive finite number (1e-30 to 1e30, so that
    the kernel's float32 constants stay finite); window_left -1 (no window) or a token count >= 0;
    pos_encoding_mode "NONE" or "ROPE_LLAMA", whose rope_scale and rope_theta are positive finite numbers
    (None: FlashInfer's 1 and 1e4) and are given with it only."""
    if pos_encoding_mode not in POS_ENCODING_MODES:
        raise ValueError(f"pos_encoding_mode must be one of {POS_ENCODING_MODES}, got {pos_encoding_mode!r}")
    rope = {"rope_scale": 1.0, "rope_theta": 0.0}
    for name, value, default in (("rope_scale", rope_scale, 1.0), ("rope_theta", rope_theta, 1e4)):
        if pos_encoding_mode == "NONE":
            if value is not None:
                raise ValueError(f"{name}={value!r} is for pos_encoding_mode='ROPE_LLAMA', got "
                                 f"pos_encoding_mode={pos_encoding_mode!r}")
            continue
        x = default if value is None else check_finite(name, value)
        if not 1e-30 <= x <= 1e30:
            raise ValueError(f"{name} must be a positive number from 1e-30 to 1e30, got {value!r}")
        rope[name] = x
    cap = 0.0
    if logits_soft_cap is not None:
        cap = check_finite("logits_soft_cap", logits_soft_cap)
        if cap < 0 or 0 < cap < 1e-30 or cap > 1e30:
            raise ValueError(f"logits_soft_cap must be None, 0 (off) or a positive number from 1e-30 to 1e30, got "
                             f"{logits_soft_cap!r}")
    if not is_int(window_left) or not -1 <= window_left < 2 ** 31:
        raise ValueError(f"window_left must be -1 (no window) or a token count >= 0 (below 2**31), got "
                         f"{window_left!r}")
    return DecodeVariant(cap if cap > 0 else 0.0, int(window_left), **rope)


def _describe_unit(units_per_request: int, head_blocks: int, group_size: int, heads_per_unit: int, q_len: int,
                   unit: int) -> str:
    """Unit `unit` in the terms of the batch; its rows are (q head, token) pairs, head-major (one token: q heads)."""
    req, hb = divmod(unit, units_per_request)
    kv, qb = divmod(hb, head_blocks)
    first = kv * group_size * q_len + qb * heads_per_unit
    last = min(first + heads_per_unit, (kv + 1) * group_size * q_len) - 1
    if q_len == 1:
        return f"request {req}, kv head {kv}, q heads {first}-{last}"
    return (f"request {req}, kv head {kv}, rows {first}-{last} (q heads {first // q_len}-{last // q_len} of its "
            f"{q_len} new tokens)")


class DecodeAttention(PagedDecode):
    """Decode attention over a paged KV cache (FlashInfer's layouts) for variable-length batches.

    Args:
        num_qo_heads, num_kv_heads: query and KV heads (num_qo_heads % num_kv_heads == 0).
        head_dim: 64, 128, 256 or 512.
        page_size: tokens per KV page (any >= 1).
        dtype: torch.bfloat16 or torch.float16 (q and output; the KV cache too unless kv_dtype says otherwise).
        kv_dtype: the KV cache's dtype: None or dtype, or torch.float8_e4m3fn or torch.float8_e5m2: FP8 values
            read at one byte each and dequantised on chip with run()'s per-tensor k_scale and v_scale (FlashInfer's
            FP8 KV cache: a cache element x stands for x * k_scale in K, x * v_scale in V).
        device: "cuda[:i]" runs the generated kernel; "cpu" runs the same schedule on the CPU reference
            executor (float64), for machines without a GPU.
        kv_layout: "NHD" (default): kv_cache is [num_pages, 2, page_size, num_kv_heads, head_dim], or K and V
            [num_pages, page_size, num_kv_heads, head_dim] each; "HND": [num_pages, 2, num_kv_heads, page_size,
            head_dim], or [num_pages, num_kv_heads, page_size, head_dim] each, as FlashInfer's. When
            num_kv_heads == page_size the two shapes are the same: the cache is read as kv_layout says.
        sm_scale: softmax scale, a finite number; default 1/sqrt(head_dim).
        logits_soft_cap: None or 0 (off), or c > 0: each scaled score s becomes c * tanh(s / c) before the
            softmax, lse included (FlashInfer's logits_soft_cap; Gemma 2's 50.0). A kernel of its own per c.
        window_left: -1 (off), or w >= 0: each request's query, its last token, attends to its last w + 1
            keys only, lse over them (FlashInfer's sliding window): plan() drops the pages wholly before the
            window (the kernel reads no more than those left) and the kernel masks the keys before the window
            in the first page left. A kernel of its own per w.
        pos_encoding_mode: "NONE", or "ROPE_LLAMA": Llama's rotary embedding ("rotate half") applied inside
            attention, each key at its position in its request and the query at the request's last, with
            frequencies rope_theta^(-2i/head_dim) / rope_scale (FlashInfer's; None: 1e4 and 1). q and the
            cache hold the keys unrotated. A kernel of its own per (rope_theta, rope_scale). The kernel rotates
            each key by its offset from the query (the same scores) and rounds it to the MMA type (bfloat16: 2^-9
            of each key), where FlashInfer rotates in float32. An FP8 cache's keys are rotated as they are stored
            and k_scale applies to the scores after, in FlashInfer's order (the rotation is linear: the same
            scores as rotating the dequantised keys).
        q_len: new tokens per request, 1 to 8 (speculative decoding's drafts, multi-token prediction; FlashInfer's
            q_len_per_req): run()'s q and out are [B * q_len, num_qo_heads, head_dim], a request's tokens
            consecutive, and token j of a request of kv_len tokens (the cache already holds its q_len new ones)
            attends to keys 0 .. kv_len - q_len + j (causal among the new tokens). Fixed at construction: it is
            compiled into the kernel and shapes the work tables (a unit is up to 32 (q head, token) rows of one
            kv head), so every plan() rewrites the same tables for the same kernel and a captured run() replays
            any later plan; a plan() that changed it would need another kernel, which a graph cannot follow. A
            kernel of its own per q_len; soft cap, FP8 and separate K/V caches, both layouts and batch
            invariance work with it, a sliding window and RoPE (whose key positions are the last token's) do
            not (ValueError).
        ragged: with q_len = n > 1, requests of 1 to n new tokens each, as plan()'s qo_indptr gives them (FlashInfer's
            prefill layout: request b's tokens are q's rows qo_indptr[b] .. qo_indptr[b + 1], q and out
            [qo_indptr[-1], num_qo_heads, head_dim]); token j of a request of n_b new tokens attends to keys
            0 .. kv_len - n_b + j. A kernel of its own (n's, its rows read from the planned qo_indptr): a request's
            missing tokens cost tensor-core rows but no KV bytes. A captured run() replays later plans' qo_indptr as
            it does their page tables, reading and writing their first qo_indptr[-1] rows from the addresses of the
            q and out it was captured with (capture views of buffers that hold the most rows).
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
        >>> out = attn.run(q, (k_cache, v_cache))   # K and V in two tensors: read in place, no copy
        >>> fp8 = meld.DecodeAttention(32, 8, 128, 16, torch.bfloat16, "cuda", kv_dtype=torch.float8_e4m3fn)
        >>> out = fp8.run(q, kv_cache_e4m3, k_scale=0.02, v_scale=0.03)   # after fp8.plan(...)
    """

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cuda", *,
                 kv_dtype: torch.dtype | None = None, kv_layout: str = "NHD", sm_scale: float | None = None,
                 max_batch_size: int | None = None, max_num_pages: int | None = None, topology: Topology | None = None,
                 cost: DecodeCost | None = None, kernel_config: DecodeKernelConfig | None = None,
                 cluster_size: int = DEFAULT_CLUSTER_SIZE, batch_invariant: bool = False, overlap: bool = False,
                 logits_soft_cap: float | None = None, window_left: int = -1, pos_encoding_mode: str = "NONE",
                 rope_scale: float | None = None, rope_theta: float | None = None, q_len: int = 1,
                 ragged: bool = False):
        num_qo_heads, num_kv_heads, page_size = (check_positive(name, v) for name, v in (
            ("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads), ("page_size", page_size)))
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads={num_qo_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        if not is_int(head_dim) or head_dim not in (64, 128, 256, 512):
            raise ValueError(f"head_dim must be 64, 128, 256 or 512, got {head_dim!r}")
        head_dim = int(head_dim)
        if not isinstance(dtype, torch.dtype) or dtype not in _DTYPES:
            raise ValueError(f"dtype must be torch.bfloat16 or torch.float16, got {dtype}")
        if kv_dtype is not None and kv_dtype is not dtype and not any(kv_dtype is t for t in FP8):
            raise ValueError(f"kv_dtype must be None (the dtype, {dtype}) or an FP8 type ({FP8_NAMES}), got "
                             f"{kv_dtype!r}")
        if not isinstance(kv_layout, str) or kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
        if not is_int(cluster_size) or cluster_size not in (1, 2, 4, 8, 16):
            raise ValueError(f"cluster_size must be 1, 2, 4, 8 or 16, got {cluster_size!r}")
        cluster_size = int(cluster_size)
        if not isinstance(batch_invariant, bool):
            raise ValueError(f"batch_invariant must be True or False, got {batch_invariant!r}")
        if not isinstance(overlap, bool):
            raise ValueError(f"overlap must be True or False, got {overlap!r}")
        self.variant = decode_variant(logits_soft_cap, window_left, pos_encoding_mode, rope_scale, rope_theta)
        if not is_int(q_len) or not 1 <= q_len <= MAX_Q_LEN:
            raise ValueError(f"q_len must be an int from 1 to {MAX_Q_LEN} (new tokens per request), got {q_len!r}")
        self.q_len = int(q_len)
        if not isinstance(ragged, bool) or (ragged and self.q_len == 1):
            raise ValueError(f"ragged must be True or False, True only with q_len > 1 (a request's most new tokens), "
                             f"got ragged={ragged!r} with q_len={q_len!r}")
        self.ragged = ragged
        if self.q_len > 1 and (self.variant.window_left >= 0 or self.variant.rope_theta):
            which = f"window_left={window_left!r}" if self.variant.window_left >= 0 else \
                f"pos_encoding_mode={pos_encoding_mode!r}"
            raise ValueError(f"q_len={q_len} with {which}: the kernel's window and RoPE place every key relative to a "
                             "request's last token, so they take q_len=1")
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
        self.kv_dtype = kv_dtype or dtype
        kv_build = FP8.get(self.kv_dtype, "")   # the kernel's kv_dtype
        self._rows_seen: dict[tuple, tuple] = {}   # caches' strides as the kernel's (_kv_rows)
        # The kernel takes sm_scale * log2(e) as a float32: it must stay finite there.
        self.sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else \
            check_finite("sm_scale", sm_scale, _FLOAT32_MAX / _LOG2E)
        self._setup(self._graph(_DTYPES[dtype]), device)
        # The tuning database's entry for this shape on this GPU (MELD_TUNING_DB), unless cost or kernel is given.
        self.tuning = self._tuned(_DTYPES[dtype], self.shape_bucket) if cost is None and kernel_config is None else None
        built = self.lowering.kernel_config(onchip_merge=cluster_size > 1, batch_invariant=batch_invariant,
                                            kv_dtype=kv_build, variant=self.variant,
                                            q_len=self.q_len, ragged_q=ragged)   # (xrank: the graph's transport)
        self.kernel_config = kernel_config or self._tuned_config("kernel", built)
        kc, xrank = self.kernel_config, built.xrank
        if (kc.dtype, kc.head_dim, kc.batch_invariant, kc.xrank, kc.kv_dtype, kc.variant, kc.q_len, kc.ragged_q) != (
                built.dtype, built.head_dim, built.batch_invariant, xrank, built.kv_dtype, built.variant, built.q_len,
                ragged):
            rg = (f", ragged_q={kc.ragged_q}", f", ragged={ragged}") if kc.ragged_q or ragged else ("", "")
            raise ValueError(f"kernel_config is for {kc.dtype}, head_dim {kc.head_dim}, batch_invariant="
                             f"{kc.batch_invariant}, xrank={kc.xrank!r}, {kc.variant}, q_len={kc.q_len}, kv_dtype="
                             f"{kc.kv_dtype!r}{rg[0]}; the operator is {_DTYPES[dtype]}, head_dim {head_dim}, "
                             f"batch_invariant={batch_invariant}, {self.variant}, q_len={self.q_len}, kv_dtype="
                             f"{kv_build!r}{rg[1]}, and its "
                             "graph's partials "
                             + (f"cross ranks by {xrank!r}" if xrank else "stay on one GPU (xrank='')"))
        self.heads_per_unit = self.kernel_config.heads_per_unit
        if cost is None:
            cost = self._tuned_config("cost", DecodeCost.default(self.heads_per_unit))
        if cost.tile_tokens != TILE_TOKENS:
            raise ValueError(f"cost.tile_tokens={cost.tile_tokens} must equal the kernel's KV tile {TILE_TOKENS}")
        self.cost = cost
        self.head_blocks = -(-self.group_size * self.q_len // self.heads_per_unit)   # units per kv head
        self.units_per_request = num_kv_heads * self.head_blocks
        if config.profile() and not self.kernel_config.profile:
            self.kernel_config = dataclasses.replace(self.kernel_config, profile=True)
        self.profile_every = config.profile_every()
        if self.kernel_config.tma and page_size % TILE_TOKENS:
            raise ValueError(f"page_size={page_size}: a kernel with TMA rings needs pages that hold whole "
                             f"{TILE_TOKENS}-token tiles (a multiple of {TILE_TOKENS})")
        self._init_plan_state(functools.partial(_describe_unit, self.units_per_request, self.head_blocks,
                                                self.group_size, self.heads_per_unit, self.q_len))
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
                + ("/invariant" if self.batch_invariant else "")
                + (f"/kv-{KV_FP8[FP8[self.kv_dtype]]}" if self.kv_dtype in FP8 else "")
                + self.variant.suffix.replace("_", "/") + (f"/q{self.q_len}" if self.q_len > 1 else "")
                + ("r" if self.ragged else ""))

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
        from ..runtime.tensor_map import TensorMapCache, kv_tensor_maps

        self._require_hopper()
        kc = self.kernel_config
        self.kernel = self._kernels(kc, {kc.entry: (kc.threads, kc.smem_bytes)})[kc.entry]
        self.topology = self._servable(topology or Topology.discover(self.kernel))
        self.cluster_mix = self.topology.cluster_mix(self.cluster_size)
        self._grid_resident = (Topology.discover(self.kernel) if topology else self.topology).resident(self.cluster_mix)
        self._cluster_rows = torch.from_numpy(cluster_rows(self.cluster_mix)).to(self.device) \
            if self._plan_clusters else None
        self._tensor_maps = TensorMapCache(functools.partial(kv_tensor_maps, layout=self.kv_layout)) if kc.tma else None
        self._init_device()

    def _kernel_launch(self, tables, fields: dict[str, int]):
        from ..runtime.driver import PersistentLaunch

        params_struct = self.lowering.params
        return PersistentLaunch(self.kernel, self.cluster_mix, params_struct.pack(
            q=0, k=0, v=0, out=0, lse=0, slot_base=tables.ptr(tables.off_slot_base), chunk=self._chunk,
            k_map=TensorMap(), v_map=TensorMap(), q_stride_b=0, q_stride_h=0, kv_page_stride=0, kv_slot_stride=0,
            kv_head_stride=0,   # (q, the caches, their maps and strides, out and lse: set by run())
            kv_hnd=int(self.kv_layout == "HND"), grid_resident=int(self._grid_resident), **fields,
            num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads, group_size=self.group_size * self.q_len,
            head_blocks=self.head_blocks, units_per_request=self.units_per_request, page_size=self.page_size,
            page_shift=self.page_size.bit_length() - 1 if self.page_size & (self.page_size - 1) == 0 else -1,
            sm_scale_log2=self.sm_scale * _LOG2E, v_scale=1.0,   # (FP8 caches: run() sets both from its scales)
            # (the cross-rank edge's: meld.distributed sets them; a uniform build's qo_indptr, which it never reads)
            **{f.name: 0 for f in params_struct.fields if f.name.startswith("x") or
               f.name == "qo_indptr" and not self.ragged}))

    @property
    def _chunk(self) -> int:
        """The chunk of batch-invariant plans (0: plans balance freely)."""
        return self.cost.invariant_chunk_tokens if self.batch_invariant else 0

    # --- plan -----------------------------------------------------------------------------------
    @property
    def _plan_clusters(self) -> list[tuple[int, int]]:
        """The cluster mix the planner places for: only where pieces in one cluster merge on chip."""
        return self.cluster_mix if self.kernel_config.onchip_merge and self.cluster_size > 1 else []

    def _pages_read(self, kv_indptr, kv_indices, kv_last_page_len, check, qo=None):
        """With a sliding window, the table without the pages wholly before each request's window (checked
        first where plan() checks, so that its errors name the table given). With q_len > 1, where plan()
        checks, every request must hold its new tokens (`_check_new_tokens`)."""
        if check:
            self._check_new_tokens(kv_indptr, kv_indices, kv_last_page_len, qo)
        if self.variant.window_left < 0:
            return kv_indptr, kv_indices
        if check:
            check_page_table(_host(kv_indptr), _host(kv_last_page_len), kv_indices.numel(), self.page_size)
        return window_page_table(kv_indptr, kv_indices, kv_last_page_len, self.page_size, self.variant.window_left)

    # --- run ------------------------------------------------------------------------------------
    _run_inputs = ("q", "kv_cache")

    @property
    def _lse_meaning(self) -> str:
        if self.ragged:
            return "qo_indptr[-1] of the last plan(), num_qo_heads"
        return "batch, num_qo_heads" if self.q_len == 1 else f"batch * q_len (q_len={self.q_len}), num_qo_heads"

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor], *,
            return_lse: bool = False, out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
            k_scale: float = 1.0, v_scale: float = 1.0):
        """Attention of q over the planned batch.

        Args:
            q: [B, num_qo_heads, head_dim] (last dim contiguous); with q_len > 1, [B * q_len, num_qo_heads,
                head_dim], request b's new token j at row b * q_len + j; ragged, [qo_indptr[-1], num_qo_heads,
                head_dim], at row qo_indptr[b] + j (the last plan()'s qo_indptr).
            kv_cache: one tensor [num_pages, 2, page_size, num_kv_heads, head_dim] (NHD) or [num_pages, 2,
                num_kv_heads, page_size, head_dim] (HND), as kv_layout says, whose [:, 0] is K and [:, 1] V;
                or a tuple (k_cache, v_cache) of two tensors of one shape, [num_pages, page_size, num_kv_heads,
                head_dim] (NHD) or [num_pages, num_kv_heads, page_size, head_dim] (HND): two allocations, or
                views of any (FlashInfer's tuple form, SGLang's per-layer K and V buffers). Read in place,
                never copied, through its strides: the last dim contiguous, the page, token and head strides
                multiples of head_dim (and K's the same as V's), K and V starting on 16-byte boundaries.
            return_lse: also return the log-sum-exp [B, num_qo_heads] (float32, natural log; [B * q_len, ...]).
            out, lse: optional preallocated outputs.
            k_scale, v_scale: an FP8 cache's per-tensor scales (FlashInfer's): positive finite numbers, K = cache
                x k_scale, V = cache x v_scale. k_scale multiplies the scores (folded into sm_scale: lse includes
                it), v_scale the output, both on chip. A 16-bit cache takes none (1.0). A run() captured in a
                CUDA graph replays with the scales it was captured with, as with its tensors.
        Returns:
            out [B, num_qo_heads, head_dim] ([B * q_len, ...]; and lse if return_lse). A request with no KV tokens
            gives zeros and lse = -inf.
        """
        if torch.compiler.is_dynamo_compiling():   # traced by torch.compile: one custom op, no graph break
            from .torch_ops import decode_attention
            return decode_attention(self, q, kv_cache, return_lse=return_lse, out=out, lse=lse, k_scale=k_scale,
                                    v_scale=v_scale)
        if (return_lse is True or return_lse is False) and type(k_scale) is float and type(v_scale) is float \
                and self._op_route():   # the op (its C++ fast path) for arguments its schema carries as they are
            pair = type(kv_cache) is tuple and len(kv_cache) == 2
            k, v = kv_cache if pair else (kv_cache, None)
            dev = self.device
            if (usual(q, dev) and usual(k, dev) and (not pair or usual(v, dev)) and (out is None or usual(out, dev))
                    and (lse is None or usual(lse, dev))):
                return self._op_call(q, k, v, return_lse, out, lse, k_scale, v_scale)
        return self._run((q, kv_cache), return_lse, out, lse, k_scale=k_scale, v_scale=v_scale)

    @property
    def _replayable(self) -> bool:   # (the launch right after a plan() does not overlap the plan's kernel)
        return self._buf is not None and self._buf.prof is None and not self._plan_kernel_last

    def _check_run(self, planned: _Planned, q: torch.Tensor, kv_cache: object, *, k_scale: object = 1.0,
                   v_scale: object = 1.0) -> tuple[tuple[int, int, int], dict[str, torch.Tensor], tuple]:
        if self.ragged:
            shape = (int(planned.qo_indptr[-1]), self.num_qo_heads, self.head_dim)
            meaning = "qo_indptr[-1] of the last plan(), num_qo_heads, head_dim"
        else:
            shape = (planned.batch * self.q_len, self.num_qo_heads, self.head_dim)
            meaning = "batch of the last plan(), num_qo_heads, head_dim" if self.q_len == 1 else \
                f"batch of the last plan() x q_len={self.q_len}, num_qo_heads, head_dim"
        expect("q", q, self.dtype, shape, meaning, self.device)
        kv = self._check_kv_cache(kv_cache, planned, k_scale, v_scale)
        return shape, {"q": q, **kv.tensors}, (q, kv)

    @functools.cached_property
    def _kv_shapes(self) -> dict[str, tuple[tuple, str]]:
        """The shape of each tensor a kv_cache names (`kv_parts`), and what it means, for `expect`."""
        P, Hkv, D = self.page_size, self.num_kv_heads, self.head_dim
        dims, meaning = ((P, Hkv, D), "page_size, num_kv_heads, head_dim") if self.kv_layout == "NHD" else \
            ((Hkv, P, D), "num_kv_heads, page_size, head_dim")
        part = (None, *dims), f"num_pages, {meaning}: kv_layout={self.kv_layout!r}"
        return {"kv_cache": ((None, 2, *dims), f"num_pages, K/V, {meaning}: kv_layout={self.kv_layout!r}"),
                "k_cache": part, "v_cache": part}

    def _check_kv_shapes(self, parts: dict[str, object]) -> None:
        """The tensors of a kv_cache (`kv_parts`): dtype, device, and the shape kv_layout says, K's and V's one
        page count (what a fake implementation can check too)."""
        for name, t in parts.items():
            expect(name, t, self.kv_dtype, *self._kv_shapes[name], self.device)
        if len(parts) == 1:
            return
        k, v = parts.values()
        if k.shape[0] != v.shape[0]:
            raise ValueError(f"k_cache has {k.shape[0]} pages but v_cache {v.shape[0]}: K and V must have one page "
                             "count")

    def _check_kv_cache(self, kv_cache: object, planned: _Planned, k_scale: object = 1.0,
                        v_scale: object = 1.0) -> _KV:
        """kv_cache (one tensor, or a (k_cache, v_cache) tuple) as the kernel reads it: its tensors' dtype,
        device and shape, pages enough for the plan's page indices, strides the kernel's row offsets can
        express (K's and V's the same), addresses its 16-byte copies can read, and its scales
        (`_check_scales`)."""
        k_scale, v_scale = self._check_scales(k_scale, v_scale)
        if type(kv_cache) is torch.Tensor and not kv_cache.requires_grad:   # (one plain cache, the usual case:
            parts = {"kv_cache": kv_cache}                                  # tested first, run() is hot)
        else:
            parts = {name: plain(t) for name, t in kv_parts(kv_cache).items()}
        self._check_kv_shapes(parts)
        name, first = next(iter(parts.items()))
        if planned.max_page >= first.shape[0]:
            raise ValueError(f"kv_indices of the last plan() reference page {planned.max_page}, but {name} has only "
                             f"{first.shape[0]} pages")
        rows, v_offset = self._kv_rows(name, first)
        if name == "kv_cache":   # one cache: K and V are its halves [:, 0] and [:, 1]
            k = first.data_ptr()
            v = k + v_offset
            names = (name, "kv_cache[:, 1] (V)")
        else:
            kt, vt = parts.values()
            if self._kv_rows("v_cache", vt)[0] != rows:
                raise ValueError(f"k_cache and v_cache must have the same strides (the kernel reads both through one "
                                 f"set, as FlashInfer's), got {kt.stride()} and {vt.stride()}")
            k, v = kt.data_ptr(), vt.data_ptr()
            names = ("k_cache", "v_cache")
        if k % _ALIGN or v % _ALIGN:
            what, address = (names[0], k) if k % _ALIGN else (names[1], v)
            raise ValueError(f"{what} must start on a {_ALIGN}-byte boundary (the kernel's copies read "
                             f"{_ALIGN}-byte chunks), got address {address:#x}")
        return _KV(parts, k, v, rows, k_scale, v_scale)

    def _check_scales(self, k_scale: object, v_scale: object) -> tuple[float, float]:
        """run()'s k_scale and v_scale as floats: an FP8 cache's are positive finite numbers whose products with
        the softmax scale (k_scale) and the output (v_scale) stay finite in the kernel's float32; a 16-bit cache
        takes 1.0 only (it is read as it is: a key scale belongs in sm_scale)."""
        if type(k_scale) is float and type(v_scale) is float and k_scale == 1.0 and v_scale == 1.0:
            return k_scale, v_scale   # (the usual call, tested first: run() is hot)
        limits = {"k_scale": _FLOAT32_MAX / (_LOG2E * abs(self.sm_scale)) if self.sm_scale else math.inf,
                  "v_scale": _FLOAT32_MAX}
        scales = []
        for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
            scales.append(check_scale(name, value, limits[name]))
        if self.kv_dtype not in FP8 and scales != [1.0, 1.0]:
            raise ValueError(f"k_scale={k_scale!r} and v_scale={v_scale!r}: the scales dequantise an FP8 cache "
                             f"(kv_dtype {FP8_NAMES}), but this operator reads a {self.kv_dtype} cache as it is "
                             "(fold a key scale into sm_scale)")
        return scales[0], scales[1]

    def _kv_rows(self, name: str, t: torch.Tensor) -> tuple[tuple[int, int, int], int]:
        """The page, token and head strides, in rows of head_dim elements, of the K or V cache `t` (named `name`:
        [num_pages, mid, inner, head_dim]; or one cache [num_pages, 2, mid, inner, head_dim], of its halves),
        and V's offset from K in bytes (one cache; else 0): the last dim contiguous, the others (those of extent
        above 1: the rest are never stepped over) multiples of head_dim, and every row and token of the cache
        within the kernel's int32 indices. Remembered by strides and page count: run() sees the same few
        caches every step."""
        strides, num_pages = t.stride(), t.shape[0]
        seen = self._rows_seen.get((strides, num_pages))
        if seen is not None:
            return seen
        D, P, Hkv = self.head_dim, self.page_size, self.num_kv_heads
        if strides[-1] != 1:
            raise ValueError(f"{name} must have a contiguous last dim (head_dim), got strides {strides}")
        used = [st if n > 1 else 0 for st, n in zip((strides[0], *strides[-3:-1]), (num_pages, *t.shape[-3:-1]))]
        if any(st % D for st in used):
            raise ValueError(f"{name} must have page, token and head strides that are multiples of head_dim={D} (the "
                             f"kernel addresses rows of head_dim elements), got strides {strides}")
        page, mid, inner = (st // D for st in used)
        token, head = (mid, inner) if self.kv_layout == "NHD" else (inner, mid)
        last = (num_pages - 1) * page + (P - 1) * token + (Hkv - 1) * head
        if max(last, num_pages * P - 1) >= 2 ** 31:
            raise ValueError(f"{name} ({num_pages} pages of {P} tokens, strides {strides}) reaches row {last} of "
                             f"head_dim elements and token {num_pages * P - 1}: the kernel indexes both in int32 "
                             "(below 2**31)")
        if len(self._rows_seen) >= 1024:
            self._rows_seen.clear()
        v_offset = strides[1] * t.element_size() if t.dim() == 5 else 0   # one cache: V's half after K's
        seen = self._rows_seen[strides, num_pages] = (page, token, head), v_offset
        return seen

    def _launch(self, q: torch.Tensor, kv: _KV, out: torch.Tensor, lse: torch.Tensor | None) -> None:
        sb, sh, sd = q.stride()
        if sd != 1 or sb % 8 or sh % 8 or q.data_ptr() % 16:
            q = q.contiguous()
            sb, sh, _ = q.stride()
        launcher = self._buf.launcher
        if self._tensor_maps is not None:
            k_map, v_map = self._tensor_maps.get(*kv.tensors.values())
            launcher.set(k_map=k_map, v_map=v_map)
        page, token, head = kv.rows
        launcher.set(q=q.data_ptr(), k=kv.k, v=kv.v, out=out.data_ptr(), lse=lse.data_ptr() if lse is not None else 0,
                     q_stride_b=sb, q_stride_h=sh, kv_page_stride=page, kv_slot_stride=token, kv_head_stride=head)
        if self.kv_dtype in FP8:
            launcher.set(sm_scale_log2=self.sm_scale * kv.k_scale * _LOG2E, v_scale=kv.v_scale)
        launcher.launch(overlap=self.overlap and not self._plan_kernel_last)
        self._launched()

    def _execute_cpu(self, planned: _Planned, q: torch.Tensor, kv: _KV):
        k, v = kv.tensors["kv_cache"].unbind(1) if "kv_cache" in kv.tensors else kv.tensors.values()
        if self.kv_layout == "HND":
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        return self.lowering.executor(self.schedule, q, k, v, planned.kv_indices, self.sm_scale,
                                      self.lowering.combiner, k_scale=kv.k_scale, v_scale=kv.v_scale,
                                      variant=self.variant, q_len=self.q_len, qo_indptr=planned.qo_indptr)
