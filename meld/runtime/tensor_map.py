"""TMA tensor maps: of the paged KV cache (kernels built with `DecodeKernelConfig.tma`) and of the MoE
GEMM operands (2-D row-major matrices, `tensor_map_2d`; FP8 MoE's token scales, `tensor_map_runs`), and of MLA's
queries (`tensor_map_heads`).

The KV maps describe the K and V caches, each NHD `[num_pages, page_size, num_kv_heads, head_dim]` or HND
`[num_pages, num_kv_heads, page_size, head_dim]` with its own address and strides, as a 4-D tensor in its
own dimension order, whose box is 16 token rows x 128 bytes of channels of one (page, kv head) (64 bf16/fp16
or 128 FP8 channels; FP8 head_dim 64: its 64 bytes, in 64-byte swizzle): one copy fills one swizzled 2 KiB
(1 KiB) block of a ring stage, the same block in either layout (the kernel orders the coordinates by kv_hnd).
Encoding is a host call; `TensorMapCache` keeps the maps.
"""
from __future__ import annotations

import ctypes
from typing import Callable, Generic, TypeVar

import torch

from ..codegen import TensorMap
from .driver import check, drv

M = TypeVar("M")   # what a cache keeps per tensor: a map, or a tuple of maps

BOX_ROWS, BOX_COLS = 16, 64   # token rows x channels per copy (64 bf16 = the 128-byte swizzle span)
SWIZZLE_BYTES = 128           # a box row's bytes (at most): the swizzle span


def _encode(t: torch.Tensor, dims: list[int], strides: list[int], box: list[int], swizzled: bool = True) -> TensorMap:
    """cuTensorMapEncodeTiled over `t` (bf16/fp16, FP8 as bytes, or float32), dimensions innermost first, byte
    strides of the outer ones, swizzled over the box's rows (128 bytes; 64 where the row is 64 bytes) unless not
    `swizzled`, zero fill out of bounds: the 128 opaque bytes a kernel takes by value."""
    d = drv()
    dtype = {torch.bfloat16: d.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
             torch.float16: d.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
             torch.float8_e4m3fn: d.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8,
             torch.float8_e5m2: d.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8,
             torch.float32: d.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT32}[t.dtype]
    swizzle = (d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE if not swizzled else
               d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B if box[0] * t.element_size() == SWIZZLE_BYTES else
               d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_64B)
    u64, u32 = d.cuuint64_t, d.cuuint32_t
    m = check(d.cuTensorMapEncodeTiled(
        dtype, len(dims), t.data_ptr(), [u64(x) for x in dims], [u64(x) for x in strides], [u32(x) for x in box],
        [u32(1)] * len(dims),
        d.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
        d.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        d.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE), "cuTensorMapEncodeTiled")
    out = TensorMap()
    ctypes.memmove(ctypes.addressof(out), m.getPtr(), ctypes.sizeof(out))
    return out


def _kv_map(cache: torch.Tensor, layout: str) -> TensorMap:
    """The tensor map of one bf16/fp16/FP8 K or V cache [pages, mid, inner, head_dim] in `layout` (NHD: mid is
    page_size, inner the kv heads; HND the other way round), read through its strides (the last dim
    contiguous, the others multiples of 16 bytes; a dimension of extent 1 is never stepped over, so it
    takes a stride of one row)."""
    pages, mid, inner, dim = cache.shape
    es = cache.element_size()
    dims = [dim, inner, mid, pages]                                   # innermost first
    strides = [(s if n > 1 else dim) * es for s, n in zip(cache.stride()[2::-1], dims[1:])]
    cols = min(dim, SWIZZLE_BYTES // es)
    box = [cols, 1, BOX_ROWS, 1] if layout == "NHD" else [cols, BOX_ROWS, 1, 1]
    return _encode(cache, dims, strides, box)


def kv_tensor_maps(*caches: torch.Tensor, layout: str = "NHD") -> tuple[TensorMap, TensorMap]:
    """The K and V caches' tensor maps, of one cache `[num_pages, 2, ...]` (its halves [:, 0] and [:, 1]) or of
    two, (k_cache, v_cache), in `layout` (NHD or HND)."""
    k, v = caches[0].unbind(1) if len(caches) == 1 else caches
    return _kv_map(k, layout), _kv_map(v, layout)


class TensorMapCache(Generic[M]):
    """Tensor maps per (address, shape, strides, dtype) of the tensors a kernel reads, so run() encodes each
    one once: a model passes the same per-layer caches and weights every step. (`encode` may return several
    maps, of one tensor or of several read together: one lookup a call.) Templates whose address the kernel sets
    (`tensor_map_heads`: a per-call input) are kept per (shape, strides, dtype): `by_address=False`."""

    def __init__(self, encode: Callable[..., M], max_entries: int = 1024, by_address: bool = True):
        self._maps: dict[tuple, M] = {}
        self._encode, self._max, self._by_address = encode, max_entries, by_address

    def get(self, *ts: torch.Tensor) -> M:
        key = tuple((t.data_ptr() if self._by_address else 0, t.shape, t.stride(), t.dtype)   # (torch.Size hashes)
                    for t in ts)
        m = self._maps.get(key)
        if m is None:
            if len(self._maps) >= self._max:
                self._maps.clear()
            m = self._maps[key] = self._encode(*ts)
        return m


def tensor_map_2d(t: torch.Tensor, box_rows: int, box_cols: int = BOX_COLS) -> TensorMap:
    """The tensor map of a row-major bf16/fp16 matrix [rows, cols] (rows 16-byte aligned) whose box is
    `box_rows` rows x `box_cols` columns, 128-byte swizzled: the operand tiles of the GEMM kernels."""
    rows, cols = t.shape
    return _encode(t, [cols, rows], [t.stride(0) * t.element_size()], [box_cols, box_rows])


def tensor_map_heads(t: torch.Tensor, box_heads: int) -> TensorMap:
    """The tensor map of a bf16/fp16 query [rows, heads, dim] (the last dim contiguous, the others multiples of 16
    bytes) whose box is `box_heads` heads x 64 channels of one row, 128-byte swizzled, heads past the end zeros: MLA's
    Q, a 64-head unit's box of 64 channels at a time. A dimension of extent 1 is never stepped over, so it takes the
    stride of a dense layout. Kernels that take it as a template set its address per call (tensor_map_publish)."""
    rows, heads, dim = t.shape
    es = t.element_size()
    sh = t.stride(1) if heads > 1 else dim
    sr = t.stride(0) if rows > 1 else heads * sh
    return _encode(t, [dim, heads, rows], [sh * es, sr * es], [BOX_COLS, box_heads, 1])


def tensor_map_runs(t: torch.Tensor, box_cols: int) -> TensorMap:
    """The tensor map of a row-major float32 matrix [rows, cols] (rows 16-byte aligned) whose box is a run of
    `box_cols` elements of one row, unswizzled (past the end: zeros): FP8 MoE's token scales, a K block's row
    block's at a time. A copy's first column must be a multiple of 4 (the innermost coordinate, 16 bytes)."""
    rows, cols = t.shape
    return _encode(t, [cols, rows], [t.stride(0) * t.element_size()], [box_cols, 1], swizzled=False)
