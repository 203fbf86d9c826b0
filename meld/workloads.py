"""Decode batches: the length distributions of BENCH.md and FlashInfer's paged layout built for them.

One definition for the demo, the tests and the benchmarks, so they all run the same workloads.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from .ops.checks import INT32_MAX, check_count, check_positive, is_int


def lengths(dist: str, batch: int) -> list[int]:
    """The KV lengths of a batch of `batch` requests of BENCH.md's distribution `dist`."""
    batch = check_count("batch", batch, 1 << 24)
    if dist == "one-long" and batch < 1:
        raise ValueError("batch must be >= 1 for one-long (it holds the long request), got 0")
    if dist == "uniform2k":
        return [2048] * batch
    if dist == "skewed":   # exactly as BENCH.md
        g = torch.Generator().manual_seed(1)
        return [int(min(65536, max(64, math.exp(torch.empty(1).normal_(7.5, 1.2, generator=g).item()))))
                for _ in range(batch)]
    if dist == "one-long":
        return [512] * (batch - 1) + [65536]
    if dist == "ragged":   # small, odd lengths with empty requests mixed in
        g = torch.Generator().manual_seed(batch)
        out = torch.randint(0, 700, (batch,), generator=g).tolist()
        for i in range(0, batch, 3):
            out[i] = 0
        return out
    raise ValueError(f"unknown distribution {dist!r}; expected uniform2k, skewed, one-long or ragged")


@dataclass
class PagedBatch:
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    num_pages: int


def paged(lens: list[int], page_size: int, spare_pages: int = 3, generator: torch.Generator | None = None) -> PagedBatch:
    """FlashInfer's paged layout for `lens`, page indices shuffled over a cache with a few spare pages."""
    page_size, spare_pages = check_positive("page_size", page_size), check_count("spare_pages", spare_pages)
    if hasattr(lens, "tolist"):   # a tensor or an array
        lens = lens.tolist()
    if isinstance(lens, (str, bytes)) or not hasattr(lens, "__iter__"):
        raise ValueError(f"lens must be a list of KV lengths, got {lens!r:.80}")
    lens = list(lens)
    if not all(is_int(n) and n >= 0 for n in lens):
        raise ValueError(f"lens must be integer KV lengths >= 0, got {lens!r:.120}")
    pages = [-(-n // page_size) for n in lens]
    if sum(pages) + spare_pages > INT32_MAX:
        raise ValueError(f"lens of {sum(lens)} tokens need {sum(pages)} pages of {page_size} (+ {spare_pages} spare): "
                         f"page indices are int32 (at most {INT32_MAX} pages)")
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.tensor(pages, dtype=torch.int32).cumsum(0) if lens else indptr[1:]
    nnz = int(indptr[-1])
    num_pages = nnz + spare_pages
    indices = torch.randperm(num_pages, generator=generator)[:nnz].to(torch.int32)
    last = torch.tensor([n - (p - 1) * page_size if p else 0 for n, p in zip(lens, pages)], dtype=torch.int32)
    return PagedBatch(indptr, indices, last, num_pages)


def with_request(others: list[int], pos: int, length: int, pages: torch.Tensor, page_size: int, num_pages: int,
                 generator: torch.Generator | None = None) -> PagedBatch:
    """The batch `others` with one more request of `length` tokens at position `pos` that reads exactly
    `pages`; the others read pages of the same cache of `num_pages`. The same request in any batch, at any
    place: what a batch-invariance check needs."""
    pb = paged(others[:pos] + [length] + others[pos:], page_size, spare_pages=0, generator=generator)
    indices = pb.kv_indices % num_pages
    first = int(pb.kv_indptr[pos])
    indices[first:first + len(pages)] = pages
    return PagedBatch(pb.kv_indptr, indices, pb.kv_last_page_len, num_pages)


@dataclass
class SharedPrefixBatch:
    """A two-level cascade batch (BENCH.md, "Shared-prefix (cascade) decode"): `levels` in FlashInfer's
    multi-level layout (qo_indptr, kv_indptr, kv_indices, kv_last_page_len per level: the groups' shared
    prefixes, then one suffix per request), and `flat`, the same KV as one page table per request (its
    group's prefix pages, then its own), for non-cascade decode of the same batch."""

    levels: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
    flat: PagedBatch
    lengths: list[int]        # each request's whole KV length (prefix + suffix)
    unique_tokens: int        # tokens stored once: every group's prefix + every suffix
    num_pages: int


def shared_prefix(batch: int, prefix: int, suffix: int, groups: int, page_size: int,
                  generator: torch.Generator | None = None) -> SharedPrefixBatch:
    """`batch` requests in `groups` equal groups; a group shares `prefix` tokens (a multiple of page_size, so
    the flat page tables hold whole prefix pages), each request has `suffix` tokens of its own. Page indices
    are one random permutation of the cache's pages."""
    batch, groups = check_positive("batch", batch), check_positive("groups", groups)
    prefix, suffix = check_count("prefix", prefix), check_count("suffix", suffix)
    page_size = check_positive("page_size", page_size)
    if batch % groups:
        raise ValueError(f"groups={groups} does not divide batch={batch}")
    if prefix % page_size:
        raise ValueError(f"prefix={prefix} is not a multiple of page_size={page_size}: the flat page tables "
                         "need whole prefix pages")
    per_group, pp, sp = batch // groups, prefix // page_size, -(-suffix // page_size)
    num_pages = groups * pp + batch * sp
    if num_pages > INT32_MAX:
        raise ValueError(f"{num_pages} pages: page indices are int32")
    perm = torch.randperm(num_pages, generator=generator).to(torch.int32)
    prefix_pages, suffix_pages = perm[:groups * pp].view(groups, pp), perm[groups * pp:].view(batch, sp)
    i32 = functools.partial(torch.tensor, dtype=torch.int32)
    last_sfx = suffix - (sp - 1) * page_size if sp else 1
    levels = [
        (i32([g * per_group for g in range(groups + 1)]), i32([g * pp for g in range(groups + 1)]),
         prefix_pages.reshape(-1).clone(), i32([page_size if pp else 1] * groups)),
        (i32(list(range(batch + 1))), i32([b * sp for b in range(batch + 1)]), suffix_pages.reshape(-1).clone(),
         i32([last_sfx] * batch)),
    ]
    rows = [torch.cat([prefix_pages[b // per_group], suffix_pages[b]]) for b in range(batch)]
    n = pp + sp
    last = (last_sfx if sp else page_size) if n else 0
    flat = PagedBatch(i32([b * n for b in range(batch + 1)]), torch.cat(rows) if rows else i32([]),
                      i32([last] * batch), num_pages)
    return SharedPrefixBatch(levels, flat, [prefix + suffix] * batch, groups * prefix + batch * suffix, num_pages)
