/* meld: the fused-MoE plan on the host, for the CPU reference executor. The ticket order and the tiles' rows
 * come from templates/moe_plan.h, which meld/runtime/host_helper.py puts in front of this file when it
 * compiles it (after one_thread.h and the MoeTile accessors): the GPU planner (templates/moe.cuh) compiles
 * the same text. Rows of an expert are in token order, as the GPU's deterministic ranks give them.
 *
 * ids [T * K]: expert of each (token, choice), -1 for an invalid pair. Writes expert_off [E + 1],
 * pair_pos [T * K] (-1: invalid), row_token [rows], rb_off [E + 1], row_blocks [nrb][3] (expert, first
 * row, rows) and the tiles' MOE_TILE rows in ticket order into `tiles` (field-major, `tile_capacity` rows);
 * row_blocks must hold E + T * K / block_tokens row blocks, tiles their (n1 + n2) tiles each. Returns the
 * number of row blocks. Split K: `ctas` (the main launch's grid; 0: no split) and the phases' ring stages
 * `stages1`, `stages2` give each phase's slices (moe_split), written to slices[0..1]; tiles must then hold
 * (n1 + n2) tiles a row block plus 2 * ctas. */
extern "C" long long meld_moe_plan(const long long *ids, int T, int K, int E, int block_tokens, int n1, int n2,
                                   int lag, long long *expert_off, long long *pair_pos, long long *row_token,
                                   int *rb_off, long long *row_blocks, int *tiles, int tile_capacity, int ctas,
                                   int stages1, int stages2, int *slices) {
  for (int e = 0; e <= E; ++e) expert_off[e] = 0;
  for (long long i = 0; i < (long long)T * K; ++i)
    if (ids[i] >= 0) ++expert_off[ids[i] + 1];
  for (int e = 0; e < E; ++e) expert_off[e + 1] += expert_off[e];
  rb_off[0] = 0;
  for (int e = 0; e < E; ++e) {
    const long long rows = expert_off[e + 1] - expert_off[e];
    rb_off[e + 1] = rb_off[e] + (int)((rows + block_tokens - 1) / block_tokens);
    for (int r = 0; r < rb_off[e + 1] - rb_off[e]; ++r) {
      long long *b = row_blocks + 3 * (long long)(rb_off[e] + r);
      const long long left = rows - (long long)r * block_tokens;
      b[0] = e;
      b[1] = expert_off[e] + (long long)r * block_tokens;
      b[2] = left < block_tokens ? left : block_tokens;
    }
  }
  /* positions: an expert's rows in token order (expert_off[e] becomes the next free row, then restored) */
  for (long long t = 0; t < T; ++t)
    for (int j = 0; j < K; ++j) {
      const long long e = ids[t * K + j];
      pair_pos[t * K + j] = e < 0 ? -1 : expert_off[e]++;
      if (e >= 0) row_token[pair_pos[t * K + j]] = t;
    }
  for (int e = E; e > 0; --e) expert_off[e] = expert_off[e - 1];
  expert_off[0] = 0;
  slices[0] = ctas ? moe_split((long long)rb_off[E] * n1, stages1, ctas) : 1;
  slices[1] = ctas ? moe_split((long long)rb_off[E] * n2, stages2, ctas) : 1;
  moe_write_tiles(tiles, tile_capacity, rb_off, E, n1, n2, lag, 0, 1, ctas != 0, slices[0], slices[1]);
  return rb_off[E];
}
