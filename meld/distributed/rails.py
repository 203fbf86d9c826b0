"""Rail-aware hierarchical movement: the transport protocol routed over a modelled multi-node topology.

Why hierarchical: in a rail-optimised cluster GPU i of every node hangs off rail i's switch. A transfer
that changes rail crosses the spine, which a node's GPUs share and which is often oversubscribed, and
each pair of ranks sending on its own pays a network chunk's latency for every piece of its own data. Routed
hierarchically, a transfer from s to d on another node goes over NVLink to the GPU of s's node on d's rail
(the relay, `Topology.relay`), which sends it over its own rail; the relay gathers everything its node has
for that peer into one stream, so one rail chunk carries several ranks' data. Transfers inside a node go
direct over NVLink. It costs an NVLink hop and puts the relayed bytes on the relay's rail: where the spine
is as fast as that, flat routes win (tests/test_rails.py shows both sides).

`RailTransport` is `EmulatedTransport` (the one protocol: put / fetch_add / signal / get / quiet, command
rings, a proxy) with a routing layer in its proxy: each record becomes a hop on its first link; a hop that
lands on a relay is sent on from there (the relay's proxy forwards it, as a GPU's proxy does in PXN-style
designs). Every hop is a channel of the base transport's `ProxySchedule` and obeys its rules (ordered, or
shuffled with adds fenced behind the puts before them), and a relay sends on what it received in the order
it landed, so a signal or fetch-add still lands after every put before it from the same source, relay or
not. `relay_fence=False` makes a broken relay that sends an add ahead of the data it still holds for the
same peer (the test that must catch one). A channel packs its data into network chunks of `chunk_bytes`,
whatever the size of the puts (the producer's tile): a put still waiting for its link is topped up with
data that arrives behind it, from whichever rank. (A relayed put lands from its origin's window, which
the protocol keeps unchanged until it has landed; a real relay would hold a copy in a staging buffer.)

Modelled time: every hop is charged latency + bytes / bandwidth on its link's clock (`Topology.link`: a
link carries one chunk at a time), starting when the link is free and its data is at the sender; the
proxy lands the chunk that would start first (ties at random: chunks of one put still land out of order
when unordered). A rank's operations start at its clock, which moves to the landing it waited for
(`wait_for`, `quiet`, `fetch_add`; a rank that polls with `get` is not followed). `makespan` is the last
landing. `all_to_all_time` predicts it in closed form. This hardware has no multi-node rails: the topology
is modelled, the protocol is the real one.
"""
from __future__ import annotations

import dataclasses
import time
from collections import Counter, defaultdict, deque
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from .topology import Link, Topology
from .transport import PUT, EmulatedTransport, ProxySchedule, _Op, _Ticket

ADD_BYTES = 8   # an add on the wire: one 64-bit word


@dataclass
class _Hop:
    """One network chunk on the channel src -> dst (one hop of a route): pieces of puts (`_Op`s from their
    origin to their final rank), or one add; `ready`: modelled time its contents are at src."""

    src: int
    dst: int
    kind: int
    ready: float
    pieces: list[_Op]
    nbytes: int
    queue: tuple | None       # its link's queue (`Topology.link`; None: a rank's put to itself, free)
    link: Link | None
    seq: int = 0

    @property
    def fenced(self) -> bool:
        return self.kind != PUT


class _HopSchedule(ProxySchedule):
    """`ProxySchedule`'s channels and landing rules over hops the routing layer appends already cut."""

    def __init__(self, ordered: bool, fence: bool):
        super().__init__(ordered, chunk=1, fence=fence)   # (the chunk is unused: `add` is not)

    def append(self, hop: _Hop, jump: bool = False) -> None:
        """At the channel's end, or ahead of everything on it (`jump`: a broken relay's add)."""
        ops = self._pending.setdefault((hop.src, hop.dst), [])
        if jump and ops:
            hop.seq = ops[0].seq - 1
            ops.insert(0, hop)
            return
        hop.seq = self._seq[(hop.src, hop.dst)]
        self._seq[(hop.src, hop.dst)] += 1
        ops.append(hop)

    def last(self, src: int, dst: int) -> _Hop | None:
        ops = self._pending.get((src, dst))
        return ops[-1] if ops else None


class RailTransport(EmulatedTransport):
    """`EmulatedTransport` over `topology`'s links (module docstring): hierarchical routes, or `hierarchical=False`
    for flat ones (every pair on its own link, crossing rails through the spine). `chunks`, `bytes` and
    `gathered` count per link queue the chunks, bytes and chunks carrying more than one origin's data."""

    def __init__(self, topology: Topology, hierarchical: bool = True, chunk_bytes: int = 64 << 10,
                 ordered: bool = True, seed: int = 0, max_delay: float = 0.0, fence: bool = True,
                 relay_fence: bool = True, timeout: float = 30.0, ring_capacity: int = 1024, clock=time):
        if not isinstance(topology, Topology):
            raise TypeError(f"topology must be a Topology, got {topology!r}")
        if not isinstance(chunk_bytes, int) or chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be an int >= 1, got {chunk_bytes!r}")
        self.topology, self.hierarchical, self.chunk_bytes, self.relay_fence = topology, hierarchical, chunk_bytes, relay_fence
        self.makespan = 0.0
        self.chunks: Counter = Counter()
        self.bytes: Counter = Counter()
        self.gathered: Counter = Counter()
        self._free: dict[tuple, float] = {}               # link queue -> when it is free
        self._now = [0.0] * topology.world                # each rank's clock
        self._issued_at = [deque() for _ in range(topology.world)]   # clocks of records not taken yet
        self._last_end = 0.0
        self._held = False
        super().__init__(topology.world, ordered, seed, max_delay, chunk_bytes, fence, timeout, ring_capacity, clock)
        with self._cv:   # (the proxy thread reads the schedule only under the lock)
            self._schedule = _HopSchedule(ordered, fence)

    # --- the ranks' side: records carry the issuing rank's clock ------------------------------------------
    def _issue(self, src: int, op: int, window: int, dst: int, start: int, **fields) -> None:
        with self._cv:
            self._issued_at[src].append(self._now[src])
        super()._issue(src, op, window, dst, start, **fields)

    def wait_for(self, src, ready, what):
        def timed():
            out = ready()
            if out is not None:
                self._now[src] = max(self._now[src], self._last_end)
            return out
        return super().wait_for(src, timed, what)

    def quiet(self, src: int) -> None:
        super().quiet(src)
        with self._cv:
            self._now[src] = max(self._now[src], self._last_end)

    @contextmanager
    def hold(self):
        """The proxy takes no records inside: operations issued in it (from any thread, each with its rank's
        clock) reach their links together when it ends, as they would if the ranks issued them at one
        instant. Without it a rank whose thread starts late finds its link already given to a chunk that
        starts later in modelled time, and the makespan depends on the threads' timing."""
        with self._cv:
            self._held = True
        try:
            yield
        finally:
            with self._cv:
                self._held = False
                self._cv.notify_all()

    # --- the proxy: routing and modelled time -------------------------------------------------------------
    def _take_commands(self) -> None:
        if self._held:
            return
        for src, ring in enumerate(self.rings):
            for rec in ring.take():
                op = _Op(src, int(rec["dst"]), 0, int(rec["window"]), int(rec["start"]), int(rec["count"]),
                         int(rec["addend"]), int(rec["op"]), int(rec["ticket"]))
                if op.kind == PUT:
                    self._unlanded[src] += op.count - 1    # counted in elements: a put is cut anywhere
                self._send(src, op, self._issued_at[src].popleft())

    def _send(self, at: int, op: _Op, ready: float, jump: bool = False) -> None:
        """Queue `op` (a put piece or an add, on its way from op.src to op.dst) on its next hop from `at`."""
        path = self.topology.route(op.src, op.dst, self.hierarchical)
        nxt = path[path.index(at) + 1]
        queue, link = (None, None) if at == nxt else self.topology.link(at, nxt)
        if op.kind != PUT:
            self._schedule.append(_Hop(at, nxt, op.kind, ready, [op], ADD_BYTES, queue, link), jump)
            return
        size, done = self._windows[op.window][0].itemsize, 0
        last = self._schedule.last(at, nxt)
        if last is not None and last.kind == PUT and self._start(last) >= ready:   # still waiting: top it up
            done = min(op.count, (self.chunk_bytes - last.nbytes) // size)
            if done > 0:
                last.pieces.append(dataclasses.replace(op, count=done))
                last.nbytes += done * size
                last.ready = max(last.ready, ready)
        per = max(1, self.chunk_bytes // size)
        for a in range(done, op.count, per):
            n = min(per, op.count - a)
            self._schedule.append(_Hop(at, nxt, PUT, ready, [dataclasses.replace(op, start=op.start + a, count=n)],
                                       n * size, queue, link))

    def _start(self, hop: _Hop) -> float:
        return max(hop.ready, self._free.get(hop.queue, 0.0))

    def _pick(self, landable: list[_Hop]) -> _Hop:
        starts = [self._start(h) for h in landable]
        first = min(starts)
        return self._rng.choice([h for h, s in zip(landable, starts) if s == first])

    def _complete(self, hop: _Hop) -> _Ticket | None:
        end = self._start(hop) + (hop.link.time(hop.nbytes) if hop.link else 0.0)
        if hop.queue is not None:
            self._free[hop.queue] = end
            self.chunks[hop.queue] += 1
            self.bytes[hop.queue] += hop.nbytes
            self.gathered[hop.queue] += len({p.src for p in hop.pieces}) > 1
        self.makespan, self._last_end = max(self.makespan, end), end
        self._schedule.done(hop)
        ticket = None
        for piece in hop.pieces:
            if piece.dst != hop.dst:    # at a relay: on to the next hop, behind what it holds for that peer
                self._send(hop.dst, piece, end, jump=piece.fenced and not self.relay_fence)
                continue
            ticket = self._land(piece) or ticket
            self._unlanded[piece.src] -= piece.count if piece.kind == PUT else 1
            if ticket is not None:
                self._now[piece.src] = max(self._now[piece.src], end)   # (the fetch-add's rank waits for it)
        return ticket


def all_to_all_time(topology: Topology, nbytes, chunk_bytes: int, hierarchical: bool = True) -> float:
    """Predicted makespan of rank s putting nbytes[s][d] bytes to every rank d at once over `RailTransport`,
    each rank issuing its relayed transfers first (the longest route starts first). A link is busy with its
    channels' bytes cut into chunks (chunks x latency + bytes / bandwidth; a relay's channel carries its
    node's data for that peer as one stream). It ends no earlier than that busy time after 0, nor than the
    busy time of what it relays after the first relayed chunk has arrived, nor than one chunk after the
    last has (the feeding link busy with what it sends on); the makespan is the last end."""
    world = topology.world
    nbytes = np.asarray(nbytes)
    if nbytes.shape != (world, world) or (nbytes < 0).any():
        raise ValueError(f"nbytes must be a [{world}, {world}] array of byte counts >= 0, got {nbytes!r}")
    if not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be an int >= 1, got {chunk_bytes!r}")
    carried, relayed, onward = Counter(), Counter(), Counter()   # channel -> bytes; relayed; going further
    feeds = defaultdict(set)                                     # channel -> the channels feeding it
    for s in range(world):
        for d in range(world):
            if s != d and nbytes[s, d] > 0:
                path = topology.route(s, d, hierarchical)
                hops = list(zip(path, path[1:]))
                for h in hops:
                    carried[h] += int(nbytes[s, d])
                for a, b in zip(hops, hops[1:]):
                    feeds[b].add(a)
                    relayed[b] += int(nbytes[s, d])
                    onward[a] += int(nbytes[s, d])
    on_link = defaultdict(list)
    for c in carried:
        on_link[topology.link(*c)[0]].append(c)

    def busy(link, n: int) -> float:
        full, rest = divmod(n, chunk_bytes)
        return full * link.time(chunk_bytes) + (link.time(rest) if rest else 0.0)

    makespan = 0.0
    for key, chans in on_link.items():
        link = topology.link(*chans[0])[1]
        t = sum(busy(link, carried[c]) for c in chans)
        fed = [(topology.link(*f), c) for c in chans for f in feeds[c]]   # ((queue, link) of the feeder, channel)
        if fed:
            first = min(f.time(min(chunk_bytes, onward[g])) for (q, f), _ in fed for g in on_link[q] if onward[g])
            last = max(busy(f, sum(onward[g] for g in on_link[q])) + link.time(min(chunk_bytes, relayed[c]))
                       for (q, f), c in fed)
            t = max(t, first + sum(busy(link, relayed[c]) for c in chans), last)
        makespan = max(makespan, t)
    return makespan
