// meld: the decode-attention planner, written once for the GPU and the host.
//
// plan_tables makes the cut of meld/scheduler/decode_plan.py (its NumPy test oracle) from the raw page
// table, block-parallel: loops stride by the block's PT threads and scans are block-wide. The GPU planner
// (decode_plan.cuh) runs it in CTA 0 with 1024 threads; the host planner (meld/runtime/host/decode_plan.cpp,
// for the CPU reference executor and DecodeAttention.schedule) compiles this same text as a block of one
// thread (PLAN_THREADS = 1, under meld/runtime/host/one_thread.h), so the two cannot cut differently.
// With `chunk` > 0 it makes decode_plan.py's batch-invariant cut instead (_cut_chunks): every piece a
// chunk with its own overhead on the line, cuts on the nearest chunk boundary, no head/tail runs, and
// each request's first partial slot in slot_base.
//
// With PLAN_TOKEN_REQUESTS (multi-token decode whose kernel runs one new token per unit: DecodeMLA), request b
// of the page table is planned as p.token_requests = n requests b * n + t, one per new token t, sharing its
// pages and ending n - 1 - t keys before it (the causal mask, exact by construction); a kernel reads their
// lengths and page bases as any request's, and the neighbours on the line read the same KV (from L2 after the
// first). Built without it the planner is what it was (token_requests is then 1 at compile time).
//
// With p.head_major (DecodeMLA: a request's 64-head units read the same KV), the line holds every planned
// request's first unit, then every request's second, and so on: entry e is unit e, of planned request e % S
// (S planned requests) and head block e / S. With equal halves (two head blocks), CTA c and CTA c + W / 2 then
// cut the same tokens of a request at the same time, and read each KV block from DRAM once between them (L2
// serves the other); units side by side on the line would put both on one CTA, one after the other.
//
// Defined by the including source: PLAN_THREADS, PLAN_TOKEN_REQUESTS, struct PlanParams, CtaRow and store_ctarow.

namespace meld {

constexpr int PT = PLAN_THREADS;
constexpr int PW = (PT + 31) / 32;   // warps (one, in the host build)

// Inclusive block-wide scan of one value per thread under an associative op; `total` receives the
// block's reduction. Every thread must call it.
template <class T, class Op>
__device__ __forceinline__ T block_scan(T v, Op op, T* warp_tot, T& total) {
  if constexpr (PT == 1) {   // the host build: the scan of one thread's value is the value
    total = v;
    return v;
  } else {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const T n = __shfl_up_sync(0xffffffffu, v, d);
      if (lane >= d) v = op(n, v);
    }
    if (lane == 31) warp_tot[warp] = v;
    __syncthreads();
    if (warp == 0) {
      T w = warp_tot[lane < PW ? lane : PW - 1];
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const T n = __shfl_up_sync(0xffffffffu, w, d);
        if (lane >= d) w = op(n, w);
      }
      if (lane < PW) warp_tot[lane] = w;
    }
    __syncthreads();
    if (warp > 0) v = op(warp_tot[warp - 1], v);
    total = warp_tot[PW - 1];
    __syncthreads();   // warp_tot is reused by the next call
    return v;
  }
}

struct Add { __device__ long long operator()(long long a, long long b) const { return a + b; } };
struct Max { __device__ int operator()(int a, int b) const { return a > b ? a : b; } };
struct Min { __device__ int operator()(int a, int b) const { return a < b ? a : b; } };

__device__ __forceinline__ long long floor_div(long long a, long long b) {   // b > 0, as NumPy's //
  const long long q = a / b;
  return (a % b != 0 && a < 0) ? q - 1 : q;
}

struct PlanOutcome { int active, snap; };   // what the host build reports besides the tables

__device__ __forceinline__ PlanOutcome plan_tables(const PlanParams& p) {
  __shared__ long long tot64[PW];
  __shared__ int tot32[PW];
  // [num_ctas + 1] long long: where each cut lands after two-level placement (clusters only); then
  // [4][num_ctas] int: unit, token, run first, run last of cut c (1..active-1).
  extern __shared__ long long smem64[];
  long long* moved = smem64;
  int* cut = reinterpret_cast<int*>(smem64 + p.num_ctas + 1);
  const int tr = PLAN_TOKEN_REQUESTS ? p.token_requests : 1;   // planned requests per page-table request
  const bool hm = p.head_major != 0;
  const int S = p.batch * tr;                    // planned requests
  const int tid = threadIdx.x, B = hm ? S * p.units_per_request : S, W = p.num_ctas, nh = hm ? 1 : p.units_per_request;
  const int U = B * nh, o = p.item_overhead, ms = p.min_split, tile = p.tile, chunk = p.chunk;
  // B line entries of nh units each: requests (nh = units per request), or head-major units (nh = 1)
  auto len_of = [&](int b) { return p.kv_len[hm ? b % S : b]; };
  int* cut_u = cut;
  int* cut_s = cut + W;
  int* first = cut + 2 * W;
  int* last = cut + 3 * W;
  long long* R = p.line;

  // 1. Lengths, and the line: entry b occupies [R[b], R[b+1]) with width nh * (len + overhead) (chunks:
  //    nh * (len + overhead * pieces), and slot_base[b] = the pieces of the split requests before it).
  auto pieces = [&](long long len) { return max(1ll, (len + chunk - 1) / chunk); };
  long long carry = 0, slots = 0;
  for (int base = 0; base < B; base += PT) {
    const int b = base + tid;
    long long v = 0, w = 0;
    if (b < B) {
      const int q = hm ? b % S : b;                      // its planned request
      const int r = q / tr, hidden = tr - 1 - q % tr;    // its page-table request, and the keys its token does not see
      const int pages = p.kv_indptr[r + 1] - p.kv_indptr[r];
      const int full = pages > 0 ? (pages - 1) * p.page_size + p.last_page_len[r] : 0;
      const int len = hidden ? max(0, full - hidden) : full;
      if (b < S) {
        p.kv_len[b] = len;
        p.page_base[b] = p.kv_indptr[r];
      }
      const long long n = chunk ? pieces(len) : 1;
      v = (long long)nh * (len + o * n);
      w = n > 1 ? nh * n : 0;
    }
    long long block_total;
    const long long s = block_scan(v, Add(), tot64, block_total);
    if (b < B) R[b + 1] = carry + s;
    carry += block_total;
    if (chunk) {
      const long long sw = block_scan(w, Add(), tot64, block_total);
      if (b < S) p.slot_base[b] = (int)(slots + sw - w);   // (chunked plans are never head-major)
      slots += block_total;
    }
  }
  if (tid == 0) R[0] = 0;
  __syncthreads();
  const long long total = carry;
  int active = (int)min((long long)W, max(1ll, (total + p.min_cta_tokens - 1) / p.min_cta_tokens));

  // 2. Cut c (1..active-1) at line position x: its request (binary search), unit and token, placed as
  //    decode_plan.py's cut() places it (nearest allowed place on a tile when `roomy`, else the old
  //    snapping on a round of the warps, with at least one round per CTA).
  const bool roomy = total / active >= 2 * (o + (ms + tile - 1) / tile * tile + tile);
  const int grain = roomy ? tile : p.round;
  if (!roomy && !chunk) active = (int)min((long long)active, max(1ll, total / grain));
  const long long lo = (ms + grain - 1) / grain * grain, far = 1ll << 62;

  //    A short batch whose units, cut at every allowed grain boundary, give no more pieces than the grid has
  //    CTAs: each piece its own CTA (decode_plan.py); R becomes the requests' pieces, cut c the start of piece c.
  auto round_pieces = [&](long long n) {         // a unit's pieces when cut at every allowed grain boundary
    const long long hi = floor_div(n - ms, grain) * grain;
    return hi >= lo ? (hi - lo) / grain + 2 : 1ll;
  };
  bool per_round = false;
  if (!roomy && !chunk) {
    long long pieces_all = 0;
    for (int base = 0; base < B; base += PT) {
      const int b = base + tid;
      long long block_total;
      block_scan(b < B ? nh * round_pieces(len_of(b)) : 0ll, Add(), tot64, block_total);
      pieces_all += block_total;
    }
    per_round = 0 < pieces_all && pieces_all <= W;
    if (per_round) {
      carry = 0;
      for (int base = 0; base < B; base += PT) {
        const int b = base + tid;
        const long long v = b < B ? nh * round_pieces(len_of(b)) : 0ll;
        long long block_total;
        const long long incl = block_scan(v, Add(), tot64, block_total);
        if (b < B) R[b + 1] = carry + incl;
        carry += block_total;
      }
      active = (int)pieces_all;
      __syncthreads();
    }
  }
  auto request_at = [&](long long x) {           // largest b with R[b] <= x
    int lo_b = 0, hi_b = B;
    while (lo_b < hi_b) {
      const int mid = (lo_b + hi_b + 1) >> 1;
      if (R[mid] <= x) lo_b = mid; else hi_b = mid - 1;
    }
    return lo_b;
  };
  auto cut_at = [&](int c, long long x) {
    const int b = request_at(x);
    const long long wb = (long long)len_of(b) + o, n = wb - o;
    const long long r = x - R[b];
    const long long hb = r / wb;
    const long long pos = r - hb * wb - o;       // token position in the unit (< 0: in its overhead)
    const long long hi = floor_div(n - ms, grain) * grain;
    long long s = floor_div(pos + grain / 2, grain) * grain;
    bool to_end, to_start;
    if (roomy) {
      s = min(max(s, lo), hi);
      const long long d_split = lo <= hi ? llabs(pos - s) : far;
      const long long d_start = pos + o;         // the unit starts with its overhead on the line
      to_end = n - pos < d_start && n - pos < d_split;
      to_start = d_start <= d_split;
    } else {
      to_end = s > hi && s >= lo;
      to_start = s < lo;
    }
    cut_u[c] = b * nh + (int)hb + to_end;
    cut_s[c] = to_end || to_start ? 0 : (int)s;
  };

  auto cut_chunk = [&](int c, long long x) {     // decode_plan.py's _cut_chunks
    const int b = request_at(x);
    const long long n = pieces(len_of(b)), wb = len_of(b) + o * n;
    const long long r0 = x - R[b];
    const long long hb = r0 / wb, r = r0 - hb * wb, step = chunk + o;
    const long long k = min((r + step / 2) / step, n - 1);
    const bool to_end = wb - r < llabs(r - k * step);
    cut_u[c] = b * nh + (int)hb + to_end;
    cut_s[c] = to_end ? 0 : (int)(k * chunk);
  };

  //    Two levels with clusters (roomy only, as decode_plan.py's place()): a cut between two clusters
  //    moves to the nearest unit boundary when that moves it by at most `snap` tokens per CTA of the
  //    smaller cluster; the cuts inside a cluster keep their proportions within its moved span. A cluster
  //    whose moved span left two interior cuts on one token has its snaps undone, until none has.
  const int* cl_first = p.cluster_rows;
  const int* cl_end = p.cluster_rows + W;
  const int snap = roomy && p.cluster_rows != nullptr ? p.cluster_snap : 0;
  int* shift = first;                            // second cut: interior cuts before cut c (scratch until step 3)
  int* undone = last;                            // cut c's snap was undone (scratch until step 3)
  if (snap) {
    for (int c = 1 + tid; c < active; c += PT) undone[c] = 0;
    __syncthreads();
  }
  long long grown = 0;                           // second cut: the line grown by their overheads
  auto target = [&](int c, bool second) -> long long {   // where cut c (0..active) goes on one level
    if (c == 0) return 0;
    if (c == active) return total;
    return second ? (long long)c * grown / active - (long long)o * shift[c] : (long long)c * total / active;
  };
  auto snap_and_cut = [&](bool second) -> int {  // one try; 1 where a cluster's snaps were undone
    for (int c = tid; c <= active; c += PT) {
      const long long x = target(c, second);
      moved[c] = x;
      if (c == 0 || c == active || cl_first[c] != c || undone[c]) continue;
      const int size = cl_end[c] - c, before = cl_end[c - 1] - cl_first[c - 1];
      if (max(size, before) < 2) continue;
      const int b = request_at(x);
      const long long wb = (long long)len_of(b) + o;
      const long long start = R[b] + (x - R[b]) / wb * wb;
      const long long near = x - start <= start + wb - x ? start : start + wb;
      // ... and never past the neighbouring cluster boundaries' own targets: rounding to the nearest unit
      // boundary keeps snapped cuts in order, and this keeps a snapped cut behind an unsnapped neighbour.
      const long long lo = target(cl_first[c - 1], second), hi = target(min(cl_end[c], active), second);
      if (llabs(near - x) <= (long long)snap * min(size, before) && near > 0 && near < total && near >= lo && near <= hi)
        moved[c] = near;
    }
    __syncthreads();
    for (int c = 1 + tid; c < active; c += PT) {
      const int f = cl_first[c], e = min(cl_end[c], active);
      const long long tf = target(f, second);
      cut_at(c, moved[f] + floor_div((target(c, second) - tf) * (moved[e] - moved[f]), target(e, second) - tf));
    }
    __syncthreads();
    int met = 0;                                 // cuts c and c + 1 on one token: undo the snaps of c's cluster
    for (int c = 1 + tid; c + 1 < active; c += PT) {
      if (cut_s[c] == 0 || cut_u[c] != cut_u[c + 1] || cut_s[c] != cut_s[c + 1]) continue;
      const int f = cl_first[c], e = min(cl_end[c], active);
      if (moved[f] != target(f, second)) undone[f] = met = 1;
      if (moved[e] != target(e, second)) undone[e] = met = 1;
    }
    return met;
  };
  auto place_cuts = [&](bool second) {
    if (!snap) {
      for (int c = 1 + tid; c < active; c += PT) cut_at(c, target(c, second));
      return;
    }
    while (__syncthreads_or(snap_and_cut(second))) {
    }
  };
  if (per_round) {
    for (int c = 1 + tid; c < active; c += PT) {
      const int b = request_at(c);
      const long long n = round_pieces(len_of(b)), r = c - R[b], hb = r / n, k = r - hb * n;
      cut_u[c] = b * nh + (int)hb;
      cut_s[c] = k == 0 ? 0 : (int)(lo + (k - 1) * grain);
    }
  } else if (chunk) {
    for (int c = 1 + tid; c < active; c += PT) cut_chunk(c, (long long)c * total / active);
  } else {
    place_cuts(false);
  }
  __syncthreads();

  //    Every piece pays the item overhead, but the line holds it once per unit (at its start): a CTA
  //    whose segment starts inside a unit pays one the line does not show. Second cut (roomy only):
  //    grow the line by one overhead per interior cut of the first and move each cut left by those before it.
  if (roomy && !chunk) {
    long long before = 0;
    for (int base = 1; base < active; base += PT) {
      const int c = base + tid;
      const long long v = c < active && cut_s[c] > 0;
      long long block_total;
      const long long incl = block_scan(v, Add(), tot64, block_total);
      if (c < active) shift[c] = (int)(before + incl - v);
      before += block_total;
    }
    __syncthreads();
    grown = total + o * before;
    place_cuts(true);
    __syncthreads();
  }

  // 3. Runs of interior cuts (s > 0) in one unit: the pieces of a split unit. first = the run's first
  //    cut (max-scan of run starts), last = its last cut (min-scan, right to left, of run ends).
  auto interior = [&](int c) { return !chunk && c >= 1 && c < active && cut_s[c] > 0; };
  int acc = 0;
  for (int base = 0; base < W; base += PT) {
    const int c = base + tid;
    const bool start = c < W && interior(c) && !(interior(c - 1) && cut_u[c - 1] == cut_u[c]);
    int tot;
    const int f = max(acc, block_scan(start ? c : 0, Max(), tot32, tot));
    if (c < W) first[c] = f;
    acc = max(acc, tot);
  }
  acc = 0x7fffffff;
  for (int base = 0; base < W; base += PT) {
    const int c = W - 1 - (base + tid);
    const bool end = c >= 0 && interior(c) && !(interior(c + 1) && cut_u[c + 1] == cut_u[c]);
    int tot;
    const int l = min(acc, block_scan(end ? c : 0x7fffffff, Min(), tot32, tot));
    if (c >= 0) last[c] = l;
    acc = min(acc, tot);
  }
  __syncthreads();

  // 4. The CTA table (meld/ir/schedule.py): segment c runs from cut c to cut c + 1; a split unit that
  //    a segment starts (head) or ends (tail) inside has parts = cuts in its run + 1, the first in CTA
  //    first - 1.
  for (int c = tid; c < W; c += PT) {
    const bool act = c < active;
    const bool head = interior(c), tail = interior(c + 1);
    CtaRow r;
    r.u_begin = c == 0 ? 0 : act ? cut_u[c] : U;
    r.s_begin = c == 0 || !act ? 0 : cut_s[c];
    r.u_end = c + 1 < active ? cut_u[c + 1] : U;
    r.s_end = c + 1 < active ? cut_s[c + 1] : 0;
    r.head_first = head ? first[c] - 1 : 0;
    r.head_parts = head ? last[c] - first[c] + 2 : 0;
    r.tail_first = tail ? first[c + 1] - 1 : 0;
    r.tail_parts = tail ? last[c + 1] - first[c + 1] + 2 : 0;
    r.kind = CTAROW_TASK_KIND;   // the task header (meld/ir/schedule.py: segment_header)
    r.cta = c;
    r.slot = -1;
    r.event_first = r.u_begin;
    const int u_last = r.s_end > 0 ? r.u_end : r.u_end - 1;   // the units it touches (none: an empty segment)
    r.event_count = r.u_begin == r.u_end && r.s_begin == r.s_end ? 0 : u_last - r.u_begin + 1;
    store_ctarow(p.cta_table, W, c, r);   // meld/ir/work_table.py: CTA_TABLE
  }
  return {active, snap};
}

}  // namespace meld
