// meld: the grouped-attention planner (a split-reduce graph whose partials come from several tasks, or from
// tasks over groups of requests: meld/scheduler/split_reduce_plan.py explains the cut, and its NumPy
// `plan_split_reduce_numpy` is this file's test oracle). Written once for the GPU and the host: the host
// build (meld/runtime/host/split_reduce_plan.cpp) compiles it for a block of one thread under
// one_thread.h. The line is walked in order by thread 0 (work items number the groups times the kv heads:
// thousands, not millions); the other threads of a GPU block only wait at the barrier.
//
// Work items are (group g, kv head h, slice s), groups producer after producer: slice s holds the group's
// requests s * S .. (S = slice_rows / group_size, at least 1: the rows one task's CTA attends at once), each
// item of the group's t tokens and r = its requests x group_size query rows, costing a fixed
// item_overhead + (requests - 1) * merge_overhead, then t * ceil(r / rows_per_tile), the fixed cost first on the
// line. Each producer's items make one line of their costs, cut into num_ctas segments of equal cost: every
// CTA holds a share of every producer, the producers' in graph order. A cut inside an item is a piece boundary
// at the nearest multiple of `cut` tokens: a cut nearer the item's start than half of `min_piece` tokens moves
// the whole item to the next CTA, one that would leave the piece before it shorter than `min_piece` moves up
// to make it that long, and one that would leave the last piece shorter is dropped. Each piece is one
// SPLIT_TASK row (CTA after CTA, a CTA's in line order) and counts towards its requests' events
// (h * batch + b); each event lists its parts' first slots in line order (the merge order). With `stagger`, the
// CTAs of the second half (c >= num_ctas / 2) list their tasks last to first: two CTAs an SM (the grouped kernel's
// four-warp build) are c and c + num_ctas / 2, and while one attends its share of the shared levels (bound by the
// tensor cores) the other streams its requests' own KV (bound by bytes), instead of both doing the same at once.
//
// Defined by the including source: PLAN_THREADS, SplitPlanParams, SplitTask / store_splittask, Event /
// store_event.

namespace meld {

__device__ __forceinline__ void plan_split_reduce(const SplitPlanParams& p) {
  if (threadIdx.x == 0) {
    const int H = p.num_kv_heads, W = p.num_ctas, E = p.batch * p.num_kv_heads;
    const int slice = max(1, p.slice_rows / p.group_size);   // requests of a slice
    int* const at = p.cursor + E;   // [W]: pass 0 counts each CTA's tasks, pass 1 its next row
    for (int e = 0; e < E; ++e) p.cursor[e] = 0;
    for (int c = 0; c < W; ++c) at[c] = 0;
    // Pass 0 counts each event's parts and each CTA's tasks; pass 1 writes the tasks (CTA after CTA, a CTA's
    // in line order) and lists the parts' slots.
    int tasks = 0, slots = 0;
    bool fits = true;
    for (int pass = 0; pass < 2 && fits; ++pass) {
      if (pass == 1) {   // each event's first part and each CTA's first row: exclusive scans of the counts
        int first = 0;
        for (int e = 0; e < E; ++e) {
          store_event(p.events, E, e, Event{p.cursor[e], first});
          first += p.cursor[e];
          p.cursor[e] = first - p.cursor[e];
        }
        int row = 0;
        for (int c = 0; c < W; ++c) row += at[c], at[c] = p.stagger && 2 * c >= W ? row : row - at[c];   // (staggered: its end)
        fits = first <= p.slot_capacity && row <= p.task_capacity;
        if (!fits) break;
      }
      int task = 0, slot = 0;
      for (int g0 = 0; g0 < p.num_groups;) {   // one line per producer
        int g1 = g0;
        long long total = 0;
        for (; g1 < p.num_groups && p.group_producer[g1] == p.group_producer[g0]; ++g1)
          for (int s0 = 0; p.group_tokens[g1] > 0 && s0 < p.group_requests[g1]; s0 += slice) {
            const int req = min(slice, p.group_requests[g1] - s0);
            total += (long long)H * (p.item_overhead + (long long)(req - 1) * p.merge_overhead +
                     (long long)p.group_tokens[g1] * ((req * p.group_size + p.rows_per_tile - 1) / p.rows_per_tile));
          }
        long long start = 0, seg_c = 0, seg_first = 0;
        // CTA c's segment starts at cost c * total / W, a 64-bit division: remembered, as the walk asks for the
        // same CTA's again and again.
        auto segment = [&](int c) {
          if (c != seg_c) seg_c = c, seg_first = c * total / W;
          return seg_first;
        };
        int cta = 0;
        for (int g = g0; g < g1; ++g) {
          const int n = p.group_tokens[g];
          if (n <= 0) continue;
          for (int h = 0; h < H; ++h)   // kv head after kv head, its slices together (their KV shared in L2)
          for (int s0 = 0; s0 < p.group_requests[g]; s0 += slice) {
            const int req = min(slice, p.group_requests[g] - s0), q0 = p.group_q0[g] + s0;
            const int tiles = (req * p.group_size + p.rows_per_tile - 1) / p.rows_per_tile;
            const long long fixed = p.item_overhead + (long long)(req - 1) * p.merge_overhead;
            const long long cost = fixed + (long long)n * tiles;
            while (cta + 1 < W && segment(cta + 1) <= start) ++cta;   // the CTA whose segment holds the start
            int begin = 0, owner = cta;
            for (int c = cta + 1;; ++c) {   // the pieces: cut where a CTA boundary falls inside, if not too short
              int end = n, next = owner;
              for (; c < W && segment(c) < start + cost; ++c) {
                const long long into = segment(c) - start - fixed;   // (a boundary in the fixed cost: at 0)
                const long long pos0 = (into > 0 ? into : 0) / tiles;
                const int near = (int)((pos0 + p.cut / 2) / p.cut * p.cut);
                if (begin == 0 && 2 * near < p.min_piece) {   // nearer the item's start than half a piece: it starts on c
                  owner = c;
                  continue;
                }
                const int pos = max(near, begin + p.min_piece);   // the piece before is at least min_piece long
                if (n - pos >= p.min_piece) {
                  end = pos;
                  next = c;
                  break;
                }
              }
              if (pass == 0) {
                ++at[owner];
                for (int r = 0; r < req; ++r) ++p.cursor[h * p.batch + q0 + r];
              } else {
                SplitTask t;   // a task row of the one layout (meld/ir/work_table.py: TASK, SPLIT_TASK)
                t.group = t.last_group = p.group_index[g];
                t.kv_begin = begin; t.kv_end = end; t.producer = p.group_producer[g]; t.kv_head = h;
                t.pages = p.group_pages[g]; t.arg3 = 0;
                t.kind = SPLITTASK_TASK_KIND; t.cta = owner; t.slot = slot; t.event_first = h * p.batch + q0; t.event_count = req;
                store_splittask(p.tasks, p.task_capacity, p.stagger && 2 * owner >= W ? --at[owner] : at[owner]++, t);
                for (int r = 0; r < req; ++r) p.part_slot[p.cursor[h * p.batch + q0 + r]++] = slot + r * p.group_size;
              }
              ++task;
              slot += req * p.group_size;
              if (end == n) {
                cta = owner;
                break;
              }
              begin = end;
              owner = next;
            }
            start += cost;
          }
        }
        g0 = g1;
      }
      tasks = task;
      slots = slot;
    }
    p.out[0] = fits ? tasks : -1;
    p.out[1] = slots;
  }
  __syncthreads();
}

}  // namespace meld
