"""Capture of MLA decode attention: derive meld's "mla_decode" TaskGraph from a TVM PrimFunc by walking it.

It reads the definition exactly as `meld.frontend.capture` reads GQA decode, with its helpers:

- the range axis, its request axis and the combiner come from `find_operands` (`find_range_reduction`); the
  combiner, recognised by evaluating it, must be online softmax: partials of attention merge no other way;
- the paged caches are the float inputs indexed through the page table. The one the softmax reduction itself
  loads holds the values, so it is the latent cache (ckv); the other is the rotary-key cache (kpe);
- a query is paired with the cache it is multiplied with in a score: by the math, not by name or position,
  so swapped queries or shapes that do not line up are named rather than compiled.
"""
from __future__ import annotations

import tvm
from tvm import tirx
from tvm.s_tir import SBlock

from ..ir import Axis, TaskGraph
from .capture import REQUEST, Operands, _collect, _static, find_operands, split_kv_graph


def _partners(ops: Operands, queries: list[tirx.Var], caches: list[tirx.Var]) -> dict[str, tirx.Var]:
    """query name -> the paged cache it is multiplied with; ValueError unless each pairs with one distinct cache."""
    blocks: list[SBlock] = []
    for blk, _ in ops.loads:
        if not any(blk.same_as(b) for b in blocks):
            blocks.append(blk)
    pairs: dict[str, set[str]] = {q.name: set() for q in queries}
    for mul in (m for blk in blocks for m in _collect(blk.body, tirx.Mul)):
        read = {ld.source.name for ld in _collect(mul, tvm.ir.TensorLoad)}
        qs, cs = [q.name for q in queries if q.name in read], [c.name for c in caches if c.name in read]
        if len(qs) == 1 and len(cs) == 1:
            pairs[qs[0]].add(cs[0])
    if any(len(c) != 1 for c in pairs.values()) or len(set().union(*pairs.values())) != len(caches):
        raise ValueError(f"each query must be multiplied with a paged cache of its own (q_nope . ckv, q_pe . kpe); "
                         f"found {({q: sorted(c) for q, c in pairs.items()})}")
    return {q: next(c for c in caches if c.name in names) for q, names in pairs.items()}


def capture_mla(func: tirx.PrimFunc) -> TaskGraph:
    """Derive the MLA decode-attention task graph from its TVM definition.

    Args:
        func: a PrimFunc of paged MLA decode attention, e.g. from `mla_decode_primfunc`: q_nope [B, H, Dc] and
            q_pe [B, H, Dr] scored against ckv_cache [P, page_size, Dc] and kpe_cache [P, page_size, Dr], both
            read through one page table, and one online-softmax reduction over the KV axis (masked by each
            request's length) whose values are the ckv rows.

    Returns:
        The validated TaskGraph; equal to `meld.ops.mla_graph.mla_decode_graph` of the same config.

    Raises:
        ValueError: the function does not have that structure, merges with another combiner or has shapes
            that do not line up; the message names the buffer or what is missing.

    Example:
        >>> capture_mla(mla_decode_primfunc(16, page_size=16)).attrs["head_dim_kpe"]
        64
    """
    ops = find_operands(func)
    red, floats, paged = ops.reduction, ops.floats, ops.paged
    if red.combiner != "online_softmax":
        raise ValueError(f"the reduction over {red.axis.var.name!r} merges as {red.combiner!r}; MLA decode "
                         "attention merges online-softmax states (m, l, acc)")
    if len(floats) != 4 or len(paged) != 2:
        raise ValueError(f"expected two queries and two paged caches (ckv, kpe) among the float inputs, found "
                         f"{[p.name for p in floats]} ({[p.name for p in paged]} paged)")
    values = [c for c in paged if any(blk.same_as(red.block) and ld.source.same_as(c) for blk, ld in ops.loads)]
    if len(values) != 1:
        raise ValueError(f"the softmax reduction must read its values from one paged cache (ckv), it reads "
                         f"{[c.name for c in values] or 'none'}")
    ckv = values[0]
    kpe = next(c for c in paged if not c.same_as(ckv))
    queries = [p for p in floats if not any(p.same_as(c) for c in paged)]
    partner = _partners(ops, queries, paged)
    q_nope, q_pe = (next(q for q in queries if partner[q.name].same_as(c)) for c in (ckv, kpe))
    for q in (q_nope, q_pe):
        if len(q.shape) != 3 or not q.shape[0].same_as(red.request.dom.extent):
            raise ValueError(f"{q.name} must be [batch, num_heads, head_dim], got {list(q.shape)}")
    for c in (ckv, kpe):
        if len(c.shape) != 3:
            raise ValueError(f"{c.name} must be [num_pages, page_size, head_dim] (one latent head), "
                             f"got {list(c.shape)}")
    for q, c in ((q_nope, ckv), (q_pe, kpe)):
        if _static(q, 2) != _static(c, 2):
            raise ValueError(f"{q.name} (head_dim {_static(q, 2)}) is multiplied with {c.name} (head_dim "
                             f"{_static(c, 2)}): their head dims must match")
    if _static(q_nope, 1) != _static(q_pe, 1):
        raise ValueError(f"{q_nope.name} has {_static(q_nope, 1)} heads and {q_pe.name} {_static(q_pe, 1)}")
    if _static(ckv, 1) != _static(kpe, 1):
        raise ValueError(f"{ckv.name} has page size {_static(ckv, 1)} and {kpe.name} {_static(kpe, 1)}: one page "
                         "table indexes both, so they must match")
    dtypes = {p.name: str(p.dtype) for p in (q_nope, q_pe, ckv, kpe)}
    if len(set(dtypes.values())) != 1:
        raise ValueError(f"the queries and caches must share one dtype, got {dtypes}")

    return split_kv_graph("mla_decode", {
        "num_heads": _static(q_nope, 1), "head_dim_ckv": _static(ckv, 2), "head_dim_kpe": _static(kpe, 2),
        "page_size": _static(ckv, 1), "dtype": str(q_nope.dtype),
    }, (Axis(REQUEST, red.request.dom.extent.name),), ops)
