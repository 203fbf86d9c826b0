"""`RowParallelLinear`: a tensor-parallel row-parallel projection whose all-reduce is fused into the GEMM,
tile by tile, in one persistent kernel per GPU (templates/tp_linear.cuh).

Rank r holds x_r [M, K] and W_r [N, K], its slices of the contraction dimension (Megatron's row-parallel
layer: the input arrives split, as the column-parallel layer before it leaves it); every rank gets
y = sum_r x_r W_r^T [M, N]. By default (`TpKernelConfig.merge="every_rank"`) every piece's partial tile
is published in its rank's window as soon as it is computed (bf16 by default) and stamped on every rank;
each rank sums its own output in rank order, reading the partials where they lie (NVLink peer memory),
as soon as a tile's are all stamped: the exchange and the sums overlap the GEMM's next tiles, there is no
separate collective and no remote fetch-add, and every rank's result is bit-identical, launch after
launch. At decode sizes (every CTA one piece, token blocks of at most 64) the kernel takes a direct path
instead: each CTA stores its partial into every rank's window as words that carry the launch's tag, and
sums its share of the tile once every part's words carry it (tp_linear.cuh, tp_direct). The proxy
transport (`transport="proxy"`, the model of RDMA between nodes) carries the same as puts and signals into
every rank's window. With `merge="owner"` each tile is summed at its owner rank by whichever partial
arrives last and written into every rank's output: fewer bytes per rank in larger groups, slower on two
H200s (bench/RESULTS.md).
templates/tp_linear.cuh says how each works and why neither deadlocks.

The output is a view of this rank's symmetric window (torch symmetric memory), complete when the launch
ends in stream order and rewritten by the next call: clone it to keep it. Every rank must make the same
calls with the same M. The launch is CUDA-graph capturable.
"""
from __future__ import annotations

import torch

from .. import config
from ..ops.base import Operator
from ..ops.checks import check_positive, expect, grad_inputs, no_backward, plain, resolve_device
from ..ops.tp_linear_graph import tp_linear_graph
from .member import GroupMember
from .window import check_engine, pack_regions



def _window_layout(max_tokens: int, n: int, world: int, sm_count: int, part_ranks: int, direct: int = 0) -> dict[str, int]:
    """Byte offsets in a rank's window: the output [max_tokens, N] bf16, the partials (sized as float) of
    `part_ranks` ranks (`TpSchedule.max_partial_floats` each: owner merges keep [tiles][world x k_splits]
    [cols x block tokens] at a tile's owner; every-rank merges per CTA, over peer memory this rank's own
    only, over the proxy every rank's), one u64 counter per output tile, the landing counter, the launches
    every rank started, the every-rank merges' stamps [world][2 x SMs], and `direct` bytes for the direct
    path's tagged words (`meld.codegen.tp_kernel.direct_room`)."""
    from ..codegen.tp_kernel import TpSchedule

    sizes = {"out": max_tokens * n * 2, "part": TpSchedule.max_partial_floats(max_tokens, n, sm_count) * part_ranks * 4,
             "count": -(-n // 64) * -(-max_tokens // 8) * 8, "landed": 8, "started": 8 * world,
             "signal": 8 * world * 2 * sm_count, "ll": direct}
    return pack_regions(sizes)


def _describe_tile(call: dict):
    """The watchdog's name for piece t of the last call (`call`: its schedule, grid and world), from its row."""
    def describe(t: int) -> str:
        from ..ir.work_table import TP_PIECE

        s = call.get("sched")
        if s is None or not 0 <= t < s.pieces:
            return f"piece {t}"
        row = TP_PIECE.unpack(s.tasks(call["grid"], call["world"])[0], s.pieces)
        tokens, cols, _ = s.piece_slices(row, t)
        return (f"piece {row['split'][t]} of {s.k_splits} of K of output tile {row['tile'][t]}: columns "
                f"{cols.start}..{cols.stop - 1}, tokens {tokens.start}..{tokens.stop - 1}")
    return describe


_PROFILE_CAP = 1024   # timed records per CTA in profiling builds


def _x_block_maps(x: torch.Tensor, bt: int) -> tuple:
    """x's tensor maps for token blocks of `bt` rows: full blocks, and the last block of its own rows only."""
    from ..runtime.tensor_map import tensor_map_2d

    return tensor_map_2d(x, bt), tensor_map_2d(x, x.shape[0] % bt or bt)


class RowParallelLinear(GroupMember, Operator):
    """y = sum over ranks of x_r @ W_r.T, on every rank of a `torch.distributed` group (module docstring).

    Args:
        in_features: K, this rank's slice of the input features (the same on every rank; a multiple of 8).
        out_features: N (a multiple of 8).
        max_tokens: the most rows M of x per call (the symmetric window is sized by it).
        group: the process group (default: the default group); device: this rank's GPU (default: current).
        kernel_config: the kernel's static choices (`meld.codegen.tp_kernel.TpKernelConfig`: how tiles merge,
            over which transport, partials in bf16 or float, consumer warpgroups; its block_tokens is chosen per
            call). A wait inside the kernel gives up after its watchdog_ms (waits for other ranks: ten times
            it), names what it waited for and traps.
        ordered, chunk_bytes: the proxy transport's delivery (in issue order, or shuffled) and network chunk
            (`meld.distributed.proxy.GpuProxy`).
        engine: the window's and the proxy's engine, "cuda" or "nvshmem" (`meld.distributed.window`).
    """

    def __init__(self, in_features: int, out_features: int, *, max_tokens: int, dtype: torch.dtype = torch.bfloat16,
                 group=None, device: str | torch.device | None = None, kernel_config=None, ordered: bool = True,
                 chunk_bytes: int = 64 << 10, engine: str = "cuda"):
        from ..codegen.tp_kernel import TP_BLOCK_TOKENS, TpKernelConfig, call_configs, direct_room

        check_engine(engine)
        self._join(group)
        self.in_features = check_positive("in_features", in_features)
        self.out_features = check_positive("out_features", out_features)
        self.max_tokens = check_positive("max_tokens", max_tokens)
        for name, v in (("in_features", in_features), ("out_features", out_features)):
            if v % 8:
                raise ValueError(f"{name}={v}: must be a multiple of 8 (16-byte rows for the TMA loads and stores)")
        if dtype != torch.bfloat16:
            raise ValueError(f"dtype must be torch.bfloat16, got {dtype}")
        if kernel_config is not None:
            if not isinstance(kernel_config, TpKernelConfig):
                raise ValueError(f"kernel_config must be a meld.codegen.tp_kernel.TpKernelConfig, got {kernel_config!r}")
            call_configs(kernel_config)   # every variant a call may run is valid (a call never fails on the config)
        device = resolve_device("cuda" if device is None else device)
        if device.type != "cuda":
            raise ValueError(f"device must be a CUDA device, got {device}")
        # The graph's combine edge carries the given config's transport (default: peer memory); the default
        # config is the lowering's, for that graph.
        self._setup(tp_linear_graph(self.in_features, self.out_features, self.world,
                                    **({} if kernel_config is None else {"transport": kernel_config.transport})),
                    device)
        self.kernel_config = kernel_config = kernel_config or self.lowering.kernel_config(profile=config.profile())
        self._require_hopper(exact=True)
        self.dtype = dtype
        self._sm_count = torch.cuda.get_device_properties(device).multi_processor_count
        own_parts_only = kernel_config.merge == "every_rank" and kernel_config.transport == "peer"
        self.layout = _window_layout(self.max_tokens, self.out_features, self.world, self._sm_count,
                                     1 if own_parts_only else self.world,
                                     direct_room(kernel_config, self.max_tokens, self.world, self._sm_count)
                                     if own_parts_only else 0)
        if max(-(-out_features // 64) * -(-max_tokens // b) for b in TP_BLOCK_TOKENS) >= 1 << 31:
            raise ValueError(f"out_features={out_features}, max_tokens={max_tokens}: too many output tiles")
        self._open_window(self.layout["nbytes"], device, kernel_config.transport, ordered, chunk_bytes, engine)
        self._xexit = torch.zeros(2, dtype=torch.int32, device=device)
        self._prof, _ = self._profile_buffers(kernel_config.profile, 2 * self._sm_count, _PROFILE_CAP)
        self._last_grid = 0
        self._xlaunch = torch.zeros(1, dtype=torch.int64, device=device)
        self._shape: dict = {}
        self._register_watchdog("meld_tp_linear", _describe_tile(self._shape))
        self._variants: dict[tuple, tuple] = {}   # per (token block, warpgroups): (config, kernel, parameter struct)
        self._calls: dict[int, tuple] = {}      # per M: (schedule, kernel, parameter struct, grid, direct path,
                                                # the plan's TP_PIECE rows on the device)
        if self.proxy is not None:   # every variant loaded now: no module load while a kernel waits on the proxy
            for cfg in call_configs(kernel_config):
                self._variant(cfg)
        self._last_m = 0
        from ..runtime.tensor_map import TensorMapCache, tensor_map_2d
        self._weight_maps = TensorMapCache(lambda w: tensor_map_2d(w, 64))
        # x's maps: token-block boxes, and the last block's, of its own rows only (tp_linear.cuh, tp_produce);
        # made in __call__, after the call's schedule
        calls = self._calls
        self._x_maps = TensorMapCache(lambda x: _x_block_maps(x, calls[x.shape[0]][0].block_tokens))
        self._joined(device)

    def _variant(self, cfg):
        v = self._variants.get((cfg.block_tokens, cfg.wgs))
        if v is None:
            kernel = self._kernels(cfg, {cfg.entry: (cfg.threads, cfg.smem_bytes)})[cfg.entry]
            L = self.layout
            params = self.lowering.params.ctype(
                **self._edge_params(xexit=self._xexit, xlaunch=self._xlaunch),
                **self._header(self._prof, None, _PROFILE_CAP),
                x_out_off=L["out"], x_part_off=L["part"], x_count_off=L["count"], x_landed_off=L["landed"],
                x_started_off=L["started"], x_signal_off=L["signal"], x_ll_off=L["ll"], x_grid_cap=2 * self._sm_count,
                x_ll_cap=self._sm_count, n=self.out_features, k=self.in_features)
            v = self._variants[(cfg.block_tokens, cfg.wgs)] = (cfg, kernel, params)
        return v

    def _direct(self, cfg, sched, grid: int) -> bool:
        from ..codegen.tp_kernel import direct_path

        return direct_path(cfg, sched, grid, self.world, self._sm_count, self.layout["nbytes"] - self.layout["ll"])

    def output(self, num_tokens: int) -> torch.Tensor:
        """This rank's output view [num_tokens, out_features] of its window."""
        n = num_tokens * self.out_features
        return self.window.local[self.layout["out"]:self.layout["out"] + 2 * n].view(self.dtype).view(num_tokens, -1)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """y [M, out_features] = sum over ranks of x_r @ weight_r.T, for this rank's x [M, in_features] and
        weight [out_features, in_features] (bf16, contiguous, on this rank's device)."""
        grads = grad_inputs(x, weight)
        x, weight = plain(x), plain(weight)
        expect("x", x, self.dtype, (None, self.in_features), "tokens x in_features (this rank's slice)", self.device,
               contiguous=True)
        expect("weight", weight, self.dtype, (self.out_features, self.in_features), "out_features x in_features",
               self.device, contiguous=True)
        M = x.shape[0]
        if M > self.max_tokens:
            raise ValueError(f"x has {M} rows, more than max_tokens={self.max_tokens}")
        self._check_proxy()
        if M == 0:
            return self._tied(grads, self.output(0))
        self._watchdog.check()
        call = self._calls.get(M)
        if call is None:   # the schedule, kernel and grid of M rows, worked out once
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"RowParallelLinear: a first call with {M} rows is being captured; call once with "
                                   f"{M} rows before capturing (its plan's rows are copied to the device then)")
            sched = self.lowering.planner(M, self.out_features, self.in_features, self._sm_count, self.kernel_config)
            cfg, kernel, p = self._variant(sched.config(self.kernel_config))
            # Every CTA resident at once (every-rank merges wait for CTAs of the same launch: tp_linear.cuh).
            grid = min(sched.pieces, min(kernel.ctas_per_sm, cfg.ctas) * self._sm_count)
            # its plan's rows, on the device for as long as the operator (a captured graph's launches read them)
            tasks = torch.from_numpy(sched.tasks(grid, self.world)[0]).to(self.device)
            call = self._calls[M] = (sched, kernel, p, grid, self._direct(cfg, sched, grid), tasks)
        sched, kernel, p, grid, direct, tasks = call
        if M != self._last_m:
            self._last_m = M
            p.m, p.m_tiles, p.k_splits, p.tiles, p.direct = M, sched.m_tiles, sched.k_splits, sched.pieces, int(direct)
            p.tasks = tasks.data_ptr()
            self._shape.update(sched=sched, grid=grid, world=self.world)
        p.w_map = self._weight_maps.get(weight)
        p.x_map, p.x_tail_map = self._x_maps.get(x)
        kernel.launch(grid, p)
        self._last_grid = grid
        return self._tied(grads, self.output(M))

    @staticmethod
    def _tied(grads: tuple | None, y: torch.Tensor) -> torch.Tensor:
        """y (a view of the window, which stays untied) as a view tied to the inputs that require grad."""
        return no_backward("meld.distributed.RowParallelLinear", grads, (y,), in_place=False)[0]

    def _profile_records(self):
        """Each CTA's GEMMs, staged and sent partials, merge waits and merges, named by piece (merges and
        their waits: by claim, `TpSchedule.merge_units`); every launch records (MELD_PROFILE_EVERY does not
        apply here)."""
        return None if self._prof is None or not self._last_grid else (self._prof[:self._last_grid], (1, 1), {})
