// meld: grouped (shared-prefix, cascade) decode attention: the split-reduce task and event tables of
// meld.scheduler.plan_split_reduce, walked by persistent CTAs.
//
// A task is a piece [kv_begin, kv_end) of one producer's (a cascade level's) page table for one group of
// requests and one kv head, for every query row of the group: its event_count requests x GROUP q heads,
// rows r = request * GROUP + head. The CTA's warps take the task's 16-row blocks round-robin; a warp streams
// the piece's KV in 16-token tiles through its own shared memory (K as stored, V transposed) and keeps its
// rows' online-softmax state in registers (m16n8k16 tensor-core tiles), so a level's KV is read once per
// 16 rows of the group, not once per request. A task of one row block (a request's own suffix) has the warps
// split its tiles instead and merge their states through shared memory. Each row's normalised partial goes to slot + r (float) with
// its log2-sum-exp.
//
// The combine is fired by a count: after a task's partials are stored, one thread fences and counts the
// task's arrival at each of its events (a request and kv head); the arrival that reaches an event's `parts`
// merges the event's parts (part_slot, in the planner's order) into the output and resets the counter for
// the next launch. No CTA waits for another's work: any grid, any residency, is deadlock-free. Events with
// no part (a request with no KV at any level) write zeros and lse = -inf.
//
// NaN or Inf in q or K reaches exactly the rows whose scores they enter; NaN in V the rows whose P.V it
// enters. Defined by the including source: HEAD_DIM, NUM_WARPS, SMEM_BYTES, MELD_MMA_TYPE, GroupedParams,
// SplitTask, Event (meld.ir.work_table).

namespace meld {

constexpr int GD = HEAD_DIM;
constexpr int GWARPS = NUM_WARPS;
constexpr int GT = 16;                 // KV tokens per tile; query rows per row block
constexpr int GKSTEPS = GD / 16;       // k-steps of Q.K^T
constexpr int GNT = GD / 8;            // n8 tiles of P.V (O's columns)
constexpr int K_STRIDE = GD + 8;       // u16 per K row in shared memory (+8: fewer bank conflicts)
constexpr int V_STRIDE = GT + 8;       // u16 per transposed V row (one head-dim column, 16 tokens)
constexpr int WARP_SMEM = (GT * K_STRIDE + GD * V_STRIDE) * 2;
static_assert(GD % 64 == 0 && GD <= 256, "head_dim must be 64, 128 or 256");
static_assert(GWARPS * WARP_SMEM <= SMEM_BYTES, "SMEM_BYTES (from Python) is too small");

__device__ __forceinline__ u32 lds32(const u16* s) { return *reinterpret_cast<const u32*>(s); }

// One warp's 16 query rows of a task: the rows' online-softmax state over the piece's tokens.
struct RowBlock {
  float o[GNT][4];   // O: n8 tile j, (row g, cols 2t, 2t+1), (row g + 8, ...)
  float m[2], l[2];  // rows g and g + 8 (log2 domain)
};

// The K tile [16 tokens][D] as stored, and the V tile transposed [D][16 tokens], of tokens pos0 .. pos0 + 15
// of the task's piece (tokens at or past `end` load as zeros and are masked out of the scores).
__device__ __forceinline__ void load_kv_tile(const GroupedParams& p, const int* pages, int kv_head, int pos0, int end,
                                             u16* ks, u16* vt, int lane) {
  constexpr int CHUNKS = GD / 8;   // 16-byte chunks per token row
  for (int c = lane; c < GT * CHUNKS; c += 32) {
    const int tok = c / CHUNKS, d = (c - tok * CHUNKS) * 8, pos = pos0 + tok;
    uint4 k = make_uint4(0, 0, 0, 0), v = k;
    if (pos < end) {
      const i64 page = pages[pos / p.page_size];
      const i64 row = ((page * 2) * p.page_size + pos % p.page_size) * p.num_kv_heads + kv_head;
      k = *reinterpret_cast<const uint4*>(p.kv + row * GD + d);
      v = *reinterpret_cast<const uint4*>(p.kv + (row + (i64)p.page_size * p.num_kv_heads) * GD + d);
    }
    *reinterpret_cast<uint4*>(ks + tok * K_STRIDE + d) = k;
    const u16* vv = reinterpret_cast<const u16*>(&v);
#pragma unroll
    for (int i = 0; i < 8; ++i) vt[(d + i) * V_STRIDE + tok] = vv[i];
  }
}

// Q.K^T, online softmax and P.V of one KV tile for the warp's 16 rows (qf: Q's A fragments).
__device__ __forceinline__ void attend_tile(const GroupedParams& p, RowBlock& rb, const u32 (&qf)[GKSTEPS][4],
                                            const u16* ks, const u16* vt, int valid, int lane) {
  const int g = lane >> 2, t = lane & 3;
  float s[2][4];   // S: n8 tiles of tokens 0-7 and 8-15
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
    for (int k = 0; k < GKSTEPS; ++k) {
      const u16* kr = ks + (j * 8 + g) * K_STRIDE + k * 16 + 2 * t;
      mma_16816(s[j], qf[k][0], qf[k][1], qf[k][2], qf[k][3], lds32(kr), lds32(kr + 8));
    }
  }
  float mx[2] = {rb.m[0], rb.m[1]};
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int tok = j * 8 + 2 * t + (c & 1);
      const float x = s[j][c] * p.sm_scale_log2;   // a non-finite score (Inf or NaN in q or K) makes the row NaN
      s[j][c] = tok < valid ? (isinf(x) ? __int_as_float(0x7fc00000) : x) : neg_inf();
      mx[c >> 1] = fmaxf(mx[c >> 1], s[j][c]);
    }
  float alpha[2], sum[2] = {0.f, 0.f};
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
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      s[j][c] = exp2_approx(s[j][c] - mx[c >> 1]);
      sum[c >> 1] += s[j][c];
    }
#pragma unroll
  for (int r = 0; r < 2; ++r) rb.l[r] = rb.l[r] * alpha[r] + sum[r];   // (this thread's columns; reduced at the end)
  const u32 a0 = pack2(s[0][0], s[0][1]), a1 = pack2(s[0][2], s[0][3]), a2 = pack2(s[1][0], s[1][1]),
            a3 = pack2(s[1][2], s[1][3]);
#pragma unroll
  for (int n = 0; n < GNT; ++n) {
    rb.o[n][0] *= alpha[0]; rb.o[n][1] *= alpha[0];
    rb.o[n][2] *= alpha[1]; rb.o[n][3] *= alpha[1];
    const u16* vr = vt + (n * 8 + g) * V_STRIDE + 2 * t;
    mma_16816(rb.o[n], a0, a1, a2, a3, lds32(vr), lds32(vr + 8));
  }
}

// One warp: rows row0 .. row0 + 15 of task `tk` (rows past `rows` are padding: zero q, not stored) over the
// piece's tiles at pos_first, pos_first + pos_step, ...: the rows' state, O unnormalised and l this thread's.
__device__ __forceinline__ RowBlock attend_rows(const GroupedParams& p, const SplitTask& tk, int q0, const int* pages,
                                                int row0, int rows, int pos_first, int pos_step, u16* ks, u16* vt,
                                                int lane) {
  const int g = lane >> 2, t = lane & 3;
  u32 qf[GKSTEPS][4];
#pragma unroll
  for (int h = 0; h < 2; ++h) {   // rows g and g + 8: A fragment registers (0, 2) and (1, 3)
    const int r = row0 + g + 8 * h;
    const u16* q = r < rows ? p.q + ((i64)(q0 + r / p.group_size) * p.num_qo_heads + tk.kv_head * p.group_size +
                                     r % p.group_size) * GD
                            : nullptr;
#pragma unroll
    for (int k = 0; k < GKSTEPS; ++k) {
      qf[k][h] = q ? *reinterpret_cast<const u32*>(q + k * 16 + 2 * t) : 0u;
      qf[k][h + 2] = q ? *reinterpret_cast<const u32*>(q + k * 16 + 8 + 2 * t) : 0u;
    }
  }
  RowBlock rb;
#pragma unroll
  for (int n = 0; n < GNT; ++n) rb.o[n][0] = rb.o[n][1] = rb.o[n][2] = rb.o[n][3] = 0.f;
  rb.m[0] = rb.m[1] = neg_inf();
  rb.l[0] = rb.l[1] = 0.f;
  for (int pos = pos_first; pos < tk.kv_end; pos += pos_step) {
    __syncwarp();   // the last tile's reads are done
    load_kv_tile(p, pages, tk.kv_head, pos, tk.kv_end, ks, vt, lane);
    __syncwarp();
    attend_tile(p, rb, qf, ks, vt, tk.kv_end - pos, lane);
  }
  return rb;
}

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
// rows: the warps split the piece's tiles instead and merge their states through shared memory, each warp's
// state in its own tile area once its last tile is read (rows padded by 4 floats: fewer bank conflicts).
struct WarpStash {
  float o[GT][GD + 4];   // O, unnormalised
  float m[GT], l[GT];
};
static_assert((int)sizeof(WarpStash) <= WARP_SMEM, "a warp's stash must fit its tile area");

__device__ __forceinline__ const WarpStash& stash_of(const unsigned char* smem, int warp) {
  return *reinterpret_cast<const WarpStash*>(smem + warp * WARP_SMEM);
}

__device__ __forceinline__ void stash_rows(const RowBlock& rb, WarpStash& ws, int lane) {
  const int g = lane >> 2, t = lane & 3;
  __syncwarp();   // every lane's reads of the warp's last tile are done: the area is the stash's now
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float l = quad_sum(rb.l[h]);
    const int r = g + 8 * h;
#pragma unroll
    for (int n = 0; n < GNT; ++n)
      *reinterpret_cast<float2*>(&ws.o[r][n * 8 + 2 * t]) = make_float2(rb.o[n][2 * h], rb.o[n][2 * h + 1]);
    if (t == 0) {
      ws.m[r] = rb.m[h];
      ws.l[r] = l;
    }
  }
}

// Every thread of the CTA, after the warps' stash_rows: rows r < rows merged across the warps into their slots.
__device__ __forceinline__ void merge_warps(const GroupedParams& p, const SplitTask& tk, int rows,
                                            const unsigned char* smem) {
  for (int i = threadIdx.x; i < rows * (GD / 4); i += GWARPS * 32) {
    const int r = i / (GD / 4), d = (i - r * (GD / 4)) * 4;
    float mx = neg_inf();
#pragma unroll
    for (int w = 0; w < GWARPS; ++w) mx = fmaxf(mx, stash_of(smem, w).m[r]);
    const float base = mx == neg_inf() ? 0.f : mx;   // (every score NaN: the l's carry it)
    float l = 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < GWARPS; ++w) {   // a warp with no tile: m = -inf, l = 0, O = 0, weight 0
      const WarpStash& ws = stash_of(smem, w);
      const float c = exp2_approx(ws.m[r] - base);
      const float4 v = *reinterpret_cast<const float4*>(&ws.o[r][d]);
      l += c * ws.l[r];
      acc.x += c * v.x; acc.y += c * v.y; acc.z += c * v.z; acc.w += c * v.w;
    }
    const float inv = 1.f / l;
    *reinterpret_cast<float4*>(p.part_o + (i64)(tk.slot + r) * GD + d) =
        make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
    if (d == 0) p.part_lse[tk.slot + r] = base + log2_approx(l);
  }
}

// Event e's parts merged into out and lse (every thread of the CTA), its counter reset for the next launch.
__device__ __forceinline__ void merge_event(const GroupedParams& p, int e) {
  const Event ev = load_event(p.events, p.event_capacity, e);
  const int batch = p.plan_info[0], b = e % batch, kv_head = e / batch;
  for (int i = threadIdx.x; i < p.group_size * (GD / 4); i += GWARPS * 32) {
    const int h = i / (GD / 4), d = (i - h * (GD / 4)) * 4;
    float mx = neg_inf();
    for (int k = 0; k < ev.parts; ++k) mx = fmaxf(mx, ld_cg(p.part_lse + p.part_slot[ev.part_first + k] + h));
    const float base = mx == neg_inf() ? 0.f : mx;
    float sum = 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int k = 0; k < ev.parts; ++k) {
      const int slot = p.part_slot[ev.part_first + k] + h;
      const float w = exp2_approx(ld_cg(p.part_lse + slot) - base);
      const float4 v = ld_cg4(p.part_o + (i64)slot * GD + d);
      sum += w;
      acc.x += w * v.x; acc.y += w * v.y; acc.z += w * v.z; acc.w += w * v.w;
    }
    const float inv = ev.parts ? 1.f / sum : 0.f;   // no part: zeros, lse -inf
    const i64 row = (i64)b * p.num_qo_heads + kv_head * p.group_size + h;
    uint2 packed;
    packed.x = pack2(acc.x * inv, acc.y * inv);
    packed.y = pack2(acc.z * inv, acc.w * inv);
    *reinterpret_cast<uint2*>(p.out + row * GD + d) = packed;
    if (d == 0 && p.lse != nullptr) p.lse[row] = ev.parts ? (base + log2_approx(sum)) * kLn2 : neg_inf();
  }
  if (threadIdx.x == 0) p.counters[e] = 0u;
}

}  // namespace meld

extern "C" __global__ void __launch_bounds__(NUM_WARPS * 32, 1) meld_grouped_attention(const __grid_constant__ GroupedParams p) {
  using namespace meld;
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int FIRED = 64;
  __shared__ int fired[FIRED];   // events one count of this CTA completed (merged by the whole CTA)
  __shared__ int n_fired;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  u16* ks = reinterpret_cast<u16*>(smem + warp * WARP_SMEM);
  u16* vt = ks + GT * K_STRIDE;
  const int num_events = p.plan_info[0] * p.num_kv_heads;   // (plan() writes the batch: graph replays see it)
  for (int e = blockIdx.x; e < num_events; e += gridDim.x)
    if (load_event(p.events, p.event_capacity, e).parts == 0) merge_event(p, e);
  const int first = p.cta_first[blockIdx.x], last = p.cta_first[blockIdx.x + 1];
  for (int i = first; i < last; ++i) {
    const SplitTask tk = load_splittask(p.tasks, p.task_capacity, i);
    const int gid = p.producer_groups[tk.producer] + tk.group;
    const int q0 = p.group_q0[gid];
    const int* pages = p.kv_indices + p.group_pages[gid];
    const int rows = tk.event_count * p.group_size;
    if (rows <= GT) {   // one row block: the warps split its tiles
      stash_rows(attend_rows(p, tk, q0, pages, 0, rows, tk.kv_begin + warp * GT, GWARPS * GT, ks, vt, lane),
                 *reinterpret_cast<WarpStash*>(ks), lane);
      __syncthreads();
      merge_warps(p, tk, rows, smem);
    } else {            // row blocks round-robin over the warps, each over every tile
      for (int row0 = warp * GT; row0 < rows; row0 += GWARPS * GT)
        store_rows(p, tk, attend_rows(p, tk, q0, pages, row0, rows, tk.kv_begin, GT, ks, vt, lane), row0, rows, lane);
    }
    __syncthreads();   // every row of the task is stored (and the stashes read: the next task's tiles overwrite them)
    const int end = tk.event_first + tk.event_count;
    for (int e0 = tk.event_first; e0 < end; e0 += FIRED) {
      if (threadIdx.x == 0) {
        __threadfence();   // the CTA's partials before its counts
        int n = 0;
        for (int e = e0; e < min(end, e0 + FIRED); ++e)
          if (atomicAdd(p.counters + e, 1u) == (unsigned)load_event(p.events, p.event_capacity, e).parts - 1u) fired[n++] = e;
        n_fired = n;
        __threadfence();   // the other parts' partials, counted before ours, are seen (acquire)
      }
      __syncthreads();
      for (int k = 0; k < n_fired; ++k) merge_event(p, fired[k]);
      __syncthreads();   // (fired and n_fired are rewritten next)
    }
  }
}
