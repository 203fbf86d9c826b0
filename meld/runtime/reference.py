"""The CPU reference executor: runs a `Schedule` the way the kernel does, in float64.

It walks the CTAs in order, computes each item's online-softmax state over exactly its KV range, writes
whole units to the output and split pieces to their partial slots, counts arrivals per unit, and lets
the piece that completes a unit merge its slots — so a wrong range, slot, part count or merge in a
schedule gives a wrong (or NaN-poisoned) answer here, without a GPU.

Non-finite inputs follow the kernel's IEEE rule: a row (request, q head) with a non-finite score (NaN or
Inf in q or K) gets l = NaN, so its output and lse are NaN; a non-finite P.V value (in V) makes the row's
output NaN and leaves its lse, a function of the scores alone, finite; split or not. An empty row
(l == 0) gives zeros and lse = -inf.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from typing import TYPE_CHECKING

from ..codegen.decode_kernel import DecodeVariant
from ..ir import COMBINERS, Schedule, TaskGraph
from ..ir.combiners import Combiner
from ..ir.task_graph import GraphError

if TYPE_CHECKING:
    from ..scheduler.split_reduce_plan import GroupTable, SplitReducePlan

_SOFTMAX = COMBINERS["online_softmax"]


def _state(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, soft_cap: float = 0.0,
           seen: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
    """(m, l, acc) of softmax attention of q [H, D] over k [n, D], v [n, Dv] (n may be 0), each scaled score s
    capped to soft_cap tanh(s / soft_cap) when soft_cap > 0, and row h seeing only the keys seen[h] marks (a
    causal mask: [H, n] bool; None: every key); l = NaN marks a row that met a non-finite score among its keys,
    a NaN acc row one that met a non-finite value (a NaN value reaches rows that do not see its key too, as the
    kernel's P.V products of 0 and NaN do)."""
    H = q.shape[0]
    if k.shape[0] == 0:
        return np.full(H, -np.inf), np.zeros(H), np.zeros((H, v.shape[1]))
    with np.errstate(invalid="ignore", over="ignore"):
        s = (q @ k.T) * scale
        bad = ~(np.isfinite(s) if seen is None else np.isfinite(s) | ~seen).all(axis=1)
        s[bad] = 0.0
        if soft_cap:
            s = soft_cap * np.tanh(s / soft_cap)
        if seen is not None:
            s = np.where(seen, s, -np.inf)
        m = s.max(axis=1)
        p = np.exp(s - np.where(m == -np.inf, 0.0, m)[:, None])   # (a row that sees none of these keys: p = 0)
        acc = p @ v
    l = p.sum(axis=1)
    l[bad] = np.nan
    acc[~np.isfinite(acc).all(axis=1)] = np.nan
    return m, l, acc


def execute_decode(schedule: Schedule, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   kv_indices: torch.Tensor, sm_scale: float, combiner: str = "online_softmax", *,
                   k_scale: float = 1.0, v_scale: float = 1.0, variant: DecodeVariant = DecodeVariant(),
                   q_len: int = 1, qo_indptr: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Execute `schedule` on CPU tensors (k_cache and v_cache NHD [pages, page_size, Hkv, D], any strides: one
    cache's halves or two tensors), merging split units with `combiner` (the graph's). An FP8 cache is read as
    its exact values and dequantised where the kernel does it: k_scale multiplies the scores (with sm_scale)
    and v_scale the output (templates/decode_attention.cuh, MELD_KV_FP8). `variant`'s soft cap applies to the
    scaled scores; its window leaves out each item's keys before the last window_left + 1 of its request (the
    schedule's kv_len: the pages plan() kept); its RoPE rotates each key by its offset from the query (the
    request's last token), as the kernel does. With q_len new tokens per request, q is [B * q_len, Hq, D], a
    request's tokens consecutive, and the schedule's rows are its (q head, token) pairs, head-major (its
    group_size is q heads per kv head x q_len, as the kernel's): token j of a request of kv_len keys sees keys
    0 .. kv_len - q_len + j. A ragged batch's `qo_indptr` [B + 1] gives request b n_b = qo_indptr[b + 1] -
    qo_indptr[b] of them at q's rows qo_indptr[b] ..: the schedule's rows are still q_len a q head, as the
    kernel's, the missing tokens' rows zero and never written out; token j sees keys 0 .. kv_len - n_b + j.
    Returns (out [B * q_len, Hq, D] float64, lse [B * q_len, Hq] float64; ragged, [qo_indptr[-1], ...])."""
    P = k_cache.shape[1]
    k64, v64 = k_cache.double().numpy(), v_cache.double().numpy()

    def kv(pages: np.ndarray, slots: np.ndarray, kv_head: int) -> tuple[np.ndarray, np.ndarray]:
        return k64[pages, slots, kv_head], v64[pages, slots, kv_head]

    Hq, D = q.shape[1:]
    tokens = None
    if qo_indptr is not None:   # each request's tokens at its q_len rows' first n_b, the rest zero
        tokens = np.diff(qo_indptr)
        starts = np.repeat(qo_indptr[:-1].astype(np.int64), tokens)   # each q row's request's first row
        at = torch.from_numpy(np.repeat(np.arange(len(tokens)) * q_len, tokens) + np.arange(len(starts)) - starts)
        q = q.new_zeros(len(tokens) * q_len, Hq, D).index_copy_(0, at, q)
    rows = q.double().reshape(-1, q_len, Hq, D).transpose(1, 2).reshape(-1, Hq * q_len, D)   # row: head * q_len + j
    out, lse = _execute(schedule, rows.numpy(), kv, P, k_cache.shape[-1], kv_indices, sm_scale * k_scale,
                        _softmax(combiner), variant, q_len, tokens)
    out = out.reshape(-1, Hq, q_len, D).transpose(1, 2).reshape(-1, Hq, D)
    lse = lse.reshape(-1, Hq, q_len).transpose(1, 2).reshape(-1, Hq)
    if tokens is not None:
        out, lse = out[at], lse[at]
    return (out if v_scale == 1.0 else out * v_scale), lse


def execute_mla(schedule: Schedule, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor,
                kpe_cache: torch.Tensor, kv_indices: torch.Tensor, sm_scale: float,
                combiner: str = "online_softmax", *, kv_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Execute an MLA schedule (one latent kv head shared by every q head) on CPU tensors: keys are the
    latent rows with their rope part, values the latent rows. An FP8 cache is read as its exact values and
    dequantised where the kernel does it: kv_scale multiplies the scores (with sm_scale) and the output
    (templates/mla_decode.cuh, MLA_KV_FP8). Returns (out [B, H, Dc], lse [B, H]) float64."""
    dc = ckv_cache.shape[-1]
    k64 = torch.cat([ckv_cache, kpe_cache], dim=-1).double().numpy()   # a key row; its first dc: the value

    def kv(pages: np.ndarray, slots: np.ndarray, kv_head: int) -> tuple[np.ndarray, np.ndarray]:
        k = k64[pages, slots]
        return k, k[:, :dc]

    q = torch.cat([q_nope, q_pe], dim=-1).double().numpy()
    out, lse = _execute(schedule, q, kv, ckv_cache.shape[1], dc, kv_indices, sm_scale * kv_scale, _softmax(combiner))
    return (out if kv_scale == 1.0 else out * kv_scale), lse


def _softmax(name: str) -> Combiner:
    """The combiner an attention piece's partials merge with: the graph names it; attention pieces produce
    online-softmax states, so a graph asking for another merge of them is refused."""
    if name != "online_softmax":
        raise GraphError(f"attention partials are online-softmax states: they cannot merge with combiner {name!r}")
    return COMBINERS[name]


def _execute(schedule: Schedule, q64: np.ndarray, kv, page_size: int, dv: int, kv_indices: torch.Tensor,
             sm_scale: float, combiner: Combiner, variant: DecodeVariant = DecodeVariant(), q_len: int = 1,
             tokens: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The walk both executors share: `kv(pages, slots, kv_head)` gives an item's keys and values; with q_len > 1
    row r of a request is its new token r % q_len, which sees keys up to kv_len - n + r % q_len, n the request's
    new tokens: q_len, or a ragged batch's `tokens[b]`."""
    B, Hq, _ = q64.shape
    # NumPy, not torch: per-item matmuls are tiny and torch's CPU thread pool only adds overhead.
    indices = kv_indices.numpy()
    out = torch.full((B, Hq, dv), float("nan"), dtype=torch.float64)
    lse = torch.full((B, Hq), float("nan"), dtype=torch.float64)
    part_o = np.full((schedule.num_slots, schedule.heads_per_item, dv), np.nan)
    part_lse = np.full((schedule.num_slots, schedule.heads_per_item), np.nan)
    arrived = np.zeros(schedule.num_units, dtype=np.int64)
    it = schedule.items()
    page_base = schedule.page_base
    for i in range(len(it["unit"])):
        b, kvh, h0, rows = (int(it[k][i]) for k in ("req", "kv_head", "q_head", "rows"))
        beg, end, slot = int(it["kv_begin"][i]), int(it["kv_end"][i]), int(it["slot"][i])
        pos = np.arange(beg, end)
        if variant.window_left >= 0:   # a piece may lie wholly before the window: then it is empty
            pos = pos[pos >= int(schedule.kv_len[b]) - 1 - variant.window_left]
        k, v = kv(indices[int(page_base[b]) + pos // page_size], pos % page_size, kvh)
        if variant.rope_theta:   # each key by its offset from the query, as the kernel does
            k = _rope(k, pos - (int(schedule.kv_len[b]) - 1), variant)
        seen = None
        if q_len > 1:
            n = q_len if tokens is None else int(tokens[b])
            last = int(schedule.kv_len[b]) - n + (np.arange(h0, h0 + rows) % q_len)   # each row's last key
            seen = pos[None, :] <= last[:, None]
        m, l, acc = _state(q64[b, h0:h0 + rows], k, v, sm_scale, variant.logits_soft_cap, seen)
        if slot < 0:
            _write(out, lse, b, h0, m, l, acc)
            continue
        part_o[slot, :rows], part_lse[slot, :rows] = _normalised(m, l, acc)   # empty: zeros, -inf
        u = int(it["unit"][i])
        arrived[u] += 1
        if arrived[u] == it["num_parts"][i]:      # last arriver merges the unit's slots
            s0, n = int(it["parts_begin"][i]), int(it["num_parts"][i])
            o, ls = merge_partials(part_lse[s0:s0 + n, :rows], part_o[s0:s0 + n, :rows], combiner)
            out[b, h0:h0 + rows], lse[b, h0:h0 + rows] = torch.from_numpy(o), torch.from_numpy(ls)
    return out, lse


def merge_partials(part_lse: np.ndarray, part_o: np.ndarray, combiner: Combiner = _SOFTMAX
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Merge n partial results of the same rows, in order, as a last arriver does: lse [n, H] and o [n, H, D]
    (a part with no tokens: lse -inf) -> (o [H, D], lse [H])."""
    H, D = part_o.shape[1:]
    m, l, acc = np.full(H, -np.inf), np.zeros(H), np.zeros((H, D))
    for s in range(len(part_lse)):
        m, l, acc = combiner.merge(m, l, acc, part_lse[s], np.ones(H), part_o[s])
    return _normalised(m, l, acc)


def _rope(k: np.ndarray, offsets: np.ndarray, variant: DecodeVariant) -> np.ndarray:
    """Keys k [n, D] rotated by Llama's "rotate half" embedding at `offsets` [n] (float64)."""
    h = k.shape[1] // 2
    freq = variant.rope_theta ** (-2.0 * np.arange(h) / k.shape[1]) / variant.rope_scale
    angle = offsets[:, None] * freq
    cos, sin = np.cos(angle), np.sin(angle)
    with np.errstate(invalid="ignore", over="ignore"):
        return np.concatenate([k[:, :h] * cos - k[:, h:] * sin, k[:, h:] * cos + k[:, :h] * sin], axis=1)


def execute_split_reduce(graph: TaskGraph, plan: SplitReducePlan, tables: dict[str, GroupTable], q: torch.Tensor,
                         kv_cache: torch.Tensor, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Run a paged-attention split-reduce graph on one device from the plan's task and event tables
    (`meld.scheduler.plan_split_reduce` over the lowering's producers, in its order), `tables` their
    `GroupTable`s by task name, kv_cache NHD on the CPU. Any such graph: decode's (one task over the
    requests, each its own group), a cascade's (a task per level over groups of requests), or one whose
    partials merge through a tree of combines. Tasks run in table order (CTA after CTA); each counts its
    arrival at its events, and at each combine of the tree an event fires when its count reaches the parts
    listed for it there (its producers' parts in the event's slot list, plus one per lower combine with
    any): the count-fired combine of the kernels, one counter per level. A combine merges its inputs in the
    graph's order with the graph's combiner, a lower combine's merged state taking its place as one part.
    Returns (out [B, Hq, D], lse [B, Hq]) float64."""
    from ..codegen.lowering import lower

    low = lower(graph)
    if low.family not in ("decode_attention", "grouped_attention") or low.transport is not None:
        crossing = f" (partials crossing ranks by {low.transport!r})" if low.transport else ""
        raise GraphError(f"graph {graph.name!r} lowers to the {low.family} family{crossing}, not paged attention "
                         "on one device (decode_attention or grouped_attention)")
    producers, merge = low.producers, _softmax(low.combiner)
    missing = [t for t in producers if t not in tables]
    if missing:
        raise ValueError(f"graph {graph.name!r}: no group table for task(s) {missing}")
    order = [tables[t] for t in producers]
    B, Hq, D = q.shape
    P = kv_cache.shape[2]
    G = plan.group_size
    q64, kv64 = q.double().numpy(), kv_cache.double().numpy()
    out = torch.full((B, Hq, D), float("nan"), dtype=torch.float64)
    lse = torch.full((B, Hq), float("nan"), dtype=torch.float64)
    part_o, part_lse = np.full((plan.num_slots, D), np.nan), np.full(plan.num_slots, np.nan)
    task, event = plan.task_columns(), plan.event_columns()
    n_events = B * plan.num_kv_heads
    heads = np.arange(G)

    # The merge tree from the graph: each combine's inputs in merge order; graph.tasks is topological, so a
    # combine comes after the ones it reads and the output's comes last.
    combines = [t.name for t in graph.tasks if t.kind == "combine"]
    inputs = {c: [t.name for t in graph.producers(c)] for c in combines}
    parent = {i: c for c in combines for i in inputs[c]}
    slot_producer = np.full(plan.num_slots, -1)
    for i in range(plan.num_tasks):
        s0, n = int(task["slot"][i]), int(task["event_count"][i])
        slot_producer[s0:s0 + n * G] = task["producer"][i]

    listed = [plan.part_slot[f:f + n].astype(np.int64) for f, n in zip(event["part_first"], event["parts"])]
    if any((slot_producer[s] < 0).any() for s in listed):
        raise ValueError(f"graph {graph.name!r}: the plan lists a part slot that no task writes")
    by_producer = np.array([np.bincount(slot_producer[s], minlength=len(producers)) for s in listed],
                           dtype=np.int64).reshape(n_events, len(producers)).T
    need: dict[str, np.ndarray] = {}   # parts each combine's event waits for
    for c in combines:
        need[c] = sum((by_producer[producers.index(i)] if i in producers else need[i] > 0 for i in inputs[c]),
                      np.zeros(n_events, dtype=np.int64))
    arrived = {c: np.zeros(n_events, dtype=np.int64) for c in combines}
    merged: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]] = {}   # a lower combine's (lse [G], o [G, D])

    def fire(c: str, e: int) -> None:
        h, b = divmod(e, B)
        slots, lses, os = listed[e], [], []
        for i in inputs[c]:
            if i in producers:
                s = slots[slot_producer[slots] == producers.index(i)][:, None] + heads
                lses.append(part_lse[s])
                os.append(part_o[s])
            elif need[i][e]:
                ls, o = merged.pop((i, e))
                lses.append(ls[None])
                os.append(o[None])
        if lses:
            o, ls = merge_partials(np.concatenate(lses), np.concatenate(os), merge)
        else:   # nothing to attend to: zeros, lse -inf
            o, ls = np.zeros((G, D)), np.full(G, -np.inf)
        if c in parent:
            merged[c, e] = ls, o
            arrive(parent[c], e)
        else:
            out[b, h * G:(h + 1) * G], lse[b, h * G:(h + 1) * G] = torch.from_numpy(o), torch.from_numpy(ls)

    def arrive(c: str, e: int) -> None:
        arrived[c][e] += 1
        if arrived[c][e] == need[c][e]:
            fire(c, e)

    for i in range(plan.num_tasks):
        p, g, h = int(task["producer"][i]), int(task["group"][i]), int(task["kv_head"][i])
        t = order[p]
        q0 = int(task["event_first"][i]) - h * B   # the task's first request (a slice of the group's)
        pos = np.arange(int(task["kv_begin"][i]), int(task["kv_end"][i]))
        pages = t.kv_indices[int(t.kv_indptr[g]) + pos // P]
        rows = q64[q0:q0 + int(task["event_count"][i]), h * G:(h + 1) * G].reshape(-1, D)
        m, l, acc = _state(rows, kv64[pages, 0, pos % P, h], kv64[pages, 1, pos % P, h], sm_scale)
        s0 = int(task["slot"][i])
        part_o[s0:s0 + len(m)] = acc / l[:, None]   # a piece holds tokens: l >= 1, or NaN
        part_lse[s0:s0 + len(m)] = m + np.log(l)
        for e in range(int(task["event_first"][i]), int(task["event_first"][i] + task["event_count"][i])):
            arrive(parent[producers[p]], e)
    for e in np.flatnonzero(need[combines[-1]] == 0):
        fire(combines[-1], int(e))
    return out, lse


def _normalised(m, l, acc) -> tuple[np.ndarray, np.ndarray]:
    """(o, lse) of a softmax state: l == 0 is an empty row (zeros, lse -inf); a NaN l stays NaN."""
    empty = l == 0
    safe = np.where(empty, 1.0, l)
    return np.where(empty[:, None], 0.0, acc / safe[:, None]), np.where(empty, -np.inf, m + np.log(safe))


def _write(out, lse, b, h0, m, l, acc) -> None:
    o, ls = _normalised(m, l, acc)
    out[b, h0:h0 + len(m)], lse[b, h0:h0 + len(m)] = torch.from_numpy(o), torch.from_numpy(ls)


def _requests(kv_indptr, kv_indices, kv_last_page_len, page_size: int):
    """(request, its pages, its tokens) of every request with tokens, from FlashInfer's paged layout."""
    indptr, last = kv_indptr.tolist(), kv_last_page_len.tolist()
    for b in range(len(last)):
        pages = kv_indices[indptr[b]:indptr[b + 1]].long()
        if len(pages):
            yield b, pages, (len(pages) - 1) * page_size + last[b]


def attention_reference(q: torch.Tensor, kv_cache: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                        kv_last_page_len: torch.Tensor, sm_scale: float | None = None, q_len: int = 1,
                        logits_soft_cap: float = 0.0, qo_indptr: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain float64 paged decode attention, one request at a time (no schedule): the ground truth. With q_len
    new tokens per request, q is [B * q_len, Hq, D] (a request's tokens consecutive) and token j of a request of
    n tokens attends to keys 0 .. n - q_len + j (causal: the cache holds the new tokens); logits_soft_cap c > 0
    caps each scaled score s to c tanh(s / c). A ragged batch's `qo_indptr` [B + 1] puts request b's n_b new
    tokens at q's rows qo_indptr[b] .. qo_indptr[b + 1] instead (token j attends to keys 0 .. n - n_b + j)."""
    T, Hq, D = q.shape
    _, _, P, Hkv, _ = kv_cache.shape
    G = Hq // Hkv
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
    out = torch.zeros(T, Hq, D, dtype=torch.float64, device=q.device)
    lse = torch.full((T, Hq), -math.inf, dtype=torch.float64, device=q.device)
    for b, pages, n in _requests(kv_indptr, kv_indices, kv_last_page_len, P):
        k = kv_cache[pages, 0].reshape(-1, Hkv, D)[:n].double()       # [n, Hkv, D]
        v = kv_cache[pages, 1].reshape(-1, Hkv, D)[:n].double()
        first, nb = (b * q_len, q_len) if qo_indptr is None else (int(qo_indptr[b]), int(qo_indptr[b + 1] - qo_indptr[b]))
        rows = slice(first, first + nb)
        qb = q[rows].double().view(nb, Hkv, G, D)
        s = torch.einsum("jhgd,nhd->jhgn", qb, k) * scale
        if logits_soft_cap:
            s = logits_soft_cap * torch.tanh(s / logits_soft_cap)
        if nb > 1:   # token j's keys end at n - nb + j
            hidden = torch.arange(n, device=q.device) > (n - nb + torch.arange(nb, device=q.device))[:, None]
            s = s.masked_fill(hidden[:, None, None, :], -math.inf)
        lse[rows] = torch.logsumexp(s, dim=-1).reshape(nb, Hq)
        out[rows] = torch.einsum("jhgn,nhd->jhgd", torch.softmax(s, dim=-1), v).reshape(nb, Hq, D)
    return out, lse


def mla_reference(q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor, kpe_cache: torch.Tensor,
                  kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor, sm_scale: float,
                  q_len: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain float64 paged MLA decode attention (the absorbed form: keys [ckv, kpe], values ckv, one latent
    head shared by every q head), one request at a time: the ground truth. With q_len new tokens per request,
    q_nope and q_pe are [B * q_len, H, D] (a request's tokens consecutive) and token j of a request of n tokens
    attends to keys 0 .. n - q_len + j. Returns (out [B * q_len, H, Dc], lse [B * q_len, H])."""
    T, H, Dc = q_nope.shape
    P = ckv_cache.shape[1]
    out = torch.zeros(T, H, Dc, dtype=torch.float64, device=q_nope.device)
    lse = torch.full((T, H), -math.inf, dtype=torch.float64, device=q_nope.device)
    for b, pages, n in _requests(kv_indptr, kv_indices, kv_last_page_len, P):
        rows = slice(b * q_len, (b + 1) * q_len)
        c = ckv_cache[pages].reshape(-1, Dc)[:n].double()                       # [n, Dc]
        r = kpe_cache[pages].reshape(-1, kpe_cache.shape[-1])[:n].double()      # [n, Dr]
        s = (q_nope[rows].double() @ c.T + q_pe[rows].double() @ r.T) * sm_scale   # [q_len, H, n]
        hidden = torch.arange(n, device=s.device) > (n - q_len + torch.arange(q_len, device=s.device))[:, None]
        s = s.masked_fill(hidden[:, None, :], -math.inf)   # token j's keys end at n - q_len + j
        lse[rows] = torch.logsumexp(s, dim=-1)
        out[rows] = torch.softmax(s, dim=-1) @ c
    return out, lse


def cascade_reference(q: torch.Tensor, kv_cache: torch.Tensor, levels: list[tuple[torch.Tensor, ...]],
                      sm_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain float64 cascade decode attention: request b attends to the tokens of its group at every level
    (levels: (qo_indptr, kv_indptr, kv_indices, kv_last_page_len) each, FlashInfer's layout; kv_cache NHD),
    as one sequence, one request at a time: the ground truth. A row that meets a non-finite score is NaN
    (out and lse); NaN or Inf in V reaches out only."""
    B, Hq, D = q.shape
    _, _, P, Hkv, _ = kv_cache.shape
    G = Hq // Hkv
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
    out = torch.zeros(B, Hq, D, dtype=torch.float64)
    lse = torch.full((B, Hq), -math.inf, dtype=torch.float64)
    for b in range(B):
        ks, vs = [], []
        for qo, indptr, indices, last in levels:
            g = int(np.searchsorted(qo.numpy(), b, side="right")) - 1
            for _, pages, n in _requests(indptr[g:g + 2] - indptr[g], indices[int(indptr[g]):], last[g:g + 1], P):
                ks.append(kv_cache[pages, 0].reshape(-1, Hkv, D)[:n].double())
                vs.append(kv_cache[pages, 1].reshape(-1, Hkv, D)[:n].double())
        if not ks:
            continue
        k, v = torch.cat(ks), torch.cat(vs)
        s = torch.einsum("hgd,nhd->hgn", q[b].double().view(Hkv, G, D), k) * scale
        bad = ~s.isfinite().all(dim=-1)   # a non-finite score (NaN or Inf in q or K) makes its row NaN,
        s = s.masked_fill(bad[..., None], 0.0)   # out and lse, as meld's kernels and executors give it
        lse[b] = torch.logsumexp(s, dim=-1).masked_fill(bad, math.nan).reshape(Hq)
        out[b] = torch.einsum("hgn,nhd->hgd", torch.softmax(s, dim=-1), v).masked_fill(bad[..., None], math.nan) \
            .reshape(Hq, D)
    return out, lse
