"""Emit the row-parallel linear kernel (templates/tp_linear.cuh) from its static configuration: the token
block (wgmma's N), CTAs per SM and, from them, the ring depth. Shapes, ranks and the window's layout are
run-time values."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from .source import SMEM_PER_CTA_MAX, template
from ..ir.work_table import EVENT, TP_PIECE
from ..runtime.profile import kind_defines
from .params import TP_PARAMS, WATCHDOG_RECORD
from .wgmma import wgmma_bf16

TP_BLOCK_TOKENS = (8, 16, 32, 64, 128, 256)
_TWO_PER_SM_BYTES = 112 << 10   # shared memory of one of two CTAs on an SM (228 KiB, 1 KiB reserved per CTA)


MAX_STAGES = 32


def tp_block_tokens(num_tokens: int) -> int:
    """The smallest token block that holds `num_tokens` up to 64; 128 up to 256 rows; the widest beyond.
    128-token blocks against 64-token ones (then two CTAs per SM, each weight box read once per block): a
    wider block reads each weight box for more tokens, and on Llama-70B's o and down projections it was
    faster on two H200s at 128 rows and on one GPU at 200 and 256, slower only for the o projection at 96
    and 128 rows on one GPU (bench/RESULTS.md, "the last token block in bounds, 128-token blocks").
    `TpSchedule.of` halves it where that spares a K split."""
    if num_tokens > 256:
        return TP_BLOCK_TOKENS[-1]
    if num_tokens > 64:
        return 128
    return next(b for b in TP_BLOCK_TOKENS if b >= num_tokens)


@dataclass(frozen=True)
class TpSchedule:
    """How one call's output is cut: token blocks, output tiles (`cols` = 64 per consumer warpgroup x a token
    block) and the pieces of K each tile is split into, so that every CTA slot of the GPU has a piece (each at
    least 512 of K)."""

    m: int
    n: int
    k: int
    block_tokens: int
    m_tiles: int
    out_tiles: int
    k_splits: int
    cols: int = 64
    k_block: int = 64   # K per ring stage (64 x the config's K boxes)

    @staticmethod
    def of(m: int, n: int, k: int, sm_count: int, base: "TpKernelConfig") -> "TpSchedule":
        """The schedule of an M x N x K call: tp_block_tokens(m) (at most base.max_block_tokens), or, where that
        block's tiles are too few for the CTA slots and K would be split, a block half as wide (not below 64)
        whose tiles fill them unsplit.
        A split doubles the partials that cross to the other ranks and adds a merge per tile. On one GPU (a
        group of one rank) the half-width block was faster at N = 4096 except where its tiles overflow one
        wave (M = 300 at K 7168: three token blocks, 192 tiles on 132 SMs) (bench/RESULTS.md, "a token block
        that would split K gives way to one half as wide"). Not yet measured on two GPUs."""
        cap = base.max_block_tokens or TP_BLOCK_TOKENS[-1]
        s = TpSchedule._cut(m, n, k, sm_count, base, min(tp_block_tokens(m), cap))
        if s.block_tokens > 64 and s.k_splits > 1:
            half = TpSchedule._cut(m, n, k, sm_count, base, s.block_tokens // 2)
            if half.k_splits == 1 and half.m_tiles > s.m_tiles:
                return half
        return s

    @staticmethod
    def _cut(m: int, n: int, k: int, sm_count: int, base: "TpKernelConfig", bt: int) -> "TpSchedule":
        """The tiles of `bt`-token blocks: at 128 tokens (warpgroups automatic) two warpgroups' 128 columns where
        they need no K split, else 64. Each activation box then feeds twice the weight columns, and a one-rank
        GEMM of 128 x 128 tiles ran faster than of 128 x 64 (bench/RESULTS.md, "Figures moved from code
        comments")."""
        if bt == 128 and base.warpgroups == 0:
            wide = TpSchedule._cut_for(m, n, k, sm_count, block_config(_two_warpgroups(base), bt))
            if wide.k_splits == 1:
                return wide
        return TpSchedule._cut_for(m, n, k, sm_count, block_config(base, bt))

    @staticmethod
    def _cut_for(m: int, n: int, k: int, sm_count: int, cfg: "TpKernelConfig") -> "TpSchedule":
        bt = cfg.block_tokens
        m_tiles = -(-m // bt)
        out_tiles = -(-n // cfg.cols) * m_tiles
        slots = cfg.ctas * sm_count
        return TpSchedule(m, n, k, bt, m_tiles, out_tiles, max(1, min(slots // out_tiles, -(-k // 64) // 8, 8)),
                          cfg.cols, 64 * cfg.boxes)

    def config(self, base: "TpKernelConfig") -> "TpKernelConfig":
        """The kernel configuration that runs this schedule: `base` for its token block and columns (two
        warpgroups where `_cut` widened a 128-token block's tiles)."""
        cfg = block_config(base, self.block_tokens)
        return cfg if cfg.cols == self.cols else block_config(_two_warpgroups(base), self.block_tokens)

    def tasks(self, grid: int, world: int) -> tuple[np.ndarray, np.ndarray]:
        """The plan as rows of meld's one task layout (meld/ir/work_table.py), worked out once per M so that
        the kernel (templates/tp_linear.cuh, tp_task) and the emulation (meld/distributed/tp_matmul.py) load a
        piece's row rather than each derive it: a `TP_PIECE` row per piece in walk order (CTA t % grid runs
        piece t, its ordinal t // grid there), K split into whole stages; an `EVENT` row per output tile,
        its merge of world x k_splits parts. Flat int32 tables (TASK, EVENT), field-major."""
        for name, v in (("grid", grid), ("world", world)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}={v!r}: expected a positive int")
        t = np.arange(self.pieces)
        o, split = np.divmod(t, self.k_splits)
        col, tm = np.divmod(o, self.m_tiles)
        nk = -(-self.k // self.k_block)   # stages of K
        per_cta = -(-self.pieces // grid)
        tasks = TP_PIECE.pack(self.pieces, tile=o, k0=nk * split // self.k_splits, last_tile=o,
                              k1=nk * (split + 1) // self.k_splits, split=split, col=col, tok0=tm * self.block_tokens,
                              arg3=0, kind=TP_PIECE.kind, cta=t % grid, slot=t % grid * per_cta + t // grid,
                              event_first=o, event_count=1)
        events = EVENT.pack(self.out_tiles, parts=world * self.k_splits,
                            part_first=np.arange(self.out_tiles) * self.k_splits)
        return tasks, events

    def piece_slices(self, row: dict[str, np.ndarray], i: int) -> tuple[slice, slice, slice]:
        """Row i of an unpacked TP_PIECE table: its tile's tokens and columns and its K range, clipped to the
        shape."""
        tok0, c0, kb = int(row["tok0"][i]), self.cols * int(row["col"][i]), self.k_block
        return (slice(tok0, min(tok0 + self.block_tokens, self.m)), slice(c0, min(c0 + self.cols, self.n)),
                slice(min(int(row["k0"][i]) * kb, self.k), min(int(row["k1"][i]) * kb, self.k)))

    @property
    def pieces(self) -> int:
        return self.out_tiles * self.k_splits

    @property
    def merge_chunks(self) -> tuple[int, int]:
        """Every-rank merges move a partial tile in chunks: (rows a chunk, chunks a tile), each staged, sent,
        stamped and merged on its own; chunk q of a tile is merged by the CTA of its split q % k_splits
        (templates/tp_linear.cuh, MergeClaims)."""
        rows = min(self.block_tokens, 64)
        return rows, self.block_tokens // rows

    @property
    def merge_units(self) -> tuple[int, int]:
        """(rows a unit, units a tile): merge teams claim a chunk's rows a unit or more at a time (the merge
        warps one, the consumers up to a chunk); a profile's merge record names its claim as first unit (tile's
        first piece x units a tile + unit) x 8 + units claimed."""
        rows = min(self.merge_chunks[0], 16)
        return rows, self.block_tokens // rows

    @staticmethod
    def max_partial_floats(max_tokens: int, n: int, sm_count: int) -> int:
        """The most float partials one rank contributes to a call of at most `max_tokens` rows: the whole
        output tile grid when K is not split (columns rounded up to two warpgroups' 128), at most one piece
        per CTA slot when it is (128 x 256 floats a CTA at one per SM, 64 x 64 at two); plus, for every-rank
        merges, whose partials lie per CTA in blocks of equal size, up to one more tile per CTA."""
        return max(-(-n // 128) * 128 * -(-max_tokens // 256) * 256, sm_count * 128 * 256) + sm_count * 128 * 256


@dataclass(frozen=True)
class TpKernelConfig:
    """Static configuration of the row-parallel linear kernel. `RowParallelLinear` picks `block_tokens` per
    call from the rows of x; the other fields are its `kernel_config`'s."""

    block_tokens: int = 64
    k_boxes: int = 0          # 64-wide K boxes per ring stage: 1, 2 or 4 (each weight row read in runs of
                              # 128 k_boxes bytes), or 0: two for token blocks of at most 64 at one CTA per SM,
                              # one otherwise (bench/RESULTS.md, "two K boxes a stage, one CTA per SM")
    warpgroups: int = 0       # consumer warpgroups (64 weight rows each, sharing each stage's token box): 1, 2
                              # (one CTA per SM), or 0: two for 256-token blocks of one K box and for 128-token
                              # blocks whose 128-column tiles keep K whole (TpSchedule), one otherwise
    ctas_per_sm: int = 0      # 1: one CTA per SM with the deepest ring that fits; 2 (token blocks up to 64,
                              # whose accumulators fit 128 registers a thread): two, each with half the memory
                              # (no direct path); 0: one (bench/RESULTS.md, "two K boxes a stage, one CTA per SM")
    merge: str = "every_rank"   # "every_rank": every rank gets every partial and sums its own output (faster on
                                # two H200s: bench/RESULTS.md, "owner against every-rank merges"); "owner": a
                                # tile's last arriving partial sums it at its owner rank and writes every rank's
                                # output (fewer bytes per rank when the group is larger)
    transport: str = "peer"   # "peer" (NVLink peer memory) or "proxy" (puts and signals through a host proxy
                              # thread, the model of RDMA: meld/distributed/proxy.py; needs merge="every_rank")
    partials: str = "bfloat16"   # how partial tiles travel between ranks and splits of K: "bfloat16" (half the
                                 # bytes; the rounding of a bf16 NCCL all-reduce) or "float32"
    watchdog_ms: int = 2000   # a spin gives up after this long (cross-rank waits: ten times it)
    profile: bool = False     # record each CTA's GEMMs, sends, waits and merges (RowParallelLinear.last_trace)
    max_block_tokens: int = 0   # the widest token block a call takes (0: 256). Narrower tiles cost L2 traffic
                                # but give a CTA more pieces, whose exchange overlaps its later GEMMs (one piece
                                # a CTA exposes all of it: bench/RESULTS.md, "the row-parallel linear on one GPU")

    def __post_init__(self) -> None:
        if self.block_tokens not in TP_BLOCK_TOKENS:
            raise ValueError(f"block_tokens={self.block_tokens}: expected one of {TP_BLOCK_TOKENS}")
        if self.ctas_per_sm not in (0, 1, 2) or (self.ctas_per_sm == 2 and self.block_tokens > 64):
            raise ValueError(f"ctas_per_sm={self.ctas_per_sm}: expected 0 (automatic), 1, or 2 with blocks of at "
                             "most 64 tokens")
        if self.warpgroups not in (0, 1, 2) or (self.warpgroups == 2 and self.ctas == 2):
            raise ValueError(f"warpgroups={self.warpgroups}: expected 0 (automatic), 1, or 2 with one CTA per SM")
        if self.merge not in ("owner", "every_rank") or self.transport not in ("peer", "proxy"):
            raise ValueError(f"merge={self.merge!r}, transport={self.transport!r}: expected merge 'owner' or "
                             "'every_rank', transport 'peer' or 'proxy'")
        if self.transport == "proxy" and self.merge != "every_rank":
            raise ValueError("transport='proxy' needs merge='every_rank' (a proxy carries puts and signals, not the "
                             "owner's fetch-add)")
        if self.partials not in ("bfloat16", "float32"):
            raise ValueError(f"partials={self.partials!r}: expected 'bfloat16' or 'float32'")
        if self.k_boxes not in (0, 1, 2, 4):
            raise ValueError(f"k_boxes={self.k_boxes}: expected 0 (automatic), 1, 2 or 4")
        if self.stages < 2:
            raise ValueError(f"{self.boxes} K boxes of {self.block_tokens}-token blocks leave room for {self.stages} stages")
        if not isinstance(self.watchdog_ms, int) or self.watchdog_ms < 1:
            raise ValueError(f"watchdog_ms={self.watchdog_ms!r}: expected a positive int")
        if self.max_block_tokens not in (0, *TP_BLOCK_TOKENS):
            raise ValueError(f"max_block_tokens={self.max_block_tokens!r}: expected 0 (256) or one of {TP_BLOCK_TOKENS}")

    @staticmethod
    def of(low, *, profile: bool = False) -> "TpKernelConfig":
        """The default build of a lowered row-parallel graph (`meld.codegen.lowering.Lowering`): its partials
        cross ranks by the graph's transport; a call picks its token block (`TpSchedule.config`)."""
        return TpKernelConfig(transport=low.transport, profile=profile)

    @property
    def ctas(self) -> int:
        """CTAs per SM, resolved: automatic (0) is one (the deepest ring streams a few tokens' weights fastest;
        64-token blocks two to an SM, once faster on one GPU, were slower on two H200s than one CTA per SM
        with the direct path: bench/RESULTS.md, "two K boxes a stage, one CTA per SM")."""
        return self.ctas_per_sm or 1

    @property
    def wgs(self) -> int:
        """Consumer warpgroups, resolved: automatic (0) is two for 256-token blocks of one K box a stage
        (their activation boxes are the largest traffic) and one otherwise (`TpSchedule.of` picks two for
        128-token blocks where that keeps K whole)."""
        return self.warpgroups or (2 if self.block_tokens == 256 and self.boxes == 1 else 1)

    @property
    def boxes(self) -> int:
        """K boxes per ring stage, resolved: automatic (0) is two for token blocks of at most 64 at one CTA per
        SM (a decode step's GEMM ends sooner: bench/RESULTS.md, "two K boxes a stage, one CTA per SM") and one
        otherwise (more stages fit)."""
        return self.k_boxes or (2 if self.block_tokens <= 64 and self.ctas == 1 else 1)

    @property
    def direct(self) -> bool:
        """Whether the kernel has the direct path (templates/tp_linear.cuh, tp_direct; `direct_path` says
        which calls take it): every-rank merges over peer memory, token blocks of at most LL_MAX_TOKENS, one
        CTA per SM (the registers of its words)."""
        return (self.merge == "every_rank" and self.transport == "peer" and self.block_tokens <= LL_MAX_TOKENS
                and self.ctas == 1)

    @property
    def cols(self) -> int:
        """Output columns (weight rows) of a tile."""
        return 64 * self.wgs

    @property
    def threads(self) -> int:
        return 128 + 128 * self.wgs   # the producer warpgroup (warp 0 loads) and the consumer warpgroups

    @property
    def stage_bytes(self) -> int:
        return self.boxes * (self.cols + self.block_tokens) * 64 * 2

    @property
    def _fixed_bytes(self) -> int:
        """Alignment, the staging buffers (every-rank merges: two chunks of a partial, as it travels, at most
        64 rows each; owner merges: the tile's bf16 sum), four mbarriers and eight ints (the merge teams'
        claims, the last-arriver flag, the profile's record count)."""
        if self.merge == "every_rank":
            staged = min(self.block_tokens, 128) * self.cols * (4 if self.partials == "float32" else 2)
        else:
            staged = self.block_tokens * self.cols * 2
        return 1024 + staged + 64

    @property
    def stages(self) -> int:
        budget = _TWO_PER_SM_BYTES if self.ctas == 2 else SMEM_PER_CTA_MAX
        return min(MAX_STAGES, (budget - self._fixed_bytes) // (self.stage_bytes + 16))

    @property
    def smem_bytes(self) -> int:
        return self._fixed_bytes + self.stages * (self.stage_bytes + 16)

    @property
    def name(self) -> str:
        return (f"meld_tp_linear_bf16_n{self.block_tokens}_k{self.boxes}_c{self.ctas}_s{self.stages}_w{self.wgs}"
                + ("_ev" if self.merge == "every_rank" else "") + ("_xp" if self.transport == "proxy" else "")
                + ("_pf32" if self.partials == "float32" else "") + ("_prof" if self.profile else "")
                + (f"_wd{self.watchdog_ms}" if self.watchdog_ms != 2000 else ""))

    entry = "meld_tp_linear"

    def render(self) -> str:
        head = "\n".join([
            f"// {self.name}: generated by meld.codegen.tp_kernel from {self!r}",
            f"#define BLOCK_TOKENS {self.block_tokens}",
            f"#define NUM_STAGES {self.stages}",
            f"#define CTAS_PER_SM {self.ctas}",
            f"#define TP_WGS {self.wgs}",
            f"#define K_BOXES {self.boxes}",
            f"#define MELD_TP_EVERY {int(self.merge == 'every_rank')}",
            f"#define MELD_TP_PROXY {int(self.transport == 'proxy')}",
            f"#define MELD_TP_BF16_PARTS {int(self.partials == 'bfloat16')}",
            f"#define MELD_TP_DIRECT {int(self.direct)}",
            '#define MELD_MMA_TYPE "bf16"',
            f"#define MELD_PROFILE {int(self.profile)}",
            kind_defines(),
            f"#define MELD_WATCHDOG_NS {self.watchdog_ms * 1_000_000}ll",
        ])
        return "\n".join([head, WATCHDOG_RECORD.c_source(), template("common.cuh"), template("events.cuh"), template("persistent.cuh"), template("xrank.cuh"),
                          template("hopper.cuh"), "namespace meld {\n" + wgmma_bf16(self.block_tokens) + "}  // namespace meld",
                          TP_PARAMS.c_source(), TP_PIECE.c_source(), template("tp_linear.cuh")])


LL_MAX_TOKENS = 64   # the largest token block of the direct path (its words carry twice a partial's bytes)


def direct_words(cfg: TpKernelConfig) -> int:
    """8-byte words of one direct-path slot: a partial tile, 4 bytes of it a word (tp_linear.cuh, LL_WORDS)."""
    return cfg.block_tokens * cfg.cols * (4 if cfg.partials == "float32" else 2) // 4


def direct_bytes(cfg: TpKernelConfig, world: int, sm_count: int) -> int:
    """Bytes of the direct-path slots of `cfg`'s calls: two launches' (parity) x every rank x every CTA slot
    (the SMs: the direct path runs one CTA per SM), each one tile's words."""
    return 2 * world * sm_count * direct_words(cfg) * 8


def direct_room(base: TpKernelConfig, max_tokens: int, world: int, sm_count: int) -> int:
    """Bytes of a window's direct-path region for calls of at most `max_tokens` rows: the slots of the
    largest direct block."""
    return direct_bytes(block_config(base, tp_block_tokens(min(max_tokens, LL_MAX_TOKENS))), world, sm_count)


def direct_path(cfg: TpKernelConfig, sched: TpSchedule, grid: int, world: int, sm_count: int, room: int) -> bool:
    """Whether a call takes the kernel's direct path (templates/tp_linear.cuh, tp_direct): a kernel that has
    it (`TpKernelConfig.direct`: decode-size token blocks), one piece a CTA, and `room` (bytes of the window's
    direct region) for its slots."""
    return cfg.direct and sched.pieces <= grid <= sm_count and direct_bytes(cfg, world, sm_count) <= room


def call_configs(base: TpKernelConfig) -> list[TpKernelConfig]:
    """Every kernel configuration a call with `base` may run (`TpSchedule.config`): one per token block, and at
    128 tokens with warpgroups automatic, both widths."""
    wide = [block_config(_two_warpgroups(base), 128)] if base.warpgroups == 0 else []
    return [block_config(base, bt) for bt in TP_BLOCK_TOKENS] + wide


def _two_warpgroups(base: TpKernelConfig) -> TpKernelConfig:
    """`base` with two consumer warpgroups (one CTA per SM), for blocks wider than 64 tokens."""
    return dataclasses.replace(base, warpgroups=2, ctas_per_sm=min(base.ctas_per_sm, 1))


def block_config(base: TpKernelConfig, block_tokens: int) -> TpKernelConfig:
    """`base` for a token block (one CTA per SM where the block is too wide for two)."""
    return dataclasses.replace(base, block_tokens=block_tokens,
                               ctas_per_sm=base.ctas_per_sm if block_tokens <= 64 else min(base.ctas_per_sm, 1),
                               warpgroups=base.warpgroups if block_tokens > 64 else min(base.warpgroups, 1))
