"""Device buffers for the work tables, rewritten in place by every plan().

One int32 device buffer holds

    [CTA table | kv_len | page_base | slot_base | raw: kv_indptr then kv_last_page_len | kv_indices]

with every section at a fixed offset (sized by the capacities), so the attention kernel's pointers
never change between plans and a CUDA graph that captured run() stays valid.

A page table on the host is staged in pinned memory with the same layout (two buffers, alternating)
and read from there by the GPU planner itself, which also copies the page indices into the device
buffer: plan() then makes a single driver call (the launch). The planner tells the host that a staging
buffer may be reused by writing a sequence number into pinned memory, so the host checks a flag instead
of calling into the driver; only when it runs two plans ahead of the GPU does it wait.

Grouped attention's tables are planned on the host: `StagedImage` holds them in one device buffer written
from one pinned image of it by one copy.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from ..ir import CTA_FIELDS
from . import fastcall
from .driver import current_stream

HOST_WAIT_S = 60.0   # plan() gives up waiting for a staging buffer after this long (a blocked stream)


@dataclass(frozen=True)
class Capacity:
    batch: int
    pages: int


class WorkTables:
    def __init__(self, device: torch.device, num_ctas: int, cap: Capacity, line_entries: int | None = None):
        """`line_entries`: the planner's line (default: a request an entry; a head-major plan's: a unit an entry)."""
        self.device, self.num_ctas, self.cap = device, num_ctas, cap
        self.off_kv_len = len(CTA_FIELDS) * num_ctas
        self.off_page_base = self.off_kv_len + cap.batch
        self.off_slot_base = self.off_page_base + cap.batch  # batch-invariant plans only
        self.off_raw = self.off_slot_base + cap.batch        # kv_indptr [B + 1], then kv_last_page_len [B]
        self.off_indices = -(-(self.off_raw + 2 * cap.batch + 1) // 4) * 4   # 16-byte aligned for the copy
        size = self.off_indices + max(cap.pages, 1)
        self.buf = torch.zeros(size, dtype=torch.int32, device=device)
        entries = cap.batch if line_entries is None else line_entries
        self.line = torch.zeros(entries + 1, dtype=torch.int64, device=device)   # the planner's scratch
        self.arrive = torch.zeros(1, dtype=torch.int32, device=device)             # CTAs done reading
        self._staging = [torch.zeros(size, dtype=torch.int32, pin_memory=True) for _ in range(2)]
        self._host = [s.numpy() for s in self._staging]
        self._staging_ptr = [s.data_ptr() for s in self._staging]
        self._done = torch.zeros(2, dtype=torch.int32, pin_memory=True)   # written by the planner
        self._done_host = self._done.numpy()
        self._expect = [0, 0]
        self._seq = 0
        self._turn = 0
        self._buf_ptr = self.buf.data_ptr()

    def stage(self) -> np.ndarray:
        """The next pinned staging buffer, once the GPU has finished reading it (the host is two plans
        ahead of the GPU when it has not: then wait for the planner's done flag, boundedly)."""
        t = self._turn
        if self._done_host[t] != self._expect[t]:
            self._wait_released(t)
        return self._host[t]

    def _wait_released(self, t: int) -> None:
        """Poll the planner's done flag for staging buffer t. A failed kernel ahead of it on the stream
        raises (as the WatchdogTimeout it may be); a stream blocked for HOST_WAIT_S raises too."""
        from . import watchdog

        deadline = time.monotonic() + HOST_WAIT_S
        pause = 0.0
        while self._done_host[t] != self._expect[t]:
            try:
                torch.cuda.current_stream(self.device).query()   # raises if a kernel failed
            except RuntimeError as e:
                watchdog.translate(e)
                raise
            watchdog.check(self.device)
            if time.monotonic() > deadline:
                raise RuntimeError(f"plan(): the GPU planner of an earlier plan() has not released staging buffer "
                                   f"{t} after {HOST_WAIT_S:g} s: the stream is blocked by work ahead of it")
            time.sleep(pause)
            pause = min(2 * pause + 1e-5, 1e-3)

    def staging_ptr(self) -> int:
        """Address of the staging buffer stage() returned last (valid on the device too: pinned memory)."""
        return self._staging_ptr[self._turn]

    def commit(self) -> tuple[int, int]:
        """Hand the staged buffer to the GPU: returns (flag address, sequence number) for the planner."""
        self._seq = self._seq % 0x7FFFFFFF + 1
        t = self._turn
        self._expect[t] = self._seq
        self._turn ^= 1
        return self._done.data_ptr() + 4 * t, self._seq

    def copy_from_device(self, indptr: torch.Tensor, last: torch.Tensor, indices: torch.Tensor) -> None:
        """A page table already on the GPU: device-to-device copies, no host involvement."""
        stream = current_stream(self.device)
        raw_last = self.off_raw + indptr.numel()
        for off, t in ((self.off_raw, indptr), (raw_last, last), (self.off_indices, indices)):
            if t.numel():
                fastcall.memcpy_dtod_async(self.ptr(off), t.data_ptr(), 4 * t.numel(), stream)

    def ptr(self, offset: int) -> int:
        return self._buf_ptr + 4 * offset


class StagedImage:
    """An int32 device buffer that each plan() rewrites from a pinned host image of it in one asynchronous
    copy (grouped attention's tables: meld.scheduler.split_reduce_plan.LaunchLayout); a copy per table from
    pageable memory would wait for the device each time. The device buffer never moves, so a CUDA graph
    that captured run() reads every later plan. The host image is rewritten only once the GPU has copied it
    (an event): plan() runs at most one copy ahead of the stream."""

    def __init__(self, device: torch.device, size: int):
        self.buf = torch.zeros(size, dtype=torch.int32, device=device)
        self._staging = torch.zeros(size, dtype=torch.int32, pin_memory=True)
        self.host = self._staging.numpy()
        self._copied = torch.cuda.Event()

    def wait(self) -> None:
        """Until the last upload() has been read: then `host` may be rewritten (or dropped)."""
        self._copied.synchronize()   # (at once before the first upload)

    def upload(self, n: int) -> None:
        """Copy the image's first n entries to the device on torch's current stream, without waiting (torch
        keeps the pinned block from reuse until the copy has read it, should this object go first)."""
        self.buf[:n].copy_(self._staging[:n], non_blocking=True)
        self._copied.record(torch.cuda.current_stream(self.buf.device))
