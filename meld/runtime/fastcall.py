"""The driver calls on plan()/run()'s hot path, made through ctypes.

Why not cuda-python here: its wrappers convert and type-check every argument in Python, which
measured 8-10 µs per call on the H200 host (bench/RESULTS.md) — three such calls were half of
plan()'s 50 µs budget and most of run()'s eager overhead. libcuda is already loaded by torch; a
ctypes call costs about a microsecond. Everything off the hot path (module loading, attributes,
occupancy, NVRTC) stays on cuda-python.
"""
from __future__ import annotations

import ctypes

_c = ctypes.c_void_p
_u = ctypes.c_uint
_SIGNATURES = {
    "cuMemcpyHtoDAsync_v2": (ctypes.c_uint64, _c, ctypes.c_size_t, _c),
    "cuMemcpyDtoDAsync_v2": (ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, _c),
    "cuEventRecord": (_c, _c),
    "cuEventSynchronize": (_c,),
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


def memcpy_htod_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    _check(_cuda().cuMemcpyHtoDAsync_v2(dst, src, nbytes, stream), "cuMemcpyHtoDAsync")


def memcpy_dtod_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    _check(_cuda().cuMemcpyDtoDAsync_v2(dst, src, nbytes, stream), "cuMemcpyDtoDAsync")


def event_record(event: int, stream: int) -> None:
    _check(_cuda().cuEventRecord(event, stream), "cuEventRecord")


def event_synchronize(event: int) -> None:
    _check(_cuda().cuEventSynchronize(event), "cuEventSynchronize")


def launch(func: int, grid: int, block: int, smem: int, stream: int, params: int, what: str) -> None:
    """cuLaunchKernel with a 1-D grid and block; `params` is the address of the void* argument array."""
    _check(_cuda().cuLaunchKernel(func, grid, 1, 1, block, 1, 1, smem, stream, params, None), f"launch {what}")
