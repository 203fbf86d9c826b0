"""Capture of the MoE expert FFN: derive meld's "moe" TaskGraph from a TVM PrimFunc by walking it.

Like the decode capture, this reads the definition's *shape as work*, not its loop nest:

- the expert GEMMs are the reductions that load a weight through a loaded expert id (`w[ids[t, j], n, h]`):
  that indirect index is what lets rows be grouped by expert (the dispatch task) and makes them wait for
  routing. Of the two, the one whose operand is computed from the other's output is the down projection;
  the blocks in between are the activation.
- the down projection reads the activation at its own (token, k) row and contracts over all its columns,
  so one of its tiles (expert, row_block) waits for every gate/up tile of that (expert, row_block): the
  edge's `depends="row_block"`. A definition that reads another row is rejected.
- the combine is the reduction that reads the expert outputs. Its merge is recognised by evaluating the
  update against `meld.ir.combiners` (as for decode); the weighting, the activation and the routing are
  checked by RUNNING their blocks on random data in NumPy (`run_blocks`), so any spelling of the same math
  is accepted and a wrong formula is rejected with the reason, not compiled.
- `renormalize` is read from the routing's values. Where it cannot change them (top_k = num_experts: the
  chosen probabilities already sum to 1) the graph records False, as `meld.ops.moe_graph` does.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import tvm
import tvm_ffi
from tvm import tirx
from tvm.s_tir import SBlock

from ..ir import Axis, Reduction, TaskGraph, TaskTemplate
from .capture import (
    _blocks,
    _collect,
    _cone,
    _is_load,
    _static,
    _stored,
    canonical_update,
    evaluate,
    recognise_combiner,
)

# meld's vocabulary for the MoE graph; rows of an expert are only known from routing (dynamic).
TOKEN, EXPERT, ROW_BLOCK, COL_BLOCK, K = "token", "expert", "row_block", "col_block", "k"
EXPERT_TOKENS, EXPERT_ROWS = "expert_tokens", "expert_rows"  # per-expert row count; dispatch's row lists
_SAMPLE_TOKENS = 4  # tokens in the NumPy runs: a few distinct rows, cheap for any H, I, E


def _close(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool(np.allclose(a, b, rtol=1e-6, atol=1e-9))


def _silu(v: np.ndarray) -> np.ndarray:
    return v / (1.0 + np.exp(-v))


def _same(exprs: list, vars_: list) -> bool:
    return len(exprs) == len(vars_) and all(e.same_as(v) for e, v in zip(exprs, vars_))


def _axes(block: SBlock) -> tuple[list[tirx.IterVar], list[tirx.IterVar]]:
    return ([iv for iv in block.iter_vars if iv.iter_type == tirx.IterVar.DataPar],
            [iv for iv in block.iter_vars if iv.iter_type == tirx.IterVar.CommReduce])


def _names(blocks: list[SBlock]) -> set[str]:
    return {b.name_hint for b in blocks}


def _names_written(blocks: list[SBlock]) -> set[str]:
    return {b.name for blk in blocks for b in _stored(blk)}


# --- running blocks in NumPy ------------------------------------------------------------------------

def run_blocks(blocks: list[SBlock], bufs: dict[str, np.ndarray], sizes: dict[str, int]) -> dict[str, np.ndarray]:
    """Run `blocks` in order in float64, over every point of their domains; returns `bufs` with their outputs.

    Buffers are looked up by name in `bufs`; `sizes` binds the symbolic extents. A reduction runs its init,
    then its update once per point of its reduction axes, vectorised over its spatial axes.
    """
    for blk in blocks:
        spatial, reduced = _axes(blk)

        def extent(iv: tirx.IterVar) -> int:
            return int(evaluate(iv.dom.extent, sizes))

        for buf in _stored(blk):
            bufs.setdefault(buf.name, np.zeros([int(evaluate(d, sizes)) for d in buf.shape]))
        grid = np.meshgrid(*(np.arange(extent(iv)) for iv in spatial), indexing="ij")
        env = sizes | bufs | {iv.var.name: g for iv, g in zip(spatial, grid)}

        def store(stmt: object, env: dict[str, np.ndarray] = env) -> None:
            for s in _collect(stmt, tirx.BufferStore):
                index = tuple(np.asarray(evaluate(i, env)).astype(np.int64) for i in s.indices)
                bufs[s.buffer.name][index] = evaluate(s.value, env)

        if blk.init is not None:
            store(blk.init)
        for point in itertools.product(*(range(extent(iv)) for iv in reduced)):
            env.update({iv.var.name: np.int64(p) for iv, p in zip(reduced, point)})
            store(blk.body)
    return bufs


def _random(buf: tirx.Var, sizes: dict[str, int], rng: np.random.Generator) -> np.ndarray:
    return rng.normal(0.0, 2.0, [int(evaluate(d, sizes)) for d in buf.shape])


# --- the expert GEMMs -------------------------------------------------------------------------------

@dataclass(frozen=True)
class ExpertGemm:
    """out[t, j, n] = sum_r operand[t, (j,) r] * weight[ids[t, j], n, r]: one token row through one expert."""

    block: SBlock
    operand: tvm.ir.TensorLoad  # x [t, r] (gate/up) or act [t, j, r] (down)
    weight: tvm.ir.TensorLoad
    ids: tvm.ir.TensorLoad  # the expert id the weight is read through

    @property
    def out(self) -> tirx.Var:
        return _stored(self.block)[0]


def _loads_as_vars(expr: object, names: dict[str, str]) -> object:
    def rewrite(e: object, m: tvm_ffi.StructuralMutator) -> object:
        if _is_load(e) and e.source.name in names:
            return tirx.Var(names[e.source.name], "float64")
        return m.default_mutate(e)

    return tvm_ffi.structural_mutate(expr, (tvm.ir.expr.Expr, rewrite))


def _expert_gemm(block: SBlock) -> ExpertGemm:
    """Read `block` as an expert GEMM, or raise ValueError saying which part does not fit."""
    name, (spatial, reduced) = block.name_hint, _axes(block)
    if len(spatial) != 3 or len(reduced) != 1 or len(_stored(block)) != 1:
        raise ValueError(f"block {name!r}: an expert GEMM has spatial axes (token, k, column), one contraction "
                         f"axis and one output; it has {len(spatial)}, {len(reduced)} and {len(_stored(block))}")
    (t, j, n), r = (iv.var for iv in spatial), reduced[0].var
    state = _stored(block)[0]
    loads = [ld for ld in _collect(block.body, tvm.ir.TensorLoad) if not ld.source.same_as(state)]
    weight = next(ld for ld in loads if len(ld.indices) == 3 and _is_load(ld.indices[0]))
    ids = weight.indices[0]
    if not (_is_load(ids) and _same(list(ids.indices), [t, j]) and _same(list(weight.indices[1:]), [n, r])):
        raise ValueError(f"block {name!r}: the weight must be read as {weight.source.name}[expert id[token, k], "
                         f"column, contraction], got {weight}")
    operands = {ld.source.name: ld for ld in loads if not (ld.same_as(weight) or ld.same_as(ids))}
    op = next(iter(operands.values()), None)
    if len(operands) != 1 or not (op.indices[0].same_as(t) and op.indices[-1].same_as(r)):
        raise ValueError(f"block {name!r}: besides the weight, an expert GEMM reads one operand at "
                         f"[token, ..., contraction]; got {list(operands.values())}")
    recognise_combiner(block, ("sum",))
    _, (term,) = canonical_update(block, [state])
    a, b = np.random.default_rng(0).normal(size=(2, 16))
    got = evaluate(_loads_as_vars(term, {op.source.name: "a", weight.source.name: "b"}), {"a": a, "b": b})
    if not _close(np.broadcast_to(got, a.shape), a * b):
        raise ValueError(f"block {name!r}: the summand {term} is not operand * weight")
    return ExpertGemm(block, op, weight, ids)


def _find_gemms(blocks: list[SBlock]) -> tuple[ExpertGemm, ExpertGemm]:
    """(gate/up, down): the reductions that read a 3-d weight through a loaded expert id, in dataflow order."""
    found = [_expert_gemm(b) for b in blocks if _axes(b)[1] and any(
        len(ld.indices) == 3 and _is_load(ld.indices[0]) for ld in _collect(b.body, tvm.ir.TensorLoad))]
    if len(found) != 2:
        raise ValueError(f"expected two expert GEMMs (a weight read through a routed expert id, "
                         f"`w[ids[t, k], n, h]`), found {[g.block.name_hint for g in found]}")
    first, second = found
    if first.block.name_hint in _names(_cone(blocks, second.block)):
        return first, second
    raise ValueError(f"the down projection {second.block.name_hint!r} must read the output of "
                     f"{first.block.name_hint!r} (through the activation)")


# --- the formulas, checked by running them ----------------------------------------------------------

def _check_activation(region: list[SBlock], gate_up: tirx.Var, act: tirx.Var, sizes: dict[str, int],
                      w13: str) -> None:
    """The blocks between the GEMMs must compute SiLU(gate) * up from the gate/up GEMM's two halves."""
    if not region:
        raise ValueError(f"{gate_up.name} feeds the down projection directly: the activation SiLU(gate) * up "
                         "is missing")
    g = _random(gate_up, sizes, np.random.default_rng(1))
    inter = _static(act, 2)
    if g.shape[-1] != 2 * inter:
        raise ValueError(f"{gate_up.name} has {g.shape[-1]} columns; gate and up need 2 x {inter}")
    got = run_blocks(region, {gate_up.name: g}, sizes)[act.name]
    gate, up = g[..., :inter], g[..., inter:]
    if _close(got, _silu(gate) * up):
        return
    known = {"SiLU is missing (it computes gate * up)": gate * up,
             "gate and up are swapped (it computes SiLU(up) * gate)": _silu(up) * gate}
    why = next((k for k, v in known.items() if _close(got, v)), "it computes something else")
    raise ValueError(f"the activation {act.name} must be SiLU(gate) * up, gate = rows 0..{inter - 1} and up = "
                     f"rows {inter}..{2 * inter - 1} of {w13}: {why}")


def _check_combine(region: list[SBlock], expert_out: tirx.Var, weights: list[tirx.Var], out: tirx.Var,
                   sizes: dict[str, int], top_k: int) -> None:
    """The blocks after the down projection must compute out[t] = sum_j weights[t, j] * expert_out[t, j]."""
    rng = np.random.default_rng(2)
    y = _random(expert_out, sizes, rng)
    bufs = {expert_out.name: y} | {w.name: _random(w, sizes, rng) for w in weights}
    got = run_blocks(region, bufs, sizes)[out.name]
    if (len(weights) == 1 and bufs[weights[0].name].shape == y.shape[:2]
            and _close(got, np.einsum("tj,tjh->th", bufs[weights[0].name], y))):
        return
    why = ("an unweighted sum of the expert outputs: the routing weights are not applied"
           if _close(got, y.sum(axis=1)) else f"not sum_k w[t, k] * {expert_out.name}[t, k, h] with "
           f"w [num_tokens, {top_k}] (it reads {[w.name for w in weights]} besides {expert_out.name})")
    raise ValueError(f"the combine computing {out.name} is {why}")


def _routing_renormalizes(route: list[SBlock], logits: tirx.Var, ids: tirx.Var, weights: tirx.Var,
                          sizes: dict[str, int], top_k: int) -> bool:
    """Check the routing is top-k softmax; True when it also renormalises (and that changes the weights)."""
    lg = _random(logits, sizes, np.random.default_rng(3))
    bufs = run_blocks(route, {logits.name: lg}, sizes)
    got_ids, got_w = bufs[ids.name].astype(np.int64), bufs[weights.name]
    probs = np.exp(lg - lg.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    want_ids = np.sort(np.argsort(-probs, axis=1, kind="stable")[:, :top_k], axis=1)
    if not np.array_equal(np.sort(got_ids, axis=1), want_ids):
        raise ValueError(f"the routing's {ids.name} are not the top {top_k} experts by softmax probability "
                         f"of {logits.name}")
    got_w = np.take_along_axis(got_w, np.argsort(got_ids, axis=1), axis=1)   # both in expert order
    chosen = np.take_along_axis(probs, want_ids, axis=1)
    if _close(got_w, chosen):
        return False
    if _close(got_w, chosen / chosen.sum(axis=1, keepdims=True)):
        return True
    raise ValueError(f"the routing's {weights.name} are neither the softmax probabilities of the chosen "
                     "experts nor those probabilities renormalised to sum 1")


# --- the graph --------------------------------------------------------------------------------------

def _check_shape(buf: tirx.Var, want: list[int]) -> None:
    got = [_static(buf, i) for i in range(len(buf.shape))]
    if got != want:
        raise ValueError(f"{buf.name} must have shape {want}, got {got}")


def _reads(blocks: list[SBlock]) -> dict[str, tirx.Var]:
    """The buffers `blocks` load and do not write themselves, by name."""
    made = {b.name for blk in blocks for b in _stored(blk)}
    return {ld.source.name: ld.source for blk in blocks for ld in _collect(blk.body, tvm.ir.TensorLoad)
            if ld.source.name not in made}


def _combine(blocks: list[SBlock], gemm2: ExpertGemm) -> tuple[SBlock, list[SBlock], list[tirx.Var]]:
    """(the reduction over k that reads the expert outputs, it and every block after it, what else they read)."""
    tail = [b for b in blocks if not b.same_as(gemm2.block) and gemm2.block.name_hint in _names(_cone(blocks, b))]
    readers = [b for b in tail if any(ld.source.same_as(gemm2.out) for ld in _collect(b.body, tvm.ir.TensorLoad))]
    if len(readers) != 1 or len(_axes(readers[0])[1]) != 1:
        raise ValueError(f"expected one reduction over k reading {gemm2.out.name}, got "
                         f"{[b.name_hint for b in readers]}")
    return readers[0], tail, [b for n, b in _reads(tail).items() if n != gemm2.out.name]


def capture_moe(func: tirx.PrimFunc) -> TaskGraph:
    """Derive the MoE expert-FFN task graph from its TVM definition.

    Args:
        func: a PrimFunc like `meld.frontend.moe.moe_primfunc`'s: top-k softmax routing of router_logits
            [T, E], per (token, k) row the gate/up GEMM with w13 [E, 2I, H] on x [T, H], SiLU(gate) * up,
            the down GEMM with w2 [E, H, I], and the routing-weighted sum over k into out [T, H]; T symbolic.

    Returns:
        The validated TaskGraph "moe": route -> dispatch -> gemm1 -> gemm2 -> combine; equal to
        `meld.ops.moe_graph.moe_graph` of the same config.

    Raises:
        ValueError: the function does not have that structure or computes another formula; the message
            names the block or buffer and what is wrong.

    Example:
        >>> capture_moe(moe_primfunc(4096, 14336, 8, 2)).attrs["top_k"]
        2
    """
    blocks = _blocks(func)
    gemm1, gemm2 = _find_gemms(blocks)
    x, act, w13, w2 = gemm1.operand.source, gemm2.operand.source, gemm1.weight.source, gemm2.weight.source
    ids = gemm1.ids.source
    if not gemm2.ids.source.same_as(ids):
        raise ValueError(f"the GEMMs read their experts from different ids: {ids.name}, {gemm2.ids.source.name}")
    if not _same(list(gemm2.operand.indices[:-1]), [iv.var for iv in _axes(gemm2.block)[0][:2]]):
        raise ValueError(f"{gemm2.block.name_hint!r} must read {act.name} at its own (token, k) row, got "
                         f"{gemm2.operand}")
    outputs = [p for p in func.params if tirx.is_buffer_var(p) and p.name in _names_written(blocks)]
    num_tokens = x.shape[0]
    symbolic = isinstance(num_tokens, tirx.Var)
    if len(outputs) != 1 or not symbolic:
        raise ValueError(f"expected one output and x [num_tokens, H] with num_tokens symbolic, got outputs "
                         f"{[p.name for p in outputs]} and {x.name} {list(x.shape)}")
    out, sizes = outputs[0], {num_tokens.name: _SAMPLE_TOKENS}
    writer = {b.name: blk for blk in blocks for b in _stored(blk)}
    before = _names(_cone(blocks, gemm1.block))
    _check_activation([b for b in blocks if b.name_hint in _names(_cone(blocks, writer[act.name])) - before],
                      gemm1.out, act, sizes, w13.name)
    combine, tail, weights = _combine(blocks, gemm2)
    combiner = recognise_combiner(combine, ("weighted_sum",))
    top_k = _static(ids, 1)
    _check_combine(tail, gemm2.out, weights, out, sizes, top_k)

    if ids.name not in writer or weights[0].name not in writer:
        raise ValueError(f"{ids.name} and {weights[0].name} must be computed from the router logits in the "
                         "function (the routing), not passed in")
    route_names = _names(_cone(blocks, writer[ids.name])) | _names(_cone(blocks, writer[weights[0].name]))
    route = [b for b in blocks if b.name_hint in route_names]
    if len(_reads(route)) != 1:
        raise ValueError(f"the routing must read only the router logits, reads {sorted(_reads(route))}")
    (logits,) = _reads(route).values()
    hidden, inter, num_experts = _static(x, 1), _static(act, 2), _static(w13, 0)
    _check_shape(w13, [num_experts, 2 * inter, hidden])
    _check_shape(w2, [num_experts, hidden, inter])
    if not (logits.shape[0].same_as(num_tokens) and _static(logits, 1) == num_experts):
        raise ValueError(f"{logits.name} must be [{num_tokens.name}, {num_experts}], got {list(logits.shape)}")
    dtypes = {str(b.dtype) for b in (x, w13, w2, out)}
    if len(dtypes) != 1:
        raise ValueError(f"{x.name}, {w13.name}, {w2.name} and {out.name} must share one dtype, got {dtypes}")
    renormalize = _routing_renormalizes(route, logits, ids, weights[0], sizes, top_k)

    token, expert = Axis(TOKEN, num_tokens.name), Axis(EXPERT, num_experts)
    rows = Axis(ROW_BLOCK, EXPERT_TOKENS, dynamic=True)
    reduction = Reduction(combiner, K)
    g = TaskGraph("moe", {
        "hidden_size": hidden, "intermediate_size": inter, "num_experts": num_experts, "top_k": top_k,
        "renormalize": renormalize, "dtype": dtypes.pop(), "activation": "silu",
    })
    g.add_task(TaskTemplate("route", "map", (token,), affinity=(TOKEN,), reads=(logits.name,),
                            writes=(ids.name, weights[0].name)))
    g.add_task(TaskTemplate("dispatch", "map", (expert,), affinity=(EXPERT,), reads=(ids.name,),
                            writes=(EXPERT_ROWS,)))
    # gemm1's tile computes gate and up for the same act columns and applies the activation in place
    g.add_task(TaskTemplate("gemm1", "tile", (expert, rows, Axis(COL_BLOCK, inter)), affinity=(EXPERT,),
                            reads=(EXPERT_ROWS, x.name, w13.name), writes=(act.name,)))
    g.add_task(TaskTemplate("gemm2", "tile", (expert, rows, Axis(COL_BLOCK, hidden)), affinity=(EXPERT,),
                            reads=(EXPERT_ROWS, act.name, w2.name), writes=(gemm2.out.name,)))
    g.add_task(TaskTemplate("combine", "combine", (token,), affinity=(TOKEN,), reduction=reduction,
                            reads=(weights[0].name, gemm2.out.name), writes=(out.name,)))
    g.add_edge("route", "dispatch")                  # dispatch groups rows by the ids routing writes
    g.add_edge("dispatch", "gemm1", depends=EXPERT)  # a GEMM row reads the weights of its own expert only
    g.add_edge("gemm1", "gemm2", depends=ROW_BLOCK)  # gemm2 contracts over all of its own row's act columns
    g.add_edge("gemm2", "combine", reduction)
    return g.validate()
