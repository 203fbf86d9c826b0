"""meld's operators as torch custom ops, so that `torch.compile(fullgraph=True)` of a model calling meld
traces it as one opaque node instead of breaking the graph.

A custom op takes tensors and scalars, not Python objects, so each operator is named by an int, its
`handle` (given at construction), which `meld.ops.registry` maps back to it.

    torch.ops.meld.decode_attention(q, kv_cache, out, lse, handle, v_cache=None, k_scale=1.0, v_scale=1.0) -> ()
                                                                                      # DecodeAttention.run
    torch.ops.meld.decode_mla(q_nope, q_pe, ckv_cache, kpe_cache, out, lse, handle, kv_scale=1.0) -> ()
                                                                                      # DecodeMLA.run
    torch.ops.meld.moe(x, router_logits, w13, w2, topk_weights, topk_ids, out, handle) -> ()   # MoE()

All write their preallocated outputs, declared mutated (functionalisation and Inductor's re-inplacing
handle them, as for vLLM's `unified_attention_with_output`), and return nothing; their fake
implementations check dtypes and shapes against the operator when a graph is traced. Like vLLM's
`direct_register_custom_op`, they are defined with `torch.library.Library` rather than
`torch.library.custom_op`, whose Python-side dispatch costs several times more per call;
tools/torch_op_overhead.py times the op path against the direct call. Torch's dispatch into any Python kernel
of these schemas costs about the whole budget issue 42 allows an op call (bench/RESULTS.md, "the op call's host
path"), so on a GPU the ops' CUDA and AutogradCUDA kernels are C++ (`fast_path`, meld.runtime.torch_fastcall):
they replay the launches the Python kernel recorded for the same kinds of arguments, and send every other call to
that Python kernel, registered as the twin op `meld::_<op>_slow`. meld has no backward: an autograd
kernel ties each op's outputs to its inputs that require grad, so a backward through them raises
NotImplementedError naming the op (never a gradient that silently leaves the op out).

`DecodeAttention.run`, `DecodeMLA.run` and `MoE.__call__` emit these ops by themselves while Dynamo traces,
so model code needs no change, and call them eagerly too where the C++ fast path is installed, for arguments the
schemas carry as they are (`Operator._op_route`; the ops' Python kernels run the entry points' bodies, `_run` and
`MoE._call`); `decode_attention()`, `decode_mla()` and `moe()` below take the op path always (eager included). plan()
stays outside the graph, once per step, as engines build their attention metadata.

Example:
    attn = meld.DecodeAttention(32, 8, 128, 16, torch.bfloat16, "cuda")   # attn.handle names it
    step = torch.compile(model, fullgraph=True)      # model calls attn.run(q, kv_cache) in every layer
    attn.plan(kv_indptr, kv_indices, kv_last_page_len)   # once per step, outside the compiled region
    logits = step(tokens)                                # one meld::decode_attention node per layer
    torch.ops.meld.decode_attention(q, kv_cache, out, None, attn.handle)   # or the op itself
    torch.ops.meld.decode_attention(q, k_cache, out, None, attn.handle, v_cache)   # K and V in two tensors
    torch.ops.meld.decode_attention(q, kv_e4m3, out, None, fp8.handle, None, 0.02, 0.03)   # an FP8 cache's scales
"""
from __future__ import annotations

import torch

from .. import config
from ..runtime import torch_fastcall
from .checks import check_tensors, expect, grad_inputs, no_backward
from .decode_attention import DecodeAttention, kv_parts
from .decode_mla import DecodeMLA
from .moe import MoE
from .registry import lookup

# --- the ops --------------------------------------------------------------------------------------------
_lib = torch.library.Library("meld", "FRAGMENT")
# The Python kernels at each backend key, apart: installing the C++ fast path on a device's keys replaces them.
_backends = {key: torch.library.Library("meld", "FRAGMENT") for key in ("CPU", "CUDA")}
_ops: dict[str, tuple[str, object, tuple[int, ...]]] = {}   # name: (schema, impl, written), for the fast path


def _autograd(name: str, impl, written: tuple[int, ...]):
    """Op `name`'s autograd kernel: the arguments at `written` (the mutated outputs) are tied to the inputs that
    require grad, so that a backward through them raises NotImplementedError naming torch.ops.meld.`name` (meld has
    no backward)."""
    op = getattr(torch.ops.meld, name).default
    shown = name.removeprefix("_").removesuffix("_slow")   # (the fast path's twin reports as its op)

    def autograd(keyset, *args):
        grads = grad_inputs(*args)
        if grads is None and type(args[0]) is torch.Tensor:   # eager, nothing to tie: the kernel itself (a
            return impl(*args)                                # redispatch adds host time to every call)
        with torch._C._AutoDispatchBelowAutograd():
            op.redispatch(keyset & torch._C._after_autograd_keyset, *args)
        no_backward(f"torch.ops.meld.{shown}", grads, tuple(args[i] for i in written if args[i] is not None))

    return autograd


def _define(name: str, schema: str, impl, fake, written: tuple[int, ...]) -> None:
    """Op `name` of `schema`, its kernel `impl` (CPU and CUDA), its `fake`, and its autograd kernel (`_autograd`)."""
    _lib.define(name + schema, tags=(torch.Tag.pt2_compliant_tag,))
    for key, lib in _backends.items():
        lib.impl(name, impl, key)
    torch.library.register_fake(f"meld::{name}", fake, lib=_lib)
    _lib.impl(name, _autograd(name, impl, written), "Autograd", with_keyset=True)
    _ops[name] = (schema, impl, written)


def fast_path(device_type: str = "cuda") -> bool:
    """Give the ops on `device_type`'s dispatch keys the C++ kernels of meld.runtime.torch_fastcall (once; "cpu":
    for tests with stubbed launches), each falling back to its Python twin `meld::_<op>_slow`. False where the
    library cannot be built or MELD_TORCH_FASTCALL=0: the Python kernels stay."""
    key = {"cuda": "CUDA", "cpu": "CPU"}[device_type]
    if key not in _backends:
        return True
    if not config.torch_fastcall() or torch_fastcall.load() is None:
        return False
    for name, (schema, impl, written) in _ops.items():
        slow = f"_{name}_slow"
        if not hasattr(torch.ops.meld, slow):
            _lib.define(slow + schema)
            _lib.impl(slow, _autograd(slow, impl, written), "Autograd", with_keyset=True)
        _lib.impl(slow, impl, key)
    _backends.pop(key)._destroy()
    return torch_fastcall.install(device_type, {name: schema[:schema.index("int handle")].count(",")
                                                for name, (schema, _, _) in _ops.items()})


def _recorded(name: str, layer, args: tuple, written: tuple[int, ...], fields: dict[str, tuple[int, bool]],
              pinned: tuple[int, ...], steady: bool, call) -> None:
    """`call()`, recorded for the fast path (`torch_fastcall.recorded`) where it is installed on the operator's
    device and the launches are the ones every call of these arguments makes (`steady`; not a profiling build, not
    an operator that sets its launches' parameters elsewhere)."""
    if steady and layer._fastcall and torch_fastcall.installed(layer.device):
        torch_fastcall.recorded(name, layer.handle, layer, args, written, fields, pinned, call)
    else:
        call()


def _required_out(op: str, out: object) -> None:
    """The op writes `out` and returns nothing: without one its result would be lost."""
    if out is None:
        raise ValueError(f"out must be a preallocated tensor: torch.ops.meld.{op} writes its result there and "
                         "returns nothing, got None")


def _kv_cache(kv_cache, v_cache):
    """The op's cache arguments as DecodeAttention.run's kv_cache: one cache, or with v_cache (k_cache, v_cache)."""
    return kv_cache if v_cache is None else (kv_cache, v_cache)


def _decode_attention_impl(q, kv_cache, out, lse, handle, v_cache=None, k_scale=1.0, v_scale=1.0) -> None:
    _required_out("decode_attention", out)
    attn = lookup(handle, DecodeAttention)
    # The parameters run() writes q, K, V, out and lse's addresses into (V: K's plus its offset in one cache); the
    # launch right after a plan() differs from the later ones (no overlap with the plan's kernel): not recorded.
    fields = {"q": (0, False), "k": (1, False), "v": (1, True) if v_cache is None else (5, False), "out": (2, False),
              "lse": (3, False)}
    _recorded("decode_attention", attn, (q, kv_cache, out, lse, handle, v_cache, k_scale, v_scale), (2, 3), fields,
              (1, 5) if getattr(attn, "_tensor_maps", None) is not None else (),   # (the CPU executor: none)
              attn._replayable,
              lambda: attn._run((q, _kv_cache(kv_cache, v_cache)), False, out, lse, k_scale=k_scale, v_scale=v_scale))


def _decode_attention_fake(q, kv_cache, out, lse, handle, v_cache=None, k_scale=1.0, v_scale=1.0) -> None:
    _required_out("decode_attention", out)
    attn = lookup(handle, DecodeAttention)
    Hq, D, dt, dev = attn.num_qo_heads, attn.head_dim, attn.dtype, attn.device
    expect("q", q, dt, (None, Hq, D), "batch, num_qo_heads, head_dim", dev)
    attn._check_kv_shapes(kv_parts(_kv_cache(kv_cache, v_cache)))
    attn._check_scales(k_scale, v_scale)
    expect("out", out, dt, (q.shape[0], Hq, D), "like q", dev)
    if lse is not None:
        expect("lse", lse, torch.float32, (q.shape[0], Hq), "batch, num_qo_heads", dev)


def _decode_mla_impl(q_nope, q_pe, ckv_cache, kpe_cache, out, lse, handle, kv_scale=1.0) -> None:
    _required_out("decode_mla", out)
    mla = lookup(handle, DecodeMLA)
    _recorded("decode_mla", mla, (q_nope, q_pe, ckv_cache, kpe_cache, out, lse, handle, kv_scale), (4, 5),
              {"q_nope": (0, False), "q_pe": (1, False), "out": (4, False), "lse": (5, False)}, (2, 3),
              mla._replayable,
              lambda: mla._run((q_nope, q_pe, ckv_cache, kpe_cache), False, out, lse, kv_scale=kv_scale))


def _decode_mla_fake(q_nope, q_pe, ckv_cache, kpe_cache, out, lse, handle, kv_scale=1.0) -> None:
    _required_out("decode_mla", out)
    mla = lookup(handle, DecodeMLA)
    H, Dc, Dr, P, dt, dev = mla.num_heads, mla.head_dim_ckv, mla.head_dim_kpe, mla.page_size, mla.dtype, mla.device
    expect("q_nope", q_nope, dt, (None, H, Dc), "batch, num_heads, head_dim_ckv", dev)
    expect("q_pe", q_pe, dt, (q_nope.shape[0], H, Dr), "batch, num_heads, head_dim_kpe", dev)
    expect("ckv_cache", ckv_cache, mla.kv_dtype, (None, P, Dc), "num_pages, page_size, head_dim_ckv", dev)
    expect("kpe_cache", kpe_cache, mla.kv_dtype, (ckv_cache.shape[0], P, Dr), "num_pages, page_size, head_dim_kpe",
           dev)
    mla._check_scale(kv_scale)
    expect("out", out, dt, (q_nope.shape[0], H, Dc), "like q_nope", dev)
    if lse is not None:
        expect("lse", lse, torch.float32, (q_nope.shape[0], H), "batch, num_heads", dev)


def _moe_impl(x, router_logits, w13, w2, topk_weights, topk_ids, out, handle) -> None:
    _required_out("moe", out)
    layer = lookup(handle, MoE)
    packed = isinstance(w13, torch.Tensor) and w13.dim() == 6   # (plain weights: their tensor maps hold them)
    fields = {"x": (0, False), "out": (6, False), "logits": (1, False), "topk_ids_in": (5, False),
              "topk_w_in": (4, False), **({"w13_packed": (2, False), "w2_packed": (3, False)} if packed else {})}
    _recorded("moe", layer, (x, router_logits, w13, w2, topk_weights, topk_ids, out, handle), (6,), fields,
              () if packed else (2, 3), layer._replayable,
              lambda: layer._call(x, router_logits, w13, w2, topk_weights, topk_ids, out))


def _moe_fake(x, router_logits, w13, w2, topk_weights, topk_ids, out, handle) -> None:
    _required_out("moe", out)
    layer = lookup(handle, MoE)
    H, dt, dev = layer.hidden_size, layer.dtype, layer.device
    T = layer._check_x(x)
    layer._check_weights(w13, w2, contiguous=False)
    layer._check_routing(router_logits, topk_weights, topk_ids, T)
    expect("out", out, dt, (T, H), "tokens x hidden_size", dev)


# v_cache (K and V in two tensors, kv_cache then K) and an FP8 cache's scales (decode_mla's kv_scale too) come
# last, with defaults: calls written before them stay valid.
_define("decode_attention", "(Tensor q, Tensor kv_cache, Tensor(a!) out, Tensor(b!)? lse, int handle, "
        "Tensor? v_cache=None, float k_scale=1.0, float v_scale=1.0) -> ()", _decode_attention_impl,
        _decode_attention_fake, written=(2, 3))
_define("decode_mla", "(Tensor q_nope, Tensor q_pe, Tensor ckv_cache, Tensor kpe_cache, Tensor(a!) out, "
        "Tensor(b!)? lse, int handle, float kv_scale=1.0) -> ()", _decode_mla_impl, _decode_mla_fake, written=(4, 5))
_define("moe", "(Tensor x, Tensor? router_logits, Tensor w13, Tensor w2, Tensor? topk_weights, Tensor? topk_ids, "
        "Tensor(a!) out, int handle) -> ()", _moe_impl, _moe_fake, written=(6,))
_decode_attention_op = torch.ops.meld.decode_attention.default   # the overload: no resolution per call
_decode_mla_op = torch.ops.meld.decode_mla.default
_moe_op = torch.ops.meld.moe.default


# --- callers ----------------------------------------------------------------------------------------------
def _outputs(q: torch.Tensor, dtype: torch.dtype, return_lse: bool, out: torch.Tensor | None,
             lse: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An attention op's outputs, allocated where not given: out like q [batch, heads, width] in dtype, and lse
    [batch, heads] float32 when asked for (the ops write into them: their schemas return nothing)."""
    if out is None:
        out = torch.empty(q.shape, dtype=dtype, device=q.device)
    if return_lse and lse is None:
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    return out, lse


def decode_attention(attn: DecodeAttention, q: torch.Tensor, kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                     *, return_lse: bool = False, out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                     k_scale: float = 1.0, v_scale: float = 1.0):
    """`attn.run(q, kv_cache, ...)` (same arguments and results; kv_cache one tensor or (k_cache, v_cache)) through
    torch.ops.meld.decode_attention."""
    if not isinstance(attn, DecodeAttention):
        raise ValueError(f"attn must be a meld.DecodeAttention, got {type(attn).__name__}")
    if return_lse is not True and return_lse is not False:
        raise ValueError(f"return_lse must be True or False, got {return_lse!r}")
    caches = kv_parts(kv_cache)
    check_tensors({"q": q, **caches}, {"out": out, "lse": lse})
    if q.dim() != 3:
        expect("q", q, attn.dtype, (None, attn.num_qo_heads, attn.head_dim), "batch, num_qo_heads, head_dim")
    k, v = caches.values() if len(caches) == 2 else (kv_cache, None)
    k_scale, v_scale = attn._check_scales(k_scale, v_scale)   # (floats: the schema's check would be a RuntimeError)
    return _decode_attention_call(attn, q, k, v, return_lse, out, lse, k_scale, v_scale)


def _decode_attention_call(attn: DecodeAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                           return_lse: bool, out: torch.Tensor | None, lse: torch.Tensor | None, k_scale: float,
                           v_scale: float):
    """The op's call of arguments its schema carries (`decode_attention()`'s, and `DecodeAttention.run`'s eager
    route): outputs allocated where not given, and run()'s results."""
    out, lse = _outputs(q, attn.dtype, return_lse, out, lse)
    extra = () if v is None and k_scale == v_scale == 1.0 else (v, k_scale, v_scale)   # (defaults left out: the
    _decode_attention_op(q, k, out, lse, attn.handle, *extra)                        # dispatcher parses each one)
    return (out, lse) if return_lse else out


def decode_mla(mla: DecodeMLA, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor,
               kpe_cache: torch.Tensor, *, return_lse: bool = False, out: torch.Tensor | None = None,
               lse: torch.Tensor | None = None, kv_scale: float = 1.0):
    """`mla.run(q_nope, q_pe, ckv_cache, kpe_cache, ...)` (same arguments and results) through
    torch.ops.meld.decode_mla."""
    if not isinstance(mla, DecodeMLA):
        raise ValueError(f"mla must be a meld.DecodeMLA, got {type(mla).__name__}")
    if return_lse is not True and return_lse is not False:
        raise ValueError(f"return_lse must be True or False, got {return_lse!r}")
    check_tensors({"q_nope": q_nope, "q_pe": q_pe, "ckv_cache": ckv_cache, "kpe_cache": kpe_cache},
                  {"out": out, "lse": lse})
    if q_nope.dim() != 3:
        expect("q_nope", q_nope, mla.dtype, (None, mla.num_heads, mla.head_dim_ckv), "batch, num_heads, head_dim_ckv")
    kv_scale = mla._check_scale(kv_scale)   # (a float: the schema's check would be a RuntimeError)
    return _decode_mla_call(mla, q_nope, q_pe, ckv_cache, kpe_cache, return_lse, out, lse, kv_scale)


def _decode_mla_call(mla: DecodeMLA, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor,
                     kpe_cache: torch.Tensor, return_lse: bool, out: torch.Tensor | None, lse: torch.Tensor | None,
                     kv_scale: float):
    """The op's call of arguments its schema carries (`decode_mla()`'s, and `DecodeMLA.run`'s eager route):
    outputs allocated where not given, and run()'s results."""
    out, lse = _outputs(q_nope, mla.dtype, return_lse, out, lse)
    _decode_mla_op(q_nope, q_pe, ckv_cache, kpe_cache, out, lse, mla.handle, *(() if kv_scale == 1.0 else (kv_scale,)))
    return (out, lse) if return_lse else out


def moe(layer: MoE, x: torch.Tensor, router_logits: torch.Tensor | None, w13: torch.Tensor, w2: torch.Tensor, *,
        topk_weights: torch.Tensor | None = None, topk_ids: torch.Tensor | None = None,
        out: torch.Tensor | None = None) -> torch.Tensor:
    """`layer(x, router_logits, w13, w2, ...)` (same arguments and result) through torch.ops.meld.moe."""
    if not isinstance(layer, MoE):
        raise ValueError(f"layer must be a meld.MoE, got {type(layer).__name__}")
    check_tensors({"x": x, "w13": w13, "w2": w2},
                  {"router_logits": router_logits, "topk_weights": topk_weights, "topk_ids": topk_ids, "out": out})
    if x.dim() != 2:
        expect("x", x, layer.dtype, (None, layer.hidden_size), "tokens x hidden_size")
    return _moe_call(layer, x, router_logits, w13, w2, topk_weights, topk_ids, out)


def _moe_call(layer: MoE, x: torch.Tensor, router_logits: torch.Tensor | None, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor | None, topk_ids: torch.Tensor | None,
              out: torch.Tensor | None) -> torch.Tensor:
    """The op's call (`moe()`'s, and `MoE.__call__`'s eager route): out allocated where not given, and returned."""
    if out is None:
        out = torch.empty(x.shape[0], layer.hidden_size, dtype=layer.dtype, device=x.device)
    _moe_op(x, router_logits, w13, w2, topk_weights, topk_ids, out, layer.handle)
    return out


# The entry points' eager route (`Operator._op_route`) calls the ops through these, as methods: set here, as the
# operators' modules cannot import this one (it imports them).
DecodeAttention._op_call, DecodeMLA._op_call, MoE._op_call = _decode_attention_call, _decode_mla_call, _moe_call
