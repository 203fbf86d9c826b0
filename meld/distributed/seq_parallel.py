"""`SeqParallelDecode`: decode attention with the KV of long requests sharded across the GPUs of a
process group, in one persistent kernel per GPU and no collective.

Every rank holds the whole batch's q and runs its parts of the batch (`shard_batch`: a long request is
cut into one contiguous token range per rank, a short one stays whole on one rank) as a batch of its own
as the `DecodeAttention` it is, with the kernel's cross-rank combine edge built in (`xrank`: MELD_XRANK,
templates/decode_xrank.cuh).
Results travel through one symmetric window per rank (`meld.distributed.window`), by one of two transports:
- `"peer"` (NVLink peer memory, the GPUs of a node): a part's partial goes straight into the owner's
  window, the part whose arrival completes a unit's count merges the parts and writes the output into
  every rank's window;
- `"proxy"` (the model of RDMA between nodes, `meld.distributed.proxy`): every unit's rows go from this rank's
  window to the others' as puts handed to a host proxy thread, with one signal per CTA and destination;
  every rank merges the split requests itself once their parts have landed, at the end of its launch.
Either way each launch ends once every unit of the batch is in its own rank's window: each rank's
output is complete when its launch ends, in stream order, and a CUDA graph can hold the launch.

The page table is the batch's, the same on every rank; the pages of the tokens rank r computes
(`self.shard`, a function of the lengths only) index rank r's own `kv_cache`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..ir import TRANSPORTS
from ..ops.checks import check_positive, expect, grad_inputs, no_backward, plain
from ..ops.decode_attention import DecodeAttention
from ..ops.decode_graph import decode_attention_graph
from ..ops.page_table import check_page_table
from .shard import ShardPlan, shard_batch
from .member import GroupMember
from .window import check_engine, pack_regions

@dataclass(frozen=True)
class WindowLayout:
    """Byte offsets in a rank's symmetric window: the output rows and lse every rank receives, the float
    partials (and log2 lse) of split requests' parts at their owner (with the proxy: at every rank), one
    arrival counter per unit of the batch, the landing counter (the proxy: one per source rank), and the
    launches each rank has started."""

    out: int
    lse: int
    part_o: int
    part_lse: int
    counts: int
    landed: int
    started: int
    nbytes: int

    @staticmethod
    def of(max_batch: int, world: int, num_qo_heads: int, head_dim: int, units_per_request: int) -> "WindowLayout":
        return WindowLayout(**pack_regions({
            "out": max_batch * num_qo_heads * head_dim * 2, "lse": max_batch * num_qo_heads * 4,
            "part_o": max_batch * world * num_qo_heads * head_dim * 4, "part_lse": max_batch * world * num_qo_heads * 4,
            "counts": max_batch * units_per_request * 8, "landed": 8 * world, "started": 8 * world}))


class SeqParallelDecode(GroupMember, DecodeAttention):
    """Sequence-parallel paged decode attention over the ranks of a `torch.distributed` process group
    (one process per GPU; module docstring): `DecodeAttention` over this rank's parts of the batch, whose
    plan() shards the batch first and whose run() writes every rank's output.

    Args:
        num_qo_heads, num_kv_heads, head_dim, page_size, dtype, sm_scale, kv_layout, cluster_size: as
            `meld.DecodeAttention`'s.
        max_batch_size: requests per plan (the symmetric window is sized by it).
        max_num_pages: page indices of one rank's parts per plan.
        min_split_tokens: a request of at least `min_split_tokens * world` tokens is split across the ranks.
        group: the process group (default: the default group); device: this rank's GPU (default: current).
        transport: "peer" (NVLink peer memory) or "proxy" (puts and signals through a host proxy thread, as
            RDMA between nodes would carry them); ordered, chunk_bytes: the proxy's delivery (in issue
            order, or shuffled) and network chunk (`meld.distributed.proxy.GpuProxy`).
        engine: the window's and the proxy's engine, "cuda" or "nvshmem" (`meld.distributed.window`).
        kernel_config: the kernel (default: DecodeAttention's, with xrank the transport, as the graph's
            combine edge says). A launch waits at most 10 x its watchdog_ms for the other ranks' results, then
            the watchdog names the wait and the kernel traps.
    """

    _fastcall = False   # (its run() sets launch parameters of its own: the op's fast path does not replay it)

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 dtype: torch.dtype = torch.bfloat16, *, max_batch_size: int, max_num_pages: int,
                 min_split_tokens: int = 4096, group=None, device: str | torch.device | None = None,
                 sm_scale: float | None = None, kv_layout: str = "NHD", cluster_size: int = 1,
                 transport: str = "peer", ordered: bool = True, chunk_bytes: int = 64 << 10, kernel_config=None,
                 engine: str = "cuda"):
        check_engine(engine)
        self._join(group)
        check_positive("max_batch_size", max_batch_size)
        self.min_split_tokens = check_positive("min_split_tokens", min_split_tokens)
        device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        if device.type != "cuda":
            raise ValueError(f"device must be a CUDA device, got {device}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        self.transport = transport
        super().__init__(num_qo_heads, num_kv_heads, head_dim, page_size, dtype, device, kv_layout=kv_layout,
                         sm_scale=sm_scale, max_batch_size=max_batch_size, max_num_pages=max_num_pages,
                         cluster_size=cluster_size, kernel_config=kernel_config)
        self.layout = WindowLayout.of(max_batch_size, self.world, num_qo_heads, head_dim, self.units_per_request)
        self._open_window(self.layout.nbytes, device, transport, ordered, chunk_bytes, engine)
        # The kernel's int32 tables, written by plan() in one copy: per local request (batch request, part,
        # parts, owner); the split requests (batch request, parts; the proxy); exit count, landings per
        # launch, split requests, 0.
        nb = max_batch_size
        self._xint = torch.zeros(6 * nb + 4, dtype=torch.int32, device=device)
        self._xreq, self._xsplit = self._xint[:4 * nb].view(nb, 4), self._xint[4 * nb:6 * nb].view(nb, 2)
        self._xexit = self._xint[6 * nb:]
        # Per source rank the units expected from it and those taken (the proxy), then this rank's launches.
        self._xsrc = torch.zeros(2 * self.world + 1, dtype=torch.int64, device=device)
        self.shard: ShardPlan | None = None
        self._views: tuple[torch.Tensor, torch.Tensor] | None = None   # run()'s outputs for the planned batch
        self._bind_edge()
        self._joined(device)

    def _graph(self, dtype: str):
        """DecodeAttention's graph with its rank dimension: partials cross ranks by the transport."""
        return decode_attention_graph(self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size, dtype,
                                      transport=self.transport)

    def _bind_edge(self) -> None:
        """The kernel's cross-rank edge parameters: fixed for the operator's life (the capacities are given,
        so plan() never replaces the buffers that hold them)."""
        L = self.layout
        self._buf.launcher.set(
            **self._edge_params(xreq=self._xreq, xexit=self._xexit, xsplit=self._xsplit, xsrc=self._xsrc),
            x_out_off=L.out, x_lse_off=L.lse, x_po_off=L.part_o, x_plse_off=L.part_lse, x_count_off=L.counts,
            x_landed_off=L.landed, x_started_off=L.started)

    def plan(self, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor, *,
             check: bool = True) -> None:
        """Plan a batch (FlashInfer's paged layout, int32 CPU tensors, the same on every rank): this rank's
        parts of it as DecodeAttention's plan, then the edge's tables. A plan() that raises changes nothing."""
        for name, t in (("kv_indptr", kv_indptr), ("kv_indices", kv_indices), ("kv_last_page_len", kv_last_page_len)):
            expect(name, t, torch.int32, (None,), "int32 on the CPU", torch.device("cpu"), contiguous=True)
        indptr, last = kv_indptr.numpy(), kv_last_page_len.numpy()
        B = len(indptr) - 1
        if B < 0 or len(last) != B:
            raise ValueError(f"kv_indptr has {len(indptr)} entries and kv_last_page_len {len(last)}: expected B + 1 and B")
        if B > self.max_batch_size:
            raise ValueError(f"batch of {B} requests exceeds max_batch_size={self.max_batch_size}")
        check_page_table(indptr, last, kv_indices.numel(), self.page_size)
        pages = np.diff(indptr.astype(np.int64))
        kv_len = np.where(pages > 0, (pages - 1) * self.page_size + last, 0)
        shard = shard_batch(kv_len, self.page_size, self.world, self.min_split_tokens)
        idx, l_indptr, l_indices, l_last = shard.local_tables(self.rank, indptr, kv_indices.numpy(), self.page_size)
        super().plan(torch.from_numpy(l_indptr), torch.from_numpy(l_indices), torch.from_numpy(l_last), check=check)
        rows = np.stack([shard.req[idx], shard.part[idx], shard.num_parts[shard.req[idx]], shard.owner[shard.req[idx]]],
                        axis=1).astype(np.int32).reshape(-1, 4)
        U, nb = self.units_per_request, self.max_batch_size
        split = np.flatnonzero(shard.num_parts > 1)
        host = np.zeros(self._xint.numel(), dtype=np.int32)
        host[:rows.size] = rows.reshape(-1)
        host[4 * nb:4 * nb + 2 * len(split)] = np.stack([split, shard.num_parts[split]], axis=1).reshape(-1)
        host[6 * nb:] = (0, B * U, len(split), 0)
        self._xint.copy_(torch.from_numpy(host))
        from_src = np.bincount(shard.rank, minlength=self.world) * U
        from_src[self.rank] = 0
        self._xsrc[:self.world].copy_(torch.from_numpy(from_src.astype(np.int64)))
        self.shard, self._views = shard, self.outputs(B)

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor], *,   # type: ignore[override]
            return_lse: bool = False):
        """out [B, num_qo_heads, head_dim] (and lse [B, num_qo_heads], float32, natural log), the same on
        every rank once this launch ends; kv_cache as `DecodeAttention.run`'s (one tensor, or (k_cache,
        v_cache)). They are views of this rank's window, rewritten by the next run(): clone them to keep them.
        Every rank must run each plan."""
        if self.shard is None:
            raise RuntimeError("SeqParallelDecode.run: call plan() first")
        self._check_proxy()
        B, Hq, D = len(self.shard.kv_len), self.num_qo_heads, self.head_dim
        grads = grad_inputs(q, *(kv_cache if isinstance(kv_cache, tuple) else (kv_cache,)))
        q = plain(q)
        expect("q", q, self.dtype, (B, Hq, D), "batch of the last plan(), num_qo_heads, head_dim", self.device)
        kv = self._check_kv_cache(kv_cache, self._planned)
        out, lse = self._views
        self._launch(q, kv, out, lse)
        # (the window's views stay untied: new views of them carry the tie)
        out, lse = no_backward("meld.distributed.SeqParallelDecode.run", grads, (out, lse), in_place=False)
        return (out, lse) if return_lse else out

    def outputs(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's output and lse views of its window for a batch of `batch` requests."""
        w, L, Hq, D = self.window.local, self.layout, self.num_qo_heads, self.head_dim
        out = w[L.out:L.out + batch * Hq * D * 2].view(self.dtype).view(batch, Hq, D)
        lse = w[L.lse:L.lse + batch * Hq * 4].view(torch.float32).view(batch, Hq)
        return out, lse
