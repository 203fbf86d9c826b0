"""Emit the decode-attention kernel from its static configuration.

Only what changes the generated code is static (dtype, head dim, warps, pipeline depth); page size,
group size, head counts and everything that depends on the batch are run-time values, so one compiled
kernel serves every batch and every `plan()`.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from ..ir.work_table import CTA_TABLE
from ..runtime.profile import kind_defines
from .params import PLAN_PARAMS, WATCHDOG_RECORD, ParamStruct
from .source import SMEM_PER_CTA_MAX, template

_MMA_TYPES = {"bfloat16": "bf16", "float16": "f16"}
# DecodeKernelConfig.kv_dtype of an FP8 cache (torch's name of the type) -> its short name (kernel names, tuning keys)
KV_FP8 = {"float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}
_KV_BUILDS = ("", *KV_FP8)   # kv_dtype by MELD_KV_FP8 (0: the 16-bit dtype's, 1: e4m3, 2: e5m2)
TILE_TOKENS = 16     # KV tokens per warp step
MAX_Q_LEN = 8        # new tokens per request a decode build takes (DecodeKernelConfig.q_len)
_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class DecodeVariant:
    """What a decode kernel computes besides plain softmax attention: FlashInfer's decode variants, fixed per
    operator and compiled in as constants (a model fixes them), so the default build's code stays as it was
    and a variant costs only its own instructions.

    logits_soft_cap: c > 0 caps each scaled score s (sm_scale * q.k; an FP8 cache's k_scale is in sm_scale) to
        c * tanh(s / c) before the softmax, lse included (FlashInfer's convention: its pre-tanh scale is
        sm_scale / c); 0: off.
    window_left: w >= 0: the query, the request's last token, attends to its last w + 1 keys only (FlashInfer's
        sliding window; lse over those keys); -1: to every key. The kernel masks the keys before the window
        in the first page it reads; plan() leaves out the whole pages before it (`window_page_table`).
    rope_theta: t > 0: FlashInfer's pos_encoding_mode="ROPE_LLAMA": Llama's rotary embedding ("rotate half":
        channel i < D/2 pairs with i + D/2, frequency f_i = t^(-2i/D) / rope_scale) applied inside attention,
        each key at its position in its request, the query at the request's last (FlashInfer's decode
        convention); 0: none. Since q.k after rotation depends only on the keys' offsets from the query, the
        kernel rotates each key by its offset (<= 0) and leaves q as it is: the same scores, with the angles
        small where attention usually looks.
    rope_scale: s > 0, the positions' divisor (FlashInfer's rope_scale; 1.0 without RoPE).
    """

    logits_soft_cap: float = 0.0
    window_left: int = -1
    rope_theta: float = 0.0
    rope_scale: float = 1.0

    def __post_init__(self) -> None:
        cap = self.logits_soft_cap
        if not isinstance(cap, float) or not (cap == 0.0 or 1e-30 <= cap <= 1e30):
            raise ValueError(f"logits_soft_cap={cap!r}: expected 0.0 (off) or a float in [1e-30, 1e30]")
        if not isinstance(self.window_left, int) or isinstance(self.window_left, bool) or \
                not -1 <= self.window_left < 2 ** 31:
            raise ValueError(f"window_left={self.window_left!r}: expected -1 (no window) or an int32 >= 0")
        for name, value in (("rope_theta", self.rope_theta), ("rope_scale", self.rope_scale)):
            if not isinstance(value, float) or not (1e-30 <= value <= 1e30 or name == "rope_theta" and value == 0.0):
                raise ValueError(f"{name}={value!r}: expected a float in [1e-30, 1e30]"
                                 + (" or 0.0 (no RoPE)" if name == "rope_theta" else ""))
        if not self.rope_theta and self.rope_scale != 1.0:
            raise ValueError(f"rope_scale={self.rope_scale!r} without RoPE (rope_theta=0.0): expected 1.0")

    @property
    def suffix(self) -> str:
        """The kernel name's part that spells the variant ('' for plain attention)."""
        def spelt(x: float) -> str:
            return repr(x).replace(".", "p").replace("+", "").replace("-", "m")

        return (f"_cap{spelt(self.logits_soft_cap)}" if self.logits_soft_cap else "") + \
            (f"_win{self.window_left}" if self.window_left >= 0 else "") + \
            (f"_rope{spelt(self.rope_theta)}" if self.rope_theta else "") + \
            (f"s{spelt(self.rope_scale)}" if self.rope_scale != 1.0 else "")

    def defines(self, head_dim: int) -> list[str]:
        """The template's constants: the cap in the kernel's log2 units (c log2 e) and 2 / c, with which its
        log2-domain score x becomes c log2 e tanh(x / (c log2 e)) = c log2 e (1 - 2 / (2^(2 x / c) + 1)); the
        window's w; RoPE's frequencies as f_i / pi = 2^(i step) / (rope_scale pi), step = -2 log2(t) / D (the
        kernel's sincospif takes angles in units of pi)."""
        cap, rope = self.logits_soft_cap, self.rope_theta
        return [f"#define MELD_SOFT_CAP {int(cap > 0)}",
                f"#define MELD_SOFT_CAP_LOG2 {cap * _LOG2E!r}f" if cap else "#define MELD_SOFT_CAP_LOG2 0.f",
                f"#define MELD_SOFT_CAP_TWO {2.0 / cap!r}f" if cap else "#define MELD_SOFT_CAP_TWO 0.f",
                f"#define MELD_WINDOW_LEFT {self.window_left}",
                f"#define MELD_ROPE {int(rope > 0)}",
                f"#define MELD_ROPE_FPI0 {1.0 / (self.rope_scale * math.pi)!r}f" if rope else "#define MELD_ROPE_FPI0 0.f",
                f"#define MELD_ROPE_LOG2_STEP {-2.0 * math.log2(rope) / head_dim!r}f" if rope
                else "#define MELD_ROPE_LOG2_STEP 0.f"]


@dataclass(frozen=True)
class DecodeKernelConfig:
    """Static configuration of the decode kernel (everything that changes the generated code)."""

    dtype: str = "bfloat16"
    head_dim: int = 128
    num_warps: int = 4
    num_stages: int = 3
    onchip_merge: bool = False  # merge split units inside a cluster through distributed shared memory
    profile: bool = False       # record per-task timestamps (MELD_PROFILE; meld/runtime/profile.py)
    tma: bool = False           # load KV tiles with TMA tensor copies into mbarrier-completed rings
    heads_per_unit: int = 8     # q heads (rows) one unit computes, reading its kv head's KV once for them: 8, 16 or
                                # (multi-token builds, head_dim 64 and 128) 32
    batch_invariant: bool = False   # walk split units as fixed chunks (meld/ir/schedule.py): no on-chip merges
    watchdog_ms: int = 2000     # a spin (TMA ring waits) gives up after this long: record and trap
    debug_withhold_signal: bool = False   # debug build: unit 0's first tile is never issued (tests the watchdog)
    xrank: str = ""             # one rank's share of a sequence-parallel batch (meld/distributed/seq_parallel.py), its
                                # results crossing to the other ranks through "peer" memory or a "proxy"
    kv_dtype: str = ""          # "": K and V in `dtype`; "float8_e4m3fn" or "float8_e5m2": FP8 bytes, dequantised
                                # on chip (MELD_KV_FP8; the template's header says how and where the scales apply)
    variant: DecodeVariant = DecodeVariant()   # soft cap, sliding window, RoPE (MELD_SOFT_CAP, MELD_WINDOW_LEFT,
                                               # MELD_ROPE)
    q_len: int = 1              # new tokens per request (speculative decoding, MTP), causal among themselves: a unit's
                                # rows are (q head, token) pairs (MELD_Q_LEN; the template's header says how)
    fp8_math: str = ""          # "": the tensor cores take the dtype's type; "f16" (FP8 caches with bf16 q,
                                # `default`'s choice for them): f16, so K and V convert to it in one instruction and
                                # q is scaled into its range per row (MELD_Q_TO_F16; the template's header says how)
    merge_rows: int = 0         # rows the end-of-piece merge area holds (0: a unit's all), the warps' states merging in
                                # heads_per_unit / merge_rows passes: a smaller area leaves room for more warps
    ragged_q: bool = False      # requests of 1 .. q_len new tokens each, their rows from a qo_indptr table (MELD_RAGGED_Q;
                                # the template's header says how)

    def __post_init__(self) -> None:
        if self.dtype not in _MMA_TYPES:
            raise ValueError(f"dtype={self.dtype!r}: expected one of {sorted(_MMA_TYPES)}")
        if self.head_dim not in (64, 128, 256, 512):
            raise ValueError(f"head_dim={self.head_dim}: expected 64, 128, 256 or 512")
        if self.heads_per_unit not in (8, 16, 32):
            raise ValueError(f"heads_per_unit={self.heads_per_unit}: expected 8, 16 or 32")
        if self.heads_per_unit == 32 and (self.q_len == 1 or self.head_dim > 128):
            raise ValueError(f"heads_per_unit=32 with q_len={self.q_len}, head_dim={self.head_dim}: 32-row units are "
                             "for multi-token builds (q_len > 1) of head_dim 64 or 128")
        if self.head_dim == 512 and self.heads_per_unit != 8:
            raise ValueError(f"heads_per_unit={self.heads_per_unit} with head_dim=512: expected 8 (a warp's registers "
                             "hold the output of 8 heads of 512 channels)")
        if self.merge_rows not in (0, 8, 16) or (self.merge_rows and self.heads_per_unit % self.merge_rows):
            raise ValueError(f"merge_rows={self.merge_rows}: expected 0 (all of a unit's rows), 8 or 16, dividing "
                             f"heads_per_unit={self.heads_per_unit}")
        if not 1 <= self.num_warps <= 16 or not 2 <= self.num_stages <= 8:
            raise ValueError(f"num_warps={self.num_warps} (1..16), num_stages={self.num_stages} (2..8)")
        if not isinstance(self.watchdog_ms, int) or self.watchdog_ms < 1:
            raise ValueError(f"watchdog_ms={self.watchdog_ms!r}: expected a positive int")
        if self.batch_invariant and self.onchip_merge:
            raise ValueError("batch_invariant kernels merge through global memory: onchip_merge must be False")
        if self.xrank not in ("", "peer", "proxy"):
            raise ValueError(f"xrank={self.xrank!r}: expected '', 'peer' or 'proxy'")
        if self.xrank and self.batch_invariant:
            raise ValueError("xrank kernels merge across ranks in part order; batch_invariant is not supported")
        if self.kv_dtype not in _KV_BUILDS:
            raise ValueError(f"kv_dtype={self.kv_dtype!r}: expected one of {_KV_BUILDS} ('': the dtype's)")
        if self.kv_dtype and self.xrank:
            raise ValueError("xrank kernels read 16-bit caches: SeqParallelDecode takes no FP8 cache (kv_dtype='')")
        if not isinstance(self.variant, DecodeVariant):
            raise ValueError(f"variant={self.variant!r}: expected a DecodeVariant")
        if self.xrank and self.variant != DecodeVariant():
            raise ValueError("xrank kernels compute plain softmax attention: SeqParallelDecode takes no variant")
        if not isinstance(self.q_len, int) or isinstance(self.q_len, bool) or not 1 <= self.q_len <= MAX_Q_LEN:
            raise ValueError(f"q_len={self.q_len!r}: expected an int from 1 to {MAX_Q_LEN}")
        if self.q_len > 1 and (self.xrank or self.variant.window_left >= 0 or self.variant.rope_theta):
            raise ValueError(f"q_len={self.q_len}: multi-token builds take no xrank, sliding window or RoPE (their "
                             "per-query key positions are the last token's)")
        if not isinstance(self.ragged_q, bool) or (self.ragged_q and self.q_len == 1):
            raise ValueError(f"ragged_q={self.ragged_q!r} with q_len={self.q_len}: expected a bool, True only with "
                             "q_len > 1 (the most new tokens a request has)")
        if self.fp8_math not in ("", "f16"):
            raise ValueError(f"fp8_math={self.fp8_math!r}: expected '' (the dtype's MMA type) or 'f16'")
        if self.fp8_math and (not self.kv_dtype or self.dtype != "bfloat16"):
            raise ValueError(f"fp8_math={self.fp8_math!r} with dtype={self.dtype!r}, kv_dtype={self.kv_dtype!r}: f16 "
                             "math is for FP8 caches with bfloat16 q (float16 builds compute in f16 already)")
        if self.debug_withhold_signal and not self.tma:
            raise ValueError("debug_withhold_signal needs tma=True: only the TMA rings wait on a signal")
        if self.smem_bytes > SMEM_PER_CTA_MAX:
            raise ValueError(f"{self.name} needs {self.smem_bytes} bytes of shared memory, more than the "
                             f"{SMEM_PER_CTA_MAX} a CTA may have on sm_90: use fewer warps or stages")

    @staticmethod
    def default(dtype: str, head_dim: int, onchip_merge: bool = False, group_size: int = 1,
                batch_invariant: bool = False, kv_dtype: str = "",
                variant: DecodeVariant = DecodeVariant(), q_len: int = 1,
                heads_per_unit: Optional[int] = None, ragged_q: bool = False) -> "DecodeKernelConfig":
        """Chosen by bench/decode_sweep.py (bench/RESULTS.md, "kernel configs and cost models"): one CTA
        of eight warps with two-stage rings per SM is the best, or close to it, at every batch size, and
        the fastest at small batches. head_dim 256 (not swept) takes four warps and three stages to fit
        227 KiB, which leaves no room for the on-chip merge area: its split units merge through global memory.
        `onchip_merge=True` adds it (for clusters of more than one CTA) where it fits. Groups of more
        than 8 q heads per kv head get 16-head units (head_dim 64 and 128; 256 has no room for their
        merge area), so a group of 16 reads its KV once instead of twice. Batch-invariant kernels merge
        through global memory only. An FP8 cache's tiles are half the bytes: its rings take 2 (s - 1) + 1
        stages for the 16-bit build's s, so each warp keeps as many bytes in flight (not yet swept). head_dim 512
        (not swept) takes two warps of two stages, all that its 32 KiB tiles leave room for: 64 KiB in flight per
        CTA, as head_dim 128's eight warps of 8 KiB tiles; over an FP8 cache, whose tiles hold as many tokens in
        half the bytes, four warps of two stages instead: as many bytes in flight, and twice the warps for the
        conversions (and RoPE) each byte costs. Its units are 8 heads and merge through global memory. An FP8 cache
        with bf16 q computes in f16 (`fp8_math="f16"`): K and V convert in one instruction, and the f16 build was
        the faster on every FP8 case of bench/decode.py (bench/RESULTS.md, 2026-12-03 sixth session), with no
        larger error (f16 keeps three more bits of P and of the scaled q). Multi-token builds whose kv head has 17-32
        rows ((q head, token) pairs) get 32-row units, which read the KV once instead of twice. At head_dim 128 their
        output takes 128 registers a lane, so their Q fragments wait in shared memory (one copy a CTA, in the merge
        area), and their warps' states merge 8 rows at a time (`merge_rows`), with eight warps of two stages (six with
        the on-chip merge area, chosen when each warp kept its own Q; eight fit now, not timed): the rows' compute
        binds, and eight warps were the faster on every case timed; a third stage or fewer warps with more stages
        gained nothing (bench/RESULTS.md, 2026-12-04, 2026-12-04 ninth session).
        `heads_per_unit` overrides the choice by rows (bench/decode.py's meld-h16 times the 16-row build). A ragged
        build (`ragged_q`) is the uniform q_len build's with each request's rows read from qo_indptr."""
        fp8_math = "f16" if kv_dtype and dtype == "bfloat16" else ""
        rows = group_size * q_len
        heads = heads_per_unit or (8 if rows <= 8 else 16 if rows <= 16 or q_len == 1 or head_dim > 128 else 32)
        warps, stages = {256: (4, 3), 512: (2, 2)}.get(head_dim, (8, 2))
        merge_rows = 8 if heads == 32 and head_dim == 128 else 0
        if merge_rows:
            warps, stages = 6 if onchip_merge and not batch_invariant else 8, 2
        if kv_dtype and head_dim == 512:
            warps = 4
        elif kv_dtype:
            stages = 2 * (stages - 1) + 1
        if head_dim >= 256:
            return DecodeKernelConfig(dtype, head_dim, warps, stages, onchip_merge=False,
                                      heads_per_unit=heads_per_unit or 8, batch_invariant=batch_invariant,
                                      kv_dtype=kv_dtype, variant=variant, q_len=q_len, fp8_math=fp8_math,
                                      ragged_q=ragged_q)
        return DecodeKernelConfig(dtype, head_dim, warps, stages, onchip_merge=onchip_merge and not batch_invariant,
                                  heads_per_unit=heads, batch_invariant=batch_invariant,
                                  kv_dtype=kv_dtype, variant=variant, q_len=q_len, fp8_math=fp8_math,
                                  merge_rows=merge_rows, ragged_q=ragged_q)

    @staticmethod
    def of(low, *, onchip_merge: bool = False, batch_invariant: bool = False,
           kv_dtype: str = "", variant: DecodeVariant = DecodeVariant(), q_len: int = 1,
           ragged_q: bool = False) -> "DecodeKernelConfig":
        """The default build (`default`) of a lowered decode graph (`meld.codegen.lowering.Lowering`): dtype,
        head_dim and group size from its attrs, a cross-rank build where its partials cross ranks."""
        a = low.attrs
        return dataclasses.replace(DecodeKernelConfig.default(
            a["dtype"], a["head_dim"], onchip_merge=onchip_merge, group_size=a["group_size"],
            batch_invariant=batch_invariant, kv_dtype=kv_dtype, variant=variant, q_len=q_len, ragged_q=ragged_q),
            xrank=low.transport or "")

    phase_records = 0   # (MlaKernelConfig's phase stamps: none here)

    @property
    def name(self) -> str:
        kv = "_" + KV_FP8[self.kv_dtype] if self.kv_dtype else ""
        return (f"meld_decode_attention_{_MMA_TYPES[self.dtype]}{kv}_d{self.head_dim}"
                f"_w{self.num_warps}_s{self.num_stages}"
                + (f"_h{self.heads_per_unit}" if self.heads_per_unit > 8 else "")
                + (f"_m{self.merge_rows}" if self.merge_rows and self.merge_rows < self.heads_per_unit else "")
                + ("_dsm" if self.onchip_merge else "") + ("_tma" if self.tma else "")
                + ("_f16m" if self.fp8_math else "")
                + self.variant.suffix + (f"_q{self.q_len}" if self.q_len > 1 else "") + ("r" if self.ragged_q else "")
                + ("_inv" if self.batch_invariant else "") + {"": "", "peer": "_xr", "proxy": "_xp"}[self.xrank]
                + ("_prof" if self.profile else "")
                + (f"_wd{self.watchdog_ms}" if self.watchdog_ms != 2000 else "")
                + ("_withhold" if self.debug_withhold_signal else ""))

    entry = "meld_decode_attention"   # the template's kernel (MELD_PERSISTENT_KERNEL)

    @property
    def threads(self) -> int:
        return 32 * self.num_warps

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory: the cp.async rings, the end-of-unit merge area and, with on-chip
        merges, the two partials kept for cluster peers. Where the output takes 128 registers a lane (head_dim 512;
        32-row units of head_dim 128), Q's fragments wait in the merge area, or after it in batch-invariant builds,
        whose chunks merge while Q is still needed (see the template)."""
        ring = self.num_warps * self.num_stages * 2 * TILE_TOKENS * self.head_dim * (1 if self.kv_dtype else 2)
        merge = self.num_warps * (self.merge_rows or self.heads_per_unit) * (self.head_dim + 4 + 2) * 4 + 16
        parts = 2 * self.heads_per_unit * (self.head_dim + 1) * 4 + 16 if self.onchip_merge else 0
        bars = self.num_warps * self.num_stages * 8 + 8 if self.tma else 0
        blocks = self.head_dim // 16 * self.heads_per_unit // 8   # channel blocks x head blocks of Q (Q_SMEM at 32)
        q_frags = blocks * 32 * 8 if blocks >= 32 and self.batch_invariant else 0
        return ring + merge + parts + bars + q_frags

    @property
    def mma_type(self) -> str:
        """The tensor cores' input type (PTX's name): the dtype's, or f16 under fp8_math="f16"."""
        return self.fp8_math or _MMA_TYPES[self.dtype]

    def render(self) -> str:
        head = "\n".join([
            f"// {self.name}: generated by meld.codegen.decode_kernel from {self!r}",
            f"#define HEAD_DIM {self.head_dim}",
            f"#define NUM_WARPS {self.num_warps}",
            f"#define NUM_STAGES {self.num_stages}",
            f"#define HEADS_PER_UNIT {self.heads_per_unit}",
            f"#define MELD_MERGE_ROWS {self.merge_rows}",
            f"#define SMEM_BYTES {self.smem_bytes}",
            f'#define MELD_MMA_TYPE "{self.mma_type}"',
            f'#define MELD_OUT_TYPE "{_MMA_TYPES[self.dtype]}"',
            f"#define MELD_Q_TO_F16 {int(self.mma_type != _MMA_TYPES[self.dtype])}",
            f"#define MELD_ONCHIP_MERGE {int(self.onchip_merge)}",
            f"#define MELD_PROFILE {int(self.profile)}",
            kind_defines(),
            f"#define MELD_TMA {int(self.tma)}",
            f"#define MELD_CHUNKED {int(self.batch_invariant)}",
            f"#define MELD_WATCHDOG_NS {self.watchdog_ms * 1_000_000}ll",
            f"#define MELD_DEBUG_WITHHOLD {int(self.debug_withhold_signal)}",
            f"#define MELD_XRANK {('', 'peer', 'proxy').index(self.xrank)}",
            f"#define MELD_KV_FP8 {_KV_BUILDS.index(self.kv_dtype)}",
            *self.variant.defines(self.head_dim),
            f"#define MELD_Q_LEN {self.q_len}",
            f"#define MELD_RAGGED_Q {int(self.ragged_q)}",
        ])
        return "\n".join([head, WATCHDOG_RECORD.c_source(), template("common.cuh"), template("events.cuh"), template("persistent.cuh"), template("xrank.cuh"),
                          self.params.c_source(), CTA_TABLE.c_source(), template("split_kv.cuh"),
                          template("decode_attention.cuh"), *([template("decode_xrank.cuh")] if self.xrank else [])])

    @property
    def params(self) -> ParamStruct:
        """The kernel's parameter struct: the decode family's (the cross-rank edge's fields only in
        sequence-parallel builds)."""
        from .lowering import Lowering

        return Lowering("decode_attention", "online_softmax", transport=self.xrank or None).params


@dataclass(frozen=True)
class DecodePlanKernelConfig:
    """The GPU planner (`templates/decode_plan.cuh`): one CTA; shared memory grows with the grid it plans."""

    threads: int = 1024
    # plans each request of the page table as `token_requests` requests, one per new token (decode_plan.h)
    token_requests: bool = False
    entry = "meld_decode_plan"

    @property
    def name(self) -> str:
        return f"meld_decode_plan_t{self.threads}" + ("_tokens" if self.token_requests else "")

    def smem_bytes(self, num_ctas: int) -> int:
        return 8 * (num_ctas + 1) + 4 * 4 * num_ctas

    @property
    def max_ctas(self) -> int:
        """The largest grid it can plan: its scratch for every CTA must fit one CTA's shared memory (1 KiB
        is kept for the static scan buffers)."""
        return (SMEM_PER_CTA_MAX - 1024 - 8) // 24

    def render(self) -> str:
        head = "\n".join([f"// {self.name}: generated by meld.codegen.decode_kernel", "#define MELD_PROFILE 0",
                          "#define MELD_WATCHDOG_NS 2000000000ll", '#define MELD_MMA_TYPE "bf16"'])
        return "\n".join([head, WATCHDOG_RECORD.c_source(), template("common.cuh"), template("events.cuh"),
                          template("persistent.cuh"), plan_source(self.threads, self.token_requests),
                          template("decode_plan.cuh")])


def plan_source(threads: int, token_requests: bool = False) -> str:
    """The planner (templates/decode_plan.h) for blocks of `threads` threads, with its declarations: the
    GPU planner's text, and with threads = 1 the host planner's (meld/runtime/host_helper.py)."""
    return "\n".join([f"#define PLAN_THREADS {threads}", f"#define PLAN_TOKEN_REQUESTS {int(token_requests)}",
                      PLAN_PARAMS.c_source(), CTA_TABLE.c_source(), template("decode_plan.h")])
