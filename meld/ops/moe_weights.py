"""A MoE layer's weights in the kernel's box order (`pack_moe_weights`), for `MoE` calls that stream them
with one contiguous bulk copy per ring stage instead of 2-D tensor-map copies.

Every 64 x 64 box of a weight matrix (64 rows, 64 elements of K) is stored as the 8 KB image a 2-D TMA copy
with the 128-byte swizzle leaves in shared memory (row r's 16-byte chunk c at chunk c ^ (r % 8)), and the
boxes one ring stage of a tile needs lie next to each other:

    w13 packed [E, ceil(H / 64), ceil(I / 64), 2, 64, 64]: (expert, K box, 64 columns of I, gate / up)
    w2 packed  [E, ceil(I / 64), ceil(H / 64), 64, 64]:    (expert, K box, 64 rows of H)

so a stage of a gemm1 tile (its columns' gate and up boxes) or of a gemm2 tile (its rows of H) is one run
of bytes. Rows and K past the matrix are zeros. (Contiguous bulk copies stream the same weights faster than
2-D boxes: bench/RESULTS.md, "What a T = 1 layer's bytes cost to stream".) Pack once, when the weights are
loaded; the packed tensors are ordinary tensors (CUDA graphs, torch.compile and the custom op take them as
they take w13 and w2).
"""
from __future__ import annotations

import torch

from .checks import check_positive

BOX = 64   # rows and K elements of a box (templates/moe.cuh: W_ROWS, BK)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def packed_shapes(hidden_size: int, intermediate_size: int,
                  num_experts: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of the packed w13 and w2 of a layer."""
    H, I, E = hidden_size, intermediate_size, num_experts
    return (E, _cdiv(H, BOX), _cdiv(I, BOX), 2, BOX, BOX), (E, _cdiv(I, BOX), _cdiv(H, BOX), BOX, BOX)


def _swizzle_index(device: torch.device) -> torch.Tensor:
    """[64, 8]: for row r and stored chunk c, the chunk of the row it holds (c ^ (r % 8); an involution)."""
    r = torch.arange(BOX, device=device)[:, None]
    c = torch.arange(8, device=device)[None, :]
    return c ^ (r % 8)


def _to_boxes(m: torch.Tensor) -> torch.Tensor:
    """[E, R, K] -> [E, K boxes, R boxes, 64, 64], zero-padded and swizzled."""
    E, R, K = m.shape
    padded = m.new_zeros(E, _cdiv(R, BOX) * BOX, _cdiv(K, BOX) * BOX)
    padded[:, :R, :K] = m
    b = padded.view(E, _cdiv(R, BOX), BOX, _cdiv(K, BOX), 8, 8).permute(0, 3, 1, 2, 4, 5)   # E, kb, rb, r, chunk, 8
    idx = _swizzle_index(m.device).view(1, 1, 1, BOX, 8, 1).expand(b.shape)
    return torch.gather(b, 4, idx).reshape(E, _cdiv(K, BOX), _cdiv(R, BOX), BOX, BOX)


def _from_boxes(b: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    """The inverse of _to_boxes: [E, K boxes, R boxes, 64, 64] -> [E, rows, k]."""
    E, kb, rb = b.shape[:3]
    v = b.reshape(E, kb, rb, BOX, 8, 8)
    idx = _swizzle_index(b.device).view(1, 1, 1, BOX, 8, 1).expand(v.shape)
    m = torch.gather(v, 4, idx).permute(0, 2, 3, 1, 4, 5).reshape(E, rb * BOX, kb * BOX)
    return m[:, :rows, :k]


def pack_moe_weights(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13 packed, w2 packed) from w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I], on their
    device and in their dtype. Raises ValueError for shapes that do not belong together.

    Example:
        w13p, w2p = meld.pack_moe_weights(w13, w2)
        out = moe(x, router_logits, w13p, w2p)
    """
    for name, t in (("w13", w13), ("w2", w2)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a 3-D tensor, got {getattr(t, 'shape', type(t).__name__)}")
    E, I2, H = w13.shape
    if min(E, I2, H) < 1:
        raise ValueError(f"w13 must be [E, 2I, H] with E, I, H >= 1, got {tuple(w13.shape)}")
    if I2 % 2 or tuple(w2.shape) != (E, H, I2 // 2):
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} are not [E, 2I, H] and [E, H, I]")
    if w2.dtype != w13.dtype or w2.device != w13.device:
        raise ValueError(f"w13 and w2 must share dtype and device, got {w13.dtype} on {w13.device} and "
                         f"{w2.dtype} on {w2.device}")
    I = I2 // 2
    w13p = torch.stack([_to_boxes(w13[:, :I]), _to_boxes(w13[:, I:])], dim=3)
    return w13p.contiguous(), _to_boxes(w2).contiguous()


def unpack_moe_weights(w13p: torch.Tensor, w2p: torch.Tensor, hidden_size: int,
                       intermediate_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13, w2) back from their packed forms (the CPU reference executor runs on these)."""
    H, I = check_positive("hidden_size", hidden_size), check_positive("intermediate_size", intermediate_size)
    for name, t in (("w13p", w13p), ("w2p", w2p)):
        if not isinstance(t, torch.Tensor) or t.dim() < 1:
            raise ValueError(f"{name} must be a packed tensor (pack_moe_weights), got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
    want13, want2 = packed_shapes(H, I, w13p.shape[0])
    if tuple(w13p.shape) != want13 or tuple(w2p.shape) != want2:
        raise ValueError(f"w13p {tuple(w13p.shape)} and w2p {tuple(w2p.shape)} are not the packed weights of "
                         f"hidden_size={H}, intermediate_size={I} ({want13} and {want2})")
    if w2p.dtype != w13p.dtype or w2p.device != w13p.device:
        raise ValueError(f"w13p and w2p must share dtype and device, got {w13p.dtype} on {w13p.device} and "
                         f"{w2p.dtype} on {w2p.device}")
    w13 = torch.cat([_from_boxes(w13p[:, :, :, 0], I, H), _from_boxes(w13p[:, :, :, 1], I, H)], dim=1)
    return w13, _from_boxes(w2p, H, I)
