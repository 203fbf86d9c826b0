"""Checks of a FlashInfer-layout page table (kv_indptr, kv_indices, kv_last_page_len) on the host, and the
table a sliding window reads (`window_page_table`, through `slice_pages`: torch ops on the table's device).

The C helper (meld/runtime/host/stage_page_table.c) makes the same checks in one pass while it stages
the table; both report a problem by the same codes, turned into one ValueError here. Offsets are int32
on the way in but every difference is taken in 64 bits: kv_indptr = [0, 2**31 - 1, -2**31 + 1] must not
wrap into a plausible page count.
"""
from __future__ import annotations

import numpy as np
import torch

INT32_MAX = 2 ** 31 - 1


def page_table_error(code: int, where: int, indptr, last, num_indices: int, indices=None, page_size: int = 0):
    """Raise the ValueError for problem `code` (as numbered in stage_page_table.c) found at entry `where`."""
    if code == 1:
        raise ValueError(f"kv_indptr must start at 0, got kv_indptr[0]={int(indptr[0])}")
    def bounds() -> str:   # request `where`'s two offsets
        return f"kv_indptr[{where}:{where + 2}]={np.asarray(indptr[where:where + 2]).tolist()}"

    if code == 2:
        wrapped = int(indptr[where]) >= 0 > int(indptr[where + 1])
        raise ValueError(f"kv_indptr must never decrease, got {bounds()}"
                         + (f" (an int32 offset past {INT32_MAX} wraps negative)" if wrapped else ""))
    if code == 3:
        raise ValueError(f"kv_indptr[-1]={int(indptr[-1])} exceeds len(kv_indices)={num_indices}")
    if code == 4:
        raise ValueError(f"kv_last_page_len[{where}]={int(last[where])} is outside [1, page_size={page_size}]")
    if code == 6:   # named by kv_indptr's entries: an int32 sum of page counts that wrapped ends here too
        pages = int(indptr[where + 1]) - int(indptr[where])
        raise ValueError(f"{bounds()}: request {where} has {pages} pages of page_size={page_size} (kv_last_page_len"
                         f"[{where}]={int(last[where])}), more than {INT32_MAX} KV tokens")
    raise ValueError(f"kv_indices[{where}]={int(indices[where])} is a negative page index")


def check_page_table(indptr: np.ndarray, last: np.ndarray, num_indices: int, page_size: int) -> int:
    """Validate kv_indptr / kv_last_page_len in a handful of vector ops; returns nnz = kv_indptr[-1].
    The first problem reported is the one the C helper reports (it checks request by request)."""
    if indptr[0] != 0:
        page_table_error(1, 0, indptr, last, num_indices)
    wide = indptr.astype(np.int64)
    pages = wide[1:] - wide[:-1]   # (np.diff's dispatch alone costs more)
    if len(pages):
        # last - 1 must lie in [0, page_size) for non-empty requests; below 0 wraps to >= 2**31 as uint32.
        bad = (pages < 0) | (((last - 1) * (pages > 0)).view(np.uint32) >= page_size)
        long = pages.max() > INT32_MAX // page_size          # only then can a request's length leave int32
        if long:
            bad |= (pages - 1) * page_size + last > INT32_MAX
        if bad.any():
            b = int(np.flatnonzero(bad)[0])
            code = 2 if pages[b] < 0 else 4 if pages[b] > 0 and not 1 <= last[b] <= page_size else 6
            page_table_error(code, b, indptr, last, num_indices, page_size=page_size)
    nnz = int(indptr[-1])   # kv_indptr starts at 0 and never decreases: this is its largest entry
    if nnz > num_indices:
        page_table_error(3, 0, indptr, last, num_indices)
    return nnz


def window_page_table(indptr: torch.Tensor, indices: torch.Tensor, last: torch.Tensor, page_size: int,
                      window_left: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_indptr and kv_indices without each request's pages that lie wholly before its last window_left + 1
    tokens (its last page, and so kv_last_page_len, stays), for a sliding window: the kernel then reads at most
    page_size - 1 keys before the window, which it masks, and the planner balances only the pages read.

    No host synchronisation (`slice_pages`), so that a GPU table planned with check=False stays free of one.
    Expects a valid table (plan() checks the original first wherever it checks).
    """
    dev = indices.device
    ptr = indptr.to(dev, torch.int64)
    counts = (ptr[1:] - ptr[:-1]).clamp(min=0)
    lens = torch.where(counts > 0, (counts - 1) * page_size + last.to(dev, torch.int64), 0)
    skip = torch.minimum((lens - 1 - window_left).div(page_size, rounding_mode="floor").clamp(min=0), counts)
    return slice_pages(ptr, indices, skip, counts - skip)


def slice_pages(indptr: torch.Tensor, indices: torch.Tensor, first: torch.Tensor,
                count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The page table of each request's own pages first .. first + count - 1 (first >= 0 and first + count
    within the request's pages of `indptr`; int64, one entry a request): kv_indptr and kv_indices, by torch
    ops on kv_indices' device with no host synchronisation. kv_indices keeps its length, the entries past the
    new kv_indptr[-1] being copies (never read); on an invalid table it still reads only within `indices`.
    Returns int32 tensors on kv_indices' device."""
    dev = indices.device
    ptr, first, count = (t.to(dev, torch.int64) for t in (indptr, first, count))
    new_ptr = torch.cat([torch.zeros(1, dtype=torch.int64, device=dev), torch.cumsum(count, 0)])
    n = indices.numel()
    if n == 0 or count.numel() == 0:
        return new_ptr.to(torch.int32), indices.contiguous()
    j = torch.arange(n, device=dev)
    b = torch.searchsorted(new_ptr[1:], j, right=True).clamp(max=count.numel() - 1)   # request of entry j
    src = (ptr[b] + first[b] + j - new_ptr[b]).clamp(0, n - 1)
    return new_ptr.to(torch.int32), indices[src].contiguous()


def max_page(indices: np.ndarray) -> int:
    """Largest page index, in one pass (negative indices wrap above 2**31 as uint32); -1 if empty."""
    if not len(indices):
        return -1
    top = int(indices.view(np.uint32).max())
    if top > INT32_MAX:
        page_table_error(5, int(np.flatnonzero(indices < 0)[0]), None, None, 0, indices)
    return top
