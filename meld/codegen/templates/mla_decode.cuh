// meld: persistent split-KV MLA decode attention (DeepSeek's multi-head latent attention in its absorbed
// form, over a paged latent cache).
//
// Every q head attends to one latent KV head: keys are the latent rows (DC = 512 channels) with their rope
// part (DR = 64), values the latent rows alone. A unit is one (request, block of 64 q heads); the decode
// planner (decode_plan.h) cuts the units' KV into one segment per CTA (split_kv.cuh), exactly as for GQA.
// With 128 heads a token's 1152 bytes feed 128 x 1088 multiply-adds: the tensor cores, not the bytes,
// bound the kernel, so everything here is laid out for wgmma:
//   S [64 heads x B tokens]  = Q [64 x 576] . K^T        (m64nBk16, Q and K from shared memory)
//   O [64 heads x 512]      += P [64 x B] . V [B x 512]   (m64n256k16, V MN-major: wgmma_bf16_tb)
// One CTA per SM (the smem below) of three warpgroups:
//   - warpgroup 0: warp 0 streams the KV blocks (B = BLOCK_TOKENS tokens, 9 TMA boxes of 64 channels) through
//     a ring of NUM_STAGES stages, one box copy per page chunk; warp 1 loads each unit's Q (9 TMA boxes, one
//     thread) into the one Q buffer once the score warpgroup is done with the last unit's;
//   - warpgroup 1 (the score warpgroup) computes S, the online softmax, writes P (bf16) and each row's
//     rescale into shared memory, and accumulates O's latent channels 0-255;
//   - warpgroup 2 accumulates channels 256-511 from the same P and V.
// That is the split schedule (FP8 caches, 32-token blocks). A bf16 cache's 64-token blocks run the halves by default
// (mla_halves): both math warpgroups score every block, half of its channels each (so neither computes all of Q.K^T
// and the scores take half the time), and take the softmax of half of its tokens each.
// The score warpgroup hands each block's P and row rescale to warpgroup 2 through two named barriers that
// both sync on (P_FULL: P is written; P_EMPTY: warpgroup 2 is done with it). compute-sanitizer's racecheck
// models neither an mbarrier hand-off of generic stores nor barrier.arrive (tools/SANITIZE.md), and in bf16
// builds the syncs cost nothing: each side reaches the other's barrier right after its own. FP8 builds' score
// warpgroup arrives at P_FULL (score_block says why). Every mbarrier
// wait carries the watchdog: the ring's stages (sites 1, 5), Q (17, 18), a merge's parts (21); a named
// barrier needs none, since the other warpgroup reaches it unless it is stuck in one of those.
//
// A unit split across CTAs leaves one partial per piece ([64 heads][512] floats, normalised, and its lse).
// Its partials are 32x a GQA unit's, too many for one CTA to merge on the kernel's tail, so up to
// MERGE_SLICES of its pieces' CTAs merge it together, each a slice of the channels, in part order
// (bit-identical whoever merges). Part k of n (the piece of CTA first + k) merges slice k when k < S, S the
// largest power of two <= min(n - 1, MERGE_SLICES): it counts its arrival on the unit's counter, waits
// until all n have, merges, and the last of the S mergers resets the counter. The last part never merges:
// it starts its CTA's segment, and a CTA must not wait while its own later work waits on it. The others
// end their segments (part 0) or are their segments (the middle parts), so a waiting CTA has nothing left
// to do, and every part it waits for is computed without a wait before it (the last part is its CTA's
// first piece): no cycle, and no chain of CTAs each held up by the one before. That wait needs every CTA
// resident: one CTA per SM, a grid of at most the SMs (DecodeMLA launches no more).
//
// IEEE semantics as decode_attention.cuh: a non-finite score or P.V value makes that (request, head) row's
// output and lse NaN; an empty unit gives zeros and lse -inf. KV rows past a piece's end (the rest of its
// last page, stale rows of the stage) are masked in S and their V rows zeroed before P.V reads them.
//
// Defined by the including source: BLOCK_TOKENS, NUM_STAGES, MELD_PROFILE, MELD_WATCHDOG_NS, MlaParams, CtaRow,
// split_kv.cuh, hopper.cuh, wgmma_bf16 (m64nBLOCK_TOKENS) and wgmma_bf16_tb (m64n256, B MN-major); FP8 builds
// MLA_KV_FP8 and RAW_STAGES.

namespace meld {

constexpr int HB = 64;                         // q heads a unit computes: wgmma's M
constexpr int DC = 512, DR = 64, DQK = DC + DR;
constexpr int BLK = BLOCK_TOKENS;              // KV tokens a stage holds (32 or 64): S's N, P.V's K
constexpr int NBOX = DQK / 64;                 // boxes of 64 channels (128 swizzled bytes a row): 8 latent, 1 rope
constexpr int BOX = BLK * 128;                 // a box of the stage: BLK rows of 64 channels
constexpr int STAGES = NUM_STAGES;
constexpr int STAGE_BYTES = NBOX * BOX;
constexpr int Q_BYTES = NBOX * HB * 128;
constexpr int P_BYTES = HB * 128;              // P as wgmma's K-major A: 64 rows of 128 swizzled bytes (BLK
                                               // tokens of them in use)
constexpr int VH = DC / 2;                     // latent channels a consumer warpgroup accumulates
constexpr int OACC = VH / 2;                   // its accumulators a thread (m64n256)
constexpr int MERGE_SLICES = 8;                // the most CTAs that merge one split unit together
constexpr int MERGE_CHUNK = 4;                 // parts a merging thread keeps in flight for each of
constexpr int MERGE_OUTS = 4;                  // its groups of four outputs (the loads are latency-bound)

#ifdef MLA_SEESAW
constexpr bool SEESAW = true;                  // the seesaw schedule (mla_seesaw)
#else
constexpr bool SEESAW = false;
#endif
// MLA_HALVES builds (the halves schedule, mla_halves): both consumer warpgroups score every 64-token block, half
// of its channels each, and take the softmax of 32 tokens each.
#ifdef MLA_HALVES
constexpr bool HALVES = true;
#else
constexpr bool HALVES = false;
#endif
constexpr bool PAIRED = SEESAW || HALVES;      // both consumer warpgroups score
constexpr int SACC = BLK / 2;                  // S's accumulators a thread (m64nBLK)
constexpr int HACC = SACC / 2;                 // the halves': those of the block's tokens a warpgroup's softmax takes
constexpr int FULL_BARS = SEESAW ? NBOX : 1;   // full mbarriers a stage: the seesaw's one a box
constexpr int BOX_BAR = SEESAW ? 8 : 0;        // bytes from one box's full mbarrier to the next's

// MLA_KV_FP8 builds read an e4m3 latent cache (the split schedule; 32-token blocks): the TMA copies each block's
// bytes, one a value, into a ring of RAW_STAGES staging stages of its own (4 latent boxes of 128 channels, 128-byte
// swizzle, and the rope box of 64 channels, 64-byte swizzle). Q.K^T runs on e4m3 wgmmas straight from those bytes
// (K-major already): the score warpgroup quantises each unit's Q in place to two e4m3 terms a row of one scale
// (mla_quantize_q; one term would cost ~4% of accuracy, two keep about bf16's: bench/RESULTS.md), and multiplies
// each row's scores by its scale in the softmax. The values still go to bf16 for P.V: warps 2-3 and warpgroup 2
// convert each block's latent boxes (exact: every e4m3 value is a bf16, NaN stays NaN) into the ring stage the bf16
// build's TMA fills, in its layout, and arrive on its full mbarrier (one arrival a thread), which the score
// warpgroup waits for after its softmax, not before its Q.K^T. Warpgroup 2 waits for each block's P most of the
// time (its P.V is a quarter of a block's tensor work): it converts its share of block g + 1 between its P.V of
// block g - 1 and its wait for block g's P, while warpgroup 1 scores block g. A staging stage goes back once the
// converters and the score warps are done with it. The per-tensor scale kv_scale multiplies the scores (folded
// into sm_scale_log2 on the host: lse includes it) and each piece's normalised output (p.v_scale: a merge is a
// convex combination of pieces), as decode_attention.cuh's MELD_KV_FP8 does.
#ifdef MLA_KV_FP8
constexpr bool KV_FP8 = true;
constexpr int RAW_STAGES_ = RAW_STAGES;
#else
constexpr bool KV_FP8 = false;
constexpr int RAW_STAGES_ = 0;
#endif
constexpr int RAW_LAT = BLK * 128;             // a staged latent box: BLK rows of 128 e4m3 channels
constexpr int RAW_ROPE = BLK * 64;             // the staged rope box: BLK rows of 64
constexpr int RAW_BYTES = (DC / 128) * RAW_LAT + RAW_ROPE;
constexpr int CONVERTERS = 64 + 128;           // FP8: warps 2-3 (threads 0-63 of the conversion), warpgroup 2 (64-191)
static_assert(!(KV_FP8 && PAIRED), "FP8 caches run the split schedule");
static_assert(!HALVES || BLK == 64, "the halves schedule runs 64-token blocks");

// Shared memory: Q, the ring, P (the seesaw keeps each block's P in its stage), then the rows' statistics and
// the mbarriers.
constexpr int OFF_RING = Q_BYTES;
constexpr int OFF_P = OFF_RING + STAGES * STAGE_BYTES;
constexpr int OFF_RAW = OFF_P + (SEESAW ? 0 : P_BYTES);   // FP8: the staging ring
constexpr int OFF_STATS = OFF_RAW + RAW_STAGES_ * RAW_BYTES;
struct Stats {
  float alpha[HB];     // the block's rescale of each row (score warpgroup -> warpgroup 2)
  float l[HB], m[HB];  // the unit's final row sums and maxima (with its last block's P)
  float bad[2][HB];    // each warpgroup's non-finite check of its channels (0 or NaN)
  float qs[HB];        // FP8: the unit's q scale of each row (mla_quantize_q)
};
struct SeesawStats {
  Stats base;          // (mla_store's non-finite exchange: base.bad)
  float alpha[2][HB];  // warpgroup g's last block: the rows' rescale and maxima, for the other warpgroup
  float m[2][HB];
  float l[2][HB];      // each warpgroup's row sums at the unit's end
};
struct HalvesStats {   // (in Stats' bytes: the split build's room, which the two stages of 64 tokens leave)
  float mx[2][HB];     // each warpgroup's row maxima of its half of the block
  float l[2][HB];      // each warpgroup's row sums at the unit's end
  float bad[2][HB];    // mla_store's non-finite exchange
};
static_assert(sizeof(HalvesStats) == sizeof(Stats), "the halves' statistics take the split build's room");
constexpr int OFF_BARS = (OFF_STATS + (int)(SEESAW ? sizeof(SeesawStats) : sizeof(Stats)) + 7) & ~7;
constexpr int NUM_BARS = (FULL_BARS + 1) * STAGES + 2 + 2 * RAW_STAGES_;   // (FP8: the staging ring's full, empty)
constexpr int P_FULL = 3, P_EMPTY = 4;         // named barriers of the P hand-off (2: the unit's end)
constexpr int HALF_MAX = 5, HALF_P = 6, HALF_S = 8;   // the halves': the rows' maxima, P's halves, the partial
                                                     // scores exchanged
constexpr int ZERO_BAR = 1;                    // the score warpgroup's: a partial block's zeroed V rows, all warps'
                                               // before its P.V reads them (FP8: also the quantised Q before the
                                               // unit's first Q.K^T)
// MLA_PHASES builds (MlaKernelConfig(phases=True), a profiled diagnostic): where each role's cycles go, phase by
// phase (meld/runtime/profile.py: PHASES). A role's first thread sums its laps in shared memory by a predicated
// reduction (no branch: a branch while a wgmma is in flight serialises the wgmmas) and the recording thread records
// every role's sums at the end of its segment. Roles: 0 the score warpgroup (the seesaw's warpgroup 0), 1
// warpgroup 2 (the seesaw's 1), 2 the converting warps (FP8). Other builds' clocks are empty.
#ifdef MLA_PHASES
constexpr bool PHASES_ON = true;
#else
constexpr bool PHASES_ON = false;
#endif
constexpr int PHASE_ROLES = 3;
constexpr int PHASE_BYTES = PHASES_ON ? PHASE_ROLES * NUM_PHASES * 4 : 0;
constexpr int PHASE_BAR = 7;                   // both consumer warpgroups at the end, before the sums are recorded
constexpr int OFF_PHASES = OFF_BARS + 8 * NUM_BARS;
constexpr int SMEM_USED = OFF_PHASES + PHASE_BYTES;
static_assert(SMEM_USED + 1024 <= SMEM_BYTES, "SMEM_BYTES (from Python) is too small");
static_assert(OFF_RING % 1024 == 0 && OFF_P % 1024 == 0 && OFF_RAW % 1024 == 0 && RAW_BYTES % 1024 == 0,
              "128-byte swizzled buffers start on 1 KiB");
static_assert(BLK == 32 || BLK == 64, "KV blocks of 32 or 64 tokens");

struct Bars {   // mbarrier addresses (full: FULL_BARS a stage)
  u32 full, empty, q_full, q_empty;
  __device__ Bars(u32 base) : full(base), empty(base + 8 * FULL_BARS * STAGES), q_full(base + 8 * (FULL_BARS + 1) * STAGES),
                              q_empty(base + 8 * (FULL_BARS + 1) * STAGES + 8) {}
  __device__ u32 box_full(int stage, int box) const { return full + 8 * (FULL_BARS * stage + box); }
  // FP8: the staging ring's (after q_empty)
  __device__ u32 raw_full(int stage) const { return q_empty + 8 + 8 * stage; }
  __device__ u32 raw_empty(int stage) const { return q_empty + 8 + 8 * (RAW_STAGES_ + stage); }
};

__device__ __forceinline__ WaitSite mla_site(const MlaParams& p, int site, int cta, int unit, int detail) {
  return WaitSite{p.watchdog, p.watchdog_claim, p.watchdog_kernel, site, cta, (int)(threadIdx.x >> 5), unit, detail};
}

struct PhaseClock {
  u32 sums;     // this role's [NUM_PHASES] u32 in shared memory
  u32 t = 0;    // the last lap's clock
  bool first;   // the thread that sums
  __device__ __forceinline__ PhaseClock(u32 base, int role, bool first_) : sums(base + OFF_PHASES + 4 * NUM_PHASES * role), first(first_) {
    restart();
  }
  __device__ __forceinline__ void restart() {
    if constexpr (PHASES_ON) asm volatile("mov.u32 %0, %%clock;" : "=r"(t)::"memory");
  }
  __device__ __forceinline__ void add(int phase, u32 v) const {
    if constexpr (PHASES_ON)
      asm volatile("{ .reg .pred p; setp.ne.u32 p, %2, 0; @p red.shared.add.u32 [%0], %1; }"
                   ::"r"(sums + 4 * phase), "r"(v), "r"((u32)first) : "memory");
  }
  // The cycles since the last lap go to `phase`.
  __device__ __forceinline__ void lap(int phase) {
    if constexpr (PHASES_ON) {
      u32 now;
      asm volatile("mov.u32 %0, %%clock;" : "=r"(now)::"memory");
      add(phase, now - t);
      t = now;
    }
  }
};
// Every role's sums, by the recording thread (prof's), once every role is done.
__device__ __forceinline__ void record_phases(Profiler& prof, u32 base) {
  if constexpr (PHASES_ON)
#pragma unroll 1   // (unrolled, the seesaw's stamped build spilled)
    for (int r = 0; r < PHASE_ROLES; ++r)
#pragma unroll 1
      for (int k = 0; k < NUM_PHASES; ++k) {
        u32 v;
        asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(base + OFF_PHASES + 4 * (NUM_PHASES * r + k)) : "memory");
        if (v != 0u) prof.record_cycles(k, r, v);
      }
}

struct MlaUnit { int req, h0, rows; };   // a unit's planned request (its q and out row) and q heads

// The units of a segment in order, with each one's piece (what every role walks). DecodeMLA plans head-major
// (decode_plan.h): unit u is q heads 64 (u / planned) on of planned request u % planned, so that the CTAs that
// cut one request's two halves at the same tokens read its KV blocks together; `planned` is the plan's units
// (the last CTA row's u_end, written by the planner) over the units a request has, read where it is needed
// (held in a register across the roles' loops, it made the seesaw build spill).
struct UnitWalk {
  const MlaParams& p;
  Segment g;
  int cta;
  __device__ UnitWalk(const MlaParams& p_, int cta_) : p(p_), g(load_segment(p_.cta_table, p_.num_ctas, cta_)), cta(cta_) {}
  __device__ int first() const { return g.empty ? 0 : g.u_begin; }
  __device__ int last() const { return g.empty ? -1 : g.u_last; }
  __device__ int planned() const {   // (a plan with units has a request)
    return max(1, p.cta_table[CTAROW_U_END * p.num_ctas + p.num_ctas - 1] / p.units_per_request);
  }
  __device__ int req(int u) const { return u % planned(); }
  __device__ MlaUnit unit(int u) const {
    const int n = planned(), h0 = u / n * HB;
    return MlaUnit{u % n, h0, min(HB, p.num_heads - h0)};
  }
  __device__ Piece piece(int u) const { return segment_piece(g, u, cta, p.kv_len[req(u)]); }
  __device__ static int blocks(const Piece& x) { return (x.end - x.begin + BLK - 1) / BLK; }
};

// Warp 0, one thread: every KV block of the segment into the ring. A block of `valid` tokens loads the page
// chunks (box_rows rows each) that hold them; rows past them keep stale bytes, masked by the consumers. The
// seesaw counts each box's bytes on its own mbarrier, so Q.K^T starts on the first box to land. The segment's
// second block waits until the first unit's Q has landed: at the launch every CTA asks DRAM for its Q and its
// first blocks at once, and the first Q.K^T needs only Q and block 0 (the phase stamps' first wait for Q:
// 17-23k cycles a CTA, 2026-12-05). Deadlock-free: Q's loaders wait for nothing the producer does. Only when
// that second block is the first unit's own: then q_full's next phase (the next unit's Q) needs the first unit's
// last Q.K^T, so needs this block, and cannot complete before this wait looks. A second block of a later unit
// could follow a one-block first unit whose next Q had already landed, and a parity wait would then be for a
// phase that needs the blocks not yet issued.
__device__ void mla_produce(const MlaParams& p, const UnitWalk& w, u32 ring, const Bars& b) {
  const unsigned long long policy = l2_evict_first();   // (the other head block's CTA reads the same KV from L2
                                                        //  at about the same time; nothing reads it later)
  int stage = 0;
  u32 phase = 0;
  const int R = p.box_rows;
  int issued = 0;
  for (int u = w.first(); u <= w.last(); ++u) {
    const Piece x = w.piece(u);
    const int base = p.page_base[w.req(u)];
    for (int t0 = x.begin; t0 < x.end; t0 += BLK) {
      if (issued++ == 1 && t0 > x.begin)   // (the first unit's second block: its Q is q_full's phase 0)
        mbar_wait(b.q_full, 0u, mla_site(p, 17, w.cta, u, 0));
      const int chunks = (min(BLK, x.end - t0) + R - 1) / R;
      if constexpr (KV_FP8) {   // into the staging ring: 4 latent boxes of 128 channels, the rope box
        mbar_wait(b.raw_empty(stage), phase ^ 1u, mla_site(p, 22, w.cta, u, stage));
        const u32 full = b.raw_full(stage), dst = ring + stage * RAW_BYTES;
        mbar_arrive_expect_tx(full, chunks * R * (DC + DR));
        for (int c = 0; c < chunks; ++c) {
          const int tok = t0 + c * R, pg = tok / p.page_size;
          const int row = p.kv_indices[base + pg] * p.page_size + (tok - pg * p.page_size);
#pragma unroll
          for (int k = 0; k < DC / 128; ++k)
            tma_load_2d_hint(dst + k * RAW_LAT + c * R * 128, &p.ckv_map, 128 * k, row, full, policy);
          tma_load_2d_hint(dst + (DC / 128) * RAW_LAT + c * R * 64, &p.kpe_map, 0, row, full, policy);
        }
        if (++stage == RAW_STAGES_) { stage = 0; phase ^= 1u; }
        continue;
      }
      mbar_wait(b.empty + 8 * stage, phase ^ 1u, mla_site(p, 5, w.cta, u, stage));
      const u32 full = b.full + 8 * FULL_BARS * stage, dst = ring + stage * STAGE_BYTES;
      if constexpr (SEESAW) {
#pragma unroll
        for (int k = 0; k < NBOX; ++k) mbar_arrive_expect_tx(full + BOX_BAR * k, chunks * R * 128);
      } else {
        mbar_arrive_expect_tx(full, chunks * R * 128 * NBOX);
      }
      for (int c = 0; c < chunks; ++c) {
        const int tok = t0 + c * R, pg = tok / p.page_size;
        const int row = p.kv_indices[base + pg] * p.page_size + (tok - pg * p.page_size);
#pragma unroll
        for (int k = 0; k < NBOX - 1; ++k)
          tma_load_2d_hint(dst + k * BOX + c * R * 128, &p.ckv_map, 64 * k, row, full + BOX_BAR * k, policy);
        tma_load_2d_hint(dst + (NBOX - 1) * BOX + c * R * 128, &p.kpe_map, 0, row, full + BOX_BAR * (NBOX - 1),
                         policy);
      }
      if (++stage == STAGES) { stage = 0; phase ^= 1u; }
    }
  }
}

// Warp 1: each unit's Q (q_nope's 8 boxes of 64 channels, then q_pe's) into the Q buffer by TMA, one thread, in
// the 128-byte swizzle (chunk c of head h at box c / 8, row h, chunk (c % 8) ^ (h % 8)); heads past the unit's rows
// are past num_heads, which the copies fill with zeros. Q's address is the call's: the host encodes each map once per
// strides (p.qn_map, p.qp_map, templates) and the warp publishes this CTA's copies with the call's addresses to its
// slot of p.q_maps first (tensor_map_publish, staged in the Q buffer before any copy lands there). Empty pieces load
// nothing (the score warpgroup skips them too).
__device__ void mla_load_q(const MlaParams& p, const UnitWalk& w, u32 qbuf, const Bars& b) {
  const int lane = threadIdx.x & 31;
  char* maps = p.q_maps + 256 * (i64)w.cta;
  tensor_map_publish(&p.qn_map, p.q_nope, qbuf, maps);
  tensor_map_publish(&p.qp_map, p.q_pe, qbuf + 128, maps + 128);
  if (lane != 0) return;
  tensor_map_acquire(maps);
  tensor_map_acquire(maps + 128);
  fence_proxy_async();   // (the staging's reads before the copies write the Q buffer)
  u32 phase = 0;
  for (int u = w.first(); u <= w.last(); ++u) {
    if (UnitWalk::blocks(w.piece(u)) == 0) continue;
    const MlaUnit un = w.unit(u);
    mbar_wait(b.q_empty, phase ^ 1u, mla_site(p, 18, w.cta, u, 0));
    mbar_arrive_expect_tx(b.q_full, Q_BYTES);
#pragma unroll
    for (int k = 0; k < DC / 64; ++k) tma_load_3d(qbuf + k * (HB * 128), maps, 64 * k, un.h0, un.req, b.q_full);
    tma_load_3d(qbuf + (DC / 64) * (HB * 128), maps + 128, 0, un.h0, un.req, b.q_full);
    phase ^= 1u;
  }
}

// FP8 builds: block g of the segment's (every unit's blocks in turn) values, its staged latent boxes, into its
// ring stage as bf16, the share of conversion thread t (0 .. CONVERTERS - 1: warps 2-3, then warpgroup 2); the
// scores read the staged bytes themselves (mla_issue_scores_fp8), so the rope box is not converted. A 16-byte
// chunk of the staging stage (found by its swizzled place: consecutive threads read consecutive chunks) holds 16
// channels of one token row; they become two 16-byte chunks of the stage's row. Staged rows past the block's
// tokens are converted too (stale bytes, zeroed by the score warpgroup as in the bf16 build). `u`: the block's
// unit (for the watchdog).
__device__ void mla_convert_block(const MlaParams& p, int cta, u32 raw, u32 ring, const Bars& b, int g, int u, int t,
                                  PhaseClock& pc) {
  const int rs = g % RAW_STAGES_, stage = g % STAGES;
  const u32 rphase = (u32)(g / RAW_STAGES_) & 1u, phase = (u32)(g / STAGES) & 1u;
  mbar_wait(b.raw_full(rs), rphase, mla_site(p, 7, cta, u, rs));
  mbar_wait(b.empty + 8 * stage, phase ^ 1u, mla_site(p, 5, cta, u, stage));
  pc.lap(PHASE_WAIT_RAW);
  const u32 src = raw + rs * RAW_BYTES, dst = ring + stage * STAGE_BYTES;
#pragma unroll 2
  for (int i = t; i < (DC / 128) * RAW_LAT / 16; i += CONVERTERS) {
    const int off = 16 * i;
    // the chunk's token row and first channel: a latent box's 128-byte rows, chunk c at c ^ (row % 8)
    const int box = off / RAW_LAT, o = off - box * RAW_LAT;
    const int row = o >> 7, ch = 128 * box + 16 * (((o >> 4) & 7) ^ (row & 7));
    const uint4 v = ld_shared_v4(src + off);
    u32 r[8];
    e4m3x4_to_f16(v.x, r[0], r[1]);
    e4m3x4_to_f16(v.y, r[2], r[3]);
    e4m3x4_to_f16(v.z, r[4], r[5]);
    e4m3x4_to_f16(v.w, r[6], r[7]);
#pragma unroll
    for (int k = 0; k < 8; k += 2) f16x4_to_mma(r[k], r[k + 1]);
    const int c8 = (ch & 63) >> 3;      // the first bf16 chunk of the 64-channel box ch / 64
    const u32 row_addr = dst + (ch >> 6) * BOX + row * 128;
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(row_addr + ((c8 ^ (row & 7)) << 4)),
                 "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(row_addr + (((c8 + 1) ^ (row & 7)) << 4)),
                 "r"(r[4]), "r"(r[5]), "r"(r[6]), "r"(r[7]) : "memory");
  }
  fence_proxy_async();   // the stores before the wgmmas (async proxy) read them
  pc.lap(PHASE_CONVERT);   // (before the arrival: the score warpgroup's wait for it orders the sum for the record)
  mbar_arrive(b.full + 8 * stage);
  mbar_arrive(b.raw_empty(rs));
}

// The first unit from `u` on with a block to compute (w.last() + 1: none).
__device__ __forceinline__ int unit_with_blocks(const UnitWalk& w, int u) {
  while (u <= w.last() && UnitWalk::blocks(w.piece(u)) == 0) ++u;
  return u;
}

// FP8 builds, warps 2-3: their share of every block of the segment, in order.
__device__ void mla_convert(const MlaParams& p, const UnitWalk& w, u32 raw, u32 ring, const Bars& b, u32 base) {
  int g = 0;
  PhaseClock pc(base, 2, threadIdx.x == 64);
  for (int u = w.first(); u <= w.last(); ++u)
    for (int j = UnitWalk::blocks(w.piece(u)); j > 0; --j, ++g) {
      pc.add(PHASE_BLOCKS, 1);   // (before the block's arrivals, which order the sums for the record)
      mla_convert_block(p, w.cta, raw, ring, b, g, u, threadIdx.x - 64, pc);
    }
}

// Row r of a thread's m64nN accumulators (register i): 16 (warp % 4) + lane / 4 + 8 ((i / 2) % 2); column
// 8 (i / 4) + 2 (lane % 4) + i % 2. A thread holds two rows: half 0 and half 1.
__device__ __forceinline__ int acc_row(int lane, int warp, int half) { return 16 * (warp & 3) + (lane >> 2) + 8 * half; }

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// O[:, 256 g .. 256 g + 255] += P . V of ring stage `st` (g: the warpgroup's channel half), issued and
// committed.
__device__ __forceinline__ void mla_issue_pv(float (&o)[OACC], u32 pbuf, u32 st, int g) {
#pragma unroll
  for (int k = 0; k < BLK / 16; ++k)
    wgmma_bf16_tb(o, wgmma_desc(pbuf + 32 * k), wgmma_desc_mn(st + 4 * g * BOX + 2048 * k, BOX));
  wgmma_commit();
}

// The score warpgroup's P as the A operand of its own P.V, in registers: the accumulator fragment of two
// neighbouring 8-token column groups of S is the A fragment of one 16-token k step (its rows r and r + 8,
// tokens 2 (lane % 4) + {0, 1} and + 8), so P goes to the tensor cores without the trip through shared memory.
__device__ __forceinline__ void p_fragments(const float (&s)[SACC], u32 (&pa)[BLK / 16][4]) {
#pragma unroll
  for (int k = 0; k < BLK / 16; ++k)
#pragma unroll
    for (int r = 0; r < 4; ++r) pa[k][r] = pack2(s[8 * k + 2 * r], s[8 * k + 2 * r + 1]);
}

// O[:, 256 g ..] += P . V of ring stage `st` with P in registers (p_fragments), issued and committed.
__device__ __forceinline__ void mla_issue_pv_regs(float (&o)[OACC], const u32 (&pa)[BLK / 16][4], u32 st, int g) {
#pragma unroll
  for (int k = 0; k < BLK / 16; ++k) wgmma_rs_tb(o, pa[k], wgmma_desc_mn(st + 4 * g * BOX + 2048 * k, BOX));
  wgmma_commit();
}

// The same, waited for.
__device__ __forceinline__ void mla_pv(float (&o)[OACC], u32 pbuf, u32 st, int g) {
  fence_regs(o);   // the rescale is done before the fence (or ptxas serialises the wgmmas)
  wgmma_fence();
  mla_issue_pv(o, pbuf, st, g);
  wgmma_wait<0>();
  fence_regs(o);
}

// The rows' rescale of one block: a thread's accumulators of half h times a[h].
__device__ __forceinline__ void rescale(float (&o)[OACC], float a0, float a1) {
#pragma unroll
  for (int i = 0; i < OACC; ++i) o[i] *= (i >> 1) & 1 ? a1 : a0;
}

// V rows past the piece's end (from `valid`) in the BOXES latent boxes of a stage from `st`: zeros, which P (0
// there) must not turn into NaN. One warpgroup (ct 0..127).
template <int BOXES = DC / 64>
__device__ __forceinline__ void zero_tail(u32 st, int valid, int ct) {
  static_assert(BOXES == 4 || BOXES == 8, "four or eight boxes");
  constexpr int ROW_SHIFT = BOXES == 8 ? 6 : 5;   // log2(8 BOXES): 16-byte chunks of a row's boxes
  if (valid < BLK)
    for (int i = ct; i < (BLK - valid) * 8 * BOXES; i += 128)   // row valid + i / (8 BOXES), box (i / 8) % BOXES
      st_shared_zero16(st + ((i >> 3) & (BOXES - 1)) * BOX + (valid + (i >> ROW_SHIFT)) * 128 + ((i & 7) << 4));
}

// A block's P (bf16) from a warpgroup's S accumulators (its tokens from col0 on) into `pbuf` as wgmma's K-major A
// (128-byte swizzle).
template <int N>
__device__ __forceinline__ void store_p(u32 pbuf, const float (&s)[N], int lane, int warp, int col0 = 0) {
#pragma unroll
  for (int i = 0; i < N; i += 2) {
    const int r = acc_row(lane, warp, (i >> 1) & 1), col = col0 + 8 * (i >> 2) + 2 * (lane & 3);
    asm volatile("st.shared.u32 [%0], %1;" ::"r"(pbuf + r * 128 + ((((col >> 3) ^ (r & 7))) << 4) + (col & 7) * 2),
                 "r"(pack2(s[i], s[i + 1])) : "memory");
  }
}

// Straight-line forms of `if (c) named_barrier(...)` and `if (c) *addr = v` (predicated instructions, no branch),
// for code that runs while a wgmma is in flight: a branch there makes ptxas serialise the wgmmas.
__device__ __forceinline__ void named_barrier_if(bool c, int id, int threads) {
  __syncwarp();
  asm volatile("{ .reg .pred p; setp.ne.b32 p, %0, 0; @p barrier.sync %1, %2; }" ::"r"((int)c), "r"(id), "r"(threads)
               : "memory");
}
__device__ __forceinline__ void st_shared_if(bool c, float* addr, float v) {
  asm volatile("{ .reg .pred p; setp.ne.b32 p, %0, 0; @p st.shared.f32 [%1], %2; }" ::"r"((int)c), "r"(smem_addr(addr)),
               "f"(v) : "memory");
}

// Part 0 of a unit split in two merges it from its own accumulators and part 1's partial: part 1 is its CTA's
// first piece and long done, and part 0, its CTA's last, would otherwise store 128 KiB of partial and read it back
// with part 1's while every CTA does the same at the kernel's end (the phase stamps' unit-end: ~40k cycles a
// split CTA against ~10k for a whole unit's, 2026-12-05). Units of more parts merge in slices (mla_arrive), and
// so do the seesaw's (at its 168 registers the merge spilled). A two-part unit has one merger, so its bits need
// not match a sliced merge's; the weights are merge_lse4's (IEEE: a NaN part makes the row NaN).
__device__ __forceinline__ bool merges_in_registers(const Piece& x) {
  return !SEESAW && x.num_parts == 2 && x.slot == x.parts_begin;
}

// merges_in_registers: row r's (output row `orow`) outputs of this thread, channels c0 + 8 j + {0, 1}, from the
// accumulators of row half h (o[i] * inv, lse2: this part's normalised partial) and part 1's.
__device__ __forceinline__ void merge_pair(const MlaParams& p, const Piece& x, const float (&o)[OACC], float inv,
                                           float lse2, i64 orow, int r, int c0, int h, bool write_lse) {
  const i64 other = (i64)x.parts_begin + 1;
  const float lse1 = ld_cg(p.part_lse + other * HB + r);
  const float* part = p.part_o + (other * HB + r) * DC + c0;
  u16* out = p.out + orow * DC + c0;
  const float mx = fmaxf(lse2, lse1), m_use = mx == neg_inf() ? 0.f : mx;
  const float w0 = exp2_approx(lse2 - m_use), w1 = exp2_approx(lse1 - m_use), sum = w0 + w1;
  const float a0 = w0 * inv / sum, a1 = w1 / sum;   // each part's weight (part 0's times its normalisation)
  constexpr int BATCH = 8;   // part 1's values a thread has in flight: one round trip a batch (volatile loads,
                             // issued together ahead of the batch's stores)
#pragma unroll   // (o[] indexed by constants: a partial unroll put it in local memory)
  for (int b = 0; b < OACC / 4; b += BATCH) {
    float2 v1[BATCH];
#pragma unroll
    for (int j = 0; j < BATCH; ++j) v1[j] = ld_cg2(part + 8 * (b + j));
#pragma unroll
    for (int j = 0; j < BATCH; ++j) {
      const int i = 4 * (b + j) + 2 * h;   // o[i], o[i + 1]: channels c0 + 8 (b + j) + {0, 1}
      *reinterpret_cast<u32*>(out + 8 * (b + j)) = pack2(o[i] * a0 + v1[j].x * a1, o[i + 1] * a0 + v1[j].y * a1);
    }
  }
  if (write_lse && p.lse != nullptr) p.lse[orow] = (mx + log2_approx(sum)) * kLn2;
}

// Both consumer warpgroups at a unit's end: the rows' non-finite check over all 512 channels (exchanged in
// shared memory, `xbad`), then the output (whole unit) or this piece's partial. `l`, `m`: the thread's two rows'.
__device__ __forceinline__ void mla_store(const MlaParams& p, int u, const MlaUnit& un, const Piece& x, float (&o)[OACC],
                                          const float (&l)[2], const float (&m)[2], float (&xbad)[2][HB], int g, int warp, int lane,
                                          int cta, PhaseClock& pc) {
  float bad[2] = {0.f, 0.f};
#pragma unroll
  for (int i = 0; i < OACC; ++i) bad[(i >> 1) & 1] += o[i] - o[i];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    bad[h] = quad_sum(bad[h]);
    if ((lane & 3) == 0) xbad[g][acc_row(lane, warp, h)] = bad[h];
  }
  named_barrier(2, 256);
  pc.lap(PHASE_END_SYNC);
  float lrow[2];   // NaN when a row met a non-finite value anywhere
#pragma unroll
  for (int h = 0; h < 2; ++h) lrow[h] = l[h] + xbad[0][acc_row(lane, warp, h)] + xbad[1][acc_row(lane, warp, h)];
  named_barrier(2, 256);   // both have read xbad (every lane, before any diverges): the next unit's may
                           // overwrite it
  pc.lap(PHASE_END_SYNC);
  const int req = un.req, h0 = un.h0, rows = un.rows;
  const bool regs = merges_in_registers(x);
  if (regs) {   // the other part's partial and lse, once it has arrived
    if (g == 0 && warp == 0 && lane == 0)
      event_wait(reinterpret_cast<const int*>(p.counters + u), 1, mla_site(p, 21, cta, u, 2));
    named_barrier(2, 256);
    pc.lap(PHASE_WAIT_PARTS);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = acc_row(lane, warp, h);
    const float lr = lrow[h];
    const float inv = lr == 0.f ? 0.f : (KV_FP8 ? p.v_scale : 1.f) / lr;   // 0: an empty unit; NaN stays NaN
    const float lse2 = lr == 0.f ? neg_inf() : (m[h] == neg_inf() ? 0.f : m[h]) + log2_approx(lr);
    if (r >= rows) continue;
    const int c0 = VH * g + 2 * (lane & 3);
    if (regs) {
      merge_pair(p, x, o, inv, lse2, (i64)req * p.num_heads + h0 + r, r, c0, h, g == 0 && (lane & 3) == 0);
    } else if (x.slot < 0) {
      u16* out = p.out + ((i64)req * p.num_heads + h0 + r) * DC + c0;
#pragma unroll
      for (int i = 2 * h; i < OACC; i += 4)
        *reinterpret_cast<u32*>(out + 8 * (i >> 2)) = pack2(o[i] * inv, o[i + 1] * inv);
      if (g == 0 && (lane & 3) == 0 && p.lse != nullptr) p.lse[(i64)req * p.num_heads + h0 + r] = lse2 * kLn2;
    } else {
      float* part = p.part_o + ((i64)x.slot * HB + r) * DC + c0;
#pragma unroll
      for (int i = 2 * h; i < OACC; i += 4)
        *reinterpret_cast<float2*>(part + 8 * (i >> 2)) = make_float2(o[i] * inv, o[i + 1] * inv);
      if (g == 0 && (lane & 3) == 0) p.part_lse[x.slot * HB + r] = lse2;
    }
  }
  pc.lap(PHASE_STORE);
}

// Both consumer warpgroups (256 threads, ct 0..255) after storing a split piece's partial: count its arrival;
// parts 0 .. S - 1 wait for every part and merge their slice of the channels, in part order (module comment).
__device__ __forceinline__ void mla_arrive(const MlaParams& p, int u, const MlaUnit& un, const Piece& x, int cta,
                                           int ct, PhaseClock& pc) {
  if (merges_in_registers(x)) {   // merged in mla_store, after part 1's arrival: the last to touch the counter
    if (ct == 0) event_reset(p.counters + u);
    return;
  }
  __threadfence();   // this piece's partial before its count
  named_barrier(2, 256);
  pc.lap(PHASE_STORE);
  const int n = x.num_parts, k = x.slot - x.parts_begin;
  int slices = 1;
  while (2 * slices <= n - 1 && 2 * slices <= MERGE_SLICES) slices *= 2;
  unsigned* counter = p.counters + u;
  if (ct == 0) event_arrive(counter, 1u, (unsigned)n);
  if (k >= slices) return;
  if (ct == 0) event_wait(reinterpret_cast<const int*>(counter), n, mla_site(p, 21, cta, u, n));
  named_barrier(2, 256);
  pc.lap(PHASE_WAIT_PARTS);
  const int req = un.req, h0 = un.h0, rows = un.rows;
  const int width = DC / slices, c0 = k * width, q4 = width / 4, outs = rows * q4;
  for (int i0 = ct; i0 < outs; i0 += 256 * MERGE_OUTS) {   // MERGE_OUTS groups of four outputs a thread
    int r[MERGE_OUTS], c[MERGE_OUTS];
#pragma unroll
    for (int g = 0; g < MERGE_OUTS; ++g) {
      const int i = min(i0 + 256 * g, outs - 1);   // (past the end: a repeat, not stored)
      r[g] = i / q4;
      c[g] = c0 + 4 * (i - r[g] * q4);
    }
    float lse2[MERGE_OUTS];
    float4 v[MERGE_OUTS];
    merge_lse4<MERGE_CHUNK, MERGE_OUTS>(n, [&](int j, int g, float& lse, float4& o) {
      lse = ld_cg(p.part_lse + (x.parts_begin + j) * HB + r[g]);
      o = ld_cg4(p.part_o + ((i64)(x.parts_begin + j) * HB + r[g]) * DC + c[g]);
    }, v, lse2);
#pragma unroll
    for (int g = 0; g < MERGE_OUTS; ++g) {
      if (i0 + 256 * g >= outs) break;
      u16* out = p.out + ((i64)req * p.num_heads + h0 + r[g]) * DC + c[g];
      *reinterpret_cast<uint2*>(out) = make_uint2(pack2(v[g].x, v[g].y), pack2(v[g].z, v[g].w));
      if (c[g] == 0 && p.lse != nullptr) p.lse[(i64)req * p.num_heads + h0 + r[g]] = lse2[g] * kLn2;
    }
  }
  named_barrier(2, 256);   // every thread's loads of the parts are done before the counter can reset
  pc.lap(PHASE_MERGE);
  if (ct == 0 && event_arrive(counter, 1u, (unsigned)(n + slices))) event_reset(counter);   // ready for the next launch
}

// A descriptor `bytes` (a multiple of 16) past `d`, computed where it is used: an asm the compiler keeps in
// order with the wgmmas, so it does not hoist 72 descriptors into registers ahead of them (that spilled).
__device__ __forceinline__ unsigned long long desc_at(unsigned long long d, u32 bytes) {
  unsigned long long r;
  asm volatile("add.s64 %0, %1, %2;" : "=l"(r) : "l"(d), "l"((unsigned long long)(bytes >> 4)));
  return r;
}

// S = Q . K^T of ring stage `st` into s (the first k step overwrites it), issued and committed: the caller
// waits. `box_ready(b)` runs before the first wgmma that reads box b (the seesaw waits for its copies there). The
// halves sum channels 16 K0 .. 16 K1 - 1 only (k steps K0 .. K1 - 1).
template <int K0 = 0, int K1 = DQK / 16, class BoxReady>
__device__ __forceinline__ void mla_issue_scores(float (&s)[SACC], u32 qbuf, u32 st, BoxReady&& box_ready) {
  const unsigned long long dq = wgmma_desc(qbuf), dk = wgmma_desc(st);
#pragma unroll
  for (int k = K0; k < K1; ++k) {
    if (k == K0 || (k & 3) == 0) box_ready(k >> 2);
    wgmma_bf16(s, desc_at(dq, (k >> 2) * (HB * 128) + 32 * (k & 3)), desc_at(dk, (k >> 2) * BOX + 32 * (k & 3)), k > K0);
  }
  wgmma_commit();
}
template <int K0 = 0, int K1 = DQK / 16>
__device__ __forceinline__ void mla_issue_scores(float (&s)[SACC], u32 qbuf, u32 st) {
  mla_issue_scores<K0, K1>(s, qbuf, st, [](int) {});
}

#ifdef MLA_KV_FP8
// FP8 builds: the unit's Q, as its TMA wrote it (bf16, 9 boxes), quantised in place to two e4m3 terms of one scale
// a row, s = the row's max |q| / 448 (group_scale): hi = e4m3(q / s), lo = e4m3(q / s - hi) (bf16x8_to_e4m3_split).
// The e4m3 operands of mla_issue_scores_fp8, 128-byte swizzled: hi's latent box m (channels 128 m .. + 127) in bf16
// box m's place, lo's in box 4 + m's, the rope's hi and lo in bytes 0-63 and 64-127 of box 8's rows. Each of a row's
// bytes stays among that row's bytes of the nine boxes, so the eight threads of a row (one warp's) load all of it
// before any of them stores. The score warpgroup (ct 0..127); each row's s goes to qs.
__device__ void mla_quantize_q(u32 qbuf, float* qs, int ct) {
  const int j = ct & 7;   // the thread's 16-byte chunk of every box: channels 64 k + 8 j .. + 7 of box k
#pragma unroll 1
  for (int r = ct >> 3; r < HB; r += 16) {
    u32 w[NBOX][4];
    u32 amax = 0;
#pragma unroll
    for (int k = 0; k < NBOX; ++k) {
      const uint4 v = ld_shared_v4(qbuf + k * (HB * 128) + r * 128 + ((j ^ (r & 7)) << 4));
      w[k][0] = v.x; w[k][1] = v.y; w[k][2] = v.z; w[k][3] = v.w;
      amax = max(amax, bf16x8_amax(w[k]));
    }
#pragma unroll
    for (int d = 1; d < 8; d <<= 1) amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, d));
    const float sc = group_scale(amax << 16), inv = 1.f / sc;
    if (j == 0) qs[r] = sc;
    __syncwarp();   // the row's loads, all eight threads', before its stores
#pragma unroll
    for (int k = 0; k < NBOX; ++k) {
      uint2 hi, lo;
      bf16x8_to_e4m3_split(w[k], inv, hi, lo);
      // the 8 bytes' place in their 128-byte row: latent channel 64 k + 8 j is byte 64 (k % 2) + 8 j of box k / 2;
      // the rope's channel 8 j is byte 8 j (hi) or 64 + 8 j (lo)
      const int c = k < DC / 64 ? 4 * (k & 1) + (j >> 1) : j >> 1;
      const u32 row = qbuf + (k < DC / 64 ? k >> 1 : DC / 64) * (HB * 128) + r * 128 + 8 * (j & 1);
      const u32 lo_row = row + (k < DC / 64 ? (DC / 128) * (HB * 128) : 0);
      const int lo_c = k < DC / 64 ? c : c + 4;
      asm volatile("st.shared.v2.u32 [%0], {%1, %2};" ::"r"(row + ((c ^ (r & 7)) << 4)), "r"(hi.x), "r"(hi.y) : "memory");
      asm volatile("st.shared.v2.u32 [%0], {%1, %2};" ::"r"(lo_row + ((lo_c ^ (r & 7)) << 4)), "r"(lo.x), "r"(lo.y)
                   : "memory");
    }
  }
}

// FP8 builds: S of the block in staging stage `raw` from the quantised Q (mla_quantize_q): hi's 18 K steps of 32
// channels, then lo's, into one sum (the row's scale multiplies it in the softmax); issued and committed.
__device__ __forceinline__ void mla_issue_scores_fp8(float (&s)[SACC], u32 qbuf, u32 raw) {
  const unsigned long long dq = wgmma_desc(qbuf), dk = wgmma_desc(raw),
                           dr = wgmma_desc_sw64(raw + (DC / 128) * RAW_LAT);   // (the rope box: 64-byte rows)
#pragma unroll
  for (int t = 0; t < 2; ++t) {
#pragma unroll
    for (int k = 0; k < DC / 32; ++k)
      wgmma_e4m3(s, desc_at(dq, ((DC / 128) * t + (k >> 2)) * (HB * 128) + 32 * (k & 3)),
                 desc_at(dk, (k >> 2) * RAW_LAT + 32 * (k & 3)), t + k > 0);
#pragma unroll
    for (int k = 0; k < DR / 32; ++k)
      wgmma_e4m3(s, desc_at(dq, (DC / 64) * (HB * 128) + 64 * t + 32 * k), desc_at(dr, 32 * k));
  }
  wgmma_commit();
}
#endif

// The online softmax of one block's scores (log2 domain: scale_log2, the thread's two rows' factors), in place: s
// becomes P; columns from `valid` on (past the piece's end) are masked, Inf and NaN scores become NaN. Updates the
// thread's two rows' m and (its share of) l; a gets the rows' rescale of O.
// In two steps for the halves, whose warpgroups exchange their maxima between them: scores_max scales and masks
// the scores and gives the thread's two rows' maxima over its own columns, softmax_rest the rest from those (their
// quad_max: the rows' maxima over the block; REDUCED: the caller's maxima are the rows' already).
template <int N>
__device__ __forceinline__ void scores_max(float (&s)[N], int valid, const float (&scale_log2)[2], float (&mx)[2],
                                           int lane) {
  mx[0] = mx[1] = neg_inf();
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const int col = 8 * (i >> 2) + 2 * (lane & 3) + (i & 1);
    const float v = s[i] * scale_log2[(i >> 1) & 1];
    s[i] = col >= valid ? neg_inf() : v + 0.f * v;
    mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], s[i]);
  }
}
template <bool REDUCED = false, int N>
__device__ __forceinline__ void softmax_rest(float (&s)[N], const float (&mx)[2], float (&m)[2], float (&l)[2],
                                             float (&a)[2]) {
  float sum[2] = {0.f, 0.f}, mu[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float mn = fmaxf(m[h], REDUCED ? mx[h] : quad_max(mx[h]));
    mu[h] = mn == neg_inf() ? 0.f : mn;   // nothing seen yet: keep exp2 finite
    a[h] = exp2_approx(m[h] - mu[h]);
    m[h] = mn;
  }
#pragma unroll
  for (int i = 0; i < N; ++i) {
    s[i] = exp2_approx(s[i] - mu[(i >> 1) & 1]);
    sum[(i >> 1) & 1] += s[i];
  }
  l[0] = l[0] * a[0] + sum[0];
  l[1] = l[1] * a[1] + sum[1];
}
__device__ __forceinline__ void mla_softmax(float (&s)[SACC], int valid, const float (&scale_log2)[2], float (&m)[2],
                                            float (&l)[2], float (&a)[2], int lane) {
  float mx[2];
  scores_max(s, valid, scale_log2, mx, lane);
  softmax_rest(s, mx, m, l, a);
}

// A unit's online-softmax state before its first block (both schedules): O zero, l zero, m -inf.
__device__ __forceinline__ void unit_start(float (&o)[OACC], float (&l)[2], float (&m)[2]) {
#pragma unroll
  for (int i = 0; i < OACC; ++i) o[i] = 0.f;
  l[0] = l[1] = 0.f;
  m[0] = m[1] = neg_inf();
}

// One block of the score warpgroup's loop (mla_score): s holds block j's raw scores; on return, block j + 1's
// (NEXT_AHEAD, NEXT_AFTER). Block j's softmax, then its P.V from P in registers right away, and P's publication
// for warpgroup 2 under it (a branch while a wgmma is in flight would serialise them: the publication is
// straight-line, its stores predicated). Block j + 1's scores go to the tensor cores before the softmax (into s2,
// running under it: where the registers allow, 32-token blocks) or after the publication.
constexpr int NEXT_NONE = 0, NEXT_AFTER = 1, NEXT_AHEAD = 2;
// 64-token blocks spilled 160 B with s2. FP8 builds: block j + 1's scores wait for its conversion, whose share by
// warpgroup 2 comes after warpgroup 2's sync on P_EMPTY for block j - 1, which the score warpgroup reaches only
// after that wait: a cycle (H200, 2026-12-05: every FP8 MLA test died, `unspecified launch failure`).
constexpr int NEXT_MODE = BLK == 32 && !KV_FP8 ? NEXT_AHEAD : NEXT_AFTER;
// The ring's places the score warpgroup walks: the stage of the block it computes and (FP8) the staging stage of
// the next block it scores.
struct ScoreRing {
  int stage = 0, raw = 0;
  u32 phase = 0, raw_phase = 0;
};

// FP8 builds: the next block's Q.K^T from its staging stage once its bytes have landed; issued and committed.
__device__ __forceinline__ void issue_scores_staged(float (&s)[SACC], const MlaParams& p, int cta, int u, u32 qbuf,
                                                   u32 raw, const Bars& b, const ScoreRing& r) {
#ifdef MLA_KV_FP8
  mbar_wait(b.raw_full(r.raw), r.raw_phase, mla_site(p, 7, cta, u, r.raw));
  wgmma_fence();
  mla_issue_scores_fp8(s, qbuf, raw + r.raw * RAW_BYTES);
#endif
}
// ... and once it has completed, the staging stage back (this warp's arrival) and the ring on to the next.
__device__ __forceinline__ void release_staged(ScoreRing& r, const Bars& b, int lane) {
  if (lane == 0) mbar_arrive(b.raw_empty(r.raw));
  if (++r.raw == RAW_STAGES_) { r.raw = 0; r.raw_phase ^= 1u; }
}

template <int NEXT>
__device__ __forceinline__ void score_block(const MlaParams& p, const UnitWalk& w, int u, const Piece& x, int j,
                                            u32 qbuf, u32 ring, u32 pbuf, Stats& sx, const Bars& b, ScoreRing& rg,
                                            const float (&sl)[2], float (&o)[OACC], float (&s)[SACC], float (&l)[2],
                                            float (&m)[2], PhaseClock& pc) {
  int& stage = rg.stage;
  u32& phase = rg.phase;
  const int ct = threadIdx.x - 128, warp = ct >> 5, lane = ct & 31;
  const int valid = min(BLK, x.end - x.begin - j * BLK);
  const u32 st = ring + stage * STAGE_BYTES;
  const int ns = stage + 1 == STAGES ? 0 : stage + 1;
  const u32 nphase = stage + 1 == STAGES ? phase ^ 1u : phase;
  float s2[SACC], a[2];   // (s2: NEXT_AHEAD's next scores; a: the rows' rescale)
  if constexpr (NEXT == NEXT_AHEAD) {
    mbar_wait(b.full + 8 * ns, nphase, mla_site(p, 1, w.cta, u, ns));
    pc.lap(PHASE_WAIT_KV);
    wgmma_fence();
    mla_issue_scores(s2, qbuf, ring + ns * STAGE_BYTES);
  }
  mla_softmax(s, valid, sl, m, l, a, lane);
  if constexpr (KV_FP8) {   // the block's values, converted (its scores read the staged bytes)
    mbar_wait(b.full + 8 * stage, phase, mla_site(p, 1, w.cta, u, stage));
    pc.lap(PHASE_WAIT_KV);
  }
  zero_tail(st, valid, ct);
  rescale(o, a[0], a[1]);
  u32 pa[BLK / 16][4];
  p_fragments(s, pa);
#pragma unroll
  for (int k = 0; k < BLK / 16; ++k) fence_regs(pa[k]);
  fence_proxy_async();   // the zeroed rows before the wgmmas read them: every warp's (a partial block)
  named_barrier_if(valid < BLK, ZERO_BAR, 128);
  pc.lap(PHASE_SOFTMAX);
  fence_regs(o);
  wgmma_fence();
  mla_issue_pv_regs(o, pa, st, 0);
  pc.lap(PHASE_ISSUE_PV);   // (apart from the wait below: the stamps had counted the issue as waiting for P)
  named_barrier_if(j > 0, P_EMPTY, 256);   // warpgroup 2 is done with block j - 1's P and sx
  pc.lap(PHASE_WAIT_P);
  store_p(pbuf, s, lane, warp);   // (from s: P's registers may not be read while the P.V is in flight)
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float lt = quad_sum(l[h]);
    const int r = acc_row(lane, warp, h);
    st_shared_if((lane & 3) == 0, &sx.alpha[r], a[h]);
    st_shared_if((lane & 3) == 0 && NEXT == NEXT_NONE, &sx.l[r], lt);
    st_shared_if((lane & 3) == 0 && NEXT == NEXT_NONE, &sx.m[r], m[h]);
  }
  fence_proxy_async();   // P before warpgroup 2's wgmmas read it
  // FP8 builds: an arrival, not a sync. Warpgroup 2 reaches P_FULL only after its share of block j + 1's
  // conversion, and a sync held this warpgroup through it (the phase stamps' FP8 publish: 1875 cycles a block
  // against bf16's 469, H100, 2026-12-05). One arrival a publication: the next comes after P_EMPTY, which warpgroup
  // 2 reaches past this one. bf16 builds keep the sync, which racecheck models (barrier.arrive it does not:
  // tools/SANITIZE.md, probe 5) and which costs them nothing: warpgroup 2 waits at P_FULL already.
  if constexpr (KV_FP8) named_barrier_arrive(P_FULL, 256);
  else named_barrier(P_FULL, 256);
  if (NEXT == NEXT_NONE && lane == 0) mbar_arrive(b.q_empty);   // this warp's Q.K^T of the unit have completed;
                                                                 // the loaders wait for all four warps
  pc.lap(PHASE_PUBLISH);
  if constexpr (NEXT == NEXT_AFTER) {
    if constexpr (KV_FP8) {
      issue_scores_staged(s, p, w.cta, u, qbuf, ring - OFF_RING + OFF_RAW, b, rg);
      pc.lap(PHASE_WAIT_KV);
    } else {
      mbar_wait(b.full + 8 * ns, nphase, mla_site(p, 1, w.cta, u, ns));
      pc.lap(PHASE_WAIT_KV);
      wgmma_fence();
      mla_issue_scores(s, qbuf, ring + ns * STAGE_BYTES);
    }
    wgmma_wait<1>();   // this block's P.V (committed first) is done: its stage may go back
  } else {
    wgmma_wait<0>();   // this block's P.V (and block j + 1's scores, committed before it)
  }
  pc.lap(PHASE_WAIT_MMA);
  fence_regs(o);
#pragma unroll
  for (int k = 0; k < BLK / 16; ++k) fence_regs(pa[k]);   // (P's registers held until the P.V is done)
  if (lane == 0) mbar_arrive(b.empty + 8 * stage);
  if constexpr (NEXT == NEXT_AFTER) {
    wgmma_wait<0>();
    fence_regs(s);
    if constexpr (KV_FP8) release_staged(rg, b, lane);
  }
  if constexpr (NEXT == NEXT_AHEAD) {
    fence_regs(s2);
#pragma unroll
    for (int i = 0; i < SACC; ++i) s[i] = s2[i];
  }
  pc.lap(PHASE_WAIT_MMA);
  pc.add(PHASE_BLOCKS, 1);
  stage = ns;
  phase = nphase;
}

// Warpgroup 1: scores, online softmax and P, O's channels 0-255, a block at a time (score_block); then the unit's
// end with warpgroup 2.
__device__ void mla_score(const MlaParams& p, const UnitWalk& w, u32 qbuf, u32 ring, u32 pbuf, Stats& sx, const Bars& b,
                          Profiler& prof) {
  const int ct = threadIdx.x - 128, warp = ct >> 5, lane = ct & 31;
  ScoreRing rg;
  u32 qphase = 0;
  PhaseClock pc(qbuf, 0, ct == 0);   // (qbuf: the shared memory's base)
  for (int u = w.first(); u <= w.last(); ++u) {
    const i64 t0 = prof.now();
    const Piece x = w.piece(u);
    const int nb = UnitWalk::blocks(x);
    float o[OACC], s[SACC], l[2], m[2];
    float sl[2] = {p.sm_scale_log2, p.sm_scale_log2};   // the rows' factors of their scores (FP8: times q's scale)
    unit_start(o, l, m);
    if (nb > 0) {   // the first block's scores
      mbar_wait(b.q_full, qphase, mla_site(p, 17, w.cta, u, 0));
      qphase ^= 1u;
      pc.lap(PHASE_WAIT_Q);
      if constexpr (KV_FP8) {
#ifdef MLA_KV_FP8
        mla_quantize_q(qbuf, sx.qs, ct);
#endif
        fence_proxy_async();          // the e4m3 Q before the wgmmas read it
        named_barrier(ZERO_BAR, 128);   // every row's, and its scale
        sl[0] *= sx.qs[acc_row(lane, warp, 0)];
        sl[1] *= sx.qs[acc_row(lane, warp, 1)];
        pc.lap(PHASE_WAIT_Q);
        issue_scores_staged(s, p, w.cta, u, qbuf, ring - OFF_RING + OFF_RAW, b, rg);
        pc.lap(PHASE_WAIT_KV);
      } else {
        mbar_wait(b.full + 8 * rg.stage, rg.phase, mla_site(p, 1, w.cta, u, rg.stage));
        pc.lap(PHASE_WAIT_KV);
        wgmma_fence();
        mla_issue_scores(s, qbuf, ring + rg.stage * STAGE_BYTES);
      }
      wgmma_wait<0>();
      fence_regs(s);
      if constexpr (KV_FP8) release_staged(rg, b, lane);
      pc.lap(PHASE_WAIT_MMA);
    }
    for (int j = 0; j < nb; ++j) {   // s holds block j's raw scores (each branch a whole fence .. wait)
      if (j < nb - 1) score_block<NEXT_MODE>(p, w, u, x, j, qbuf, ring, pbuf, sx, b, rg, sl, o, s, l, m, pc);
      else score_block<NEXT_NONE>(p, w, u, x, j, qbuf, ring, pbuf, sx, b, rg, sl, o, s, l, m, pc);
    }
    if (nb > 0) {
      l[0] = quad_sum(l[0]);
      l[1] = quad_sum(l[1]);
    }
    mla_store(p, u, w.unit(u), x, o, l, m, sx.bad, 0, warp, lane, w.cta, pc);
    prof.record(t0, PROF_PIECE, u);
    if (x.slot >= 0) {
      const i64 t1 = prof.now();
      mla_arrive(p, u, w.unit(u), x, w.cta, ct, pc);
      prof.record(t1, PROF_MERGE_HBM, u);
    }
    pc.lap(PHASE_UNIT_END);
  }
  if constexpr (PHASES_ON) {
    named_barrier(PHASE_BAR, 256);   // warpgroup 2's sums are complete (the converting warps': before the last block)
    record_phases(prof, qbuf);
  }
}

// Warpgroup 2: O's channels 256-511 from warpgroup 1's P; then the unit's end with it. FP8 builds: before it
// waits for block g's P, its share of block g + 1's conversion (and of block 0's first). Deadlock-free: that
// conversion waits for the TMA and for block g - 1's stage (STAGES = 2), which both warpgroups give back after
// their P.V of g - 1; warpgroup 1's does not wait for this warpgroup past block g - 1's P, and block g, which
// warpgroup 1 scores meanwhile, was converted before block g - 1's P.
__device__ void mla_value(const MlaParams& p, const UnitWalk& w, u32 ring, u32 pbuf, Stats& sx, const Bars& b,
                          u32 raw) {
  const int ct = threadIdx.x - 256, warp = ct >> 5, lane = ct & 31;
  int stage = 0;
  u32 phase = 0;
  int g = 0;   // the segment's block this warpgroup takes next
  PhaseClock pc(ring - OFF_RING, 1, ct == 0);
  if (KV_FP8 && unit_with_blocks(w, w.first()) <= w.last())
    mla_convert_block(p, w.cta, raw, ring, b, 0, unit_with_blocks(w, w.first()), 64 + ct, pc);
  for (int u = w.first(); u <= w.last(); ++u) {
    const Piece x = w.piece(u);
    const int nb = UnitWalk::blocks(x);
    float o[OACC];
#pragma unroll
    for (int i = 0; i < OACC; ++i) o[i] = 0.f;
    float l[2] = {0.f, 0.f}, m[2] = {neg_inf(), neg_inf()};
    for (int j = 0; j < nb; ++j, ++g) {
      if (KV_FP8) {   // block g + 1: the unit's next, or the first of a later unit's
        const int next = j + 1 < nb ? u : unit_with_blocks(w, u + 1);
        if (next <= w.last()) mla_convert_block(p, w.cta, raw, ring, b, g + 1, next, 64 + ct, pc);
      }
      mbar_wait(b.full + 8 * stage, phase, mla_site(p, 1, w.cta, u, stage));   // (the TMA bytes, visible here)
      pc.lap(PHASE_WAIT_KV);
      named_barrier(P_FULL, 256);
      pc.lap(PHASE_WAIT_P);
      const int r0 = acc_row(lane, warp, 0), r1 = acc_row(lane, warp, 1);
      rescale(o, sx.alpha[r0], sx.alpha[r1]);
      if (j == nb - 1) {
        l[0] = sx.l[r0]; l[1] = sx.l[r1];
        m[0] = sx.m[r0]; m[1] = sx.m[r1];
      }
      mla_pv(o, pbuf, ring + stage * STAGE_BYTES, 1);
      pc.lap(PHASE_PV);
      if (lane == 0) mbar_arrive(b.empty + 8 * stage);
      if (j < nb - 1) named_barrier(P_EMPTY, 256);   // (the unit's last: mla_store's barriers order it)
      pc.lap(PHASE_WAIT_P);
      pc.add(PHASE_BLOCKS, 1);
      if (++stage == STAGES) { stage = 0; phase ^= 1u; }
    }
    mla_store(p, u, w.unit(u), x, o, l, m, sx.bad, 1, warp, lane, w.cta, pc);
    if (x.slot >= 0) mla_arrive(p, u, w.unit(u), x, w.cta, ct + 128, pc);
    pc.lap(PHASE_UNIT_END);
  }
  if constexpr (PHASES_ON) named_barrier(PHASE_BAR, 256);   // (the score warpgroup records the sums)
}

// The seesaw's and the halves' unit end, warpgroup G's part (ct 0..127): the two warpgroups' row sums meet (`sl`:
// their slots; mla_store's barriers order their reads before the next unit writes them), then the output or this
// piece's partial, and its merge; warpgroup 0's first thread records the piece (t0: its start).
template <int G>
__device__ __forceinline__ void pair_unit_end(const MlaParams& p, const UnitWalk& w, int u, const Piece& x,
                                              float (&o)[OACC], float (&l)[2], const float (&m)[2], float (&sl)[2][HB],
                                              float (&xbad)[2][HB], int ct, Profiler& prof, i64 t0, PhaseClock& pc) {
  const int warp = ct >> 5, lane = ct & 31;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] = quad_sum(l[h]);
    if ((lane & 3) == 0) sl[G][acc_row(lane, warp, h)] = l[h];
  }
  named_barrier(2, 256);
#pragma unroll
  for (int h = 0; h < 2; ++h) l[h] = sl[0][acc_row(lane, warp, h)] + sl[1][acc_row(lane, warp, h)];
  mla_store(p, u, w.unit(u), x, o, l, m, xbad, G, warp, lane, w.cta, pc);
  if (G == 0) prof.record(t0, PROF_PIECE, u);
  if (x.slot >= 0) {
    const i64 t1 = G == 0 ? prof.now() : 0;
    mla_arrive(p, u, w.unit(u), x, w.cta, ct + 128 * G, pc);
    if (G == 0) prof.record(t1, PROF_MERGE_HBM, u);
  }
  pc.lap(PHASE_UNIT_END);
}

// Both warpgroups at the segment's end of a phases build: warpgroup 0 records every role's sums once the other's are
// complete.
template <int G>
__device__ __forceinline__ void pair_record_phases(Profiler& prof, u32 base) {
  if constexpr (PHASES_ON) {
    named_barrier(PHASE_BAR, 256);
    if (G == 0) record_phases(prof, base);
  }
}

#ifdef MLA_SEESAW
// The seesaw (FlashMLA's idea, DeepSeek's "seesaw" schedule, on meld's walk and merge): warpgroup g (0, 1)
// scores the unit's blocks j with j % 2 == g and, for every block, accumulates O's channels 256 g .. 256 g
// + 255. Block j's scorer computes S, the online softmax from the rows' maxima after block j - 1 (scored by
// the other warpgroup), and publishes P into the block's rope box (dead once S has read it), the rows'
// rescale and maxima into sx.alpha[g], sx.m[g], then arrives on named barrier SEESAW_PUB + g; the other
// warpgroup syncs there. While one warpgroup does its softmax, the other's Q.K^T of the next block (issued
// before it waits for the publication, box by box as the copies land) and both P.V halves keep the tensor
// cores busy. Each warpgroup sums l over its own blocks (rescaled on every block); the two sums meet at the
// unit's end. A warpgroup publishes again only after it has synced on the other's publication, which comes
// after the other read the slot: one slot per warpgroup suffices, and a named barrier never sees a second
// arrival of one side before the other's sync. The publication is barrier.arrive, not a sync on both sides
// as the split build's P_FULL: a scorer that waited for the other warpgroup would idle through its Q.K^T,
// which is the overlap. compute-sanitizer's racecheck does not model barrier.arrive (tools/SANITIZE.md,
// probe 5): it reports P and sx.alpha / sx.m between the warpgroups here.
constexpr int SEESAW_PUB = 5;   // named barriers 5, 6

// Q.K^T of the block in `stage`, each box once its copies have landed; issued and committed.
__device__ __forceinline__ void seesaw_issue_scores(float (&s)[SACC], const MlaParams& p, u32 qbuf, u32 ring,
                                                    const Bars& b, int stage, u32 phase, int cta, int u, PhaseClock& pc) {
  mla_issue_scores(s, qbuf, ring + stage * STAGE_BYTES, [&](int box) {
    pc.lap(PHASE_WAIT_MMA);   // (issuing the boxes before it)
    mbar_wait(b.box_full(stage, box), phase, mla_site(p, 1, cta, u, stage));
    pc.lap(PHASE_WAIT_KV);
    wgmma_fence();
  });
}

template <int G>
__device__ void mla_seesaw(const MlaParams& p, const UnitWalk& w, u32 qbuf, u32 ring, SeesawStats& sx, const Bars& b,
                           Profiler& prof) {
  const int ct = threadIdx.x - 128 * (G + 1), warp = ct >> 5, lane = ct & 31;
  const int r0 = acc_row(lane, warp, 0), r1 = acc_row(lane, warp, 1);
  u32 it = 0, qphase = 0;   // the blocks taken from the ring so far: stage it % STAGES, phase (it / STAGES) % 2
  PhaseClock pc(qbuf, G, ct == 0);   // (qbuf: the shared memory's base)
  const float sl[2] = {p.sm_scale_log2, p.sm_scale_log2};
  for (int u = w.first(); u <= w.last(); ++u) {
    const i64 t0 = prof.now();
    const Piece x = w.piece(u);
    const int nb = UnitWalk::blocks(x);
    float o[OACC], s[SACC], a[2], l[2], m[2];
    unit_start(o, l, m);
    if (nb > 0) {
      if (nb > G) {   // this warpgroup scores a block of the unit
        mbar_wait(b.q_full, qphase, mla_site(p, 17, w.cta, u, 0));
        pc.lap(PHASE_WAIT_Q);
        if (G == 0) {   // the first
          seesaw_issue_scores(s, p, qbuf, ring, b, it % STAGES, (it / STAGES) & 1u, w.cta, u, pc);
          wgmma_wait<0>();
          fence_regs(s);
          pc.lap(PHASE_WAIT_MMA);
        }
      } else if (lane == 0) {
        mbar_arrive(b.q_empty);   // none: Q may go as far as this warpgroup is concerned
      }
      qphase ^= 1u;
    }
    // The other warpgroup's block j: the TMA bytes of this half's V (visible here), then its rescale and
    // maxima, into a, m and l. (Every wgmma below is issued and waited for inside one branch: one in flight
    // across a branch serialises them all.)
    auto v_ready = [&](int stage, u32 phase) {
#pragma unroll
      for (int k = 4 * G; k < 4 * G + 4; ++k) mbar_wait(b.box_full(stage, k), phase, mla_site(p, 1, w.cta, u, stage));
      pc.lap(PHASE_WAIT_KV);
    };
    auto take = [&]() {
      named_barrier(SEESAW_PUB + 1 - G, 256);
      pc.lap(PHASE_WAIT_P);
      a[0] = sx.alpha[1 - G][r0]; a[1] = sx.alpha[1 - G][r1];
      m[0] = sx.m[1 - G][r0]; m[1] = sx.m[1 - G][r1];
      l[0] *= a[0]; l[1] *= a[1];
      rescale(o, a[0], a[1]);
    };
    for (int j = 0; j < nb; ++j, ++it) {
      const int stage = it % STAGES;
      const u32 st = ring + stage * STAGE_BYTES, pbuf = st + (NBOX - 1) * BOX;
      if ((j & 1) == G) {   // this warpgroup's block, its scores in s
        const int valid = min(BLK, x.end - x.begin - j * BLK);
        if (j + 2 >= nb && lane == 0) mbar_arrive(b.q_empty);   // this warp's last Q.K^T of the unit is done
        mla_softmax(s, valid, sl, m, l, a, lane);
        zero_tail(st, valid, ct);
        pc.lap(PHASE_SOFTMAX);
        store_p(pbuf, s, lane, warp);
        if ((lane & 3) == 0) {
          sx.alpha[G][r0] = a[0]; sx.alpha[G][r1] = a[1];
          sx.m[G][r0] = m[0]; sx.m[G][r1] = m[1];
        }
        fence_proxy_async();   // P and the zeroed rows before the wgmmas read them
        named_barrier_arrive(SEESAW_PUB + G, 256);
        pc.lap(PHASE_PUBLISH);
        rescale(o, a[0], a[1]);
        mla_pv(o, pbuf, st, G);
        pc.lap(PHASE_PV);
      } else if (j + 1 < nb) {   // the next block is this warpgroup's: its scores run while the other's softmax
        v_ready(stage, (it / STAGES) & 1u);
        seesaw_issue_scores(s, p, qbuf, ring, b, (it + 1) % STAGES, ((it + 1) / STAGES) & 1u, w.cta, u, pc);
        pc.lap(PHASE_WAIT_MMA);   // (issuing the last box)
        take();
        fence_regs(o);
        wgmma_fence();
        mla_issue_pv(o, pbuf, st, G);
        wgmma_wait<0>();
        fence_regs(s);
        fence_regs(o);
        pc.lap(PHASE_WAIT_MMA);
      } else {
        v_ready(stage, (it / STAGES) & 1u);
        take();
        mla_pv(o, pbuf, st, G);
        pc.lap(PHASE_PV);
      }
      if (lane == 0) mbar_arrive(b.empty + 8 * stage);
      pc.add(PHASE_BLOCKS, 1);
    }
    pair_unit_end<G>(p, w, u, x, o, l, m, sx.l, sx.base.bad, ct, prof, t0, pc);
  }
  pair_record_phases<G>(prof, qbuf);
}
#endif

#ifdef MLA_HALVES
// The halves schedule: both consumer warpgroups score every 64-token block, warpgroup g (0, 1) half of Q.K^T's
// channels (k steps 18 g .. 18 g + 17: m64n64 wgmmas, as many shared-memory bytes as multiply-adds allow, both at
// once), takes the softmax of tokens 32 g .. 32 g + 31, and accumulates O's channels 256 g .. 256 g + 255 over all 64
// tokens (its P.V, as in the split build). A block: each computes its partial scores, hands the other's tokens'
// partial to it (X) and syncs on HALF_S; each adds the other's partial of its own tokens, publishes its rows' maxima
// (sx.mx[g]) and syncs on HALF_MAX; both take the block's maxima (the same on both sides, so m, the rescale and the
// exponent agree bit for bit), exponentiate their tokens into P, zero their own boxes' rows past the piece's end and
// sync on HALF_P; then each runs its P.V over both halves of P. Each warpgroup sums l over its own tokens; the two
// sums meet at the unit's end (sx.l). No block's Q.K^T is issued before the last block's P.V is done: two stages of
// 64 tokens are all the ring holds, and this way the next block's bytes land under this block's work.
// The places: warpgroup 0's X in the P buffer, warpgroup 1's in the stage's rope box (warpgroup 1 alone reads the
// rope channels, and its Q.K^T is done when it writes there), P in the rope box too (past HALF_MAX: both read X
// before it). One slot of each suffices: warpgroup 0 writes X again at the next block, past HALF_MAX, which
// warpgroup 1 reaches after reading it; a warpgroup writes its maxima again past the other's arrival at HALF_P,
// after that other read them. Deadlock-free: the two warpgroups meet at the same barriers in the same order and
// between them wait only for the TMA.
template <int G>
__device__ void mla_halves(const MlaParams& p, const UnitWalk& w, u32 qbuf, u32 ring, u32 pbuf, HalvesStats& sx,
                           const Bars& b, Profiler& prof) {
  const int ct = threadIdx.x - 128 * (G + 1), warp = ct >> 5, lane = ct & 31;
  const int r0 = acc_row(lane, warp, 0), r1 = acc_row(lane, warp, 1);
  constexpr int KH = DQK / 32;   // k steps a warpgroup's Q.K^T sums
  int stage = 0;
  u32 phase = 0, qphase = 0;
  PhaseClock pc(qbuf, G, ct == 0);   // (qbuf: the shared memory's base)
  const float sl[2] = {p.sm_scale_log2, p.sm_scale_log2};
  for (int u = w.first(); u <= w.last(); ++u) {
    const i64 t0 = G == 0 ? prof.now() : 0;   // (warpgroup 0's thread 0 records)
    const Piece x = w.piece(u);
    const int nb = UnitWalk::blocks(x);
    float o[OACC], s[HACC], a[2], l[2], m[2], mx[2];
    unit_start(o, l, m);
    if (nb > 0) {
      mbar_wait(b.q_full, qphase, mla_site(p, 17, w.cta, u, 0));
      qphase ^= 1u;
      pc.lap(PHASE_WAIT_Q);
    }
    for (int j = 0; j < nb; ++j) {
      const u32 st = ring + stage * STAGE_BYTES, rope = st + (NBOX - 1) * BOX;
      const int valid = min(BLK, x.end - x.begin - j * BLK);
      mbar_wait(b.full + 8 * stage, phase, mla_site(p, 1, w.cta, u, stage));
      pc.lap(PHASE_WAIT_KV);
      float sf[SACC];   // this warpgroup's partial scores of all 64 tokens
      wgmma_fence();
      mla_issue_scores<KH * G, KH * (G + 1)>(sf, qbuf, st);
      wgmma_wait<0>();
      fence_regs(sf);
      if (j == nb - 1 && lane == 0) mbar_arrive(b.q_empty);   // this warp's Q.K^T of the unit are done
      pc.lap(PHASE_WAIT_MMA);
      // X: the other's tokens' partials (accumulators 16 (1 - g) ..), four 16-byte columns of 128 threads; the thread
      // of the same place in the other warpgroup holds the same rows and tokens
      const u32 xo = (G == 0 ? pbuf : rope) + 16 * ct, xi = (G == 0 ? rope : pbuf) + 16 * ct;
#pragma unroll
      for (int k = 0; k < HACC / 4; ++k)
        asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(xo + 2048 * k), "f"(sf[HACC * (1 - G) + 4 * k]),
                     "f"(sf[HACC * (1 - G) + 4 * k + 1]), "f"(sf[HACC * (1 - G) + 4 * k + 2]),
                     "f"(sf[HACC * (1 - G) + 4 * k + 3]) : "memory");
      named_barrier(HALF_S, 256);
      pc.lap(PHASE_WAIT_P);
#pragma unroll
      for (int k = 0; k < HACC / 4; ++k) {
        float4 v;
        asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                     : "r"(xi + 2048 * k) : "memory");
        s[4 * k] = sf[HACC * G + 4 * k] + v.x;
        s[4 * k + 1] = sf[HACC * G + 4 * k + 1] + v.y;
        s[4 * k + 2] = sf[HACC * G + 4 * k + 2] + v.z;
        s[4 * k + 3] = sf[HACC * G + 4 * k + 3] + v.w;
      }
      scores_max(s, valid - G * (BLK / 2), sl, mx, lane);
      mx[0] = quad_max(mx[0]);
      mx[1] = quad_max(mx[1]);
      if ((lane & 3) == 0) {
        sx.mx[G][r0] = mx[0];
        sx.mx[G][r1] = mx[1];
      }
      pc.lap(PHASE_SOFTMAX);
      named_barrier(HALF_MAX, 256);
      pc.lap(PHASE_WAIT_P);
      mx[0] = fmaxf(mx[0], sx.mx[1 - G][r0]);
      mx[1] = fmaxf(mx[1], sx.mx[1 - G][r1]);
      softmax_rest<true>(s, mx, m, l, a);
      rescale(o, a[0], a[1]);
      store_p(rope, s, lane, warp, G * (BLK / 2));
      zero_tail<DC / 128>(st + 4 * G * BOX, valid, ct);
      fence_proxy_async();   // P and the zeroed rows before the wgmmas read them
      pc.lap(PHASE_SOFTMAX);
      named_barrier(HALF_P, 256);
      pc.lap(PHASE_PUBLISH);
      mla_pv(o, rope, st, G);
      pc.lap(PHASE_PV);
      if (lane == 0) mbar_arrive(b.empty + 8 * stage);
      pc.add(PHASE_BLOCKS, 1);
      if (++stage == STAGES) { stage = 0; phase ^= 1u; }
    }
    pair_unit_end<G>(p, w, u, x, o, l, m, sx.l, sx.bad, ct, prof, t0, pc);
  }
  pair_record_phases<G>(prof, qbuf);
}
#endif

// The family's persistent main (persistent.cuh): the shared-memory places, the barriers, the three roles.
struct MlaFamily {
  using Params = MlaParams;
  static constexpr LaunchKind LAUNCH = LAUNCH_OVERLAPPABLE;
  static constexpr int SMEM_ALIGN = 1024;
  struct State {
    u32 raw, base;   // (MlaKernelConfig asks 1 KiB more: base is the first 1 KiB boundary)
    Bars b;
    Stats& sx;
    int cta;
    __device__ __forceinline__ State(const MlaParams& p, unsigned char* smem)
        : raw(smem_addr(smem)), base((raw + 1023) & ~1023u), b(base + OFF_BARS),
          sx(*reinterpret_cast<Stats*>(smem + (base - raw) + OFF_STATS)), cta(p.cta_offset + blockIdx.x) {}
  };

  static __device__ __forceinline__ void setup(const MlaParams& p, const State& s) {
    if (PHASES_ON && threadIdx.x < PHASE_BYTES / 4)   // (the phase sums start from zero)
      asm volatile("st.shared.u32 [%0], %1;" ::"r"(s.base + OFF_PHASES + 4 * threadIdx.x), "r"(0u) : "memory");
    if (threadIdx.x == 0) {
      for (int st = 0; st < STAGES; ++st) {
        for (int k = 0; k < FULL_BARS; ++k) mbar_init(s.b.box_full(st, k), KV_FP8 ? CONVERTERS : 1);
        mbar_init(s.b.empty + 8 * st, 8);   // the consumer warps
      }
      for (int st = 0; st < RAW_STAGES_; ++st) {
        mbar_init(s.b.raw_full(st), 1);
        mbar_init(s.b.raw_empty(st), CONVERTERS + 4);   // (and the score warps, once their Q.K^T read it)
      }
      mbar_init(s.b.q_full, 1);   // the Q loader's arrival with its bytes
      mbar_init(s.b.q_empty, PAIRED ? 8 : 4);   // the warps that score
      fence_mbar_init();
    }
    __syncthreads();
  }

  static __device__ __forceinline__ void score_role(const MlaParams& p, const UnitWalk& w, const State& s) {
    Profiler prof;
    prof.begin(p.prof, p.prof_cap, s.cta, threadIdx.x == 128, p.prof_clock, p.prof_every);
    mla_score(p, w, s.base, s.base + OFF_RING, s.base + OFF_P, s.sx, s.b, prof);
    prof.end(p.num_ctas);
  }

  static __device__ __forceinline__ void run(const MlaParams& p, const State& s) {
#if defined(MLA_SEESAW) || defined(MLA_HALVES)
    // setmaxnreg moves registers within the CTA's launch allocation: 384 threads at one CTA an SM get 168
    // each (65536 / 384, in steps of 8), and an increase that the warpgroups' sum overdraws never returns
    constexpr int LOAD_REGS = 40, MATH_REGS = 232;
    static_assert(LOAD_REGS + 2 * MATH_REGS <= 3 * (65536 / 384 / 8 * 8), "setmaxnreg budget over the register file");
    if (threadIdx.x < 128) {   // (the walk after setmaxnreg: nothing live across it, where 40 spilled)
      regs_dealloc<LOAD_REGS>();
      const UnitWalk w(p, s.cta);
      if (threadIdx.x == 0) mla_produce(p, w, s.base + OFF_RING, s.b);
      else if (threadIdx.x >= 32 && threadIdx.x < 64) mla_load_q(p, w, s.base, s.b);
    } else {
      regs_alloc<MATH_REGS>();
      const UnitWalk w(p, s.cta);
      Profiler prof;
      prof.begin(p.prof, p.prof_cap, s.cta, threadIdx.x == 128, p.prof_clock, p.prof_every);
#ifdef MLA_SEESAW
      SeesawStats& sx = reinterpret_cast<SeesawStats&>(s.sx);
      if (threadIdx.x < 256) mla_seesaw<0>(p, w, s.base, s.base + OFF_RING, sx, s.b, prof);
      else mla_seesaw<1>(p, w, s.base, s.base + OFF_RING, sx, s.b, prof);
#else
      HalvesStats& sx = reinterpret_cast<HalvesStats&>(s.sx);
      if (threadIdx.x < 256) mla_halves<0>(p, w, s.base, s.base + OFF_RING, s.base + OFF_P, sx, s.b, prof);
      else mla_halves<1>(p, w, s.base, s.base + OFF_RING, s.base + OFF_P, sx, s.b, prof);
#endif
      prof.end(p.num_ctas);
    }
    return;
#endif
    const UnitWalk w(p, s.cta);
    if (threadIdx.x < 128) {
      regs_dealloc<56>();
      if (threadIdx.x == 0) mla_produce(p, w, s.base + (KV_FP8 ? OFF_RAW : OFF_RING), s.b);
      else if (KV_FP8 && threadIdx.x >= 64) mla_convert(p, w, s.base + OFF_RAW, s.base + OFF_RING, s.b, s.base);
      else if (threadIdx.x >= 32 && threadIdx.x < 64) mla_load_q(p, w, s.base, s.b);
    } else if (threadIdx.x < 256) {   // (224 registers each spilled the score warpgroup: it holds S and O)
      regs_alloc<240>();
      score_role(p, w, s);
    } else {
      regs_alloc<208>();
      mla_value(p, w, s.base + OFF_RING, s.base + OFF_P, s.sx, s.b, s.base + OFF_RAW);
    }
  }
};

}  // namespace meld

MELD_PERSISTENT_KERNEL(meld_mla_decode, meld::MlaFamily, 384, 1)
