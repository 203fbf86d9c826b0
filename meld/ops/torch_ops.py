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
path"): a faster call needs a C++ op that launches without Python. meld has no backward: an autograd
kernel ties each op's outputs to its inputs that require grad, so a backward through them raises
NotImplementedError naming the op (never a gradient that silently leaves the op out).

`DecodeAttention.run`, `DecodeMLA.run` and `MoE.__call__` emit these ops by themselves while Dynamo traces,
so model code needs no change; `decode_attention()`, `decode_mla()` and `moe()` below take the op path always
(eager included). plan()
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

from .checks import check_tensors, expect, grad_inputs, no_backward
from .decode_attention import DecodeAttention, kv_parts
from .decode_mla import DecodeMLA
from .moe import MoE
from .registry import lookup

# --- the ops --------------------------------------------------------------------------------------------
_lib = torch.library.Library("meld", "FRAGMENT")


def _define(name: str, schema: str, impl, fake, written: tuple[int, ...]) -> None:
    """Op `name` of `schema`, its kernel `impl` (CPU and CUDA), its `fake`, and an autograd kernel: the
    arguments at `written` (the mutated outputs) are tied to the inputs that require grad, so that a
    backward through them raises NotImplementedError naming the op (meld has no backward)."""
    _lib.define(name + schema, tags=(torch.Tag.pt2_compliant_tag,))
    for key in ("CPU", "CUDA"):
        _lib.impl(name, impl, key)
    torch.library.register_fake(f"meld::{name}", fake, lib=_lib)
    op = getattr(torch.ops.meld, name).default

    def autograd(keyset, *args):
        grads = grad_inputs(*args)
        if grads is None and type(args[0]) is torch.Tensor:   # eager, nothing to tie: the kernel itself (a
            return impl(*args)                                # redispatch adds host time to every call)
        with torch._C._AutoDispatchBelowAutograd():
            op.redispatch(keyset & torch._C._after_autograd_keyset, *args)
        no_backward(f"torch.ops.meld.{name}", grads, tuple(args[i] for i in written if args[i] is not None))

    _lib.impl(name, autograd, "Autograd", with_keyset=True)


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
    lookup(handle, DecodeAttention).run(q, _kv_cache(kv_cache, v_cache), out=out, lse=lse, k_scale=k_scale,
                                        v_scale=v_scale)


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
    lookup(handle, DecodeMLA).run(q_nope, q_pe, ckv_cache, kpe_cache, out=out, lse=lse, kv_scale=kv_scale)


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
    lookup(handle, MoE)(x, router_logits, w13, w2, topk_weights=topk_weights, topk_ids=topk_ids, out=out)


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
    out, lse = _outputs(q, attn.dtype, return_lse, out, lse)
    k, v = caches.values() if len(caches) == 2 else (kv_cache, None)
    k_scale, v_scale = attn._check_scales(k_scale, v_scale)   # (floats: the schema's check would be a RuntimeError)
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
    out, lse = _outputs(q_nope, mla.dtype, return_lse, out, lse)
    kv_scale = mla._check_scale(kv_scale)   # (a float: the schema's check would be a RuntimeError)
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
    if out is None:
        out = torch.empty(x.shape[0], layer.hidden_size, dtype=layer.dtype, device=x.device)
    _moe_op(x, router_logits, w13, w2, topk_weights, topk_ids, out, layer.handle)
    return out
