"""The rank dimension of a decode schedule: which rank computes which token range of which request.

Sequence-parallel decode attention shards the KV of long requests across ranks: a request of at least
`min_split_tokens * world` tokens is cut into `world` contiguous parts of whole pages (the same number of
pages each, up to one), one per rank; a shorter request stays whole on the rank with the least work so
far. Part 0's rank owns the request: every part's partial (output and log-sum-exp) crosses to the owner,
one arrival counter per request counts them, and the part that completes the count merges them, in part
order (so the result does not depend on the order they arrive in). Each cross-rank edge of this plan is
one put of a partial and one fetch-add of the owner's counter (meld.distributed.transport).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..ops.checks import check_positive

MAX_WORLD = 1 << 16   # ranks a plan places over: the placement keeps a load per rank and scans it per request


@dataclass(frozen=True)
class ShardPlan:
    """Parts in rank order; part i computes tokens [begin[i], end[i]) of request req[i] on rank rank[i]."""

    world: int
    kv_len: np.ndarray        # [B] tokens per request
    req: np.ndarray           # [N] per part
    part: np.ndarray          # [N] its index among its request's parts (the merge order)
    rank: np.ndarray          # [N]
    begin: np.ndarray         # [N] first token
    end: np.ndarray           # [N] one past the last token
    num_parts: np.ndarray     # [B] parts of each request
    owner: np.ndarray         # [B] the rank that holds the merged result (part 0's)

    def on(self, rank: int) -> np.ndarray:
        """The indices of rank `rank`'s parts."""
        return np.flatnonzero(self.rank == rank)

    def local_tables(self, rank: int, kv_indptr: np.ndarray, kv_indices: np.ndarray,
                     page_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Rank `rank`'s parts as a batch of their own: (part indices, kv_indptr, kv_indices,
        kv_last_page_len), int32, each part a request over its token range's pages of the batch's table."""
        idx = self.on(rank)
        lo, hi = self.begin[idx], self.end[idx]
        base = np.asarray(kv_indptr, dtype=np.int64)[self.req[idx]]
        first, stop = base + lo // page_size, base - (-hi // page_size)
        counts = stop - first
        indptr = np.r_[0, np.cumsum(counts)].astype(np.int64)
        gather = np.repeat(first - indptr[:-1], counts) + np.arange(indptr[-1])   # each part's pages, in order
        indices = np.asarray(kv_indices)[gather].astype(np.int32)
        last = np.where(hi > lo, (hi - lo - 1) % page_size + 1, 0)
        return idx, indptr.astype(np.int32), indices, last.astype(np.int32)

    def validate(self) -> "ShardPlan":
        """Every request covered exactly once by its parts, in order; ValueError otherwise (vectorised: plan()
        runs it per batch)."""
        B = len(self.kv_len)
        if np.any((self.rank < 0) | (self.rank >= self.world)):
            raise ValueError(f"ranks outside [0, {self.world})")
        if np.any((self.req < 0) | (self.req >= B)):
            raise ValueError(f"part requests outside [0, {B})")
        order = np.lexsort((self.part, self.req))
        req, part, begin, end = self.req[order], self.part[order], self.begin[order], self.end[order]
        first = np.cumsum(self.num_parts) - self.num_parts             # each request's first part, sorted
        bad_parts = np.bincount(req, minlength=B) != self.num_parts
        if not bad_parts.any() and len(req):   # counts agree: request b's parts sit at first[b]... in order
            bad_parts = np.bincount(req, weights=part != np.arange(len(req)) - first[req], minlength=B) > 0
        if bad_parts.any():
            b = int(np.flatnonzero(bad_parts)[0])
            got = np.sort(self.part[self.req == b]).tolist()
            raise ValueError(f"request {b}: parts {got} are not 0..{self.num_parts[b] - 1}")
        has = self.num_parts > 0
        last = first + self.num_parts - 1
        gap = np.zeros(B, dtype=bool)
        if len(req) > 1:
            inner = req[1:] == req[:-1]
            np.logical_or.at(gap, req[1:][inner], begin[1:][inner] != end[:-1][inner])
        np.logical_or.at(gap, req, end < begin)
        gap[has] |= (begin[first[has]] != 0) | (end[last[has]] != self.kv_len[has])
        if gap.any():
            b = int(np.flatnonzero(gap)[0])
            raise ValueError(f"request {b}: parts do not cover [0, {self.kv_len[b]}) in order")
        wrong = has.copy()
        wrong[has] = self.owner[has] != self.rank[order][first[has]]
        if wrong.any():
            b = int(np.flatnonzero(wrong)[0])
            raise ValueError(f"request {b}: owner {self.owner[b]} is not part 0's rank {self.rank[order][first[b]]}")
        return self


def shard_batch(kv_len, page_size: int, world: int, min_split_tokens: int = 4096) -> ShardPlan:
    """The plan for requests of `kv_len` tokens over `world` ranks (at most MAX_WORLD; module docstring);
    every request, empty ones too, gets at least one part."""
    world = check_positive("world", world, MAX_WORLD)
    page_size, min_split_tokens = (check_positive(name, v) for name, v in (
        ("page_size", page_size), ("min_split_tokens", min_split_tokens)))
    if isinstance(kv_len, torch.Tensor):
        kv_len = kv_len.cpu().numpy()
    try:
        given = np.asarray(kv_len)
    except (TypeError, ValueError):   # ragged
        given = np.asarray(None)
    if given.ndim != 1 or not (given.dtype.kind in "iu" or given.size == 0) or np.any(given < 0) or \
            np.any(given > np.iinfo(np.int64).max // 2):
        raise ValueError(f"kv_len must be a 1-D list of integer lengths >= 0, got {kv_len!r:.120}")   # (no float cut)
    L = given.astype(np.int64)
    load = [0] * world                                   # Python ints: this loop runs per plan()
    ranks = range(world)
    parts: list[tuple[int, int, int, int, int]] = []   # (req, part, rank, begin, end)
    for b in np.argsort(-L, kind="stable").tolist():    # longest first: the greedy placement balances better
        n = int(L[b])
        if world > 1 and n >= min_split_tokens * world:
            pages = -(-n // page_size)
            cuts = [min(n, (pages * r // world) * page_size) for r in range(world + 1)]
            for r in ranks:
                parts.append((b, r, r, cuts[r], cuts[r + 1]))
                load[r] += cuts[r + 1] - cuts[r]
        else:
            r = min(ranks, key=load.__getitem__)        # the least loaded (the lowest rank on a tie)
            parts.append((b, 0, r, 0, n))
            load[r] += n
    parts.sort(key=lambda p: (p[2], p[0], p[1]))
    a = np.array(parts, dtype=np.int64).reshape(-1, 5)
    num_parts = np.bincount(a[:, 0], minlength=len(L))
    owner = np.zeros(len(L), dtype=np.int64)
    first = a[:, 1] == 0
    owner[a[first, 0]] = a[first, 2]
    return ShardPlan(world, L, a[:, 0], a[:, 1], a[:, 2], a[:, 3], a[:, 4], num_parts, owner).validate()
