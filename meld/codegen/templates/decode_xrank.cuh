// meld: the cross-rank combine edge of sequence-parallel decode (MELD_XRANK builds; rendered after
// decode_attention.cuh, whose MELD_XRANK description this implements, with the protocol of xrank.cuh).
// DecodeParams carries the edge's fields (meld.codegen.params.SEQ_PARALLEL_DECODE_PARAMS) only in these
// builds: each local request's (batch request, part, parts, owner rank), every rank's symmetric window,
// the launch's exit counter, landings and split requests, and, with the proxy transport, its command ring.

namespace meld {

constexpr bool PROXY = MELD_XRANK == 2;   // 1: NVLink peer memory, 2: the proxy transport

// The batch request of local request x.req, and its part here: (batch request, part, parts, owner rank).
__device__ __forceinline__ void xrank_unit(const DecodeParams& p, Unit& x) {
  const int4 r = p.xreq[x.req];
  x.xb = r.x; x.xpart = r.y; x.xparts = r.z; x.xowner = r.w;
}

// MELD_XRANK: rank r's symmetric window as this rank addresses it, and places in it (offsets: p.x_*_off).
__device__ __forceinline__ char* xwin(const DecodeParams& p, int r) { return p.xpeers[r]; }
__device__ __forceinline__ XWindows xwindows(const DecodeParams& p) {
  return XWindows{p.xpeers, p.x_rank, p.x_world, p.x_started_off, p.x_landed_off};
}
__device__ __forceinline__ unsigned long long* xcounter(const DecodeParams& p, const Unit& x, int u) {
  const int gu = x.xb * p.units_per_request + (u - x.req * p.units_per_request);
  return reinterpret_cast<unsigned long long*>(xwin(p, x.xowner) + p.x_count_off) + gu;
}

// Four outputs (h, d..d+3) of a unit of batch row `row`: a request whole on this rank writes every rank's
// window; a part of a split one puts its float partial into the owner's (the proxy: into this rank's own
// window, which the proxy copies to the others).
__device__ __forceinline__ void xrank_store4(const DecodeParams& p, const Unit& x, i64 row, int h, int d, float4 v,
                                             float lse2) {
  if (PROXY) {
    char* w = xwin(p, p.x_rank);
    if (x.xparts == 1) {
      store_final4(reinterpret_cast<u16*>(w + p.x_out_off), reinterpret_cast<float*>(w + p.x_lse_off), row, d, v, lse2);
    } else {
      const i64 prow = ((i64)x.xb * p.x_world + x.xpart) * p.num_qo_heads + x.q_head + h;
      *reinterpret_cast<float4*>(reinterpret_cast<float*>(w + p.x_po_off) + prow * D + d) = v;
      if (d == 0) reinterpret_cast<float*>(w + p.x_plse_off)[prow] = lse2;
    }
  } else if (x.xparts == 1) {
    for (int r = 0; r < p.x_world; ++r)
      store_final4(reinterpret_cast<u16*>(xwin(p, r) + p.x_out_off), reinterpret_cast<float*>(xwin(p, r) + p.x_lse_off),
                   row, d, v, lse2);
  } else {
    char* w = xwin(p, x.xowner);
    const i64 prow = ((i64)x.xb * p.x_world + x.xpart) * p.num_qo_heads + x.q_head + h;
    *reinterpret_cast<float4*>(reinterpret_cast<float*>(w + p.x_po_off) + prow * D + d) = v;
    if (d == 0) reinterpret_cast<float*>(w + p.x_plse_off)[prow] = lse2;
  }
}

// MELD_XRANK, after a unit's result on this rank is stored (store_out4, every thread). A final result
// (a request whole on this rank) only adds to the CTA's tally of units it wrote; a part of a split request
// counts on the owner's unit counter (after a system-scope fence, so the count covers its partial), and
// the part that completes the count merges the parts from the owner's window (remote loads over NVLink
// when this rank is not the owner), writes every rank's output, resets the counter and adds to the tally.
// Returns the units this call finished.
//
// Nothing is written into another rank's window before that rank has started the same launch: its
// stream has then finished with the previous launch's output (which the next layer reads) and partials.
// CTA 0 announces each launch to every rank at entry (the proxy: a signal through the ring); a CTA waits
// for the others' announcements once, before the end of its first piece, so its first tiles load meanwhile.
__device__ __forceinline__ unsigned long long xrank_launch(const DecodeParams& p) { return p.xsrc[2 * p.x_world] + 1; }
__device__ __forceinline__ void xrank_announce(const DecodeParams& p, int cta) {
  const unsigned long long n = xrank_launch(p);
  if (PROXY)
    xrank_announce_proxy(xwindows(p), XRing{p.xring, p.xring_tail, p.xring_head, p.xring_cap}, n,
                         WaitSite{p.watchdog, p.watchdog_claim, p.watchdog_kernel, 12, cta, 0, -1, 0});
  else
    xrank_announce_peers(xwindows(p), n);
}
__device__ __forceinline__ void xrank_await_started(const DecodeParams& p, int cta) {
  if (threadIdx.x == 0)
    xrank_wait_started(xwindows(p), xrank_launch(p), WaitSite{p.watchdog, p.watchdog_claim, p.watchdog_kernel, 13, cta, 0, -1, 0},
                       XRANK_WAIT_NS);
  __syncthreads();
}

// The proxy transport instead: the unit's rows (its output, or its part's partial) are in this rank's own
// window; after one system-scope fence thread 0 hands the proxy one put of the rows and one of their lse
// per other rank, and the unit counts as sent. Split requests are merged at the end of the launch, on
// every rank (xrank_exit): a result crosses the network once.
__device__ __forceinline__ int proxy_send_unit(const DecodeParams& p, const Unit& x, int u, int cta) {
  if (p.x_world == 1) return 1;
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    const WaitSite s{p.watchdog, p.watchdog_claim, p.watchdog_kernel, 12, cta, 0, u, 0};
    const bool part = x.xparts > 1;
    const i64 row = part ? ((i64)x.xb * p.x_world + x.xpart) * p.num_qo_heads + x.q_head
                         : (i64)x.xb * p.num_qo_heads + x.q_head;
    const i64 o_off = part ? p.x_po_off + row * D * 4 : p.x_out_off + row * D * 2;
    const i64 l_off = (part ? p.x_plse_off : p.x_lse_off) + row * 4;
    for (int r = 0; r < p.x_world; ++r) {
      if (r == p.x_rank) continue;
      proxy_push(p.xring, p.xring_tail, p.xring_head, p.xring_cap, PROXY_PUT, r, o_off, x.rows * D * (part ? 4 : 2), 0, s);
      proxy_push(p.xring, p.xring_tail, p.xring_head, p.xring_cap, PROXY_PUT, r, l_off, x.rows * 4, 0, s);
    }
  }
  return 1;
}

__device__ __forceinline__ int xrank_finish(const DecodeParams& p, const Unit& x, int u, int cta, MergeArea& mg) {
  if (PROXY) return proxy_send_unit(p, x, u, cta);
  if (x.xparts == 1) return 1;
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0)
    mg.last = event_arrive_sys(xcounter(p, x, u), 1ull, (unsigned long long)x.xparts);
  __syncthreads();
  if (!mg.last) return 0;
  const char* w = xwin(p, x.xowner);
  Unit f = x;
  f.xparts = 1;   // the merged result is final: store_out4 writes every rank's output
  merge_parts(p, f, x.xparts, [&](int k, int h, int d, float& lse, float4& v) {
    const i64 prow = ((i64)x.xb * p.x_world + k) * p.num_qo_heads + x.q_head + h;
    lse = ld_cg(reinterpret_cast<const float*>(w + p.x_plse_off) + prow);
    v = ld_cg4(reinterpret_cast<const float*>(w + p.x_po_off) + prow * D + d);
  });
  if (threadIdx.x == 0) event_reset(xcounter(p, x, u));   // every part has arrived: ready for the next launch
  __syncthreads();   // (mg.last is rewritten by the next unit)
  return 1;
}

// MELD_XRANK, at the end of every CTA: one system-scope fence covers every final write and counter reset
// of the CTA, then its tally lands on every rank's landing counter (one fence per CTA, not per unit).
// The last CTA of the launch (all grids) then waits until every unit of the batch has landed in this
// rank's window (p.xexit[1] of them) and takes that count back.
//
// Proxy transport: the CTA's tally goes to each other rank as one signal, after its puts (the proxy lands
// a signal only after every put before it to that rank: one fence per destination). The proxy writes the
// running total from this rank into the destination's landing slot for this rank. The last CTA waits
// until each source's slot holds every unit expected from it (p.xsrc[src]) past those taken before
// (p.xsrc[world + src]), then, with all its threads, merges the split requests' parts from its own
// window, in part order.
__device__ __forceinline__ Unit split_unit(const DecodeParams& p, int xb, int hb) {
  Unit f = {};
  f.xb = xb;
  f.kv_head = hb / p.head_blocks;
  const int qb = hb - f.kv_head * p.head_blocks;
  f.q_head = f.kv_head * p.group_size + qb * HEADS;
  f.rows = min(HEADS, p.group_size - qb * HEADS);
  f.xparts = 1;   // merged here: final
  return f;
}

__device__ __forceinline__ void proxy_exit(const DecodeParams& p, int cta, int sent, MergeArea& mg) {
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    const WaitSite s{p.watchdog, p.watchdog_claim, p.watchdog_kernel, 12, cta, 0, -1, 0};
    if (sent)
      for (int r = 0; r < p.x_world; ++r)
        if (r != p.x_rank)
          proxy_push(p.xring, p.xring_tail, p.xring_head, p.xring_cap, PROXY_SIGNAL, r, p.x_landed_off + 8 * p.x_rank,
                     0, sent, s);
    mg.last = event_arrive(p.xexit, 1u, (unsigned)p.num_ctas);
  }
  __syncthreads();
  if (!mg.last) return;
  if (threadIdx.x == 0) {
    event_reset(p.xexit);
    __threadfence();
    unsigned long long* landed = reinterpret_cast<unsigned long long*>(xwin(p, p.x_rank) + p.x_landed_off);
    for (int src = 0; src < p.x_world; ++src) {
      if (src == p.x_rank) continue;
      const unsigned long long want = p.xsrc[p.x_world + src] + p.xsrc[src];
      event_wait_sys(landed + src, want,
                     WaitSite{p.watchdog, p.watchdog_claim, p.watchdog_kernel, 11, cta, 0, -1, (int)p.xsrc[src]}, XRANK_WAIT_NS);
      p.xsrc[p.x_world + src] = want;
    }
    p.xsrc[2 * p.x_world] += 1;   // launches done (every CTA read the count at its start)
  }
  __syncthreads();
  const char* w = xwin(p, p.x_rank);
  const int n_split = *reinterpret_cast<volatile unsigned*>(p.xexit + 2);
  for (int i = 0; i < n_split; ++i) {
    const int2 sp = p.xsplit[i];
    for (int hb = 0; hb < p.units_per_request; ++hb) {
      const Unit f = split_unit(p, sp.x, hb);
      merge_parts(p, f, sp.y, [&](int k, int h, int d, float& lse, float4& v) {
        const i64 prow = ((i64)f.xb * p.x_world + k) * p.num_qo_heads + f.q_head + h;
        lse = ld_cg(reinterpret_cast<const float*>(w + p.x_plse_off) + prow);
        v = ld_cg4(reinterpret_cast<const float*>(w + p.x_po_off) + prow * D + d);
      });
    }
  }
}

__device__ __forceinline__ void xrank_exit(const DecodeParams& p, int cta, int finished, MergeArea& mg) {
  if (PROXY) {
    proxy_exit(p, cta, finished, mg);
    return;
  }
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x != 0) return;
  xrank_land(xwindows(p), (unsigned long long)finished);
  if (!event_arrive(p.xexit, 1u, (unsigned)p.num_ctas)) return;
  event_reset(p.xexit);
  const unsigned long long expected = *reinterpret_cast<volatile unsigned*>(p.xexit + 1);   // plan() writes it
  xrank_take_landed(xwindows(p), expected, WaitSite{p.watchdog, p.watchdog_claim, p.watchdog_kernel, 11, cta, 0, -1, 0},
                    XRANK_WAIT_NS);
  p.xsrc[2 * p.x_world] += 1;   // launches done (every CTA read the count at its start)
}

}  // namespace meld
