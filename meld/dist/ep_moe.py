"""Expert-parallel MoE over emulated ranks: dispatch, expert FFNs and combine as one protocol (the GPU
kernel is not written yet).

Every rank holds its own tokens and their routing; the experts are split into contiguous blocks, one per
rank. Dispatch: each (token, choice) row is put into its expert's rank, with its expert id and weight
(the routing travels with the row), and after its rows to a rank a source counts itself there (the count
lands behind the rows: one fence per destination). An expert rank serves each source as soon as that
source's count is in, without waiting for the others: its FFN rows for that source start while other
sources' rows are still in flight. Combine: each weighted expert output is one part of its token's result,
reduced at the token's rank by the last arriving part, in choice order (`LastArriverReduce`), so the
result does not depend on which expert rank finishes first.
"""
from __future__ import annotations

import functools
import time

import numpy as np

from .reduce import LastArriverReduce, run_ranks


def expert_owner(num_experts: int, world: int) -> np.ndarray:
    """The rank of each expert: contiguous blocks, as even as they come."""
    return np.arange(num_experts) * world // num_experts


def expert_ffn(x: np.ndarray, w13: np.ndarray, w2: np.ndarray, e: int) -> np.ndarray:
    """SiLU(gate) * up, then down, for one row through expert e (float64; w13 [E, 2I, H], w2 [E, H, I])."""
    inter = w2.shape[2]
    g, u = w13[e, :inter] @ x, w13[e, inter:] @ x
    return w2[e] @ (g / (1 + np.exp(-g)) * u)


def expert_parallel_moe(transport, xs: list[np.ndarray], topk_ids: list[np.ndarray], topk_w: list[np.ndarray],
                        w13: np.ndarray, w2: np.ndarray, poll_s: float = 1e-4) -> list[np.ndarray]:
    """Rank r's tokens xs[r] [T_r, H] routed to topk_ids[r] [T_r, k] with weights topk_w[r]; returns every
    rank's output [T_r, H] (module docstring)."""
    world = transport.world
    hidden = w13.shape[2]
    owner = expert_owner(w13.shape[0], world)
    t_max = max(1, max(len(x) for x in xs))
    k = topk_ids[0].shape[1]
    transport.window("moe.rows", (world, t_max, k, hidden + 2), np.float64, np.nan)   # row, expert, weight
    transport.window("moe.sent", (world,), np.int64, 0)
    combine = LastArriverReduce("moe.y", lambda parts: functools.reduce(np.add, parts))   # choice order
    out = combine.windows(transport, world * t_max, k, (hidden,))

    def rank_main(r: int) -> None:
        x, ids, wts = xs[r], topk_ids[r], topk_w[r]
        for t in range(len(x)):
            for j in range(k):
                e = int(ids[t, j])
                transport.put(r, int(owner[e]), "moe.rows", (r, t, j), np.r_[x[t], e, wts[t, j]])
        for d in range(world):
            transport.fetch_add(r, d, "moe.sent", r, 1)   # behind every row to d
        waiting = set(range(world))
        while waiting:                                      # serve each source once its rows are all in
            ready = [s for s in waiting if int(transport.get(r, r, "moe.sent", s)) == 1]
            if not ready:
                time.sleep(poll_s)
            for s in ready:
                waiting.remove(s)
                rows = transport.get(r, r, "moe.rows", s)
                expert = rows[:, :, hidden]   # NaN: no row in that slot
                mine = ~np.isnan(expert)
                mine[mine] = owner[expert[mine].astype(np.int64)] == r   # (this rank's puts staged in its own window)
                for t, j in zip(*np.nonzero(mine)):
                    row = rows[t, j]
                    y = row[hidden + 1] * expert_ffn(row[:hidden], w13, w2, int(row[hidden]))
                    combine.contribute(transport, r, s, s * t_max + int(t), int(j), k, y, to=[s])
        transport.quiet(r)

    run_ranks(world, rank_main)
    return [out[r][r * t_max:r * t_max + len(xs[r])] for r in range(world)]


def single_rank_reference(x: np.ndarray, ids: np.ndarray, wts: np.ndarray, w13: np.ndarray, w2: np.ndarray) -> np.ndarray:
    """The same MoE on one rank, each token's weighted expert outputs added in choice order."""
    out = np.zeros((len(x), w2.shape[1]))
    for t in range(len(x)):
        out[t] = functools.reduce(np.add, [wts[t, j] * expert_ffn(x[t], w13, w2, int(ids[t, j])) for j in range(ids.shape[1])])
    return out
