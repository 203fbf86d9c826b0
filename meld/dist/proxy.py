"""The proxy transport on a GPU: the model of inter-node RDMA that runs on the GPUs of one node.

A kernel that may not store into a peer's memory (as between nodes) writes its puts and signals as
48-byte records (`transport.COMMAND`) into a ring in pinned host memory (templates/common.cuh,
`proxy_push`). `GpuProxy` is the host thread that takes them, through the same `ProxySchedule` as the
CPU emulation (channels per destination, puts cut into network chunks independent of the compute tile,
`ordered` delivery in issue order or unordered, shuffled), and lands them with copies from this rank's
symmetric window into the destination's at the same offset: peer copies over NVLink here, where a NIC's
RDMA writes would go between nodes (this node has no RDMA device; an NVSHMEM or ibverbs backend would
take the same records). A signal adds to a running total per (destination, slot), which the proxy writes
into the destination after every put before it on that channel has completed (one fence per
destination; unordered puts run on two copy streams, and the signal's stream waits for both).
"""
from __future__ import annotations

import random
import threading
import time
from collections import Counter

import numpy as np
import torch

from .transport import COMMAND, PUT, SIGNAL, ProxySchedule


class GpuProxy:
    """One rank's proxy for `window` (a `SymmetricWindow`): the ring the kernel writes, and the thread that
    lands its records. `ring_params()` are the kernel's parameters for it. Idle, the thread sleeps `poll_s`
    seconds between polls of the ring (a sleep releases the GIL that the rank's own Python needs)."""

    def __init__(self, window, ordered: bool = True, chunk_bytes: int = 64 << 10, capacity: int = 4096,
                 seed: int = 0, poll_s: float = 1e-5):
        if chunk_bytes < 1 or capacity < 2:
            raise ValueError(f"chunk_bytes and capacity must be >= 1 and >= 2, got {chunk_bytes}, {capacity}")
        self.window, self.ordered, self.capacity, self.poll_s = window, ordered, capacity, poll_s
        dev = window.local.device
        self._records_t = torch.zeros(capacity * COMMAND.itemsize, dtype=torch.uint8, pin_memory=True)
        self.records = self._records_t.numpy().view(COMMAND)
        self._head_t = torch.zeros(1, dtype=torch.int64, pin_memory=True)   # records taken (the kernel reads it)
        self._head = self._head_t.numpy()
        self._tail = torch.zeros(1, dtype=torch.int64, device=dev)          # slots claimed (the kernel's counter)
        self._values_t = torch.zeros(capacity, dtype=torch.int64, pin_memory=True)   # signal totals in flight
        nbytes = window.local.numel()
        self._bufs = [window.local if r == window.rank else window.handle.get_buffer(r, (nbytes,), torch.uint8, 0)
                      for r in range(window.world)]
        self._streams = [torch.cuda.Stream(dev) for _ in range(1 if ordered else 2)]
        self._schedule = ProxySchedule(ordered, chunk_bytes)
        self._totals: Counter = Counter()
        self._signals = 0
        self._rng = random.Random(seed)
        self.landed_ops = 0
        self.error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"meld-proxy-{window.rank}", daemon=True)
        self._thread.start()

    def ring_params(self) -> dict[str, int]:
        return dict(xring=self._records_t.data_ptr(), xring_tail=self._tail.data_ptr(),
                    xring_head=self._head_t.data_ptr(), xring_cap=self.capacity)

    def close(self) -> None:
        self._closed = True
        self._thread.join()

    def _take(self, head: int) -> int:
        """Records from `head` on whose tickets are written; returns the new head."""
        batch = []
        while True:
            rec = self.records[head % self.capacity]
            if int(rec["ticket"]) != head + 1:
                break
            batch.append(rec.copy())   # the ticket was read first: the fields are the record's (x86 keeps load order)
            head += 1
        if batch:
            self._schedule.add(self.window.rank, np.array(batch, dtype=COMMAND))
            self._head[0] = head       # the slots are free for the kernel again
        return head

    def _run(self) -> None:
        try:
            torch.cuda.set_device(self.window.local.device)
            head = 0
            while not self._closed:
                head = self._take(head)
                # Ordered: everything taken, in issue order (one stream keeps it); unordered: what may land
                # now, shuffled over the copy streams.
                ops = self._schedule.pending() if self.ordered else self._schedule.landable()
                if not ops:
                    if self.poll_s:
                        time.sleep(self.poll_s)
                    continue
                if not self.ordered:
                    self._rng.shuffle(ops)
                self._land(ops)
                self._schedule.done_all(ops)
                self.landed_ops += len(ops)
        except BaseException as e:   # noqa: BLE001 - the kernel's watchdog reports the stall; this says why
            self.error = e

    def _land(self, ops) -> None:
        """Issue `ops` in their order: puts as copies on their stream, each signal after every put issued
        before it (on any stream) completes."""
        src = self._bufs[self.window.rank]
        for op in ops:
            if op.kind == PUT:
                stream = self._streams[0] if self.ordered else self._rng.choice(self._streams)
                with torch.cuda.stream(stream):   # (copy_ crosses devices; the peer's view is on the peer)
                    self._bufs[op.dst][op.start:op.start + op.count].copy_(src[op.start:op.start + op.count],
                                                                           non_blocking=True)
                continue
            if op.kind != SIGNAL:
                raise ValueError(f"the GPU proxy lands puts and signals, got a record of op {op.kind}")
            stream = self._streams[0]
            for other in self._streams[1:]:    # every put before it, on either stream, completes first
                stream.wait_stream(other)
            key = (op.dst, op.start)
            self._totals[key] += op.addend
            slot = self._signals % self.capacity   # a pinned staging slot per signal in flight
            self._signals += 1
            self._values_t[slot] = self._totals[key]
            with torch.cuda.stream(stream):
                self._bufs[op.dst][op.start:op.start + 8].copy_(self._values_t[slot:slot + 1].view(torch.uint8),
                                                                non_blocking=True)
