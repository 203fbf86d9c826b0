"""`ExpertParallelMoE`: an MoE layer whose experts are split over the GPUs of a process group, each rank
keeping its own tokens: dispatch, this rank's experts on its MoE kernels, and the weighted expert rows back
to their tokens' ranks, combined in choice order — a stream of launches on every GPU with no host
synchronisation and no collective (templates/ep_moe.cuh), CUDA-graph capturable. The rows cross through
NVLink peer memory, or through the proxy transport (the model of RDMA between nodes: meld/distributed/proxy.py).

Rank r serves experts [r E/W, (r+1) E/W) (`meld.distributed.ep_moe.expert_owner`; `meld.distributed.ep_moe` runs the
same protocol on emulated ranks). Its window receives every rank's rows at fixed slots (source rank, token,
choice), which its `meld.MoE` (top_k 1, first_expert r E/W, a pair of another rank's expert skipped) runs
as tokens: each served slot's row through its expert, times its weight. The result is deterministic: each
token's k weighted rows are summed in choice order on its own rank. Precision: each weighted expert row is
rounded to bf16 before the sum (the single-GPU MoE rounds once, after it).

Routing is the caller's (`topk_weights`, `topk_ids`: vLLM's `fused_experts` convention), computed on every
rank for its own tokens. Every rank must make the same calls with the same number of tokens (a new count is
checked across the group once, on its first call).
"""
from __future__ import annotations

import dataclasses

import torch

from ..codegen.ep_kernel import EP_ENTRIES, EP_WARPS, EpKernelConfig
from ..codegen.moe_kernel import MAX_EXPERTS, MoeKernelConfig, block_tokens_for
from ..ops.base import Operator
from ..ops.checks import check_output, check_positive, expect, grad_inputs, no_backward, plain, resolve_device
from ..ops.moe import MoE
from ..ops.moe_graph import moe_graph
from .member import GroupMember
from .window import check_engine, pack_regions

MAX_TOP_K = 32            # a warp's lanes hold a token's pairs (templates/ep_moe.cuh)


def window_layout(max_tokens: int, top_k: int, hidden: int, world: int) -> dict[str, int]:
    """Byte offsets in a rank's window: per rank, the calls it started, its dispatches and its returns that
    landed here (u64 running counts); per (source, pair) slot [world][T k], its global expert (int32, -1:
    invalid), weight (float) and row (bf16 [H]); per (owner, source) [world][world][T k], the weighted expert
    rows the owner served (bf16 [H]: a block per pair of ranks, so that the proxy puts whole blocks that
    no other rank writes)."""
    slots = max_tokens * top_k
    sizes = {"started": 8 * world, "sent": 8 * world, "back": 8 * world, "hdr": 4 * world * slots,
             "wts": 4 * world * slots, "rows": 2 * hidden * world * slots, "ret": 2 * hidden * world * world * slots}
    return pack_regions(sizes)


@dataclasses.dataclass(frozen=True)
class _Call:
    grid_dispatch: int
    grid_return: int
    grid_combine: int
    rows: torch.Tensor          # the window's slots as the MoE's tokens [world T k, H]
    ids: torch.Tensor           # their global experts [world T k, 1]
    weights: torch.Tensor       # [world T k, 1]
    served: torch.Tensor        # the MoE's output [world T k, H]
    block_tokens: int


def _describe(unit: int) -> str:
    return {-1: "the dispatch (every rank's rows for this rank's experts)",
            -2: "the return (every rank's expert rows for this rank's tokens)"}.get(unit, f"token {unit}")


class ExpertParallelMoE(GroupMember, Operator):
    """out = the MoE layer on this rank's tokens, its experts spread over a `torch.distributed` group
    (module docstring).

    Args:
        hidden_size, intermediate_size: H and I (multiples of 8).
        num_experts: E over the whole group (a multiple of the group's size: each rank serves E / world).
        top_k: experts per token, 1..min(E, 32).
        max_num_tokens: the most tokens per rank per call (the symmetric window is sized by it).
        group: the process group (default: the default group); device: this rank's GPU (default: current).
        kernel_config: the cross-rank kernels (`meld.codegen.ep_kernel.EpKernelConfig`: the transport, "peer"
            or "proxy"); a wait for other ranks gives up after ten times its watchdog_ms, names what it
            waited for and traps.
        moe_kernel_config: this rank's MoE kernels (`meld.codegen.moe_kernel.MoeKernelConfig`; absent pairs
            are always on).
        ordered, chunk_bytes: the proxy transport's delivery (in issue order, or shuffled) and network chunk
            (`meld.distributed.proxy.GpuProxy`).
        engine: the window's and the proxy's engine, "cuda" or "nvshmem" (`meld.distributed.window`).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, *,
                 max_num_tokens: int, dtype: torch.dtype = torch.bfloat16, group=None,
                 device: str | torch.device | None = None, kernel_config: EpKernelConfig | None = None,
                 moe_kernel_config: MoeKernelConfig | None = None, ordered: bool = True,
                 chunk_bytes: int = 64 << 10, engine: str = "cuda"):
        check_engine(engine)
        self._join(group)
        self.hidden_size = H = check_positive("hidden_size", hidden_size)
        self.intermediate_size = I = check_positive("intermediate_size", intermediate_size)
        for name, v in (("hidden_size", H), ("intermediate_size", I)):
            if v % 8:
                raise ValueError(f"{name}={v}: must be a multiple of 8 (16-byte rows)")
        self.num_experts = E = check_positive("num_experts", num_experts)
        self.top_k = check_positive("top_k", top_k)
        if self.top_k > min(E, MAX_TOP_K):
            raise ValueError(f"top_k={top_k}: expected 1..min(num_experts={E}, {MAX_TOP_K})")
        self.max_num_tokens = check_positive("max_num_tokens", max_num_tokens)
        if dtype != torch.bfloat16:
            raise ValueError(f"dtype must be torch.bfloat16, got {dtype}")
        given = kernel_config or EpKernelConfig()
        if not isinstance(given, EpKernelConfig):
            raise ValueError(f"kernel_config must be a meld.codegen.ep_kernel.EpKernelConfig, got {kernel_config!r}")
        if E % self.world:
            raise ValueError(f"num_experts={E} does not divide over the group's {self.world} ranks")
        self.experts_per_rank = E // self.world
        if self.experts_per_rank > MAX_EXPERTS:
            raise ValueError(f"num_experts={E}: {self.experts_per_rank} experts per rank, more than {MAX_EXPERTS}")
        self.first_expert = self.rank * self.experts_per_rank
        device = resolve_device("cuda" if device is None else device)
        if device.type != "cuda":
            raise ValueError(f"device must be a CUDA device, got {device}")
        self.dtype = dtype
        # The graph says the experts' outputs cross ranks (its combine edge's transport); the lowering gives the
        # cross-rank kernels' config and their parameter struct.
        self._setup(moe_graph(H, I, E, self.top_k, renormalize=False, transport=given.transport), device)
        self.kernel_config = self.lowering.transport_config(watchdog_ms=given.watchdog_ms)
        self._require_hopper(exact=True)
        slots = self.world * self.max_num_tokens * self.top_k
        base = moe_kernel_config or self.lowering.kernel_config()
        self.experts = MoE(H, I, self.experts_per_rank, 1, dtype, device, slots, renormalize=False,
                           kernel_config=dataclasses.replace(base, absent_pairs=True), first_expert=self.first_expert)
        # Every row-block variant loaded now: a module load inside a call would wait for the device while the
        # dispatch kernel waits for the other ranks, whose proxy threads' copies wait for that load's lock.
        self.experts.load_kernels()
        self.layout = window_layout(self.max_num_tokens, self.top_k, H, self.world)
        self._open_window(self.layout["nbytes"], device, self.kernel_config.transport, ordered, chunk_bytes, engine)
        self._served = torch.empty(slots, H, dtype=dtype, device=device)
        self._error = torch.zeros(1, dtype=torch.int32, device=device)
        self._xexit = torch.zeros(1, dtype=torch.int32, device=device)
        self._xlaunch = torch.zeros(1, dtype=torch.int64, device=device)
        self._register_watchdog("meld_ep_moe", _describe)
        cfg = self.kernel_config
        self._k = self._kernels(cfg, {e: (cfg.threads, 0) for e in EP_ENTRIES})
        self._sm_count = torch.cuda.get_device_properties(device).multi_processor_count
        L = self.layout
        self._p = self.lowering.params.ctype(
            **self._edge_params(xexit=self._xexit, xlaunch=self._xlaunch), **self._header(),
            served=self._served.data_ptr(), error=self._error.data_ptr(), x_started_off=L["started"],
            x_sent_off=L["sent"], x_back_off=L["back"], x_hdr_off=L["hdr"], x_wts_off=L["wts"], x_rows_off=L["rows"],
            x_ret_off=L["ret"], hidden=H, top_k=self.top_k, num_experts=E, experts_per_rank=self.experts_per_rank)
        self._checked_counts: set[int] = set()
        self._calls: dict[int, _Call] = {}
        self._joined(device)

    def _grid(self, entry: str, items: int) -> int:
        """CTAs of one warp per item, at most as many as are resident at once (the dispatch's handshake
        waits for CTA 0)."""
        return max(1, min(-(-items // EP_WARPS), self._k[entry].ctas_per_sm * self._sm_count))

    def _check_count(self, T: int) -> None:
        """Every rank calls with the same number of tokens: checked across the group once per count."""
        if T in self._checked_counts:
            return
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"ExpertParallelMoE: a first call with {T} tokens is being captured; call once with "
                               f"{T} tokens before capturing (the count is checked across the group, on the host)")
        import torch.distributed as dist

        got = [None] * self.world
        dist.all_gather_object(got, T, group=self.group)
        if len(set(got)) != 1:
            raise ValueError(f"x has {T} tokens on rank {self.rank}, but the ranks' counts are {got}: every rank "
                             "must call with the same number of tokens")
        self._checked_counts.add(T)

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor,
                 w2: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """out [T, H] for this rank's x [T, H] routed to `topk_ids` [T, top_k] (global expert ids, int32 or
        int64) with `topk_weights` [T, top_k] (float32), this rank's experts' w13 [E / world, 2I, H] and
        w2 [E / world, H, I]. An id out of range or repeated in a row gives its token NaN (see `errors`)."""
        grads = grad_inputs(x, topk_weights, w13, w2)
        x, w13, w2 = plain(x), plain(w13), plain(w2)
        H, I, k, El, dev = self.hidden_size, self.intermediate_size, self.top_k, self.experts_per_rank, self.device
        expect("x", x, self.dtype, (None, H), "tokens x hidden_size", dev)
        T = x.shape[0]
        if T > self.max_num_tokens:
            raise ValueError(f"x has {T} tokens, more than max_num_tokens={self.max_num_tokens}")
        topk_ids, topk_weights = plain(topk_ids), plain(topk_weights)
        dt = topk_ids.dtype if isinstance(topk_ids, torch.Tensor) else None
        expect("topk_ids", topk_ids, dt if dt in (torch.int32, torch.int64) else torch.int32, (T, k), "tokens x top_k", dev)
        expect("topk_weights", topk_weights, torch.float32, (T, k), "tokens x top_k", dev)
        expect("w13", w13, self.dtype, (El, 2 * I, H), "this rank's experts x 2*intermediate_size x hidden_size", dev,
               True)
        expect("w2", w2, self.dtype, (El, H, I), "this rank's experts x hidden_size x intermediate_size", dev, True)
        if out is None:
            out = torch.empty(T, H, dtype=self.dtype, device=dev)
        else:
            expect("out", out, self.dtype, (T, H), "tokens x hidden_size", dev, True)
            check_output("out", out, {"x": x, "topk_weights": topk_weights, "topk_ids": topk_ids, "w13": w13, "w2": w2})
        self._check_proxy()
        self._check_count(T)
        if T == 0:
            return no_backward("meld.distributed.ExpertParallelMoE", grads, (out,))[0]
        if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
            x = x.contiguous()
        ids = topk_ids.to(torch.int32).contiguous()
        wts = topk_weights.contiguous()
        self._watchdog.check()
        p = self._p
        p.x, p.x_stride, p.topk_ids, p.topk_w, p.out, p.num_tokens = (x.data_ptr(), x.stride(0), ids.data_ptr(),
                                                                       wts.data_ptr(), out.data_ptr(), T)
        c = self._calls.get(T) or self._call(T)
        self._k["meld_ep_dispatch"].launch(c.grid_dispatch, p)
        self.experts(c.rows, None, w13, w2, topk_weights=c.weights, topk_ids=c.ids, out=c.served,
                     block_tokens=c.block_tokens)
        self._k["meld_ep_return"].launch(c.grid_return, p)
        self._k["meld_ep_combine"].launch(c.grid_combine, p)
        return no_backward("meld.distributed.ExpertParallelMoE", grads, (out,))[0]

    def _call(self, T: int) -> "_Call":
        """What a call of T tokens launches over, worked out once per T: the grids, and the MoE's inputs as
        views of the window's world T k slots."""
        S, L, win, H = self.world * T * self.top_k, self.layout, self.window.local, self.hidden_size
        c = self._calls[T] = _Call(
            grid_dispatch=self._grid("meld_ep_dispatch", T), grid_return=self._grid("meld_ep_return", S),
            grid_combine=self._grid("meld_ep_combine", T),
            rows=win[L["rows"]:L["rows"] + S * H * 2].view(self.dtype).view(S, H),
            ids=win[L["hdr"]:L["hdr"] + S * 4].view(torch.int32).view(S, 1),
            weights=win[L["wts"]:L["wts"] + S * 4].view(torch.float32).view(S, 1), served=self._served[:S],
            # this rank's rows per expert average world T k / E: the row block the MoE picks for them
            block_tokens=block_tokens_for(self.world * T, self.top_k, self.num_experts))
        return c

    def errors(self) -> int:
        """Nonzero once a call met an invalid topk id (waits for the GPU); clears it."""
        e = int(self._error.item())
        self._error.zero_()
        return e
