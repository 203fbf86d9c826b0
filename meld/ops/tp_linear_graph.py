"""The row-parallel linear's task graph, built directly (no TVM needed).

A split-reduce over the contraction dimension: a partial task covers a range of K for one (token block,
column block) and produces a float partial sum; the combine sums the partials of one output tile. Which
ranges exist is the schedule's choice: the ranks' slices of K (the input arrives split across the group),
and within a rank the pieces a tile's K is cut into where tiles are few (`meld.codegen.tp_kernel.TpSchedule`).
"""
from __future__ import annotations

from ..ir import Axis, Reduction, TaskGraph, TaskTemplate


def tp_linear_graph(in_features: int, out_features: int, world: int, dtype: str = "bfloat16",
                    transport: str = "peer") -> TaskGraph:
    """y [num_tokens, out_features] = sum over k < world x in_features of x[:, k] w[:, k], each rank holding
    `in_features` of k; partials cross ranks by `transport` (one of meld.ir.TRANSPORTS)."""
    for name, v in (("in_features", in_features), ("out_features", out_features), ("world", world)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive integer")
    domain = (Axis("token", "num_tokens"), Axis("column", out_features))
    red = Reduction("sum", "k")
    g = TaskGraph("tp_linear", {"in_features": in_features, "out_features": out_features, "world": world,
                                "dtype": dtype})
    g.add_task(TaskTemplate("gemm_partial", "split_reduce", domain, range_axis=Axis("k", in_features * world),
                            affinity=("column",), reduction=red, reads=("x", "weight"), writes=("partial",)))
    g.add_task(TaskTemplate("sum", "combine", domain, affinity=("column",), reduction=red, reads=("partial",),
                            writes=("out",)))
    g.add_edge("gemm_partial", "sum", red, transport=transport)
    return g.validate()
