"""Emit the grouped (shared-prefix, cascade) decode-attention kernel (templates/grouped_attention.cuh)."""
from __future__ import annotations

from dataclasses import dataclass

from ..ir.work_table import EVENT, SPLIT_TASK
from ..runtime.profile import kind_defines
from .params import GROUPED_PARAMS, WATCHDOG_RECORD
from .source import template
from .wgmma import wgmma_rs

_MMA_TYPES = {"bfloat16": "bf16", "float16": "f16"}
GROUPED_TILE = 16    # query rows per warp's row block, KV tokens per tile (the template's GT)
GROUPED_CHUNK = 64   # KV tokens per ring stage (the template's CHUNK)
GROUPED_WARPS = 8    # a CTA's warps: row blocks of 16 query rows attended at once (two sets of a chunk's 4 tiles);
                     # at head_dim 256 the row state takes all 255 registers (4 or 16 warps spill)
WARP_CHOICES = (8, 4)   # 4: two CTAs an SM (GroupedKernelConfig.warps)
_RING_MAX = 200 * 1024
# Dynamic shared memory the warp build's rings may take: sm_90's 227 KiB a CTA, less the kernel's static arrays
# (about 9.6 KiB: the fired events, their rows and staged part slots, the chunks' token rows, the stashes' m and l)
# and the wgmma build's 1 KiB of alignment.
_WARP_SMEM_MAX = 227 * 1024 - 11 * 1024
# Two CTAs an SM share its 228 KiB, less 1 KiB the hardware keeps a CTA; each keeps the same 11 KiB for the static
# arrays and the alignment as above, and the CTA ring and the warps' rings overlap as in one.
_PAIR_SMEM_MAX = 228 * 1024 // 2 - 1024 - 11 * 1024
SPLIT_STREAMS = ("cta", "warp")
PREFIX_MMAS = ("mma", "wgmma")


@dataclass(frozen=True)
class GroupedKernelConfig:
    """Static configuration of the grouped-attention kernel: what changes the generated code.

    `split_stream` picks how a split task (at most 16 query rows: a request's own suffix) streams its KV:
    "cta", through the CTA's ring of 64-token chunks, a CTA barrier per chunk; "warp", each warp its own
    16-token tiles through a ring of its own (`warp_stages` tiles of K and V), running ahead into the CTA's
    next split task (the default: faster on 6 of the 7 BENCH cascade cases at 611126d, bench/RESULTS.md).
    Tasks of more rows take the CTA's ring in both builds.

    `prefix_mma` picks the tensor-core instructions of a task of more than 16 rows (a shared prefix's slice):
    "mma", each warp its 16 rows with mma.sync m16n8k16 (this config's default); "wgmma", each warpgroup its
    64 rows with wgmma against a whole chunk, the CTA ring in wgmma's 128-byte swizzle. It needs the "warp"
    split stream (split tasks read their own rings, never the CTA ring's layout) and head_dim 64 or 128 (at 256
    the accumulators of O, S and P do not fit a thread's registers beside Q): `prefix_mma_for` picks it where
    allowed, as CascadeDecode does by default.

    `defer_split_events` moves a split task's arrival at its events, and the merges it completes, from the end of
    the task to the end of the CTA's walk, where the CTA counts all its split tasks' arrivals at once (16 tasks a
    round) and merges the events they complete together. A request's own suffix then ends as decode's pieces do
    (its warps' merge and a partial store), not in an L2 round trip chain that stalls every warp of the CTA (a
    fence, the event's row, an atomic, then often a merge of the event's parts). It needs the "warp" split stream.
    Off by default.

    `warps`: a CTA's warps, 8 or 4. With 4 (head_dim 64 or 128) two CTAs share an SM, each with half its shared
    memory (rings of fewer stages) and 64 query rows a task: an SM then runs two tasks at once, so a shared
    level's slice (tensor-bound: 256 FLOP a byte at 256 rows a kv head) can run beside a request's own suffix
    (bound by bytes), where one CTA of 8 warps runs them one after the other. CascadeDecode plans twice the CTAs.
    `direct_single_part`: a split task that is the one part of an event (a request with no shared level, or a plan
    of one level) writes that event's output and lse itself, from its warps' merge, as decode's whole units do:
    no partial, no count, no merge. Each merging thread reads its row's event first (one more L2 read a split task,
    overlapped with the stashes' reads). It needs the "warp" split stream. Off by default.
    """

    dtype: str = "bfloat16"
    head_dim: int = 128
    profile: bool = False   # record per-task timestamps (MELD_PROFILE; meld/runtime/profile.py)
    split_stream: str = "warp"
    prefix_mma: str = "mma"
    defer_split_events: bool = False
    direct_single_part: bool = False
    warps: int = GROUPED_WARPS

    def __post_init__(self) -> None:
        if self.dtype not in _MMA_TYPES:
            raise ValueError(f"dtype={self.dtype!r}: expected one of {sorted(_MMA_TYPES)}")
        if self.head_dim not in (64, 128, 256):
            raise ValueError(f"head_dim={self.head_dim}: expected 64, 128 or 256")
        if self.split_stream not in SPLIT_STREAMS:
            raise ValueError(f"split_stream={self.split_stream!r}: expected one of {SPLIT_STREAMS}")
        if self.prefix_mma not in PREFIX_MMAS:
            raise ValueError(f"prefix_mma={self.prefix_mma!r}: expected one of {PREFIX_MMAS}")
        if self.prefix_mma == "wgmma" and self.split_stream != "warp":
            raise ValueError(f"prefix_mma='wgmma' with split_stream={self.split_stream!r}: the wgmma build needs "
                             "split_stream='warp'")
        for name in ("defer_split_events", "direct_single_part"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r}: expected a bool")
            if getattr(self, name) and self.split_stream != "warp":
                raise ValueError(f"{name}=True with split_stream={self.split_stream!r}: it needs split_stream='warp' "
                                 "(the cta build at head_dim 256 has no registers for it)")
        if self.warps not in WARP_CHOICES:
            raise ValueError(f"warps={self.warps!r}: expected one of {WARP_CHOICES}")
        if self.warps != GROUPED_WARPS and self.head_dim == 256:
            raise ValueError(f"warps={self.warps} with head_dim=256: two CTAs an SM leave a ring of one 64 KiB chunk "
                             "(head_dim 64 or 128)")
        if self.prefix_mma == "wgmma" and self.head_dim == 256:
            raise ValueError("prefix_mma='wgmma' with head_dim=256: its accumulators do not fit the registers "
                             "(head_dim 64 or 128)")

    @staticmethod
    def prefix_mma_for(split_stream: str, head_dim: int) -> str:
        """The faster build a task of many rows can have (bench/RESULTS.md 2026-12-03): wgmma where allowed."""
        return "wgmma" if split_stream == "warp" and head_dim != 256 else "mma"

    @staticmethod
    def of(low, *, profile: bool = False, split_stream: str = "warp", prefix_mma: str = "mma",
           defer_split_events: bool = False, direct_single_part: bool = False,
           warps: int = GROUPED_WARPS) -> "GroupedKernelConfig":
        """The build of a lowered grouped-attention graph (`meld.codegen.lowering.Lowering`): its attrs' dtype
        and head_dim."""
        return GroupedKernelConfig(low.attrs["dtype"], low.attrs["head_dim"], profile=profile, split_stream=split_stream,
                                   prefix_mma=prefix_mma, defer_split_events=defer_split_events,
                                   direct_single_part=direct_single_part, warps=warps)

    entry = "meld_grouped_attention"

    @property
    def name(self) -> str:
        return (f"meld_grouped_attention_{_MMA_TYPES[self.dtype]}_d{self.head_dim}" +
                ("_warp" if self.split_stream == "warp" else "") + ("_wgmma" if self.prefix_mma == "wgmma" else "") +
                ("_defer" if self.defer_split_events else "") + ("_direct" if self.direct_single_part else "") +
                (f"_w{self.warps}" if self.warps != GROUPED_WARPS else "") +
                ("_prof" if self.profile else ""))

    @property
    def row_blocks(self) -> int:
        """16-row blocks a task attends at once (a warp each): the planner slices larger groups to fit."""
        return self.warps

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def ctas_per_sm(self) -> int:
        """CTAs an SM runs at once (the kernel's launch bounds): two of four warps, one of eight."""
        return GROUPED_WARPS // self.warps

    @property
    def _ring_max(self) -> int:
        return _RING_MAX if self.ctas_per_sm == 1 else _PAIR_SMEM_MAX

    @property
    def _warp_smem_max(self) -> int:
        return _WARP_SMEM_MAX if self.ctas_per_sm == 1 else _PAIR_SMEM_MAX

    @property
    def stages(self) -> int:
        """Ring stages: as many chunks (K and V, 16-bit) as fit 200 KiB (two CTAs an SM: each its share), at most
        four (three in flight); the wgmma build one more, as its P.V reads a chunk until the next step."""
        return min(4 + (self.prefix_mma == "wgmma"), self._ring_max // (2 * GROUPED_CHUNK * self.head_dim * 2))

    @property
    def chunks_ahead(self) -> int:
        """Chunks the CTA ring keeps in flight (the template's AHEAD): all stages but the one attended, and in the
        wgmma build also the one before, whose P.V runs during this chunk's softmax."""
        return self.stages - 1 - (self.prefix_mma == "wgmma")

    def _warp_stage_bytes(self) -> int:
        return 2 * GROUPED_TILE * self.head_dim * 2   # a 16-token tile of K and one of V (a warp's stash: as many)

    @property
    def split_warps(self) -> int:
        """Warps that attend a split task's tiles: all, or (the warp build at head_dim 256) the first four, whose
        two-stage rings fit where eight do not."""
        if self.split_stream == "cta":
            return self.warps
        fits = lambda w: w * 2 * self._warp_stage_bytes() <= self._warp_smem_max  # noqa: E731
        return self.warps if fits(self.warps) else self.warps // 2

    @property
    def warp_stages(self) -> int:
        """The warp build's stages a warp ring (at most four), as many as fit; 0 in the cta build. A split task's
        stashes take no room of their own: each warp's lies in the stage of its ring that it read last. head_dim 256
        keeps two: its row state takes every register, and a third stage's walk spilled 22 bytes (the builds that
        count after each task)."""
        if self.split_stream == "cta":
            return 0
        return min(4 if self.head_dim < 256 else 2,
                   self._warp_smem_max // (self.split_warps * self._warp_stage_bytes()))

    @property
    def _layout_bytes(self) -> int:
        """The CTA ring (tasks of many rows; the cta build lays the warps' stashes over it), or (the warp build)
        the warps' rings, the larger."""
        ring = self.stages * 2 * GROUPED_CHUNK * self.head_dim * 2
        if self.split_stream == "warp":
            return max(ring, self.split_warps * self.warp_stages * self._warp_stage_bytes())
        return ring

    @property
    def smem_bytes(self) -> int:
        """The layout's bytes (`_layout_bytes`), and in the wgmma build 1 KiB more: the kernel starts them at the
        first 1 KiB boundary of its allocation, where the 128-byte swizzle's pattern starts."""
        return self._layout_bytes + (1024 if self.prefix_mma == "wgmma" else 0)

    def render(self) -> str:
        head = [
            f"// {self.name}: generated by meld.codegen.grouped_kernel from {self!r}",
            f"#define HEAD_DIM {self.head_dim}",
            f"#define NUM_WARPS {self.warps}",
            f"#define MIN_CTAS {self.ctas_per_sm}",
            f"#define NUM_STAGES {self.stages}",
            f"#define CHUNKS_AHEAD {self.chunks_ahead}",
            f"#define SMEM_BYTES {self.smem_bytes}",
            f'#define MELD_MMA_TYPE "{_MMA_TYPES[self.dtype]}"',
            f"#define MELD_PROFILE {int(self.profile)}",
            kind_defines(),
            "#define MELD_WATCHDOG_NS 2000000000ll",
        ]
        if self.split_stream == "warp":   # (the cta build's source stays as it was)
            head[4:4] = ["#define MELD_SPLIT_WARP 1", f"#define SPLIT_WARPS {self.split_warps}",
                         f"#define WARP_STAGES {self.warp_stages}"]
        if self.defer_split_events:   # (the other builds' source stays as it was)
            head[4:4] = ["#define MELD_DEFER_SPLIT_EVENTS 1"]
        if self.direct_single_part:
            head[4:4] = ["#define MELD_DIRECT_SINGLE_PART 1"]
        hopper = []
        if self.prefix_mma == "wgmma":   # (the other builds' source stays as it was)
            head[4:4] = ["#define MELD_PREFIX_WGMMA 1"]
            hopper = [template("hopper.cuh"), "namespace meld {\n" + wgmma_rs(self.dtype, GROUPED_CHUNK) +
                      wgmma_rs(self.dtype, self.head_dim, trans_b=True) + "}  // namespace meld"]
        return "\n".join([ "\n".join(head), WATCHDOG_RECORD.c_source(), template("common.cuh"), template("events.cuh"), template("persistent.cuh"),
                          *hopper, GROUPED_PARAMS.c_source(), SPLIT_TASK.c_source(), EVENT.c_source(),
                          template("grouped_attention.cuh")])
