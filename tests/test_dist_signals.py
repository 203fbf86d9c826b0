"""The system-scope event primitives of events.cuh (event_signal_sys, event_arrive_sys, event_wait_sys under the
watchdog): they compile for sm_90a (CPU), and on a GPU two co-resident CTAs ping-pong data through them,
every round's data visible once its signal is seen, and event_arrive_sys counts every arrival once."""
import ctypes
import shutil

import pytest
import torch

from meld.codegen.params import WATCHDOG_RECORD
from meld.codegen.source import template
from tests.kernel_matrix import nvcc

HEAD = "\n".join(["#define MELD_PROFILE 0", "#define MELD_WATCHDOG_NS 2000000000ll", '#define MELD_MMA_TYPE "bf16"'])
KERNEL = r"""
struct PingParams {
  float* data;
  unsigned long long* flags;   // [0] rounds written, [1] rounds checked, [2] bad values, [3] arrivals
  WatchdogRecord* rec;
  int* claim;
  int n, rounds;
};
extern "C" __global__ void __launch_bounds__(256) meld_signal_pingpong(const __grid_constant__ PingParams p) {
  using namespace meld;
  const int waits_on = blockIdx.x == 0 ? 1 : 0;   // the flag this CTA waits on (the watchdog's detail)
  const WaitSite site{p.rec, p.claim, 0, 10, (int)blockIdx.x, (int)(threadIdx.x >> 5), 0, waits_on};
  for (int r = 1; r <= p.rounds; ++r) {
    if (blockIdx.x == 0) {                       // the writer: round r's data, then its signal
      if (threadIdx.x == 0 && r > 1) event_wait_sys(&p.flags[1], r - 1, site);
      __syncthreads();
      for (int i = threadIdx.x; i < p.n; i += blockDim.x) p.data[i] = (float)(r * 7 + i);
      __syncthreads();
      if (threadIdx.x == 0) event_signal_sys(&p.flags[0], 1);
    } else {                                     // the reader: wait for the signal, check, signal back
      if (threadIdx.x == 0) event_wait_sys(&p.flags[0], r, site);
      __syncthreads();
      for (int i = threadIdx.x; i < p.n; i += blockDim.x)
        if (p.data[i] != (float)(r * 7 + i)) event_arrive_sys(&p.flags[2], 1, 0);
      __syncthreads();
      if (threadIdx.x == 0) event_signal_sys(&p.flags[1], 1);
    }
  }
  if (threadIdx.x % 32 == 0) event_arrive_sys(&p.flags[3], 1, 0);
}
"""


def source() -> str:
    return "\n".join([HEAD, WATCHDOG_RECORD.c_source(), template("common.cuh"), template("events.cuh"), KERNEL])


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_signal_primitives_compile_for_sm_90a():
    cubin, _ = nvcc(source(), "meld_signal_pingpong")
    assert cubin[:4] == b"\x7fELF"


@pytest.mark.gpu
def test_gpu_two_ctas_ping_pong_through_signals():
    from meld.codegen import compile_source
    from meld.runtime import watchdog
    from meld.runtime.driver import Kernel

    dev = torch.device("cuda", torch.cuda.current_device())
    kernel = Kernel(compile_source(source(), "meld_signal_pingpong"), "meld_signal_pingpong", dev, 256, 0)

    class PingParams(ctypes.Structure):
        _fields_ = [("data", ctypes.c_void_p), ("flags", ctypes.c_void_p), ("rec", ctypes.c_void_p),
                    ("claim", ctypes.c_void_p), ("n", ctypes.c_int), ("rounds", ctypes.c_int)]

    n, rounds = 5000, 200
    data = torch.full((n,), float("nan"), device=dev)
    flags = torch.zeros(4, dtype=torch.int64, device=dev)
    wd = watchdog.for_device(dev)
    kernel.launch(2, PingParams(data.data_ptr(), flags.data_ptr(), wd.record_ptr, wd.claim_ptr, n, rounds))
    torch.cuda.synchronize()
    wd.check()
    assert flags.tolist() == [rounds, rounds, 0, 2 * 256 // 32]
    assert torch.equal(data, torch.arange(n, device=dev, dtype=torch.float32) + rounds * 7)
