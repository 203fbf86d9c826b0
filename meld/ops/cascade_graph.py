"""The shared-prefix (cascade) decode-attention task graph, composed from decode attention's parts.

Level l of a cascade partitions the batch's requests into groups (FlashInfer's `qo_indptr` of the level);
each group has one page table at that level: the KV its requests share there (a system prompt, few-shot
examples, the prompt of parallel samples), the last level usually one group per request (its own
suffix). One split-reduce task per level reads a group's KV once for all its requests' q heads of a kv
head; the one combine task merges, per (request, kv head), every level's partials with decode's
online-softmax combiner. Nothing here is cascade-specific code: the graph is decode attention's
split-reduce and combine with more than one producer of partials.
"""
from __future__ import annotations

from ..ir import Axis, Reduction, TaskGraph, TaskTemplate
from .checks import check_dtype_name, check_positive


def level_task(level: int) -> str:
    """The name of level `level`'s split-reduce task (the key of its page table)."""
    return f"level{level}_partial"


def cascade_decode_graph(num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, num_levels: int,
                         dtype: str = "bfloat16") -> TaskGraph:
    """Paged GQA decode over `num_levels` levels of KV, each a page table per group of requests."""
    num_qo_heads, num_kv_heads, head_dim, page_size = (check_positive(name, v) for name, v in (   # (Python ints:
        ("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),  # attrs are JSON)
        ("page_size", page_size)))
    num_levels = check_positive("num_levels", num_levels, 64)
    check_dtype_name(dtype)
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads={num_qo_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    red = Reduction("online_softmax", "kv")
    g = TaskGraph("cascade_decode_attention", {
        "num_qo_heads": num_qo_heads, "num_kv_heads": num_kv_heads, "group_size": num_qo_heads // num_kv_heads,
        "head_dim": head_dim, "page_size": page_size, "dtype": dtype, "num_levels": num_levels,
    })
    for lv in range(num_levels):
        g.add_task(TaskTemplate(
            level_task(lv), "split_reduce", (Axis("group", f"num_groups_{lv}"), Axis("kv_head", num_kv_heads)),
            range_axis=Axis("kv", f"kv_len_{lv}", dynamic=True), affinity=("group", "kv_head"), reduction=red,
            reads=("q", "kv_cache", f"qo_indptr_{lv}", f"kv_indptr_{lv}", f"kv_indices_{lv}", f"kv_last_page_len_{lv}"),
            writes=("partial_out", "partial_lse")))
    g.add_task(TaskTemplate(
        "merge", "combine", (Axis("request", "batch_size"), Axis("kv_head", num_kv_heads)),
        affinity=("request", "kv_head"), reduction=red, reads=("partial_out", "partial_lse"), writes=("out", "lse")))
    for lv in range(num_levels):
        g.add_edge(level_task(lv), "merge", red)
    return g.validate()
