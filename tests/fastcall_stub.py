"""The torch ops' C++ fast path on the CPU with launches stubbed (run by tests/test_torch_fastcall.py in a process
of its own: it installs the fast path on the CPU dispatch keys, which must not leak into other tests).

CPU operators run their GPU call paths (tools/moe_eager.py's `_StubMoE`, tools/torch_op_overhead.py's
`StubDecode`) against a stand-in for libcuda whose cuLaunchKernelEx logs each launch (function, grid, block, shared
memory, stream, attributes and the parameter bytes). A case records one call (the slow path: Python checks,
launches, records), then makes another call through the op and the same call again with the record dropped (the
slow path), and reports whether the first of those was a fast-path launch and whether both logged the same bytes.
Prints JSON.
"""
import ctypes
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tools")]

import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from meld.codegen.moe_kernel import BLOCK_TOKEN_CHOICES  # noqa: E402
from meld.ops import torch_ops  # noqa: E402
from meld.runtime import driver, fastcall, torch_fastcall  # noqa: E402
from meld.workloads import paged  # noqa: E402
from moe_eager import _StubMoE  # noqa: E402
from torch_op_overhead import StubDecode  # noqa: E402

_DRIVER = r"""
#include <string.h>
typedef struct { int id, pad; unsigned v[16]; } Attr;
typedef struct { unsigned g[3], b[3], smem; void *stream; Attr *attrs; unsigned n; } Cfg;
static unsigned char log_[64][4096];
static long len_[64], count_, blob_;
void stub_set_blob(long n) { blob_ = n; }
long stub_count(void) { return count_; }
const unsigned char *stub_log(long i, long *n) { *n = len_[i % 64]; return log_[i % 64]; }
int cuLaunchKernelEx(const Cfg *c, void *f, void **params, void **extra) {
  unsigned char *p = log_[count_ % 64];
  memcpy(p, &f, 8); memcpy(p + 8, c->g, 12); memcpy(p + 20, c->b, 12); memcpy(p + 32, &c->smem, 4);
  memcpy(p + 36, &c->stream, 8); memcpy(p + 44, &c->n, 4); memcpy(p + 48, c->attrs, c->n * sizeof(Attr));
  long n = 48 + c->n * sizeof(Attr);
  memcpy(p + n, params[0], blob_);
  len_[count_++ % 64] = n + blob_;
  return 0;
}
int cuMemcpyDtoDAsync_v2(unsigned long long d, unsigned long long s, unsigned long n, void *st) { return 0; }
int cuOccupancyMaxActiveClusters(int *n, void *f, const void *c) { *n = 0; return 0; }
int cuFuncSetAttribute(void *f, int a, int v) { return 0; }
int cuGetErrorString(int e, const char **m) { *m = "stub"; return 0; }
"""
BF16 = torch.bfloat16
H, I, E, K = 128, 64, 8, 2


def main() -> None:
    folder = Path(tempfile.mkdtemp(prefix="meld-fastcall-stub-"))
    (folder / "stub.c").write_text(_DRIVER)
    subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", str(folder / "libstub.so"), str(folder / "stub.c")],
                   check=True)
    stub = fastcall.load(str(folder / "libstub.so"))
    stub.stub_log.restype = ctypes.POINTER(ctypes.c_ubyte)
    stub.stub_log.argtypes = [ctypes.c_long, ctypes.POINTER(ctypes.c_long)]
    stub.stub_count.restype = ctypes.c_long
    fastcall._lib = stub
    driver.current_stream = lambda device: 0
    assert torch_ops.fast_path("cpu")
    torch_fastcall.set_driver(stub)

    layer = _StubMoE(H, I, E, K, BF16, "cpu", max_num_tokens=64)
    stub.stub_set_blob(ctypes.sizeof(layer.lowering.params.ctype))
    op, h = torch.ops.meld.moe.default, layer.handle
    handle = [h]   # (the operator the cases drop the record of)
    w13, w2 = torch.empty(E, 2 * I, H, dtype=BF16), torch.empty(E, H, I, dtype=BF16)

    def launches(fn) -> tuple[list[bytes], int]:
        """The launches `fn` logged and whether it was a fast-path call."""
        n0, hits = stub.stub_count(), torch_fastcall.hits()
        fn()
        out = []
        for i in range(n0, stub.stub_count()):
            n = ctypes.c_long()
            p = stub.stub_log(i, ctypes.byref(n))
            out.append(ctypes.string_at(p, n.value))
        return out, torch_fastcall.hits() - hits

    def case(recorded, call) -> dict:
        """Record `recorded` (a slow call), then `call` (fast if its arguments match) and `call` again slowly."""
        torch_fastcall.drop(handle[0])
        launches(recorded)
        fast, hit = launches(call)
        torch_fastcall.drop(handle[0])
        slow, slow_hit = launches(call)
        return {"hit": hit, "slow_hit": slow_hit, "same": fast == slow, "launches": len(fast)}

    def x_(T, **kw):
        return torch.randn(T, H, **kw).to(BF16)

    x, logits, out = x_(5), torch.randn(5, E), torch.empty(5, H, dtype=BF16)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(5)]).to(torch.int32)
    tw = torch.rand(5, K)
    base = lambda: op(x, logits, w13, w2, None, None, out, h)  # noqa: E731
    x2, out2, logits2 = x_(5), torch.empty(5, H, dtype=BF16), torch.randn(5, E)
    tw2, ids2, ids64 = tw.clone(), ids.clone(), ids.long()
    x3, logits3, logits_bf16, x_grad = x_(3), torch.randn(3, E), logits.to(BF16), x.clone().requires_grad_()
    out_g = torch.empty(5, H, dtype=BF16)
    unaligned = torch.empty(5 * H + 4, dtype=BF16)[4:].view(5, H)   # (8 bytes off: the slow path copies it)
    wide, w13b = x_(5 * 2)[::2], w13.clone()   # (x of another row stride; weights elsewhere: their maps differ)
    res = {
        "same arguments": case(base, base),
        "other tensors": case(base, lambda: op(x2, logits2, w13, w2, None, None, out2, h)),
        "topk routing": case(lambda: op(x, None, w13, w2, tw, ids, out, h),
                             lambda: op(x2, None, w13, w2, tw2, ids2, out2, h)),
        "new shape": case(base, lambda: op(x3, logits3, w13, w2, None, None, out[:3], h)),
        "new dtype": case(base, lambda: op(x, logits_bf16, w13, w2, None, None, out, h)),
        "new stride": case(base, lambda: op(wide, logits, w13, w2, None, None, out, h)),
        "routing by ids": case(base, lambda: op(x, None, w13, w2, tw, ids, out, h)),
        "int64 ids (copied)": case(lambda: op(x, None, w13, w2, tw, ids64, out, h),
                                   lambda: op(x, None, w13, w2, tw, ids64, out, h)),
        "requires grad": case(base, lambda: op(x_grad, logits, w13, w2, None, None, out_g, h)),   # (ties out_g)
        "other weights": case(base, lambda: op(x, logits, w13b, w2, None, None, out, h)),
        "unaligned x": case(base, lambda: op(unaligned, logits, w13, w2, None, None, out, h)),
    }
    # One layer object serving two layers' weights (their tensor maps: addresses the records require), and calls
    # with and without routing by ids: each kind of call is recorded once, then all are fast.
    torch_fastcall.drop(h)
    calls = [lambda: op(x, logits, w13, w2, None, None, out, h), lambda: op(x, logits, w13b, w2, None, None, out, h),
             lambda: op(x, None, w13, w2, tw, ids, out, h)]
    res["alternating"] = {"hits": [launches(c)[1] for _ in range(3) for c in calls]}
    torch_fastcall.drop(h)
    base()   # (recorded)
    errors = {}
    for name, call in {"out overlaps x": lambda: op(x, logits, w13, w2, None, None, x, h),
                       "x of another width": lambda: op(x_(5)[:, :64], logits, w13, w2, None, None, out, h)}.items():
        try:
            call()
            errors[name] = None
        except Exception as e:   # noqa: BLE001   (reported)
            errors[name] = f"{type(e).__name__}: {e}"
    decode = {}
    for cluster in (1, 16):   # (one grid; three grids of 16-, 8- and 2-CTA clusters)
        attn = StubDecode(32, 8, 128, 16, BF16, cluster_size=cluster)
        stub.stub_set_blob(ctypes.sizeof(attn.lowering.params.ctype))
        op, handle[0] = torch.ops.meld.decode_attention.default, attn.handle
        pb = paged([30, 100, 7], 16)
        attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
        q, q2 = torch.randn(3, 32, 128).to(BF16), torch.randn(3, 32, 128).to(BF16)
        kv, kv2 = (torch.randn(pb.num_pages + 2, 2, 16, 8, 128).to(BF16) for _ in range(2))
        k, v = torch.randn(2, pb.num_pages, 16, 8, 128).to(BF16).unbind(0)
        out, out2, lse, lse2 = torch.empty_like(q), torch.empty_like(q), torch.empty(3, 32), torch.empty(3, 32)
        q_heads_outer = q2.transpose(0, 1).contiguous().transpose(0, 1)   # (strides (128, 384, 1))
        base = lambda: op(q, kv, out, None, attn.handle)  # noqa: E731
        a = attn.handle
        base()   # (the launch right after plan(): not recorded)
        decode[f"cluster {cluster}"] = {
            "same arguments": case(base, base),
            "other tensors": case(base, lambda: op(q2, kv2, out2, None, a)),
            "with lse": case(lambda: op(q, kv, out, lse, a), lambda: op(q2, kv2, out2, lse2, a)),
            "k and v apart": case(lambda: op(q, k, out, None, a, v), lambda: op(q2, k, out2, None, a, v)),
            "lse not recorded": case(base, lambda: op(q, kv, out, lse, a)),
            "other page count": case(base, lambda: op(q, kv[:-1], out, None, a)),
            "q of other strides": case(base, lambda: op(q_heads_outer, kv, out, None, a)),
        }
        torch_fastcall.drop(a)
        alternating = [lambda: op(q, kv, out, None, a), lambda: op(q, kv, out, lse, a),
                       lambda: op(q, k, out, None, a, v)]
        decode[f"cluster {cluster}"]["alternating"] = {"hits": [launches(c)[1] for _ in range(3) for c in alternating]}
        pb = paged([50, 3, 9], 16)
        attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)   # (drops the records)
        hits = [launches(base)[1] for _ in range(3)]   # the first after a plan, then recorded, then fast
        decode[f"cluster {cluster}"]["re-plan"] = {"hits": hits}
    def tripped():   # a kernel's watchdog gave up (its record in host memory): run() raises, fast path or not
        attn._watchdog.record.tripped = 1
        try:
            op(q, kv, out, None, attn.handle)
        finally:
            attn._watchdog.record.tripped = 0

    for _ in range(2):
        op(q, kv, out, None, attn.handle)   # (recorded)
    for name, call in {"scale on a bf16 cache": lambda: op(q, kv, out, None, attn.handle, None, 2.0, 1.0),
                       "the MoE's handle": lambda: op(q, kv, out, None, layer.handle),   # (recorded: the MoE)
                       "watchdog tripped": tripped,
                       # torch.compile's and opcheck's tracing (fake and functional tensors, no data pointer to
                       # patch) with a record in place: the Python path's fake kernel, never the record
                       "opcheck with a record": lambda: torch.library.opcheck(op, (q, kv, out.zero_(), None,
                                                                                   attn.handle))}.items():
        try:
            call()
            errors[name] = None
        except Exception as e:   # noqa: BLE001   (reported)
            errors[name] = f"{type(e).__name__}: {e}"
    print(json.dumps({"cases": res, "errors": errors, "decode": decode, "eager": eager(stub, launches)}))


def eager(stub, launches) -> dict:
    """The entry points' route through the ops: `MoE()` and `run()` calls (counted when they call the op), each
    kind's first call recorded and the next fast, launching the direct path's bytes; the calls the route leaves
    to the direct path; and errors raised through the op as the direct path raises them."""
    op_calls = {"moe": 0, "decode_attention": 0}

    def counted(name):
        op = getattr(torch_ops, f"_{name}_op")

        def call(*args):
            op_calls[name] += 1
            return op(*args)
        return call

    torch_ops._moe_op, torch_ops._decode_attention_op = counted("moe"), counted("decode_attention")

    def calls(fns) -> dict:
        """Each call's fast-path hits and op calls."""
        hits, ops = [], []
        for fn in fns:
            before = dict(op_calls)
            hits.append(launches(fn)[1])
            ops.append(sum(op_calls.values()) - sum(before.values()))
        return {"hits": hits, "op calls": ops}

    def raised(fn) -> str | None:
        try:
            fn()
        except Exception as e:   # noqa: BLE001   (reported)
            return f"{type(e).__name__}: {e}"
        return None

    def moded(base, fn):
        """fn() under a mode of `base` that passes every call through."""
        hook = "__torch_dispatch__" if base is TorchDispatchMode else "__torch_function__"
        through = type("Through", (base,), {hook: lambda self, func, types, args=(), kwargs=None:
                                            func(*args, **(kwargs or {}))})
        with through():
            return fn()

    res = {}
    layer = _StubMoE(H, I, E, K, BF16, "cpu", max_num_tokens=64)
    stub.stub_set_blob(ctypes.sizeof(layer.lowering.params.ctype))
    w13, w2 = torch.empty(E, 2 * I, H, dtype=BF16), torch.empty(E, H, I, dtype=BF16)
    x, x2, logits = torch.randn(5, H).to(BF16), torch.randn(5, H).to(BF16), torch.randn(5, E)
    out = torch.empty(5, H, dtype=BF16)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(5)]).to(torch.int32)
    tw = torch.rand(5, K)
    got = []
    res["moe"] = calls([lambda: got.append(layer(x, logits, w13, w2, out=out)),
                        lambda: got.append(layer(x, logits, w13, w2, out=out)),
                        lambda: got.append(layer(x2, logits, w13, w2)),
                        lambda: layer(x, None, w13, w2, topk_weights=tw, topk_ids=ids, out=out),
                        lambda: layer(x2, None, w13, w2, topk_weights=tw, topk_ids=ids)])
    res["moe"]["returns out"] = got[0] is out and got[1] is out
    res["moe"]["allocated"] = [str(got[2].dtype), list(got[2].shape), got[2].data_ptr() != out.data_ptr()]
    fast, _ = launches(lambda: layer(x, logits, w13, w2, out=out))
    direct, _ = launches(lambda: layer._call(x, logits, w13, w2, None, None, out))
    res["moe"]["same as direct"] = fast == direct
    res["moe direct"] = calls([lambda: layer(x, logits, w13, w2, out=out, block_tokens=BLOCK_TOKEN_CHOICES[0]),
                               lambda: layer(x, None, w13, w2, topk_weights=tw, topk_ids=ids.long(), out=out),
                               lambda: layer(x.clone().requires_grad_(), logits, w13, w2),
                               lambda: moded(TorchDispatchMode, lambda: layer(x, logits, w13, w2, out=out)),
                               lambda: moded(TorchFunctionMode, lambda: layer(x, logits, w13, w2, out=out))])
    bad_out = torch.empty(5, H)   # (float32: the route takes it, the op's Python kernel refuses it)
    res["moe errors"] = [raised(lambda: layer(x, logits, w13, w2, out=bad_out)),
                         raised(lambda: layer._call(x, logits, w13, w2, None, None, bad_out)),
                         raised(lambda: layer(x, logits, w13, w2, out=x)),
                         raised(lambda: layer._call(x, logits, w13, w2, None, None, x))]
    # (shapes the route no longer tests: through the op, whose Python kernel raises the direct path's errors)
    x_wide, w13_narrow = torch.randn(5, H + 8).to(BF16), w13[:, :-8]
    res["moe shape errors"] = calls([lambda: res.setdefault("moe shape raised", []).append(
                                         raised(lambda: layer(x_wide, logits, w13, w2))),
                                     lambda: res["moe shape raised"].append(
                                         raised(lambda: layer(x, logits, w13_narrow, w2)))])
    res["moe shape raised"] += [raised(lambda: layer._call(x_wide, logits, w13, w2, None, None, None)),
                                raised(lambda: layer._call(x, logits, w13_narrow, w2, None, None, None))]
    attn = StubDecode(32, 8, 128, 16, BF16)
    stub.stub_set_blob(ctypes.sizeof(attn.lowering.params.ctype))
    pb = paged([30, 100, 7], 16)
    q, q2 = torch.randn(3, 32, 128).to(BF16), torch.randn(3, 32, 128).to(BF16)
    kv = torch.randn(pb.num_pages, 2, 16, 8, 128).to(BF16)
    k, v = torch.randn(2, pb.num_pages, 16, 8, 128).to(BF16).unbind(0)
    out = torch.empty_like(q)
    got = []
    for lens in ([30, 100, 7], [50, 3, 9]):   # (the second plan drops the records)
        pb = paged(lens, 16)
        attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
        res[f"run {lens}"] = calls([lambda: got.append(attn.run(q, kv, out=out)),   # (after plan(): direct)
                                    lambda: got.append(attn.run(q, kv, out=out)),   # (recorded)
                                    lambda: got.append(attn.run(q2, kv)),
                                    lambda: got.append(attn.run(q, kv, return_lse=True)),
                                    lambda: got.append(attn.run(q2, kv, return_lse=True)),
                                    lambda: attn.run(q, (k, v), out=out),
                                    lambda: attn.run(q2, (k, v))])
    res["run returns"] = [got[1] is out, type(got[3]).__name__, [list(t.shape) for t in got[4]],
                          str(got[4][1].dtype)]
    fast, _ = launches(lambda: attn.run(q, kv, out=out))
    direct, _ = launches(lambda: attn._run((q, kv), False, out, None))
    res["run"] = {"same as direct": fast == direct}
    res["run direct"] = calls([lambda: attn.run(q, kv, out=out, k_scale=1),   # (an int scale: the direct path)
                               lambda: attn.run(q.clone().requires_grad_(), kv),
                               lambda: moded(TorchDispatchMode, lambda: attn.run(q, kv, out=out)),
                               lambda: moded(TorchFunctionMode, lambda: attn.run(q, kv, out=out))])
    res["run errors"] = [raised(lambda: attn.run(q, kv, k_scale=2.0)),
                         raised(lambda: attn._run((q, kv), False, None, None, k_scale=2.0, v_scale=1.0)),
                         raised(lambda: attn.run(q[:2], kv)), raised(lambda: attn._run((q[:2], kv), False, None, None)),
                         raised(lambda: attn.run(q, kv, return_lse=1)), raised(lambda: attn.run(q, [k, v])),
                         raised(lambda: attn.run(q, (k, None))),
                         raised(lambda: attn._run((q, (k, None)), False, None, None))]
    return res


if __name__ == "__main__":
    main()
