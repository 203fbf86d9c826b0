"""Load cubins (cuda-python) and launch kernels (`fastcall`, ctypes) on torch's current stream.

torch owns the CUDA context: we make sure it exists (torch.cuda.init) and use its primary context,
so meld's launches interleave with torch's work on `torch.cuda.current_stream()` and can be
captured into CUDA graphs like any torch kernel.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from ..codegen import Compiled
from . import fastcall


class CudaError(RuntimeError):
    """A CUDA driver call failed."""


def drv():
    """cuda.bindings.driver, imported on first use (the CPU path never needs it)."""
    from cuda.bindings import driver
    return driver


def check(result, what: str):
    """Unpack a cuda-python result tuple, raising CudaError on failure."""
    d = drv()
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != d.CUresult.CUDA_SUCCESS:
        _, msg = d.cuGetErrorString(err)
        raise CudaError(f"{what}: {err.name} ({msg.decode() if msg else '?'})")
    return rest[0] if len(rest) == 1 else tuple(rest) if rest else None


def current_stream(device: torch.device) -> int:
    """Raw handle of torch's current stream on `device`: the private accessor skips building a
    torch.cuda.Stream object, on plan()/run()'s hot path."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(device.index) if raw is not None else torch.cuda.current_stream(device).cuda_stream


@dataclass(frozen=True)
class DeviceInfo:
    sm_count: int
    capability: tuple[int, int]
    name: str


def device_info(device: torch.device) -> DeviceInfo:
    p = torch.cuda.get_device_properties(device)
    return DeviceInfo(p.multi_processor_count, (p.major, p.minor), p.name)


class Kernel:
    """One compiled kernel loaded into torch's context on one device."""

    def __init__(self, compiled: Compiled, entry: str, device: torch.device, threads: int, smem_bytes: int):
        d = drv()
        torch.cuda.init()
        with torch.cuda.device(device):
            torch.empty(1, device=device)          # make torch's primary context current on this thread
            check(d.cuInit(0), "cuInit")
            self.module = check(d.cuModuleLoadData(compiled.cubin), f"load {compiled.name}")
            self.func = check(d.cuModuleGetFunction(self.module, entry.encode()), f"find {entry} in {compiled.name}")
            attr = d.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            check(d.cuFuncSetAttribute(self.func, attr, smem_bytes), f"set smem of {compiled.name}")
            self.ctas_per_sm = check(d.cuOccupancyMaxActiveBlocksPerMultiprocessor(self.func, threads, smem_bytes),
                                     f"occupancy of {compiled.name}")
        if self.ctas_per_sm < 1:
            raise CudaError(f"{compiled.name} cannot run: {threads} threads with {smem_bytes} B shared memory "
                            "do not fit one SM")
        self.name, self.device, self.threads, self.smem_bytes = compiled.name, device, threads, smem_bytes
        self._func = int(self.func)
        self._params: ctypes.Structure | None = None

    def launch(self, grid: int, params: ctypes.Structure) -> None:
        """Launch on torch's current stream with one by-value parameter struct.

        The argument array is kept and reused while `params` is the same object, so callers on a hot
        path keep one struct and update only the fields that change.
        """
        if params is not self._params:
            self._params = params
            self._args = (ctypes.c_void_p * 1)(ctypes.addressof(params))
            self._args_ptr = ctypes.addressof(self._args)
        fastcall.launch(self._func, grid, self.threads, self.smem_bytes, current_stream(self.device),
                        self._args_ptr, self.name)
