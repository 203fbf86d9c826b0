"""K and V in separate tensors (issue 42, item 1): `DecodeAttention.run(q, (k_cache, v_cache))`, the custom op's
v_cache and the FlashInfer wrapper's tuple form read K and V through two addresses and one set of strides, in
place, whatever allocations or views hold them; one cache [num_pages, 2, ...] is the case k = [:, 0], v = [:, 1].

CPU: each form against float64 and bit for bit against the same values in one cache, through the operator,
the op (opcheck, torch.compile) and the wrapper; the kernel's row arithmetic (and the TMA maps' geometry)
checked element by element against the tensors' own addresses; bad caches named with their values, leaving
the operator as it was. GPU (`gpu`): the same forms on the kernel (cp.async and TMA rings), bit for bit
against the one-cache run, no copy made, SGLang-style per-layer buffers replayed from a CUDA graph."""
import dataclasses
import math

import pytest
import torch

import meld
from meld.codegen import DecodeKernelConfig
from meld.compat.flashinfer import BatchDecodeWithPagedKVCacheWrapper
from meld.ops import torch_ops
from meld.runtime.reference import attention_reference
from meld.scheduler import Topology
from meld.workloads import paged

BF16 = torch.bfloat16
LENS = [37, 0, 250, 1, 1003, 115]   # no length a multiple of the 16-token tile or of the page
FORMS = ["halves", "two-allocations", "layer-views", "other-layout-views", "offsets"]


def _layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A K or V cache given NHD [pages, page_size, Hkv, D], contiguous in `layout`."""
    return t if layout == "NHD" else t.transpose(1, 2).contiguous()


def _caches(form: str, layout: str, num_pages: int, P: int, Hkv: int, D: int, device="cpu"):
    """(what run() takes in `form`, the same K and V in one contiguous cache, K and V NHD for the reference):
    fresh random values (never zeros).
      halves: (kv[:, 0], kv[:, 1]) of one cache [num_pages, 2, ...];
      two-allocations: two contiguous tensors;
      layer-views: this layer's slices of K and V buffers that interleave 3 layers per page (page stride 3 pages);
      other-layout-views: the layout asked for as a transposed view of memory in the other layout;
      offsets: one flat allocation holding V, then K, at 16-byte (not head_dim) aligned offsets."""
    k, v = (torch.randn(num_pages, P, Hkv, D, device=device).to(BF16) for _ in range(2))
    lk, lv = _layout(k, layout), _layout(v, layout)
    one = torch.stack([lk, lv], dim=1)
    if form == "halves":
        parts = (one[:, 0], one[:, 1])
    elif form == "two-allocations":
        parts = (lk.clone(), lv.clone())
    elif form == "layer-views":
        bufs = [torch.randn(num_pages, 3, *lk.shape[1:], device=device).to(BF16) for _ in range(2)]
        bufs[0][:, 1], bufs[1][:, 2] = lk, lv
        parts = (bufs[0][:, 1], bufs[1][:, 2])
    elif form == "other-layout-views":
        other = "HND" if layout == "NHD" else "NHD"
        parts = tuple(_layout(t, other).transpose(1, 2) for t in (k, v))
    else:
        n = k.numel()
        flat = torch.randn(2 * n + 64, device=device).to(BF16)
        v_at, k_at = 24, 24 + n + 40          # elements: 48 and 48 + 2 n + 80 bytes in
        flat[v_at:v_at + n], flat[k_at:k_at + n] = lv.flatten(), lk.flatten()
        parts = (flat[k_at:k_at + n].view(lk.shape), flat[v_at:v_at + n].view(lv.shape))
    assert all(torch.equal(p, t) for p, t in zip(parts, (lk, lv)))
    return parts, one, (k, v)


def _planned(layout="NHD", P=16, lens=LENS, Hq=8, Hkv=2, D=64, **kw):
    pb = paged(lens, P)
    attn = meld.DecodeAttention(Hq, Hkv, D, P, BF16, "cpu", kv_layout=layout, topology=Topology(24, {1: 48}), **kw)
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    return attn, pb, torch.randn(len(lens), Hq, D).to(BF16)


def _close(out, lse, q, k, v, pb, device="cpu"):
    ref, ref_lse = attention_reference(q, torch.stack([k, v], dim=1), *(t.to(device) for t in (
        pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)))
    assert not out.isnan().any()
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse.double() - ref_lse)[finite].abs().max().item() < 2e-3


# --- the operator --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("layout,P", [("NHD", 16), ("HND", 16), ("NHD", 5), ("HND", 7)])
def test_separate_caches_match_float64_and_one_cache(form, layout, P):
    attn, pb, q = _planned(layout, P)
    parts, one, (k, v) = _caches(form, layout, pb.num_pages, P, 2, 64)
    out, lse = attn.run(q, parts, return_lse=True)
    _close(out, lse, q, k, v, pb)
    want, want_lse = attn.run(q, one, return_lse=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse), "the same K and V read from elsewhere"
    assert (attn.schedule.items()["slot"] >= 0).any(), "the test must exercise split units and merges"


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_one_cache_as_a_strided_view(layout):
    """One cache [num_pages, 2, ...] need not be contiguous either: pages of a larger buffer, and a padded
    K/V stride (V 16 bytes past the end of K)."""
    attn, pb, q = _planned(layout)
    _, one, (k, v) = _caches("halves", layout, pb.num_pages, 16, 2, 64)
    want = attn.run(q, one)
    every_other = torch.stack([one, torch.randn_like(one)], dim=1).flatten(0, 1)[::2]
    assert not every_other.is_contiguous() and torch.equal(attn.run(q, every_other), want)
    n, half = pb.num_pages, one[0, 0].numel()
    flat = torch.randn(n * (2 * half + 64)).to(BF16)
    padded = flat.as_strided(one.shape, (2 * half + 64, half + 8, *one.stride()[2:]))
    padded.copy_(one)
    assert torch.equal(attn.run(q, padded), want)


@pytest.mark.parametrize("form", ["combined", *FORMS])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_the_kernels_row_arithmetic_reaches_each_element(form, layout, monkeypatch):
    """What run() hands the kernel, checked element by element without a GPU: K's and V's own addresses (no
    copy) and row strides such that k + (page * page_stride + token * token_stride + head * head_stride) * D
    is the address of element [page, token, head, 0] of K (and from v, of V); and the TMA maps' dims and
    strides, at the kernel's coordinates (channel, token or head as kv_hnd orders them, page), the same."""
    from meld.runtime import tensor_map

    P, Hkv, D = 16, 3, 64
    attn, pb, _ = _planned(layout, P, Hq=6, Hkv=Hkv, D=D)
    parts, one, _ = _caches("halves" if form == "combined" else form, layout, pb.num_pages, P, Hkv, D)
    arg = one if form == "combined" else parts
    kv = attn._check_kv_cache(arg, attn._planned)
    tensors = one.unbind(1) if form == "combined" else parts
    nhd = [t if layout == "NHD" else t.transpose(1, 2) for t in tensors]   # [page, token, head, D] views
    page, token, head = (torch.arange(n).view(*[-1 if i == d else 1 for i in range(3)])
                         for d, n in enumerate(nhd[0].shape[:3]))
    rows = page * kv.rows[0] + token * kv.rows[1] + head * kv.rows[2]
    maps = []
    monkeypatch.setattr(tensor_map, "_encode", lambda t, dims, strides, box: maps.append((t, dims, strides, box)))
    tensor_map.kv_tensor_maps(*kv.tensors.values(), layout=layout)
    for base, t, (m, dims, strides, box) in zip((kv.k, kv.v), nhd, maps):
        es = t.element_size()
        want = t.data_ptr() + es * (page * t.stride(0) + token * t.stride(1) + head * t.stride(2))
        assert torch.equal(base + rows * D * es, want)
        assert m.data_ptr() == t.data_ptr() and dims[0] == D and box == ([64, 1, 16, 1] if layout == "NHD" else
                                                                            [64, 16, 1, 1])
        c1, c2 = (token, head) if layout == "HND" else (head, token)
        assert torch.equal(m.data_ptr() + c1 * strides[0] + c2 * strides[1] + page * strides[2], want)
        assert all(s % 16 == 0 for s in strides)


# --- the op and torch.compile ---------------------------------------------------------------------------------
@pytest.mark.parametrize("layout,with_lse,grad", [("NHD", True, False), ("HND", False, False), ("NHD", True, True)])
def test_opcheck_with_v_cache(layout, with_lse, grad):
    attn, pb, q = _planned(layout, Hq=8, Hkv=2, D=64)
    (k, v), _, _ = _caches("two-allocations", layout, pb.num_pages, 16, 2, 64)
    lse = torch.empty(len(LENS), 8) if with_lse else None
    torch.library.opcheck(torch.ops.meld.decode_attention.default,
                          (q.requires_grad_(grad), k, torch.empty_like(q), lse, attn.handle, v))


def test_op_and_compiled_model_take_the_tuple():
    attn, pb, q = _planned()
    (k, v), one, _ = _caches("two-allocations", "NHD", pb.num_pages, 16, 2, 64)
    want, want_lse = attn.run(q, one, return_lse=True)
    out, lse = torch_ops.decode_attention(attn, q, (k, v), return_lse=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    buf = torch.empty_like(q)
    torch.ops.meld.decode_attention(q, k, buf, None, attn.handle, v_cache=v)
    assert torch.equal(buf, want)
    step = torch.compile(lambda q, k, v: attn.run(q, (k, v)) * 2, fullgraph=True, backend="aot_eager")
    assert torch.equal(step(q, k, v), want * 2)
    with pytest.raises(ValueError, match=r"kv_cache as a tuple must be \(k_cache, v_cache\), got 3 items"):
        torch_ops.decode_attention(attn, q, (k, v, v))


def test_fake_implementation_checks_k_and_v():
    from torch._subclasses.fake_tensor import FakeTensorMode

    attn, pb, q = _planned()
    (k, v), _, _ = _caches("two-allocations", "NHD", pb.num_pages, 16, 2, 64)
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        q, k, v = (mode.from_tensor(t) for t in (q, k, v))
        torch.ops.meld.decode_attention(q, k, torch.empty_like(q), None, attn.handle, v)
        with pytest.raises(ValueError, match=r"v_cache must have shape \('\*', 16, 2, 64\) .*got \(\d+, 16, 2, 32\)"):
            torch.ops.meld.decode_attention(q, k, torch.empty_like(q), None, attn.handle, v[..., :32])
        with pytest.raises(ValueError, match=rf"k_cache has {pb.num_pages} pages but v_cache {pb.num_pages - 1}"):
            torch.ops.meld.decode_attention(q, k, torch.empty_like(q), None, attn.handle, v[1:])
        with pytest.raises(ValueError, match="v_cache must have dtype torch.bfloat16, got torch.float16"):
            torch.ops.meld.decode_attention(q, k, torch.empty_like(q), None, attn.handle, v.half())


# --- the FlashInfer wrapper -----------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("P", [16, 1])
def test_wrapper_takes_separate_allocations(layout, P):
    """paged_kv_cache=(k_cache, v_cache) in two allocations (with page_size 1, FlashInfer's 3-D parts): meld's
    own result for the same K and V, and float64's."""
    pb = paged(LENS, P)
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(16, dtype=torch.uint8), layout)
    w.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len, 8, 2, 64, P, q_data_type=BF16)
    (k, v), one, nhd = _caches("two-allocations", layout, pb.num_pages, P, 2, 64)
    q = torch.randn(len(LENS), 8, 64).to(BF16)
    out, lse = w.run(q, (k.squeeze(-3 if layout == "NHD" else -2), v.squeeze(-3 if layout == "NHD" else -2))
                     if P == 1 else (k, v), return_lse=True)
    assert torch.equal(out, w.run(q, one))
    _close(out, lse / math.log2(math.e), q, *nhd, pb)


# --- bad caches ----------------------------------------------------------------------------------------------
def _bad(case, kv, k, v):
    n = kv.shape[0]
    if case == "padded-rows":
        return tuple(torch.randn(n, 16, 2, 72).to(BF16)[..., :64] for _ in range(2))
    if case == "misaligned":
        flat = torch.randn(k.numel() + 8).to(BF16)
        return flat[1:1 + k.numel()].view(k.shape), v
    if case == "misaligned-v-half":   # one cache whose V half starts 8 bytes off a 16-byte boundary
        half = kv[0, 0].numel()
        return torch.randn(n * (2 * half + 64)).to(BF16).as_strided(kv.shape, (2 * half + 64, half + 4,
                                                                              *kv.stride()[2:]))
    if case == "too-many-tokens":   # 2**31 + 16 tokens (no memory: every page is the same one)
        return torch.randn(1, 2, 16, 2, 64).to(BF16).expand(2 ** 27 + 1, -1, -1, -1, -1)
    return {
        "three": (k, v, v), "list": [k, v], "one-part": (k,),
        "v-dtype": (k, v.half()), "v-device": (k, v.to("meta")), "v-shape": (k, v[:, :, :1]),
        "v-hnd": (k, v.transpose(1, 2)), "pages": (k, v[:-1]), "too-few-pages": (k[:2], v[:2]),
        "strides": (k, kv[:, 1]), "k-last-dim": (k.transpose(2, 3).contiguous().transpose(2, 3), v),
        "v-last-dim": (k, v.transpose(2, 3).contiguous().transpose(2, 3)), "overlap": (k, v),
    }[case]


BAD = {
    "three": r"kv_cache as a tuple must be \(k_cache, v_cache\), got 3 items",
    "list": r"kv_cache must be a torch\.Tensor or a \(k_cache, v_cache\) tuple, got list",
    "one-part": r"kv_cache as a tuple must be \(k_cache, v_cache\), got 1 items",
    "v-dtype": r"v_cache must have dtype torch\.bfloat16, got torch\.float16",
    "v-device": r"v_cache must be on cpu, got meta",
    "v-shape": r"v_cache must have shape \('\*', 16, 2, 64\) \(num_pages, page_size, num_kv_heads, head_dim: "
               r"kv_layout='NHD'\), got \(\d+, 16, 1, 64\)",
    "v-hnd": r"v_cache must have shape \('\*', 16, 2, 64\) .*got \(\d+, 2, 16, 64\)",
    "pages": r"k_cache has (\d+) pages but v_cache (\d+): K and V must have one page count",
    "too-few-pages": r"kv_indices of the last plan\(\) reference page \d+, but k_cache has only 2 pages",
    "strides": r"k_cache and v_cache must have the same strides \(the kernel reads both through one set, as "
               r"FlashInfer's\), got \(2048, 128, 64, 1\) and \(4096, 128, 64, 1\)",
    "k-last-dim": r"k_cache must have a contiguous last dim \(head_dim\), got strides \(2048, 128, 1, 2\)",
    "v-last-dim": r"v_cache must have a contiguous last dim \(head_dim\), got strides \(2048, 128, 1, 2\)",
    "padded-rows": r"k_cache must have page, token and head strides that are multiples of head_dim=64 \(the kernel "
                   r"addresses rows of head_dim elements\), got strides \(2304, 144, 72, 1\)",
    "misaligned": r"k_cache must start on a 16-byte boundary \(the kernel's copies read 16-byte chunks\), got "
                  r"address 0x[0-9a-f]*[2468ace]\b",
    "misaligned-v-half": r"kv_cache\[:, 1\] \(V\) must start on a 16-byte boundary .*got address 0x[0-9a-f]*8\b",
    "too-many-tokens": r"kv_cache \(134217729 pages of 16 tokens, strides \(0, 2048, 128, 64, 1\)\) reaches row 31 "
                       r"of head_dim elements and token 2147483663: the kernel indexes both in int32",
    "overlap": r"out \(strides .*\) shares memory with v_cache",
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_caches_are_named_and_change_nothing(case):
    attn, pb, q = _planned()
    (k, v), kv, _ = _caches("two-allocations", "NHD", pb.num_pages, 16, 2, 64)
    before = attn.run(q, (k, v), return_lse=True)
    out = v.view(-1)[:q.numel()].view(q.shape) if case == "overlap" else torch.zeros_like(q)
    snapshot = out.clone()
    with pytest.raises(ValueError, match=BAD[case]):
        attn.run(q, _bad(case, kv, k, v), out=out)
    assert torch.equal(out, snapshot), "a run() that raises must not write out="
    after = attn.run(q, (k, v), return_lse=True)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])


# --- GPU --------------------------------------------------------------------------------------------------------
def _tma(**kw):
    return dataclasses.replace(DecodeKernelConfig.default("bfloat16", 128), tma=True, **kw)


def _gpu_case(form, layout, P=16, lens=None, **op):
    from meld.workloads import lengths

    lens = lens or [n + 3 for n in lengths("ragged", 9)] + [0, 5000]
    pb = paged(lens, P)
    attn = meld.DecodeAttention(32, 8, 128, P, BF16, "cuda", kv_layout=layout, **op)
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    parts, one, nhd = _caches(form, layout, pb.num_pages, P, 8, 128, "cuda")
    return attn, pb, parts, one, nhd, torch.randn(len(lens), 32, 128, device="cuda").to(BF16)


@pytest.mark.gpu
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("tma", [False, True], ids=["cp.async", "tma"])
def test_gpu_separate_caches_match_one_cache_with_no_copy(form, layout, tma):
    """The kernel on K and V in each form: bit for bit the one-cache run (the same schedule over the same
    values), close to float64, reading the tensors where they are: the kernel's parameters are their own
    addresses and run() allocates nothing (out and lse given)."""
    attn, pb, parts, one, nhd, q = _gpu_case(form, layout, kernel_config=_tma() if tma else None)
    out = torch.full_like(q, math.nan)
    lse = torch.full(q.shape[:2], math.nan, device="cuda")
    want, want_lse = attn.run(q, one, return_lse=True)
    torch.cuda.synchronize()
    allocations = torch.cuda.memory_stats()["allocation.all.allocated"]
    attn.run(q, parts, out=out, lse=lse)
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == allocations, "run() allocated (a copy?)"
    p = attn._buf.launcher.params[0]
    assert (p.k, p.v) == (parts[0].data_ptr(), parts[1].data_ptr())
    torch.cuda.synchronize()
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    _close(out, lse, q, *nhd, pb, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [False, True], ids=["cp.async", "tma"])
def test_gpu_one_cache_as_strided_views(tma):
    """One cache whose pages are every other page of a buffer, and one whose V half sits 16 bytes past K's
    end (the page stride padded to match): both give the contiguous cache's output bit for bit."""
    attn, pb, _, one, nhd, q = _gpu_case("halves", "NHD", kernel_config=_tma() if tma else None)
    want = attn.run(q, one)
    every_other = torch.stack([one, torch.randn_like(one)], dim=1).flatten(0, 1)[::2]
    assert torch.equal(attn.run(q, every_other), want)
    n, half = one.shape[0], one[0, 0].numel()
    padded = torch.empty(n * (2 * half + 128), device="cuda", dtype=BF16).as_strided(
        one.shape, (2 * half + 128, half + 8, *one.stride()[2:]))
    padded.copy_(one)
    assert torch.equal(attn.run(q, padded), want)


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [False, True], ids=["cp.async", "tma"])
def test_gpu_per_layer_buffers_in_one_graph(tma):
    """SGLang's layout: per layer a K buffer and a V buffer of token rows [pages * page_size, Hkv, D] (viewed as
    pages); plan once per batch, every layer's run() captured in one CUDA graph, replayed after re-plans."""
    from meld.workloads import lengths

    Hq, Hkv, D, P, B, layers = 32, 8, 128, 16, 16, 3
    plans = [paged(lengths("skewed", B), P), paged([n + 5 for n in lengths("ragged", B)], P)]
    num_pages = max(p.num_pages for p in plans)
    k_buf = [torch.randn(num_pages * P, Hkv, D, device="cuda").to(BF16) for _ in range(layers)]
    v_buf = [torch.randn(num_pages * P, Hkv, D, device="cuda").to(BF16) for _ in range(layers)]
    caches = [(k.view(num_pages, P, Hkv, D), v.view(num_pages, P, Hkv, D)) for k, v in zip(k_buf, v_buf)]
    qs = [torch.randn(B, Hq, D, device="cuda").to(BF16) for _ in range(layers)]
    outs = [torch.empty(B, Hq, D, dtype=BF16, device="cuda") for _ in range(layers)]
    attn = meld.DecodeAttention(Hq, Hkv, D, P, BF16, "cuda", max_batch_size=B,
                                max_num_pages=max(p.kv_indices.numel() for p in plans),
                                kernel_config=_tma() if tma else None)
    attn.plan(plans[0].kv_indptr, plans[0].kv_indices, plans[0].kv_last_page_len)
    from meld.runtime.cuda_graphs import capture

    def step():
        for q, kv, out in zip(qs, caches, outs):
            attn.run(q, kv, out=out)

    g, _ = capture(step)
    for p in plans:
        attn.plan(p.kv_indptr, p.kv_indices, p.kv_last_page_len)
        for out in outs:
            out.fill_(math.nan)
        g.replay()
        torch.cuda.synchronize()
        for q, (k, v), out in zip(qs, caches, outs):
            assert torch.equal(out, attn.run(q, torch.stack([k, v], dim=1)))
            ref, _ = attention_reference(q, torch.stack([k, v], dim=1), *(t.cuda() for t in (
                p.kv_indptr, p.kv_indices, p.kv_last_page_len)))
            assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.gpu
def test_gpu_opcheck_with_v_cache():
    attn, pb, (k, v), _, _, q = _gpu_case("two-allocations", "HND", max_batch_size=16, max_num_pages=4096)
    torch.library.opcheck(torch.ops.meld.decode_attention.default,
                          (q, k, torch.empty_like(q), torch.empty(q.shape[:2], device="cuda"), attn.handle, v))
