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


_modules: dict[tuple, object] = {}
# The dynamic shared memory each loaded function allows, by (module key, entry). A CUfunction is one object per
# module and entry, shared by every Kernel that loads it, and its limit is the last value set: lowering it for
# a smaller grid of one operator made another operator's larger launch fail (invalid argument). It only rises.
_smem_allowed: dict[tuple, int] = {}


def _module_key(compiled: Compiled, device: torch.device) -> tuple:
    return (device.index, compiled.name, hash(compiled.cubin))


def _module(compiled: Compiled, device: torch.device):
    """A cubin is loaded once per device: every entry of a module (a MoE's routing, dispatch and GEMM
    kernels) shares it. The caller has made torch's context current."""
    key = _module_key(compiled, device)
    m = _modules.get(key)
    if m is None:
        m = _modules[key] = check(drv().cuModuleLoadData(compiled.cubin), f"load {compiled.name}")
    return m


def _allow_smem(func, key: tuple, smem_bytes: int, name: str) -> None:
    """Let the shared function `func` launch with `smem_bytes` of dynamic shared memory, never lowering what
    an earlier Kernel of it allowed (_smem_allowed)."""
    if _smem_allowed.get(key, -1) < smem_bytes:
        attr = drv().CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        check(drv().cuFuncSetAttribute(func, attr, smem_bytes), f"set smem of {name}")
        _smem_allowed[key] = smem_bytes


class Kernel:
    """One compiled kernel loaded into torch's context on one device."""

    def __init__(self, compiled: Compiled, entry: str, device: torch.device, threads: int, smem_bytes: int):
        d = drv()
        torch.cuda.init()
        with torch.cuda.device(device):
            torch.empty(1, device=device)          # make torch's primary context current on this thread
            check(d.cuInit(0), "cuInit")
            self.module = _module(compiled, device)
            self.func = check(d.cuModuleGetFunction(self.module, entry.encode()), f"find {entry} in {compiled.name}")
            _allow_smem(self.func, (*_module_key(compiled, device), entry), smem_bytes, compiled.name)
            self.ctas_per_sm = check(d.cuOccupancyMaxActiveBlocksPerMultiprocessor(self.func, threads, smem_bytes),
                                     f"occupancy of {compiled.name}")
        if self.ctas_per_sm < 1:
            raise CudaError(f"{compiled.name} cannot run: {threads} threads with {smem_bytes} B shared memory "
                            "do not fit one SM")
        self.name, self.device, self.threads, self.smem_bytes = compiled.name, device, threads, smem_bytes
        self._func = int(self.func)
        self._params: ctypes.Structure | None = None
        self._configs: dict[tuple[int, bool], fastcall.LaunchConfig] = {}   # by grid size and programmatic

    def max_active_clusters(self, size: int) -> int:
        """Clusters of `size` CTAs of this kernel resident at once (cuOccupancyMaxActiveClusters with
        its real threads and shared memory); 0 where the size is not possible."""
        with torch.cuda.device(self.device):
            return fastcall.max_active_clusters(self._func, fastcall.cluster_config(size, self.threads,
                                                                                    self.smem_bytes, size))

    def launch(self, grid: int, params: ctypes.Structure, programmatic: bool = False) -> None:
        """Launch on torch's current stream with one by-value parameter struct.

        The argument array is kept and reused while `params` is the same object, so callers on a hot
        path keep one struct and update only the fields that change. `programmatic`: a programmatic
        dependent launch of the stream's previous kernel (the kernel must `grid_dependency_wait()`
        before it reads that kernel's output: common.cuh).
        """
        if params is not self._params:
            self._params = params
            self._args = (ctypes.c_void_p * 1)(ctypes.addressof(params))
            self._args_ptr = ctypes.addressof(self._args)
        cfg = self._configs.get((grid, programmatic))
        if cfg is None:
            cfg = self._configs[grid, programmatic] = fastcall.launch_config(grid, self.threads, self.smem_bytes,
                                                                             programmatic)
        cfg.hStream = current_stream(self.device)
        fastcall.launch_ex(self._func, cfg, self._args_ptr, self.name)
        if fastcall.recording is not None:
            fastcall.recording(self._func, cfg, params)


class PersistentLaunch:
    """One persistent launch of `kernel` as several grids, one per cluster size of a cluster mix, over
    one CTA table: grid i runs table rows [offset_i, offset_i + ctas_i) (its `cta_offset` field).

    The grids go on torch's current stream, largest clusters first; each later grid is a programmatic
    dependent launch of the one before. The kernel lets its dependents start once all its CTAs run
    (`griddepcontrol.launch_dependents` at entry: so the big clusters take their GPC slices before the
    small ones fill the rest) and, last of all, waits for the grid it depends on
    (`griddepcontrol.wait`), so the stream's next work starts only after every grid has finished. It is
    one in-order stream launch: capturable in CUDA graphs. The kernel never waits across grids for
    work (see decode_attention.cuh), so the order of the grids cannot deadlock.

    `launch(overlap=True)` makes the first grid a programmatic dependent of the stream's previous kernel
    too: its CTAs read their tables while that kernel ends, wait for it (its `wait_inputs` field), and
    only then let the later grids start.
    """

    def __init__(self, kernel: Kernel, mix: list[tuple[int, int]], params: ctypes.Structure):
        self.kernel, self.mix = kernel, list(mix)
        self.params: list[ctypes.Structure] = []
        self._grids = []
        offset = 0
        for i, (size, count) in enumerate(self.mix):
            p = type(params).from_buffer_copy(params)
            p.cta_offset = offset
            cfg = fastcall.cluster_config(size * count, kernel.threads, kernel.smem_bytes, size, programmatic=i > 0)
            args = (ctypes.c_void_p * 1)(ctypes.addressof(p))
            self.params.append(p)
            self._grids.append((cfg, args, ctypes.addressof(args)))
            offset += size * count
        size, count = self.mix[0]
        self._overlap_cfg = fastcall.cluster_config(size * count, kernel.threads, kernel.smem_bytes, size,
                                                    programmatic=True)

    def cluster_of_cta(self) -> list[int]:
        """Cluster id of every CTA row (clusters numbered across the grids)."""
        out, first = [], 0
        for size, count in self.mix:
            out += [first + i // size for i in range(size * count)]
            first += count
        return out

    def grid_of_cta(self) -> list[int]:
        return [g for g, (size, count) in enumerate(self.mix) for _ in range(size * count)]

    def set(self, **fields: int) -> None:
        """Update fields (tensor pointers, strides) of every grid's parameter struct."""
        for p in self.params:
            for k, v in fields.items():
                setattr(p, k, v)

    def launch(self, overlap: bool = False) -> None:
        """`overlap`: only where the stream's previous kernel wrote none of the tables the kernel reads
        before its wait (a plan's)."""
        stream = current_stream(self.kernel.device)
        func, name = self.kernel._func, self.kernel.name
        self.params[0].wait_inputs = int(overlap)
        for i, (cfg, _, args) in enumerate(self._grids):
            if i == 0 and overlap:
                cfg = self._overlap_cfg
            cfg.hStream = stream
            fastcall.launch_ex(func, cfg, args, name)
            if fastcall.recording is not None:
                fastcall.recording(func, cfg, self.params[i])
