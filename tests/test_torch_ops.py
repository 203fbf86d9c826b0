"""meld's operators as torch custom ops (meld.ops.torch_ops): opcheck of each op, torch.compile(fullgraph=True)
of a small decoder block calling meld equal to eager across re-plans, the fake implementations' checks, the
handle registry's errors and weak references. CPU-executor tests, and their GPU variants."""
import copy
import gc
import os
import shutil
import weakref

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._subclasses.fake_tensor import FakeTensorMode

import meld
from meld.ops import torch_ops
from meld.workloads import paged

BF16 = torch.bfloat16
HQ, HKV, D, P = 8, 2, 128, 16           # attention; its output row o[:, 0] is the MoE's input: H = D
H, I, E, K = D, 64, 4, 2                 # MoE
BATCHES = ([5, 40, 17], [3, 100], [1, 0, 2, 33])   # one compiled model across these plans
POOL = 80                                           # KV pages


def _has_cxx() -> bool:
    return any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "g++", "clang++"))


BACKENDS = ["aot_eager", pytest.param("inductor", marks=pytest.mark.skipif(
    not _has_cxx(), reason="Inductor on the CPU needs a C++ compiler (none found)"))]


def attention(lens, device="cpu", kv_layout="NHD", **kw):
    """A planned DecodeAttention, q, and a KV cache in `kv_layout`."""
    attn = meld.DecodeAttention(HQ, HKV, D, P, BF16, device, kv_layout=kv_layout, **kw)
    pb = paged(lens, P)
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    page = (P, HKV) if kv_layout == "NHD" else (HKV, P)
    kv = torch.randn(pb.num_pages, 2, *page, D).to(BF16).to(device)
    q = torch.randn(len(lens), HQ, D).to(BF16).to(device)
    return attn, q, kv


def moe_weights(device="cpu"):
    g = torch.Generator().manual_seed(1)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(BF16).to(device)
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(BF16).to(device)
    return w13, w2


def moe_inputs(T, device="cpu"):
    layer = meld.MoE(H, I, E, K, BF16, device, max_num_tokens=64)
    x = torch.randn(T, H).to(BF16).to(device)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).to(device)
    return layer, x, torch.randn(T, E, device=device), ids, torch.rand(T, K, device=device)


class Block(torch.nn.Module):
    """A decoder step in miniature: a q projection, meld attention, a router and meld's MoE."""

    def __init__(self, device="cpu", **attn_kw):
        super().__init__()
        self.attn = meld.DecodeAttention(HQ, HKV, D, P, BF16, device, **attn_kw)
        self.moe = meld.MoE(H, I, E, K, BF16, device, max_num_tokens=64)
        self.q_proj = torch.nn.Linear(H, HQ * D, bias=False, dtype=BF16, device=device)
        self.router = torch.nn.Linear(H, E, bias=False, dtype=BF16, device=device)
        w13, w2 = moe_weights(device)
        self.register_buffer("w13", w13)
        self.register_buffer("w2", w2)

    def forward(self, x, kv_cache):
        q = self.q_proj(x).view(-1, HQ, D)
        o, lse = self.attn.run(q, kv_cache, return_lse=True)
        h = o[:, 0]
        return self.moe(h, self.router(h), self.w13, self.w2), o, lse


def step_inputs(block, lens, device="cpu"):
    """Plan `lens` (outside any compiled region, as an engine does) over a pool of POOL pages (one size for
    every batch, as an engine's KV cache) and make the step's inputs."""
    pb = paged(lens, P, spare_pages=POOL - sum(-(-n // P) for n in lens))
    block.attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    return torch.randn(len(lens), H).to(BF16).to(device), torch.randn(POOL, 2, P, HKV, D).to(BF16).to(device)


def check_compiled_matches_eager(device, backend, batches=BATCHES, **compile_kw):
    block = Block(device, **({"max_batch_size": 8, "max_num_pages": POOL} if device == "cuda" else {}))
    counter = None if compile_kw else CompileCounterWithBackend(backend)   # it takes no `mode`
    step = torch.compile(block, fullgraph=True, backend=counter or backend, **compile_kw)
    with torch.no_grad():
        for lens in batches:
            x, kv = step_inputs(block, lens, device)
            for _ in range(2 if compile_kw else 1):    # CUDA graphs: record, then replay
                got = step(x, kv)
            want = block(x, kv)
            for name, g, w in zip(("moe", "out", "lse"), got, want):
                assert torch.equal(g, w), f"{name} differs from eager for lens={lens}"
    if counter is not None:
        targets = {n.target for gm in counter.graphs for n in gm.graph.nodes}
        assert {torch.ops.meld.decode_attention.default, torch.ops.meld.moe.default} <= targets
        assert counter.frame_count <= 2     # the first batch size, then one graph dynamic in it


# --- CPU executor ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kv_layout,with_lse,grad", [("NHD", True, False), ("HND", False, False), ("NHD", True, True)])
def test_opcheck_decode_attention(kv_layout, with_lse, grad):
    attn, q, kv = attention([5, 40, 0, 17], kv_layout=kv_layout)
    lse = torch.empty(4, HQ) if with_lse else None
    torch.library.opcheck(torch.ops.meld.decode_attention.default,
                          (q.requires_grad_(grad), kv, torch.empty_like(q), lse, attn.handle))


@pytest.mark.parametrize("routing, packed", [("logits", False), ("topk", False), ("logits", True)])
def test_opcheck_moe(routing, packed):
    layer, x, logits, ids, w = moe_inputs(9)
    w13, w2 = moe_weights()
    if packed:   # meld.pack_moe_weights's layout goes through the op (and its fake) as plain tensors
        w13, w2 = meld.pack_moe_weights(w13, w2)
    route = (logits, None, None) if routing == "logits" else (None, w, ids)
    torch.library.opcheck(torch.ops.meld.moe.default, (x, route[0], w13, w2, *route[1:], torch.empty_like(x),
                                                       layer.handle))


def test_callers_match_direct_calls():
    attn, q, kv = attention([7, 0, 300])
    out, lse = torch_ops.decode_attention(attn, q, kv, return_lse=True)
    want, want_lse = attn.run(q, kv, return_lse=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    buf = torch.empty_like(q)
    assert torch_ops.decode_attention(attn, q, kv, out=buf) is buf and torch.equal(buf, want)
    layer, x, logits, ids, w = moe_inputs(6)
    w13, w2 = moe_weights()
    assert torch.equal(torch_ops.moe(layer, x, logits, w13, w2), layer(x, logits, w13, w2))
    assert torch.equal(torch_ops.moe(layer, x, None, w13, w2, topk_weights=w, topk_ids=ids),
                       layer(x, None, w13, w2, topk_weights=w, topk_ids=ids))


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_block_matches_eager(backend):
    check_compiled_matches_eager("cpu", backend)


def test_unknown_and_wrong_handles_raise():
    attn, q, kv = attention([5, 9])
    layer = meld.MoE(H, I, E, K, BF16, "cpu")
    with pytest.raises(ValueError, match=r"handle=123456789 names no live meld operator"):
        torch.ops.meld.decode_attention(q, kv, torch.empty_like(q), None, 123456789)
    with pytest.raises(ValueError, match=rf"handle={layer.handle} names a MoE, not a DecodeAttention"):
        torch.ops.meld.decode_attention(q, kv, torch.empty_like(q), None, layer.handle)
    x = torch.randn(2, H).to(BF16)
    w13, w2 = moe_weights()
    with pytest.raises(ValueError, match=rf"handle={attn.handle} names a DecodeAttention, not a MoE"):
        torch.ops.meld.moe(x, torch.randn(2, E), w13, w2, None, None, torch.empty_like(x), attn.handle)


class _Sub(torch.Tensor):
    """A tensor subclass that changes nothing: the op's autograd kernel redispatches for it."""


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_eager_kernel_and_redispatch_agree(device):
    """The ops' autograd kernel calls the kernel itself when nothing requires grad and the first argument is a plain
    tensor (the eager call), and otherwise redispatches below autograd: both paths write the same outputs (poisoned
    before) and raise the same named errors (a handle of another kind, out=None)."""
    attn, q, kv = attention([7, 0, 300], device, **({"max_batch_size": 8, "max_num_pages": 64} if device == "cuda"
                                                    else {}))
    layer, x, logits, _, _ = moe_inputs(5, device)
    w13, w2 = moe_weights(device)

    def decode(q, handle=attn.handle, poisoned=True):
        out = torch.full(q.shape, float("nan"), dtype=BF16, device=device) if poisoned else None
        lse = torch.full(q.shape[:2], float("nan"), device=device)
        torch.ops.meld.decode_attention(q, kv, out, lse, handle)
        return out.detach(), lse.detach()

    def moe(x, handle=layer.handle, poisoned=True):
        out = torch.full(x.shape, float("nan"), dtype=BF16, device=device) if poisoned else None
        torch.ops.meld.moe(x, logits, w13, w2, None, None, out, handle)
        return out.detach()

    want, want_moe = decode(q), moe(x)
    assert not want[0].isnan().any() and not want_moe.isnan().any()
    redispatched = ((q.clone().requires_grad_(), x.clone().requires_grad_()),
                    (q.as_subclass(_Sub), x.as_subclass(_Sub)))
    for slow_q, slow_x in redispatched:
        got = decode(slow_q)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert torch.equal(moe(slow_x), want_moe)
        for args in ((q,), (slow_q,)):
            with pytest.raises(ValueError, match=rf"handle={layer.handle} names a MoE, not a DecodeAttention"):
                decode(*args, handle=layer.handle)
            with pytest.raises(ValueError, match=r"out must be a preallocated tensor: torch.ops.meld.decode_attention"):
                decode(*args, poisoned=False)
        for args in ((x,), (slow_x,)):
            with pytest.raises(ValueError, match=rf"handle={attn.handle} names a DecodeAttention, not a MoE"):
                moe(*args, handle=attn.handle)
            with pytest.raises(ValueError, match=r"out must be a preallocated tensor: torch.ops.meld.moe"):
                moe(*args, poisoned=False)


def test_registering_keeps_no_operator_alive():
    attn = meld.DecodeAttention(HQ, HKV, D, P, BF16, "cpu")
    layer = meld.MoE(H, I, E, K, BF16, "cpu")
    handles, refs = (attn.handle, layer.handle), (weakref.ref(attn), weakref.ref(layer))
    assert handles[0] != handles[1]
    del attn, layer
    gc.collect()
    assert all(r() is None for r in refs)
    for h in handles:
        with pytest.raises(ValueError, match=rf"handle={h} names no live meld operator"):
            torch_ops.lookup(h, meld.DecodeAttention)


def test_a_copy_gets_its_own_handle():
    layer, x, logits, _, _ = moe_inputs(3)
    w13, w2 = moe_weights()
    twin = copy.deepcopy(layer)
    assert twin.handle != layer.handle and torch_ops.lookup(twin.handle, meld.MoE) is twin
    assert torch.equal(torch_ops.moe(twin, x, logits, w13, w2), layer(x, logits, w13, w2))


def test_fake_implementations_check_shapes():
    attn, q, kv = attention([5, 9])
    layer, x, logits, _, _ = moe_inputs(3)
    w13, w2 = moe_weights()
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        q, kv, x, logits, w13, w2 = (mode.from_tensor(t) for t in (q, kv, x, logits, w13, w2))
        torch.ops.meld.decode_attention(q, kv, torch.empty_like(q), torch.empty(2, HQ), attn.handle)
        with pytest.raises(ValueError, match=r"out must have shape \(2, 8, 128\)"):
            torch.ops.meld.decode_attention(q, kv, torch.empty(3, HQ, D, dtype=BF16), None, attn.handle)
        with pytest.raises(ValueError, match=r"lse must have dtype torch.float32"):
            torch.ops.meld.decode_attention(q, kv, torch.empty_like(q), torch.empty(2, HQ, dtype=BF16), attn.handle)
        with pytest.raises(ValueError, match=r"kv_cache must have shape"):
            torch.ops.meld.decode_attention(q, kv.transpose(2, 3), torch.empty_like(q), None, attn.handle)
        torch.ops.meld.moe(x, logits, w13, w2, None, None, torch.empty_like(x), layer.handle)
        with pytest.raises(ValueError, match=r"router_logits must have shape \(3, 4\)"):
            torch.ops.meld.moe(x, logits[:2], w13, w2, None, None, torch.empty_like(x), layer.handle)
        with pytest.raises(ValueError, match=r"pass either router_logits or \(topk_weights, topk_ids\)"):
            torch.ops.meld.moe(x, None, w13, w2, None, None, torch.empty_like(x), layer.handle)


def test_callers_reject_bad_arguments():
    attn, q, kv = attention([5])
    with pytest.raises(ValueError, match="return_lse must be True or False"):
        torch_ops.decode_attention(attn, q, kv, return_lse=1)
    with pytest.raises(ValueError, match="q must be a torch.Tensor, got list"):
        torch_ops.decode_attention(attn, [1.0], kv)
    layer = meld.MoE(H, I, E, K, BF16, "cpu")
    with pytest.raises(ValueError, match="x must be a torch.Tensor, got NoneType"):
        torch_ops.moe(layer, None, None, *moe_weights())


# --- GPU ------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_opcheck():
    attn, q, kv = attention([5, 40, 0, 1700], "cuda", max_batch_size=8, max_num_pages=256)
    torch.library.opcheck(torch.ops.meld.decode_attention.default,
                          (q, kv, torch.empty_like(q), torch.empty(4, HQ, device="cuda"), attn.handle))
    layer, x, logits, ids, w = moe_inputs(9, "cuda")
    w13, w2 = moe_weights("cuda")
    for route in ((logits, None, None), (None, w, ids)):
        torch.library.opcheck(torch.ops.meld.moe.default, (x, route[0], w13, w2, *route[1:], torch.empty_like(x),
                                                           layer.handle))


@pytest.mark.gpu
@pytest.mark.cublas_output
def test_gpu_compiled_block_matches_eager():
    check_compiled_matches_eager("cuda", "inductor")


@pytest.mark.gpu
@pytest.mark.caching_allocator
@pytest.mark.cublas_output
def test_gpu_cuda_graph_replays_after_replans():
    """mode="reduce-overhead": one CUDA graph for the batch size, replayed after each plan()."""
    batches = ([5, 40, 17], [300, 1, 64], [0, 999, 2])
    check_compiled_matches_eager("cuda", "inductor", batches, mode="reduce-overhead")


# --- DecodeMLA ----------------------------------------------------------------------------------------------
def mla_inputs(lens, device="cpu", q_len=1):
    mla = meld.DecodeMLA(64, P, BF16, device, sm_scale=192 ** -0.5, q_len=q_len)
    pb = paged(lens, P)
    mla.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    g = torch.Generator().manual_seed(3)
    qn, qp = (torch.randn(len(lens) * q_len, 64, d, generator=g).to(BF16).to(device) for d in (512, 64))
    ckv, kpe = (torch.randn(pb.num_pages, P, d, generator=g).to(BF16).to(device) for d in (512, 64))
    return mla, qn, qp, ckv, kpe


@pytest.mark.parametrize("with_lse,grad", [(True, False), (False, False), (True, True)])
def test_opcheck_decode_mla(with_lse, grad):
    mla, qn, qp, ckv, kpe = mla_inputs([5, 40, 0, 17])
    lse = torch.empty(4, 64) if with_lse else None
    torch.library.opcheck(torch.ops.meld.decode_mla.default,
                          (qn.requires_grad_(grad), qp, ckv, kpe, torch.empty_like(qn), lse, mla.handle))


def test_decode_mla_op_with_q_len():
    """Multi-token decode through the op: q_len rows per request, opcheck and a compiled run equal to eager."""
    mla, qn, qp, ckv, kpe = mla_inputs([5, 40, 2, 17], q_len=2)
    torch.library.opcheck(torch.ops.meld.decode_mla.default,
                          (qn, qp, ckv, kpe, torch.empty_like(qn), torch.empty(8, 64), mla.handle))
    want, want_lse = mla.run(qn, qp, ckv, kpe, return_lse=True)
    step = torch.compile(lambda *a: mla.run(*a, return_lse=True), fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        got, got_lse = step(qn, qp, ckv, kpe)
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse) and got.shape == (8, 64, 512)


def test_decode_mla_compiles_to_one_op_and_matches_eager():
    mla, qn, qp, ckv, kpe = mla_inputs([7, 0, 70])
    out, lse = torch_ops.decode_mla(mla, qn, qp, ckv, kpe, return_lse=True)
    want, want_lse = mla.run(qn, qp, ckv, kpe, return_lse=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(lambda *a: mla.run(*a, return_lse=True), fullgraph=True, backend=counter)
    with torch.no_grad():
        got, got_lse = step(qn, qp, ckv, kpe)
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)
    assert torch.ops.meld.decode_mla.default in {n.target for gm in counter.graphs for n in gm.graph.nodes}
    with pytest.raises(ValueError, match="mla must be a meld.DecodeMLA"):
        torch_ops.decode_mla(object(), qn, qp, ckv, kpe)
    narrow, empty = kpe[:, :, :32].contiguous(), torch.empty_like(qn)
    with FakeTensorMode() as mode, pytest.raises(ValueError, match="kpe_cache must have shape"):
        f = mode.from_tensor
        torch.ops.meld.decode_mla(f(qn), f(qp), f(ckv), f(narrow), f(empty), None, mla.handle)


@pytest.mark.gpu
def test_gpu_decode_mla_compiles_to_one_op_and_matches_eager():
    """The MLA op on the GPU under torch.compile(fullgraph=True) with inductor: one frame, no graph break, equal to
    eager across re-plans (the op reads the operator's current plan through its handle)."""
    mla, qn, qp, ckv, kpe = mla_inputs([7, 0, 70], "cuda")   # 9 pages: the batches below fit them
    counter = CompileCounterWithBackend("inductor")
    step = torch.compile(lambda *a: mla.run(*a, return_lse=True), fullgraph=True, backend=counter)
    with torch.no_grad():
        for lens in ([7, 0, 70], [64, 3, 1], [0, 33, 90]):
            pb = paged(lens, P, spare_pages=ckv.shape[0] - sum(-(-n // P) for n in lens))
            mla.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
            got, want = step(qn, qp, ckv, kpe), mla.run(qn, qp, ckv, kpe, return_lse=True)
            torch.cuda.synchronize()
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"compiled differs for {lens}"
    assert counter.frame_count == 1
    assert torch.ops.meld.decode_mla.default in {n.target for gm in counter.graphs for n in gm.graph.nodes}
