// meld: the grouped-attention planner on the host, for the CPU reference executor. The planning is
// templates/split_reduce_plan.h, the GPU planner's text, which meld/runtime/host_helper.py puts in front of
// this file (after one_thread.h, SplitPlanParams and the SplitTask / Event accessors) with PLAN_THREADS = 1.

extern "C" void meld_split_reduce_plan_host(const SplitPlanParams* p) { meld::plan_split_reduce(*p); }
