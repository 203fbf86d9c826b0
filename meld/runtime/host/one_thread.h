// meld: CUDA's block-level keywords for a host build of a device function written for one thread block
// (templates/decode_plan.h), run as a block of one thread by each host thread that calls it. Shared
// memory is per block, so here it is per thread (thread_local): concurrent calls from several host
// threads never share scratch. Only what that planner uses is defined.
#include <cstdlib>

#define __device__
#define __forceinline__ inline
#define __shared__ thread_local

struct MeldThreadIdx { unsigned x; };
constexpr MeldThreadIdx threadIdx{0};

inline void __syncthreads() {}
inline int __syncthreads_or(int predicate) { return predicate; }
template <class T> inline T min(T a, T b) { return a < b ? a : b; }
template <class T> inline T max(T a, T b) { return a > b ? a : b; }
