"""Emit the MLA decode-attention kernel (templates/mla_decode.cuh) from its static configuration.

The latent widths (512 + 64, DeepSeek's) and the 64-head unit are the template's constants; the KV block
(32 or 64 tokens), the ring depth and the warpgroups' schedule (split, seesaw or halves) are the knobs, and heads, page
size and the batch are run-time values, so one compiled kernel serves every batch and every `plan()`.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..ir.work_table import CTA_TABLE
from ..runtime.profile import PHASES, kind_defines
from .source import SMEM_PER_CTA_MAX, template
from .params import MLA_PARAMS, WATCHDOG_RECORD
from .wgmma import wgmma_bf16, wgmma_e4m3, wgmma_rs

MLA_HEAD_DIM_CKV, MLA_HEAD_DIM_KPE = 512, 64
MLA_HEADS_PER_UNIT = 64    # wgmma's M
MLA_BLOCK_TOKENS = (32, 64)   # KV tokens a ring stage may hold
_ROW = 128                    # bytes of a 128-byte swizzled row: 64 channels
_STATS_BYTES = 6 * 64 * 4   # the template's Stats (alpha, l, m, bad[2], qs)
_SEESAW_STATS_BYTES = _STATS_BYTES + 6 * 64 * 4   # SeesawStats: Stats, alpha[2], m[2], l[2]
MLA_SCHEDULES = ("split", "seesaw", "halves")
MLA_KV_FP8 = ("float8_e4m3fn",)   # the FP8 latent caches the kernel reads (MlaKernelConfig.kv_dtype)
_RAW_ROW = 576                    # bytes of an FP8 latent row (512 + 64 channels) in the staging ring


@dataclass(frozen=True)
class MlaKernelConfig:
    """Static configuration of the MLA kernel."""

    dtype: str = "bfloat16"
    block_tokens: int = 64     # KV tokens a ring stage holds (S's N): 32 or 64
    num_stages: int = 0        # ring stages; 0: as many as fit beside Q and P (two of 64 tokens, four of 32)
    profile: bool = False      # record per-piece timestamps (MELD_PROFILE)
    watchdog_ms: int = 2000    # a spin gives up after this long: record and trap
    # "" (the default): "halves" for a bf16 cache's 64-token blocks, else "split".
    # "split": one warpgroup scores every block and both accumulate half of O; "seesaw": the two warpgroups
    # score alternate blocks, so one's softmax runs while the other's wgmmas do (64-token blocks only); "halves":
    # both warpgroups score every block over half of its channels each, take the softmax of half of its tokens each
    # and accumulate half of O (64-token blocks only)
    schedule: str = ""
    # "": a bf16 cache; "float8_e4m3fn": e4m3 bytes, staged by TMA in a ring of their own, scored by e4m3 wgmmas
    # against Q as two e4m3 terms and converted to bf16 on chip for P.V (the split schedule, 32-token blocks;
    # num_stages counts the bf16 stages, 2 by default, and the staging ring takes what is left:
    # templates/mla_decode.cuh, MLA_KV_FP8)
    kv_dtype: str = ""
    # a diagnostic (with profile): each role's cycles per phase of its blocks, as profile records
    # (meld/runtime/profile.py: PHASES; Trace.phase_table; tools/mla_phases.py)
    phases: bool = False

    def __post_init__(self) -> None:
        if self.schedule == "":   # (frozen: the resolved default set once, here)
            object.__setattr__(self, "schedule", "split" if self.kv_dtype or self.block_tokens != 64 else "halves")
        if self.dtype != "bfloat16":
            raise ValueError(f"dtype={self.dtype!r}: the MLA kernel runs bfloat16")
        if self.kv_dtype not in ("", *MLA_KV_FP8):
            raise ValueError(f"kv_dtype={self.kv_dtype!r}: expected one of {('', *MLA_KV_FP8)} ('': bfloat16)")
        if self.kv_dtype and (self.schedule != "split" or self.block_tokens != 32):
            raise ValueError(f"kv_dtype={self.kv_dtype!r} with schedule={self.schedule!r}, block_tokens="
                             f"{self.block_tokens!r}: an FP8 cache runs the split schedule on 32-token blocks (the "
                             "staging ring beside two bf16 stages of 64 tokens does not fit)")
        if self.block_tokens not in MLA_BLOCK_TOKENS:
            raise ValueError(f"block_tokens={self.block_tokens!r}: expected one of {MLA_BLOCK_TOKENS}")
        if self.schedule not in MLA_SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r}: expected one of {MLA_SCHEDULES}")
        if self.schedule == "seesaw" and self.block_tokens != 64:
            raise ValueError(f"block_tokens={self.block_tokens!r}: the seesaw schedule runs 64-token blocks (each "
                             "block's P takes its stage's 64-row rope box)")
        if self.schedule == "halves" and self.block_tokens != 64:
            raise ValueError(f"block_tokens={self.block_tokens!r}: the halves schedule runs 64-token blocks (its P "
                             "takes its stage's 64-row rope box)")
        if self.phases and not self.profile:
            raise ValueError("phases=True needs profile=True: the phase sums are profile records")
        if not isinstance(self.watchdog_ms, int) or self.watchdog_ms < 1:
            raise ValueError(f"watchdog_ms={self.watchdog_ms!r}: expected a positive int")
        if not isinstance(self.num_stages, int) or self.stages < 2 or self.smem_bytes > SMEM_PER_CTA_MAX or (
                self.kv_dtype and self.raw_stages < 2):
            raise ValueError(f"num_stages={self.num_stages!r}: expected 0 or an int >= 2 whose ring fits "
                             f"{SMEM_PER_CTA_MAX} bytes of shared memory with Q and P"
                             + (" and two FP8 staging stages" if self.kv_dtype else ""))

    @staticmethod
    def of(low, *, profile: bool = False) -> "MlaKernelConfig":
        """The default build of a lowered MLA graph (`meld.codegen.lowering.Lowering`): its attrs' dtype."""
        return MlaKernelConfig(low.attrs["dtype"], profile=profile)

    @staticmethod
    def for_cache(kv_dtype: str = "", **fields) -> "MlaKernelConfig":
        """The default build for a cache of `kv_dtype` ("" or an FP8 type's torch name): an FP8 cache's takes
        32-token blocks (the staging ring's room)."""
        return MlaKernelConfig(kv_dtype=kv_dtype, **({"block_tokens": 32} if kv_dtype else {}), **fields)

    @property
    def stages(self) -> int:
        if self.num_stages:
            return self.num_stages
        if self.kv_dtype:
            return 2
        return (SMEM_PER_CTA_MAX - self._fixed_bytes) // self.stage_bytes

    @property
    def raw_stage_bytes(self) -> int:
        return self.block_tokens * _RAW_ROW

    @property
    def raw_stages(self) -> int:
        """FP8: the staging ring's stages (what fits beside the bf16 ring); 0 for a bf16 cache."""
        if not self.kv_dtype:
            return 0
        return (SMEM_PER_CTA_MAX - self._fixed_bytes - self.stages * self.stage_bytes) // self.raw_stage_bytes

    @property
    def stage_bytes(self) -> int:
        return 9 * self.block_tokens * _ROW

    @property
    def _fixed_bytes(self) -> int:
        """Q (9 boxes of 64 heads), P (64 rows), the rows' statistics, the mbarriers of up to 8 stages, and 1 KiB
        to align the boxes (and a phases build's sums). The seesaw keeps each block's P in its stage (no P buffer) and
        a full mbarrier per box of a stage. The halves' statistics take the split build's room (the template's
        HalvesStats)."""
        sums = 4 * self.phase_records if self.phases else 0
        if self.schedule == "seesaw":
            return 9 * 64 * _ROW + _SEESAW_STATS_BYTES + 8 * (8 * 10 + 2) + 1024 + sums
        return 9 * 64 * _ROW + 64 * _ROW + _STATS_BYTES + 8 * (2 * 8 + 4) + 1024 + sums

    @property
    def phase_records(self) -> int:
        """Profile records a CTA adds for its phase sums (templates/mla_decode.cuh: PHASE_ROLES x NUM_PHASES)."""
        return 3 * len(PHASES) if self.phases else 0

    entry = "meld_mla_decode"
    threads = 384   # three warpgroups: loads, then (split) scores + channels 0-255, channels 256-511, (seesaw)
                    # the scores of even / odd blocks + channels 0-255 / 256-511 or (halves) the scores of each
                    # block's channels 0-287 / 288-575, the softmax of its tokens 0-31 / 32-63, O's channels
                    # 0-255 / 256-511

    @property
    def smem_bytes(self) -> int:
        """Q, the ring, P (all 128-byte swizzled), the rows' statistics, the mbarriers (the template's layout)."""
        return self._fixed_bytes + self.stages * self.stage_bytes + self.raw_stages * self.raw_stage_bytes

    @property
    def name(self) -> str:
        return (f"meld_mla_decode_bf16_b{self.block_tokens}_s{self.stages}" + ("_prof" if self.profile else "")
                + ("_phases" if self.phases else "")
                + (f"_wd{self.watchdog_ms}" if self.watchdog_ms != 2000 else "")
                + (f"_{self.schedule}" if self.schedule != "split" else "")
                + (f"_e4m3_r{self.raw_stages}" if self.kv_dtype else ""))

    def render(self) -> str:
        head = "\n".join([
            f"// {self.name}: generated by meld.codegen.mla_kernel from {self!r}",
            f"#define BLOCK_TOKENS {self.block_tokens}",
            f"#define NUM_STAGES {self.stages}",
            f"#define SMEM_BYTES {self.smem_bytes}",
            '#define MELD_MMA_TYPE "bf16"',
            f"#define MELD_PROFILE {int(self.profile)}",
            kind_defines(),
            f"#define MELD_WATCHDOG_NS {self.watchdog_ms * 1_000_000}ll",
        ] + (["#define MLA_SEESAW 1"] if self.schedule == "seesaw" else [])
          + (["#define MLA_HALVES 1"] if self.schedule == "halves" else [])
          + (["#define MLA_KV_FP8 1", f"#define RAW_STAGES {self.raw_stages}"] if self.kv_dtype else [])
          + (["#define MLA_PHASES 1"] if self.phases else []))
        mma = ("namespace meld {\n" + wgmma_bf16(self.block_tokens) + wgmma_bf16(MLA_HEAD_DIM_CKV // 2, trans_b=True)
               + wgmma_rs("bfloat16", MLA_HEAD_DIM_CKV // 2, trans_b=True)
               + (wgmma_e4m3(self.block_tokens) if self.kv_dtype else "") + "}")
        return "\n".join([head, WATCHDOG_RECORD.c_source(), template("common.cuh"), template("events.cuh"), template("persistent.cuh"), template("hopper.cuh"), mma,
                          MLA_PARAMS.c_source(), CTA_TABLE.c_source(), template("split_kv.cuh"),
                          template("mla_decode.cuh")])
