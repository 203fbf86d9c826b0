// meld: the cross-rank protocol that every operator over a process group shares (meld/distributed): each rank's
// symmetric window as this rank addresses it, the start handshake and the landing count.
//
// Nothing is written into another rank's window before that rank has started the same launch (its
// stream has then finished with the previous launch's outputs and partials): CTA 0 announces each
// launch on every rank, and a CTA waits for every rank's announcement once, before its first remote
// write. (The one exception, the row-parallel linear's direct path, writes words tagged with the launch
// into slots that alternate between launches: tp_linear.cuh says why no rank can then overwrite a word
// another still has to read. Its launches announce themselves all the same.) Every CTA adds the results
// it wrote to every rank's landing counter after one system-scope fence; the launch's last CTA waits
// until its own rank holds all of them, so a rank's output is complete when its launch ends, and takes
// the count back (a faster rank's next launch may have added to it already).

namespace meld {

constexpr i64 XRANK_WAIT_NS = 10 * MELD_WATCHDOG_NS;   // a wait for another rank: ranks start launches up to seconds apart

struct XWindows {
  char* const* peers;          // every rank's window base, as this rank addresses it (NVLink peer memory)
  int rank, world;
  long long started_off;       // u64 per rank: the launches it has started
  long long landed_off;        // u64: results landed in this window
  __device__ __forceinline__ unsigned long long* word(int r, long long off) const {
    return reinterpret_cast<unsigned long long*>(peers[r] + off);
  }
};

// Launch n has started on this rank: one system-scope fence, then n stored into every rank's slot for it.
// (A release store per rank would fence once per rank: ptxas emits a MEMBAR.SYS before each.)
__device__ __forceinline__ void xrank_announce_peers(const XWindows& w, unsigned long long n) {
  fence_acq_rel_sys();
  for (int r = 0; r < w.world; ++r)
    store_relaxed_sys(w.word(r, w.started_off + 8 * w.rank), n);
}

// The proxy transport's command ring (meld/distributed/proxy.py) as a kernel addresses it (common.cuh: proxy_push).
struct XRing {
  ProxyCommand* ring;
  unsigned long long* tail;
  const unsigned long long* head;
  int cap;
  __device__ __forceinline__ void push(u32 op, int dst, unsigned long long start, unsigned long long count,
                                       long long addend, const WaitSite& s) const {
    proxy_push(ring, tail, head, cap, op, dst, start, count, addend, s);
  }
};

// The same through the proxy: a signal adding 1 to every other rank's slot for this rank (its running
// total is the launch number) and a store into this rank's own.
__device__ __forceinline__ void xrank_announce_proxy(const XWindows& w, const XRing& q, unsigned long long n,
                                                     const WaitSite& s) {
  const long long slot = w.started_off + 8 * w.rank;
  for (int r = 0; r < w.world; ++r) {
    if (r != w.rank)
      q.push(PROXY_SIGNAL, r, slot, 0, 1, s);
    else
      event_publish_sys(w.word(r, slot), n);
  }
}

// Wait (one thread) until every other rank has started launch n; the wait site's detail names the rank.
__device__ __forceinline__ void xrank_wait_started(const XWindows& w, unsigned long long n, WaitSite s, i64 limit_ns) {
  const unsigned long long* started = w.word(w.rank, w.started_off);
  for (int r = 0; r < w.world; ++r) {
    if (r == w.rank) continue;
    s.detail = r;
    event_wait_sys(started + r, n, s, limit_ns);
  }
}

// One thread, after the system-scope fences of every thread whose writes `landed` counts.
__device__ __forceinline__ void xrank_land(const XWindows& w, unsigned long long landed) {
  if (landed)
    for (int r = 0; r < w.world; ++r) event_signal_sys(w.word(r, w.landed_off), landed);
}

// The launch's last CTA: wait until `expected` results have landed in this rank's window, take them back.
__device__ __forceinline__ void xrank_take_landed(const XWindows& w, unsigned long long expected, WaitSite s, i64 limit_ns) {
  unsigned long long* landed = w.word(w.rank, w.landed_off);
  s.detail = (int)expected;
  event_wait_sys(landed, expected, s, limit_ns);
  event_take_sys(landed, expected);
}

}  // namespace meld
