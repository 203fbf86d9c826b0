"""The paged KV cache of the decode loop, as a serving engine keeps it: one pool allocated up front, pages
handed out by a block allocator, a page list per request, and FlashInfer-layout page tables per step.

The pool is one tensor [layers, pages, 2, page_size, num_kv_heads, head_dim]: `pool[layer]` is a contiguous
FlashInfer NHD cache, what meld, FlashInfer and the SDPA reference all read, so every backend sees the same
bytes. MLA's `PagedLatentCache` holds one latent row per token instead, [layers, pages, page_size, head_dim],
with the same allocator, slots and page tables. Page 0 is never handed out: padded rows of a CUDA-graph batch
write their K/V there (`NULL_SLOT`), and backends that want no empty requests give padded rows that page to
read.

Admission reserves a request's pages for its whole life (prompt + output) but allocates them as tokens
arrive, so a running request never fails for want of a page and no request is ever preempted.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from ..ops.checks import INT32_MAX, check_count, check_positive, check_seed, expect, is_int, resolve_device

NULL_PAGE = 0
_MAX_TOKENS = 1 << 40   # a request's tokens: far beyond any pool, small enough for int64 slot arithmetic
NULL_SLOT = NULL_PAGE   # token slot 0: page 0, offset 0


class BlockAllocator:
    """A free list over pages first..num_pages-1 (the first ones are reserved), in a seeded shuffled order
    so page indices are scattered as in a long-running server.

    Invariants: a page is either free or owned, never both and never owned twice; freeing a page that is
    not owned is a ValueError (a double free would corrupt another request's KV). Page indices are int32, as
    page tables hold them. A call that raises changes nothing.
    """

    def __init__(self, num_pages: int, first: int = NULL_PAGE + 1, seed: int = 0):
        num_pages = check_positive("num_pages", num_pages)
        first = check_count("first", first)
        seed = check_seed("seed", seed)
        if num_pages <= first:
            raise ValueError(f"num_pages={num_pages}: need more than the {first} reserved page(s)")
        self.num_pages = num_pages
        order = torch.randperm(num_pages - first, generator=torch.Generator().manual_seed(seed)) + first
        self._free = deque(order.tolist())
        self._owned = np.zeros(num_pages, dtype=bool)
        self._owned[:first] = True   # reserved pages are never free

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        """n pages off the free list; ValueError when fewer are free."""
        n = check_count("n", n, self.num_pages)
        if n > len(self._free):
            raise ValueError(f"KV cache out of pages: asked for {n}, {len(self._free)} of {self.num_pages} free")
        pages = [self._free.popleft() for _ in range(n)]
        self._owned[pages] = True
        return pages

    def free(self, pages) -> None:
        """Return pages to the free list; ValueError (and nothing freed) if one is not owned or repeated."""
        if isinstance(pages, (str, bytes)) or not hasattr(pages, "__iter__"):
            raise ValueError(f"pages must be a list of page indices, got {pages!r:.80}")
        pages = list(pages.tolist() if isinstance(pages, (np.ndarray, torch.Tensor)) else pages)
        if not all(is_int(p) for p in pages):
            raise ValueError(f"pages must be integer page indices, got {pages!r:.120}")
        pages = [int(p) for p in pages]
        if len(pages) and (min(pages) < 0 or max(pages) >= self.num_pages):
            raise ValueError(f"cannot free pages outside 0..{self.num_pages - 1}: {pages!r:.120}")
        arr = np.asarray(pages, dtype=np.int64)
        if len(arr):
            if arr.min() < 0 or arr.max() >= self.num_pages:
                raise ValueError(f"cannot free pages outside 0..{self.num_pages - 1}: {pages}")
            if len(np.unique(arr)) != len(arr) or not self._owned[arr].all() or (arr <= NULL_PAGE).any():
                bad = [p for p in pages if not self._owned[p] or p <= NULL_PAGE or pages.count(p) > 1]
                raise ValueError(f"cannot free pages {sorted(set(bad))}: not allocated (double free?) or reserved")
        self._owned[arr] = False
        self._free.extend(pages)


@dataclass
class PageTable:
    """One step's FlashInfer-layout page table (int32, CPU). Rows past `batch` are padding (no pages, or
    one `NULL_PAGE` of one token, as the backend asked)."""

    kv_indptr: torch.Tensor        # [rows + 1]
    kv_indices: torch.Tensor       # [kv_indptr[-1]]
    kv_last_page_len: torch.Tensor  # [rows]
    kv_lens: np.ndarray            # [rows] tokens per row (int64)
    batch: int                     # real requests: the first `batch` rows
    page_size: int

    @property
    def rows(self) -> int:
        return len(self.kv_lens)


class _Seq:
    __slots__ = ("pages", "num_pages", "length", "reserved")

    def __init__(self, reserved: int):
        self.pages = np.empty(reserved, dtype=np.int32)   # its page list, filled as tokens arrive
        self.num_pages = 0
        self.length = 0
        self.reserved = reserved


class PagedKVCache:
    """The pool, its allocator and the page list of each request.

    Args:
        num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype, device: the pool's shape.
        seed: the allocator's initial page order.

    Example:
        >>> kv = PagedKVCache(4, 4096, 16, 8, 128, torch.bfloat16, "cuda")
        >>> kv.add(rid=7, max_tokens=900)             # reserve; ValueError if it can never fit
        >>> slots = kv.extend(7, 300)                 # token slots (page * page_size + offset) of the prompt
        >>> table = kv.page_table([7])                # kv_indptr, kv_indices, kv_last_page_len
        >>> kv.release(7)
    """

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu", seed: int = 0):
        num_layers, page_size, num_kv_heads, head_dim = (check_positive(name, v) for name, v in (
            ("num_layers", num_layers), ("page_size", page_size), ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim)))
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
        device = resolve_device(device)
        self.page_size, self.num_kv_heads, self.head_dim = page_size, num_kv_heads, head_dim
        self.allocator = BlockAllocator(num_pages, seed=seed)
        shape = (num_layers, num_pages, *self._page_shape())
        try:   # Zeros, not empty: a padded row that reads the null page must read finite values.
            self.pool = torch.zeros(shape, dtype=dtype, device=device)
        except (RuntimeError, MemoryError) as e:   # (torch.OutOfMemoryError is a RuntimeError)
            size = dtype.itemsize * int(np.prod(shape, dtype=object))
            raise ValueError(f"the KV pool {shape} ({size / 2 ** 30:.1f} GiB of {dtype}) cannot be allocated on "
                             f"{device}: {str(e).splitlines()[0]:.160}") from None
        self._seqs: dict[int, _Seq] = {}
        self._unallocated = 0   # pages reserved by admitted requests but not yet allocated

    def _page_shape(self) -> tuple[int, ...]:
        """One layer's page: K and V planes of page_size tokens (FlashInfer NHD)."""
        return (2, self.page_size, self.num_kv_heads, self.head_dim)

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def usable_pages(self) -> int:
        """Pages a request can ever get (all but the null page)."""
        return self.num_pages - 1

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def _seq(self, rid: int) -> _Seq:
        try:
            return self._seqs[rid]
        except (KeyError, TypeError):   # (TypeError: an unhashable rid)
            raise ValueError(f"request {rid!r} is not in the KV cache (never added, or released)") from None

    def can_admit(self, max_tokens: int) -> bool:
        """Whether a request of up to `max_tokens` tokens can be reserved now."""
        return self.pages_for(check_count("max_tokens", max_tokens, _MAX_TOKENS)) <= \
            self.allocator.num_free - self._unallocated

    def add(self, rid: int, max_tokens: int) -> None:
        """Admit request `rid` (an int), reserving pages for `max_tokens` tokens (allocated as they arrive)."""
        if not is_int(rid):
            raise ValueError(f"rid must be an int, got {rid!r}")
        need = self.pages_for(check_count("max_tokens", max_tokens, _MAX_TOKENS))
        if rid in self._seqs:
            raise ValueError(f"request {rid} is already in the KV cache")
        if need > self.usable_pages:
            raise ValueError(f"request {rid} needs {need} pages of {self.page_size} tokens ({max_tokens} tokens); "
                             f"the KV pool has only {self.usable_pages} usable pages")
        if not self.can_admit(max_tokens):
            raise ValueError(f"request {rid} needs {need} pages; {self.allocator.num_free - self._unallocated} are "
                             "free and unreserved")
        self._seqs[rid] = _Seq(need)
        self._unallocated += need

    def extend(self, rid: int, n: int) -> np.ndarray:
        """Append n tokens to request `rid`: their token slots (page * page_size + offset, int64)."""
        s = self._seq(rid)
        n = check_count("n", n, _MAX_TOKENS)
        P = self.page_size
        end = s.length + n
        if end > s.reserved * P:
            raise ValueError(f"request {rid} would hold {end} tokens, more than the {s.reserved * P} it reserved")
        new = self.pages_for(end) - s.num_pages
        if new:
            s.pages[s.num_pages:s.num_pages + new] = self.allocator.alloc(new)
            s.num_pages += new
            self._unallocated -= new
        pos = np.arange(s.length, end)
        s.length = end
        return s.pages[pos // P].astype(np.int64) * P + pos % P

    def append(self, rids: list[int]) -> np.ndarray:
        """One token appended to each of `rids` (a decode step): their token slots (int64). The per-step
        path: plain integer work, a page allocated only when a request crosses into a new one. Every request
        is checked before any grows: a call that raises appends nothing."""
        P = self.page_size
        seqs = [self._seq(rid) for rid in rids]
        for rid, s in zip(rids, seqs):
            if s.length == s.reserved * P:
                raise ValueError(f"request {rid} would hold {s.length + 1} tokens, more than the {s.reserved * P} it "
                                 "reserved")
        if len(set(map(id, seqs))) != len(seqs):
            raise ValueError(f"rids name a request twice (one token per request and step): {list(rids)!r:.120}")
        out = np.empty(len(rids), dtype=np.int64)
        for i, s in enumerate(seqs):
            n = s.length
            if n % P == 0:   # pages are allocated lazily: exactly ceil(n / P) are held, so a new one is due
                s.pages[s.num_pages] = self.allocator.alloc(1)[0]
                s.num_pages += 1
                self._unallocated -= 1
            out[i] = int(s.pages[n // P]) * P + n % P
            s.length = n + 1
        return out

    def length(self, rid: int) -> int:
        return self._seq(rid).length

    def pages(self, rid: int) -> np.ndarray:
        s = self._seq(rid)
        return s.pages[:s.num_pages].copy()

    def release(self, rid: int) -> None:
        """Free a finished request's pages and its unused reservation (a request released twice, or never
        added, is a ValueError)."""
        s = self._seq(rid)
        self.allocator.free(s.pages[:s.num_pages])
        del self._seqs[rid]
        self._unallocated -= s.reserved - s.num_pages

    @property
    def requests(self) -> list[int]:
        return list(self._seqs)

    # --- per step -----------------------------------------------------------------------------------
    def page_table(self, rids: list[int], pad_to: int | None = None, pad_page: int | None = None) -> PageTable:
        """The page table of `rids` in order, padded to `pad_to` rows: padded rows hold no pages
        (pad_page None: an empty request) or the one page `pad_page` with one token."""
        seqs = [self._seq(r) for r in rids]
        rows = len(seqs) if pad_to is None else check_count("pad_to", pad_to, INT32_MAX - 1)
        if rows < len(seqs):
            raise ValueError(f"pad_to={pad_to} is smaller than the batch of {len(seqs)}")
        if pad_page is not None and not (is_int(pad_page) and 0 <= pad_page < self.num_pages):
            raise ValueError(f"pad_page must be a page of the pool (0..{self.num_pages - 1}) or None, got {pad_page!r}")
        lens = np.zeros(rows, dtype=np.int64)
        counts = np.zeros(rows, dtype=np.int64)
        lens[:len(seqs)] = [s.length for s in seqs]
        counts[:len(seqs)] = [s.num_pages for s in seqs]
        parts = [s.pages[:s.num_pages] for s in seqs]
        if pad_page is not None and rows > len(seqs):
            lens[len(seqs):] = 1
            counts[len(seqs):] = 1
            parts.append(np.full(rows - len(seqs), pad_page, dtype=np.int32))
        indptr = np.zeros(rows + 1, dtype=np.int32)
        indptr[1:] = np.cumsum(counts)
        indices = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
        last = np.where(lens > 0, (lens - 1) % self.page_size + 1, 0).astype(np.int32)
        return PageTable(torch.from_numpy(indptr), torch.from_numpy(indices.astype(np.int32, copy=False)),
                         torch.from_numpy(last), lens, len(seqs), self.page_size)

    # --- the pool ------------------------------------------------------------------------------------
    def _layer_index(self, i: object) -> int:
        if not is_int(i) or not 0 <= i < self.pool.shape[0]:
            raise ValueError(f"layer must be 0..{self.pool.shape[0] - 1}, got {i!r}")
        return int(i)

    def layer(self, i: int) -> torch.Tensor:
        """Layer i's cache [pages, 2, page_size, num_kv_heads, head_dim] (FlashInfer NHD, contiguous)."""
        return self.pool[self._layer_index(i)]

    def _check_write(self, layer: object, slots: torch.Tensor) -> int:
        """The layer index, after checking it and the slots (int64 on the pool's device; their values on the
        CPU only, outside torch.compile: on a GPU reading them back would break graph capture)."""
        layer = self._layer_index(layer)
        expect("slots", slots, torch.int64, (None,), "token slots", self.pool.device)
        end = self.num_pages * self.page_size
        if slots.is_cpu and len(slots) and not torch.compiler.is_compiling() and \
                not 0 <= int(slots.min()) <= int(slots.max()) < end:
            raise ValueError(f"slots must be token slots of the pool (0..{end - 1}), got "
                             f"{int(slots.min())}..{int(slots.max())}")
        return layer

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [n, num_kv_heads, head_dim] into token slots [n] (int64, on the pool's device). Launch-only:
        capturable in a CUDA graph, so on a GPU the slots' values are not read back (slots come from `extend` /
        `append`; on the CPU they are checked, outside torch.compile); shapes, dtypes and devices are checked."""
        layer = self._check_write(layer, slots)
        shape = (slots.shape[0], self.num_kv_heads, self.head_dim)
        expect("k", k, self.pool.dtype, shape, "n slots, num_kv_heads, head_dim", self.pool.device)
        expect("v", v, self.pool.dtype, shape, "n slots, num_kv_heads, head_dim", self.pool.device)
        P = self.page_size
        rows = slots // P * (2 * P) + slots % P   # K row of each slot in the layer seen as [pages*2*P, H, D]
        flat = self.pool[layer].view(-1, self.num_kv_heads, self.head_dim)
        flat.index_copy_(0, rows, k)
        flat.index_copy_(0, rows + P, v)


class PagedLatentCache(PagedKVCache):
    """MLA's paged cache: one latent row of `head_dim` channels per token (DeepSeek's [c, k_pe], 512 + 64),
    shared by every q head. `layer(i)` is [pages, page_size, head_dim], the layout meld.DecodeMLA and
    FlashInfer's MLA wrapper read through [..., :512] and [..., 512:] views, and FlashMLA as
    [pages, page_size, 1, head_dim]. Allocation, slots and page tables are PagedKVCache's.

    Example:
        >>> kv = PagedLatentCache(2, 4096, 64, 576, torch.bfloat16, "cuda")
        >>> kv.add(rid=7, max_tokens=900); kv.write(0, torch.from_numpy(kv.extend(7, 300)).cuda(), latent)
    """

    def __init__(self, num_layers: int, num_pages: int, page_size: int, head_dim: int,
                 dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu", seed: int = 0):
        super().__init__(num_layers, num_pages, page_size, 1, head_dim, dtype, device, seed)

    def _page_shape(self) -> tuple[int, ...]:
        return (self.page_size, self.head_dim)

    def write(self, layer: int, slots: torch.Tensor, latent: torch.Tensor) -> None:
        """latent [n, head_dim] into token slots [n]; launch-only, checked as `PagedKVCache.write`."""
        layer = self._check_write(layer, slots)
        expect("latent", latent, self.pool.dtype, (slots.shape[0], self.head_dim), "n slots, head_dim",
               self.pool.device)
        self.pool[layer].view(-1, self.head_dim).index_copy_(0, slots, latent)
