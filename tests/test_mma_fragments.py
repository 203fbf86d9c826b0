"""The decode kernel's register layouts for an 8-head unit, checked on a NumPy model of the warp's fragments
(PTX ISA: ldmatrix m8n8 .b16, mma.m16n8k16 A/B/C fragments, movmatrix m8n8 .trans): lane L = 4 g + t.

Two ways to the scores of a 16-token tile (templates/decode_attention.cuh): scores_rows' S = Q . K^T with Q's 8 heads
padded to the A operand's 16 rows and K as B (ldmatrix blocks tokens 0-7 lo/hi, 8-15 lo/hi), and scores_cols'
S^T = K . Q^T with K as A (ldmatrix blocks in A's order) and Q's registers as B; then P^T's B fragment for the P.V,
from S's C fragments directly or from S^T's by movmatrix. Both must give each lane the values its comments name,
for a 16-bit tile in the swizzled shared layout and for an FP8 one (channels permuted within 16, as Q's are)."""
import numpy as np
import pytest

G, T = np.arange(32) // 4, np.arange(32) % 4   # each lane's g and t


def ldmatrix_x4(smem_rows, addr):
    """ldmatrix .x4 (no .trans): lane L gives the row address of matrix L // 8, row L % 8 (`addr[L]`: a key
    into `smem_rows`, 8 elements each); register j of lane L holds row L // 4, elements 2 (L % 4), + 1 of matrix j."""
    mats = [np.stack([smem_rows[addr[8 * j + i]] for i in range(8)]) for j in range(4)]
    return [np.stack([m[G, 2 * T], m[G, 2 * T + 1]], axis=1) for m in mats]   # 4 x [32 lanes, 2]


def a_matrix(a0, a1, a2, a3):
    """The 16 x 16 A operand from its fragments (rows g / g + 8, columns 2t, 2t + 1 / + 8)."""
    a = np.zeros((16, 16))
    for reg, dr, dc in ((a0, 0, 0), (a1, 8, 0), (a2, 0, 8), (a3, 8, 8)):
        a[G + dr, 2 * T + dc], a[G + dr, 2 * T + dc + 1] = reg[:, 0], reg[:, 1]
    return a


def b_matrix(b0, b1):
    """The 16 x 8 B operand (k x n) from its fragments (k 2t, 2t + 1 / + 8, n = g)."""
    b = np.zeros((16, 8))
    for reg, dk in ((b0, 0), (b1, 8)):
        b[2 * T + dk, G], b[2 * T + dk + 1, G] = reg[:, 0], reg[:, 1]
    return b


def mma(acc, a, b):
    """acc (C fragments [32, 4]: rows g, g + 8, columns 2t, 2t + 1) += A . B."""
    d = a_matrix(*a) @ b_matrix(*b)
    return acc + np.stack([d[G, 2 * T], d[G, 2 * T + 1], d[G + 8, 2 * T], d[G + 8, 2 * T + 1]], axis=1)


def movmatrix_trans(x):
    """An 8 x 8 matrix held as C fragments (row g, columns 2t, 2t + 1), transposed, in the same layout."""
    m = np.zeros((8, 8))
    m[G, 2 * T], m[G, 2 * T + 1] = x[:, 0], x[:, 1]
    return np.stack([m.T[G, 2 * T], m.T[G, 2 * T + 1]], axis=1)


def tile_rows(k_tile):
    """A 16-bit K tile (16 tokens x 128 channels) as the kernel lays it out: 16-byte chunks of 8 channels, chunk c of
    token r at chunk slot c ^ (r & 7) of its row (tile_off): rows of the model's memory keyed by (token, slot)."""
    return {(r, c ^ (r & 7)): k_tile[r, 8 * c:8 * c + 8] for r in range(16) for c in range(16)}


def q_regs(q, perm):
    """Q's registers for channel block ks (load_q): lane (g, t) holds head g's channels 16 ks + the A fragment's
    columns 2t, 2t + 1 (word 0) and 2t + 8, 2t + 9 (word 1), through `perm` (k index -> channel in the block)."""
    return [(np.stack([q[G, 16 * ks + perm[2 * T]], q[G, 16 * ks + perm[2 * T + 1]]], axis=1),
             np.stack([q[G, 16 * ks + perm[2 * T + 8]], q[G, 16 * ks + perm[2 * T + 9]]], axis=1)) for ks in range(8)]


IDENTITY = np.arange(16)
FP8_PERM = np.array([4 * (k // 2 % 4) + 2 * (k // 8) + k % 2 for k in range(16)])   # k 2t + e <-> 4t + e; 2t + 8 + e <-> 4t + 2 + e


def scores_rows(q, k_tile, perm):
    """S = Q . K^T: lane (g, t)'s scores of head g, tokens 2t, 2t + 1 (from tokens 0-7's accumulator) and 8 + 2t,
    9 + 2t (8-15's)."""
    rows = tile_rows(k_tile)
    lrow, lch = (np.arange(32) & 7) + ((np.arange(32) >> 4) << 3), (np.arange(32) >> 3) & 1
    zero = np.zeros((32, 2))
    lo, hi = np.zeros((32, 4)), np.zeros((32, 4))
    for ks, (w0, w1) in enumerate(q_regs(q, perm)):
        b = ldmatrix_x4(rows, [(r, (2 * ks + c) ^ (r & 7)) for r, c in zip(lrow, lch)])
        lo, hi = mma(lo, (w0, zero, w1, zero), (b[0], b[1])), mma(hi, (w0, zero, w1, zero), (b[2], b[3]))
    return lo[:, :2], hi[:, :2]


def scores_cols(q, k_tile, perm):
    """S^T = K . Q^T: lane (g, t)'s scores of tokens g and g + 8 for heads 2t, 2t + 1 (two accumulators, summed)."""
    rows = tile_rows(k_tile)
    arow, ach = (np.arange(32) & 7) + (((np.arange(32) >> 3) & 1) << 3), np.arange(32) >> 4
    acc = [np.zeros((32, 4)), np.zeros((32, 4))]
    for ks, (w0, w1) in enumerate(q_regs(q, perm)):
        a = ldmatrix_x4(rows, [(r, (2 * ks + c) ^ (r & 7)) for r, c in zip(arow, ach)])
        acc[ks & 1] = mma(acc[ks & 1], a, (w0, w1))
    return acc[0] + acc[1]


def test_both_score_layouts_hold_the_scores_their_comments_name():
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((8, 128)), rng.standard_normal((16, 128))
    s = q @ k.T   # [head, token]
    lo, hi = scores_rows(q, k, IDENTITY)
    np.testing.assert_allclose(lo, np.stack([s[G, 2 * T], s[G, 2 * T + 1]], axis=1), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(hi, np.stack([s[G, 8 + 2 * T], s[G, 9 + 2 * T]], axis=1), rtol=1e-12, atol=1e-12)
    st = scores_cols(q, k, IDENTITY)
    want = np.stack([s[2 * T, G], s[2 * T + 1, G], s[2 * T, G + 8], s[2 * T + 1, G + 8]], axis=1)
    np.testing.assert_allclose(st, want, rtol=1e-12, atol=1e-12)


def test_movmatrix_turns_the_transposed_ps_into_the_p_v_operand_of_the_row_layout():
    """P^T's B fragments (pb0: head g, tokens 2t, 2t + 1; pb1: 8 + 2t, 9 + 2t) from S^T's blocks as scores_cols
    packs them (token g / g + 8 of heads 2t, 2t + 1), equal to scores_rows' (which are S's C fragments as they are)."""
    p = np.random.default_rng(1).random((8, 16))   # [head, token]
    lo = movmatrix_trans(np.stack([p[2 * T, G], p[2 * T + 1, G]], axis=1))
    hi = movmatrix_trans(np.stack([p[2 * T, G + 8], p[2 * T + 1, G + 8]], axis=1))
    np.testing.assert_array_equal(lo, np.stack([p[G, 2 * T], p[G, 2 * T + 1]], axis=1))
    np.testing.assert_array_equal(hi, np.stack([p[G, 8 + 2 * T], p[G, 9 + 2 * T]], axis=1))


def fp8_cols(q, k_tile):
    """scores_cols over an FP8 tile: an ldmatrix of FP8 bytes hands lane (g, t) bytes 4t .. 4t + 3 of its row's
    16-byte chunk (16 channels), and kv_pair splits them into channels 4t, 4t + 1 (a0 / a1) and 4t + 2, 4t + 3
    (a2 / a3); Q's words follow the same permutation (FP8_PERM)."""
    acc = np.zeros((32, 4))
    for ks, (w0, w1) in enumerate(q_regs(q, FP8_PERM)):
        lo = lambda tok: np.stack([k_tile[tok, 16 * ks + 4 * T], k_tile[tok, 16 * ks + 4 * T + 1]], axis=1)  # noqa: E731
        hi = lambda tok: np.stack([k_tile[tok, 16 * ks + 4 * T + 2], k_tile[tok, 16 * ks + 4 * T + 3]], axis=1)  # noqa: E731
        acc = mma(acc, (lo(G), lo(G + 8), hi(G), hi(G + 8)), (w0, w1))
    return acc


def test_the_fp8_tiles_transposed_scores_use_q_in_its_permuted_order():
    rng = np.random.default_rng(2)
    q, k = rng.standard_normal((8, 128)), rng.standard_normal((16, 128))
    s = q @ k.T
    want = np.stack([s[2 * T, G], s[2 * T + 1, G], s[2 * T, G + 8], s[2 * T + 1, G + 8]], axis=1)
    np.testing.assert_allclose(fp8_cols(q, k), want, rtol=1e-12, atol=1e-12)
    # (the model can fail: Q's words in channel order against the permuted K pairs give other sums)
    bad = np.zeros((32, 4))
    for ks, (w0, w1) in enumerate(q_regs(q, IDENTITY)):
        kk = lambda tok, e: np.stack([k[tok, 16 * ks + 4 * T + e], k[tok, 16 * ks + 4 * T + e + 1]], axis=1)  # noqa: E731
        bad = mma(bad, (kk(G, 0), kk(G + 8, 0), kk(G, 2), kk(G + 8, 2)), (w0, w1))
    assert not np.allclose(bad, want)


@pytest.mark.parametrize("wrong", ["rows_order", "no_swizzle"])
def test_a_wrong_ldmatrix_addressing_is_caught(wrong):
    """scores_cols' check can fail: B's block order (scores_rows' lrow / lch) for the A operand, or addresses that
    ignore the tile's swizzle, give other scores."""
    rng = np.random.default_rng(3)
    q, k = rng.standard_normal((8, 128)), rng.standard_normal((16, 128))
    s = q @ k.T
    rows = tile_rows(k)
    if wrong == "rows_order":
        arow, ach = (np.arange(32) & 7) + ((np.arange(32) >> 4) << 3), (np.arange(32) >> 3) & 1
        key = lambda r, c, ks: (r, (2 * ks + c) ^ (r & 7))  # noqa: E731
    else:
        arow, ach = (np.arange(32) & 7) + (((np.arange(32) >> 3) & 1) << 3), np.arange(32) >> 4
        key = lambda r, c, ks: (r, 2 * ks + c)  # noqa: E731
    acc = np.zeros((32, 4))
    for ks, (w0, w1) in enumerate(q_regs(q, IDENTITY)):
        acc = mma(acc, ldmatrix_x4(rows, [key(r, c, ks) for r, c in zip(arow, ach)]), (w0, w1))
    want = np.stack([s[2 * T, G], s[2 * T + 1, G], s[2 * T, G + 8], s[2 * T + 1, G + 8]], axis=1)
    assert not np.allclose(acc, want)
