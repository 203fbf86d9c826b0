"""The fused-MoE plan from a routing: rows grouped by expert in token order, row blocks of `block_tokens`
rows, and the gemm1 / gemm2 tiles as rows of meld's one task layout (meld/ir/work_table.py: MOE_TILE) in
ticket order (gemm1 tiles expert by expert, column-major inside an expert; an expert's gemm2 tiles `lag`
tickets after its last gemm1 tile).

The rules have one source, templates/moe_plan.h, compiled into the GPU planner (templates/moe.cuh) and
into the host planner `plan_moe_host` (runtime/host/moe_plan.cpp), which the CPU reference executor runs.
`plan_moe` below is written independently in NumPy: the test oracle both are checked against."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ir.work_table import MOE_TILE

GEMM1, GEMM2 = 0, 1


@dataclass(frozen=True)
class MoeSplit:
    """Split K (MoeKernelConfig.split_k): the main launch's `ctas`, and K per ring stage, of `hidden` (gemm1's K)
    and `inter` (gemm2's K)."""

    ctas: int
    stage_k: int
    hidden: int
    inter: int

    @property
    def stages(self) -> tuple[int, int]:
        """Ring stages of a gemm1 tile and of a gemm2 tile."""
        return -(-self.hidden // self.stage_k), -(-self.inter // self.stage_k)

    def slice_columns(self, gemm: int, s: int, S: int) -> slice:
        """The K columns of slice s of S of a tile of phase `gemm` (templates/moe_plan.h: moe_slice_stages)."""
        n, K = self.stages[gemm], (self.hidden, self.inter)[gemm]
        return slice(n * s // S * self.stage_k, min(K, n * (s + 1) // S * self.stage_k))


@dataclass(frozen=True)
class MoePlan:
    """Rows, row blocks and tiles of one routing.

    expert_off [E + 1]: each expert's first row; pair_pos [T, k]: the row of each (token, choice), -1 for
    an invalid pair; row_token [rows]: the token of each row; row_blocks [nrb, 3]: (expert, first row,
    rows), the items of ROW_BLOCKS; tiles: the MOE_TILE rows in ticket order (field-major, num_tiles rows).
    """

    expert_off: np.ndarray
    pair_pos: np.ndarray
    row_token: np.ndarray
    row_blocks: np.ndarray
    tiles: np.ndarray
    columns: tuple[int, int]   # columns of I per gemm1 tile, of H per gemm2 tile
    split: MoeSplit | None = None

    @property
    def num_tiles(self) -> int:
        return self.tiles.size // MOE_TILE.width

    def tile_columns(self) -> dict[str, np.ndarray]:
        """The tiles' fields by MOE_TILE's names, each [num_tiles] in ticket order."""
        return MOE_TILE.unpack(self.tiles, self.num_tiles)


def _slices(tiles: int, stages: int, ctas: int) -> int:
    """K slices of a phase of `tiles` (the oracle's own statement of templates/moe_plan.h: moe_split)."""
    if tiles == 0 or tiles >= ctas:
        return 1
    return max(1, min(-(-ctas // tiles), stages // 4))   # (MOE_SPLIT_MIN_STAGES stages a slice)


def plan_moe(topk_ids: np.ndarray, num_experts: int, block_tokens: int, n1: int, n2: int, lag: int,
             columns: tuple[int, int] = (128, 256), split: MoeSplit | None = None) -> MoePlan:
    """The test oracle. `topk_ids` [T, k] (int, -1: an invalid pair); n1, n2: column blocks of the gemm1
    and gemm2 tiles, each `columns` wide; `split`: split K's sizes (None: none)."""
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
    s1, s2 = (1, 1) if split is None else (_slices(int(rb_off[-1]) * n, st, split.ctas)
                                           for n, st in zip((n1, n2), split.stages))
    # a tile's slices in adjacent tickets, column-major inside an expert
    g1 = [(GEMM1, rb_off[e] + r, c, s, s1) for e in range(num_experts) for c in range(n1) for s in range(s1)
          for r in range(nrb_e[e])]
    g2 = [[(GEMM2, rb_off[e] + r, c, s, s2) for c in range(n2) for s in range(s2) for r in range(nrb_e[e])]
          for e in range(num_experts)]
    nA = len(g1)
    order, a = [], 0
    for e in range(num_experts):   # each expert's gemm2 tiles go in once `lag` tickets passed its gemm1 end
        due = min(rb_off[e + 1] * n1 * s1 + lag, nA)
        order += g1[a:due]
        a = max(a, due)
        order += g2[e]
    order += g1[a:]
    gemm, rb, col, sl, S = np.array(order, dtype=np.int64).reshape(-1, 5).T
    if split is None:   # (the table's constant fields)
        sl, S = 0, 0
    # A gemm1 tile arrives at its row block's event, a gemm2 tile waits for it; slots derived, CTAs by ticket.
    tiles = MOE_TILE.pack(len(order), row_block=rb, col=col, last_row_block=rb, col_end=col + 1, gemm=gemm,
                          slice=sl, slices=S, arg3=0, kind=MOE_TILE.kind, cta=-1, slot=-1, event_first=rb,
                          event_count=1)
    return MoePlan(expert_off, pair_pos, row_token, row_blocks, tiles, columns, split)


def moe_tile_table(capacity: int) -> np.ndarray:
    """A MOE_TILE table of `capacity` rows with its constant fields written (kind, cta, slot, event_count,
    arg3; slice and slices of a plan without split K): the planners store only the fields that vary (templates/moe_plan.h), so each launch's routing
    writes 6 words a tile, not 13."""
    return MOE_TILE.pack(capacity, row_block=0, col=0, last_row_block=0, col_end=0, gemm=0, slice=0, slices=0, arg3=0,
                         kind=MOE_TILE.kind, cta=-1, slot=-1, event_first=0, event_count=1)


def plan_moe_host(topk_ids: np.ndarray, num_experts: int, block_tokens: int, n1: int, n2: int, lag: int,
                  columns: tuple[int, int] = (128, 256), split: MoeSplit | None = None) -> MoePlan:
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
    tile_cap = cap * (n1 + n2) + (0 if split is None else 2 * split.ctas)
    tiles = moe_tile_table(tile_cap)
    slices = np.ones(2, np.int32)
    ctas, stages = (0, (0, 0)) if split is None else (split.ctas, split.stages)
    nrb = load_moe_plan().meld_moe_plan(
        ids.ctypes.data, T, k, num_experts, block_tokens, n1, n2, lag,
        *(a.ctypes.data for a in (expert_off, pair_pos, row_token, rb_off, row_blocks, tiles)), tile_cap, ctas,
        *stages, slices.ctypes.data)
    n = nrb * (n1 * int(slices[0]) + n2 * int(slices[1]))
    return MoePlan(expert_off, pair_pos, row_token[: expert_off[-1]], row_blocks[:nrb],
                   tiles.reshape(MOE_TILE.width, tile_cap)[:, :n].flatten(), columns, split)
