"""Fused MoE expert layer (vLLM / SGLang conventions): routing, expert GEMMs and the top-k combine in one
stream of three launches, planned on the GPU from the routing (templates/moe.cuh) — no host
synchronisation, CUDA-graph capturable within `max_num_tokens`.

Layouts: x [T, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I]; router_logits [T, E];
out [T, H]. out[t] = sum_j w[t, j] * W2[e_j] (SiLU(W_gate[e_j] x[t]) * W_up[e_j] x[t]).

FP8 (`weight_dtype=torch.float8_e4m3fn`): w13 and w2 in e4m3 with DeepSeek-V3's block scales (vLLM's
`w1_scale` / `w2_scale`, block_shape [128, 128]): w13_scale [E, ceil(2I / 128), ceil(H / 128)], w2_scale
[E, ceil(H / 128), ceil(I / 128)], float32. x and act are quantised per token per 128 channels inside the layer.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np
import torch

from .. import config
from ..codegen.moe_kernel import (BLOCK_TOKEN_CHOICES, FP8_BLOCK_TOKEN_CHOICES, FP8_GROUP, MAIN_THREADS, MAX_EXPERTS,
                                  ROUTE_BLOCK, SCATTER_WARPS, MoeKernelConfig, block_tokens_for, route_smem_bytes,
                                  tile_columns, token_box_rows)
from ..ir.work_table import MOE_TILE, ROW_BLOCKS
from ..scheduler import Topology
from ..scheduler.moe_plan import moe_tile_table
from .base import Operator
from .checks import (check_output, check_pair, check_positive, exactly, expect, grad_inputs, is_int, no_backward,
                     plain, resolve_device, usual)
from .moe_graph import moe_graph
from .moe_weights import packed_shapes, unpack_moe_weights

_PROFILE_CAP = 4096      # timed records per CTA in profiling builds
# Rows a lone routing CTA copies itself rather than launch dispatch (templates/moe.cuh). One SM copies far
# slower than a launch of many: below this size the lone routing CTA copying the rows beats launching
# dispatch, above it the launch wins (bench/RESULTS.md, "Figures moved from code comments").
_ROUTE_DISPATCH_BYTES = 128 * 1024


def _describe_ticket(ticket: int) -> str:
    return f"tile ticket {ticket} of the MoE launch"


@dataclass
class _Variant:
    """The kernels of one token-block size and weight layout, loaded, with their parameter struct."""

    config: MoeKernelConfig
    route: object
    scatter: object
    main: object
    params: object


class MoE(Operator):
    """A fused MoE expert layer of fixed sizes and capacity.

    Args:
        hidden_size, intermediate_size: H and I (multiples of 8: rows must be 16-byte aligned for TMA).
        num_experts: E (at most 1024); top_k: experts per token, 1..E.
        dtype: torch.bfloat16. device: "cuda" (or "cuda:N"), or "cpu" for the reference executor.
        max_num_tokens: capacity; every buffer is sized for it, so calls up to it never allocate.
        renormalize: renormalise the top-k softmax weights to sum 1 (when routing from logits).
        weight_dtype: torch.bfloat16, or torch.float8_e4m3fn for block-scaled FP8 weights (a call then takes
            w13_scale and w2_scale; hidden_size and intermediate_size multiples of 16). Default: kernel_config's
            (`MoeKernelConfig(weight_dtype="e4m3")` selects the same), else bf16.
        first_expert: precomputed topk ids are global and this layer's experts are ids first_expert ..
            first_expert + num_experts - 1 (expert parallelism: w13 and w2 hold those); with
            `kernel_config.absent_pairs`, a pair of another expert is skipped (its token's output row is
            left as it was when it has no pair here), otherwise it is an invalid id. GPU only.

    Example:
        moe = meld.MoE(hidden_size=2048, intermediate_size=768, num_experts=128, top_k=8,
                       dtype=torch.bfloat16, device="cuda", max_num_tokens=8192)
        out = moe(x, router_logits, w13, w2)
        w13p, w2p = meld.pack_moe_weights(w13, w2)   # once, at load: the kernel streams them in bulk runs
        out = moe(x, router_logits, w13p, w2p)
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 dtype: torch.dtype = torch.bfloat16, device: object = "cuda", max_num_tokens: int = 8192,
                 renormalize: bool = True, kernel_config: MoeKernelConfig | None = None, first_expert: int = 0,
                 weight_dtype: torch.dtype | None = None):
        self.hidden_size = H = check_positive("hidden_size", hidden_size)
        self.intermediate_size = I = check_positive("intermediate_size", intermediate_size)
        if kernel_config is not None and not isinstance(kernel_config, MoeKernelConfig):
            raise ValueError(f"kernel_config must be a meld.codegen.moe_kernel.MoeKernelConfig, got "
                             f"{type(kernel_config).__name__}")
        if weight_dtype is None:   # kernel_config's, else bf16
            weight_dtype = torch.float8_e4m3fn if kernel_config is not None and kernel_config.fp8 else torch.bfloat16
        if weight_dtype not in (torch.bfloat16, torch.float8_e4m3fn):
            raise ValueError(f"weight_dtype must be torch.bfloat16 or torch.float8_e4m3fn, got {weight_dtype}")
        self._fp8 = fp8 = weight_dtype == torch.float8_e4m3fn
        if kernel_config is not None and kernel_config.fp8 != fp8:
            raise ValueError(f"weight_dtype={weight_dtype} with kernel_config.weight_dtype="
                             f"{kernel_config.weight_dtype!r}: they must agree")
        self.weight_dtype = weight_dtype
        row = 16 if fp8 else 8   # elements of a 16-byte row
        for name, v in (("hidden_size", H), ("intermediate_size", I)):
            if v % row:
                raise ValueError(f"{name} must be a multiple of {row} (16-byte rows for the TMA copies"
                                 f"{' of e4m3' if fp8 else ''}), got {v}")
        self.num_experts = E = check_positive("num_experts", num_experts, MAX_EXPERTS)
        self.top_k = check_positive("top_k", top_k)
        if self.top_k > E:
            raise ValueError(f"top_k must be in 1..num_experts={E}, got {top_k}")
        if dtype != torch.bfloat16:
            raise ValueError(f"dtype must be torch.bfloat16, got {dtype}")
        if not isinstance(renormalize, bool):
            raise ValueError(f"renormalize must be a bool, got {renormalize!r}")
        self.max_num_tokens = check_positive("max_num_tokens", max_num_tokens, _max_num_tokens(self.top_k))
        # The GPU kernel's task table limit, on every device: a CPU layer takes no shape the GPU refuses.
        # Row blocks a plan can make: every expert's rows in blocks of the smallest size a call may choose
        # (block_tokens, or an expert-parallel owner's choice), one partial block per expert; each has a tile
        # (a MOE_TILE row) per column block of I and of H.
        self._rb_cap = E + max(E, -(-self.max_num_tokens * self.top_k // BLOCK_TOKEN_CHOICES[0]))
        cols = sum(self._column_blocks(BLOCK_TOKEN_CHOICES[0]))
        self._tile_cap = self._rb_cap * cols
        if self._tile_cap > MOE_TILE.max_entries:
            raise ValueError(f"max_num_tokens={self.max_num_tokens}, hidden_size={H}, intermediate_size={I}: up to "
                             f"{self._rb_cap} row blocks x {cols} column blocks = {self._tile_cap} tiles do not fit a "
                             f"task table ({MOE_TILE.max_entries} rows)")
        self.dtype, self.renormalize = dtype, renormalize
        # The weights' shapes by w13's rank: plain, or packed by meld.pack_moe_weights.
        self._weight_shapes = {3: ((E, 2 * I, H), (E, H, I))} if fp8 else \
            {3: ((E, 2 * I, H), (E, H, I)), 6: packed_shapes(H, I, E)}
        g = FP8_GROUP
        self._scale_shapes = ((E, -(-2 * I // g), -(-H // g)), (E, -(-H // g), -(-I // g)))
        self._setup(moe_graph(H, I, E, self.top_k, renormalize), device)
        default = self.lowering.kernel_config(profile=config.profile())
        if fp8:   # (a call picks its own token block)
            default = dataclasses.replace(default, weight_dtype="e4m3", block_tokens=FP8_BLOCK_TOKEN_CHOICES[-1])
        self._kernel_config = kernel_config or default
        self.profile_every = config.profile_every()   # (read on every device: the CPU takes no setting the GPU refuses)
        if not is_int(first_expert) or first_expert < 0:
            raise ValueError(f"first_expert must be a non-negative int, got {first_expert!r}")
        first_expert = int(first_expert)
        if (first_expert or self._kernel_config.absent_pairs) and self.device.type != "cuda":
            raise ValueError(f"first_expert={first_expert}, absent_pairs={self._kernel_config.absent_pairs}: a slice "
                             "of the experts runs on the GPU only")
        self.first_expert = first_expert
        self._variants: dict[tuple[int, bool], _Variant] = {}
        self._call_shapes: dict[tuple[int, bool, int | None], tuple[_Variant, int, int]] = {}   # (`_call_shape`)
        if self.device.type == "cuda":
            self._init_cuda()
        else:   # the CPU executor plans for the H200, as decode attention's does
            self._sm_count = Topology.h200().sm_count

    # --- GPU state ------------------------------------------------------------------------------------
    def _init_cuda(self) -> None:
        info = self._require_hopper(exact=True)
        self._sm_count = info.sm_count
        self._grid = info.sm_count   # one CTA of 384 threads and ~200 KiB per SM (checked at load)
        T, k, E, H, I = self.max_num_tokens, self.top_k, self.num_experts, self.hidden_size, self.intermediate_size
        R = T * k
        nblk = -(-T // ROUTE_BLOCK)
        ops = self.weight_dtype   # the GEMMs' activation operands: e4m3 with FP8 weights
        g = FP8_GROUP
        f32 = dict(dtype=torch.float32, device=self.device)
        i32 = dict(dtype=torch.int32, device=self.device)
        b = self._bufs = {
            "topk_ids": torch.empty(R, **i32), "topk_w": torch.empty(R, dtype=torch.float32, device=self.device),
            "rank": torch.empty(R, **i32), "blk_cnt": torch.empty(nblk * E, **i32),
            "expert_off": torch.empty(E + 1, **i32), "rb": torch.empty(ROW_BLOCKS.width * self._rb_cap, **i32),
            "tasks": torch.from_numpy(moe_tile_table(self._tile_cap)).to(self.device),
            "counters": torch.zeros(3, **i32),
            "rb_done": torch.zeros(self._rb_cap, **i32),
            "tok_cnt": torch.zeros(T * self._column_blocks(BLOCK_TOKEN_CHOICES[0])[1], **i32),
            "tok_need": torch.empty(T, **i32), "pair_pos": torch.empty(R, **i32),
            "row_token": torch.empty(R, **i32), "error": torch.zeros(1, **i32),
            "xs": torch.empty(R, H, dtype=ops, device=self.device),
            "act": torch.empty(R, I, dtype=ops, device=self.device),
            "y": torch.empty(R, H, dtype=self.dtype, device=self.device),
        }
        if self._fp8:   # x's and act's scales per 128 channels, [groups][rows, to a multiple of 4: a TMA stride of
            # whole 16 bytes]; zeroed once, so a tile's box of a row block's scales never reads unwritten memory
            ld = -(-R // 4) * 4
            b["xs_scale"] = torch.zeros(-(-H // g), ld, **f32)
            b["act_scale"] = torch.zeros(-(-I // g), ld, **f32)
        self._register_watchdog("meld_moe_main", _describe_ticket)
        # (gemm1, gemm2 and combine records, named by ticket)
        self._prof, self._prof_clock = self._profile_buffers(self._kernel_config.profile, self._grid, _PROFILE_CAP,
                                                             self.profile_every)
        self._ptrs = {name: t.data_ptr() for name, t in b.items()}
        from ..runtime.tensor_map import TensorMapCache
        self._weight_maps = TensorMapCache(self._encode_weights)   # (one lookup a call: both maps)

    def _encode_weights(self, w13: torch.Tensor, w2: torch.Tensor):
        """The tensor maps of plain w13 and w2 (contiguous), as matrices of 64-row boxes."""
        from ..runtime.tensor_map import tensor_map_2d

        cols = self._box_cols
        return (tensor_map_2d(w13.view(-1, self.hidden_size), box_rows=64, box_cols=cols),
                tensor_map_2d(w2.view(-1, self.intermediate_size), box_rows=64, box_cols=cols))

    @property
    def _box_cols(self) -> int:
        """K elements of a TMA box: a 128-byte row (templates/moe.cuh: BK)."""
        return 128 if self._fp8 else 64

    @property
    def _block_choices(self) -> tuple[int, ...]:
        return FP8_BLOCK_TOKEN_CHOICES if self._fp8 else BLOCK_TOKEN_CHOICES

    def _column_blocks(self, block_tokens: int) -> tuple[int, int]:
        """Tiles per row block: (gemm1 column blocks of I, gemm2 column blocks of H)."""
        c1, c2 = tile_columns(block_tokens, self._fp8)
        return -(-self.intermediate_size // c1), -(-self.hidden_size // c2)

    def _variant(self, block_tokens: int, packed: bool = False) -> _Variant:
        v = self._variants.get((block_tokens, packed))
        if v is not None:
            return v
        from ..runtime.tensor_map import tensor_map_2d, tensor_map_runs

        base = self._kernel_config
        cfg = dataclasses.replace(base, block_tokens=block_tokens, packed_weights=packed)
        k = self._kernels(cfg, {"meld_moe_route": (1024, route_smem_bytes(self.num_experts)), "meld_moe_scatter": (32 * SCATTER_WARPS, 0),
                                "meld_moe_main": (MAIN_THREADS, cfg.smem_bytes)})
        p, cols = self._bufs, self._box_cols
        params = self.lowering.params.ctype(
            **self._ptrs, **self._header(self._prof, self._prof_clock, _PROFILE_CAP, self.profile_every),
            hidden=self.hidden_size, inter=self.intermediate_size,
            num_experts=self.num_experts, expert_base=self.first_expert, top_k=self.top_k,
            renormalize=int(self.renormalize),
            n1=self._column_blocks(block_tokens)[0], n2=self._column_blocks(block_tokens)[1], lag=self._sm_count,
            xs_map=tensor_map_2d(p["xs"], block_tokens, cols), act_map=tensor_map_2d(p["act"], block_tokens, cols),
            xs_part_map=tensor_map_2d(p["xs"], token_box_rows(block_tokens), cols),
            act_part_map=tensor_map_2d(p["act"], token_box_rows(block_tokens), cols),
            **({"xs_scale_map": tensor_map_runs(p["xs_scale"], cfg.scale_box),
                "act_scale_map": tensor_map_runs(p["act_scale"], cfg.scale_box),
                "scale_ld": p["xs_scale"].shape[1]} if self._fp8 else {}),
            task_capacity=self._tile_cap)
        v = _Variant(cfg, k["meld_moe_route"], k["meld_moe_scatter"], k["meld_moe_main"], params)
        if v.main.ctas_per_sm != 1:
            raise RuntimeError(f"{cfg.name}: expected one CTA per SM, occupancy says {v.main.ctas_per_sm}")
        self._variants[block_tokens, packed] = v
        return v

    # --- the call -------------------------------------------------------------------------------------
    def load_kernels(self, packed: bool = False) -> None:
        """Load every row-block variant's kernels now (CUDA) for weights in the plain layout, or as
        meld.pack_moe_weights packs them, so that no call with such weights loads a module: a composer whose
        launches wait on other ranks must not wait on a module load in between."""
        if not isinstance(packed, bool):
            raise ValueError(f"packed must be True or False, got {packed!r}")
        if self.device.type == "cuda":
            for bt in self._block_choices:
                self._variant(bt, packed)

    def __call__(self, x: torch.Tensor, router_logits: torch.Tensor | None, w13: torch.Tensor, w2: torch.Tensor,
                 *, topk_weights: torch.Tensor | None = None, topk_ids: torch.Tensor | None = None,
                 out: torch.Tensor | None = None, block_tokens: int | None = None,
                 w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None) -> torch.Tensor:
        """out [T, H] = the MoE layer on x [T, H]. Route from `router_logits` [T, E] (float32 or the
        activation dtype), or pass `topk_weights` (float32) and `topk_ids` (int32/int64) [T, top_k]
        instead (vLLM's `fused_experts`); an id out of range or repeated in a row gives that token NaN
        on the GPU (a ValueError on the CPU, where it is checked). w13 and w2 as laid out in the class
        docstring, or both as `meld.pack_moe_weights` packs them. `block_tokens`: the GEMMs' row block, one
        of BLOCK_TOKEN_CHOICES (default: chosen for T tokens routed uniformly; a caller that knows its rows
        per expert, as an expert-parallel owner does, may choose better; FP8: FP8_BLOCK_TOKEN_CHOICES).
        `w13_scale`, `w2_scale`: an FP8 layer's block scales (float32, as the module docstring lays them out),
        required there and refused elsewhere. A NaN or infinite scale makes NaN the rows it reaches: every
        token routed to that expert."""
        choices = self._block_choices
        if block_tokens is not None and (not is_int(block_tokens) or block_tokens not in choices):
            raise ValueError(f"block_tokens must be one of {choices} or None, got {block_tokens!r}")
        if torch.compiler.is_dynamo_compiling():   # traced by torch.compile: one custom op, no graph break
            if self._fp8:
                raise NotImplementedError("an FP8 meld.MoE under torch.compile: the op torch.ops.meld.moe takes "
                                          "bf16 weights only")
            if block_tokens is not None:
                raise NotImplementedError("MoE(block_tokens=...) under torch.compile: the traced call is the op "
                                          "torch.ops.meld.moe, which chooses the row block itself")
            from .torch_ops import moe
            return moe(self, x, router_logits, w13, w2, topk_weights=topk_weights, topk_ids=topk_ids, out=out)
        if block_tokens is None and w13_scale is None and w2_scale is None and self._op_route():
            # The op (its C++ fast path) for arguments its schema carries as they are (int64 ids are copied each
            # call, which the fast path does not replay). Shapes and dtypes are not tested here: the fast path
            # replays only a call laid out as one its Python kernel checked, and sends any other there.
            dev = self.device
            if (usual(x, dev) and x.dim() == 2 and usual(w13, dev) and usual(w2, dev)
                    and (router_logits is None or usual(router_logits, dev))
                    and (topk_weights is None or usual(topk_weights, dev))
                    and (topk_ids is None or (usual(topk_ids, dev) and topk_ids.dtype is torch.int32))
                    and (out is None or usual(out, dev))):
                return self._op_call(x, router_logits, w13, w2, topk_weights, topk_ids, out)
        return self._call(x, router_logits, w13, w2, topk_weights, topk_ids, out, block_tokens, w13_scale, w2_scale)

    @property
    def _replayable(self) -> bool:
        return self._prof is None and not self._fp8   # (a profiling build's launches differ by call; the op takes
                                                      # no FP8 scales)

    def _call(self, x, router_logits, w13, w2, topk_weights, topk_ids, out, block_tokens=None, w13_scale=None,
              w2_scale=None) -> torch.Tensor:
        """__call__'s body past the route to the op (its Python kernel's too): checks, out, the launches."""
        H, dev, grads = self.hidden_size, self.device, None
        T = None if self._fp8 else self._usual_inputs(x, router_logits, w13, w2, topk_weights, topk_ids)
        if T is None:   # anything else: made plain tensors, checked, and diagnosed
            grads = grad_inputs(x, router_logits, w13, w2, topk_weights)
            x, w13, w2 = plain(x), plain(w13), plain(w2)
            T = self._check_x(x)
            self._check_weights(w13, w2)
            w13_scale, w2_scale = plain(w13_scale), plain(w2_scale)
            self._check_scales(w13_scale, w2_scale)
            router_logits, topk_weights, topk_ids = (plain(t) for t in (router_logits, topk_weights, topk_ids))
            self._check_routing(router_logits, topk_weights, topk_ids, T)
        elif w13_scale is not None or w2_scale is not None:   # (the usual inputs of a bf16 layer, plus scales)
            self._check_scales(w13_scale, w2_scale)
        if topk_ids is not None and dev.type == "cpu":
            self._check_ids(topk_ids)
        if out is None:
            out = torch.empty(T, H, dtype=self.dtype, device=dev)
        else:
            expect("out", out, self.dtype, (T, H), "tokens x hidden_size", dev)
            out_stride = out.stride()
            if out_stride[1] != 1 or out_stride[0] % 8 or out.data_ptr() % 16:
                raise ValueError(f"out must have 16-byte aligned rows of unit stride (the kernel writes 16 bytes "
                                 f"at a time), got strides {out.stride()} at address {out.data_ptr():#x}")
            check_output("out", out, {"x": x, "router_logits": router_logits, "w13": w13, "w2": w2,
                                      "topk_weights": topk_weights, "topk_ids": topk_ids, "w13_scale": w13_scale,
                                      "w2_scale": w2_scale})
        if T:
            if dev.type == "cpu":
                self._run_cpu(x, router_logits, w13, w2, topk_weights, topk_ids, plain(out), w13_scale, w2_scale)
            else:
                self._launch(x, router_logits, w13, w2, topk_weights, topk_ids, plain(out),
                             None if block_tokens is None else int(block_tokens), w13_scale, w2_scale)
        return no_backward("meld.MoE", grads, (out,))[0]

    def _usual_inputs(self, x, router_logits, w13, w2, topk_weights, topk_ids) -> int | None:
        """x's T when the inputs are a serving loop's: plain tensors that need no grad, of this layer's dtypes,
        shapes and device, contiguous weights, and routing by logits or by the topk pair — everything the checks
        of `_check_x`, `_check_weights` and `_check_routing` require, with nothing for plain() to do. None
        otherwise. (One test of each tensor: this is every eager call's path.)"""
        if type(x) is not torch.Tensor or type(w13) is not torch.Tensor or x.dim() != 2:
            return None
        dev, dt, shapes = self.device, (self.dtype,), self._weight_shapes.get(w13.dim())
        try:
            T = x.shape[0]
        except RuntimeError:   # a nested tensor has no sizes
            return None
        if topk_ids is None:
            routed = topk_weights is None and exactly(router_logits, (torch.float32, self.dtype),
                                                      (T, self.num_experts), dev)
        else:
            routed = (router_logits is None and exactly(topk_ids, (torch.int32, torch.int64), (T, self.top_k), dev)
                      and exactly(topk_weights, (torch.float32,), (T, self.top_k), dev))
        usual = (routed and shapes is not None and T <= self.max_num_tokens
                 and exactly(x, dt, (T, self.hidden_size), dev) and exactly(w13, dt, shapes[0], dev, contiguous=True)
                 and exactly(w2, dt, shapes[1], dev, contiguous=True))
        return T if usual else None

    def _check_x(self, x: torch.Tensor) -> int:
        """ValueError unless x is [T, hidden_size] of this layer's dtype and device with T <= max_num_tokens; T."""
        expect("x", x, self.dtype, (None, self.hidden_size), "tokens x hidden_size", self.device)
        T = x.shape[0]
        if T > self.max_num_tokens:
            raise ValueError(f"x has {T} tokens, more than max_num_tokens={self.max_num_tokens}")
        return T

    def _check_routing(self, router_logits, topk_weights, topk_ids, T: int) -> None:
        """ValueError unless the routing is router_logits [T, E] (float32 or the activation dtype) or the pair
        topk_weights (float32), topk_ids (int32/int64) [T, top_k]."""
        check_pair("topk_weights", topk_weights, "topk_ids", topk_ids)
        if (router_logits is None) == (topk_ids is None):
            raise ValueError("pass either router_logits or (topk_weights, topk_ids), not both or neither")
        if router_logits is not None:
            dt = router_logits.dtype if isinstance(router_logits, torch.Tensor) else None
            expect("router_logits", router_logits, dt if dt in (torch.float32, self.dtype) else torch.float32,
                   (T, self.num_experts), "tokens x num_experts", self.device)
        else:
            dt = topk_ids.dtype if isinstance(topk_ids, torch.Tensor) else None
            expect("topk_ids", topk_ids, dt if dt in (torch.int32, torch.int64) else torch.int32, (T, self.top_k),
                   "tokens x top_k", self.device)
            expect("topk_weights", topk_weights, torch.float32, (T, self.top_k), "tokens x top_k", self.device)

    def _check_weights(self, w13: torch.Tensor, w2: torch.Tensor, contiguous: bool = True) -> None:
        """ValueError unless w13 and w2 are this layer's weights: as laid out in the class docstring, or both
        packed by meld.pack_moe_weights (a 6-D w13)."""
        dev = self.device
        if isinstance(w13, torch.Tensor) and w13.dim() == 6 and not self._fp8:   # (FP8 weights run plain)
            s13, s2 = self._weight_shapes[6]
            expect("w13", w13, self.dtype, s13, "packed by meld.pack_moe_weights: experts x K boxes x 64-column "
                   "blocks of I x (gate, up) x 64 x 64", dev, contiguous)
            expect("w2", w2, self.dtype, s2, "packed by meld.pack_moe_weights: experts x K boxes x 64-row blocks "
                   "of H x 64 x 64", dev, contiguous)
        else:
            s13, s2 = self._weight_shapes[3]
            wdt = self.weight_dtype
            expect("w13", w13, wdt, s13, "experts x 2*intermediate_size x hidden_size", dev, contiguous)
            expect("w2", w2, wdt, s2, "experts x hidden_size x intermediate_size", dev, contiguous)

    def _check_scales(self, w13_scale, w2_scale) -> None:
        """ValueError unless an FP8 layer has its weights' block scales (float32, contiguous, the shapes of the
        module docstring) and a bf16 layer none."""
        if not self._fp8:
            if w13_scale is None and w2_scale is None:
                return
            name = "w13_scale" if w13_scale is not None else "w2_scale"
            raise ValueError(f"{name} is for FP8 weights (MoE(weight_dtype=torch.float8_e4m3fn)); this layer's "
                             f"weights are {self.weight_dtype}")
        s13, s2 = self._scale_shapes
        expect("w13_scale", w13_scale, torch.float32, s13, "experts x ceil(2*intermediate_size / 128) x "
               "ceil(hidden_size / 128): a scale per 128 x 128 block of w13", self.device, contiguous=True)
        expect("w2_scale", w2_scale, torch.float32, s2, "experts x ceil(hidden_size / 128) x "
               "ceil(intermediate_size / 128): a scale per 128 x 128 block of w2", self.device, contiguous=True)

    def _check_ids(self, ids: torch.Tensor) -> None:
        bad = (ids < 0) | (ids >= self.num_experts)
        if bool(bad.any()):
            t, j = (int(i) for i in bad.nonzero()[0])
            raise ValueError(f"topk_ids[{t}, {j}] = {int(ids[t, j])} is outside 0..{self.num_experts - 1}")
        s = ids.sort(dim=1).values
        rep = (s[:, 1:] == s[:, :-1]).any(dim=1)
        if bool(rep.any()):
            t = int(rep.nonzero()[0])
            raise ValueError(f"topk_ids[{t}] = {ids[t].tolist()} names an expert twice")

    def _launch(self, x, logits, w13, w2, topk_w, topk_ids, out, block_tokens: int | None = None,
                w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None) -> None:
        """The launches of checked inputs; `block_tokens` and the scales as __call__'s."""
        T = x.shape[0]
        x_stride, x_ptr = x.stride(), x.data_ptr()   # (stride() whole: stride(dim) parses its argument, slower)
        if x_stride[1] != 1 or x_stride[0] % 8 or x_ptr % 16:
            x = x.contiguous()
            x_stride, x_ptr = x.stride(), x.data_ptr()
        if topk_ids is not None:
            topk_ids = topk_ids.to(torch.int32).contiguous()
            topk_w = topk_w.contiguous()
        elif logits.stride()[1] != 1:
            logits = logits.contiguous()
        packed = w13.dim() == 6
        v, route_dispatches, x_direct = self._call_shape(T, packed, block_tokens)
        p = v.params
        p.x, p.x_stride, p.out, p.out_stride, p.num_tokens = x_ptr, x_stride[0], out.data_ptr(), out.stride()[0], T
        if logits is not None:
            p.logits, p.logits_stride = logits.data_ptr(), logits.stride()[0]
            p.logits_bf16, p.topk_ids_in, p.topk_w_in = int(logits.dtype != torch.float32), 0, 0
        else:
            p.logits, p.topk_ids_in, p.topk_w_in = 0, topk_ids.data_ptr(), topk_w.data_ptr()
        if packed:
            p.w13_packed, p.w2_packed = w13.data_ptr(), w2.data_ptr()
        else:
            p.w13_map, p.w2_map = self._weight_maps.get(w13, w2)
        if self._fp8:
            p.w13_scale, p.w2_scale = w13_scale.data_ptr(), w2_scale.data_ptr()
        self._watchdog.check()
        if self._prof is not None and self.profile_every == 1:   # (sampling keeps the last sampled trace)
            self._prof.zero_()
        p.route_dispatches, p.x_direct = route_dispatches, x_direct
        self._enqueue(v, T)

    def _call_shape(self, T: int, packed: bool, block_tokens: int | None) -> tuple[_Variant, int, int]:
        """The variant that runs `T` tokens (`block_tokens` as _launch's) and its route_dispatches and x_direct
        parameters, kept per call shape: they depend on nothing else, and a serving loop repeats a few shapes."""
        key = (T, packed, block_tokens)
        shape = self._call_shapes.get(key)
        if shape is None:
            v = self._variant(block_tokens or block_tokens_for(T, self.top_k, self.num_experts, self._fp8), packed)
            rows = T * self.top_k
            route_dispatches = int(T <= ROUTE_BLOCK and rows * self.hidden_size * 2 <= _ROUTE_DISPATCH_BYTES
                                   and rows <= ROUTE_BLOCK * 32)   # (the lone CTA's shared table of rows)
            # One token whose row splits into whole ring stages: the gemm1 tiles read it from x, nothing is copied
            # (FP8: x is quantised as it is copied).
            x_direct = int(T == 1 and self.hidden_size % (64 * v.config.boxes) == 0 and not self._fp8)
            shape = self._call_shapes[key] = (v, route_dispatches, x_direct)
        return shape

    def _enqueue(self, v: _Variant, T: int) -> None:
        """The launches of variant `v` for `T` tokens, its parameters written."""
        p = v.params
        v.route.launch(-(-T // ROUTE_BLOCK), p)
        if not p.route_dispatches:
            v.scatter.launch(-(-T // SCATTER_WARPS), p, programmatic=True)
        v.main.launch(self._grid, p, programmatic=True)

    def errors(self) -> int:
        """Nonzero once a launch met an invalid precomputed topk id (waits for the GPU); clears it."""
        if self.device.type == "cpu":
            return 0
        e = int(self._bufs["error"].item())
        self._bufs["error"].zero_()
        return e

    # --- CPU reference executor -----------------------------------------------------------------------
    def plan_for(self, topk_ids: np.ndarray, num_tokens: int):
        """The `MoePlan` this layer runs for a routing (the GPU planner builds the same on the device)."""
        bt = block_tokens_for(num_tokens, self.top_k, self.num_experts, self._fp8)
        return self.lowering.planner(topk_ids, self.num_experts, bt, *self._column_blocks(bt), self._sm_count,
                                     tile_columns(bt, self._fp8))

    def _run_cpu(self, x, logits, w13, w2, topk_w, topk_ids, out, w13_scale=None, w2_scale=None) -> None:
        from ..runtime.moe_reference import route

        if w13.dim() == 6:
            w13, w2 = unpack_moe_weights(w13, w2, self.hidden_size, self.intermediate_size)
        if logits is not None:
            ids, w = route(logits, self.top_k, self.renormalize)
        else:
            ids, w = topk_ids.long(), topk_w
        plan = self.plan_for(ids.numpy(), x.shape[0])
        out.copy_(self.lowering.executor(plan, x, w13, w2, w, self.lowering.combiner, w13_scale, w2_scale))


def _max_num_tokens(top_k: int) -> int:
    """The largest max_num_tokens of a layer of `top_k` (its routed rows times 4096 fit an int32)."""
    return (2 ** 31 - 1) // (top_k * 4096)


@functools.lru_cache(maxsize=16)
def _cached(H: int, I: int, E: int, k: int, device: torch.device, renormalize: bool, capacity: int) -> MoE:
    return MoE(H, I, E, k, torch.bfloat16, device, capacity, renormalize)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, router_logits: torch.Tensor | None, top_k: int,
              renormalize: bool = True, *, topk_weights: torch.Tensor | None = None,
              topk_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The MoE layer as one call (a cached `MoE` per shape and device, capacity the next power of two up
    to the most a layer holds).

    Example:
        out = meld.fused_moe(x, w13, w2, router_logits, top_k=8, renormalize=True)
    """
    if not isinstance(w13, torch.Tensor) or w13.dim() != 3:
        packed = isinstance(w13, torch.Tensor) and w13.dim() == 6
        hint = "; weights packed by meld.pack_moe_weights go to a meld.MoE (which knows I)" if packed else ""
        raise ValueError(f"w13 must be a 3-D tensor [E, 2*I, H], got {getattr(w13, 'shape', type(w13).__name__)}{hint}")
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D tensor [T, H], got {getattr(x, 'shape', type(x).__name__)}")
    # Checked before the cache lookup: its key must be hashable, and its errors name this function's arguments.
    top_k = check_positive("top_k", top_k)
    if not isinstance(renormalize, bool):
        raise ValueError(f"renormalize must be a bool, got {renormalize!r}")
    E, I2, H = w13.shape
    T, limit = x.shape[0], _max_num_tokens(top_k)
    if T > limit:
        raise ValueError(f"x has {T} tokens: fused_moe with top_k={top_k} serves at most {limit}")
    capacity = min(limit, max(256, 1 << max(0, T - 1).bit_length()))
    device = x.device   # (a tensor's CPU or CUDA device exists and has its index: resolve_device has nothing to do)
    if device.type not in ("cpu", "cuda"):
        device = resolve_device(device)
    try:
        moe = _cached(H, I2 // 2, E, top_k, device, renormalize, capacity)
    except ValueError as e:   # named by the layer's terms: say where they come from
        raise ValueError(f"fused_moe: w13 of shape {tuple(w13.shape)} ([E, 2*I, H]), top_k={top_k}: {e}") from None
    return moe(x, router_logits, w13, w2, topk_weights=topk_weights, topk_ids=topk_ids)
