// meld: the split-KV walk every decode kernel shares (decode_attention.cuh, mla_decode.cuh): a CTA's segment
// of the schedule (meld/ir/schedule.py), the piece of each unit the segment runs, and the merge of a split
// unit's partials by their log-sum-exps.
//
// Defined by the including source: CtaRow and load_ctarow (meld/ir/work_table.py: CTA_TABLE), common.cuh.

namespace meld {

struct Segment {
  int u_begin, s_begin, u_end, s_end, head_first, head_parts, tail_first, tail_parts;
  int u_last;   // last unit the segment touches
  bool empty;
};

__device__ __forceinline__ Segment load_segment(const int* cta_table, int num_ctas, int cta) {
  Segment g;
  const CtaRow r = load_ctarow(cta_table, num_ctas, cta);
  g.u_begin = r.u_begin; g.s_begin = r.s_begin; g.u_end = r.u_end; g.s_end = r.s_end;
  g.head_first = r.head_first; g.head_parts = r.head_parts; g.tail_first = r.tail_first; g.tail_parts = r.tail_parts;
  g.u_last = g.s_end > 0 ? g.u_end : g.u_end - 1;
  g.empty = g.u_begin == g.u_end && g.s_begin == g.s_end;
  return g;
}

// The piece of unit u (of kv_len tokens) that CTA `cta`'s segment runs: tokens [begin, end), and, when the
// segment starts (head) or ends (tail) inside the unit, the partial slot u + cta and the unit's parts.
struct Piece {
  int begin, end;
  int slot;          // -1: the unit is whole here and writes the output directly
  int parts_begin, num_parts;
  bool head;         // the piece starts the segment (else it ends it)
};

__device__ __forceinline__ Piece segment_piece(const Segment& g, int u, int cta, int kv_len) {
  Piece x;
  const bool first = u == g.u_begin, last = u == g.u_last;
  x.begin = first ? g.s_begin : 0;
  x.end = (last && g.s_end > 0) ? g.s_end : kv_len;
  x.head = first && g.s_begin > 0;
  const bool tail = !x.head && last && g.s_end > 0;
  x.slot = (x.head || tail) ? u + cta : -1;
  x.parts_begin = u + (x.head ? g.head_first : g.tail_first);
  x.num_parts = x.head ? g.head_parts : g.tail_parts;
  return x;
}

// U groups of four outputs (each of one row) merged from `parts` partials (each normalised, with its lse in
// log2): the sum of the parts weighted exp2(lse_k - max) / sum, in part order, so any merger gets the same
// bits. `load(k, u, lse, v)` reads part k of group u. The loads are latency-bound (L2 or a peer's shared
// memory): CHUNK parts of all U groups are in flight together (one round trip per chunk), with a running
// max across chunks. Sets out[u] and lse2[u] (log2).
template <int CHUNK, int U, class Load>
__device__ __forceinline__ void merge_lse4(int parts, Load&& load, float4 (&out)[U], float (&lse2)[U]) {
  float m[U], sum[U];
  float4 acc[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    m[u] = neg_inf(); sum[u] = 0.f; acc[u] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  for (int k0 = 0; k0 < parts; k0 += CHUNK) {
    float lse[U][CHUNK];
    float4 v[U][CHUNK];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int j = 0; j < CHUNK; ++j) load(min(k0 + j, parts - 1), u, lse[u][j], v[u][j]);   // past the last
#pragma unroll                                                                               // part: reload
    for (int u = 0; u < U; ++u) {                                                            // it, weighted 0
      float mc = m[u];
#pragma unroll
      for (int j = 0; j < CHUNK; ++j) mc = k0 + j < parts ? fmaxf(mc, lse[u][j]) : mc;
      const float m_use = mc == neg_inf() ? 0.f : mc;
      const float r = exp2_approx(m[u] - m_use);   // rescale the chunks before (0 for the first)
      float4& a = acc[u];
      sum[u] *= r; a.x *= r; a.y *= r; a.z *= r; a.w *= r;
#pragma unroll
      for (int j = 0; j < CHUNK; ++j) {
        const float wk = k0 + j < parts ? exp2_approx(lse[u][j] - m_use) : 0.f;
        sum[u] += wk;
        a.x += wk * v[u][j].x; a.y += wk * v[u][j].y; a.z += wk * v[u][j].z; a.w += wk * v[u][j].w;
      }
      m[u] = mc;
    }
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const float inv = 1.f / sum[u];   // every part holds tokens: sum >= 1, or NaN from a NaN part
    lse2[u] = m[u] + log2_approx(sum[u]);
    out[u] = make_float4(acc[u].x * inv, acc[u].y * inv, acc[u].z * inv, acc[u].w * inv);
  }
}

}  // namespace meld
