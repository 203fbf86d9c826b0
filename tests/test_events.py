"""Every count a task makes for another goes through the event API (templates/events.cuh): no template
adds to, spins on or stores a counter's zero by hand. The allow-list names the atomics that are not
events (tickets, list slots, claims) and why."""
import re
import shutil
from importlib import resources

import pytest

TEMPLATES = resources.files("meld.codegen") / "templates"

# The primitives of arrivals and waits: only events.cuh may use them.
COUNTING = re.compile(r"\b(atomicAdd|atomicSub|atomicInc|atomicDec|ld_acquire|load_acquire_sys|fetch_add_sys|"
                      r"dsmem_atomic_add|signal_add|signal_wait)\s*\(|\b(ld\.acquire|red\.|atom\.|st\.release)")
# A counter's zero stored by hand instead of event_reset.
RESET = re.compile(r"\b(counters?|xexit|rb_done|tok_cnt|arrive|count)\b(\s*\[[^]]*\]|\s*\+[^=;]*)?\s*=\s*0(u|ull)?\s*;")

# (template, text of the line) -> why it is not an event.
ALLOWED = {
    ("common.cuh", "__device__ __forceinline__ int next_slot() { return shared != nullptr ? atomicAdd(shared, 1) : n++; }"):
        "the profiler's record slots: a list index",
    ("common.cuh", "if (atomicAdd(clock + 1, 1u) == (unsigned)ctas - 1u) {"):
        "the profiler's sampling clock (common.cuh comes before events.cuh): counts launches, fires no task",
    ("common.cuh", "atomicAdd(clock, 1u);"): "the profiler's sampling clock: the launch number",
    ("common.cuh", "const unsigned long long slot = atomicAdd(tail, 1ull);"): "the proxy ring's slot ticket",
    ("moe.cuh", "const int ticket = atomicAdd(p.counters, 1);"): "the MoE task ticket (work handed out, not counted)",
    ("moe.cuh", "p.counters[0] = 0;"): "the MoE task ticket, rewound",
    ("moe.cuh", "combine_list[1 + atomicAdd(combine_list, 1)] = t;"): "a slot in the CTA's list of fired combines",
    ("grouped_attention.cuh", "const int k = atomicAdd(&n_fired, 1);"): "a slot in the CTA's list of fired events",
    ("mla_decode.cuh", 'asm volatile("{ .reg .pred p; setp.ne.u32 p, %2, 0; @p red.shared.add.u32 [%0], %1; }"'):
        "the phase stamps' cycle sums (a diagnostic build's statistics): nothing waits on them",
}


def _code_lines(name: str):
    for n, line in enumerate((TEMPLATES / name).read_text().splitlines(), 1):
        code = line.split("//", 1)[0].strip()
        if code:
            yield n, code


def test_templates_count_only_through_events_cuh():
    names = sorted(p.name for p in TEMPLATES.iterdir() if p.name.endswith((".cuh", ".h")) and p.name != "events.cuh")
    assert "decode_attention.cuh" in names and "moe.cuh" in names
    bad, used = [], set()
    for name in names:
        for n, code in _code_lines(name):
            if COUNTING.search(code) or RESET.search(code):
                if (name, code) in ALLOWED:
                    used.add((name, code))
                else:
                    bad.append(f"{name}:{n}: {code}")
    assert not bad, "counting outside the event API (templates/events.cuh):\n" + "\n".join(bad)
    assert used == set(ALLOWED), f"stale allow-list entries: {sorted(set(ALLOWED) - used)}"


def test_every_counting_family_uses_the_api():
    """Each family's counting is the API's: a template that fires a combine by a count calls it."""
    uses = {"decode_attention.cuh": ("event_arrive(", "event_arrive_cluster(", "event_reset("),
            "mla_decode.cuh": ("event_arrive(", "event_wait(", "event_reset("),
            "grouped_attention.cuh": ("event_arrive(", "event_reset("),
            "moe.cuh": ("event_arrive(", "event_wait(", "event_reset("),
            "tp_linear.cuh": ("event_arrive_sys(", "event_reset(", "event_wait_sys(", "event_reached_sys("),
            "decode_xrank.cuh": ("event_arrive_sys(", "event_arrive(", "event_wait_sys("),
            "xrank.cuh": ("event_publish_sys(", "event_wait_sys(", "event_signal_sys(", "event_take_sys(")}
    for name, calls in uses.items():
        text = (TEMPLATES / name).read_text()
        for call in calls:
            assert call in text, f"{name} does not call {call}"


# A standalone probe of the device-scope API (the system scope's is tests/test_dist_signals.py): every CTA
# writes a part and arrives with 1 or 2 parts at once at event 0; the completing arrival reads every part,
# resets the counter and arrives at event 1, on which every CTA waits; the last to leave resets event 1. A
# preset counter counts down to zero (a MoE token's combine). Launched twice: the resets make the second
# launch count from zero.
PROBE = r"""
struct ProbeParams {
  int* part;            // [ctas]
  unsigned* counters;   // [3]: event 0, event 1, leavers of event 1
  int* down;            // preset to ctas
  int* out;             // [4]: sum of the parts seen by the completer, completers of 0, of down, bad reads
  WatchdogRecord* rec;
  int* claim;
  unsigned target;      // sum of the CTAs' arrivals
};
extern "C" __global__ void __launch_bounds__(128) meld_event_probe(const __grid_constant__ ProbeParams p) {
  using namespace meld;
  const int b = blockIdx.x;
  if (threadIdx.x == 0) p.part[b] = b + 1;
  __threadfence();
  __syncthreads();
  if (threadIdx.x != 0) return;
  if (event_arrive(p.counters, 1u + (b & 1), p.target)) {
    __threadfence();
    int sum = 0;
    for (int i = 0; i < (int)gridDim.x; ++i) sum += *reinterpret_cast<volatile int*>(p.part + i);
    p.out[0] = sum;
    p.out[1] += 1;
    event_reset(p.counters);
    __threadfence();
    event_arrive(p.counters + 1, 1u, 1u);
  }
  event_wait(reinterpret_cast<const int*>(p.counters + 1), 1, WaitSite{p.rec, p.claim, 0, 21, b, 0, 0, 0});
  if (*reinterpret_cast<volatile int*>(p.out) != (int)(gridDim.x * (gridDim.x + 1) / 2)) atomicAdd(p.out + 3, 1);
  if (event_arrive(p.counters + 2, 1u, gridDim.x)) {
    event_reset(p.counters + 1);
    event_reset(p.counters + 2);
  }
  if (event_arrive(p.down, -1, 0)) p.out[2] += 1;
}
"""


def _probe_source() -> str:
    from meld.codegen.params import WATCHDOG_RECORD
    from meld.codegen.source import template

    head = "\n".join(["#define MELD_PROFILE 0", "#define MELD_WATCHDOG_NS 2000000000ll", '#define MELD_MMA_TYPE "bf16"'])
    return "\n".join([head, WATCHDOG_RECORD.c_source(), template("common.cuh"), template("events.cuh"), PROBE])


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_event_probe_compiles_for_sm_90a():
    from tests.kernel_matrix import nvcc

    cubin, _ = nvcc(_probe_source(), "meld_event_probe")
    assert cubin[:4] == b"\x7fELF"


@pytest.mark.gpu
def test_gpu_events_complete_once_wait_and_reset():
    import ctypes

    import torch

    from meld.codegen import compile_source
    from meld.runtime import watchdog
    from meld.runtime.driver import Kernel

    dev = torch.device("cuda", torch.cuda.current_device())
    kernel = Kernel(compile_source(_probe_source(), "meld_event_probe"), "meld_event_probe", dev, 128, 0)

    class ProbeParams(ctypes.Structure):
        _fields_ = [("part", ctypes.c_void_p), ("counters", ctypes.c_void_p), ("down", ctypes.c_void_p),
                    ("out", ctypes.c_void_p), ("rec", ctypes.c_void_p), ("claim", ctypes.c_void_p),
                    ("target", ctypes.c_uint)]

    ctas = torch.cuda.get_device_properties(dev).multi_processor_count // 2   # co-resident: the wait ends
    wd = watchdog.for_device(dev)
    counters = torch.zeros(3, dtype=torch.int32, device=dev)
    for launch in (1, 2):
        part = torch.full((ctas,), -7, dtype=torch.int32, device=dev)   # poisoned
        down = torch.full((1,), ctas, dtype=torch.int32, device=dev)
        out = torch.zeros(4, dtype=torch.int32, device=dev)
        target = sum(1 + (b & 1) for b in range(ctas))
        kernel.launch(ctas, ProbeParams(part.data_ptr(), counters.data_ptr(), down.data_ptr(), out.data_ptr(),
                                        wd.record_ptr, wd.claim_ptr, target))
        torch.cuda.synchronize()
        wd.check()
        assert out.tolist() == [ctas * (ctas + 1) // 2, 1, 1, 0], launch
        assert counters.tolist() == [0, 0, 0] and down.item() == 0, launch
