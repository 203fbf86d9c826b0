"""The MLA decode-attention task graph, built directly (no TVM needed).

`meld.frontend.capture_mla` derives the same graph from the TVM definition in `meld.frontend.mla_decode`;
a test asserts the two are equal.
"""
from __future__ import annotations

from ..ir import Axis, Reduction, TaskGraph, TaskTemplate
from .checks import check_dtype_name, check_positive


def mla_decode_graph(num_heads: int, head_dim_ckv: int, head_dim_kpe: int, page_size: int,
                     dtype: str = "bfloat16") -> TaskGraph:
    """Paged MLA decode attention: one split-reduce task per request over its KV positions.

    All q heads share the one latent KV head, so a request is one unit (no kv-head axis): the partial task
    covers a sub-range of its KV tokens for every head and produces an online-softmax state; the merge task
    combines the partials of one request. `head_dim_kpe` in the attrs is what lowers it to the MLA family.
    """
    sizes = {"num_heads": num_heads, "head_dim_ckv": head_dim_ckv, "head_dim_kpe": head_dim_kpe,
             "page_size": page_size}
    sizes = {name: check_positive(name, v) for name, v in sizes.items()}
    check_dtype_name(dtype)
    domain = (Axis("request", "batch_size"),)
    red = Reduction("online_softmax", "kv")
    g = TaskGraph("mla_decode", sizes | {"dtype": dtype})
    g.add_task(TaskTemplate(
        "attention_partial", "split_reduce", domain, range_axis=Axis("kv", "kv_len", dynamic=True),
        affinity=("request",), reduction=red,
        reads=("q_nope", "q_pe", "ckv_cache", "kpe_cache", "kv_indptr", "kv_indices", "kv_last_page_len"),
        writes=("partial_out", "partial_lse"),
    ))
    g.add_task(TaskTemplate(
        "merge", "combine", domain, affinity=("request",), reduction=red,
        reads=("partial_out", "partial_lse"), writes=("out", "lse"),
    ))
    g.add_edge("attention_partial", "merge", red)
    return g.validate()
