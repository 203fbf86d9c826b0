"""The decode-attention cost model: time is KV bytes read plus a fixed cost per work item.

Decode attention is bound by reading the KV cache, so a CTA's time is close to the bytes it reads over
its share of bandwidth. Each item (every piece of a split unit too) also pays a fixed cost (loading q,
the end-of-item merge of the warps, writing a partial), expressed here in KV tokens so the planner can
cut one line of cost into equal segments. Per-SM traces (bench/decode_trace.py) put it at about a hundred
tokens' streaming time per piece, and bench/decode_sweep.py chose 128 (bench/RESULTS.md, "why the per-piece
cost model"; 8-head units; 16-head units merge twice the state and take 192, see `DecodeCost.default`).

Cuts inside a unit land on tile boundaries. Where segments are short (a few tiles per warp, as at
B = 1), they land on whole rounds of the CTA's warps instead (8 warps x 16-token tiles = 128 tokens):
every warp then gets the same number of tiles, and none idles through a partial last round before the
piece's end-of-unit barrier (bench/RESULTS.md, "short segments cut on whole warp rounds": faster at B = 1;
longer segments gain nothing from round cuts, so they keep tile cuts).
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class DecodeCost:
    """Attributes:
        item_overhead_tokens: fixed cost of one item, in KV-token equivalents.
        min_split_tokens: never split a (request, head block) into a piece shorter than this.
        min_cta_tokens: use fewer CTAs than the grid when each would get less than this.
        tile_tokens: splits land on multiples of the kernel's KV tile.
        round_tokens: splits of short segments (see `plan_decode`'s `roomy`) land on multiples of this,
            a multiple of tile_tokens: one tile for each of the CTA's 8 warps.
        cluster_snap_tokens: with thread-block clusters, a cut between two clusters moves to the nearest
            unit boundary (so that unit's pieces stay in one cluster and merge on chip) when that moves
            at most this many tokens per CTA of the smaller neighbouring cluster; 0 turns it off.
        invariant_chunk_tokens: the chunk of batch-invariant plans (`DecodeAttention(batch_invariant=True)`):
            a unit longer than this is always split into its chunks of this many tokens; a multiple of
            tile_tokens. Larger chunks merge less and balance worse (bench/RESULTS.md).
    """

    item_overhead_tokens: int = 128
    min_split_tokens: int = 128
    min_cta_tokens: int = 128
    tile_tokens: int = 16
    round_tokens: int = 128
    cluster_snap_tokens: int = 64
    invariant_chunk_tokens: int = 1024

    def __post_init__(self) -> None:
        for f in fields(self):   # every field reaches the GPU planner as an int32
            v = getattr(self, f.name)
            if not isinstance(v, numbers.Integral) or isinstance(v, bool) or not 0 <= v <= 2 ** 31 - 1:
                raise ValueError(f"DecodeCost.{f.name} must be an int in [0, 2**31 - 1], got {v!r}")
        if self.tile_tokens < 1 or self.min_split_tokens < 1 or self.min_cta_tokens < 1 or self.item_overhead_tokens < 1:
            raise ValueError(f"DecodeCost fields must be >= 1: {self}")
        if self.round_tokens < 1 or self.round_tokens % self.tile_tokens:
            raise ValueError(f"DecodeCost.round_tokens must be a positive multiple of tile_tokens: {self}")
        if self.invariant_chunk_tokens < 1 or self.invariant_chunk_tokens % self.tile_tokens:
            raise ValueError(f"DecodeCost.invariant_chunk_tokens must be a positive multiple of tile_tokens: {self}")
        if self.cluster_snap_tokens < 0:
            raise ValueError(f"DecodeCost.cluster_snap_tokens must be >= 0: {self}")

    @staticmethod
    def default(heads_per_unit: int = 8) -> "DecodeCost":
        """The model for the kernel's unit size: 16-head units merge twice the warp state at each unit's
        end, so their pieces cost more, and an overhead of 192 tokens balanced them best (bench/RESULTS.md,
        "item overhead for 16-head units"). With several new tokens per request (`DecodeAttention(q_len=)`) a
        unit's rows are (q head, token) pairs and heads_per_unit counts rows: more rows cost more compute per
        piece (the 16-row build's second P.V tile and merge) but read the same KV bytes, so the line stays in KV
        tokens and only the item overhead follows the rows (not yet fitted for q_len > 1: bench/cost_fit.py).
        32-row units take the 16-row overhead too: smaller and larger ones were no faster on q_len 8's 32-row build
        of four warps (bench/RESULTS.md, 2026-12-04)."""
        return DecodeCost(item_overhead_tokens=192) if heads_per_unit >= 16 else DecodeCost()
