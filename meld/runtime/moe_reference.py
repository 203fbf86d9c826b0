"""The CPU reference executor of the fused MoE: it walks a `MoePlan`'s tile rows (meld/ir/work_table.py:
MOE_TILE) in ticket order, in float64, rounding act and y to the activation dtype where the kernel stores
them, counting each row block's event as the kernel's gemm1 tiles do and checking that a gemm2 tile finds
it complete, and forms each token's output when its last row arrives — the kernel's schedule and its
numerics, without a GPU. Split K: a tile's slices' sums are added, in slice order, by its last slice.

Block-scaled FP8 (DeepSeek-V3's format; templates/moe.cuh, MELD_FP8): e4m3 weights with a float32 scale per
128 x 128 block, and activations (x, and act before the down projection) quantised per token per 128 channels
as the kernel quantises them (`quantize_groups`)."""
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


GROUP = 128               # channels per activation scale; rows and K of a weight scale's block
E4M3_MAX = 448.0          # the largest e4m3 value
FP8_MIN_AMAX = 1e-10      # an all-zero group's maximum is taken as this (templates/moe.cuh: FP8_MIN_AMAX)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _scale(amax: torch.Tensor) -> torch.Tensor:
    """float32 scales of groups whose maximum magnitude is `amax`: amax / 448 as one IEEE division (the kernel's
    div.rn.f32), NaN where amax is. The divisor is a tensor: torch on CUDA divides by a Python number as a
    multiply by its float32 reciprocal, one bit off the quotient for most maxima, and bf16 rows often land
    exactly on an e4m3 rounding tie, where a scale one bit off moves the code a whole step."""
    return torch.where(amax.isnan(), amax, amax.clamp_min(FP8_MIN_AMAX) / torch.full_like(amax, E4M3_MAX))


def quantize_groups(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a [rows, K] quantised per row per 128 columns as the kernel does it, in float32, the same bits on any
    device: scale = max |v| / 448 (`_scale`), e4m3 = v * (1 / scale) rounded to nearest, saturated at 448:
    (e4m3 [rows, K], scales float32 [rows, ceil(K / 128)])."""
    rows, K = a.shape
    G = _cdiv(K, GROUP)
    g = torch.nn.functional.pad(a.float(), (0, G * GROUP - K)).view(rows, G, GROUP)
    scale = _scale(g.abs().amax(dim=-1))
    q = (g * (1 / scale)[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(rows, G * GROUP)[:, :K], scale


def dequantize_groups(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float64 [rows, K] of quantize_groups' output."""
    K = q.shape[1]
    return q.double() * scale.double().repeat_interleave(GROUP, dim=1)[:, :K]


def dequantize_blocks(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float64 [E, N, K] of e4m3 weights w [E, N, K] with a scale per 128 x 128 block, scale [E, ceil(N / 128),
    ceil(K / 128)]."""
    N, K = w.shape[1:]
    return w.double() * scale.double().repeat_interleave(GROUP, 1)[:, :N].repeat_interleave(GROUP, 2)[:, :, :K]


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights w [E, N, K] as block-scaled e4m3: (e4m3 [E, N, K], float32 scales [E, ceil(N / 128),
    ceil(K / 128)]), each 128 x 128 block's scale its max |w| / 448 (as DeepSeek-V3's checkpoints hold them)."""
    E, N, K = w.shape
    nb, kb = _cdiv(N, GROUP), _cdiv(K, GROUP)
    b = torch.nn.functional.pad(w.float(), (0, kb * GROUP - K, 0, nb * GROUP - N)).view(E, nb, GROUP, kb, GROUP)
    scale = _scale(b.abs().amax(dim=(2, 4)))
    q = (b / scale[:, :, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(E, nb * GROUP, kb * GROUP)[:, :N, :K].contiguous(), scale


def _round(a: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    return torch.from_numpy(a).to(dtype).to(torch.float64).numpy()


def _fp8_rows(a: np.ndarray) -> np.ndarray:
    """Rows of a (float64) as the kernel's FP8 operand holds them: rounded to float32, quantised per 128."""
    return dequantize_groups(*quantize_groups(torch.from_numpy(a).float())).numpy()


def execute_moe(plan: MoePlan, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_w: torch.Tensor,
                combiner: str = "weighted_sum", w13_scale: torch.Tensor | None = None,
                w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """out [T, H] (x's dtype) from the plan (its routing already validated: every pair has a row);
    `combiner`: the graph's reduction, whose merge folds a token's weighted rows in fixed order. With
    `w13_scale` and `w2_scale`, w13 and w2 are block-scaled e4m3 and the GEMMs' activations are quantised
    (the plan's gemm1 tiles are then whole 128-column groups of act)."""
    merge = COMBINERS[combiner].merge
    dt = x.dtype
    fp8 = w13_scale is not None
    if fp8:
        w13, w2 = dequantize_blocks(w13, w13_scale), dequantize_blocks(w2, w2_scale)
    xd, w13d, w2d = (t.double().numpy() for t in (x, w13, w2))
    wd = topk_w.double().numpy()
    T, H = xd.shape
    I = w2d.shape[2]
    nrows = len(plan.row_token)
    xs = xd[plan.row_token] if nrows else np.zeros((0, H))
    if fp8:
        xs = _fp8_rows(xs)
    act, y = np.zeros((nrows, I)), np.zeros((nrows, H))
    G1_COLS, G2_COLS = plan.columns
    n1 = -(-I // G1_COLS)
    need = (plan.pair_pos >= 0).sum(axis=1)
    count = np.zeros((T, -(-H // G2_COLS)), dtype=np.int64)
    arrived = np.zeros(len(plan.row_blocks), dtype=np.int64)   # the row blocks' events (the kernel's rb_done)
    out = np.full((T, H), np.nan)
    t = plan.tile_columns()
    parts: dict[tuple[int, int, int], list] = {}   # split K: a tile's slices' sums until its last slice
    for i in range(plan.num_tiles):
        rb, c0, c1, gemm = t["row_block"][i], t["col"][i], t["col_end"][i], t["gemm"][i]
        events = slice(t["event_first"][i], t["event_first"][i] + t["event_count"][i])
        e, r0, n = plan.row_blocks[rb]
        rows = slice(r0, r0 + n)
        if gemm != GEMM1 and np.any(arrived[events] != n1):   # the kernel would wait here for a later ticket: never
            raise RuntimeError(f"tile ticket {i}: a gemm2 tile before its row block {rb}'s {n1} gemm1 tiles")
        S = max(1, int(t["slices"][i]))
        ks = slice(None) if S == 1 else plan.split.slice_columns(gemm, int(t["slice"][i]), S)
        # each slice's sums (float64: the kernel's float32 slices summed in slice order, within float32 rounding)
        if gemm == GEMM1:
            cols = slice(c0 * G1_COLS, min(I, c1 * G1_COLS))
            part = (xs[rows, ks] @ w13d[e, cols, ks].T, xs[rows, ks] @ w13d[e, I + cols.start:I + cols.stop, ks].T)
        else:
            cols = slice(c0 * G2_COLS, min(H, c1 * G2_COLS))
            part = (act[rows, ks] @ w2d[e, cols, ks].T,)
        done = parts.setdefault((gemm, rb, c0), [None] * S)
        done[int(t["slice"][i]) if S > 1 else 0] = part
        if any(d is None for d in done):   # not the tile's last slice
            continue
        del parts[gemm, rb, c0]
        sums = [sum(d[m] for d in done) for m in range(len(part))]
        if gemm == GEMM1:
            g, u = sums
            a = g / (1 + np.exp(-g)) * u
            act[rows, cols] = _fp8_rows(a) if fp8 else _round(a, dt)
            arrived[events] += 1
            continue
        y[rows, cols] = _round(sums[0], dt)
        for c in range(c0, c1):
            cols = slice(c * G2_COLS, min(H, (c + 1) * G2_COLS))
            for tok in plan.row_token[rows]:
                count[tok, c] += 1
                if count[tok, c] == need[tok]:   # the token's last row for this column block: combine
                    acc = np.zeros(cols.stop - cols.start)
                    for j, pos in enumerate(plan.pair_pos[tok]):
                        (acc,) = merge(acc, wd[tok, j] * y[pos, cols])
                    out[tok, cols] = acc
    return torch.from_numpy(out).to(dt)
