"""The MoE expert-FFN task graph, built directly (no TVM needed: meld's runtime never imports it).

`meld.frontend.capture_moe` derives the same graph from the TVM definition in `meld.frontend.moe`; a CPU
test asserts the two are equal.
"""
from __future__ import annotations

from ..ir import Axis, Reduction, TaskGraph, TaskTemplate
from .checks import check_dtype_name, check_positive, is_int


def _check(hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, renormalize: bool,
           dtype: str) -> None:
    for name, v in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size),
                    ("num_experts", num_experts)):
        check_positive(name, v)
    if isinstance(top_k, bool) or not is_int(top_k) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k!r} must be an integer in 1..num_experts={num_experts}")
    if not isinstance(renormalize, bool):
        raise ValueError(f"renormalize must be True or False, got {renormalize!r}")
    check_dtype_name(dtype)


def moe_graph(hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
              renormalize: bool = True, dtype: str = "bfloat16", transport: str | None = None) -> TaskGraph:
    """The MoE expert FFN with top-k softmax routing over `num_tokens` tokens, as five task templates.

    - route (map, per token): softmax of router_logits over the experts, top_k choice, optional
      renormalisation; writes topk_ids and topk_weights.
    - dispatch (map, per expert): the (token, k) rows routed to the expert (expert_rows).
    - gemm1 (tile over (expert, row_block, col_block)): a tile of act = SiLU(x w13_gate^T) * (x w13_up^T)
      for the expert's rows; the rows per expert are known only after routing (dynamic extent
      "expert_tokens"); col_block tiles the intermediate_size act columns.
    - gemm2 (tile, col_block over hidden_size): a tile of expert_out = act w2^T. It waits only for the
      gemm1 tiles of its own (expert, row_block), across all their column blocks (edge depends="row_block").
    - combine (per token): out[t] = sum_j topk_weights[t, j] * expert_out[t, j], the "weighted_sum" reduction
      over axis "k", carried on the gemm2 -> combine edge.

    Block axes carry the extent they tile (elements, not blocks): the scheduler chooses the tile sizes.
    `transport` (one of meld.ir.TRANSPORTS): the experts are spread over a process group (expert
    parallelism), so a token's rows cross ranks to their experts and their outputs cross back before the
    combine: the gemm2 -> combine edge carries the transport, and the lowering gives the family's
    cross-rank kernels and parameter struct (meld/distributed/expert_parallel.py).

    `renormalize` is recorded as False when top_k == num_experts, where renormalising changes nothing
    (the chosen probabilities already sum to 1), so both spellings give the same graph.

    Raises:
        ValueError: a non-positive size or top_k outside 1..num_experts; the message names the argument.
    """
    _check(hidden_size, intermediate_size, num_experts, top_k, renormalize, dtype)
    hidden_size, intermediate_size, num_experts, top_k = map(int, (hidden_size, intermediate_size, num_experts,
                                                                   top_k))   # (attrs are JSON: Python ints)
    token, expert = Axis("token", "num_tokens"), Axis("expert", num_experts)
    rows = Axis("row_block", "expert_tokens", dynamic=True)
    red = Reduction("weighted_sum", "k")
    g = TaskGraph("moe", {
        "hidden_size": hidden_size, "intermediate_size": intermediate_size, "num_experts": num_experts,
        "top_k": top_k, "renormalize": bool(renormalize) and top_k < num_experts, "dtype": dtype,
        "activation": "silu",
    })
    g.add_task(TaskTemplate("route", "map", (token,), affinity=("token",), reads=("router_logits",),
                            writes=("topk_ids", "topk_weights")))
    g.add_task(TaskTemplate("dispatch", "map", (expert,), affinity=("expert",), reads=("topk_ids",),
                            writes=("expert_rows",)))
    g.add_task(TaskTemplate("gemm1", "tile", (expert, rows, Axis("col_block", intermediate_size)),
                            affinity=("expert",), reads=("expert_rows", "x", "w13"), writes=("act",)))
    g.add_task(TaskTemplate("gemm2", "tile", (expert, rows, Axis("col_block", hidden_size)),
                            affinity=("expert",), reads=("expert_rows", "act", "w2"), writes=("expert_out",)))
    g.add_task(TaskTemplate("combine", "combine", (token,), affinity=("token",), reduction=red,
                            reads=("topk_weights", "expert_out"), writes=("out",)))
    g.add_edge("route", "dispatch")
    g.add_edge("dispatch", "gemm1", depends="expert")
    g.add_edge("gemm1", "gemm2", depends="row_block")
    g.add_edge("gemm2", "combine", red, transport=transport)
    return g.validate()
