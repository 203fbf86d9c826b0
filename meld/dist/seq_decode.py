"""Sequence-parallel decode attention over emulated ranks: each rank computes its parts of the batch (a
`ShardPlan`) with the CPU reference executor, puts each part's partial output and log-sum-exp into the
owner rank's window and counts it there with a fetch-add; the part whose fetch-add completes its
request's count merges the request's partials, in part order, and puts the result into the owner's
output window (`LastArriverReduce`). No all-gather, no separate merge step, and a result that does not depend on the order
in which the parts land.
"""
from __future__ import annotations

import numpy as np
import torch

from ..runtime.reference import execute_decode, merge_partials
from .reduce import LastArriverReduce, run_ranks
from .shard import ShardPlan


def rank_partials(plan: ShardPlan, rank: int, q: torch.Tensor, kv_cache: torch.Tensor, kv_indptr: torch.Tensor,
                  kv_indices: torch.Tensor, sm_scale: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(o [n, Hq, D], lse [n, Hq]) in float64 of rank `rank`'s n parts, each planned as a request of its own
    (its token range's pages) and run by the CPU reference executor."""
    import meld

    B, Hq, D = q.shape
    P, Hkv = kv_cache.shape[2], kv_cache.shape[3]
    idx, indptr, indices, last = plan.local_tables(rank, kv_indptr.numpy(), kv_indices.numpy(), P)
    if not len(idx):
        return np.zeros((0, Hq, D)), np.zeros((0, Hq))
    local_indices = torch.from_numpy(indices)
    attn = meld.DecodeAttention(Hq, Hkv, D, P, q.dtype, "cpu", sm_scale=sm_scale)
    attn.plan(torch.from_numpy(indptr), local_indices, torch.from_numpy(last))
    o, lse = execute_decode(attn.schedule, q[torch.from_numpy(plan.req[idx])], kv_cache, local_indices, attn.sm_scale)
    return o.numpy(), lse.numpy()


def _merge_packed(parts: np.ndarray) -> np.ndarray:
    """Parts packed as [n, Hq, D + 1] (the output rows, then the lse) -> the merged [Hq, D + 1]."""
    o, lse = merge_partials(parts[:, :, -1], parts[:, :, :-1])
    return np.concatenate([o, lse[:, None]], axis=1)


def seq_parallel_decode(plan: ShardPlan, transport, q: torch.Tensor, kv_cache: torch.Tensor, kv_indptr: torch.Tensor,
                        kv_indices: torch.Tensor, sm_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run `plan` with one thread per rank over `transport`; returns (out [B, Hq, D], lse [B, Hq]) float64,
    gathered from the owners' output windows."""
    B, Hq, D = q.shape
    reduce = LastArriverReduce("attn", _merge_packed)
    out_w = reduce.windows(transport, B, int(plan.num_parts.max(initial=1)), (Hq, D + 1))

    def rank_main(r: int) -> None:
        o, lse = rank_partials(plan, r, q, kv_cache, kv_indptr, kv_indices, sm_scale)
        for k, i in enumerate(plan.on(r)):
            b = int(plan.req[i])
            owner = int(plan.owner[b])
            reduce.contribute(transport, r, owner, b, int(plan.part[i]), int(plan.num_parts[b]),
                              np.concatenate([o[k], lse[k][:, None]], axis=1), to=[owner])
        transport.quiet(r)

    run_ranks(plan.world, rank_main)
    res = np.stack([out_w[plan.owner[b]][b] for b in range(B)]) if B else np.zeros((0, Hq, D + 1))
    return torch.from_numpy(res[:, :, :D].copy()), torch.from_numpy(res[:, :, D].copy())
