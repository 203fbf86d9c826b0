"""The decode-attention task graph, built directly (no TVM needed).

`meld.frontend.capture` derives the same graph from the TVM definition in
`meld.frontend.decode_attention`; a CPU test asserts the two are equal.
"""
from __future__ import annotations

from ..ir import Axis, Reduction, TaskGraph, TaskTemplate
from .checks import check_dtype_name, check_positive


def decode_attention_graph(num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                           dtype: str = "bfloat16", transport: str | None = None) -> TaskGraph:
    """Paged GQA decode attention: one split-reduce task per (request, kv head) over its KV positions.

    The partial task covers a sub-range of a request's KV tokens for all q heads of one kv head and
    produces an online-softmax state; the merge task combines the partials of one (request, kv head).
    `transport` (one of meld.ir.TRANSPORTS): the KV is sharded over a process group, and partials cross
    ranks on their way to the merge (meld.distributed.SeqParallelDecode).
    """
    num_qo_heads, num_kv_heads, head_dim, page_size = (check_positive(name, v) for name, v in (   # (Python ints:
        ("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),  # attrs are JSON)
        ("page_size", page_size)))
    check_dtype_name(dtype)
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads={num_qo_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    domain = (Axis("request", "batch_size"), Axis("kv_head", num_kv_heads))
    red = Reduction("online_softmax", "kv")
    g = TaskGraph("decode_attention", {
        "num_qo_heads": num_qo_heads, "num_kv_heads": num_kv_heads,
        "group_size": num_qo_heads // num_kv_heads, "head_dim": head_dim,
        "page_size": page_size, "dtype": dtype,
    })
    g.add_task(TaskTemplate(
        "attention_partial", "split_reduce", domain, range_axis=Axis("kv", "kv_len", dynamic=True),
        affinity=("request", "kv_head"), reduction=red,
        reads=("q", "kv_cache", "kv_indptr", "kv_indices", "kv_last_page_len"),
        writes=("partial_out", "partial_lse"),
    ))
    g.add_task(TaskTemplate(
        "merge", "combine", domain, affinity=("request", "kv_head"), reduction=red,
        reads=("partial_out", "partial_lse"), writes=("out", "lse"),
    ))
    g.add_edge("attention_partial", "merge", red, transport=transport)
    return g.validate()
