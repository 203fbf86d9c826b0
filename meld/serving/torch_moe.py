"""The unfused torch MoE: BENCH.md's peer for meld's fused MoE (bench/moe.py) and the MoE of the serving
loop's non-meld backends. Softmax top-k routing -> the (token, expert) pairs sorted by expert -> grouped
GEMM gate/up -> SiLU(gate) * up -> grouped GEMM down -> weighted index_add_ in float32. No host
synchronisation on the GPU, so it is CUDA-graph capturable.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def topk_route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing: (weights [T, k] float32, expert ids [T, k] int64)."""
    weights, ids = torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_mm_loop(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """What grouped_mm computes, one matmul per group (reads offs on the host: for the CPU only)."""
    out = a.new_empty(a.shape[0], b.shape[-1])
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = a[start:end] @ b[g]
        start = end
    return out


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """out[offs[g-1]:offs[g]] = a[offs[g-1]:offs[g]] @ b[g]; a [M, K], b [G, K, N], offs [G] int32 cumulative.

    torch's grouped GEMM on the GPU (`F.grouped_mm`, else `torch._grouped_mm`); on the CPU it too where this
    torch has it for the dtype, else a per-group loop."""
    if a.is_cuda:
        if GROUPED_MM is None:
            raise RuntimeError(f"torch {torch.__version__} has neither F.grouped_mm nor torch._grouped_mm")
        return GROUPED_MM(a, b, offs=offs)
    if GROUPED_MM is not None:
        try:
            return GROUPED_MM(a, b, offs=offs)
        except (RuntimeError, NotImplementedError):
            pass
    return grouped_mm_loop(a, b, offs)


def torch_grouped_mm_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, logits: torch.Tensor, top_k: int,
                         renormalize: bool = True,
                         mm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = grouped_mm,
                         routing: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The BENCH.md MoE peer: an unfused torch pipeline, launch-only on the GPU (no host sync: capturable).

    Args:
        x: [T, H] tokens; w13: [E, 2I, H] gate rows then up rows; w2: [E, H, I]; logits: [T, E] router logits.
        top_k: experts per token; renormalize: divide the k softmax weights by their sum.
        mm: the grouped GEMM (`grouped_mm`; `grouped_mm_loop` to force the loop on the CPU).
        routing: (weights [T, k] float32, expert ids [T, k] int64) to use instead of routing `logits`.
    Returns:
        [T, H] in x's dtype: Σ_j w_j · (SiLU(x·gate_j) ⊙ (x·up_j)) · down_j over the token's k experts.

    Example:
        >>> out = torch_grouped_mm_moe(x, w13, w2, logits, top_k=8)   # doctest: +SKIP
    """
    T, H = x.shape
    E, I = w13.shape[0], w2.shape[-1]
    weights, ids = routing if routing is not None else topk_route(logits, top_k, renormalize)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)  # the T*k (token, expert) pairs grouped by expert
    token = order // top_k
    counts = torch.zeros(E, dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))  # not bincount: that syncs with the host on CUDA
    offs = counts.cumsum(0, dtype=torch.int32)
    gate_up = mm(x[token], w13.transpose(1, 2), offs)  # [T*k, 2I]
    h = F.silu(gate_up[:, :I]) * gate_up[:, I:]
    y = mm(h, w2.transpose(1, 2), offs)  # [T*k, H]
    y = y.float() * weights.flatten()[order, None]
    return torch.zeros(T, H, dtype=torch.float32, device=x.device).index_add_(0, token, y).to(x.dtype)
