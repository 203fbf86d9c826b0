"""The fused-MoE plan from a routing: rows grouped by expert in token order, row blocks of `block_tokens`
rows, and the ticket order of the gemm1 / gemm2 tiles (gemm1 tiles expert by expert, column-major inside
an expert; an expert's gemm2 tiles `lag` tickets after its last gemm1 tile).

The rules have one source, templates/moe_plan.h, compiled into the GPU planner (templates/moe.cuh) and
into the host planner `plan_moe_host` (runtime/host/moe_plan.c), which the CPU reference executor runs.
`plan_moe` below is written independently in NumPy: the test oracle both are checked against."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ir.work_table import MOE_TASK

GEMM1, GEMM2 = 0, 1


@dataclass(frozen=True)
class MoePlan:
    """Rows, row blocks and tiles of one routing.

    expert_off [E + 1]: each expert's first row; pair_pos [T, k]: the row of each (token, choice), -1 for
    an invalid pair; row_token [rows]: the token of each row; row_blocks [nrb, 3]: (expert, first row,
    rows); tasks [ntasks, 3]: (kind, row block, column block) in ticket order.
    """

    expert_off: np.ndarray
    pair_pos: np.ndarray
    row_token: np.ndarray
    row_blocks: np.ndarray
    tasks: np.ndarray
    columns: tuple[int, int]   # columns of I per gemm1 tile, of H per gemm2 tile

    @property
    def packed_tasks(self) -> np.ndarray:
        """The tasks as the GPU planner writes them (meld/ir/work_table.py: MOE_TASK)."""
        return MOE_TASK.pack(kind=self.tasks[:, 0], row_block=self.tasks[:, 1], col=self.tasks[:, 2])


def plan_moe(topk_ids: np.ndarray, num_experts: int, block_tokens: int, n1: int, n2: int, lag: int,
             columns: tuple[int, int] = (128, 256)) -> MoePlan:
    """The test oracle. `topk_ids` [T, k] (int, -1: an invalid pair); n1, n2: column blocks of the gemm1
    and gemm2 tiles, each `columns` wide."""
    ids = np.asarray(topk_ids, dtype=np.int64)
    T, k = ids.shape
    valid = ids >= 0
    counts = np.bincount(ids[valid], minlength=num_experts)
    expert_off = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    pair_pos = np.full((T, k), -1, dtype=np.int64)
    row_token = np.zeros(int(expert_off[-1]), dtype=np.int64)
    # rows of an expert in token order (a token routes to an expert at most once)
    t_idx, j_idx = np.nonzero(valid)
    order = np.lexsort((t_idx, ids[t_idx, j_idx]))
    t_idx, j_idx = t_idx[order], j_idx[order]
    rows = np.arange(len(t_idx))
    pair_pos[t_idx, j_idx] = rows
    row_token[rows] = t_idx
    nrb_e = -(-counts // block_tokens)
    rb_off = np.concatenate([[0], np.cumsum(nrb_e)]).astype(np.int64)
    blocks = [(e, expert_off[e] + r * block_tokens, min(block_tokens, counts[e] - r * block_tokens))
              for e in range(num_experts) for r in range(nrb_e[e])]
    row_blocks = np.array(blocks, dtype=np.int64).reshape(-1, 3)
    g1 = [(GEMM1, rb_off[e] + r, c) for e in range(num_experts) for c in range(n1) for r in range(nrb_e[e])]
    g2 = [[(GEMM2, rb_off[e] + r, c) for c in range(n2) for r in range(nrb_e[e])] for e in range(num_experts)]
    nA = len(g1)
    tasks, a = [], 0
    for e in range(num_experts):   # each expert's gemm2 tiles go in once `lag` tickets passed its gemm1 end
        due = min(rb_off[e + 1] * n1 + lag, nA)
        tasks += g1[a:due]
        a = max(a, due)
        tasks += g2[e]
    tasks += g1[a:]
    return MoePlan(expert_off, pair_pos, row_token, row_blocks, np.array(tasks, dtype=np.int64).reshape(-1, 3),
                   columns)


def plan_moe_host(topk_ids: np.ndarray, num_experts: int, block_tokens: int, n1: int, n2: int, lag: int,
                  columns: tuple[int, int] = (128, 256)) -> MoePlan:
    """The plan from the host build of the GPU planner's rules (same arguments as `plan_moe`)."""
    from ..runtime.host_helper import load_moe_plan

    ids = np.ascontiguousarray(topk_ids, dtype=np.int64)
    T, k = ids.shape
    cap = num_experts + T * k // block_tokens + 1
    expert_off = np.zeros(num_experts + 1, np.int64)
    pair_pos = np.zeros((T, k), np.int64)
    row_token = np.zeros(max(T * k, 1), np.int64)
    rb_off = np.zeros(num_experts + 1, np.int32)
    row_blocks = np.zeros((cap, 3), np.int64)
    tasks = np.zeros((cap * (n1 + n2), 3), np.int64)
    nrb = load_moe_plan().meld_moe_plan(
        ids.ctypes.data, T, k, num_experts, block_tokens, n1, n2, lag,
        *(a.ctypes.data for a in (expert_off, pair_pos, row_token, rb_off, row_blocks, tasks)))
    return MoePlan(expert_off, pair_pos, row_token[: expert_off[-1]], row_blocks[:nrb], tasks[: nrb * (n1 + n2)],
                   columns)
