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
CLUSTER_DIMENSION = 4        # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
PROGRAMMATIC_SERIALIZATION = 6   # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
NON_PORTABLE_CLUSTERS = 14   # CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: an id, padding to 8 bytes, a 64-byte value union (clusterDim = first 3 uints)."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_int), ("value", _u * 16)]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig (cuda.h)."""
    _fields_ = [("gridDimX", _u), ("gridDimY", _u), ("gridDimZ", _u), ("blockDimX", _u), ("blockDimY", _u),
                ("blockDimZ", _u), ("sharedMemBytes", _u), ("hStream", _c),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", _u)]


_SIGNATURES = {
    "cuMemcpyDtoDAsync_v2": (ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, _c),
    "cuLaunchKernelEx": (_c, _c, _c, _c),   # (the config by address: converts faster than a byref())
    "cuOccupancyMaxActiveClusters": (ctypes.POINTER(ctypes.c_int), _c, ctypes.POINTER(LaunchConfig)),
    "cuFuncSetAttribute": (_c, ctypes.c_int, ctypes.c_int),
    "cuGetErrorString": (ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)),
}
_lib: ctypes.CDLL | None = None
# Called after each launch (function, config, parameter struct) while meld.runtime.torch_fastcall records an op
# call's launches; None otherwise.
recording = None


def load(path: str) -> ctypes.CDLL:
    """The library at `path` with the signatures of the calls above: libcuda, or a stand-in of no-op functions
    that lets tools/moe_eager.py time the Python side of launches on a host without a GPU."""
    lib = ctypes.CDLL(path)
    for name, args in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib


def _cuda() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        _lib = load("libcuda.so.1")
    return _lib


def _check(err: int, what: str) -> None:
    """Raise CudaError for a failed call, or the WatchdogTimeout behind it (a meld kernel that trapped)."""
    if err:
        from . import watchdog
        from .driver import CudaError

        msg = ctypes.c_char_p()
        _cuda().cuGetErrorString(err, ctypes.byref(msg))
        error = CudaError(f"{what}: CUDA error {err} ({msg.value.decode() if msg.value else '?'})")
        watchdog.translate(error)
        raise error


def memcpy_dtod_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    _check(_cuda().cuMemcpyDtoDAsync_v2(dst, src, nbytes, stream), "cuMemcpyDtoDAsync")


def cluster_config(grid: int, block: int, smem: int, cluster: int, programmatic: bool = False) -> LaunchConfig:
    """A 1-D launch configuration with clusters of `cluster` CTAs along x (the occupancy query needs
    the attribute even for 1); `programmatic`: the grid may start once the previous kernel in the
    stream lets it (programmatic dependent launch). The attribute array is kept alive by the struct."""
    cfg = LaunchConfig(grid, 1, 1, block, 1, 1, smem, None)
    attr = (LaunchAttribute * 2)()
    attr[0].id = CLUSTER_DIMENSION
    attr[0].value[0], attr[0].value[1], attr[0].value[2] = cluster, 1, 1
    attr[1].id = PROGRAMMATIC_SERIALIZATION
    attr[1].value[0] = 1
    cfg.attrs, cfg.numAttrs = ctypes.cast(attr, ctypes.POINTER(LaunchAttribute)), 2 if programmatic else 1
    cfg._keep = attr
    return cfg


def launch_config(grid: int, block: int, smem: int, programmatic: bool) -> LaunchConfig:
    """A 1-D launch configuration without clusters: a plain launch (no attribute, as cuLaunchKernel), or a
    programmatic dependent one (`cluster_config`'s, of one-CTA clusters)."""
    cfg = cluster_config(grid, block, smem, 1, programmatic)
    if not programmatic:
        cfg.numAttrs = 0
    return cfg


def launch_ex(func: int, cfg: LaunchConfig, params: int, what: str) -> None:
    """cuLaunchKernelEx; `params` is the address of the void* argument array, and the caller sets `cfg.hStream`.
    (One call takes both plain and programmatic launches: ctypes converts its four arguments much faster than
    cuLaunchKernel's eleven, on every eager call's path: bench/RESULTS.md.)"""
    err = _cuda().cuLaunchKernelEx(ctypes.addressof(cfg), func, params, None)
    if err:   # (the message is only made for a failure)
        _check(err, f"launch {what}")


def max_active_clusters(func: int, cfg: LaunchConfig) -> int:
    """Clusters of `cfg`'s shape that can be resident at once (0 if the cluster size is not possible)."""
    lib = _cuda()
    if cfg.attrs[0].value[0] > 8:
        if lib.cuFuncSetAttribute(func, NON_PORTABLE_CLUSTERS, 1):
            return 0
    n = ctypes.c_int(0)
    return n.value if lib.cuOccupancyMaxActiveClusters(ctypes.byref(n), func, ctypes.byref(cfg)) == 0 else 0
