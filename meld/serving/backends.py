"""Attention backends of the decode loop, behind the interface serving engines use: `plan(table)` once
per step with that step's page table (vLLM's metadata builder, SGLang's init_forward_metadata), then
`run(layer, q, kv_cache)` in every layer, reading the plan.

- `meld`: one `meld.DecodeAttention` shared by all layers, its capacities fixed at construction so a
  plan() rewrites its tables in place and one captured graph per batch-size bucket replays every plan.
- `flashinfer` / `flashinfer-tc`: FlashInfer's `BatchDecodeWithPagedKVCacheWrapper` (CUDA cores, or its
  tensor-core decode), one wrapper per bucket under CUDA graphs (its cuda-graph mode fixes the batch).
- `sdpa`: torch `scaled_dot_product_attention` over K/V gathered from the pages, requests sorted by length
  and batched under a token budget: the reference. Eager only (its shapes change with every batch).

Padding rows of a graph bucket: meld gives an empty request zeros, so they get no pages; FlashInfer's
are given the one null page of one token instead (`pad_page`), which needs no promise about empty ones.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .kv_cache import NULL_PAGE, PageTable
from .models import ModelConfig

BACKENDS = ("meld", "flashinfer", "flashinfer-tc", "sdpa")
_FLASHINFER_WORKSPACE = 128 * 1024 * 1024


class BackendUnavailable(RuntimeError):
    """A backend that cannot run here (package missing, no GPU): the message says why."""


class AttentionBackend:
    """plan() once per step, run() per layer. Subclasses set `name`, `supports_graphs`, `pad_page`."""

    name = ""
    supports_graphs = False
    pad_page: int | None = None   # padded rows: None = empty requests, else this page with one token

    def prepare_graphs(self, buckets: list[int]) -> None:
        """Called once before CUDA graphs of these batch sizes are captured."""
        if not self.supports_graphs:
            raise BackendUnavailable(f"the {self.name} backend cannot run in CUDA graphs (use eager mode)")

    def plan(self, table: PageTable) -> None:
        raise NotImplementedError

    def run(self, layer: int, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class MeldBackend(AttentionBackend):
    """meld.DecodeAttention: plan() validates the table on the host and launches the GPU planner (on the
    CPU, the host planner for the reference executor); run() is one launch."""

    name = "meld"
    supports_graphs = True

    def __init__(self, config: ModelConfig, page_size: int, device, max_batch: int, max_pages: int):
        import meld

        self.attn = meld.DecodeAttention(config.num_qo_heads, config.num_kv_heads, config.head_dim, page_size,
                                         config.dtype, device, max_batch_size=max_batch, max_num_pages=max_pages)

    def plan(self, table: PageTable) -> None:
        self.attn.plan(table.kv_indptr, table.kv_indices, table.kv_last_page_len)

    def run(self, layer: int, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        return self.attn.run(q, kv_cache)


def _import_flashinfer():
    try:
        import flashinfer
    except Exception as e:   # ImportError, or a broken install failing at import
        raise BackendUnavailable(f"the flashinfer backend needs the flashinfer package (flashinfer-python), which "
                                 f"does not import here: {type(e).__name__}: {e}") from None
    return flashinfer


class FlashInferBackend(AttentionBackend):
    """FlashInfer's paged decode wrapper: eager, one wrapper; with graphs, one cuda-graph wrapper per bucket
    with its own page-table buffers (as vLLM and SGLang keep them). All share one workspace."""

    supports_graphs = True
    pad_page = NULL_PAGE

    def __init__(self, config: ModelConfig, page_size: int, device, max_pages: int, tensor_cores: bool = False):
        device = torch.device(device)
        if device.type != "cuda":
            raise BackendUnavailable("the flashinfer backend runs on CUDA GPUs only (this run is on the CPU)")
        self._fi = _import_flashinfer()
        self.name = "flashinfer-tc" if tensor_cores else "flashinfer"
        self.config, self.page_size, self.device, self.max_pages = config, page_size, device, max_pages
        self.tensor_cores = tensor_cores
        self.workspace = torch.empty(_FLASHINFER_WORKSPACE, dtype=torch.uint8, device=device)
        self._eager = self._fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD",
                                                                  use_tensor_cores=tensor_cores)
        self._graphed: dict[int, object] = {}
        self._wrapper = None

    def prepare_graphs(self, buckets: list[int]) -> None:
        i32 = dict(dtype=torch.int32, device=self.device)
        for b in buckets:
            self._graphed[b] = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.tensor_cores,
                paged_kv_indptr_buffer=torch.zeros(b + 1, **i32),
                paged_kv_indices_buffer=torch.zeros(self.max_pages, **i32),
                paged_kv_last_page_len_buffer=torch.zeros(b, **i32))

    def plan(self, table: PageTable) -> None:
        c = self.config
        w = self._graphed.get(table.rows, self._eager)
        w.plan(table.kv_indptr, table.kv_indices, table.kv_last_page_len, c.num_qo_heads, c.num_kv_heads,
               c.head_dim, self.page_size, q_data_type=c.dtype, kv_data_type=c.dtype)
        self._wrapper = w

    def run(self, layer: int, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        return self._wrapper.run(q, kv_cache)


class SdpaBackend(AttentionBackend):
    """The reference: plan() turns the page table into gather indices (requests sorted by length, grouped
    so that a group's padded tokens stay under `budget_tokens`); run() gathers each group's K/V from the
    pages and calls SDPA with a padding mask, the q heads of a kv head taken as its query rows (GQA
    without copying K/V per q head). A request with no tokens gives zeros, as meld's does."""

    name = "sdpa"

    def __init__(self, config: ModelConfig, page_size: int, device, budget_tokens: int = 1 << 19):
        self.config, self.page_size, self.device = config, page_size, torch.device(device)
        self.budget_tokens = budget_tokens
        self._groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def plan(self, table: PageTable) -> None:
        P = self.page_size
        lens = table.kv_lens
        indptr, indices = table.kv_indptr.numpy().astype(np.int64), table.kv_indices.numpy()
        order = np.argsort(-lens, kind="stable")
        order = order[lens[order] > 0]
        groups, i = [], 0
        while i < len(order):
            longest = int(lens[order[i]])
            rows = order[i:i + max(1, self.budget_tokens // longest)]
            t = np.arange(longest)
            valid = t[None, :] < lens[rows][:, None]
            page = indices[np.where(valid, indptr[rows][:, None] + t[None, :] // P, 0)].astype(np.int64)
            k_rows = np.where(valid, page * 2 * P + t[None, :] % P, 0)   # rows of the layer as [pages*2*P, H, D]
            groups.append(tuple(torch.from_numpy(a).to(self.device) for a in (rows, k_rows, valid[:, None, None, :])))
            i += len(rows)
        self._groups = groups

    def run(self, layer: int, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        B, Hq, D = q.shape
        Hkv, P = self.config.num_kv_heads, self.page_size
        flat = kv_cache.view(-1, Hkv, D)
        out = torch.zeros_like(q)
        for rows, k_rows, mask in self._groups:
            g, L = k_rows.shape
            k = flat[k_rows.view(-1)].view(g, L, Hkv, D).transpose(1, 2)
            v = flat[k_rows.view(-1) + P].view(g, L, Hkv, D).transpose(1, 2)
            o = F.scaled_dot_product_attention(q[rows].view(g, Hkv, Hq // Hkv, D), k, v, attn_mask=mask)
            out.index_copy_(0, rows, o.reshape(g, Hq, D))
        return out


def make_backend(name: str, config: ModelConfig, page_size: int, device, max_batch: int,
                 max_pages: int) -> AttentionBackend:
    """The backend `name` (one of BACKENDS) for this model and pool; BackendUnavailable if it cannot run here.

    Args:
        max_batch: the most rows a plan will have (the largest graph bucket).
        max_pages: the most page indices a plan will hold (pool pages plus padding rows).
    """
    if name == "meld":
        return MeldBackend(config, page_size, device, max_batch, max_pages)
    if name in ("flashinfer", "flashinfer-tc"):
        return FlashInferBackend(config, page_size, device, max_pages, tensor_cores=name == "flashinfer-tc")
    if name == "sdpa":
        return SdpaBackend(config, page_size, device)
    raise ValueError(f"unknown attention backend {name!r}; expected one of {', '.join(BACKENDS)}")


def unavailable(name: str, device) -> str | None:
    """Why backend `name` cannot run on `device` (None if it can), found without building anything."""
    if name not in BACKENDS:
        return f"unknown attention backend {name!r}; expected one of {', '.join(BACKENDS)}"
    if name.startswith("flashinfer"):
        if torch.device(device).type != "cuda":
            return f"the {name} backend runs on CUDA GPUs only (this run is on the CPU)"
        try:
            _import_flashinfer()
        except BackendUnavailable as e:
            return str(e)
    return None
