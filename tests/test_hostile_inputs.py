"""Hostile inputs on the CPU path and the CLI (no GPU needed).

The rules these tests hold meld to (README, DecodeAttention's docstrings):
  * every bad input is a ValueError (or a TypeError where Python's conventions call for one) whose message
    names the argument and the offending value; never a hang, a silent wrong answer, a crash, or an
    exception from deep inside NumPy/torch;
  * a call that raises leaves the object as it was (a failed plan() changes nothing);
  * NaN/Inf in q, K or V gives NaN in out and lse for exactly the (request, q head) rows it reaches;
    an empty request gives zeros and lse = -inf;
  * every valid edge case matches an independent float64 reference (written here, not meld's own);
  * the CLI answers bad arguments with one line on stderr and exit status 2.
"""
import json
import math
from fractions import Fraction

import numpy as np
import pytest
import torch

import meld
from meld import cli
from meld.codegen import DecodeKernelConfig
from meld.runtime.profile import Trace
from meld.scheduler import DecodeCost, Topology
from tests.test_cli import _fails

SMALL = Topology(24, {1: 48})      # 48 CTAs: long requests split
pytestmark = pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
I32 = torch.int32


def i32(values):
    return torch.tensor(values, dtype=I32)


def _op(**kw):
    args = dict(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.bfloat16, device="cpu",
                topology=SMALL)
    args.update(kw)
    return meld.DecodeAttention(**args)


def _table(lens, P, spare=3, seed=0, shared=False):
    """FlashInfer's paged layout for `lens`, built here (not with meld.workloads): shuffled page indices;
    shared=True makes every request read the same pages."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // P) for n in lens]
    indptr = [0]
    for p in pages:
        indptr.append(indptr[-1] + p)
    nnz = indptr[-1]
    if shared:
        most = max(pages, default=0)
        own = torch.randperm(most + spare, generator=g)[:most]
        indices = torch.cat([own[:p] for p in pages]) if pages else torch.zeros(0, dtype=torch.int64)
        num_pages = most + spare
    else:
        num_pages = nnz + spare
        indices = torch.randperm(num_pages, generator=g)[:nnz]
    last = [n - (p - 1) * P if p else 0 for n, p in zip(lens, pages)]
    return i32(indptr), indices.to(I32), i32(last), num_pages


def _data(B, num_pages, Hq=8, Hkv=2, D=64, P=16, dtype=torch.bfloat16, layout="NHD", seed=1, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    shape = (num_pages, 2, P, Hkv, D) if layout == "NHD" else (num_pages, 2, Hkv, P, D)
    kv = (torch.randn(shape, generator=g) * scale).to(dtype)
    q = (torch.randn(B, Hq, D, generator=g) * scale).to(dtype)
    return q, kv


def reference(q, kv, indptr, indices, last, P, Hkv, sm_scale, layout="NHD"):
    """Plain float64 attention: softmax(q k^T scale) v per request and q head; q head h reads kv head
    h // (Hq / Hkv); an empty request gives zeros and lse = -inf."""
    B, Hq, D = q.shape
    G = Hq // Hkv
    kv64 = kv.double()
    if layout == "HND":
        kv64 = kv64.transpose(2, 3)                      # -> [pages, 2, P, Hkv, D]
    out = torch.zeros(B, Hq, D, dtype=torch.float64)
    lse = torch.full((B, Hq), -math.inf, dtype=torch.float64)
    ip, ll = indptr.tolist(), last.tolist()
    for b in range(B):
        pages = indices[ip[b]:ip[b + 1]].long()
        if len(pages) == 0:
            continue
        n = (len(pages) - 1) * P + ll[b]
        k = kv64[pages, 0].reshape(-1, Hkv, D)[:n]
        v = kv64[pages, 1].reshape(-1, Hkv, D)[:n]
        s = torch.einsum("hgd,nhd->hgn", q[b].double().view(Hkv, G, D), k) * sm_scale
        lse[b] = torch.logsumexp(s, dim=-1).reshape(Hq)
        out[b] = torch.einsum("hgn,nhd->hgd", torch.softmax(s, dim=-1), v).reshape(Hq, D)
    return out, lse


def _close(out, lse, ref, ref_lse, dtype=torch.bfloat16):
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    assert out.shape == ref.shape and lse.shape == ref_lse.shape
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert not out.isnan().any() and not lse.isnan().any()
    err = (out.double() - ref).abs()
    assert (err <= tol * (1 + ref.abs())).all(), f"max out error {err.max().item()}"
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin) and torch.equal(lse[~fin], ref_lse[~fin].float())
    lerr = (lse.double()[fin] - ref_lse[fin]).abs()
    assert (lerr <= 1e-5 * (1 + ref_lse[fin].abs())).all(), f"max lse error {lerr.max().item()}"


def _solve(lens, P=16, Hq=8, Hkv=2, D=64, dtype=torch.bfloat16, layout="NHD", shared=False, scale=1.0, **kw):
    """Plan and run `lens` on a fresh op; check against the float64 reference. Returns the op."""
    indptr, indices, last, num_pages = _table(lens, P, shared=shared)
    q, kv = _data(len(lens), num_pages, Hq, Hkv, D, P, dtype, layout, scale=scale)
    attn = _op(num_qo_heads=Hq, num_kv_heads=Hkv, head_dim=D, page_size=P, dtype=dtype, kv_layout=layout, **kw)
    attn.plan(indptr, indices, last)
    out, lse = attn.run(q, kv, return_lse=True)
    ref, ref_lse = reference(q, kv, indptr, indices, last, P, Hkv, attn.sm_scale, layout)
    _close(out, lse, ref, ref_lse, dtype)
    return attn


class _Tagged(torch.Tensor):
    pass


# =====================================================================================================
# 1. constructor arguments
# =====================================================================================================

BAD_CONSTRUCTOR = [
    # (id, kwargs, regex that must name the argument and the value)
    ("qo-zero", dict(num_qo_heads=0), r"num_qo_heads must be a positive int, got 0"),
    ("qo-float", dict(num_qo_heads=8.0), r"num_qo_heads must be a positive int, got 8\.0"),
    ("qo-none", dict(num_qo_heads=None), r"num_qo_heads must be a positive int, got None"),
    ("qo-bool", dict(num_qo_heads=True, num_kv_heads=1), r"num_qo_heads must be a positive int, got True"),
    ("kv-not-divisor", dict(num_kv_heads=3), r"num_qo_heads=8 must be a multiple of num_kv_heads=3"),
    ("kv-more-than-qo", dict(num_kv_heads=16), r"num_qo_heads=8 must be a multiple of num_kv_heads=16"),
    ("page-zero", dict(page_size=0), r"page_size must be a positive int, got 0"),
    ("page-bool", dict(page_size=True), r"page_size must be a positive int, got True"),
    ("hd-96", dict(head_dim=96), r"head_dim must be 64, 128, 256 or 512, got 96"),
    ("hd-bool", dict(head_dim=True), r"head_dim must be 64, 128, 256 or 512, got True"),
    ("hd-float", dict(head_dim=64.0), r"head_dim must be 64, 128, 256 or 512, got 64\.0"),
    ("dtype-f32", dict(dtype=torch.float32), r"dtype must be torch\.bfloat16 or torch\.float16, got torch\.float32"),
    ("dtype-str", dict(dtype="bfloat16"), r"dtype must be torch\.bfloat16 or torch\.float16, got bfloat16"),
    ("dtype-list", dict(dtype=[torch.bfloat16]), r"dtype.*\[torch\.bfloat16\]"),
    ("device-gpu", dict(device="gpu"), r"device='gpu' is not a device"),
    ("device-meta", dict(device="meta"), r"device must be 'cuda' or 'cpu', got 'meta'"),
    ("device-none", dict(device=None), r"device=None is not a device"),
    ("layout-lower", dict(kv_layout="nhd"), r"kv_layout must be 'NHD' or 'HND', got 'nhd'"),
    ("scale-nan", dict(sm_scale=math.nan), r"sm_scale must be a finite number, got nan"),
    ("scale-str", dict(sm_scale="0.1"), r"sm_scale must be a finite number, got '0\.1'"),
    ("scale-bool", dict(sm_scale=False), r"sm_scale must be a finite number, got False"),
    ("scale-huge-int", dict(sm_scale=10 ** 400), r"sm_scale must be a finite number, got 1000"),
    ("maxb-zero", dict(max_batch_size=0), r"max_batch_size must be a positive int, got 0"),
    ("caps-beyond-int32", dict(max_batch_size=2 ** 62), r"max_batch_size must be at most 2147483647, got 4611"),
    ("pages-beyond-int32", dict(max_num_pages=2 ** 31), r"max_num_pages must be at most 2147483647, got 2147483648"),
    ("scale-float32-inf", dict(sm_scale=1e39), r"sm_scale must have a magnitude below 2\.3\d*e\+38, got 1e\+39"),
    ("maxb-bool", dict(max_batch_size=True), r"max_batch_size must be a positive int, got True"),
    ("maxp-negative", dict(max_num_pages=-1), r"max_num_pages must be a positive int, got -1"),
    ("cluster-3", dict(cluster_size=3), r"cluster_size must be 1, 2, 4, 8 or 16, got 3"),
    ("cluster-bool", dict(cluster_size=True), r"cluster_size must be 1, 2, 4, 8 or 16, got True"),
    ("cluster-float", dict(cluster_size=2.0), r"cluster_size must be 1, 2, 4, 8 or 16, got 2\.0"),
    ("bi-int", dict(batch_invariant=1), r"batch_invariant must be True or False, got 1"),
    ("overlap-int", dict(overlap=1), r"overlap must be True or False, got 1"),
    ("topology-str", dict(topology="h200"), r"topology must be a meld\.scheduler\.Topology, got str"),
    ("topology-too-big", dict(topology=Topology(70000)), r"topology=.*70000 CTA slots"),
    ("cost-dict", dict(cost={}), r"cost must be a meld\.scheduler\.DecodeCost, got dict"),
    ("kc-dict", dict(kernel_config={}), r"kernel_config must be a meld\.codegen\.DecodeKernelConfig, got dict"),
    ("kc-dtype", dict(kernel_config=DecodeKernelConfig(dtype="float16", head_dim=64)),
     r"kernel_config is for float16.*the operator is bfloat16"),
    ("kc-head-dim", dict(kernel_config=DecodeKernelConfig(dtype="bfloat16", head_dim=128)),
     r"kernel_config is for bfloat16, head_dim 128.*head_dim 64"),
    ("kc-invariant", dict(kernel_config=DecodeKernelConfig(dtype="bfloat16", head_dim=64, batch_invariant=True)),
     r"batch_invariant=True.*batch_invariant=False"),
    ("kc-tma-page", dict(page_size=8, kernel_config=DecodeKernelConfig(dtype="bfloat16", head_dim=64, tma=True)),
     r"page_size=8: a kernel with TMA rings"),
]


@pytest.mark.parametrize("kw,match", [c[1:] for c in BAD_CONSTRUCTOR], ids=[c[0] for c in BAD_CONSTRUCTOR])
def test_constructor_rejects(kw, match):
    # Python's own convention allows TypeError for a wrong type; the message must still name it.
    with pytest.raises((ValueError, TypeError), match=match):
        _op(**kw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda:7", 0], ids=["cuda:7", "int-0"])
def test_constructor_cuda_without_cuda(device):
    with pytest.raises(ValueError, match=r"device=.*(CUDA is not available|does not exist)"):
        _op(device=device)


@pytest.mark.parametrize("arg,make,match", [
    ("topology", lambda: Topology("a"), r"sm_count.*'a'"),
    ("topology", lambda: Topology(None), r"sm_count.*None"),
    ("topology", lambda: Topology(4.5), r"sm_count.*4\.5"),
    ("topology", lambda: Topology(24, {1: 48.5}), r"max_active_clusters.*48\.5"),
    ("cost", lambda: DecodeCost(item_overhead_tokens=None), r"item_overhead_tokens.*None"),
], ids=["topology-str", "topology-none", "topology-float", "topology-float-count", "cost-none"])
def test_topology_and_cost_objects_reject(arg, make, match):
    """Topology and DecodeCost are constructor arguments too: their fields must be checked by name, and
    not fail later deep inside the planner (Topology(4.5) is accepted and the first run() then raises
    TypeError "'float' object cannot be interpreted as an integer")."""
    lens = [3000, 20]
    indptr, indices, last, num_pages = _table(lens, 16)
    with pytest.raises((ValueError, TypeError), match=match):
        attn = _op(**{arg: make()})
        attn.plan(indptr, indices, last)
        attn.run(*_data(len(lens), num_pages))


@pytest.mark.parametrize("name", ["num_qo_heads", "num_kv_heads", "head_dim", "page_size"])
def test_constructor_accepts_numpy_ints(name):
    """NumPy integers are integers (check_positive accepts numbers.Integral): the op must work with them."""
    value = dict(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16)[name]
    lens = [40, 0, 300]
    indptr, indices, last, num_pages = _table(lens, 16)
    q, kv = _data(len(lens), num_pages)
    attn = _op(**{name: np.int64(value)})
    attn.plan(indptr, indices, last)
    out, lse = attn.run(q, kv, return_lse=True)
    _close(out, lse, *reference(q, kv, indptr, indices, last, 16, 2, 1 / 8))


@pytest.mark.parametrize("kw", [
    dict(sm_scale=np.float32(0.125)), dict(sm_scale=Fraction(1, 8)), dict(max_batch_size=np.int64(3)),
    dict(cluster_size=np.int64(4), topology=Topology.h200()),
], ids=["scale-np32", "scale-fraction", "maxb-np", "cluster-np"])
def test_constructor_accepts_valid_odd_types(kw):
    _solve([40, 0, 300], **kw)


# =====================================================================================================
# 2. plan() inputs
# =====================================================================================================

def _good():
    indptr, indices, last, _ = _table([100, 20, 0, 300], 16)
    return indptr, indices, last


def _bad_plan(case):
    """The three plan() arguments with one made bad, plus plan()'s keyword arguments."""
    ip, ix, ll = _good()
    kw = {}
    two_d = lambda t: t[None]
    strided = lambda t: torch.stack([t, t], 1)[:, 0]
    changes = {
        "indptr-int64": lambda: (ip.long(), ix, ll),
        "indptr-float": lambda: (ip.float(), ix, ll),
        "indices-int64": lambda: (ip, ix.long(), ll),
        "last-float": lambda: (ip, ix, ll.float()),
        "last-float-grad": lambda: (ip, ix, ll.float().requires_grad_()),
        "indptr-2d": lambda: (two_d(ip), ix, ll),
        "indptr-0d": lambda: (torch.tensor(0, dtype=I32), ix, ll[:0]),
        "indptr-empty": lambda: (ip[:0], ix, ll[:0]),
        "last-short": lambda: (ip, ix, ll[:-1]),
        "indptr-strided": lambda: (strided(ip), ix, ll),
        "indices-strided": lambda: (ip, strided(ix), ll),
        "indices-expanded": lambda: (ip, torch.zeros(1, dtype=I32).expand(int(ip[-1])), ll),
        "indptr-list": lambda: (ip.tolist(), ix, ll),
        "indptr-numpy": lambda: (ip.numpy(), ix, ll),
        "last-numpy": lambda: (ip, ix, ll.numpy()),
        "indptr-meta": lambda: (ip.to("meta"), ix, ll),
        "indptr-starts-1": lambda: (ip + 1, ix, ll),
        "indptr-starts-neg": lambda: (ip - 1, ix, ll),
        "indptr-decreasing": lambda: (i32([0, 7, 3, 3, 22]), ix, ll),
        "indptr-wrap-1": lambda: (i32([0, 2 ** 31 - 1, -2 ** 31 + 1]), ix, i32([1, 1])),
        "indptr-huge": lambda: (i32([0, 2 ** 31 - 1]), ix, i32([1])),
        "last-negative": lambda: (ip, ix, i32([4, -1, 0, 12])),
        "last-above-page": lambda: (ip, ix, i32([4, 4, 0, 17])),
        "last-int-min": lambda: (ip, ix, i32([4, 4, 0, -2 ** 31])),
        "indices-short": lambda: (ip, ix[:-1], ll),
        "indices-neg-last": lambda: (ip, torch.cat([ix[:-1], i32([-5])]), ll),
        "indices-int-min": lambda: (ip, torch.cat([ix[:3], i32([-2 ** 31]), ix[4:]]), ll),
        "check-int": lambda: (kw.update(check=1), (ip, ix, ll))[1],
        "check-none": lambda: (kw.update(check=None), (ip, ix, ll))[1],
        "check-false-neg-page": lambda: (kw.update(check=False),
                                         (ip, torch.cat([i32([-1]), ix[1:]]), ll))[1],
    }
    return changes[case](), kw


BAD_PLAN = {
    "indptr-int64": r"kv_indptr must have dtype torch\.int32, got torch\.int64",
    "indptr-float": r"kv_indptr must have dtype torch\.int32, got torch\.float32",
    "indices-int64": r"kv_indices must have dtype torch\.int32, got torch\.int64",
    "last-float": r"kv_last_page_len must have dtype torch\.int32, got torch\.float32",
    "last-float-grad": r"kv_last_page_len must have dtype torch\.int32, got torch\.float32",
    "indptr-2d": r"kv_indptr must have shape .*got \(1, 5\)",
    "indptr-0d": r"kv_indptr must have shape .*got \(\)",
    "indptr-empty": r"kv_indptr must have B \+ 1 entries, got an empty tensor",
    "last-short": r"kv_last_page_len must have shape \(4,\) .*got \(3,\)",
    "indptr-strided": r"kv_indptr must be contiguous, got strides \(2,\)",
    "indices-strided": r"kv_indices must be contiguous, got strides \(2,\)",
    "indices-expanded": r"kv_indices must be contiguous, got strides \(0,\)",
    "indptr-list": r"kv_indptr must be a torch\.Tensor, got list",
    "indptr-numpy": r"kv_indptr must be a torch\.Tensor, got ndarray",
    "last-numpy": r"kv_last_page_len must be a torch\.Tensor, got ndarray",
    "indptr-meta": r"kv_indptr must be on the CPU or on cpu, got meta",
    "indptr-starts-1": r"kv_indptr must start at 0, got kv_indptr\[0\]=1",
    "indptr-starts-neg": r"kv_indptr must start at 0, got kv_indptr\[0\]=-1",
    "indptr-decreasing": r"kv_indptr must never decrease, got kv_indptr\[1:3\]=\[7, 3\]",
    "indptr-wrap-1": r"kv_indptr must never decrease|more than 2147483647 KV tokens",
    "indptr-huge": r"request 0 has 2147483647 pages|kv_indptr\[-1\]=2147483647 exceeds",
    "last-negative": r"kv_last_page_len\[1\]=-1 is outside \[1, page_size=16\]",
    "last-above-page": r"kv_last_page_len\[3\]=17 is outside \[1, page_size=16\]",
    "last-int-min": r"kv_last_page_len\[3\]=-2147483648 is outside",
    "indices-short": r"kv_indptr\[-1\]=\d+ exceeds len\(kv_indices\)=\d+",
    "indices-neg-last": r"kv_indices\[\d+\]=-5 is a negative page index",
    "indices-int-min": r"kv_indices\[3\]=-2147483648 is a negative page index",
    "check-int": r"check must be True or False, got 1",
    "check-none": r"check must be True or False, got None",
    "check-false-neg-page": r"kv_indices\[0\]=-1 is a negative page index",   # CPU inputs are always checked
}


@pytest.mark.parametrize("case", list(BAD_PLAN))
def test_plan_rejects(case):
    args, kw = _bad_plan(case)
    attn = _op(page_size=1) if case.startswith("indptr-wrap") else _op()
    with pytest.raises((ValueError, TypeError), match=BAD_PLAN[case]):
        attn.plan(*args, **kw)
    with pytest.raises(RuntimeError, match="call plan"):   # and it did not half-plan
        attn.schedule


@pytest.mark.parametrize("kw,lens,match", [
    (dict(max_batch_size=2), [5, 6, 7], r"batch of 3 requests exceeds max_batch_size=2"),
    (dict(max_num_pages=4), [100], r"kv_indptr\[-1\]=7 page indices exceed max_num_pages=4"),
    (dict(max_batch_size=1), [0, 0], r"batch of 2 requests exceeds max_batch_size=1"),
], ids=["batch", "pages", "empty-requests-count"])
def test_plan_capacity_limits(kw, lens, match):
    indptr, indices, last, _ = _table(lens, 16)
    with pytest.raises(ValueError, match=match):
        _op(**kw).plan(indptr, indices, last)


def test_plan_capacity_limits_are_inclusive():
    _solve([16, 16, 32], max_batch_size=3, max_num_pages=4)


def test_page_size_beyond_int32_is_refused():
    """kv_last_page_len is checked as (last - 1) in uint32 against page_size, which cannot fire for
    page_size >= 2**32 (last = 0 would slip through), and the kernels hold page_size as int32: so a page
    size beyond int32 is refused at construction, naming it."""
    with pytest.raises(ValueError, match=r"page_size must be at most 2147483647, got 4294967296"):
        meld.DecodeAttention(8, 2, 64, 2 ** 32, torch.bfloat16, "cpu", topology=SMALL)
    attn = meld.DecodeAttention(8, 2, 64, 2 ** 31 - 1, torch.bfloat16, "cpu", topology=SMALL)
    with pytest.raises(ValueError, match=r"kv_last_page_len\[0\]=0 is outside"):
        attn.plan(i32([0, 1]), i32([0]), i32([0]))


@pytest.mark.parametrize("wrap", ["parameter", "subclass", "parameter-subclass-all"])
def test_plan_accepts_tensor_subclasses(wrap):
    indptr, indices, last, num_pages = _table([300, 7, 0], 16)
    if wrap == "parameter":
        args = (torch.nn.Parameter(indptr, requires_grad=False), indices, last)
    elif wrap == "subclass":
        args = (indptr, indices.as_subclass(_Tagged), last.as_subclass(_Tagged))
    else:
        args = tuple(torch.nn.Parameter(t, requires_grad=False).as_subclass(_Tagged) for t in (indptr, indices, last))
    q, kv = _data(3, num_pages)
    attn = _op()
    attn.plan(*args)
    out, lse = attn.run(q, kv, return_lse=True)
    _close(out, lse, *reference(q, kv, indptr, indices, last, 16, 2, 1 / 8))


def test_plan_owns_its_inputs():
    """plan() copies the page table: editing the caller's tensors afterwards must not change run()."""
    indptr, indices, last, num_pages = _table([300, 7, 50], 16)
    q, kv = _data(3, num_pages)
    ref = reference(q, kv, indptr, indices, last, 16, 2, 1 / 8)
    attn = _op()
    attn.plan(indptr, indices, last)
    indptr.fill_(0), indices.fill_(-1), last.fill_(99)
    _close(*attn.run(q, kv, return_lse=True), *ref)


def test_plan_ignores_indices_past_nnz_and_last_of_empty_requests():
    """kv_indices may be longer than kv_indptr[-1] (garbage after it is never read), and
    kv_last_page_len of an empty request may be anything (documented)."""
    indptr, indices, last, num_pages = _table([300, 0, 7, 0], 16)
    last[1], last[3] = -12345, 10 ** 6
    padded = torch.cat([indices, i32([-7, 2 ** 31 - 1, 10 ** 9])])
    q, kv = _data(4, num_pages)
    attn = _op()
    attn.plan(indptr, padded, last)
    out, lse = attn.run(q, kv, return_lse=True)
    last[1] = last[3] = 0
    _close(out, lse, *reference(q, kv, indptr, indices, last, 16, 2, 1 / 8))


# =====================================================================================================
# 3. run() inputs
# =====================================================================================================

@pytest.fixture
def planned():
    indptr, indices, last, num_pages = _table([100, 20, 0, 300], 16)
    q, kv = _data(4, num_pages)
    attn = _op()
    attn.plan(indptr, indices, last)
    return attn, q, kv


def _bad_run(case, q, kv):
    kw = {}
    cases = {
        "q-batch": lambda: (q[:3], kv),
        "q-head-dim": lambda: (torch.zeros(4, 8, 128, dtype=torch.bfloat16), kv),
        "q-2d": lambda: (q[0], kv),
        "q-fp16": lambda: (q.half(), kv),
        "q-list": lambda: (q.tolist(), kv),
        "q-none": lambda: (None, kv),
        "q-meta": lambda: (q.to("meta"), kv),
        "q-sparse": lambda: (q.to_sparse(), kv),
        "q-nested": lambda: (torch.nested.nested_tensor(list(q)), kv),
        "kv-fp16": lambda: (q, kv.half()),
        "kv-hnd-into-nhd": lambda: (q, kv.transpose(2, 3).contiguous()),
        "kv-noncontig": lambda: (q, torch.zeros(kv.shape[0], 2, 16, 2, 128, dtype=torch.bfloat16)[..., ::2]),
        "kv-too-few-pages": lambda: (q, kv[:3]),
        "kv-meta": lambda: (q, kv.to("meta")),
        "kv-numpy": lambda: (q, kv.float().numpy()),
        "out-shape": lambda: (kw.update(out=torch.zeros(4, 8, 32, dtype=torch.bfloat16)), (q, kv))[1],
        "out-dtype": lambda: (kw.update(out=torch.zeros(4, 8, 64)), (q, kv))[1],
        "out-noncontig": lambda: (kw.update(out=torch.zeros(4, 8, 128, dtype=torch.bfloat16)[..., ::2]), (q, kv))[1],
        "out-expanded": lambda: (kw.update(out=torch.zeros(1, 1, 1, dtype=torch.bfloat16).expand(4, 8, 64)), (q, kv))[1],
        "lse-shape": lambda: (kw.update(lse=torch.empty(4, 4)), (q, kv))[1],
        "lse-f64": lambda: (kw.update(lse=torch.empty(4, 8, dtype=torch.float64), return_lse=True), (q, kv))[1],
        "lse-noncontig": lambda: (kw.update(lse=torch.empty(8, 4).t()), (q, kv))[1],
        "return-lse-str": lambda: (kw.update(return_lse="no"), (q, kv))[1],
    }
    return cases[case](), kw


BAD_RUN = {
    "q-batch": r"q must have shape \(4, 8, 64\) .*got \(3, 8, 64\)",
    "q-head-dim": r"q must have shape \(4, 8, 64\) .*got \(4, 8, 128\)",
    "q-2d": r"q must have shape \(4, 8, 64\) .*got \(8, 64\)",
    "q-fp16": r"q must have dtype torch\.bfloat16, got torch\.float16",
    "q-list": r"q must be a torch\.Tensor, got list",
    "q-none": r"q must be a torch\.Tensor, got NoneType",
    "q-meta": r"q must be on cpu, got meta",
    "q-sparse": r"\bq\b.*(sparse|Sparse|layout|strided)",
    "q-nested": r"\bq\b.*(nested|Nested|layout|strided|shape)",
    "kv-fp16": r"kv_cache must have dtype torch\.bfloat16, got torch\.float16",
    "kv-hnd-into-nhd": r"kv_cache must have shape .*kv_layout='NHD'.*got \(\d+, 2, 2, 16, 64\)",
    "kv-noncontig": r"kv_cache must have a contiguous last dim \(head_dim\), got strides \(8192, 4096, 256, 128, 2\)",
    "kv-too-few-pages": r"kv_indices of the last plan\(\) reference page \d+, but kv_cache has only 3 pages",
    "kv-meta": r"kv_cache must be on cpu, got meta",
    "kv-numpy": r"kv_cache must be a torch\.Tensor or a \(k_cache, v_cache\) tuple, got ndarray",
    "out-shape": r"out must have shape \(4, 8, 64\) .*got \(4, 8, 32\)",
    "out-dtype": r"out must have dtype torch\.bfloat16, got torch\.float32",
    "out-noncontig": r"out must be contiguous, got strides \(1024, 128, 2\)",
    "out-expanded": r"out must be contiguous, got strides \(0, 0, 0\)",
    "lse-shape": r"lse must have shape \(4, 8\) .*got \(4, 4\)",
    "lse-f64": r"lse must have dtype torch\.float32, got torch\.float64",
    "lse-noncontig": r"lse must be contiguous, got strides \(1, 4\)",
    "return-lse-str": r"return_lse must be True or False, got 'no'",
}


@pytest.mark.parametrize("case", list(BAD_RUN))
def test_run_rejects(case, planned):
    attn, q, kv = planned
    before = attn.run(q, kv, return_lse=True)
    args, kw = _bad_run(case, q, kv)
    out = kw.get("out")
    snapshot = out.clone() if isinstance(out, torch.Tensor) and out.device.type == "cpu" else None
    with pytest.raises((ValueError, TypeError), match=BAD_RUN[case]):
        attn.run(*args, **kw)
    if snapshot is not None:
        assert torch.equal(out, snapshot), "a run() that raises must not write out="
    after = attn.run(q, kv, return_lse=True)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])


def test_run_before_plan():
    q, kv = _data(1, 4)
    with pytest.raises(RuntimeError, match=r"call plan\(\) first"):
        _op().run(q, kv)


def test_run_hnd_op_rejects_nhd_cache():
    indptr, indices, last, num_pages = _table([100, 3], 16)
    q, kv = _data(2, num_pages)                                  # NHD cache
    attn = _op(kv_layout="HND")
    attn.plan(indptr, indices, last)
    with pytest.raises(ValueError, match=r"kv_cache must have shape .*kv_layout='HND'.*got \(\d+, 2, 16, 2, 64\)"):
        attn.run(q, kv)


def test_run_lse_buffer_without_return_lse_is_filled():
    indptr, indices, last, num_pages = _table([100, 0, 3], 16)
    q, kv = _data(3, num_pages)
    attn = _op()
    attn.plan(indptr, indices, last)
    out_buf, lse_buf = torch.full((3, 8, 64), 7.0, dtype=torch.bfloat16), torch.full((3, 8), 7.0)
    res = attn.run(q, kv, out=out_buf, lse=lse_buf)
    assert torch.equal(res, out_buf)
    _close(out_buf, lse_buf, *reference(q, kv, indptr, indices, last, 16, 2, 1 / 8))


@pytest.mark.parametrize("view", ["last-dim-strided", "heads-strided", "batch-transposed"])
def test_run_accepts_strided_q(view):
    indptr, indices, last, num_pages = _table([100, 0, 300], 16)
    q, kv = _data(3, num_pages)
    if view == "last-dim-strided":
        qv = torch.stack([q, q], -1).flatten(-2)[..., ::2]
    elif view == "heads-strided":
        qv = torch.stack([q, q], 2).flatten(1, 2)[:, ::2]
    else:
        qv = q.transpose(0, 1).contiguous().transpose(0, 1)
    assert torch.equal(qv, q) and not qv.is_contiguous()
    attn = _op()
    attn.plan(indptr, indices, last)
    _close(*attn.run(qv, kv, return_lse=True), *reference(q, kv, indptr, indices, last, 16, 2, 1 / 8))


def test_run_with_grad_inputs_refuses_backward():
    indptr, indices, last, num_pages = _table([100, 3], 16)
    q, kv = _data(2, num_pages)
    attn = _op()
    attn.plan(indptr, indices, last)
    out = attn.run(q.clone().requires_grad_(), torch.nn.Parameter(kv))
    _close(out, attn.run(q, kv, return_lse=True)[1], *reference(q, kv, indptr, indices, last, 16, 2, 1 / 8))
    with pytest.raises(NotImplementedError, match="no backward"):
        out.float().sum().backward()


# =====================================================================================================
# 4. valid edge cases, against the float64 reference
# =====================================================================================================

LENS = [700, 5, 0, 2000, 1, 16, 17]


@pytest.mark.parametrize("Hq,Hkv", [(2, 2), (6, 2), (16, 2), (32, 2), (64, 2), (32, 1), (9, 3)],
                         ids=lambda v: str(v))
def test_group_sizes(Hq, Hkv):
    _solve(LENS, Hq=Hq, Hkv=Hkv)


@pytest.mark.parametrize("P", [1, 3, 15, 16, 17, 100, 1000])
def test_page_sizes(P):
    _solve(LENS, P=P)


@pytest.mark.parametrize("P,Hkv", [(1, 2), (4, 4), (1000, 2)])
def test_hnd_layout(P, Hkv):
    _solve(LENS, P=P, Hq=2 * Hkv, Hkv=Hkv, layout="HND")


@pytest.mark.parametrize("D,dtype", [(64, torch.bfloat16), (128, torch.bfloat16), (256, torch.bfloat16),
                                     (64, torch.float16), (256, torch.float16)], ids=["64", "128", "256", "64-fp16", "256-fp16"])
def test_head_dims_and_dtypes(D, dtype):
    _solve([300, 0, 1000, 3], D=D, dtype=dtype)


def test_batch_of_zero():
    attn = _op()
    attn.plan(i32([0]), i32([]), i32([]))
    q, kv = _data(0, 0)
    out, lse = attn.run(q, kv, return_lse=True)
    assert out.shape == (0, 8, 64) and lse.shape == (0, 8)
    with pytest.raises(ValueError, match=r"q must have shape \(0, 8, 64\)"):
        attn.run(_data(1, 1)[0], kv)


@pytest.mark.parametrize("n", [1, 17, 20000])
def test_batch_of_one(n):
    _solve([n])


def test_thousands_of_one_token_requests():
    _solve([1] * 3000, P=16)


def test_one_token_requests_page_size_one():
    _solve([1] * 2000, P=1)


@pytest.mark.parametrize("lens", [[300, 300, 300], [5, 1000, 17, 0, 64]], ids=["equal", "prefixes"])
def test_requests_sharing_pages(lens):
    _solve(lens, shared=True)


@pytest.mark.parametrize("lens", [[0], [0] * 50, [0, 0, 3000, 0], [5, 0, 0, 0, 0, 0, 7], [0] * 7 + [1]],
                         ids=["one", "fifty", "around-long", "middle", "last-only"])
def test_empty_requests(lens):
    attn = _solve(lens)
    if not any(lens):   # a cache with no pages serves a batch of empty requests
        attn.plan(*_table(lens, 16)[:3])
        q, kv = _data(len(lens), 0)
        out, lse = attn.run(q, kv, return_lse=True)
        assert (out == 0).all() and (lse == -math.inf).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_scores_near_1e4(dtype):
    """q and K entries ~N(0, 20**2), sm_scale 1: scores of several thousand, the largest near 1e4 (exp of
    them overflows anything without the running max); softmax must stay exact."""
    attn = _solve([300, 2000, 1], dtype=dtype, scale=20.0, sm_scale=1.0)
    assert attn.sm_scale == 1.0


@pytest.mark.parametrize("sm_scale", [-1.0, 0.0, 1e-30, 10.0, 1e30], ids=str)
def test_sm_scale_values(sm_scale):
    _solve([300, 2000, 1, 0], sm_scale=sm_scale)


@pytest.mark.parametrize("lens", [[5000], [5000, 3, 0, 3000], [20000, 1, 2]], ids=str)
def test_batch_invariant(lens):
    _solve(lens, batch_invariant=True)


def test_batch_invariant_small_chunks():
    _solve([5000, 17, 0, 300], batch_invariant=True, cost=DecodeCost(invariant_chunk_tokens=16))


@pytest.mark.parametrize("kw", [
    dict(cluster_size=4, topology=Topology.h200()),
    dict(cluster_size=16, topology=Topology.h200()),
    dict(cluster_size=2),                                  # SMALL has no clusters of 2: falls back to 1
    dict(topology=Topology(1)),
    dict(kernel_config=DecodeKernelConfig(dtype="bfloat16", head_dim=64, heads_per_unit=16)),
    dict(kernel_config=DecodeKernelConfig(dtype="bfloat16", head_dim=64, onchip_merge=True), cluster_size=4,
         topology=Topology.h200()),
    dict(cost=DecodeCost(item_overhead_tokens=1, min_split_tokens=1, min_cta_tokens=1, round_tokens=16)),
], ids=["cluster4", "cluster16", "cluster2-small", "one-cta", "hpu16", "onchip",
        "tiny-costs"])
def test_scheduling_options(kw):
    _solve([5000, 3, 0, 3000, 64], **kw)


def test_replan_other_batches():
    attn = _op()
    for lens in ([3000, 1], [0] * 9, [5] * 40, [], [70000]):
        indptr, indices, last, num_pages = _table(lens, 16)
        q, kv = _data(len(lens), num_pages)
        attn.plan(indptr, indices, last)
        _close(*attn.run(q, kv, return_lse=True), *reference(q, kv, indptr, indices, last, 16, 2, 1 / 8))


# =====================================================================================================
# 5. NaN / Inf containment
# =====================================================================================================

CONT_LENS = [3000, 40, 0, 900]     # under SMALL: request 0 is split, request 1 is whole
VALUES = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


@pytest.fixture(scope="module")
def contained():
    indptr, indices, last, num_pages = _table(CONT_LENS, 16)
    q, kv = _data(len(CONT_LENS), num_pages)
    attn = _op()
    attn.plan(indptr, indices, last)
    it = attn.schedule.items()
    assert ((it["slot"] >= 0) & (it["req"] == 0)).any(), "request 0 must be split"
    assert not ((it["slot"] >= 0) & (it["req"] == 1)).any(), "request 1 must be whole"
    ref = reference(q, kv, indptr, indices, last, 16, 2, attn.sm_scale)
    return attn, (indptr, indices, last), q, kv, ref


def _token(table, b, t):
    """(page, slot) of token t of request b."""
    indptr, indices, _ = table
    return int(indices[int(indptr[b]) + t // 16]), t % 16


def _expect_rows(attn, q, kv, ref, hit, in_v=False):
    """`hit` rows NaN, the rest as the reference. A value in V (`in_v`) reaches the output only: lse depends
    on the scores alone, so the hit rows' lse stays the reference's (IEEE)."""
    out, lse = attn.run(q, kv, return_lse=True)
    r, rl = ref
    assert out[hit].isnan().all(), "the rows it reaches must be NaN"
    if in_v:
        assert torch.allclose(lse[hit].double(), rl[hit], rtol=1e-5, atol=1e-5), "V must not reach lse"
    else:
        assert lse[hit].isnan().all(), "the rows it reaches must have a NaN lse"
    assert not out[~hit].isnan().any() and not lse[~hit].isnan().any(), "NaN leaked into other rows"
    err = (out[~hit].double() - r[~hit]).abs()
    assert (err <= 1e-2 * (1 + r[~hit].abs())).all()
    fin = torch.isfinite(rl[~hit])
    assert torch.allclose(lse[~hit].double()[fin], rl[~hit][fin], rtol=1e-5, atol=1e-5)
    assert (out[2] == 0).all() and (lse[2] == -math.inf).all(), "the empty request stays zeros, lse -inf"


@pytest.mark.parametrize("value", list(VALUES))
@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("b", [0, 1], ids=["split", "whole"])
def test_nonfinite_reaches_exactly_its_rows(contained, value, where, b):
    attn, table, q, kv, ref = contained
    q, kv = q.clone(), kv.clone()
    hit = torch.zeros(4, 8, dtype=torch.bool)
    h = 5                                        # q head 5 -> kv head 1 (q heads 4..7)
    if where == "q":
        q[b, h, 3] = VALUES[value]
        hit[b, h] = True
    else:
        t = CONT_LENS[b] - 1                     # the request's very last token
        page, slot = _token(table, b, t)
        kv[page, 0 if where == "k" else 1, slot, 1, 7] = VALUES[value]
        hit[b, 4:8] = True
    _expect_rows(attn, q, kv, ref, hit, in_v=where == "v")


@pytest.mark.parametrize("where", ["k", "v"])
def test_nonfinite_in_middle_of_split_request(contained, where):
    attn, table, q, kv, ref = contained
    kv = kv.clone()
    page, slot = _token(table, 0, 1500)
    kv[page, 0 if where == "k" else 1, slot, 0, 0] = math.nan
    hit = torch.zeros(4, 8, dtype=torch.bool)
    hit[0, 0:4] = True
    _expect_rows(attn, q, kv, ref, hit, in_v=where == "v")


@pytest.mark.parametrize("where", ["k", "v"])
def test_nonfinite_past_last_page_len_is_not_read(contained, where):
    """Slots of a last page past kv_last_page_len hold no tokens: poison there must reach nothing."""
    attn, table, q, kv, ref = contained
    kv = kv.clone()
    for b, n in ((0, 3000), (1, 40), (3, 900)):
        page, _ = _token(table, b, n - 1)
        kv[page, 0 if where == "k" else 1, n % 16 or 16:, :, :] = math.nan
    _expect_rows(attn, q, kv, ref, torch.zeros(4, 8, dtype=torch.bool))


def test_nonfinite_in_unreferenced_pages_is_not_read(contained):
    attn, table, q, kv, ref = contained
    kv = kv.clone()
    used = set(table[1].tolist())
    spare = [p for p in range(kv.shape[0]) if p not in used]
    assert spare
    kv[spare] = math.nan
    _expect_rows(attn, q, kv, ref, torch.zeros(4, 8, dtype=torch.bool))


def test_nonfinite_q_of_empty_request(contained):
    """An empty request reads no KV: its q never meets a key, so it stays zeros and lse = -inf."""
    attn, table, q, kv, ref = contained
    q = q.clone()
    q[2] = math.nan
    _expect_rows(attn, q, kv, ref, torch.zeros(4, 8, dtype=torch.bool))


def test_nonfinite_in_shared_page_reaches_every_reader():
    indptr, indices, last, num_pages = _table([2000, 500, 0, 64], 16, shared=True)
    q, kv = _data(4, num_pages)
    attn = _op()
    attn.plan(indptr, indices, last)
    ref = reference(q, kv, indptr, indices, last, 16, 2, attn.sm_scale)
    kv = kv.clone()
    kv[int(indices[0]), 1, 0, 0, 0] = math.inf          # token 0 of every non-empty request, kv head 0
    hit = torch.zeros(4, 8, dtype=torch.bool)
    hit[[0, 1, 3], 0:4] = True
    _expect_rows(attn, q, kv, ref, hit, in_v=True)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_nonfinite_group_of_sixteen(layout):
    """Units of 16 q heads (group 16): a NaN in q head 13 reaches only head 13; in K of kv head 1, heads 16-31."""
    lens = [3000, 40, 0, 900]
    indptr, indices, last, num_pages = _table(lens, 16)
    q, kv = _data(4, num_pages, Hq=32, Hkv=2, layout=layout)
    attn = _op(num_qo_heads=32, kv_layout=layout)
    attn.plan(indptr, indices, last)
    ref = reference(q, kv, indptr, indices, last, 16, 2, attn.sm_scale, layout)
    q, kv = q.clone(), kv.clone()
    q[0, 13, 0] = math.nan
    page = int(indices[int(indptr[3])])
    if layout == "NHD":
        kv[page, 0, 3, 1, 0] = math.nan
    else:
        kv[page, 0, 1, 3, 0] = math.nan
    hit = torch.zeros(4, 32, dtype=torch.bool)
    hit[0, 13] = True
    hit[3, 16:32] = True
    _expect_rows(attn, q, kv, ref, hit)


# =====================================================================================================
# 6. plan() is transactional
# =====================================================================================================

FAILED_PLANS = ["indptr-int64", "indptr-list", "indptr-decreasing", "indptr-wrap-1", "last-above-page",
                "indices-short", "indices-neg-last", "check-none", "capacity-batch", "capacity-pages"]


@pytest.mark.parametrize("case", FAILED_PLANS)
def test_failed_plan_changes_nothing(case):
    indptr, indices, last, num_pages = _table([3000, 17, 0, 900], 16)
    q, kv = _data(4, num_pages)
    attn = _op(max_batch_size=6, max_num_pages=300)
    attn.plan(indptr, indices, last)
    out, lse = attn.run(q, kv, return_lse=True)
    schedule = attn.schedule
    if case == "capacity-batch":
        bad = _table([1] * 7, 16)[:3]
    elif case == "capacity-pages":
        bad = _table([16 * 301], 16)[:3]
    else:
        bad, kw = _bad_plan(case)
        if kw:
            with pytest.raises(ValueError):
                attn.plan(*bad, **kw)
            bad = None
    if bad is not None:
        with pytest.raises((ValueError, TypeError)):
            attn.plan(*bad)
    assert attn.schedule is schedule
    out2, lse2 = attn.run(q, kv, return_lse=True)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    with pytest.raises(ValueError, match=r"q must have shape \(4, 8, 64\)"):
        attn.run(q[:3], kv)


def test_failed_plan_on_fresh_op_leaves_it_unplanned():
    attn = _op()
    with pytest.raises(ValueError):
        attn.plan(i32([0, 1]), i32([-1]), i32([1]))
    with pytest.raises(RuntimeError, match=r"call plan\(\) first"):
        attn.run(*_data(1, 1))


# =====================================================================================================
# 7. the CLI
# =====================================================================================================

@pytest.fixture
def calls(monkeypatch):
    seen = []
    monkeypatch.setattr(cli, "demo", lambda batch, device: seen.append((batch, device)) or 0)
    return seen


@pytest.mark.parametrize("argv,named", [
    ([], "required"),
    (["bogus"], "invalid choice: 'bogus'"),
    (["demo", "--bogus"], "unrecognized arguments: --bogus"),
    (["demo", "--batch"], "argument --batch: expected one argument"),
    (["demo", "--batch", "0"], "argument --batch: '0'"),
    (["demo", "--batch", "1.5"], "argument --batch: '1.5'"),
    (["demo", "--batch", "0x10"], "argument --batch: '0x10'"),
    (["demo", "--batch", "99999999999999999999"], "argument --batch: '99999999999999999999'"),
    (["demo", "--device", "CPU"], "argument --device: 'CPU'"),
    (["demo", "--device", "cpu "], "argument --device: 'cpu '"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_cli_demo_rejects(argv, named, calls, capsys):
    _fails(argv, capsys, named)
    assert calls == []


@pytest.fixture
def trace_file(tmp_path):
    T = 10_000
    raw = np.zeros((2, 3, 4), np.int64)
    raw[0] = [[T, T + 1000, 0, 2], [T, T + 400, 0, 0], [T + 400, T + 600, 1, 0]]
    raw[1, :2] = [[T + 100, T + 900, 1, 1], [T + 100, T + 400, 0, 1]]
    return Trace.from_buffer(raw, units_per_request=1, head_blocks=1).write_chrome(tmp_path / "run.json")


@pytest.mark.parametrize("extra,named", [
    (["--width", "10"], "argument --width: '10'"),
    (["--width", "1e3"], "argument --width: '1e3'"),
    (["--row-height", "0"], "argument --row-height: '0'"),
    (["--width", "1000000000000000"], "argument --width: '1000000000000000'"),
    (["--row-height", "99999999999999"], "argument --row-height: '99999999999999'"),
    (["--width"], "argument --width: expected one argument"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_cli_timeline_rejects_sizes(extra, named, trace_file, capsys):
    _fails(["timeline", str(trace_file), *extra], capsys, named)
    assert not list(trace_file.parent.glob("*.png"))


def _corrupt(trace_file, edit):
    obj = json.loads(trace_file.read_text())
    edit(obj)
    trace_file.write_text(json.dumps(obj))
    return trace_file


@pytest.mark.parametrize("content,named", [
    (lambda f: f.write_text("[" * 100_000 + "]" * 100_000), "argument TRACE"),
    (lambda f: f.write_text('{"meld": {"ctas": ' + "[" * 50_000 + "]" * 50_000 + "}}"), "argument TRACE"),
    (lambda f: f.write_bytes(b""), "not JSON"),
    (lambda f: f.write_text('{"meld": {"base_ns": 1' + "0" * 5000 + "}}"), "argument TRACE"),
    (lambda f: _corrupt(f, lambda o: o["meld"].update(head_blocks=0)), "head_blocks=0"),
    (lambda f: _corrupt(f, lambda o: o["meld"].update(base_ns=1.5)), "meld.base_ns must be an integer, got 1.5"),
    (lambda f: _corrupt(f, lambda o: o.update(traceEvents=[1])), "traceEvents[0] must be an object"),
    (lambda f: _corrupt(f, lambda o: o["meld"].update(overflowed=-5)), "meld.overflowed"),
], ids=["deep-array", "deep-ctas", "empty-file", "huge-int", "head-blocks-0", "float-base",
        "event-not-object", "negative-overflow"])
def test_cli_timeline_rejects_files(content, named, trace_file, capsys):
    content(trace_file)
    _fails(["timeline", str(trace_file)], capsys, named)
    assert not list(trace_file.parent.glob("*.png"))


def test_cli_timeline_rejects_output_in_missing_folder(trace_file, capsys):
    _fails(["timeline", str(trace_file), "-o", str(trace_file) + ".d/out.png"], capsys, "argument -o/--output")
