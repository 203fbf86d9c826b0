"""Hostile and edge inputs on the CPU path: a plan() that raises changes nothing, offsets near 2**31 do
not wrap, NaN and Inf stay NaN in exactly the rows they reach, tensor subclasses and tensors that require
grad are read as plain tensors, every bad argument is a ValueError naming it, both KV layouts, and the
batch-invariant mode (each request's output bit-identical in any batch)."""
import math

import numpy as np
import pytest
import torch

import meld
from meld.ops.page_table import check_page_table
from meld.runtime.reference import attention_reference, execute_decode
from meld.scheduler import DecodeCost, Topology
from meld.workloads import lengths, paged, with_request

SMALL = Topology(24, {1: 48})


def _op(**kw):
    args = dict(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.bfloat16, device="cpu",
                topology=SMALL)
    args.update(kw)
    return meld.DecodeAttention(**args)


def _batch(lens, Hq=8, Hkv=2, D=64, P=16):
    pb = paged(lens, P)
    kv = torch.randn(pb.num_pages, 2, P, Hkv, D).bfloat16()
    q = torch.randn(len(lens), Hq, D).bfloat16()
    return pb, kv, q


def _err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


# --- plan() is transactional ---------------------------------------------------------------------

def test_a_failed_plan_leaves_the_previous_one_intact():
    pb, kv, q = _batch([3000, 17, 0, 900])
    attn = _op()
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    out, lse = attn.run(q, kv, return_lse=True)
    schedule = attn.schedule
    bad = pb.kv_indices.clone()
    bad[-1] = -4
    with pytest.raises(ValueError, match="negative page index"):
        attn.plan(pb.kv_indptr, bad, pb.kv_last_page_len)
    other = paged([5, 6, 7], 16)                              # another batch size, and a bad last page
    last = other.kv_last_page_len.clone()
    last[1] = 99
    with pytest.raises(ValueError, match=r"kv_last_page_len\[1\]=99"):
        attn.plan(other.kv_indptr, other.kv_indices, last)
    with pytest.raises(ValueError, match="max_batch_size"):
        _op(max_batch_size=4).plan(*(torch.zeros(6, dtype=torch.int32),) * 2, torch.zeros(5, dtype=torch.int32))
    assert attn.schedule is schedule
    out2, lse2 = attn.run(q, kv, return_lse=True)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    with pytest.raises(ValueError, match=r"q must have shape \(4, 8, 64\)"):
        attn.run(q[:3], kv)                                   # the failed plans' batch sizes were not taken


@pytest.mark.parametrize("kw,match", [
    (dict(max_batch_size=2), r"batch of 3 requests exceeds max_batch_size=2"),
    (dict(max_num_pages=4), r"kv_indptr\[-1\]=\d+ page indices exceed max_num_pages=4"),
])
def test_capacities_are_limits_on_the_cpu_too(kw, match):
    pb, _, _ = _batch([100, 20, 300])
    attn = _op(**kw)
    with pytest.raises(ValueError, match=match):
        attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    with pytest.raises(RuntimeError, match="call plan"):
        attn.schedule


# --- offsets near 2**31 --------------------------------------------------------------------------

@pytest.mark.parametrize("indptr", [[0, 2 ** 31 - 1, -2 ** 31 + 1], [0, 5, 2 ** 31 - 1, -2 ** 31]])
def test_offsets_near_int32_limits_do_not_wrap(indptr):
    i = torch.tensor(indptr, dtype=torch.int32)
    last = torch.ones(len(indptr) - 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="never decrease"):
        _op(page_size=1).plan(i, torch.zeros(8, dtype=torch.int32), last)


def test_a_request_longer_than_int32_tokens_is_refused():
    # 2**27 pages of 16 tokens: 2**31 tokens in one request (the indices need not exist: it fails first)
    i = np.array([0, 2 ** 27], dtype=np.int32)
    with pytest.raises(ValueError, match=r"request 0 has 134217728 pages of page_size=16 .*more than 2147483647"):
        check_page_table(i, np.array([16], dtype=np.int32), 2 ** 27, 16)
    assert check_page_table(i, np.array([15], dtype=np.int32), 2 ** 27, 16) == 2 ** 27   # 2**31 - 1: fits


# --- IEEE semantics -------------------------------------------------------------------------------

def _poison(kind, pb, kv, q, b, h, group=4):
    """Put a non-finite value where it reaches (request b, q head h) and only the q heads of its kv head."""
    q, kv = q.clone(), kv.clone()
    page = int(pb.kv_indices[int(pb.kv_indptr[b])])
    if kind == "q-nan":
        q[b, h, 3] = math.nan
        return q, kv, [(b, h)]
    rows = [(b, x) for x in range((h // group) * group, (h // group + 1) * group)]
    value = {"k-nan": math.nan, "k-inf": math.inf, "k-neginf": -math.inf, "v-nan": math.nan, "v-inf": math.inf}[kind]
    kv[page, 0 if kind.startswith("k") else 1, 2, h // group, 5] = value
    return q, kv, rows


@pytest.mark.parametrize("kind", ["q-nan", "k-nan", "k-inf", "k-neginf", "v-nan", "v-inf"])
@pytest.mark.parametrize("b", [0, 1], ids=["split", "whole"])
def test_nan_and_inf_give_nan_in_exactly_the_rows_they_reach(kind, b):
    pb, kv, q = _batch([3000, 40, 0, 900])
    attn = _op()
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    split = (attn.schedule.items()["slot"] >= 0) & (attn.schedule.items()["req"] == b)
    assert split.any() == (b == 0), "request 0 must be split and request 1 whole"
    ref, ref_lse = attention_reference(q, kv, pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    qp, kvp, rows = _poison(kind, pb, kv, q, b, 1)
    out, lse = attn.run(qp, kvp, return_lse=True)
    hit = torch.zeros(4, 8, dtype=torch.bool)
    for r in rows:
        hit[r] = True
    assert out[hit].isnan().all()
    if kind.startswith("v"):   # lse depends on the scores alone (IEEE): V reaches the output only
        assert torch.allclose(lse[hit].double(), ref_lse[hit].double(), rtol=1e-5, atol=1e-5)
    else:
        assert lse[hit].isnan().all()
    assert not out[~hit].isnan().any() and not lse[~hit].isnan().any()
    assert _err(out[~hit], ref[~hit]) < 1e-2
    assert (out[2] == 0).all() and (lse[2] == -math.inf).all(), "an empty request stays zeros, lse -inf"


# --- tensor subclasses and autograd ---------------------------------------------------------------

class _Tagged(torch.Tensor):
    pass


def test_subclasses_and_grad_tensors_are_read_as_plain_tensors():
    pb, kv, q = _batch([300, 7])
    ref, _ = attention_reference(q, kv, pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    attn = _op()
    attn.plan(torch.nn.Parameter(pb.kv_indptr, requires_grad=False), pb.kv_indices.as_subclass(_Tagged),
              pb.kv_last_page_len)
    out = attn.run(torch.nn.Parameter(q.float()).bfloat16(), torch.nn.Parameter(kv))
    assert _err(out, ref) < 1e-2
    with torch.no_grad():
        assert not attn.run(q.requires_grad_(), kv).requires_grad
    out = attn.run(q.requires_grad_(), kv)
    assert out.requires_grad
    with pytest.raises(NotImplementedError, match="no backward"):
        out.float().sum().backward()


# --- named errors ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kw,match", [
    (dict(sm_scale=math.nan), "sm_scale must be a finite number, got nan"),
    (dict(sm_scale=math.inf), "sm_scale must be a finite number, got inf"),
    (dict(sm_scale="0.1"), "sm_scale must be a finite number, got '0.1'"),
    (dict(sm_scale=True), "sm_scale must be a finite number, got True"),
    (dict(device="gpu"), r"device='gpu' is not a device; available: cpu"),
    (dict(device="meta"), "device must be 'cuda' or 'cpu', got 'meta'"),
    (dict(kv_layout="NDH"), "kv_layout must be 'NHD' or 'HND', got 'NDH'"),
    (dict(max_batch_size=0), "max_batch_size must be a positive int, got 0"),
    (dict(max_num_pages=-1), "max_num_pages must be a positive int, got -1"),
    (dict(batch_invariant=1), "batch_invariant must be True or False, got 1"),
    (dict(topology=Topology(70000)), r"70000 CTA slots, but the planner serves grids of at most \d+ CTAs"),
    (dict(topology="h200"), "topology must be a meld.scheduler.Topology, got str"),
    (dict(head_dim=True), "head_dim must be 64, 128, 256 or 512, got True"),
])
def test_constructor_names_the_bad_argument(kw, match):
    with pytest.raises(ValueError, match=match):
        _op(**kw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", 0])
def test_cuda_without_cuda_is_a_named_error(device):
    with pytest.raises(ValueError, match=r"device=.* CUDA is not available on this machine; available: cpu"):
        _op(device=device)


def test_last_trace_on_the_cpu_is_the_documented_error():
    attn = _op()
    with pytest.raises(RuntimeError, match="CPU reference executor records no trace"):
        attn.last_trace()


def test_plan_over_any_grid_size():
    """The NumPy planner serves any grid (no fixed-size scratch): 70000 CTAs plan, one request each."""
    s = meld.scheduler.plan_decode(np.full(70000, 300), np.arange(70000) * 19, 1, 1, Topology(70000))
    assert s.validate().meta["active_ctas"] == 70000


# --- KV layouts -----------------------------------------------------------------------------------

@pytest.mark.parametrize("P,Hkv", [(16, 2), (4, 4)])   # 4 == 4: the shapes of the two layouts coincide
def test_hnd_layout(P, Hkv):
    lens = [1000, 3, 0, 77]
    pb, kv, q = _batch(lens, Hq=4 * Hkv, Hkv=Hkv, P=P)
    ref, ref_lse = attention_reference(q, kv, pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    hnd = _op(num_qo_heads=4 * Hkv, num_kv_heads=Hkv, page_size=P, kv_layout="HND")
    hnd.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    out, lse = hnd.run(q, kv.transpose(2, 3).contiguous(), return_lse=True)
    assert _err(out, ref) < 1e-2
    finite = torch.isfinite(ref_lse)
    assert torch.allclose(lse.double()[finite], ref_lse[finite], atol=1e-5)
    if P == Hkv:   # the same tensor read as NHD is a different (wrong) cache: the layout decides
        nhd = _op(num_qo_heads=4 * Hkv, num_kv_heads=Hkv, page_size=P)
        nhd.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
        assert _err(nhd.run(q, kv.transpose(2, 3).contiguous()), ref) > 0.1
    else:
        with pytest.raises(ValueError, match="kv_layout='HND'"):
            hnd.run(q, kv)


# --- batch invariance -----------------------------------------------------------------------------

COMPOSITIONS = [[], [5, 7000], [100] * 30, [20000, 1, 2, 3], [0, 0, 9000, 50], [2048] * 12]


def _in_batches(attn, target_len, D=64, P=16, Hkv=2, Hq=8):
    """One request (the same q and KV pages) placed in several batches at several places: its output,
    lse, the executor's float64 output (which bf16 rounding cannot hide) and the CTAs its pieces ran on."""
    g = torch.Generator().manual_seed(3)
    n_pages = 4000
    kv = torch.randn(n_pages, 2, P, Hkv, D, generator=g).bfloat16()
    q0 = torch.randn(Hq, D, generator=g).bfloat16()
    own = torch.randperm(n_pages, generator=g)[:-(-target_len // P)].to(torch.int32)
    outs = []
    for others in COMPOSITIONS:
        for pos in sorted({0, len(others) // 2, len(others)}):
            pb = with_request(others, pos, target_len, own, P, n_pages, g)
            idx = pb.kv_indices
            q = torch.randn(len(others) + 1, Hq, D, generator=g).bfloat16()
            q[pos] = q0
            attn.plan(pb.kv_indptr, idx, pb.kv_last_page_len)
            out, lse = attn.run(q, kv, return_lse=True)
            it = attn.schedule.items()
            exact, _ = execute_decode(attn.schedule, q, kv[:, 0], kv[:, 1], idx, attn.sm_scale)
            outs.append((out[pos], lse[pos], exact[pos], tuple(it["cta"][it["req"] == pos])))
    return outs


@pytest.mark.parametrize("target_len", [5000, 700])
def test_batch_invariant_outputs_are_bit_identical_in_every_batch(target_len):
    outs = _in_batches(_op(batch_invariant=True), target_len)
    assert len(outs) >= 5 * 2
    for out, lse, exact, _ in outs:
        assert torch.equal(out, outs[0][0]) and torch.equal(lse, outs[0][1]) and torch.equal(exact, outs[0][2])
    assert len({ctas for *_, ctas in outs}) > 1, "the request must run on other CTAs in other batches"


def test_default_mode_is_not_batch_invariant():
    """The control: without batch_invariant the same request is split by the batch and the float64
    bits of its result move (so the test above can fail)."""
    outs = _in_batches(_op(), 5000)
    assert any(not torch.equal(exact, outs[0][2]) for _, _, exact, _ in outs)


def test_batch_invariant_matches_the_reference():
    pb, kv, q = _batch(lengths("skewed", 9))
    attn = _op(batch_invariant=True, cost=DecodeCost(invariant_chunk_tokens=256))
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    s = attn.schedule.validate()
    it = s.items()
    assert (it["num_parts"] == s.chunks[it["req"]] * (s.chunks[it["req"]] > 1)).all()
    ref, _ = attention_reference(q, kv, pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    assert _err(attn.run(q, kv), ref) < 1e-2
