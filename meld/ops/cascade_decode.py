"""`meld.CascadeDecode`: shared-prefix (cascade) decode attention, composed from its task graph.

Requests of a group share a prefix of KV pages; each level of the cascade is a page table per group of
requests (FlashInfer's multi-level cascade layout). The graph (`cascade_decode_graph`) has one split-reduce
task per level and decode attention's online-softmax combine; `lower()` gives it the grouped-attention family,
whose planner (`meld.scheduler.plan_split_reduce`, asked of the lowering) balances every level's pieces
together, and whose reference executor runs the plan from the graph: a level's group is read once for all its
requests, and each (request, kv head) merges its parts as soon as the last one arrives.

On a GPU the grouped-attention kernel (templates/grouped_attention.cuh, a family of the persistent skeleton)
walks the same tables: a CTA streams a task's KV once through a shared ring for every query row of the task
(a slice of the group's rows, a 16-row block per warp), and the arrival that completes an event's count
merges it in the same launch.
"""
from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import numpy as np
import torch

from ..runtime.tables import StagedImage
from ..scheduler.split_reduce_plan import (ITEM_OVERHEAD_TOKENS, MERGE_OVERHEAD_TOKENS, ROWS_PER_TILE, GroupTable,
                                           LaunchLayout, SplitReducePlan, launch_sizes, write_launch_tables)
from .. import config
from .base import Operator
from .cascade_graph import cascade_decode_graph, level_task
from .checks import check_count, check_finite, check_positive, expect, is_int, plain
from .page_table import check_page_table, max_page

_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
_CPU = torch.device("cpu")
H200_SMS = 132


def _describe_task(unit: int) -> str:
    return f"split-reduce task {unit}"


@dataclass(frozen=True)
class _Buffers:
    """CUDA: the kernel's buffers for plans within `caps` (launch_sizes' units, plus partial slots and
    MELD_PROFILE records per CTA) and its parameter struct, which points into them: the operator shell's
    buffers (`_make_buffers`, installed with the plan by `_commit`)."""

    caps: dict[str, int]
    layout: LaunchLayout
    image: StagedImage                     # every launch table, at layout's offsets
    host_tables: dict[str, np.ndarray]     # layout's views of the pinned image: plan() writes these
    scratch: dict[str, torch.Tensor]       # counters (zero between launches), part_o, part_lse
    prof: torch.Tensor | None              # MELD_PROFILE: the kernel's per-CTA records (last_trace)
    params: ctypes.Structure


def _launch_need(plan: SplitReducePlan, order: list[GroupTable], profile: bool) -> dict[str, int]:
    """What a plan needs of each capacity: launch_sizes', the partial slots, and in MELD_PROFILE builds the
    records of a CTA (one per task and one per merging of the events it completed)."""
    records = 2 * int(np.bincount(plan.task_columns()["cta"], minlength=plan.num_ctas).max(initial=0)) if profile else 0
    return {**launch_sizes(plan, order), "slots": plan.num_slots, "records": records}


class CascadeDecode(Operator):
    """Decode attention over `num_levels` levels of paged KV, each a page table per group of requests.

    Args:
        num_qo_heads, num_kv_heads, head_dim, page_size: as `meld.DecodeAttention` (head_dim 64, 128 or 256).
        num_levels: levels of the cascade (>= 1; one level is plain decode).
        dtype: torch.bfloat16 or torch.float16 (q, KV cache and output).
        device: "cuda[:i]" (the grouped-attention kernel) or "cpu" (the reference executor).
        sm_scale: softmax scale, a finite number; default 1/sqrt(head_dim).
        num_ctas: CTAs the planner balances the pieces over (default: the H200's SMs, times the CTAs an SM runs).
        item_overhead_tokens: the planner's fixed cost of a work item, in KV tokens
            (`meld.scheduler.split_reduce_plan`): more spreads many short items over more CTAs.
        merge_overhead_tokens: and per request of an item past its first (the merges an item that arrives last
            does; default 0: a level's items arrive in level order).
        rows_per_tile: a token of an item of r query rows costs ceil(r / rows_per_tile) units (a request's own
            suffix one): less charges a level's large groups more against its small ones.
        split_stream: how the GPU kernel streams a task of at most 16 query rows (a request's own suffix):
            "warp" (default) through each warp's own ring, "cta" through the CTA's shared ring
            (`meld.codegen.grouped_kernel.GroupedKernelConfig`). The same results either way; the CPU
            executor ignores it.
        prefix_mma: the GPU kernel's tensor-core instructions for a task of more than 16 query rows (a shared
            level's slice): "wgmma" (a warpgroup's 64 rows; needs split_stream "warp" and head_dim 64 or 128) or
            "mma" (mma.sync, a warp's 16 rows); default None: "wgmma" where the build allows it, else "mma"
            (mma took 0.99-1.10x wgmma's time on bench/cascade.py's seven cases, bench/RESULTS.md 2026-12-03).
            The same results up to rounding; the CPU executor ignores it.
        defer_split_events: the GPU kernel counts a split task's arrival at its events (and merges those it
            completes) after the CTA's last task rather than after the task, so a request's own suffix ends without
            stalling the CTA on L2 round trips (`GroupedKernelConfig.defer_split_events`; needs split_stream "warp").
            Default None: True under split_stream "warp" (within 1% of counting after each task, or faster, on
            bench/cascade.py's seven cases, bench/RESULTS.md 2026-12-03 sixth session), else False. The same
            results, bit for bit (an event's parts merge in the planner's order either way); the CPU executor
            ignores it.
        direct_single_part: a split task that is its event's one part (a request with no shared level, a plan of one
            level) writes the output itself, with no partial, count or merge
            (`GroupedKernelConfig.direct_single_part`; needs split_stream "warp"; default False). The same results
            as the merge of that one part; the CPU executor ignores it.
        warps: the GPU kernel's warps a CTA, 8 (default) or 4: two CTAs an SM, so that a shared level's slice and a
            request's own suffix can run on an SM at once (`GroupedKernelConfig.warps`; head_dim 64 or 128); tasks
            hold at most warps x 16 query rows, and the default num_ctas doubles. The same results up to rounding
            (the planner slices the rows differently on the CPU too).
        stagger: the second half of the CTAs walks its tasks last to first (`plan_split_reduce`): with two CTAs an
            SM, c and c + num_ctas / 2, one attends the shared levels while the other streams its requests' own KV.
            Default False. The same results, bit for bit (an event's parts merge in the planner's order).

    Example:
        >>> op = CascadeDecode(32, 8, 128, 16, 2, torch.bfloat16, "cuda", split_stream="warp")  # doctest: +SKIP
    """

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, num_levels: int,
                 dtype: torch.dtype = torch.bfloat16, device: object = "cpu", *, sm_scale: float | None = None,
                 num_ctas: int | None = None, item_overhead_tokens: int = ITEM_OVERHEAD_TOKENS,
                 merge_overhead_tokens: int = MERGE_OVERHEAD_TOKENS, rows_per_tile: int = ROWS_PER_TILE,
                 split_stream: str = "warp", prefix_mma: str | None = None, defer_split_events: bool | None = None,
                 direct_single_part: bool = False, warps: int = 8, stagger: bool = False):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {list(_DTYPES)}, got {dtype!r}")
        if not is_int(head_dim) or head_dim not in (64, 128, 256):   # (the GPU kernel's; the CPU takes no other)
            raise ValueError(f"head_dim must be 64, 128 or 256, got {head_dim!r}")
        from ..codegen.grouped_kernel import PREFIX_MMAS, SPLIT_STREAMS, GroupedKernelConfig

        if split_stream not in SPLIT_STREAMS:
            raise ValueError(f"split_stream must be one of {SPLIT_STREAMS}, got {split_stream!r}")
        if prefix_mma is None:
            prefix_mma = GroupedKernelConfig.prefix_mma_for(split_stream, head_dim)
        if prefix_mma not in PREFIX_MMAS:
            raise ValueError(f"prefix_mma must be one of {PREFIX_MMAS}, got {prefix_mma!r}")
        if defer_split_events is None:
            defer_split_events = split_stream == "warp"
        for name, v in (("defer_split_events", defer_split_events), ("direct_single_part", direct_single_part),
                        ("stagger", stagger)):
            if not isinstance(v, bool):
                raise ValueError(f"{name} must be a bool, got {v!r}")
        probe = GroupedKernelConfig(head_dim=head_dim, split_stream=split_stream, prefix_mma=prefix_mma,   # (the checks)
                                    defer_split_events=defer_split_events, direct_single_part=direct_single_part,
                                    warps=warps)
        self.split_stream, self.prefix_mma = split_stream, prefix_mma
        self.defer_split_events, self.direct_single_part, self.warps = defer_split_events, direct_single_part, warps
        self.stagger = stagger
        graph = cascade_decode_graph(num_qo_heads, num_kv_heads, head_dim, page_size, num_levels, _DTYPES[dtype])
        self.num_ctas = (H200_SMS * probe.ctas_per_sm if num_ctas is None
                         else check_positive("num_ctas", num_ctas, 1 << 16))
        self.item_overhead_tokens = check_count("item_overhead_tokens", item_overhead_tokens, 1 << 20)
        self.merge_overhead_tokens = check_count("merge_overhead_tokens", merge_overhead_tokens, 1 << 16)
        self.rows_per_tile = check_positive("rows_per_tile", rows_per_tile, 1 << 10)
        self._setup(graph, device)
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.page_size, self.num_levels, self.dtype = page_size, num_levels, dtype
        self.sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else check_finite("sm_scale", sm_scale)
        self._slice_rows = probe.row_blocks * 16   # a task's query rows at most: the kernel's row blocks
        if self.device.type == "cuda":
            self._require_hopper()
            kc = self.kernel_config = self.lowering.kernel_config(profile=config.profile(), split_stream=split_stream,
                                                                     prefix_mma=prefix_mma,
                                                                     defer_split_events=defer_split_events,
                                                                     direct_single_part=direct_single_part,
                                                                     warps=warps)
            if num_qo_heads // num_kv_heads > self._slice_rows:   # (a task holds whole requests)
                raise ValueError(f"num_qo_heads={num_qo_heads} over num_kv_heads={num_kv_heads}: groups of "
                                 f"{num_qo_heads // num_kv_heads} q heads, but the GPU kernel attends at most "
                                 f"{self._slice_rows} query rows of a kv head at once")
            self.kernel = self._kernels(kc, {kc.entry: (kc.threads, kc.smem_bytes)})[kc.entry]
            self._register_watchdog(kc.name, _describe_task)   # (the kernel never waits: the id names it)

    @property
    def plan_tables(self):
        """The last plan: (batch, the level tables by task name, the `SplitReducePlan`)."""
        if self._planned is None:
            raise RuntimeError("CascadeDecode: call plan() first")
        return self._planned[:3]

    def plan(self, qo_indptr_arr, kv_indptr_arr, kv_indices_arr, kv_last_page_len_arr) -> None:
        """Plan a batch: per level l, qo_indptr_arr[l] [G_l + 1] (requests of each group, ending at the batch
        size B, the same for every level) and the groups' page tables in FlashInfer's layout (int32 CPU
        tensors). A plan() that raises changes nothing. On a GPU the tables go to the device by a copy on the
        current stream: run() (or the graph replay that runs it) belongs on the same stream, as for decode."""
        arrays = {"qo_indptr_arr": qo_indptr_arr, "kv_indptr_arr": kv_indptr_arr, "kv_indices_arr": kv_indices_arr,
                  "kv_last_page_len_arr": kv_last_page_len_arr}
        for name, arr in arrays.items():
            if not isinstance(arr, (list, tuple)) or len(arr) != self.num_levels:
                got = f"{type(arr).__name__} of {len(arr)}" if isinstance(arr, (list, tuple)) else type(arr).__name__
                raise ValueError(f"{name} must be a list of num_levels={self.num_levels} tensors, got {got}")
        tables, batch, top = {}, None, -1
        for lv in range(self.num_levels):
            table, batch, level_top = self._level(lv, batch, *(plain(a[lv]) for a in arrays.values()))
            tables[level_task(lv)], top = table, max(top, level_top)
        order = [tables[t] for t in self.lowering.producers]
        plan = self.lowering.planner(order, batch, self.num_kv_heads, self.num_qo_heads // self.num_kv_heads,
                                     self.page_size, self.num_ctas, self._slice_rows, self.item_overhead_tokens,
                                     self.merge_overhead_tokens, self.rows_per_tile, stagger=self.stagger)
        buf = self._device_tables(plan, order) if self.device.type == "cuda" else None
        self._commit((batch, tables, plan, top), buf)   # (batch, {task: GroupTable}, SplitReducePlan, largest page)

    def _level(self, lv: int, batch: int | None, qo, ip, ix, last) -> tuple[GroupTable, int, int]:
        """Level lv's arguments checked (each problem named by its argument) against the batch of the levels
        before (None: this is the first): its table as the planner reads it, the batch, its largest page."""
        for name, t, meaning in ((f"qo_indptr_arr[{lv}]", qo, "G + 1 offsets"),
                                 (f"kv_indptr_arr[{lv}]", ip, "G + 1 offsets"),
                                 (f"kv_indices_arr[{lv}]", ix, "page indices")):
            expect(name, t, torch.int32, (None,), meaning, _CPU, contiguous=True)
        G = qo.shape[0] - 1
        if G < 0:
            raise ValueError(f"qo_indptr_arr[{lv}] must have G + 1 entries, got an empty tensor")
        if ip.shape[0] != G + 1:
            raise ValueError(f"kv_indptr_arr[{lv}] has {ip.shape[0]} entries, qo_indptr_arr[{lv}] {G + 1}: one "
                             "page table per group")
        expect(f"kv_last_page_len_arr[{lv}]", last, torch.int32, (G,), "one entry per group", _CPU, contiguous=True)
        q, ip, ix, last = qo.numpy().astype(np.int64), ip.numpy(), ix.numpy(), last.numpy()
        if q[0] != 0 or (q[1:] < q[:-1]).any():
            raise ValueError(f"qo_indptr_arr[{lv}] must start at 0 and never decrease, got {q.tolist()}")
        if batch is not None and int(q[-1]) != batch:
            raise ValueError(f"qo_indptr_arr[{lv}][-1]={int(q[-1])}, but level 0 has {batch} requests: every "
                             "level covers the same batch")
        try:
            nnz = check_page_table(ip, last, len(ix), self.page_size)
            ix = ix[:nnz]
            top = max_page(ix)
        except ValueError as e:
            raise ValueError(f"level {lv}: {e}") from None
        return GroupTable(q, ip.astype(np.int64), ix.astype(np.int64), last.astype(np.int64)), int(q[-1]), top

    def _device_tables(self, plan: SplitReducePlan, order: list[GroupTable]) -> _Buffers:
        """The plan written into the kernel's device tables (`_buffers_for`), which are reused while the plan
        fits them, so a CUDA graph captured after one plan() replays any later plan that fits (the batch is read
        from the device, plan_info); a larger plan grows them, and graphs captured before then must be captured
        again. Returns the buffers, for `_commit` (new ones when the plan outgrew the last)."""
        need = _launch_need(plan, order, self.kernel_config.profile)
        buf = self._buffers_for(need)
        buf.image.wait()
        write_launch_tables(buf.host_tables, plan, order)
        buf.image.upload(buf.layout.used(need))
        return buf

    def _make_buffers(self, caps: dict[str, int]) -> _Buffers:
        """Device buffers for plans within `caps`, and the kernel's parameter struct pointing into them."""
        layout = LaunchLayout.of(caps)
        image = StagedImage(self.device, layout.size)
        f32 = dict(dtype=torch.float32, device=self.device)
        scratch = {"counters": torch.zeros(caps["events"], dtype=torch.int32, device=self.device),
                   "part_o": torch.empty(caps["slots"] * self.head_dim, **f32),
                   "part_lse": torch.empty(caps["slots"], **f32)}
        # MELD_PROFILE builds: a record per task and per merging of the events it completed, a CTA
        prof, _ = self._profile_buffers(self.kernel_config.profile, self.num_ctas, caps["records"])
        params = self.lowering.params.ctype(**self._header(prof, None, caps["records"], 1, self.num_ctas),
                                      **{k: v.data_ptr() for k, v in {**layout.views(image.buf), **scratch}.items()},
                                      task_capacity=caps["tasks"], event_capacity=caps["events"],
                                      num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads,
                                      group_size=self.num_qo_heads // self.num_kv_heads, page_size=self.page_size,
                                      sm_scale_log2=self.sm_scale * math.log2(math.e))
        return _Buffers(caps, layout, image, layout.views(image.host), scratch, prof, params)

    _run_inputs, _lse_meaning = ("q", "kv_cache"), "batch, num_qo_heads"

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, *, return_lse: bool = False,
            out: torch.Tensor | None = None, lse: torch.Tensor | None = None):
        """Attention of q [B, num_qo_heads, head_dim] over every level of the planned batch; kv_cache NHD
        [num_pages, 2, page_size, num_kv_heads, head_dim]. Returns out (and lse, natural log, float32). A
        request with no KV tokens at any level gives zeros and lse = -inf."""
        return self._run((q, kv_cache), return_lse, out, lse)

    def _check_run(self, planned: tuple, q: torch.Tensor, kv_cache: torch.Tensor):
        batch, _, _, top = planned
        Hq, Hkv, D, P = self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size
        expect("q", q, self.dtype, (batch, Hq, D), "batch of the last plan(), num_qo_heads, head_dim", self.device)
        expect("kv_cache", kv_cache, self.dtype, (None, 2, P, Hkv, D),
               "num_pages, K/V, page_size, num_kv_heads, head_dim", self.device,
               contiguous=self.device.type == "cuda")
        if top >= kv_cache.shape[0]:
            raise ValueError(f"the last plan() references page {top}, but kv_cache has only {kv_cache.shape[0]} pages")
        return (batch, Hq, D), *self._reads((q, kv_cache))

    def _execute_cpu(self, planned: tuple, q: torch.Tensor, kv_cache: torch.Tensor):
        _, tables, plan, _ = planned
        return self.lowering.executor(self.graph, plan, tables, q, kv_cache, self.sm_scale)

    def _profile_records(self):   # a task's attention as "piece", its events' merging as "merge-hbm", by task
        return None if self._buf is None or self._buf.prof is None else (self._buf.prof, (1, 1), {})

    def _launch(self, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None) -> None:
        params = self._buf.params
        q = q.contiguous() if q.data_ptr() % 16 == 0 else q.clone(memory_format=torch.contiguous_format)
        for name, t in (("kv_cache", kv_cache), ("out", out)):   # (the kernel's 16-byte loads and 8-byte stores)
            if t.data_ptr() % 16:
                raise ValueError(f"{name} must start on a 16-byte boundary, got address {t.data_ptr():#x}")
        params.q, params.kv, params.out = q.data_ptr(), kv_cache.data_ptr(), out.data_ptr()
        params.lse = lse.data_ptr() if lse is not None else 0
        self.kernel.launch(self.num_ctas, params)
