// meld: the persistent-kernel skeleton. Every family's persistent kernel (decode attention, MLA decode, the
// MoE GEMMs, the row-parallel linear) is this one main, instantiated at compile time with the family's type
// F (no run-time switch over bodies, and no registers for bodies a family does not use):
//
//   F::State s(p, smem)   places in shared memory and in the grid: address arithmetic only
//   [launch]              an overlappable launch releases the next grid at once unless it waits for inputs
//   F::setup(p, s)        CTA-wide, before any input is read: barriers, profiler, the plan's tables
//   [launch]              then waits for the op before it (overlappable launches that wait, dependent ones)
//   F::run(p, s)          the warp roles and their task bodies
//   [launch]              an overlappable grid ends only after the grid before it
//
// Launch protocols (F::LAUNCH):
// - LAUNCH_OVERLAPPABLE (PersistentLaunch, meld/runtime/driver.py; DecodeParams, MlaParams): every grid of a
//   mixed launch after the first is a programmatic dependent of the one before, and the first grid is one of
//   the op before it when p.wait_inputs is set. A grid that does not wait releases its dependent at once; one
//   that waits (whose inputs the op before writes) releases it after the wait, so no later grid sees that
//   op's output unfinished either. Each grid ends after the grid before it, so the stream's next work sees
//   every grid's output.
// - LAUNCH_DEPENDENT: always a programmatic dependent of the kernel before it (the MoE GEMMs of dispatch):
//   setup overlaps that kernel's tail.
// - LAUNCH_PLAIN: an ordinary launch.
//
// Shared memory is the dynamic allocation, F::SMEM_ALIGN-aligned as declared (the families that carve TMA
// boxes out of it align their regions themselves).

namespace meld {

enum LaunchKind { LAUNCH_OVERLAPPABLE, LAUNCH_DEPENDENT, LAUNCH_PLAIN };

template <class F>
__device__ __forceinline__ void persistent_main(const typename F::Params& p) {
  extern __shared__ __align__(F::SMEM_ALIGN) unsigned char smem[];
  typename F::State s(p, smem);
  if (F::LAUNCH == LAUNCH_OVERLAPPABLE && !p.wait_inputs) launch_dependents();
  F::setup(p, s);
  if (F::LAUNCH == LAUNCH_OVERLAPPABLE && p.wait_inputs) {
    grid_dependency_wait();
    launch_dependents();
  }
  if (F::LAUNCH == LAUNCH_DEPENDENT) grid_dependency_wait();
  F::run(p, s);
  if (F::LAUNCH == LAUNCH_OVERLAPPABLE) grid_dependency_wait();
}

}  // namespace meld

// A family's kernel entry: `name`, F's persistent main, at most `threads` threads with `min_ctas` per SM.
#define MELD_PERSISTENT_KERNEL(name, F, threads, min_ctas)                                                  \
  extern "C" __global__ void __launch_bounds__(threads, min_ctas) name(const __grid_constant__ F::Params p) { \
    meld::persistent_main<F>(p);                                                                            \
  }
