// What compute-sanitizer's racecheck models: ten small kernels, each race-free by the PTX memory model
// except the positive control. tools/SANITIZE.md records what racecheck reported for each; meld's kernels
// hand generic shared-memory data between warpgroups only through barriers racecheck models (probe 2, 3, 6).
//
//   nvcc -arch=sm_90a -O3 -lineinfo -o /tmp/racecheck_probe tools/probes/racecheck_probe.cu
//   for i in $(seq 10); do compute-sanitizer --tool racecheck /tmp/racecheck_probe $i | grep SUMMARY; done
//
//   1  a warpgroup's stores handed to another through mbarriers (arrive / try_wait.parity): correct
//   2  two warpgroups exchange through one buffer around barrier.sync 2, 256 reached from different
//      instructions (as meld's warp-specialised kernels do): correct
//   3  the same through one barrier instruction: correct
//   4  positive control: another thread's slot read with no barrier: a real race
//   5  probe 1's hand-off through named barriers, the producer arriving (barrier.arrive), the consumer
//      syncing: correct (barrier.arrive synchronizes with barrier.sync of the same barrier)
//   6  probe 2 with each warp diverged around the read and before the second barrier: correct
//   7  probe 2 in a CTA of 384 threads whose first warpgroup exits at once (as MLA's loaders end before
//      its consumers): correct
//   8  MLA's hand-offs in miniature (templates/mla_decode.cuh): per block, warpgroup 1 writes a row
//      statistic and both sync on P_FULL (3), warpgroup 2 reads it and both sync on P_EMPTY (4) but after the
//      unit's last block; warpgroup 1 alone syncs on barrier 1 at the unit's last block; at the unit's end
//      both exchange through barrier 2 from their own copies of the code: correct
//   9  probe 8 without warpgroup 1's barrier 1: correct
//  10  probe 8 with barrier 1 and barrier 2's exchange only (no P_FULL / P_EMPTY): correct
#include <cstdio>
#include <cstdlib>

typedef unsigned int u32;

__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(u32 bar, int n) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(n));
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 phase) {
  asm volatile("{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W;\n}"
               ::"r"(bar), "r"(phase) : "memory");
}
__device__ __forceinline__ void bar_sync(int id, int threads) {   // as meld's named_barrier (hopper.cuh)
  __syncwarp();
  asm volatile("barrier.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id, int threads) {
  __syncwarp();
  asm volatile("barrier.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __noinline__ void sink(float* out, float v) { out[threadIdx.x] = v; }

__global__ void mbar_handoff(float* out, int iters) {
  __shared__ float x[64];
  __shared__ __align__(8) unsigned long long bars[2];
  const u32 full = smem_addr(&bars[0]), empty = smem_addr(&bars[1]);
  if (threadIdx.x == 0) {
    mbar_init(full, 1);
    mbar_init(empty, 4);
    asm volatile("fence.mbarrier_init.release.cluster;");
  }
  __syncthreads();
  float acc = 0.f;
  u32 ph = 0;
  for (int i = 0; i < iters; ++i, ph ^= 1u) {
    if (threadIdx.x < 128) {
      mbar_wait(empty, ph ^ 1u);
      if ((threadIdx.x & 1) == 0) x[threadIdx.x >> 1] = i + threadIdx.x;
      bar_sync(1, 128);
      if (threadIdx.x == 0) mbar_arrive(full);
    } else {
      mbar_wait(full, ph);
      acc += x[(threadIdx.x - 128) >> 1];
      __syncwarp();
      if ((threadIdx.x & 31) == 0) mbar_arrive(empty);
    }
  }
  sink(out, acc);
}

__global__ void bar_split(float* out, int iters) {
  __shared__ float x[256];
  float acc = 0.f;
  for (int i = 0; i < iters; ++i) {
    if (threadIdx.x < 128) {
      x[threadIdx.x] = i * 2.f;
      bar_sync(2, 256);
      acc += x[255 - threadIdx.x];
      bar_sync(2, 256);
    } else {
      x[threadIdx.x] = i * 3.f;
      bar_sync(2, 256);
      acc -= x[255 - threadIdx.x];
      bar_sync(2, 256);
    }
  }
  sink(out, acc);
}

__global__ void bar_same(float* out, int iters) {
  __shared__ float x[256];
  float acc = 0.f;
  for (int i = 0; i < iters; ++i) {
    x[threadIdx.x] = i * (threadIdx.x < 128 ? 2.f : 3.f);
    bar_sync(2, 256);
    acc += x[255 - threadIdx.x];
    bar_sync(2, 256);
  }
  sink(out, acc);
}

__global__ void real_race(float* out, int iters) {
  __shared__ float x[256];
  float acc = 0.f;
  for (int i = 0; i < iters; ++i) {
    x[threadIdx.x] = i;
    acc += x[255 - threadIdx.x];
  }
  sink(out, acc);
}

__global__ void bar_handoff(float* out, int iters) {
  __shared__ float x[64];
  float acc = 0.f;
  for (int i = 0; i < iters; ++i) {
    if (threadIdx.x < 128) {
      if (i > 0) bar_sync(4, 256);
      if ((threadIdx.x & 1) == 0) x[threadIdx.x >> 1] = i + threadIdx.x;
      bar_arrive(3, 256);
    } else {
      bar_sync(3, 256);
      acc += x[(threadIdx.x - 128) >> 1];
      if (i + 1 < iters) bar_arrive(4, 256);
    }
  }
  sink(out, acc);
}

__global__ void bar_diverged(float* out, int iters, int rows) {
  __shared__ float x[256];
  float acc = 0.f;
  for (int i = 0; i < iters; ++i) {
    const int t = threadIdx.x & 127;
    x[threadIdx.x] = i * 2.f;
    bar_sync(2, 256);
    if ((t & 31) < rows) acc += x[255 - threadIdx.x];
    if ((t & 3) == 0) out[512 + threadIdx.x] = acc;
    bar_sync(2, 256);
  }
  sink(out, acc);
}

// Warpgroups 1 and 2 of `bar_split` in a CTA of 384 threads, warpgroup 0 gone.
__global__ void bar_split_partial(float* out, int iters) {
  __shared__ float x[256];
  __shared__ int done;
  if (threadIdx.x == 0) done = 0;
  __syncthreads();
  if (threadIdx.x < 128) return;
  const int t = threadIdx.x - 128;
  float acc = 0.f;
  for (int i = 0; i < iters; ++i) {
    if (t < 128) {
      x[t] = i * 2.f;
      bar_sync(2, 256);
      acc += x[255 - t];
      bar_sync(2, 256);
    } else {
      x[t] = i * 3.f;
      bar_sync(2, 256);
      acc -= x[255 - t];
      bar_sync(2, 256);
    }
  }
  if (t == 0 || t == 128) atomicAdd(&done, 1);
  out[512 + threadIdx.x] = acc;
}

__global__ void mini_mla(float* out, int units, int blocks) {
  __shared__ float alpha[64], bad[2][64];
  if (threadIdx.x < 128) return;
  const int g = threadIdx.x < 256 ? 0 : 1, t = threadIdx.x & 127, r = (t >> 5) * 16 + ((t & 31) >> 2);
  float acc = 0.f;
  for (int u = 0; u < units; ++u) {
    for (int j = 0; j < blocks; ++j) {
      if (g == 0) {
        if (j > 0) bar_sync(4, 256);
        if ((t & 3) == 0) alpha[r] = u + j + 0.5f * r;
        bar_sync(3, 256);
        if (j == blocks - 1) bar_sync(1, 128);
        acc += 1.f;
      } else {
        bar_sync(3, 256);
        acc += alpha[r];
        if (j < blocks - 1) bar_sync(4, 256);
      }
    }
    if ((t & 3) == 0) bad[g][r] = acc - acc;
    bar_sync(2, 256);
    acc += bad[0][r] + bad[1][r];
    bar_sync(2, 256);
  }
  out[512 + threadIdx.x] = acc;
}

__global__ void mini_mla_no_bar1(float* out, int units, int blocks) {
  __shared__ float alpha[64], bad[2][64];
  if (threadIdx.x < 128) return;
  const int g = threadIdx.x < 256 ? 0 : 1, t = threadIdx.x & 127, r = (t >> 5) * 16 + ((t & 31) >> 2);
  float acc = 0.f;
  for (int u = 0; u < units; ++u) {
    for (int j = 0; j < blocks; ++j) {
      if (g == 0) {
        if (j > 0) bar_sync(4, 256);
        if ((t & 3) == 0) alpha[r] = u + j + 0.5f * r;
        bar_sync(3, 256);
        acc += 1.f;
      } else {
        bar_sync(3, 256);
        acc += alpha[r];
        if (j < blocks - 1) bar_sync(4, 256);
      }
    }
    if ((t & 3) == 0) bad[g][r] = acc - acc;
    bar_sync(2, 256);
    acc += bad[0][r] + bad[1][r];
    bar_sync(2, 256);
  }
  out[512 + threadIdx.x] = acc;
}

__global__ void mini_mla_bar1_only(float* out, int units, int blocks) {
  __shared__ float alpha[64], bad[2][64];   // (alpha unused: as measured)
  if (threadIdx.x < 128) return;
  const int g = threadIdx.x < 256 ? 0 : 1, t = threadIdx.x & 127, r = (t >> 5) * 16 + ((t & 31) >> 2);
  float acc = 0.f;
  for (int u = 0; u < units; ++u) {
    for (int j = 0; j < blocks; ++j) {
      if (g == 0) {
        if (j == blocks - 1) bar_sync(1, 128);
        acc += 1.f;
      } else {
      }
    }
    if ((t & 3) == 0) bad[g][r] = acc - acc;
    bar_sync(2, 256);
    acc += bad[0][r] + bad[1][r];
    bar_sync(2, 256);
  }
  out[512 + threadIdx.x] = acc;
}

int main(int argc, char** argv) {
  const int which = argc > 1 ? atoi(argv[1]) : 0;
  float* out;
  if (cudaMalloc(&out, 4096) != cudaSuccess) return 2;
  switch (which) {
    case 1: mbar_handoff<<<1, 256>>>(out, 8); break;
    case 2: bar_split<<<1, 256>>>(out, 8); break;
    case 3: bar_same<<<1, 256>>>(out, 8); break;
    case 4: real_race<<<1, 256>>>(out, 8); break;
    case 5: bar_handoff<<<1, 256>>>(out, 8); break;
    case 6: bar_diverged<<<1, 256>>>(out, 8, 20); break;
    case 7: bar_split_partial<<<1, 384>>>(out, 8); break;
    case 8: mini_mla<<<1, 384>>>(out, 4, 3); break;
    case 9: mini_mla_no_bar1<<<1, 384>>>(out, 4, 3); break;
    case 10: mini_mla_bar1_only<<<1, 384>>>(out, 4, 3); break;
    default: fprintf(stderr, "usage: %s 1..10\n", argv[0]); return 2;
  }
  const cudaError_t e = cudaDeviceSynchronize();
  printf("probe %d: %s\n", which, cudaGetErrorString(e));
  return e != cudaSuccess;
}
