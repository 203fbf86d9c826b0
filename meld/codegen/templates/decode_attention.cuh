// meld: persistent split-KV decode attention (paged GQA).
//
// One CTA per segment of the schedule (meld/ir/schedule.py). A *unit* is one (request, block of up to
// HEADS = 8 or 16 q heads of one kv head); the CTA's warps take the unit's 16-token KV tiles round-robin,
// each warp streaming its tiles through a private cp.async ring (the ring runs ahead across unit
// boundaries, so the memory pipeline never drains between units). Scores and P.V run on the tensor
// cores (m16n8k16):
//   S[HEADS heads x 16 tokens] = Q . K^T, or with 8 heads S^T[16 tokens x 8 heads] = K . Q^T (no padding rows)
//   O^T[D x 8 heads] += V^T . P^T, once per 8 heads  (P from S's accumulator layout; from S^T's, transposed in
//                                                    registers by movmatrix)
// At the end of a unit the warps merge their online-softmax states through shared memory. A unit that
// the schedule split across CTAs leaves one partial (o, lse) per piece, merged:
//   - on chip, when every piece ran in this CTA's thread-block cluster (MELD_ONCHIP_MERGE): the partial
//     stays in the shared memory of the CTA that computed it, the counter lives in the shared memory of
//     the first piece's CTA, and the last arriver reads the partials over distributed shared memory;
//   - through global memory otherwise (slot unit + cta, a counter per unit that the mergers reset): by up to
//     MERGE_SLICES of its pieces' CTAs together, each a slice of the outputs, after they wait for every part
//     (merge_slices says when that wait cannot deadlock), or, where the parts span grids, by the CTA whose
//     arrival completes the counter (last arriver does the work).
// The pieces of a unit sit on consecutive CTAs, and clusters are runs of consecutive CTAs, so most
// split units merge on chip. Several grids (one per cluster size, `cta_offset` apart) can share one
// schedule: pieces in different grids always merge through global memory, so a grid that starts late
// delays the work but never deadlocks (meld/runtime/driver.py's PersistentLaunch orders their start
// and end with griddepcontrol). The waits: a slice's merger for its unit's parts, all in its grid and none
// computed after a wait (merge_slices); cluster barriers (co-resident by hardware): one after the counters
// are zeroed, one before exit so that no CTA's shared memory vanishes while a peer reads it; and at exit,
// for the grid launched before this one (which never waits on this one).
//
// MELD_TMA builds load each tile with TMA tensor copies instead (cp.async.bulk.tensor over 4-D maps of
// the K and V caches, p.k_map and p.v_map: one 16-row x 64-channel box per copy, 128-byte swizzled) into
// the same per-warp rings, each stage completed by an mbarrier (expect-tx bytes). A tile must then lie in
// one page: page_size % 16 == 0 (DecodeAttention checks it).
//
// IEEE semantics: a non-finite score (NaN or Inf in q or K) makes that (request, q head) row's output and
// lse NaN; a non-finite P.V accumulator (in V) makes its output NaN while its lse, a function of the scores
// alone, stays finite; split or not. An empty unit gives zeros and lse -inf. Scores are poisoned as they
// are made (x + 0 * x is NaN exactly for Inf and NaN) and so reach l; the accumulators' check is folded
// into every channel of the row's output once per piece; every normalisation tells empty (l == 0) from NaN.
//
// MELD_CHUNKED (batch-invariant) builds walk each unit of a segment as its chunks of p.chunk tokens, every
// chunk a piece of its own whenever the unit has more than one (meld/ir/schedule.py): its slot is
// slot_base[req] + head block * chunks + chunk, and the last of its chunks to arrive merges them in
// chunk order, so a request's result does not depend on where in the batch, or beside what, it runs.
// These builds merge through global memory only.
//
// MELD_XRANK builds run one rank's share of a sequence-parallel batch (meld/distributed/seq_parallel.py): each
// local request is part `part` of `parts` of batch request `b` (p.xreq), its q row is q[b], and a unit's
// result on this rank (whole here, or merged from this rank's pieces as above) goes to the ranks'
// symmetric windows (p.xpeers: NVLink peer memory) instead of p.out: a request whole on this rank writes
// its output and lse into every rank's window; a part of a request split across ranks puts its float
// partial into the owner's window and counts it on the owner's counter for the unit (system-scope
// release), and the part whose count completes it merges the parts, in part order, and writes every
// rank's output: the same last-arriver merge one level up, so no rank waits on another's work inside the
// loop. At its end each CTA fences once (system scope) and adds the units it finished to every rank's
// landing counter; the last CTA of the launch waits (under the watchdog) until its own counter holds
// every unit of the batch, so the launch ends with the whole output in this rank's window, and takes
// that count back for the next launch.
//
// K and V are two caches, NHD [pages, page_size, Hkv, D] or HND [pages, Hkv, page_size, D], at their own
// addresses (p.k, p.v: two tensors, or the halves [:, 0] and [:, 1] of one [pages, 2, ...] cache) with one
// set of strides: the cp.async loads address a token's K and V rows, D elements each, at the same row
// offset from each (run-time strides kv_page_stride, ... in rows); the TMA maps are encoded for the
// layout and their box coordinates follow kv_hnd.
//
// MELD_KV_FP8 builds read K and V as FP8 bytes, e4m3 (1) or e5m2 (2) (q and out stay bf16/fp16): a tile row
// is D bytes, copied to shared memory as it is (cp.async or TMA: half the bytes of a 16-bit tile), loaded
// with the same ldmatrix addressing and converted to the MMA type in registers (kv_pair: exact, NaN stays
// NaN, e5m2's Inf stays Inf). The two formats differ in that conversion alone, so one macro selects it and
// everything below holds for both. An 8x8 b16 ldmatrix of FP8 bytes hands lane (g, t) four consecutive
// bytes of its row, so
//   Q.K^T: one non-transposed matrix is a whole B fragment (token g, 16 channels): b0 = channels 4t, 4t+1,
//          b1 = 4t+2, 4t+3. The reduction order inside each 16 channels is permuted, and Q's A fragments
//          (loaded once per unit) follow it: MMA k index 2t + j <-> channel 4t + j, 2t + 8 + j <-> 4t + 2 + j.
//   P.V:   one transposed matrix gives lane (g, t) tokens 2t, 2t+1 of channels 2g, 2g+1; a byte permute
//          pairs them per channel, so the O^T rows g and g + 8 of an m16 tile are channels 2g and 2g + 1
//          (finish_piece reads them so); tokens, the reduction, keep their order, and so does P.
// The scales are FlashInfer's per-tensor k_scale and v_scale: k_scale is folded into sm_scale_log2 on the
// host (the scores, and so lse, include it), v_scale multiplies each piece's normalised output (a merge is
// a convex combination of pieces, so a merged output carries it once).
//
// MELD_Q_TO_F16 builds (an FP8 cache with bf16 q and out: DecodeKernelConfig.fp8_math="f16") run the tensor cores in
// f16 (MELD_MMA_TYPE "f16", MELD_OUT_TYPE "bf16"): an e4m3 pair becomes an f16 pair in one cvt and an e5m2 pair in one
// prmt, where bf16 MMAs take each pair on through two floats to a bf16 pair (kv_pair). P is f16, three more bits than
// bf16, times P_SCALE = 2^15 (p in [0, 2^15], below f16's 65504): unscaled, f16's subnormals would round a long
// row's tail of p < 2^-14 on a 2^-24 grid and drop p < 2^-25 from P.V while l (float32) counts it; scaled, they start
// at p < 2^-29 and only p < 2^-40 drops. O carries the 2^15, taken out with l (O / (l 2^15)); lse does not change.
// Q is the one operand whose range f16 lacks: load_q scales each row of the unit by its own power of two 2^e, the
// row's largest |q| into [2^14, 2^15) (e at most 126: a zero row stays zero), and rounds it to f16 once (q_to_f16);
// the row's scores carry 2^e, taken out exactly (s 2^-e, then sm_scale_log2 as in every build). Per row, not per
// unit: the rows are different heads (and tokens), whose sizes need not agree, and each lane's scores belong to one
// row per head block anyway. A bf16 value of magnitude at least 2^-31 of its row's largest is exact in f16 after the
// scaling (from 2^-17 on, f16 keeps bf16's 8 significant bits); smaller ones round to f16's subnormal grid (2^-24
// after scaling) or flush to zero: each entry then moves by at most 2^-25 x 2^-e <= 2^-39 max|q|, a score by at most
// 2^-39 max|q| sum|k| <= 2^-30 max|q| max|k| at head_dim 512, 1/64 of float32's unit roundoff (2^-24) times
// max|q| max|k|. NaN and Inf in q stay NaN and Inf (the row's scores are NaN, as in every build). The output is
// rounded to bf16 once, as in every build.
//
// MELD_SOFT_CAP builds cap each score as FlashInfer's logits_soft_cap c does, c tanh(sm_scale q.k / c), before
// the softmax (lse included); the cap is a compile-time constant (meld/codegen/decode_kernel.py, DecodeVariant).
// MELD_WINDOW_LEFT >= 0 builds attend to the last MELD_WINDOW_LEFT + 1 keys of each request only (FlashInfer's
// sliding window, for the query at the request's last position): plan() drops the pages wholly before the
// window, and the kernel masks the keys before it in the first page left (their scores -inf, their V rows
// zeroed in shared memory as past a unit's end). MELD_ROPE builds apply Llama's rotary embedding inside
// attention (FlashInfer's pos_encoding_mode="ROPE_LLAMA": keys at their positions, the query at its request's
// last): each warp rotates its K tile in shared memory, after it lands and before its ldmatrix, by each key's
// offset from the query (position - (kv_len - 1) <= 0), and q stays as it is: q.k after rotation depends on
// that offset alone. The rotated keys are rounded to the MMA type, as the loaded ones were. Over an FP8 cache the
// tile stays FP8 bytes and each lane rotates the K fragments it loads, in registers (rope_fp8): the FP8 build's
// ldmatrix hands lane (g, t) channels 16 ks + 4t .. 4t + 3 of tokens g and g + 8, and at channel block ks + KSTEPS / 2
// their partners c + D / 2, so a pair never leaves its lane. The keys are rotated as the cache stores them and k_scale
// scales the scores after (in sm_scale_log2), FlashInfer's order. Off (0, -1, 0) each compiles to the plain build's
// code.
//
// MELD_Q_LEN > 1 builds decode Q_LEN new tokens per request (speculative decoding, MTP), causal among themselves:
// the cache already holds them, so token j of a request of kv_len tokens sees keys 0 .. kv_len - Q_LEN + j. q and
// out are [B * Q_LEN, Hq, D], a request's tokens consecutive (FlashInfer's q_len_per_req layout). A kv head's query
// rows are its (q head, token) pairs, head-major: row r of the request is q head r / Q_LEN, token r % Q_LEN, so
// p.group_size counts rows (q heads per kv head x Q_LEN) and a unit is up to HEADS such rows against one KV
// stream, the rows of a single-token unit. Scores past a row's last visible key are masked as past a unit's end.
// Q_LEN 1 compiles to the plain build's code.
// MELD_RAGGED_Q builds take requests of n_b = 1 .. Q_LEN new tokens each (a ragged batch: speculative decoding's
// drafts of different lengths): request b's tokens are q and out rows p.qo_indptr[b] .. p.qo_indptr[b + 1] (FlashInfer's
// qo_indptr), token j < n_b sees keys 0 .. kv_len - n_b + j. The unit's row tiling stays Q_LEN tokens per q head (the
// plan, units and partial slots are the uniform build's), so the rows of tokens j >= n_b load zero q, cost MMA rows
// but no KV bytes, and are never stored.
//
// HEAD_DIM 512 builds (8-head units, two or four warps: meld/codegen/decode_kernel.py) keep each warp's O^T in
// registers (128 floats a lane) and Q's A fragments in shared memory instead (Q_SMEM: one copy for the CTA's warps,
// which all compute the same unit, in the merge area, which holds nothing while tiles compute, or after it where a
// unit's chunks reuse Q across merges (MELD_CHUNKED); q_frag reads one 8-byte word per channel block), and copy a
// 16-bit token row (1 KiB) as two 16-byte chunks a lane (CPL). Everything else is the same code over four times the
// bytes a token; at other head dims these compile to the code they were.
//
// Defined by the including source: HEAD_DIM, NUM_WARPS, NUM_STAGES, SMEM_BYTES, MELD_MMA_TYPE, MELD_OUT_TYPE,
// MELD_Q_TO_F16, HEADS_PER_UNIT, MELD_ONCHIP_MERGE, MELD_PROFILE, MELD_TMA, MELD_CHUNKED, MELD_WATCHDOG_NS,
// MELD_DEBUG_WITHHOLD, MELD_XRANK, MELD_KV_FP8, MELD_SOFT_CAP (MELD_SOFT_CAP_LOG2, MELD_SOFT_CAP_TWO),
// MELD_WINDOW_LEFT, MELD_ROPE (MELD_ROPE_FPI0, MELD_ROPE_LOG2_STEP), MELD_Q_LEN, MELD_RAGGED_Q, DecodeParams.

namespace meld {

constexpr int D = HEAD_DIM;
constexpr int WARPS = NUM_WARPS;
constexpr int THREADS = WARPS * 32;
constexpr int STAGES = NUM_STAGES;
constexpr int TILE = 16;                   // KV tokens per warp step
constexpr int HEADS = HEADS_PER_UNIT;      // q heads (rows) per unit: 8, or 16 for groups of 9-16, or 32 for
                                           // multi-token groups of 17-32 rows (each reads its KV once)
constexpr int NT = HEADS / 8;              // blocks of 8 head rows: n8 tiles of P.V, and half an m16 tile of Q.K^T
constexpr int MT = (NT + 1) / 2;           // m16 tiles of Q.K^T
// 8-head units compute S^T = K . Q^T (K as the A operand: 16 tokens; Q as B: 8 heads, no padding rows): one HMMA a
// channel block instead of two, and Q's fragments as they are, not rebuilt each tile into register quads with zero
// rows (compute_tile).
constexpr bool ST = NT == 1;
constexpr int MERGE_ROWS = MELD_MERGE_ROWS ? MELD_MERGE_ROWS : HEADS;   // rows the end-of-piece merge area holds: the
constexpr int MERGE_PASSES = HEADS / MERGE_ROWS;   // warps' states merge in HEADS / MERGE_ROWS passes over it
static_assert(MERGE_ROWS % 8 == 0 && HEADS % MERGE_ROWS == 0, "merge passes of whole 8-row blocks");
constexpr bool KV_FP8 = MELD_KV_FP8;       // 1: e4m3, 2: e5m2 (the conversion is all that differs)
constexpr bool KV_E5M2 = MELD_KV_FP8 == 2;
constexpr int KV_BYTES = KV_FP8 ? 1 : 2;   // bytes per K or V element, in memory and in shared memory
constexpr bool Q_TO_F16 = MELD_Q_TO_F16;   // bf16 q and out, f16 MMAs (FP8 caches)
static_assert(!Q_TO_F16 || (KV_FP8 && MELD_MMA_TYPE[0] == 'f' && MELD_OUT_TYPE[0] == 'b'), "f16 math: FP8, bf16 q");
constexpr float P_SCALE = 32768.f;         // MELD_Q_TO_F16: P, and so O, carry 2^15 (the header says why)
#if MELD_KV_FP8
typedef unsigned char kv_t;                // a K or V element as the cp.async loads address it
#else
typedef u16 kv_t;
#endif
// Four FP8 K or V bytes x, permuted by SEL (byte_perm's selector), as two registers of f16 pairs (exact).
template <u32 SEL>
__device__ __forceinline__ void kv_f16(u32 x, u32& lo, u32& hi) {
  if (KV_E5M2) e5m2x4_to_f16<SEL>(x, lo, hi);
  else e4m3x4_to_f16(SEL == 0x3210u ? x : byte_perm<SEL>(x), lo, hi);
}
// The same as two registers of MMA-type pairs.
template <u32 SEL>
__device__ __forceinline__ void kv_pair(u32 x, u32& lo, u32& hi) {
  kv_f16<SEL>(x, lo, hi);
  f16x4_to_mma(lo, hi);
}
constexpr int ROW_BYTES = D * KV_BYTES;    // one token row of K or V
constexpr int CPR = ROW_BYTES / 16;        // 16-byte chunks per token row
constexpr int RPP = CPR > 32 ? 1 : 32 / CPR;   // token rows one warp-wide cp.async pass covers
constexpr int CPL = CPR > 32 ? CPR / 32 : 1;   // chunks of a row one lane copies in a pass (2: 16-bit head_dim 512)
constexpr int PASSES = TILE / RPP;
constexpr int KSTEPS = D / 16;
constexpr bool TMA = MELD_TMA;
constexpr int TILE_BYTES = TILE * ROW_BYTES;   // one K or V tile
constexpr int BOX_ROW = ROW_BYTES < 128 ? ROW_BYTES : 128;   // bytes of a TMA box row: the swizzle span (128,
                                           // or the 64-byte rows of FP8 head_dim 64, in 64-byte swizzle)
constexpr int BOX_COLS = BOX_ROW / KV_BYTES;   // channels per TMA box
constexpr int BOXES = D / BOX_COLS;        // boxes per K or V tile
constexpr int BOX_BYTES = TILE * BOX_ROW;
constexpr int STAGE_BYTES = 2 * TILE_BYTES;
constexpr int RING_BYTES = WARPS * STAGES * STAGE_BYTES;
constexpr int O_STRIDE = D + 4;            // floats per (warp, head) row of the merge area; +4 avoids bank conflicts
static_assert(D % 64 == 0 && D <= 512, "head_dim must be 64, 128, 256 or 512");
static_assert(HEADS == 8 || HEADS == 16 || HEADS == 32, "a unit computes 8, 16 or 32 q heads (rows)");
static_assert(STAGES >= 2, "the cp.async ring needs at least two stages");
constexpr bool ONCHIP = MELD_ONCHIP_MERGE;
constexpr bool CHUNKED = MELD_CHUNKED;
static_assert(!(ONCHIP && CHUNKED), "batch-invariant kernels merge through global memory");
constexpr bool SOFT_CAP = MELD_SOFT_CAP;
constexpr int WINDOW_LEFT = MELD_WINDOW_LEFT;
constexpr bool WINDOW = WINDOW_LEFT >= 0;
constexpr bool ROPE = MELD_ROPE;
// MELD_ROPE with MELD_KV_FP8 = 2 (e5m2) and f16 MMAs: the rotated keys are halved before they are rounded to f16,
// whose range e5m2's (to 57344) fills: a rotated pair's norm reaches sqrt(2) x 57344. The scores are doubled back.
constexpr float ROPE_KEY_SCALE = ROPE && KV_E5M2 && MELD_MMA_TYPE[0] == 'f' ? 0.5f : 1.f;
constexpr int Q_LEN = MELD_Q_LEN;          // new tokens per request: a unit's row r is q head r / Q_LEN, token r % Q_LEN
static_assert(Q_LEN >= 1 && Q_LEN <= 8, "1 to 8 new tokens per request");
static_assert(Q_LEN == 1 || !(WINDOW || ROPE || MELD_XRANK), "multi-token builds take no window, RoPE or ranks");
constexpr bool RAGGED = MELD_RAGGED_Q;     // each request's first q row and token count from p.qo_indptr
static_assert(!RAGGED || Q_LEN > 1, "a ragged build's Q_LEN is its requests' most new tokens (> 1)");

// MELD_SOFT_CAP: a log2-domain score x = sm_scale log2(e) q.k becomes c log2(e) tanh(x / (c log2(e))), written
// with ex2 as c log2(e) (1 - 2 / (2^(2 x / c) + 1)): off by float rounding in absolute terms, where tanh.approx's
// relative error, times c, would move the probabilities visibly at large caps. NaN stays NaN (the caller makes
// Inf NaN first); large |x| saturates at +-c log2(e). The plain build returns x.
__device__ __forceinline__ float soft_cap(float x) {
  if (!SOFT_CAP) return x;
  const float e = exp2_approx(x * MELD_SOFT_CAP_TWO);
  return MELD_SOFT_CAP_LOG2 * (1.f - __fdividef(2.f, e + 1.f));
}

// Byte offset of 16-byte chunk `c` of token row `r` in a tile: XOR swizzle so that ldmatrix's eight
// rows at one chunk column hit eight different bank groups. TMA tiles are BOXES blocks of [16 rows][BOX_ROW
// bytes] in the hardware's swizzle of that span (128 bytes: chunk ^ row % 8 inside each block). Rows of
// 64 bytes (FP8, head_dim 64) pair up in 128-byte lines: chunk ^ (row / 2) % 4, which is the 64-byte TMA
// swizzle too.
constexpr int CPB = BOX_ROW / 16;          // chunks per TMA box row: 8, or 4
__device__ __forceinline__ int swizzle(int r, int c) { return ROW_BYTES < 128 ? c ^ ((r >> 1) & 3) : c ^ (r & 7); }
__device__ __forceinline__ u32 tile_off(int r, int c) {
  return TMA ? (c >> (CPB == 8 ? 3 : 2)) * BOX_BYTES + r * BOX_ROW + (swizzle(r, c & (CPB - 1)) << 4)
             : r * ROW_BYTES + (swizzle(r, c) << 4);
}

// Where this CTA runs: its row of the CTA table and the rows of its cluster.
struct Place {
  int cta, cluster_first, cluster_ctas;
};

struct Unit {
  int req, kv_head, q_head, rows, begin, end, page_base;
  int slot;         // partial slot; -1: the unit is whole here and writes the output directly
  int parts_begin, num_parts;
  int first_cta;    // CTA of the unit's first piece (split units)
  bool head;        // this piece starts the CTA's segment (else it ends it)
  bool onchip;      // every piece ran in this cluster: merge through distributed shared memory
  int seg_end, k, k_first, k_last;   // MELD_CHUNKED: the unit's end in this segment; this chunk; its chunks here
  int xb, xpart, xparts, xowner;     // the batch request (its q and output row) and, MELD_XRANK, its part here
#if MELD_RAGGED_Q
  int q0, qn;       // the request's first q row and its new tokens
#endif
  __device__ __forceinline__ int num_tiles() const { return (end - begin + TILE - 1) / TILE; }
};

// The q row of the unit's request's first new token, and its new tokens (MELD_RAGGED_Q: from p.qo_indptr).
#if MELD_RAGGED_Q
__device__ __forceinline__ int first_row(const Unit& x) { return x.q0; }
__device__ __forceinline__ int new_tokens(const Unit& x) { return x.qn; }
#else
__device__ __forceinline__ int first_row(const Unit& x) { return x.xb * Q_LEN; }
__device__ __forceinline__ int new_tokens(const Unit&) { return Q_LEN; }
#endif

struct MergeArea;
#if MELD_XRANK   // the cross-rank combine edge of sequence-parallel builds: decode_xrank.cuh, rendered after this file
__device__ __forceinline__ void xrank_unit(const DecodeParams& p, Unit& x);
__device__ __forceinline__ void xrank_store4(const DecodeParams& p, const Unit& x, i64 row, int h, int d, float4 v,
                                             float lse2);
__device__ __forceinline__ void xrank_announce(const DecodeParams& p, int cta);
__device__ __forceinline__ void xrank_await_started(const DecodeParams& p, int cta);
__device__ __forceinline__ int xrank_finish(const DecodeParams& p, const Unit& x, int u, int cta, MergeArea& mg);
__device__ __forceinline__ void xrank_exit(const DecodeParams& p, int cta, int finished, MergeArea& mg);
#endif

// MELD_CHUNKED: make x (a unit of this segment) its chunk k, [k chunk, min(seg_end, (k + 1) chunk)).
// Segments start and end on chunk boundaries, so every piece is one whole chunk (or a unit's last).
__device__ __forceinline__ void enter_chunk(const DecodeParams& p, Unit& x, int u, int k) {
  const int n = max(1, (p.kv_len[x.req] + p.chunk - 1) / p.chunk);
  x.k = k;
  x.begin = k * p.chunk;
  x.end = min(x.seg_end, x.begin + p.chunk);
  x.num_parts = n > 1 ? n : 0;
  x.parts_begin = p.slot_base[x.req] + (u - x.req * p.units_per_request) * n;
  x.slot = n > 1 ? x.parts_begin + k : -1;
}

__device__ __forceinline__ Unit load_unit(const DecodeParams& p, const Segment& g, int u, const Place& pl) {
  const int cta = pl.cta;
  Unit x;
  x.req = u / p.units_per_request;
  const int hb = u - x.req * p.units_per_request;
#if MELD_XRANK
  xrank_unit(p, x);
#else
  x.xb = x.req;
#endif
#if MELD_RAGGED_Q
  x.q0 = p.qo_indptr[x.xb];
  x.qn = p.qo_indptr[x.xb + 1] - x.q0;
#endif
  x.kv_head = hb / p.head_blocks;
  const int qb = hb - x.kv_head * p.head_blocks;
  x.q_head = x.kv_head * p.group_size + qb * HEADS;
  x.rows = min(HEADS, p.group_size - qb * HEADS);
  x.page_base = p.page_base[x.req];
  const Piece pc = segment_piece(g, u, cta, p.kv_len[x.req]);   // split_kv.cuh
  x.begin = pc.begin; x.end = pc.end; x.slot = pc.slot;
  x.parts_begin = pc.parts_begin; x.num_parts = pc.num_parts;
  x.first_cta = x.parts_begin - u;
  x.head = pc.head;
  x.onchip = ONCHIP && x.slot >= 0 && x.first_cta >= pl.cluster_first &&
             x.first_cta + x.num_parts <= pl.cluster_first + pl.cluster_ctas;
  if (CHUNKED) {
    x.seg_end = x.end;
    x.k_first = x.begin / p.chunk;
    x.k_last = max(x.k_first, (x.end - 1) / p.chunk);   // an empty unit: one empty piece
    enter_chunk(p, x, u, x.k_first);
  }
  return x;
}

// Walks one warp's tile stream (units of the segment in order, tiles warp, warp + WARPS, ...) ahead of
// the compute loop, and keeps the page-table lookup for the next tile in flight: the page index loaded here is
// first used when the tile is issued, after the tile before it has been computed.
struct LoadCursor {
  int u, j;
  Unit x;
  int page;     // this lane's token (lane & 15) of the next tile: its page, or -1 past the unit's end
  int slot;     // and its slot in the page
  bool live;
};

__device__ __forceinline__ void cursor_fetch_row(const DecodeParams& p, LoadCursor& c, int lane) {
  const int pos = c.x.begin + c.j * TILE + (lane & 15);
  c.page = -1;
  c.slot = 0;
  if (pos < c.x.end) {
    const int pg = p.page_shift >= 0 ? pos >> p.page_shift : pos / p.page_size;
    c.page = p.kv_indices[c.x.page_base + pg];
    c.slot = pos - pg * p.page_size;
  }
}

__device__ __forceinline__ void cursor_seek(const DecodeParams& p, const Segment& g, LoadCursor& c,
                                            const Place& pl, int warp, int lane) {
  while (c.live && c.j >= c.x.num_tiles()) {
    if (CHUNKED && c.x.k < c.x.k_last) {
      enter_chunk(p, c.x, c.u, c.x.k + 1);
      c.j = warp;
      continue;
    }
    if (++c.u > g.u_last) { c.live = false; break; }
    c.x = load_unit(p, g, c.u, pl);
    c.j = warp;
  }
  if (c.live) cursor_fetch_row(p, c, lane);
}

// Issue the cursor's tile into ring stage `stage` (cp.async: one commit group per call, empty when the
// stream is done; TMA: 2 * BOXES tensor copies, counted on the stage's mbarrier).
__device__ __forceinline__ void issue_tile(const DecodeParams& p, const Segment& g, LoadCursor& c, u32 ring,
                                           u32 bars, int stage, const Place& pl, int warp, int lane) {
  const u32 dst = ring + stage * STAGE_BYTES;
  if (TMA) {
    if (!c.live) return;
    if (MELD_DEBUG_WITHHOLD && g.u_begin == 0 && g.s_begin == 0 && warp == 0 && c.u == 0 && c.j == 0) {
      c.j += WARPS;            // unit 0's first tile is never issued: its consumer's wait must trip
      cursor_seek(p, g, c, pl, warp, lane);
      return;
    }
    const u32 bar = bars + 8 * stage;
    fence_proxy_async();   // this warp's generic accesses to the stage come before the copies overwrite it
    if (lane == 0) mbar_arrive_expect_tx(bar, STAGE_BYTES);
    __syncwarp();
    const int page = __shfl_sync(0xffffffffu, c.page, 0);   // the tile's first token (always valid)
    const int slot = __shfl_sync(0xffffffffu, c.slot, 0);
    if (lane < 2 * BOXES) {   // lane: K or V (lane / BOXES), channel block (lane % BOXES)
      const int kv = lane / BOXES, b = lane % BOXES;
      const int c1 = p.kv_hnd ? slot : c.x.kv_head, c2 = p.kv_hnd ? c.x.kv_head : slot;   // the map's dim order
      const void* map = kv ? (const void*)&p.v_map : (const void*)&p.k_map;
      tma_load_4d(dst + kv * TILE_BYTES + b * BOX_BYTES, map, b * BOX_COLS, c1, c2, page, bar);
    }
  } else {
    if (c.live) {
      // this lane's token's K (and V) row of D elements from p.k (p.v), or -1
      const int row = c.page < 0 ? -1 : c.page * p.kv_page_stride + c.slot * p.kv_slot_stride +
                                            c.x.kv_head * p.kv_head_stride;
      // (byte addresses from the row's 32-bit index, and a row past the end as the copy's ignore-src predicate)
      const char* kbase = reinterpret_cast<const char*>(p.k) + (lane % CPR) * 16;
      const char* vbase = reinterpret_cast<const char*>(p.v) + (lane % CPR) * 16;
#pragma unroll
      for (int k = 0; k < PASSES; ++k) {
        const int r = lane / CPR + k * RPP;
        const int ro = __shfl_sync(0xffffffffu, row, r);
        const unsigned long long off = (unsigned long long)(u32)max(ro, 0) * (D * KV_BYTES);
#pragma unroll
        for (int e = 0; e < CPL; ++e) {
          const int ch = lane % CPR + 32 * e;
          cp_async_16_row(dst + tile_off(r, ch), kbase + off + 32 * e * 16, ro);
          cp_async_16_row(dst + TILE_BYTES + tile_off(r, ch), vbase + off + 32 * e * 16, ro);
        }
      }
    }
    cp_async_commit();
  }
  if (c.live) {
    c.j += WARPS;
    cursor_seek(p, g, c, pl, warp, lane);
  }
}

// Wait until ring stage `stage` holds its tile (TMA: the stage's mbarrier phase; `phases` keeps one
// parity bit per stage; the watchdog names the CTA, warp, unit and stage).
__device__ __forceinline__ void wait_tile(const DecodeParams& p, u32 bars, int stage, u32& phases, int cta, int warp,
                                          int unit) {
  if (TMA) {
    const WaitSite site{p.watchdog, p.watchdog_claim, p.watchdog_kernel, 1, cta, warp, unit, stage};
    mbar_wait(bars + 8 * stage, (phases >> stage) & 1u, site);
    phases ^= 1u << stage;
  } else {
    cp_async_wait<STAGES - 2>();
  }
  __syncwarp();
}

// Per-warp online-softmax state for the current unit. Lane (g = lane / 4, t = lane % 4) holds, for each
// block i < NT of 8 heads:
//   m[i], l[i]  for head 8 i + g (l is this lane's share; the 4 lanes of a head sum at the end); with 8-head units
//               (ST) m[j], l[j] for head 2t + j, j < 2 (l: this lane's share, its tokens g and g + 8; the 8 lanes of
//               a head sum at the end);
//   o[i][mt]    = O^T[16 mt + g (+8)][heads 8 i + 2t, 8 i + 2t + 1] (MELD_KV_FP8: rows 16 mt + 2g (+1)).
// Where O^T alone takes 128 of a lane's registers (head_dim 512; 32-row units of head_dim 128), Q's fragments wait in
// shared memory instead (qs[NT ks + i][lane], one 8-byte load per head block and channel block: no bank conflicts) and
// qa is not used. The CTA's warps share one copy, since they compute the same unit (each its own tiles of it).
constexpr bool Q_SMEM = NT * KSTEPS >= 32;
constexpr int NSTATE = ST ? 2 : NT;   // the heads whose m and l (and q_unscale) a lane holds
struct WarpState {
  float m[NSTATE], l[NSTATE];
  float o[NT][KSTEPS][4];
  u32 qa[Q_SMEM ? 1 : KSTEPS][NT][2];   // A fragments of Q: head 8 i + g, channels 16 ks + 2t (+8) (MELD_KV_FP8:
                           // 16 ks + 4t (+2)); of an 8-head unit, the B fragment of S^T = K . Q^T (q_bfrag)
  uint2* qs;               // Q_SMEM: the same fragments, qs[32 (NT ks + i) + lane] = {qa[ks][i][0], qa[ks][i][1]} (the
                           // CTA's one copy)
  float q_unscale[NSTATE]; // MELD_Q_TO_F16: 2^-e of head 8 i + g's row (q_to_f16); ST: of head 2t + j's
};

// Q's B fragment for channel block ks of an 8-head unit (ST): head g, the A fragment's a0 and a2 registers.
__device__ __forceinline__ void q_bfrag(const WarpState& st, int ks, int lane, u32& b0, u32& b1) {
  if (Q_SMEM) {
    const uint2 v = st.qs[32 * NT * ks + lane];
    b0 = v.x; b1 = v.y;
  } else {
    b0 = st.qa[ks][0][0]; b1 = st.qa[ks][0][1];
  }
}

// Q's A fragment of m16 tile m for channel block ks (units of 16 or more heads): head block 2 m (heads 16 m + 0..7)
// in a0, a2, block 2 m + 1 (16 m + 8..15) in a1, a3.
static_assert(ST || NT % 2 == 0, "units of 16 or more heads fill whole m16 tiles");
__device__ __forceinline__ void q_frag(const WarpState& st, int ks, int m, int lane, u32& a0, u32& a1, u32& a2,
                                       u32& a3) {
  const int i = 2 * m;
  if (Q_SMEM) {
    const uint2 v = st.qs[32 * (NT * ks + i) + lane], w = st.qs[32 * (NT * ks + i + 1) + lane];
    a0 = v.x; a2 = v.y; a1 = w.x; a3 = w.y;
  } else {
    a0 = st.qa[ks][i][0]; a2 = st.qa[ks][i][1];
    a1 = st.qa[ks][i + 1][0]; a3 = st.qa[ks][i + 1][1];
  }
}

// A fresh online-softmax state for the next piece.
__device__ __forceinline__ void reset_state(WarpState& st) {
#pragma unroll
  for (int j = 0; j < NSTATE; ++j) {
    st.m[j] = neg_inf();
    st.l[j] = 0.f;
  }
#pragma unroll
  for (int i = 0; i < NT; ++i) {
#pragma unroll
    for (int mt = 0; mt < KSTEPS; ++mt)
#pragma unroll
      for (int k = 0; k < 4; ++k) st.o[i][mt][k] = 0.f;
  }
}

// MELD_Q_TO_F16: the unit's Q fragments (bf16 pairs) as f16 pairs of q 2^e, e per row, and 2^-e (the header says why).
// e = 141 - the biased exponent of the row's largest |q| (its 4 lanes', t): that value times 2^e lies in [2^14, 2^15);
// at most 126, so that a zero or subnormal row's 2^-e is a normal float; at least -114 (Inf). NaN is skipped by fmaxf
// and stays NaN.
__device__ __forceinline__ float abs_max2(u32 x) {   // the larger |.| of a bf16 pair
  return fmaxf(fabsf(__uint_as_float(x << 16)), fabsf(__uint_as_float(x & 0xffff0000u)));
}
__device__ __forceinline__ u32 scale2(u32 x, float up) {   // a bf16 pair times up, as an f16 pair
  return pack2(__uint_as_float(x << 16) * up, __uint_as_float(x & 0xffff0000u) * up);
}
// 2^e of head block i's row from this lane's largest |q| (`amax`); keeps 2^-e in st.q_unscale[i].
__device__ __forceinline__ float q_row_scale(WarpState& st, int i, float amax) {
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
  const int e = min(141 - (int)(__float_as_uint(amax) >> 23), 126);
  st.q_unscale[i] = __uint_as_float((u32)(127 - e) << 23);
  return __uint_as_float((u32)(127 + e) << 23);
}
__device__ __forceinline__ void q_to_f16(WarpState& st) {   // (Q in registers)
#pragma unroll
  for (int i = 0; i < NT; ++i) {
    float amax = 0.f;
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) amax = fmaxf(amax, fmaxf(abs_max2(st.qa[ks][i][0]), abs_max2(st.qa[ks][i][1])));
    const float up = q_row_scale(st, i, amax);
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks)
#pragma unroll
      for (int w = 0; w < 2; ++w) st.qa[ks][i][w] = scale2(st.qa[ks][i][w], up);
  }
}

// The unit's Q fragments, and a fresh state. Q_SMEM: called by the whole CTA, once every thread is done with the
// previous unit (the end of finish_piece). Each warp writes the channel blocks ks = warp (mod WARPS) of the
// CTA's copy (MELD_Q_TO_F16: scaled by its row's 2^e, which every warp finds from the whole row, re-read from L1), then
// the CTA waits for the copy. Every row's words are loaded before the first store: ptxas does not move a global load
// above a store through a generic pointer, so storing each row as it arrived took one round trip a row (four for
// 32-row units, every one on the CTA's path to its first tile).
__device__ __forceinline__ void load_q(const DecodeParams& p, const Unit& x, WarpState& st, int lane, int warp) {
  const int g = lane >> 2, t = lane & 3;
  constexpr int KPW = Q_SMEM ? (KSTEPS + WARPS - 1) / WARPS : 1;   // channel blocks a warp writes of the CTA's copy
  u32 qw[NT][KPW][2];   // (Q_SMEM) this warp's words of them
  float up[NT];         // (Q_SMEM) 2^e of each row (MELD_Q_TO_F16)
#pragma unroll
  for (int i = 0; i < NT; ++i) {
    const int h = 8 * i + g;
    const int r = x.q_head + h;   // (Q_LEN > 1: the request's row, token r % Q_LEN of q head r / Q_LEN)
    const u16* q = Q_LEN == 1 ? p.q + x.xb * p.q_stride_b + (i64)(x.q_head + h) * p.q_stride_h + (KV_FP8 ? 4 : 2) * t
                              : p.q + (first_row(x) + r % Q_LEN) * p.q_stride_b +
                                    (i64)(r / Q_LEN) * p.q_stride_h + (KV_FP8 ? 4 : 2) * t;
    // (MELD_RAGGED_Q: rows of tokens past the request's load zero q)
    const bool live = h < x.rows && (!RAGGED || r % Q_LEN < new_tokens(x));
    const auto word = [&](int ks, int w) {
      return live ? *reinterpret_cast<const u32*>(q + ks * 16 + (w ? (KV_FP8 ? 2 : 8) : 0)) : 0u;
    };
    if constexpr (Q_SMEM) {
      up[i] = 1.f;
      if (Q_TO_F16) {
        float amax = 0.f;
#pragma unroll 4
        for (int ks = 0; ks < KSTEPS; ++ks)
#pragma unroll
          for (int w = 0; w < 2; ++w) amax = fmaxf(amax, abs_max2(word(ks, w)));
        up[i] = q_row_scale(st, i, amax);
      }
#pragma unroll
      for (int kk = 0; kk < KPW; ++kk) {
        const int ks = warp + kk * WARPS;
        qw[i][kk][0] = ks < KSTEPS ? word(ks, 0) : 0u;
        qw[i][kk][1] = ks < KSTEPS ? word(ks, 1) : 0u;
      }
    } else {
#pragma unroll
      for (int ks = 0; ks < KSTEPS; ++ks) {
        st.qa[ks][i][0] = word(ks, 0);
        st.qa[ks][i][1] = word(ks, 1);
      }
    }
  }
  if constexpr (Q_SMEM) {
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
      for (int kk = 0; kk < KPW; ++kk) {
        const int ks = warp + kk * WARPS;
        const u32 lo = qw[i][kk][0], hi = qw[i][kk][1];
        if (ks < KSTEPS)
          st.qs[32 * (NT * ks + i) + lane] = Q_TO_F16 ? make_uint2(scale2(lo, up[i]), scale2(hi, up[i]))
                                                      : make_uint2(lo, hi);
      }
    __syncthreads();
  } else if (Q_TO_F16) {
    q_to_f16(st);
  }
  if (ST && Q_TO_F16) {   // S^T's columns are heads 2t and 2t + 1: their rows' 2^-e, from lanes 4 (2t) and 4 (2t + 1)
    const float u = st.q_unscale[0];
    st.q_unscale[0] = __shfl_sync(0xffffffffu, u, 8 * t);
    st.q_unscale[1] = __shfl_sync(0xffffffffu, u, 8 * t + 4);
  }
  reset_state(st);
}

// Two 16-bit MMA-type values (lo in the low half) as floats, and back (pack2).
__device__ __forceinline__ void unpack2(u32 x, float& lo, float& hi) {
  if (MELD_MMA_TYPE[0] == 'b') {
    lo = __uint_as_float(x << 16);
    hi = __uint_as_float(x & 0xffff0000u);
  } else {
    asm("{ .reg .b16 a, b; mov.b32 {a, b}, %2; cvt.f32.f16 %0, a; cvt.f32.f16 %1, b; }" : "=f"(lo), "=f"(hi) : "r"(x));
  }
}
__device__ __forceinline__ u32 ld_shared_u32(u32 addr) {
  u32 v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ void st_shared_u32(u32 addr, u32 v) {
  asm volatile("st.shared.u32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}

// MELD_ROPE: channel c's (< D/2) frequency in units of pi, f_c / pi: a key at offset `off` turns by off f_c.
__device__ __forceinline__ float rope_fpi(int c) { return MELD_ROPE_FPI0 * exp2_approx((float)c * MELD_ROPE_LOG2_STEP); }

// MELD_ROPE: rotate this warp's K tile (tile row r is the key at offset rel0 + r from the query) in shared memory:
// channels c < D/2 and c + D/2 by the angle offset * f_c, f_c / pi = MELD_ROPE_FPI0 2^(c MELD_ROPE_LOG2_STEP).
// Each lane takes channel pairs (c, c + 1) and their partners c + D/2, c + D/2 + 1: one 32-bit word each.
__device__ __forceinline__ void rope_tile(u32 kbase, int rel0, int lane) {
  constexpr int QP = D / 4;                     // channel pairs in each half
#pragma unroll 1   // (not unrolled: head_dim 256's accumulators leave no registers for more in flight)
  for (int item = lane; item < TILE * QP; item += 32) {
    const int r = item / QP, c = 2 * (item % QP);
    const u32 lo_at = kbase + tile_off(r, c / 8) + (c % 8) * 2;
    const u32 hi_at = kbase + tile_off(r, (c + D / 2) / 8) + (c % 8) * 2;
    float a0, a1, b0, b1, s0, c0, s1, c1;
    unpack2(ld_shared_u32(lo_at), a0, a1);
    unpack2(ld_shared_u32(hi_at), b0, b1);
    const float off = (float)(rel0 + r);
    sincospif(off * rope_fpi(c), &s0, &c0);
    sincospif(off * rope_fpi(c + 1), &s1, &c1);
    st_shared_u32(lo_at, pack2(a0 * c0 - b0 * s0, a1 * c1 - b1 * s1));
    st_shared_u32(hi_at, pack2(b0 * c0 + a0 * s0, b1 * c1 + a1 * s1));
  }
  __syncwarp();
}

// MELD_ROPE over MELD_KV_FP8: sin(pi x) and cos(pi x), x reduced exactly to [-1, 1] (x - 2 rint(x / 2)) and pi times
// that through the hardware's approximations (__sincosf: within CUDA's documented bound on [-pi, pi], far below the
// rounding of a rotated key to the MMA type). An FP8 tile lands in half the time of a 16-bit one, and sincospif's
// polynomials (rope_tile's) would be most of its arithmetic.
__device__ __forceinline__ void sincospi_approx(float x, float& s, float& c) {
  __sincosf(3.14159265358979f * fmaf(-2.f, rintf(0.5f * x), x), &s, &c);
}

// MELD_ROPE over MELD_KV_FP8: the FP8 build's K fragments of channel blocks ks and ks + KSTEPS / 2 (lane (g, t): channels
// c = 16 ks + 4 t + e and their partners c + D / 2, e < 4, of token `tok`, the key at offset rel0 + tok) rotated in
// float by rope_tile's angles, into B fragments of the MMA type: lo[0..1] for ks, hi[0..1] for its partner.
__device__ __forceinline__ void rope_fp8(u32 klo, u32 khi, int ks, int rel0, int tok, int t, u32 (&lo)[2],
                                         u32 (&hi)[2]) {
  float a[4], b[4];
  kv_f16<0x3210u>(klo, lo[0], lo[1]);
  kv_f16<0x3210u>(khi, hi[0], hi[1]);
  f16x4_to_f32(lo[0], lo[1], a);
  f16x4_to_f32(hi[0], hi[1], b);
  const float off = (float)(rel0 + tok);
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    float sn, cs;
    sincospi_approx(off * rope_fpi(16 * ks + 4 * t + e), sn, cs);
    if (ROPE_KEY_SCALE != 1.f) { sn *= ROPE_KEY_SCALE; cs *= ROPE_KEY_SCALE; }
    const float x = a[e] * cs - b[e] * sn, y = b[e] * cs + a[e] * sn;
    a[e] = x;
    b[e] = y;
  }
  lo[0] = pack2(a[0], a[1]); lo[1] = pack2(a[2], a[3]);
  hi[0] = pack2(b[0], b[1]); hi[1] = pack2(b[2], b[3]);
}

// Head block i's score s in the kernel's log2 units (MELD_Q_TO_F16: s carries its row's 2^e, taken out first, exactly).
__device__ __forceinline__ float log2_score(const DecodeParams& p, const WarpState& st, int i, float s) {
  return (Q_TO_F16 ? s * st.q_unscale[i] : s) * p.sm_scale_log2;
}

// MELD_ROPE over MELD_KV_FP8: an FP8 tile's K channel blocks 2 kp and 2 kp + 1 (b[j]: tokens 0-7 of block 2 kp + j;
// b[2 + j]: tokens 8-15) and their partners KSTEPS / 2 on (c), which rope_fp8 rotates together.
__device__ __forceinline__ void ld_k_rope_fp8(u32 kbase, int kp, int lrow, int lch, u32 (&b)[4], u32 (&c)[4]) {
  ldmatrix_x4(b, kbase + tile_off(lrow, 2 * kp + lch));
  ldmatrix_x4(c, kbase + tile_off(lrow, 2 * kp + KSTEPS / 2 + lch));
}

// The tile's scores as S = Q . K^T (units of 16 or more heads: Q's rows as the A operand), their online softmax (the
// masks compute_tile describes), and for each head block i: the factors O^T's columns (heads 8 i + 2t, + 1) take to
// the new maxima (a_lo, a_hi) and P^T's B fragments (pb0: tokens 2t, 2t + 1 of head 8 i + g; pb1: 8 + 2t, 9 + 2t).
__device__ __forceinline__ void scores_rows(const DecodeParams& p, WarpState& st, u32 kbase, int nvalid, int lo,
                                            int causal, int row0, int rel0, int lane, float (&a_lo)[NT],
                                            float (&a_hi)[NT], u32 (&pb0)[NT], u32 (&pb1)[NT]) {
  const int t = lane & 3;
  const int lrow = (lane & 7) + ((lane >> 4) << 3);
  const int lch = (lane >> 3) & 1;
  float sc[MT][2][4];   // m16 tile m's scores of tokens 0-7 ([m][0]) and 8-15 ([m][1])
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int k = 0; k < 4; ++k) sc[m][0][k] = sc[m][1][k] = 0.f;
  if (KV_FP8 && ROPE) {   // two ldmatrix: channel blocks ks = 2 kp + j (b[j], b[2 + j] as below) and their partners
                          // ks + KSTEPS / 2 (c[j], c[2 + j]), rotated together in registers; with Q_SMEM, two at a
#pragma unroll (Q_SMEM ? 2 : KSTEPS / 4)   // time (the rotations' temporaries would take registers O^T holds)
    for (int kp = 0; kp < KSTEPS / 4; ++kp) {
      u32 b[4], c[4];
      ld_k_rope_fp8(kbase, kp, lrow, lch, b, c);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {   // tokens g and g + 8: accumulators sc[m][half]
          const int ks = 2 * kp + j, kh = ks + KSTEPS / 2;
          u32 bl[2], bh[2];
          rope_fp8(b[2 * half + j], c[2 * half + j], ks, rel0, (lane >> 2) + 8 * half, t, bl, bh);
#pragma unroll
          for (int m = 0; m < MT; ++m) {
            u32 a0, a1, a2, a3, h0, h1, h2, h3;
            q_frag(st, ks, m, lane, a0, a1, a2, a3);
            q_frag(st, kh, m, lane, h0, h1, h2, h3);
            mma_16816(sc[m][half], a0, a1, a2, a3, bl[0], bl[1]);
            mma_16816(sc[m][half], h0, h1, h2, h3, bh[0], bh[1]);
          }
        }
      }
    }
    if (ROPE_KEY_SCALE != 1.f) {
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int k = 0; k < 4; ++k) { sc[m][0][k] *= 1.f / ROPE_KEY_SCALE; sc[m][1][k] *= 1.f / ROPE_KEY_SCALE; }
    }
  } else if (KV_FP8) {   // one ldmatrix: tokens 0-7 (b[j]) and 8-15 (b[2 + j]) of channel blocks ks = 2 kp + j
#pragma unroll
    for (int kp = 0; kp < KSTEPS / 2; ++kp) {
      u32 b[4];
      ldmatrix_x4(b, kbase + tile_off(lrow, 2 * kp + lch));
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int ks = 2 * kp + j;
        u32 b0, b1, b2, b3;
        kv_pair<0x3210u>(b[j], b0, b1);
        kv_pair<0x3210u>(b[2 + j], b2, b3);
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          u32 a0, a1, a2, a3;
          q_frag(st, ks, m, lane, a0, a1, a2, a3);
          mma_16816(sc[m][0], a0, a1, a2, a3, b0, b1);
          mma_16816(sc[m][1], a0, a1, a2, a3, b2, b3);
        }
      }
    }
  } else {
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
      u32 b[4];
      ldmatrix_x4(b, kbase + tile_off(lrow, 2 * ks + lch));
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        u32 a0, a1, a2, a3;
        q_frag(st, ks, m, lane, a0, a1, a2, a3);
        mma_16816(sc[m][0], a0, a1, a2, a3, b[0], b[1]);
        mma_16816(sc[m][1], a0, a1, a2, a3, b[2], b[3]);
      }
    }
  }
  // Head block i: scores of head 8 i + g for tokens 2t, 2t+1, 8+2t, 9+2t (log2 domain), from m16 tile i / 2's
  // accumulator rows g (i even) and g + 8 (i odd).
  const int tok[4] = {2 * t, 2 * t + 1, 8 + 2 * t, 9 + 2 * t};
#pragma unroll
  for (int i = 0; i < NT; ++i) {
    const float (&s0)[4] = sc[i / 2][0], (&s1)[4] = sc[i / 2][1];
    const int r = 2 * (i % 2);
    float x[4] = {log2_score(p, st, i, s0[r]), log2_score(p, st, i, s0[r + 1]),
                  log2_score(p, st, i, s1[r]), log2_score(p, st, i, s1[r + 1])};
    const int nv = Q_LEN == 1 ? nvalid : min(nvalid, causal + (row0 + 8 * i + (lane >> 2)) % Q_LEN);   // this row's
#pragma unroll
    for (int k = 0; k < 4; ++k)   // past the unit's end (or before the window): masked; else Inf and NaN scores
      x[k] = tok[k] >= nv || (WINDOW && tok[k] < lo) ? neg_inf() : soft_cap(x[k] + 0.f * x[k]);   // become NaN
    float mx = fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(st.m[i], mx);
    const float m_use = m_new == neg_inf() ? 0.f : m_new;   // nothing seen yet: keep exp2 finite
    const float alpha = exp2_approx(st.m[i] - m_use);
    float pr[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) pr[k] = exp2_approx(x[k] - m_use);
    st.l[i] = st.l[i] * alpha + (pr[0] + pr[1]) + (pr[2] + pr[3]);
    st.m[i] = m_new;
    pb0[i] = Q_TO_F16 ? pack2(pr[0] * P_SCALE, pr[1] * P_SCALE) : pack2(pr[0], pr[1]);
    pb1[i] = Q_TO_F16 ? pack2(pr[2] * P_SCALE, pr[3] * P_SCALE) : pack2(pr[2], pr[3]);
    a_lo[i] = __shfl_sync(0xffffffffu, alpha, 8 * t);      // head 8i + 2t lives in lanes 8t..8t+3
    a_hi[i] = __shfl_sync(0xffffffffu, alpha, 8 * t + 4);  // head 8i + 2t + 1
  }
}

// The same for an 8-head unit (ST) as S^T = K . Q^T: K's 16 tokens as the A operand (ldmatrix's four 8 x 8 blocks in
// A's order; an FP8 tile's converted pairs straight into A's registers), Q's 8 heads as B, so one HMMA a channel block
// and no padding rows. Lane (g, t) holds tokens g and g + 8 of heads 2t and 2t + 1: a head's maximum is over the 8
// lanes of its t (shuffles across g), each lane keeps its own heads' m, l and factors (O^T's columns are the same
// heads: no shuffle for them), and P^T's B fragments are S^T's 8 x 8 blocks transposed (movmatrix).
__device__ __forceinline__ void scores_cols(const DecodeParams& p, WarpState& st, u32 kbase, int nvalid, int lo,
                                            int causal, int row0, int rel0, int lane, float& a_lo, float& a_hi,
                                            u32& pb0, u32& pb1) {
  const int g = lane >> 2, t = lane & 3;
  // S^T: token g of heads 2t, 2t + 1 ([0], [1]); token g + 8 ([2], [3]); the even and odd channel blocks in two
  // accumulators (two HMMA chains of half the length), summed after
  float sc2[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
  if (KV_FP8) {   // one ldmatrix: tokens 0-7 (b[j]) and 8-15 (b[2 + j]) of channel blocks 2 kp + j, as scores_rows has them
    const int lrow = (lane & 7) + ((lane >> 4) << 3), lch = (lane >> 3) & 1;
    if (ROPE) {   // and their partners ks + KSTEPS / 2 (c), rotated together in registers (rope_fp8)
#pragma unroll (Q_SMEM ? 2 : KSTEPS / 4)
      for (int kp = 0; kp < KSTEPS / 4; ++kp) {
        u32 b[4], c[4];
        ld_k_rope_fp8(kbase, kp, lrow, lch, b, c);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int ks = 2 * kp + j, kh = ks + KSTEPS / 2;
          u32 l0[2], h0[2], l1[2], h1[2], q0, q1, r0, r1;
          rope_fp8(b[j], c[j], ks, rel0, g, t, l0, h0);
          rope_fp8(b[2 + j], c[2 + j], ks, rel0, g + 8, t, l1, h1);
          q_bfrag(st, ks, lane, q0, q1);
          q_bfrag(st, kh, lane, r0, r1);
          mma_16816(sc2[0], l0[0], l1[0], l0[1], l1[1], q0, q1);
          mma_16816(sc2[1], h0[0], h1[0], h0[1], h1[1], r0, r1);
        }
      }
      if (ROPE_KEY_SCALE != 1.f) {
#pragma unroll
        for (int k = 0; k < 4; ++k) { sc2[0][k] *= 1.f / ROPE_KEY_SCALE; sc2[1][k] *= 1.f / ROPE_KEY_SCALE; }
      }
    } else {
#pragma unroll
      for (int kp = 0; kp < KSTEPS / 2; ++kp) {
        u32 b[4];
        ldmatrix_x4(b, kbase + tile_off(lrow, 2 * kp + lch));
#pragma unroll
        for (int j = 0; j < 2; ++j) {   // A: tokens g (a0, a2) and g + 8 (a1, a3), channel pairs as Q's B has them
          u32 a0, a1, a2, a3, q0, q1;
          kv_pair<0x3210u>(b[j], a0, a2);
          kv_pair<0x3210u>(b[2 + j], a1, a3);
          q_bfrag(st, 2 * kp + j, lane, q0, q1);
          mma_16816(sc2[j], a0, a1, a2, a3, q0, q1);
        }
      }
    }
  } else {   // ldmatrix in A's order: tokens 0-7 and 8-15 of the block's first 8 channels, then of its last 8
    const int arow = (lane & 7) + (((lane >> 3) & 1) << 3), ach = lane >> 4;
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
      u32 a[4], q0, q1;
      ldmatrix_x4(a, kbase + tile_off(arow, 2 * ks + ach));
      q_bfrag(st, ks, lane, q0, q1);
      mma_16816(sc2[ks & 1], a[0], a[1], a[2], a[3], q0, q1);
    }
  }
  const float sc[4] = {sc2[0][0] + sc2[1][0], sc2[0][1] + sc2[1][1], sc2[0][2] + sc2[1][2], sc2[0][3] + sc2[1][3]};
  float x[4], m_use[2], alpha[2], pr[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {   // masked as scores_rows masks (row: head 2t + k % 2; token g + 8 (k / 2))
    const int tok = g + 8 * (k >> 1);
    const int nv = Q_LEN == 1 ? nvalid : min(nvalid, causal + (row0 + 2 * t + (k & 1)) % Q_LEN);
    const float s = log2_score(p, st, k & 1, sc[k]);
    x[k] = tok >= nv || (WINDOW && tok < lo) ? neg_inf() : soft_cap(s + 0.f * s);
  }
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    float mx = fmaxf(x[j], x[j + 2]);
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
    const float m_new = fmaxf(st.m[j], mx);
    m_use[j] = m_new == neg_inf() ? 0.f : m_new;   // nothing seen yet: keep exp2 finite
    alpha[j] = exp2_approx(st.m[j] - m_use[j]);
    st.m[j] = m_new;
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) pr[k] = exp2_approx(x[k] - m_use[k & 1]);
#pragma unroll
  for (int j = 0; j < 2; ++j) st.l[j] = st.l[j] * alpha[j] + (pr[j] + pr[j + 2]);
  const float ps = Q_TO_F16 ? P_SCALE : 1.f;
  pb0 = movmatrix_trans(pack2(pr[0] * ps, pr[1] * ps));   // [head g][tokens 2t, 2t + 1]
  pb1 = movmatrix_trans(pack2(pr[2] * ps, pr[3] * ps));   // [head g][tokens 8 + 2t, 9 + 2t]
  a_lo = alpha[0];
  a_hi = alpha[1];
}

// The tile's tokens [0, nvalid) are the unit's; MELD_WINDOW_LEFT builds mask its first `lo` (before the window);
// MELD_Q_LEN > 1 builds mask row r's tokens from `causal` + r % Q_LEN on (the tile's keys the request's first new
// token sees: row0 is the unit's first row); MELD_ROPE over MELD_KV_FP8 rotates its keys, tile row r at offset
// rel0 + r from the query (rope_fp8).
__device__ __forceinline__ void compute_tile(const DecodeParams& p, WarpState& st, u32 kbase, int nvalid, int lo,
                                             int causal, int row0, int rel0, int lane) {
  if (TMA && nvalid < TILE) {   // a TMA tile holds whole pages: zero the V rows past the unit's end,
    for (int i = lane; i < (TILE - nvalid) * CPR; i += 32)   // which P (0 there) must not turn into NaN
      st_shared_zero16(kbase + TILE_BYTES + tile_off(nvalid + i / CPR, i % CPR));
    __syncwarp();
  }
  if (WINDOW && lo > 0) {   // likewise the V rows of keys before the window (read: they share its first page)
    for (int i = lane; i < min(lo, TILE) * CPR; i += 32)
      st_shared_zero16(kbase + TILE_BYTES + tile_off(i / CPR, i % CPR));
    __syncwarp();
  }
  float a_lo[NT], a_hi[NT];   // each head block's factors for O^T's columns (heads 8 i + 2t, + 1), and P^T's B
  u32 pb0[NT], pb1[NT];       // fragments
  if constexpr (ST)
    scores_cols(p, st, kbase, nvalid, lo, causal, row0, rel0, lane, a_lo[0], a_hi[0], pb0[0], pb1[0]);
  else
    scores_rows(p, st, kbase, nvalid, lo, causal, row0, rel0, lane, a_lo, a_hi, pb0, pb1);
  const int lrow = (lane & 7) + ((lane >> 4) << 3);
  const int lch = (lane >> 3) & 1;
  const u32 vbase = kbase + TILE_BYTES;
  if (KV_FP8) {   // one ldmatrix: tokens 0-7 (a[j]) and 8-15 (a[2 + j]) of channel blocks mt = 2 mp + j;
#pragma unroll    // byte k of a register: token 2t + k / 2, channel 2g + k % 2: regrouped by channel
    for (int mp = 0; mp < KSTEPS / 2; ++mp) {
      u32 a[4];
      ldmatrix_x4_trans(a, vbase + tile_off(lrow, 2 * mp + lch));
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        u32 a0, a1, a2, a3;   // rows g (channel 2g) and g + 8 (channel 2g + 1), tokens 2t, 2t+1 (+8)
        kv_pair<0x3120u>(a[j], a0, a1);
        kv_pair<0x3120u>(a[2 + j], a2, a3);
#pragma unroll
        for (int i = 0; i < NT; ++i) {
          float (&o)[4] = st.o[i][2 * mp + j];
          o[0] *= a_lo[i]; o[1] *= a_hi[i]; o[2] *= a_lo[i]; o[3] *= a_hi[i];
          mma_16816(o, a0, a1, a2, a3, pb0[i], pb1[i]);
        }
      }
    }
  } else {
#pragma unroll
    for (int mt = 0; mt < KSTEPS; ++mt) {
      u32 a[4];
      ldmatrix_x4_trans(a, vbase + tile_off(lrow, 2 * mt + lch));
#pragma unroll
      for (int i = 0; i < NT; ++i) {
        float (&o)[4] = st.o[i][mt];
        o[0] *= a_lo[i]; o[1] *= a_hi[i]; o[2] *= a_lo[i]; o[3] *= a_hi[i];
        mma_16816(o, a[0], a[1], a[2], a[3], pb0[i], pb1[i]);
      }
    }
  }
}

struct MergeArea {   // one merge pass's rows: all of a unit's, or MERGE_ROWS of them at a time
  float o[WARPS][MERGE_ROWS][O_STRIDE];
  float m[WARPS][MERGE_ROWS];
  float l[WARPS][MERGE_ROWS];
  int last;
};

// The partials of this CTA's split pieces kept for an on-chip merge: [0] the piece that starts its
// segment, [1] the piece that ends it (each written once per launch), and the arrival counter of the
// unit whose first piece ends this CTA's segment.
struct __align__(16) PartArea {
  float o[2][HEADS][D];
  float lse[2][HEADS];
  unsigned counter;
};
constexpr int PART_OFFSET = (RING_BYTES + (int)sizeof(MergeArea) + 15) & ~15;
constexpr int PART_BYTES = ONCHIP ? (int)sizeof(PartArea) : 0;
constexpr int MBAR_OFFSET = (PART_OFFSET + PART_BYTES + 7) & ~7;
constexpr int MBAR_BYTES = TMA ? WARPS * STAGES * 8 : 0;
static_assert(MBAR_OFFSET + MBAR_BYTES <= SMEM_BYTES, "SMEM_BYTES (from Python) is too small");
constexpr bool Q_IN_MERGE = Q_SMEM && !CHUNKED;   // Q's fragments in the merge area, else (Q_SMEM) after the barriers
constexpr int QS_BYTES = NT * KSTEPS * 32 * 8;
static_assert(!Q_IN_MERGE || QS_BYTES <= sizeof(MergeArea::o), "Q's fragments fit the merge area");
static_assert(!Q_SMEM || Q_IN_MERGE || MBAR_OFFSET + MBAR_BYTES + QS_BYTES <= SMEM_BYTES,
              "SMEM_BYTES (from Python) is too small");

// Four final outputs (h, d..d+3) of the batch row `row` into out/lse (lse when d == 0).
__device__ __forceinline__ void store_final4(u16* out, float* lse, i64 row, int d, float4 v, float lse2) {
  uint2 packed;
  packed.x = pack2_as<MELD_OUT_TYPE[0] == 'b'>(v.x, v.y);
  packed.y = pack2_as<MELD_OUT_TYPE[0] == 'b'>(v.z, v.w);
  *reinterpret_cast<uint2*>(out + row * D + d) = packed;
  if (d == 0 && lse != nullptr) lse[row] = lse2 * kLn2;
}

// Four outputs (h, d..d+3) of a unit, and the head's lse when d == 0 (MELD_XRANK: into the ranks' windows;
// MELD_RAGGED_Q: none for a token past the request's).
__device__ __forceinline__ void store_out4(const DecodeParams& p, const Unit& x, int h, int d, float4 v, float lse2) {
  const int r = x.q_head + h;
  if (RAGGED && r % Q_LEN >= new_tokens(x)) return;
  const i64 row = Q_LEN == 1 ? (i64)x.xb * p.num_qo_heads + x.q_head + h
                             : ((RAGGED ? (i64)first_row(x) : (i64)x.xb * Q_LEN) + r % Q_LEN) * p.num_qo_heads + r / Q_LEN;
#if MELD_XRANK
  xrank_store4(p, x, row, h, d, v, lse2);
#else
  store_final4(p.out, p.lse, row, d, v, lse2);
#endif
}

// How many of a split unit's parts merge it, each a slice of its outputs: up to MERGE_SLICES when one CTA would
// take more than one pass over the outputs (a thread per four; 16 rows and more at head_dim 128), every part runs
// in this grid and every CTA of the grid is resident at once (p.grid_resident: the op checks its mix against the
// kernel's occupancy), else 1, the last arriver alone (a merger that waits sees the last arrival one load later).
// Part k < slices (the piece on CTA first_cta + k) waits for every part, then merges outputs [k n / slices,
// (k + 1) n / slices) of the n; the last part never merges, since it starts its CTA's segment and a CTA must not
// wait while its own later work is waited on. Part 0 ends its CTA's segment and a middle part is its CTA's whole
// segment, so a waiting CTA has no work left, and every part it waits for is computed with no wait before it (the
// last part is its CTA's first piece): no cycle. One merger alone reads every byte the unit's pieces wrote (16 parts
// of 32 rows: 256 KiB) through one SM, on the kernel's tail.
constexpr int MERGE_SLICES = 8;
constexpr bool SLICED_MERGES = !CHUNKED && !MELD_XRANK && HEADS * (D / 4) > THREADS;   // (else no code for them)
__device__ __forceinline__ int merge_slices(const DecodeParams& p, const Unit& x) {
  if (!SLICED_MERGES || x.onchip || x.slot < 0 || !p.grid_resident || x.rows * (D / 4) <= THREADS) return 1;
  if (x.first_cta < p.cta_offset || x.first_cta + x.num_parts > p.cta_offset + (int)gridDim.x) return 1;
  return min(x.num_parts - 1, MERGE_SLICES);
}
// A slice's merger waits for every part of the unit (acquire: their partials are visible after the barrier), under
// twice the watchdog's limit: a part's own waits (its ring stages) give up first and name the cause.
__device__ __forceinline__ void await_parts(const DecodeParams& p, const Unit& x, int u, int cta) {
  if (threadIdx.x == 0)
    event_wait(reinterpret_cast<const int*>(p.counters + u), x.num_parts,
               WaitSite{p.watchdog, p.watchdog_claim, p.watchdog_kernel, 21, cta, 0, u, x.num_parts},
               2 * (i64)MELD_WATCHDOG_NS);
  __syncthreads();
}

// End of a piece: merge the warps' states (MERGE_ROWS rows a pass through the merge area), then write the output
// (whole unit) or this piece's partial and count its arrival. Returns true when this CTA completed a split unit and
// must merge it, or merges a slice of it (merge_slices).
__device__ __forceinline__ bool finish_piece(const DecodeParams& p, const Unit& x, int u, const Place& pl,
                                             WarpState& st, MergeArea& mg, PartArea& pa, int warp, int lane) {
  const int g = lane >> 2, t = lane & 3;
  if (Q_IN_MERGE) __syncthreads();   // every warp's last tile has read Q before the merge area holding it is rewritten
#pragma unroll
  for (int pass = 0; pass < MERGE_PASSES; ++pass) {   // rows [pass MERGE_ROWS, (pass + 1) MERGE_ROWS)
    if (pass > 0) __syncthreads();   // the last pass's reads are done before its area is rewritten
    constexpr int BLOCKS = MERGE_ROWS / 8;
#pragma unroll
    for (int b = 0; b < BLOCKS; ++b) {
      const int i = pass * BLOCKS + b;   // the head block; the area's rows 8 b ..
      // o - o is 0, or NaN for an Inf or NaN accumulator: summed over a head's channels (this lane's, then
      // the 8 lanes of the same t) and added to each of them, it turns the head's whole output row NaN and
      // leaves l, and so lse, to the scores (IEEE semantics, above).
      float bad_lo = 0.f, bad_hi = 0.f;   // heads 8 i + 2 t and 8 i + 2 t + 1
#pragma unroll
      for (int mt = 0; mt < KSTEPS; ++mt) {
        const float(&o)[4] = st.o[i][mt];
        bad_lo += (o[0] - o[0]) + (o[2] - o[2]);
        bad_hi += (o[1] - o[1]) + (o[3] - o[3]);
      }
#pragma unroll
      for (int d = 4; d < 32; d <<= 1) {
        bad_lo += __shfl_xor_sync(0xffffffffu, bad_lo, d);
        bad_hi += __shfl_xor_sync(0xffffffffu, bad_hi, d);
      }
      if constexpr (ST) {   // heads 2t + j: the 8 lanes of t sum l
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          float l = st.l[j] + __shfl_xor_sync(0xffffffffu, st.l[j], 4);
          l += __shfl_xor_sync(0xffffffffu, l, 8);
          l += __shfl_xor_sync(0xffffffffu, l, 16);
          if (g == 0) { mg.m[warp][2 * t + j] = st.m[j]; mg.l[warp][2 * t + j] = l; }
        }
      } else {
        float l = st.l[i] + __shfl_xor_sync(0xffffffffu, st.l[i], 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        if (t == 0) { mg.m[warp][8 * b + g] = st.m[i]; mg.l[warp][8 * b + g] = l; }
      }
      const int h = 8 * b + 2 * t;
#pragma unroll
      for (int mt = 0; mt < KSTEPS; ++mt) {
        const int lo = KV_FP8 ? 16 * mt + 2 * g : 16 * mt + g, hi = KV_FP8 ? lo + 1 : lo + 8;   // rows g, g + 8
        mg.o[warp][h][lo] = st.o[i][mt][0] + bad_lo;
        mg.o[warp][h + 1][lo] = st.o[i][mt][1] + bad_hi;
        mg.o[warp][h][hi] = st.o[i][mt][2] + bad_lo;
        mg.o[warp][h + 1][hi] = st.o[i][mt][3] + bad_hi;
      }
    }
    __syncthreads();
    const int own = x.head ? 0 : 1;
    constexpr int Q = D / 4;
    const int rows = MERGE_PASSES == 1 ? x.rows : min(MERGE_ROWS, x.rows - pass * MERGE_ROWS);
    for (int i = threadIdx.x; i < rows * Q; i += THREADS) {   // four outputs of one head per thread
      const int a = i / Q, h = pass * MERGE_ROWS + a, d = (i - a * Q) * 4;   // the area's row a: the unit's row h
      float mmax = neg_inf();
#pragma unroll
      for (int w = 0; w < WARPS; ++w) mmax = fmaxf(mmax, mg.m[w][a]);
      const float m_use = mmax == neg_inf() ? 0.f : mmax;
      float lsum = 0.f;
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int w = 0; w < WARPS; ++w) {
        const float sc = exp2_approx(mg.m[w][a] - m_use);
        const float4 o = *reinterpret_cast<const float4*>(&mg.o[w][a][d]);
        lsum += mg.l[w][a] * sc;
        acc.x += o.x * sc; acc.y += o.y * sc; acc.z += o.z * sc; acc.w += o.w * sc;
      }
      // 0: an empty unit; NaN stays NaN (MELD_Q_TO_F16: O carries P's 2^15)
      const float inv = lsum == 0.f ? 0.f : (KV_FP8 ? p.v_scale : 1.f) / (Q_TO_F16 ? lsum * P_SCALE : lsum);
      const float4 val = make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
      const float lse2 = lsum == 0.f ? neg_inf() : m_use + log2_approx(lsum);
      if (x.slot < 0) {
        store_out4(p, x, h, d, val, lse2);
      } else if (x.onchip) {
        *reinterpret_cast<float4*>(&pa.o[own][h][d]) = val;
        if (d == 0) pa.lse[own][h] = lse2;
      } else {
        *reinterpret_cast<float4*>(p.part_o + ((i64)x.slot * HEADS + h) * D + d) = val;
        if (d == 0) p.part_lse[x.slot * HEADS + h] = lse2;
      }
    }
  }
  if (x.slot < 0 || (CHUNKED && x.k < x.k_last)) {   // (MELD_CHUNKED: the unit's chunks here arrive together,
    __syncthreads();   // with its last one.) The merge area is rewritten by the next piece
    return false;
  }
  if (!x.onchip) __threadfence();   // partials visible device-wide before the counter says so
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned arrivals = CHUNKED ? x.k_last - x.k_first + 1 : 1;
    bool last;
    if (x.onchip) {
      fence_cluster();               // this CTA's partial (ordered by the barrier above) before the count
      last = event_arrive_cluster(dsmem_map(smem_addr(&pa.counter), x.first_cta - pl.cluster_first), arrivals,
                                  (unsigned)x.num_parts);
    } else {
      last = event_arrive(p.counters + u, arrivals, (unsigned)x.num_parts);
    }
    mg.last = last;
    if (last) {
      if (x.onchip) fence_cluster(); else __threadfence();
    }
  }
  const int slices = merge_slices(p, x);
  if (slices > 1) return x.slot - x.parts_begin < slices;   // (no barrier: mg.last is not read)
  __syncthreads();
  return mg.last;
}

// The last arriver merges the unit's partials (k = 0: the piece that ends CTA first_cta's segment;
// k >= 1: the piece that starts CTA first_cta + k's segment) and writes the output. The merge sits on the
// kernel's tail, so each thread merges four outputs of one head on its own (split_kv.cuh, merge_lse4: no
// shared memory, no barrier), a chunk's loads of lse and values in flight together (volatile loads: one round
// trip). Chunk sizes: 16 parts (a unit over the 132 SMs has ~17) for head_dim 128; 8 elsewhere, since 16 cost the
// head_dim-64 kernel registers and made it slower throughout (bench/RESULTS.md, "one-round-trip merges"). A chunk
// issues all its slots' instructions, used or not, and a merge is bound by its instruction stream (ncu at q_len 8,
// B=8: two or three parts in a 16-part chunk took as long as 16 parts), so a unit of up to 4 (8) parts takes a chunk
// of 4 (8), except in batch-invariant builds (whose registers it would spill). Every merger of a unit has its part
// count, so all of them still get the same bits.
constexpr int MERGE_CHUNK = D == 128 ? 16 : 8;
// `load(k, h, d, lse, v)` reads part k's lse (log2) and outputs h, d..d+3; the result goes to store_out4. Slice k of
// `slices` merges the unit's outputs (four channels of one head each) [k n / slices, (k + 1) n / slices) of the n.
template <int CHUNK, class Load>
__device__ __forceinline__ void merge_parts_in(const DecodeParams& p, const Unit& x, int parts, Load& load, int lo,
                                               int hi) {
  constexpr int Q = D / 4;
  for (int i = lo + threadIdx.x; i < hi; i += THREADS) {
    const int h = i / Q, d = (i - h * Q) * 4;
    float lse2[1];
    float4 v[1];
    merge_lse4<CHUNK, 1>(parts, [&](int k, int, float& lse, float4& o) { load(k, h, d, lse, o); }, v, lse2);
    store_out4(p, x, h, d, v[0], lse2[0]);
  }
}
template <class Load>
__device__ __forceinline__ void merge_parts(const DecodeParams& p, const Unit& x, int parts, Load load, int k = 0,
                                            int slices = 1) {
  const int n = x.rows * (D / 4), lo = k * n / slices, hi = (k + 1) * n / slices;
  if (!CHUNKED && parts <= 4) merge_parts_in<4>(p, x, parts, load, lo, hi);   // (batch-invariant builds: no
  else if (!CHUNKED && MERGE_CHUNK > 8 && parts <= 8) merge_parts_in<8>(p, x, parts, load, lo, hi);   // registers)
  else merge_parts_in<MERGE_CHUNK>(p, x, parts, load, lo, hi);
}

// slices > 1: this CTA merges slice x.slot - x.parts_begin, after await_parts (merge_slices).
__device__ __forceinline__ void merge_unit(const DecodeParams& p, const Unit& x, int u, const Place& pl,
                                           PartArea& pa, int slices) {
  const u32 pa_addr = smem_addr(&pa);
  const float* lse0 = p.part_lse + (i64)x.parts_begin * HEADS;   // part 0's (part k's: k HEADS further)
  const float* o0 = p.part_o + (i64)x.parts_begin * HEADS * D;   // (k HEADS D further)
  merge_parts(p, x, x.num_parts, [&](int k, int h, int d, float& lse, float4& v) {
    if (x.onchip) {
      const u32 peer = dsmem_map(pa_addr, x.first_cta + k - pl.cluster_first);
      lse = dsmem_load(peer + (u32)((char*)&pa.lse[k == 0][h] - (char*)&pa));
      v = dsmem_load4(peer + (u32)((char*)&pa.o[k == 0][h][d] - (char*)&pa));
    } else {
      v = ld_cg4<true>(o0 + (h * D + d) + (i64)k * (HEADS * D));   // (the values first: the last load is one the
      lse = ld_cg<true>(lse0 + h + (i64)k * HEADS);                 // max waits for; the part's offset last, the
                                                                     // rest of each address the same for every part)
    }
  }, slices > 1 ? x.slot - x.parts_begin : 0, slices);
  if (slices > 1) {
    __syncthreads();   // every thread's loads of the parts are done before the counter can reset
    if (threadIdx.x == 0 && event_arrive(p.counters + u, 1u, (unsigned)(x.num_parts + slices)))
      event_reset(p.counters + u);   // the last merger: ready for the next launch
  } else if (!x.onchip && threadIdx.x == 0) {
    event_reset(p.counters + u);   // every piece has arrived: ready for the next launch
  }
}

// The family's persistent main (persistent.cuh): one CTA per SM (its shared memory decides), every warp
// loading and computing its own tiles of the segment's units.
struct DecodeFamily {
  using Params = DecodeParams;
  static constexpr LaunchKind LAUNCH = LAUNCH_OVERLAPPABLE;
  static constexpr int SMEM_ALIGN = 1024;   // TMA 128-byte-swizzled boxes
  struct State {
    unsigned char* smem;
    int warp, lane;
    Place pl;
    Profiler prof;
    MergeArea& mg;
    PartArea& pa;
    Segment g;
    u32 ring, bars;   // this warp's ring stages and their barriers (TMA)
    LoadCursor lc;
#if MELD_XRANK
    int finished = 0;       // units whose final output this CTA wrote (to every rank)
    bool started = false;   // every rank has started this launch
#endif
    __device__ __forceinline__ State(const DecodeParams& p, unsigned char* smem_)
        : smem(smem_), warp(threadIdx.x >> 5), lane(threadIdx.x & 31),
          mg(*reinterpret_cast<MergeArea*>(smem_ + RING_BYTES)), pa(*reinterpret_cast<PartArea*>(smem_ + PART_OFFSET)) {
      pl.cta = p.cta_offset + blockIdx.x;
      pl.cluster_first = pl.cta - (ONCHIP ? cluster_rank() : 0);
      pl.cluster_ctas = ONCHIP ? cluster_size() : 1;
    }
  };

  // The segment, the barriers and the first tiles' addresses: only plan() tables, which the op before
  // (an overlapped launch's) has not written.
  static __device__ __forceinline__ void setup(const DecodeParams& p, State& s) {
    s.prof.begin(p.prof, p.prof_cap, s.pl.cta, threadIdx.x == 0, p.prof_clock, p.prof_every);
    if (TMA && threadIdx.x == 0) {
      prefetch_tensormap(&p.k_map);
      prefetch_tensormap(&p.v_map);
    }
    if (ONCHIP) {
      if (threadIdx.x == 0) event_reset(&s.pa.counter);
      cluster_arrive();     // the counter is zero before any peer counts on it
      cluster_wait();
    }
    s.g = load_segment(p.cta_table, p.num_ctas, s.pl.cta);   // split_kv.cuh
    s.ring = smem_addr(s.smem) + s.warp * STAGES * STAGE_BYTES;
    s.bars = smem_addr(s.smem + MBAR_OFFSET) + s.warp * STAGES * 8;
    if (TMA) {
      if (s.lane == 0)
        for (int st = 0; st < STAGES; ++st) mbar_init(s.bars + 8 * st, 1);
      fence_mbar_init();
      __syncwarp();
    }
    if (!s.g.empty) {
      s.lc.u = s.g.u_begin;
      s.lc.x = load_unit(p, s.g, s.lc.u, s.pl);
      s.lc.j = s.warp;
      s.lc.live = true;
      cursor_seek(p, s.g, s.lc, s.pl, s.warp, s.lane);
    }
  }

  static __device__ __forceinline__ void run(const DecodeParams& p, State& s) {
    const Segment& g = s.g;
    const Place& pl = s.pl;
    const int warp = s.warp, lane = s.lane;
    LoadCursor& lc = s.lc;
    Profiler& prof = s.prof;
#if MELD_XRANK
    if (pl.cta == 0 && threadIdx.x == 0) xrank_announce(p, pl.cta);
#endif
    if (!g.empty) {
#pragma unroll
      for (int st = 0; st < STAGES - 1; ++st) issue_tile(p, g, lc, s.ring, s.bars, st, pl, warp, lane);

      WarpState ws;
      if (Q_SMEM)
        ws.qs = reinterpret_cast<uint2*>(Q_IN_MERGE ? (unsigned char*)s.mg.o : s.smem + MBAR_OFFSET + MBAR_BYTES);
      int cs = 0;
      u32 phases = 0;
      for (int u = g.u_begin; u <= g.u_last; ++u) {
        Unit x = load_unit(p, g, u, pl);
        load_q(p, x, ws, lane, warp);
        for (;;) {   // the unit's piece here (MELD_CHUNKED: each of its chunks here)
          const i64 t0 = prof.now();
          const int nt = x.num_tiles();
          for (int j = warp; j < nt; j += WARPS) {
            wait_tile(p, s.bars, cs, phases, pl.cta, warp, u);
            const int ns = cs == 0 ? STAGES - 1 : cs - 1;   // the slot consumed last step
            issue_tile(p, g, lc, s.ring, s.bars, ns, pl, warp, lane);
            const int rel0 = ROPE ? x.begin + j * TILE - (p.kv_len[x.req] - 1) : 0;   // the tile's first key's offset
            if (ROPE && !KV_FP8) rope_tile(s.ring + cs * STAGE_BYTES, rel0, lane);
            compute_tile(p, ws, s.ring + cs * STAGE_BYTES, min(TILE, x.end - x.begin - j * TILE),
                         WINDOW ? p.kv_len[x.req] - (x.begin + j * TILE) - 1 - WINDOW_LEFT : 0,
                         Q_LEN > 1 ? p.kv_len[x.req] - (new_tokens(x) - 1) - (x.begin + j * TILE) : 0,
                         x.q_head, rel0, lane);
            cs = cs + 1 == STAGES ? 0 : cs + 1;
          }
#if MELD_XRANK
          if (!s.started) {
            xrank_await_started(p, pl.cta);
            s.started = true;
          }
#endif
          const bool merge = finish_piece(p, x, u, pl, ws, s.mg, s.pa, warp, lane);
          prof.record(t0, PROF_PIECE, u);
          if (merge) {
            const int slices = merge_slices(p, x);
            if (slices > 1) {
              const i64 tw = prof.now();
              await_parts(p, x, u, pl.cta);
              prof.record(tw, PROF_MERGE_WAIT, u);
            }
            const i64 t1 = prof.now();
            merge_unit(p, x, u, pl, s.pa, slices);
            prof.record(t1, x.onchip ? PROF_MERGE_DSMEM : PROF_MERGE_HBM, u);
          }
#if MELD_XRANK
          if (merge || x.slot < 0) s.finished += xrank_finish(p, x, u, pl.cta, s.mg);
#endif
          if (!CHUNKED || x.k >= x.k_last) break;
          enter_chunk(p, x, u, x.k + 1);
          reset_state(ws);
        }
      }
      if (!TMA) cp_async_wait<0>();   // (TMA: every issued tile was waited for)
    }
    if (ONCHIP) {           // peers may still read this CTA's partials: leave together
      const i64 t0 = prof.now();
      cluster_arrive();
      cluster_wait();
      prof.record(t0, PROF_CLUSTER_WAIT, -1);
    }
#if MELD_XRANK
    xrank_exit(p, pl.cta, s.finished, s.mg);
#endif
    prof.end(p.num_ctas);
  }
};

}  // namespace meld

MELD_PERSISTENT_KERNEL(meld_decode_attention, meld::DecodeFamily, meld::THREADS, 1)
