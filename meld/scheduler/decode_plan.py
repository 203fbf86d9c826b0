"""Split-KV planning for decode attention: cut one line of cost into equal segments, one per CTA.

The units of work — one per (request, q-head block) — are laid end to end in request order, each as
long as its cost (KV tokens + a fixed item overhead). Cutting that line into as many equal segments as
there are CTAs balances the CTAs (up to the rounding of cuts to tiles or warp rounds) and keeps the
pieces of a split unit on neighbouring CTAs, in order. See `meld.ir.schedule` for how the kernel walks
the segments and merges split units.

With thread-block clusters the placement has two levels: the cuts between clusters move to unit
boundaries where that unbalances the CTAs by little, so more split units keep all their pieces in one
cluster (merged through distributed shared memory); a unit longer than that still spans clusters.

Batch-invariant plans (`chunk_tokens` > 0) cut every unit longer than a chunk into all its chunks
(a rule that depends on its length alone, see `meld.ir.schedule`): each chunk is a piece with its own
overhead on the line, and the cuts between CTAs snap to the nearest chunk boundary.

This is the test oracle, written independently of the planner that runs: templates/decode_plan.h
(meld/codegen), compiled into the GPU planner and, for a block of one thread, into the host planner
`plan_decode_host` that serves the CPU executor and `DecodeAttention.schedule`. Tests assert that both
write its tables. It is a few dozen vectorised NumPy operations over requests and cuts, never over
units or tokens.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..ir import CTA_FIELDS, Schedule
from ..ir.schedule import SEGMENT_FIELDS, segment_header
from .cost_model import DecodeCost
from .topology import Topology, cluster_rows

_ARANGE = np.arange(1 << 16, dtype=np.int64)   # sliced, not rebuilt, per plan
_FAR = np.int64(1) << 62


def check_plan_shape(num_kv_heads: object, group_size: object, heads_per_item: object) -> None:
    """The attention shape the public planners take: positive ints (a 0 planned a batch of no units)."""
    from ..ops.checks import check_positive

    for name, v in (("num_kv_heads", num_kv_heads), ("group_size", group_size), ("heads_per_item", heads_per_item)):
        check_positive(name, v)


def _cuts(active: int) -> np.ndarray:
    """The cut numbers 1..active-1."""
    return _ARANGE[1:active] if active <= len(_ARANGE) else np.arange(1, active, dtype=np.int64)


def plan_decode(kv_len: np.ndarray, page_base: np.ndarray, num_kv_heads: int, group_size: int,
                topology: Topology, cost: DecodeCost = DecodeCost(), heads_per_item: int = 8,
                clusters: Sequence[tuple[int, int]] = (), chunk_tokens: int = 0) -> Schedule:
    """Plan one batch.

    Args:
        kv_len: [B] KV tokens per request.
        page_base: [B] index of each request's first page in kv_indices (kv_indptr[:-1]).
        num_kv_heads, group_size: kv heads, and q heads per kv head.
        topology: the persistent grid (`num_ctas` segments).
        cost: the cost model.
        heads_per_item: q heads one unit computes; a kv head with more q heads gets several units.
        clusters: the launch's cluster mix (`Topology.cluster_mix`); empty: no clusters.
        chunk_tokens: > 0 for a batch-invariant plan cut on chunks of this many tokens (a multiple of
            the tile); clusters then only shape the launch, every merge goes through global memory.
    Returns:
        A `Schedule`; `Schedule.validate()` checks that it covers every KV token exactly once.
    """
    check_plan_shape(num_kv_heads, group_size, heads_per_item)
    given = [np.asarray(kv_len), np.asarray(page_base)]
    for name, a in zip(("kv_len", "page_base"), given):
        if a.ndim != 1 or not (a.dtype.kind in "iu" or a.size == 0) or (
                a.size and not 0 <= a.min() <= a.max() <= 2 ** 31 - 1):
            raise ValueError(f"{name} must be a 1-D array of integers in [0, 2**31 - 1] (int32 on the device), got "
                             f"{a!r:.120}")
    if given[0].shape != given[1].shape:
        raise ValueError(f"kv_len and page_base must have one entry per request, got {len(given[0])} and "
                         f"{len(given[1])}")
    L = given[0].astype(np.int64)
    nh = num_kv_heads * -(-group_size // heads_per_item)
    U, W = len(L) * nh, topology.num_ctas
    if clusters and sum(size * n for size, n in clusters) != W:
        raise ValueError(f"clusters {list(clusters)} cover {sum(s * n for s, n in clusters)} CTAs, the grid has {W}")
    tile, o, ms = cost.tile_tokens, cost.item_overhead_tokens, cost.min_split_tokens
    if chunk_tokens:
        if chunk_tokens < 0 or chunk_tokens % tile:
            raise ValueError(f"chunk_tokens={chunk_tokens} must be a positive multiple of the tile ({tile})")
        u, s, active = _cut_chunks(L, nh, W, cost, chunk_tokens)
        return _schedule(num_kv_heads, group_size, heads_per_item, L, page_base, U, W, active, u, s, False,
                         {"active_ctas": active, "item_overhead_tokens": o, "chunk_tokens": chunk_tokens},
                         chunk_tokens)

    width = L + o                                    # one unit of request b on the line
    R = np.zeros(len(L) + 1, dtype=np.int64)
    np.cumsum(width * nh, out=R[1:])                 # request b occupies [R[b], R[b+1])
    total = int(R[-1])
    active = int(min(W, max(1, -(-total // cost.min_cta_tokens))))

    # Cut j (1..active-1) at line position x[j-1]: find its request b, unit u and token s (a multiple of
    # the grain, both pieces >= min_split tokens, else the unit's start or end). When segments are long
    # (`roomy`), the grain is a tile, a cut takes the nearest of those places to x, and the cuts are far
    # enough apart that no two land on the same token. Otherwise the grain is a round of the warps (see
    # DecodeCost), a cut takes the grain boundary nearest to x, then the unit's start or end if that
    # leaves a piece too short, and every CTA gets at least one grain, so no two cuts round onto one token.
    roomy = total // active >= 2 * (o + -(-ms // tile) * tile + tile)
    grain = tile if roomy else cost.round_tokens
    if not roomy:
        active = min(active, max(1, total // grain))
    lo = -(-ms // grain) * grain                     # the first allowed split token

    rounds = None if roomy else _cut_rounds(L, nh, W, ms, grain, lo)
    if rounds is not None:
        u, s, active = rounds
        return _schedule(num_kv_heads, group_size, heads_per_item, L, page_base, U, W, active, u, s, True,
                         {"active_ctas": active, "item_overhead_tokens": o, "cluster_snap_tokens": 0})

    def cut(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        b = R.searchsorted(x, "right") - 1
        wb = width[b]
        r = x - R[b]
        hb = r // wb
        pos = r - hb * wb - o                        # token position in the unit (< 0: in its overhead)
        n = wb - o                                   # the unit's tokens
        hi = (n - ms) // grain * grain               # the last allowed split token
        s = (pos + grain // 2) // grain * grain
        if roomy:
            s = np.clip(s, lo, hi)
            d_split = np.where(lo <= hi, np.abs(pos - s), _FAR)
            d_start = pos + o                        # the unit starts with its overhead on the line
            to_end = (n - pos < d_start) & (n - pos < d_split)
            s[to_end | (d_start <= d_split)] = 0
        else:
            to_end = (s > hi) & (s >= lo)
            s[to_end | (s < lo)] = 0
        return b * nh + hb + to_end, s

    # Two levels with clusters (roomy only): a cut between two clusters moves to the nearest unit
    # boundary when that moves it by at most `snap` tokens per CTA of the smaller of the two clusters
    # (and at least one of them has more than one CTA), and not past the neighbouring cluster boundaries'
    # own positions (a snapped cut ahead of an unsnapped neighbour made a cluster's span run backwards), so
    # the unit's pieces stay in one cluster and merge on chip; the cuts inside each cluster keep their
    # proportions within its moved span. A cluster whose moved span became too short for the roomy cut to keep
    # its cuts apart (two interior cuts on one token: a split unit counting an empty piece) has its snaps undone,
    # until no cluster has: with neither boundary moved a cluster cuts as the roomy plan does.
    j = _cuts(active)
    snap = cost.cluster_snap_tokens if roomy and any(size > 1 for size, _ in clusters) else 0
    if snap:
        first, end = cluster_rows(clusters).astype(np.int64)
        f, e = first[j], np.minimum(end[j], active)
        size, size_before = end[j] - f, end[j - 1] - first[j - 1]
        boundary = (f == j) & (np.maximum(size, size_before) > 1)
        tol = snap * np.minimum(size, size_before)
        undone = np.zeros(active + 1, dtype=bool)    # boundaries whose snap was undone

    def place(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Cut c's line position (c = 1..active-1), and whether cut c (0..active) moved off its target."""
        xs = np.r_[0, x, total]                      # cut c = 0..active; the first and last never move
        b = R.searchsorted(x, "right") - 1
        start = R[b] + (x - R[b]) // width[b] * width[b]
        near = np.where(x - start <= start + width[b] - x, start, start + width[b])
        moved = xs.copy()
        ok = boundary & ~undone[j] & (np.abs(near - x) <= tol) & (near > 0) & (near < total) & (
            near >= xs[first[j - 1]]) & (near <= xs[e])
        moved[j[ok]] = near[ok]
        return moved[f] + (x - xs[f]) * (moved[e] - moved[f]) // (xs[e] - xs[f]), moved != xs

    def placed_cut(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cut(place(x)), undoing the snaps of each cluster where two interior cuts met, until none do."""
        if not snap:
            return cut(x)
        while True:
            y, was_moved = place(x)
            u, s = cut(y)
            met = j[:-1][(s[:-1] > 0) & (u[:-1] == u[1:]) & (s[:-1] == s[1:])]   # cuts c and c + 1 on one token
            ends = np.r_[first[met], np.minimum(end[met], active)]
            ends = ends[was_moved[ends]]
            if not ends.size:
                return u, s
            undone[ends] = True

    # Every piece pays the item overhead, but the line holds it once per unit (at the unit's start), so
    # a CTA whose segment starts inside a unit pays one overhead the line does not show. Second cut
    # (roomy only): grow the line by one overhead per interior cut of the first, and move cut j left by
    # the overheads of the interior cuts before it, so that (x[j+1] - x[j]) + o * interior[j] is the
    # same for every CTA.
    u, s = placed_cut(j * total // active)
    if roomy:
        interior = s > 0
        shift = np.zeros(len(j), dtype=np.int64)
        np.cumsum(interior[:-1], out=shift[1:])
        u, s = placed_cut(j * (total + o * int(interior.sum())) // active - o * shift)

    return _schedule(num_kv_heads, group_size, heads_per_item, L, page_base, U, W, active, u, s, True,
                     {"active_ctas": active, "item_overhead_tokens": o, "cluster_snap_tokens": snap})


def _cut_rounds(L: np.ndarray, nh: int, W: int, ms: int, grain: int, lo: int
                ) -> tuple[np.ndarray, np.ndarray, int] | None:
    """Cuts of a short batch whose units, cut at every allowed grain boundary, give no more pieces than the grid
    has CTAs: each piece its own CTA (one round of the warps each; cutting on the line instead left some CTAs two
    rounds and others none). None where the pieces would outnumber the CTAs."""
    hi = (L - ms) // grain * grain                   # each unit's last allowed split token
    per_unit = np.where(hi >= lo, (hi - lo) // grain + 2, 1)
    if not 0 < per_unit.sum() * nh <= W:
        return None
    P = np.zeros(len(L) + 1, dtype=np.int64)
    np.cumsum(per_unit * nh, out=P[1:])
    active = int(P[-1])
    c = _cuts(active)
    b = P.searchsorted(c, "right") - 1
    hb, k = np.divmod(c - P[b], per_unit[b])
    return b * nh + hb, np.where(k == 0, 0, lo + (k - 1) * grain), active


def _cut_chunks(L: np.ndarray, nh: int, W: int, cost: DecodeCost, chunk: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Cuts of a batch-invariant plan: each unit is its pieces (chunks) with one overhead each, and cut j
    lands on the chunk boundary (or unit end) nearest to its equal share of the line."""
    o = cost.item_overhead_tokens
    n = np.maximum(1, -(-L // chunk))               # pieces per unit
    width = L + o * n
    R = np.zeros(len(L) + 1, dtype=np.int64)
    np.cumsum(width * nh, out=R[1:])
    total = int(R[-1])
    active = int(min(W, max(1, -(-total // cost.min_cta_tokens))))
    x = _cuts(active) * total // active
    b = R.searchsorted(x, "right") - 1
    r = x - R[b]
    hb = r // width[b]
    r -= hb * width[b]                              # position in the unit; chunk k starts at k * (chunk + o)
    step = chunk + o
    k = np.minimum((r + step // 2) // step, n[b] - 1)
    to_end = width[b] - r < np.abs(r - k * step)
    return b * nh + hb + to_end, np.where(to_end, 0, k * chunk), active


def _schedule(num_kv_heads: int, group_size: int, heads_per_item: int, L: np.ndarray, page_base: np.ndarray,
              U: int, W: int, active: int, u: np.ndarray, s: np.ndarray, runs: bool, meta: dict,
              chunk_tokens: int = 0) -> Schedule:
    """The CTA table from cuts 1..active-1 at (unit u, token s); `runs`: fill the head/tail columns with
    the runs of interior cuts in one unit (the pieces of a split unit; the first piece belongs to the
    CTA before the run, and no two cuts share a token)."""
    t = np.zeros((len(CTA_FIELDS), W), dtype=np.int32)
    t[0, active:] = U                                # idle CTAs: an empty segment at the end
    t[2, active - 1:] = U
    t[0, 1:active] = t[2, :active - 1] = u
    t[1, 1:active] = t[3, :active - 1] = s
    if runs:
        _fill_runs(t, u, s)
    t[len(SEGMENT_FIELDS):] = segment_header(t)
    return Schedule(num_kv_heads, group_size, heads_per_item, L, page_base, t, meta, chunk_tokens)


def _fill_runs(t: np.ndarray, u: np.ndarray, s: np.ndarray) -> None:
    j = s.nonzero()[0]
    ui = u[j]
    run_start = np.empty(len(j), dtype=bool)
    run_start[:1] = True
    np.not_equal(ui[1:], ui[:-1], out=run_start[1:])
    run_id = run_start.cumsum() - 1
    first_cta = j[run_start][run_id]                 # cut j starts CTA j + 1; the first piece is CTA j
    parts = np.bincount(run_id)[run_id] + 1
    t[6, j] = t[4, j + 1] = first_cta                # head (4, 5): the split unit a segment starts inside
    t[7, j] = t[5, j + 1] = parts                    # tail (6, 7): the split unit a segment ends inside
