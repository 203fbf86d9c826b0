"""The MoE expert FFN (vLLM's fused_moe), defined in TVM as the input `meld.frontend.capture_moe` reads.

Why it is written this way:

- It is the token-major definition: every (token t, choice j) row runs expert topk_ids[t, j]'s FFN, the
  expert's weights loaded through that id (`w13[topk_ids[t, j], n, h]`). Grouping rows by expert is a
  schedule, not math, so it is not spelled here; capture reads it off that indirect weight index.
- Top-k is selection by rank, which TE can express without sorting: rank[t, e] counts the experts that
  beat e (higher probability, ties to the lower id), and choice j is the expert of rank j. topk_ids and
  topk_weights come out ordered by descending probability, as torch.topk returns them.
- Routing is in float32 whatever the model dtype (softmax over E, then the optional renormalisation of the
  chosen probabilities to sum 1). GEMMs accumulate in float32; act is rounded to the model dtype (it is
  the next GEMM's operand); the combine sums float32 and rounds once.
- The pieces are separate functions so a variant (another activation, a broken combine) can be built
  from the same parts; `moe_primfunc` composes the real one.
- Reductions sit at the top of their computes (TE's rule), so softmax, selection, renormalisation and the
  combine's final cast are blocks of their own.
"""
from __future__ import annotations

from collections.abc import Callable

from tvm import te, tirx

_F32 = "float32"


def moe_inputs(hidden_size: int, intermediate_size: int, num_experts: int,
               dtype: str) -> tuple[te.Tensor, te.Tensor, te.Tensor, te.Tensor]:
    """x [T, H], router_logits [T, E], w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I]; T symbolic."""
    num_tokens = tirx.Var("num_tokens", "int32")
    return (te.placeholder((num_tokens, hidden_size), dtype, "x"),
            te.placeholder((num_tokens, num_experts), dtype, "router_logits"),
            te.placeholder((num_experts, 2 * intermediate_size, hidden_size), dtype, "w13"),
            te.placeholder((num_experts, hidden_size, intermediate_size), dtype, "w2"))


def topk_softmax(router_logits: te.Tensor, top_k: int, renormalize: bool) -> tuple[te.Tensor, te.Tensor]:
    """(topk_ids [T, k] int32, topk_weights [T, k] float32): the top_k experts by softmax probability."""
    num_tokens, num_experts = router_logits.shape

    def logit(t: tirx.PrimExpr, e: tirx.PrimExpr) -> tirx.PrimExpr:
        return router_logits[t, e].astype(_F32)

    def over_experts(name: str) -> tirx.IterVar:
        return te.reduce_axis((0, num_experts), name)

    e = over_experts("e")
    logit_max = te.compute((num_tokens,), lambda t: te.max(logit(t, e), axis=e), name="logit_max")
    e = over_experts("e")
    exp_sum = te.compute((num_tokens,), lambda t: te.sum(te.exp(logit(t, e) - logit_max[t]), axis=e),
                         name="exp_sum")
    probs = te.compute((num_tokens, num_experts),
                       lambda t, i: te.exp(logit(t, i) - logit_max[t]) / exp_sum[t], name="probs")
    o = over_experts("other")
    rank = te.compute((num_tokens, num_experts), lambda t, i: te.sum(te.if_then_else(tirx.Or(
        probs[t, o] > probs[t, i], tirx.And(probs[t, o] == probs[t, i], o < i)), 1, 0), axis=o), name="rank")
    e = over_experts("e")
    topk_ids = te.compute((num_tokens, top_k),
                          lambda t, j: te.sum(te.if_then_else(rank[t, e] == j, e, 0), axis=e), name="topk_ids")
    e = over_experts("e")
    chosen = te.compute(
        (num_tokens, top_k), lambda t, j: te.sum(te.if_then_else(rank[t, e] == j, probs[t, e], 0.0), axis=e),
        name="topk_probs" if renormalize else "topk_weights")
    if not renormalize:
        return topk_ids, chosen
    k = te.reduce_axis((0, top_k), "k")
    chosen_sum = te.compute((num_tokens,), lambda t: te.sum(chosen[t, k], axis=k), name="topk_sum")
    return topk_ids, te.compute((num_tokens, top_k), lambda t, j: chosen[t, j] / chosen_sum[t],
                                name="topk_weights")


def silu_and_mul(gate: tirx.PrimExpr, up: tirx.PrimExpr) -> tirx.PrimExpr:
    """SiLU(gate) * up, the gated activation between the two GEMMs."""
    return gate * te.sigmoid(gate) * up


def expert_ffn(x: te.Tensor, topk_ids: te.Tensor, w13: te.Tensor, w2: te.Tensor,
               activation: Callable[[tirx.PrimExpr, tirx.PrimExpr], tirx.PrimExpr] = silu_and_mul
               ) -> te.Tensor:
    """expert_out [T, k, H] float32: row (t, j) through expert topk_ids[t, j]'s gate/up, activation, down."""
    num_tokens, hidden = x.shape
    top_k, inter = topk_ids.shape[1], int(w2.shape[2])
    h = te.reduce_axis((0, hidden), "h")
    gate_up = te.compute(
        (num_tokens, top_k, 2 * inter),
        lambda t, j, n: te.sum(x[t, h].astype(_F32) * w13[topk_ids[t, j], n, h].astype(_F32), axis=h),
        name="gate_up")
    act = te.compute((num_tokens, top_k, inter),
                     lambda t, j, i: activation(gate_up[t, j, i], gate_up[t, j, inter + i]).astype(x.dtype),
                     name="act")
    i = te.reduce_axis((0, inter), "i")
    return te.compute(
        (num_tokens, top_k, hidden),
        lambda t, j, n: te.sum(act[t, j, i].astype(_F32) * w2[topk_ids[t, j], n, i].astype(_F32), axis=i),
        name="expert_out")


def weighted_combine(topk_weights: te.Tensor, expert_out: te.Tensor, dtype: str) -> te.Tensor:
    """out [T, H] = sum_j topk_weights[t, j] * expert_out[t, j, h], rounded to dtype."""
    num_tokens, top_k, hidden = expert_out.shape
    k = te.reduce_axis((0, top_k), "k")
    moe_sum = te.compute((num_tokens, hidden),
                         lambda t, h: te.sum(topk_weights[t, k] * expert_out[t, k, h], axis=k), name="moe_sum")
    return te.compute((num_tokens, hidden), lambda t, h: moe_sum[t, h].astype(dtype), name="out")


def moe_primfunc(hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 renormalize: bool = True, dtype: str = "bfloat16") -> tirx.PrimFunc:
    """Build the PrimFunc of the MoE expert FFN with top-k softmax routing over T tokens (T symbolic).

    Args:
        hidden_size, intermediate_size: H and I of every expert (w13 [E, 2I, H], w2 [E, H, I]).
        num_experts, top_k: E experts, each token routed to top_k of them.
        renormalize: scale the chosen probabilities to sum 1 per token.
        dtype: dtype of x, router_logits, w13, w2 and out.

    Returns:
        PrimFunc(x [T, H], router_logits [T, E], w13 [E, 2I, H], w2 [E, H, I], out [T, H]).

    Example:
        >>> capture_moe(moe_primfunc(4096, 14336, 8, 2)) == moe_graph(4096, 14336, 8, 2)
        True
    """
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in 1..num_experts={num_experts}")
    x, router_logits, w13, w2 = moe_inputs(hidden_size, intermediate_size, num_experts, dtype)
    topk_ids, topk_weights = topk_softmax(router_logits, top_k, renormalize)
    out = weighted_combine(topk_weights, expert_ffn(x, topk_ids, w13, w2), dtype)
    return te.create_prim_func([x, router_logits, w13, w2, out]).with_attr("global_symbol", "moe")
