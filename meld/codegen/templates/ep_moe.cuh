// meld expert-parallel MoE: the cross-rank launches around each rank's MoE (meld/dist/expert_parallel.py).
// The experts are split into contiguous blocks, one per rank; every rank holds T tokens and their routing
// (the same T on every rank). A call is, in stream order on every rank:
//
//   meld_ep_dispatch  one warp per token: each (token, choice) pair's row of x is stored into its expert's
//                     rank's window, at slot (this rank, t k + j), with its local expert id and weight; every
//                     other rank gets -1 at that slot (absent), so no slot holds a stale id. The last CTA,
//                     after every CTA's system-scope fence, adds 1 to this rank's dispatch count on every
//                     rank, then waits until every rank's dispatch to this one has landed.
//   meld_moe_*        this rank's MoE over its window's [world T k] slots, one pair each, absent ones
//                     skipped (MELD_ABSENT_PAIRS): out[slot] = w * FFN_e(row) (templates/moe.cuh).
//   meld_ep_return    one warp per served slot: its output row is stored into the source rank's window at
//                     its pair (t k + j); the last CTA counts this rank's return on every rank, then waits
//                     for every rank's return to this one.
//   meld_ep_combine   one warp per token: out[t] = sum_j of its pairs' returned rows, in j order (float,
//                     rounded once; no atomics: the result does not depend on which rank finished first).
//
// Windows are reused call after call: nothing is written into another rank's window before that rank has
// started the same call (xrank.cuh's handshake, in the dispatch), and a rank starts a call only after its
// previous combine, so every window's previous contents have been consumed. Counts are running totals
// (call n waits for n), never reset. Deadlock freedom: a dispatch waits only for dispatches, and a return
// only for returns; each signals before it waits and signals unconditionally, and every rank launches the
// same kernels in the same order, so the smallest waiting kernel's awaited signals come from kernels that
// wait for nothing later than themselves. Each kernel's grid is resident at once (the handshake waits for
// CTA 0).

namespace meld {

constexpr i64 XRANK_WAIT_NS = 10 * MELD_WATCHDOG_NS;   // ranks start their calls up to seconds apart
constexpr int EP_VECS = 8;                             // 16-byte vectors per lane per chunk of a row

__device__ __forceinline__ WaitSite ep_site(const EpParams& p, int site, int unit, int detail) {
  return WaitSite{p.watchdog, p.watchdog_claim, p.watchdog_kernel, site, (int)blockIdx.x, (int)threadIdx.x / 32, unit,
                  detail};
}
__device__ __forceinline__ XWindows ep_windows(const EpParams& p) {
  return XWindows{p.xpeers, p.x_rank, p.x_world, p.x_started_off, 0};
}
__device__ __forceinline__ unsigned long long ep_call(const EpParams& p) {
  return *reinterpret_cast<const volatile unsigned long long*>(p.xlaunch) + 1;
}

// Every thread fences its stores at system scope; true in thread 0 of the kernel's last CTA to get here
// (which leaves the exit counter at 0 for the next kernel). The fences before the counter and the one
// after it order every CTA's stores before the caller's release.
__device__ bool ep_last_cta(const EpParams& p) {
  __shared__ int last;
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    last = atomicAdd(p.xexit, 1u) == gridDim.x - 1;
    if (last) {
      p.xexit[0] = 0u;
      __threadfence_system();
    }
  }
  __syncthreads();
  return threadIdx.x == 0 && last;
}

// Count this rank's `off` slot up on every rank, then wait until every rank's slot here reaches `call`.
__device__ void ep_exchange_counts(const EpParams& p, long long off, unsigned long long call, int site_unit) {
  const XWindows w = ep_windows(p);
  for (int r = 0; r < p.x_world; ++r) signal_add(w.word(r, off + 8 * p.x_rank), 1ull);
  for (int r = 0; r < p.x_world; ++r)
    signal_wait(w.word(p.x_rank, off + 8 * r), call, ep_site(p, 10, site_unit, r), XRANK_WAIT_NS);
}

// Lane j of a warp's token t: its pair j's global expert id if valid (in range, not a repeat of an earlier
// pair of the token), else -1. (k <= 32.)
__device__ __forceinline__ int ep_pair_id(const EpParams& p, int t, int lane) {
  const int K = p.top_k;
  const int raw = lane < K ? p.topk_ids[(i64)t * K + lane] : -1;
  bool ok = lane < K && raw >= 0 && raw < p.num_experts;
  for (int l = 0; l < 32; ++l) {
    const int other = __shfl_sync(~0u, raw, l);
    if (l < lane && other == raw) ok = false;
  }
  return ok ? raw : -1;
}

extern "C" __global__ void __launch_bounds__(EP_WARPS * 32) meld_ep_dispatch(const __grid_constant__ EpParams p) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, K = p.top_k, T = p.num_tokens, W = p.x_world;
  const XWindows w = ep_windows(p);
  const unsigned long long call = ep_call(p);
  if (blockIdx.x == 0 && threadIdx.x == 0) xrank_announce_peers(w, call);
  if (threadIdx.x == 0) xrank_wait_started(w, call, ep_site(p, 13, -1, 0), XRANK_WAIT_NS);
  __syncthreads();
  const int vecs = p.hidden / 8;
  const i64 slots = (i64)T * K, row_bytes = (i64)p.hidden * 2;
  for (int t = blockIdx.x * EP_WARPS + warp; t < T; t += gridDim.x * EP_WARPS) {
    const int id = ep_pair_id(p, t, lane);
    const int dst = id < 0 ? -1 : id / p.experts_per_rank;
    const i64 slot = (i64)p.x_rank * slots + (i64)t * K + lane;   // this pair's slot in every rank's window
    if (lane < K) {
      if (id < 0) atomicOr(p.error, 1);
      for (int r = 0; r < W; ++r)
        reinterpret_cast<int*>(w.peers[r] + p.x_hdr_off)[slot] = r == dst ? id - dst * p.experts_per_rank : -1;
      if (dst >= 0) reinterpret_cast<float*>(w.peers[dst] + p.x_wts_off)[slot] = p.topk_w[(i64)t * K + lane];
    }
    const uint4* src = reinterpret_cast<const uint4*>(p.x + (i64)t * p.x_stride);
    for (int c = 0; c < vecs; c += 32 * EP_VECS) {   // each chunk loaded once, stored to every pair's rank
      uint4 v[EP_VECS];
#pragma unroll
      for (int u = 0; u < EP_VECS; ++u)
        if (c + lane + 32 * u < vecs) v[u] = src[c + lane + 32 * u];
      for (int j = 0; j < K; ++j) {
        const int d = __shfl_sync(~0u, dst, j);
        if (d < 0) continue;
        const i64 s = (i64)p.x_rank * slots + (i64)t * K + j;
        uint4* row = reinterpret_cast<uint4*>(w.peers[d] + p.x_rows_off + s * row_bytes) + c;
#pragma unroll
        for (int u = 0; u < EP_VECS; ++u)
          if (c + lane + 32 * u < vecs) row[lane + 32 * u] = v[u];
      }
    }
  }
  if (ep_last_cta(p)) ep_exchange_counts(p, p.x_sent_off, call, -1);
}

extern "C" __global__ void __launch_bounds__(EP_WARPS * 32) meld_ep_return(const __grid_constant__ EpParams p) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const XWindows w = ep_windows(p);
  const unsigned long long call = ep_call(p);
  const int vecs = p.hidden / 8;
  const i64 slots = (i64)p.num_tokens * p.top_k, row_bytes = (i64)p.hidden * 2;
  const int* hdr = reinterpret_cast<const int*>(w.peers[p.x_rank] + p.x_hdr_off);
  for (i64 s = (i64)blockIdx.x * EP_WARPS + warp; s < p.x_world * slots; s += (i64)gridDim.x * EP_WARPS) {
    if (hdr[s] < 0) continue;   // absent: another rank serves this pair
    const int src = (int)(s / slots);
    const uint4* from = reinterpret_cast<const uint4*>(p.served + s * p.hidden);
    uint4* to = reinterpret_cast<uint4*>(w.peers[src] + p.x_ret_off + (s - src * slots) * row_bytes);
    for (int c = lane; c < vecs; c += 32) to[c] = from[c];
  }
  if (ep_last_cta(p)) ep_exchange_counts(p, p.x_back_off, call, -2);
}

__device__ __forceinline__ void ep_add_bf16x2(float& lo, float& hi, u32 two) {
  lo += __uint_as_float(two << 16);
  hi += __uint_as_float(two & 0xFFFF0000u);
}

extern "C" __global__ void __launch_bounds__(EP_WARPS * 32) meld_ep_combine(const __grid_constant__ EpParams p) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, K = p.top_k;
  const u16* ret = reinterpret_cast<const u16*>(p.xpeers[p.x_rank] + p.x_ret_off);
  for (int t = blockIdx.x * EP_WARPS + warp; t < p.num_tokens; t += gridDim.x * EP_WARPS) {
    const int id = ep_pair_id(p, t, lane);   // (every lane: it shuffles)
    const bool all_valid = __all_sync(~0u, lane >= K || id >= 0);
    u16* o = p.out + (i64)t * p.hidden;
    if (!all_valid) {   // NaN in, NaN out: an invalid pair was never sent
      for (int h = lane; h < p.hidden; h += 32) o[h] = 0x7fc0;
      continue;
    }
    for (int h = lane * 8; h < p.hidden; h += 32 * 8) {   // 8 bf16 per lane per step
      float acc[8] = {};
      for (int j = 0; j < K; ++j) {
        const uint4 v = *reinterpret_cast<const uint4*>(ret + ((i64)t * K + j) * p.hidden + h);
        ep_add_bf16x2(acc[0], acc[1], v.x);
        ep_add_bf16x2(acc[2], acc[3], v.y);
        ep_add_bf16x2(acc[4], acc[5], v.z);
        ep_add_bf16x2(acc[6], acc[7], v.w);
      }
      *reinterpret_cast<uint4*>(o + h) = make_uint4(pack2(acc[0], acc[1]), pack2(acc[2], acc[3]), pack2(acc[4], acc[5]),
                                                    pack2(acc[6], acc[7]));
    }
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) *p.xlaunch = ep_call(p);   // the call is finished on this rank
}

}  // namespace meld
