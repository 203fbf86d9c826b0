"""The row-parallel linear's per-tile all-reduce over emulated ranks, with the GPU kernel's schedule
(`meld.codegen.tp_kernel.TpSchedule`; the GPU operator is `meld.distributed.RowParallelLinear`).

Rank r holds x_r [M, K] and w_r [N, K] (its slices of the contraction dimension) and every rank gets
y = sum_r x_r w_r^T. Each output tile (`cols` columns x a token block) is computed as world x k_splits
pieces. Owner merges: each rank computes its pieces in its own order and hands each partial to the tile's
owner rank (o % world) as soon as it is done (`LastArriverReduce`): the last partial to arrive sums the
tile's partials in (rank, split) order — with the combiner the operator's task graph records, as the GPU's
merge is chosen from it — and puts the sum to every rank. Every-rank merges (the GPU's default): every
partial goes to every rank behind a per-CTA stamp, and each rank sums a tile once the stamps cover its
pieces. The kernel's rules, run by the CPU reference executor under the emulated transport's reordering
and delays, over the plan's rows as the kernel loads them (`TpSchedule.tasks`: a TP_PIECE row per piece, an
EVENT row per tile).
"""
from __future__ import annotations

import functools
import random
import time

import numpy as np

from ..codegen.lowering import lower
from ..codegen.tp_kernel import TpSchedule
from ..ir import COMBINERS
from ..ir.work_table import EVENT, TP_PIECE
from ..ops.tp_linear_graph import tp_linear_graph
from .reduce import LastArriverReduce, run_ranks


def _merge(sched: TpSchedule, world: int):
    """The merge of a tile's partials, in their order: the combiner the operator's graph lowers to."""
    combine = COMBINERS[lower(tp_linear_graph(sched.k, sched.n, world)).combiner].merge
    return lambda parts: functools.reduce(lambda a, b: combine(a, b)[0], parts)


def _plan(sched: TpSchedule, grid: int, world: int) -> tuple[dict, dict]:
    """The plan's TP_PIECE and EVENT rows (`TpSchedule.tasks`), by field."""
    tasks, events = sched.tasks(grid, world)
    return TP_PIECE.unpack(tasks, sched.pieces), EVENT.unpack(events, sched.out_tiles)


def _partial(sched: TpSchedule, x: np.ndarray, w: np.ndarray, task: dict, t: int) -> np.ndarray:
    """Piece t's partial of its output tile (its row of `task`), padded to the tile's shape [block_tokens, cols]."""
    rows, cols, ks = sched.piece_slices(task, t)
    part = np.zeros((sched.block_tokens, sched.cols))
    part[:rows.stop - rows.start, :cols.stop - cols.start] = x[rows, ks] @ w[cols, ks].T
    return part


def _assemble(sched: TpSchedule, task: dict, event: dict, tiles) -> np.ndarray:
    """y from its tiles, each placed by its first piece's row (the event's `part_first`)."""
    y = np.empty((sched.m, sched.n))
    for o in range(sched.out_tiles):
        rows, cols, _ = sched.piece_slices(task, int(event["part_first"][o]))
        y[rows, cols] = tiles[o][:rows.stop - rows.start, :cols.stop - cols.start]
    return y


def row_parallel_matmul(transport, xs: list[np.ndarray], ws: list[np.ndarray], sched: TpSchedule,
                        seed: int = 0, merge: str = "owner", grid: int | None = None,
                        launches: int = 1) -> list[np.ndarray]:
    """y = sum_r xs[r] @ ws[r].T (float64) over len(xs) emulated ranks (module docstring); every rank's y.
    `merge`: "owner" (the last arriving partial of a tile sums it at the owner), "every_rank" (as
    `TpKernelConfig.merge` and templates/tp_linear.cuh over the proxy transport, but a put per piece: the
    pieces of `grid` CTAs, by default about three each; every partial put into every rank's window, each
    followed by its CTA's stamp on every rank; each rank sums a tile from its own window once the stamps
    cover its pieces) or "direct" (the kernel's direct path at decode sizes: a CTA a piece, partials as
    tagged words; `launches` of them back to back, launch l on x_r * l: the last one's y)."""
    if merge == "every_rank":
        return _every_rank(transport, xs, ws, sched, seed, grid or max(1, (sched.pieces + 2) // 3))
    if merge == "direct":
        return _direct(transport, xs, ws, sched, seed, launches)
    if merge != "owner":
        raise ValueError(f"merge={merge!r}: expected 'owner', 'every_rank' or 'direct'")
    world, S = len(xs), sched.k_splits
    task, event = _plan(sched, 1, world)   # (pieces in any order: the CTAs do not matter here)
    reduce = LastArriverReduce("y", _merge(sched, world))   # (rank, split) order
    out = reduce.windows(transport, sched.out_tiles, world * S, (sched.block_tokens, sched.cols))

    def rank_main(r: int) -> None:
        order = list(range(sched.pieces))
        random.Random(seed * 1000 + r).shuffle(order)   # pieces finish in a different order on every rank
        for t in order:
            o = int(task["tile"][t])
            reduce.contribute(transport, r, o % world, o, r * S + int(task["split"][t]), int(event["parts"][o]),
                              _partial(sched, xs[r], ws[r], task, t), to=range(world))
        transport.quiet(r)

    run_ranks(world, rank_main)
    return [_assemble(sched, task, event, out[r]) for r in range(world)]


def _every_rank(transport, xs, ws, sched: TpSchedule, seed: int, G: int, poll_s: float = 1e-5) -> list[np.ndarray]:
    """CTA c of every rank computes pieces c, c + G, ... in order (the CTAs of a rank interleaved at random
    within each round). After each piece it puts the partial chunk by chunk (`merge_chunks` rows) into every
    rank's window (its own too), signalling its stamp slot [rank][c] there after each (the chunks it has
    sent). A tile is summed chunk by chunk, chunk q by the CTA of its split q % k_splits, in the order of
    that CTA's pieces, as soon as chunk q of every part is stamped: after each of its pieces if the stamps
    already cover it (the GPU's consumers), and every chunk left after its last piece, waiting for them."""
    world, S = len(xs), sched.k_splits
    task, event = _plan(sched, G, world)
    walk = [np.flatnonzero(task["cta"] == c) for c in range(G)]   # each CTA's pieces, in order
    ordinal = {int(t): i for w in walk for i, t in enumerate(w)}
    merge = _merge(sched, world)
    rows, chunks = sched.merge_chunks
    transport.window("y.parts", (sched.out_tiles, world * S, chunks, rows, sched.cols), np.float64, np.nan)
    transport.window("y.stamp", (world, G), np.int64, 0)
    out = [np.full((sched.out_tiles, sched.block_tokens, sched.cols), np.nan) for _ in range(world)]

    def rank_main(r: int) -> None:
        def covered(o: int, q: int) -> bool:   # chunk q of every part, (rank, split) k, of tile o stamped here
            first = int(event["part_first"][o])
            return all(transport.get(r, r, "y.stamp", (k // S, int(task["cta"][first + k % S])))
                       >= ordinal[first + k % S] * chunks + q + 1 for k in range(int(event["parts"][o])))

        claimed = [0] * G   # per CTA: the claims looked at (piece ordinal x chunks + chunk)

        def merge_next(c: int, wait: bool) -> bool:
            """CTA c's next chunk to merge, if any (waiting for its tile's parts, or only if they have landed)."""
            while claimed[c] // chunks < len(walk[c]):
                t, q = int(walk[c][claimed[c] // chunks]), claimed[c] % chunks
                if q % S == task["split"][t]:
                    o = int(task["tile"][t])
                    deadline = time.monotonic() + transport.timeout
                    while not covered(o, q):
                        if not wait:
                            return False
                        if time.monotonic() > deadline:
                            raise TimeoutError(f"rank {r}: the parts of tile {o} did not arrive")
                        time.sleep(poll_s)
                    claimed[c] += 1
                    out[r][o][q * rows:(q + 1) * rows] = merge([p[q] for p in transport.get(r, r, "y.parts", o)])
                    return True
                claimed[c] += 1
            return False

        rng = random.Random(seed * 1000 + r)
        for j in range(max(len(w) for w in walk)):
            ctas = [c for c in range(G) if j < len(walk[c])]
            rng.shuffle(ctas)
            for c in ctas:
                t = int(walk[c][j])
                part = _partial(sched, xs[r], ws[r], task, t)
                for q in range(chunks):
                    for dst in range(world):
                        transport.put(r, dst, "y.parts", (int(task["tile"][t]), r * S + int(task["split"][t]), q),
                                      part[q * rows:(q + 1) * rows])
                        transport.signal(r, dst, "y.stamp", (r, c), 1)
                merge_next(c, wait=False)
        for c in range(G):
            while merge_next(c, wait=True):
                pass
        transport.quiet(r)

    run_ranks(world, rank_main)
    return [_assemble(sched, task, event, out[r]) for r in range(world)]


LL_WORD = np.dtype([("v", np.float64), ("tag", np.int64)])   # a direct-path word: a value and its launch's tag


def _direct(transport, xs, ws, sched: TpSchedule, seed: int, launches: int) -> list[np.ndarray]:
    """The kernel's direct path (templates/tp_linear.cuh, tp_direct): CTA c of every rank computes piece c
    (one piece a CTA) and puts its partial, every element tagged with the launch, into slot [launch % 2]
    [rank][c] of every rank's window (its own too). The k_splits CTAs of a tile each sum a share of its
    elements (element e: split e % k_splits) in (rank, split) order once that share of every part carries the
    launch's tag; no stamps, no fences. Launch l computes x_r * l; `launches` run back to back with no wait
    between them, so a rank can be a launch ahead of another (the parity slots are what keeps it from
    overwriting words the other has still to read). Every rank's y of the last launch."""
    world, S, G = len(xs), sched.k_splits, sched.pieces
    task, event = _plan(sched, G, world)   # (CTA c's only piece is piece c)
    merge = _merge(sched, world)
    shape = (sched.block_tokens, sched.cols)
    transport.window("y.ll", (2, world, G) + shape, LL_WORD, np.array((np.nan, 0), dtype=LL_WORD))
    out = [np.full((sched.out_tiles,) + shape, np.nan) for _ in range(world)]

    def rank_main(r: int) -> None:
        rng = random.Random(seed * 1000 + r)
        for launch in range(1, launches + 1):
            par, ctas = launch % 2, list(range(G))
            rng.shuffle(ctas)
            for c in ctas:
                word = np.empty(shape, LL_WORD)
                word["v"], word["tag"] = _partial(sched, xs[r] * launch, ws[r], task, c), launch
                for dst in range(world):
                    transport.put(r, dst, "y.ll", (par, r, c), word)
            for c in ctas:
                o = int(task["tile"][c])
                share = np.arange(shape[0] * shape[1]) % S == task["split"][c]

                def landed(o=o, share=share):   # one snapshot of each part: its tags and values together
                    parts, first = [], int(event["part_first"][o])
                    for k in range(int(event["parts"][o])):   # (the first part still in flight ends the look)
                        cta = int(task["cta"][first + k % S])
                        part = transport.get(r, r, "y.ll", (par, k // S, cta)).reshape(-1)
                        if not (part["tag"][share] == launch).all():
                            return None
                        parts.append(part)
                    return parts
                parts = transport.wait_for(r, landed, f"the parts of tile {o} in launch {launch}")
                out[r][o].reshape(-1)[share] = merge([p["v"] for p in parts])[share]
        transport.quiet(r)

    run_ranks(world, rank_main)
    return [_assemble(sched, task, event, out[r]) for r in range(world)]


def single_rank_reference(xs: list[np.ndarray], ws: list[np.ndarray], sched: TpSchedule) -> np.ndarray:
    """The same sum on one rank: every tile's partials, computed as the ranks compute them, added in
    (rank, split) order."""
    S, merge = sched.k_splits, _merge(sched, len(xs))
    task, event = _plan(sched, 1, len(xs))
    tiles = [merge([_partial(sched, x, w, task, int(event["part_first"][o]) + s) for x, w in zip(xs, ws)
                    for s in range(S)]) for o in range(sched.out_tiles)]
    return _assemble(sched, task, event, tiles)
