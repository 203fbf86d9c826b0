"""The GPU proxy on one GPU: a kernel hands it puts and signals towards a second buffer of the same GPU
(standing for another rank's window) and waits for the signals, while the host thread that launched it
waits for the GPU holding the GIL. The C++ proxy thread lands everything meanwhile; a proxy that needs
the GIL would leave the kernel waiting until its watchdog fires."""
import ctypes
import types

import pytest
import torch

from meld.codegen.compiler import compile_source
from meld.codegen.source import template
from meld.codegen.params import WATCHDOG_RECORD, Field, ParamStruct

PUTS, PUT_BYTES, SLOT = 48, 3000, 1 << 20   # puts of 3000 bytes (not whole chunks); the signal slot's byte

ECHO_PARAMS = ParamStruct("EchoParams", [
    Field("ring", "ptr", "meld::ProxyCommand*"), Field("tail", "ptr", "unsigned long long*"),
    Field("head", "ptr", "const unsigned long long*"), Field("remote_slot", "ptr", "unsigned long long*"),
    Field("watchdog", "ptr", "WatchdogRecord*"), Field("watchdog_claim", "ptr", "int*"),
    Field("cap", "i32"), Field("watchdog_kernel", "i32"),
])

ECHO = r"""
extern "C" __global__ void proxy_echo(const __grid_constant__ EchoParams p) {
  // Each CTA: PUTS / gridDim.x puts of its own stripes to rank 1, then one signal adding its puts; then every
  // CTA waits until rank 1's slot holds all of them.
  const meld::WaitSite s{p.watchdog, p.watchdog_claim, p.watchdog_kernel, 10, (int)blockIdx.x, 0, -1, 1};
  if (threadIdx.x != 0) return;
  int mine = 0;
  for (int j = blockIdx.x; j < PUTS; j += gridDim.x, ++mine)
    meld::proxy_push(p.ring, p.tail, p.head, p.cap, meld::PROXY_PUT, 1, (unsigned long long)j * PUT_BYTES, PUT_BYTES, 0, s);
  meld::proxy_push(p.ring, p.tail, p.head, p.cap, meld::PROXY_SIGNAL, 1, SLOT, 0, mine, s);
  meld::event_wait_sys(p.remote_slot, PUTS, s);
}
"""


def _echo_source() -> str:
    return "\n".join([f"#define PUTS {PUTS}\n#define PUT_BYTES {PUT_BYTES}\n#define SLOT {SLOT}ull",
                      '#define MELD_MMA_TYPE "bf16"', "#define MELD_PROFILE 0", "#define MELD_WATCHDOG_NS 2000000000ll",
                      WATCHDOG_RECORD.c_source(), template("common.cuh"), template("events.cuh"), ECHO_PARAMS.c_source(), ECHO])


def test_echo_kernel_compiles_for_sm90a():
    assert compile_source(_echo_source(), "meld_test_proxy_echo", "sm_90a").cubin


@pytest.mark.gpu
@pytest.mark.parametrize("ordered", [True, False])
def test_proxy_lands_puts_and_signals_while_the_launching_thread_holds_the_gil(ordered):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from meld.distributed.proxy import GpuProxy
    from meld.runtime import watchdog

    dev = torch.device("cuda", torch.cuda.current_device())
    nbytes = SLOT + 8
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev)
    src[SLOT:].zero_()
    dst = torch.full((nbytes,), 7, dtype=torch.uint8, device=dev)
    dst[SLOT:].zero_()
    window = types.SimpleNamespace(local=src, rank=0, world=2, ptrs=[src.data_ptr(), dst.data_ptr()], engine="cuda")
    proxy = GpuProxy(window, ordered=ordered, chunk_bytes=1000, capacity=16, seed=3)   # a small ring: it wraps
    try:
        from meld.runtime.driver import Kernel

        kernel = Kernel(compile_source(_echo_source(), "meld_test_proxy_echo"), "proxy_echo", dev, 32, 0)
        wd = watchdog.for_device(dev)
        ring = proxy.ring_params()
        params = ECHO_PARAMS.ctype(ring=ring["xring"], tail=ring["xring_tail"], head=ring["xring_head"],
                                   remote_slot=dst.data_ptr() + SLOT, watchdog=wd.record_ptr,
                                   watchdog_claim=wd.claim_ptr, cap=ring["xring_cap"],
                                   watchdog_kernel=wd.register("proxy_echo", str))
        kernel.launch(5, params)
        assert ctypes.PyDLL("libcuda.so.1").cuCtxSynchronize() == 0   # the GIL held all along
        wd.check()
        assert proxy.error is None
        assert torch.equal(dst[:PUTS * PUT_BYTES], src[:PUTS * PUT_BYTES]), "a put did not land whole"
        assert (dst[PUTS * PUT_BYTES:SLOT] == 7).all(), "a put landed outside its range"
        assert dst[SLOT:].view(torch.int64).item() == PUTS
        assert proxy.landed_ops == PUTS * -(-PUT_BYTES // 1000) + 5
    finally:
        proxy.close()


@pytest.mark.gpu
def test_a_proxy_dropped_without_close_stops_its_thread():
    """No close(): the finalizer stops the thread before the ring it polls is freed (no crash, at exit either)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import gc
    import weakref

    from meld.distributed.proxy import GpuProxy

    dev = torch.device("cuda", torch.cuda.current_device())
    buf = torch.zeros(4096, dtype=torch.uint8, device=dev)
    window = types.SimpleNamespace(local=buf, rank=0, world=1, ptrs=[buf.data_ptr()], engine="cuda")
    proxy = GpuProxy(window)
    stopped = proxy._stop
    alive = weakref.ref(proxy)
    del proxy
    gc.collect()
    assert alive() is None and not stopped.alive
    torch.cuda.synchronize()
