// meld: the decode-attention planner on the GPU.
//
// CTA 0 plans (decode_plan.h: the cut of meld/scheduler/decode_plan.py, the same text the host planner
// compiles) from the raw page table; the other CTAs copy the page indices into the device buffer. The raw
// page table may sit in pinned host memory (read over PCIe: plan() then costs the host one launch and no
// copy call) or in device memory (a page table that already lives on the GPU: no host involvement at all).
// When every CTA is done reading, the last one writes `done_seq` to the host-mapped `done_flag`, which
// tells the host it may reuse its staging buffer.
//
// Defined by the including source: events.cuh, persistent.cuh, decode_plan.h and what it needs.

namespace meld {

struct alignas(16) Int4 { int x, y, z, w; };

// CTAs 1..: copy the first kv_indptr[batch] page indices, four 16-byte loads in flight per thread
// (the source may be host memory, where latency, not bandwidth, is the cost).
__device__ __forceinline__ void copy_indices(const PlanParams& p) {
  const int nnz = p.kv_indptr[p.batch];
  const int n4 = nnz / 4, stride = (gridDim.x - 1) * PT;
  const Int4* src = reinterpret_cast<const Int4*>(p.src_indices);
  Int4* dst = reinterpret_cast<Int4*>(p.dst_indices);
  for (int i0 = (blockIdx.x - 1) * PT + threadIdx.x; i0 < n4; i0 += 4 * stride) {
    Int4 v[4];
#pragma unroll
    for (int k = 0; k < 4; ++k)
      if (i0 + k * stride < n4) v[k] = src[i0 + k * stride];
#pragma unroll
    for (int k = 0; k < 4; ++k)
      if (i0 + k * stride < n4) dst[i0 + k * stride] = v[k];
  }
  if (blockIdx.x == 1)
    for (int i = 4 * n4 + threadIdx.x; i < nnz; i += PT) p.dst_indices[i] = p.src_indices[i];
}

// The family (persistent.cuh): an ordinary launch (meld/ops/paged_decode.py) of one planning CTA and the
// copying ones; the planner's scratch is its own extern shared array (decode_plan.h, shared with the host build).
struct DecodePlanFamily : SimpleFamily<PlanParams, LAUNCH_PLAIN> {
  static __device__ __forceinline__ void run(const PlanParams& p, const State&) {
    if (blockIdx.x == 0) plan_tables(p);
    else copy_indices(p);
    if (p.done_flag == nullptr) return;
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      if (event_arrive(p.arrive, 1, (int)gridDim.x)) {   // last CTA: all reads of the staging buffer are done
        event_reset(p.arrive);
        __threadfence_system();
        *reinterpret_cast<volatile int*>(p.done_flag) = p.done_seq;
      }
    }
  }
};

}  // namespace meld

MELD_PERSISTENT_KERNEL(meld_decode_plan, meld::DecodePlanFamily, PLAN_THREADS, 1)
