"""Hostile inputs to every operator's call path on the CPU (issue 37 and its audit), no GPU needed:

  * a tensor that requires grad reaching a meld op (its direct call, its torch custom op, fused_moe, the
    FlashInfer wrapper, the emulated dist ops) gives outputs whose backward raises NotImplementedError naming
    the op: never a gradient that silently leaves the op out; an out= buffer carries that tie itself;
  * arguments that only mean something together (topk_weights, topk_ids) are refused when half given;
  * a preallocated out= / lse= whose elements share memory, or that shares memory with an input, is a
    ValueError naming it and its strides, raised before anything is written;
  * a custom op whose required out is None raises instead of computing a result it would throw away;
  * fused_moe's cached capacity stays within MoE's limit, and its errors name its own arguments;
  * a layer or operator built for the CPU refuses the shapes and grids the GPU kernel refuses.
"""
import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import meld
from meld.compat.flashinfer import BatchDecodeWithPagedKVCacheWrapper
from meld.distributed import EmulatedTransport, seq_parallel_decode, shard_batch
from meld.ops import moe as moe_module
from meld.scheduler import Topology
from meld.workloads import paged

BF16 = torch.bfloat16
H, I, E, K = 64, 64, 8, 2          # MoE
HQ, HKV, D, P = 8, 2, 64, 16        # decode attention
NO_BACKWARD = "has no backward"


def _moe(T=4, **kw):
    g = torch.Generator().manual_seed(0)
    layer = meld.MoE(H, I, E, K, BF16, "cpu", max_num_tokens=16, **kw)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(BF16)
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(BF16)
    x = torch.randn(T, H, generator=g).to(BF16)
    return layer, x, torch.randn(T, E, generator=g), w13, w2


def _routing(T=4):
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).to(torch.int32)
    return torch.rand(T, K), ids


def _attention(lens=(40, 7, 300)):
    """A planned DecodeAttention, q and kv_cache, and the FlashInfer wrapper planned for the same batch."""
    attn = meld.DecodeAttention(HQ, HKV, D, P, BF16, "cpu")
    pb = paged(list(lens), P)
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    kv = torch.randn(pb.num_pages, 2, P, HKV, D).to(BF16)
    wrapper = BatchDecodeWithPagedKVCacheWrapper(torch.empty(8, dtype=torch.uint8))
    wrapper.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len, HQ, HKV, D, P, q_data_type=BF16)
    return attn, torch.randn(len(lens), HQ, D).to(BF16), kv, wrapper


def _mla(lens=(40, 300)):
    mla = meld.DecodeMLA(64, 64, BF16, "cpu", sm_scale=0.1)
    pb = paged(list(lens), 64)
    mla.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    B = len(lens)
    return mla, (torch.randn(B, 64, 512).to(BF16), torch.randn(B, 64, 64).to(BF16),
                 torch.randn(pb.num_pages, 64, 512).to(BF16), torch.randn(pb.num_pages, 64, 64).to(BF16))


# =====================================================================================================
# 1. autograd: a backward through a meld op raises, naming the op
# =====================================================================================================

def test_moe_backward_raises_instead_of_dropping_the_moe_path():
    layer, x, logits, w13, w2 = _moe()
    want = layer(x, logits, w13, w2)
    xg = x.clone().requires_grad_()
    out = layer(xg, logits, w13, w2)
    assert torch.equal(out, want) and out.requires_grad
    with pytest.raises(NotImplementedError, match="meld.MoE " + NO_BACKWARD):
        out.float().sum().backward()
    with pytest.raises(NotImplementedError, match="meld.MoE " + NO_BACKWARD):   # was: x.grad == 1, silently
        (layer(xg, logits, w13, w2) + xg).float().sum().backward()
    assert xg.grad is None
    with pytest.raises(NotImplementedError, match="meld.MoE " + NO_BACKWARD):   # weights that require grad
        layer(x, logits, torch.nn.Parameter(w13), w2).float().sum().backward()
    with torch.no_grad():
        assert not layer(xg, logits, w13, w2).requires_grad


def test_moe_out_buffer_carries_the_tie():
    layer, x, logits, w13, w2 = _moe()
    xg = x.clone().requires_grad_()
    buf = torch.empty(4, H, dtype=BF16)
    assert layer(xg, logits, w13, w2, out=buf) is buf
    with pytest.raises(NotImplementedError, match="meld.MoE " + NO_BACKWARD):
        (buf + xg).float().sum().backward()
    # an out with autograd history, inputs that need none: its old history must not pass a gradient
    base = torch.zeros(4, H, dtype=BF16, requires_grad=True)
    hist = base * 2
    layer(x, logits, w13, w2, out=hist)
    with pytest.raises(NotImplementedError, match="meld.MoE " + NO_BACKWARD):
        hist.float().sum().backward()
    assert base.grad is None


def test_out_that_is_a_leaf_requiring_grad_is_refused_unchanged():
    layer, x, logits, w13, w2 = _moe()
    leaf = torch.zeros(4, H, dtype=BF16, requires_grad=True)
    with pytest.raises(ValueError, match="out is a leaf tensor that requires grad"):
        layer(x, logits, w13, w2, out=leaf)
    assert not leaf.detach().any()
    with torch.no_grad():   # outside grad mode autograd allows the write
        layer(x, logits, w13, w2, out=leaf)
    attn, q, kv, _ = _attention()
    with pytest.raises(ValueError, match="lse is a leaf tensor that requires grad"):
        attn.run(q, kv, lse=torch.zeros(3, HQ, requires_grad=True))


def test_fused_moe_backward_raises():
    _, x, logits, w13, w2 = _moe()
    xg = x.clone().requires_grad_()
    with pytest.raises(NotImplementedError, match=NO_BACKWARD):
        (meld.fused_moe(xg, w13, w2, logits, K) + xg).float().sum().backward()


def test_torch_ops_backward_raises_naming_the_op():
    layer, x, logits, w13, w2 = _moe()
    xg = x.clone().requires_grad_()
    out = torch.empty(4, H, dtype=BF16)
    torch.ops.meld.moe(xg, logits, w13, w2, None, None, out, layer.handle)
    assert torch.equal(out, layer(x, logits, w13, w2))
    with pytest.raises(NotImplementedError, match="torch.ops.meld.moe " + NO_BACKWARD):
        (out + xg).float().sum().backward()
    attn, q, kv, _ = _attention()
    qg = q.clone().requires_grad_()
    out, lse = torch.empty_like(q), torch.empty(3, HQ)
    torch.ops.meld.decode_attention(qg, kv, out, lse, attn.handle)
    want, want_lse = attn.run(q, kv, return_lse=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    for t in (out, lse):
        with pytest.raises(NotImplementedError, match="torch.ops.meld.decode_attention " + NO_BACKWARD):
            (t.float().sum() + qg.float().sum()).backward()


def test_attention_out_buffers_carry_the_tie():
    attn, q, kv, _ = _attention()
    qg = q.clone().requires_grad_()
    out, lse = torch.empty_like(q), torch.empty(3, HQ)
    attn.run(qg, kv, out=out, lse=lse)
    for t in (out, lse):
        with pytest.raises(NotImplementedError, match="meld.DecodeAttention.run " + NO_BACKWARD):
            (t.float().sum() + qg.float().sum()).backward()
    mla, (qn, qp, ckv, kpe) = _mla()
    out = torch.empty(2, 64, 512, dtype=BF16)
    mla.run(qn, qp, torch.nn.Parameter(ckv), kpe, out=out)
    with pytest.raises(NotImplementedError, match="meld.DecodeMLA.run " + NO_BACKWARD):
        out.float().sum().backward()


def test_flashinfer_wrapper_backward_raises_and_lse_stays_base_2():
    attn, q, kv, w = _attention()
    qg = q.clone().requires_grad_()
    lse = torch.empty(3, HQ)
    out, got = w.run(qg, kv, lse=lse, return_lse=True)
    assert got is lse
    want, want_lse = attn.run(q, kv, return_lse=True)
    assert torch.equal(out, want) and torch.allclose(lse, want_lse * 1.4426950408889634)
    with pytest.raises(NotImplementedError, match=NO_BACKWARD):
        (out.float().sum() + lse.sum() + qg.float().sum()).backward()


def test_emulated_seq_parallel_decode_backward_raises():
    lens = [40, 300]
    pb = paged(lens, P)
    kv = torch.randn(pb.num_pages, 2, P, HKV, D).to(BF16)
    q = torch.randn(2, HQ, D).to(BF16).requires_grad_()
    plan = shard_batch(np.array(lens), P, 2, 64)
    tr = EmulatedTransport(2)
    try:
        out, lse = seq_parallel_decode(plan, tr, q, kv, pb.kv_indptr, pb.kv_indices)
    finally:
        tr.close()
    with pytest.raises(NotImplementedError, match="meld.distributed.seq_parallel_decode " + NO_BACKWARD):
        (out.sum() + q.float().sum()).backward()


# =====================================================================================================
# 2. arguments that go together
# =====================================================================================================

def test_half_a_routing_pair_is_refused():
    layer, x, logits, w13, w2 = _moe()
    w, ids = _routing()
    both = "topk_weights and topk_ids go together"
    for call in (lambda: layer(x, logits, w13, w2, topk_weights=w),        # was: silently ignored
                 lambda: meld.fused_moe(x, w13, w2, logits, K, topk_weights=w),
                 lambda: layer(x, None, w13, w2, topk_weights=w),
                 lambda: torch.ops.meld.moe(x, logits, w13, w2, w, None, torch.empty(4, H, dtype=BF16), layer.handle)):
        with pytest.raises(ValueError, match=both + ": got topk_weights without topk_ids"):
            call()
    with pytest.raises(ValueError, match=both + ": got topk_ids without topk_weights"):
        layer(x, None, w13, w2, topk_ids=ids)
    with pytest.raises(ValueError, match="not both"):
        layer(x, logits, w13, w2, topk_weights=w, topk_ids=ids)
    with FakeTensorMode() as mode:
        fx, fl, f13, f2, fw = (mode.from_tensor(t) for t in (x, logits, w13, w2, w))
        with pytest.raises(ValueError, match=both):
            torch.ops.meld.moe(fx, fl, f13, f2, fw, None, torch.empty(4, H, dtype=BF16), layer.handle)


# =====================================================================================================
# 3. out= / lse= that overlap themselves or the inputs
# =====================================================================================================

def test_moe_out_with_overlapping_rows_is_refused():
    layer, x, logits, w13, w2 = _moe()
    with pytest.raises(ValueError, match=r"out has elements that share memory \(shape \(4, 64\), strides \(0, 1\)\)"):
        layer(x, logits, w13, w2, out=torch.empty(1, H, dtype=BF16).expand(4, H))
    rows = torch.empty(40 * 8, dtype=BF16).as_strided((4, H), (8, 1))   # rows of 64 starting 8 apart
    with pytest.raises(ValueError, match=r"out has elements that share memory .* strides \(8, 1\)"):
        layer(x, logits, w13, w2, out=rows)
    with pytest.raises(ValueError, match=r"out has elements that share memory"):   # the op path, as the layer
        torch.ops.meld.moe(x, logits, w13, w2, None, None, torch.empty(1, H, dtype=BF16).expand(4, H), layer.handle)


def test_moe_out_sharing_memory_with_an_input_is_refused_before_any_write():
    layer, x, logits, w13, w2 = _moe()
    keep = x.clone()
    with pytest.raises(ValueError, match=r"out \(strides \(64, 1\)\) shares memory with x \(strides \(64, 1\)\)"):
        layer(x, logits, w13, w2, out=x)
    assert torch.equal(x, keep)
    w, ids = _routing()
    with pytest.raises(ValueError, match="out .* shares memory with w13"):
        layer(x, logits, w13, w2, out=w13[0, :4])
    # rows of one buffer that do not meet are fine: x in the first half, out in the second
    buf = torch.empty(8, H, dtype=BF16)
    buf[:4] = x
    got = layer(buf[:4], None, w13, w2, topk_weights=w, topk_ids=ids, out=buf[4:])
    assert torch.equal(got, layer(x, None, w13, w2, topk_weights=w, topk_ids=ids))
    wide = torch.empty(4, 2 * H, dtype=BF16)   # and an out of row stride 2H
    assert torch.equal(layer(x, logits, w13, w2, out=wide[:, H:]), layer(x, logits, w13, w2))


def test_attention_outputs_sharing_memory_are_refused():
    attn, q, kv, _ = _attention()
    with pytest.raises(ValueError, match="out must be contiguous, got strides"):
        attn.run(q, kv, out=torch.empty(1, HQ, D, dtype=BF16).expand(3, HQ, D))
    with pytest.raises(ValueError, match=r"out \(strides \(512, 64, 1\)\) shares memory with q"):
        attn.run(q, kv, out=q)
    with pytest.raises(ValueError, match="out .* shares memory with kv_cache"):
        attn.run(q, kv, out=kv[0].reshape(-1)[:3 * HQ * D].view(3, HQ, D))
    with pytest.raises(ValueError, match="lse .* shares memory with out"):
        out, lse = _out_and_lse_in_one_buffer()
        attn.run(q, kv, out=out, lse=lse)
    mla, (qn, qp, ckv, kpe) = _mla()
    with pytest.raises(ValueError, match="out .* shares memory with q_nope"):
        mla.run(qn, qp, ckv, kpe, out=qn)
    with pytest.raises(ValueError, match="lse .* shares memory with ckv_cache"):
        mla.run(qn, qp, ckv, kpe, lse=ckv.view(-1)[:2 * 64 * 2].view(torch.float32).view(2, 64))


def _out_and_lse_in_one_buffer():
    """out [3, HQ, D] bf16, and lse [3, HQ] float32 over its first bytes."""
    raw = torch.empty(3 * HQ * D * 2, dtype=torch.uint8)
    return raw.view(BF16).view(3, HQ, D), raw[:3 * HQ * 4].view(torch.float32).view(3, HQ)


def test_flashinfer_wrapper_outputs_sharing_memory_are_refused():
    _, q, kv, w = _attention()
    keep = q.clone()
    with pytest.raises(ValueError, match="out .* shares memory with q"):
        w.run(q, kv, out=q)
    assert torch.equal(q, keep)
    out, lse = _out_and_lse_in_one_buffer()
    with pytest.raises(ValueError, match="lse .* shares memory with out"):   # before the wrapper scales lse
        w.run(q, kv, out=out, lse=lse, return_lse=True)


# =====================================================================================================
# 4. a required out that is None
# =====================================================================================================

def test_custom_ops_refuse_a_missing_out():
    layer, x, logits, w13, w2 = _moe()
    with pytest.raises(ValueError, match="out must be a preallocated tensor: torch.ops.meld.moe writes its result"):
        torch.ops.meld.moe(x, logits, w13, w2, None, None, None, layer.handle)
    attn, q, kv, _ = _attention()
    with pytest.raises(ValueError, match="out must be a preallocated tensor: torch.ops.meld.decode_attention"):
        torch.ops.meld.decode_attention(q, kv, None, None, attn.handle)
    with pytest.raises(ValueError, match="out must be a preallocated tensor"):
        torch.ops.meld.decode_attention(q, kv, None, torch.empty(3, HQ), attn.handle)
    with FakeTensorMode() as mode:
        fx, fl, f13, f2 = (mode.from_tensor(t) for t in (x, logits, w13, w2))
        with pytest.raises(ValueError, match="out must be a preallocated tensor: torch.ops.meld.moe"):
            torch.ops.meld.moe(fx, fl, f13, f2, None, None, None, layer.handle)


# =====================================================================================================
# 5. fused_moe's capacity and its arguments
# =====================================================================================================

def test_fused_moe_capacity_stays_within_the_layer_limit():
    _, _, _, w13, w2 = _moe()
    x = torch.zeros(40000, H, dtype=BF16)
    # the layer is built (capacity capped at 65535, not 65536); the call then names the logits' bad shape
    with pytest.raises(ValueError, match=r"router_logits must have shape \(40000, 8\)"):
        meld.fused_moe(x, w13, w2, torch.zeros(1, E), top_k=8)
    layer = moe_module._cached(H, I, E, 8, torch.device("cpu"), True, 65535)
    assert layer.max_num_tokens == 65535 == meld.MoE(H, I, E, 8, device="cpu", max_num_tokens=65535).max_num_tokens
    with pytest.raises(ValueError, match="x has 70000 tokens: fused_moe with top_k=8 serves at most 65535"):
        meld.fused_moe(torch.zeros(70000, H, dtype=BF16), w13, w2, None, top_k=8)


@pytest.mark.parametrize("kw,match", [
    (dict(top_k=[2]), r"top_k must be a positive int, got \[2\]"),      # was: unhashable type: 'list'
    (dict(top_k=0), "top_k must be a positive int, got 0"),
    (dict(top_k=True), "top_k must be a positive int, got True"),
    (dict(top_k=9), r"fused_moe: w13 of shape \(8, 128, 64\) .*top_k=9: top_k must be in 1..num_experts=8"),
    (dict(renormalize=[1]), r"renormalize must be a bool, got \[1\]"),
])
def test_fused_moe_validates_before_the_cache(kw, match):
    _, x, logits, w13, w2 = _moe()
    args = {**dict(top_k=K, renormalize=True), **kw}
    with pytest.raises(ValueError, match=match):
        meld.fused_moe(x, w13, w2, logits, args["top_k"], args["renormalize"])


def test_fused_moe_errors_name_w13_for_the_layer_terms():
    w13 = torch.zeros(E, 2 * I, 100, dtype=BF16)
    with pytest.raises(ValueError, match=r"fused_moe: w13 of shape \(8, 128, 100\).*hidden_size must be a multiple "
                                         "of 8"):
        meld.fused_moe(torch.zeros(2, 100, dtype=BF16), w13, torch.zeros(E, 100, I, dtype=BF16),
                       torch.zeros(2, E), K)


# =====================================================================================================
# 6. what the GPU refuses, the CPU refuses too
# =====================================================================================================

@pytest.mark.parametrize("hidden,inter", [(64, 64 * 2 ** 18), (128 * 2 ** 18, 64)])
def test_cpu_moe_refuses_shapes_the_gpu_kernel_cannot_serve(hidden, inter):
    """More tiles than a task table's int32 indices reach (meld/ir/work_table.py: MOE_TILE.max_entries)."""
    with pytest.raises(ValueError, match=f"max_num_tokens=8192, hidden_size={hidden}, intermediate_size={inter}: "
                                         r"up to \d+ row blocks x \d+ column blocks = \d+ tiles do not fit a task table"):
        meld.MoE(hidden, inter, E, K, device="cpu")
    meld.MoE(64, 64 * 2 ** 16, E, K, device="cpu")   # fits


def test_cpu_mla_refuses_grids_of_more_than_one_cta_per_sm():
    with pytest.raises(ValueError, match="the MLA kernel runs one CTA per SM"):
        meld.DecodeMLA(64, 64, BF16, "cpu", sm_scale=0.1, topology=Topology(24, {1: 48}))
    meld.DecodeMLA(64, 64, BF16, "cpu", sm_scale=0.1, topology=Topology(24))
