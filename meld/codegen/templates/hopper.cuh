// meld: Hopper (sm_90a) matrix helpers: 2-D TMA tile copies, wgmma shared-memory descriptors, the
// wgmma fences and warpgroup register reallocation. The m64nNk16 instructions themselves are generated
// per N by meld/codegen/wgmma.py (their accumulator lists are long and regular).

namespace meld {

// One TMA copy of a box of a 2-D tensor map (coordinates innermost first) into this CTA's shared memory;
// its bytes complete on `bar`. Out-of-bounds elements are written as zeros and still counted.
__device__ __forceinline__ void tma_load_2d(u32 dst, const void* map, int c0, int c1, u32 bar) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
               " [%0], [%1, {%2, %3}], [%4];"
               ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(bar) : "memory");
}

// The same for a 3-D tensor map.
__device__ __forceinline__ void tma_load_3d(u32 dst, const void* map, int c0, int c1, int c2, u32 bar) {
  asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
               " [%0], [%1, {%2, %3, %4}], [%5];"
               ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar) : "memory");
}

// A tensor map whose address is known only on the device (a per-call input, where the host encodes the rest once):
// one warp copies the template `tmpl` (param space) into shared memory at `tmp` (128-byte aligned, 128 bytes),
// lane 0 sets its address to `addr`, and the warp publishes it to `dst` (global, 128-byte aligned), from where
// TMA copies may read it once tensor_map_acquire(dst) has run in the copying thread. Every lane calls it.
__device__ __forceinline__ void tensor_map_publish(const void* tmpl, const void* addr, u32 tmp, void* dst) {
  const int lane = threadIdx.x & 31;
  if (lane < 8) {
    const uint4 v = reinterpret_cast<const uint4*>(tmpl)[lane];
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(tmp + 16 * lane), "r"(v.x), "r"(v.y), "r"(v.z),
                 "r"(v.w) : "memory");
  }
  __syncwarp();
  if (lane == 0)
    asm volatile("tensormap.replace.tile.global_address.shared::cta.b1024.b64 [%0], %1;" ::"r"(tmp), "l"(addr)
                 : "memory");
  __syncwarp();
  asm volatile("tensormap.cp_fenceproxy.global.shared::cta.tensormap::generic.release.cta.sync.aligned [%0], [%1], 128;"
               ::"l"(dst), "r"(tmp) : "memory");
}
__device__ __forceinline__ void tensor_map_acquire(const void* map) {
  asm volatile("fence.proxy.tensormap::generic.acquire.cta [%0], 128;" ::"l"(map) : "memory");
}

// An L2 eviction policy for a stream read once from DRAM and soon after from L2 by at most a neighbour: its lines
// go first when L2 needs room (createpolicy's evict_first over the whole access).
__device__ __forceinline__ unsigned long long l2_evict_first() {
  unsigned long long policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

// tma_load_2d under an L2 cache policy (l2_evict_first).
__device__ __forceinline__ void tma_load_2d_hint(u32 dst, const void* map, int c0, int c1, u32 bar,
                                                 unsigned long long policy) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
               " [%0], [%1, {%2, %3}], [%4], %5;"
               ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(bar), "l"(policy) : "memory");
}

// A contiguous run of `bytes` (a multiple of 16, both ends 16-byte aligned) into this CTA's shared memory;
// its bytes complete on `bar`.
__device__ __forceinline__ void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// Ask for `bytes` (a multiple of 16, from a 16-byte aligned address) of global memory in L2, without waiting.
__device__ __forceinline__ void prefetch_l2(const void* src, u32 bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// Descriptor of a K-major operand tile stored as TMA's 128-byte swizzle writes it: rows of 64 16-bit
// elements (128 bytes), 8-row atoms of 1 KiB one after another (stride byte offset 1024), swizzle mode 1
// (128 B) in bits 62-63. A k16 step inside the 64-wide row adds 32 bytes to the start address.
__device__ __forceinline__ unsigned long long wgmma_desc(u32 smem) {
  return (unsigned long long)((smem & 0x3FFFF) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) |
         (1ull << 62);
}

// The same for TMA's 64-byte swizzle (swizzle mode 2): rows of 64 bytes, 8-row atoms of 512 bytes (stride byte
// offset 512); a K step of 32 bytes adds 32 to the start address.
__device__ __forceinline__ unsigned long long wgmma_desc_sw64(u32 smem) {
  return (unsigned long long)((smem & 0x3FFFF) >> 4) | (1ull << 16) | ((unsigned long long)(512 >> 4) << 32) |
         (2ull << 62);
}

// Descriptor of an MN-major operand (its MN elements contiguous, as attention's value rows lie: B of
// P.V, wgmma_bf16_tb) stored as TMA's 128-byte swizzle writes boxes of [K rows][64 elements]: 8-row atoms
// 1 KiB apart along K (stride byte offset) and `box_bytes` between the boxes of consecutive 64 elements
// along MN (leading byte offset). A k16 step is two atoms: 2 KiB on.
__device__ __forceinline__ unsigned long long wgmma_desc_mn(u32 smem, u32 box_bytes) {
  return (unsigned long long)((smem & 0x3FFFF) >> 4) | ((unsigned long long)(box_bytes >> 4) << 16) |
         ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }

// Keep the accumulators in registers across wgmma issue and wait (the compiler must not move them).
template <int N>
__device__ __forceinline__ void fence_regs(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// And a wgmma's A operand from registers: written before the wgmma_fence that precedes the wgmma.
template <int N>
__device__ __forceinline__ void fence_regs(u32 (&a)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(a[i])::"memory");
}

template <int REGS>
__device__ __forceinline__ void regs_dealloc() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(REGS)); }
template <int REGS>
__device__ __forceinline__ void regs_alloc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(REGS)); }

// Named barrier over `threads` threads (ids 1..15; 0 is __syncthreads), every lane of every participating
// warp. `bar.sync` is barrier.sync.aligned: every participating thread must execute the same barrier
// instruction, converged. Neither holds here: the two warpgroups of a warp-specialised kernel reach one
// barrier from different inlined copies of a function (MLA's mla_store, the TP kernel's tp_every_done), and
// callers come from per-thread loops and branches that leave a warp diverged (__syncwarp does not reconverge
// it for the next instruction); synccheck reports either as divergent threads. The unaligned form allows
// both; __syncwarp first orders the warp's lanes' shared-memory accesses before any of them arrives.
__device__ __forceinline__ void named_barrier(int id, int threads) {
  __syncwarp();
  asm volatile("barrier.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// A producer's side of a named barrier: counts this warp's arrival and goes on (the consumers bar.sync on
// it; `threads` counts both sides). Unaligned, as named_barrier.
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  __syncwarp();
  asm volatile("barrier.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Orders this thread's generic-proxy and async-proxy (TMA) accesses to global memory: generic writes it
// acquired before TMA reads, or TMA writes it waited for before a generic release.
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

// TMA bulk copies from this CTA's shared memory to global memory (a peer's too, over NVLink): `bytes` a
// multiple of 16, both addresses 16-byte aligned, in this thread's bulk group. wait_read: the sources may
// be rewritten; wait: the writes have completed (then fence_proxy_async_global before a generic release).
__device__ __forceinline__ void bulk_store(void* dst, u32 src, u32 bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
__device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// Four 8x8 16-bit matrices from mma fragments (register m of each thread: its two elements of matrix m),
// stored transposed: fragment column j of matrix m goes to the 16 bytes at the address lane 8m + j gives.
__device__ __forceinline__ void stmatrix_x4_trans(u32 addr, u32 a, u32 b, u32 c, u32 d) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};"
               ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}
__device__ __forceinline__ uint4 ld_shared_v4(u32 addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ float ld_shared_f32(u32 addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
  return v;
}

__device__ __forceinline__ float bf16_to_float(u16 v) { return __uint_as_float((u32)v << 16); }
__device__ __forceinline__ u16 float_to_bf16(float f) {
  u16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return r;
}

// A ring of NUM_STAGES TMA stages: a `full` mbarrier per stage (the producer's copies completed: one
// arrival with the byte count) and an `empty` one (one arrival per consumer warp once its wgmmas have read
// the stage); the phase flips each time the ring wraps.
struct Ring {
  u32 base, full, empty;       // stage buffers; mbarriers (8 bytes each)
  int stage = 0;
  u32 phase = 0;
  __device__ void advance() {
    if (++stage == NUM_STAGES) { stage = 0; phase ^= 1u; }
  }
  // The ring at the start of dynamic shared memory (whose address is `raw`): stage buffers of STAGE bytes
  // from the first 1 KiB boundary (TMA's 128-byte swizzle repeats every 1 KiB), then the mbarriers.
  template <int STAGE>
  __device__ static Ring at(u32 raw) {
    Ring r;
    r.base = (raw + 1023) & ~1023u;
    r.full = r.base + NUM_STAGES * STAGE;
    r.empty = r.full + 8 * NUM_STAGES;
    return r;
  }
  __device__ u32 end() const { return empty + 8 * NUM_STAGES; }   // the first byte after the ring
  __device__ void init(int consumer_warps) const {
    for (int s = 0; s < NUM_STAGES; ++s) {
      mbar_init(full + 8 * s, 1);
      mbar_init(empty + 8 * s, consumer_warps);
    }
  }
};

// A consumer warpgroup's turn at the ring's next stage (of STAGE bytes): wait for its copies, issue the
// wgmmas that read it (`mma(stage address)`), and keep them in flight while the stage before, whose
// wgmmas have then completed, goes back to the producer. `prev`: the stage still to release (-1: none).
template <int STAGE, class Mma>
__device__ __forceinline__ void ring_consume(Ring& ring, int& prev, int lane, const WaitSite& site, i64 limit_ns, Mma&& mma) {
  mbar_wait(ring.full + 8 * ring.stage, ring.phase, site, limit_ns);
  wgmma_fence();
  mma(ring.base + ring.stage * STAGE);
  wgmma_commit();
  wgmma_wait<1>();
  if (prev >= 0 && lane == 0) mbar_arrive(ring.empty + 8 * prev);
  prev = ring.stage;
  ring.advance();
}

}  // namespace meld
