"""Paged GQA decode attention, defined in TVM as the input `meld.frontend.capture` reads.

Why it is written this way:

- Softmax attention over a request's KV tokens is ONE reduction whose state is the online-softmax triple
  (m, l, acc) and whose combiner is a `te.comm_reducer`. That is the form meld can split: any sub-range of
  the KV axis yields a partial state, and the combiner merges partials. Capture finds the combiner in the
  PrimFunc and recognises it by evaluating it (`meld.ir.combiners`).
- The KV axis is reduced up to the symbolic bound `max_kv_len` and masked per request with `if_then_else`
  (masked tokens contribute the identity). `where=` would be the natural spelling, but
  `te.create_prim_func` drops it in TVM 0.27. The mask's bound loads `kv_indptr` / `kv_last_page_len`,
  which is how capture tells the data-dependent range axis from the static head-dim axis.
- The combiner zeroes the weight of a side whose max is -inf, so an empty request (two identities merged)
  stays the identity instead of NaN (exp(-inf - -inf)); such a request gets out = 0 and lse = -inf.
- Scores are a separate block: TE allows a reduction only at the top of a compute, and the q.k dot
  product is itself a reduction (over head_dim).
- `lse` is the natural-log logsumexp of the scaled scores, as `meld.DecodeAttention.run` returns it.
"""
from __future__ import annotations

import math

from tvm import te, tirx

_F32 = "float32"


def _online_softmax() -> tirx.CommReducer:
    """The (m, l, acc) reducer; a weight exp(m_i - M) is taken as 0 when m_i is -inf (an empty side)."""
    neg_inf, zero = tirx.const(-math.inf, _F32), tirx.const(0.0, _F32)

    def combine(x: tuple, y: tuple) -> tuple:
        m = te.max(x[0], y[0])
        w_x = te.if_then_else(x[0] == neg_inf, zero, te.exp(x[0] - m))
        w_y = te.if_then_else(y[0] == neg_inf, zero, te.exp(y[0] - m))
        return m, x[1] * w_x + y[1] * w_y, x[2] * w_x + y[2] * w_y

    def identity(*_dtypes: str) -> tuple:
        return neg_inf, zero, zero

    return te.comm_reducer(combine, identity, name="online_softmax")


def decode_attention_primfunc(num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                              dtype: str = "bfloat16") -> tirx.PrimFunc:
    """Build the PrimFunc of one decode step of paged GQA attention (FlashInfer's paged KV layout).

    Args:
        num_qo_heads, num_kv_heads: query / KV heads; q head h reads kv head h // (num_qo_heads // num_kv_heads).
        head_dim: D, shared by q, K and V.
        page_size: tokens per KV page.
        dtype: dtype of q, kv_cache and out.

    Returns:
        PrimFunc(q [B, Hq, D], kv_cache [P, 2, page_size, Hkv, D] (0 = K, 1 = V), kv_indptr [B + 1] i32,
        kv_indices [nnz] i32, kv_last_page_len [B] i32, out [B, Hq, D], lse [B, Hq] f32, max_kv_len i32);
        B, P, nnz and max_kv_len are symbolic, max_kv_len bounds every request's KV length.

    Example:
        >>> f = decode_attention_primfunc(32, 8, 128, 16)
        >>> capture(f) == decode_attention_graph(32, 8, 128, 16)
        True
    """
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads={num_qo_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    group = num_qo_heads // num_kv_heads
    batch, num_pages, nnz_pages, max_kv_len = (tirx.Var(n, "int32") for n in
                                                ("batch_size", "num_pages", "nnz_pages", "max_kv_len"))
    q = te.placeholder((batch, num_qo_heads, head_dim), dtype, "q")
    kv_cache = te.placeholder((num_pages, 2, page_size, num_kv_heads, head_dim), dtype, "kv_cache")
    kv_indptr = te.placeholder((batch + 1,), "int32", "kv_indptr")
    kv_indices = te.placeholder((nnz_pages,), "int32", "kv_indices")
    kv_last_page_len = te.placeholder((batch,), "int32", "kv_last_page_len")
    neg_inf, zero, one = (tirx.const(v, _F32) for v in (-math.inf, 0.0, 1.0))

    def kv_len(b: tirx.Var) -> tirx.PrimExpr:
        pages = kv_indptr[b + 1] - kv_indptr[b]
        return te.if_then_else(pages > 0, (pages - 1) * page_size + kv_last_page_len[b], 0)

    def kv(which: int, b: tirx.Var, n: tirx.PrimExpr, h: tirx.Var, d: tirx.PrimExpr) -> tirx.PrimExpr:
        page = kv_indices[kv_indptr[b] + te.indexdiv(n, page_size)]
        return kv_cache[page, which, te.indexmod(n, page_size), te.indexdiv(h, group), d].astype(_F32)

    sm_scale = 1.0 / math.sqrt(head_dim)
    d = te.reduce_axis((0, head_dim), "d")
    # Masked here too: past the request's length the page index would read outside kv_indices.
    scores = te.compute(
        (batch, num_qo_heads, max_kv_len),
        lambda b, h, n: te.sum(te.if_then_else(
            n < kv_len(b), q[b, h, d].astype(_F32) * kv(0, b, n, h, d) * sm_scale, zero), axis=d),
        name="scores")

    n = te.reduce_axis((0, max_kv_len), "kv")
    online_softmax = _online_softmax()

    def state(b: tirx.Var, h: tirx.Var, j: tirx.Var) -> tuple:
        valid = n < kv_len(b)
        token = (te.if_then_else(valid, scores[b, h, n], neg_inf), te.if_then_else(valid, one, zero),
                 te.if_then_else(valid, kv(1, b, n, h, j), zero))
        return online_softmax(token, axis=n)

    # m and l repeat along head_dim: a multi-output reduction has one shape for all its outputs.
    m, l, acc = te.compute((batch, num_qo_heads, head_dim), state, name="state")
    out = te.compute(
        (batch, num_qo_heads, head_dim),
        lambda b, h, j: te.if_then_else(l[b, h, j] > 0, acc[b, h, j] / l[b, h, j], zero).astype(dtype),
        name="out")
    lse = te.compute(
        (batch, num_qo_heads),
        lambda b, h: te.if_then_else(l[b, h, 0] > 0, m[b, h, 0] + te.log(l[b, h, 0]),
                                     neg_inf),
        name="lse")
    # max_kv_len appears only in intermediate shapes, so it must be passed explicitly.
    func = te.create_prim_func([q, kv_cache, kv_indptr, kv_indices, kv_last_page_len, out, lse, max_kv_len])
    return func.with_attr("global_symbol", "decode_attention")
