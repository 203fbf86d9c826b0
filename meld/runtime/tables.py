"""Device buffers for the work tables, rewritten in place by every plan().

One int32 device buffer holds

    [CTA table | kv_len | page_base | raw: kv_indptr then kv_last_page_len | kv_indices]

with every section at a fixed offset (sized by the capacities), so the attention kernel's pointers
never change between plans and a CUDA graph that captured run() stays valid. plan() stages the raw
page table (the last two sections) in pinned memory — two buffers,
alternating, each guarded by an event — uploads it with one asynchronous copy, and the GPU planner
fills the first three sections. Driver calls go through cuda-python directly: plan() is on the
serving loop's critical path and torch's copy dispatch costs more than the copy.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..ir import CTA_FIELDS
from . import fastcall
from .driver import check, current_stream, drv


@dataclass(frozen=True)
class Capacity:
    batch: int
    pages: int


class WorkTables:
    def __init__(self, device: torch.device, num_ctas: int, cap: Capacity):
        self.device, self.num_ctas, self.cap = device, num_ctas, cap
        self.off_kv_len = len(CTA_FIELDS) * num_ctas
        self.off_page_base = self.off_kv_len + cap.batch
        self.off_raw = self.off_page_base + cap.batch        # kv_indptr [B + 1], then kv_last_page_len [B]
        self.off_indices = self.off_raw + 2 * cap.batch + 1
        size = self.off_indices + max(cap.pages, 1)
        self.buf = torch.zeros(size, dtype=torch.int32, device=device)
        self.line = torch.zeros(cap.batch + 1, dtype=torch.int64, device=device)   # the planner's scratch
        self._staging = [torch.zeros(size, dtype=torch.int32, pin_memory=True) for _ in range(2)]
        self._host = [s.numpy() for s in self._staging]
        self._staging_ptr = [s.data_ptr() for s in self._staging]
        self._buf_ptr = self.buf.data_ptr()
        d = drv()
        self._events = [check(d.cuEventCreate(d.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
                        for _ in range(2)]
        self._event_ptr = [int(e) for e in self._events]
        self._destroy = d.cuEventDestroy
        self._pending = [False, False]
        self._turn = 0

    def stage(self) -> np.ndarray:
        """The next pinned staging buffer (waits only if its previous upload has not run yet)."""
        if self._pending[self._turn]:
            fastcall.event_synchronize(self._event_ptr[self._turn])
        return self._host[self._turn]

    def staging_ptr(self) -> int:
        """Address of the staging buffer stage() returned last."""
        return self._staging_ptr[self._turn]

    def upload(self, nnz: int) -> None:
        """Copy the staged raw page table (indptr, last_page_len, the first nnz indices) to the device."""
        stream = current_stream(self.device)
        lo, hi = self.off_raw, self.off_indices + nnz
        fastcall.memcpy_htod_async(self._buf_ptr + 4 * lo, self._staging_ptr[self._turn] + 4 * lo, 4 * (hi - lo), stream)
        fastcall.event_record(self._event_ptr[self._turn], stream)
        self._pending[self._turn] = True
        self._turn ^= 1

    def copy_from_device(self, indptr: torch.Tensor, last: torch.Tensor, indices: torch.Tensor) -> None:
        """A page table already on the GPU: device-to-device copies, no host involvement."""
        stream = current_stream(self.device)
        raw_last = self.off_raw + indptr.numel()
        for off, t in ((self.off_raw, indptr), (raw_last, last), (self.off_indices, indices)):
            if t.numel():
                fastcall.memcpy_dtod_async(self.ptr(off), t.data_ptr(), 4 * t.numel(), stream)

    def ptr(self, offset: int) -> int:
        return self._buf_ptr + 4 * offset

    def __del__(self) -> None:
        destroy = getattr(self, "_destroy", None)   # bound at init: module imports fail at interpreter exit
        for ev in getattr(self, "_events", ()):
            destroy(ev)
