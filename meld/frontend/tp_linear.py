"""The row-parallel linear (a tensor-parallel projection), defined in TVM as the input
`meld.frontend.capture_tp.capture_tp_linear` reads.

The definition is the math over the whole contraction dimension: y = x w^T, accumulated in float32 and
rounded once to the model dtype. That the K range is spread over the ranks of a group (each holding
`in_features` of it, as the column-parallel layer before leaves the input) is a schedule, not math: the
capture takes the number of ranks as an argument.
"""
from __future__ import annotations

from tvm import te, tirx


def tp_linear_primfunc(in_features: int, out_features: int, world: int, dtype: str = "bfloat16") -> tirx.PrimFunc:
    """x [T, world x in_features], weight [out_features, world x in_features] -> out [T, out_features]; T
    symbolic."""
    k_all = in_features * world
    num_tokens = tirx.Var("num_tokens", "int32")
    x = te.placeholder((num_tokens, k_all), dtype, "x")
    w = te.placeholder((out_features, k_all), dtype, "weight")
    k = te.reduce_axis((0, k_all), "k")
    acc = te.compute((num_tokens, out_features),
                     lambda t, n: te.sum(x[t, k].astype("float32") * w[n, k].astype("float32"), axis=k), name="acc")
    out = te.compute((num_tokens, out_features), lambda t, n: acc[t, n].astype(dtype), name="out")
    return te.create_prim_func([x, w, out])
