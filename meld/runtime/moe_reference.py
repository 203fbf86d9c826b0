"""The CPU reference executor of the fused MoE: it runs a `MoePlan`'s tiles in ticket order, in float64,
rounding act and y to the activation dtype where the kernel stores them, and forms each token's output
when its last row arrives — the kernel's schedule and its numerics, without a GPU."""
from __future__ import annotations

import numpy as np
import torch

from ..ir import COMBINERS
from ..scheduler.moe_plan import GEMM1, MoePlan


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts in float32, the top_k largest (NaN first, then smaller ids on ties), weights
    optionally renormalised to sum 1: (ids int64 [T, k], weights float32 [T, k])."""
    lg = logits.float()
    probs = torch.softmax(lg, dim=-1)
    rank = torch.where(lg.isnan(), torch.full_like(lg, float("inf")), lg)
    ids = torch.sort(rank, dim=-1, descending=True, stable=True).indices[:, :top_k]
    w = probs.gather(1, ids)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return ids, w


def _round(a: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    return torch.from_numpy(a).to(dtype).to(torch.float64).numpy()


def execute_moe(plan: MoePlan, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_w: torch.Tensor,
                combiner: str = "weighted_sum") -> torch.Tensor:
    """out [T, H] (x's dtype) from the plan (its routing already validated: every pair has a row);
    `combiner`: the graph's reduction, whose merge folds a token's weighted rows in fixed order."""
    merge = COMBINERS[combiner].merge
    dt = x.dtype
    xd, w13d, w2d = (t.double().numpy() for t in (x, w13, w2))
    wd = topk_w.double().numpy()
    T, H = xd.shape
    I = w2d.shape[2]
    nrows = len(plan.row_token)
    xs = xd[plan.row_token] if nrows else np.zeros((0, H))
    act, y = np.zeros((nrows, I)), np.zeros((nrows, H))
    G1_COLS, G2_COLS = plan.columns
    n2 = -(-H // G2_COLS)
    need = (plan.pair_pos >= 0).sum(axis=1)
    count = np.zeros((T, n2), dtype=np.int64)
    out = np.full((T, H), np.nan)
    for kind, rb, c in plan.tasks:
        e, r0, n = plan.row_blocks[rb]
        rows = slice(r0, r0 + n)
        if kind == GEMM1:
            cols = slice(c * G1_COLS, min(I, (c + 1) * G1_COLS))
            g = xs[rows] @ w13d[e, cols].T
            u = xs[rows] @ w13d[e, I + cols.start:I + cols.stop].T
            act[rows, cols] = _round(g / (1 + np.exp(-g)) * u, dt)
            continue
        cols = slice(c * G2_COLS, min(H, (c + 1) * G2_COLS))
        y[rows, cols] = _round(act[rows] @ w2d[e, cols].T, dt)
        for t in plan.row_token[rows]:
            count[t, c] += 1
            if count[t, c] == need[t]:   # the token's last row for this column block: combine
                acc = np.zeros(cols.stop - cols.start)
                for j, pos in enumerate(plan.pair_pos[t]):
                    (acc,) = merge(acc, wd[t, j] * y[pos, cols])
                out[t, cols] = acc
    return torch.from_numpy(out).to(dt)
