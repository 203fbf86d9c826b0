"""The planner of split-reduce graphs whose partials come from several tasks: pieces of every task's range,
balanced together over the CTAs, and the events (combine points) they count towards.

A split-reduce task of such a graph covers groups of requests (its `GroupTable`): a group's KV range is
read once for all the group's query rows (requests x the q heads of a kv head). Its range is cut into
pieces and each piece produces one partial per row; a combine point (request, kv head) is an event that
fires when every piece covering it has arrived — the combine is fired by a count, as in the kernels. A
shared prefix (one group of many requests) and the requests' own suffixes (one group each) are pieces of
one plan, balanced together instead of one level after another.

The plan is two int32 tables declared in `meld.ir.work_table` (SPLIT_TASK, EVENT) plus the slot list of
each event's parts: what a kernel would read, and all the CPU executor reads besides the page tables.

Cost model (a piece of t tokens and r query rows): t * ceil(r / 64), the tensor-core tiles of 64 rows a
token's key row feeds; a group's range is cut into pieces of about the total cost / the CTAs, never
below MIN_PIECE_TOKENS, and the pieces are dealt longest first onto the least loaded CTA.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from ..ir.work_table import EVENT, SPLIT_TASK

MIN_PIECE_TOKENS = 64
ROWS_PER_TILE = 64


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
        pages = np.diff(self.kv_indptr)
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

    def task_columns(self) -> dict[str, np.ndarray]:
        return SPLIT_TASK.unpack(self.tasks, self.num_tasks)

    def event_columns(self) -> dict[str, np.ndarray]:
        return EVENT.unpack(self.events, self.batch * self.num_kv_heads)

    def cta_cost(self, tables: list[GroupTable]) -> np.ndarray:
        """Each CTA's cost under the planner's model (for tests and printing)."""
        t, out = self.task_columns(), np.zeros(self.num_ctas)
        for i in range(self.num_tasks):
            out[t["cta"][i]] += _cost(int(t["kv_end"][i] - t["kv_begin"][i]), int(t["event_count"][i]) * self.group_size)
        return out


def _cost(tokens: int, rows: int) -> float:
    return tokens * -(-rows // ROWS_PER_TILE)


def plan_split_reduce(tables: list[GroupTable], batch: int, num_kv_heads: int, group_size: int, page_size: int,
                      num_ctas: int) -> SplitReducePlan:
    """Cut every task's group ranges into pieces, deal them to `num_ctas` CTAs and list each event's parts
    (module docstring). `tables` are the producers in the graph's order: the order their parts merge in."""
    work = []   # (producer, group, kv_head, tokens, requests)
    for ti, t in enumerate(tables):
        lens = t.kv_len(page_size)
        for g in range(len(lens)):
            n_req = int(t.qo_indptr[g + 1] - t.qo_indptr[g])
            if lens[g] > 0 and n_req > 0:
                work += [(ti, g, h, int(lens[g]), n_req) for h in range(num_kv_heads)]
    total = sum(_cost(n, r * group_size) for *_, n, r in work)
    target = max(1.0, total / max(1, num_ctas))
    pieces = []   # (cost, producer, group, kv_head, begin, end)
    for ti, g, h, n, r in work:
        k = max(1, min(-(-n // MIN_PIECE_TOKENS), round(_cost(n, r * group_size) / target)))
        bounds = [n * i // k for i in range(k + 1)]
        pieces += [(_cost(e - b, r * group_size), ti, g, h, b, e) for b, e in zip(bounds, bounds[1:])]
    load = [(0.0, c) for c in range(num_ctas)]
    placed = []
    for p in sorted(range(len(pieces)), key=lambda i: (-pieces[i][0], i)):
        c_load, c = heapq.heappop(load)
        placed.append((c, p))
        heapq.heappush(load, (c_load + pieces[p][0], c))
    placed.sort(key=lambda cp: (cp[0], pieces[cp[1]][1:]))   # per CTA: producer, group, kv head, range
    cols = {f: np.zeros(len(placed), dtype=np.int64) for f in SPLIT_TASK.fields}
    parts: dict[int, list[tuple[tuple[int, int], int]]] = {}   # event -> ((producer, begin), slot)
    slot = 0
    for i, (c, p) in enumerate(placed):
        _, ti, g, h, b, e = pieces[p]
        q0, q1 = int(tables[ti].qo_indptr[g]), int(tables[ti].qo_indptr[g + 1])
        row = dict(cta=c, producer=ti, group=g, kv_head=h, kv_begin=b, kv_end=e, slot=slot,
                   event_first=h * batch + q0, event_count=q1 - q0)
        for f, v in row.items():
            cols[f][i] = v
        for r in range(q1 - q0):
            parts.setdefault(h * batch + q0 + r, []).append(((ti, b), slot + r * group_size))
        slot += (q1 - q0) * group_size
    n_events = batch * num_kv_heads
    counts = np.array([len(parts.get(ev, ())) for ev in range(n_events)], dtype=np.int64)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]]) if n_events else counts
    part_slot = np.array([s for ev in range(n_events) for _, s in sorted(parts.get(ev, ()))], dtype=np.int32)
    return SplitReducePlan(batch, num_kv_heads, group_size, num_ctas, SPLIT_TASK.pack(len(placed), **cols), len(placed),
                           EVENT.pack(n_events, parts=counts, part_first=first), part_slot, slot)
