// meld row-parallel linear, all-reduced tile by tile across the ranks of a process group
// (meld/dist/tp_linear.py): y = sum_r x_r W_r^T on every rank, where x_r [M, K] and W_r [N, K] are rank
// r's slices of the contraction dimension. One persistent kernel per GPU, no collective afterwards.
//
// An output tile is COLS = 64 TP_WGS columns of N (weight rows: wgmma's A, 64 for each consumer warpgroup)
// x BLOCK_TOKENS tokens (wgmma's N), so a decode step with a few tokens wastes no tensor-core rows; with
// two consumer warpgroups (wide token blocks) both read each stage's token box, which halves the
// activation traffic per weight row. With few output tiles, K is split too
// (p.k_splits pieces per tile), so that every SM streams weights. CTA c computes pieces c, c + grid, ...;
// the token blocks of a column block are adjacent, so CTAs running together share its weight boxes in
// L2. Warp 0 keeps a ring of (weight box, token box) stages loaded by TMA; the consumer warpgroups run
// the wgmmas, one stage's in flight while the next is issued.
//
// Two ways to merge, both in a fixed order (rank-major over the world x k_splits partials of a tile: the
// same sum, bit for bit, whichever piece arrives last; no float atomics), partials in bf16 or float
// (MELD_TP_BF16_PARTS):
// - every rank merges (MELD_TP_EVERY 1, the default; tp_consume_every says how): every partial goes to
//   every rank and each rank sums its own output;
// - the owner merges (MELD_TP_EVERY 0): output tile o is reduced at its owner rank o % world; every piece
//   stores its partial into the owner's window (NVLink peer memory) and counts it on the owner's tile
//   counter after a system-scope fence; the piece whose count completes the tile sums the partials and
//   writes the bf16 tile into every rank's output.
// The start handshake and the landing count are xrank.cuh's.
//
// Deadlock freedom (owner merges): no CTA waits for another CTA's tile. A CTA waits only on its own TMA
// ring, once for every rank to have started the launch (every launch starts all its CTAs without waiting
// for anything), and, the launch's last CTA, for tiles that CTAs which never wait have finished or will
// finish. Every-rank merges: at tp_consume_every.

namespace meld {

constexpr int BK = 64;                           // K per box: one 128-byte swizzled row
constexpr int COLS = 64 * TP_WGS;                // output columns (weight rows) of a tile
constexpr int W_BOX = COLS * BK * 2;
constexpr int X_BOX = BLOCK_TOKENS * BK * 2;     // the token block
constexpr int BOX_PAIR = W_BOX + X_BOX;
constexpr int STAGE_BYTES = K_BOXES * BOX_PAIR;  // K_BOXES boxes along K: each weight row read in runs of
                                                 // 128 K_BOXES contiguous bytes (DRAM row locality)
constexpr int ACC = BLOCK_TOKENS / 2;            // accumulators per consumer thread (64 x BLOCK_TOKENS)
constexpr int TILE_ELEMS = COLS * BLOCK_TOKENS;
constexpr int CONSUMERS = 128 * TP_WGS;
constexpr bool TP_EVERY = MELD_TP_EVERY != 0;          // every rank merges (else the owner: see below)
constexpr bool TP_PROXY = MELD_TP_PROXY != 0;          // the proxy transport (every rank merges)

__device__ __forceinline__ WaitSite tp_site(const TpParams& p, int site, int warp, int tile, int detail) {
  return WaitSite{p.watchdog, p.watchdog_claim, p.watchdog_kernel, site, (int)blockIdx.x, warp, tile, detail};
}

__device__ __forceinline__ XWindows tp_windows(const TpParams& p) {
  return XWindows{p.xpeers, p.x_rank, p.x_world, p.x_started_off, p.x_landed_off};
}

// Piece t: output tile o = t / k_splits (column block, token block) and its K blocks [k0, k1).
struct Piece {
  int o, split, col, tok0, k0, k1;
};
__device__ __forceinline__ Piece tp_piece(const TpParams& p, int t) {
  Piece x;
  x.o = t / p.k_splits;
  x.split = t - x.o * p.k_splits;
  x.col = x.o / p.m_tiles;
  x.tok0 = (x.o - x.col * p.m_tiles) * BLOCK_TOKENS;
  const int nk = (p.k + BK * K_BOXES - 1) / (BK * K_BOXES);   // stages
  x.k0 = (int)((long long)nk * x.split / p.k_splits);
  x.k1 = (int)((long long)nk * (x.split + 1) / p.k_splits);
  return x;
}

__device__ void tp_produce(const TpParams& p, Ring ring) {
  for (int t = blockIdx.x; t < p.tiles; t += gridDim.x) {
    const Piece x = tp_piece(p, t);
    const int col = x.col, tok0 = x.tok0;
    for (int kk = x.k0; kk < x.k1; ++kk) {
      const u32 full = ring.full + 8 * ring.stage, dst = ring.base + ring.stage * STAGE_BYTES;
      mbar_wait(ring.empty + 8 * ring.stage, ring.phase ^ 1u, tp_site(p, 5, 0, t, ring.stage));
      mbar_arrive_expect_tx(full, STAGE_BYTES);   // out-of-bounds elements arrive as zeros, counted
#pragma unroll
      for (int b = 0; b < K_BOXES; ++b) {
#pragma unroll
        for (int g = 0; g < TP_WGS; ++g)   // 64 weight rows a box (the map's), one per consumer warpgroup
          tma_load_2d(dst + b * BOX_PAIR + g * 64 * BK * 2, &p.w_map, (kk * K_BOXES + b) * BK, col * COLS + 64 * g, full);
        tma_load_2d(dst + b * BOX_PAIR + W_BOX, &p.x_map, (kk * K_BOXES + b) * BK, tok0, full);
      }
      ring.advance();
    }
  }
}

// Partials travel as bf16 (as NCCL's bf16 all-reduce carries them: half the bytes of float) or float.
#if MELD_TP_BF16_PARTS
using Part = u16;
__device__ __forceinline__ void part_store4(Part* d, const float* a) {
  *reinterpret_cast<uint2*>(d) = make_uint2(float_to_bf16(a[0]) | (u32)float_to_bf16(a[1]) << 16,
                                            float_to_bf16(a[2]) | (u32)float_to_bf16(a[3]) << 16);
}
__device__ __forceinline__ float4 part_value4(const float* a) {   // a partial as it reads back from memory
  return make_float4(bf16_to_float(float_to_bf16(a[0])), bf16_to_float(float_to_bf16(a[1])),
                     bf16_to_float(float_to_bf16(a[2])), bf16_to_float(float_to_bf16(a[3])));
}
__device__ __forceinline__ float4 part_load4(const Part* s) {
  uint2 v;
  asm volatile("ld.global.cg.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(s));
  return make_float4(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u), __uint_as_float(v.y << 16),
                     __uint_as_float(v.y & 0xffff0000u));
}
#else
using Part = float;
__device__ __forceinline__ void part_store4(Part* d, const float* a) {
  *reinterpret_cast<float4*>(d) = make_float4(a[0], a[1], a[2], a[3]);
}
__device__ __forceinline__ float4 part_value4(const float* a) { return make_float4(a[0], a[1], a[2], a[3]); }
__device__ __forceinline__ float4 part_load4(const Part* s) { return ld_cg4(s); }
#endif

// A partial tile in memory: consumer thread ct's accumulators i .. i + 3 at element i CONSUMERS + 4 ct, so
// that each store (and load) instruction of a warp covers 32 contiguous runs of 4 elements: whole lines
// across NVLink rather than a few bytes of each of 32 lines. `dst` is the tile's base + 4 ct.
__device__ __forceinline__ void tp_store_partial(Part* dst, const float (&acc)[ACC]) {
#pragma unroll
  for (int i = 0; i < ACC; i += 4) part_store4(dst + i * CONSUMERS, acc + i);
}

// The tile's partials, summed in their fixed order (part `mine` from registers, rounded as the others read
// back, so the sum is the same whichever piece merges; the others from memory: `part(k)` is part k's
// base + 4 ct, laid out as tp_store_partial writes it), converted to bf16 and staged token-major in shared
// memory [BLOCK_TOKENS][COLS].
template <class PartAt>
__device__ __forceinline__ void tp_sum(PartAt&& part, int nparts, int mine, float (&acc)[ACC], u16* staged,
                                       int warp, int lane) {
#pragma unroll
  for (int i = 0; i < ACC; i += 4) {
    const float4 own = part_value4(acc + i);
    float4 s = mine == 0 ? own : part_load4(part(0) + i * CONSUMERS);
    for (int r = 1; r < nparts; ++r) {
      const float4 v = r == mine ? own : part_load4(part(r) + i * CONSUMERS);
      s.x += v.x; s.y += v.y; s.z += v.z; s.w += v.w;
    }
    acc[i] = s.x; acc[i + 1] = s.y; acc[i + 2] = s.z; acc[i + 3] = s.w;
  }
  // Accumulator layout (wgmma m64nN, f32): register r of thread (warp w, lane l) holds weight row (output
  // column) 64 (w / 4) + 16 (w % 4) + l / 4 + 8 ((r / 2) % 2) and token 8 (r / 4) + 2 (l % 4) + r % 2.
#pragma unroll
  for (int r = 0; r < ACC; ++r) {
    const int c = 64 * (warp / 4) + 16 * (warp % 4) + lane / 4 + 8 * ((r / 2) % 2);
    const int tok = 8 * (r / 4) + 2 * (lane % 4) + r % 2;
    staged[tok * COLS + c] = float_to_bf16(acc[r]);
  }
}

// Piece t's partial into acc, from the ring's stages (one stage's wgmmas in flight while the next issue).
__device__ __forceinline__ void tp_gemm(const TpParams& p, Ring& ring, const Piece& x, int t, float (&acc)[ACC],
                                        int warp, int lane) {
#pragma unroll
  for (int i = 0; i < ACC; ++i) acc[i] = 0.f;
  int prev = -1;
  for (int kk = x.k0; kk < x.k1; ++kk)
    ring_consume<STAGE_BYTES>(ring, prev, lane, tp_site(p, 7, warp + 4, t, ring.stage), MELD_WATCHDOG_NS, [&](u32 st) {
#pragma unroll
      for (int b = 0; b < K_BOXES; ++b)
#pragma unroll
        for (int s = 0; s < BK / 16; ++s)
          wgmma_bf16(acc, wgmma_desc(st + b * BOX_PAIR + (warp / 4) * 64 * BK * 2 + 32 * s),
                     wgmma_desc(st + b * BOX_PAIR + W_BOX + 32 * s));
    });
  wgmma_wait<0>();
  fence_regs(acc);
  if (prev >= 0 && lane == 0) mbar_arrive(ring.empty + 8 * prev);
}

// A staged tile's rows (16 bytes of a token's COLS columns per thread and step) into the outputs of ranks
// r0 .. r1 - 1.
__device__ __forceinline__ void tp_store_tile(const TpParams& p, const u16* staged, const Piece& x, int ct, int r0,
                                              int r1) {
  constexpr int STEPS = COLS / 8;   // 16-byte steps per token
  for (int i = ct; i < BLOCK_TOKENS * STEPS; i += CONSUMERS) {
    const int tk = i / STEPS, c = x.col * COLS + 8 * (i % STEPS);
    if (x.tok0 + tk >= p.m || c >= p.n) continue;
    const uint4 v = *reinterpret_cast<const uint4*>(staged + tk * COLS + 8 * (i % STEPS));
    const i64 off = p.x_out_off + ((i64)(x.tok0 + tk) * p.n + c) * 2;
    for (int r = r0; r < r1; ++r) *reinterpret_cast<uint4*>(p.xpeers[r] + off) = v;
  }
}

// The owner merges (MELD_TP_EVERY 0): the protocol at the top of this file.
__device__ void tp_consume(const TpParams& p, Ring ring, u16* staged, int* last) {
  const int ct = threadIdx.x - 128, warp = ct / 32, lane = ct % 32;
  const XWindows w = tp_windows(p);
  const unsigned long long launch = *reinterpret_cast<volatile unsigned long long*>(p.xlaunch) + 1;
  if (blockIdx.x == 0 && ct == 0) xrank_announce_peers(w, launch);
  const int nparts = p.x_world * p.k_splits;
  int finished = 0;          // tiles whose output this CTA wrote (into every rank's window)
  bool started = false;      // every rank has started this launch
  for (int t = blockIdx.x; t < p.tiles; t += gridDim.x) {
    const Piece x = tp_piece(p, t);
    const int mine = p.x_rank * p.k_splits + x.split;
    float acc[ACC];
    tp_gemm(p, ring, x, t, acc, warp, lane);
    if (!started) {   // before this CTA's first write into another rank's window
      if (ct == 0) xrank_wait_started(w, launch, tp_site(p, 13, warp + 4, t, 0), XRANK_WAIT_NS);
      named_barrier(1, CONSUMERS);
      started = true;
    }
    char* ow = p.xpeers[x.o % p.x_world];   // the owner's window
    Part* parts = reinterpret_cast<Part*>(ow + p.x_part_off) + (i64)x.o * nparts * TILE_ELEMS + 4 * ct;
    if (nparts > 1) {
      tp_store_partial(parts + (i64)mine * TILE_ELEMS, acc);
      __threadfence_system();
    }
    named_barrier(1, CONSUMERS);
    unsigned long long* count = reinterpret_cast<unsigned long long*>(ow + p.x_count_off) + x.o;
    if (ct == 0) *last = fetch_add_sys(count, 1ull) == (unsigned long long)(nparts - 1);
    named_barrier(1, CONSUMERS);
    if (!*last) continue;
    tp_sum([&](int k) { return parts + (i64)k * TILE_ELEMS; }, nparts, mine, acc, staged, warp, lane);
    named_barrier(1, CONSUMERS);
    tp_store_tile(p, staged, x, ct, 0, p.x_world);
    if (ct == 0) *count = 0ull;   // every part has arrived: ready for the next launch
    ++finished;
    named_barrier(1, CONSUMERS);   // (staged is rewritten by the next tile)
  }
  // One system-scope fence per thread covers the CTA's output writes and counter resets, then its tally
  // lands on every rank; the launch's last CTA waits for every tile of its own rank's output.
  __threadfence_system();
  named_barrier(1, CONSUMERS);
  if (ct != 0) return;
  xrank_land(w, (unsigned long long)finished);
  if (atomicAdd(p.xexit, 1u) != gridDim.x - 1) return;
  p.xexit[0] = 0u;
  xrank_take_landed(w, (unsigned long long)(p.tiles / p.k_splits), tp_site(p, 11, warp + 4, -1, 0), XRANK_WAIT_NS);
  *p.xlaunch = launch;   // launches finished (every CTA read the count at its start)
}

// Every rank merges (MELD_TP_EVERY 1; the proxy transport needs it). Each piece's partial goes to
// every rank's window: with peer memory stored into each; with the proxy stored into this rank's own and,
// at the CTA's end, sent as one put per destination of all the CTA's partials (they are contiguous: a
// rank's partials lie per CTA, I slots each). At its end each CTA stamps its slot [rank][cta] with the
// launch number on every rank, after one system-scope fence (the proxy: a signal behind its put, whose
// running total the stamp before this one tells). Then it merges the tiles whose first piece it computed,
// once every CTA that computed one of their pieces, on every rank, has stamped this launch: it reads only
// its own window, sums in (rank, split) order and writes only its own rank's output. Every rank computes
// the same sums in the same order: the outputs are bit-identical, and nothing but partials crosses ranks.
//
// Deadlock freedom: a CTA waits only after it has issued everything it sends, for CTAs that stamp before
// they wait; the grid fits the GPU at once (RowParallelLinear sizes it by occupancy), so each of them runs.
__device__ void tp_consume_every(const TpParams& p, Ring ring, u16* staged) {
  const int ct = threadIdx.x - 128, warp = ct / 32, lane = ct % 32;
  const XWindows w = tp_windows(p);
  const XRing q{p.xring, p.xring_tail, p.xring_head, p.xring_cap};
  const unsigned long long launch = *reinterpret_cast<volatile unsigned long long*>(p.xlaunch) + 1;
  if (blockIdx.x == 0 && ct == 0) {
    if (TP_PROXY)
      xrank_announce_proxy(w, q, launch, tp_site(p, 12, warp + 4, -1, 0));
    else
      xrank_announce_peers(w, launch);
  }
  const int G = gridDim.x, I = (p.tiles + G - 1) / G;   // CTAs; pieces of one CTA, at most
  const i64 region = (i64)G * I * TILE_ELEMS;          // one rank's partials in a window (elements)
  // Piece t's partial from rank r, in a window: its CTA's block of I slots, at the piece's ordinal there.
  auto part_at = [&](int r, int t) -> i64 {
    return p.x_part_off / (i64)sizeof(Part) + r * region + ((i64)(t % G) * I + t / G) * TILE_ELEMS;
  };
  auto stamp_at = [&](int r, int cta) -> i64 { return p.x_signal_off + 8 * ((i64)r * p.x_grid_cap + cta); };
  int pieces = 0;
  for (int t = blockIdx.x; t < p.tiles; t += G, ++pieces) {
    const Piece x = tp_piece(p, t);
    float acc[ACC];
    tp_gemm(p, ring, x, t, acc, warp, lane);
    if (pieces == 0) {   // before this CTA's first write of this launch into any window (module docstring)
      if (ct == 0) xrank_wait_started(w, launch, tp_site(p, 13, warp + 4, t, 0), XRANK_WAIT_NS);
      named_barrier(1, CONSUMERS);
    }
    const i64 off = part_at(p.x_rank, t) + 4 * ct;
    for (int r = TP_PROXY ? p.x_rank : 0; r < (TP_PROXY ? p.x_rank + 1 : p.x_world); ++r)
      tp_store_partial(reinterpret_cast<Part*>(p.xpeers[r]) + off, acc);
  }
  __threadfence_system();
  named_barrier(1, CONSUMERS);
  if (ct == 0) {
    const i64 stamp = stamp_at(p.x_rank, blockIdx.x);
    if (TP_PROXY) {
      unsigned long long* own = w.word(p.x_rank, stamp);
      const unsigned long long before = *own;   // the proxy's running total for this slot (only this CTA adds)
      const WaitSite s = tp_site(p, 12, warp + 4, -1, 0);
      for (int r = 0; r < p.x_world; ++r) {
        if (r == p.x_rank) continue;
        if (pieces)
          q.push(PROXY_PUT, r, sizeof(Part) * part_at(p.x_rank, blockIdx.x), pieces * TILE_ELEMS * sizeof(Part), 0, s);
        q.push(PROXY_SIGNAL, r, stamp, 0, (long long)(launch - before), s);
      }
      asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(own), "l"(launch) : "memory");
    } else {
      for (int r = 0; r < p.x_world; ++r)
        asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(w.word(r, stamp)), "l"(launch) : "memory");
    }
  }
  const int nparts = p.x_world * p.k_splits;
  const Part* mine = reinterpret_cast<const Part*>(p.xpeers[p.x_rank]);
  for (int t = blockIdx.x; t < p.tiles; t += G) {
    const Piece x = tp_piece(p, t);
    if (x.split != 0) continue;   // a tile is merged by the CTA of its first piece
    if (ct == 0)
      for (int k = 0; k < nparts; ++k) {
        const int src = x.o * p.k_splits + k % p.k_splits;
        signal_wait(w.word(p.x_rank, stamp_at(k / p.k_splits, src % G)), launch,
                    tp_site(p, 10, warp + 4, t, k / p.k_splits), XRANK_WAIT_NS);
      }
    named_barrier(1, CONSUMERS);
    float acc[ACC];
#pragma unroll
    for (int i = 0; i < ACC; ++i) acc[i] = 0.f;
    tp_sum([&](int k) { return mine + part_at(k / p.k_splits, x.o * p.k_splits + k % p.k_splits) + 4 * ct; },
           nparts, -1, acc, staged, warp, lane);
    named_barrier(1, CONSUMERS);
    tp_store_tile(p, staged, x, ct, p.x_rank, p.x_rank + 1);
    named_barrier(1, CONSUMERS);   // (staged is rewritten by the next tile)
  }
  if (ct != 0 || atomicAdd(p.xexit, 1u) != G - 1) return;
  p.xexit[0] = 0u;
  *p.xlaunch = launch;   // launches finished (every CTA read the count at its start)
}

extern "C" __global__ void __launch_bounds__(128 + CONSUMERS, CTAS_PER_SM) meld_tp_linear(const __grid_constant__ TpParams p) {
  extern __shared__ unsigned char smem_raw[];
  const u32 raw = smem_addr(smem_raw);
  const Ring ring = Ring::at<STAGE_BYTES>(raw);
  u16* staged = reinterpret_cast<u16*>(smem_raw + (ring.end() - raw));
  int* last = reinterpret_cast<int*>(staged + BLOCK_TOKENS * COLS);
  if (threadIdx.x == 0) {
    ring.init(CONSUMERS / 32);
    fence_mbar_init();
  }
  __syncthreads();
  if (threadIdx.x < 128) {
    if (TP_WGS == 2) regs_dealloc<40>();   // (two consumer warpgroups: their accumulators take the registers)
    if (threadIdx.x == 0) tp_produce(p, ring);
    return;
  }
  if (TP_WGS == 2) regs_alloc<232>();
  if (TP_EVERY)
    tp_consume_every(p, ring, staged);
  else
    tp_consume(p, ring, staged, last);
}

}  // namespace meld
