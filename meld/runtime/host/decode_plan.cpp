// meld: the decode-attention planner on the host, for the CPU reference executor and
// DecodeAttention.schedule. The planning is templates/decode_plan.h, the GPU planner's own text, which
// meld/runtime/host_helper.py puts in front of this file (after one_thread.h, PlanParams and CtaRow)
// with PLAN_THREADS = 1. Writes what the GPU planner's CTA 0 writes (p->kv_len, page_base, line,
// slot_base, cta_table); `out` receives the active CTAs and the cluster snap applied.

namespace meld {
thread_local long long smem64[PLAN_SMEM_BYTES / sizeof(long long)];   // plan_tables' dynamic shared memory
}

extern "C" void meld_decode_plan_host(const PlanParams* p, int* out) {
  const meld::PlanOutcome r = meld::plan_tables(*p);
  out[0] = r.active;
  out[1] = r.snap;
}
