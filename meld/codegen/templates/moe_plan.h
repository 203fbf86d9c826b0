/* meld fused MoE: the ticket order of the tiles and their task rows, written once. The GPU planner (moe.cuh:
 * plan) and the host planner (runtime/host/moe_plan.cpp, the CPU reference executor's) both compile this
 * text after the MoeTile accessors (meld/ir/work_table.py: MOE_TILE), so the two cannot order or describe
 * tiles differently; meld/scheduler/moe_plan.py is the NumPy test oracle of both.
 *
 * gemm1 tiles come expert by expert, column-major inside an expert (the CTAs running at once share
 * weight tiles in L2); an expert's gemm2 tiles come `lag` tickets after its last gemm1 tile. rb_off[e] is
 * the first row block of expert e (rb_off[E]: all of them); n1, n2: column blocks per row block.
 *
 * Split K (MoeKernelConfig.split_k): a phase whose tiles leave SMs of the main launch idle cuts each tile's K
 * into S slices (moe_split), each its own ticket; to the ticket order a slice is one more column block (column
 * c, slice s: c * S + s), so a tile's slices take adjacent tickets. */
#ifndef MELD_MOE_PLAN_H
#define MELD_MOE_PLAN_H
#ifdef __CUDACC__
#define MELD_HD __host__ __device__ __forceinline__
#else
#define MELD_HD static inline
#endif

/* The last index i in [lo, hi] with a[i] * scale <= v (a nondecreasing, a[lo] * scale <= v). */
MELD_HD int moe_last_at_most(const int *a, int lo, int hi, long long scale, long long v) {
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if ((long long)a[mid] * scale <= v) lo = mid; else hi = mid - 1;
  }
  return lo;
}

/* K slices of a phase's tiles: 1 when its `tiles` fill the main launch's `ctas`, else the fewest with which
 * tiles x S covers them (under two waves), each slice at least MOE_SPLIT_MIN_STAGES of the phase's `stages`
 * ring stages (a slice too short leaves the ring little to overlap; a guess, not measured). */
#define MOE_SPLIT_MIN_STAGES 4
MELD_HD int moe_split(long long tiles, int stages, int ctas) {
  if (tiles == 0 || tiles >= ctas) return 1;
  const int s = (int)((ctas + tiles - 1) / tiles), most = stages / MOE_SPLIT_MIN_STAGES;
  return s < most ? s : most > 1 ? most : 1;
}

/* The ring stages [*k0, *k1) of slice s of S of a tile's `stages`. */
MELD_HD void moe_slice_stages(int stages, int s, int S, int *k0, int *k1) {
  *k0 = (int)((long long)stages * s / S);
  *k1 = (int)((long long)stages * (s + 1) / S);
}

/* Ticket of the a-th gemm1 tile (g2 = 0) or gemm2 tile (g2 = 1) in (expert, column, row block) order;
 * its row block and column come back in *rb and *col. */
MELD_HD long long moe_ticket(int g2, long long a, const int *rb_off, int E, int n1, int n2, int lag,
                             int *rb, int *col) {
  const long long nA = (long long)rb_off[E] * n1;
  const int per = g2 ? n2 : n1;
  const int e = moe_last_at_most(rb_off, 0, E - 1, per, a);   /* never an empty expert: see moe.cuh */
  const int nrb = rb_off[e + 1] - rb_off[e];
  const int local = (int)(a - (long long)rb_off[e] * per);   /* < per * nrb: 32-bit division, the cheap one */
  *col = local / nrb;
  *rb = rb_off[e] + local % nrb;
  if (g2) {
    const long long due = (long long)rb_off[e + 1] * n1 + lag;
    return a + (due < nA ? due : nA);
  }
  /* gemm2 tiles before it: those of every expert e' with rb_off[e' + 1] * n1 + lag <= a */
  if (a < lag) return a;
  return a + (long long)rb_off[moe_last_at_most(rb_off, 0, E, n1, a - lag)] * n2;
}

/* The tiles' rows, each at its ticket in `tiles` (field-major, `capacity` rows): those of tile indices first,
 * first + step, ... (a block's threads share them out). `split`: a split-K build, which writes each row's slice
 * and its phase's slice count (s1 for gemm1, s2 for gemm2); otherwise both stay as the table was made (0). A gemm1 tile (all of them come first in the index)
 * arrives at its row block's event and a gemm2 tile waits for it (event_first = row_block); slots derived,
 * CTA taken at run time (-1 both). __device__ as the accessors it stores through (the host build defines it
 * away: runtime/host/one_thread.h). */
__device__ __forceinline__ void moe_write_tiles(int *tiles, int capacity, const int *rb_off, int E, int n1, int n2,
                                                int lag, int first, int step, int split, int s1, int s2) {
  const long long nA = (long long)rb_off[E] * n1 * s1, nB = (long long)rb_off[E] * n2 * s2;
  for (long long i = first; i < nA + nB; i += step) {
    const int g2 = i >= nA, S = g2 ? s2 : s1;
    int rb, cs;
    const int pos = (int)moe_ticket(g2, g2 ? i - nA : i, rb_off, E, n1 * s1, n2 * s2, lag, &rb, &cs);
    const int col = cs / S;
    /* The fields that vary; the constant ones (kind, cta, slot, event_count, arg3; slice and slices without split) are written once when
     * the table is made (meld.scheduler.moe_plan.moe_tile_table), so a launch stores 6 words a tile, not 13. */
    int *t = tiles + pos;   /* field-major: field f at f * capacity */
    t[MOETILE_ROW_BLOCK * capacity] = t[MOETILE_LAST_ROW_BLOCK * capacity] = t[MOETILE_EVENT_FIRST * capacity] = rb;
    t[MOETILE_COL * capacity] = col;
    t[MOETILE_COL_END * capacity] = col + 1;
    t[MOETILE_GEMM * capacity] = g2;
    if (split) {
      t[MOETILE_SLICE * capacity] = cs % S;
      t[MOETILE_SLICES * capacity] = S;
    }
  }
}
#endif
