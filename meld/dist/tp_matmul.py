"""Row-parallel GEMM with its all-reduce fused per output tile, over emulated ranks (the protocol of the
tensor-parallel projection; its GPU kernel is not written yet).

y = x @ w with the K dimension split across ranks (rank r holds x[:, K_r] and w[K_r, :], as after a
column-parallel layer). Each rank computes its partial of every output tile, in its own order, and hands
each one to the tile's owner as soon as it is done (`LastArriverReduce`): the last partial of a tile to
arrive sums the tile's partials in rank order and puts the sum to every rank. An all-reduce that starts
with the first finished tile instead of after the whole GEMM, and a sum whose order (rank 0 + rank 1 +
...) does not depend on which rank finishes first.
"""
from __future__ import annotations

import functools
import random

import numpy as np

from .reduce import LastArriverReduce, run_ranks


def k_slices(k: int, world: int) -> np.ndarray:
    """Rank r's rows of w: [bounds[r], bounds[r + 1])."""
    return np.array([k * r // world for r in range(world + 1)])


def tile_grid(m: int, n: int, tile: tuple[int, int]) -> list[tuple[slice, slice]]:
    tm, tn = tile
    return [(slice(i, min(i + tm, m)), slice(j, min(j + tn, n))) for i in range(0, m, tm) for j in range(0, n, tn)]


def row_parallel_matmul(transport, x: np.ndarray, w: np.ndarray, world: int, tile: tuple[int, int] = (64, 128),
                        seed: int = 0) -> list[np.ndarray]:
    """y = x @ w (float64) reduced across `world` emulated ranks (module docstring); returns every rank's y."""
    m, k = x.shape
    n = w.shape[1]
    bounds, tiles = k_slices(k, world), tile_grid(m, n, tile)
    reduce = LastArriverReduce("y", lambda parts: functools.reduce(np.add, parts))   # rank order
    out = reduce.windows(transport, len(tiles), world, tile)

    def rank_main(r: int) -> None:
        ks = slice(bounds[r], bounds[r + 1])
        order = list(range(len(tiles)))
        random.Random(seed * 1000 + r).shuffle(order)   # tiles finish in a different order on every rank
        for t in order:
            rows, cols = tiles[t]
            part = np.zeros(tile)
            part[:rows.stop - rows.start, :cols.stop - cols.start] = x[rows, ks] @ w[ks, cols]
            reduce.contribute(transport, r, t % world, t, r, world, part, to=range(world))
        transport.quiet(r)

    run_ranks(world, rank_main)
    ys = []
    for r in range(world):
        y = np.empty((m, n))
        for t, (rows, cols) in enumerate(tiles):
            y[rows, cols] = out[r][t][:rows.stop - rows.start, :cols.stop - cols.start]
        ys.append(y)
    return ys


def single_rank_reference(x: np.ndarray, w: np.ndarray, world: int) -> np.ndarray:
    """The same sum on one rank: the K slices' products added in rank order."""
    b = k_slices(x.shape[1], world)
    return functools.reduce(np.add, [x[:, b[r]:b[r + 1]] @ w[b[r]:b[r + 1]] for r in range(world)])
