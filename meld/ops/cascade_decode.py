"""`meld.CascadeDecode`: shared-prefix (cascade) decode attention, composed from its task graph.

Requests of a group share a prefix of KV pages; each level of the cascade is a page table per group of
requests (FlashInfer's multi-level cascade layout). The graph (`cascade_decode_graph`) has one split-reduce
task per level and decode attention's online-softmax combine; `lower()` gives it the grouped-attention family,
whose planner (`meld.scheduler.plan_split_reduce`, asked of the lowering) balances every level's pieces
together, and whose reference executor runs the plan from the graph: a level's group is read once for all its
requests, and each (request, kv head) merges its parts as soon as the last one arrives.

Where it stands: the CPU reference executor runs it. The GPU kernel has no prefix task body yet (a piece
whose query rows are a whole group's requests), so a CUDA device is refused at construction.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ..scheduler.split_reduce_plan import GroupTable
from .base import Operator
from .cascade_graph import cascade_decode_graph, level_task
from .checks import check_finite, check_positive, expect, grad_inputs, is_int, plain
from .page_table import check_page_table, max_page

_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
H200_SMS = 132


class CascadeDecode(Operator):
    """Decode attention over `num_levels` levels of paged KV, each a page table per group of requests.

    Args:
        num_qo_heads, num_kv_heads, head_dim, page_size: as `meld.DecodeAttention` (head_dim 64, 128 or 256).
        num_levels: levels of the cascade (>= 1; one level is plain decode).
        dtype: torch.bfloat16 or torch.float16 (q, KV cache and output).
        device: "cpu" (the reference executor); the GPU kernel has no cascade task body yet.
        sm_scale: softmax scale, a finite number; default 1/sqrt(head_dim).
        num_ctas: CTAs the planner balances the pieces over (default: the H200's SMs).
    """

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, num_levels: int,
                 dtype: torch.dtype = torch.bfloat16, device: object = "cpu", *, sm_scale: float | None = None,
                 num_ctas: int = H200_SMS):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {list(_DTYPES)}, got {dtype!r}")
        if not is_int(head_dim) or head_dim not in (64, 128, 256):   # (the GPU kernel's; the CPU takes no other)
            raise ValueError(f"head_dim must be 64, 128 or 256, got {head_dim!r}")
        graph = cascade_decode_graph(num_qo_heads, num_kv_heads, head_dim, page_size, num_levels, _DTYPES[dtype])
        self.num_ctas = check_positive("num_ctas", num_ctas, 1 << 16)
        self._setup(graph, device)
        if self.device.type != "cpu" and self.lowering.kernel is None:
            raise NotImplementedError(f"CascadeDecode on {self.device}: its graph lowers to the {self.lowering.family} "
                                      "family, which has no GPU kernel yet (no shared-prefix task body); use "
                                      "device='cpu' (the reference executor)")
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.page_size, self.num_levels, self.dtype = page_size, num_levels, dtype
        self.sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else check_finite("sm_scale", sm_scale)
        self._planned = None   # (batch, {task: GroupTable}, SplitReducePlan, largest page index)

    @property
    def plan_tables(self):
        """The last plan: (batch, the level tables by task name, the `SplitReducePlan`)."""
        if self._planned is None:
            raise RuntimeError("CascadeDecode: call plan() first")
        return self._planned[:3]

    def plan(self, qo_indptr_arr, kv_indptr_arr, kv_indices_arr, kv_last_page_len_arr) -> None:
        """Plan a batch: per level l, qo_indptr_arr[l] [G_l + 1] (requests of each group, ending at the batch
        size B, the same for every level) and the groups' page tables in FlashInfer's layout (int32 CPU
        tensors). A plan() that raises changes nothing."""
        arrays = {"qo_indptr_arr": qo_indptr_arr, "kv_indptr_arr": kv_indptr_arr, "kv_indices_arr": kv_indices_arr,
                  "kv_last_page_len_arr": kv_last_page_len_arr}
        for name, arr in arrays.items():
            if not isinstance(arr, (list, tuple)) or len(arr) != self.num_levels:
                got = f"{type(arr).__name__} of {len(arr)}" if isinstance(arr, (list, tuple)) else type(arr).__name__
                raise ValueError(f"{name} must be a list of num_levels={self.num_levels} tensors, got {got}")
        tables, batch, top = {}, None, -1
        for lv in range(self.num_levels):
            qo, ip, ix, last = (plain(arrays[n][lv]) for n in arrays)
            for name, t, meaning in ((f"qo_indptr_arr[{lv}]", qo, "G + 1 offsets"),
                                     (f"kv_indptr_arr[{lv}]", ip, "G + 1 offsets"),
                                     (f"kv_indices_arr[{lv}]", ix, "page indices")):
                expect(name, t, torch.int32, (None,), meaning, torch.device("cpu"), contiguous=True)
            G = qo.shape[0] - 1
            if G < 0:
                raise ValueError(f"qo_indptr_arr[{lv}] must have G + 1 entries, got an empty tensor")
            if ip.shape[0] != G + 1:
                raise ValueError(f"kv_indptr_arr[{lv}] has {ip.shape[0]} entries, qo_indptr_arr[{lv}] {G + 1}: one "
                                 "page table per group")
            expect(f"kv_last_page_len_arr[{lv}]", last, torch.int32, (G,), "one entry per group", torch.device("cpu"),
                   contiguous=True)
            q = qo.numpy().astype(np.int64)
            if q[0] != 0 or (np.diff(q) < 0).any():
                raise ValueError(f"qo_indptr_arr[{lv}] must start at 0 and never decrease, got {q.tolist()}")
            if batch is None:
                batch = int(q[-1])
            elif int(q[-1]) != batch:
                raise ValueError(f"qo_indptr_arr[{lv}][-1]={int(q[-1])}, but level 0 has {batch} requests: every "
                                 "level covers the same batch")
            try:
                nnz = check_page_table(ip.numpy(), last.numpy(), ix.numel(), self.page_size)
                top = max(top, max_page(ix.numpy()[:nnz]))
            except ValueError as e:
                raise ValueError(f"level {lv}: {e}") from None
            tables[level_task(lv)] = GroupTable(q, ip.numpy().astype(np.int64), ix.numpy()[:nnz].astype(np.int64),
                                                last.numpy().astype(np.int64))
        plan = self.lowering.planner([tables[t] for t in self.lowering.producers], batch, self.num_kv_heads,
                                     self.num_qo_heads // self.num_kv_heads, self.page_size, self.num_ctas)
        self._planned = (batch, tables, plan, top)

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, *, return_lse: bool = False,
            out: torch.Tensor | None = None, lse: torch.Tensor | None = None):
        """Attention of q [B, num_qo_heads, head_dim] over every level of the planned batch; kv_cache NHD
        [num_pages, 2, page_size, num_kv_heads, head_dim]. Returns out (and lse, natural log, float32). A
        request with no KV tokens at any level gives zeros and lse = -inf."""
        if self._planned is None:
            raise RuntimeError("CascadeDecode.run: call plan() first")
        if return_lse is not True and return_lse is not False:
            raise ValueError(f"return_lse must be True or False, got {return_lse!r}")
        batch, tables, plan, top = self._planned
        grads = grad_inputs(q, kv_cache)
        q, kv_cache = plain(q), plain(kv_cache)
        Hq, Hkv, D, P = self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size
        expect("q", q, self.dtype, (batch, Hq, D), "batch of the last plan(), num_qo_heads, head_dim", self.device)
        expect("kv_cache", kv_cache, self.dtype, (None, 2, P, Hkv, D),
               "num_pages, K/V, page_size, num_kv_heads, head_dim", self.device)
        if top >= kv_cache.shape[0]:
            raise ValueError(f"the last plan() references page {top}, but kv_cache has only {kv_cache.shape[0]} pages")
        out, lse = self._run_outputs(out, lse, (batch, Hq, D), return_lse, "like q", "batch, num_qo_heads",
                                     {"q": q, "kv_cache": kv_cache})
        o, l = self.lowering.executor(self.graph, plan, tables, q, kv_cache, self.sm_scale)
        plain(out).copy_(o)
        if lse is not None:
            plain(lse).copy_(l)
        out, lse = self._tied(grads, out, lse)
        return (out, lse) if return_lse else out
