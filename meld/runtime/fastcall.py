"""The driver calls on plan()/run()'s hot path, made through ctypes.

Why not cuda-python here: its wrappers convert and type-check every argument in Python on each call,
and plan() and run() are on the serving loop's critical path. libcuda is already loaded by torch, so
a ctypes call is a thin C call. Everything off the hot path (module loading, attributes, occupancy,
NVRTC) stays on cuda-python.
"""
from __future__ import annotations

import ctypes

_c = ctypes.c_void_p
_u = ctypes.c_uint
_SIGNATURES = {
    "cuMemcpyDtoDAsync_v2": (ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, _c),
    "cuLaunchKernel": (_c, _u, _u, _u, _u, _u, _u, _u, _c, _c, _c),
    "cuGetErrorString": (ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)),
}
_lib: ctypes.CDLL | None = None


def _cuda() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = ctypes.CDLL("libcuda.so.1")
        for name, args in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
        _lib = lib
    return _lib


def _check(err: int, what: str) -> None:
    if err:
        from .driver import CudaError

        msg = ctypes.c_char_p()
        _cuda().cuGetErrorString(err, ctypes.byref(msg))
        raise CudaError(f"{what}: CUDA error {err} ({msg.value.decode() if msg.value else '?'})")


def memcpy_dtod_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    _check(_cuda().cuMemcpyDtoDAsync_v2(dst, src, nbytes, stream), "cuMemcpyDtoDAsync")


def launch(func: int, grid: int, block: int, smem: int, stream: int, params: int, what: str) -> None:
    """cuLaunchKernel with a 1-D grid and block; `params` is the address of the void* argument array."""
    _check(_cuda().cuLaunchKernel(func, grid, 1, 1, block, 1, 1, smem, stream, params, None), f"launch {what}")
