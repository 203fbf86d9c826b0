"""GQA decode at head_dim 512 (issue 42, item 3: FlashInfer's large-head decode): `DecodeAttention(head_dim=512)`,
the torch op and the FlashInfer wrapper. The kernel's build keeps each warp's O^T (128 registers a lane) in
registers and Q's fragments in shared memory, on two warps of two-stage rings (four over FP8 caches;
tests/test_codegen.py compiles its variants for sm_90a without spills).

The reference is float64 attention over the dequantised cache (tests/test_decode_variants.py's `reference`: RoPE at
each key's position, q at its request's last), independent of meld's executor. CPU: the configuration's limits and
the executor against it. GPU (`gpu`): the kernel against it for 16-bit and FP8 caches (e4m3 with scales),
RoPE, NHD and HND, pages of 1, 7 and 16 tokens, groups of 1, 4, 8 and 16, lengths off the pages and tiles with
requests long enough to split; NaN in q, K or V reaching exactly its rows; the torch op's and the wrapper's results;
a captured run() replayed across re-plans. Outputs are NaN-filled before every run."""
import math

import pytest
import torch

import meld
from meld.codegen import DecodeKernelConfig
from meld.compat.flashinfer import BatchDecodeWithPagedKVCacheWrapper
from meld.ops import torch_ops
from meld.scheduler import Topology
from meld.workloads import paged
from tests.test_decode_variants import _check, reference

D = 512
BF16, F16 = torch.bfloat16, torch.float16
E4M3 = torch.float8_e4m3fn
K_SCALE, V_SCALE = 0.37, 2.5            # FP8 caches' per-tensor scales (not powers of two)
LENS = [37, 0, 250, 1, 1003, 115, 18]   # no length a multiple of the 16-token tile or of the page
GPU_LENS = [37, 0, 250, 1, 1003, 115, 9000, 17, 64]   # 9000: its units split across CTAs on the H200


def test_config():
    """Two warps of two stages (four over FP8), 8-head units (a group of 16 takes two), global-memory merges;
    16-head units are refused by name."""
    for kv, warps in (("", 2), ("float8_e4m3fn", 4)):
        c = DecodeKernelConfig.default("float16", D, onchip_merge=True, group_size=16, kv_dtype=kv)
        assert (c.num_warps, c.num_stages, c.heads_per_unit, c.onchip_merge) == (warps, 2, 8, False)
        assert c.smem_bytes <= 227 * 1024
    with pytest.raises(ValueError, match="heads_per_unit=16 with head_dim=512: expected 8"):
        DecodeKernelConfig(head_dim=D, num_warps=2, num_stages=2, heads_per_unit=16)


def _case(dtype, fmt, layout, P, Hq, Hkv, lens, rope, device, **kw):
    """A planned operator, fresh q and K, V [pages, P, Hkv, D] (NHD; FP8: normal draws times 8 rounded to the
    format), the cache as run() takes it in `layout`, and the run's scales."""
    pb = paged(lens, P)
    attn = meld.DecodeAttention(Hq, Hkv, D, P, dtype, device, kv_dtype=fmt, kv_layout=layout,
                                pos_encoding_mode="ROPE_LLAMA" if rope else "NONE", **kw)
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    k, v = ((torch.randn(pb.num_pages, P, Hkv, D, device=device) * (8 if fmt else 1)).to(fmt or dtype)
            for _ in range(2))
    q = torch.randn(len(lens), Hq, D, device=device).to(dtype)
    kv = torch.stack([k, v], dim=1)
    cache = kv if layout == "NHD" else kv.transpose(2, 3).contiguous()
    scales = dict(k_scale=K_SCALE, v_scale=V_SCALE) if fmt else {}
    return attn, pb, q, k, v, cache, scales


def _reference(attn, pb, q, k, v, scales):
    rope = (attn.variant.rope_theta, attn.variant.rope_scale) if attn.variant.rope_theta else None
    return reference(q.cpu(), k.cpu().double() * scales.get("k_scale", 1.0),
                     v.cpu().double() * scales.get("v_scale", 1.0), pb, attn.sm_scale, rope=rope)


def _run(attn, q, cache, scales):
    """out and lse (natural log) of a run whose outputs were NaN-filled first."""
    out = torch.full_like(q, math.nan)
    lse = torch.full(q.shape[:2], math.nan, device=q.device)
    attn.run(q, cache, out=out, lse=lse, **scales)
    return out, lse


@pytest.mark.parametrize("dtype,fmt,layout,P,rope", [(F16, None, "NHD", 16, True), (BF16, E4M3, "HND", 5, False)])
def test_executor_matches_float64(dtype, fmt, layout, P, rope):
    attn, pb, q, k, v, cache, scales = _case(dtype, fmt, layout, P, 8, 2, LENS, rope, "cpu",
                                             topology=Topology(24, {1: 48}))
    assert (attn.schedule.items()["slot"] >= 0).any(), "the test must exercise split units and merges"
    out, lse = _run(attn, q, cache, scales)
    # float64 rounded to q's dtype (bfloat16: 2^-9), and RoPE's keys to it first
    _check(out, lse, *_reference(attn, pb, q, k, v, scales), tol=3e-3, lse_tol=2e-3)


# --- GPU ----------------------------------------------------------------------------------------------------------
# (q dtype, FP8 format or None, layout, page_size, num_qo_heads, num_kv_heads, RoPE): five kernels (each compiled on
# first use), four of them those of the port's head_dim-512 cases
GPU_CASES = [(BF16, None, "NHD", 16, 32, 8, False), (F16, None, "HND", 1, 8, 8, True),
             (F16, E4M3, "NHD", 16, 32, 4, True), (F16, E4M3, "HND", 1, 32, 4, False),
             (BF16, None, "HND", 7, 16, 4, False), (F16, None, "NHD", 16, 64, 4, False)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,fmt,layout,P,Hq,Hkv,rope", GPU_CASES)
def test_gpu_matches_float64(dtype, fmt, layout, P, Hq, Hkv, rope):
    attn, pb, q, k, v, cache, scales = _case(dtype, fmt, layout, P, Hq, Hkv, GPU_LENS, rope, "cuda")
    assert (attn.schedule.items()["slot"] >= 0).any(), "the test must exercise split units and merges"
    out, lse = _run(attn, q, cache, scales)
    again, again_lse = _run(attn, q, cache, scales)
    _check(out, lse, *_reference(attn, pb, q, k, v, scales), lse_tol=2e-2)
    assert torch.equal(out, again) and torch.equal(lse, again_lse), "results differ between two identical runs"


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [None, E4M3])
def test_gpu_nan_reaches_exactly_its_rows(fmt):
    """NaN in q[b, h]: that row's out and lse; in a key of request c's kv head g: out and lse of g's q heads in c; in a
    value: their out only (lse is the scores'). Request 6 (9000 keys) is split: its NaN crosses the merge."""
    attn, pb, q, k, v, cache, scales = _case(F16, fmt, "NHD", 16, 32, 4, GPU_LENS, True, "cuda")
    def page(b, i):   # request b's page i
        return int(pb.kv_indices[int(pb.kv_indptr[b]) + i])

    bits = cache.view(torch.uint8) if fmt else cache.view(torch.int16)   # NaN's code: 0x7F (e4m3), 0x7E00 (f16)
    nan = 0x7F if fmt else 0x7E00
    q[3, 5, 7] = math.nan
    bits[page(6, 100), 0, 3, 1, 300] = nan      # request 6, key 1603 of kv head 1: q heads 8-15
    bits[page(4, 2), 1, 5, 2, 9] = nan          # request 4, a value of kv head 2: q heads 16-23 (out only)
    out, lse = _run(attn, q, cache, scales)
    bad_out = torch.zeros(len(GPU_LENS), 32, dtype=torch.bool)
    bad_out[3, 5] = bad_out[6, 8:16] = bad_out[4, 16:24] = True
    bad_lse = bad_out.clone()
    bad_lse[4, 16:24] = False
    assert torch.equal(out.isnan().any(-1).cpu(), bad_out) and torch.equal(out.isnan().all(-1).cpu(), bad_out)
    assert torch.equal(lse.isnan().cpu(), bad_lse)
    ref, ref_lse = _reference(attn, pb, q, cache[:, 0], cache[:, 1], scales)
    good = ~bad_out
    err = ((out.double().cpu()[good] - ref[good]).norm() / ref[good].norm()).item()
    assert err < 1e-2, f"relative error {err:.2e} on the rows without NaN"


@pytest.mark.gpu
def test_gpu_torch_op_and_wrapper():
    """The torch op gives the operator's bits; FlashInfer's wrapper (float16, e4m3 with scales, RoPE, HND) the
    reference's, lse in base 2."""
    attn, pb, q, k, v, cache, scales = _case(F16, E4M3, "HND", 16, 32, 4, GPU_LENS, True, "cuda")
    out, lse = _run(attn, q, cache, scales)
    op_out, op_lse = torch_ops.decode_attention(attn, q, (cache[:, 0], cache[:, 1]), return_lse=True, **scales)
    assert torch.equal(op_out, out) and torch.equal(op_lse, lse)
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(16, dtype=torch.uint8, device="cuda"), "HND")
    w.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len, 32, 4, D, 16, q_data_type=F16, kv_data_type=E4M3,
           pos_encoding_mode="ROPE_LLAMA")
    w_out = torch.full_like(q, math.nan)
    w_lse = torch.full(q.shape[:2], math.nan, device="cuda")
    w.run(q, cache, out=w_out, lse=w_lse, return_lse=True, **scales)
    _check(w_out, w_lse / math.log2(math.e), *_reference(attn, pb, q, k, v, scales), lse_tol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [None, E4M3])
def test_gpu_cuda_graph_replay_across_replans(fmt):
    """A captured run() replays later plans of other batches (short, long and split, empty requests)."""
    from meld.runtime.cuda_graphs import capture

    P, tables = 16, [paged(lens, 16) for lens in ([300, 40, 7, 1000], [5, 12000, 0, 333], [1, 2, 3, 4])]
    pages = max(t.num_pages for t in tables)
    attn, _, q, k, v, cache, scales = _case(F16, fmt, "NHD", P, 32, 4, [pages * P, 1, 1, 1], True, "cuda",
                                            max_batch_size=4, max_num_pages=pages + 3)
    out = torch.full_like(q, math.nan)
    graph, _ = capture(lambda: attn.run(q, cache, out=out, **scales))
    for t in tables:
        attn.plan(t.kv_indptr, t.kv_indices, t.kv_last_page_len)
        out.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        ref, _ = _reference(attn, t, q, k, v, scales)
        assert not out.isnan().any()
        assert ((out.double().cpu() - ref).norm() / ref.norm()).item() < 1e-2
