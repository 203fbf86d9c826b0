"""Attention backends of the decode loop, behind the interface serving engines use: `plan(table)` once
per step with that step's page table (vLLM's metadata builder, SGLang's init_forward_metadata), then
`run(layer, q, kv_cache)` in every layer, reading the plan.

- `meld`: one `meld.DecodeAttention` shared by all layers, its capacities fixed at construction so a
  plan() rewrites its tables in place and one captured graph per batch-size bucket replays every plan.
- `flashinfer` / `flashinfer-tc`: FlashInfer's `BatchDecodeWithPagedKVCacheWrapper` (CUDA cores, or its
  tensor-core decode), one wrapper per bucket under CUDA graphs (its cuda-graph mode fixes the batch).
- `sdpa`: torch `scaled_dot_product_attention` over K/V gathered from the pages, requests sorted by length
  and batched under a token budget: the reference. Eager only (its shapes change with every batch).

MLA models (DeepSeek, `ModelConfig.is_mla`) run q [B, Hq, 576] (the absorbed query and its rope part) over
a `PagedLatentCache` layer [pages, page_size, 576] to the latent output [B, Hq, 512], on:
- `meld`: `meld.DecodeMLA`, as the GQA one (capacities fixed, graphs per bucket).
- `flashinfer`: FlashInfer's `flashinfer.mla.BatchMLAPagedAttentionWrapper`, one per bucket under graphs.
- `flashmla`: FlashMLA's `flash_mla_with_kvcache` (page size 64 only), its block table, lengths and split
  scheduling metadata in fixed buffers per bucket under graphs.
- `sdpa`: the reference, as for GQA with the latent row as K and its first 512 channels as V.

Padding rows of a graph bucket: meld gives an empty request zeros, so they get no pages; FlashInfer's
and FlashMLA's are given the one null page of one token instead (`pad_page`), which needs no promise about
empty ones.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .kv_cache import NULL_PAGE, PageTable
from .models import ModelConfig

BACKENDS = ("meld", "flashinfer", "flashinfer-tc", "sdpa", "flashmla")
MLA_BACKENDS = ("meld", "flashinfer", "sdpa", "flashmla")
FLASHMLA_PAGE_SIZE = 64
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


def _split_latent(q: torch.Tensor, kv_cache: torch.Tensor, width: int) -> tuple[torch.Tensor, ...]:
    """q_nope, q_pe, ckv_cache, kpe_cache: views of the MLA query and latent cache at channel `width`."""
    return q[..., :width], q[..., width:], kv_cache[..., :width], kv_cache[..., width:]


class MeldMLABackend(MeldBackend):
    """meld.DecodeMLA over the latent cache, planned as MeldBackend's decode."""

    def __init__(self, config: ModelConfig, page_size: int, device, max_batch: int, max_pages: int):
        import meld

        self.width = config.kv_lora_rank
        self.attn = meld.DecodeMLA(config.num_qo_heads, page_size, config.dtype, device, sm_scale=config.sm_scale,
                                   head_dim_ckv=config.kv_lora_rank, head_dim_kpe=config.qk_rope_head_dim,
                                   max_batch_size=max_batch, max_num_pages=max_pages)

    def run(self, layer: int, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        return self.attn.run(*_split_latent(q, kv_cache, self.width))


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


class FlashInferMLABackend(AttentionBackend):
    """FlashInfer's MLA wrapper (`flashinfer.mla.BatchMLAPagedAttentionWrapper`): eager, one wrapper; with
    graphs, one cuda-graph wrapper per bucket with its own page-table buffers. All share one workspace."""

    name = "flashinfer"
    supports_graphs = True
    pad_page = NULL_PAGE

    def __init__(self, config: ModelConfig, page_size: int, device, max_pages: int):
        device = torch.device(device)
        if device.type != "cuda":
            raise BackendUnavailable("the flashinfer backend runs on CUDA GPUs only (this run is on the CPU)")
        self._mla = _import_flashinfer().mla
        self.config, self.page_size, self.device, self.max_pages = config, page_size, device, max_pages
        self.workspace = torch.empty(_FLASHINFER_WORKSPACE, dtype=torch.uint8, device=device)
        self._eager = self._mla.BatchMLAPagedAttentionWrapper(self.workspace)
        self._graphed: dict[int, object] = {}
        self._wrapper = None

    def prepare_graphs(self, buckets: list[int]) -> None:
        i32 = dict(dtype=torch.int32, device=self.device)
        for b in buckets:
            self._graphed[b] = self._mla.BatchMLAPagedAttentionWrapper(
                self.workspace, use_cuda_graph=True, qo_indptr=torch.zeros(b + 1, **i32),
                kv_indptr=torch.zeros(b + 1, **i32), kv_indices=torch.zeros(self.max_pages, **i32),
                kv_len_arr=torch.zeros(b, **i32))

    def plan(self, table: PageTable) -> None:
        c = self.config
        w = self._graphed.get(table.rows, self._eager)
        qo_indptr = torch.arange(table.rows + 1, dtype=torch.int32)   # decode: one query row per request
        w.plan(qo_indptr, table.kv_indptr, table.kv_indices, torch.from_numpy(table.kv_lens.astype(np.int32)),
               c.num_qo_heads, c.kv_lora_rank, c.qk_rope_head_dim, self.page_size, False, c.sm_scale, c.dtype,
               c.dtype)
        self._wrapper = w

    def run(self, layer: int, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        return self._wrapper.run(*_split_latent(q, kv_cache, self.config.kv_lora_rank))


class FlashMLABackend(AttentionBackend):
    """FlashMLA's decode (`flash_mla.flash_mla_with_kvcache`, its SM90 dense path, `use_legacy=True`), as
    bench/mla.py calls it. plan() writes the block table [B, pages] and the lengths on the device and runs
    FlashMLA's split scheduler (`get_mla_decoding_metadata`, hoisted out of the layers as engines do); every
    layer's run() reads them. With graphs, one set of these per bucket, at fixed addresses: the table as wide
    as `max_position` needs, the metadata overwritten in place by each plan."""

    name = "flashmla"
    supports_graphs = True
    pad_page = NULL_PAGE

    def __init__(self, config: ModelConfig, page_size: int, device):
        device = torch.device(device)
        if device.type != "cuda":
            raise BackendUnavailable("the flashmla backend runs on CUDA GPUs only (this run is on the CPU)")
        self._fm = _import_flash_mla()
        self.config, self.page_size, self.device = config, page_size, device
        self._graphed: dict[int, tuple[torch.Tensor, ...]] = {}
        self._plan: tuple[torch.Tensor, ...] = ()
        self._sched = None

    def _schedule(self, seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(tile scheduler metadata, split counts) of one query token per request over lengths `seqlens`."""
        h = self.config.num_qo_heads
        return self._fm.get_mla_decoding_metadata(seqlens, h, 1, h, use_legacy=True)

    def prepare_graphs(self, buckets: list[int]) -> None:
        width = -(-self.config.max_position // self.page_size)
        for b in buckets:
            seqlens = torch.ones(b, dtype=torch.int32, device=self.device)
            self._graphed[b] = (torch.zeros(b, width, dtype=torch.int32, device=self.device), seqlens,
                                *self._schedule(seqlens))

    def plan(self, table: PageTable) -> None:
        counts = np.diff(table.kv_indptr.numpy())
        blocks = np.zeros((table.rows, max(1, int(counts.max(initial=0)))), dtype=np.int32)
        blocks[np.arange(blocks.shape[1])[None, :] < counts[:, None]] = table.kv_indices.numpy()   # row by row
        seqlens = torch.from_numpy(table.kv_lens.astype(np.int32))
        fixed = self._graphed.get(table.rows)
        if fixed is None:
            seqlens = seqlens.to(self.device)
            self._plan = (torch.from_numpy(blocks).to(self.device), seqlens, *self._schedule(seqlens))
        else:
            fixed[0][:, :blocks.shape[1]].copy_(torch.from_numpy(blocks))
            fixed[1].copy_(seqlens)
            for buf, new in zip(fixed[2:], self._schedule(fixed[1])):
                buf.copy_(new)
            self._plan = fixed
        self._sched, _ = self._fm.get_mla_metadata()
        self._sched.tile_scheduler_metadata, self._sched.num_splits = self._plan[2:]

    def run(self, layer: int, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        c = self.config
        out, _ = self._fm.flash_mla_with_kvcache(
            q.unsqueeze(1), kv_cache.view(kv_cache.shape[0], self.page_size, 1, c.head_dim), self._plan[0],
            self._plan[1], c.kv_lora_rank, self._sched, softmax_scale=c.sm_scale, use_legacy=True)
        return out[:, 0]


class SdpaBackend(AttentionBackend):
    """The reference: plan() turns the page table into gather indices (requests sorted by length, grouped
    so that a group's padded tokens stay under `budget_tokens`); run() gathers each group's K/V from the
    pages and calls SDPA with a padding mask, the q heads of a kv head taken as its query rows (GQA
    without copying K/V per q head). A request with no tokens gives zeros, as meld's does. For MLA the pages
    hold one latent row per token: K is the row, V its first kv_lora_rank channels."""

    name = "sdpa"

    def __init__(self, config: ModelConfig, page_size: int, device, budget_tokens: int = 1 << 19):
        self.config, self.page_size, self.device = config, page_size, torch.device(device)
        self.budget_tokens = budget_tokens
        # A layer's cache as token rows [pages * row_pages * P, heads, D]: K at row_pages * P * page + offset,
        # V (GQA) P rows further.
        self._row_pages = 1 if config.is_mla else 2
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
            k_rows = np.where(valid, page * self._row_pages * P + t[None, :] % P, 0)
            groups.append(tuple(torch.from_numpy(a).to(self.device) for a in (rows, k_rows, valid[:, None, None, :])))
            i += len(rows)
        self._groups = groups

    def run(self, layer: int, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        c = self.config
        B, Hq, D = q.shape
        Hkv, P = c.num_kv_heads, self.page_size
        Dv = c.kv_lora_rank if c.is_mla else D
        flat = kv_cache.view(-1, Hkv, D)
        out = q.new_zeros(B, Hq, Dv)
        for rows, k_rows, mask in self._groups:
            g, L = k_rows.shape
            k = flat[k_rows.view(-1)].view(g, L, Hkv, D).transpose(1, 2)
            v = k[..., :Dv] if c.is_mla else flat[k_rows.view(-1) + P].view(g, L, Hkv, D).transpose(1, 2)
            o = F.scaled_dot_product_attention(q[rows].view(g, Hkv, Hq // Hkv, D), k, v, attn_mask=mask,
                                               scale=c.sm_scale)
            out.index_copy_(0, rows, o.reshape(g, Hq, Dv))
        return out


def make_backend(name: str, config: ModelConfig, page_size: int, device, max_batch: int,
                 max_pages: int) -> AttentionBackend:
    """The backend `name` (one of BACKENDS) for this model and pool; BackendUnavailable if it cannot run here,
    ValueError if it does not run this model's attention or page size (`unavailable` says which, first).

    Args:
        max_batch: the most rows a plan will have (the largest graph bucket).
        max_pages: the most page indices a plan will hold (pool pages plus padding rows).
    """
    why = unsupported(name, config, page_size)
    if why:
        raise ValueError(why)
    if config.is_mla and name == "meld":
        return MeldMLABackend(config, page_size, device, max_batch, max_pages)
    if config.is_mla and name == "flashinfer":
        return FlashInferMLABackend(config, page_size, device, max_pages)
    if name == "flashmla":
        return FlashMLABackend(config, page_size, device)
    if name == "meld":
        return MeldBackend(config, page_size, device, max_batch, max_pages)
    if name in ("flashinfer", "flashinfer-tc"):
        return FlashInferBackend(config, page_size, device, max_pages, tensor_cores=name == "flashinfer-tc")
    if name == "sdpa":
        return SdpaBackend(config, page_size, device)
    raise ValueError(f"unknown attention backend {name!r}; expected one of {', '.join(BACKENDS)}")


def _import_flash_mla():
    try:
        import flash_mla
    except Exception as e:   # ImportError, or a broken install failing at import
        raise BackendUnavailable(f"the flashmla backend needs the flash_mla package (FlashMLA), which does not "
                                 f"import here: {type(e).__name__}: {e}") from None
    return flash_mla


def unsupported(name: str, config: ModelConfig, page_size: int | None) -> str | None:
    """Why backend `name` (one of BACKENDS) does not run `config`'s attention at `page_size` (not checked when
    None); None if it does."""
    if config.is_mla and name not in MLA_BACKENDS:
        return (f"the {name} backend has no MLA attention, which model {config.name!r} needs (its backends: "
                f"{', '.join(MLA_BACKENDS)})")
    if not config.is_mla and name == "flashmla":
        return f"the flashmla backend runs MLA only (model 'deepseek'), not the GQA of model {config.name!r}"
    if name == "flashmla" and page_size not in (None, FLASHMLA_PAGE_SIZE):
        return f"the flashmla backend runs page size {FLASHMLA_PAGE_SIZE} only, got {page_size}"
    return None


def not_installed(name: str) -> str | None:
    """Why backend `name`'s package does not import here (None: it does, or the backend needs none)."""
    if name.startswith("flashinfer") or name == "flashmla":
        try:
            (_import_flash_mla if name == "flashmla" else _import_flashinfer)()
        except BackendUnavailable as e:
            return str(e)
    return None


def unavailable(name: str, device, config: ModelConfig | None = None, page_size: int | None = None) -> str | None:
    """Why backend `name` cannot run on `device` (None if it can), found without building or importing
    anything; given a model config and page size, also why it does not run them (`unsupported`). Whether its
    package imports is `not_installed`'s question (serve-bench skips such a backend)."""
    if name not in BACKENDS:
        return f"unknown attention backend {name!r}; expected one of {', '.join(BACKENDS)}"
    if config is not None:
        why = unsupported(name, config, page_size)
        if why:
            return why
    if (name.startswith("flashinfer") or name == "flashmla") and torch.device(device).type != "cuda":
        return f"the {name} backend runs on CUDA GPUs only (this run is on the CPU)"
    return None
