"""The decode planner on the host: the GPU planner's own source (templates/decode_plan.h) compiled for a
block of one thread (meld/runtime/host_helper.py), so the CPU reference executor and
`DecodeAttention.schedule` get the tables the GPU planner writes by construction. `plan_decode` (NumPy)
is their test oracle.

Where no C++ compiler works it raises RuntimeError, as the MoE's host planner does, rather than fall
back to the oracle: the CPU executor would then run a planner the GPU does not, the drift this module
removes.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..codegen.decode_kernel import DecodePlanKernelConfig
from ..codegen.params import PLAN_PARAMS
from ..ir import CTA_FIELDS, Schedule
from ..runtime.host_helper import load_decode_plan
from .cost_model import DecodeCost
from .topology import Topology, cluster_rows


def plan_params(cost: DecodeCost, page_size: int, units_per_request: int, num_ctas: int, chunk: int,
                token_requests: int = 1, head_major: bool = False, **buffers: int) -> ctypes.Structure:
    """The planner's `PlanParams` on either side: the cost model, the shape, the unit order (`head_major`:
    templates/decode_plan.h), and `buffers` (the addresses, `batch`, and the GPU's done-flag fields)."""
    if head_major and chunk:
        raise ValueError("head_major plans cut no chunks: a batch-invariant plan numbers its slots request by request")
    return PLAN_PARAMS.pack(page_size=page_size, units_per_request=units_per_request, num_ctas=num_ctas,
                            item_overhead=cost.item_overhead_tokens, min_split=cost.min_split_tokens,
                            tile=cost.tile_tokens, round=cost.round_tokens, min_cta_tokens=cost.min_cta_tokens,
                            cluster_snap=cost.cluster_snap_tokens, chunk=chunk, token_requests=token_requests,
                            head_major=int(head_major), **buffers)


@dataclass(frozen=True)
class HostTables:
    """What the planner writes (the GPU planner's CTA 0 writes the same into the work tables), and what
    it decided besides."""

    cta: np.ndarray          # int32 [len(CTA_FIELDS), num_ctas]
    kv_len: np.ndarray       # int32 [B * token_requests] (of the planned requests)
    page_base: np.ndarray    # int32 [B * token_requests]
    slot_base: np.ndarray    # int32 [B * token_requests]: first partial slots (batch-invariant plans; else 0)
    active_ctas: int
    cluster_snap: int        # tokens per CTA a cut between clusters may move (0: one level; chunk plans ignore it)


def plan_tables_host(kv_indptr: np.ndarray, last_page_len: np.ndarray, page_size: int, units_per_request: int,
                     topology: Topology, cost: DecodeCost, clusters: Sequence[tuple[int, int]] = (),
                     chunk_tokens: int = 0, token_requests: int = 1, head_major: bool = False) -> HostTables:
    """Run the planner on a raw page table (kv_indptr [B + 1], kv_last_page_len [B], already validated:
    meld.ops.page_table). Arguments otherwise as `plan_decode_host`."""
    W, limit = topology.num_ctas, DecodePlanKernelConfig().max_ctas
    if W > limit:
        raise ValueError(f"topology={topology}: {W} CTA slots, but the planner serves grids of at most {limit} CTAs "
                         "(its per-CTA scratch must fit one CTA's shared memory)")
    if clusters and sum(size * n for size, n in clusters) != W:
        raise ValueError(f"clusters {list(clusters)} cover {sum(s * n for s, n in clusters)} CTAs, the grid has {W}")
    indptr = np.ascontiguousarray(kv_indptr, dtype=np.int32)
    last = np.ascontiguousarray(last_page_len, dtype=np.int32)
    B = len(indptr) - 1
    if B < 0 or last.shape != (B,):
        raise ValueError(f"kv_indptr has {len(indptr)} entries and kv_last_page_len {len(last)}: expected B + 1 and B")
    kv_len, page_base, slot_base = np.zeros((3, B * token_requests), dtype=np.int32)
    cta = np.zeros((len(CTA_FIELDS), W), dtype=np.int32)
    line = np.zeros(B * token_requests * (units_per_request if head_major else 1) + 1, dtype=np.int64)
    rows = cluster_rows(clusters) if any(size > 1 for size, _ in clusters) else None
    p = plan_params(cost, page_size, units_per_request, W, chunk_tokens, token_requests, head_major, batch=B,
                    kv_indptr=indptr.ctypes.data,
                    last_page_len=last.ctypes.data, kv_len=kv_len.ctypes.data, page_base=page_base.ctypes.data,
                    cta_table=cta.ctypes.data, line=line.ctypes.data, slot_base=slot_base.ctypes.data,
                    cluster_rows=rows.ctypes.data if rows is not None else 0, src_indices=0, dst_indices=0,
                    done_flag=0, arrive=0, done_seq=0)
    decided = (ctypes.c_int * 2)()
    load_decode_plan().meld_decode_plan_host(ctypes.byref(p), decided)
    return HostTables(cta, kv_len, page_base, slot_base, decided[0], decided[1])


def plan_decode_host(kv_indptr: np.ndarray, last_page_len: np.ndarray, page_size: int, num_kv_heads: int,
                     group_size: int, topology: Topology, cost: DecodeCost = DecodeCost(), heads_per_item: int = 8,
                     clusters: Sequence[tuple[int, int]] = (), chunk_tokens: int = 0, token_requests: int = 1,
                     head_major: bool = False) -> Schedule:
    """The `Schedule` of one batch from its raw page table, as the GPU planner makes it: the same
    arguments as `plan_decode`, but the page table (kv_indptr, kv_last_page_len, page_size) in place of
    kv_len and page_base. The page table is validated (meld.ops.page_table: a ValueError naming the entry).
    token_requests n > 1 plans request b as requests b * n + t of n - 1 - t keys fewer (its new token t, as
    the planner built with token requests does: DecodeMLA's multi-token decode). head_major orders the units head
    block by head block (templates/decode_plan.h; the Schedule's `head_major`)."""
    from ..ops.checks import check_positive, is_int
    from ..ops.page_table import check_page_table
    from .decode_plan import check_plan_shape

    check_plan_shape(num_kv_heads, group_size, heads_per_item)
    page_size = check_positive("page_size", page_size)
    indptr, last = np.asarray(kv_indptr), np.asarray(last_page_len)
    for name, a in (("kv_indptr", indptr), ("kv_last_page_len", last)):
        if a.ndim != 1 or not (a.dtype.kind in "iu" or a.size == 0) or (
                a.size and not -2 ** 31 <= a.min() <= a.max() < 2 ** 31):
            raise ValueError(f"{name} must be a 1-D array of int32 values, got {a!r:.120}")
    if len(indptr) < 1 or last.shape != (len(indptr) - 1,):
        raise ValueError(f"kv_indptr has {len(indptr)} entries and kv_last_page_len {len(last)}: expected B + 1 and B")
    check_page_table(indptr.astype(np.int32), last.astype(np.int32), int(indptr[-1]), page_size)
    units = num_kv_heads * -(-group_size // heads_per_item)
    if not is_int(token_requests) or token_requests < 1:
        raise ValueError(f"token_requests must be an int >= 1, got {token_requests!r}")
    t = plan_tables_host(kv_indptr, last_page_len, page_size, units, topology, cost, clusters, chunk_tokens,
                         int(token_requests), head_major)
    meta = {"active_ctas": t.active_ctas, "item_overhead_tokens": cost.item_overhead_tokens}
    meta.update({"chunk_tokens": chunk_tokens} if chunk_tokens else {"cluster_snap_tokens": t.cluster_snap})
    return Schedule(num_kv_heads, group_size, heads_per_item, t.kv_len, t.page_base, t.cta, meta, chunk_tokens,
                    head_major)
