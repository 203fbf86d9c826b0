"""A rank's window: device memory every rank of a process group can address, and how its regions are laid out.

Two engines. "cuda" (the default): ranks on different GPUs share windows through torch symmetric memory (its
CUDA backend); ranks that share one GPU (two processes on it: how the cross-rank protocols are tested where
only one GPU is at hand) are refused by torch symmetric memory, so their windows are ordinary allocations mapped
into every rank by CUDA IPC handles (the driver's cuIpcGetMemHandle / cuIpcOpenMemHandle). "nvshmem": the
window is on NVSHMEM's symmetric heap (`meld.distributed.nvshmem`), and a rank's pointer to another's is
NVSHMEM's (nvshmem_ptr) where the two can load and store each other's memory, 0 where they cannot (other
nodes: only the proxy's puts reach them). The kernels see the same thing either way: one pointer per rank.
"""
from __future__ import annotations

import warnings

import torch

_ALIGN = 256


def pack_regions(sizes: dict[str, int]) -> dict[str, int]:
    """Byte offsets of a symmetric window's regions, in order, each at a 256-byte boundary (16-byte vector
    and TMA alignment, and no two regions' counters in one line); "nbytes": the window's size."""
    offsets, at = {}, 0
    for name, size in sizes.items():
        offsets[name] = at
        at += -(-size // _ALIGN) * _ALIGN
    return {**offsets, "nbytes": at}


class _DeviceBytes:
    """`nbytes` at device pointer `ptr` as a CUDA array (torch.as_tensor keeps this object, and so the memory,
    alive as long as the tensor); `release` frees or unmaps it when the last reference goes."""

    def __init__(self, ptr: int, nbytes: int, release):
        self.ptr, self._release = ptr, release
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}

    def __del__(self):
        self._release(self.ptr)


def _ipc_window(nbytes: int, device: torch.device, group) -> tuple[torch.Tensor, list[int], list]:
    """This rank's window allocated with cuMemAlloc, and every rank's, opened from the CUDA IPC handles the
    ranks exchange through `group` (ranks that share a GPU)."""
    import torch.distributed as dist

    from ..runtime.driver import check, drv

    d = drv()
    torch.cuda.init()
    with torch.cuda.device(device):
        torch.empty(1, device=device)   # make torch's primary context current on this thread
        check(d.cuInit(0), "cuInit")
        ptr = int(check(d.cuMemAlloc(nbytes), "cuMemAlloc (window)"))
        mine = _DeviceBytes(ptr, nbytes, lambda p: d.cuMemFree(p))
        handle = check(d.cuIpcGetMemHandle(ptr), "cuIpcGetMemHandle (window)")
        handles = [None] * dist.get_world_size(group)
        dist.all_gather_object(handles, bytes(handle.reserved), group=group)
        rank, ptrs, keep = dist.get_rank(group), [], [mine]
        for r, raw in enumerate(handles):
            if r == rank:
                ptrs.append(ptr)
                continue
            h = d.CUipcMemHandle()
            h.reserved = raw
            p = int(check(d.cuIpcOpenMemHandle(h, d.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
                          f"cuIpcOpenMemHandle (rank {r}'s window)"))
            keep.append(_DeviceBytes(p, nbytes, lambda q: d.cuIpcCloseMemHandle(q)))
            ptrs.append(p)
    return torch.as_tensor(mine, device=device), ptrs, keep


def _shares_a_gpu(device: torch.device, group) -> bool:
    """Whether two ranks of `group` run on one GPU (collective)."""
    import socket

    import torch.distributed as dist

    mine = (socket.gethostname(), str(torch.cuda.get_device_properties(device).uuid))
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    return len(set(every)) < len(every)


class SymmetricWindow:
    """`nbytes` of device memory on every rank of `group`, each rank's addressable from every other: `local`
    (this rank's, a uint8 tensor), `ptrs` (every rank's address, in rank order; 0: not addressable from here)
    and `peers` (the same on the device, int64). Allocation is collective. `engine` "cuda": torch symmetric
    memory (its CUDA backend), or CUDA IPC handles where ranks share a GPU; "nvshmem": NVSHMEM's symmetric heap,
    released by `close()` (collective, in the same order on every rank) or with the process (module docstring)."""

    def __init__(self, nbytes: int, device: torch.device, group, engine: str = "cuda"):
        import torch.distributed as dist

        check_engine(engine)
        self.engine = engine
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.ipc = engine == "cuda" and _shares_a_gpu(device, group)
        self._nvshmem = None
        if engine == "nvshmem":
            from . import nvshmem

            self._nvshmem = nvshmem.job(group, device)
            ptr = self._nvshmem.malloc(nbytes)
            self.local = torch.as_tensor(_DeviceBytes(ptr, nbytes, lambda p: None), device=device)
            self.ptrs = [ptr if r == self.rank else self._nvshmem.peer(ptr, r) for r in range(self.world)]
        elif self.ipc:
            self.local, self.ptrs, self._mapped = _ipc_window(nbytes, device, group)
        else:
            import torch.distributed._symmetric_memory as symm_mem

            with warnings.catch_warnings():   # older torch needs it per group; newer ones deprecate it
                warnings.simplefilter("ignore")
                if hasattr(symm_mem, "enable_symm_mem_for_group"):
                    symm_mem.enable_symm_mem_for_group(group.group_name)
            self.local = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
            self._handle = symm_mem.rendezvous(self.local, group)
            self.ptrs = list(self._handle.buffer_ptrs)
        self.peers = torch.tensor(self.ptrs, dtype=torch.int64, device=device)

    @property
    def every_rank_mapped(self) -> bool:
        """Whether this rank can load and store every rank's window (what the peer transport needs)."""
        return all(self.ptrs)

    def close(self) -> None:
        """Release an NVSHMEM window now (collective); the "cuda" engine's are released with their tensors."""
        if self._nvshmem is not None:
            torch.cuda.synchronize(self.local.device)
            self._nvshmem.free(self.ptrs[self.rank])
            self._nvshmem = None


ENGINES = ("cuda", "nvshmem")


def check_engine(engine: object) -> None:
    """ValueError naming `engine` unless it is one of ENGINES."""
    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r}: expected one of {ENGINES} (the windows' and the proxy's engine)")
