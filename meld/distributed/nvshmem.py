"""NVSHMEM as the engine under meld's windows and proxy (`engine="nvshmem"`): a transport that runs across nodes.

meld's cross-rank kernels address one window per rank and, on the proxy transport, hand puts and signals to a
host thread (`meld.distributed.proxy`). With this engine the windows are allocated on NVSHMEM's symmetric heap
and the proxy thread lands its records with NVSHMEM's stream operations (`nvshmemx_putmem_on_stream`, then
`nvshmemx_quiet_on_stream` and `nvshmemx_signal_op_on_stream` for a signal), which NVSHMEM carries over NVLink
within a node and over InfiniBand (or another of its network transports) between nodes. The kernels do not
change: they never call NVSHMEM, so only its host library is used (`nvshmemx_hostlib_init_attr`, as
nvshmem4py starts it), and no device library is linked into meld's kernels.

The job is bootstrapped from the operator's `torch.distributed` group by NVSHMEM's unique-id method: rank 0
makes the id, the group broadcasts it, and every rank initialises with (rank, world, id). One job per
process, for one group; it ends when the process does. Ranks on one host bootstrap over the loopback
interface unless NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME says otherwise.

The host library is found at $MELD_NVSHMEM_LIB, else in the `nvidia-nvshmem-cu13` (or -cu12) wheel that CUDA
builds of torch install, else by the loader's search for libnvshmem_host.so.3.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch

LIBRARY = "libnvshmem_host.so.3"
INIT_WITH_UNIQUEID = 1 << 3          # nvshmemx's NVSHMEMX_INIT_WITH_UNIQUEID
SIGNAL_SET = 9                       # NVSHMEM_SIGNAL_SET


class UniqueId(ctypes.Structure):
    """nvshmemx_uniqueid_v1: 128 bytes, version (1 << 16) + 128."""
    _fields_ = [("version", ctypes.c_int), ("internal", ctypes.c_char * 124)]


class UniqueIdArgs(ctypes.Structure):
    """nvshmemx_uniqueid_args_v1: 24 bytes."""
    _fields_ = [("version", ctypes.c_int), ("id", ctypes.POINTER(UniqueId)), ("myrank", ctypes.c_int),
                ("nranks", ctypes.c_int)]


class InitArgs(ctypes.Structure):
    """nvshmemx_init_args_v1: 128 bytes."""
    _fields_ = [("version", ctypes.c_int), ("uid_args", UniqueIdArgs), ("content", ctypes.c_char * 96)]


class InitAttr(ctypes.Structure):
    """nvshmemx_init_attr_v1: 144 bytes. Version 1 of the attributes, which every NVSHMEM 3 library takes."""
    _fields_ = [("version", ctypes.c_int), ("mpi_comm", ctypes.c_void_p), ("args", InitArgs)]


def _v1(struct: type[ctypes.Structure]) -> int:
    return (1 << 16) + ctypes.sizeof(struct)


def _candidates() -> list[str]:
    """Where the host library may be, in the order tried (module docstring)."""
    found = [os.environ["MELD_NVSHMEM_LIB"]] if os.environ.get("MELD_NVSHMEM_LIB") else []
    for package in ("nvidia.nvshmem", "nvidia.nvshmem_cu12"):
        try:
            spec = importlib.util.find_spec(package)
        except ModuleNotFoundError:
            spec = None
        for root in (spec.submodule_search_locations or []) if spec else []:
            if (Path(root) / "lib" / LIBRARY).exists():
                found.append(str(Path(root) / "lib" / LIBRARY))
    return found + [LIBRARY]


_library: ctypes.CDLL | None = None


def library() -> ctypes.CDLL:
    """NVSHMEM's host library, loaded once with its symbols global (the proxy thread finds them there);
    RuntimeError naming what was tried where none loads."""
    global _library
    if _library is None:
        tried = []
        for path in _candidates():
            try:
                lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                break
            except OSError as e:
                tried.append(f"{path} ({e})")
        else:
            raise RuntimeError("engine='nvshmem' needs NVSHMEM's host library (the nvidia-nvshmem-cu13 wheel, or "
                               f"$MELD_NVSHMEM_LIB); none loaded: {'; '.join(tried)}")
        for name, res, args in [
                ("nvshmemx_get_uniqueid", ctypes.c_int, [ctypes.POINTER(UniqueId)]),
                ("nvshmemx_set_attr_uniqueid_args", ctypes.c_int,
                 [ctypes.c_int, ctypes.c_int, ctypes.POINTER(UniqueId), ctypes.POINTER(InitAttr)]),
                ("nvshmemx_hostlib_init_attr", ctypes.c_int, [ctypes.c_uint, ctypes.POINTER(InitAttr)]),
                ("nvshmem_my_pe", ctypes.c_int, []), ("nvshmem_n_pes", ctypes.c_int, []),
                ("nvshmem_malloc", ctypes.c_void_p, [ctypes.c_size_t]), ("nvshmem_free", None, [ctypes.c_void_p]),
                ("nvshmem_ptr", ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_int]),
                ("nvshmem_barrier_all", None, []), ("nvshmemx_init_status", ctypes.c_int, [])]:
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
        _library = lib
    return _library


STATUS = {0: "not initialised", 1: "bootstrapped", 2: "initialised",
          3: "initialised, limited: several PEs share a GPU without MPS"}   # nvshmemx_init_status()


@dataclass
class NvshmemJob:
    """This process's NVSHMEM job: its PE (the group rank) among `world`, on `device`, for `group`; `status`:
    nvshmemx_init_status() once started (STATUS)."""
    group: object
    rank: int
    world: int
    device: torch.device
    status: int = 2

    def malloc(self, nbytes: int) -> int:
        """`nbytes` of the symmetric heap (collective: every rank asks for the same size, in the same order);
        the address of this rank's copy."""
        ptr = library().nvshmem_malloc(nbytes)
        if not ptr:
            raise RuntimeError(f"nvshmem_malloc({nbytes}) failed on rank {self.rank} (the symmetric heap is "
                               "NVSHMEM_SYMMETRIC_SIZE bytes a rank)")
        return ptr

    def free(self, ptr: int) -> None:
        """Release a malloc'd window (collective, in the same order on every rank)."""
        library().nvshmem_free(ptr)

    def peer(self, ptr: int, pe: int) -> int:
        """Rank `pe`'s copy of symmetric `ptr` as this rank can load and store it (over NVLink or P2P), or 0
        where it cannot (another node: only NVSHMEM's puts reach it)."""
        return library().nvshmem_ptr(ptr, pe) or 0


_job: NvshmemJob | None = None


def _one_host(group) -> bool:
    import socket

    import torch.distributed as dist

    names = [None] * dist.get_world_size(group)
    dist.all_gather_object(names, socket.gethostname(), group=group)
    return len(set(names)) == 1


def job(group, device: torch.device) -> NvshmemJob:
    """The process's NVSHMEM job, started on first use over `group` (collective then); the same job after,
    which must be over the same group on the same device."""
    import torch.distributed as dist

    global _job
    if _job is not None:
        if _job.group is not group or _job.device != device:
            raise RuntimeError(f"this process's NVSHMEM job runs over another group or device ({_job.device}); one "
                               f"job a process: every operator with engine='nvshmem' must use the same group")
        return _job
    lib = library()
    if (before := lib.nvshmemx_init_status()) != 0:
        raise RuntimeError(f"NVSHMEM is already {STATUS.get(before, before)} in this process (by another library): "
                           "meld's engine starts the process's one job itself")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if _one_host(group):
        os.environ.setdefault("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "lo")
    uid = UniqueId(version=_v1(UniqueId))
    if rank == 0 and lib.nvshmemx_get_uniqueid(ctypes.byref(uid)) != 0:
        raise RuntimeError("nvshmemx_get_uniqueid failed on rank 0")
    box = [bytes(uid)]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    ctypes.memmove(ctypes.byref(uid), box[0], ctypes.sizeof(uid))
    attr = InitAttr(version=_v1(InitAttr))
    attr.args.version = _v1(InitArgs)
    attr.args.uid_args = UniqueIdArgs(_v1(UniqueIdArgs), None, -1, -1)
    torch.cuda.set_device(device)
    torch.empty(1, device=device)   # torch's primary context current on this thread: NVSHMEM binds to it
    status = lib.nvshmemx_set_attr_uniqueid_args(rank, world, ctypes.byref(uid), ctypes.byref(attr))
    if status == 0:
        status = lib.nvshmemx_hostlib_init_attr(INIT_WITH_UNIQUEID, ctypes.byref(attr))
    if status != 0:
        raise RuntimeError(f"NVSHMEM did not start on rank {rank} of {world} (status {status}; NVSHMEM_DEBUG=INFO "
                           "says why)")
    if (lib.nvshmem_my_pe(), lib.nvshmem_n_pes()) != (rank, world):
        raise RuntimeError(f"NVSHMEM placed rank {rank} of {world} as PE {lib.nvshmem_my_pe()} of {lib.nvshmem_n_pes()}")
    _job = NvshmemJob(group, rank, world, device, lib.nvshmemx_init_status())
    return _job
