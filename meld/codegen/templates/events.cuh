// meld: events, the one way a task tells another that its part is done (Mirage MPK's task/event contract).
// An event is a counter of arrivals and a target, its parts (meld/ir/work_table.py: EVENT). Every "combine
// fired by a count" of every family is one: a split-KV unit's partials (decode, MLA, grouped attention), a
// MoE row block's gemm1 tiles and a token's gemm2 rows, a row-parallel tile's pieces, a launch's CTAs (the
// last one finishes the launch), and across ranks the start, landing and stamp counters of xrank.cuh.
//
// The contract, relied on by every template (tests/test_events.py keeps the counting here):
// - Arrive. The data an arrival covers is made visible at the event's scope before it: each writing thread
//   fences (__threadfence, fence_cluster, __threadfence_system), then a barrier, then one thread arrives
//   with n parts at once. event_arrive* returns true to exactly one arrival, the one that brings the count
//   to the target; it fences again (acquire) before reading the other parts and fires the combine. No one
//   waits for the combine: the last arriver does the work.
// - Wait. A task that needs an event complete spins with acquire loads until the count reaches the target,
//   under the watchdog, with a site that names the task. Only tasks whose producers never wait on them may
//   wait (each template's deadlock argument says why its waits end).
// - Reset. A counter is zero between launches. Whoever touches it last in a launch stores the zero: the
//   completing arrival after its combine has read the parts (event_reset), or the last of the waiters to
//   leave (an arrival at target + waiters); a counter that several tasks wait on, none knowing it reads
//   last, is zeroed by the next launch's planner before that launch counts (MoE's row blocks). A counter
//   its planner presets to the parts counts down instead (n = -1, target 0): zero once complete. A system
//   counter that a faster rank's next launch may already add to is taken back by the count it expected
//   (event_take_sys), never stored. A cluster counter lives in shared memory, which does not outlive the
//   launch: its CTA zeroes it at its start, before the cluster barrier that precedes any arrival.
//
// Scopes: device (a counter in global memory), cluster (a counter in a peer CTA's shared memory, addressed
// over DSMEM: dsmem_map), system (a u64 in a rank's symmetric window, or pinned host memory: xrank.cuh owns
// the transport, these are its counts).
//
// Defined by the including source: common.cuh.

namespace meld {

// --- device scope ------------------------------------------------------------------------------------
// n arrivals at once; true for the arrival that completes the event (count reaches `target`).
template <class T>
__device__ __forceinline__ bool event_arrive(T* counter, T n, T target) {
  return atomicAdd(counter, n) == target - n;
}
template <class T>
__device__ __forceinline__ void event_reset(T* counter) { *counter = T(0); }

__device__ __forceinline__ int ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// The one spin of every scope: until `reached()` (an acquire load of the count against `target`), under the
// watchdog, which names the site and the target when `limit_ns` passes.
template <class Reached>
__device__ __forceinline__ void spin_until(Reached reached, u32 target, const WaitSite& s, i64 limit_ns) {
  if (reached()) return;
  const i64 t0 = global_timer_ns();
  while (!reached()) {
    const i64 waited = global_timer_ns() - t0;
    if (waited > limit_ns)
      watchdog_trip(s.rec, s.claim, s.kernel, s.site, s.cta, s.warp, s.unit, s.detail, target, waited);
  }
}
// Spin until the count reaches `target` (acquire: the parts it counts are visible after), under the watchdog.
__device__ __forceinline__ void event_wait(const int* counter, int target, const WaitSite& s,
                                           i64 limit_ns = MELD_WATCHDOG_NS) {
  spin_until([&] { return ld_acquire(counter) >= target; }, (u32)target, s, limit_ns);
}

// --- cluster scope: `counter` is a shared-memory address of a CTA of this cluster (dsmem_map) -----------
__device__ __forceinline__ bool event_arrive_cluster(u32 counter, u32 n, u32 target) {
  u32 old;
  asm volatile("atom.relaxed.cluster.shared::cluster.add.u32 %0, [%1], %2;"
               : "=r"(old) : "r"(counter), "r"(n) : "memory");
  return old == target - n;
}

// --- system scope: across ranks (xrank.cuh) -----------------------------------------------------------
// event_signal_sys makes every store this thread issued before it visible at system scope, then adds n
// (release); event_arrive_sys does the same and says whether it completed the event; event_publish_sys
// stores a count outright (a monotonic value: a launch number, a stamp), release.
__device__ __forceinline__ void event_signal_sys(unsigned long long* counter, unsigned long long n) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(counter), "l"(n) : "memory");
}
__device__ __forceinline__ unsigned long long fetch_add_sys(unsigned long long* counter, unsigned long long n) {
  unsigned long long old;
  asm volatile("atom.acq_rel.sys.global.add.u64 %0, [%1], %2;" : "=l"(old) : "l"(counter), "l"(n) : "memory");
  return old;
}
__device__ __forceinline__ bool event_arrive_sys(unsigned long long* counter, unsigned long long n,
                                                 unsigned long long target) {
  return fetch_add_sys(counter, n) == target - n;
}
__device__ __forceinline__ void event_publish_sys(unsigned long long* counter, unsigned long long value) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(counter), "l"(value) : "memory");
}
// A fence, then relaxed stores: the release of several stores at one fence's cost (xrank_announce_peers).
__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
__device__ __forceinline__ void store_relaxed_sys(unsigned long long* word, unsigned long long value) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(word), "l"(value) : "memory");
}
__device__ __forceinline__ unsigned long long load_acquire_sys(const unsigned long long* counter) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(counter) : "memory");
  return v;
}
// The count has reached `target` (one acquire load; the caller decides what to do meanwhile).
__device__ __forceinline__ bool event_reached_sys(const unsigned long long* counter, unsigned long long target) {
  return load_acquire_sys(counter) >= target;
}
__device__ __forceinline__ void event_wait_sys(const unsigned long long* counter, unsigned long long target,
                                               const WaitSite& s, i64 limit_ns = MELD_WATCHDOG_NS) {
  spin_until([&] { return event_reached_sys(counter, target); }, (u32)target, s, limit_ns);
}
// Take `n` counted arrivals back (the reset of a counter other launches may already count on).
__device__ __forceinline__ void event_take_sys(unsigned long long* counter, unsigned long long n) {
  atomicAdd(counter, 0ull - n);
}

}  // namespace meld
