// meld: grouped (shared-prefix, cascade) decode attention: the split-reduce task and event tables of
// meld.scheduler.plan_split_reduce, walked by persistent CTAs (the persistent skeleton, persistent.cuh).
//
// A task is a piece [kv_begin, kv_end) of one producer's (a cascade level's) page table for one group of
// requests and one kv head, for every query row of the group: its event_count requests x GROUP q heads,
// rows r = request * GROUP + head. The CTA streams the piece's KV through one shared ring of STAGES chunks
// of CHUNK tokens (cp.async, K and V as stored, 16-byte chunks XOR-swizzled for ldmatrix), every thread
// issuing its share of the chunk STAGES - 1 ahead, so the loads of the whole CTA stay in flight while the
// warps compute. Scores and P.V run on the tensor cores (m16n8k16, 16 query rows per warp):
//   - a task of more than 16 rows (a shared level): each warp owns a 16-row block and attends every token of
//     every chunk. The planner slices a group's rows into tasks of at most NUM_WARPS x 16 rows, so a level's
//     KV is read once per slice (its slices' tasks are neighbours: mostly from L2);
//   - a task of at most 16 rows (a request's own suffix), a *split* task: the warps split the piece's 16-token
//     tiles and merge their online-softmax states through shared memory at the end of the piece (the stashes).
//     How the tiles reach the warps is the build's choice (MELD_SPLIT_WARP):
//       cta build:  through the CTA's ring above, each chunk's tiles to one set of TILES warps, the stashes laid
//                   over the drained ring;
//       warp build: each of the first SPLIT_WARPS warps streams tiles warp, warp + SPLIT_WARPS, ... of the
//                   piece through a ring of its own (WARP_STAGES tiles of K and V, cp.async, one commit group a
//                   tile, as decode_attention.cuh's warps do), with the page-table lookup of its next tile in
//                   flight, and runs ahead into the CTA's next task while that is a split task too (never past
//                   a task of more rows). Inside a split task a warp meets no CTA barrier until its stash.
// The wgmma build (MELD_PREFIX_WGMMA) attends a task of more rows on wgmma instead: warpgroup w's 64 rows (its
// four warps' row blocks) against a whole chunk at once, S = Q.K^T (m64n64k16, Q from the warps' A fragments, K
// from the ring), the online softmax on S's fragments, O += P.V (m64nHEAD_DIMk16, P from registers, V from the
// ring), each chunk's P.V issued behind the next chunk's S and run during its softmax (attend_wgmma), so the ring
// keeps the chunk before the one attended; the CTA ring is then laid out as wgmma's 128-byte swizzle reads it
// (chunk_off). Split tasks stream through the warps' rings (the warp build) as before.
// Each row's normalised partial goes to slot + r (float) with its log2-sum-exp.
//
// The combine is fired by a count: after a task's partials are stored, a thread per event fences and counts
// the task's arrival at it (a request and kv head); the CTA whose arrival reaches an event's `parts` merges
// the event's parts (part_slot, in the planner's order) into the output, every event it completed at once,
// and resets their counters for the next launch. No CTA waits for another's work: any grid, any residency, is deadlock-free. Events with
// no part (a request with no KV at any level) write zeros and lse = -inf.
// Two builds move a split task's end closer to decode's (a piece's warps merge, then one store): MELD_DEFER_SPLIT_EVENTS
// counts the CTA's split tasks' arrivals after its last task (GTHREADS / GT tasks a round, the events they complete
// merged together), so a split task ends at its partials' store; MELD_DIRECT_SINGLE_PART has a split task that is
// its event's one part write the output and lse itself, from the warps' merge, and never count at that event.
//
// Inside a CTA every wait is a __syncthreads that every thread reaches (all walk the same task list, and every
// loop bound a barrier sits in is the CTA's: chunks of a task, its events), or a warp's own cp.async.wait_group
// and __syncwarp. Shared memory (the warp build; the cta build has only the CTA ring):
//   [0, WRING_BYTES)        the warps' rings (split tasks), overlaid by the CTA ring (tasks of more rows).
// A split task's stashes (each warp's 16 rows of O, GT x GD floats: a warp ring stage's bytes) lie in the warp
// build in the stage of each warp's ring that its next issue will fill: the one it read last, which holds no
// live tile and has no copy in flight, so a warp's copies for the next split task land beside its stash while
// the CTA merges; in the cta build warp w's at w x STASH_BYTES of the drained CTA ring. The rows' m and l are in
// static shared memory.
// The two rings never hold live data at once: a warp's cursor stops at a task of more rows, so when the CTA
// reaches one every tile a warp issued has been waited for and read (the split task's stash barriers order
// those reads before the CTA ring's first copy), and the CTA ring ends drained behind a barrier (wait_group 0,
// __syncthreads) before a split task primes the warps' rings again. A warp's ring stage is rewritten only by
// that warp, after its __syncwarp following the wait for the stage's previous tile, which every lane has then
// read (the ldmatrix of the step before); a stash is written after its warp's __syncwarp following its last
// step (every lane has read that stage) and rewritten (by the warp's next copy, or stash) only after the barrier
// that ends the merge that read it.
//
// NaN or Inf in q or K reaches exactly the rows whose scores they enter; NaN in V the rows whose P.V it
// enters. Tokens past a piece's end are zero-filled in the ring (cp.async with no source bytes), so a stale
// value never meets a zero probability. Defined by the including source: HEAD_DIM, NUM_WARPS, MIN_CTAS,
// NUM_STAGES, CHUNKS_AHEAD, SMEM_BYTES, MELD_MMA_TYPE, GroupedParams, SplitTask, Event (meld.ir.work_table); the warp build also
// MELD_SPLIT_WARP, SPLIT_WARPS, WARP_STAGES; the wgmma build MELD_PREFIX_WGMMA, hopper.cuh, wgmma_rs (m64n64)
// and wgmma_rs_tb (m64nHEAD_DIM); optionally MELD_DEFER_SPLIT_EVENTS, MELD_DIRECT_SINGLE_PART.

namespace meld {

constexpr int GD = HEAD_DIM;
constexpr int GWARPS = NUM_WARPS;
constexpr int GTHREADS = GWARPS * 32;
constexpr int GSTAGES = NUM_STAGES;
constexpr int GT = 16;                  // tokens per tile; query rows per warp's row block
constexpr int CHUNK = 64;               // tokens per ring stage
constexpr int TILES = CHUNK / GT;       // tiles per chunk
constexpr int WARP_SETS = GWARPS / TILES;   // split tasks: chunk c's tiles go to warps [c % WARP_SETS]
constexpr int GKSTEPS = GD / 16;        // k-steps of Q.K^T
constexpr int GNT = GD / 8;             // n8 tiles of P.V (O's columns)
constexpr int CPR = GD / 8;             // 16-byte chunks per token row
constexpr int KV_BYTES = CHUNK * GD * 2;    // one chunk of K (or V)
constexpr int STAGE_BYTES = 2 * KV_BYTES;
constexpr int ROW_TILES = GD <= 128 ? TILES : 1;   // tiles a row block attends per softmax step (registers)
static_assert(GD % 64 == 0 && GD <= 256, "head_dim must be 64, 128 or 256");
static_assert(GWARPS % TILES == 0, "a CTA's warps split a chunk's tiles evenly");
static_assert((CHUNK * CPR) % GTHREADS == 0, "every thread issues the same number of a chunk's copies");
static_assert(GSTAGES >= 2 && GSTAGES * STAGE_BYTES <= SMEM_BYTES, "SMEM_BYTES (from Python) is too small");

#ifndef MELD_SPLIT_WARP   // (the cta build)
#define MELD_SPLIT_WARP 0
#define SPLIT_WARPS NUM_WARPS
#define WARP_STAGES 2
#endif
constexpr bool WARP_STREAM = MELD_SPLIT_WARP;   // split tasks through the warps' own rings
constexpr int SWARPS = SPLIT_WARPS;             // warps that attend a split task's tiles (and stash)
constexpr int WSTAGES = WARP_STAGES;            // tiles a warp's ring holds
constexpr int TILE_BYTES = GT * GD * 2;         // one tile of K (or V)
constexpr int WSTAGE_BYTES = 2 * TILE_BYTES;
constexpr int WRING_BYTES = WARP_STREAM ? SWARPS * WSTAGES * WSTAGE_BYTES : 0;
constexpr int STASH_BYTES = GT * GD * 4;         // a warp's stash of O: its 16 rows, float
static_assert(STASH_BYTES == WSTAGE_BYTES, "a stash fills one stage of a warp's ring");
constexpr int RPP = 32 / CPR;                    // token rows a warp's cp.async pass covers
constexpr int PASSES = GT / RPP;
static_assert(SWARPS >= 1 && SWARPS <= GWARPS && WSTAGES >= 2, "a warp ring needs two stages");
static_assert(WRING_BYTES <= SMEM_BYTES && (WARP_STREAM || GWARPS * STASH_BYTES <= GSTAGES * STAGE_BYTES),
              "the warps' rings (the cta build: the stashes) must fit");
static_assert(CPR <= 32 && 32 % CPR == 0, "a token row's chunks fit a warp's lanes");
#ifndef MELD_PREFIX_WGMMA
#define MELD_PREFIX_WGMMA 0
#endif
#ifndef MELD_DEFER_SPLIT_EVENTS
#define MELD_DEFER_SPLIT_EVENTS 0
#endif
constexpr bool DEFER_SPLIT = MELD_DEFER_SPLIT_EVENTS;   // split tasks count (and merge) after the CTA's last task
#ifndef MELD_DIRECT_SINGLE_PART
#define MELD_DIRECT_SINGLE_PART 0
#endif
constexpr bool DIRECT_SINGLE = MELD_DIRECT_SINGLE_PART;   // a split task that is its event's one part writes the output
constexpr bool PREFIX_WGMMA = MELD_PREFIX_WGMMA;   // tasks of more rows on wgmma, a warpgroup's 64 rows at once
constexpr int WG_ROWS = 64;                        // wgmma's M
constexpr int SW_BLOCK = CHUNK * 128;              // the wgmma build: a chunk's 64-channel column block (bytes)
static_assert(!PREFIX_WGMMA || (WARP_STREAM && GWARPS * GT % WG_ROWS == 0 && CHUNK == 64),
              "the wgmma build: split tasks on the warps' rings, whole warpgroups, a chunk one m64n64 tile");

// Byte offset of 16-byte chunk c of token row r in a K or V chunk: XOR swizzle, so ldmatrix's eight rows
// at one chunk column hit eight different bank groups.
__device__ __forceinline__ u32 kv_off(int r, int c) { return r * (GD * 2) + ((c ^ (r & 7)) << 4); }

// Byte offset of 16-byte chunk c of token row r in a chunk of the CTA ring: kv_off, or (the wgmma build) wgmma's
// 128-byte swizzle, from a 1 KiB boundary: column blocks of 64 channels (SW_BLOCK bytes: CHUNK rows of 128 bytes,
// chunk c & 7 at c & 7 ^ r & 7), so a block's 8-row atoms lie 1 KiB apart, as the K-major (K) and MN-major (V)
// descriptors read them.
__device__ __forceinline__ u32 chunk_off(int r, int c) {
  return PREFIX_WGMMA ? (c >> 3) * SW_BLOCK + r * 128 + (((c & 7) ^ (r & 7)) << 4) : kv_off(r, c);
}

// One warp's 16 query rows of a task: the rows' online-softmax state over the tokens it attended.
struct RowBlock {
  float o[GNT][4];   // O: n8 tile j, (row g, cols 2t, 2t+1), (row g + 8, ...)
  float m[2], l[2];  // rows g and g + 8 (log2 domain; l this thread's columns, reduced at the end)
};

__device__ __forceinline__ void reset_rows(RowBlock& rb) {
#pragma unroll
  for (int n = 0; n < GNT; ++n) rb.o[n][0] = rb.o[n][1] = rb.o[n][2] = rb.o[n][3] = 0.f;
  rb.m[0] = rb.m[1] = neg_inf();
  rb.l[0] = rb.l[1] = 0.f;
}

// Q's A fragments of rows row0 .. row0 + 15 of the task (rows past `rows` are padding: zero).
__device__ __forceinline__ void load_q_rows(const GroupedParams& p, int kv_head, int q0, int row0, int rows,
                                           u32 (&qf)[GKSTEPS][4], int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int h = 0; h < 2; ++h) {   // rows g and g + 8: A fragment registers (0, 2) and (1, 3)
    const int r = row0 + g + 8 * h;
    const u16* q = r < rows ? p.q + ((i64)(q0 + r / p.group_size) * p.num_qo_heads + kv_head * p.group_size +
                                     r % p.group_size) * GD
                            : nullptr;
#pragma unroll
    for (int k = 0; k < GKSTEPS; ++k) {
      qf[k][h] = q ? *reinterpret_cast<const u32*>(q + k * 16 + 2 * t) : 0u;
      qf[k][h + 2] = q ? *reinterpret_cast<const u32*>(q + k * 16 + 8 + 2 * t) : 0u;
    }
  }
}

// Task i's row, and Q's A fragments of this warp's rows of it (a split task's 16; a task of more rows, the warp's
// block). LOAD_AHEAD: loaded while the task before ends (its stashes, merge and stores), so the two dependent L2
// round trips at a task's start overlap work (head_dim 256 has no registers to hold Q across that end).
constexpr bool LOAD_AHEAD = GD <= 128;
__device__ __forceinline__ void load_task(const GroupedParams& p, int i, int batch, int warp, SplitTask& tk,
                                          u32 (&qf)[GKSTEPS][4], int lane) {
  tk = load_splittask(p.tasks, p.task_capacity, i);
  const int rows = tk.event_count * p.group_size;
  load_q_rows(p, tk.kv_head, tk.event_first - tk.kv_head * batch, rows <= GT ? 0 : warp * GT, rows, qf, lane);
}

// The page of token `pos` of a piece (-1 at or past `end`) and its place in the page: looked up here, first used by
// kv_row_at, so that the page-table load stays in flight until the row is needed.
__device__ __forceinline__ int kv_page(const GroupedParams& p, const int* pages, int pos, int end, int& slot) {
  slot = 0;
  if (pos >= end) return -1;
  const int pg = pos / p.page_size;
  slot = pos - pg * p.page_size;
  return pages[pg];
}
// The K row (index of its GD elements from p.kv; V's is page_size x num_kv_heads rows on) of a token kv_page found,
// or -1. (int: a cache of 2^31 rows of 64 16-bit channels is larger than a GPU's memory)
__device__ __forceinline__ int kv_row_at(const GroupedParams& p, int page, int slot, int kv_head) {
  return page < 0 ? -1 : ((page * 2) * p.page_size + slot) * p.num_kv_heads + kv_head;
}
__device__ __forceinline__ int kv_row(const GroupedParams& p, const int* pages, int kv_head, int pos, int end) {
  int slot;
  const int page = kv_page(p, pages, pos, end, slot);
  return kv_row_at(p, page, slot, kv_head);
}

// Every thread's share of a chunk into ring stage `dst`, its tokens' rows from `rows` (-1: zeros). The rows are
// looked up a chunk ahead (stream), so a copy never waits on the page table.
__device__ __forceinline__ void issue_chunk(const GroupedParams& p, const int* rows, u32 dst) {
  const i64 v_rows = (i64)p.page_size * p.num_kv_heads;   // V's rows follow K's in a page
#pragma unroll
  for (int it = 0; it < CHUNK * CPR / GTHREADS; ++it) {
    const int i = threadIdx.x + it * GTHREADS, tok = i / CPR, c = i - tok * CPR;
    const int row = rows[tok];
    const u16* k = p.kv + (i64)max(row, 0) * GD + c * 8;
    cp_async_16_row(dst + chunk_off(tok, c), k, row);
    cp_async_16_row(dst + KV_BYTES + chunk_off(tok, c), k + v_rows * GD, row);
  }
}

// The online softmax of a warp's 16 rows over NT n8 tiles of scores `s` (mma's C fragments; a wgmma accumulator
// holds a warp's rows the same way): scaled, masked at or past `valid`, exponentiated in place (P), the rows' m and
// l updated, and `alpha`, the factor O's rows take to the new maximum (rescale_rows), returned.
template <int NT>
__device__ __forceinline__ void softmax_scores(const GroupedParams& p, RowBlock& rb, float (&s)[NT][4], int valid, int t,
                                               float (&alpha)[2]) {
  float mx[2] = {rb.m[0], rb.m[1]};
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int tok = n * 8 + 2 * t + (c & 1);
      const float x = s[n][c] * p.sm_scale_log2;   // a non-finite score (Inf or NaN in q or K) makes the row NaN
      s[n][c] = tok < valid ? (isinf(x) ? __int_as_float(0x7fc00000) : x) : neg_inf();
      mx[c >> 1] = fmaxf(mx[c >> 1], s[n][c]);
    }
  float sum[2] = {0.f, 0.f};
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    const float base = mx[r] == neg_inf() ? 0.f : mx[r];   // a row with no finite score yet
    alpha[r] = exp2_approx(rb.m[r] - base);
    rb.m[r] = mx[r];
    mx[r] = base;
  }
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      s[n][c] = exp2_approx(s[n][c] - mx[c >> 1]);
      sum[c >> 1] += s[n][c];
    }
#pragma unroll
  for (int r = 0; r < 2; ++r) rb.l[r] = rb.l[r] * alpha[r] + sum[r];
}

__device__ __forceinline__ void rescale_rows(RowBlock& rb, const float (&alpha)[2]) {
#pragma unroll
  for (int n = 0; n < GNT; ++n) {
    rb.o[n][0] *= alpha[0]; rb.o[n][1] *= alpha[0];
    rb.o[n][2] *= alpha[1]; rb.o[n][3] *= alpha[1];
  }
}

// softmax_scores, and O's rows rescaled at once.
template <int NT>
__device__ __forceinline__ void softmax_step(const GroupedParams& p, RowBlock& rb, float (&s)[NT][4], int valid, int t) {
  float alpha[2];
  softmax_scores(p, rb, s, valid, t, alpha);
  rescale_rows(rb, alpha);
}

// One online-softmax step of a warp's 16 rows over NS tiles staged at `stage` (K) and `vstage` (V), from tile
// `tile0` on; tokens at or past `valid` (counted from the step's first) are masked out.
template <int NS>
__device__ __forceinline__ void attend(const GroupedParams& p, RowBlock& rb, const u32 (&qf)[GKSTEPS][4], u32 stage,
                                       u32 vstage, int tile0, int valid, int lane) {
  const int g = lane >> 2, t = lane & 3;
  const int krow = (lane & 7) + ((lane >> 4) << 3), kch = (lane >> 3) & 1;   // ldmatrix: K as B (n = tokens)
  const int vrow = (lane & 7) + (((lane >> 3) & 1) << 3), vch = lane >> 4;   // .trans: V as B (k = tokens)
  float s[2 * NS][4];
#pragma unroll
  for (int j = 0; j < NS; ++j) {
    s[2 * j][0] = s[2 * j][1] = s[2 * j][2] = s[2 * j][3] = 0.f;
    s[2 * j + 1][0] = s[2 * j + 1][1] = s[2 * j + 1][2] = s[2 * j + 1][3] = 0.f;
#pragma unroll
    for (int k = 0; k < GKSTEPS; ++k) {
      u32 b[4];
      ldmatrix_x4(b, stage + kv_off((tile0 + j) * GT + krow, 2 * k + kch));
      mma_16816(s[2 * j], qf[k][0], qf[k][1], qf[k][2], qf[k][3], b[0], b[1]);
      mma_16816(s[2 * j + 1], qf[k][0], qf[k][1], qf[k][2], qf[k][3], b[2], b[3]);
    }
  }
  softmax_step(p, rb, s, valid, t);
#pragma unroll
  for (int j = 0; j < NS; ++j) {
    const u32 a0 = pack2(s[2 * j][0], s[2 * j][1]), a1 = pack2(s[2 * j][2], s[2 * j][3]),
              a2 = pack2(s[2 * j + 1][0], s[2 * j + 1][1]), a3 = pack2(s[2 * j + 1][2], s[2 * j + 1][3]);
#pragma unroll
    for (int n = 0; n < GNT; n += 2) {
      u32 b[4];
      ldmatrix_x4_trans(b, vstage + kv_off((tile0 + j) * GT + vrow, n + vch));
      mma_16816(rb.o[n], a0, a1, a2, a3, b[0], b[1]);
      mma_16816(rb.o[n + 1], a0, a1, a2, a3, b[2], b[3]);
    }
  }
}

#if MELD_PREFIX_WGMMA
// The wgmma build's step c of a task of more rows: the warpgroup's 64 rows (each warp's 16 in rb and qf, as attend
// has them) over the whole chunk at `stage` (K; V KV_BYTES on), tokens at or past `valid` masked out. Every thread
// of the warpgroup calls it (wgmma is warpgroup-wide), its rows padding or not. With PV (every step but the first)
// the P.V of the chunk before (P in `pa`, V at `vprev`) is issued behind S = Q.K^T (m64n64k16, Q from the warps' A
// fragments) and runs while S's online softmax does (FlashAttention-3's overlap inside a warpgroup): O takes the
// new maximum's factor once that P.V is done, and this chunk's P is left in `pa` for the next step (or
// attend_wgmma_last). So O holds the rows' sum up to the chunk before, at the maximum up to this one. (PV is a
// template argument: a run-time branch around the P.V's wgmmas alone made ptxas serialise every wgmma of the kernel,
// C7520; one around the whole step does not.)
template <bool PV>
__device__ __forceinline__ void attend_wgmma(const GroupedParams& p, RowBlock& rb, const u32 (&qf)[GKSTEPS][4],
                                             u32 (&pa)[TILES][4], u32 stage, u32 vprev, int valid, int lane) {
  float s[2 * TILES][4];   // S's accumulator: n8 tile n of the warp's rows, as mma's C fragments
  auto& sa = reinterpret_cast<float (&)[2 * TILES * 4]>(s);
  auto& oa = reinterpret_cast<float (&)[GNT * 4]>(rb.o);
  wgmma_fence();
#pragma unroll
  for (int k = 0; k < GKSTEPS; ++k)   // K-major B: k16 step k is 32 bytes into column block k / 4
    wgmma_rs(sa, qf[k], wgmma_desc(stage + (k >> 2) * SW_BLOCK + (k & 3) * 32), k > 0);
  wgmma_commit();
  if (PV) {
#pragma unroll
    for (int j = 0; j < TILES; ++j)   // MN-major B: 16 tokens are two 1 KiB atoms; column blocks SW_BLOCK apart
      wgmma_rs_tb(oa, pa[j], wgmma_desc_mn(vprev + j * 2048, SW_BLOCK));
    wgmma_commit();
  }
  wgmma_wait<PV ? 1 : 0>();   // S is done (the P.V may run on)
  fence_regs(sa);   // (S is read after its group is done)
  float alpha[2];
  softmax_scores(p, rb, s, valid, lane & 3, alpha);
  wgmma_wait<0>();
  fence_regs(oa);   // (O, and pa, are rewritten only after the P.V that read them)
  rescale_rows(rb, alpha);
#pragma unroll
  for (int j = 0; j < TILES; ++j) {   // P's A fragments, k16 step j: tokens 16j .. 16j + 15
    pa[j][0] = pack2(s[2 * j][0], s[2 * j][1]);
    pa[j][1] = pack2(s[2 * j][2], s[2 * j][3]);
    pa[j][2] = pack2(s[2 * j + 1][0], s[2 * j + 1][1]);
    pa[j][3] = pack2(s[2 * j + 1][2], s[2 * j + 1][3]);
    fence_regs(pa[j]);
  }
  fence_regs(oa);   // (O is rescaled before the fence and the wgmmas that accumulate into it)
}

// The last chunk's P.V (V at `vlast`), after its attend_wgmma step.
__device__ __forceinline__ void attend_wgmma_last(RowBlock& rb, const u32 (&pa)[TILES][4], u32 vlast) {
  auto& oa = reinterpret_cast<float (&)[GNT * 4]>(rb.o);
  wgmma_fence();
#pragma unroll
  for (int j = 0; j < TILES; ++j) wgmma_rs_tb(oa, pa[j], wgmma_desc_mn(vlast + j * 2048, SW_BLOCK));
  wgmma_commit();
  wgmma_wait<0>();
  fence_regs(oa);
}
#endif

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// The warp's rows normalised into their partial slots (slot + r) with their log2-sum-exp.
__device__ __forceinline__ void store_rows(const GroupedParams& p, const SplitTask& tk, const RowBlock& rb, int row0,
                                           int rows, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float l = quad_sum(rb.l[h]);
    const int r = row0 + g + 8 * h;
    if (r >= rows) continue;
    const float inv = 1.f / l;   // a piece has tokens: l >= 1, or NaN
    float* o = p.part_o + (i64)(tk.slot + r) * GD;
#pragma unroll
    for (int n = 0; n < GNT; ++n)
      *reinterpret_cast<float2*>(o + n * 8 + 2 * t) = make_float2(rb.o[n][2 * h] * inv, rb.o[n][2 * h + 1] * inv);
    if (t == 0) p.part_lse[tk.slot + r] = rb.m[h] + log2_approx(l);
  }
}

// Tasks of at most 16 rows (a request's own suffix: one request's q heads) leave the CTA's other warps no
// rows: the warps split the piece's tiles instead and merge their states through shared memory: each warp's O
// in a stash of STASH_BYTES (where: the comment at the top), 8-float groups of row r XOR-swizzled by r & 7 so
// that a warp's stores of its rows g and g + 8 hit every bank evenly; its m and l in StashRows.
struct StashRows {
  float m[GWARPS][GT], l[GWARPS][GT];
  u32 at[GWARPS];   // each stashing warp's stash: its byte offset from the ring's start
};
__device__ __forceinline__ int stash_col(int r, int c) { return c ^ ((r & 7) << 3); }

__device__ __forceinline__ void stash_rows(const RowBlock& rb, unsigned char* ring, u32 at, StashRows& sr, int warp,
                                           int lane) {
  const int g = lane >> 2, t = lane & 3;
  float* o = reinterpret_cast<float*>(ring + at);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float l = quad_sum(rb.l[h]);
    const int r = g + 8 * h;
#pragma unroll
    for (int n = 0; n < GNT; ++n)
      *reinterpret_cast<float2*>(o + r * GD + stash_col(r, n * 8 + 2 * t)) = make_float2(rb.o[n][2 * h], rb.o[n][2 * h + 1]);
    if (t == 0) {
      sr.m[warp][r] = rb.m[h];
      sr.l[warp][r] = l;
    }
  }
  if (lane == 0) sr.at[warp] = at;
}

// Outputs acc * inv (channels d .. d + 3 of head h of request b and kv head kv_head) into out, and when d == 0 the
// head's lse (natural), lse() computed only then.
template <class Lse>
__device__ __forceinline__ void store_out4(const GroupedParams& p, int b, int kv_head, int h, int d, const float4& acc,
                                           float inv, Lse lse) {
  const i64 row = (i64)b * p.num_qo_heads + kv_head * p.group_size + h;
  uint2 packed;
  packed.x = pack2(acc.x * inv, acc.y * inv);
  packed.y = pack2(acc.z * inv, acc.w * inv);
  *reinterpret_cast<uint2*>(p.out + row * GD + d) = packed;
  if (d == 0 && p.lse != nullptr) p.lse[row] = lse();
}

// Every thread of the CTA, after the SWARPS warps' stash_rows: rows r < rows merged across them into their slots
// (MELD_DIRECT_SINGLE_PART: a row whose event has this task as its one part into the output, as a merge of that one
// part would write it).
__device__ __forceinline__ void merge_warps(const GroupedParams& p, const SplitTask& tk, int rows,
                                            const unsigned char* ring, const StashRows& sr) {
  for (int i = threadIdx.x; i < rows * (GD / 4); i += GWARPS * 32) {
    const int r = i / (GD / 4), d = (i - r * (GD / 4)) * 4;
    const int e = tk.event_first + r / p.group_size;   // (MELD_DIRECT_SINGLE_PART: its row read before the stashes')
    const bool whole = DIRECT_SINGLE && load_event(p.events, p.event_capacity, e).parts == 1;
    float mx = neg_inf();
#pragma unroll
    for (int w = 0; w < SWARPS; ++w) mx = fmaxf(mx, sr.m[w][r]);
    const float base = mx == neg_inf() ? 0.f : mx;   // (every score NaN: the l's carry it)
    float l = 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < SWARPS; ++w) {   // a warp with no tile: m = -inf, l = 0, O = 0, weight 0
      const float c = exp2_approx(sr.m[w][r] - base);
      const float4 v = *reinterpret_cast<const float4*>(reinterpret_cast<const float*>(ring + sr.at[w]) + r * GD +
                                                        stash_col(r, d));
      l += c * sr.l[w][r];
      acc.x += c * v.x; acc.y += c * v.y; acc.z += c * v.z; acc.w += c * v.w;
    }
    const float inv = 1.f / l;
    if (whole) {
      const int batch = p.plan_info[0];
      store_out4(p, e % batch, e / batch, r % p.group_size, d, acc, inv, [=] { return (base + log2_approx(l)) * kLn2; });
    } else {
      *reinterpret_cast<float4*>(p.part_o + (i64)(tk.slot + r) * GD + d) =
          make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
      if (d == 0) p.part_lse[tk.slot + r] = base + log2_approx(l);
    }
  }
}

// The warp build: one warp's walk over its tiles of the CTA's split tasks, ahead of its compute loop (tiles warp,
// warp + SWARPS, ... of task i, then of task i + 1 while that is a split task too), with the page-table lookup
// of the next tile in flight.
struct TileCursor {
  int i;                   // the task walked
  int pos, end;            // its next tile's first token, and the end of its piece
  int kv_head, pages;      // its kv head, and its group's pages: kv_indices + pages
  int page, slot;          // this lane's token (lane & 15) of the next tile: its page (-1 past the piece), and place
                           // in it (kv_page: the row is computed at the tile's issue)
  bool live;
};

// The cursor at task c.i's first tile for this warp; false (and not live) if the task has more than 16 rows.
__device__ __forceinline__ bool cursor_enter(const GroupedParams& p, TileCursor& c, int warp) {
  const SplitTask tk = load_splittask(p.tasks, p.task_capacity, c.i);
  c.pos = tk.kv_begin + warp * GT;
  c.end = tk.kv_end;
  c.kv_head = tk.kv_head;
  c.pages = tk.pages;
  c.live = tk.event_count * p.group_size <= GT;
  return c.live;
}

// The cursor at its next tile (at or after c.pos, in the CTA's tasks before `last`), its lane's row looked up.
__device__ __forceinline__ void cursor_seek(const GroupedParams& p, TileCursor& c, int last, int warp, int lane) {
  while (c.live && c.pos >= c.end)   // past this task's tiles: the next task, if a split task
    c.live = ++c.i < last && cursor_enter(p, c, warp);
  if (!c.live) return;
  c.page = kv_page(p, p.kv_indices + c.pages, c.pos + (lane & 15), c.end, c.slot);
}

// The cursor's tile into the warp's ring stage at `dst` (K, then V TILE_BYTES on; rows past the piece: zeros),
// the cursor moved on: one commit group per call, empty once the walk is done.
__device__ __forceinline__ void issue_tile(const GroupedParams& p, TileCursor& c, int last, u32 dst, int warp, int lane) {
  if (c.live) {
    const u16* k = p.kv + (lane % CPR) * 8;
    const i64 v_rows = (i64)p.page_size * p.num_kv_heads;   // V's rows follow K's in a page
    const int lane_row = kv_row_at(p, c.page, c.slot, c.kv_head);
#pragma unroll
    for (int it = 0; it < PASSES; ++it) {
      const int r = lane / CPR + it * RPP;
      const int row = __shfl_sync(0xffffffffu, lane_row, r);
      const u16* src = k + (i64)max(row, 0) * GD;
      cp_async_16_row(dst + kv_off(r, lane % CPR), src, row);
      cp_async_16_row(dst + TILE_BYTES + kv_off(r, lane % CPR), src + v_rows * GD, row);
    }
    c.pos += SWARPS * GT;
    cursor_seek(p, c, last, warp, lane);
  }
  cp_async_commit();
}

// Channels d .. d + 3 of head h of event e (ev: its row, as the arrival that completed it read it): its parts
// merged (in part_slot order) into out, and lse when d == 0. A merge waits on L2 more than it computes, so parts
// are read MERGE_PARTS at a time, all their slots and then all their lse and O at once, and folded into a running
// maximum and sum: two round trips for an event of up to MERGE_PARTS parts, two more for each MERGE_PARTS after;
// one, where merge_events staged the event's slots (`staged`: its list of at most MERGE_PARTS, or null). A merge is
// bound by its instructions too, and every slot of a round costs its instructions, used or not: an event of at most
// 4 (8) parts, a cascade's usual 2, takes rounds of 4 (8) (merge_row4; head_dim <= 128: 256 spilled 40 B), with the
// same bits, since the slots past its parts add exact zeros.
constexpr int MERGE_PARTS = GD <= 128 ? 16 : 8;   // (head_dim 256 has no registers for 16)
template <int PARTS>
__device__ __forceinline__ void merge_row4_in(const GroupedParams& p, int e, const Event& ev, int h, int d,
                                              const int* staged) {
  const int batch = p.plan_info[0], b = e % batch, kv_head = e / batch;
  float mx = neg_inf(), sum = 0.f;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int k0 = 0; k0 < ev.parts; k0 += PARTS) {
    int slot[PARTS];
    float lse[PARTS];
    float4 v[PARTS];
#pragma unroll
    for (int k = 0; k < PARTS; ++k)
      slot[k] = k0 + k < ev.parts ? (staged ? staged[k0 + k] : p.part_slot[ev.part_first + k0 + k]) + h : -1;
#pragma unroll
    for (int k = 0; k < PARTS; ++k) {   // (a missing part: weight exp2(-inf) = 0 on zeros)
      lse[k] = slot[k] >= 0 ? ld_cg(p.part_lse + slot[k]) : neg_inf();
      v[k] = slot[k] >= 0 ? ld_cg4(p.part_o + (i64)slot[k] * GD + d) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    float top = mx;
#pragma unroll
    for (int k = 0; k < PARTS; ++k) top = fmaxf(top, lse[k]);
    const float base = top == neg_inf() ? 0.f : top;
    const float keep = exp2_approx(mx - base);   // the parts before, to the new maximum (0 when there were none)
    sum *= keep;
    acc.x *= keep; acc.y *= keep; acc.z *= keep; acc.w *= keep;
#pragma unroll
    for (int k = 0; k < PARTS; ++k) {
      const float w = exp2_approx(lse[k] - base);
      sum += w;
      acc.x += w * v[k].x; acc.y += w * v[k].y; acc.z += w * v[k].z; acc.w += w * v[k].w;
    }
    mx = base;
  }
  const float inv = ev.parts ? 1.f / sum : 0.f;   // no part: zeros, lse -inf
  store_out4(p, b, kv_head, h, d, acc, inv, [=] { return ev.parts ? (mx + log2_approx(sum)) * kLn2 : neg_inf(); });
}
__device__ __forceinline__ void merge_row4(const GroupedParams& p, int e, const Event& ev, int h, int d,
                                           const int* staged) {
  if (GD <= 128 && ev.parts <= 4)
    merge_row4_in<4>(p, e, ev, h, d, staged);
  else if (GD <= 128 && ev.parts <= 8)
    merge_row4_in<8>(p, e, ev, h, d, staged);
  else
    merge_row4_in<MERGE_PARTS>(p, e, ev, h, d, staged);
}

// The n events of `list` (their rows in `rows`) merged by the CTA's threads together (one head's 4 channels
// each), their counters reset for the next launch: a task that completes a whole slice of events merges them all
// at once. Every thread of the CTA calls it. The part slots of the first STAGED_EVENTS events of at most
// MERGE_PARTS parts are read first, all at once, into `staged` (a thread merges several (head, channels) of
// different events one after another, each of which would read its event's slots again: a round trip each).
// (head_dim 256 stages none: the staged list's pointer spilled its registers.)
constexpr int STAGED_EVENTS = GD <= 128 ? 64 : 0;
struct StagedSlots { int slot[STAGED_EVENTS > 0 ? STAGED_EVENTS : 1][MERGE_PARTS]; };
__device__ __forceinline__ void merge_events(const GroupedParams& p, const int* list, const Event* rows, int n,
                                             StagedSlots& staged) {
  if (n == 0) return;   // (n is the CTA's: every thread returns, or none)
  const auto fits = [&](int k) { return k < STAGED_EVENTS && rows[k].parts <= MERGE_PARTS; };
  if (STAGED_EVENTS > 0) {
    for (int i = threadIdx.x; i < min(n, STAGED_EVENTS) * MERGE_PARTS; i += GTHREADS) {
      const int k = i / MERGE_PARTS, q = i - k * MERGE_PARTS;
      if (fits(k) && q < rows[k].parts) staged.slot[k][q] = p.part_slot[rows[k].part_first + q];
    }
    __syncthreads();
  }
  const int per = p.group_size * (GD / 4);
  for (int i = threadIdx.x; i < n * per; i += GTHREADS) {
    const int k = i / per, j = i - k * per;
    merge_row4(p, list[k], rows[k], j / (GD / 4), (j % (GD / 4)) * 4, fits(k) ? staged.slot[k] : nullptr);
  }
  for (int k = threadIdx.x; k < n; k += GTHREADS) event_reset(p.counters + list[k]);
}

// One round of arrivals, after the barrier-ordered stores of the partials they cover: each thread for which
// `pick(e)` holds arrives once at event e (`direct`: unless the event has one part, whose split task wrote the
// output itself, MELD_DIRECT_SINGLE_PART), and the CTA merges every event these arrivals completed at once
// (merge_events); `unit` names the round's task in the profile.
template <class Pick>
__device__ __forceinline__ void arrive_round(const GroupedParams& p, Pick pick, bool direct, int* fired,
                                             Event* fired_rows, int& n_fired, StagedSlots& staged, Profiler& prof,
                                             int unit) {
  if (threadIdx.x == 0) n_fired = 0;
  __syncthreads();   // every row of the task is stored
  int e;
  if (pick(e)) {
    __threadfence();   // the CTA's partials, stored before the barrier, before this count
    const Event ev = load_event(p.events, p.event_capacity, e);
    if (!(direct && ev.parts == 1) && event_arrive(p.counters + e, 1u, (unsigned)ev.parts)) {
      __threadfence();   // the other parts' partials, counted before ours, are seen (acquire)
      const int k = atomicAdd(&n_fired, 1);
      fired[k] = e;
      fired_rows[k] = ev;
    }
  }
  __syncthreads();
  const i64 t1 = prof.now();
  merge_events(p, fired, fired_rows, n_fired, staged);
  if (n_fired > 0) prof.record(t1, PROF_MERGE_HBM, unit);
  __syncthreads();   // (fired, n_fired and the staged slots are rewritten next)
}

// The persistent family (persistent.cuh): a plain launch; the CTA walks its tasks, then counts and merges.
struct GroupedFamily {
  using Params = GroupedParams;
  static constexpr LaunchKind LAUNCH = LAUNCH_PLAIN;
  static constexpr int SMEM_ALIGN = 128;
  struct State {
    unsigned char* smem;   // the ring; a split task's warp stashes once it is drained
    // (the wgmma build: from the first 1 KiB boundary, where the 128-byte swizzle's pattern starts)
    __device__ __forceinline__ State(const GroupedParams&, unsigned char* s)
        : smem(PREFIX_WGMMA ? s + ((1024u - (smem_addr(s) & 1023u)) & 1023u) : s) {}
  };

  static __device__ __forceinline__ void setup(const GroupedParams&, const State&) {}

  // A task's piece streamed through the ring, attended by the warp's 16 rows (a split task: the warp's tiles
  // of every chunk), the ring drained at the end.
  static __device__ __forceinline__ void stream(const GroupedParams& p, const SplitTask& tk, const int* pages,
                                                bool split, bool active, RowBlock& rb, const u32 (&qf)[GKSTEPS][4],
                                                u32 ring, int warp, int lane) {
    // AHEAD chunks in flight (GroupedKernelConfig.chunks_ahead): GSTAGES - 1, or (the wgmma build, whose P.V reads
    // a chunk until the next step) GSTAGES - 2. rows[c % GSTAGES]: chunk c's token rows, looked up by the first CHUNK
    // threads before its issue (chunk c + GSTAGES's lookup is in flight while chunk c is attended; the barrier of
    // step c + 1 publishes it).
    constexpr int AHEAD = CHUNKS_AHEAD;
    static_assert(AHEAD >= 1 && AHEAD <= GSTAGES - 1 - PREFIX_WGMMA, "a chunk in flight, and none over one still read");
    __shared__ int rows[GSTAGES][CHUNK];
    const int chunks = (tk.kv_end - tk.kv_begin + CHUNK - 1) / CHUNK;
    if (threadIdx.x < CHUNK) {   // (every page looked up before the first store: a store to `rows` between them kept
      int page[GSTAGES], slot[GSTAGES];   // each lookup behind the one before, one round trip each)
#pragma unroll
      for (int c = 0; c < GSTAGES; ++c)
        page[c] = kv_page(p, pages, tk.kv_begin + c * CHUNK + threadIdx.x, tk.kv_end, slot[c]);
#pragma unroll
      for (int c = 0; c < GSTAGES; ++c) rows[c][threadIdx.x] = kv_row_at(p, page[c], slot[c], tk.kv_head);
    }
    __syncthreads();
#pragma unroll
    for (int c = 0; c < AHEAD; ++c) {
      if (c < chunks) issue_chunk(p, rows[c], ring + c * STAGE_BYTES);
      cp_async_commit();
    }
    u32 pa[TILES][4];   // (the wgmma build) the P of the chunk before, for its P.V
    for (int c = 0; c < chunks; ++c) {
      cp_async_wait<AHEAD - 1>();
      if (PREFIX_WGMMA) fence_proxy_async();   // (this thread's copies, before wgmma reads them)
      __syncthreads();   // chunk c has landed for every thread, chunk c + AHEAD - GSTAGES is read (its stage is free:
                         // the wgmma build's P.V of it was waited for at step c - 1), and chunk c + AHEAD's rows are
                         // in `rows`
      const int next = c + AHEAD;
      if (next < chunks) issue_chunk(p, rows[next % GSTAGES], ring + (next % GSTAGES) * STAGE_BYTES);
      cp_async_commit();
      // Chunk c + GSTAGES's row of this thread's token (its stage's rows were read at step c - 1): its page looked up
      // before the attention, the row computed and stored after it (computed at once, it waited on the lookup before
      // the attention could start). (head_dim 256 has no register to spare across the attention: it looks up after
      // it.)
      constexpr bool HOLD = GD <= 128;
      int ahead = -1, slot = 0;
      if (HOLD && threadIdx.x < CHUNK && c + GSTAGES < chunks)
        ahead = kv_page(p, pages, tk.kv_begin + (c + GSTAGES) * CHUNK + threadIdx.x, tk.kv_end, slot);
      const u32 stage = ring + (c % GSTAGES) * STAGE_BYTES;
      const int valid = tk.kv_end - (tk.kv_begin + c * CHUNK);
      if (split) {
        const int tile = warp % TILES;
        if (c % WARP_SETS == warp / TILES && valid > tile * GT) attend<1>(p, rb, qf, stage, stage + KV_BYTES, tile, valid - tile * GT, lane);
      } else if (active) {
#if MELD_PREFIX_WGMMA
        const u32 vprev = ring + ((c + GSTAGES - 1) % GSTAGES) * STAGE_BYTES + KV_BYTES;
        if (c == 0)
          attend_wgmma<false>(p, rb, qf, pa, stage, vprev, valid, lane);
        else
          attend_wgmma<true>(p, rb, qf, pa, stage, vprev, valid, lane);
#else
#pragma unroll
        for (int j = 0; j < TILES; j += ROW_TILES)
          if (valid > j * GT) attend<ROW_TILES>(p, rb, qf, stage, stage + KV_BYTES, j, valid - j * GT, lane);
#endif
      }
      if (HOLD)
        ahead = kv_row_at(p, ahead, slot, tk.kv_head);
      else if (threadIdx.x < CHUNK && c + GSTAGES < chunks)
        ahead = kv_row(p, pages, tk.kv_head, tk.kv_begin + (c + GSTAGES) * CHUNK + threadIdx.x, tk.kv_end);
      if (threadIdx.x < CHUNK) rows[c % GSTAGES][threadIdx.x] = ahead;
    }
#if MELD_PREFIX_WGMMA
    if (active && chunks > 0) attend_wgmma_last(rb, pa, ring + ((chunks - 1) % GSTAGES) * STAGE_BYTES + KV_BYTES);
#endif
    cp_async_wait<0>();
    __syncthreads();   // the ring is drained and read: the next pass (or a stash) may overwrite it
  }

  // The warp build: a split task's tiles for this warp (warp, warp + SWARPS, ...) from its ring, each step
  // issuing the cursor's next tile (this task's, or the next split task's) into the stage read the step before.
  static __device__ __forceinline__ void stream_warp(const GroupedParams& p, const SplitTask& tk, TileCursor& lc,
                                                     int last, int& cs, RowBlock& rb, const u32 (&qf)[GKSTEPS][4],
                                                     u32 wring, int warp, int lane) {
    for (int valid = tk.kv_end - tk.kv_begin - warp * GT; valid > 0; valid -= SWARPS * GT) {   // (tokens from the tile's first)
      cp_async_wait<WSTAGES - 2>();
      __syncwarp();   // the tile has landed for every lane, and every lane has read the stage of the step before
      issue_tile(p, lc, last, wring + (cs == 0 ? WSTAGES - 1 : cs - 1) * WSTAGE_BYTES, warp, lane);
      const u32 stage = wring + cs * WSTAGE_BYTES;
      attend<1>(p, rb, qf, stage, stage + TILE_BYTES, 0, valid, lane);
      cs = cs + 1 == WSTAGES ? 0 : cs + 1;
    }
  }

  static __device__ __forceinline__ void run(const GroupedParams& p, const State& s) {
    __shared__ int fired[GTHREADS];   // events this CTA's counts completed (merged by the whole CTA)
    __shared__ Event fired_rows[GTHREADS];   // and their rows
    __shared__ int n_fired;
    __shared__ StagedSlots staged;   // their part slots (merge_events)
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const u32 ring = smem_addr(s.smem);
    Profiler prof;   // (MELD_PROFILE builds; thread 0 records: a task's attention, then its merges)
    prof.begin(p.prof, p.prof_cap, blockIdx.x, threadIdx.x == 0, p.prof_clock, p.prof_every);
    // Events no task counts towards (requests with no KV: zeros, lse -inf), of this CTA's share (e = blockIdx.x mod
    // the grid): each thread looks one up, so up to GTHREADS of them cost one round trip (walked one at a time, each
    // event's load waited on the last: one round trip each, on every CTA's path to its first task), then the CTA
    // writes those it found together.
    const int batch = p.plan_info[0], events = batch * p.num_kv_heads;   // (plan() writes it: graph replays see it)
    const int first = p.cta_first[blockIdx.x], last = p.cta_first[blockIdx.x + 1];
    SplitTask tk, next;     // the task walked, the next (LOAD_AHEAD), and Q's fragments of this warp's rows of it
    u32 qf[GKSTEPS][4];
    if (LOAD_AHEAD && first < last) load_task(p, first, batch, warp, next, qf, lane);
    for (int e0 = blockIdx.x; e0 < events; e0 += gridDim.x * GTHREADS) {
      if (threadIdx.x == 0) n_fired = 0;
      __syncthreads();
      const int e = e0 + threadIdx.x * gridDim.x;
      if (e < events) {
        const Event ev = load_event(p.events, p.event_capacity, e);
        if (ev.parts == 0) {
          const int k = atomicAdd(&n_fired, 1);
          fired[k] = e;
          fired_rows[k] = ev;
        }
      }
      __syncthreads();
      merge_events(p, fired, fired_rows, n_fired, staged);
      __syncthreads();   // (fired and n_fired are rewritten next)
    }
    const bool streams = warp < SWARPS;   // (the warp build) this warp attends split tasks' tiles
    const u32 wring = ring + warp * WSTAGES * WSTAGE_BYTES;
    __shared__ StashRows sr;   // split tasks' stashed m and l, and where each warp's O is
    TileCursor lc;   // (the warp build) this warp's walk over split tasks' tiles, ahead of its compute
    lc.live = false;
    int cs = 0;             // its ring stage consumed next
    bool primed = false;    // its ring holds the walk's tiles (false at the CTA's first task and after a task
                            // of more rows, where the walk stopped)
    for (int i = first; i < last; ++i) {
      if (LOAD_AHEAD) tk = next; else load_task(p, i, batch, warp, tk, qf, lane);
      const i64 t0 = prof.now();
      const int* pages = p.kv_indices + tk.pages;
      const int rows = tk.event_count * p.group_size;   // at most GWARPS * GT: the planner's slice
      const bool split = rows <= GT;
      const int row0 = split ? 0 : warp * GT;
      RowBlock rb;
      reset_rows(rb);
      if (WARP_STREAM && split) {
        if (!primed) {   // the walk starts here: WSTAGES - 1 tiles in flight
          lc.i = i;
          if (streams && cursor_enter(p, lc, warp)) cursor_seek(p, lc, last, warp, lane);
          cs = 0;
#pragma unroll
          for (int st = 0; st < WSTAGES - 1; ++st) issue_tile(p, lc, last, wring + st * WSTAGE_BYTES, warp, lane);
          primed = true;
        }
        if (streams) stream_warp(p, tk, lc, last, cs, rb, qf, wring, warp, lane);
      } else {
        primed = false;   // (the warp build: the walk stopped at this task; every tile it issued is read)
        const bool active = PREFIX_WGMMA ? warp / 4 * WG_ROWS < rows : row0 < rows;   // (wgmma: the warpgroup's)
        stream(p, tk, pages, split, active, rb, qf, ring, warp, lane);
      }
      if (LOAD_AHEAD && i + 1 < last) load_task(p, i + 1, batch, warp, next, qf, lane);   // (qf is read)
      if (split) {
        if (!WARP_STREAM || streams) {   // its stash: the warp build's ring stage read last, or the cta build's place
          __syncwarp();   // (every lane has read that stage)
          const int free_stage = cs == 0 ? WSTAGES - 1 : cs - 1;
          stash_rows(rb, s.smem, WARP_STREAM ? (warp * WSTAGES + free_stage) * WSTAGE_BYTES : warp * STASH_BYTES, sr,
                     warp, lane);
        }
        __syncthreads();
        merge_warps(p, tk, rows, s.smem, sr);
        __syncthreads();   // the stashes are read: the warps' next copies (or the CTA ring's) may land on them
      } else if (row0 < rows) {
        store_rows(p, tk, rb, row0, rows, lane);
      }
      prof.record(t0, PROF_PIECE, i);
      if (DEFER_SPLIT && split) continue;   // (counted after the CTA's last task)
      const int end = tk.event_first + tk.event_count;
      for (int e0 = tk.event_first; e0 < end; e0 += GTHREADS)   // count the task's arrival, a thread an event
        arrive_round(p, [&](int& e) { e = e0 + threadIdx.x; return e < end; }, DIRECT_SINGLE && split, fired, fired_rows,
                     n_fired, staged, prof, i);
    }
    // MELD_DEFER_SPLIT_EVENTS: the split tasks' arrivals, GTHREADS / GT tasks a round (a split task has at most
    // GT rows, so at most GT events): thread j arrives for event j % GT of the round's task j / GT.
    for (int i0 = first; DEFER_SPLIT && i0 < last; i0 += GTHREADS / GT) {
      const int i = i0 + threadIdx.x / GT, k = threadIdx.x % GT;
      arrive_round(p, [&](int& e) {
        if (i >= last) return false;
        const SplitTask tk = load_splittask(p.tasks, p.task_capacity, i);
        e = tk.event_first + k;
        return tk.event_count * p.group_size <= GT && k < tk.event_count;
      }, DIRECT_SINGLE, fired, fired_rows, n_fired, staged, prof, i0);
    }
    prof.end(gridDim.x);
  }
};

}  // namespace meld

MELD_PERSISTENT_KERNEL(meld_grouped_attention, meld::GroupedFamily, NUM_WARPS * 32, MIN_CTAS)
