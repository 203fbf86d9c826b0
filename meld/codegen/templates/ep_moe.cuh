// meld expert-parallel MoE: the cross-rank launches around each rank's MoE (meld/distributed/expert_parallel.py).
// The experts are split into contiguous blocks, one per rank; every rank holds T tokens and their routing
// (the same T on every rank). Windows are laid out by (source rank, pair) slots, slot = t k + j of
// slots = T k: every rank's window holds, per source, each pair's global expert id (-1: invalid) and
// weight and its row of x, and per (owner, source) the weighted expert rows the owner served. A call is,
// in stream order on every rank:
//
//   meld_ep_dispatch  one warp per token: each pair's id goes to every rank, and its weight and row to its
//                     expert's rank. The last CTA, after every CTA's system-scope fence, counts this
//                     rank's dispatch on every rank, then waits until every rank's dispatch to this one has
//                     landed.
//   meld_moe_*        this rank's MoE over its window's [world T k] slots, one pair each, a pair of another
//                     rank's expert skipped (MELD_ABSENT_PAIRS): served[slot] = w * FFN_e(row).
//   meld_ep_return    one warp per served slot: its row goes to its source's window; the last CTA counts
//                     this rank's return on every rank, then waits for every rank's return to this one.
//   meld_ep_combine   one warp per token: out[t] = sum_j of its pairs' returned rows, in j order (float,
//                     rounded once; no atomics: the result does not depend on which rank finished first).
//
// Transports. Peer (MELD_EP_PROXY 0): stores straight into the other ranks' windows over NVLink, only
// what each needs. Proxy (MELD_EP_PROXY 1, the model of RDMA between nodes): a rank writes only its own
// window, at the offsets the data will have at its destination — its slots' ids, weights and rows (its
// source block), or the rows it served for each source (its owner block of that source) — and the last
// CTA hands the proxy one put per block and destination, then the count as a signal behind them (one
// fence per destination). A source block holds the rows for every rank, so a put carries world times the
// rows the destination needs: few large puts instead of a put per row.
//
// Windows are reused call after call: nothing lands in another rank's window before that rank has started
// the same call (xrank.cuh's handshake), and a rank starts a call only after its previous combine, which
// waited for everything of the previous call to land, so every block's previous contents are consumed and
// every earlier put from it has landed. Counts are running totals (call n waits for n), never reset.
// Deadlock freedom: a dispatch waits only for dispatches, and a return only for returns; each signals
// before it waits and signals unconditionally, and every rank launches the same kernels in the same order,
// so the awaited signals come from kernels that wait for nothing later than themselves. Each kernel's grid
// is resident at once (the handshake waits for CTA 0).

namespace meld {

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
    last = event_arrive(p.xexit, 1u, gridDim.x);
    if (last) {
      event_reset(p.xexit);
      __threadfence_system();
    }
  }
  __syncthreads();
  return threadIdx.x == 0 && last;
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

// Where the slots of source `src` start in a window's id, weight and row regions; the rows owner d served
// to source src start at ep_ret(p, d, src).
__device__ __forceinline__ i64 ep_slots(const EpParams& p) { return (i64)p.num_tokens * p.top_k; }
__device__ __forceinline__ i64 ep_ret(const EpParams& p, int d, int src) {
  return p.x_ret_off + ((i64)d * p.x_world + src) * ep_slots(p) * p.hidden * 2;
}

// The last CTA of a kernel: land this rank's `count_off` count on every rank — with the proxy, behind the
// puts of its `nblocks` blocks for each destination r (block(b, r, off, bytes): where in this rank's
// window, how long) — then wait until every rank's count here reaches `call`.
template <class Block>
__device__ void ep_send_and_wait(const EpParams& p, long long count_off, int nblocks, Block block,
                                 unsigned long long call, int site_unit) {
  const XWindows w = ep_windows(p);
  if (MELD_EP_PROXY) {
    const XRing q{p.xring, p.xring_tail, p.xring_head, p.xring_cap};
    xrank_wait_started(w, call, ep_site(p, 13, site_unit, 0), XRANK_WAIT_NS);
    for (int r = 0; r < p.x_world; ++r) {
      if (r == p.x_rank) continue;
      for (int b = 0; b < nblocks; ++b) {
        long long off, bytes;
        block(b, r, off, bytes);
        if (bytes) q.push(PROXY_PUT, r, off, bytes, 0, ep_site(p, 12, site_unit, r));
      }
      q.push(PROXY_SIGNAL, r, count_off + 8 * p.x_rank, 0, 1, ep_site(p, 12, site_unit, r));
    }
    event_signal_sys(w.word(p.x_rank, count_off + 8 * p.x_rank), 1ull);
  } else {
    for (int r = 0; r < p.x_world; ++r) event_signal_sys(w.word(r, count_off + 8 * p.x_rank), 1ull);
  }
  for (int r = 0; r < p.x_world; ++r)
    event_wait_sys(w.word(p.x_rank, count_off + 8 * r), call, ep_site(p, 10, site_unit, r), XRANK_WAIT_NS);
}

// The three kernels are families of the skeleton (persistent.cuh), each an ordinary launch
// (meld/distributed/expert_parallel.py) whose CTAs take EP_WARPS tokens or slots at a time.
struct EpDispatch : SimpleFamily<EpParams, LAUNCH_PLAIN> {
  static __device__ __forceinline__ void run(const EpParams& p, const State&) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, K = p.top_k, T = p.num_tokens, W = p.x_world;
    const XWindows w = ep_windows(p);
    const unsigned long long call = ep_call(p);
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      if (MELD_EP_PROXY)
        xrank_announce_proxy(w, XRing{p.xring, p.xring_tail, p.xring_head, p.xring_cap}, call, ep_site(p, 12, -1, 0));
      else
        xrank_announce_peers(w, call);
    }
    if (!MELD_EP_PROXY) {   // (the proxy's puts wait in the last CTA: this rank writes only its own window)
      if (threadIdx.x == 0) xrank_wait_started(w, call, ep_site(p, 13, -1, 0), XRANK_WAIT_NS);
      __syncthreads();
    }
    const int vecs = p.hidden / 8;
    const i64 slots = ep_slots(p), row_bytes = (i64)p.hidden * 2;
    for (int t = blockIdx.x * EP_WARPS + warp; t < T; t += gridDim.x * EP_WARPS) {
      const int id = ep_pair_id(p, t, lane);
      const int dst = id < 0 ? -1 : id / p.experts_per_rank;
      const i64 slot = (i64)p.x_rank * slots + (i64)t * K + lane;   // this pair's slot in every rank's window
      if (lane < K) {
        if (id < 0) atomicOr(p.error, 1);
        for (int r = MELD_EP_PROXY ? p.x_rank : 0; r < (MELD_EP_PROXY ? p.x_rank + 1 : W); ++r)
          reinterpret_cast<int*>(w.peers[r] + p.x_hdr_off)[slot] = id;
        if (dst >= 0)
          reinterpret_cast<float*>(w.peers[MELD_EP_PROXY ? p.x_rank : dst] + p.x_wts_off)[slot] =
              p.topk_w[(i64)t * K + lane];
      }
      const uint4* src = reinterpret_cast<const uint4*>(p.x + (i64)t * p.x_stride);
      for (int c = 0; c < vecs; c += 32 * EP_VECS) {   // each chunk loaded once, stored for every pair
        uint4 v[EP_VECS];
#pragma unroll
        for (int u = 0; u < EP_VECS; ++u)
          if (c + lane + 32 * u < vecs) v[u] = src[c + lane + 32 * u];
        for (int j = 0; j < K; ++j) {
          const int d = __shfl_sync(~0u, dst, j);
          if (d < 0) continue;
          const i64 s = (i64)p.x_rank * slots + (i64)t * K + j;
          uint4* row =
              reinterpret_cast<uint4*>(w.peers[MELD_EP_PROXY ? p.x_rank : d] + p.x_rows_off + s * row_bytes) + c;
#pragma unroll
          for (int u = 0; u < EP_VECS; ++u)
            if (c + lane + 32 * u < vecs) row[lane + 32 * u] = v[u];
        }
      }
    }
    if (!ep_last_cta(p)) return;
    ep_send_and_wait(p, p.x_sent_off, 3, [&](int b, int, long long& off, long long& bytes) {   // this rank's
      bytes = b == 2 ? slots * row_bytes : slots * 4;                                          // source block:
      off = (b == 0 ? p.x_hdr_off : b == 1 ? p.x_wts_off : p.x_rows_off) + p.x_rank * bytes;   // ids, weights, rows
    }, call, -1);
  }
};

struct EpReturn : SimpleFamily<EpParams, LAUNCH_PLAIN> {
  static __device__ __forceinline__ void run(const EpParams& p, const State&) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const XWindows w = ep_windows(p);
    const unsigned long long call = ep_call(p);
    const int vecs = p.hidden / 8, first = p.x_rank * p.experts_per_rank;
    const i64 slots = ep_slots(p), row_bytes = (i64)p.hidden * 2;
    const int* hdr = reinterpret_cast<const int*>(w.peers[p.x_rank] + p.x_hdr_off);
    for (i64 s = (i64)blockIdx.x * EP_WARPS + warp; s < p.x_world * slots; s += (i64)gridDim.x * EP_WARPS) {
      const int e = hdr[s];
      if (e < first || e >= first + p.experts_per_rank) continue;   // another rank serves this pair
      const int src = (int)(s / slots);
      const uint4* from = reinterpret_cast<const uint4*>(p.served + s * p.hidden);
      uint4* to = reinterpret_cast<uint4*>(w.peers[MELD_EP_PROXY ? p.x_rank : src] + ep_ret(p, p.x_rank, src) +
                                           (s - src * slots) * row_bytes);
#pragma unroll 4
      for (int c = lane; c < vecs; c += 32) to[c] = from[c];
    }
    if (!ep_last_cta(p)) return;
    ep_send_and_wait(p, p.x_back_off, 1, [&](int, int r, long long& off, long long& bytes) {   // this rank's owner
      off = ep_ret(p, p.x_rank, r);                                                          // block of source r
      bytes = slots * row_bytes;
    }, call, -2);
  }
};

__device__ __forceinline__ void ep_add_bf16x2(float& lo, float& hi, u32 two) {
  lo += __uint_as_float(two << 16);
  hi += __uint_as_float(two & 0xFFFF0000u);
}

struct EpCombine : SimpleFamily<EpParams, LAUNCH_PLAIN> {
  static __device__ __forceinline__ void run(const EpParams& p, const State&) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, K = p.top_k;
    const char* win = p.xpeers[p.x_rank];
    for (int t = blockIdx.x * EP_WARPS + warp; t < p.num_tokens; t += gridDim.x * EP_WARPS) {
      const int id = ep_pair_id(p, t, lane);   // (every lane: it shuffles)
      const bool all_valid = __all_sync(~0u, lane >= K || id >= 0);
      u16* o = p.out + (i64)t * p.hidden;
      if (!all_valid) {   // NaN in, NaN out: an invalid pair was never sent
        for (int h = lane; h < p.hidden; h += 32) o[h] = 0x7fc0;
        continue;
      }
      const int owner = lane < K ? id / p.experts_per_rank : 0;   // lane j: pair j's owner
      for (int h0 = 0; h0 < p.hidden; h0 += 32 * 8) {   // 8 bf16 per lane per step (every lane: it shuffles)
        const int h = min(h0 + lane * 8, p.hidden - 8);   // (a lane past the row rereads its last vector)
        float acc[8] = {};
        for (int j0 = 0; j0 < K; j0 += 8) {   // eight pairs' loads in flight at once
          uint4 v[8];
#pragma unroll
          for (int u = 0; u < 8; ++u) {
            const int j = j0 + u, d = __shfl_sync(~0u, owner, j & 31);
            if (j < K)
              v[u] = *reinterpret_cast<const uint4*>(reinterpret_cast<const u16*>(win + ep_ret(p, d, p.x_rank)) +
                                                     ((i64)t * K + j) * p.hidden + h);
          }
#pragma unroll
          for (int u = 0; u < 8; ++u) {
            if (j0 + u >= K) break;
            ep_add_bf16x2(acc[0], acc[1], v[u].x);
            ep_add_bf16x2(acc[2], acc[3], v[u].y);
            ep_add_bf16x2(acc[4], acc[5], v[u].z);
            ep_add_bf16x2(acc[6], acc[7], v[u].w);
          }
        }
        if (h0 + lane * 8 < p.hidden)
          *reinterpret_cast<uint4*>(o + h) =
              make_uint4(pack2(acc[0], acc[1]), pack2(acc[2], acc[3]), pack2(acc[4], acc[5]), pack2(acc[6], acc[7]));
      }
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) *p.xlaunch = ep_call(p);   // the call is finished on this rank
  }
};

}  // namespace meld

MELD_PERSISTENT_KERNEL(meld_ep_dispatch, meld::EpDispatch, EP_WARPS * 32, 0)
MELD_PERSISTENT_KERNEL(meld_ep_return, meld::EpReturn, EP_WARPS * 32, 0)
MELD_PERSISTENT_KERNEL(meld_ep_combine, meld::EpCombine, EP_WARPS * 32, 0)
