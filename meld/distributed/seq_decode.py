"""Sequence-parallel decode attention over emulated ranks: each rank computes its parts of the batch (a
`ShardPlan`, run as a `RankedSchedule`) with the CPU reference executor, puts each part's partial output
and log-sum-exp into the owner rank's window and counts it there with a fetch-add; the part whose
fetch-add completes its request's count merges the request's partials, in part order, and puts the result
into every rank's output window (`LastArriverReduce`), as the GPU kernel does. No all-gather, no separate
merge step, and a result that does not depend on the order in which the parts land.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ..ir.ranked import RankedSchedule
from ..ops.checks import grad_inputs, no_backward, plain
from ..runtime.reference import execute_decode, merge_partials
from .reduce import LastArriverReduce, run_ranks
from .shard import ShardPlan


def ranked_decode_schedule(plan: ShardPlan, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, num_qo_heads: int,
                           num_kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype = torch.bfloat16,
                           ) -> tuple[RankedSchedule, list[torch.Tensor]]:
    """`plan` as a `RankedSchedule` (each rank's parts planned as a batch of their own, as on the GPU) and
    each rank's local page indices."""
    import meld

    schedules, keys, parts, indices = [], [], [], []
    for r in range(plan.world):
        idx, ip, ind, last = plan.local_tables(r, kv_indptr.numpy(), kv_indices.numpy(), page_size)
        attn = meld.DecodeAttention(num_qo_heads, num_kv_heads, head_dim, page_size, dtype, "cpu")
        attn.plan(torch.from_numpy(ip), torch.from_numpy(ind), torch.from_numpy(last))
        schedules.append(attn.schedule)
        keys.append(plan.req[idx].astype(np.int32))
        parts.append(plan.part[idx].astype(np.int32))
        indices.append(torch.from_numpy(ind))
    return RankedSchedule(plan.world, schedules, keys, parts, len(plan.kv_len)).validate(), indices


def rank_partials(rs: RankedSchedule, indices: list[torch.Tensor], rank: int, q: torch.Tensor, kv_cache: torch.Tensor,
                  sm_scale: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(o [n, Hq, D], lse [n, Hq]) in float64 of rank `rank`'s n local items, by the CPU reference executor
    (NumPy arrays: q and kv_cache are read as plain tensors)."""
    q, kv_cache = plain(q), plain(kv_cache)
    B, Hq, D = q.shape
    key = rs.key[rank]
    if not len(key):
        return np.zeros((0, Hq, D)), np.zeros((0, Hq))
    scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    o, lse = execute_decode(rs.schedules[rank], q[torch.from_numpy(key).long()], kv_cache[:, 0], kv_cache[:, 1],
                            indices[rank], scale)
    return o.numpy(), lse.numpy()


def _merge_packed(parts: np.ndarray) -> np.ndarray:
    """Parts packed as [n, Hq, D + 1] (the output rows, then the lse) -> the merged [Hq, D + 1]."""
    o, lse = merge_partials(parts[:, :, -1], parts[:, :, :-1])
    return np.concatenate([o, lse[:, None]], axis=1)


def seq_parallel_decode(plan: ShardPlan, transport, q: torch.Tensor, kv_cache: torch.Tensor, kv_indptr: torch.Tensor,
                        kv_indices: torch.Tensor, sm_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run `plan` with one thread per rank over `transport`; the merged result goes to every rank's output
    window, as the GPU kernel's does. Returns (out [B, Hq, D], lse [B, Hq]) float64 from rank 0's window;
    ValueError if any rank's differs. Inputs that require grad give outputs whose backward raises
    NotImplementedError (meld has none)."""
    grads = grad_inputs(q, kv_cache)
    q, kv_cache = plain(q), plain(kv_cache)
    B, Hq, D = q.shape
    rs, indices = ranked_decode_schedule(plan, kv_indptr, kv_indices, Hq, kv_cache.shape[3], D, kv_cache.shape[2],
                                         q.dtype)
    owner, n = rs.owner(), rs.parts_of()
    reduce = LastArriverReduce("attn", _merge_packed)
    out_w = reduce.windows(transport, B, int(n.max(initial=1)), (Hq, D + 1))

    def rank_main(r: int) -> None:
        o, lse = rank_partials(rs, indices, r, q, kv_cache, sm_scale)
        for i, (b, p) in enumerate(zip(rs.key[r].tolist(), rs.part[r].tolist())):
            reduce.contribute(transport, r, int(owner[b]), b, p, int(n[b]),
                              np.concatenate([o[i], lse[i][:, None]], axis=1), to=range(plan.world))
        transport.quiet(r)

    run_ranks(plan.world, rank_main)
    res = out_w[0][:B]
    for r in range(1, plan.world):
        if not np.array_equal(out_w[r][:B], res, equal_nan=True):
            raise ValueError(f"rank {r}'s output window differs from rank 0's")
    return no_backward("meld.distributed.seq_parallel_decode", grads,
                       (torch.from_numpy(res[:, :, :D].copy()), torch.from_numpy(res[:, :, D].copy())))
