"""The planner of split-reduce graphs whose partials come from several tasks: pieces of every task's range,
balanced together over the CTAs, and the events (combine points) they count towards.

A split-reduce task of such a graph covers groups of requests (its `GroupTable`): a group's KV range is
read once for all the group's query rows (requests x the q heads of a kv head). Its range is cut into
pieces and each piece produces one partial per row; a combine point (request, kv head) is an event that
fires when every piece covering it has arrived — the combine is fired by a count, as in the kernels. A
shared prefix (one group of many requests) and the requests' own suffixes (one group each) are pieces of
one plan, balanced together instead of one level after another.

The plan is two int32 tables declared in `meld.ir.work_table` (SPLIT_TASK, EVENT) plus the slot list of
each event's parts: what a kernel would read, and all the CPU executor reads besides the page tables. It is
made by one C source for the GPU and the host (templates/split_reduce_plan.h; `plan_split_reduce` runs its
host build), with `plan_split_reduce_numpy` as its oracle. `write_launch_tables` lays them out, with the rest
of what the grouped-attention kernel reads, in one buffer (`LaunchLayout`): the GPU operator's device tables.

Cost model and cut (decode's, on a line): a work item (producer, group, kv head, slice) of t tokens, q
requests and r query rows costs item_overhead + (q - 1) * merge_overhead + t * ceil(r / 64): a fixed cost
(the ring's fill and drain, the q load, the partials' store, the event counts and one request's merge; in
KV tokens), the merges of its other requests, which the item does when its arrival completes their events
(a slice of a shared prefix that arrives last merges every request of the slice), and the tensor-core tiles of 64 rows each of its key rows feeds. The
fixed part comes first on an item's stretch of the line, so a cut lands on tokens past it. A slice is
up to `slice_rows` of the group's query rows (whole requests, at least one): the rows a kernel task attends
at once, so a large group's shared KV is read once per slice (mostly from L2: its slices are neighbours on
the line) and no task carries more than a slice's events. Each producer's items lie on a line of their own in
graph order (group, kv head, slice), cut into `num_ctas` segments of equal cost: every CTA holds a share of every
producer, the producers in graph order. So a shared level's slices arrive early on every CTA and the events
complete at the requests' own pieces, each merging its own requests, spread over the CTAs and the launch; on
one line for all producers the shared slices filled the first CTAs one after another, the later ones
arrived last, and each merged all of its slice's requests on one CTA at the end of the launch (bench/RESULTS.md,
2026-12-03). A cut inside an item becomes a piece boundary, at a multiple of CUT_TOKENS: one nearer the item's
start than half of MIN_PIECE_TOKENS (in its overhead, say) moves the whole item to the next CTA, one that would
leave the piece before it shorter than MIN_PIECE_TOKENS moves up to make it that long, and one that would leave
the last piece shorter is dropped (that piece stays with the CTA before). So a CTA's pieces of one producer are
consecutive on its line (its groups together: their KV shared in L2), an item is split only where a CTA
boundary falls in it (at most num_ctas - 1 splits a producer), and the table lists the tasks CTA after CTA,
a CTA's producer after producer. With `stagger`, the CTAs of the second half list theirs last to first (the
grouped kernel's two CTAs an SM, c and c + num_ctas / 2, then attend different levels at once: templates/
split_reduce_plan.h).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from ..ir.work_table import EVENT, SPLIT_TASK

MIN_PIECE_TOKENS = 64
CUT_TOKENS = 16
ROWS_PER_TILE = 64   # query rows a token of an item costs one unit for (CascadeDecode(rows_per_tile=) sweeps it)
# A work item's fixed cost in KV tokens, inferred from one H200 run of bench/cascade.py (bench/RESULTS.md,
# 2026-12-02, fifth session), not yet fitted: with no overhead term the 64-group case put 140 of its 64-token
# suffix items on each of the line's last 15 CTAs and took 1058.6 µs, ~7.5 µs an item. A per-CTA model of
# ~13 ns a token (x2.5 for row-block tasks) plus 6.6 µs a task reproduces six of the seven cases within 20% and
# has its smallest sum over them at 256 (bench/cascade.py --item-overhead sweeps it on the GPU).
ITEM_OVERHEAD_TOKENS = 256
# Per request of an item past its first (whose merge item_overhead holds), in KV tokens: the merges an item
# does when it arrives last at its events. On one line for every level a shared prefix's slices often did
# (~33 µs each at B=128, prefix 1024, suffix 2048, ade5c53), and 48 paid; on a line per level they arrive
# first, and 0 was as fast or faster on six of bench/cascade.py's seven cases (bench/RESULTS.md, 2026-12-03):
# a fixed charge no cut can split only makes a level's line lumpier.
MERGE_OVERHEAD_TOKENS = 0
SLICE_ROWS = 128   # query rows a task holds at most: the grouped kernel's warps x 16 (one pass over the KV)


@dataclass(frozen=True)
class GroupTable:
    """One split-reduce task's input, FlashInfer's cascade layout of a level: the requests of group g are
    qo_indptr[g] .. qo_indptr[g + 1] - 1, its pages kv_indices[kv_indptr[g] .. kv_indptr[g + 1] - 1] with
    kv_last_page_len[g] tokens in the last (int64 NumPy arrays, validated by the caller)."""

    qo_indptr: np.ndarray
    kv_indptr: np.ndarray
    kv_indices: np.ndarray
    kv_last_page_len: np.ndarray

    def kv_len(self, page_size: int) -> np.ndarray:
        pages = self.kv_indptr[1:] - self.kv_indptr[:-1]   # (np.diff's dispatch costs more, every plan())
        return np.where(pages > 0, (pages - 1) * page_size + self.kv_last_page_len, 0)


@dataclass(frozen=True)
class SplitReducePlan:
    """The tables of one batch. Event e is (kv head e // batch, request e % batch), so a piece's events (its
    group's requests, one kv head) are consecutive. A piece's partial rows take slots slot .. slot + rows - 1:
    request i of its group, head j of the kv head's group at slot + i * group_size + j."""

    batch: int
    num_kv_heads: int
    group_size: int
    num_ctas: int
    tasks: np.ndarray        # SPLIT_TASK, field-major, num_tasks entries, in CTA order
    num_tasks: int
    events: np.ndarray       # EVENT, field-major, batch * num_kv_heads entries
    part_slot: np.ndarray    # the parts' first slots, event after event, each event's in merge order
    num_slots: int
    item_overhead: int       # the cost model's (module docstring)
    merge_overhead: int = 0
    rows_per_tile: int = ROWS_PER_TILE

    def task_columns(self) -> dict[str, np.ndarray]:
        return SPLIT_TASK.unpack(self.tasks, self.num_tasks)

    def event_columns(self) -> dict[str, np.ndarray]:
        return EVENT.unpack(self.events, self.batch * self.num_kv_heads)

    def cta_cost(self, tables: list[GroupTable], producer: int | None = None) -> np.ndarray:
        """Each CTA's cost under the planner's model (for tests and printing), of every producer's pieces or of
        one's: an item's overhead goes to its first piece."""
        t, out = self.task_columns(), np.zeros(self.num_ctas)
        for i in range(self.num_tasks):
            if producer is not None and t["producer"][i] != producer:
                continue
            tiles = -(-int(t["event_count"][i]) * self.group_size // self.rows_per_tile)
            out[t["cta"][i]] += int(t["kv_end"][i] - t["kv_begin"][i]) * tiles + \
                (self.item_overhead + (int(t["event_count"][i]) - 1) * self.merge_overhead if t["kv_begin"][i] == 0 else 0)
        return out


def plan_split_reduce_numpy(tables: list[GroupTable], batch: int, num_kv_heads: int, group_size: int,
                            page_size: int, num_ctas: int, slice_rows: int = SLICE_ROWS,
                            item_overhead: int = ITEM_OVERHEAD_TOKENS,
                            merge_overhead: int = MERGE_OVERHEAD_TOKENS,
                            rows_per_tile: int = ROWS_PER_TILE, stagger: bool = False) -> SplitReducePlan:
    """The cut in NumPy, written from the module docstring: the test oracle of `plan_split_reduce` (the
    planner's C source, templates/split_reduce_plan.h, the GPU's and the host's)."""
    per = max(1, slice_rows // group_size)   # requests of a slice
    cols = {f: [] for f in SPLIT_TASK.fields}
    parts: dict[int, list[int]] = {}   # event -> its parts' first slots, in line order
    slot = pages = 0
    for ti, t in enumerate(tables):   # a line per producer
        items = []   # (group, kv_head, first request, tokens, requests, tiles) in line order
        lens = t.kv_len(page_size)
        for g in range(len(lens)):
            q0, q1 = int(t.qo_indptr[g]), int(t.qo_indptr[g + 1])
            if lens[g] > 0:
                items += [(g, h, s, int(lens[g]), min(per, q1 - s), -(-min(per, q1 - s) * group_size // rows_per_tile))
                          for h in range(num_kv_heads) for s in range(q0, q1, per)]
        fixed = [item_overhead + (n_req - 1) * merge_overhead for *_, n_req, _ in items]
        total = sum(f + n * tiles for f, (*_, n, _, tiles) in zip(fixed, items))
        bounds = [c * total // num_ctas for c in range(num_ctas + 1)]   # the segments' first costs
        start, cta = 0, 0
        for (g, h, q0, n, n_req, tiles), fix in zip(items, fixed):
            while cta + 1 < num_ctas and bounds[cta + 1] <= start:   # the CTA whose segment holds the item's start
                cta += 1
            cuts = [(0, cta)]
            c = cta + 1
            while c < num_ctas and bounds[c] < start + fix + n * tiles:   # CTA boundaries inside the item
                near = (max(0, bounds[c] - start - fix) // tiles + CUT_TOKENS // 2) // CUT_TOKENS * CUT_TOKENS
                pos = max(near, cuts[-1][0] + MIN_PIECE_TOKENS)
                if len(cuts) == 1 and 2 * near < MIN_PIECE_TOKENS:   # nearer the item's start: it starts on CTA c
                    cuts = [(0, c)]
                elif n - pos >= MIN_PIECE_TOKENS:
                    cuts.append((pos, c))
                c += 1
            for (b, owner), (e, _) in zip(cuts, cuts[1:] + [(n, None)]):
                row = dict(group=g, kv_begin=b, last_group=g, kv_end=e, producer=ti, kv_head=h,
                           pages=pages + int(t.kv_indptr[g]), arg3=0,
                           kind=SPLIT_TASK.kind, cta=owner, slot=slot, event_first=h * batch + q0, event_count=n_req)
                for f in SPLIT_TASK.fields:
                    cols[f].append(row[f])
                for r in range(n_req):
                    parts.setdefault(h * batch + q0 + r, []).append(slot + r * group_size)
                slot += n_req * group_size
            cta = cuts[-1][1]
            start += fix + n * tiles
        pages += len(t.kv_indices)
    cta = np.array(cols["cta"], dtype=np.int64)
    line = np.arange(len(cta))
    order = np.lexsort((np.where(stagger & (2 * cta >= num_ctas), -line, line), cta))   # CTA after CTA, each in
    # line order (staggered: the second half's last to first)
    cols = {f: np.asarray(v, dtype=np.int64)[order] for f, v in cols.items()}
    n_events = batch * num_kv_heads
    counts = np.array([len(parts.get(ev, ())) for ev in range(n_events)], dtype=np.int64)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]]) if n_events else counts
    part_slot = np.array([s for ev in range(n_events) for s in parts.get(ev, ())], dtype=np.int32)
    num_tasks = len(cols["cta"])
    return SplitReducePlan(batch, num_kv_heads, group_size, num_ctas, SPLIT_TASK.pack(num_tasks, **cols), num_tasks,
                           EVENT.pack(n_events, parts=counts, part_first=first), part_slot, slot, item_overhead,
                           merge_overhead, rows_per_tile)


def plan_split_reduce(tables: list[GroupTable], batch: int, num_kv_heads: int, group_size: int, page_size: int,
                      num_ctas: int, slice_rows: int = SLICE_ROWS,
                      item_overhead: int = ITEM_OVERHEAD_TOKENS,
                      merge_overhead: int = MERGE_OVERHEAD_TOKENS,
                      rows_per_tile: int = ROWS_PER_TILE, stagger: bool = False) -> SplitReducePlan:
    """Cut the line of every task's work items into `num_ctas` segments of equal cost and list each event's
    parts (module docstring), with the planner's C source built for the host. `tables` are the producers
    in the graph's order: the order their parts merge in. `stagger`: the second half's CTAs list their tasks
    last to first (module docstring)."""
    from ..codegen.params import SPLIT_PLAN_PARAMS
    from ..runtime.host_helper import load_split_reduce_plan

    groups = _group_columns(tables, page_size)
    requests, tokens = groups[3], groups[4]
    busy = (tokens > 0) & (requests > 0)
    task_cap = int(-(-requests[busy] // max(1, slice_rows // group_size)).sum()) * num_kv_heads + num_ctas * len(tables)
    part_cap = int(requests[busy].sum()) * num_kv_heads + num_ctas * len(tables) * int(requests.max(initial=0))
    n_events = batch * num_kv_heads
    # The planner's outputs and scratch in one array (one allocation, one address); everything read back is
    # written by the planner first.
    sizes = {"tasks": task_cap * SPLIT_TASK.width, "events": n_events * EVENT.width, "part_slot": part_cap,
             "cursor": n_events + num_ctas, "out": 2}
    scratch = np.empty(sum(sizes.values()), dtype=np.int32)
    base, at, part, addr = scratch.ctypes.data, 0, {}, {}
    for name, n in sizes.items():
        part[name], addr[name] = scratch[at:at + n], base + 4 * at
        at += n
    g, n_groups = groups.ctypes.data, groups.shape[1]
    params = SPLIT_PLAN_PARAMS.pack(
        group_producer=g, group_index=g + 4 * n_groups, group_q0=g + 8 * n_groups, group_requests=g + 12 * n_groups,
        group_tokens=g + 16 * n_groups, group_pages=g + 20 * n_groups, **addr, num_groups=n_groups, batch=batch,
        num_kv_heads=num_kv_heads, group_size=group_size, num_ctas=num_ctas, min_piece=MIN_PIECE_TOKENS,
        cut=CUT_TOKENS, rows_per_tile=rows_per_tile, slice_rows=slice_rows, item_overhead=item_overhead,
        merge_overhead=merge_overhead, stagger=int(stagger), task_capacity=task_cap, slot_capacity=part_cap)
    load_split_reduce_plan().meld_split_reduce_plan_host(ctypes.addressof(params))
    num_tasks, num_slots = int(part["out"][0]), int(part["out"][1])
    if num_tasks < 0:   # the capacities above bound every cut: this is a planner bug, not an input error
        raise RuntimeError(f"split-reduce planner: capacities {task_cap} tasks / {part_cap} parts were too small")
    events = part["events"]
    parts = int(EVENT.unpack(events, n_events)["parts"].sum())
    return SplitReducePlan(batch, num_kv_heads, group_size, num_ctas,
                           part["tasks"].reshape(SPLIT_TASK.width, task_cap)[:, :num_tasks].flatten(), num_tasks,
                           events.copy(), part["part_slot"][:parts].copy(), num_slots, item_overhead, merge_overhead,
                           rows_per_tile)


def _group_columns(tables: list[GroupTable], page_size: int) -> np.ndarray:
    """The planner's per-group inputs, int32 [6, groups]: producer, index in it, first request, requests,
    KV tokens, and its page list's first entry in the producers' lists laid one after another
    (SplitPlanParams.group_*), producer after producer."""
    counts = [len(t.kv_last_page_len) for t in tables]
    out = np.empty((6, sum(counts)), dtype=np.int32)
    at = pages = 0
    for i, (t, n) in enumerate(zip(tables, counts)):
        cols = out[:, at:at + n]
        cols[0], cols[1], cols[2] = i, np.arange(n), t.qo_indptr[:-1]
        cols[3], cols[4], cols[5] = t.qo_indptr[1:] - t.qo_indptr[:-1], t.kv_len(page_size), t.kv_indptr[:-1] + pages
        at, pages = at + n, pages + len(t.kv_indices)
    return out


# The tables the grouped-attention kernel reads (GroupedParams), in their order in one buffer: kv_indices last, so
# a copy of the buffer can stop at its last used entry.
LAUNCH_TABLES = ("plan_info", "cta_first", "events", "tasks", "part_slot", "kv_indices")
_ROWS = {"tasks": SPLIT_TASK, "events": EVENT}   # tables of rows: field-major over their capacity of rows
_ALIGN = 32   # int32 entries: each table starts on a 128-byte line


def launch_sizes(plan: SplitReducePlan, tables: list[GroupTable]) -> dict[str, int]:
    """What each of LAUNCH_TABLES holds for the plan: rows of tasks and events, entries of the others."""
    return {"plan_info": 1, "cta_first": plan.num_ctas + 1, "events": plan.batch * plan.num_kv_heads,
            "tasks": plan.num_tasks, "part_slot": len(plan.part_slot),
            "kv_indices": sum(len(t.kv_indices) for t in tables) + 1}   # (one more: never empty)


@dataclass(frozen=True)
class LaunchLayout:
    """LAUNCH_TABLES in one int32 buffer, each at a fixed offset sized by its capacity (`capacity`, in
    launch_sizes' units), so that a plan that fits rewrites them in place and their addresses stay."""

    capacity: dict[str, int]
    offset: dict[str, int]    # int32 entries
    entries: dict[str, int]
    size: int

    @classmethod
    def of(cls, capacity: dict[str, int]) -> LaunchLayout:
        entries = {k: capacity[k] * (_ROWS[k].width if k in _ROWS else 1) for k in LAUNCH_TABLES}
        offset, at = {}, 0
        for k, n in entries.items():
            offset[k], at = at, -(-(at + n) // _ALIGN) * _ALIGN
        return cls(capacity, offset, entries, offset["kv_indices"] + entries["kv_indices"])

    def views(self, buf):
        """Each table's slice of `buf` (a NumPy array or a tensor of `size` entries)."""
        return {k: buf[o:o + self.entries[k]] for k, o in self.offset.items()}

    def used(self, sizes: dict[str, int]) -> int:
        """Leading entries of the buffer that hold a plan of launch_sizes `sizes` (its kv_indices last)."""
        return self.offset["kv_indices"] + sizes["kv_indices"]


def write_launch_tables(views: dict[str, np.ndarray], plan: SplitReducePlan, tables: list[GroupTable]) -> None:
    """Write the plan's launch tables into `views` (a LaunchLayout's views, large enough). What the kernel
    reads (templates/grouped_attention.cuh): the batch, each CTA's first task, the task and event rows
    (those past the plan's zeroed), each event's part slots, and the producers' page lists laid one after
    another (a task row's `pages` is where its group's starts; a task's first request is its first event's,
    event_first - kv_head * batch). Entries past the plan's in the other tables keep what they held: the
    kernel reads none of them."""
    views["plan_info"][0] = plan.batch
    views["cta_first"][:plan.num_ctas + 1] = np.searchsorted(plan.task_columns()["cta"], np.arange(plan.num_ctas + 1))
    for name, rows in (("tasks", plan.num_tasks), ("events", plan.batch * plan.num_kv_heads)):
        dst = views[name].reshape(_ROWS[name].width, -1)
        dst[:, :rows] = getattr(plan, name).reshape(_ROWS[name].width, rows)
        dst[:, rows:] = 0
    views["part_slot"][:len(plan.part_slot)] = plan.part_slot
    pages = 0
    for t in tables:
        views["kv_indices"][pages:pages + len(t.kv_indices)] = t.kv_indices
        pages += len(t.kv_indices)
    views["kv_indices"][pages] = 0   # (the entry that keeps it never empty)
