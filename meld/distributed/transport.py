"""Moving partial results between ranks: one protocol, carried by a command ring and a host proxy.

A transport moves data between *windows*: named arrays of one shape on every rank (symmetric memory). A
rank `src` issues towards a rank `dst`:

    put(src, dst, window, index, value)     dst's window[index] = value; returns at once (value is staged
                                            in src's own window[index], which must not change until it lands)
    fetch_add(src, dst, window, index, n)   dst's integer window[index] += n, returning the old value; it
                                            lands only after every put src issued to dst before it (one
                                            fence per destination: the completion travels behind the data)
    signal(src, dst, window, index, n)      dst's integer window[index] += n, no reply (the GPU proxy's
                                            signal); lands behind the puts before it, as a fetch-add does
    get(src, dst, window, index)            a copy of dst's window[index] (a remote read)
    quiet(src)                              returns once everything src issued has landed
    wait_for(src, ready, what)              blocks until ready(), run under the lock after each landing and
                                            issue, returns something other than None
    observe(seen)                           runs seen() the same way, without blocking, until it returns True

Each rank writes its operations as fixed-size records (`COMMAND`, 48 bytes) into its own `CommandRing`; a
host proxy thread takes them, cuts every put into network chunks of `chunk` elements (whatever the size
of the compute result), and lands them one at a time. That is the design of the proxy transport that
models inter-node RDMA, where a GPU kernel writes the records into pinned memory. `EmulatedTransport` is
it with ranks as threads of one process, copies between NumPy windows, random delays, and landing order
either in issue order per (src, dst) pair (`ordered`, as reliable connections deliver) or shuffled (as
SRD-like transports deliver). `fence=False` lets a fetch-add overtake the puts before it: a broken
transport, for the test that must catch one. It counts every element each put lands (`landed()`), so a
test can check that nothing was lost or written twice. Every wait gives up after `timeout` seconds with an
error that names the operation (the emulation's watchdog). The delays are slept on `clock`: the `time`
module, or a `FakeClock` that draws them without the wait (tests).
"""
from __future__ import annotations

import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, TypeVar

import numpy as np

T = TypeVar("T")

PUT, ADD, SIGNAL = 1, 2, 3    # SIGNAL: an add with no reply (the GPU proxy's; meld/distributed/proxy.py)
COMMAND = np.dtype([("op", "<u4"), ("window", "<u4"), ("dst", "<u4"), ("pad", "<u4"), ("start", "<u8"),
                    ("count", "<u8"), ("addend", "<i8"), ("ticket", "<u8")])   # 48 bytes, 8-byte aligned fields


class CommandRing:
    """One rank's commands to the proxy: records in one buffer, a tail the rank advances after writing a
    record and a head the proxy advances after taking records. Full: the rank waits (up to `timeout`)."""

    def __init__(self, rank: int, capacity: int = 1024, timeout: float = 30.0):
        self.rank, self.records, self.timeout = rank, np.zeros(capacity, dtype=COMMAND), timeout
        self.head = self.tail = 0

    def push(self, op: int, window: int, dst: int, start: int, count: int = 0, addend: int = 0, ticket: int = 0) -> None:
        deadline = time.monotonic() + self.timeout
        while self.tail - self.head >= len(self.records):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rank}: the command ring stayed full for {self.timeout} s")
            time.sleep(1e-5)
        self.records[self.tail % len(self.records)] = (op, window, dst, 0, start, count, addend, ticket)
        self.tail += 1            # after the record: the proxy reads only records below the tail

    def take(self) -> np.ndarray:
        """The records written since the last take (the proxy's side)."""
        head, tail = self.head, self.tail
        out = self.records[np.arange(head, tail) % len(self.records)]   # a copy: the rank may reuse the slots
        self.head = tail
        return out


@dataclass
class _Op:
    src: int
    dst: int
    seq: int                      # issue order on its (src, dst) channel
    window: int
    start: int                    # first flat element (put chunk) or the element added to
    count: int = 0
    addend: int = 0
    kind: int = PUT
    ticket: int = 0

    @property
    def fenced(self) -> bool:
        """An add (fetch-add or signal): it lands only after the puts issued before it on its channel."""
        return self.kind != PUT


class ProxySchedule:
    """A proxy's operations in flight: taken from command records, one list per (src, dst) channel in
    issue order, every put cut into network chunks of `chunk` units (elements or bytes, as the records
    count them). `landable()` is what may land next: the oldest operation of each channel (`ordered`), or
    any put and an add only once it is its channel's oldest (unordered; `fence=False` drops that rule, a
    broken transport). The GPU proxy (runtime/host/gpu_proxy.cpp) delivers by the same rules
    (tests/test_gpu_proxy_plan.py compares them)."""

    def __init__(self, ordered: bool, chunk: int, fence: bool = True):
        self.ordered, self.chunk, self.fence = ordered, chunk, fence
        self._pending: dict[tuple[int, int], list[_Op]] = {}
        self._seq: Counter = Counter()

    def add(self, src: int, records: np.ndarray) -> int:
        """Take `src`'s records; returns how many operations they became (puts count their chunks)."""
        made = 0
        for rec in records:
            dst, w, start, kind = int(rec["dst"]), int(rec["window"]), int(rec["start"]), int(rec["op"])
            if kind != PUT:
                ops = [_Op(src, dst, 0, w, start, addend=int(rec["addend"]), kind=kind, ticket=int(rec["ticket"]))]
            else:
                n = int(rec["count"])
                ops = [_Op(src, dst, 0, w, start + a, min(self.chunk, n - a)) for a in range(0, n, self.chunk)]
            for op in ops:
                op.seq = self._seq[(src, dst)]
                self._seq[(src, dst)] += 1
                self._pending.setdefault((src, dst), []).append(op)
            made += len(ops)
        return made

    def landable(self) -> list[_Op]:
        out = []
        for ops in self._pending.values():
            if not ops:
                continue
            if self.ordered:
                out.append(ops[0])
                continue
            first = ops[0].seq   # (a channel's list stays in issue order)
            out += [o for o in ops if not o.fenced or not self.fence or o.seq == first]
        return out

    def done(self, op: _Op) -> None:
        self._pending[(op.src, op.dst)].remove(op)


class FakeClock:
    """The emulation's delays without the wait: `sleep(s)` moves `now` on by s and only yields the CPU (a
    zero sleep), so the ranks' threads still run while the proxy "waits" and operations still pile up for
    it to land in random order. Landing without the yield reorders almost nothing: a count overtaking its
    data (tests/test_dist_emulation.py) was caught in 0 of 30 runs, against 27 of 30 with either clock."""

    def __init__(self) -> None:
        self.now = 0.0

    def sleep(self, seconds: float) -> None:
        self.now += seconds    # (only the proxy thread sleeps on it)
        time.sleep(0)


@dataclass
class _Ticket:
    landed: threading.Event = field(default_factory=threading.Event)
    old: int = 0


@dataclass
class _Waiter:
    """A rank blocked in `wait_for`: its condition (an observer: evaluated by whichever thread changed the windows,
    under the lock), and what it returned or raised, handed to the rank's own thread."""

    ready: Callable
    out: object = None
    error: BaseException | None = None
    done: bool = False

    def check(self) -> bool:
        try:
            self.out = self.ready()
        except BaseException as e:   # (raised in the waiting rank's thread, not the proxy's)
            self.error = e
        self.done = self.out is not None or self.error is not None
        return self.done


class EmulatedTransport:
    """Ranks as threads, one command ring each, a proxy thread landing their operations (module docstring)."""

    def __init__(self, world: int, ordered: bool = True, seed: int = 0, max_delay: float = 1e-4, chunk: int = 64,
                 fence: bool = True, timeout: float = 30.0, ring_capacity: int = 1024, clock=time):
        if world < 1 or chunk < 1:
            raise ValueError(f"world and chunk must be >= 1, got {world}, {chunk}")
        self.world, self.ordered, self.fence, self.chunk, self.timeout = world, ordered, fence, chunk, timeout
        self.rings = [CommandRing(r, ring_capacity, timeout) for r in range(world)]
        self._rng, self._max_delay, self._clock = random.Random(seed), max_delay, clock
        self._names: list[str] = []
        self._windows: list[list[np.ndarray]] = []
        self._schedule = ProxySchedule(ordered, chunk, fence)
        self._unlanded: Counter = Counter()          # per src: issued, not landed yet
        self._tickets: dict[tuple[int, int], _Ticket] = {}
        self._next_ticket: Counter = Counter()
        self._landed: list[list[np.ndarray]] = []    # [window][dst]: times a put landed each flat element
        self._observers: list[Callable[[], bool]] = []   # observe(): ranks in wait_for, and tests' watches
        self._cv = threading.Condition()             # the doorbell, and the lock of everything above
        self._closed = False
        self._proxy = threading.Thread(target=self._run_proxy, name="meld-emulated-proxy", daemon=True)
        self._proxy.start()

    # --- windows -----------------------------------------------------------------------------------------
    def window(self, name: str, shape: tuple[int, ...], dtype, fill) -> list[np.ndarray]:
        """Allocate `name` on every rank, filled with `fill` (NaN makes a slot never written visible)."""
        with self._cv:
            if name in self._names:
                raise ValueError(f"window {name!r} exists already")
            self._names.append(name)
            self._windows.append([np.full(shape, fill, dtype=dtype) for _ in range(self.world)])
            self._landed.append([np.zeros(self._windows[-1][0].size, dtype=np.int64) for _ in range(self.world)])
            return self._windows[-1]

    def landed(self) -> dict[str, np.ndarray]:
        """Every window's count of puts landed on each element: name -> [dst rank, flat element] (a copy)."""
        with self._cv:
            return {name: np.stack(counts) for name, counts in zip(self._names, self._landed)}

    def _at(self, window: str, rank: int, index) -> tuple[int, np.ndarray, int]:
        """(window id, rank's window[index] as a view, its first flat element). The index's last entry may be a
        slice of unit step (a put of the first n rows of a block) where the view is contiguous."""
        w = self._names.index(window)
        arr = self._windows[w][rank]
        index = index if isinstance(index, tuple) else (index,)
        view = arr[index]
        if index and isinstance(index[-1], slice):
            if index[-1].step not in (None, 1) or not view.flags.c_contiguous:
                raise ValueError(f"window {window!r}: index {index} is not a contiguous range")
            index = index[:-1] + (index[-1].start or 0,)
        return w, view, int(np.ravel_multi_index(index + (0,) * (arr.ndim - len(index)), arr.shape))

    # --- the operations ----------------------------------------------------------------------------------
    def put(self, src: int, dst: int, window: str, index, value) -> None:
        w, own, start = self._at(window, src, index)
        own[...] = value                              # staged in the rank's own window (symmetric layout)
        self._issue(src, PUT, w, dst, start, count=own.size)

    def fetch_add(self, src: int, dst: int, window: str, index, n: int) -> int:
        w, _, start = self._at(window, dst, index)
        with self._cv:
            ticket = self._next_ticket[src]
            self._next_ticket[src] += 1
            t = self._tickets[(src, ticket)] = _Ticket()
        self._issue(src, ADD, w, dst, start, addend=n, ticket=ticket)
        if not t.landed.wait(self.timeout):
            raise TimeoutError(f"rank {src}: fetch_add on rank {dst}'s {window}[{index}] did not land in "
                               f"{self.timeout} s")
        with self._cv:
            del self._tickets[(src, ticket)]
        return t.old

    def signal(self, src: int, dst: int, window: str, index, n: int) -> None:
        w, _, start = self._at(window, dst, index)
        self._issue(src, SIGNAL, w, dst, start, addend=n)

    def get(self, src: int, dst: int, window: str, index) -> np.ndarray:
        with self._cv:
            return self._at(window, dst, index)[1].copy()

    def observe(self, seen: Callable[[], bool]) -> None:
        """Call `seen()` under the transport's lock now and right after each later landing and issue, in the
        thread that made it (the proxy's, or a rank's), until it returns True: it sees every state the windows
        pass through, whatever the threads' timing (a signal that lands ahead of its data is seen before the
        data lands). `seen` must not raise (it may run in the proxy's thread)."""
        with self._cv:
            if not seen():
                self._observers.append(seen)

    def wait_for(self, src: int, ready: Callable[[], T | None], what: str) -> T:
        """Rank `src` blocks until `ready()` returns something other than None, and gets it. `ready` runs as an
        observer (`observe`: under the lock, at each change), so a rank that waits for large parts does not
        poll them (copies under the lock, in a loop, kept the proxy thread from landing anything for seconds:
        three ranks waiting on 256 x 128 parts); what it raises is raised here."""
        w = _Waiter(ready)
        with self._cv:
            self.observe(w.check)
            if not self._cv.wait_for(lambda: w.done, self.timeout):
                self._observers.remove(w.check)
                raise TimeoutError(f"rank {src}: {what} did not arrive in {self.timeout} s")
        if w.error is not None:
            raise w.error
        return w.out

    def _changed(self) -> None:
        """Under the lock, after the windows or the rings changed: the observers, then wake the waiting ranks."""
        for seen in list(self._observers):
            if seen():
                self._observers.remove(seen)
        self._cv.notify_all()

    def quiet(self, src: int) -> None:
        with self._cv:
            if not self._cv.wait_for(lambda: self._unlanded[src] == 0, self.timeout):
                raise TimeoutError(f"rank {src}: {self._unlanded[src]} operations did not land in {self.timeout} s")

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._proxy.join()

    def _issue(self, src: int, op: int, window: int, dst: int, start: int, **fields) -> None:
        with self._cv:
            self._unlanded[src] += 1
        self.rings[src].push(op, window, dst, start, **fields)
        with self._cv:
            self._changed()                           # the doorbell

    # --- the proxy ---------------------------------------------------------------------------------------
    def _take_commands(self) -> None:
        """Move every ring's new records into the channels."""
        for src, ring in enumerate(self.rings):
            records = ring.take()
            self._unlanded[src] += self._schedule.add(src, records) - len(records)   # a put lands as its chunks

    def _run_proxy(self) -> None:
        while True:
            with self._cv:
                def ready():
                    self._take_commands()
                    return self._closed or bool(self._schedule.landable())
                self._cv.wait_for(ready)
                if self._closed:
                    return
                op = self._pick(self._schedule.landable())
                delay = self._rng.random() * self._max_delay
            self._clock.sleep(delay)
            with self._cv:
                ticket = self._complete(op)
                self._changed()
            if ticket is not None:
                ticket.landed.set()

    def _pick(self, landable: list[_Op]) -> _Op:
        """The operation to land next (a routing layer picks by its modelled time: rails.RailTransport)."""
        return self._rng.choice(landable)

    def _complete(self, op: _Op) -> _Ticket | None:
        ticket = self._land(op)
        self._schedule.done(op)
        self._unlanded[op.src] -= 1
        return ticket

    def _land(self, op: _Op) -> _Ticket | None:
        dst = self._windows[op.window][op.dst].reshape(-1)
        if op.fenced:
            old = int(dst[op.start])
            dst[op.start] += op.addend
            if op.kind == SIGNAL:
                return None
            t = self._tickets[(op.src, op.ticket)]
            t.old = old
            return t
        dst[op.start:op.start + op.count] = self._windows[op.window][op.src].reshape(-1)[op.start:op.start + op.count]
        self._landed[op.window][op.dst][op.start:op.start + op.count] += 1
        return None
