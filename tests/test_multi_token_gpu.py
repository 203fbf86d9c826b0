"""Multi-token decode on the GPU (`DecodeAttention(q_len=...)`) against a float64 causal reference: BENCH's
batches and length distributions, outputs poisoned first, NaN rows, the variants that take q_len, CUDA-graph
replay across re-plans, and FlashInfer's wrapper."""
import dataclasses

import pytest
import torch

import meld
from meld.codegen import DecodeKernelConfig
from meld.compat.flashinfer import BatchDecodeWithPagedKVCacheWrapper
from meld.runtime.reference import attention_reference
from meld.workloads import lengths, paged
from tests.gpu_checks import check as _check
from tests.gpu_checks import run_nan_rows

pytestmark = pytest.mark.gpu


def _error(out, ref) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("q_len", [1, 2, 4, 8])
@pytest.mark.parametrize("B", [1, 8, 64, 256])
def test_batches(q_len, B):
    """BENCH's shape (Hq 32, Hkv 8, head_dim 128, page 16, bf16) and distributions: poisoned outputs all written,
    error < 1e-2 against float64, lse, the GPU planner's tables equal to the host planner's, two runs identical."""
    for dist in ("uniform2k", "skewed", "one-long"):
        if dist != "one-long" or B > 1:
            _check(B, dist, q_len=q_len)


@pytest.mark.parametrize("q_len", [4, 8])   # 16-row units; 32-row units merging 8 rows a pass (six warps in clusters)
@pytest.mark.parametrize("options", [
    dict(kv_layout="HND"), dict(batch_invariant=True), dict(cluster_size=4), "tma",
])
def test_options_with_q_len(options, q_len):
    if options == "tma":   # the default build with TMA rings
        built = DecodeKernelConfig.default("bfloat16", 128, group_size=4, q_len=q_len)
        options = dict(kernel_config=dataclasses.replace(built, tma=True))
    _check(64, "skewed", q_len=q_len, **options)
    _check(8, "one-long", q_len=q_len, **options)


@pytest.mark.parametrize("q_len", [4, 8])   # 16- and 32-row units
@pytest.mark.parametrize("fp8,cap", [(True, 0.0), (False, 5.0), (True, 5.0)])
def test_fp8_and_soft_cap_with_q_len(fp8, cap, q_len):
    """An e4m3 cache (FlashInfer's per-tensor scales) and a soft cap that bites, in separate K and V tensors, against
    float64 on the values the cache stands for."""
    Hq, Hkv, D, dev = 32, 8, 128, "cuda"
    lens = lengths("skewed", 64)
    pb = paged(lens, 16)
    kv = torch.randn(pb.num_pages, 2, 16, Hkv, D, device=dev)
    q = torch.randn(len(lens) * q_len, Hq, D, device=dev).bfloat16()
    scales = dict(k_scale=0.5, v_scale=2.0) if fp8 else {}
    cache = kv.to(torch.float8_e4m3fn) if fp8 else kv.bfloat16()
    attn = meld.DecodeAttention(Hq, Hkv, D, 16, torch.bfloat16, dev, q_len=q_len, logits_soft_cap=cap or None,
                                kv_dtype=torch.float8_e4m3fn if fp8 else None)
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), device=dev)
    attn.run(q, (cache[:, 0], cache[:, 1]), out=out, lse=lse, **scales)
    torch.cuda.synchronize()
    values = cache.double() * torch.tensor([0.5, 2.0], device=dev).view(1, 2, 1, 1, 1).double() if fp8 else cache
    ref, ref_lse = attention_reference(q, values, pb.kv_indptr.to(dev), pb.kv_indices.to(dev),
                                       pb.kv_last_page_len.to(dev), q_len=q_len, logits_soft_cap=cap)
    assert not out.isnan().any() and not lse.isnan().any()
    assert _error(out, ref) < 1e-2
    assert (lse.double() - ref_lse).abs().max().item() < 2e-3


@pytest.mark.parametrize("q_len,group", [(3, 8), (8, 1), (2, 16), (8, 8), (2, 12)])
def test_other_rows(q_len, group):
    """Rows per kv head that leave a unit part empty (3 x 8 = 24 of a 32-row unit; 2 x 12 = 24), one head per kv
    head, 32 rows in one unit and 64 in two."""
    _check(64, "skewed", group=group, q_len=q_len)


@pytest.mark.parametrize("q_len", [4, 8])   # 16- and 32-row units
def test_nan_reaches_exactly_the_rows_that_see_it(q_len):
    """NaN in q: its (request, token, q head) row; NaN in K at a new token's key: the rows of that token and the
    later ones of that request and kv head (out and lse), split across CTAs or not; the rest as float64."""
    Hq, Hkv, D, dev = 32, 8, 128, "cuda"
    lens = [300, 65536, 2048, 40]
    pb = paged(lens, 16)
    kv = torch.randn(pb.num_pages, 2, 16, Hkv, D, device=dev).bfloat16()
    q = torch.randn(len(lens) * q_len, Hq, D, device=dev).bfloat16()
    q[2 * q_len + 1, 9] = float("nan")
    bad = torch.zeros(len(lens) * q_len, Hq, dtype=torch.bool, device=dev)
    bad[2 * q_len + 1, 9] = True
    for b in (0, 1):   # a whole unit and a unit split over many CTAs
        pos = lens[b] - q_len + 2            # seen by tokens 2 on
        page = int(pb.kv_indices[int(pb.kv_indptr[b]) + pos // 16])
        kv[page, 0, pos % 16, 3] = float("nan")   # kv head 3: q heads 12-15
        bad[b * q_len + 2:(b + 1) * q_len, 12:16] = True
    attn = meld.DecodeAttention(Hq, Hkv, D, 16, torch.bfloat16, dev, q_len=q_len)
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    out, lse = run_nan_rows(attn, q, kv, bad)
    ref, ref_lse = attention_reference(q.nan_to_num(0.0), kv.nan_to_num(0.0), pb.kv_indptr.to(dev),
                                       pb.kv_indices.to(dev), pb.kv_last_page_len.to(dev), q_len=q_len)
    assert _error(out[~bad], ref[~bad]) < 1e-2
    assert (lse[~bad].double() - ref_lse[~bad]).abs().max().item() < 2e-3


@pytest.mark.parametrize("q_len", [2, 4, 8])
def test_cuda_graph_replay_across_replans(q_len):
    dev, Hq, Hkv, D, P, B = "cuda", 32, 8, 128, 16, 64
    batches = [lengths("skewed", B), lengths("one-long", B), [q_len] * (B - 1) + [5000], [2048] * B]
    plans = [paged(l, P) for l in batches]
    kv = torch.randn(max(p.num_pages for p in plans), 2, P, Hkv, D, device=dev).bfloat16()
    q = torch.randn(B * q_len, Hq, D, device=dev).bfloat16()
    attn = meld.DecodeAttention(Hq, Hkv, D, P, torch.bfloat16, dev, q_len=q_len, max_batch_size=B,
                                max_num_pages=max(p.kv_indices.numel() for p in plans))
    out = torch.empty_like(q)
    lse = torch.empty(B * q_len, Hq, device=dev)
    attn.plan(plans[0].kv_indptr, plans[0].kv_indices, plans[0].kv_last_page_len)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        attn.run(q, kv, out=out, lse=lse)   # warm up outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        attn.run(q, kv, out=out, lse=lse)
    for p in plans:
        attn.plan(p.kv_indptr, p.kv_indices, p.kv_last_page_len)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ref, ref_lse = attention_reference(q, kv, p.kv_indptr.to(dev), p.kv_indices.to(dev),
                                           p.kv_last_page_len.to(dev), q_len=q_len)
        assert not out.isnan().any() and not lse.isnan().any()
        assert _error(out, ref) < 1e-2
        assert (lse.double() - ref_lse).abs().max().item() < 2e-3


@pytest.mark.parametrize("q_len", [2, 3])
def test_flashinfer_wrapper_graph_replay(q_len):
    """FlashInfer's own multi-token case through meld's wrapper: a CUDA-graph wrapper captured at kv 129 and
    replayed after re-plans down to kv_len = q_len_per_req, lse base 2."""
    dev, Hkv, G, D, P, B = "cuda", 8, 4, 128, 16, 16
    sets = [[129] * B, [[33, 17, 65, 129][i % 4] for i in range(B)], [[q_len, 128, 64, 100][i % 4] for i in range(B)]]
    plans = [paged(l, P) for l in sets]
    kv = torch.randn(max(p.num_pages for p in plans), 2, P, Hkv, D, device=dev).bfloat16()
    q = torch.randn(B * q_len, Hkv * G, D, device=dev).bfloat16()
    ints = dict(dtype=torch.int32, device=dev)
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=dev), "NHD",
                                           use_cuda_graph=True, use_tensor_cores=True,
                                           paged_kv_indptr_buffer=torch.empty(B + 1, **ints),
                                           paged_kv_indices_buffer=torch.empty(max(p.kv_indices.numel() for p in plans),
                                                                               **ints),
                                           paged_kv_last_page_len_buffer=torch.empty(B, **ints))

    def plan(p):
        w.plan(p.kv_indptr, p.kv_indices, p.kv_last_page_len, Hkv * G, Hkv, D, P, q_data_type=torch.bfloat16,
               q_len_per_req=q_len)

    plan(plans[0])
    out = torch.empty_like(q)
    lse = torch.empty(B * q_len, Hkv * G, device=dev)
    w.run(q, kv, out=out, lse=lse)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w.run(q, kv, out=out, lse=lse)
    for p in plans:
        plan(p)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ref, ref_lse = attention_reference(q, kv, p.kv_indptr.to(dev), p.kv_indices.to(dev),
                                           p.kv_last_page_len.to(dev), q_len=q_len)
        assert _error(out, ref) < 1e-2
        assert (lse.double() * 0.6931471805599453 - ref_lse).abs().max().item() < 2e-3
