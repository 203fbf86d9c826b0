"""Capture of the row-parallel linear: derive meld's "tp_linear" TaskGraph from a TVM PrimFunc.

As for decode attention and MoE, the definition's shape as work is read, and its math checked by running
it: the one reduction must merge as a sum (`recognise_combiner`, evaluated against `meld.ir.combiners`);
its two inputs are the tokens [T, K] (T symbolic) and the weight [N, K]; and the blocks, run in NumPy on
random data (`run_blocks`), must give x w^T. Any spelling of that math is accepted; anything else is
rejected with the reason, before a kernel is compiled.
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import tirx

from ..ir import TaskGraph
from ..ops.tp_linear_graph import tp_linear_graph
from .capture import _blocks, _collect, _is_load, _stored, recognise_combiner
from .capture_moe import _axes, _names_written, run_blocks

_SAMPLE_TOKENS = 3


def capture_tp_linear(func: tirx.PrimFunc, world: int) -> TaskGraph:
    """The task graph of a row-parallel linear defined by `func` (like `meld.frontend.tp_linear.
    tp_linear_primfunc`'s), its contraction dimension spread over `world` ranks; equal to
    `meld.ops.tp_linear_graph.tp_linear_graph` of the same sizes.

    Raises:
        ValueError: not one sum over a contraction of x [T, K] with weight [N, K], a K that `world` does
            not divide, or another formula; the message names the block or buffer and what is wrong.
    """
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world={world!r} must be a positive integer")
    blocks = _blocks(func)
    reductions = [b for b in blocks if b.init is not None]
    if len(reductions) != 1:
        raise ValueError(f"a row-parallel linear is one reduction; found {len(reductions)}: "
                         f"{[b.name_hint for b in reductions]}")
    block = reductions[0]
    recognise_combiner(block, ("sum",))   # raises unless the reduction merges as a sum
    spatial, reduced = _axes(block)
    if len(spatial) != 2 or len(reduced) != 1:
        raise ValueError(f"block {block.name_hint!r}: expected spatial axes (token, column) and one contraction "
                         f"axis, got {len(spatial)} and {len(reduced)}")
    states = _stored(block)
    inputs = {}
    for e in _collect(block.body, tvm.ir.expr.Expr):
        if _is_load(e) and not any(e.source.same_as(s) for s in states):
            inputs.setdefault(e.source.name, e.source)
    if len(inputs) != 2:
        raise ValueError(f"block {block.name_hint!r} reads {sorted(inputs)}; a row-parallel linear reads the tokens "
                         "and the weight")
    x, w = sorted(inputs.values(), key=lambda b: isinstance(b.shape[0], tirx.IntImm))   # x: T symbolic
    if isinstance(x.shape[0], tirx.IntImm) or not isinstance(w.shape[0], tirx.IntImm) or len(x.shape) != 2 \
            or len(w.shape) != 2:
        raise ValueError(f"expected tokens [T, K] with T symbolic and a weight [N, K]; got {x.name} {list(x.shape)}, "
                         f"{w.name} {list(w.shape)}")
    k_all, n = int(x.shape[1]), int(w.shape[0])
    if int(w.shape[1]) != k_all:
        raise ValueError(f"{x.name} has K = {k_all} and {w.name} K = {int(w.shape[1])}: they must match")
    if k_all % world:
        raise ValueError(f"world={world} does not divide the contraction dimension K = {k_all}")
    outputs = [p for p in func.params if tirx.is_buffer_var(p) and p.name in _names_written(blocks)]
    if len(outputs) != 1:
        raise ValueError(f"expected one output buffer, got {[b.name for b in outputs]}")
    rng = np.random.default_rng(0)
    sizes = {str(x.shape[0]): _SAMPLE_TOKENS}
    xv, wv = rng.normal(0.0, 1.0, (_SAMPLE_TOKENS, k_all)), rng.normal(0.0, 1.0, (n, k_all))
    got = run_blocks(blocks, {x.name: xv, w.name: wv}, sizes)[outputs[0].name]
    want = xv @ wv.T
    if got.shape != want.shape or not np.allclose(got, want, rtol=1e-6, atol=1e-9):
        raise ValueError(f"{outputs[0].name} is not {x.name} @ {w.name}^T: the definition computes another formula")
    return tp_linear_graph(k_all // world, n, world, str(x.dtype))
