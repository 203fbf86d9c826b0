"""Adaptive compute/communication split of a persistent kernel's CTA slots, in modelled time.

Why: a fused kernel that both computes tiles and moves them (GEMM + reduce-scatter, dispatch + expert GEMM)
gives each CTA slot a role, and the best fixed number of communication slots depends on the shape: a few
slots saturate a link, so more only take SMs from the GEMM, while a small GEMM leaves the link the critical
path. mKernel's authors report the best fixed count anywhere from 2 to 64 SMs. A controller that reads the slots'
progress counters during the launch and publishes a target count removes that per-shape tuning.

The protocol (what a GPU build runs; `simulate` runs it over modelled slots):
- Counters in global memory: per role, the tasks finished and the time they took; the communication tasks
  finished since the last estimate and their time; the published `target` (communication slots).
- A slot that finishes a task adds to the counters, then takes its next role: communication while fewer than
  `target` slots hold it, else compute. A slot whose role has no ready task takes a ready task of the other
  role (no slot idles while work is ready), so a target can cost time only where both roles have work.
- Every `period` finished tasks, the slot whose finish crossed the boundary re-estimates (`SplitController`)
  and publishes a new target.

The estimate is mKernel's: with C_comp the mean time of a compute task so far, C_comm that of the communication
tasks of the last period (at the concurrency and link load they ran under) and R_comp, R_comm the tasks left,
the two roles finish together with slots x R_comm C_comm / (R_comp C_comp + R_comm C_comm) communication
slots; the published target moves halfway there (a target that jumps each period swings the per-task cost it
is computed from). Where the link saturates, C_comm grows with the slots holding the role, so the target
stops where more of them would only lengthen each task.

Modelled time: a compute task takes `compute_s`; a communication task `latency_s` and then its bytes, the
communication tasks moving at once sharing the link (each at min(slot_rate, link_rate / moving)). The GPU
machines here lend one GPU at a time: the slots and the link are modelled, the protocol is the one a kernel
would run. `run_split_gemm_rs` replays a schedule on emulated ranks with real data through `EmulatedTransport`.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

COMPUTE, COMM = 0, 1


@dataclass(frozen=True)
class SlotCosts:
    """Modelled costs (seconds, bytes, bytes per second): module docstring."""

    compute_s: float
    latency_s: float
    slot_rate: float
    link_rate: float

    def __post_init__(self):
        for name in ("compute_s", "latency_s", "slot_rate", "link_rate"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0) or (name != "latency_s" and v == 0):
                raise ValueError(f"{name} must be a finite number {'>= 0' if name == 'latency_s' else '> 0'}, "
                                 f"got {v!r}")


@dataclass(frozen=True)
class SplitWorkload:
    """`compute` tasks and one communication task per entry of `comm_bytes`. Dependencies, at most one kind:
    `comm_after[j]`, the compute task communication task j sends the result of (GEMM + reduce-scatter), or
    `compute_after[i]`, the communication task compute task i needs the data of (dispatch + GEMM)."""

    compute: int
    comm_bytes: tuple[int, ...]
    comm_after: Optional[tuple[int, ...]] = None
    compute_after: Optional[tuple[int, ...]] = None

    def __post_init__(self):
        if not isinstance(self.compute, int) or self.compute < 0:
            raise ValueError(f"compute must be an int >= 0, got {self.compute!r}")
        if any(not isinstance(b, (int, np.integer)) or b < 0 for b in self.comm_bytes):
            raise ValueError(f"comm_bytes must be byte counts >= 0, got {self.comm_bytes!r}")
        if self.comm_after is not None and self.compute_after is not None:
            raise ValueError("give comm_after or compute_after, not both")
        for name, deps, n, m in (("comm_after", self.comm_after, len(self.comm_bytes), self.compute),
                                 ("compute_after", self.compute_after, self.compute, len(self.comm_bytes))):
            if deps is not None and (len(deps) != n or any(not 0 <= d < m for d in deps)):
                raise ValueError(f"{name} must hold {n} task indices in [0, {m}), got {deps!r}")

    @property
    def comm(self) -> int:
        return len(self.comm_bytes)


@dataclass
class SplitController:
    """The estimate of the module docstring over the counters; `target` is what the slots read."""

    slots: int
    target: int
    period: int
    history: list[tuple[float, int]] = field(default_factory=list)   # (time, target) as published

    def __post_init__(self):
        if not isinstance(self.slots, int) or self.slots < 2:
            raise ValueError(f"slots must be an int >= 2 (one slot a role), got {self.slots!r}")
        if not isinstance(self.period, int) or self.period < 1:
            raise ValueError(f"period must be an int >= 1, got {self.period!r}")
        if not isinstance(self.target, int) or not 1 <= self.target < self.slots:
            raise ValueError(f"target must be an int in [1, {self.slots}), got {self.target!r}")

    def update(self, now: float, counters: "Counters") -> None:
        """Re-estimate from the counters, publish, and start the next period's communication sample."""
        if counters.done[COMPUTE] and counters.recent_comm:
            comp = counters.left[COMPUTE] * counters.time[COMPUTE] / counters.done[COMPUTE]
            comm = counters.left[COMM] * counters.recent_time / counters.recent_comm
            if comp + comm > 0:
                aim = self.slots * comm / (comp + comm)
                self.target = min(self.slots - 1, max(1, round((self.target + aim) / 2)))
        counters.recent_comm, counters.recent_time = 0, 0.0
        self.history.append((now, self.target))


@dataclass
class Counters:
    """The slots' progress counters (module docstring): per role tasks left, finished and their summed time;
    the communication tasks finished since the last estimate and their time."""

    left: list[int]
    done: list[int] = field(default_factory=lambda: [0, 0])
    time: list[float] = field(default_factory=lambda: [0.0, 0.0])
    recent_comm: int = 0
    recent_time: float = 0.0

    def finish(self, kind: int, seconds: float) -> None:
        self.left[kind] -= 1
        self.done[kind] += 1
        self.time[kind] += seconds
        if kind == COMM:
            self.recent_comm += 1
            self.recent_time += seconds


@dataclass(frozen=True)
class TaskRun:
    kind: int
    index: int
    slot: int
    start: float
    end: float


@dataclass
class SplitRun:
    """A simulated launch: every task's run, the makespan, the controller's published targets."""

    runs: list[TaskRun]
    makespan: float
    targets: list[tuple[float, int]]

    def order(self) -> list[TaskRun]:
        """The tasks in the order they finished (a replay in this order meets every dependency)."""
        return sorted(self.runs, key=lambda t: (t.end, t.kind == COMPUTE, t.index))


def simulate(work: SplitWorkload, costs: SlotCosts, slots: int, target: int, adaptive: bool = True,
             period: Optional[int] = None) -> SplitRun:
    """Run `work` on `slots` modelled CTA slots under the protocol of the module docstring: with a fixed
    `target` (adaptive=False) or one the controller re-estimates every `period` finished tasks (default: a
    round of the slots), starting from `target`."""
    if not isinstance(work, SplitWorkload):
        raise TypeError(f"work must be a SplitWorkload, got {work!r}")
    if not isinstance(costs, SlotCosts):
        raise TypeError(f"costs must be a SlotCosts, got {costs!r}")
    ctl = SplitController(slots, target, period if period is not None else slots)
    waiting = [np.zeros(work.compute, dtype=np.int64), np.zeros(work.comm, dtype=np.int64)]
    dependents: list[list[list[int]]] = [[[] for _ in range(work.compute)], [[] for _ in range(work.comm)]]
    for kind, deps in ((COMM, work.comm_after), (COMPUTE, work.compute_after)):
        for task_index, needed in enumerate(deps or ()):
            waiting[kind][task_index] += 1
            dependents[1 - kind][needed].append(task_index)
    ready = [deque(np.flatnonzero(w == 0).tolist()) for w in waiting]
    counters = Counters(left=[work.compute, work.comm])
    # Each slot's task: [kind, index, start, end of its fixed part, bytes still to move], or None.
    task: list[Optional[list]] = [None] * slots
    runs: list[TaskRun] = []
    now = 0.0
    ctl.history.append((0.0, ctl.target))
    while counters.left[COMPUTE] or counters.left[COMM]:
        held = sum(1 for t in task if t is not None and t[0] == COMM)
        for s in range(slots):
            if task[s] is not None:
                continue
            want = COMM if held < ctl.target else COMPUTE
            kind = want if ready[want] else 1 - want
            if not ready[kind]:
                continue
            i = ready[kind].popleft()
            if kind == COMPUTE:
                task[s] = [COMPUTE, i, now, now + costs.compute_s, 0.0]
            else:
                task[s] = [COMM, i, now, now + costs.latency_s, float(work.comm_bytes[i])]
                held += 1
        moving = [t for t in task if t is not None and t[3] <= now and t[4] > 0]
        rate = min(costs.slot_rate, costs.link_rate / len(moving)) if moving else 0.0
        # (Something always runs: a dependency points one way only, so some task of the left ones is ready.)
        nxt = min(t[3] if t[3] > now or t[4] == 0 else now + t[4] / rate for t in task if t is not None)
        for t in moving:
            t[4] = 0.0 if now + t[4] / rate <= nxt else t[4] - rate * (nxt - now)
        now = nxt
        for s, t in enumerate(task):
            if t is None or t[3] > now or t[4] > 0:
                continue
            kind, i, start = t[0], t[1], t[2]
            task[s] = None
            runs.append(TaskRun(kind, i, s, start, now))
            counters.finish(kind, now - start)
            for d in dependents[kind][i]:
                waiting[1 - kind][d] -= 1
                if waiting[1 - kind][d] == 0:
                    ready[1 - kind].append(d)
            if adaptive and len(runs) % ctl.period == 0:
                ctl.update(now, counters)
    return SplitRun(runs, now, ctl.history)


def best_fixed(work: SplitWorkload, costs: SlotCosts, slots: int, targets: Optional[Sequence[int]] = None
               ) -> tuple[int, float, dict[int, float]]:
    """The fixed targets (default every one from 1 to slots - 1): the best, its makespan, and every makespan."""
    spans = {n: simulate(work, costs, slots, n, adaptive=False).makespan for n in (targets or range(1, slots))}
    best = min(spans, key=spans.get)
    return best, spans[best], spans


def gemm_rs_workload(tiles: int, world: int, rank: int, tile_bytes: int) -> SplitWorkload:
    """Rank `rank`'s tasks of a GEMM whose output tiles are reduce-scattered: every tile's partial computed,
    each tile another rank owns sent there once computed."""
    sent = [t for t in range(tiles) if t % world != rank]
    return SplitWorkload(tiles, (tile_bytes,) * len(sent), comm_after=tuple(sent))


def run_split_gemm_rs(x: Sequence[np.ndarray], w: Sequence[np.ndarray], tile_cols: int, costs: SlotCosts,
                      slots: int, target: int, adaptive: bool = True, transport=None) -> list[np.ndarray]:
    """y = sum_r x[r] @ w[r].T, its column tiles reduce-scattered over the ranks (tile t owned by rank t % world),
    each rank running its tasks in the order `simulate` finished them: a compute task computes the tile's
    partial, a communication task puts it into the owner's parts window and signals its count there. Each
    owner sums its tiles' parts in rank order once they have landed. Returns every rank's y, its own tiles
    filled and the rest NaN."""
    from .reduce import run_ranks
    from .transport import EmulatedTransport

    world = len(x)
    m, n = x[0].shape[0], w[0].shape[0]
    tiles = -(-n // tile_cols)
    tr = transport if transport is not None else EmulatedTransport(world)
    tr.window("rs.parts", (tiles, world, m, tile_cols), np.float64, np.nan)
    tr.window("rs.count", (tiles,), np.int64, 0)
    out = [np.full((m, n), np.nan) for _ in range(world)]

    def rank_main(r: int) -> None:
        work = gemm_rs_workload(tiles, world, r, m * tile_cols * 8)
        sched = simulate(work, costs, slots, target, adaptive)
        parts: dict[int, np.ndarray] = {}
        for t in sched.order():
            if t.kind == COMPUTE:
                cols = slice(t.index * tile_cols, min(n, (t.index + 1) * tile_cols))
                p = np.zeros((m, tile_cols))
                p[:, :cols.stop - cols.start] = x[r] @ w[r][cols].T
                parts[t.index] = p
            else:
                tile = work.comm_after[t.index]
                tr.put(r, tile % world, "rs.parts", (tile, r), parts[tile])
                tr.signal(r, tile % world, "rs.count", tile, 1)
        mine = range(r, tiles, world)
        for tile in mine:
            tr.put(r, r, "rs.parts", (tile, r), parts[tile])
            tr.signal(r, r, "rs.count", tile, 1)
        for tile in mine:
            got = tr.wait_for(r, lambda tile=tile: (tr.get(r, r, "rs.parts", tile)
                                                   if tr.get(r, r, "rs.count", tile) == world else None),
                              f"tile {tile}'s {world} parts")
            cols = slice(tile * tile_cols, min(n, (tile + 1) * tile_cols))
            total = got[0].copy()
            for k in range(1, world):
                total += got[k]
            out[r][:, cols] = total[:, :cols.stop - cols.start]

    try:
        run_ranks(world, rank_main)
    finally:
        if transport is None:
            tr.close()
    return out
