/* meld: validate a host page table and stage it for the GPU planner, in one pass.
 *
 * plan()'s host budget is tens of microseconds; NumPy spends most of it in per-call dispatch (about
 * ten vector operations on B entries) and in two passes over the page indices (copy, then range check).
 * This does the same checks and copies in one pass each. Compiled at first use with the system C
 * compiler (meld/runtime/host_helper.py); without one, meld falls back to the NumPy path.
 *
 * Returns 0, or the first problem found: 1 indptr[0] != 0, 2 indptr decreases after entry *where,
 * 3 indptr[B] > num_indices, 4 last[*where] outside [1, page_size] for a non-empty request,
 * 5 indices[*where] < 0. On success *max_page holds the largest page index (-1 if none).
 */
int meld_stage_page_table(const int *indptr, const int *last, const int *indices, int batch, long long num_indices,
                          int page_size, int *raw, int *staged_indices, int *max_page, long long *where) {
  if (indptr[0] != 0) return 1;
  for (int b = 0; b < batch; ++b) {
    const int pages = indptr[b + 1] - indptr[b];
    if (pages < 0) { *where = b; return 2; }
    if (pages > 0 && (unsigned)(last[b] - 1) >= (unsigned)page_size) { *where = b; return 4; }
    raw[b] = indptr[b];
    raw[batch + 1 + b] = last[b];
  }
  raw[batch] = indptr[batch];
  const long long nnz = indptr[batch];
  if (nnz > num_indices) return 3;
  int top = -1, low = 0;
  for (long long i = 0; i < nnz; ++i) {   /* copy and range in one pass; vectorised by the compiler */
    const int v = indices[i];
    staged_indices[i] = v;
    top = v > top ? v : top;
    low = v < low ? v : low;
  }
  if (low < 0) {
    for (long long i = 0; i < nnz; ++i)
      if (indices[i] < 0) { *where = i; return 5; }
  }
  *max_page = top;
  return 0;
}
