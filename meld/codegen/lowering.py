"""From a task graph to the kernel family that runs it: the graph, not the operator, decides.

The task kinds select the family's planner policy (`PLANNED_KINDS`: which selector reads the rest of the
graph) and its device task bodies; within the kinds, the combiner recorded on the graph's reduction selects
the merge — the device merge the family compiles and the merge the CPU reference executor applies — and the
producers' domains and the attrs select among families of one shape. The family names its kernel template, its planner and its reference executor (`FAMILIES`); operators ask their
`Lowering` for the planner and the executor instead of importing one. A graph that asks for something no
family implements is refused here, with the reason, before anything is compiled.
"""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Callable

from ..ir import TaskGraph
from ..ir.task_graph import GraphError, TaskTemplate


@dataclass(frozen=True)
class Family:
    """What runs one family: its kernel template (None: only the CPU reference executor so far), its host
    planner (the GPU planner, where there is one, builds the same C source) and its CPU reference executor,
    the last two as "module:attribute" paths, imported when asked for (they import torch and NumPy;
    lowering only the IR)."""

    kernel: str | None
    planner: str
    executor: str


FAMILIES = {
    "decode_attention": Family("decode_attention.cuh", "meld.scheduler.decode_plan_host:plan_decode_host",
                               "meld.runtime.reference:execute_decode"),
    "mla_decode": Family("mla_decode.cuh", "meld.scheduler.decode_plan_host:plan_decode_host",
                         "meld.runtime.reference:execute_mla"),
    "moe": Family("moe.cuh", "meld.scheduler.moe_plan:plan_moe_host", "meld.runtime.moe_reference:execute_moe"),
    "tp_linear": Family("tp_linear.cuh", "meld.codegen.tp_kernel:TpSchedule.of",
                        "meld.distributed.tp_matmul:row_parallel_matmul"),
    "grouped_attention": Family("grouped_attention.cuh", "meld.scheduler.split_reduce_plan:plan_split_reduce",
                                "meld.runtime.reference:execute_split_reduce"),
}


def _resolve(path: str) -> Callable:
    """The attribute a "module:attribute" path names, looked up at each call (so a patched one is seen)."""
    module, name = path.split(":")
    return functools.reduce(getattr, name.split("."), importlib.import_module(module))


@dataclass(frozen=True)
class Lowering:
    family: str                          # a FAMILIES key: template, planner, executor
    combiner: str                        # meld.ir.COMBINERS key: the device merge and the executor's merge
    waits: tuple[tuple[str, str, str], ...] = ()   # (src, dst, axis): tile edges that become dependency counters
    producers: tuple[str, ...] = ()      # the split-reduce tasks whose partials the combines merge, in merge order
    transport: str | None = None         # how those partials cross ranks (meld.ir.TRANSPORTS; None: one GPU)

    @property
    def kernel(self) -> str | None:
        """The family's kernel template, or None where only the CPU reference executor runs it."""
        return FAMILIES[self.family].kernel

    @property
    def planner(self) -> Callable:
        """The family's planner: real lengths in, the work tables its kernel and its executor walk out."""
        return _resolve(FAMILIES[self.family].planner)

    @property
    def executor(self) -> Callable:
        """The family's CPU reference executor (the walk of its work tables the kernel makes)."""
        return _resolve(FAMILIES[self.family].executor)


def _split_reduce(g: TaskGraph) -> Lowering:
    """Split-reduce and combine tasks. A split range of KV positions merges online-softmax states (attention:
    MLA's where it reads a latent cache, i.e. the graph has a rotary-key width); a split contraction
    dimension, plain sums (the row-parallel GEMM, its ranges spread over ranks). Attention whose partials
    come from several tasks, from a task over groups of the combine's points (a shared prefix read once for
    a group of requests), or through more than one level of combines, is the grouped family: its plan is a
    task and event table (meld.ir.work_table)."""
    reductions = {t.reduction.combiner for t in g.tasks if t.reduction is not None}
    if len(reductions) != 1 or next(iter(reductions)) not in ("online_softmax", "sum"):
        raise GraphError(f"graph {g.name!r}: a split-reduce family merges online-softmax states or sums; "
                         f"this graph reduces with {sorted(reductions)}")
    combiner = next(iter(reductions))
    combines = [t for t in g.tasks if t.kind == "combine"]
    if combiner == "sum":
        producers = tuple(t.name for t in g.producers(combines[0].name)) if len(combines) == 1 else ()
        transport = g.transport(combines[0].name) if len(combines) == 1 else None
        return Lowering("tp_linear", combiner, producers=producers, transport=transport)
    sink = _sink(g, combines)
    producers = _leaves(g, sink)
    grouped = len(combines) > 1 or len(producers) > 1 or g.task(producers[0]).domain != sink.domain
    attention = "mla_decode" if "head_dim_kpe" in g.attrs else "decode_attention"
    family = "grouped_attention" if grouped else attention
    crossing = sorted({t for t in map(g.transport, (c.name for c in combines)) if t is not None})
    if crossing and family != "decode_attention":
        raise GraphError(f"graph {g.name!r}: partials cross ranks ({', '.join(map(repr, crossing))}) only in the "
                         f"decode_attention and tp_linear families, not {family}")
    return Lowering(family, combiner, producers=producers, transport=g.transport(sink.name))


def _sink(g: TaskGraph, combines: list[TaskTemplate]) -> TaskTemplate:
    """The combine that writes attention's output: the one whose merged state no other combine reads. The
    others are levels of a merge tree (each merges per combine point, like the sink, and feeds one combine)."""
    feeds = {c.name: [d for _, d, r in g.graph.out_edges(c.name, data="reduction") if r is not None]
             for c in combines}
    sinks = [c for c in combines if not feeds[c.name]]
    if len(sinks) != 1 or any(len(d) > 1 for d in feeds.values()):
        raise GraphError(f"graph {g.name!r}: attention's combines must form one tree that merges into one output; "
                         f"combines {[c.name for c in combines]} feed {feeds}")
    inner = [c.name for c in combines if c.domain != sinks[0].domain]
    if inner:
        raise GraphError(f"graph {g.name!r}: combine(s) {inner} merge over another domain than the output's "
                         f"{sinks[0].name!r}: every level of attention's merge is per (request, kv head)")
    return sinks[0]


def _leaves(g: TaskGraph, combine: TaskTemplate) -> tuple[str, ...]:
    """The split-reduce tasks under `combine`, depth first through its inputs in merge order: the order the
    planner lays their pieces on its line and an event lists its parts in."""
    out: list[str] = []
    for t in g.producers(combine.name):
        if t.kind == "combine":
            out += _leaves(g, t)
        elif sum(r is not None for _, _, r in g.graph.out_edges(t.name, data="reduction")) > 1:
            raise GraphError(f"graph {g.name!r}: task {t.name!r} feeds its partials to several combines")
        else:
            out.append(t.name)
    return tuple(out)


def _tiles(g: TaskGraph) -> Lowering:
    """Map, tile and combine tasks: two tile stages joined by a row-block dependency, merged by a weighted sum."""
    kinds = {t.name: t.kind for t in g.tasks}
    reductions = {t.reduction.combiner for t in g.tasks if t.reduction is not None}
    waits = tuple((s, d, dep) for s, d, dep in g.graph.edges(data="depends") if dep is not None and kinds[s] == "tile")
    if reductions != {"weighted_sum"} or len(waits) != 1 or waits[0][2] != "row_block":
        raise GraphError(f"graph {g.name!r}: the tile family runs two tile stages joined by a row-block "
                         f"dependency and a weighted-sum combine; this graph has reductions "
                         f"{sorted(reductions)} and tile edges {list(waits)}")
    return Lowering("moe", "weighted_sum", waits)


# The task kinds a graph may have (sorted), and the selector that reads the rest of it: the planner policies.
PLANNED_KINDS: dict[tuple[str, ...], Callable[[TaskGraph], Lowering]] = {
    ("combine", "split_reduce"): _split_reduce,
    ("combine", "map", "tile"): _tiles,
}


def lower(graph: TaskGraph) -> Lowering:
    """The family that runs `graph` (validated first); GraphError says why none does."""
    if not isinstance(graph, TaskGraph):
        raise TypeError(f"graph must be a meld.ir.TaskGraph, got {type(graph).__name__}")
    g = graph.validate()
    kinds = tuple(sorted({t.kind for t in g.tasks}))
    select = PLANNED_KINDS.get(kinds)
    if select is None:
        raise GraphError(f"graph {g.name!r}: no planner takes task kinds {list(kinds)}; planners take "
                         + " or ".join(str(list(k)) for k in PLANNED_KINDS))
    return select(g)
