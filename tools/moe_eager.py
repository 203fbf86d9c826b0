"""Host cost of one eager `meld.MoE` / `meld.fused_moe` call, whole and by phase (issue 40: eager cost).

    python tools/moe_eager.py [--cuda] [--shape NAME] [--tokens 1,16,128] [--calls N] [--rounds R] [--json PATH]

Without --cuda (any host, no GPU needed) the layer's GPU call path runs on CPU tensors with its launches
stubbed: `_StubMoE` is a CPU layer whose executor is the GPU path (`MoE._launch`) over stand-ins for what
needs a GPU — kernels that are `driver.Kernel`s without a module, a zeroed parameter struct, a watchdog record
in ordinary memory, tensor maps that encode to zeros — and the driver library is a C library of no-op
functions of libcuda's signatures, compiled here, so ctypes converts each launch's arguments as it does on a
GPU. torch's current stream is 0 (a CPU build of torch has no streams), and `torch.empty` allocates CPU
memory, not from the CUDA caching allocator. What remains is exactly the Python of a call: checks, output
allocation, parameter writes and the launches' Python side.

With --cuda it times the real layer on the GPU: host time per call (each round of calls between
synchronisations, few enough calls not to fill the launch queue), and beside it the eager latency and the
CUDA-graph time of `bench.harness` (cold L2), the issue's "eager call <= graph time + 15 us" comparison, for
the call as it is (through the torch op's C++ fast path, where installed) and by its direct path; and the time per
call of calls issued back to back, eager and replayed (`bench.harness.back_to_back_us`): one call's latency from an
idle GPU charges all of its host work, while a layer loop hides the host work behind the GPU's own.

Phases are the pieces of `moe(x, logits)`'s direct path (packed weights, as bench/moe.py times it) each timed
alone with the same arguments, interleaved with the whole calls so that all run in the same conditions; "rest of
the call" is the whole direct call less their sum (argument handling, the tie to autograd, the calls between the
pieces, and what the pieces cost more in the whole call than alone). Every number is the best round's mean per
call: other processes on the host only ever add to it. Stubbed, the clock is this thread's CPU time (a shared
host's other processes do not count); with --cuda it is wall time.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import meld  # noqa: E402
from bench.moe import SHAPES, Shape, router_logits  # noqa: E402
from meld.codegen import TensorMap  # noqa: E402
from meld.codegen.moe_kernel import BLOCK_TOKEN_CHOICES, MAIN_THREADS, block_tokens_for  # noqa: E402
from meld.codegen.params import WATCHDOG_RECORD  # noqa: E402
from meld.ops import moe as moe_module  # noqa: E402
from meld.ops.moe_weights import packed_shapes  # noqa: E402
from meld.runtime import driver, fastcall  # noqa: E402
from meld.runtime.tensor_map import TensorMapCache  # noqa: E402
from meld.runtime.watchdog import Watchdog  # noqa: E402
from torch_op_overhead import time_calls  # noqa: E402   (tools/ is this script's path[0])

BF16 = torch.bfloat16

# libcuda's hot-path functions (fastcall._SIGNATURES), each returning CUDA_SUCCESS and doing nothing.
_STUB_DRIVER = """
typedef unsigned long long u64;
int cuMemcpyDtoDAsync_v2(u64 dst, u64 src, unsigned long n, void *stream) { return 0; }
int cuLaunchKernelEx(const void *config, void *f, void **params, void **extra) { return 0; }
int cuOccupancyMaxActiveClusters(int *n, void *f, const void *config) { *n = 0; return 0; }
int cuFuncSetAttribute(void *f, int attr, int value) { return 0; }
int cuGetErrorString(int err, const char **msg) { *msg = "stub"; return 0; }
"""


def stub_library() -> ctypes.CDLL:
    """The driver calls meld's hot path makes, as no-op C functions (built once a process)."""
    global _stub
    if _stub is None:
        folder = Path(tempfile.mkdtemp(prefix="meld-stub-driver-"))
        (folder / "stub.c").write_text(_STUB_DRIVER)
        subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", str(folder / "libstub.so"), str(folder / "stub.c")],
                       check=True)
        _stub = fastcall.load(str(folder / "libstub.so"))
    return _stub


_stub: ctypes.CDLL | None = None


def stub_driver() -> None:
    """Route meld's hot-path driver calls to no-op C functions and torch's current stream to 0."""
    fastcall._lib = stub_library()
    driver.current_stream = lambda device: 0


def _stub_kernel(name: str, threads: int) -> driver.Kernel:
    """A `driver.Kernel` whose launches reach the stub driver: the launch path's state, no module."""
    k = object.__new__(driver.Kernel)
    k.__dict__.update(name=name, device=torch.device("cpu"), threads=threads, smem_bytes=0, _func=0, _params=None,
                      _configs={})
    return k


class _StubMoE(meld.MoE):
    """A CPU layer that runs the GPU call path (`_launch`) over stand-ins for the GPU state (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._grid = self._sm_count
        self._watchdog = object.__new__(Watchdog)
        self._watchdog.record = WATCHDOG_RECORD.ctype()
        self._weight_maps = TensorMapCache(lambda w13, w2: (TensorMap(), TensorMap()))
        for bt in BLOCK_TOKEN_CHOICES:
            for packed in (False, True):
                self._variants[bt, packed] = moe_module._Variant(
                    self._kernel_config, _stub_kernel("route", 1024), _stub_kernel("scatter", 32),
                    _stub_kernel("main", MAIN_THREADS), self.lowering.params.ctype())

    def _check_ids(self, ids):   # (the GPU checks ids on the device)
        pass

    def _run_cpu(self, *args):
        self._launch(*args)


def inputs(shape: Shape, T: int, device: str, packed: bool) -> tuple[torch.Tensor, ...]:
    """x, router_logits, w13, w2 (packed or plain) of a case; weights empty on the CPU (never read there)."""
    H, I, E = shape.hidden, shape.inter, shape.experts
    s13, s2 = packed_shapes(H, I, E) if packed else ((E, 2 * I, H), (E, H, I))
    make = torch.empty if device == "cpu" else lambda *s, **kw: torch.randn(*s, **kw) / 32
    w13, w2 = make(s13, dtype=BF16, device=device), make(s2, dtype=BF16, device=device)
    x = torch.randn(T, H, dtype=BF16, device=device)
    return x, router_logits(shape, T, "uniform").to(device), w13, w2


def calls(layer: meld.MoE, shape: Shape, T: int, x, logits, w13, w2, w13_plain, w2_plain):
    """The call paths timed whole: bench/moe.py's (logits, packed weights), and it by the direct path (the Python
    of `MoE.__call__` past its route to the torch op, which a GPU layer takes where the op's C++ fast path is
    installed), an out= buffer, precomputed routing (int64 ids, as torch.topk gives them: the direct path),
    plain weights, and fused_moe."""
    k, out = shape.top_k, torch.empty_like(x)
    topk_w, topk_ids = torch.rand(T, shape.experts, device=x.device).topk(k)   # (int64 ids, none repeated)
    return {"moe(x, logits)": lambda: layer(x, logits, w13, w2),
            "moe(x, logits), direct path": lambda: layer._call(x, logits, w13, w2, None, None, None),
            "moe(x, logits, out=)": lambda: layer(x, logits, w13, w2, out=out),
            "moe(x, None, topk_weights=, topk_ids=)":
                lambda: layer(x, None, w13, w2, topk_weights=topk_w, topk_ids=topk_ids),
            "moe(x, logits), plain weights": lambda: layer(x, logits, w13_plain, w2_plain),
            "fused_moe(x, w13, w2, logits)": lambda: meld.fused_moe(x, w13_plain, w2_plain, logits, k)}


def phases(layer: meld.MoE, T: int, x, logits, w13, w2) -> dict[str, Callable[[], object]]:
    """The pieces of `moe(x, logits)`'s direct path, each alone."""
    out = torch.empty_like(x)
    v = layer._variant(block_tokens_for(T, layer.top_k, layer.num_experts), w13.dim() == 6)
    return {"input checks": lambda: layer._usual_inputs(x, logits, w13, w2, None, None),
            "output allocation": lambda: torch.empty(T, layer.hidden_size, dtype=BF16, device=layer.device),
            "_launch: parameters": lambda: layer._launch(x, logits, w13, w2, None, None, out),
            "launches' Python side": lambda: layer._enqueue(v, T)}


def measure(shape: Shape, tokens: list[int], n_calls: int, rounds: int, cuda: bool) -> dict[str, dict[str, float]]:
    device = "cuda" if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    clock = time.perf_counter if cuda else time.thread_time   # (stubbed: the time this thread ran, not the host's load)
    cls = meld.MoE if cuda else _StubMoE
    layer = cls(shape.hidden, shape.inter, shape.experts, shape.top_k, BF16, device, max_num_tokens=max(tokens))
    res: dict[str, dict[str, float]] = {}
    for T in tokens:
        x, logits, w13p, w2p = inputs(shape, T, device, packed=True)
        _, _, w13, w2 = inputs(shape, T, device, packed=False)
        whole, parts = calls(layer, shape, T, x, logits, w13p, w2p, w13, w2), phases(layer, T, x, logits, w13p, w2p)
        times = time_calls({**whole, **parts}, n_calls, rounds, sync, clock)   # (interleaved: the same conditions)
        whole, parts = ({name: times[name] for name in d} for d in (whole, parts))
        parts["_launch: parameters"] -= parts["launches' Python side"]
        parts["rest of the call"] = whole["moe(x, logits), direct path"] - sum(parts.values())
        res[f"{shape.name} T={T}: calls"] = whole
        res[f"{shape.name} T={T}: phases of moe(x, logits)'s direct path"] = parts
        if cuda:
            from bench.harness import back_to_back_us, eager_time_us, graph_time_us

            from meld.runtime import torch_fastcall

            fn = lambda x=x, logits=logits, w13=w13p, w2=w2p: layer(x, logits, w13, w2)  # noqa: E731

            def direct(x=x, logits=logits, w13=w13p, w2=w2p):
                return layer._call(x, logits, w13, w2, None, None, None)
            hits = torch_fastcall.hits()
            eager = eager_time_us(fn).median_us
            hits = torch_fastcall.hits() - hits
            eager_direct, graph = eager_time_us(direct).median_us, graph_time_us(fn).median_us
            b2b, b2b_graph = back_to_back_us(fn).median_us, back_to_back_us(fn, graph=True).median_us
            res[f"{shape.name} T={T}: moe(x, logits) on the GPU (median us)"] = {
                "eager latency": eager, "graph replay": graph, "eager - graph": eager - graph,
                "eager latency, direct path": eager_direct, "direct - graph": eager_direct - graph,
                "back to back, eager": b2b, "back to back, graph": b2b_graph,
                "back to back, eager - graph": b2b - b2b_graph,
                "fast-path calls of the eager ones": hits}
        del w13, w2, w13p, w2p
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cuda", action="store_true", help="time the real layer on the GPU (default: stubbed, CPU)")
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    ap.add_argument("--tokens", default="1,16,128", help="comma-separated token counts")
    ap.add_argument("--calls", type=int, default=None, help="calls per round (default 2000; 20 with --cuda)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--json", type=Path, help="write the results here too")
    args = ap.parse_args(argv)
    if not args.cuda:
        stub_driver()
        moe_module.MoE = _StubMoE   # fused_moe's cached layers are stubs too
    tokens = [int(t) for t in args.tokens.split(",")]
    res = measure(SHAPES[args.shape], tokens, args.calls or (20 if args.cuda else 2000), args.rounds, args.cuda)
    print(f"{'GPU' if args.cuda else 'CPU, launches stubbed'}: best of {args.rounds} rounds, us per call")
    for case, times in res.items():
        print(case)
        for name, us in times.items():
            print(f"  {name:40s} {us:8.2f}")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
