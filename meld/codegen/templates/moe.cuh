// meld fused MoE: routing, planning from routing, dispatch and one persistent kernel of expert GEMM tiles
// with just-in-time combines. Three launches in stream order (two for a few rows: the lone routing CTA
// dispatches too, or, for one token, the gemm1 tiles read its row of x themselves), each after the first a
// programmatic dependent of the one before (it starts its prologue while the one before finishes); no host
// synchronisation anywhere, so the layer is CUDA-graph capturable within the capacity the buffers were
// sized for.
//
//   meld_moe_route    one warp per token: softmax over E logits, top-k, optional renormalisation (or the
//                     caller's topk_ids / topk_weights, validated, less expert_base; MELD_ABSENT_PAIRS: an
//                     id outside this layer's experts is a pair another rank serves, skipped — expert
//                     parallelism); per 32-token block, each expert's token mask gives the block's count
//                     and every pair's rank (deterministic: no order of atomics decides a position). The
//                     last CTA to finish plans: offsets of every expert's rows, row blocks of
//                     BLOCK_TOKENS rows (the items), and every tile's task row in ticket order
//                     (meld/ir/work_table.py: MOE_TILE).
//   meld_moe_scatter  rows of x copied to their expert-sorted positions (xs), so every tile's token
//                     operand is one TMA box (done by the routing CTA itself for a few rows).
//   meld_moe_main     the persistent kernel: CTAs take tiles by ticket (an atomic counter). A gemm1 tile
//                     computes act = SiLU(x W_gate^T) * (x W_up^T) for one row block and 128 columns of
//                     I; a gemm2 tile computes y = act W2^T for one row block and 256 columns of H; the
//                     CTA that completes the last of a token's k rows for a column block forms
//                     out = sum_j w_j y_j for it, in fixed j order (no float atomics: bit-identical runs).
//
// Swapped operands: the weights are wgmma's A (M = 64 weight rows per accumulator) and the tokens its B
// (N = BLOCK_TOKENS), so a decode step with a few tokens per expert wastes no tensor-core rows on padding.
//
// Deadlock freedom: a gemm2 tile waits (spins, with a watchdog) only for the gemm1 tiles of its row
// block, and the planner puts every one of those at a smaller ticket. Tickets are taken in increasing
// order by running CTAs, and gemm1 tiles wait for nothing, so the smallest waiting ticket's inputs are
// always held by running CTAs that finish them: progress without any co-residency assumption.
//
// Ticket order: gemm1 tiles expert by expert (inside an expert column-major, so the CTAs that run at the
// same time share weight tiles in L2), with each expert's gemm2 tiles slotted in LAG tickets after its
// last gemm1 tile (LAG = the grid size: by then those gemm1 tiles have been taken and mostly finished).

namespace meld {

constexpr int TOK_BLOCK = 32;                  // tokens per routing block: one bit each in an expert mask
constexpr int ELEM = MELD_FP8 ? 1 : 2;         // bytes of a GEMM operand element (e4m3 or bf16)
constexpr int BK = 128 / ELEM;                 // K per ring stage: the 128-byte swizzle (FP8: one scale block)
constexpr int W_ROWS = 64;                     // weight rows per accumulator (wgmma M)
constexpr int W_BOX = W_ROWS * BK * ELEM;      // 8 KiB
constexpr int T_BOX = BLOCK_TOKENS * BK * ELEM;
// Wide tiles (MELD_NARROW 0): each consumer warpgroup keeps two 64-row accumulators — gate and up rows
// of the same 64 columns of I (gemm1), or 128 rows of H (gemm2). Narrow tiles (small token blocks, where
// the layer is bound by reading weights and needs more, smaller tiles to keep every SM streaming): one
// accumulator each — warpgroup 0 the gate rows and warpgroup 1 the up rows of 64 columns (their product
// meets in shared memory), or 64 rows of H each. FP8 tiles are wide at every token block: a gemm1 tile then
// holds whole 128-column groups of act, which its epilogue quantises.
constexpr int NACC = MELD_NARROW && !MELD_FP8 ? 1 : 2;   // accumulators per consumer warpgroup
constexpr int NBOX = 2 * NACC;                 // weight boxes per ring stage
constexpr int BOX_SET = NBOX * W_BOX + T_BOX;   // one 64-wide K box: its weight boxes, then its token box
constexpr int STAGE_BYTES = K_BOXES * BOX_SET;  // K_BOXES of them along K: each weight row read in runs of
                                                // 128 K_BOXES contiguous bytes
constexpr int G1_COLS = 64 * NACC;             // columns of I per gemm1 tile
constexpr int G2_COLS = 128 * NACC;            // columns of H per gemm2 tile
constexpr int ACC = BLOCK_TOKENS / 2;          // accumulator registers per thread per 64-row accumulator
// A wide tile copies and multiplies only the token columns its row block fills, rounded up to T_ROWS
// (wgmma N; meld/codegen/moe_kernel.py: token_box_rows): an expert's last row block, a few rows past a
// multiple of BLOCK_TOKENS, then costs a fraction of a full tile.
constexpr int T_ROWS = MELD_NARROW ? BLOCK_TOKENS : 32;
__device__ __forceinline__ int tile_tokens(int rows) {
  return MELD_NARROW ? BLOCK_TOKENS : min(BLOCK_TOKENS, (rows + T_ROWS - 1) / T_ROWS * T_ROWS);
}
constexpr int CONSUMERS = 256;
// A task slot (the producer's mailbox to the consumers, two of them): gemm (-1: the end), ticket, tile tokens,
// row block, column block; ints, padded.
constexpr int TASK_SLOT = 8;
// FP8: a ring stage's token scales (one K block's, of the row block's BLOCK_TOKENS rows: a TMA box of xs_scale_map
// or act_scale_map, zeros past the rows) in a slot of their own beside the ring, 128-byte aligned. A TMA box's
// innermost coordinate must be a multiple of 16 bytes (else the copy is an illegal instruction), and a row block
// starts at any row (its expert's rows follow the others'): the box starts at the row block's first row rounded
// down to SCALE_ALIGN tokens and is SCALE_ALIGN tokens longer (meld/codegen/moe_kernel.py: scale_box), so it
// holds the block's scales from token row0 % SCALE_ALIGN on.
constexpr int SCALE_ALIGN = 4;
constexpr int SCALE_BYTES = MELD_FP8 ? (BLOCK_TOKENS + SCALE_ALIGN) * 4 : 0;
constexpr int SCALE_SLOT = (SCALE_BYTES + 127) / 128 * 128;
// Where the slots start, from the task slots (MoeFamily::State: the mailbox and the combine list after them, then
// the exchange area, FP8's quantise_act maxima, then consume's staging of wide tiles).
__device__ __forceinline__ u32 scale_slots(const int* slots) {
  const u32 xchg = smem_addr(slots + 2 * TASK_SLOT + 4 + 4 + BLOCK_TOKENS);
  return (((xchg + 9 * BLOCK_TOKENS * 4 + 15) & ~15u) + (MELD_NARROW ? 0 : 8 * BLOCK_TOKENS * 32) + 127) & ~127u;
}
constexpr int POISON = 1 << 30;                // tok_need: the token had an invalid (id, weight) pair

// --- routing ------------------------------------------------------------------------------------------
// Routing ranks by an order-preserving 32-bit key: every NaN above everything (so a NaN logit is chosen
// and its token's weights are NaN), then larger values (-0 equal to +0); key 0 (no float has it) marks
// an expert already taken. Among equal keys the smaller expert id wins.
__device__ __forceinline__ u32 order_key(float v) {
  if (v != v) return 0xFFFFFFFFu;
  u32 u = __float_as_uint(v);
  if (u == 0x80000000u) u = 0;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float key_value(u32 k) {
  return k == 0xFFFFFFFFu ? __int_as_float(0x7fc00000) : __uint_as_float((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k);
}
// A warp's keys are lane-major: lane l's `slots` keys (meld/codegen/moe_kernel.py: route_smem_bytes) hold
// experts l, l + 32, ... (key 0 past E), so a lane scans its experts four to a 16-byte load, with no loop
// over E, which shortens each round of the top-k (bench/RESULTS.md, "the small-batch routing launch").
__device__ __forceinline__ int route_slots(int E) { return ((E + 31) / 32 + 3) & ~3; }

// This lane's best remaining expert other than `skip` from its slots `mine`: (key, expert); key 0 and
// expert -1 when none is left.
__device__ __forceinline__ void lane_best(const u32* mine, int slots, int lane, int skip, u32& key, int& expert) {
  key = 0;
  expert = -1;
#pragma unroll 1
  for (int i = 0; i < slots; i += 4) {
    const uint4 v = *(const uint4*)(mine + i);
    const u32 k[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int e = lane + 32 * (i + u);
      if (k[u] > key && e != skip) { key = k[u]; expert = e; }
    }
  }
}

// A logit's bits as loaded (bf16: in the low half), and as a float. Routing loads four before it converts any: with
// the conversion beside each load (in the branch that skips experts past E), each load waited for its own.
__device__ __forceinline__ u32 load_logit_bits(const MoeParams& p, int t, int e) {
  return p.logits_bf16 ? (u32)((const u16*)p.logits)[(i64)t * p.logits_stride + e]
                       : ((const u32*)p.logits)[(i64)t * p.logits_stride + e];
}
__device__ __forceinline__ float logit_of(const MoeParams& p, u32 bits) {
  return p.logits_bf16 ? bf16_to_float((u16)bits) : __uint_as_float(bits);
}

// --- planning -----------------------------------------------------------------------------------------
// Exclusive scans of two ints per thread over the block (blockDim.x = 1024), in one pass; the totals come
// back in *total_a and *total_b.
__device__ int2 block_exclusive_scan2(int a, int b, int2* scratch, int* total_a, int* total_b) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int x = a, y = b;
  for (int o = 1; o < 32; o <<= 1) {
    const int xo = __shfl_up_sync(~0u, x, o), yo = __shfl_up_sync(~0u, y, o);
    if (lane >= o) { x += xo; y += yo; }
  }
  if (lane == 31) scratch[warp] = make_int2(x, y);
  __syncthreads();
  if (warp == 0) {
    int2 v = scratch[lane];
    for (int o = 1; o < 32; o <<= 1) {
      const int xo = __shfl_up_sync(~0u, v.x, o), yo = __shfl_up_sync(~0u, v.y, o);
      if (lane >= o) { v.x += xo; v.y += yo; }
    }
    scratch[lane] = v;
  }
  __syncthreads();
  const int2 before = warp ? scratch[warp - 1] : make_int2(0, 0);
  *total_a = scratch[31].x;
  *total_b = scratch[31].y;
  __syncthreads();
  return make_int2(x - a + before.x, y - b + before.y);
}

// `lone_mask`: the lone routing CTA's expert masks (its counts without a round trip through blk_cnt), and
// `row_off` gets each expert's first row there too; both null when several routing CTAs wrote blk_cnt.
__device__ void plan(const MoeParams& p, const u32* lone_mask, int* row_off) {
  __shared__ int rb_off[MAX_EXPERTS + 1];
  __shared__ int2 scratch[32];
  const int E = p.num_experts, tid = threadIdx.x;
  const int nblk = (p.num_tokens + TOK_BLOCK - 1) / TOK_BLOCK;
  int cnt = 0;
  if (lone_mask != nullptr && tid < E) {   // one block: its offsets are zeros
    cnt = __popc(lone_mask[tid]);
    p.blk_cnt[tid] = 0;
  } else if (tid < E) {   // each expert's per-block counts become per-block offsets
    constexpr int BATCH = 16;   // loads in flight at once: one L2 round trip per BATCH blocks, not per block
    for (int b0 = 0; b0 < nblk; b0 += BATCH) {
      int* c = p.blk_cnt + (i64)b0 * E + tid;
      int n[BATCH];
#pragma unroll
      for (int u = 0; u < BATCH; ++u) n[u] = b0 + u < nblk ? __ldcg(c + (i64)u * E) : 0;   // other CTAs wrote them
#pragma unroll
      for (int u = 0; u < BATCH; ++u) {
        if (b0 + u < nblk) c[(i64)u * E] = cnt;
        cnt += n[u];
      }
    }
  }
  int total_rows, total_rb;
  const int nrb_e = (cnt + BLOCK_TOKENS - 1) / BLOCK_TOKENS;
  const int2 before = block_exclusive_scan2(cnt, nrb_e, scratch, &total_rows, &total_rb);
  const int rows_before = before.x, rb_before = before.y;
  if (tid < E) {
    rb_off[tid] = rb_before;
    p.expert_off[tid] = rows_before;
    if (row_off != nullptr) row_off[tid] = rows_before;
    for (int r = 0; r < nrb_e; ++r)   // the items (meld/ir/work_table.py: ROW_BLOCKS)
      store_rowblock(p.rb, 0, rb_before + r,
                     RowBlock{tid, rows_before + r * BLOCK_TOKENS, min(BLOCK_TOKENS, cnt - r * BLOCK_TOKENS), 0});
  }
  if (tid == 0) {
    rb_off[E] = total_rb;
    p.expert_off[E] = total_rows;
  }
  __syncthreads();
  moe_write_tiles(p.tasks, p.task_capacity, rb_off, E, p.n1, p.n2, p.lag, tid, blockDim.x);   // the rows: moe_plan.h
  for (int r = tid; r < total_rb; r += blockDim.x) event_reset(p.rb_done + r);
  if (tid == 0) {
    p.counters[0] = 0;                       // the ticket counter
    p.counters[1] = total_rb * (p.n1 + p.n2);   // tickets in this launch
    event_reset(p.counters + 2);             // routing CTAs done: ready for the next launch
  }
}

// --- dispatch -----------------------------------------------------------------------------------------
// A token's row of x copied to its k expert-sorted rows of xs by one warp, which also records the pairs'
// positions and NaN-fills a token with no valid pair (the lone routing CTA does both its own way: see
// route). A lane keeps SCATTER_VECS 16-byte vectors of the row in registers, so the stores of a
// chunk wait on one round of loads, not on one load each; `row` may arrive holding the first chunk already
// (`first_loaded`).
constexpr int SCATTER_VECS = 8;
constexpr int SCATTER_CHUNK = 32 * SCATTER_VECS;   // 16-byte vectors a warp moves per round

__device__ __forceinline__ void load_chunk(const uint4* src, int c, int vecs, int lane, uint4 (&row)[SCATTER_VECS]) {
#pragma unroll
  for (int u = 0; u < SCATTER_VECS; ++u)
    if (c + lane + 32 * u < vecs) row[u] = src[c + lane + 32 * u];
}

// No valid pair: nothing will combine the token, so its output row is NaN. (With absent pairs, a token that
// had only absent ones is not this layer's to write: an expert-parallel owner's slot that another rank serves.)
__device__ void nan_fill_unrouted(const MoeParams& p, int t, int lane, int need) {
  if ((need & (POISON - 1)) == 0 && (!MELD_ABSENT_PAIRS || (need & POISON)))
    for (int h = lane; h < p.hidden; h += 32) p.out[(i64)t * p.out_stride + h] = 0x7fc0;   // NaN
}

__device__ __forceinline__ void store_chunk(uint4* dst, int c, int vecs, int lane, const uint4 (&row)[SCATTER_VECS]) {
#pragma unroll
  for (int u = 0; u < SCATTER_VECS; ++u)
    if (c + lane + 32 * u < vecs) dst[c + lane + 32 * u] = row[u];
}

#if MELD_FP8
using u8 = unsigned char;
// FP8 activations (DeepSeek-V3's): per token per 128-channel group, scale = max |v| / 448 (the largest e4m3),
// e4m3 = v * (1 / scale) rounded to nearest, both IEEE (moe_reference.quantize_groups: the same bits). A group's
// maximum is taken on the magnitudes' bits, where every NaN lies above infinity: a NaN makes its scale NaN
// (group_scale, e4m3x2: common.cuh).

// A 16-byte vector of a row (8 channels), as dispatch holds them (load_chunk), quantised: lane `lane` holds
// vector `v` (0..vecs-1: past it, nothing), and the 16 vectors of a 128-channel group are held by one half
// warp (a chunk starts at a multiple of 16 vectors): the group's maximum is met there, by shuffles.
__device__ __forceinline__ void quantise_vec(uint4 x, int v, int vecs, uint2& q, float& sc) {
  const u32 w[4] = {x.x, x.y, x.z, x.w};
  u32 m = v < vecs ? bf16x8_amax(w) : 0u;
  for (int o = 1; o < 16; o <<= 1) m = max(m, __shfl_xor_sync(~0u, m, o));
  sc = group_scale(m << 16);
  q = bf16x8_to_e4m3(w, 1.f / sc);
}
// A quantised vector into row r of xs (e4m3), its group's scale into xs_scale (by the group's first lane).
__device__ __forceinline__ void store_vec_fp8(const MoeParams& p, int r, int v, int vecs, int lane, uint2 q, float sc) {
  if (v >= vecs) return;
  *(uint2*)((u8*)p.xs + (i64)r * p.hidden + 8 * v) = q;
  if (lane % 16 == 0) p.xs_scale[(i64)(v / 16) * p.scale_ld + r] = sc;
}
#endif

__device__ void dispatch(const MoeParams& p, int t, int lane, uint4 (&row)[SCATTER_VECS], bool first_loaded) {
  const int E = p.num_experts, K = p.top_k, rblk = t / TOK_BLOCK, vecs = p.hidden / 8;
  const uint4* src = (const uint4*)(p.x + (i64)t * p.x_stride);
  for (int j0 = 0; j0 < K; j0 += 32) {   // lane j resolves pair j0 + j
    const int j = j0 + lane;
    int pos = -1;
    if (j < K) {
      const int id = p.topk_ids[(i64)t * K + j];
      pos = id < 0 ? -1 : p.expert_off[id] + p.blk_cnt[(i64)rblk * E + id] + p.rank[(i64)t * K + j];
      p.pair_pos[(i64)t * K + j] = pos;
      if (pos >= 0) p.row_token[pos] = t;
    }
    for (int c = 0; c < vecs; c += SCATTER_CHUNK) {
      if (c > 0 || j0 > 0 || !first_loaded) load_chunk(src, c, vecs, lane, row);
#if MELD_FP8
#pragma unroll
      for (int u = 0; u < SCATTER_VECS; ++u) {   // a vector quantised once for the token's k rows
        uint2 q;
        float sc;
        quantise_vec(row[u], c + lane + 32 * u, vecs, q, sc);
        for (int jj = 0; jj < min(32, K - j0); ++jj) {
          const int r = __shfl_sync(~0u, pos, jj);
          if (r >= 0) store_vec_fp8(p, r, c + lane + 32 * u, vecs, lane, q, sc);
        }
      }
#else
      for (int jj = 0; jj < min(32, K - j0); ++jj) {
        const int r = __shfl_sync(~0u, pos, jj);
        if (r >= 0) store_chunk((uint4*)(p.xs + (i64)r * p.hidden), c, vecs, lane, row);
      }
#endif
    }
  }
  nan_fill_unrouted(p, t, lane, p.tok_need[t]);
}

// The routing launch's body (MoeRoute): `route_keys`, its dynamic shared memory.
__device__ __forceinline__ void route(const MoeParams& p, u32* route_keys) {
  __shared__ u32 mask[MAX_EXPERTS];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, E = p.num_experts, K = p.top_k;
  const int t = blockIdx.x * TOK_BLOCK + warp;
  const bool lone_dispatch = gridDim.x == 1 && p.route_dispatches;
  // A lone CTA that copies the rows itself asks for them in L2 now (x is the layer's input): its copies then
  // wait on L2, not HBM.
  if (lone_dispatch && lane == 0 && t < p.num_tokens) prefetch_l2(p.x + (i64)t * p.x_stride, p.hidden * 2);
  for (int e = threadIdx.x; e < E; e += blockDim.x) mask[e] = 0;
  __syncthreads();
  // This lane's pair when K <= 32 (pair j = lane): its expert stays in a register for the rank below.
  int own = -1, need = 0;
  if (t < p.num_tokens) {
    int valid = 0, poison = 0;
    if (p.topk_ids_in != nullptr) {
      for (int j0 = 0; j0 < K; j0 += 32) {   // lane j checks pair j0 + j
        const int j = j0 + lane;
        const int raw = j < K ? p.topk_ids_in[(i64)t * K + j] - p.expert_base : -1;
        const bool in_range = raw >= 0 && raw < E;
        bool ok = in_range;
        for (int l = 0; l < 32; ++l) {   // a repeat of an earlier pair of this chunk...
          const int other = __shfl_sync(~0u, raw, l);
          if (l < lane && other == raw) ok = false;
        }
        for (int j2 = 0; j2 < j0 && ok; ++j2) ok = p.topk_ids_in[(i64)t * K + j2] - p.expert_base != raw;   // ...or of one before
        if (j >= K) continue;
        const int id = ok ? raw : -1;
        if (ok) { atomicOr(&mask[id], 1u << warp); ++valid; }
        else if (!MELD_ABSENT_PAIRS || in_range) { poison = 1; atomicOr(p.error, 1); }   // out of range, or a repeat
        own = id;
        p.topk_ids[(i64)t * K + j] = id;
        p.topk_w[(i64)t * K + j] = p.topk_w_in[(i64)t * K + j];
      }
    } else {
      // The token's logits are read from memory once, as keys in shared memory.
      const int slots = route_slots(E);
      u32* mine = route_keys + (warp * 32 + lane) * slots;
      float mx = neg_inf(), sum = 0.f;
      int nan = 0;
      for (int i0 = 0; i0 < slots; i0 += 4) {   // four loads in flight, then one 16-byte store of their keys
        float v[4];
        u32 k[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) k[u] = lane + 32 * (i0 + u) < E ? load_logit_bits(p, t, lane + 32 * (i0 + u)) : 0u;
#pragma unroll
        for (int u = 0; u < 4; ++u) v[u] = lane + 32 * (i0 + u) < E ? logit_of(p, k[u]) : neg_inf();
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          k[u] = lane + 32 * (i0 + u) < E ? order_key(v[u]) : 0u;
          nan |= v[u] != v[u];
          mx = fmaxf(mx, v[u]);
        }
        *(uint4*)(mine + i0) = make_uint4(k[0], k[1], k[2], k[3]);
      }
      for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(~0u, mx, o));
      nan = __any_sync(~0u, nan);
      for (int i = 0; i < slots && lane + 32 * i < E; ++i) sum += __expf(key_value(mine[i]) - mx);
      for (int o = 16; o; o >>= 1) sum += __shfl_xor_sync(~0u, sum, o);
      // Each lane holds its best and its second best remaining expert: a round's winner moves up its second
      // at once, and every lane then rescans for its second (the same code for all: no divergent rescan).
      u32 lane_key, next_key;
      int lane_expert, next_expert;
      lane_best(mine, slots, lane, -1, lane_key, lane_expert);
      lane_best(mine, slots, lane, lane_expert, next_key, next_expert);
      float picked_sum = 0.f;
      u32 my_key = 0;   // lane j's pair of the current chunk of 32: its key and expert
      int my_id = -1;
      for (int j = 0; j < K; ++j) {
        // Two warp reductions: the best key, then the smallest expert holding it (one butterfly of shuffles
        // over (key, expert complement) was slower: bench/RESULTS.md, "the small-batch routing launch").
        const u32 top = __reduce_max_sync(~0u, lane_key);   // > 0: K <= E leaves an expert untaken
        const int bi = (int)__reduce_min_sync(~0u, lane_key == top ? (u32)lane_expert : 0xFFFFFFFFu);
        if (bi % 32 == lane) {
          mine[bi / 32] = 0;
          lane_key = next_key;
          lane_expert = next_expert;
        }
        lane_best(mine, slots, lane, lane_expert, next_key, next_expert);
        if (j % 32 == lane) { my_key = top; my_id = bi; }
        if (j % 32 == 31 || j == K - 1) {   // lanes hold pairs j - j % 32 .. j: weigh and write them
          const int jj = j - j % 32 + lane;
          const float w = jj > j ? 0.f : nan ? __int_as_float(0x7fc00000) : __expf(key_value(my_key) - mx) / sum;
          float chunk = w;
          for (int o = 16; o; o >>= 1) chunk += __shfl_xor_sync(~0u, chunk, o);
          picked_sum += chunk;
          if (jj <= j) {   // with K <= 32 this is the last chunk: the weights are renormalised here
            p.topk_ids[(i64)t * K + jj] = own = my_id;
            p.topk_w[(i64)t * K + jj] = p.renormalize && K <= 32 ? w / picked_sum : w;
            atomicOr(&mask[my_id], 1u << warp);
            ++valid;
          }
        }
      }
      if (p.renormalize && K > 32) {
        __syncwarp();
        for (int j = lane; j < K; j += 32) p.topk_w[(i64)t * K + j] /= picked_sum;
      }
    }
    for (int o = 16; o; o >>= 1) {
      valid += __shfl_xor_sync(~0u, valid, o);
      poison |= __shfl_xor_sync(~0u, poison, o);
    }
    need = valid | (poison ? POISON : 0);
    if (lane == 0) p.tok_need[t] = need;
    // Rows still to come per column block of out: the last gemm2 tile to count a token's row down combines it.
    for (int c = lane; c < p.n2; c += 32) p.tok_cnt[(i64)t * p.n2 + c] = valid;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) p.blk_cnt[(i64)blockIdx.x * E + e] = __popc(mask[e]);
  if (t < p.num_tokens) {
    for (int j = lane; j < K; j += 32) {
      const int id = K <= 32 ? own : p.topk_ids[(i64)t * K + j];
      p.rank[(i64)t * K + j] = id < 0 ? -1 : __popc(mask[id] & ((1u << warp) - 1));
    }
  }
  // The last routing CTA to finish plans (last arriver: no second launch, and no CTA ever waits). A lone
  // CTA (T <= 32) is last by construction and plans at once; when its rows are few (route_dispatches: one
  // SM copies only tens of GB/s) it dispatches them too, and a decode step runs two launches, not three.
  // Its pairs' rows come from its own shared memory (the expert's first row + the token's rank among the
  // block's tokens of that expert), not from a round trip through the tables it writes for the main kernel.
  if (gridDim.x == 1) {
    __shared__ int row_off[MAX_EXPERTS], placed[TOK_BLOCK * 32];   // (route_dispatches: T * K <= TOK_BLOCK * 32)
    __syncthreads();
    plan(p, mask, row_off);
    if (lone_dispatch) {
      __syncthreads();   // row_off
      if (t < p.num_tokens) {
        for (int j = lane; j < K; j += 32) {
          const int id = K <= 32 ? own : p.topk_ids[(i64)t * K + j];
          const int pos = id < 0 ? -1 : row_off[id] + __popc(mask[id] & ((1u << warp) - 1));
          placed[t * K + j] = pos;
          p.pair_pos[(i64)t * K + j] = pos;
          if (pos >= 0) p.row_token[pos] = t;
        }
        nan_fill_unrouted(p, t, lane, need);
      }
      __syncthreads();   // placed
      // One (pair, chunk of the row) per warp at a time, so all the copies of a few rows are in flight at once
      // (one warp copying a row's chunks one after another left the copies in series: bench/RESULTS.md,
      // "Inside the routing launch").
      // A lone token (x_direct) is read from x by the gemm1 tiles themselves: nothing to copy.
      const int vecs = p.hidden / 8, chunks = p.x_direct ? 0 : (vecs + SCATTER_CHUNK - 1) / SCATTER_CHUNK;
      uint4 row[SCATTER_VECS];
      for (int u = warp; u < p.num_tokens * K * chunks; u += blockDim.x / 32) {
        const int pair = u / chunks, c = u % chunks * SCATTER_CHUNK, r = placed[pair];
        if (r < 0) continue;
#if MELD_FP8
        const uint4* src = (const uint4*)(p.x + (i64)(pair / K) * p.x_stride);
#pragma unroll
        for (int u = 0; u < SCATTER_VECS; ++u) {   // (a vector at a time: the chunk and its quantised copy spilled)
          const int v = c + lane + 32 * u;
          uint2 q;
          float sc;
          quantise_vec(v < vecs ? src[v] : make_uint4(0, 0, 0, 0), v, vecs, q, sc);
          store_vec_fp8(p, r, v, vecs, lane, q, sc);
        }
#else
        load_chunk((const uint4*)(p.x + (i64)(pair / K) * p.x_stride), c, vecs, lane, row);
        store_chunk((uint4*)(p.xs + (i64)r * p.hidden), c, vecs, lane, row);
#endif
      }
    }
    return;
  }
  __shared__ int last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = event_arrive(p.counters + 2, 1, (int)gridDim.x);
  __syncthreads();
  if (last) {
    __threadfence();
    plan(p, nullptr, nullptr);
  }
}

// The routing launch (persistent.cuh): an ordinary launch (meld/ops/moe.py) that releases the dispatch
// launch at once, so its CTAs may start loading rows of x. Its CTAs take TOK_BLOCK tokens each.
struct MoeRoute : SimpleFamily<MoeParams, LAUNCH_CHAIN_HEAD> {
  struct State {
    u32* keys;   // [TOK_BLOCK][32][slots]: a warp's keys, lane-major
    __device__ __forceinline__ State(const MoeParams&, unsigned char* smem) : keys(reinterpret_cast<u32*>(smem)) {}
  };
  static __device__ __forceinline__ void run(const MoeParams& p, const State& s) { route(p, s.keys); }
};

// The dispatch launch (more than one routing CTA): a programmatic dependent of routing that releases the
// persistent kernel at once (its prologue overlaps this launch). x is the layer's input, not routing's
// output, so setup loads each warp's token's first chunk before the wait for routing. CTAs are small
// (SCATTER_WARPS tokens): one SM moves only tens of GB/s, so a few hundred tokens must spread over many SMs.
struct MoeScatter : SimpleFamily<MoeParams, LAUNCH_CHAIN_LINK> {
  struct State {
    int lane, t;                 // the warp's token
    uint4 row[SCATTER_VECS];     // its first chunk of x
    __device__ __forceinline__ State(const MoeParams&, unsigned char*)
        : lane(threadIdx.x % 32), t(blockIdx.x * SCATTER_WARPS + threadIdx.x / 32) {}
  };
  static __device__ __forceinline__ void setup(const MoeParams& p, State& s) {
    if (s.t < p.num_tokens) load_chunk((const uint4*)(p.x + (i64)s.t * p.x_stride), 0, p.hidden / 8, s.lane, s.row);
  }
  static __device__ __forceinline__ void run(const MoeParams& p, State& s) {
    if (s.t < p.num_tokens) dispatch(p, s.t, s.lane, s.row, true);
  }
};

// --- the persistent kernel ----------------------------------------------------------------------------
__device__ __forceinline__ WaitSite wait_site(const MoeParams& p, int site, int warp, int unit, int detail) {
  return WaitSite{p.watchdog, p.watchdog_claim, p.watchdog_kernel, site, (int)blockIdx.x, warp, unit, detail};
}

// Spin until a gemm2 tile's row block has all its gemm1 tiles (see the deadlock-freedom note above).
__device__ void wait_row_block(const MoeParams& p, int rb, int ticket) {
  event_wait(p.rb_done + rb, p.n1, wait_site(p, 3, 0, ticket, rb));
  fence_proxy_async_global();   // act, written by other CTAs' generic stores, is read next by TMA
}

__device__ void produce(const MoeParams& p, Ring ring, u32 task_full, u32 task_empty, int* slots) {
  const int ntasks = p.counters[1];
  int slot = 0;
  u32 tphase = 0;
  for (;;) {
    const int ticket = atomicAdd(p.counters, 1);
    // The ticket's row (meld/ir/work_table.py: MOE_TILE), field-major: only gemm, row_block and col are read
    // (the rest is dead code), one scalar load each, issued together; its event is its row block. Past the
    // last ticket, gemm -1: the end.
    MoeTile tile;
    tile.gemm = -1;
    tile.row_block = tile.col = 0;
    if (ticket < ntasks) tile = load_moetile(p.tasks, p.task_capacity, ticket);
    const int kind = tile.gemm, col = tile.col, rbi = tile.row_block;
    const RowBlock blk = kind < 0 ? RowBlock{} : load_rowblock(p.rb, 0, rbi);
    const int expert = blk.expert, row0 = blk.first_row, n = tile_tokens(blk.rows);
    mbar_wait(task_empty + 8 * slot, tphase ^ 1u, wait_site(p, 4, 0, ticket, slot));
    int* ts = slots + TASK_SLOT * slot;
    ts[0] = kind;
    ts[1] = ticket;
    ts[2] = n;
    ts[3] = rbi;
    ts[4] = col;
    mbar_arrive(task_full + 8 * slot);
    if ((slot ^= 1) == 0) tphase ^= 1u;
    if (kind < 0) break;
    const void* wmap = kind ? (const void*)&p.w2_map : (const void*)&p.w13_map;
    // A full-width tile copies its token operand as one box a stage, a narrower one as n / T_ROWS boxes.
    const bool part = n < BLOCK_TOKENS;
    const void* tmap = part ? (kind ? (const void*)&p.act_part_map : (const void*)&p.xs_part_map)
                            : (kind ? (const void*)&p.act_map : (const void*)&p.xs_map);
    const void* smap = kind ? (const void*)&p.act_scale_map : (const void*)&p.xs_scale_map;   // (FP8)
    const u32 scales = MELD_FP8 ? scale_slots(slots) : 0u;   // (smem_addr is volatile asm: not in bf16 builds)
    const int tboxes = part ? n / T_ROWS : 1, trows = part ? T_ROWS : BLOCK_TOKENS;
    // One token (x_direct: H whole stages of K boxes, so none runs past x's row): a gemm1 tile's token operand
    // is x's row itself, 128 bytes a K box into the box's first row (unswizzled: row 0); its other rows
    // keep whatever the stage held, which only feeds accumulator columns that are never stored.
    const bool direct = !MELD_FP8 && p.x_direct && kind == 0;   // (FP8: x must be quantised first)
    int wrow[NBOX];
    if (kind == 0) {
      const i64 e0 = (i64)expert * 2 * p.inter;
      for (int w = 0; w < NACC; ++w) {
        wrow[2 * w] = (int)(e0 + col * G1_COLS + w * 64);                   // gate rows
        wrow[2 * w + 1] = (int)(e0 + p.inter + col * G1_COLS + w * 64);     // up rows
      }
    } else {
      for (int q = 0; q < NBOX; ++q) wrow[q] = (int)((i64)expert * p.hidden + col * G2_COLS + q * 64);
    }
    const int nk = ((kind ? p.inter : p.hidden) + BK * K_BOXES - 1) / (BK * K_BOXES);   // stages (a K box past
                                                                                     // the end: zeros, counted)
    // A weight box whose first column (of I for gemm1, of H for gemm2) is past the end would read the next
    // expert's rows (the last column block of an I or H that is not a multiple of the tile's): not loaded;
    // the consumers multiply what its stage buffer held before and never store those rows.
    int live = 0, nlive = 0;
#pragma unroll
    for (int q = 0; q < NBOX; ++q)
      if ((kind ? col * G2_COLS + q * 64 < p.hidden : col * G1_COLS + (q / 2) * 64 < p.inter)) {
        live |= 1 << q;
        ++nlive;
      }
    // A gemm2 tile's weights do not depend on gemm1: up to a ring of them is in flight before the wait
    // for its row block, and only the act boxes of those stages wait (their stages complete with them).
    const int early = kind ? min(nk, NUM_STAGES) : 0;
    Ring late = ring;
    for (int kk = 0; kk <= nk; ++kk) {
      if (kind && kk == early) {
        wait_row_block(p, rbi, ticket);
        for (int e = 0; e < early; ++e, late.advance()) {
#pragma unroll
          for (int b = 0; b < K_BOXES; ++b)
            for (int i = 0; i < tboxes; ++i)
              tma_load_2d(late.base + late.stage * STAGE_BYTES + b * BOX_SET + NBOX * W_BOX + i * trows * BK * ELEM, tmap,
                          (e * K_BOXES + b) * BK, row0 + i * trows, late.full + 8 * late.stage);
          if (MELD_FP8) tma_load_2d(scales + late.stage * SCALE_SLOT, smap, row0 & -SCALE_ALIGN, e, late.full + 8 * late.stage);
        }
      }
      if (kk == nk) break;
      const u32 full = ring.full + 8 * ring.stage, dst = ring.base + ring.stage * STAGE_BYTES;
      mbar_wait(ring.empty + 8 * ring.stage, ring.phase ^ 1u, wait_site(p, 5, 0, ticket, ring.stage));
      mbar_arrive_expect_tx(full, K_BOXES * (nlive * W_BOX + (direct ? BK * ELEM : n * BK * ELEM)) + SCALE_BYTES);
#pragma unroll
      for (int b = 0; b < K_BOXES; ++b) {
        if (MELD_PACKED) {   // the stage's live boxes: one run (meld/ops/moe_weights.py), K_BOXES 1
          const int k = kk * K_BOXES + b, nkb = ((kind ? p.inter : p.hidden) + BK - 1) / BK;
          const int nb = ((kind ? p.hidden : p.inter) + W_ROWS - 1) / W_ROWS;   // 64-row blocks of the output
          const u16* src = kind ? p.w2_packed + ((i64)(expert * nkb + k) * nb + col * NBOX) * (W_BOX / 2)
                                : p.w13_packed + ((i64)(expert * nkb + k) * nb + col * NACC) * 2 * (W_BOX / 2);
          bulk_load(dst + b * BOX_SET, src, nlive * W_BOX, full);
        } else {
#pragma unroll
          for (int q = 0; q < NBOX; ++q)
            if (live >> q & 1) tma_load_2d(dst + b * BOX_SET + q * W_BOX, wmap, (kk * K_BOXES + b) * BK, wrow[q], full);
        }
        if (direct)
          bulk_load(dst + b * BOX_SET + NBOX * W_BOX, p.x + (kk * K_BOXES + b) * BK, BK * 2, full);
        else if (kk >= early)
          for (int i = 0; i < tboxes; ++i)
            tma_load_2d(dst + b * BOX_SET + NBOX * W_BOX + i * trows * BK * ELEM, tmap, (kk * K_BOXES + b) * BK,
                        row0 + i * trows, full);
      }
      if (MELD_FP8 && kk >= early) tma_load_2d(scales + ring.stage * SCALE_SLOT, smap, row0 & -SCALE_ALIGN, kk, full);   // (K_BOXES 1)
      ring.advance();
    }
  }
}

// One weight block x the token block, K = 64: four k16 steps into one accumulator, as an N-wide wgmma on
// its first N/2 registers (N = 2R); the others stay zero, and hold tokens >= N >= the row block's rows,
// which the epilogues never store.
// FP8: K = 128, four k32 steps, the first of which starts the sum (the stage's product alone, which KLoop
// scales into the tile's sum).
template <int R, int N>
__device__ __forceinline__ void mma_stage(float (&acc)[N], u32 w_smem, u32 t_smem) {
  float (&head)[R] = *reinterpret_cast<float (*)[R]>(&acc[0]);
#pragma unroll
#if MELD_FP8
  for (int s = 0; s < BK / 32; ++s) wgmma_e4m3(head, wgmma_desc(w_smem + 32 * s), wgmma_desc(t_smem + 32 * s), s);
#else
  for (int s = 0; s < BK / 16; ++s) wgmma_bf16(head, wgmma_desc(w_smem + 32 * s), wgmma_desc(t_smem + 32 * s));
#endif
}

// FP8 block scales. A consumer thread's accumulator registers hold two weight rows (`lo`, and `lo` + 8: see the
// layout in consume) for the tokens 8 (r / 4) + 2 (lane % 4) + r % 2; register r of a stage's product is
// scaled by its weight row's block scale and its token's scale of that 128-wide K block.
struct Fp8Scales {
  const float* w[2][2];   // [accumulator][row lo, lo + 8]: the row's weight block scales (one per K block)
  u32 t;                  // shared: stage 0's scale slot at this thread's first token (2 (lane % 4))
};

// Weight row `row` of an expert's `n` rows of weights of K `k`: its 128 x 128 blocks' scales along K.
__device__ __forceinline__ const float* weight_scales(const float* scale, int expert, int n, int k, int row) {
  const int nb = (n + 127) / 128, kb = (k + 127) / 128;
  return scale + ((i64)expert * nb + min(row, n - 1) / 128) * kb;
}

// A tile's k loop for wgmmas of N = 2R token columns: one stage's wgmmas stay in flight while the next
// stage's are issued; a stage goes back to the producer once the wgmmas that read it have completed.
// FP8: a stage's product is complete (wgmma_wait<0>) before it is scaled into its sum, one accumulator after
// the other through one set of registers, so the stage goes back to the producer within the loop (`prev` stays
// -1). Its token scales (the producer's TMA box of them, in the stage's scale slot) are read while the first
// product runs, a pair of tokens a shared load (they were 16 L2 loads a thread a stage, whose offsets, clamped to
// the block's rows, held 16 registers); its weight scales before its copies are waited for.
struct KLoop {
  const MoeParams& p;
  int nk, lane, warp, wg, ticket;
  Fp8Scales sc;
  template <int R>
  __device__ __forceinline__ void run(Ring& ring, int& prev, float (&acc0)[ACC], float (&acc1)[ACC]) const {
#if MELD_FP8
    for (int kk = 0; kk < nk; ++kk) {
      float ws[2][2];
#pragma unroll
      for (int a = 0; a < 2; ++a)
#pragma unroll
        for (int h = 0; h < 2; ++h) ws[a][h] = __ldg(sc.w[a][h] + kk);
      mbar_wait(ring.full + 8 * ring.stage, ring.phase, wait_site(p, 7, warp + 4, ticket, ring.stage), 2 * MELD_WATCHDOG_NS);
      const u32 st = ring.base + ring.stage * STAGE_BYTES;
      float2 ts[R / 4];   // tokens 8i + 2 (lane % 4) + 0, 1: read while the first product runs
#pragma unroll
      for (int a = 0; a < 2; ++a) {
        float part[R];
        wgmma_fence();
        mma_stage<R>(part, st + (2 * wg + a) * W_BOX, st + NBOX * W_BOX);
        wgmma_commit();
        if (a == 0)
#pragma unroll
          for (int i = 0; i < R / 4; ++i)   // (two loads: the block's first token may sit at any 4-byte offset)
            ts[i] = make_float2(ld_shared_f32(sc.t + ring.stage * SCALE_SLOT + 32 * i),
                                ld_shared_f32(sc.t + ring.stage * SCALE_SLOT + 32 * i + 4));
        wgmma_wait<0>();
        fence_regs(part);
        if (a == 1) {   // (every lane has read the stage's scales and both products' operands)
          __syncwarp();
          if (lane == 0) mbar_arrive(ring.empty + 8 * ring.stage);
        }
        float (&acc)[ACC] = a ? acc1 : acc0;
#pragma unroll
        for (int i = 0; i < R / 4; ++i)   // registers 4i + j: token 8i + 2 (lane % 4) + j % 2, row lo + 8 (j / 2)
#pragma unroll
          for (int j = 0; j < 4; ++j)
            acc[4 * i + j] = fmaf(part[4 * i + j], ws[a][j / 2] * (j % 2 ? ts[i].y : ts[i].x), acc[4 * i + j]);
      }
      ring.advance();
    }
#else
    for (int kk = 0; kk < nk; ++kk)
      ring_consume<STAGE_BYTES>(ring, prev, lane, wait_site(p, 7, warp + 4, ticket, ring.stage), 2 * MELD_WATCHDOG_NS,
                                [&](u32 st) {
#pragma unroll
                                  for (int b = 0; b < K_BOXES; ++b, st += BOX_SET) {
                                    mma_stage<R>(acc0, st + (NACC * wg) * W_BOX, st + NBOX * W_BOX);
                                    if (NACC == 2) mma_stage<R>(acc1, st + (2 * wg + 1) * W_BOX, st + NBOX * W_BOX);
                                  }
                                });
#endif
  }
};

__device__ __forceinline__ float silu_mul(float g, float u) { return g / (1.f + __expf(-g)) * u; }

#if MELD_FP8
// The FP8 gemm1 epilogue: act = SiLU(gate) * up in f32, quantised per token over the tile's 128 columns of I
// (one group: G1_COLS = 128), the group's maximum met across the eight consumer warps in `red`
// ([9][BLOCK_TOKENS], magnitude bits: each warp's, then the group's); e4m3 bytes into act, the scales into act_scale. `g`, `u`: the gate and
// up accumulators (their layout: see consume).
__device__ void quantise_act(const MoeParams& p, const float (&g)[ACC], const float (&u)[ACC], u32* red, int row0,
                             int rows, int col, int wg, int warp, int lane) {
  constexpr int NT = ACC / 2;   // tokens of this thread: 8 (i / 2) + 2 (lane % 4) + i % 2 (register r: i = 2 (r / 4) + r % 2)
  const int c0 = col * G1_COLS + wg * 64 + 16 * (warp % 4) + lane / 4;   // its columns: c0 + 8 ((r / 2) % 2)
  float v[ACC];
  u32 m[NT];
#pragma unroll
  for (int i = 0; i < NT; ++i) m[i] = 0;
#pragma unroll
  for (int r = 0; r < ACC; ++r) {
    v[r] = silu_mul(g[r], u[r]);
    if (c0 + 8 * ((r / 2) % 2) < p.inter) m[2 * (r / 4) + r % 2] = max(m[2 * (r / 4) + r % 2], __float_as_uint(v[r]) & 0x7fffffffu);
  }
#pragma unroll
  for (int i = 0; i < NT; ++i) {
    for (int o = 4; o < 32; o <<= 1) m[i] = max(m[i], __shfl_xor_sync(~0u, m[i], o));
    if (lane < 4) red[warp * BLOCK_TOKENS + 8 * (i / 2) + 2 * lane + i % 2] = m[i];
  }
  named_barrier(1, CONSUMERS);
  const int ct = threadIdx.x - 128;
  if (ct < BLOCK_TOKENS) {   // one thread a token: the maximum of the eight warps' into red's first row
    u32 mm = 0;
#pragma unroll
    for (int w = 0; w < CONSUMERS / 32; ++w) mm = max(mm, red[w * BLOCK_TOKENS + ct]);
    red[8 * BLOCK_TOKENS + ct] = mm;
    if (ct < rows) p.act_scale[(i64)col * p.scale_ld + row0 + ct] = group_scale(mm);
  }
  named_barrier(1, CONSUMERS);
  u8* act = (u8*)p.act + (i64)row0 * p.inter + c0;
#pragma unroll
  for (int i = 0; i < NT; ++i) {   // token by token: its scale, then its two values (registers 4 (i / 2) + i % 2 + 0, 2)
    const int tok = 8 * (i / 2) + 2 * (lane % 4) + i % 2;
    if (tok >= rows) continue;
    const float inv = 1.f / group_scale(red[8 * BLOCK_TOKENS + tok]);
#pragma unroll
    for (int h = 0; h < 2; ++h)
      if (c0 + 8 * h < p.inter) act[(i64)tok * p.inter + 8 * h] = (u8)e4m3x2(v[4 * (i / 2) + 2 * h + i % 2] * inv, 0.f);
  }
}
#endif

// A consumer warp's part of an accumulator (weight rows 16 (warp % 4) + 0..15, every token: see the layout
// in consume), as bf16, into the row-major matrix dst [rows][ld] at rows row0 + token (tokens below `rows`)
// and columns c0 + 0..15 (those below `ncols`). A thread holds a weight row's values for two tokens, so the
// stores cannot leave the registers 16 bytes at a time. Wide tiles: stmatrix writes them transposed into
// the warp's `stage` (BLOCK_TOKENS rows of 32 bytes: a token's 16 columns; the two 16-byte halves swap on
// every other group of four rows, so the eight rows of a matrix hit distinct banks), and each token's 16
// columns leave as two 16-byte stores, one 32-byte sector, which large batches write faster than 2-byte
// stores from the registers. Narrow tiles (a few tokens, on the critical path of a decode step) store 2
// bytes at a time straight from the registers: the trip through the stage costs them more than it saves
// (bench/RESULTS.md, "tile outputs leave 16 bytes a store").
// `v`: the accumulator's registers packed in pairs (pack_acc), which halves the registers an epilogue holds.
__device__ __forceinline__ void pack_acc(const float (&a)[ACC], u32 (&v)[ACC / 2]) {
#pragma unroll
  for (int i = 0; i < ACC / 2; ++i) v[i] = pack2(a[2 * i], a[2 * i + 1]);
}
__device__ __forceinline__ void store_rows(const u32 (&v)[ACC / 2], u32 stage, u16* dst, int ld, int row0, int rows,
                                           int c0, int ncols, int lane) {
  if (MELD_NARROW) {   // v[i]: column c0 + lane / 4 + 8 (i % 2), tokens 8 (i / 2) + 2 (lane % 4) + 0, 1
#pragma unroll
    for (int i = 0; i < ACC / 2; ++i) {
      const int col = c0 + lane / 4 + 8 * (i % 2), tok = 8 * (i / 2) + 2 * (lane % 4);
      if (col >= ncols) continue;
      if (tok < rows) dst[(i64)(row0 + tok) * ld + col] = (u16)(v[i] & 0xffffu);
      if (tok + 1 < rows) dst[(i64)(row0 + tok + 1) * ld + col] = (u16)(v[i] >> 16);
    }
    return;
  }
  const int m = lane / 8, j = lane % 8;   // this lane addresses row j of matrix m
#pragma unroll
  for (int g = 0; g < BLOCK_TOKENS / 8; g += 2)   // matrix m: tokens 8 (g + m / 2) + 0..7, columns 8 (m % 2) + 0..7
    stmatrix_x4_trans(stage + (8 * (g + m / 2) + j) * 32 + 16 * ((m % 2) ^ (j / 4)), v[2 * g], v[2 * g + 1],
                      v[2 * g + 2], v[2 * g + 3]);
  __syncwarp();
#pragma unroll 2
  for (int c = lane; c < 2 * rows; c += 32) {   // 16-byte chunk c: token c / 2, columns 8 (c % 2) + 0..7
    const int tok = c / 2, half = c % 2, col = c0 + 8 * half;
    const uint4 q = ld_shared_v4(stage + tok * 32 + 16 * (half ^ ((tok / 4) % 2)));
    if (col < ncols) *(uint4*)(dst + (i64)(row0 + tok) * ld + col) = q;
  }
  __syncwarp();   // the stage is read before the next call writes it
}

// A token's k rows for this column block of H are all in y: out = sum_j w_j y_j, in fixed j order.
// One warp per token, 8 columns (16 bytes) per lane; the k (row, weight) pairs come from lane j by shuffle.
// The loads of COMBINE_BATCH rows are issued before any of them is used, so a token costs one L2 round
// trip per batch, not one per row (ncu: the row-at-a-time loop stalled on each load in turn).
constexpr int COMBINE_BATCH = 8;

__device__ void combine(const MoeParams& p, int t, int h0, int lane) {
  const int K = p.top_k, h = h0 + lane * 8;
  const bool active = lane * 8 < G2_COLS && h < p.hidden;   // every lane stays for the shuffles
  float acc[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = (p.tok_need[t] & POISON) ? __int_as_float(0x7fc00000) : 0.f;
  for (int j0 = 0; j0 < K; j0 += 32) {
    const int mine = j0 + lane < K ? p.pair_pos[(i64)t * K + j0 + lane] : -1;
    const float mw = j0 + lane < K ? p.topk_w[(i64)t * K + j0 + lane] : 0.f;
    const int n = min(32, K - j0);
    for (int j1 = 0; j1 < n; j1 += COMBINE_BATCH) {
      uint4 v[COMBINE_BATCH];
      float w[COMBINE_BATCH];
      bool use[COMBINE_BATCH];
#pragma unroll
      for (int u = 0; u < COMBINE_BATCH; ++u) {
        const int pos = __shfl_sync(~0u, mine, (j1 + u) % 32);   // lanes >= n hold -1
        w[u] = __shfl_sync(~0u, mw, (j1 + u) % 32);
        use[u] = active && j1 + u < n && pos >= 0;
        if (use[u]) v[u] = ld_cg_v4(p.y + (i64)pos * p.hidden + h);
      }
#pragma unroll
      for (int u = 0; u < COMBINE_BATCH; ++u) {
        if (!use[u]) continue;
        const u32 q[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          acc[2 * i] += w[u] * __uint_as_float(q[i] << 16);
          acc[2 * i + 1] += w[u] * __uint_as_float(q[i] & 0xffff0000u);
        }
      }
    }
  }
  if (active) {
    uint4 o;
    o.x = pack2(acc[0], acc[1]); o.y = pack2(acc[2], acc[3]); o.z = pack2(acc[4], acc[5]); o.w = pack2(acc[6], acc[7]);
    *(uint4*)(p.out + (i64)t * p.out_stride + h) = o;
  }
}

// A finished gemm1 tile is handed to the epilogue warp through a two-slot mailbox (mbarriers: `full` when
// every consumer thread has stored its part and arrived, `empty` when the epilogue warp is done with the
// slot), which makes the stores visible at gpu scope and signals the row block, while the consumers go on:
// they no longer wait out the gpu-scope fence after each tile's stores (bench/RESULTS.md, "the gemm1
// epilogue"). (gemm2 tiles keep their fence: their combines read what it publishes, and moved to the
// epilogue warps they ran slower than the tensor cores.)
struct Mailbox {
  u32 full, empty;   // two mbarriers each (8 bytes apart)
  int* box;          // [2][2]: kind (0: a gemm1 tile; -1: no more tiles), row block
};

__device__ void consume(const MoeParams& p, Ring ring, u32 task_full, u32 task_empty, const int* slots,
                        Mailbox mb, int* combine_list, float* xchg) {
  const int ct = threadIdx.x - 128, wg = ct / 128, warp = ct / 32, lane = ct % 32;   // wg: 0 or 1
  const bool recorder = ct == 0;
  Profiler prof;
  prof.begin(p.prof, p.prof_cap, blockIdx.x, recorder, p.prof_clock, p.prof_every);
  int slot = 0, mslot = 0;
  u32 tphase = 0, mphase = 0;
  // Hand a tile (or the end, kind -1) to the epilogue warps: every consumer's stores before its arrival.
  // The barrier keeps the two warpgroups a tile apart at most (each arrives once per slot use, and
  // warpgroup 0 has read the narrow tiles' exchange area before warpgroup 1 writes it again).
  auto post = [&](int kind, int rbi, int ticket) {
    named_barrier(1, CONSUMERS);
    if (ct == 0) {
      mbar_wait(mb.empty + 8 * mslot, mphase ^ 1u, wait_site(p, 8, warp + 4, ticket, mslot), 2 * MELD_WATCHDOG_NS);
      int* b = mb.box + 2 * mslot;
      b[0] = kind;
      b[1] = rbi;
    }
    mbar_arrive(mb.full + 8 * mslot);
    if ((mslot ^= 1) == 0) mphase ^= 1u;
  };
  for (;;) {
    // Consumers wait on the producer, which may itself be waiting (on a row block): they give up later.
    mbar_wait(task_full + 8 * slot, tphase, wait_site(p, 6, warp + 4, -1, slot), 2 * MELD_WATCHDOG_NS);
    const int* ts = slots + TASK_SLOT * slot;
    const int kind = ts[0], ticket = ts[1], n = ts[2], rbi = ts[3], col = ts[4];
    __syncwarp();
    if (lane == 0) mbar_arrive(task_empty + 8 * slot);
    if ((slot ^= 1) == 0) tphase ^= 1u;
    if (kind < 0) {
      post(-1, 0, ticket);
      break;
    }
    const i64 t0 = prof.now();
    const RowBlock blk = load_rowblock(p.rb, 0, rbi);
    const int row0 = blk.first_row, rows = blk.rows;
    // (gemm2: the token of this thread's row, loaded now so that the count-down after the tile does not wait on it)
    const int row_token = kind && ct < rows ? p.row_token[row0 + ct] : 0;
    float acc0[ACC], acc1[ACC];
#pragma unroll
    for (int i = 0; i < ACC; ++i) acc0[i] = acc1[i] = 0.f;
    const int nk = ((kind ? p.inter : p.hidden) + BK * K_BOXES - 1) / (BK * K_BOXES);
    // The k loop is instantiated per token width (a branch inside it would serialise the wgmmas); widths
    // above the block collapse onto it, so a narrow kernel has one loop (meld/codegen/moe_kernel.py emits
    // the wgmma shapes of tile_token_widths).
    int prev = -1;
    Fp8Scales sc{};
#if MELD_FP8
    {   // this thread's weight rows (see the accumulator layout below) and the row block's token scales
      const int expert = blk.expert, lo = 16 * (warp % 4) + lane / 4;
      for (int a = 0; a < 2; ++a)
        for (int h = 0; h < 2; ++h)
          sc.w[a][h] = kind ? weight_scales(p.w2_scale, expert, p.hidden, p.inter, col * G2_COLS + (2 * wg + a) * 64 + lo + 8 * h)
                            : weight_scales(p.w13_scale, expert, 2 * p.inter, p.hidden,
                                            a * p.inter + col * G1_COLS + wg * 64 + lo + 8 * h);
      sc.t = scale_slots(slots) + 4 * (row0 % SCALE_ALIGN) + 8 * (lane % 4);
    }
#endif
    const KLoop kl{p, nk, lane, warp, wg, ticket, sc};
    if (MELD_NARROW || n == BLOCK_TOKENS) kl.run<ACC>(ring, prev, acc0, acc1);
    else if (n == 32) kl.run<MELD_NARROW ? ACC : 16>(ring, prev, acc0, acc1);
    else if (n == 64) kl.run<MELD_NARROW || BLOCK_TOKENS < 64 ? ACC : 32>(ring, prev, acc0, acc1);
    else kl.run<MELD_NARROW || BLOCK_TOKENS < 96 ? ACC : 48>(ring, prev, acc0, acc1);
    wgmma_wait<0>();
    fence_regs(acc0);
    fence_regs(acc1);
    if (!MELD_FP8 && lane == 0) mbar_arrive(ring.empty + 8 * prev);   // (FP8: every stage went back in the loop)
    // this warp's output staging (store_rows, wide tiles), after the exchange area: [8 warps][BLOCK_TOKENS][32 bytes]
    const u32 stage = ((smem_addr(xchg) + (MELD_FP8 ? 9 * BLOCK_TOKENS * 4 : MELD_NARROW ? 128 * (ACC + 1) * 4 : 0) + 15) & ~15u)
                      + warp * BLOCK_TOKENS * 32;
    // Accumulator layout (wgmma m64nN, f32): register r of thread (warp w of the warpgroup, lane l)
    // holds weight row 16 (w % 4) + l / 4 + 8 ((r / 2) % 2) and token 8 (r / 4) + 2 (l % 4) + r % 2.
    if (kind == 0 && MELD_FP8) {
#if MELD_FP8
      quantise_act(p, acc0, acc1, (u32*)xchg, row0, rows, col, wg, warp, lane);
#endif
      post(0, rbi, ticket);
      prof.record(t0, PROF_GEMM1, ticket);
    } else if (kind == 0) {
      if (NACC == 1) {   // warpgroup 1 holds the up rows: hand them to the same thread of warpgroup 0
        float* mine = xchg + (ct % 128) * (ACC + 1);
        if (wg == 1) {
#pragma unroll
          for (int r = 0; r < ACC; ++r) mine[r] = acc0[r];
        }
        named_barrier(1, CONSUMERS);
        if (wg == 0) {
#pragma unroll
          for (int r = 0; r < ACC; ++r) acc1[r] = mine[r];
        }
      }
      if (NACC == 2 || wg == 0) {
        u32 v[ACC / 2];
#pragma unroll
        for (int i = 0; i < ACC / 2; ++i)   // (narrow tiles: only the tokens the row block has, as before the stage)
          v[i] = MELD_NARROW && 8 * (i / 2) + 2 * (lane % 4) >= rows
                     ? 0u : pack2(silu_mul(acc0[2 * i], acc1[2 * i]), silu_mul(acc0[2 * i + 1], acc1[2 * i + 1]));
        store_rows(v, stage, p.act, p.inter, row0, rows, col * G1_COLS + wg * 64 + 16 * (warp % 4), p.inter, lane);
      }
      post(0, rbi, ticket);
      prof.record(t0, PROF_GEMM1, ticket);
    } else {
      const int h0 = col * G2_COLS, hw = h0 + wg * 64 * NACC + 16 * (warp % 4);
      u32 v0[ACC / 2], v1[ACC / 2];
      pack_acc(acc0, v0);
      if (NACC == 2) pack_acc(acc1, v1);
      store_rows(v0, stage, p.y, p.hidden, row0, rows, hw, p.hidden, lane);
      if (NACC == 2) store_rows(v1, stage, p.y, p.hidden, row0, rows, hw + 64, p.hidden, lane);
      if (ct == 0) combine_list[0] = 0;
      __threadfence();
      named_barrier(1, CONSUMERS);
      if (ct < rows) {   // one thread per token row: count it down; the last of a token's rows combines
        const int t = row_token;
        if (event_arrive(p.tok_cnt + (i64)t * p.n2 + col, -1, 0)) {   // preset by dispatch: counts down
          __threadfence();
          combine_list[1 + atomicAdd(combine_list, 1)] = t;
        }
      }
      named_barrier(1, CONSUMERS);
      const i64 t1 = prof.now();
      prof.record(t0, PROF_GEMM2, ticket);
      const int ncomb = combine_list[0];
      for (int i = warp; i < ncomb; i += CONSUMERS / 32) combine(p, combine_list[1 + i], h0, lane);
      if (ncomb) prof.record(t1, PROF_COMBINE, ticket);
      named_barrier(1, CONSUMERS);
    }
  }
  prof.end(gridDim.x);
}

// Warp 1 of the producer warpgroup: per finished gemm1 tile, make its stores visible at gpu scope and bump
// its row block's counter, while the consumers go on to the next tile.
__device__ void epilogue(const MoeParams& p, Mailbox mb) {
  const int lane = threadIdx.x % 32;
  int mslot = 0;
  u32 mphase = 0;
  for (;;) {
    mbar_wait(mb.full + 8 * mslot, mphase, wait_site(p, 9, 1, -1, mslot), 3 * MELD_WATCHDOG_NS);
    const int* b = mb.box + 2 * mslot;
    const int kind = b[0], rbi = b[1];
    if (kind < 0) break;
    if (lane == 0) {
      __threadfence();   // the consumers' stores (acquired through the mailbox) before the counter
      if (!(MELD_DEBUG_WITHHOLD && rbi == 0)) event_arrive(p.rb_done + rbi, 1, p.n1);
      mbar_arrive(mb.empty + 8 * mslot);
    }
    __syncwarp();
    if ((mslot ^= 1) == 0) mphase ^= 1u;
  }
}

// The family's persistent main (persistent.cuh): the ring, the task and epilogue mailboxes, the roles. A
// programmatic dependent of dispatch: the setup overlaps its tail.
struct MoeFamily {
  using Params = MoeParams;
  static constexpr LaunchKind LAUNCH = LAUNCH_DEPENDENT;
  static constexpr int SMEM_ALIGN = 16;
  struct State {
    u32 raw;
    Ring ring;
    u32 task_full, task_empty;
    Mailbox mb;
    int* slots;
    int* combine_list;   // [count, tokens...]: at most BLOCK_TOKENS tokens
    float* xchg;         // narrow gemm1 tiles: [128][ACC + 1] up values
    __device__ __forceinline__ State(const MoeParams&, unsigned char* smem)
        : raw(smem_addr(smem)), ring(Ring::at<STAGE_BYTES>(raw)), task_full(ring.end()), task_empty(task_full + 16) {
      mb.full = task_empty + 16;
      mb.empty = mb.full + 16;
      slots = (int*)(smem + (mb.empty + 16 - raw));
      mb.box = slots + 2 * TASK_SLOT;
      combine_list = mb.box + 4;
      xchg = (float*)(combine_list + 4 + BLOCK_TOKENS);
    }
  };

  static __device__ __forceinline__ void setup(const MoeParams&, const State& s) {
    if (threadIdx.x == 0) {
      s.ring.init(CONSUMERS / 32);
      for (int st = 0; st < 2; ++st) {
        mbar_init(s.task_full + 8 * st, 1);
        mbar_init(s.task_empty + 8 * st, CONSUMERS / 32);
        mbar_init(s.mb.full + 8 * st, CONSUMERS);
        mbar_init(s.mb.empty + 8 * st, 1);
      }
      fence_mbar_init();
    }
    __syncthreads();
  }

  static __device__ __forceinline__ void run(const MoeParams& p, const State& s) {
    const Ring ring = s.ring;
    const u32 task_full = s.task_full, task_empty = s.task_empty;
    const Mailbox mb = s.mb;
    int* slots = s.slots;
    if (threadIdx.x < 128) {
      regs_dealloc<56>();   // (the producer spilled at 40; the consumers fit 224 without spilling: 56 x 128 + 224 x 256
                            //  threads' registers = the 168 x 384 the CTA starts with)
      if (threadIdx.x == 0) produce(p, ring, task_full, task_empty, slots);
      else if (threadIdx.x / 32 == 1) epilogue(p, mb);
    } else {
      regs_alloc<224>();
      consume(p, ring, task_full, task_empty, slots, mb, s.combine_list, s.xchg);
    }
  }
};

}  // namespace meld

MELD_PERSISTENT_KERNEL(meld_moe_route, meld::MoeRoute, 1024, 0)
MELD_PERSISTENT_KERNEL(meld_moe_scatter, meld::MoeScatter, SCATTER_WARPS * 32, 0)
MELD_PERSISTENT_KERNEL(meld_moe_main, meld::MoeFamily, 384, 1)
