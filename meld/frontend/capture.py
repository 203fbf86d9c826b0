"""Capture: derive a meld `TaskGraph` from a TVM PrimFunc by walking it.

What meld needs from a definition is not its loop nest but its *shape as work*: which reduction runs over
a range whose length is only known from data (the axis meld splits across CTAs), how its partial states
merge (the combiner), and which axes index independent tasks. All of it is read from the PrimFunc:

- the range axis is the reduction axis masked by a bound that loads a buffer (`kv < length(request)`);
  the one spatial axis that bound depends on is the request axis;
- the combiner is recovered from the reduction's update `state = f(state, source)` and recognised by
  EVALUATING f on random values against `meld.ir.combiners.COMBINERS`, so any spelling of the same math
  is accepted and a wrong formula is rejected, not silently compiled;
- the static attributes come from buffer shapes and index expressions (q head h reads kv head h // G).
"""
from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import tvm
import tvm_ffi
from tvm import tirx
from tvm.s_tir import SBlock

from ..ir import COMBINERS, Axis, Combiner, Reduction, TaskGraph, TaskTemplate

# meld's axis vocabulary: the scheduler knows these roles, whatever the PrimFunc calls its loop variables.
REQUEST, KV_HEAD, RANGE = "request", "kv_head", "kv"
RANGE_EXTENT = "kv_len"  # the per-request length (Schedule.kv_len); the PrimFunc only has an upper bound


@dataclass(frozen=True)
class RangeReduction:
    """The reduction over a data-dependent range: the part of the PrimFunc meld splits across CTAs."""

    block: SBlock
    axis: tirx.IterVar  # the reduced axis; its extent is only an upper bound of the real length
    request: tirx.IterVar  # the spatial axis the real length depends on
    combiner: str  # key of COMBINERS


# --- walking ----------------------------------------------------------------------------------------

def _collect(node: object, types: type | tuple[type, ...]) -> list:
    found: list = []
    tvm_ffi.structural_walk(node, (types, found.append), order="pre")
    return found


def _uses(expr: object, pred: Callable[[object], bool]) -> bool:
    return any(pred(e) for e in _collect(expr, tvm.ir.expr.Expr))


def _blocks(func: tirx.PrimFunc) -> list[SBlock]:
    if not isinstance(func, tirx.PrimFunc):
        raise ValueError(f"capture needs a tvm.tirx.PrimFunc, got {type(func).__name__}")
    if not isinstance(func.body, tvm.s_tir.SBlockRealize):
        raise ValueError("the PrimFunc has no root block: capture reads block-structured (s_tir) functions")
    return _collect(func.body.block.body, SBlock)


def _stored(block: SBlock) -> list[tirx.Var]:
    return [s.buffer for s in _collect(block.body, tirx.BufferStore)]


def _dtype(expr: tvm.ir.expr.Expr) -> str:
    return str(expr.ty.dtype)


def _is_load(e: object) -> bool:
    return isinstance(e, tvm.ir.TensorLoad)


# --- evaluating TIR expressions ---------------------------------------------------------------------

_BINARY = {
    tirx.Add: np.add, tirx.Sub: np.subtract, tirx.Mul: np.multiply, tirx.Div: np.divide,
    tirx.Max: np.maximum, tirx.Min: np.minimum, tirx.FloorDiv: np.floor_divide, tirx.FloorMod: np.mod,
    tirx.EQ: np.equal, tirx.NE: np.not_equal, tirx.LT: np.less, tirx.LE: np.less_equal,
    tirx.GT: np.greater, tirx.GE: np.greater_equal, tirx.And: np.logical_and, tirx.Or: np.logical_or,
}
_UNARY = {"exp": np.exp, "exp2": np.exp2, "log": np.log, "log2": np.log2, "sqrt": np.sqrt, "fabs": np.abs,
          "sigmoid": lambda v: 1.0 / (1.0 + np.exp(-v))}


def evaluate(expr: tvm.ir.expr.Expr, env: dict[str, np.ndarray]) -> np.ndarray:
    """Evaluate a TIR expression elementwise in float64, with each free Var looked up by name in `env`.

    A load reads the array `env[buffer name]` at its evaluated (truncated) indices.
    """
    if isinstance(expr, (tirx.FloatImm, tirx.IntImm)):
        return np.float64(expr.value)
    if isinstance(expr, tirx.Var):
        if expr.name not in env:
            raise ValueError(f"cannot evaluate {expr.name!r}: the expression depends on more than its inputs")
        return env[expr.name]
    if _is_load(expr):
        if expr.source.name not in env:
            raise ValueError(f"cannot evaluate a load of {expr.source.name!r}: the expression reads more "
                             "than its inputs")
        return env[expr.source.name][tuple(np.asarray(evaluate(i, env)).astype(np.int64) for i in expr.indices)]
    if type(expr) in _BINARY:
        return _BINARY[type(expr)](evaluate(expr.a, env), evaluate(expr.b, env))
    if isinstance(expr, tirx.Not):
        return np.logical_not(evaluate(expr.a, env))
    if isinstance(expr, tirx.Cast):
        v = evaluate(expr.value, env)
        return v if "float" in _dtype(expr) else np.trunc(v)
    if isinstance(expr, tirx.Select):
        args = (expr.condition, expr.true_value, expr.false_value)
    elif isinstance(expr, tvm.ir.expr.Call) and expr.op.name.endswith(".if_then_else"):
        args = tuple(expr.args)
    elif isinstance(expr, tvm.ir.expr.Call) and expr.op.name.split(".")[-1] in _UNARY:
        return _UNARY[expr.op.name.split(".")[-1]](evaluate(expr.args[0], env))
    else:
        raise ValueError(f"cannot evaluate a {type(expr).__name__}: {expr}")
    cond, then, other = (evaluate(a, env) for a in args)
    return np.where(cond, then, other)


# --- the combiner -----------------------------------------------------------------------------------

def canonical_update(block: SBlock, states: list[tirx.Var]) -> tuple[list, list]:
    """Rewrite each state update as f(lhs0.., rhs0..): lhs_i = state i, rhs_j = the distinct source term j.

    A source term is a maximal floating-point subexpression that reads no state but depends on the
    block's iteration or on a load: after TVM inlines the combiner, each source value appears as such.
    """
    binds = {b.var: b.value for b in _collect(block.body, tirx.Bind)}

    def inline(v: tirx.Var, m: tvm_ffi.StructuralMutator) -> object:  # let-bound values, recursively
        return m.mutate(binds[v]) if v in binds else v

    iters = [iv.var for iv in block.iter_vars]
    terms: list = []

    def is_state(e: object) -> bool:
        return _is_load(e) and any(e.source.same_as(s) for s in states)

    def is_term(e: object) -> bool:
        return ("float" in _dtype(e) and not _uses(e, is_state)
                and _uses(e, lambda x: _is_load(x) or any(x.same_as(v) for v in iters)))

    def rewrite(e: object, m: tvm_ffi.StructuralMutator) -> object:
        if is_state(e):
            return tirx.Var(f"lhs{[s.same_as(e.source) for s in states].index(True)}", "float64")
        if is_term(e):
            match = [j for j, t in enumerate(terms) if tvm_ffi.structural_equal(t, e)]
            if not match:
                terms.append(e)
            return tirx.Var(f"rhs{match[0] if match else len(terms) - 1}", "float64")
        return m.default_mutate(e)

    stores = _collect(block.body, tirx.BufferStore)
    values = [tvm_ffi.structural_mutate(s.value, (tirx.Var, inline)) for s in stores]
    return [tvm_ffi.structural_mutate(v, (tvm.ir.expr.Expr, rewrite)) for v in values], terms


_CASES = ("random states", "the identity on the left", "the identity on the right", "two identities")


def _mismatch(comb: Combiner, updates: list, perm: tuple[int, ...]) -> tuple[int, str] | None:
    """(state component, case) of the first difference between the update and `comb.merge`, or None."""
    k, n = len(comb.state), 16
    a, b = np.random.default_rng(0).normal(0.0, 2.0, (2, k, n))
    ident = np.broadcast_to(np.asarray(comb.identity, dtype=np.float64)[:, None], (k, n))
    lhs = np.concatenate([a, ident, a, ident], axis=1)
    rhs = np.concatenate([b, b, ident, ident], axis=1)
    env = {f"lhs{i}": lhs[i] for i in range(k)} | {f"rhs{perm[j]}": rhs[j] for j in range(k)}
    with np.errstate(all="ignore"):
        want = comb.merge(*lhs, *rhs)
        for i, u in enumerate(updates):
            ok = np.isclose(np.broadcast_to(evaluate(u, env), want[i].shape), want[i], rtol=1e-5, atol=1e-8)
            if not ok.all():
                return i, _CASES[int(np.argmin(ok)) // n]
    return None


def recognise_combiner(block: SBlock, names: tuple[str, ...] = tuple(COMBINERS)) -> str:
    """Name the entry of COMBINERS (among `names`) the reduction in `block` implements, or raise ValueError.

    The first match in `names` wins: "weighted_sum" merges like "sum" (its weights are part of the source,
    not of the merge), so a plain sum is named "sum" unless the caller asks for "weighted_sum" alone.
    """
    states = _stored(block)
    if block.init is None:
        raise ValueError(f"block {block.name_hint!r} has no init, so it is not a reduction")
    init = {s.buffer: s.value for s in _collect(block.init, tirx.BufferStore)}
    if any(s not in init for s in states):
        raise ValueError(f"block {block.name_hint!r}: every reduction state needs an init value")
    identity = tuple(float(evaluate(init[s], {})) for s in states)
    updates, terms = canonical_update(block, states)
    if len(terms) != len(states):
        raise ValueError(f"block {block.name_hint!r}: the update of {len(states)} states reads {len(terms)} "
                         "distinct source terms; expected state = combine(state, source) with one term per state")
    why = []
    for comb in (COMBINERS[n] for n in names):
        if len(comb.state) != len(states):
            continue
        if not np.array_equal(identity, comb.identity):
            why.append(f"{comb.name}: identity {identity} != {comb.identity}")
            continue
        misses = [_mismatch(comb, updates, p) for p in itertools.permutations(range(len(states)))]
        if None in misses:
            return comb.name
        state, case = max(misses)  # the source order that matches most leading states
        why.append(f"{comb.name}: state {comb.state[state]!r} differs when merging {case}")
    raise ValueError(f"block {block.name_hint!r}: the reduction's combiner matches no known combiner "
                     f"({'; '.join(why) or f'none has {len(states)} state components'})")


# --- the range reduction ----------------------------------------------------------------------------

def _data_bounds(block: SBlock, var: tirx.Var) -> list:
    """Upper bounds `var < bound` in the block's masks whose bound loads a buffer (a data-dependent length)."""
    bounds = []
    for c in _collect(block.body, (tirx.LT, tirx.LE, tirx.GT, tirx.GE)):
        below = isinstance(c, (tirx.LT, tirx.LE))
        axis, bound = (c.a, c.b) if below else (c.b, c.a)
        if axis.same_as(var) and _uses(bound, _is_load):
            bounds.append(bound)
    return bounds


def find_range_reduction(func: tirx.PrimFunc) -> RangeReduction:
    """Find the one reduction whose range is bounded by loaded data, its request axis and its combiner."""
    found = [(b, iv, bounds) for b in _blocks(func) for iv in b.iter_vars
             if iv.iter_type == tirx.IterVar.CommReduce and (bounds := _data_bounds(b, iv.var))]
    if len(found) != 1:
        raise ValueError(f"expected exactly one reduction masked by a data-dependent length "
                         f"(`axis < length[request]`), found {len(found)}")
    block, axis, bounds = found[0]
    requests = [iv for iv in block.iter_vars if iv.iter_type == tirx.IterVar.DataPar
                and any(_uses(bd, lambda e, v=iv.var: e.same_as(v)) for bd in bounds)]
    if len(requests) != 1:
        raise ValueError(f"block {block.name_hint!r}: the length of axis {axis.var.name!r} must depend on "
                         f"exactly one spatial axis (the request), not {[r.var.name for r in requests]}")
    if not isinstance(requests[0].dom.extent, tirx.Var):
        raise ValueError(f"the request axis {requests[0].var.name!r} needs a symbolic extent (the batch size)")
    return RangeReduction(block, axis, requests[0], recognise_combiner(block))


# --- split-KV attention: its operands and its graph -------------------------------------------------

def _static(buf: tirx.Var, dim: int) -> int:
    if not isinstance(buf.shape[dim], tirx.IntImm):
        raise ValueError(f"{buf.name}.shape[{dim}] = {buf.shape[dim]} must be a constant")
    return int(buf.shape[dim].value)


def _cone(blocks: list[SBlock], root: SBlock) -> list[SBlock]:
    """`root` and every block it transitively reads from."""
    cone, todo = [], [root]
    while todo:
        blk = todo.pop()
        if any(blk.same_as(c) for c in cone):
            continue
        cone.append(blk)
        read = [ld.source for ld in _collect(blk.body, tvm.ir.TensorLoad)]
        todo += [b for b in blocks if any(s.same_as(r) for s in _stored(b) for r in read)]
    return cone


@dataclass(frozen=True)
class Operands:
    """The buffers around the range reduction, each list in parameter order (the graph's reads and writes)."""

    reduction: RangeReduction
    outputs: list[tirx.Var]  # the parameters the function writes
    reads: list[tirx.Var]  # the inputs the reduction's cone loads
    loads: list[tuple[SBlock, tvm.ir.TensorLoad]]  # every load in that cone, with its block

    @property
    def floats(self) -> list[tirx.Var]:
        return [p for p in self.reads if "float" in str(p.dtype)]

    @property
    def paged(self) -> list[tirx.Var]:
        """The float inputs indexed through another load: the paged KV caches."""
        return [p for p in self.floats if any(ld.source.same_as(p) and _uses(list(ld.indices), _is_load)
                                              for _, ld in self.loads)]


def find_operands(func: tirx.PrimFunc) -> Operands:
    """The range reduction of `func` (`find_range_reduction`), what it reads and what the function writes."""
    blocks = _blocks(func)
    red = find_range_reduction(func)
    written = [b for blk in blocks for b in _stored(blk)]
    buffers = [p for p in func.params if tirx.is_buffer_var(p)]
    outputs = [p for p in buffers if any(p.same_as(w) for w in written)]
    inputs = [p for p in buffers if not any(p.same_as(o) for o in outputs)]
    loads = [(blk, ld) for blk in _cone(blocks, red.block) for ld in _collect(blk.body, tvm.ir.TensorLoad)]
    reads = [p for p in inputs if any(ld.source.same_as(p) for _, ld in loads)]
    return Operands(red, outputs, reads, loads)


def split_kv_graph(name: str, attrs: dict[str, object], domain: tuple[Axis, ...], ops: Operands) -> TaskGraph:
    """attention_partial (a split-reduce over part of the KV range, per point of `domain`) -> merge."""
    reduction = Reduction(ops.reduction.combiner, RANGE)
    affinity = tuple(a.name for a in domain)
    partials = tuple(f"partial_{p.name}" for p in ops.outputs)
    g = TaskGraph(name, attrs)
    g.add_task(TaskTemplate(
        "attention_partial", "split_reduce", domain, range_axis=Axis(RANGE, RANGE_EXTENT, dynamic=True),
        affinity=affinity, reduction=reduction, reads=tuple(p.name for p in ops.reads), writes=partials))
    g.add_task(TaskTemplate("merge", "combine", domain, affinity=affinity, reduction=reduction,
                            reads=partials, writes=tuple(p.name for p in ops.outputs)))
    g.add_edge("attention_partial", "merge", reduction)
    return g.validate()


# --- paged GQA attention ----------------------------------------------------------------------------

def _group_size(kv_loads: list, num_qo_heads: int) -> int:
    """G from the KV head index `h // G` (just `h` when G = 1) of every KV load, h a q-head axis."""
    sizes = set()
    for blk, ld in kv_loads:
        idx = ld.indices[3]  # kv_cache [num_pages, 2, page_size, num_kv_heads, head_dim]
        h, g = (idx.a, idx.b) if isinstance(idx, tirx.FloorDiv) else (idx, tirx.IntImm("int32", 1))
        heads = [iv for iv in blk.iter_vars if iv.var.same_as(h) and iv.iter_type == tirx.IterVar.DataPar]
        if not (heads and isinstance(g, tirx.IntImm) and isinstance(heads[0].dom.extent, tirx.IntImm)
                and heads[0].dom.extent.value == num_qo_heads):
            raise ValueError(f"block {blk.name_hint!r}: KV head index {idx} is not q_head // group_size")
        sizes.add(int(g.value))
    if len(sizes) != 1:
        raise ValueError(f"KV loads disagree on the group size: {sorted(sizes)}")
    return sizes.pop()


def capture(func: tirx.PrimFunc) -> TaskGraph:
    """Derive the decode-attention task graph from its TVM definition.

    Args:
        func: a PrimFunc of paged GQA decode attention in FlashInfer's layout, e.g. from
            `decode_attention_primfunc`: q [B, Hq, D], kv_cache [P, 2, page_size, Hkv, D] read through a
            page table, one reduction over the KV axis masked by each request's length.

    Returns:
        The validated TaskGraph; equal to `meld.ops.decode_graph.decode_attention_graph` of the same config.

    Raises:
        ValueError: the function does not have that structure; the message names what is missing.

    Example:
        >>> capture(decode_attention_primfunc(32, 8, 128, 16)).attrs["group_size"]
        4
    """
    ops = find_operands(func)
    red, floats, paged = ops.reduction, ops.floats, ops.paged
    if len(floats) != 2 or len(paged) != 1:
        raise ValueError(f"expected a query and a paged KV cache among the float inputs, found "
                         f"{[p.name for p in floats]} ({[p.name for p in paged]} paged)")
    kv = paged[0]
    q = next(p for p in floats if not p.same_as(kv))
    if len(q.shape) != 3 or not q.shape[0].same_as(red.request.dom.extent):
        raise ValueError(f"{q.name} must be [batch, num_qo_heads, head_dim], got {list(q.shape)}")
    if len(kv.shape) != 5 or _static(kv, 1) != 2:
        raise ValueError(f"{kv.name} must be [num_pages, 2, page_size, num_kv_heads, head_dim], "
                         f"got {list(kv.shape)}")
    if str(kv.dtype) != str(q.dtype) or _static(kv, 4) != _static(q, 2):
        raise ValueError(f"{q.name} and {kv.name} differ in dtype or head_dim")
    num_qo_heads, num_kv_heads = _static(q, 1), _static(kv, 3)
    group = _group_size([(b, ld) for b, ld in ops.loads if ld.source.same_as(kv)], num_qo_heads)
    if group * num_kv_heads != num_qo_heads:
        raise ValueError(f"group size {group} x {num_kv_heads} kv heads != {num_qo_heads} q heads")

    domain = (Axis(REQUEST, red.request.dom.extent.name), Axis(KV_HEAD, num_kv_heads))
    return split_kv_graph("decode_attention", {
        "num_qo_heads": num_qo_heads, "num_kv_heads": num_kv_heads, "group_size": group,
        "head_dim": _static(q, 2), "page_size": _static(kv, 2), "dtype": str(q.dtype),
    }, domain, ops)
