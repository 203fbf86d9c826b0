"""The proxy transport on a GPU: the model of inter-node RDMA that runs on the GPUs of one node.

A kernel that may not store into a peer's memory (as between nodes) writes its puts and signals as
48-byte records (`transport.COMMAND`) into a ring in pinned host memory (templates/common.cuh,
`proxy_push`). `GpuProxy` is the host thread that takes them and lands them from this rank's symmetric window into
the destination's at the same offset, by the window's engine: "cuda", peer copies over NVLink (the model
of a NIC's RDMA writes on one node); "nvshmem", NVSHMEM's stream puts and signals, which run over NVLink
within a node and over InfiniBand between nodes (`meld.distributed.nvshmem`). It delivers by `transport.ProxySchedule`'s rules (the CPU emulation's): channels
per destination, puts cut into network chunks independent of the compute tile, `ordered` delivery in
issue order or unordered (shuffled over two copy streams), and a signal, which adds to a running total
per (destination, slot), written only after every put before it on its channel (one fence per
destination).

The thread is C++ (runtime/host/gpu_proxy.cpp, built with the system compiler at first use) and never
takes the GIL: a Python thread that blocks in a call holding the GIL while the GPU drains (a first cuBLAS
call loading its module, say) would otherwise starve the proxy that the running kernel waits for. For the
same reason an operator that runs over the proxy loads every kernel it may launch before its first call:
a module load while one of its kernels waits for the other ranks blocked both ranks' proxies on two H200s
(their copies waited for the load, the load for the kernels, the kernels for the copies; the watchdog
named the wait).
"""
from __future__ import annotations

import ctypes
import weakref

import torch

from .transport import COMMAND


def _stop(lib, handle, *buffers) -> None:
    """Stop a proxy thread (the buffers it reads are held until it has)."""
    lib.meld_proxy_stop(handle)


class GpuProxy:
    """One rank's proxy for `window` (a `SymmetricWindow`): the ring the kernel writes, and the thread that
    lands its records. `ring_params()` are the kernel's parameters for it. Idle, the thread spins briefly,
    then sleeps `poll_s` seconds between polls of the ring."""

    def __init__(self, window, ordered: bool = True, chunk_bytes: int = 64 << 10, capacity: int = 4096,
                 seed: int = 0, poll_s: float = 1e-5):
        from ..runtime.host_helper import ProxyConfig, load_proxy

        if chunk_bytes < 1 or capacity < 2:
            raise ValueError(f"chunk_bytes and capacity must be >= 1 and >= 2, got {chunk_bytes}, {capacity}")
        self.window, self.ordered, self.capacity = window, ordered, capacity
        dev = window.local.device
        self._records_t = torch.zeros(capacity * COMMAND.itemsize, dtype=torch.uint8, pin_memory=True)
        self._head_t = torch.zeros(1, dtype=torch.int64, pin_memory=True)   # records taken (the kernel reads it)
        self._tail = torch.zeros(1, dtype=torch.int64, device=dev)          # slots claimed (the kernel's counter)
        peers = window.ptrs
        self._peers = (ctypes.c_ulonglong * len(peers))(*peers)
        cfg = ProxyConfig(records=self._records_t.data_ptr(), head=self._head_t.data_ptr(), capacity=capacity,
                          peers=ctypes.cast(self._peers, ctypes.c_void_p), window_bytes=window.local.numel(),
                          chunk=chunk_bytes, seed=seed, poll_ns=int(poll_s * 1e9), world=window.world,
                          rank=window.rank, ordered=int(ordered), device=dev.index,
                          engine=int(window.engine == "nvshmem"))
        self._lib = load_proxy()
        err = ctypes.create_string_buffer(512)
        torch.cuda.synchronize(dev)   # (the primary context exists: the proxy shares it)
        self._handle = self._lib.meld_proxy_start(ctypes.byref(cfg), err, len(err))
        if not self._handle:
            raise RuntimeError(f"the GPU proxy of rank {window.rank} could not start: {err.value.decode()}")
        # A proxy dropped without close() (or alive at exit) stops its thread before the ring it reads is
        # freed: the finalizer holds the ring's buffers until then.
        self._stop = weakref.finalize(self, _stop, self._lib, self._handle, self._records_t, self._head_t, self._peers)

    def ring_params(self) -> dict[str, int]:
        return dict(xring=self._records_t.data_ptr(), xring_tail=self._tail.data_ptr(),
                    xring_head=self._head_t.data_ptr(), xring_cap=self.capacity)

    @property
    def error(self) -> RuntimeError | None:
        """What stopped the thread (a record outside the window, a failed copy), or None while it runs."""
        if not self._handle:
            return None
        msg = self._lib.meld_proxy_error(self._handle).decode()
        return RuntimeError(msg) if msg else None

    @property
    def landed_ops(self) -> int:
        """Operations issued so far (put chunks and signals)."""
        return self._lib.meld_proxy_landed(self._handle) if self._handle else 0

    def close(self) -> None:
        """Stop the thread once what it issued has landed."""
        if self._handle:
            self._stop()
            self._handle = None
