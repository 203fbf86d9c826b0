"""Sequence-parallel decode attention over emulated ranks: each rank computes its parts of the batch (a
`ShardPlan`) with the CPU reference executor, puts each part's partial output and log-sum-exp into the
owner rank's windows and counts it there with a fetch-add; the part whose fetch-add completes its
request's count merges the request's partials, in part order, and puts the result into the owner's
output window. No all-gather, no separate merge step, and a result that does not depend on the order
in which the parts land.
"""
from __future__ import annotations

import threading

import numpy as np
import torch

from ..runtime.reference import execute_decode, merge_partials
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


def seq_parallel_decode(plan: ShardPlan, transport, q: torch.Tensor, kv_cache: torch.Tensor, kv_indptr: torch.Tensor,
                        kv_indices: torch.Tensor, sm_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run `plan` with one thread per rank over `transport`; returns (out [B, Hq, D], lse [B, Hq]) float64,
    gathered from the owners' output windows."""
    B, Hq, D = q.shape
    most = int(plan.num_parts.max(initial=1))
    transport.window("part_o", (B, most, Hq, D), np.float64, np.nan)
    transport.window("part_lse", (B, most, Hq), np.float64, np.nan)
    transport.window("arrived", (B,), np.int64, 0)
    out_w = transport.window("out", (B, Hq, D), np.float64, np.nan)
    lse_w = transport.window("lse", (B, Hq), np.float64, np.nan)
    errors: list[BaseException] = []

    def rank_main(r: int) -> None:
        try:
            o, lse = rank_partials(plan, r, q, kv_cache, kv_indptr, kv_indices, sm_scale)
            for k, i in enumerate(plan.on(r)):
                b, p = int(plan.req[i]), int(plan.part[i])
                owner, n = int(plan.owner[b]), int(plan.num_parts[b])
                transport.put(r, owner, "part_o", (b, p), o[k])
                transport.put(r, owner, "part_lse", (b, p), lse[k])
                if transport.fetch_add(r, owner, "arrived", b, 1) == n - 1:   # the last part to land merges
                    mo, ml = merge_partials(transport.get(r, owner, "part_lse", b)[:n],
                                            transport.get(r, owner, "part_o", b)[:n])
                    transport.put(r, owner, "out", b, mo)
                    transport.put(r, owner, "lse", b, ml)
            transport.quiet(r)
        except BaseException as e:   # noqa: BLE001 - reported to the caller below
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(r,), name=f"meld-rank-{r}") for r in range(plan.world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    out = np.stack([out_w[plan.owner[b]][b] for b in range(B)]) if B else np.zeros((0, Hq, D))
    lse = np.stack([lse_w[plan.owner[b]][b] for b in range(B)]) if B else np.zeros((0, Hq))
    return torch.from_numpy(out), torch.from_numpy(lse)
