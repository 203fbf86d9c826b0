"""The kernel under hostile and edge inputs: both KV layouts (cp.async and TMA loads), NaN and Inf that
stay NaN in exactly the rows they reach (split or whole, merged in global or distributed shared memory),
plan() that raises and leaves the last plan running, run-to-run determinism, and the batch-invariant
mode: each request's output bit-identical in any batch, at any place. The `racecheck` tests run every
kernel variant on a small grid, small enough for compute-sanitizer's racecheck (tools/sanitize.py)."""
import dataclasses
import math

import pytest
import torch

import meld
from meld.codegen import DecodeKernelConfig
from meld.runtime.reference import attention_reference
from meld.scheduler import DecodeCost, Topology
from meld.workloads import lengths, paged, with_request
from tests.gpu_checks import assert_gpu_plan_matches_host, check

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _tma(head_dim=128, **kw):
    return dataclasses.replace(DecodeKernelConfig.default("bfloat16", head_dim, **kw), tma=True)


def _err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


# --- KV layouts -----------------------------------------------------------------------------------

@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_hnd_layout(tma, head_dim):
    cfg = _tma(head_dim) if tma else None
    check(7, "ragged", head_dim=head_dim, group=4, kv_layout="HND", kernel_config=cfg)
    check(64, "skewed", head_dim=head_dim, group=4, kv_layout="HND", kernel_config=cfg)


@pytest.mark.parametrize("options", [dict(group=16), dict(cluster_size=4), dict(page_size=64, group=8),
                                     dict(page_size=8, num_kv_heads=8, group=2)])   # page_size == Hkv
def test_hnd_layout_other_shapes(options):
    check(64, "one-long", kv_layout="HND", **options)


# --- IEEE semantics -------------------------------------------------------------------------------

KINDS = ["q-nan", "q-inf", "k-nan", "k-inf", "k-neginf", "v-nan", "v-inf"]


def _poison(kind, pb, kv, q, b, h, group):
    """A non-finite value where it reaches (request b, q head h): q reaches that head, K and V every q
    head of its kv head. Returns the poisoned copies and the mask of rows that must turn NaN."""
    q, kv = q.clone(), kv.clone()
    hit = torch.zeros(q.shape[:2], dtype=torch.bool, device=q.device)
    value = math.inf if kind.endswith("-inf") else -math.inf if kind.endswith("neginf") else math.nan
    if kind.startswith("q"):
        q[b, h, 3] = value
        hit[b, h] = True
        return q, kv, hit
    first = int(pb.kv_indptr[b])
    pages = int(pb.kv_indptr[b + 1]) - first
    page = int(pb.kv_indices[first + pages // 2])   # a page in the middle of the request
    kv[page, 0 if kind.startswith("k") else 1, 1, h // group, 5] = value
    hit[b, (h // group) * group:(h // group + 1) * group] = True
    return q, kv, hit


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("variant", ["cp.async", "tma", "clusters", "16-head units", "batch-invariant"])
def test_nan_and_inf_give_nan_in_exactly_the_rows_they_reach(kind, variant):
    group = 16 if variant == "16-head units" else 4
    Hkv, D, P = 2, 128, 16
    op = {"tma": dict(kernel_config=_tma()), "clusters": dict(cluster_size=4),
          "batch-invariant": dict(batch_invariant=True)}.get(variant, {})
    lens = [20000, 200, 0, 5000]       # 0 and 3 split over many CTAs, 1 whole (too short to split), 2 empty
    pb = paged(lens, P)
    kv = torch.randn(pb.num_pages, 2, P, Hkv, D, device=DEV).bfloat16()
    q = torch.randn(len(lens), Hkv * group, D, device=DEV).bfloat16()
    attn = meld.DecodeAttention(Hkv * group, Hkv, D, P, torch.bfloat16, DEV, **op)
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    it = attn.schedule.items()
    assert (it["slot"][it["req"] == 0] >= 0).all() and (it["slot"][it["req"] == 1] < 0).all()
    ref, ref_lse = attention_reference(q, kv, *(t.to(DEV) for t in (pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)))
    for b in (0, 1):
        qp, kvp, hit = _poison(kind, pb, kv, q, b, 1, group)
        out, lse = attn.run(qp, kvp, return_lse=True)
        assert out[hit].isnan().all(), f"request {b}: affected rows must be NaN"
        if kind.startswith("v"):   # lse depends on the scores alone (IEEE): V reaches the output only
            assert torch.allclose(lse[hit].double(), ref_lse[hit], rtol=1e-3, atol=1e-3), f"request {b}: V reached lse"
        else:
            assert lse[hit].isnan().all(), f"request {b}: affected rows' lse must be NaN"
        assert not out[~hit].isnan().any() and not lse[~hit].isnan().any(), f"request {b}: NaN leaked"
        assert _err(out[~hit], ref[~hit]) < 1e-2
        assert (out[2] == 0).all() and (lse[2] == -math.inf).all(), "an empty request stays zeros, lse -inf"


# --- plan() is transactional ---------------------------------------------------------------------

@pytest.mark.parametrize("helper", [True, False], ids=["c-helper", "numpy"])
def test_a_failed_plan_leaves_the_last_plan_running(helper, monkeypatch):
    from meld.runtime import host_helper

    if not helper:
        monkeypatch.setattr(host_helper, "_lib", None)     # force the NumPy path
    pb = paged(lengths("skewed", 16), 16)
    kv = torch.randn(pb.num_pages, 2, 16, 8, 128, device=DEV).bfloat16()
    q = torch.randn(16, 32, 128, device=DEV).bfloat16()
    attn = meld.DecodeAttention(32, 8, 128, 16, torch.bfloat16, DEV, max_batch_size=16,
                                max_num_pages=pb.kv_indices.numel())
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    before, before_lse = attn.run(q, kv, return_lse=True)
    bad = pb.kv_indices.clone()
    bad[7] = -1
    big = paged([3000] * 20, 16)
    for args in [(pb.kv_indptr, bad, pb.kv_last_page_len),                  # bad page index (host)
                 tuple(t.to(DEV) for t in (pb.kv_indptr, bad, pb.kv_last_page_len)),   # (device)
                 (big.kv_indptr, big.kv_indices, big.kv_last_page_len)]:     # beyond the capacities
        with pytest.raises(ValueError):
            attn.plan(*args)
        out, lse = attn.run(q, kv, return_lse=True)
        assert torch.equal(out, before) and torch.equal(lse, before_lse)
    grow = meld.DecodeAttention(32, 8, 128, 16, torch.bfloat16, DEV)   # no capacities: a bad plan that
    grow.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)         # needed larger tables keeps the old
    tables = grow.tables
    bigger = paged([3000] * 80, 16)                                     # 80 requests > the first 64
    last = bigger.kv_last_page_len.clone()
    last[-1] = 0
    with pytest.raises(ValueError, match=r"kv_last_page_len\[79\]=0"):
        grow.plan(bigger.kv_indptr, bigger.kv_indices, last)
    assert grow.tables is tables
    assert torch.equal(grow.run(q, kv), before)


# --- determinism ----------------------------------------------------------------------------------

@pytest.mark.parametrize("op", [{}, dict(cluster_size=4), dict(kernel_config=_tma()), dict(batch_invariant=True)],
                         ids=["default", "clusters", "tma", "batch-invariant"])
def test_the_same_batch_is_bit_identical_run_to_run(op):
    pb = paged(lengths("skewed", 64), 16)
    kv = torch.randn(pb.num_pages, 2, 16, 8, 128, device=DEV).bfloat16()
    q = torch.randn(64, 32, 128, device=DEV).bfloat16()
    attn = meld.DecodeAttention(32, 8, 128, 16, torch.bfloat16, DEV, **op)
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    first = attn.run(q, kv, return_lse=True)
    for i in range(20):
        if i == 10:   # a re-plan of the same batch too
            attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
        out, lse = attn.run(q, kv, return_lse=True)
        assert torch.equal(out, first[0]) and torch.equal(lse, first[1]), f"run {i} differs"


# --- batch invariance -----------------------------------------------------------------------------

COMPOSITIONS = [[], lengths("skewed", 64), [512] * 63 + [65536], [2048] * 255, lengths("ragged", 40), [7, 100000]]


def _target_in_batches(attn, target_len, Hq, Hkv, D, P=16):
    """One request (the same q, the same KV pages) in every composition, at its start, middle and end:
    its out and lse each time, and the CTAs its pieces ran on."""
    g = torch.Generator().manual_seed(5)
    need = max(sum(-(-n // P) for n in c) for c in COMPOSITIONS) + -(-target_len // P)
    kv = torch.randn(need, 2, P, Hkv, D, device=DEV).bfloat16()
    q0 = torch.randn(Hq, D, device=DEV).bfloat16()
    own = torch.randperm(need, generator=g)[:-(-target_len // P)].to(torch.int32)
    results = []
    for others in COMPOSITIONS:
        for pos in sorted({0, len(others) // 2, len(others)}):
            pb = with_request(others, pos, target_len, own, P, need, g)
            q = torch.randn(len(others) + 1, Hq, D, device=DEV).bfloat16()
            q[pos] = q0
            attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
            assert_gpu_plan_matches_host(attn)
            out, lse = attn.run(q, kv, return_lse=True)
            it = attn.schedule.items()
            results.append((out[pos].clone(), lse[pos].clone(), tuple(it["cta"][it["req"] == pos].tolist())))
    return results


@pytest.mark.parametrize("target_len", [100000, 5000, 1000])
@pytest.mark.parametrize("shape", [(32, 8, 128), (128, 8, 128), (32, 8, 64), (16, 4, 256)], ids=str)
def test_batch_invariant_outputs_are_bit_identical_in_every_batch(target_len, shape):
    Hq, Hkv, D = shape
    attn = meld.DecodeAttention(Hq, Hkv, D, 16, torch.bfloat16, DEV, batch_invariant=True)
    results = _target_in_batches(attn, target_len, Hq, Hkv, D)
    assert len(results) >= 15
    for out, lse, _ in results:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])
    assert len({ctas for *_, ctas in results}) > 5, "the request must run on other CTAs in other batches"


def test_default_mode_is_not_batch_invariant():
    """The control: without batch_invariant the request is split by the batch and its bits move (so the
    test above can fail)."""
    attn = meld.DecodeAttention(32, 8, 128, 16, torch.bfloat16, DEV)
    results = _target_in_batches(attn, 100000, 32, 8, 128)
    assert any(not torch.equal(out, results[0][0]) for out, _, _ in results)


@pytest.mark.parametrize("B,dist", [(1, "skewed"), (8, "one-long"), (64, "skewed"), (256, "one-long"), (9, "ragged")])
@pytest.mark.parametrize("chunk", [256, 1024])
def test_batch_invariant_is_correct(B, dist, chunk):
    attn = check(B, dist, batch_invariant=True, cost=DecodeCost(invariant_chunk_tokens=chunk))
    assert attn.schedule.chunk_tokens == chunk


@pytest.mark.parametrize("options", [dict(kernel_config=_tma(batch_invariant=True)), dict(cluster_size=4),
                                     dict(group=16), dict(head_dim=256), dict(kv_layout="HND")])
def test_batch_invariant_with_options(options):
    check(64, "skewed", batch_invariant=True, **options)


# --- every kernel variant on a small grid (compute-sanitizer's racecheck) ---------------------------

VARIANTS = {
    "d64": dict(head_dim=64), "d128": {}, "d256": dict(head_dim=256), "h16": dict(group=16),
    "fp16": dict(dtype=torch.float16), "tma": dict(kernel_config=_tma()), "hnd": dict(kv_layout="HND"),
    "hnd-tma": dict(kv_layout="HND", kernel_config=_tma()),
    "dsmem": dict(cluster_size=2), "dsmem-tma": dict(cluster_size=2, kernel_config=_tma(onchip_merge=True)),
    "profile": dict(kernel_config=dataclasses.replace(DecodeKernelConfig.default("bfloat16", 128), profile=True)),
    "invariant": dict(batch_invariant=True, cost=DecodeCost(invariant_chunk_tokens=128)),
}


@pytest.mark.racecheck
@pytest.mark.parametrize("variant", VARIANTS)
def test_small_grid(variant):
    """Eight CTAs (four clusters of two where asked), a few split units and an empty request: every
    merge path of the variant, at a size racecheck finishes in seconds."""
    options = dict(VARIANTS[variant])
    group = options.pop("group", 4)
    attn = check(4, "ragged", lens=[700, 33, 0, 300], group=group, num_kv_heads=2,
                 topology=Topology(132, {1: 8, 2: 4}), **options)
    assert (attn.schedule.items()["slot"] >= 0).any()
