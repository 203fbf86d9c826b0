"""Host time of meld's torch custom ops against the direct calls (issue 13: the dispatcher path may add at
most ~2 us per call).

    python tools/torch_op_overhead.py [--cuda] [--stub-fast-path] [--calls N] [--rounds R] [--json PATH]

`stub` rows time operators whose work is replaced by nothing (subclasses, on the CPU), so they measure the
call paths alone: the direct method, torch.ops.meld.* (dispatcher, handle lookup, Python kernel; the decode
op also as Inductor's generated code calls it, the defaulted arguments by keyword) and the
`meld.ops.torch_ops` callers (which also allocate nothing here: outputs are passed in), and for comparison
the decode op's schema with a Python kernel that does nothing, defined as meld defines its ops
(torch.library.Library: the floor of that route) and through torch.library.custom_op. With --cuda it also
times the real operators on the GPU: host time per call of run() / MoE() and of their ops, the GPU work
queued and not waited for (each round of calls is timed between synchronisations, and is short enough not
to fill the launch queue), and again with the fast path's launch a no-op ("launch stubbed": the host time up to the
launch, which issue 42 bounds at 2 us; the difference is the driver's cuLaunchKernelEx). Each number is the best
round's mean per call: other processes on the host only ever add to it. `torch.add(out=)` on one-element CPU
tensors is timed alongside, to compare hosts by, and with --cuda on one-element GPU tensors (a launch of torch's).

On a GPU the ops take the C++ fast path (meld.runtime.torch_fastcall) once a call has been recorded; each case
reports how many of its calls did ("fast-path calls"). run() and MoE() take that route too where it is installed
(`Operator._op_route`); their "direct path" rows time the Python they ran before (and run where it is not).
`--stub-fast-path` times the fast path without a GPU, in place of the other rows: `StubDecode` and
tools/moe_eager.py's `_StubMoE` (GPU call paths, launches into no-op C functions; the clock is this thread's CPU
time) directly and through their ops, first with the ops' Python kernels, then with the C++ kernels installed on
the CPU's dispatch keys (the fast path's CPU form, for tests and this measurement only). StubDecode's run() also
copies out onto itself (the CPU executor's path ends so).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import meld  # noqa: E402
from meld.ops import torch_ops  # noqa: E402
from meld.workloads import paged  # noqa: E402


class _StubAttention(meld.DecodeAttention):
    def _run(self, inputs, return_lse, out, lse, **options):   # (run()'s body and the op kernel's: no work)
        return out


class StubDecode(meld.DecodeAttention):
    """A CPU operator that runs the GPU call path (`_launch`: parameter writes, the persistent launch's grids) over
    stand-ins, as tools/moe_eager.py's `_StubMoE`: a `driver.Kernel` without a module, work tables at address 0, a
    watchdog record in ordinary memory, no TMA maps; its launches reach whatever driver `fastcall` has loaded (a
    stub: tools/moe_eager.py's `stub_driver`). For timing and testing the op's call path without a GPU."""

    def __init__(self, *args, **kwargs):
        from types import SimpleNamespace

        from moe_eager import _stub_kernel

        from meld.codegen.params import WATCHDOG_RECORD
        from meld.runtime.watchdog import Watchdog

        super().__init__(*args, device="cpu", **kwargs)
        self.kernel = _stub_kernel("decode", self.kernel_config.threads)
        w = self._watchdog = object.__new__(Watchdog)
        w.device, w._claim, w._kernels = torch.device("cpu"), torch.zeros(1), []
        w._host = torch.zeros(WATCHDOG_RECORD.size, dtype=torch.uint8)
        w.record = WATCHDOG_RECORD.ctype.from_address(w._host.data_ptr())
        self._watchdog_id, self._tensor_maps, self._outs, self._grid_resident = 0, None, None, True
        tables = SimpleNamespace(ptr=lambda offset: 0, off_slot_base=0)
        fields = dict(kv_indices=0, kv_len=0, page_base=0, cta_table=0, part_o=0, part_lse=0, counters=0,
                      **self._header(num_ctas=self.topology.num_ctas))
        self._buf = SimpleNamespace(launcher=self._kernel_launch(tables, fields), prof=None)

    def _run_outputs(self, *args):
        self._outs = super()._run_outputs(*args)
        return self._outs

    def _execute_cpu(self, planned, q, kv):   # (the GPU path, writing the outputs run() then copies onto themselves)
        self._launch(q, kv, *self._outs)
        return self._outs


class _StubMoE(meld.MoE):
    def _call(self, x, router_logits, w13, w2, topk_weights, topk_ids, out, *rest):   # (the same for MoE)
        return out


_lib = torch.library.Library("meld_overhead", "FRAGMENT")
_lib.define("empty(Tensor q, Tensor kv_cache, Tensor(a!) out, Tensor(b!)? lse, int handle, Tensor? v_cache=None, "
            "float k_scale=1.0, float v_scale=1.0) -> ()")
_lib.impl("empty", lambda *args: None, "CPU")   # no autograd kernel: torch's own (C++) fallback


@torch.library.custom_op("meld_overhead::stub", mutates_args=("out", "lse"))
def _custom_op_stub(q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
                    handle: int) -> None:
    """The decode op's schema defined through torch.library.custom_op instead, doing nothing: what that
    path would cost (meld.ops.torch_ops uses torch.library.Library)."""


def time_calls(variants: dict[str, Callable[[], object]], calls: int, rounds: int, sync: Callable[[], None],
               clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """The best of `rounds` rounds' host time per call (us) of each variant, the variants interleaved."""
    for fn in variants.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            sync()
            t0 = clock()
            for _ in range(calls):
                fn()
            samples[name].append((clock() - t0) / calls * 1e6)
    sync()
    return {name: min(s) for name, s in samples.items()}


def attention_variants(attn, q, kv, out) -> dict[str, Callable[[], object]]:
    op, h = torch.ops.meld.decode_attention.default, attn.handle
    return {"run()": lambda: attn.run(q, kv, out=out),
            "run()'s direct path": lambda: attn._run((q, kv), False, out, None),
            "torch.ops.meld.decode_attention": lambda: op(q, kv, out, None, h),
            "  as Inductor calls it": lambda: op(q, kv, out, None, h, v_cache=None, k_scale=1.0, v_scale=1.0),
            "torch_ops.decode_attention()": lambda: torch_ops.decode_attention(attn, q, kv, out=out)}


def stub_attention_variants() -> dict[str, Callable[[], object]]:
    v = attention_case(_StubAttention, "cpu", 8, 64)
    q, kv, out = torch.empty(8, 32, 128), torch.empty(1, 2, 16, 8, 128), torch.empty(8, 32, 128)
    empty, stub = torch.ops.meld_overhead.empty.default, torch.ops.meld_overhead.stub.default
    return {**v, "Library op, empty Python kernel": lambda: empty(q, kv, out, None, 0),
            "custom_op stub (no work at all)": lambda: stub(q, kv, out, None, 0)}


def moe_variants(layer, x, logits, w13, w2, out) -> dict[str, Callable[[], object]]:
    op, h = torch.ops.meld.moe.default, layer.handle
    return {"MoE()": lambda: layer(x, logits, w13, w2, out=out),
            "MoE()'s direct path": lambda: layer._call(x, logits, w13, w2, None, None, out),
            "torch.ops.meld.moe": lambda: op(x, logits, w13, w2, None, None, out, h),
            "torch_ops.moe()": lambda: torch_ops.moe(layer, x, logits, w13, w2, out=out)}


def attention_case(cls, device: str, B: int, length: int, **kw):
    Hq, Hkv, D, P, bf16 = 32, 8, 128, 16, torch.bfloat16
    pb = paged([length] * B, P)
    attn = cls(Hq, Hkv, D, P, bf16, device, **kw)
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    kv = torch.randn(pb.num_pages, 2, P, Hkv, D, dtype=bf16, device=device)
    q = torch.randn(B, Hq, D, dtype=bf16, device=device)
    return attention_variants(attn, q, kv, torch.empty_like(q))


def moe_case(cls, device: str, T: int, H: int = 2048, I: int = 768, E: int = 64, k: int = 8):
    bf16 = torch.bfloat16
    layer = cls(H, I, E, k, bf16, device, max_num_tokens=256)
    w13 = torch.randn(E, 2 * I, H, dtype=bf16, device=device) / H ** 0.5
    w2 = torch.randn(E, H, I, dtype=bf16, device=device) / I ** 0.5
    x = torch.randn(T, H, dtype=bf16, device=device)
    logits = torch.randn(T, E, device=device)
    return moe_variants(layer, x, logits, w13, w2, torch.empty_like(x))


def stub_fast_path(calls: int, rounds: int) -> dict[str, dict[str, float]]:
    """`--stub-fast-path`'s rows (module docstring); CPU time of this thread, as tools/moe_eager.py's."""
    sys.modules.setdefault("torch_op_overhead", sys.modules[__name__])   # (moe_eager imports this script)
    from moe_eager import _StubMoE, stub_driver

    from meld.runtime import fastcall, torch_fastcall

    stub_driver()
    bf16, T, H, I, E, k = torch.bfloat16, 8, 2048, 768, 64, 8
    layer = _StubMoE(H, I, E, k, bf16, "cpu", max_num_tokens=256)
    x, logits, out = torch.randn(T, H, dtype=bf16), torch.randn(T, E), torch.empty(T, H, dtype=bf16)
    w13, w2 = torch.empty(E, 2 * I, H, dtype=bf16), torch.empty(E, H, I, dtype=bf16)
    attn = StubDecode(32, 8, 128, 16, bf16)
    pb = paged([1024] * 8, 16)
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    q, kv = torch.randn(8, 32, 128, dtype=bf16), torch.randn(pb.num_pages, 2, 16, 8, 128, dtype=bf16)
    cases = {"stub attention B=8": attention_variants(attn, q, kv, torch.empty_like(q)),
             "stub moe T=8": moe_variants(layer, x, logits, w13, w2, out)}
    none = lambda: None  # noqa: E731
    a, b, c = torch.ones(1), torch.ones(1), torch.empty(1)
    res = {"reference (cpu)": time_calls({"torch.add(a, b, out=c)": lambda: torch.add(a, b, out=c)}, calls, rounds,
                                         none, time.thread_time),
           **{f"{name}, Python kernels (cpu)": time_calls(v, calls, rounds, none, time.thread_time)
              for name, v in cases.items()}}
    if not torch_ops.fast_path("cpu"):
        return res
    torch_fastcall.set_driver(fastcall._lib)
    for name, variants in cases.items():
        hits = torch_fastcall.hits()
        res[f"{name}, C++ fast path (cpu)"] = times = time_calls(variants, calls, rounds, none, time.thread_time)
        times["fast-path calls"] = torch_fastcall.hits() - hits
    return res


def measure(calls: int, rounds: int, cuda: bool) -> dict[str, dict[str, float]]:
    none = lambda: None  # noqa: E731
    a, b, c = torch.ones(1), torch.ones(1), torch.empty(1)
    res = {"reference (cpu)": time_calls({"torch.add(a, b, out=c)": lambda: torch.add(a, b, out=c)}, calls, rounds, none),
           "stub attention (cpu)": time_calls(stub_attention_variants(), calls, rounds, none),
           "stub moe (cpu)": time_calls(moe_case(_StubMoE, "cpu", 8, H=64, I=32, E=4, k=2), calls, rounds, none)}
    if cuda:
        from meld.runtime import torch_fastcall

        sync = torch.cuda.synchronize
        a, b, c = (torch.ones(1, device="cuda") for _ in range(3))
        res["reference (cuda)"] = time_calls({"torch.add(a, b, out=c)": lambda: torch.add(a, b, out=c)},
                                             min(calls, 300), rounds, sync)
        cap = dict(max_batch_size=64, max_num_pages=64 * 64)
        for name, variants, n in (
                ("attention B=8 x 1024 tokens (cuda)", attention_case(meld.DecodeAttention, "cuda", 8, 1024, **cap),
                 min(calls, 300)),
                ("moe T=8 (cuda)", moe_case(meld.MoE, "cuda", 8), min(calls, 100))):
            hits = torch_fastcall.hits()
            res[name] = time_calls(variants, n, rounds, sync)
            res[name]["fast-path calls"] = torch_fastcall.hits() - hits
            res[name.replace("(cuda)", "(cuda), launch stubbed")] = to_launch(variants, n, rounds)
    return res


def to_launch(variants: dict[str, Callable[[], object]], calls: int, rounds: int) -> dict[str, float]:
    """The op calls' host time up to the launch: the same calls on the GPU with the fast path's cuLaunchKernelEx
    a no-op C function (tools/moe_eager.py's stub), so the driver's own launch cost is left out."""
    sys.modules.setdefault("torch_op_overhead", sys.modules[__name__])   # (moe_eager imports this script)
    from moe_eager import stub_library

    from meld.runtime import fastcall, torch_fastcall

    ops = {k: v for k, v in variants.items() if "direct" not in k}   # (the direct paths launch through ctypes)
    torch_fastcall.set_driver(stub_library())
    try:
        hits = torch_fastcall.hits()
        times = time_calls(ops, calls, rounds, lambda: None)
        times["fast-path calls"] = torch_fastcall.hits() - hits
    finally:
        torch_fastcall.set_driver(fastcall._lib)   # (libcuda: the real rows above loaded it)
    return times


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cuda", action="store_true", help="also time the real operators on the GPU")
    ap.add_argument("--stub-fast-path", action="store_true", help="time the C++ fast path with stubbed launches "
                    "(no GPU needed) instead")
    ap.add_argument("--calls", type=int, default=2000, help="calls per round (at most 300 / 100 on the GPU)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--json", type=Path, help="write the results here too")
    args = ap.parse_args(argv)
    res = stub_fast_path(args.calls, args.rounds) if args.stub_fast_path else \
        measure(args.calls, args.rounds, args.cuda)
    for case, times in res.items():
        base = next(iter(times.values()))
        print(case)
        for name, us in times.items():
            if name == "fast-path calls":
                print(f"  {name:34s} {us}")
            else:
                print(f"  {name:34s} {us:7.2f} us/call  ({us - base:+.2f})")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
