"""Device buffers for the work tables, rewritten in place by every plan().

The int32 tables live in one device buffer at fixed offsets — [CTA table | kv_len | page_base |
kv_indices] — so the kernel's pointers never change between plans and a CUDA graph that captured
run() stays valid. The host stages the same layout in pinned memory (two buffers, alternating, each
guarded by an event) and uploads it with one asynchronous copy on the current stream, so plan() never
waits for the device. Driver calls go through cuda-python directly: plan() is on the serving loop's
critical path and torch's copy dispatch costs more than the copy.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..ir import CTA_FIELDS
from .driver import check, drv


@dataclass(frozen=True)
class Capacity:
    batch: int
    pages: int


class WorkTables:
    def __init__(self, device: torch.device, num_ctas: int, cap: Capacity):
        self.device, self.num_ctas, self.cap = device, num_ctas, cap
        W = num_ctas
        self.off_kv_len = len(CTA_FIELDS) * W
        self.off_page_base = self.off_kv_len + cap.batch
        self.off_indices = self.off_page_base + cap.batch
        size = self.off_indices + max(cap.pages, 1)
        self.buf = torch.zeros(size, dtype=torch.int32, device=device)
        self._staging = [torch.zeros(size, dtype=torch.int32, pin_memory=True) for _ in range(2)]
        self._host = [s.numpy() for s in self._staging]
        d = drv()
        self._events = [check(d.cuEventCreate(d.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
                        for _ in range(2)]
        self._pending = [False, False]
        self._turn = 0

    def stage(self) -> np.ndarray:
        """The next pinned staging buffer (waits only if its previous upload has not run yet)."""
        if self._pending[self._turn]:
            check(drv().cuEventSynchronize(self._events[self._turn]), "cuEventSynchronize")
        return self._host[self._turn]

    def cta_view(self, staged: np.ndarray) -> np.ndarray:
        return staged[:self.off_kv_len].reshape(len(CTA_FIELDS), self.num_ctas)

    def upload(self, staged_words: int, device_indices: torch.Tensor | None = None) -> None:
        """Copy the first `staged_words` of the staging buffer (and GPU-resident page indices) to the device."""
        d = drv()
        stream = d.CUstream(torch.cuda.current_stream(self.device).cuda_stream)
        check(d.cuMemcpyHtoDAsync(self.buf.data_ptr(), self._staging[self._turn].data_ptr(), 4 * staged_words,
                                  stream), "upload work tables")
        if device_indices is not None and device_indices.numel():
            check(d.cuMemcpyDtoDAsync(self.ptr(self.off_indices), device_indices.data_ptr(),
                                      4 * device_indices.numel(), stream), "copy kv_indices")
        check(d.cuEventRecord(self._events[self._turn], stream), "cuEventRecord")
        self._pending[self._turn] = True
        self._turn ^= 1

    def ptr(self, offset: int) -> int:
        return self.buf.data_ptr() + 4 * offset

    def __del__(self) -> None:
        d = drv()
        for ev in getattr(self, "_events", ()):
            d.cuEventDestroy(ev)
