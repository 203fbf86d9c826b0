/* meld: validate a host page table and stage it for the GPU planner, in one pass.
 *
 * plan()'s host budget is tens of microseconds; NumPy spends most of it in per-call dispatch (about
 * ten vector operations on B entries) and in two passes over the page indices (copy, then range check).
 * This does the same checks and copies in one pass each. Compiled at first use with the system C
 * compiler (meld/runtime/host_helper.py); without one, meld falls back to the NumPy path
 * (meld/ops/page_table.py), which reports problems by the same codes.
 *
 * Returns 0, or the first problem found: 1 indptr[0] != 0, 2 indptr decreases after entry *where,
 * 3 indptr[B] > num_indices, 4 last[*where] outside [1, page_size] for a non-empty request,
 * 5 indices[*where] < 0, 6 request *where holds more than 2^31 - 1 tokens. Differences of offsets are
 * taken in 64 bits, so offsets near 2^31 cannot wrap into a plausible page count.
 * On success *max_page holds the largest page index (-1 if none).
 */
/* Copy and range-check the page indices in one pass: one unsigned max (a negative index wraps above
 * 2^31). SSE2's missing unsigned max makes the x86-64 baseline loop four times slower than AVX2's
 * (measured: 16 us against 4 us for 55.7K indices), so x86-64 gets an AVX2 clone picked at load time. */
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target_clones("avx2", "default")))
#endif
static unsigned copy_max(const int *restrict src, int *restrict dst, long long n) {
  unsigned top = 0;
  for (long long i = 0; i < n; ++i) {
    const unsigned v = (unsigned)src[i];
    dst[i] = (int)v;
    top = v > top ? v : top;
  }
  return top;
}

int meld_stage_page_table(const int *restrict indptr, const int *restrict last, const int *restrict indices,
                          int batch, long long num_indices, int page_size, int *restrict raw,
                          int *restrict staged_indices, int *max_page, long long *where) {
  if (indptr[0] != 0) return 1;
  for (int b = 0; b < batch; ++b) {
    const long long pages = (long long)indptr[b + 1] - indptr[b];
    if (pages < 0) { *where = b; return 2; }
    if (pages > 0 && (unsigned)(last[b] - 1) >= (unsigned)page_size) { *where = b; return 4; }
    if ((pages - 1) * page_size + last[b] > 0x7fffffffll) { *where = b; return 6; }
    raw[b] = indptr[b];
    raw[batch + 1 + b] = last[b];
  }
  raw[batch] = indptr[batch];
  const long long nnz = indptr[batch];   /* >= 0: indptr starts at 0 and never decreases */
  if (nnz > num_indices) return 3;
  const unsigned top = copy_max(indices, staged_indices, nnz);
  if (top >= 0x80000000u) {
    for (long long i = 0; i < nnz; ++i)
      if (indices[i] < 0) { *where = i; return 5; }
  }
  *max_page = nnz > 0 ? (int)top : -1;
  return 0;
}
