"""Moving partial results between ranks: one interface, and the CPU emulation CI tests the protocol on.

A transport moves data into *windows*: named arrays of one shape on every rank (symmetric memory). A rank
`src` issues towards a rank `dst`:

    put(src, dst, window, index, value)     dst's window[index] = value; returns at once
    fetch_add(src, dst, window, index, n)   dst's integer window[index] += n, returning the old value; it
                                            lands only after every put src issued to dst before it (one
                                            fence per destination: the completion travels behind the data)
    get(src, dst, window, index)            a copy of dst's window[index] (a remote read)
    quiet(src)                              returns once everything src issued has landed

`EmulatedTransport` runs the ranks as threads of one process. A proxy thread lands the queued operations
one at a time after random delays: in issue order per (src, dst) pair (`ordered`, as RDMA reliable
connections deliver), or in random order (unordered, as SRD-like transports deliver); either way a put
travels as chunks of `chunk` elements. `fence=False` lets a fetch-add overtake the puts before it: a broken
transport, for the test that must catch one. It counts every element each put lands, so a test can check
that nothing was lost or written twice. Every wait gives up after `timeout` seconds with an error that
names the operation (the emulation's watchdog).
"""
from __future__ import annotations

import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class _Op:
    src: int
    dst: int
    seq: int                      # issue order on its (src, dst) channel
    window: str
    index: Any
    value: Any = None             # put: (flat start, the chunk's values); add: the addend
    add: bool = False
    landed: threading.Event = field(default_factory=threading.Event)
    old: int = 0


class EmulatedTransport:
    """Ranks as threads, a proxy thread landing their operations (module docstring)."""

    def __init__(self, world: int, ordered: bool = True, seed: int = 0, max_delay: float = 1e-4, chunk: int = 64,
                 fence: bool = True, timeout: float = 30.0):
        if world < 1 or chunk < 1:
            raise ValueError(f"world and chunk must be >= 1, got {world}, {chunk}")
        self.world, self.ordered, self.fence, self.chunk, self.timeout = world, ordered, fence, chunk, timeout
        self._rng, self._max_delay = random.Random(seed), max_delay
        self._windows: dict[str, list[np.ndarray]] = {}
        self._pending: dict[tuple[int, int], list[_Op]] = {}
        self._seq: Counter = Counter()
        self._unlanded: Counter = Counter()     # per src
        self.landed_elements: Counter = Counter()   # (dst, window, flat element) -> times a put landed it
        self._cv = threading.Condition()
        self._closed = False
        self._proxy = threading.Thread(target=self._run_proxy, name="meld-emulated-proxy", daemon=True)
        self._proxy.start()

    # --- windows -----------------------------------------------------------------------------------------
    def window(self, name: str, shape: tuple[int, ...], dtype, fill) -> list[np.ndarray]:
        """Allocate `name` on every rank, filled with `fill` (NaN makes a slot never written visible)."""
        with self._cv:
            self._windows[name] = [np.full(shape, fill, dtype=dtype) for _ in range(self.world)]
            return self._windows[name]

    # --- the operations ----------------------------------------------------------------------------------
    def put(self, src: int, dst: int, window: str, index, value) -> None:
        value = np.ascontiguousarray(value, dtype=self._windows[window][dst].dtype).reshape(-1)
        with self._cv:   # cut into network chunks, whatever the size of the compute result
            for start in range(0, max(len(value), 1), self.chunk):
                self._enqueue(_Op(src, dst, 0, window, index, (start, value[start:start + self.chunk].copy())))

    def fetch_add(self, src: int, dst: int, window: str, index, n: int) -> int:
        op = _Op(src, dst, 0, window, index, n, add=True)
        with self._cv:
            self._enqueue(op)
        if not op.landed.wait(self.timeout):
            raise TimeoutError(f"rank {src}: fetch_add on rank {dst}'s {window}[{index}] did not land in "
                               f"{self.timeout} s")
        return op.old

    def get(self, src: int, dst: int, window: str, index) -> np.ndarray:
        with self._cv:
            return self._windows[window][dst][index].copy()

    def quiet(self, src: int) -> None:
        with self._cv:
            if not self._cv.wait_for(lambda: self._unlanded[src] == 0, self.timeout):
                raise TimeoutError(f"rank {src}: {self._unlanded[src]} operations did not land in {self.timeout} s")

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._proxy.join()

    # --- the proxy ---------------------------------------------------------------------------------------
    def _enqueue(self, op: _Op) -> None:
        ch = (op.src, op.dst)
        op.seq = self._seq[ch]
        self._seq[ch] += 1
        self._pending.setdefault(ch, []).append(op)
        self._unlanded[op.src] += 1
        self._cv.notify_all()

    def _landable(self) -> list[_Op]:
        out = []
        for ops in self._pending.values():
            if not ops:
                continue
            if self.ordered:
                out.append(ops[0])
                continue
            first = min(o.seq for o in ops)
            out += [o for o in ops if not o.add or not self.fence or o.seq == first]
        return out

    def _run_proxy(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._closed or self._landable())
                if self._closed:
                    return
                op = self._rng.choice(self._landable())
                delay = self._rng.random() * self._max_delay
            time.sleep(delay)
            with self._cv:
                self._land(op)
                self._pending[(op.src, op.dst)].remove(op)
                self._unlanded[op.src] -= 1
                self._cv.notify_all()
            op.landed.set()

    def _land(self, op: _Op) -> None:
        target = self._windows[op.window][op.dst]
        if op.add:
            op.old = int(target[op.index])
            target[op.index] += op.value
            return
        start, values = op.value
        flat = target[op.index].reshape(-1)          # a view: windows are C-contiguous, index picks leading axes
        flat[start:start + len(values)] = values
        for e in range(start, start + len(values)):
            self.landed_elements[(op.dst, op.window, op.index, e)] += 1
