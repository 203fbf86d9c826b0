// meld row-parallel linear, all-reduced tile by tile across the ranks of a process group
// (meld/distributed/tp_linear.py): y = sum_r x_r W_r^T on every rank, where x_r [M, K] and W_r [N, K] are rank
// r's slices of the contraction dimension. One persistent kernel per GPU, no collective afterwards.
//
// An output tile is COLS = 64 TP_WGS columns of N (weight rows: wgmma's A, 64 for each consumer warpgroup)
// x BLOCK_TOKENS tokens (wgmma's N), so a decode step with a few tokens wastes no tensor-core rows; with
// two consumer warpgroups (wide token blocks) both read each stage's token box, which halves the
// activation traffic per weight row. With few output tiles, K is split too
// (p.k_splits pieces per tile), so that every SM streams weights. CTA c computes pieces c, c + grid, ...
// (the plan's rows, p.tasks);
// the token blocks of a column block are adjacent, so CTAs running together share its weight boxes in
// L2. Warp 0 keeps a ring of (weight box, token box) stages loaded by TMA; the consumer warpgroups run
// the wgmmas, one stage's in flight while the next is issued.
//
// Two ways to merge, both in a fixed order (rank-major over the world x k_splits partials of a tile: the
// same sum, bit for bit, whichever piece arrives last; no float atomics), partials in bf16 or float
// (MELD_TP_BF16_PARTS):
// - every rank merges (MELD_TP_EVERY 1, the default; the section "Every rank merges" says how): every
//   rank reads every partial and sums its own output, warps 1-3 of the producer warpgroup publishing and
//   summing while the consumer warpgroups compute the next piece;
// - the owner merges (MELD_TP_EVERY 0): output tile o is reduced at its owner rank o % world; every piece
//   stores its partial into the owner's window (NVLink peer memory) and counts it on the owner's tile
//   counter after a system-scope fence; the piece whose count completes the tile sums the partials and
//   writes the bf16 tile into every rank's output.
// The start handshake and the landing count are xrank.cuh's.
//
// Deadlock freedom (owner merges): no CTA waits for another CTA's tile. A CTA waits only on its own TMA
// ring, once for every rank to have started the launch (every launch starts all its CTAs without waiting
// for anything), and, the launch's last CTA, for tiles that CTAs which never wait have finished or will
// finish. Every-rank merges: in their section.

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
// Every-rank merges move a partial tile in chunks of CHUNK_TOKENS rows: staged, sent and stamped chunk by
// chunk, and merged once that chunk of every part is stamped; merge teams claim UNIT_TOKENS rows at a time.
constexpr int CHUNK_TOKENS = BLOCK_TOKENS < 64 ? BLOCK_TOKENS : 64;
constexpr int CHUNKS = BLOCK_TOKENS / CHUNK_TOKENS;
constexpr int CHUNK_ELEMS = CHUNK_TOKENS * 64 * TP_WGS;
constexpr int UNIT_TOKENS = CHUNK_TOKENS < 16 ? CHUNK_TOKENS : 16;
constexpr int CHUNK_UNITS = CHUNK_TOKENS / UNIT_TOKENS;
constexpr int UNITS = BLOCK_TOKENS / UNIT_TOKENS;
constexpr int STAGE_CHUNKS = CHUNKS < 2 ? CHUNKS : 2;   // staged chunks in shared memory (double-buffered)
constexpr int CONSUMERS = 128 * TP_WGS;
constexpr bool TP_EVERY = MELD_TP_EVERY != 0;          // every rank merges (else the owner: see below)
constexpr bool TP_PROXY = MELD_TP_PROXY != 0;          // the proxy transport (every rank merges)

__device__ __forceinline__ WaitSite tp_site(const TpParams& p, int site, int warp, int tile, int detail) {
  return WaitSite{p.watchdog, p.watchdog_claim, p.watchdog_kernel, site, (int)blockIdx.x, warp, tile, detail};
}

__device__ __forceinline__ XWindows tp_windows(const TpParams& p) {
  return XWindows{p.xpeers, p.x_rank, p.x_world, p.x_started_off, p.x_landed_off};
}

// Profiling (MELD_PROFILE builds): the CTA's recording threads (a consumer, the sender, the merge teams'
// leaders) share its record count, the eighth int of the kernel's `team` ints (TEAM_RECORDS).
constexpr int TEAM_RECORDS = 7;
__device__ __forceinline__ Profiler tp_profiler(const TpParams& p, int* team, bool recorder) {
  Profiler prof;
  if (recorder) prof.join(p.prof, p.prof_cap, blockIdx.x, team + TEAM_RECORDS);
  return prof;
}

// Piece t: its row of the call's plan (p.tasks: TP_PIECE rows of the one task layout, TpSchedule.tasks),
// loaded once a piece: output tile o (column block, token block) and its K stages [k0, k1).
struct Piece {
  int o, split, col, tok0, k0, k1;
};
__device__ __forceinline__ Piece tp_task(const TpParams& p, int t) {
  const TpPiece r = load_tppiece(p.tasks, p.tiles, t);
  return Piece{r.tile, r.split, r.col, r.tok0, r.k0, r.k1};
}

// The last token block, when M is not a multiple of BLOCK_TOKENS, is loaded with boxes of its M % BLOCK_TOKENS
// rows (p.x_tail_map) rather than full boxes that run past the input: TMA boxes with out-of-bounds rows are
// slow (bench/RESULTS.md, "the last token block in bounds"). The stage's rows past the block keep stale
// bytes: they feed only accumulators of tokens >= M, which no merge reads and no store writes.
__device__ void tp_produce(const TpParams& p, Ring ring) {
  for (int t = blockIdx.x; t < p.tiles; t += gridDim.x) {
    const Piece x = tp_task(p, t);
    const int col = x.col, tok0 = x.tok0, rows = min(BLOCK_TOKENS, p.m - tok0);
    const void* xmap = rows < BLOCK_TOKENS ? &p.x_tail_map : &p.x_map;
    for (int kk = x.k0; kk < x.k1; ++kk) {
      const u32 full = ring.full + 8 * ring.stage, dst = ring.base + ring.stage * STAGE_BYTES;
      mbar_wait(ring.empty + 8 * ring.stage, ring.phase ^ 1u, tp_site(p, 5, 0, t, ring.stage));
      // (weight columns past K or rows past N arrive as zeros, counted)
      mbar_arrive_expect_tx(full, STAGE_BYTES - K_BOXES * (BLOCK_TOKENS - rows) * BK * 2);
#pragma unroll
      for (int b = 0; b < K_BOXES; ++b) {
#pragma unroll
        for (int g = 0; g < TP_WGS; ++g)   // 64 weight rows a box (the map's), one per consumer warpgroup
          tma_load_2d(dst + b * BOX_PAIR + g * 64 * BK * 2, &p.w_map, (kk * K_BOXES + b) * BK, col * COLS + 64 * g, full);
        tma_load_2d(dst + b * BOX_PAIR + W_BOX, xmap, (kk * K_BOXES + b) * BK, tok0, full);
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
// Shared memory for staging: every-rank merges stage partials there chunk by chunk, as they travel, in
// STAGE_CHUNKS buffers (at 256-token blocks half a tile: 32 KB that the ring gets as a fourth stage, which
// streams the weights faster: bench/RESULTS.md, "Figures moved from code comments"); owner merges the
// tile's bf16 sum.
constexpr int STAGED_BYTES = TP_EVERY ? STAGE_CHUNKS * CHUNK_ELEMS * (int)sizeof(Part) : TILE_ELEMS * 2;

// Owner merges' partial tile in memory: consumer thread ct's accumulators i .. i + 3 at element i CONSUMERS + 4 ct, so
// that each store (and load) instruction of a warp covers 32 contiguous runs of 4 elements: whole lines
// across NVLink rather than a few bytes of each of 32 lines. `dst` is the tile's base + 4 ct.
__device__ __forceinline__ void tp_store_partial(Part* dst, const float (&acc)[ACC]) {
#pragma unroll
  for (int i = 0; i < ACC; i += 4) part_store4(dst + i * CONSUMERS, acc + i);
}

// Tokens 2 r0 .. 2 (r0 + R) - 1 of a tile's accumulators (registers r0 .. r0 + R - 1; r0 a multiple of 4,
// known once the callers' loops unroll) staged token-major in shared memory [2 R][COLS], as bf16 (or float
// partials). Accumulator layout (wgmma m64nN, f32): register r of thread (warp w, lane l) holds weight row
// (output column) 64 (w / 4) + 16 (w % 4) + l / 4 + 8 ((r / 2) % 2) and token 8 (r / 4) + 2 (l % 4) + r % 2.
template <int R = ACC, class T>
__device__ __forceinline__ void tp_stage(const float (&acc)[ACC], T* staged, int warp, int lane, int r0 = 0) {
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int r = r0 + i;
    const int c = 64 * (warp / 4) + 16 * (warp % 4) + lane / 4 + 8 * ((r / 2) % 2);
    const int tok = 8 * (i / 4) + 2 * (lane % 4) + r % 2;
    if constexpr (sizeof(T) == 2)
      staged[tok * COLS + c] = float_to_bf16(acc[r]);
    else
      staged[tok * COLS + c] = acc[r];
  }
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
  tp_stage(acc, staged, warp, lane);
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
__device__ void tp_consume(const TpParams& p, Ring ring, u16* staged, int* team) {
  int* last = team + 3;
  const int ct = threadIdx.x - 128, warp = ct / 32, lane = ct % 32;
  const XWindows w = tp_windows(p);
  const unsigned long long launch = *reinterpret_cast<volatile unsigned long long*>(p.xlaunch) + 1;
  if (blockIdx.x == 0 && ct == 0) xrank_announce_peers(w, launch);
  const int nparts = p.x_world * p.k_splits;
  int finished = 0;          // tiles whose output this CTA wrote (into every rank's window)
  bool started = false;      // every rank has started this launch
  Profiler prof = tp_profiler(p, team, ct == 0);
  for (int t = blockIdx.x; t < p.tiles; t += gridDim.x) {
    const Piece x = tp_task(p, t);
    const int mine = p.x_rank * p.k_splits + x.split;
    float acc[ACC];
    const i64 t0 = prof.now();
    tp_gemm(p, ring, x, t, acc, warp, lane);
    prof.record(t0, PROF_TP_GEMM, t);
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
    if (ct == 0) *last = event_arrive_sys(count, 1ull, (unsigned long long)nparts);
    named_barrier(1, CONSUMERS);
    if (!*last) continue;
    const i64 t1 = prof.now();
    tp_sum([&](int k) { return parts + (i64)k * TILE_ELEMS; }, nparts, mine, acc, staged, warp, lane);
    named_barrier(1, CONSUMERS);
    tp_store_tile(p, staged, x, ct, 0, p.x_world);
    prof.record(t1, PROF_TP_MERGE, t);
    if (ct == 0) event_reset(count);   // every part has arrived: ready for the next launch
    ++finished;
    named_barrier(1, CONSUMERS);   // (staged is rewritten by the next tile)
  }
  // One system-scope fence per thread covers the CTA's output writes and counter resets, then its tally
  // lands on every rank; the launch's last CTA waits for every tile of its own rank's output.
  __threadfence_system();
  named_barrier(1, CONSUMERS);
  if (ct != 0) return;
  prof.end(gridDim.x);
  xrank_land(w, (unsigned long long)finished);
  if (!event_arrive(p.xexit, 1u, gridDim.x)) return;
  event_reset(p.xexit);
  xrank_take_landed(w, (unsigned long long)(p.tiles / p.k_splits), tp_site(p, 11, warp + 4, -1, 0), XRANK_WAIT_NS);
  *p.xlaunch = launch;   // launches finished (every CTA read the count at its start)
}

// Every rank merges (MELD_TP_EVERY 1; the proxy transport needs it): every rank reads every partial and
// sums its own output. Three roles share a CTA's pieces, so that a piece's exchange and sum overlap the
// GEMM of the next, and the chunks of one piece overlap each other:
// - the consumer warpgroups compute each piece and stage its partial, rounded as it travels, token-major in
//   shared memory, a chunk of CHUNK_TOKENS rows at a time into one of STAGE_CHUNKS buffers (waiting for the
//   sender to have read the chunk there before);
// - the sender (warp 1) copies each chunk with a TMA bulk store into this rank's window and stamps it on
//   every rank (tp_send). Over peer memory the other ranks read it there (storing it into their windows
//   instead slowed the GEMM of the next pieces and the call overall: bench/RESULTS.md);
//   the proxy puts it into theirs. A rank rewrites its window's partials only once every rank has started
//   the launch, so every read of the launch before has finished;
// - merge teams (warps 2 and 3 from the start; the consumer warpgroups between pieces when a chunk is
//   ready, and after their last piece) claim the rows of the CTA's tiles (those whose first piece it
//   computed) in order, UNIT_TOKENS rows at a time (warps 2 and 3 one unit a claim, the consumers a chunk's
//   worth: a claim's work in step with the team's threads), wait until that chunk of every piece of the tile
//   is stamped in this rank's window, sum the pieces where they lie in (rank, split) order and write this
//   rank's output. Every rank computes the same sums in the same order: the outputs are bit-identical, and
//   nothing but partials and stamps crosses ranks.
//
// Deadlock freedom: the consumers wait only for their ring and for the sender's reads; the sender only for
// the consumers and, once, for every rank to start the launch; merge teams wait for senders, and no sender
// waits for a merge. The grid fits the GPU at once (RowParallelLinear sizes it by occupancy), so every
// sender of every rank runs.

constexpr int STAMP_SHIFT = 24;   // a stamp: launch << STAMP_SHIFT | chunks sent (fewer than 2^24 a CTA)

__device__ __forceinline__ unsigned long long tp_stamp(unsigned long long launch, int sent) {
  return launch << STAMP_SHIFT | (unsigned long long)sent;
}

// Where every-rank merges keep things in a window: piece t's partial from rank r (elements: its CTA's
// block of I slots, at the piece's ordinal there; over peer memory a window holds only its own rank's, the
// proxy's every rank's) and CTA c's stamp from rank r (bytes).
struct EveryLayout {
  int G, I;
  i64 region, part0, stamp0, cap;
  __device__ explicit EveryLayout(const TpParams& p)
      : G(gridDim.x), I((p.tiles + gridDim.x - 1) / gridDim.x), region(TP_PROXY ? (i64)G * I * TILE_ELEMS : 0),
        part0(p.x_part_off / (i64)sizeof(Part)), stamp0(p.x_signal_off), cap(p.x_grid_cap) {}
  __device__ i64 part(int r, int t) const { return part0 + r * region + ((i64)(t % G) * I + t / G) * TILE_ELEMS; }
  __device__ i64 stamp(int r, int cta) const { return stamp0 + 8 * ((i64)r * cap + cta); }
};

__device__ __forceinline__ unsigned long long tp_launch(const TpParams& p) {   // this launch's number
  return *reinterpret_cast<volatile unsigned long long*>(p.xlaunch) + 1;
}

// The staging buffers' mbarriers: buffer b's chunk is staged (full, the consumers arrive) and has been read
// (empty, the sender arrives).
__device__ __forceinline__ u32 staged_full(u32 bars, int b) { return bars + 16 * b; }
__device__ __forceinline__ u32 staged_empty(u32 bars, int b) { return bars + 16 * b + 8; }

// The sender (one thread of warp 1): `staged` is the shared-memory staging buffers, `bars` their
// mbarriers. A TMA bulk store copies each chunk into this rank's window: there the other ranks' merges read
// it over NVLink (peer memory), or the proxy puts it into theirs at the CTA's end, all its pieces in one put
// per destination (they lie contiguous). Once the copy has completed, the CTA's stamp slot [rank][cta] on
// every rank gets (launch, chunks sent) after a system-scope fence (the proxy: a signal behind its put,
// adding what the slot's running total before this launch lacks).
__device__ __forceinline__ void tp_send(const TpParams& p, u32 staged, u32 bars, int* team) {
  constexpr u32 CHUNK_BYTES = CHUNK_ELEMS * sizeof(Part);
  const XWindows w = tp_windows(p);
  const XRing q{p.xring, p.xring_tail, p.xring_head, p.xring_cap};
  const EveryLayout L(p);
  const unsigned long long launch = tp_launch(p);
  if (blockIdx.x == 0) {
    if (TP_PROXY)
      xrank_announce_proxy(w, q, launch, tp_site(p, 12, 1, -1, 0));
    else
      xrank_announce_peers(w, launch);
  }
  const i64 slot = L.stamp(p.x_rank, blockIdx.x);
  const unsigned long long before = *w.word(p.x_rank, slot);   // the proxy's running total (only this CTA adds)
  Profiler prof = tp_profiler(p, team, true);
  int sent = 0;   // chunks
  for (int t = blockIdx.x; t < p.tiles; t += L.G) {
    i64 t0 = 0;
    for (int j = 0; j < CHUNKS; ++j, ++sent) {
      const int b = sent % STAGE_CHUNKS;
      mbar_wait(staged_full(bars, b), (sent / STAGE_CHUNKS) & 1, tp_site(p, 14, 1, t, sent), 2 * MELD_WATCHDOG_NS);
      if (j == 0) t0 = prof.now();
      if (sent == 0)   // before this CTA's first write of this launch into its window (module docstring)
        xrank_wait_started(w, launch, tp_site(p, 13, 1, t, 0), XRANK_WAIT_NS);
      bulk_store(p.xpeers[p.x_rank] + sizeof(Part) * (L.part(p.x_rank, t) + (i64)j * CHUNK_ELEMS),
                 staged + b * CHUNK_BYTES, CHUNK_BYTES);
      bulk_commit();
      bulk_wait_read();
      mbar_arrive(staged_empty(bars, b));   // the buffer may be restaged
      bulk_wait();
      fence_proxy_async_global();
      fence_acq_rel_sys();   // one fence, then the stamps (each a release by it)
      for (int r = TP_PROXY ? p.x_rank : 0; r < (TP_PROXY ? p.x_rank + 1 : p.x_world); ++r)
        store_relaxed_sys(w.word(r, slot), tp_stamp(launch, sent + 1));
    }
    prof.record(t0, PROF_TP_SEND, t);
  }
  if (TP_PROXY) {
    const WaitSite s = tp_site(p, 12, 1, -1, 0);
    const int pieces = sent / CHUNKS;
    for (int r = 0; r < p.x_world; ++r) {
      if (r == p.x_rank) continue;
      if (pieces)
        q.push(PROXY_PUT, r, sizeof(Part) * L.part(p.x_rank, blockIdx.x), pieces * TILE_ELEMS * sizeof(Part), 0, s);
      q.push(PROXY_SIGNAL, r, slot, 0, (long long)(tp_stamp(launch, sent) - before), s);
    }
    event_publish_sys(w.word(p.x_rank, slot), tp_stamp(launch, sent));
  }
}

// 16 bytes of a partial, in this rank's window or another's (written by other GPUs during this launch:
// volatile, never from a cache line of an earlier launch).
__device__ __forceinline__ uint4 part_ld16(const Part* a) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(a));
  return v;
}

// 16 bytes of partials (bf16 or float) added into s (or assigned to it: `first`).
__device__ __forceinline__ void part_acc16(float (&s)[16 / sizeof(Part)], const uint4 v, bool first) {
  constexpr int VEC = 16 / sizeof(Part);
  const u32 u[4] = {v.x, v.y, v.z, v.w};
  float f[VEC];
  if constexpr (VEC == 8) {
#pragma unroll
    for (int j = 0; j < 4; ++j) { f[2 * j] = __uint_as_float(u[j] << 16); f[2 * j + 1] = __uint_as_float(u[j] & 0xffff0000u); }
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) f[j] = __uint_as_float(u[j]);
  }
#pragma unroll
  for (int j = 0; j < VEC; ++j) s[j] = first ? f[j] : s[j] + f[j];
}

// Rows row0 .. row0 + rows - 1 of tile x: its partials (token-major tiles where they lie, `part(k)` for k in
// (rank, split) order) summed in that order and written into this rank's output as bf16, 16 bytes of each
// partial a thread and step (thread i of nt), U steps' first P partials loaded at once (the rest one after
// another: with P = 2, a tile of 4 partials cost two serial round trips over NVLink a step); streaming
// stores (the output is not read here), so that they leave L2 to the GEMM's boxes.
template <int U, int P, class PartAt>
__device__ __forceinline__ void tp_merge(const TpParams& p, const Piece& x, int row0, int rows, PartAt&& part, int nparts,
                                         int i, int nt) {
  constexpr int VEC = 16 / sizeof(Part), ROW = COLS / VEC;   // elements a step; steps a token
  const int total = min(rows, p.m - x.tok0 - row0) * ROW, cols = min(COLS, p.n - x.col * COLS);
  u16* out = reinterpret_cast<u16*>(p.xpeers[p.x_rank] + p.x_out_off) + (i64)(x.tok0 + row0) * p.n + x.col * COLS;
  const i64 at0 = (i64)row0 * COLS;   // the rows' first element in a partial
  for (int e0 = i; e0 < total; e0 += U * nt) {
    uint4 v[U][P];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int e = e0 + u * nt;   // (a tile's columns past n are in the window too: zeros)
      if (e >= total) continue;
#pragma unroll
      for (int j = 0; j < P; ++j)
        if (j < nparts) v[u][j] = part_ld16(part(j) + at0 + e * VEC);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int e = e0 + u * nt, c = VEC * (e % ROW);
      if (e >= total || c >= cols) continue;
      float s[VEC];
      part_acc16(s, v[u][0], true);
#pragma unroll
      for (int j = 1; j < P; ++j)
        if (j < nparts) part_acc16(s, v[u][j], false);
      for (int k = P; k < nparts; ++k) part_acc16(s, part_ld16(part(k) + at0 + e * VEC), false);
      u32 o[VEC / 2];
#pragma unroll
      for (int j = 0; j < VEC / 2; ++j) o[j] = float_to_bf16(s[2 * j]) | (u32)float_to_bf16(s[2 * j + 1]) << 16;
      u16* d = out + (i64)(e / ROW) * p.n + c;
      if constexpr (VEC == 8)
        __stcs(reinterpret_cast<uint4*>(d), make_uint4(o[0], o[1], o[2], o[3]));
      else
        __stcs(reinterpret_cast<uint2*>(d), make_uint2(o[0], o[1]));
    }
  }
}

// A claim: `units` units of UNIT_TOKENS rows of one chunk of a tile from unit `code` (first piece of the
// tile x UNITS + unit), or none (code = none()).
struct Claim {
  int code, units;
};

// Merges: a team's leader claims units of UNIT_TOKENS rows of the tiles of the CTA's pieces, in order on
// `claim`, counted as `piece ordinal x UNITS + unit` (up to p.tiles x UNITS: none left), at most `want` of
// them and never past their chunk. Chunk q of a tile is merged by the CTA that computed its split
// q % k_splits (a tile split over K is merged by all of its pieces' CTAs, not by the first alone); teams
// share a CTA's chunks, so the last tile's merge is spread over every team instead of left to the slowest
// (a 64-thread team merging a chunk alone takes several times as long as the consumers: bench/RESULTS.md,
// "Figures moved from code comments").
struct MergeClaims {
  const TpParams& p;
  XWindows w;
  EveryLayout L;
  unsigned long long launch;
  int* claim;
  __device__ MergeClaims(const TpParams& p_, int* claim_) : p(p_), w(tp_windows(p_)), L(p_), launch(tp_launch(p_)), claim(claim_) {}
  __device__ int none() const { return p.tiles * UNITS; }
  // Claim value c: piece blockIdx.x + G (c / UNITS), unit c % UNITS of its tile, in chunk (c % UNITS) / CHUNK_UNITS.
  __device__ int piece_of(int c) const { return blockIdx.x + L.G * (c / UNITS); }
  __device__ static int chunk_of(int c) { return (c % UNITS) / CHUNK_UNITS; }
  __device__ bool mine(int t, int c) const { return chunk_of(c) % p.k_splits == t % p.k_splits; }
  __device__ int code(int t, int c) const { return (t - t % p.k_splits) * UNITS + c % UNITS; }
  // Piece k of tile t's parts in (rank, split) order: piece src = t + k % k_splits from rank k / k_splits;
  // its chunk q has landed once the source CTA's stamp counts it.
  __device__ const unsigned long long* stamp(int t, int k) const {
    return w.word(p.x_rank, L.stamp(k / p.k_splits, (t + k % p.k_splits) % L.G));
  }
  __device__ unsigned long long landed(int t, int k, int q) const {
    return tp_stamp(launch, (t + k % p.k_splits) / L.G * CHUNKS + q + 1);
  }
  __device__ bool all_landed(int t0, int q) const {
    for (int k = 0; k < p.x_world * p.k_splits; ++k)
      if (!event_reached_sys(stamp(t0, k), landed(t0, k, q))) return false;
    return true;
  }
  // Up to `want` units from claim value c on, within c's chunk: the claim if `ready` allows it (and the CAS
  // on `claim` succeeds), else none() with c moved to what to try next.
  template <class Ready>
  __device__ Claim take(int& c, int want, Ready&& ready) const {
    for (;;) {
      const int t = piece_of(c);
      if (t >= p.tiles) return Claim{none(), 0};
      const int left = CHUNK_UNITS - c % CHUNK_UNITS, n = mine(t, c) ? min(want, left) : left;
      if (mine(t, c) && !ready(t - t % p.k_splits, chunk_of(c))) return Claim{none(), 0};
      const int seen = atomicCAS(claim, c, c + n);
      if (seen != c) { c = seen; continue; }
      if (mine(t, c)) return Claim{code(t, c), n};
      c += n;
    }
  }
  // The next units (at most `want`) once their chunk of every part of their tile has landed (waiting for
  // it), or none().
  __device__ Claim next(int want, int warp) const {
    int c = *reinterpret_cast<volatile int*>(claim);
    const Claim k = take(c, want, [](int, int) { return true; });
    if (k.code < none()) {
      const int t0 = k.code / UNITS, q = (k.code % UNITS) / CHUNK_UNITS;
      for (int j = 0; j < p.x_world * p.k_splits; ++j)
        event_wait_sys(stamp(t0, j), landed(t0, j, q), tp_site(p, 10, warp, t0, j / p.k_splits), 2 * XRANK_WAIT_NS);
    }
    return k;
  }
  // The next units (at most `want`) if their chunk of every part has landed already (claimed), else none()
  // (nothing claimed).
  __device__ Claim next_ready(int want) const {
    int c = *reinterpret_cast<volatile int*>(claim);
    return take(c, want, [&](int t0, int q) { return all_landed(t0, q); });
  }
  // U steps of the first two parts in flight, or U4 steps of the first four (tiles of more than two parts).
  template <int U, int U4>
  __device__ void merge(const Claim& k, int i, int nt) const {
    const int t = k.code / UNITS, row0 = (k.code % UNITS) * UNIT_TOKENS, rows = k.units * UNIT_TOKENS;
    const int nparts = p.x_world * p.k_splits;
    const auto part = [&](int j) {
      return reinterpret_cast<const Part*>(p.xpeers[TP_PROXY ? p.x_rank : j / p.k_splits]) +   // where it lies
             L.part(j / p.k_splits, t + j % p.k_splits); };
    if (nparts <= 2)
      tp_merge<U, 2>(p, tp_task(p, t), row0, rows, part, nparts, i, nt);
    else
      tp_merge<U4, 4>(p, tp_task(p, t), row0, rows, part, nparts, i, nt);
  }
};

// Steps of four parts in flight (MergeClaims::merge) within the registers: with two consumer warpgroups
// ptxas fits every path in 168 a thread (two steps spilled), at two CTAs an SM in 128.
constexpr int MERGER_U4 = TP_WGS == 2 || CTAS_PER_SM == 2 ? 1 : 2;
constexpr int CONSUMER_U4 = CTAS_PER_SM == 2 || TP_WGS == 2 ? 1 : 2;

// A merge team (threads i of nt, named barrier `bar`): merges claims of up to `want` units, its leader
// waiting for each one's parts and handing it on through `slot` (two ints), until none is left. Profile
// records name a merge by its first unit's code x 8 + its units.
template <int U, int U4>
__device__ __forceinline__ void tp_merge_team(const TpParams& p, int i, int nt, int bar, int want, int* team,
                                              volatile int* slot, int warp) {
  const MergeClaims mc(p, team);
  Profiler prof = tp_profiler(p, team, i == 0);
  for (;;) {
    const i64 t0 = prof.now();
    if (i == 0) {
      const Claim k = mc.next(want, warp);
      slot[0] = k.code;
      slot[1] = k.units;
    }
    named_barrier(bar, nt);
    const Claim k{slot[0], slot[1]};
    named_barrier(bar, nt);   // (the slot is rewritten by the next claim)
    if (k.code >= mc.none()) return;
    prof.record(t0, PROF_TP_WAIT, k.code * 8 + k.units);
    const i64 t1 = prof.now();
    mc.merge<U, U4>(k, i, nt);
    prof.record(t1, PROF_TP_MERGE, k.code * 8 + k.units);
  }
}

// Direct merges (p.direct: RowParallelLinear sets it at decode sizes — every CTA one piece, token blocks of
// at most LL_MAX_TOKENS (MELD_TP_DIRECT: compiled for those only), over peer memory). The general path
// spends a large share of a small call after the GEMM (bulk copy, fences, stamp, claim, merge:
// bench/RESULTS.md, "Where the time goes" under "the last token block in bounds"), and its machinery has
// nothing to overlap when a CTA has one piece. Here the partial travels as low-latency words (common.cuh:
// ll_put): 4 bytes of it and the launch's tag in each 8-byte store, into slot
// [launch parity][this rank][CTA] of every other rank's window (and of this rank's when K is split, for the
// tile's other CTAs): no fence, no stamp, no wait for the other ranks to start. The k_splits CTAs of a tile each sum a share of its words (word i: split
// i % k_splits) in (rank, split) order once every part's word carries the tag — the sums of the general
// path, so the outputs are bit-identical across ranks and to it.
// Why two slots (launch parity) suffice: a rank writes launch n + 1's words only after its launch n ended,
// which needed every other rank's words of launch n, written after that rank had ended launch n - 1, the
// last to read the slots that launch n + 1 rewrites. (A tag repeats after 2^32 launches.)
// Deadlock freedom: a CTA waits only for the CTAs of its tile on every rank, which store before waiting and
// are all resident (the grid fits the GPU at once).
// (Called by tp_consume_every after the GEMM of piece t = blockIdx.x: one wgmma call site, or ptxas
// serialises the wgmma pipeline.)
constexpr int LL_WORDS = TILE_ELEMS * (int)sizeof(Part) / 4;    // words of a partial tile
constexpr int LL_PER_THREAD = (LL_WORDS + CONSUMERS - 1) / CONSUMERS;
// Words waited for at once: four, the groups one after another in a loop kept rolled. Sixteen, unrolled, held
// over 200 registers at 64-token blocks and made the CTA's exchange and sum slower (bench/RESULTS.md, "the
// direct path waits for its words four at a time").
constexpr int LL_GROUP = LL_PER_THREAD < 4 ? LL_PER_THREAD : 4;
static_assert(LL_PER_THREAD % LL_GROUP == 0, "whole groups of words");

__device__ __forceinline__ unsigned long long* tp_ll_slot(const TpParams& p, char* window, u32 tag, int r, int cta) {
  return reinterpret_cast<unsigned long long*>(window + p.x_ll_off) +
         ((i64)((tag & 1) * p.x_world + r) * p.x_ll_cap + cta) * LL_WORDS;
}

__device__ __forceinline__ void tp_direct(const TpParams& p, const Piece& x, int t, const float (&acc)[ACC], Part* staged,
                                          int ct, int warp, int lane) {
  constexpr int ROW_WORDS = COLS * (int)sizeof(Part) / 4, VEC = 4 / (int)sizeof(Part);
  const u32 tag = (u32)tp_launch(p);   // launches count from 1: a zeroed window holds no tag
  const int ks = p.k_splits, words = min(BLOCK_TOKENS, p.m - x.tok0) * ROW_WORDS;
  const u32* mine = reinterpret_cast<const u32*>(staged);
  tp_stage(acc, staged, warp, lane);
  named_barrier(1, CONSUMERS);
  for (int r = 0; r < p.x_world; ++r) {
    if (r == p.x_rank && ks == 1) continue;   // (read from shared memory below)
    unsigned long long* dst = tp_ll_slot(p, p.xpeers[r], tag, p.x_rank, t);
    for (int i = ct; i < words; i += CONSUMERS) ll_put(dst + i, tag, mine[i]);
  }
  u16* out = reinterpret_cast<u16*>(p.xpeers[p.x_rank] + p.x_out_off) + (i64)x.tok0 * p.n + x.col * COLS;
#pragma unroll 1
  for (int g = 0; g < LL_PER_THREAD; g += LL_GROUP) {   // a group of this thread's words at a time (registers)
    float s[LL_GROUP][VEC];
    for (int k = 0; k < p.x_world * ks; ++k) {   // (rank, split) order
      const int r = k / ks, split = k % ks;
      const bool own = r == p.x_rank && split == x.split;
      const unsigned long long* src = tp_ll_slot(p, p.xpeers[p.x_rank], tag, r, t - x.split + split);
      u32 d[LL_GROUP];
      int off[LL_GROUP];
      unsigned pending = 0;
#pragma unroll
      for (int u = 0; u < LL_GROUP; ++u) {
        const int i = off[u] = x.split + ks * (ct + (g + u) * CONSUMERS);
        if (i < words && own) d[u] = mine[i];
        else if (i < words) pending |= 1u << u;
      }
      ll_wait(src, off, pending, tag, d, tp_site(p, 16, warp + 4, t, r), 2 * XRANK_WAIT_NS);
#pragma unroll
      for (int u = 0; u < LL_GROUP; ++u) {
        if (off[u] >= words) continue;
        float f[VEC];
        if constexpr (VEC == 2) { f[0] = __uint_as_float(d[u] << 16); f[1] = __uint_as_float(d[u] & 0xffff0000u); }
        else f[0] = __uint_as_float(d[u]);
#pragma unroll
        for (int j = 0; j < VEC; ++j) s[u][j] = k == 0 ? f[j] : s[u][j] + f[j];
      }
    }
#pragma unroll
    for (int u = 0; u < LL_GROUP; ++u) {
      const int i = x.split + ks * (ct + (g + u) * CONSUMERS), c = VEC * (i % ROW_WORDS);
      if (i >= words || x.col * COLS + c >= p.n) continue;
      u16* d = out + (i64)(i / ROW_WORDS) * p.n + c;
      if constexpr (VEC == 2)
        *reinterpret_cast<u32*>(d) = float_to_bf16(s[u][0]) | (u32)float_to_bf16(s[u][1]) << 16;
      else
        *d = float_to_bf16(s[u][0]);
    }
  }
}

// The consumer warpgroups: every piece's GEMM, its partial staged chunk by chunk for the sender, and after
// each, the next units to merge if their chunk of every part has landed already (the merge warps fall behind
// when tiles are quick to compute); then a merge team.
__device__ __forceinline__ void tp_consume_every(const TpParams& p, Ring ring, Part* staged, u32 bars, int* team) {
  const int ct = threadIdx.x - 128, warp = ct / 32, lane = ct % 32;
  const MergeClaims mc(p, team);
  Profiler prof = tp_profiler(p, team, ct == 0);
  int sent = 0;   // chunks staged
  for (int t = blockIdx.x; t < p.tiles; t += gridDim.x) {
    const Piece x = tp_task(p, t);
    float acc[ACC];
    const i64 t0 = prof.now();
    tp_gemm(p, ring, x, t, acc, warp, lane);
    prof.record(t0, PROF_TP_GEMM, t);
    const i64 t1 = prof.now();
    if constexpr (!TP_PROXY && MELD_TP_DIRECT) {   // (token blocks the direct path may take)
      if (p.direct) {   // (its only piece)
        tp_direct(p, x, t, acc, staged, ct, warp, lane);
        prof.record(t1, PROF_TP_DIRECT, t);
        return;
      }
    }
#pragma unroll
    for (int j = 0; j < CHUNKS; ++j, ++sent) {   // (unrolled: the registers of chunk j are known)
      const int b = sent % STAGE_CHUNKS;
      if (sent >= STAGE_CHUNKS)
        mbar_wait(staged_empty(bars, b), (sent / STAGE_CHUNKS - 1) & 1, tp_site(p, 15, warp + 4, t, sent), 2 * XRANK_WAIT_NS);
      tp_stage<ACC / CHUNKS>(acc, staged + b * CHUNK_ELEMS, warp, lane, j * (ACC / CHUNKS));
      fence_proxy_async();   // (the sender's bulk copy reads it)
      named_barrier(1, CONSUMERS);
      if (ct == 0) mbar_arrive(staged_full(bars, b));
    }
    prof.record(t1, PROF_TP_STAGE, t);
    if (ct == 0) {
      const Claim k = mc.next_ready(CHUNK_UNITS);
      team[5] = k.code;
      team[6] = k.units;
    }
    named_barrier(1, CONSUMERS);
    const Claim ready{team[5], team[6]};   // (rewritten after the next piece's staging barriers)
    if (ready.code < mc.none()) {
      const i64 t2 = prof.now();
      mc.merge<4, CONSUMER_U4>(ready, ct, CONSUMERS);
      prof.record(t2, PROF_TP_MERGE, ready.code * 8 + ready.units);
    }
  }
  tp_merge_team<4, CONSUMER_U4>(p, ct, CONSUMERS, 1, CHUNK_UNITS, team, team + 1, warp + 4);
}

// The end of a CTA of every-rank merges (every thread but the producer warp's): the launch's last CTA
// records the launch as finished (every CTA read the count at its start).
__device__ __forceinline__ void tp_every_done(const TpParams& p, int* team) {
  named_barrier(3, 96 + CONSUMERS);
  if (threadIdx.x == 32) tp_profiler(p, team, true).end(gridDim.x);
  if (threadIdx.x != 32 || !event_arrive(p.xexit, 1u, gridDim.x)) return;
  event_reset(p.xexit);
  *p.xlaunch = tp_launch(p);
}

// The family's persistent main (persistent.cuh): the ring, the staging buffers and their barriers, the team
// words; a plain launch.
struct TpFamily {
  using Params = TpParams;
  static constexpr LaunchKind LAUNCH = LAUNCH_PLAIN;
  static_assert(LAUNCH == LAUNCH_PLAIN, "run()'s roles return early: only a plain launch has nothing after run()");
  static constexpr int SMEM_ALIGN = 16;
  struct State {
    u32 raw;
    Ring ring;
    unsigned char* staged;   // staging, then four mbarriers and eight ints
    u32 bars;
    int* team;               // [claim, consumers' claim (2), mergers' claim (2), consumers' ready claim (2; owner
                             //  merges: last), profile records (TEAM_RECORDS)]
    __device__ __forceinline__ State(const TpParams&, unsigned char* smem)
        : raw(smem_addr(smem)), ring(Ring::at<STAGE_BYTES>(raw)), staged(smem + (ring.end() - raw)),
          bars(ring.end() + STAGED_BYTES), team(reinterpret_cast<int*>(staged + STAGED_BYTES + 32)) {}
  };

  static __device__ __forceinline__ void setup(const TpParams& p, const State& s) {
    if (threadIdx.x == 0) {
      s.ring.init(CONSUMERS / 32);
      for (int b = 0; b < 2; ++b) {
        mbar_init(staged_full(s.bars, b), 1);    // buffer b's chunk is staged (the consumers)
        mbar_init(staged_empty(s.bars, b), 1);   // it has been read (the sender)
      }
      s.team[0] = s.team[TEAM_RECORDS] = 0;
      fence_mbar_init();
    }
    __syncthreads();
    if (threadIdx.x == 0) {   // (the CTA's profile header: its records are the other threads')
      Profiler head;
      head.begin(p.prof, p.prof_cap, blockIdx.x, true, nullptr, 1);
    }
  }

  static __device__ __forceinline__ void run(const TpParams& p, const State& s) {
    if (threadIdx.x < 128) {
      if (TP_WGS == 2) regs_dealloc<104>();   // (two consumer warpgroups: their accumulators take the registers)
      if (threadIdx.x == 0) tp_produce(p, s.ring);
      if (!TP_EVERY || threadIdx.x < 32) return;
      const bool direct = !TP_PROXY && p.direct;
      if (threadIdx.x == 32) {
        if (!direct)
          tp_send(p, s.ring.end(), s.bars, s.team);
        else if (blockIdx.x == 0)
          xrank_announce_peers(tp_windows(p), tp_launch(p));
      }
      __syncwarp();
      if (threadIdx.x >= 64 && !direct) tp_merge_team<4, MERGER_U4>(p, threadIdx.x - 64, 64, 2, 1, s.team, s.team + 3, threadIdx.x / 32);
      tp_every_done(p, s.team);
      return;
    }
    if (TP_WGS == 2) regs_alloc<200>();
    if (TP_EVERY) {
      tp_consume_every(p, s.ring, reinterpret_cast<Part*>(s.staged), s.bars, s.team);
      tp_every_done(p, s.team);
    } else {
      tp_consume(p, s.ring, reinterpret_cast<u16*>(s.staged), s.team);
    }
  }
};

}  // namespace meld

MELD_PERSISTENT_KERNEL(meld_tp_linear, meld::TpFamily, 128 + meld::CONSUMERS, CTAS_PER_SM)
