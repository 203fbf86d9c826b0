"""FlashInfer's `BatchDecodeWithPagedKVCacheWrapper` on `meld.DecodeAttention` (and, at the end, its
`MultiLevelCascadeAttentionWrapper` for decode on `meld.CascadeDecode`; its `mla.BatchMLAPagedAttentionWrapper`
for decode on `meld.DecodeMLA` lives in `meld.compat.flashinfer_mla` and is re-exported here): an engine
switches by changing one import,

    from meld.compat.flashinfer import BatchDecodeWithPagedKVCacheWrapper

Argument names, defaults, positional order and return values are FlashInfer 0.6.18's
(flashinfer/decode.py). What meld does not compute raises NotImplementedError naming the option and its
value; bad inputs raise ValueError naming the argument. Differences that remain:

- lse is base 2, as FlashInfer's (its `state_t::get_lse` is m + log2(d) in sm_scale * log2(e) units):
  meld's natural-log lse is multiplied by log2(e) in place after the kernel.
- The workspace buffer is accepted and unused: each meld operator allocates its own tables and partial
  buffers, sized by its capacities.
- One meld operator per (heads, head_dim, page_size, dtype, sm_scale, batch invariance), made on first
  plan() and reused by later plans (plan once per step, run() per layer); its capacities grow as
  needed, or with use_cuda_graph=True are fixed to the paged_kv_*_buffer sizes, so that plans rewrite
  its tables in place and a run() captured in a CUDA graph stays valid across re-plans (of the same
  shapes and sm_scale: a captured run() replays the operator it was captured with).
- plan() takes a meld-only keyword `check` (default True): page tables partly on the GPU are read back
  to validate them (FlashInfer's plan() reads indptr back too); check=False plans with no host
  synchronisation at all, so plan() itself can be captured in a CUDA graph.
- fixed_split_size (> 0) and disable_split_kv=True, FlashInfer's knobs for batch-invariant outputs,
  select meld's batch-invariant mode (its own chunk size, not fixed_split_size pages).
- The kernel choice (use_tensor_cores, backend, enable_pdl) is meld's: accepted, it changes nothing.
- logits_soft_cap, window_left and pos_encoding_mode="ROPE_LLAMA" (rope_scale, rope_theta) are built into the
  kernel (one operator per value, made on first plan()): run(window_left=) must be None or plan()'s, and the
  deprecated forward()'s options plan()'s. RoPE's rotated keys are rounded to the MMA type (FlashInfer keeps them
  in float32). fast_plan() and fast_decode_plan(wrapper, ...) are plan(). README.md's table lists every argument.
- single_decode_with_kv_cache (one request, K and V as [kv_len, num_kv_heads, head_dim] tensors) is the decode
  wrapper planned for a batch of one whose pages are single tokens: K and V are read in place through their
  strides, and each call plans.
- An FP8 cache (plan(kv_data_type=torch.float8_e4m3fn or torch.float8_e5m2)): run()'s k_scale and v_scale are
  applied inside meld's kernel (k_scale folded into the softmax scale, v_scale on the output before it is rounded
  to q's dtype), where FlashInfer multiplies its rounded output by v_scale afterwards: the two differ by that one rounding.
"""
from __future__ import annotations

import concurrent.futures
import functools
import math
import numbers
import re
import warnings
from collections.abc import Callable

import torch

from ..ops.checks import check_finite, check_positive, expect, is_int, plain, same_device
from ..codegen.decode_kernel import MAX_Q_LEN, DecodeVariant
from ..ops.decode_attention import FP8, FP8_NAMES, DecodeAttention, decode_variant
from ._common import _LOG2E, _check_graph_buffers, _check_workspace, _dtype, _unsupported
from .flashinfer_mla import BatchMLAPagedAttentionWrapper

__all__ = ["BatchDecodeWithPagedKVCacheWrapper", "BatchMLAPagedAttentionWrapper",
           "CUDAGraphBatchDecodeWithPagedKVCacheWrapper", "MultiLevelCascadeAttentionWrapper", "fast_decode_plan",
           "single_decode_with_kv_cache"]

_BACKENDS = ("auto", "fa2", "fa3", "trtllm-gen", "cute-dsl")
_POS_ENCODING_MODES = ("NONE", "ROPE_LLAMA", "ALIBI")
_HEAD_DIMS = (64, 128, 256, 512)
_DTYPES = (torch.bfloat16, torch.float16)


def _variant(pos_encoding_mode: object, window_left: object, logits_soft_cap: object, rope_scale: object = None,
             rope_theta: object = None) -> DecodeVariant:
    """The attention variant plan() and the deprecated forward() share: FlashInfer's soft cap, sliding window and
    Llama RoPE inside attention, which meld's decode kernel computes (`meld.DecodeAttention`'s logits_soft_cap,
    window_left, pos_encoding_mode, rope_scale and rope_theta); ALiBi it does not. rope_scale and rope_theta count
    with ROPE_LLAMA only (FlashInfer ignores them otherwise)."""
    if pos_encoding_mode not in _POS_ENCODING_MODES:
        raise ValueError(f"pos_encoding_mode must be one of {_POS_ENCODING_MODES}, got {pos_encoding_mode!r}")
    if pos_encoding_mode == "ALIBI":
        raise _unsupported("pos_encoding_mode", pos_encoding_mode, "meld's kernel has no ALiBi bias")
    rope = (rope_scale, rope_theta) if pos_encoding_mode == "ROPE_LLAMA" else (None, None)
    return decode_variant(logits_soft_cap, window_left, pos_encoding_mode, *rope)


def _rope_arguments(variant: DecodeVariant) -> dict:
    """`meld.DecodeAttention`'s RoPE arguments for `variant`."""
    if not variant.rope_theta:
        return {}
    return dict(pos_encoding_mode="ROPE_LLAMA", rope_scale=variant.rope_scale, rope_theta=variant.rope_theta)


def _check_v_scale(v_scale: object, device: torch.device) -> None:
    """A 16-bit cache's v_scale multiplies the output in place after the kernel (FlashInfer's `out *= v_scale`): a
    real number, or a tensor of one real element on the output's device (or a 0-d CPU tensor, which torch reads as a
    number).
    Checked before the kernel, so that no output is written when the scaling would fail (a tensor of another
    shape) or do nothing (a meta tensor)."""
    if isinstance(v_scale, torch.Tensor):
        on_device = v_scale.device.type == "cpu" and v_scale.dim() == 0 or same_device(v_scale.device, device)
        if v_scale.numel() != 1 or v_scale.is_complex() or v_scale.dtype == torch.bool or not on_device:
            raise ValueError(f"v_scale must be a number or a one-element real tensor on {device}, got a tensor of shape "
                             f"{tuple(v_scale.shape)}, dtype {v_scale.dtype} on {v_scale.device}")
    elif not isinstance(v_scale, numbers.Real):
        raise ValueError(f"v_scale must be a number, got {v_scale!r}")


def _cache_names(message: str) -> str:
    """A run() message of a meld operator in the wrappers' argument names: its kv_cache is their paged_kv_cache
    (k_cache and v_cache, the tuple's parts, are FlashInfer's names too)."""
    return re.sub(r"(?<!paged_)\bkv_cache\b", "paged_kv_cache", message)


class BatchDecodeWithPagedKVCacheWrapper:
    """Decode attention over a paged KV cache for a batch of requests, with FlashInfer's API on meld.

    Example (FlashInfer's own; `flashinfer.` becomes `meld.compat.flashinfer.`):
        >>> workspace = torch.zeros(128 * 1024 * 1024, dtype=torch.uint8, device="cuda")   # unused by meld
        >>> wrapper = BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        >>> wrapper.plan(indptr, indices, last_page_len, 64, 8, 128, 16, data_type=torch.float16)
        >>> outs = [wrapper.run(q[i], kv_cache[i]) for i in range(num_layers)]   # one plan, every layer
    """

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 use_tensor_cores: bool = False, paged_kv_indptr_buffer: torch.Tensor | None = None,
                 paged_kv_indices_buffer: torch.Tensor | None = None,
                 paged_kv_last_page_len_buffer: torch.Tensor | None = None, backend: str = "auto",
                 jit_args: list | None = None) -> None:
        _check_workspace(float_workspace_buffer)
        if kv_layout not in ("NHD", "HND"):
            raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
        for name, flag in (("use_cuda_graph", use_cuda_graph), ("use_tensor_cores", use_tensor_cores)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be True or False, got {flag!r}")
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
        if jit_args is not None:
            raise _unsupported("jit_args", jit_args, "meld runs its own kernel, not FlashInfer's custom JIT variants")
        self._float_workspace_buffer = float_workspace_buffer   # held, as FlashInfer does; meld never reads it
        self.device = float_workspace_buffer.device
        self._kv_layout = kv_layout
        self._use_cuda_graph = use_cuda_graph
        self._use_tensor_cores = use_tensor_cores or backend in ("trtllm-gen", "cute-dsl")
        self._fixed_batch_size = 0
        if use_cuda_graph:
            _check_graph_buffers({"paged_kv_indptr_buffer": paged_kv_indptr_buffer,
                                  "paged_kv_last_page_len_buffer": paged_kv_last_page_len_buffer,
                                  "paged_kv_indices_buffer": paged_kv_indices_buffer}, self.device)
            self._fixed_batch_size = len(paged_kv_last_page_len_buffer)
            if len(paged_kv_indptr_buffer) != self._fixed_batch_size + 1:
                raise ValueError(f"paged_kv_indptr_buffer must have batch_size + 1 = {self._fixed_batch_size + 1} "
                                 f"entries (batch_size = len(paged_kv_last_page_len_buffer)), got "
                                 f"{len(paged_kv_indptr_buffer)}")
        self._paged_kv_indptr_buf = paged_kv_indptr_buffer
        self._paged_kv_indices_buf = paged_kv_indices_buffer
        self._paged_kv_last_page_len_buf = paged_kv_last_page_len_buffer
        self._ops: dict[tuple, DecodeAttention] = {}
        self._op: DecodeAttention | None = None   # the operator of the last plan() that succeeded
        self._batch = 0

    @property
    def use_tensor_cores(self) -> bool:
        return self._use_tensor_cores

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor, int_workspace_buffer: torch.Tensor) -> None:
        """Accepted for FlashInfer's API; meld's operators use their own buffers."""
        for name, buf in (("float_workspace_buffer", float_workspace_buffer),
                          ("int_workspace_buffer", int_workspace_buffer)):
            if not isinstance(buf, torch.Tensor):
                raise ValueError(f"{name} must be a torch.Tensor, got {type(buf).__name__}")
        self._float_workspace_buffer = float_workspace_buffer

    # --- plan -----------------------------------------------------------------------------------
    def plan(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, num_qo_heads: int,
             num_kv_heads: int, head_dim: int, page_size: int, pos_encoding_mode: str = "NONE",
             window_left: int = -1, logits_soft_cap: float | None = None,
             q_data_type: str | torch.dtype | None = "float16", kv_data_type: str | torch.dtype | None = None,
             o_data_type: str | torch.dtype | None = None, data_type: str | torch.dtype | None = None,
             sm_scale: float | None = None, rope_scale: float | None = None, rope_theta: float | None = None,
             non_blocking: bool = True, block_tables: torch.Tensor | None = None,
             seq_lens: torch.Tensor | None = None, fixed_split_size: int | None = None,
             disable_split_kv: bool = False, q_len_per_req: int = 1, *, window_right: int = 0,
             check: bool = True) -> None:
        """Plan a batch (FlashInfer's paged layout, int32; CPU or this wrapper's device) for every run()
        until the next plan(). A plan() that raises changes nothing.

        Supported: pos_encoding_mode "NONE" (rope_scale and rope_theta are then ignored, as in FlashInfer) or
        "ROPE_LLAMA" (16-bit caches; rope_scale, rope_theta: None for 1 and 1e4), window_left -1 or a window (the last window_left + 1 keys of each request), window_right=0,
        logits_soft_cap None, 0 or a cap (c tanh(sm_scale q.k / c)), q and o data types one of bfloat16 and
        float16, kv_data_type q's, float8_e4m3fn or float8_e5m2, head_dim 64, 128, 256 or 512, any sm_scale (default
        1/sqrt(head_dim)). q_len_per_req 1 to 8 (FlashInfer's rules: more than 1 needs use_tensor_cores=True and
        every request's kv_len >= q_len_per_req, and a CUDA-graph wrapper keeps its first plan's value; run()'s q,
        out and lse are [batch * q_len_per_req, ...], causal among a request's new tokens), not with a window
        or ROPE_LLAMA. Each (soft cap, window, RoPE, q_len_per_req) is a kernel of its own, built on first plan().
        The rest raises NotImplementedError. `check` is meld's (see the module docstring).
        """
        variant = _variant(pos_encoding_mode, window_left, logits_soft_cap, rope_scale, rope_theta)
        if window_right != 0:
            raise _unsupported("window_right", window_right, "meld attends to every token up to the query")
        for name, value in (("block_tables", block_tables), ("seq_lens", seq_lens)):
            if value is not None:
                raise _unsupported(name, value, "meld reads request lengths from indptr and last_page_len")
        q_len = self._q_len(q_len_per_req, variant)
        if fixed_split_size is not None and not is_int(fixed_split_size):
            raise ValueError(f"fixed_split_size must be None or an int, got {fixed_split_size!r}")
        if fixed_split_size is not None and not self._use_tensor_cores:   # FlashInfer's rule
            raise ValueError("fixed_split_size is only supported by tensor core decode (use_tensor_cores=True)")
        if not isinstance(disable_split_kv, bool):
            raise ValueError(f"disable_split_kv must be True or False, got {disable_split_kv!r}")
        if not is_int(head_dim) or head_dim < 1:
            raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
        if head_dim not in _HEAD_DIMS:
            raise _unsupported("head_dim", head_dim, f"meld's decode kernel is built for head_dim {_HEAD_DIMS}")
        dtype, kv_dtype = self._dtype(q_data_type, kv_data_type, o_data_type, data_type)
        if sm_scale is not None:
            sm_scale = check_finite("sm_scale", sm_scale)
        batch_invariant = disable_split_kv or (fixed_split_size is not None and fixed_split_size > 0)
        op = self._operator(num_qo_heads, num_kv_heads, int(head_dim), page_size, dtype, kv_dtype, sm_scale,
                            batch_invariant, variant, q_len)
        if self._use_cuda_graph and isinstance(indices, torch.Tensor) and isinstance(last_page_len, torch.Tensor):
            if len(last_page_len) != self._fixed_batch_size:
                raise ValueError(f"The batch size should be fixed in cudagraph mode: len(last_page_len)="
                                 f"{len(last_page_len)}, but the paged_kv_*_buffers given at construction hold "
                                 f"{self._fixed_batch_size}")
            if indices.numel() > len(self._paged_kv_indices_buf):
                raise ValueError(f"indices has {indices.numel()} entries, more than paged_kv_indices_buffer's "
                                 f"{len(self._paged_kv_indices_buf)}")
        op.plan(indptr, indices, last_page_len, check=check)
        if self._use_cuda_graph:   # FlashInfer's plan() keeps the table in these buffers: engines may read them
            self._paged_kv_indptr_buf.copy_(indptr, non_blocking=non_blocking)
            self._paged_kv_last_page_len_buf.copy_(last_page_len, non_blocking=non_blocking)
            self._paged_kv_indices_buf[:len(indices)].copy_(
                indices, non_blocking=indices.device == self.device and non_blocking)
        self._op, self._batch = op, len(last_page_len)

    begin_forward = plan

    def fast_plan(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, num_qo_heads: int,
                  num_kv_heads: int, head_dim: int, page_size: int, pos_encoding_mode: str = "NONE",
                  window_left: int = -1, logits_soft_cap: float | None = None,
                  q_data_type: str | torch.dtype | None = None, kv_data_type: str | torch.dtype | None = None,
                  data_type: str | torch.dtype | None = None, sm_scale: float | None = None,
                  rope_scale: float | None = None, rope_theta: float | None = None, non_blocking: bool = True,
                  fixed_split_size: int | None = None, disable_split_kv: bool = False,
                  global_override_indptr_cpu: torch.Tensor | None = None, q_len_per_req: int = 1, *,
                  check: bool = True) -> None:
        """FlashInfer's `fast_decode_plan` as a method (its faster re-plan for multi-step drafts: it skips copies
        into the cuda-graph buffers that FlashInfer's plan() makes). meld's plan() is that fast path already:
        this is plan(), with its validation and its transactional failure. global_override_indptr_cpu, FlashInfer's
        host copy of indptr, is the indptr meld plans from when given (an int32 CPU tensor of indptr's length):
        the page indices may stay on the device, and no device indptr is read back."""
        if global_override_indptr_cpu is not None:
            expect("global_override_indptr_cpu", global_override_indptr_cpu, torch.int32, (None,),
                   "a 1-D int32 tensor on the CPU (indptr's host copy)", torch.device("cpu"))
            if isinstance(indptr, torch.Tensor) and global_override_indptr_cpu.shape != indptr.shape:
                raise ValueError(f"global_override_indptr_cpu must have indptr's shape {tuple(indptr.shape)}, got "
                                 f"{tuple(global_override_indptr_cpu.shape)}")
            indptr = global_override_indptr_cpu
        # The class's plan(), not the instance's: FlashInfer's idiom `wrapper.plan = partial(fast_decode_plan,
        # wrapper)` rebinds the instance's, which would call back into this method.
        type(self).plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                        pos_encoding_mode, window_left, logits_soft_cap,
                        "float16" if q_data_type is None and data_type is None else q_data_type, kv_data_type, None,
                        data_type, sm_scale, rope_scale, rope_theta, non_blocking, fixed_split_size=fixed_split_size,
                        disable_split_kv=disable_split_kv, q_len_per_req=q_len_per_req, check=check)

    def _q_len(self, q_len_per_req: object, variant: DecodeVariant) -> int:
        """plan()'s q_len_per_req, checked as FlashInfer checks it (ValueError) and against what meld builds
        (NotImplementedError)."""
        if not is_int(q_len_per_req) or q_len_per_req < 1:
            raise ValueError(f"q_len_per_req must be an int >= 1, got {q_len_per_req!r}")
        q_len = int(q_len_per_req)
        if q_len > 1 and not self._use_tensor_cores:   # FlashInfer's rule
            raise ValueError("q_len_per_req > 1 requires tensor-core decode (use_tensor_cores=True), got "
                             f"q_len_per_req={q_len}")
        if q_len > MAX_Q_LEN:
            raise _unsupported("q_len_per_req", q_len, f"meld's decode kernel takes 1 to {MAX_Q_LEN} new tokens per "
                               "request")
        if q_len > 1 and (variant.window_left >= 0 or variant.rope_theta):
            raise _unsupported("q_len_per_req", q_len, "meld's sliding window and RoPE place every key relative to a "
                               "request's last token (window_left=-1 and pos_encoding_mode='NONE' only)")
        frozen = self._op.q_len if self._op is not None else q_len
        if self._use_cuda_graph and q_len != frozen:   # FlashInfer's rule: part of the captured shape
            raise ValueError(f"q_len_per_req is part of the frozen cudagraph shape: this wrapper was planned with "
                             f"{frozen}, got {q_len}. Use a separate wrapper per q_len_per_req.")
        return q_len

    def _dtype(self, q_data_type, kv_data_type, o_data_type, data_type) -> tuple[torch.dtype, torch.dtype]:
        """The dtype meld computes in and the cache's (that one, or FP8), resolved as FlashInfer resolves its three."""
        if data_type is not None:   # FlashInfer's deprecated alias: it only fills the types left as None
            q_data_type = data_type if q_data_type is None else q_data_type
            kv_data_type = data_type if kv_data_type is None else kv_data_type
        q = _dtype("q_data_type", q_data_type)
        kv = q if kv_data_type is None else _dtype("kv_data_type", kv_data_type)
        o = q if o_data_type is None else _dtype("o_data_type", o_data_type)
        if q not in _DTYPES:
            raise _unsupported("q_data_type", q, "meld computes in torch.bfloat16 or torch.float16")
        if kv != q and kv not in FP8:
            raise _unsupported("kv_data_type", kv, f"meld reads the KV cache in q's dtype {q} or as {FP8_NAMES} "
                               "(q_data_type defaults to 'float16', and data_type= does not override a q_data_type "
                               "given, as in FlashInfer)")
        if o != q:
            raise _unsupported("o_data_type", o, f"meld writes the output in q's dtype {q}")
        return q, kv

    def _operator(self, num_qo_heads, num_kv_heads, head_dim, page_size, dtype, kv_dtype, sm_scale, batch_invariant,
                  variant: DecodeVariant, q_len: int):
        """The meld operator of these shapes and variant, made once per wrapper."""
        num_qo_heads, num_kv_heads, page_size = (check_positive(name, v) for name, v in (
            ("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads), ("page_size", page_size)))
        scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
        key = (num_qo_heads, num_kv_heads, head_dim, page_size, dtype, kv_dtype, scale, batch_invariant, variant, q_len)
        op = self._ops.get(key)
        if op is None:
            graph = self._use_cuda_graph
            op = DecodeAttention(num_qo_heads, num_kv_heads, head_dim, page_size, dtype, self.device,
                                 kv_dtype=kv_dtype, kv_layout=self._kv_layout, sm_scale=sm_scale,
                                 batch_invariant=batch_invariant, logits_soft_cap=variant.logits_soft_cap,
                                 window_left=variant.window_left, **_rope_arguments(variant), q_len=q_len,
                                 max_batch_size=self._fixed_batch_size if graph else None,
                                 max_num_pages=max(1, len(self._paged_kv_indices_buf)) if graph else None)
            self._ops[key] = op
        return op

    # --- run ------------------------------------------------------------------------------------
    def run(self, q: torch.Tensor, paged_kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor], *args,
            q_scale: float | None = None, k_scale: float | None = None, v_scale: float | None = None,
            out: torch.Tensor | None = None, lse: torch.Tensor | None = None, return_lse: bool = False,
            enable_pdl: bool | None = None, window_left: int | None = None, sinks: torch.Tensor | None = None,
            q_len_per_req: int | None = None, skip_softmax_threshold_scale_factor: float | None = None,
            kv_cache_sf: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None):
        """Attention of q [batch, num_qo_heads, head_dim] ([batch * q_len_per_req, ...]) over the planned batch.

        paged_kv_cache: one tensor [num_pages, 2, page_size, num_kv_heads, head_dim] (NHD; HND swaps
        page_size and num_kv_heads; 4-D without the page_size axis when page_size is 1), or a tuple
        (k_cache, v_cache) of two tensors [num_pages, page_size, num_kv_heads, head_dim] (3-D when page_size
        is 1): separate allocations, or views of any. meld reads them in place, never copied, through their
        strides (`meld.DecodeAttention.run`: the last dim contiguous, the page, token and head strides
        multiples of head_dim, K's the same as V's as FlashInfer requires, 16-byte aligned starts).
        q_scale must be None or 1 (fold it into plan()'s sm_scale). An FP8 cache's k_scale and v_scale (numbers;
        None: 1) dequantise it inside the kernel (module docstring). A 16-bit cache's k_scale must be None or 1
        (fold it into sm_scale), and its v_scale multiplies the output in place, as FlashInfer does. Returns
        out, or (out, lse) with lse base 2. q_len_per_req here is deprecated, as in FlashInfer (a
        DeprecationWarning): it must match q's rows and plan()'s value.
        """
        op = self._op
        if op is None:
            raise RuntimeError("BatchDecodeWithPagedKVCacheWrapper.run: call plan() first")
        if args:
            raise _unsupported("*args", args, "they are inputs of FlashInfer's custom-JIT and fp8 kernels")
        if sinks is not None or skip_softmax_threshold_scale_factor is not None or kv_cache_sf is not None:
            for name, value in (("sinks", sinks), ("kv_cache_sf", kv_cache_sf),
                                ("skip_softmax_threshold_scale_factor", skip_softmax_threshold_scale_factor)):
                if value is not None:
                    raise _unsupported(name, value, "meld computes plain softmax attention over a bf16, fp16, "
                                       "e4m3 or e5m2 cache")
        # FlashInfer's run() may override plan()'s window; meld builds it into the kernel at plan().
        if window_left is not None and window_left != op.variant.window_left:
            raise ValueError(f"window_left must be None or plan()'s window_left={op.variant.window_left}, got "
                             f"{window_left!r}")
        self._check_q_rows(q, q_len_per_req)
        if enable_pdl is not None and enable_pdl is not True and enable_pdl is not False:
            raise ValueError(f"enable_pdl must be None, True or False, got {enable_pdl!r}")
        fp8 = op.kv_dtype in FP8
        folded = {"q_scale": q_scale} if fp8 else {"q_scale": q_scale, "k_scale": k_scale}   # (FP8: the kernel's)
        for name, scale in folded.items():
            if scale is not None and (type(scale) is not float or scale != 1.0) and check_finite(name, scale) != 1:
                raise _unsupported(name, scale, f"meld fixes the softmax scale at plan(): plan with sm_scale="
                                   f"{op.sm_scale!r} * {name} instead")
        scales = dict(k_scale=1.0 if k_scale is None else k_scale, v_scale=1.0 if v_scale is None else v_scale) \
            if fp8 else {}
        if not fp8 and type(v_scale) not in (float, type(None)):
            _check_v_scale(v_scale, op.device)
        if lse is None and return_lse:
            lse = torch.empty(self._batch * op.q_len, op.num_qo_heads, dtype=torch.float32, device=op.device)
        try:
            result = op.run(q, self._cache(paged_kv_cache), return_lse=return_lse, out=out, lse=lse, **scales)
        except ValueError as e:
            raise ValueError(_cache_names(str(e))) from None
        if lse is not None:
            plain(lse).mul_(_LOG2E)   # the memory meld wrote: run() tied lse itself to meld's no-backward node
        if not fp8 and v_scale is not None and not (isinstance(v_scale, float) and v_scale == 1.0):   # FlashInfer's rule
            plain(result[0] if return_lse else result).mul_(v_scale)
        return result

    run_return_lse = functools.partialmethod(run, return_lse=True)

    def _check_q_rows(self, q: object, q_len_per_req: object) -> None:
        """FlashInfer's run()-time q_len_per_req: deprecated there (a DeprecationWarning) and checked against
        plan()'s; q whose rows are another multiple of the batch implies another q_len_per_req (ValueError naming
        it, as FlashInfer's; the rest of q is the operator's to check)."""
        planned, batch = self._op.q_len, self._batch
        if q_len_per_req is not None:
            warnings.warn("Passing `q_len_per_req` to BatchDecodeWithPagedKVCacheWrapper.run() is deprecated (as in "
                          "FlashInfer); pass it to plan() instead", DeprecationWarning, stacklevel=3)
            if not is_int(q_len_per_req) or q_len_per_req < 1:
                raise ValueError(f"q_len_per_req must be None or an int >= 1, got {q_len_per_req!r}")
            if q_len_per_req != planned:
                raise ValueError(f"q_len_per_req={q_len_per_req} but plan() used {planned}: re-plan with the matching "
                                 "q_len_per_req")
        rows = q.shape[0] if isinstance(q, torch.Tensor) and q.dim() == 3 else 0
        if batch and rows and rows % batch == 0 and rows != batch * planned:
            raise ValueError(f"q implies q_len_per_req={rows // batch} ({rows} rows for {batch} requests), but plan() "
                             f"used {planned}: re-plan with the matching q_len_per_req")

    def _cache(self, paged_kv_cache):
        """paged_kv_cache as meld's run() takes it: FlashInfer's page_size-1 forms without the page axis get it
        back as a view; anything else goes as given (run() checks it)."""
        if self._op.page_size != 1:
            return paged_kv_cache
        axis = -3 if self._kv_layout == "NHD" else -2
        if isinstance(paged_kv_cache, tuple):   # (k_cache, v_cache), each [num_pages, num_kv_heads, head_dim]
            return tuple(t.unsqueeze(axis) if isinstance(t, torch.Tensor) and t.dim() == 3 else t
                         for t in paged_kv_cache)
        if isinstance(paged_kv_cache, torch.Tensor) and paged_kv_cache.dim() == 4:   # [num_pages, 2, Hkv, D]
            return paged_kv_cache.unsqueeze(axis)
        return paged_kv_cache

    # --- FlashInfer's deprecated spellings --------------------------------------------------------
    def forward(self, q: torch.Tensor, paged_kv_cache, pos_encoding_mode: str = "NONE", q_scale: float | None = None,
                k_scale: float | None = None, v_scale: float | None = None, window_left: int = -1,
                logits_soft_cap: float | None = None, sm_scale: float | None = None, rope_scale: float | None = None,
                rope_theta: float | None = None) -> torch.Tensor:
        """Deprecated in FlashInfer (use run()). Its options replace plan()'s there; here they must agree
        with them: sm_scale (None: 1/sqrt(head_dim)), window_left and logits_soft_cap equal to plan()'s."""
        self._forward_options(pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta)
        return self.run(q, paged_kv_cache, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale)

    def forward_return_lse(self, q: torch.Tensor, paged_kv_cache, pos_encoding_mode: str = "NONE",
                           q_scale: float | None = None, k_scale: float | None = None, v_scale: float | None = None,
                           window_left: int = -1, logits_soft_cap: float | None = None, sm_scale: float | None = None,
                           rope_scale: float | None = None, rope_theta: float | None = None):
        """Deprecated in FlashInfer (use run_return_lse()): forward() returning (out, lse)."""
        self._forward_options(pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta)
        return self.run(q, paged_kv_cache, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, return_lse=True)

    def _forward_options(self, pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale=None,
                         rope_theta=None) -> None:
        variant = _variant(pos_encoding_mode, window_left, logits_soft_cap, rope_scale, rope_theta)
        op = self._op
        if op is not None:
            for name, value, field in (("window_left", window_left, "window_left"),
                                       ("logits_soft_cap", logits_soft_cap, "logits_soft_cap"),
                                       ("pos_encoding_mode", pos_encoding_mode, "rope_theta"),
                                       ("rope_theta", rope_theta, "rope_theta"), ("rope_scale", rope_scale, "rope_scale")):
                if getattr(variant, field) != getattr(op.variant, field):
                    raise _unsupported(name, value, f"forward() must keep plan()'s {name} (meld builds it into the "
                                       "kernel at plan())")
            scale = 1.0 / math.sqrt(op.head_dim) if sm_scale is None else check_finite("sm_scale", sm_scale)
            if scale != op.sm_scale:
                raise _unsupported("sm_scale", sm_scale, f"forward() must keep plan()'s sm_scale={op.sm_scale!r} "
                                   "(meld fixes the scale at plan())")

    def end_forward(self) -> None:
        """Deprecated in FlashInfer, where it does nothing."""


class CUDAGraphBatchDecodeWithPagedKVCacheWrapper(BatchDecodeWithPagedKVCacheWrapper):
    """FlashInfer's CUDA-graph spelling: the wrapper with use_cuda_graph=True and its fixed buffers."""

    def __init__(self, workspace_buffer: torch.Tensor, indptr_buffer: torch.Tensor, indices_buffer: torch.Tensor,
                 last_page_len_buffer: torch.Tensor, kv_layout: str = "NHD", use_tensor_cores: bool = False) -> None:
        super().__init__(workspace_buffer, kv_layout, use_cuda_graph=True, use_tensor_cores=use_tensor_cores,
                         paged_kv_indptr_buffer=indptr_buffer, paged_kv_indices_buffer=indices_buffer,
                         paged_kv_last_page_len_buffer=last_page_len_buffer)


def _plan_names(message: str) -> str:
    """A CascadeDecode.plan message in the wrapper's argument names."""
    for ours, theirs in (("kv_indptr_arr", "paged_kv_indptr_arr"), ("kv_indices_arr", "paged_kv_indices_arr"),
                         ("kv_last_page_len_arr", "paged_kv_last_page_len")):
        message = re.sub(rf"(?<!paged_)\b{ours}\b", theirs, message)
    return message


class MultiLevelCascadeAttentionWrapper:
    """FlashInfer's multi-level cascade attention for decode (one query row per request), on `meld.CascadeDecode`.

    Example (FlashInfer's own, with meld's import): two levels, a prefix shared by a group of requests, then
    each request's own pages:
        >>> wrapper = MultiLevelCascadeAttentionWrapper(2, workspace, "NHD")
        >>> wrapper.plan([shared_qo_indptr, unique_qo_indptr], [shared_kv_indptr, unique_kv_indptr],
        ...              [shared_kv_indices, unique_kv_indices], [shared_last_page_len, unique_last_page_len],
        ...              num_qo_heads, num_kv_heads, head_dim, page_size)
        >>> out = wrapper.run(q, paged_kv_cache)

    Where it stands: meld's reference executor runs it on CPU tensors (a CPU workspace buffer); the GPU
    kernel has no shared-prefix task body yet, so a CUDA workspace is refused at plan() with
    NotImplementedError, as are use_cuda_graph, the attention variants meld does not compute
    (pos_encoding_mode, window_left, logits_soft_cap, use_fp16_qk_reduction) and causal=True where a
    last-level group holds more than one query row (prefill). The workspace is accepted and unused.
    """

    def __init__(self, num_levels: int, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, qo_indptr_buf_arr: list | None = None,
                 paged_kv_indptr_buf_arr: list | None = None, paged_kv_indices_buf_arr: list | None = None,
                 paged_kv_last_page_len_buf_arr: list | None = None) -> None:
        self._num_levels = check_positive("num_levels", num_levels, 64)
        _check_workspace(float_workspace_buffer)
        if kv_layout not in ("NHD", "HND"):
            raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
        if use_cuda_graph is not False:
            raise _unsupported("use_cuda_graph", use_cuda_graph, "meld's cascade runs on the CPU executor for now")
        for name, buf in (("qo_indptr_buf_arr", qo_indptr_buf_arr), ("paged_kv_indptr_buf_arr", paged_kv_indptr_buf_arr),
                          ("paged_kv_indices_buf_arr", paged_kv_indices_buf_arr),
                          ("paged_kv_last_page_len_buf_arr", paged_kv_last_page_len_buf_arr)):
            if buf is not None:
                raise ValueError(f"{name} is for use_cuda_graph=True only, got a {type(buf).__name__}")
        self._float_workspace_buffer = float_workspace_buffer
        self.device = float_workspace_buffer.device
        self._kv_layout = kv_layout
        self._ops: dict[tuple, object] = {}
        self._op = None

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return False

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor, int_workspace_buffers: list) -> None:
        """Accepted for FlashInfer's API; meld's operators use their own buffers."""
        if not isinstance(float_workspace_buffer, torch.Tensor):
            raise ValueError("float_workspace_buffer must be a torch.Tensor, got "
                             f"{type(float_workspace_buffer).__name__}")
        self._float_workspace_buffer = float_workspace_buffer

    def plan(self, qo_indptr_arr: list, paged_kv_indptr_arr: list, paged_kv_indices_arr: list,
             paged_kv_last_page_len: list, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
             causal: bool = False, pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
             sm_scale: float | None = None, window_left: int = -1, logits_soft_cap: float | None = None,
             rope_scale: float | None = None, rope_theta: float | None = None,
             q_data_type: str | torch.dtype = "float16", kv_data_type: str | torch.dtype | None = None) -> None:
        """Plan every level (int32 CPU tensors, one per level in each list). A plan() that raises changes nothing."""
        from ..ops.cascade_decode import CascadeDecode

        variant = _variant(pos_encoding_mode, window_left, logits_soft_cap, rope_scale, rope_theta)
        for name, value, off in (("pos_encoding_mode", pos_encoding_mode, not variant.rope_theta),
                                 ("window_left", window_left, variant.window_left < 0),
                                 ("logits_soft_cap", logits_soft_cap, not variant.logits_soft_cap)):
            if not off:
                raise _unsupported(name, value, "meld's cascade computes plain softmax attention (the decode wrapper "
                                   "takes it)")
        if use_fp16_qk_reduction is not False:
            raise _unsupported("use_fp16_qk_reduction", use_fp16_qk_reduction, "meld accumulates scores in float32")
        if not isinstance(causal, bool):
            raise ValueError(f"causal must be True or False, got {causal!r}")
        if causal and isinstance(qo_indptr_arr, (list, tuple)) and qo_indptr_arr and \
                isinstance(qo_indptr_arr[-1], torch.Tensor) and qo_indptr_arr[-1].dim() == 1 and \
                (qo_indptr_arr[-1].diff() > 1).any():
            raise _unsupported("causal", causal, "a last-level group of several query rows is prefill; meld decodes "
                               "one query row per request (where causal changes nothing)")
        q = _dtype("q_data_type", q_data_type)
        kv = q if kv_data_type is None else _dtype("kv_data_type", kv_data_type)
        if q not in _DTYPES:
            raise _unsupported("q_data_type", q, "meld computes in torch.bfloat16 or torch.float16")
        if kv != q:
            raise _unsupported("kv_data_type", kv, f"meld reads the KV cache in q's dtype {q}")
        if sm_scale is not None:
            sm_scale = check_finite("sm_scale", sm_scale)
        key = (num_qo_heads, num_kv_heads, head_dim, page_size, q, sm_scale)
        op = self._ops.get(key)
        if op is None:
            op = CascadeDecode(num_qo_heads, num_kv_heads, head_dim, page_size, self._num_levels, q, self.device,
                               sm_scale=sm_scale)
        try:
            op.plan(qo_indptr_arr, paged_kv_indptr_arr, paged_kv_indices_arr, paged_kv_last_page_len)
        except ValueError as e:
            raise ValueError(_plan_names(str(e))) from None
        self._ops[key] = self._op = op

    begin_forward = plan

    def run(self, q: torch.Tensor, paged_kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The output [total query rows, num_qo_heads, head_dim] over every level of the last plan."""
        if self._op is None:
            raise RuntimeError("MultiLevelCascadeAttentionWrapper.run: call plan() first")
        if isinstance(paged_kv_cache, tuple):
            if len(paged_kv_cache) != 2 or not all(isinstance(t, torch.Tensor) for t in paged_kv_cache):
                raise ValueError("paged_kv_cache as a tuple must be (k_cache, v_cache) tensors")
            if paged_kv_cache[0].shape != paged_kv_cache[1].shape:
                raise ValueError(f"k_cache and v_cache must have one shape, got {tuple(paged_kv_cache[0].shape)} and "
                                 f"{tuple(paged_kv_cache[1].shape)}")
            paged_kv_cache = torch.stack(paged_kv_cache, dim=1)   # (the CPU executor reads a copy in float64 anyway)
        elif not isinstance(paged_kv_cache, torch.Tensor):
            raise ValueError(f"paged_kv_cache must be a torch.Tensor or a (k_cache, v_cache) tuple, got "
                             f"{type(paged_kv_cache).__name__}")
        if self._kv_layout == "HND":
            op = self._op
            expect("paged_kv_cache", paged_kv_cache, op.dtype, (None, 2, op.num_kv_heads, op.page_size, op.head_dim),
                   "num_pages, K/V, num_kv_heads, page_size, head_dim: kv_layout='HND'")
            paged_kv_cache = paged_kv_cache.transpose(2, 3)
        try:
            return self._op.run(q, paged_kv_cache)
        except ValueError as e:
            raise ValueError(_cache_names(str(e))) from None

    def forward(self, q: torch.Tensor, paged_kv_cache) -> torch.Tensor:
        """FlashInfer's deprecated name of run()."""
        return self.run(q, paged_kv_cache)

    def end_forward(self) -> None:
        """FlashInfer's deprecated no-op."""


def fast_decode_plan(self: BatchDecodeWithPagedKVCacheWrapper, *args, **kwargs) -> None:
    """FlashInfer's `flashinfer.decode.fast_decode_plan(wrapper, ...)`, which engines bind to a wrapper
    (`functools.partial(fast_decode_plan, wrapper)`): `BatchDecodeWithPagedKVCacheWrapper.fast_plan`, the same
    arguments."""
    if not isinstance(self, BatchDecodeWithPagedKVCacheWrapper):
        raise ValueError(f"fast_decode_plan's first argument must be a BatchDecodeWithPagedKVCacheWrapper, got "
                         f"{type(self).__name__}")
    self.fast_plan(*args, **kwargs)


def single_decode_with_kv_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layout: str = "NHD",
                                pos_encoding_mode: str = "NONE", use_tensor_cores: bool = False,
                                q_scale: float | None = None, k_scale: float | None = None,
                                v_scale: float | None = None, window_left: int = -1,
                                logits_soft_cap: float | None = None, sm_scale: float | None = None,
                                rope_scale: float | None = None, rope_theta: float | None = None,
                                return_lse: bool = False):
    """FlashInfer's `flashinfer.single_decode_with_kv_cache`: one request's decode attention of q [num_qo_heads,
    head_dim] over k and v [kv_len, num_kv_heads, head_dim] (NHD; HND: [num_kv_heads, kv_len, head_dim]).

    The decode wrapper (one per device, kept) planned for a batch of one request whose pages are single tokens,
    so k and v are read in place through their strides, in either layout; a call plans only when its shapes or
    options differ from the last call's. As FlashInfer's,
    q_scale and k_scale multiply sm_scale and v_scale the output. Returns out [num_qo_heads, head_dim], or (out,
    lse [num_qo_heads], base 2) with return_lse.

    Example (FlashInfer's own, with meld's import):
        >>> o = single_decode_with_kv_cache(q, k, v)   # q [32, 128], k and v [4096, 32, 128], float16
    """
    if kv_layout not in ("NHD", "HND"):
        raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
    if not isinstance(use_tensor_cores, bool):
        raise ValueError(f"use_tensor_cores must be True or False, got {use_tensor_cores!r}")
    for name, t, dims in (("q", q, 2), ("k", k, 3), ("v", v, 3)):
        if not isinstance(t, torch.Tensor) or t.dim() != dims:
            raise ValueError(f"{name} must be a {dims}-D torch.Tensor, got " + (
                f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__))
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if kv_layout == "HND":   # [num_kv_heads, kv_len, head_dim] read as kv_len single-token pages
        k, v = k.transpose(0, 1), v.transpose(0, 1)
    kv_len, num_kv_heads, head_dim = k.shape
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else check_finite("sm_scale", sm_scale)
    for name, factor in (("q_scale", q_scale), ("k_scale", k_scale)):
        if factor is not None:
            scale *= check_finite(name, factor)
    wrapper, planned = _single_request_wrapper(q.device)
    key = (kv_len, q.shape[0], num_kv_heads, head_dim, pos_encoding_mode, window_left, logits_soft_cap, q.dtype,
           k.dtype, scale, rope_scale, rope_theta)
    if planned.get("key") != key:   # (a plan of the same shapes is kept: a CUDA graph captures run() alone)
        _plan_off_thread(q.device, functools.partial(
            wrapper.plan, torch.tensor([0, kv_len], dtype=torch.int32), torch.arange(kv_len, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32), q.shape[0], num_kv_heads, head_dim, 1, pos_encoding_mode, window_left,
            logits_soft_cap, q_data_type=q.dtype, kv_data_type=k.dtype, sm_scale=scale, rope_scale=rope_scale,
            rope_theta=rope_theta))
        planned["key"] = key
    try:
        result = wrapper.run(q.unsqueeze(0), (k, v), v_scale=v_scale, return_lse=return_lse)
    except ValueError as e:   # (in this function's names: the tuple's parts are k and v)
        raise ValueError(re.sub(r"\b([kv])_cache\b", r"\1", str(e))) from None
    return (result[0][0], result[1][0]) if return_lse else result[0]


_PLAN_THREAD = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="meld-single-decode-plan")


def _plan_off_thread(device: torch.device, plan: Callable[[], object]) -> None:
    """single_decode_with_kv_cache's plan(), on a GPU on a thread of its own (on the caller's device and stream,
    its errors raised here). The plan allocates the operator's lasting buffers (work tables, partials, counters),
    and torch.compile's CUDA-graph trees route every allocation of the calling thread into their pool while
    they warm a graph up: the plan's buffers would outlive the call in that pool, which the trees refuse
    ("tensor(s) in the cudagraph pool not tracked as outputs"). Another thread's allocations are not routed."""
    if device.type != "cuda":
        plan()
        return
    stream = torch.cuda.current_stream(device)

    def body() -> None:
        with torch.cuda.device(device), torch.cuda.stream(stream):
            stream.query()   # (a runtime call: torch's primary context current on this thread for meld's driver calls)
            plan()
    _PLAN_THREAD.submit(body).result()


@functools.lru_cache(maxsize=None)
def _single_request_wrapper(device: torch.device) -> tuple[BatchDecodeWithPagedKVCacheWrapper, dict]:
    """single_decode_with_kv_cache's wrapper on `device` (its operators, one per shape and variant, are kept) and
    the key of its last plan: a call of the same shapes and options runs without planning again, so it can be
    captured in a CUDA graph (plan() copies tables to the device; FlashInfer's single decode has no plan step)."""
    return BatchDecodeWithPagedKVCacheWrapper(torch.empty(0, dtype=torch.uint8, device=device)), {}
