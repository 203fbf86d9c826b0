"""Expert-parallel MoE over emulated ranks: the protocol of the GPU operator's proxy transport
(`meld.distributed.ExpertParallelMoE`, templates/ep_moe.cuh), run with the CPU reference's float64 FFN.

Every rank holds its own tokens and their routing; the experts are split into contiguous blocks, one per
rank. Windows are laid out by (source rank, pair) slots, slot = t k + j. Dispatch: a rank writes only its
own window, its source block: every pair's global expert id, weight and row of x; then it puts the block
whole to every other rank and a count behind it (one fence per destination: the signal carries the
completion). An expert rank serves each source as soon as that source's count is in, without waiting for
the others: each slot of one of its experts, w * FFN_e(row), staged in its owner block for that source
(a block per (owner, source): no other rank writes it), put whole to the source with a count behind it.
Combine: each token's k weighted rows summed in choice order on its own rank, once every owner's count
is in, so the result does not depend on which expert rank finishes first.

`compact=True` moves only what each rank needs (issue 43's compacted blocks; the GPU's proxy path still puts
whole blocks): a source packs the pairs of each destination's experts, in slot order, at the start of its block
of that destination's window, puts those rows alone, and signals their number plus one (the count exchange and
the completion in one signal); the owner serves that many and returns exactly those rows, in the same order, so
the source finds pair (t, j) at its place in its destination's list. The same sums in the same order: the result
is bit-identical to the whole-block protocol's.

`one_launch_ep_moe` is issue 43 item 1's protocol for EP as one persistent launch per rank (not yet a GPU kernel):
compacted dispatch with the count in the signal, an owner's expert tiles starting on their source's count, the
return put from each tile's epilogue with a tile-done signal, and each token combined as soon as its own tiles
have landed; ragged tokens per rank, and routing from router logits.
"""
from __future__ import annotations

import functools
import time

import numpy as np
import torch

from .reduce import run_ranks


def expert_owner(num_experts: int, world: int) -> np.ndarray:
    """The rank of each expert: contiguous blocks, as even as they come."""
    return np.arange(num_experts) * world // num_experts


def expert_ffn(x: np.ndarray, w13: np.ndarray, w2: np.ndarray, e: int) -> np.ndarray:
    """SiLU(gate) * up, then down, for one row through expert e (float64; w13 [E, 2I, H], w2 [E, H, I])."""
    inter = w2.shape[2]
    g, u = w13[e, :inter] @ x, w13[e, inter:] @ x
    return w2[e] @ (g / (1 + np.exp(-g)) * u)


def expert_parallel_moe(transport, xs: list[np.ndarray], topk_ids: list[np.ndarray], topk_w: list[np.ndarray],
                        w13: np.ndarray, w2: np.ndarray, poll_s: float = 1e-4, compact: bool = False) -> list[np.ndarray]:
    """Rank r's tokens xs[r] [T_r, H] routed to topk_ids[r] [T_r, k] with weights topk_w[r]; returns every
    rank's output [T_r, H] (module docstring; `compact`: only the rows each rank needs cross)."""
    if compact:
        return _compact_ep_moe(transport, xs, topk_ids, topk_w, w13, w2, poll_s)
    world = transport.world
    hidden = w13.shape[2]
    owner = expert_owner(w13.shape[0], world)
    k = topk_ids[0].shape[1]
    slots = max(1, max(len(x) for x in xs)) * k
    hdr = transport.window("ep.hdr", (world, slots), np.float64, -1)          # global expert id, -1: none
    wts = transport.window("ep.wts", (world, slots), np.float64, np.nan)
    rows = transport.window("ep.rows", (world, slots, hidden), np.float64, np.nan)
    ret = transport.window("ep.ret", (world, world, slots, hidden), np.float64, np.nan)   # [owner][source]
    transport.window("ep.sent", (world,), np.int64, 0)
    transport.window("ep.back", (world,), np.int64, 0)
    outs = [np.full((len(x), hidden), np.nan) for x in xs]

    def wait_all(r: int, counts: str, serve=lambda s: None) -> None:
        """Until every other rank's count is in on rank r, calling serve(s) as each source's lands."""
        waiting = set(range(world)) - {r}
        while waiting:
            ready = [s for s in waiting if int(transport.get(r, r, counts, s)) == 1]
            if not ready:
                time.sleep(poll_s)
            for s in ready:
                waiting.remove(s)
                serve(s)

    def rank_main(r: int) -> None:
        x, ids, w = xs[r], topk_ids[r], topk_w[r]
        n = len(x) * k
        hdr[r][r, :n], wts[r][r, :n], rows[r][r, :n] = ids.reshape(-1), w.reshape(-1), np.repeat(x, k, axis=0)
        for d in range(world):   # this rank's source block, whole, then its count behind it
            if d != r:
                for name, win in (("ep.hdr", hdr), ("ep.wts", wts), ("ep.rows", rows)):
                    transport.put(r, d, name, r, win[r][r])
                transport.signal(r, d, "ep.sent", r, 1)

        def serve(s: int) -> None:   # the slots of source s for this rank's experts, into block (r, s)
            e = hdr[r][s]
            for i in np.flatnonzero(e >= 0):
                if owner[int(e[i])] == r:
                    ret[r][r, s, i] = wts[r][s, i] * expert_ffn(rows[r][s, i], w13, w2, int(e[i]))
            if s != r:
                transport.put(r, s, "ep.ret", (r, s), ret[r][r, s])
                transport.signal(r, s, "ep.back", r, 1)

        serve(r)
        wait_all(r, "ep.sent", serve)
        wait_all(r, "ep.back")
        for t in range(len(x)):   # choice order
            outs[r][t] = functools.reduce(np.add, [ret[r][owner[int(ids[t, j])], r, t * k + j] for j in range(k)])
        transport.quiet(r)

    run_ranks(world, rank_main)
    return outs


def _compact_ep_moe(transport, xs, topk_ids, topk_w, w13, w2, poll_s: float) -> list[np.ndarray]:
    """expert_parallel_moe(compact=True): per-destination packed blocks, counted by their signal (docstring)."""
    world = transport.world
    hidden = w13.shape[2]
    owner = expert_owner(w13.shape[0], world)
    k = topk_ids[0].shape[1]
    slots = max(1, max(len(x) for x in xs)) * k
    # [source][destination]: a block per pair of ranks, so that no staged block is rewritten before its put lands
    hdr = transport.window("ep.hdr", (world, world, slots), np.float64, -1)   # the packed pairs' experts
    wts = transport.window("ep.wts", (world, world, slots), np.float64, np.nan)
    rows = transport.window("ep.rows", (world, world, slots, hidden), np.float64, np.nan)
    ret = transport.window("ep.ret", (world, world, slots, hidden), np.float64, np.nan)   # [owner][source]
    transport.window("ep.sent", (world,), np.int64, 0)   # rows sent + 1, per source
    transport.window("ep.back", (world,), np.int64, 0)   # 1 per owner, once its rows are back
    outs = [np.full((len(x), hidden), np.nan) for x in xs]

    def arrivals(r: int, counts: str):
        """Every other rank's (source, count) on rank r as it lands (count: the signal's value)."""
        waiting = set(range(world)) - {r}
        while waiting:
            ready = [(s, int(transport.get(r, r, counts, s))) for s in sorted(waiting)]
            ready = [(s, v) for s, v in ready if v > 0]
            if not ready:
                time.sleep(poll_s)
            for s, v in ready:
                waiting.remove(s)
                yield s, v

    def rank_main(r: int) -> None:
        x, ids, w = xs[r], topk_ids[r], topk_w[r]
        flat, wflat = ids.reshape(-1), w.reshape(-1)
        dest = owner[flat]
        lists = [np.flatnonzero(dest == d) for d in range(world)]   # this rank's slots per destination, in order
        for d in range(world):   # destination d's pairs packed at the start of this rank's block, put alone
            sl = lists[d]
            n = len(sl)
            if d == r or not n:
                if d != r:
                    transport.signal(r, d, "ep.sent", r, 1)
                continue
            for name, win, v in (("ep.hdr", hdr, flat[sl]), ("ep.wts", wts, wflat[sl]), ("ep.rows", rows, x[sl // k])):
                transport.put(r, d, name, (r, d, slice(0, n)), v)
            transport.signal(r, d, "ep.sent", r, n + 1)

        def served(e, ws, xr) -> np.ndarray:   # packed pairs' weighted expert rows, in their order
            return np.stack([ws[i] * expert_ffn(xr[i], w13, w2, int(e[i])) for i in range(len(e))])

        back = [None] * world   # each owner's rows of this rank's pairs, in the order of lists[owner]
        sl = lists[r]
        back[r] = served(flat[sl], wflat[sl], x[sl // k]) if len(sl) else None
        for s, v in arrivals(r, "ep.sent"):
            n = v - 1
            if n:
                transport.put(r, s, "ep.ret", (r, s, slice(0, n)), served(hdr[r][s, r, :n], wts[r][s, r, :n],
                                                                          rows[r][s, r, :n]))
            transport.signal(r, s, "ep.back", r, 1)
        for _ in arrivals(r, "ep.back"):
            pass
        for d in range(world):
            if d != r:
                back[d] = ret[r][d, r]
        place = np.empty(len(flat), dtype=np.int64)   # each slot's position in its destination's list
        for d in range(world):
            place[lists[d]] = np.arange(len(lists[d]))
        for t in range(len(x)):   # choice order
            outs[r][t] = functools.reduce(np.add, [back[dest[t * k + j]][place[t * k + j]] for j in range(k)])
        transport.quiet(r)

    run_ranks(world, rank_main)
    return outs


def expert_tiles(experts: np.ndarray, tile_rows: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """An owner's tiles of one source's packed pairs (their experts, in packed order): the pairs ordered by
    expert (stable), and each expert's run cut into blocks of `tile_rows`, as ranges of that order. Source and
    owner both derive them from the same packed list, so a tile's number says which pairs it returns."""
    order = np.argsort(experts, kind="stable")
    bounds = np.flatnonzero(np.diff(experts[order])) + 1
    tiles = []
    for run in np.split(np.arange(len(order)), bounds) if len(order) else []:
        tiles += [run[i:i + tile_rows] for i in range(0, len(run), tile_rows)]
    return order, tiles


def one_launch_ep_moe(transport, xs: list[np.ndarray], w13: np.ndarray, w2: np.ndarray, *,
                      topk: tuple[list[np.ndarray], list[np.ndarray]] | None = None,
                      router_logits: list[np.ndarray] | None = None, top_k: int = 0, renormalize: bool = True,
                      tile_rows: int = 16, poll_s: float = 1e-4, seed: int = 0, log: list | None = None
                      ) -> list[np.ndarray]:
    """The expert-parallel MoE layer as one persistent launch per rank (issue 43 item 1's protocol), on emulated
    ranks: rank r's tokens xs[r] [T_r, H] (T_r may differ between ranks: no padding), routed by `topk` (ids,
    weights per rank) or by softmax top-`top_k` of `router_logits[r]` [T_r, E] (meld.MoE's routing, fused);
    returns every rank's output [T_r, H], bit for bit the one-rank reference's.

    A launch's work is three kinds of task, and a task waits only for a signal that a task of an earlier kind
    sends unconditionally (on any rank), so no wait can close a cycle:
      dispatch  a source packs the pairs of each destination's experts (slot order) and puts them alone, its
                signal carrying their number plus one (the count exchange and the completion in one signal);
      tile      an owner's tiles of source s (`expert_tiles`: an expert's rows in blocks of `tile_rows`) start
                as soon as s's count is in, not after every source's (per-source counts, no barrier); the
                epilogue puts the tile's rows straight into s's return window, in tile order, and signals
                that tile done;
      combine   the source counts down each token's remote tiles as they land; a token whose last tile has
                landed is combined at once (its k rows summed in choice order), while other tokens still wait.
    Source and owner derive the tiles from the same packed list, so a tile-done signal is all the source needs
    to know which rows landed. Each rank runs its tasks in one thread here, taking whatever is ready (its own
    tiles and landed sources' in a seeded random order, landed tiles' tokens); the GPU's persistent kernel
    would run the same kinds on its CTAs. `log`, if given, receives (time, rank, event, detail) as the ranks
    go: ("count", s) when source s's count is in, ("tile", (s, i)) when tile i of source s starts, ("combine",
    t) when token t is combined.
    """
    from ..runtime.moe_reference import route

    world = transport.world
    E, hidden = w13.shape[0], w13.shape[2]
    owner = expert_owner(E, world)
    if (topk is None) == (router_logits is None):
        raise ValueError("one_launch_ep_moe: give either topk=(ids, weights) or router_logits (with top_k)")
    if topk is None:
        if not 1 <= top_k <= E:
            raise ValueError(f"top_k={top_k}: expected 1..{E} with router_logits")
        routed = [route(torch.as_tensor(lg), top_k, renormalize) for lg in router_logits]
        topk = ([i.numpy() for i, _ in routed], [w.double().numpy() for _, w in routed])
    ids_all, w_all = topk
    k = ids_all[0].shape[1]
    slots = max(1, max(len(x) for x in xs)) * k
    hdr = transport.window("ep1.hdr", (world, world, slots), np.float64, -1)    # [source][destination]
    wts = transport.window("ep1.wts", (world, world, slots), np.float64, np.nan)
    rows = transport.window("ep1.rows", (world, world, slots, hidden), np.float64, np.nan)
    ret = transport.window("ep1.ret", (world, world, slots, hidden), np.float64, np.nan)   # [owner][source], tile order
    transport.window("ep1.sent", (world,), np.int64, 0)                       # per source: pairs sent + 1
    transport.window("ep1.done", (world, slots), np.int64, 0)                 # per (owner, tile): landed
    outs = [np.full((len(x), hidden), np.nan) for x in xs]
    t0 = time.perf_counter()

    def note(r: int, event: str, detail) -> None:
        if log is not None:
            log.append((time.perf_counter() - t0, r, event, detail))

    def ffn_rows(e, ws, xr) -> np.ndarray:
        return np.stack([ws[i] * expert_ffn(xr[i], w13, w2, int(e[i])) for i in range(len(e))])

    def rank_main(r: int) -> None:
        x, ids, w = xs[r], ids_all[r], w_all[r]
        flat, wflat = ids.reshape(-1).astype(np.int64), w.reshape(-1)
        dest = owner[flat]
        lists = [np.flatnonzero(dest == d) for d in range(world)]   # this rank's slots per destination
        for d in range(world):                                        # dispatch
            n = len(lists[d])
            if d != r and n:
                sl = lists[d]
                for name, win, v in (("ep1.hdr", hdr, flat[sl]), ("ep1.wts", wts, wflat[sl]),
                                     ("ep1.rows", rows, x[sl // k])):
                    transport.put(r, d, name, (r, d, slice(0, n)), v)
            if d != r:
                transport.signal(r, d, "ep1.sent", r, n + 1)
        # As a source: each owner's tiles of this rank's pairs, and what each token still waits for.
        mine = [expert_tiles(flat[lists[d]], tile_rows) for d in range(world)]
        pending = np.zeros(len(x), dtype=np.int64)
        for d in range(world):
            for tile in mine[d][1]:
                np.add.at(pending, lists[d][mine[d][0][tile]] // k, 1)
        back = np.full((len(flat), hidden), np.nan)                   # each pair's returned row, by slot
        seen = [np.zeros(len(mine[d][1]), dtype=bool) for d in range(world)]   # tiles landed here, per owner
        # As an owner: the tiles of every source whose count is in.
        rng = np.random.default_rng(seed + r)
        ready: list[tuple[int, int]] = [(r, i) for i in range(len(mine[r][1]))]
        packed = {r: (flat[lists[r]], wflat[lists[r]], x[lists[r] // k], *mine[r])}   # a source's pairs and tiles
        counted = {r}
        combined = 0
        while combined < len(x) or len(counted) < world or ready:
            progress = False
            for s in range(world):                                    # counts in
                if s not in counted and (v := int(transport.get(r, r, "ep1.sent", s))) > 0:
                    counted.add(s)
                    progress = True
                    note(r, "count", s)
                    n = v - 1
                    e = hdr[r][s, r, :n].astype(np.int64)
                    packed[s] = (e, wts[r][s, r, :n], rows[r][s, r, :n], *expert_tiles(e, tile_rows))
                    ready += [(s, i) for i in range(len(packed[s][4]))]
            if ready:                                                 # one tile, its epilogue's return
                s, i = ready.pop(int(rng.integers(len(ready))))
                note(r, "tile", (s, i))
                e, ws, xr, order, tiles = packed[s]
                span = slice(int(tiles[i][0]), int(tiles[i][-1]) + 1)
                y = ffn_rows(e[order[span]], ws[order[span]], xr[order[span]])
                if s == r:
                    ret[r][r, r, span] = y
                    transport.signal(r, r, "ep1.done", (r, i), 1)
                else:
                    transport.put(r, s, "ep1.ret", (r, s, span), y)
                    transport.signal(r, s, "ep1.done", (r, i), 1)
                progress = True
            for d in range(world):                                    # tiles landed: tokens counted down
                order, tiles = mine[d]
                if seen[d].all():
                    continue
                landed = transport.get(r, r, "ep1.done", (d, slice(0, len(tiles)))) > 0
                for i in np.flatnonzero(landed & ~seen[d]):
                    seen[d][i] = True
                    sl = lists[d][order[tiles[i]]]
                    back[sl] = ret[r][d, r, int(tiles[i][0]):int(tiles[i][-1]) + 1]
                    np.subtract.at(pending, sl // k, 1)
                    for tok in np.unique(sl // k):                    # its last tile landed: combined now
                        if pending[tok] == 0:
                            outs[r][tok] = functools.reduce(np.add, [back[tok * k + j] for j in range(k)])
                            combined += 1
                            note(r, "combine", int(tok))
                    progress = True
            if not progress:
                time.sleep(poll_s)
        transport.quiet(r)

    run_ranks(world, rank_main)
    return outs


def single_rank_reference(x: np.ndarray, ids: np.ndarray, wts: np.ndarray, w13: np.ndarray, w2: np.ndarray) -> np.ndarray:
    """The same MoE on one rank, each token's weighted expert outputs added in choice order."""
    out = np.zeros((len(x), w2.shape[1]))
    for t in range(len(x)):
        out[t] = functools.reduce(np.add, [wts[t, j] * expert_ffn(x[t], w13, w2, int(ids[t, j])) for j in range(ids.shape[1])])
    return out
