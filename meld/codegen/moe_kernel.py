"""Emit the fused-MoE kernels (templates/moe.cuh) from their static configuration.

Only the token block (wgmma's N: tokens per row block), the ring depth and the weights' type (bf16, or e4m3
with block scales) change the generated code; shapes, expert counts, top-k and the routing are run-time
values, so one compiled module serves every layer of a model and every batch of a capacity.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .source import SMEM_PER_CTA_MAX, template
from ..runtime.profile import kind_defines
from ..ir.work_table import MOE_TILE, ROW_BLOCKS
from .params import MOE_PARAMS, WATCHDOG_RECORD
from .wgmma import wgmma_bf16, wgmma_e4m3

BLOCK_TOKEN_CHOICES = (16, 32, 64, 128)
# FP8 tiles hold a third accumulator (each 128-wide K block's product, scaled into the sums: DeepSeek-V3's FP32
# promotion, which the tensor cores' FP8 sums need): with 255 registers a thread ptxas spilled 80 B of a 128-token
# build; a 64-token one used 209 (its consumers get 224).
FP8_BLOCK_TOKEN_CHOICES = (16, 32, 64)
WEIGHT_DTYPES = ("bf16", "e4m3")
FP8_GROUP = 128           # DeepSeek-V3 block scaling: a weight scale per 128 x 128 block, an activation
                          # scale per token per 128 channels
MAX_EXPERTS = 1024        # the planner gives each expert one thread of its 1024
MAIN_THREADS = 384        # one producer warpgroup, two consumer warpgroups
SCATTER_WARPS = 2         # tokens per dispatch CTA (one warp each)
ROUTE_BLOCK = 32          # tokens per routing CTA (one warp each; templates/moe.cuh: TOK_BLOCK)
NARROW_MAX_TOKENS = 32    # token blocks up to this size run narrow tiles (templates/moe.cuh)


def tile_columns(block_tokens: int, fp8: bool = False) -> tuple[int, int]:
    """Columns of I per gemm1 tile and of H per gemm2 tile (templates/moe.cuh: G1_COLS, G2_COLS). FP8 tiles
    are always wide: a gemm1 tile then holds a whole 128-column group of act to quantise."""
    return (64, 128) if block_tokens <= NARROW_MAX_TOKENS and not fp8 else (128, 256)


def token_box_rows(block_tokens: int) -> int:
    """Rows of xs / act per TMA box of a tile narrower than its block (templates/moe.cuh: T_ROWS, the
    `*_part_map` tensor maps): such a wide tile loads as many boxes as its row block's rows need."""
    return block_tokens if block_tokens <= NARROW_MAX_TOKENS else 32


def tile_token_widths(block_tokens: int) -> tuple[int, ...]:
    """The token widths (wgmma N) a tile of this token block may run: narrow tiles the block, wide ones
    every multiple of token_box_rows up to it."""
    box = token_box_rows(block_tokens)
    return tuple(range(box, block_tokens + 1, box))


def route_smem_bytes(num_experts: int) -> int:
    """Dynamic shared memory of the routing launch: per token of its block (one warp each), 32 lanes' key
    slots, each lane's count rounded up to whole 16-byte loads (templates/moe.cuh: route_slots)."""
    slots = (-(-num_experts // 32) + 3) // 4 * 4
    return ROUTE_BLOCK * 32 * slots * 4


def block_tokens_for(num_tokens: int, top_k: int, num_experts: int, fp8: bool = False) -> int:
    """Rows per row block: the smallest choice that holds an expert's rows under uniform routing (the
    mean plus three standard deviations of its binomial count), so a decode step pads little, an expert
    whose rows spill into a second row block (which reads all its weights again) is rare, and a prefill
    chunk runs the widest tiles (of `fp8` builds: FP8_BLOCK_TOKEN_CHOICES)."""
    mean = num_tokens * top_k / num_experts
    likely_max = mean + 3 * math.sqrt(mean) + 1
    choices = FP8_BLOCK_TOKEN_CHOICES if fp8 else BLOCK_TOKEN_CHOICES
    return next((b for b in choices if b >= likely_max), choices[-1])


@dataclass(frozen=True)
class MoeKernelConfig:
    """Static configuration of the MoE kernels."""

    block_tokens: int = 128
    num_stages: int = 0          # 0: as many as fit
    profile: bool = False
    watchdog_ms: int = 2000      # a spin gives up after this long: record what it waited for, and trap
    debug_withhold_signal: bool = False   # debug build: row block 0's gemm1 tiles never signal (tests the watchdog)
    k_boxes: int = 1             # 64-wide K boxes per ring stage of narrow tiles (token blocks up to 32): 1 or 2
                                 # (each weight row read in runs of 256 bytes; on the MoE layers' A/B it won
                                 # some cases and lost others, so 1 stays the default: bench/RESULTS.md,
                                 # "the combine's row loads in flight together")
    packed_weights: bool = False  # weights as meld.pack_moe_weights lays them out: one bulk copy per stage
    absent_pairs: bool = False   # a precomputed id outside the layer's experts (MoE first_expert..+num_experts)
                                 # is a pair another rank serves (expert parallelism): skipped, not an error;
                                 # a token with only such pairs keeps its output row unwritten
    weight_dtype: str = "bf16"   # "e4m3": FP8 weights with a float32 scale per 128 x 128 block (DeepSeek-V3);
                                 # activations quantised per token per 128 channels; wgmma e4m3, f32 sums

    def __post_init__(self) -> None:
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight_dtype={self.weight_dtype!r}: expected one of {WEIGHT_DTYPES}")
        choices = FP8_BLOCK_TOKEN_CHOICES if self.fp8 else BLOCK_TOKEN_CHOICES
        if self.block_tokens not in choices:
            raise ValueError(f"block_tokens={self.block_tokens}: expected one of {choices}"
                             + (" (weight_dtype='e4m3')" if self.fp8 else ""))
        if self.fp8 and (self.k_boxes != 1 or self.packed_weights):
            raise ValueError(f"weight_dtype='e4m3' with k_boxes={self.k_boxes}, packed_weights={self.packed_weights}:"
                             " FP8 weights run plain, one K box a stage")
        if not isinstance(self.watchdog_ms, int) or self.watchdog_ms < 1:
            raise ValueError(f"watchdog_ms={self.watchdog_ms!r}: expected a positive int")
        if self.k_boxes not in (1, 2):
            raise ValueError(f"k_boxes={self.k_boxes!r}: expected 1 or 2")
        if self.packed_weights and self.boxes != 1:
            raise ValueError(f"packed_weights with k_boxes={self.k_boxes}: packed weights run one K box a stage")
        if not 0 <= self.num_stages <= 16 or self.stages < 2:
            raise ValueError(f"num_stages={self.num_stages}: {self.stages} stages of {self.stage_bytes} bytes "
                             f"do not fit {SMEM_PER_CTA_MAX} bytes of shared memory")

    @staticmethod
    def of(low, *, profile: bool = False) -> "MoeKernelConfig":
        """The default build of a lowered MoE graph (`meld.codegen.lowering.Lowering`): a call picks its token
        block and weight layout (`MoE._variant`); the graph's sizes are run-time values."""
        return MoeKernelConfig(profile=profile)

    @property
    def narrow(self) -> bool:
        return self.block_tokens <= NARROW_MAX_TOKENS

    @property
    def fp8(self) -> bool:
        return self.weight_dtype == "e4m3"

    @property
    def boxes(self) -> int:
        """K boxes per ring stage: k_boxes for narrow tiles, one for wide ones (whose stages are large already)."""
        return self.k_boxes if self.narrow else 1

    @property
    def stage_bytes(self) -> int:
        return self.boxes * ((2 if self.narrow and not self.fp8 else 4) * 64 * 128 + self.block_tokens * 128)

    @property
    def scale_box(self) -> int:
        """FP8: token scales a ring stage's TMA box copies (templates/moe.cuh: SCALE_ALIGN): a row block's, from its
        first row rounded down to 4 (a box's innermost coordinate must be a multiple of 16 bytes)."""
        return self.block_tokens + 4

    @property
    def scale_slot(self) -> int:
        """FP8: shared-memory bytes a ring stage's token scales take (templates/moe.cuh: SCALE_SLOT), beside the ring."""
        return -(-self.scale_box * 4 // 128) * 128 if self.fp8 else 0

    @property
    def stages(self) -> int:
        fit = (SMEM_PER_CTA_MAX - self._fixed_bytes) // (self.stage_bytes + self.scale_slot)
        return min(fit, 8) if self.num_stages == 0 else self.num_stages

    @property
    def _fixed_bytes(self) -> int:
        xchg = 128 * (self.block_tokens // 2 + 1) * 4 if self.narrow else 0   # narrow gemm1: up values
        if self.fp8:   # instead: each consumer warp's act maximum per token (moe.cuh: quantise_act)
            xchg = 9 * self.block_tokens * 4
        staging = 0 if self.narrow else 16 + 8 * self.block_tokens * 32   # (aligned) each consumer warp's output
                                                                          # tile (moe.cuh: store_rows)
        # alignment, ring and task-slot mbarriers, mailbox mbarriers, task slots, mailbox, combine list (FP8: and the
        # alignments of the staging and of the scale slots)
        return 1024 + 16 * 16 + 32 + 32 + 64 + 16 + 4 * (4 + self.block_tokens) + xchg + staging + (144 if self.fp8 else 0)

    @property
    def smem_bytes(self) -> int:
        return self._fixed_bytes + self.stages * (self.stage_bytes + self.scale_slot)

    @property
    def name(self) -> str:
        return (f"meld_moe_{self.weight_dtype}_n{self.block_tokens}_s{self.stages}" + (f"_k{self.boxes}" if self.boxes > 1 else "")
                + ("_pw" if self.packed_weights else "") + ("_prof" if self.profile else "")
                + (f"_wd{self.watchdog_ms}" if self.watchdog_ms != 2000 else "")
                + ("_withhold" if self.debug_withhold_signal else "") + ("_absent" if self.absent_pairs else ""))

    def render(self) -> str:
        head = "\n".join([
            f"// {self.name}: generated by meld.codegen.moe_kernel from {self!r}",
            f"#define BLOCK_TOKENS {self.block_tokens}",
            f"#define NUM_STAGES {self.stages}",
            f"#define MELD_NARROW {int(self.narrow)}",
            f"#define K_BOXES {self.boxes}",
            f"#define MAX_EXPERTS {MAX_EXPERTS}",
            f"#define SCATTER_WARPS {SCATTER_WARPS}",
            '#define MELD_MMA_TYPE "bf16"',
            f"#define MELD_PROFILE {int(self.profile)}",
            kind_defines(),
            f"#define MELD_WATCHDOG_NS {self.watchdog_ms * 1_000_000}ll",
            f"#define MELD_DEBUG_WITHHOLD {int(self.debug_withhold_signal)}",
            f"#define MELD_ABSENT_PAIRS {int(self.absent_pairs)}",
            f"#define MELD_PACKED {int(self.packed_weights)}",
            f"#define MELD_FP8 {int(self.fp8)}",
        ])
        mma = wgmma_e4m3 if self.fp8 else wgmma_bf16
        return "\n".join([head, WATCHDOG_RECORD.c_source(), template("common.cuh"), template("events.cuh"),
                          template("persistent.cuh"), template("hopper.cuh"),
                          "namespace meld {\n" + "".join(map(mma, tile_token_widths(self.block_tokens)))
                          + "}  // namespace meld",
                          MOE_PARAMS.c_source(), ROW_BLOCKS.c_source(), MOE_TILE.c_source(), template("moe_plan.h"),
                          template("moe.cuh")])
