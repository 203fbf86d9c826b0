"""From a task graph to the kernel family that runs it: the graph, not the operator, decides.

The task kinds and their edges select the family (its planner policy and device task bodies); the
combiner recorded on the graph's reduction selects the merge — the device merge the family compiles and
the merge the CPU reference executor applies; the family names its kernel template and its reference
executor, which the operators run on the CPU. A graph that asks for something
no family implements is refused here, with the reason, before anything is compiled.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from ..ir import TaskGraph
from ..ir.task_graph import GraphError


# Each family's kernel template and its CPU reference executor, as module:function
# (imported when asked for: the executors import torch and NumPy, lowering only the IR).
KERNELS = {"decode_attention": "decode_attention.cuh", "mla_decode": "mla_decode.cuh", "moe": "moe.cuh",
           "tp_linear": "tp_linear.cuh", "grouped_attention": "grouped_attention.cuh"}
EXECUTORS = {"decode_attention": "meld.runtime.reference:execute_decode",
             "mla_decode": "meld.runtime.reference:execute_mla",
             "moe": "meld.runtime.moe_reference:execute_moe",
             "tp_linear": "meld.distributed.tp_matmul:row_parallel_matmul",
             "grouped_attention": "meld.runtime.reference:execute_split_reduce"}


@dataclass(frozen=True)
class Lowering:
    family: str                          # a KERNELS key: template, planner, executor
    combiner: str                        # meld.ir.COMBINERS key: the device merge and the executor's merge
    waits: tuple[tuple[str, str, str], ...] = ()   # (src, dst, axis): tile edges that become dependency counters
    producers: tuple[str, ...] = ()      # the split-reduce tasks whose partials the combine merges, in merge order
    transport: str | None = None         # how those partials cross ranks (meld.ir.TRANSPORTS; None: one GPU)

    @property
    def kernel(self) -> str:
        """The family's kernel template."""
        return KERNELS[self.family]

    @property
    def executor(self) -> Callable:
        """The family's CPU reference executor (the walk of its work tables the kernel makes)."""
        module, name = EXECUTORS[self.family].split(":")
        return getattr(importlib.import_module(module), name)


def _kinds(g: TaskGraph) -> dict[str, str]:
    return {t.name: t.kind for t in g.tasks}


def lower(graph: TaskGraph) -> Lowering:
    """The family that runs `graph` (validated first); GraphError says why none does."""
    if not isinstance(graph, TaskGraph):
        raise TypeError(f"graph must be a meld.ir.TaskGraph, got {type(graph).__name__}")
    g = graph.validate()
    kinds = sorted(set(_kinds(g).values()))
    reductions = {t.reduction.combiner for t in g.tasks if t.reduction is not None}
    edges = [(s, d, data.get("depends")) for s, d, data in g.graph.edges(data=True)]
    if kinds == ["combine", "split_reduce"]:
        # A split range of KV positions merges online-softmax states (attention: MLA's where it reads a latent
        # cache, i.e. the graph has a rotary-key width); a split contraction dimension, plain sums (the
        # row-parallel GEMM, its ranges spread over ranks). Attention whose partials come from several tasks,
        # or from a task over groups of the combine's points (a shared prefix read once for a group of
        # requests), is the grouped family: its plan is a task and event table (meld.ir.work_table).
        if len(reductions) != 1 or next(iter(reductions)) not in ("online_softmax", "sum"):
            raise GraphError(f"graph {g.name!r}: a split-reduce family merges online-softmax states or sums; "
                             f"this graph reduces with {sorted(reductions)}")
        combiner = next(iter(reductions))
        combines = [t for t in g.tasks if t.kind == "combine"]
        producers = tuple(t.name for t in g.producers(combines[0].name)) if len(combines) == 1 else ()
        transport = g.transport(combines[0].name) if len(combines) == 1 else None
        if combiner == "sum":
            return Lowering("tp_linear", combiner, producers=producers, transport=transport)
        if len(combines) != 1:
            raise GraphError(f"graph {g.name!r}: attention merges its partials in one combine task, got "
                             f"{[t.name for t in combines]}")
        grouped = len(producers) > 1 or g.task(producers[0]).domain != combines[0].domain
        attention = "mla_decode" if "head_dim_kpe" in g.attrs else "decode_attention"
        family = "grouped_attention" if grouped else attention
        if transport is not None and family != "decode_attention":
            raise GraphError(f"graph {g.name!r}: partials cross ranks ({transport!r}) only in the decode_attention "
                             f"and tp_linear families, not {family}")
        return Lowering(family, combiner, producers=producers, transport=transport)
    if kinds == ["combine", "map", "tile"]:
        waits = tuple((s, d, dep) for s, d, dep in edges if dep is not None and _kinds(g)[s] == "tile")
        if reductions != {"weighted_sum"} or len(waits) != 1 or waits[0][2] != "row_block":
            raise GraphError(f"graph {g.name!r}: the tile family runs two tile stages joined by a row-block "
                             f"dependency and a weighted-sum combine; this graph has reductions "
                             f"{sorted(reductions)} and tile edges {list(waits)}")
        return Lowering("moe", "weighted_sum", waits)
    raise GraphError(f"graph {g.name!r}: no kernel family runs task kinds {kinds}")
