"""A multi-node cluster as links between ranks: nodes of GPUs joined by NVLink, and one network rail per GPU
index across the nodes (GPU i of every node on rail i, as rail-optimised fabrics wire their NICs).

A transfer between two GPUs of one node crosses NVLink. Between nodes, one on the same rail crosses that
rail (the sender's NIC, one switch); one that changes rail crosses the spine (the tier between the rails'
switches, shared by a node's GPUs and often oversubscribed), unless it is routed hierarchically: over
NVLink to the GPU of its own node on the destination's rail, then over that rail (`route`). Each link has
a latency and a bandwidth; `link` names the queue a hop waits in (a GPU's NVLink port, a GPU's NIC, a
node's spine uplink). This is a model: the machines meld runs its tests on have no multi-node rails
(`meld.distributed.rails` runs the real transport protocol over it). Not the GPU's SM layout
(`meld.scheduler.topology`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    """A link that carries one chunk at a time: `latency` seconds per chunk plus its bytes / `bandwidth`
    (bytes per second)."""

    latency: float
    bandwidth: float

    def __post_init__(self):
        if not (isinstance(self.latency, (int, float)) and math.isfinite(self.latency) and self.latency >= 0):
            raise ValueError(f"latency must be a finite number of seconds >= 0, got {self.latency!r}")
        if not (isinstance(self.bandwidth, (int, float)) and math.isfinite(self.bandwidth) and self.bandwidth > 0):
            raise ValueError(f"bandwidth must be a finite number of bytes per second > 0, got {self.bandwidth!r}")

    def time(self, nbytes: int) -> float:
        """Seconds the link is busy with one chunk of `nbytes`."""
        return self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class Topology:
    """`nodes` x `gpus_per_node` ranks (rank = node * gpus_per_node + gpu) and their links (module docstring)."""

    nodes: int
    gpus_per_node: int
    nvlink: Link
    rail: Link
    spine: Link

    def __post_init__(self):
        for name in ("nodes", "gpus_per_node"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        for name in ("nvlink", "rail", "spine"):
            if not isinstance(getattr(self, name), Link):
                raise TypeError(f"{name} must be a Link, got {getattr(self, name)!r}")

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    def node(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def gpu(self, rank: int) -> int:
        """The rank's GPU index in its node, which is its rail."""
        return rank % self.gpus_per_node

    def relay(self, src: int, dst: int) -> int:
        """The GPU of src's node on dst's rail: where a hierarchical transfer changes from NVLink to the rail."""
        return self.node(src) * self.gpus_per_node + self.gpu(dst)

    def route(self, src: int, dst: int, hierarchical: bool = True) -> list[int]:
        """The ranks a transfer from src to dst passes, both ends included: direct, or through the relay
        when it leaves the node on another rail and `hierarchical`."""
        for name, r in (("src", src), ("dst", dst)):
            if not 0 <= r < self.world:
                raise ValueError(f"{name} must be a rank in [0, {self.world}), got {r!r}")
        hop = self.relay(src, dst)
        if hierarchical and self.node(src) != self.node(dst) and hop != src:
            return [src, hop, dst]
        return [src, dst]

    def link(self, a: int, b: int) -> tuple[tuple, Link]:
        """The queue a hop from a to b waits in, and its link: a's NVLink port inside a node, a's NIC on its
        rail between nodes, a's node's spine uplink when the hop changes rail."""
        if self.node(a) == self.node(b):
            return ("nvlink", a), self.nvlink
        if self.gpu(a) == self.gpu(b):
            return ("rail", a), self.rail
        return ("spine", self.node(a)), self.spine
