// meld: PTX wrappers shared by the generated kernels.
// Written against PTX directly (no CUDA headers), so NVRTC needs no include paths.
// The including source defines MELD_MMA_TYPE ("bf16" or "f16") before this file.

typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;

namespace meld {

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
constexpr float kLn2 = 0.6931471805599453f;

__device__ __forceinline__ u32 smem_addr(const void* p) {
  u32 a;
  asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}

// 16-byte async copy global -> shared; src_bytes = 0 fills the destination with zeros.
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
// The same copy of a table row's bytes, zeros (src unread) where the row index is negative, as the copy's ignore-src
// predicate: from a byte count ptxas rebuilds that predicate with three more instructions a copy.
__device__ __forceinline__ void cp_async_16_row(u32 dst, const void* src, int row) {
  asm volatile("{ .reg .pred p; setp.lt.s32 p, %2, 0; cp.async.cg.shared.global [%0], [%1], 16, p; }"
               ::"r"(dst), "l"(src), "r"(row) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
// An 8 x 8 matrix of 16-bit values held as mma's C fragments (lane (g, t): row g, columns 2t, 2t + 1) transposed in
// registers: lane (g, t) gets row g, columns 2t, 2t + 1 of the transpose.
__device__ __forceinline__ u32 movmatrix_trans(u32 x) {
  u32 y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

// d += a * b on the tensor cores: m16n8k16, 16-bit inputs, fp32 accumulators.
__device__ __forceinline__ void mma_16816(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." MELD_MMA_TYPE "." MELD_MMA_TYPE
               ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Two floats -> one register of two 16-bit values (lo in the low half), round to nearest: bf16 (BF16) or f16.
template <bool BF16>
__device__ __forceinline__ u32 pack2_as(float lo, float hi) {
  u32 r;
  if (BF16) asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  else asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
// The same in the MMA type.
__device__ __forceinline__ u32 pack2(float lo, float hi) { return pack2_as<MELD_MMA_TYPE[0] == 'b'>(lo, hi); }

// The bytes of x that SEL's nibbles name (0-3), lowest result byte first (prmt).
template <u32 SEL>
__device__ __forceinline__ u32 byte_perm(u32 x) {
  u32 r;
  asm("prmt.b32 %0, %1, 0, %2;" : "=r"(r) : "r"(x), "n"(SEL));
  return r;
}

// Two registers of f16 pairs (lo, hi) as four floats (exact), low halves first.
__device__ __forceinline__ void f16x4_to_f32(u32 lo, u32 hi, float (&f)[4]) {
  asm("{ .reg .b16 a, b, c, d; mov.b32 {a, b}, %4; mov.b32 {c, d}, %5; cvt.f32.f16 %0, a; cvt.f32.f16 %1, b;"
      " cvt.f32.f16 %2, c; cvt.f32.f16 %3, d; }" : "=f"(f[0]), "=f"(f[1]), "=f"(f[2]), "=f"(f[3]) : "r"(lo), "r"(hi));
}
// Two registers of f16 pairs (lo, hi) in the MMA type: as they are for f16; for bf16 through f32, exact for
// values of at most 11 significant bits in bf16's exponent range (every FP8 value), NaN stays NaN.
__device__ __forceinline__ void f16x4_to_mma(u32& lo, u32& hi) {
  if (MELD_MMA_TYPE[0] == 'b') {
    float f[4];
    f16x4_to_f32(lo, hi, f);
    lo = pack2(f[0], f[1]);
    hi = pack2(f[2], f[3]);
  }
}
// Four e4m3 bytes x (byte 0 lowest) as two registers of f16 pairs (low half first): lo = bytes 0 and 1, hi =
// bytes 2 and 3. Exact (every e4m3 value is an f16), NaN stays NaN: sm_90 converts e4m3 pairs to f16 pairs.
__device__ __forceinline__ void e4m3x4_to_f16(u32 x, u32& lo, u32& hi) {
  asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2; cvt.rn.f16x2.e4m3x2 %0, l; cvt.rn.f16x2.e4m3x2 %1, h; }"
      : "=r"(lo), "=r"(hi) : "r"(x));
}
constexpr float E4M3_MAX = 448.f;   // e4m3's largest finite value
__device__ __forceinline__ u32 e4m3x2(float lo, float hi) {   // lo in the low byte (satfinite: NaN stays NaN)
  u16 r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}
// The e4m3 scale of a group whose largest magnitude has float bits `amax_bits` (max |v| / 448). Maxima taken on
// the magnitudes' bits put every NaN above infinity, so a NaN makes the scale NaN.
constexpr float FP8_MIN_AMAX = 1e-10f;   // an all-zero group gets a finite scale (its values stay 0)
__device__ __forceinline__ float group_scale(u32 amax_bits) {
  const float a = __uint_as_float(amax_bits);
  return a != a ? a : fmaxf(a, FP8_MIN_AMAX) / E4M3_MAX;
}
// The largest bf16 magnitude's bits of eight bf16 (four pairs), maxima taken as group_scale wants them.
__device__ __forceinline__ u32 bf16x8_amax(const u32 (&w)[4]) {
  u32 m = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) m = max(m, max(w[i] & 0x7fffu, (w[i] >> 16) & 0x7fffu));
  return m;
}
// Eight bf16 (four pairs, low half first) times `inv`, as e4m3 bytes in order.
__device__ __forceinline__ uint2 bf16x8_to_e4m3(const u32 (&w)[4], float inv) {
  u32 b[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) b[i] = e4m3x2(__uint_as_float(w[i] << 16) * inv, __uint_as_float(w[i] & 0xffff0000u) * inv);
  return make_uint2(b[0] | b[1] << 16, b[2] | b[3] << 16);
}
// The same as two e4m3 terms of one scale: hi = e4m3(v inv) and lo = e4m3(v inv - hi), whose sum keeps about
// bf16's precision (hi's rounding error is at most 1/16 of v inv, and lo rounds it to e4m3's 3 bits again).
__device__ __forceinline__ void bf16x8_to_e4m3_split(const u32 (&w)[4], float inv, uint2& hi, uint2& lo) {
  hi = bf16x8_to_e4m3(w, inv);
  u32 h[4];
  e4m3x4_to_f16(hi.x, h[0], h[1]);
  e4m3x4_to_f16(hi.y, h[2], h[3]);
  float f[2][4];   // hi's values: pair i at f[i / 2][2 (i % 2)], + 1
  f16x4_to_f32(h[0], h[1], f[0]);
  f16x4_to_f32(h[2], h[3], f[1]);
  u32 b[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    b[i] = e4m3x2(__uint_as_float(w[i] << 16) * inv - f[i >> 1][2 * (i & 1)],
                  __uint_as_float(w[i] & 0xffff0000u) * inv - f[i >> 1][2 * (i & 1) + 1]);
  lo = make_uint2(b[0] | b[1] << 16, b[2] | b[3] << 16);
}
// Four e5m2 bytes x, permuted first by SEL (as byte_perm<SEL>), as e4m3x4_to_f16 gives them. An e5m2 byte is
// the high byte of the f16 of the same value (Inf and NaN included), so each f16 pair is one prmt, which
// applies SEL too.
template <u32 SEL>
__device__ __forceinline__ void e5m2x4_to_f16(u32 x, u32& lo, u32& hi) {
  constexpr u32 b0 = SEL & 0xF, b1 = SEL >> 4 & 0xF, b2 = SEL >> 8 & 0xF, b3 = SEL >> 12 & 0xF;
  lo = byte_perm<b1 << 12 | 0x400u | b0 << 4 | 0x4u>(x);   // (selector 4: a zero byte of prmt's second operand)
  hi = byte_perm<b3 << 12 | 0x400u | b2 << 4 | 0x4u>(x);
}
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float log2_approx(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Loads that bypass L1: partials written by other SMs in the same launch. VOL: volatile loads, which ptxas keeps in
// program order, so a merge that asks for every part's values and lse together has them all in flight before it uses
// any (one round trip); ld.global.cg loads it may reorder (decode's merge: the lse first, their max, then the values).
template <bool VOL = false>
__device__ __forceinline__ float ld_cg(const float* p) {
  float v;
  if constexpr (VOL) asm volatile("ld.volatile.global.f32 %0, [%1];" : "=f"(v) : "l"(p));
  else asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}
template <bool VOL = false>
__device__ __forceinline__ float4 ld_cg4(const float* p) {
  float4 v;
  if constexpr (VOL)
    asm volatile("ld.volatile.global.v4.f32 {%0,%1,%2,%3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
  else asm volatile("ld.global.cg.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ float2 ld_cg2(const float* p) {
  float2 v;
  asm volatile("ld.global.cg.v2.f32 {%0,%1}, [%2];" : "=f"(v.x), "=f"(v.y) : "l"(p));
  return v;
}
__device__ __forceinline__ uint4 ld_cg_v4(const void* p) {   // 16 bytes of any type
  uint4 v;
  asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
// --- timing (MELD_PROFILE builds) ---------------------------------------------------------------
__device__ __forceinline__ i64 global_timer_ns() {
  i64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ int sm_id() {
  u32 r;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(r));
  return (int)r;
}

// --- per-task timestamps (MELD_PROFILE builds; meld/runtime/profile.py reads them) ---------------------
// Per CTA: a header [begin, end, smid, records] and up to `cap` records [t0, t1, kind, unit]; one thread
// of the CTA (the recorder) writes. Kinds are indices into meld.runtime.profile.KINDS (PROF_* defines).
// Sampling (`every` > 1, with a `clock` of two words [launch, exits]): a launch records only when its
// number is a multiple of `every`, so production runs pay for one launch in `every`. Each recorder reads
// the launch number when its CTA begins and takes an exit ticket when it ends; the last of the launch's
// `ctas` tickets advances the number, after every CTA of the launch has read it (eager launches and graph
// replays alike).
struct Profiler {
  i64* base = nullptr;
  unsigned* clock = nullptr;
  int* shared = nullptr;   // several recording threads of a CTA (join): their record count, in shared memory
  int n = 0, cap = 0;
  __device__ __forceinline__ void begin(i64* buf, int capacity, int cta, bool recorder, unsigned* clk, int every) {
    if (!MELD_PROFILE || !recorder || buf == nullptr) return;
    clock = clk;
    if (clk != nullptr && every > 1 && *reinterpret_cast<volatile unsigned*>(clk) % (unsigned)every != 0u) return;
    base = buf + (i64)cta * (1 + capacity) * 4;
    cap = capacity;
    base[0] = global_timer_ns();
  }
  // Another recording thread of a CTA whose header a begin() writes; all count on `count` (zeroed first).
  __device__ __forceinline__ void join(i64* buf, int capacity, int cta, int* count) {
    if (!MELD_PROFILE || buf == nullptr) return;
    base = buf + (i64)cta * (1 + capacity) * 4;
    cap = capacity;
    shared = count;
  }
  __device__ __forceinline__ i64 now() const { return MELD_PROFILE && base != nullptr ? global_timer_ns() : 0; }
  // The next record's index (counted past the capacity too: the header's count says how many were dropped).
  __device__ __forceinline__ int next_slot() { return shared != nullptr ? atomicAdd(shared, 1) : n++; }
  __device__ __forceinline__ void record(i64 t0, int kind, int unit) {
    if (!MELD_PROFILE || base == nullptr) return;
    const int i = next_slot();
    if (i < cap) {
      i64* r = base + 4 * (1 + i);
      r[0] = t0; r[1] = global_timer_ns(); r[2] = kind; r[3] = unit;
    }
  }
  // A sum of SM cycles (a diagnostic build's phase stamps: meld/runtime/profile.py, PHASES), not a task.
  __device__ __forceinline__ void record_cycles(int phase, int role, i64 cycles) {
    if (!MELD_PROFILE || base == nullptr) return;
    const int i = next_slot();
    if (i < cap) {
      i64* r = base + 4 * (1 + i);
      r[0] = -1; r[1] = cycles; r[2] = phase; r[3] = role;
    }
  }
  __device__ __forceinline__ void end(int ctas) {
    if (!MELD_PROFILE) return;
    if (base != nullptr) {
      base[1] = global_timer_ns(); base[2] = sm_id(); base[3] = shared != nullptr ? *reinterpret_cast<volatile int*>(shared) : n;
    }
    if (clock == nullptr) return;
    __threadfence();   // this CTA's read of the launch number comes before its ticket
    if (atomicAdd(clock + 1, 1u) == (unsigned)ctas - 1u) {
      clock[1] = 0u;
      atomicAdd(clock, 1u);
    }
  }
};

// --- thread-block clusters: rank, barrier, distributed shared memory -----------------------------
__device__ __forceinline__ int cluster_rank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return (int)r;
}
__device__ __forceinline__ int cluster_size() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(r));
  return (int)r;
}
// Every thread of every CTA of the cluster arrives; wait returns once all have (split phases).
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
__device__ __forceinline__ void fence_cluster() { asm volatile("fence.acq_rel.cluster;" ::: "memory"); }
// The address of shared-memory location `addr` in the CTA of cluster rank `rank`.
__device__ __forceinline__ u32 dsmem_map(u32 addr, int rank) {
  u32 r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}
__device__ __forceinline__ float dsmem_load(u32 addr) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ float4 dsmem_load4(u32 addr) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(addr) : "memory");
  return v;
}

// mbarriers and TMA bulk copies (sm_90). The barriers live in this CTA's shared memory.
__device__ __forceinline__ void mbar_init(u32 bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void fence_mbar_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
__device__ __forceinline__ void st_shared_zero16(u32 addr) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(addr), "r"(0u) : "memory");
}
// Generic-proxy accesses to shared memory before async-proxy (TMA) writes to it.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(u32 bar, u32 parity) {
  u32 done;
  asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
               : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  return done != 0;
}
// --- watchdogs -----------------------------------------------------------------------------------
// Every spin gives up after MELD_WATCHDOG_NS. The first thread on the device to give up claims the
// device's record (an atomic on a device word), writes what it waited for into the record (pinned host
// memory, readable after the trap; meld/runtime/watchdog.py decodes it) and traps.
struct WaitSite {
  WatchdogRecord* rec;
  int* claim;
  int kernel, site, cta, warp, unit, detail;   // site numbers: watchdog.SITES
};
__device__ __noinline__ void watchdog_trip(WatchdogRecord* rec, int* claim, int kernel, int site, int cta, int warp,
                                           int unit, int detail, u32 parity, i64 waited_ns) {
  if (rec != nullptr && atomicCAS(claim, 0, 1) == 0) {
    volatile WatchdogRecord* r = rec;
    r->kernel = kernel; r->site = site; r->cta = cta; r->sm = sm_id(); r->warp = warp; r->unit = unit;
    r->detail = detail; r->parity = (int)parity; r->waited_ns = waited_ns;
    __threadfence_system();   // the record before the flag that says it is complete
    r->tripped = 1;
    __threadfence_system();
  }
  __trap();
}

// Wait for the barrier's phase `parity` to complete. A phase that never completes (a copy that was
// never issued, a byte count that does not match) trips the watchdog instead of hanging. A wait that is
// downstream of another spin gets a longer `limit_ns`, so the spin at the root cause reports first.
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity, const WaitSite& s, i64 limit_ns = MELD_WATCHDOG_NS) {
  if (mbar_try_wait(bar, parity)) return;
  const i64 t0 = global_timer_ns();
  while (!mbar_try_wait(bar, parity)) {
    const i64 waited = global_timer_ns() - t0;
    if (waited > limit_ns)
      watchdog_trip(s.rec, s.claim, s.kernel, s.site, s.cta, s.warp, s.unit, s.detail, parity, waited);
  }
}
// Low-latency words (NCCL's LL protocol): 4 bytes of data and a 4-byte tag (the launch) in one 8-byte store,
// which lands whole (a single-copy-atomic access), so a reader that sees the tag has the data: no fence and
// no separate flag between them.
__device__ __forceinline__ void ll_put(unsigned long long* a, u32 tag, u32 data) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(a), "l"((unsigned long long)tag << 32 | data) : "memory");
}
__device__ __forceinline__ unsigned long long ll_load(const unsigned long long* a) {
  unsigned long long v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(a) : "memory");
  return v;
}
// The data of words a[off[u]] for the u in `pending` (a bit each), once each carries `tag`: every pending
// word's load in flight at once, round after round (a word at a time cost a round trip each: bench/RESULTS.md,
// "the direct path waits for a tile's words a round at a time"), under the watchdog.
template <int N>
__device__ __forceinline__ void ll_wait(const unsigned long long* a, const int (&off)[N], unsigned pending, u32 tag,
                                        u32 (&d)[N], const WaitSite& s, i64 limit_ns) {
  i64 t0 = -1;
  while (pending) {
    unsigned long long v[N];
#pragma unroll
    for (int u = 0; u < N; ++u)
      if (pending >> u & 1u) v[u] = ll_load(a + off[u]);
#pragma unroll
    for (int u = 0; u < N; ++u)
      if ((pending >> u & 1u) && (u32)(v[u] >> 32) == tag) {
        d[u] = (u32)v[u];
        pending &= ~(1u << u);
      }
    if (!pending) break;
    const i64 now = global_timer_ns();
    if (t0 < 0) t0 = now;
    if (now - t0 > limit_ns) watchdog_trip(s.rec, s.claim, s.kernel, s.site, s.cta, s.warp, s.unit, s.detail, tag, now - t0);
  }
}

// --- the proxy transport's command ring (meld/distributed/proxy.py) ------------------------------------------
// A GPU that cannot store into a peer (RDMA between nodes) hands its puts and signals to a host proxy as
// fixed-size records in pinned host memory (meld/distributed/transport.py's COMMAND). A thread claims a slot on
// the device's tail counter, waits (under the watchdog) until the proxy's head leaves that slot free,
// writes the record and then, after a system-scope fence, its ticket (slot + 1): the proxy takes a record
// only once its ticket is there.
struct ProxyCommand {
  u32 op, window, dst, pad;
  unsigned long long start, count;
  long long addend;
  unsigned long long ticket;
};
static_assert(sizeof(ProxyCommand) == 48, "ProxyCommand must match meld.distributed.transport.COMMAND");
constexpr u32 PROXY_PUT = 1, PROXY_SIGNAL = 3;
__device__ __forceinline__ void proxy_push(ProxyCommand* ring, unsigned long long* tail, const unsigned long long* head,
                                           int capacity, u32 op, u32 dst, unsigned long long start,
                                           unsigned long long count, long long addend, const WaitSite& s) {
  const unsigned long long slot = atomicAdd(tail, 1ull);
  const volatile unsigned long long* h = head;
  if (slot >= *h + capacity) {
    const i64 t0 = global_timer_ns();
    while (slot >= *h + capacity) {
      const i64 waited = global_timer_ns() - t0;
      if (waited > MELD_WATCHDOG_NS)
        watchdog_trip(s.rec, s.claim, s.kernel, s.site, s.cta, s.warp, s.unit, s.detail, (u32)slot, waited);
    }
  }
  volatile ProxyCommand* c = ring + slot % capacity;
  c->op = op; c->window = 0u; c->dst = dst; c->pad = 0u;
  c->start = start; c->count = count; c->addend = addend;
  __threadfence_system();
  c->ticket = slot + 1;
}

// Fetch a tensor map (a __grid_constant__ parameter's) into the TMA unit's cache ahead of its first copy, which
// would otherwise wait for it after the loads that find the copy's coordinates.
__device__ __forceinline__ void prefetch_tensormap(const void* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(map) : "memory");
}

// One TMA tensor copy (a box of a 4-D tensor map, coordinates innermost first) global -> this CTA's
// shared memory; its bytes complete on `bar`. `map` is the generic address of a __grid_constant__ map.
__device__ __forceinline__ void tma_load_4d(u32 dst, const void* map, int c0, int c1, int c2, int c3, u32 bar) {
  asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
               " [%0], [%1, {%2, %3, %4, %5}], [%6];"
               ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar) : "memory");
}

}  // namespace meld
