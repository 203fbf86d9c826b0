"""The rank dimension of a decode schedule: which rank computes which token range of which request.

Sequence-parallel decode attention shards the KV of long requests across ranks: a request of at least
`min_split_tokens * world` tokens is cut into `world` contiguous parts of whole pages (the same number of
pages each, up to one), one per rank; a shorter request stays whole on the rank with the least work so
far. Part 0's rank owns the request: every part's partial (output and log-sum-exp) crosses to the owner,
one arrival counter per request counts them, and the part that completes the count merges them, in part
order (so the result does not depend on the order they arrive in). Each cross-rank edge of this plan is
one put of a partial and one fetch-add of the owner's counter (meld.dist.transport).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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
        pages, counts, last = [], [], []
        for i in idx:
            b, lo, hi = int(self.req[i]), int(self.begin[i]), int(self.end[i])
            first, stop = int(kv_indptr[b]) + lo // page_size, int(kv_indptr[b]) - (-hi // page_size)
            pages.append(kv_indices[first:stop])
            counts.append(stop - first)
            last.append((hi - lo - 1) % page_size + 1 if hi > lo else 0)
        indptr = np.r_[0, np.cumsum(counts, dtype=np.int64)].astype(np.int32)
        indices = np.concatenate(pages).astype(np.int32) if pages else np.zeros(0, np.int32)
        return idx, indptr, indices, np.asarray(last, dtype=np.int32)

    def validate(self) -> "ShardPlan":
        """Every request covered exactly once by its parts, in order; ValueError otherwise."""
        B = len(self.kv_len)
        for b in range(B):
            idx = np.flatnonzero(self.req == b)
            idx = idx[np.argsort(self.part[idx])]
            if len(idx) != self.num_parts[b] or not np.array_equal(self.part[idx], np.arange(len(idx))):
                raise ValueError(f"request {b}: parts {self.part[idx].tolist()} are not 0..{self.num_parts[b] - 1}")
            bounds = np.r_[self.begin[idx], self.end[idx][-1:]] if len(idx) else np.zeros(0)
            if len(idx) and (self.begin[idx[0]] != 0 or self.end[idx[-1]] != self.kv_len[b]
                             or not np.array_equal(self.begin[idx[1:]], self.end[idx[:-1]]) or np.any(np.diff(bounds) < 0)):
                raise ValueError(f"request {b}: parts do not cover [0, {self.kv_len[b]}) in order")
            if len(idx) and self.owner[b] != self.rank[idx[0]]:
                raise ValueError(f"request {b}: owner {self.owner[b]} is not part 0's rank {self.rank[idx[0]]}")
        if np.any((self.rank < 0) | (self.rank >= self.world)):
            raise ValueError(f"ranks outside [0, {self.world})")
        return self


def shard_batch(kv_len, page_size: int, world: int, min_split_tokens: int = 4096) -> ShardPlan:
    """The plan for requests of `kv_len` tokens over `world` ranks (module docstring); every request,
    empty ones too, gets at least one part."""
    if world < 1 or page_size < 1 or min_split_tokens < 1:
        raise ValueError(f"world, page_size and min_split_tokens must be >= 1, got {world}, {page_size}, "
                         f"{min_split_tokens}")
    L = np.asarray(kv_len, dtype=np.int64)
    if L.ndim != 1 or np.any(L < 0):
        raise ValueError(f"kv_len must be a list of lengths >= 0, got {kv_len!r}")
    load = np.zeros(world, dtype=np.int64)
    parts: list[tuple[int, int, int, int, int]] = []   # (req, part, rank, begin, end)
    for b in np.argsort(-L, kind="stable"):             # longest first: the greedy placement balances better
        n = int(L[b])
        if world > 1 and n >= min_split_tokens * world:
            pages = -(-n // page_size)
            cuts = [min(n, (pages * r // world) * page_size) for r in range(world + 1)]
            for r in range(world):
                parts.append((int(b), r, r, cuts[r], cuts[r + 1]))
                load[r] += cuts[r + 1] - cuts[r]
        else:
            r = int(np.argmin(load))
            parts.append((int(b), 0, r, 0, n))
            load[r] += n
    parts.sort(key=lambda p: (p[2], p[0], p[1]))
    a = np.array(parts, dtype=np.int64).reshape(-1, 5)
    num_parts = np.bincount(a[:, 0], minlength=len(L))
    owner = np.zeros(len(L), dtype=np.int64)
    first = a[:, 1] == 0
    owner[a[first, 0]] = a[first, 2]
    return ShardPlan(world, L, a[:, 0], a[:, 1], a[:, 2], a[:, 3], a[:, 4], num_parts, owner).validate()
