// meld: the kernel skeleton. Every meld kernel entry is this one main, instantiated at compile time with its
// family's type F (no run-time switch over bodies, and no registers for bodies a family does not use): the
// persistent kernels (decode attention, MLA decode, grouped attention, the MoE GEMMs, the row-parallel
// linear), and the launches around them whose CTAs each take a block of the work (MoE's routing and
// dispatch, the decode planner, expert parallelism's dispatch, return and combine):
//
//   F::State s(p, smem)   places in shared memory and in the grid: address arithmetic only
//   [launch]              a grid that releases its dependent at once does it here
//   F::setup(p, s)        CTA-wide, before any input the kernel before writes is read: barriers, profiler,
//                         the plan's tables; it may keep in s what it loads of the other inputs
//   [launch]              then waits for the kernel before it (overlappable launches that wait, dependent ones)
//   F::run(p, s)          the warp roles and their task bodies
//   [launch]              an overlappable grid ends only after the grid before it
//
// Launch protocols (F::LAUNCH), each as its operator launches the family (meld/runtime/driver.py, Kernel.launch):
// - LAUNCH_OVERLAPPABLE (PersistentLaunch, meld/runtime/driver.py; DecodeParams, MlaParams): every grid of a
//   mixed launch after the first is a programmatic dependent of the one before, and the first grid is one of
//   the op before it when p.wait_inputs is set. A grid that does not wait releases its dependent at once; one
//   that waits (whose inputs the op before writes) releases it after the wait, so no later grid sees that
//   op's output unfinished either. Each grid ends after the grid before it, so the stream's next work sees
//   every grid's output.
// - LAUNCH_CHAIN_HEAD: an ordinary launch that releases its programmatic dependent at once (MoE's routing:
//   the dependent's wait, not this release, orders the routing tables before their reads).
// - LAUNCH_CHAIN_LINK: a programmatic dependent of the kernel before it that releases its own dependent at
//   once (MoE's dispatch): setup overlaps the kernel before it, and the next kernel's setup overlaps this one.
// - LAUNCH_DEPENDENT: always a programmatic dependent of the kernel before it (the MoE GEMMs of dispatch):
//   setup overlaps that kernel's tail.
// - LAUNCH_PLAIN: an ordinary launch.
//
// Shared memory is the dynamic allocation, F::SMEM_ALIGN-aligned as declared (the families that carve TMA
// boxes out of it align their regions themselves).

namespace meld {

// --- programmatic dependent launch -------------------------------------------------------------------
// A grid launched as a programmatic dependent of the one before it in the stream may start once every CTA
// of that one has called launch_dependents(); it must call grid_dependency_wait() before it reads anything
// the earlier grid writes (the wait returns when that grid has finished and its writes are visible). In a
// plain launch both are no-ops.
__device__ __forceinline__ void launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ void grid_dependency_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

enum LaunchKind { LAUNCH_OVERLAPPABLE, LAUNCH_CHAIN_HEAD, LAUNCH_CHAIN_LINK, LAUNCH_DEPENDENT, LAUNCH_PLAIN };

template <class F>
__device__ __forceinline__ void persistent_main(const typename F::Params& p) {
  constexpr LaunchKind L = F::LAUNCH;
  extern __shared__ __align__(F::SMEM_ALIGN) unsigned char smem[];
  typename F::State s(p, smem);
  if constexpr (L == LAUNCH_OVERLAPPABLE) {
    if (!p.wait_inputs) launch_dependents();
  }
  if constexpr (L == LAUNCH_CHAIN_HEAD || L == LAUNCH_CHAIN_LINK) launch_dependents();
  F::setup(p, s);
  if constexpr (L == LAUNCH_OVERLAPPABLE) {
    if (p.wait_inputs) {
      grid_dependency_wait();
      launch_dependents();
    }
  }
  if constexpr (L == LAUNCH_CHAIN_LINK || L == LAUNCH_DEPENDENT) grid_dependency_wait();
  F::run(p, s);
  if constexpr (L == LAUNCH_OVERLAPPABLE) grid_dependency_wait();
}

// The defaults of a family with no shared-memory layout and no prologue (the decode planner, expert
// parallelism's transfers: they define run(p, s) only); MoE's routing and dispatch declare their own State,
// and dispatch its own setup, over them.
template <class P, LaunchKind L>
struct SimpleFamily {
  using Params = P;
  static constexpr LaunchKind LAUNCH = L;
  static constexpr int SMEM_ALIGN = 16;
  struct State {
    __device__ __forceinline__ State(const P&, unsigned char*) {}
  };
  template <class S>
  static __device__ __forceinline__ void setup(const P&, const S&) {}
};

}  // namespace meld

// A family's kernel entry: `name`, F's main, at most `threads` threads with `min_ctas` per SM (0: no minimum,
// ptxas's own register budget). The only way a meld kernel is declared (tests/test_kernel_entries.py).
#define MELD_PERSISTENT_KERNEL(name, F, threads, min_ctas)                                                  \
  extern "C" __global__ void __launch_bounds__(threads, min_ctas) name(const __grid_constant__ F::Params p) { \
    meld::persistent_main<F>(p);                                                                            \
  }
