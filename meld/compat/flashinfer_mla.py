"""FlashInfer's `flashinfer.mla.BatchMLAPagedAttentionWrapper` (MLA paged attention, DeepSeek's absorbed form) for
decode on `meld.DecodeMLA`; `meld.compat.flashinfer` re-exports it, so an engine switches by one import:

    from meld.compat.flashinfer import BatchMLAPagedAttentionWrapper

The constructor, plan() and run() take FlashInfer 0.6.18's arguments, positions and defaults (flashinfer/mla/
_core.py) for the MLA meld computes: n query rows per request (qo_indptr = 0, n, 2n, ..., batch_size * n, n from 1
to 8; causal=True when n > 1: multi-token decode), head_dim_ckv 512 and head_dim_kpe 64, bfloat16 q, bfloat16 or
e4m3 caches (kv_data_type=torch.float8_e4m3fn: run()'s ckv_scale and kpe_scale, one value, dequantise it in the
kernel), page sizes 8, 16, 32 and multiples of 64. What else FlashInfer
takes raises NotImplementedError naming the argument; bad values raise ValueError naming it, and a plan() that
raises changes nothing. As in the decode wrapper (`meld.compat.flashinfer`):

- lse is base 2, as FlashInfer's, unless run(return_lse_base_on_e=True): meld's natural-log lse is scaled in
  place after the kernel.
- The workspace is held and unused; `backend` is accepted, the kernel is meld's; run()'s kv_len and page_table
  (the inputs of FlashInfer's cutlass backend) are accepted and unused.
- One DecodeMLA per (num_heads, page_size, sm_scale, n, kv_data_type), made on first plan() and kept: a run() captured in a CUDA
  graph replays the operator it was captured with, which must outlive the graph.
- use_cuda_graph=True: the buffers given at construction fix the batch size (len(kv_len_arr), as FlashInfer's
  plan() copies into them) and bound the page indices (len(kv_indices)); they are the operator's capacities, so
  plan() rewrites its tables in place and a captured run() replays every later plan. plan() copies its arrays
  into the buffers, as FlashInfer's does.
- kv_len_arr gives each request's tokens: FlashInfer reads request b's first ceil(kv_len_arr[b] / page_size)
  pages of kv_indptr and never the rest, and meld plans exactly those (`_decode_table`).
- plan() takes meld's keyword `check` (default True): tables partly on the GPU are read back to validate them
  (FlashInfer's plan() reads qo_indptr, kv_indptr and kv_len_arr back too); check=False plans from GPU tables with
  no host synchronisation at all, trusting their values.
"""
from __future__ import annotations

import numpy as np
import torch

from ..codegen.decode_kernel import MAX_Q_LEN
from ..ops.checks import check_finite, check_positive, check_scale, expect, is_int, plain, same_device
from ..ops.page_table import check_page_table, slice_pages
from ._common import _LOG2E, _check_graph_buffers, _check_workspace, _dtype, _unsupported

__all__ = ["BatchMLAPagedAttentionWrapper"]

_BACKENDS = ("auto", "fa2", "fa3", "cutlass")
_HEAD_DIMS = {"head_dim_ckv": 512, "head_dim_kpe": 64}


def _decode_table(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_len_arr: torch.Tensor, page_size: int,
                  on_host: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's MLA page table as `DecodeMLA.plan` takes it: kv_indptr and kv_indices of the pages FlashInfer
    reads (each request's first ceil(kv_len / page_size)), and each last page's fill (kv_last_page_len).

    on_host: kv_indptr and kv_len_arr are read on the host and validated (kv_indptr's own errors first, then a
    request with more tokens than its pages hold, named by kv_len_arr), and a table without unread pages goes as
    given. Otherwise torch ops on kv_indices' device with no host synchronisation (`slice_pages`), values trusted.
    """
    kv_indptr = kv_indptr.cpu() if on_host else kv_indptr.to(kv_indices.device)
    ptr, lens = kv_indptr.long(), kv_len_arr.to(kv_indptr.device, torch.int64)
    pages = ptr[1:] - ptr[:-1]
    need = (lens + page_size - 1).div(page_size, rounding_mode="floor")
    if on_host:   # (kv_indptr's checks: a last-page fill of 1 passes every request)
        check_page_table(ptr.numpy(), np.ones(len(lens), np.int32), kv_indices.numel(), page_size)
        bad = (lens < 0) | (need > pages)
        if bool(bad.any()):
            b = int(bad.nonzero()[0])
            if lens[b] < 0:
                raise ValueError(f"kv_len_arr[{b}]={int(lens[b])} is negative")
            raise ValueError(f"kv_len_arr[{b}]={int(lens[b])} needs {int(need[b])} pages of {page_size} tokens, but "
                             f"kv_indptr gives request {b} {int(pages[b])}")
    need = torch.minimum(need.clamp(min=0), pages.clamp(min=0))
    last = (lens - (need - 1) * page_size).to(torch.int32)   # (an empty request's is page_size: never read)
    if on_host and bool((need == pages).all()):
        return kv_indptr, kv_indices, last
    return *slice_pages(ptr, kv_indices, torch.zeros_like(need), need), last


class BatchMLAPagedAttentionWrapper:
    """FlashInfer's MLA paged attention for decode, on `meld.DecodeMLA` (module docstring: what differs).

    Example (FlashInfer's own; `flashinfer.mla.` becomes `meld.compat.flashinfer.`):
        >>> wrapper = BatchMLAPagedAttentionWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"))
        >>> wrapper.plan(qo_indptr, kv_indptr, kv_indices, kv_lens, 128, 512, 64, 64, False, sm_scale,
        ...              torch.bfloat16, torch.bfloat16)
        >>> out = wrapper.run(q_nope, q_pe, ckv_cache, kpe_cache)
    """

    def __init__(self, float_workspace_buffer: torch.Tensor, use_cuda_graph: bool = False,
                 qo_indptr: torch.Tensor | None = None, kv_indptr: torch.Tensor | None = None,
                 kv_indices: torch.Tensor | None = None, kv_len_arr: torch.Tensor | None = None,
                 backend: str = "auto") -> None:
        _check_workspace(float_workspace_buffer)
        if not isinstance(use_cuda_graph, bool):
            raise ValueError(f"use_cuda_graph must be True or False, got {use_cuda_graph!r}")
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
        self._float_workspace_buffer = float_workspace_buffer   # held, as FlashInfer does; meld never reads it
        self.device = float_workspace_buffer.device
        self._use_cuda_graph = use_cuda_graph
        self._buffers: dict[str, torch.Tensor] = {}   # use_cuda_graph's, which plan() writes
        if use_cuda_graph:
            self._buffers = dict(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices,
                                 kv_len_arr=kv_len_arr)
            _check_graph_buffers(self._buffers, self.device)
            B = len(kv_len_arr)
            if len(qo_indptr) != B + 1 or len(kv_indptr) != B + 1:
                raise ValueError(f"qo_indptr and kv_indptr must have len(kv_len_arr) + 1 = {B + 1} entries, got "
                                 f"{len(qo_indptr)} and {len(kv_indptr)}")
        self._ops: dict[tuple, object] = {}
        self._op = None   # the meld.DecodeMLA of the last plan() that succeeded

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    # --- plan -----------------------------------------------------------------------------------
    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
             kv_len_arr: torch.Tensor, num_heads: int, head_dim_ckv: int, head_dim_kpe: int, page_size: int,
             causal: bool, sm_scale: float, q_data_type: torch.dtype, kv_data_type: torch.dtype,
             use_profiler: bool = False, *, check: bool = True) -> None:
        """Plan a decode batch for every run() until the next plan(): int32 tables on the CPU or this wrapper's
        device, qo_indptr [B + 1] (0, n, 2n, ..., B n: n query rows per request, 1 to MAX_Q_LEN; FlashInfer's
        causal mask when n > 1, token j of a request of kv_len keys seeing keys 0 .. kv_len - n + j:
        `DecodeMLA(q_len=n)`), kv_indptr [B + 1] and kv_indices (FlashInfer's paged layout), kv_len_arr [B] (each
        request's KV tokens). causal changes nothing for one query row and must be True for more. `check` is
        meld's (module docstring). A plan() that raises changes nothing."""
        from ..ops.decode_mla import FP8, DecodeMLA, page_size_supported

        if use_profiler is not False:
            raise _unsupported("use_profiler", use_profiler, "meld's profiles come from MELD_PROFILE=1 (last_trace())")
        for name, flag in (("causal", causal), ("check", check)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be True or False, got {flag!r}")
        if _dtype("q_data_type", q_data_type) is not torch.bfloat16:
            raise _unsupported("q_data_type", q_data_type, "meld's MLA kernel reads bfloat16 q")
        kv_dtype = _dtype("kv_data_type", kv_data_type)
        if kv_dtype is not torch.bfloat16 and kv_dtype not in FP8:
            raise _unsupported("kv_data_type", kv_data_type, "meld's MLA kernel reads bfloat16 or float8_e4m3fn "
                               "caches")
        for name, value in (("head_dim_ckv", head_dim_ckv), ("head_dim_kpe", head_dim_kpe)):
            if not is_int(value) or value != _HEAD_DIMS[name]:
                raise _unsupported(name, value, "meld's MLA kernel is DeepSeek's: head_dim_ckv 512, head_dim_kpe 64")
        num_heads, page_size = check_positive("num_heads", num_heads), check_positive("page_size", page_size)
        if not page_size_supported(page_size):
            raise _unsupported("page_size", page_size, "meld's MLA kernel reads pages of 8, 16 or 32 tokens or a "
                               "multiple of 64")
        sm_scale = check_finite("sm_scale", sm_scale)   # (the operator key: validated values only)
        tables = dict(qo_indptr=plain(qo_indptr), kv_indptr=plain(kv_indptr), kv_indices=plain(kv_indices),
                      kv_len_arr=plain(kv_len_arr))
        for name, t in tables.items():
            expect(name, t, torch.int32, (None,), "a 1-D int32 tensor")
            if not t.is_cpu and not same_device(t.device, self.device):
                where = "" if self.device.type == "cpu" else f" or on {self.device}"
                raise ValueError(f"{name} must be on the CPU{where}, got {t.device}")
        B = len(tables["kv_len_arr"])
        if len(tables["qo_indptr"]) != B + 1 or len(tables["kv_indptr"]) != B + 1:
            raise ValueError(f"qo_indptr and kv_indptr must have len(kv_len_arr) + 1 = {B + 1} entries, got "
                             f"{len(tables['qo_indptr'])} and {len(tables['kv_indptr'])}")
        q_len = self._query_rows(tables["qo_indptr"], check)
        if q_len > 1 and not causal:
            raise _unsupported("causal", causal, f"meld decodes {q_len} query rows per request causally (its new "
                               "tokens: causal=True)")
        if self._buffers:
            self._check_fits(tables)
        on_host = check or tables["kv_indptr"].is_cpu and tables["kv_len_arr"].is_cpu
        indptr, indices, last = _decode_table(tables["kv_indptr"], tables["kv_indices"], tables["kv_len_arr"],
                                              page_size, on_host)
        key = (num_heads, page_size, sm_scale, q_len, kv_dtype)
        op = self._ops.get(key)
        if op is None:   # (its constructor checks num_heads against the kernel's)
            caps = dict(max_batch_size=max(1, len(self._buffers["kv_len_arr"])),
                        max_num_pages=max(1, len(self._buffers["kv_indices"]))) if self._buffers else {}
            op = DecodeMLA(num_heads, page_size, torch.bfloat16, self.device, sm_scale=sm_scale, q_len=q_len,
                           kv_dtype=kv_dtype, **caps)
        op.plan(indptr, indices, last, check=check)
        for name, buf in self._buffers.items():   # FlashInfer's plan() keeps the tables there: engines may read them
            buf[:len(tables[name])].copy_(tables[name], non_blocking=True)
        self._ops[key] = self._op = op

    def _query_rows(self, qo_indptr: torch.Tensor, check: bool) -> int:
        """The query rows n of every request (qo_indptr = 0, n, 2n, ..., B n, n from 1 to MAX_Q_LEN: the decode
        meld's MLA kernel computes), read where plan() reads tables (on the CPU, or with check); trusted to be one
        otherwise (a multi-token plan from GPU tables needs check=True)."""
        if not (check or qo_indptr.is_cpu):
            return 1
        host = qo_indptr.cpu()
        n = int(host[1] - host[0]) if len(host) > 1 else 1
        if not 1 <= n <= MAX_Q_LEN or not torch.equal(host, n * torch.arange(len(host), dtype=torch.int32)):
            raise _unsupported("qo_indptr", host[:9].tolist(), f"meld's MLA decodes the same 1 to {MAX_Q_LEN} query "
                               "rows per request (qo_indptr = 0, n, 2n, ..., batch_size * n)")
        return n

    def _check_fits(self, tables: dict[str, torch.Tensor]) -> None:
        """use_cuda_graph: the plan's tables fit the buffers plan() copies them into (FlashInfer's rules: the
        batch size is fixed, kv_indices at most its buffer's length)."""
        fixed, B = len(self._buffers["kv_len_arr"]), len(tables["kv_len_arr"])
        if B != fixed:
            raise ValueError(f"The batch size should be fixed in cudagraph mode: len(kv_len_arr)={B}, but the buffers "
                             f"given at construction hold {fixed}")
        n, room = len(tables["kv_indices"]), len(self._buffers["kv_indices"])
        if n > room:
            raise ValueError(f"kv_indices has {n} entries, more than the kv_indices buffer's {room} given at "
                             "construction")

    # --- run ------------------------------------------------------------------------------------
    def run(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor, kpe_cache: torch.Tensor,
            out: torch.Tensor | None = None, lse: torch.Tensor | None = None, return_lse: bool = False,
            profiler_buffer: torch.Tensor | None = None, kv_len: torch.Tensor | None = None,
            page_table: torch.Tensor | None = None, return_lse_base_on_e: bool = False, o_scale: float | None = None,
            *, ckv_scale: float | None = None, ckv_scale_arr: torch.Tensor | None = None,
            kpe_scale: float | None = None):
        """Attention of q_nope [B n, num_heads, 512] and q_pe [B n, num_heads, 64] (n: the plan's rows per request)
        over ckv_cache [num_pages, page_size, 512] and kpe_cache [num_pages, page_size, 64] (read in place:
        `meld.DecodeMLA.run`) for the last plan: out [B n, num_heads, 512], or (out, lse [B n, num_heads] float32)
        with return_lse. A given lse is
        written either way, as FlashInfer's; lse is base 2 unless return_lse_base_on_e. An e4m3 cache's ckv_scale and
        kpe_scale (None: 1.0) dequantise its latent and rope channels: meld takes one scale for both (`DecodeMLA.run`'s
        kv_scale), so they must be equal."""
        if self._op is None:
            raise RuntimeError("BatchMLAPagedAttentionWrapper.run: call plan() first")
        for name, value, why in (("profiler_buffer", profiler_buffer, "meld's profiles come from MELD_PROFILE=1"),
                                 ("o_scale", o_scale, "meld writes a bfloat16 output"),
                                 ("ckv_scale_arr", ckv_scale_arr, "meld dequantises with one scale per tensor")):
            if value is not None:
                raise _unsupported(name, value, why)
        ckv, kpe = (1.0 if v is None else check_scale(n, v) for n, v in (("ckv_scale", ckv_scale),
                                                                           ("kpe_scale", kpe_scale)))
        if kpe != ckv:
            raise _unsupported("kpe_scale", kpe_scale, f"meld dequantises the latent and rope channels with one "
                               f"scale (ckv_scale={ckv_scale!r})")
        if ckv != 1.0 and self._op.kv_dtype is torch.bfloat16:
            raise ValueError(f"ckv_scale={ckv_scale!r}: the scales dequantise an FP8 cache, but plan()'s "
                             f"kv_data_type is {self._op.kv_dtype}")
        for name, flag in (("return_lse", return_lse), ("return_lse_base_on_e", return_lse_base_on_e)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be True or False, got {flag!r}")
        want_lse = return_lse or lse is not None
        result = self._op.run(q_nope, q_pe, ckv_cache, kpe_cache, return_lse=want_lse, out=out, lse=lse, kv_scale=ckv)
        if not want_lse:
            return result
        o, l = result
        if not return_lse_base_on_e:
            plain(l).mul_(_LOG2E)   # FlashInfer's base 2
        return (o, l) if return_lse else o
