"""Ragged multi-token decode on the GPU (`DecodeAttention(q_len=n, ragged=True)`, plan()'s qo_indptr) against the
float64 ragged reference: BENCH's batches with n_b drawn per request, outputs poisoned first, NaN in q reaching exactly
its row, and CUDA-graph replay across re-plans with other qo_indptr."""
import numpy as np
import pytest
import torch

import meld
from meld.runtime.reference import attention_reference
from meld.workloads import lengths, paged
from tests.gpu_checks import check as _check
from tests.gpu_checks import run_nan_rows
from tests.test_ragged_q import qo_indptr

pytestmark = pytest.mark.gpu


def _tokens(B: int, q_len: int, seed: int) -> list[int]:
    """n_b per request, 1 to q_len, both ends present where B allows."""
    n = np.random.default_rng(seed).integers(1, q_len + 1, B)
    n[:2] = (1, q_len)[:B]
    return [int(x) for x in n]


def _error(out, ref) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("q_len", [4, 8])   # 16-row units; 32-row units merging 8 rows a pass
@pytest.mark.parametrize("B", [1, 8, 64, 256])
def test_batches(q_len, B):
    """BENCH's shape (Hq 32, Hkv 8, head_dim 128, page 16, bf16) and distributions with mixed n_b: poisoned outputs
    all written, error < 1e-2 against float64, lse, the GPU planner's tables equal to the host planner's, two runs
    identical."""
    for dist in ("uniform2k", "skewed", "one-long"):
        if dist != "one-long" or B > 1:
            _check(B, dist, q_len=q_len, ragged=True, tokens=_tokens(B, q_len, B))


@pytest.mark.parametrize("options", [dict(kv_layout="HND", cluster_size=4), dict(batch_invariant=True),
                                     dict(kv_dtype=torch.float8_e4m3fn)])
def test_options_ragged(options):
    """Requests of exactly n_b keys among long ones; clusters' on-chip merges, batch invariance, an FP8 cache (read
    as its values: scales 1)."""
    lens = [8, 3000, 1, 70000, 5, 2048, 8, 17]
    tokens = [8, 3, 1, 8, 5, 1, 2, 7]
    if "kv_dtype" in options:
        fp8 = meld.DecodeAttention(32, 8, 128, 16, torch.bfloat16, "cuda", q_len=8, ragged=True, **options)
        pb = paged(lens, 16)
        kv = torch.randn(pb.num_pages, 2, 16, 8, 128, device="cuda").to(torch.float8_e4m3fn)
        q = torch.randn(sum(tokens), 32, 128, device="cuda").bfloat16()
        qo = qo_indptr(tokens)
        fp8.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len, qo_indptr=qo)
        out = torch.full_like(q, float("nan"))
        fp8.run(q, kv, out=out)
        torch.cuda.synchronize()
        ref, _ = attention_reference(q, kv.double(), pb.kv_indptr.cuda(), pb.kv_indices.cuda(),
                                     pb.kv_last_page_len.cuda(), q_len=8, qo_indptr=qo)
        assert not out.isnan().any() and _error(out, ref) < 1e-2
        return
    _check(len(lens), None, lens=lens, q_len=8, ragged=True, tokens=tokens, **options)


def test_nan_in_q_reaches_exactly_its_row():
    Hq, Hkv, D, dev, q_len = 32, 8, 128, "cuda", 8
    lens, tokens = [300, 65536, 2048, 40], [3, 8, 1, 5]
    pb = paged(lens, 16)
    qo = qo_indptr(tokens)
    kv = torch.randn(pb.num_pages, 2, 16, Hkv, D, device=dev).bfloat16()
    q = torch.randn(sum(tokens), Hq, D, device=dev).bfloat16()
    bad = torch.zeros(q.shape[:2], dtype=torch.bool, device=dev)
    for row, head in ((int(qo[1]) + 6, 9), (int(qo[2]), 30), (int(qo[3]) + 4, 0)):   # split, whole, last row
        q[row, head] = float("nan")
        bad[row, head] = True
    attn = meld.DecodeAttention(Hq, Hkv, D, 16, torch.bfloat16, dev, q_len=q_len, ragged=True)
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len, qo_indptr=qo)
    out, lse = run_nan_rows(attn, q, kv, bad)
    ref, ref_lse = attention_reference(q.nan_to_num(0.0), kv, pb.kv_indptr.to(dev), pb.kv_indices.to(dev),
                                       pb.kv_last_page_len.to(dev), q_len=q_len, qo_indptr=qo)
    assert _error(out[~bad], ref[~bad]) < 1e-2
    assert (lse[~bad].double() - ref_lse[~bad]).abs().max().item() < 2e-3


@pytest.mark.parametrize("q_len", [4, 8])
def test_cuda_graph_replay_across_replans(q_len):
    """A run() captured once replays later plans' page tables and qo_indptr, other row counts included: q and out are
    views of buffers that hold the most rows (B x q_len), the kernel reading and writing each plan's first
    qo_indptr[-1]; the rows past them stay as they were."""
    dev, Hq, Hkv, D, P, B = "cuda", 32, 8, 128, 16, 64
    batches = [(lengths("skewed", B), _tokens(B, q_len, 1)), (lengths("one-long", B), [q_len] * B),
               ([q_len] * (B - 1) + [5000], _tokens(B, q_len, 2)), ([2048] * B, [1] * B)]
    plans = [(paged(lens, P), qo_indptr(tokens)) for lens, tokens in batches]
    kv = torch.randn(max(p.num_pages for p, _ in plans), 2, P, Hkv, D, device=dev).bfloat16()
    q = torch.randn(B * q_len, Hq, D, device=dev).bfloat16()
    out = torch.empty_like(q)
    lse = torch.empty(B * q_len, Hq, device=dev)
    attn = meld.DecodeAttention(Hq, Hkv, D, P, torch.bfloat16, dev, q_len=q_len, ragged=True, max_batch_size=B,
                                max_num_pages=max(p.kv_indices.numel() for p, _ in plans))
    p0, qo0 = plans[0]
    attn.plan(p0.kv_indptr, p0.kv_indices, p0.kv_last_page_len, qo_indptr=qo0)
    rows0 = int(qo0[-1])
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        attn.run(q[:rows0], kv, out=out[:rows0], lse=lse[:rows0])   # warm up outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        attn.run(q[:rows0], kv, out=out[:rows0], lse=lse[:rows0])
    for p, qo in plans:
        attn.plan(p.kv_indptr, p.kv_indices, p.kv_last_page_len, qo_indptr=qo)
        rows = int(qo[-1])
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ref, ref_lse = attention_reference(q[:rows], kv, p.kv_indptr.to(dev), p.kv_indices.to(dev),
                                           p.kv_last_page_len.to(dev), q_len=q_len, qo_indptr=qo)
        assert not out[:rows].isnan().any() and not lse[:rows].isnan().any()
        assert out[rows:].isnan().all() and lse[rows:].isnan().all(), "rows past qo_indptr[-1] were written"
        assert _error(out[:rows], ref) < 1e-2
        assert (lse[:rows].double() - ref_lse).abs().max().item() < 2e-3
    p, qo = plans[0]
    with torch.cuda.graph(torch.cuda.CUDAGraph()), pytest.raises(RuntimeError, match="cannot be captured"):
        attn.plan(p.kv_indptr, p.kv_indices, p.kv_last_page_len, qo_indptr=qo)   # (it reads qo_indptr on the host)
