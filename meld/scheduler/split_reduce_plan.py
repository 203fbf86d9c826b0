"""The planner of split-reduce graphs whose partials come from several tasks: pieces of every task's range,
balanced together over the CTAs, and the count of parts each combine point waits for.

A split-reduce task of such a graph covers groups of requests (its `GroupTable`): a group's KV range is
read once for all the group's query rows (requests x the q heads of a kv head). Its range is cut into
pieces and each piece produces one partial per row; a combine point (request, kv head) is complete when
every piece that covers it has arrived — the combine is fired by a count, as in the kernel. A shared
prefix (one group of many requests) and the requests' own suffixes (one group each) are pieces of the
same plan, so the planner balances them together instead of running one level after another.

Cost model (a piece of t tokens and r query rows): t * ceil(r / 64), the tensor-core tiles of 64 rows a
token's key row feeds; a group's range is cut into pieces of about the total cost / the CTAs, never
below MIN_PIECE_TOKENS, and the pieces are dealt longest first onto the least loaded CTA.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

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
    """Pieces in the order the CTAs walk them (CTA 0's first), one row per piece, and each combine point's
    part count. A piece's partial rows take slots slot .. slot + rows - 1: request qo_indptr[group] + i,
    head j of the kv head's group at slot + i * group_size + j."""

    batch: int
    num_kv_heads: int
    group_size: int
    num_ctas: int
    task: np.ndarray        # index into the graph's split-reduce tasks (their order in the graph)
    group: np.ndarray
    kv_head: np.ndarray
    kv_begin: np.ndarray
    kv_end: np.ndarray
    cta: np.ndarray
    slot: np.ndarray
    parts: np.ndarray       # [batch, num_kv_heads]: pieces each combine point waits for
    num_slots: int

    @property
    def num_pieces(self) -> int:
        return len(self.task)

    def cta_cost(self, tables: list[GroupTable]) -> np.ndarray:
        """Each CTA's cost under the planner's model (for tests and printing)."""
        out = np.zeros(self.num_ctas)
        for i in range(self.num_pieces):
            t = tables[int(self.task[i])]
            g = int(self.group[i])
            rows = int(t.qo_indptr[g + 1] - t.qo_indptr[g]) * self.group_size
            out[int(self.cta[i])] += _cost(int(self.kv_end[i] - self.kv_begin[i]), rows)
        return out


def _cost(tokens: int, rows: int) -> float:
    return tokens * -(-rows // ROWS_PER_TILE)


def plan_split_reduce(tables: list[GroupTable], batch: int, num_kv_heads: int, group_size: int, page_size: int,
                      num_ctas: int) -> SplitReducePlan:
    """Cut every task's group ranges into pieces and deal them to `num_ctas` CTAs (module docstring)."""
    work = []   # (task, group, kv_head, tokens, rows)
    for ti, t in enumerate(tables):
        lens = t.kv_len(page_size)
        for g in range(len(lens)):
            rows = int(t.qo_indptr[g + 1] - t.qo_indptr[g]) * group_size
            if lens[g] > 0 and rows > 0:
                work += [(ti, g, h, int(lens[g]), rows) for h in range(num_kv_heads)]
    total = sum(_cost(n, r) for *_, n, r in work)
    target = max(1.0, total / max(1, num_ctas))
    pieces = []   # (cost, task, group, kv_head, begin, end)
    for ti, g, h, n, rows in work:
        k = max(1, min(-(-n // MIN_PIECE_TOKENS), round(_cost(n, rows) / target)))
        bounds = [n * i // k for i in range(k + 1)]
        pieces += [(_cost(e - b, rows), ti, g, h, b, e) for b, e in zip(bounds, bounds[1:])]
    load = [(0.0, c) for c in range(num_ctas)]
    cta_of = []
    for p in sorted(range(len(pieces)), key=lambda i: (-pieces[i][0], i)):
        c_load, c = heapq.heappop(load)
        cta_of.append((c, p))
        heapq.heappush(load, (c_load + pieces[p][0], c))
    order = sorted(cta_of, key=lambda cp: (cp[0], pieces[cp[1]][1:]))   # per CTA: task, group, kv head, range
    cols = {k: np.zeros(len(order), dtype=np.int64) for k in ("task", "group", "kv_head", "kv_begin", "kv_end", "cta",
                                                               "slot")}
    parts = np.zeros((batch, num_kv_heads), dtype=np.int64)
    slot = 0
    for i, (c, p) in enumerate(order):
        _, ti, g, h, b, e = pieces[p]
        for k, v in zip(("task", "group", "kv_head", "kv_begin", "kv_end", "cta", "slot"), (ti, g, h, b, e, c, slot)):
            cols[k][i] = v
        q0, q1 = int(tables[ti].qo_indptr[g]), int(tables[ti].qo_indptr[g + 1])
        parts[q0:q1, h] += 1
        slot += (q1 - q0) * group_size
    return SplitReducePlan(batch, num_kv_heads, group_size, num_ctas, **cols, parts=parts, num_slots=slot)
