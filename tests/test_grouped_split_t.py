"""The grouped-attention kernel's transposed split step (GroupedKernelConfig(split_math="transposed"): attend_tile
on RowsT, stash_rows of RowsT, then merge_warps) emulated lane by lane in float64 NumPy: the fragments of mma
m16n8k16 and ldmatrix (.trans) as PTX defines them, the quad and alpha shuffles, the stash's (row, channel) of
each accumulator. Checked against float64 attention for 1 to 16 rows over tiles split between warps (the last one
partial), with a non-finite score poisoning exactly its row, and shown to fail when a lane rescales the wrong
row."""
import numpy as np
import pytest

LANE = np.arange(32)
G, T = LANE // 4, LANE % 4
NAN = float("nan")


def a_matrix(a):
    """mma's A fragments (lane, register, half) as the 16 x 16 matrix they hold."""
    m = np.zeros((16, 16))
    for i in range(4):
        for j in range(2):
            m[G + 8 * (i % 2), 2 * T + j + 8 * (i // 2)] = a[:, i, j]
    return m


def b_matrix(b):
    m = np.zeros((16, 8))
    for i in range(2):
        for j in range(2):
            m[2 * T + j + 8 * i, G] = b[:, i, j]
    return m


def c_frag(c):
    return np.stack([c[G + 8 * (i // 2), 2 * T + i % 2] for i in range(4)], 1)


def c_matrix(f):
    m = np.zeros((16, 8))
    for i in range(4):
        m[G + 8 * (i // 2), 2 * T + i % 2] = f[:, i]
    return m


def mma(c, a, b):
    return c_frag(a_matrix(a) @ b_matrix(b) + c_matrix(c))


def k_row(lane):
    return (lane & 7) + ((lane >> 4) << 3)


def k_chunk(lane):
    return (lane >> 3) & 1


def ldmatrix_x4(tile, chunk0, trans):
    """Four 8 x 8 matrices of `tile` (tokens x channels), lane l addressing row l % 8 of matrix l // 8 at token
    k_row(l), 16-byte chunk chunk0 + k_chunk(l): lane (g, t) gets row g's elements 2t, 2t + 1 (.trans: column g's)."""
    r = np.zeros((32, 4, 2))
    for m in range(4):
        lanes = 8 * m + np.arange(8)
        mat = np.stack([tile[k_row(lane), 8 * (chunk0 + k_chunk(lane)):][:8] for lane in lanes])
        r[:, m] = np.stack([mat[2 * T, G], mat[2 * T + 1, G]] if trans else [mat[G, 2 * T], mat[G, 2 * T + 1]], 1)
    return r


def attend_tile(st, qf, k, v, valid, scale, wrong_alpha=False):
    """attend_tile<NB>: S's C fragments, the rows' online softmax (softmax_rows_t), O^T += V^T.P^T (pv_rows_t)."""
    nb, ksteps = len(st["m"]), k.shape[1] // 16
    s = [np.zeros((32, 4)), np.zeros((32, 4))]
    for ks in range(ksteps):
        b = ldmatrix_x4(k, 2 * ks, trans=False)
        s[0], s[1] = mma(s[0], qf[ks], b[:, 0:2]), mma(s[1], qf[ks], b[:, 2:4])
    pb, a_lo, a_hi = [], [], []
    for i in range(nb):
        x = np.stack([s[k_ >> 1][:, 2 * i + (k_ & 1)] * scale for k_ in range(4)], 1)
        tok = np.stack([8 * (k_ >> 1) + 2 * T + (k_ & 1) for k_ in range(4)], 1)
        x = np.where(tok < valid, np.where(np.isinf(x), NAN, x), -np.inf)   # masked_score
        mx = np.fmax.reduce(x, axis=1)
        mx = np.fmax(mx, mx[LANE ^ 1])
        mx = np.fmax(mx, mx[LANE ^ 2])
        m_new = np.fmax(st["m"][i], mx)
        m_use = np.where(m_new == -np.inf, 0.0, m_new)
        alpha, pr = np.exp2(st["m"][i] - m_use), np.exp2(x - m_use[:, None])
        st["l"][i] = st["l"][i] * alpha + pr.sum(1)
        st["m"][i] = m_new
        pb.append(np.stack([pr[:, 0:2], pr[:, 2:4]], 1))
        a_lo.append(alpha[8 * T])
        a_hi.append(alpha[8 * T + (0 if wrong_alpha else 4)])
    for mt in range(ksteps):
        a = ldmatrix_x4(v, 2 * mt, trans=True)
        for i in range(nb):
            o = st["o"][i][mt] * np.stack([a_lo[i], a_hi[i], a_lo[i], a_hi[i]], 1)
            st["o"][i][mt] = mma(o, a, pb[i])


def stash_rows(st, d):
    """stash_rows of RowsT: each warp's rows as the rows' build stashes them (o[row][channel], m[row], l[row])."""
    nb = len(st["m"])
    ws = {"o": np.full((16, d), NAN), "m": np.full(16, NAN), "l": np.full(16, NAN)}
    for i in range(nb):
        l = st["l"][i] + st["l"][i][LANE ^ 1]
        l = l + l[LANE ^ 2]
        ws["m"][8 * i + G[T == 0]], ws["l"][8 * i + G[T == 0]] = st["m"][i][T == 0], l[T == 0]
        for mt in range(d // 16):
            o, r, c = st["o"][i][mt], 8 * i + 2 * T, 16 * mt + G
            ws["o"][r, c], ws["o"][r + 1, c], ws["o"][r, c + 8], ws["o"][r + 1, c + 8] = o[:, 0], o[:, 1], o[:, 2], o[:, 3]
    return ws


def split_task(q, k, v, warps, scale, **kw):
    """A split task of q's rows over k, v: warp w attends tiles w, w + warps, ...; the stashes merged (merge_warps)."""
    rows, d = q.shape
    nb = 1 if rows <= 8 else 2
    q16 = np.zeros((16, d))
    q16[:rows] = q
    qf = [np.stack([np.stack([q16[G + 8 * (i % 2), 16 * ks + 2 * T + j + 8 * (i // 2)] for j in range(2)], 1)
                    for i in range(4)], 1) for ks in range(d // 16)]   # load_q_rows: rows past `rows` zero
    n, stashes = len(k), []
    for w in range(warps):
        st = {"m": [np.full(32, -np.inf) for _ in range(nb)], "l": [np.zeros(32) for _ in range(nb)],
              "o": [[np.zeros((32, 4)) for _ in range(d // 16)] for _ in range(nb)]}
        for t0 in range(16 * w, n, 16 * warps):
            kt, vt = np.zeros((16, d)), np.zeros((16, d))   # (zero-filled past the piece)
            kt[:n - t0], vt[:n - t0] = k[t0:t0 + 16], v[t0:t0 + 16]
            attend_tile(st, qf, kt, vt, n - t0, scale, **kw)
        stashes.append(stash_rows(st, d))
    m = np.max([s["m"][:rows] for s in stashes], axis=0)
    base = np.where(m == -np.inf, 0.0, m)
    c = [np.exp2(s["m"][:rows] - base) for s in stashes]
    l = sum(cw * s["l"][:rows] for cw, s in zip(c, stashes))
    o = sum(cw[:, None] * s["o"][:rows] for cw, s in zip(c, stashes))
    return o / l[:, None], base + np.log2(l)


def reference(q, k, v, scale):
    s = q @ k.T * scale
    m = s.max(1, keepdims=True)
    p = np.exp2(s - m)
    return p @ v / p.sum(1, keepdims=True), m[:, 0] + np.log2(p.sum(1))


@pytest.mark.parametrize("rows,d,n,warps", [(1, 64, 45, 2), (4, 128, 45, 2), (8, 64, 100, 4), (12, 64, 7, 2),
                                            (16, 128, 33, 3)])
def test_the_transposed_split_step_is_attention(rows, d, n, warps):
    rng = np.random.default_rng(rows * 1000 + n)
    q, k, v = rng.standard_normal((rows, d)), rng.standard_normal((n, d)), rng.standard_normal((n, d))
    scale = np.log2(np.e) / np.sqrt(d)
    got_o, got_l = split_task(q, k, v, warps, scale)
    want_o, want_l = reference(q, k, v, scale)
    np.testing.assert_allclose(got_o, want_o, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got_l, want_l, rtol=1e-12, atol=1e-12)
    bad_k = k.copy()
    bad_k[n - 1, 5] = np.inf   # the last (partial) tile's last token: every row's score there is non-finite
    with np.errstate(invalid="ignore"):   # (NaN, as on the GPU)
        got_o, got_l = split_task(q, bad_k, v, warps, scale)
    assert np.isnan(got_o).all() and np.isnan(got_l).all()
    q[rows - 1, 3] = NAN       # the last row only
    with np.errstate(invalid="ignore"):   # (NaN, as on the GPU)
        got_o, got_l = split_task(q, k, v, warps, scale)
    assert np.isnan(got_o[rows - 1]).all() and np.isnan(got_l[rows - 1])
    np.testing.assert_allclose(got_o[:rows - 1], want_o[:rows - 1], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got_l[:rows - 1], want_l[:rows - 1], rtol=1e-12, atol=1e-12)

def test_a_lane_that_rescales_the_wrong_row_is_caught():
    rng = np.random.default_rng(9)
    q, k, v = rng.standard_normal((8, 64)), rng.standard_normal((45, 64)), rng.standard_normal((45, 64))
    scale = np.log2(np.e) / 8
    got_o, _ = split_task(q, k, v, 2, scale, wrong_alpha=True)
    assert not np.allclose(got_o, reference(q, k, v, scale)[0], rtol=1e-6, atol=1e-6)
