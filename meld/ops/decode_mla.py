"""`meld.DecodeMLA`: paged MLA decode attention (DeepSeek's multi-head latent attention, absorbed form) with
FlashInfer's plan()/run() split.

Every q head attends to one latent KV head: the keys are the cache's latent rows (head_dim_ckv channels)
with their rope part (head_dim_kpe), the values the latent rows. plan() is `PagedDecode`'s (the decode
planner, one unit per request and block of 64 q heads, laid out head block by head block); run() launches the persistent kernel of
templates/mla_decode.cuh, whose split units merge inside the same launch.

Multi-token decode (q_len new tokens per request) needs no kernel of its own: the planner, built with token
requests (templates/decode_plan.h), plans request b's new token t as a request b * q_len + t of its own, whose
keys end where that token's do (the causal mask, exact by construction) and whose pages are b's. The kernel
reads a planned request's length, page base and q/out row as it always has, and q laid out [B * q_len, H, D]
puts that token's row at b * q_len + t; a request's tokens sit next to each other on the planner's line, so
their CTAs read the same KV blocks about together (HBM once, L2 after).
"""
from __future__ import annotations

import dataclasses
import functools
import torch

from .. import config
from ..codegen.decode_kernel import MAX_Q_LEN
from ..codegen.mla_kernel import MLA_HEAD_DIM_CKV, MLA_HEAD_DIM_KPE, MLA_HEADS_PER_UNIT, MLA_KV_FP8, MlaKernelConfig
from ..codegen import TensorMap
from ..scheduler import DecodeCost, Topology
from .checks import check_finite, check_positive, check_scale, expect, is_int, usual
from .mla_graph import mla_decode_graph
from .paged_decode import PagedDecode, _Planned

_LOG2E = 1.4426950408889634
_FLOAT32_MAX = 3.4028234663852886e38
# The FP8 latent caches DecodeMLA reads (kv_dtype) -> the kernel's kv_dtype
FP8 = {getattr(torch, name): name for name in MLA_KV_FP8}


def default_cost(block_tokens: int) -> DecodeCost:
    """The planner's cost model for the MLA kernel: cuts on its KV blocks, and each piece charged for its
    fixed cost (loading Q, storing 64 x 512 outputs or a partial, and for split units the merge)."""
    return DecodeCost(item_overhead_tokens=128, min_split_tokens=256, min_cta_tokens=256,
                      tile_tokens=block_tokens, round_tokens=block_tokens, cluster_snap_tokens=0)


def page_size_supported(page_size: int) -> bool:
    """Whether the kernel's KV loads take pages of `page_size` tokens (a positive int): a page of 8, 16 or 32
    tokens is one TMA box of a KV block, a multiple of 64 tokens whole blocks."""
    return page_size in (8, 16, 32) or page_size % 64 == 0


def _describe_unit(units_per_request: int, num_heads: int, q_len: int, unit: int) -> str:
    planned, hb = divmod(unit, units_per_request)
    first = hb * MLA_HEADS_PER_UNIT
    heads = f"q heads {first}-{min(first + MLA_HEADS_PER_UNIT, num_heads) - 1}"
    if q_len == 1:
        return f"request {planned}, {heads}"
    req, t = divmod(planned, q_len)
    return f"request {req}, new token {t} of {q_len}, {heads}"


def _latent_rows(t: torch.Tensor) -> torch.Tensor:
    """A cache [pages, page_size, D] as rows [pages * page_size, D] (a view: contiguous rows, any row stride)."""
    return t.flatten(0, 1)


def _maps(ckv_cache: torch.Tensor, kpe_cache: torch.Tensor, box_rows: int) -> tuple[TensorMap, TensorMap]:
    """The caches' TMA maps: boxes of 128 bytes of channels (64 bf16, or 128 e4m3 latent channels), the rope
    part's FP8 box its 64 bytes (templates/mla_decode.cuh, MLA_KV_FP8)."""
    from ..runtime.tensor_map import tensor_map_2d

    cols = 128 // ckv_cache.element_size()
    return (tensor_map_2d(_latent_rows(ckv_cache), box_rows, cols),
            tensor_map_2d(_latent_rows(kpe_cache), box_rows, min(cols, kpe_cache.shape[-1])))


def _q_maps(q_nope: torch.Tensor, q_pe: torch.Tensor) -> tuple[TensorMap, TensorMap]:
    """The queries' TMA map templates (boxes of 64 heads x 64 channels of a row; the kernel sets the call's
    addresses: templates/mla_decode.cuh, mla_load_q)."""
    from ..runtime.tensor_map import tensor_map_heads

    return tensor_map_heads(q_nope, MLA_HEADS_PER_UNIT), tensor_map_heads(q_pe, MLA_HEADS_PER_UNIT)


class DecodeMLA(PagedDecode):
    """MLA decode attention over a paged latent cache, for variable-length batches.

    Args:
        num_heads: q heads (any >= 1; they run in blocks of 64, the last one padded).
        page_size: tokens per page: 8, 16, 32 or a multiple of 64.
        dtype: torch.bfloat16 (q and output; the caches too unless kv_dtype says otherwise).
        kv_dtype: the caches' dtype: None or dtype, or torch.float8_e4m3fn: the latent rows (512 + 64 channels)
            read at one byte a value (keys by e4m3 wgmmas against q as two e4m3 terms a row, values converted to
            bf16 on chip), dequantised with run()'s per-tensor kv_scale (a cache element x stands for
            x * kv_scale, in the keys and the values alike).
        device: "cuda[:i]" (Hopper) runs the generated kernel; "cpu" runs the same schedule on the CPU
            reference executor (float64).
        sm_scale: softmax scale, required (DeepSeek's absorbed attention takes 1/sqrt(qk_nope + qk_rope
            head dims) times its YaRN factor, not 1/sqrt(576)).
        head_dim_ckv, head_dim_kpe: latent and rope widths: 512 and 64 (DeepSeek-V2/V3's).
        max_batch_size, max_num_pages: capacities of the work tables, as `DecodeAttention`'s (give both
            when run() is captured in a CUDA graph).
        q_len: new tokens per request, 1 to 8 (speculative decoding's drafts, multi-token prediction; FlashMLA's
            s_q), as `DecodeAttention`'s: run()'s q_nope, q_pe, out and lse have B * q_len rows, request b's
            token j at row b * q_len + j, and token j of a request of kv_len tokens (the cache already holds its
            q_len new ones) attends to keys 0 .. kv_len - q_len + j. Fixed at construction (it shapes the work
            tables); every plan() then needs kv_len >= q_len per request.
        topology, cost, kernel_config: override the grid, the planner's cost model (`default_cost`) and the
            kernel's configuration.
    MELD_PROFILE=1 builds the kernel with per-piece timestamps (`last_trace()`).

    Example:
        >>> mla = meld.DecodeMLA(128, 64, torch.bfloat16, "cuda", sm_scale=192 ** -0.5)
        >>> mla.plan(kv_indptr, kv_indices, kv_last_page_len)
        >>> out, lse = mla.run(q_nope, q_pe, ckv_cache, kpe_cache, return_lse=True)
        >>> mtp = meld.DecodeMLA(128, 64, torch.bfloat16, "cuda", sm_scale=192 ** -0.5, q_len=2)   # q_nope [B * 2, ...]
        >>> fp8 = meld.DecodeMLA(128, 64, torch.bfloat16, "cuda", sm_scale=192 ** -0.5, kv_dtype=torch.float8_e4m3fn)
        >>> out = fp8.run(q_nope, q_pe, ckv_e4m3, kpe_e4m3, kv_scale=0.05)   # after fp8.plan(...)
    """

    # A request's 64-head units read the same KV: planned head block by head block, CTAs W / 2 apart cut the
    # same tokens of a request's two halves and read each KV block together (templates/decode_plan.h).
    head_major = True

    def __init__(self, num_heads: int, page_size: int, dtype: torch.dtype = torch.bfloat16,
                 device: str | torch.device = "cuda", *, sm_scale: float, head_dim_ckv: int = MLA_HEAD_DIM_CKV,
                 head_dim_kpe: int = MLA_HEAD_DIM_KPE, max_batch_size: int | None = None,
                 max_num_pages: int | None = None, topology: Topology | None = None, cost: DecodeCost | None = None,
                 kernel_config: MlaKernelConfig | None = None, q_len: int = 1, kv_dtype: torch.dtype | None = None):
        num_heads, page_size = check_positive("num_heads", num_heads), check_positive("page_size", page_size)
        if not page_size_supported(page_size):
            raise ValueError(f"page_size must be 8, 16, 32 or a multiple of 64, got {page_size}")
        if (head_dim_ckv, head_dim_kpe) != (MLA_HEAD_DIM_CKV, MLA_HEAD_DIM_KPE) or not (
                is_int(head_dim_ckv) and is_int(head_dim_kpe)):
            raise ValueError(f"head_dim_ckv={head_dim_ckv!r}, head_dim_kpe={head_dim_kpe!r}: the MLA kernel runs "
                             f"{MLA_HEAD_DIM_CKV} + {MLA_HEAD_DIM_KPE} (DeepSeek's)")
        head_dim_ckv, head_dim_kpe = int(head_dim_ckv), int(head_dim_kpe)   # (NumPy ints as Python's)
        if dtype is not torch.bfloat16:
            raise ValueError(f"dtype must be torch.bfloat16, got {dtype}")
        if kv_dtype is not None and kv_dtype is not dtype and kv_dtype not in FP8:
            raise ValueError(f"kv_dtype must be None (the dtype, {dtype}) or {' or '.join(map(str, FP8))}, got "
                             f"{kv_dtype!r}")
        kv_build = FP8.get(kv_dtype, "")   # the kernel's kv_dtype
        if not is_int(q_len) or not 1 <= q_len <= MAX_Q_LEN:
            raise ValueError(f"q_len must be an int from 1 to {MAX_Q_LEN} (new tokens per request), got {q_len!r}")
        if topology is not None and not isinstance(topology, Topology):
            raise ValueError(f"topology must be a meld.scheduler.Topology, got {type(topology).__name__}")
        if kernel_config is not None and not isinstance(kernel_config, MlaKernelConfig):
            raise ValueError(f"kernel_config must be a meld.codegen.mla_kernel.MlaKernelConfig, got "
                             f"{type(kernel_config).__name__}")
        if kernel_config is not None and kernel_config.kv_dtype != kv_build:
            raise ValueError(f"kernel_config reads kv_dtype={kernel_config.kv_dtype!r}, the operator's cache is "
                             f"{kv_dtype or dtype} (kernel kv_dtype {kv_build!r})")
        self._setup(mla_decode_graph(num_heads, head_dim_ckv, head_dim_kpe, page_size, "bfloat16"), device)
        self.kernel_config = kernel_config or (MlaKernelConfig.for_cache(kv_build) if kv_build else
                                               self.lowering.kernel_config())
        bt = self.kernel_config.block_tokens
        if cost is not None and (not isinstance(cost, DecodeCost) or cost.tile_tokens != bt or cost.round_tokens % bt):
            raise ValueError(f"cost must be a meld.scheduler.DecodeCost cutting on the kernel's {bt}-token blocks "
                             f"(tile_tokens {bt}, round_tokens a multiple of it), got {cost!r}")
        self.num_heads, self.page_size, self.dtype, self.kv_dtype = num_heads, page_size, dtype, kv_dtype or dtype
        self.head_dim_ckv, self.head_dim_kpe = head_dim_ckv, head_dim_kpe
        # The kernel takes sm_scale * log2(e) as a float32: it must stay finite there.
        self.sm_scale = check_finite("sm_scale", sm_scale, _FLOAT32_MAX / _LOG2E)
        self.max_batch_size = None if max_batch_size is None else check_positive("max_batch_size", max_batch_size)
        self.max_num_pages = None if max_num_pages is None else check_positive("max_num_pages", max_num_pages)
        # The decode planner's terms: one latent kv head whose group is every q head, in 64-head units.
        self.num_kv_heads, self.group_size, self.heads_per_unit = 1, num_heads, MLA_HEADS_PER_UNIT
        self.partial_width = head_dim_ckv
        self.units_per_request = self.head_blocks = -(-num_heads // MLA_HEADS_PER_UNIT)
        self.q_len = self.token_requests = int(q_len)   # (a new token per planned request: the module's docstring)
        self.cost = cost or default_cost(self.kernel_config.block_tokens)
        if config.profile() and not self.kernel_config.profile:
            self.kernel_config = dataclasses.replace(self.kernel_config, profile=True)
        self.profile_every = config.profile_every()
        self._init_plan_state(functools.partial(_describe_unit, self.units_per_request, self.num_heads, self.q_len))
        if self.device.type == "cuda":
            self._init_cuda(topology)
        else:
            self.topology = self._one_cta_per_sm(topology or Topology.h200())

    def _one_cta_per_sm(self, topology: Topology) -> Topology:
        """A grid the kernel can run, checked on every device: one CTA per SM, all resident (the split units'
        mergers wait for their parts: mla_decode.cuh)."""
        self._servable(topology)
        if topology.num_ctas > topology.sm_count:
            raise ValueError(f"topology={topology}: the MLA kernel runs one CTA per SM ({topology.sm_count})")
        return topology

    @property
    def shape_bucket(self) -> str:
        return (f"H{self.num_heads}/C{self.head_dim_ckv}/R{self.head_dim_kpe}/P{self.page_size}"
                + (f"/q{self.q_len}" if self.q_len > 1 else "") + ("/kv-e4m3" if self.kv_dtype in FP8 else ""))

    def _init_cuda(self, topology: Topology | None) -> None:
        from ..runtime.tensor_map import TensorMapCache

        self._require_hopper(exact=True)
        kc = self.kernel_config
        self.kernel = self._kernels(kc, {kc.entry: (kc.threads, kc.smem_bytes)})[kc.entry]
        self.topology = self._one_cta_per_sm(topology or Topology.discover(self.kernel, sizes=(1,)))
        self._box_rows = min(self.kernel_config.block_tokens, self.page_size)
        self._tensor_maps = TensorMapCache(functools.partial(_maps, box_rows=self._box_rows))
        self._q_templates = TensorMapCache(_q_maps, by_address=False)
        self._q_map_slots = torch.empty(256 * self.topology.num_ctas, dtype=torch.uint8, device=self.device)
        self._init_device()

    def _kernel_launch(self, tables, fields: dict[str, int]):
        from ..runtime.driver import PersistentLaunch

        return PersistentLaunch(self.kernel, [(1, self.topology.num_ctas)], self.lowering.params.pack(
            q_nope=0, q_pe=0, out=0, lse=0, ckv_map=TensorMap(), kpe_map=TensorMap(),   # set by run()
            qn_map=TensorMap(), qp_map=TensorMap(), q_maps=self._q_map_slots.data_ptr(),
            qn_stride_b=0, qn_stride_h=0, qp_stride_b=0, qp_stride_h=0, **fields, num_heads=self.num_heads,
            units_per_request=self.units_per_request, page_size=self.page_size, box_rows=self._box_rows,
            sm_scale_log2=self.sm_scale * _LOG2E, v_scale=1.0))   # (FP8 caches: run() sets both from kv_scale)

    # --- run ------------------------------------------------------------------------------------
    _run_inputs = ("q_nope", "q_pe", "ckv_cache", "kpe_cache")

    @property
    def _lse_meaning(self) -> str:
        return "batch, num_heads" if self.q_len == 1 else f"batch * q_len (q_len={self.q_len}), num_heads"

    def run(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor, kpe_cache: torch.Tensor, *,
            return_lse: bool = False, out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
            kv_scale: float = 1.0):
        """Attention of the planned batch's queries over the latent cache.

        Args:
            q_nope: [B, num_heads, head_dim_ckv] (the absorbed query; last dim contiguous); with q_len > 1,
                [B * q_len, num_heads, head_dim_ckv], request b's new token j at row b * q_len + j.
            q_pe: [B, num_heads, head_dim_kpe] (its rope part; [B * q_len, ...] likewise).
            ckv_cache: [num_pages, page_size, head_dim_ckv]; kpe_cache: [num_pages, page_size, head_dim_kpe]
                (FlashInfer's MLA layout; views of one [num_pages, page_size, 576] cache work too: rows need
                contiguous channels and 16-byte aligned strides).
            return_lse: also return the log-sum-exp [B, num_heads] (float32, natural log; [B * q_len, ...]).
            out, lse: optional preallocated outputs (contiguous).
            kv_scale: an FP8 cache's per-tensor scale (FlashInfer's, vLLM's): a positive finite number, the keys
                and values = cache x kv_scale. It multiplies the scores (folded into sm_scale: lse includes it)
                and each piece's normalised output, on chip. A bf16 cache takes none (1.0). A run() captured in a
                CUDA graph replays the scale it was captured with.
        Returns:
            out [B, num_heads, head_dim_ckv] ([B * q_len, ...]; and lse). A request with no KV tokens gives zeros
            and lse -inf.
        Inputs that require grad are read as plain tensors; meld has no backward (NotImplementedError).
        """
        if torch.compiler.is_dynamo_compiling():   # traced by torch.compile: one custom op, no graph break
            from .torch_ops import decode_mla
            return decode_mla(self, q_nope, q_pe, ckv_cache, kpe_cache, return_lse=return_lse, out=out, lse=lse,
                              kv_scale=kv_scale)
        if (return_lse is True or return_lse is False) and type(kv_scale) is float and self._op_route():
            dev = self.device   # the op (its C++ fast path) for arguments its schema carries as they are
            if (usual(q_nope, dev) and usual(q_pe, dev) and usual(ckv_cache, dev) and usual(kpe_cache, dev)
                    and (out is None or usual(out, dev)) and (lse is None or usual(lse, dev))):
                return self._op_call(q_nope, q_pe, ckv_cache, kpe_cache, return_lse, out, lse, kv_scale)
        return self._run((q_nope, q_pe, ckv_cache, kpe_cache), return_lse, out, lse, kv_scale=kv_scale)

    @property
    def _replayable(self) -> bool:
        return self._buf is not None and self._buf.prof is None

    def _check_scale(self, kv_scale: object) -> float:
        """run()'s kv_scale as a float: an FP8 cache's is a positive finite number whose products with the softmax
        scale and the output stay finite in the kernel's float32; a bf16 cache takes 1.0 only (it is read as it
        is: a key scale belongs in sm_scale), as `DecodeAttention`'s k_scale and v_scale."""
        if type(kv_scale) is float and kv_scale == 1.0:
            return kv_scale   # (the usual call, tested first: run() is hot)
        limit = min(_FLOAT32_MAX, _FLOAT32_MAX / (_LOG2E * abs(self.sm_scale))) if self.sm_scale else _FLOAT32_MAX
        x = check_scale("kv_scale", kv_scale, limit)
        if self.kv_dtype not in FP8 and x != 1.0:
            raise ValueError(f"kv_scale={kv_scale!r}: the scale dequantises an FP8 cache (kv_dtype "
                             f"{' or '.join(map(str, FP8))}), but this operator reads a {self.kv_dtype} cache as it "
                             "is (fold a key scale into sm_scale)")
        return x

    def _check_run(self, planned: _Planned, q_nope, q_pe, ckv_cache, kpe_cache, *, kv_scale: object = 1.0):
        B, H, Dc, Dr = planned.batch * self.q_len, self.num_heads, self.head_dim_ckv, self.head_dim_kpe
        rows = "batch of the last plan()" + (f" x q_len={self.q_len}" if self.q_len > 1 else "")
        expect("q_nope", q_nope, self.dtype, (B, H, Dc), f"{rows}, num_heads, head_dim_ckv", self.device)
        expect("q_pe", q_pe, self.dtype, (B, H, Dr), f"{rows}, num_heads, head_dim_kpe", self.device)
        self._check_caches(ckv_cache, kpe_cache, planned)
        kv_scale = self._check_scale(kv_scale)
        reads, args = self._reads((q_nope, q_pe, ckv_cache, kpe_cache))
        return (B, H, Dc), reads, (*args, kv_scale)

    def _check_caches(self, ckv_cache: torch.Tensor, kpe_cache: torch.Tensor, planned: _Planned) -> None:
        """Both caches' dtype, shape, device and rows (contiguous channels, 16-byte aligned), one page count,
        and pages enough for the plan's page indices."""
        P = self.page_size
        for name, t, d in (("ckv_cache", ckv_cache, self.head_dim_ckv), ("kpe_cache", kpe_cache, self.head_dim_kpe)):
            expect(name, t, self.kv_dtype, (None, P, d), f"num_pages, page_size, {name[:3]} channels", self.device)
            if t.stride(2) != 1 or t.stride(0) != P * t.stride(1) or t.stride(1) * t.element_size() % 16:
                raise ValueError(f"{name} must hold each token's channels contiguously in rows of 16-byte aligned "
                                 f"stride, pages one after another; got strides {t.stride()}")
            if t.data_ptr() % 16:
                raise ValueError(f"{name} must start on a 16-byte boundary, got address {t.data_ptr():#x} (a view "
                                 f"at element offset {t.storage_offset()})")
        if kpe_cache.shape[0] != ckv_cache.shape[0]:
            raise ValueError(f"ckv_cache has {ckv_cache.shape[0]} pages but kpe_cache {kpe_cache.shape[0]}")
        num_pages = ckv_cache.shape[0]
        if planned.max_page >= num_pages:
            raise ValueError(f"kv_indices of the last plan() reference page {planned.max_page}, but the caches have "
                             f"only {num_pages} pages")
        if num_pages * P >= 2 ** 31:
            raise ValueError(f"the caches hold {num_pages} pages of {P} tokens: more than 2**31 rows")

    def _launch(self, q_nope, q_pe, ckv_cache, kpe_cache, kv_scale, out, lse) -> None:
        qs = []
        for q in (q_nope, q_pe):
            if q.stride(2) != 1 or q.stride(0) % 8 or q.stride(1) % 8 or q.data_ptr() % 16 or 0 in q.stride()[:2]:
                q = q.contiguous()   # (the TMA copies' terms: 16-byte strides and address, no broadcast dim)
            qs.append(q)
        q_nope, q_pe = qs
        ckv_map, kpe_map = self._tensor_maps.get(ckv_cache, kpe_cache)
        qn_map, qp_map = self._q_templates.get(q_nope, q_pe)
        launcher = self._buf.launcher
        launcher.set(q_nope=q_nope.data_ptr(), q_pe=q_pe.data_ptr(), out=out.data_ptr(),
                     lse=lse.data_ptr() if lse is not None else 0, qn_stride_b=q_nope.stride(0),
                     qn_stride_h=q_nope.stride(1), qp_stride_b=q_pe.stride(0), qp_stride_h=q_pe.stride(1),
                     ckv_map=ckv_map, kpe_map=kpe_map, qn_map=qn_map, qp_map=qp_map)
        if self.kv_dtype in FP8:
            launcher.set(sm_scale_log2=self.sm_scale * kv_scale * _LOG2E, v_scale=kv_scale)
        launcher.launch()
        self._launched()

    def _execute_cpu(self, planned: _Planned, q_nope, q_pe, ckv_cache, kpe_cache, kv_scale):
        return self.lowering.executor(self.schedule, q_nope, q_pe, ckv_cache, kpe_cache, planned.kv_indices,
                                      self.sm_scale, self.lowering.combiner, kv_scale=kv_scale)
