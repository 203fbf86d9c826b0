"""Paged MLA decode attention (DeepSeek's absorbed multi-head latent attention), defined in TVM as the input
`meld.frontend.capture_mla` reads.

Why it is written this way (the same form as `meld.frontend.decode_attention`, so capture reads it alike):

- Softmax over a request's KV tokens is ONE reduction whose state is the online-softmax triple (m, l, acc),
  merged by the same `te.comm_reducer` as GQA decode (`_online_softmax`), over the KV axis up to the symbolic
  `max_kv_len`, masked per request with `if_then_else` by a length loaded from `kv_indptr` /
  `kv_last_page_len`: the range axis meld splits, and the combiner capture recognises by evaluating it.
- One latent KV head serves all q heads: a token's score is q_nope . ckv + q_pe . kpe, and its value is the
  ckv row itself (the absorbed V), so out is Dc wide.
- The two dot products are two score blocks: TE allows a reduction only at the top of a compute, so their
  sum cannot be one expression; and one reduction over Dc + Dr picking the part with `if_then_else` would
  index the part it does not take out of bounds. Both are masked, as past a request's length the page index
  would read outside `kv_indices`.
- An empty request merges only identities, which the combiner keeps as the identity: out = 0, lse = -inf.
"""
from __future__ import annotations

import math

from tvm import te, tirx

from .decode_attention import _F32, _online_softmax


def mla_decode_primfunc(num_heads: int, head_dim_ckv: int = 512, head_dim_kpe: int = 64, page_size: int = 64,
                        dtype: str = "bfloat16", sm_scale: float | None = None) -> tirx.PrimFunc:
    """Build the PrimFunc of one decode step of paged MLA attention (FlashInfer's paged layout).

    Args:
        num_heads: H, the q heads; all share the one latent KV head.
        head_dim_ckv, head_dim_kpe: Dc (the latent, also the value width) and Dr (the rotary part).
        page_size: tokens per KV page.
        dtype: dtype of the queries, the caches and out.
        sm_scale: the score scale; None gives 1 / sqrt(Dc + Dr). DeepSeek passes its own (1 / sqrt(192) before
            YaRN), the one of its heads before absorption.

    Returns:
        PrimFunc(q_nope [B, H, Dc], q_pe [B, H, Dr], ckv_cache [P, page_size, Dc], kpe_cache [P, page_size, Dr],
        kv_indptr [B + 1] i32, kv_indices [nnz] i32, kv_last_page_len [B] i32, out [B, H, Dc], lse [B, H] f32,
        max_kv_len i32); B, P, nnz and max_kv_len are symbolic, max_kv_len bounds every request's KV length.

    Example:
        >>> capture_mla(mla_decode_primfunc(128)) == mla_decode_graph(128, 512, 64, 64)
        True
    """
    batch, num_pages, nnz_pages, max_kv_len = (tirx.Var(n, "int32") for n in
                                                ("batch_size", "num_pages", "nnz_pages", "max_kv_len"))
    q_nope = te.placeholder((batch, num_heads, head_dim_ckv), dtype, "q_nope")
    q_pe = te.placeholder((batch, num_heads, head_dim_kpe), dtype, "q_pe")
    ckv_cache = te.placeholder((num_pages, page_size, head_dim_ckv), dtype, "ckv_cache")
    kpe_cache = te.placeholder((num_pages, page_size, head_dim_kpe), dtype, "kpe_cache")
    kv_indptr = te.placeholder((batch + 1,), "int32", "kv_indptr")
    kv_indices = te.placeholder((nnz_pages,), "int32", "kv_indices")
    kv_last_page_len = te.placeholder((batch,), "int32", "kv_last_page_len")
    neg_inf, zero, one = (tirx.const(v, _F32) for v in (-math.inf, 0.0, 1.0))
    scale = 1.0 / math.sqrt(head_dim_ckv + head_dim_kpe) if sm_scale is None else sm_scale

    def kv_len(b: tirx.Var) -> tirx.PrimExpr:
        pages = kv_indptr[b + 1] - kv_indptr[b]
        return te.if_then_else(pages > 0, (pages - 1) * page_size + kv_last_page_len[b], 0)

    def row(cache: te.Tensor, b: tirx.Var, n: tirx.PrimExpr, d: tirx.PrimExpr) -> tirx.PrimExpr:
        page = kv_indices[kv_indptr[b] + te.indexdiv(n, page_size)]
        return cache[page, te.indexmod(n, page_size), d].astype(_F32)

    def dot(q: te.Tensor, cache: te.Tensor, name: str) -> te.Tensor:
        d = te.reduce_axis((0, q.shape[2]), "d")
        return te.compute(
            (batch, num_heads, max_kv_len),
            lambda b, h, n: te.sum(te.if_then_else(
                n < kv_len(b), q[b, h, d].astype(_F32) * row(cache, b, n, d), zero), axis=d),
            name=name)

    score_nope, score_pe = dot(q_nope, ckv_cache, "score_nope"), dot(q_pe, kpe_cache, "score_pe")
    n = te.reduce_axis((0, max_kv_len), "kv")
    online_softmax = _online_softmax()

    def state(b: tirx.Var, h: tirx.Var, j: tirx.Var) -> tuple:
        valid = n < kv_len(b)
        score = (score_nope[b, h, n] + score_pe[b, h, n]) * scale
        token = (te.if_then_else(valid, score, neg_inf), te.if_then_else(valid, one, zero),
                 te.if_then_else(valid, row(ckv_cache, b, n, j), zero))
        return online_softmax(token, axis=n)

    # m and l repeat along the latent: a multi-output reduction has one shape for all its outputs.
    m, l, acc = te.compute((batch, num_heads, head_dim_ckv), state, name="state")
    out = te.compute(
        (batch, num_heads, head_dim_ckv),
        lambda b, h, j: te.if_then_else(l[b, h, j] > 0, acc[b, h, j] / l[b, h, j], zero).astype(dtype),
        name="out")
    lse = te.compute(
        (batch, num_heads),
        lambda b, h: te.if_then_else(l[b, h, 0] > 0, m[b, h, 0] + te.log(l[b, h, 0]), neg_inf),
        name="lse")
    # max_kv_len appears only in intermediate shapes, so it must be passed explicitly.
    func = te.create_prim_func([q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, kv_last_page_len,
                                out, lse, max_kv_len])
    return func.with_attr("global_symbol", "mla_decode")
