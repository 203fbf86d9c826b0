"""Multi-token decode (`DecodeAttention(q_len=...)`, FlashInfer's q_len_per_req) without a GPU: the CPU reference
executor against a float64 causal reference, the q_len > 1 builds compiled by nvcc for sm_90a, the planner's
rows, the FlashInfer wrapper's rules, and bad input naming the argument."""
import dataclasses
import warnings

import pytest
import torch

import meld
from meld.codegen import DecodeKernelConfig, DecodeVariant
from meld.compat.flashinfer import BatchDecodeWithPagedKVCacheWrapper
from meld.runtime.reference import attention_reference
from meld.scheduler import DecodeCost, Topology
from meld.workloads import lengths, paged
from tests.kernel_matrix import nvcc

_TOPO = Topology(24, {1: 48})


def _batch(lens, q_len, Hq=8, Hkv=2, D=64, P=16, kv_dtype=torch.bfloat16):
    pb = paged(lens, P)
    kv = torch.randn(pb.num_pages, 2, P, Hkv, D).to(kv_dtype)
    q = torch.randn(len(lens) * q_len, Hq, D).bfloat16()
    return pb, kv, q


def _error(out, ref) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("q_len", [1, 2, 4, 8])   # (3: the FlashInfer wrapper's test)
@pytest.mark.parametrize("Hq,Hkv,P", [(8, 2, 16), (32, 8, 16), (6, 2, 1), (32, 1, 64)])
def test_cpu_executor_matches_causal_reference(q_len, Hq, Hkv, P):
    """Poisoned outputs all written, split units merged, each new token masked at its own position; groups whose
    rows fill one unit, part of one (6 q heads), and several (32 q heads over one kv head)."""
    lens = [3000, q_len, 800, 9, 1500, 17]
    pb, kv, q = _batch(lens, q_len, Hq, Hkv, P=P)
    attn = meld.DecodeAttention(Hq, Hkv, 64, P, torch.bfloat16, "cpu", q_len=q_len, topology=_TOPO)
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    items = attn.schedule.validate().items()
    assert (items["slot"] >= 0).any(), "the test must exercise split units and merges"
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"))
    attn.run(q, kv, out=out, lse=lse)
    ref, ref_lse = attention_reference(q, kv, pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len, q_len=q_len)
    assert not out.isnan().any() and not lse.isnan().any()
    assert _error(out, ref) < 1e-2
    assert (lse.double() - ref_lse).abs().max().item() < 1e-5
    if q_len > 1:   # the mask matters: the same rows without it are far off
        flat, _ = attention_reference(q.view(len(lens), q_len, Hq, 64)[:, -1], kv, pb.kv_indptr, pb.kv_indices,
                                      pb.kv_last_page_len)
        first = out.view(len(lens), q_len, Hq, 64)[1, 0]   # request 1 (kv_len = q_len): its first token sees key 0
        assert _error(first, ref.view(len(lens), q_len, Hq, 64)[1, 0]) < 1e-2
        assert _error(out.view(len(lens), q_len, Hq, 64)[:, -1], flat) < 1e-2   # the last token: plain decode


@pytest.mark.parametrize("options", [
    dict(kv_layout="HND"), dict(kv_dtype=torch.float8_e4m3fn), dict(logits_soft_cap=5.0), dict(batch_invariant=True),
    dict(separate=True),
])
def test_variants_with_q_len(options):
    """The variants that work with q_len > 1, against the float64 reference of the same cache."""
    options = dict(options)
    separate = options.pop("separate", False)
    fp8 = options.get("kv_dtype") is torch.float8_e4m3fn
    lens = lengths("skewed", 6)
    pb, kv, q = _batch(lens, 4, kv_dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
    attn = meld.DecodeAttention(8, 2, 64, 16, torch.bfloat16, "cpu", q_len=4, topology=_TOPO, **options)
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    cache = kv.transpose(2, 3).contiguous() if options.get("kv_layout") == "HND" else kv
    scales = dict(k_scale=0.5, v_scale=2.0) if fp8 else {}
    out, lse = attn.run(q, (cache[:, 0], cache[:, 1]) if separate else cache, return_lse=True, **scales)
    ref_kv = kv.double() * torch.tensor([0.5, 2.0]).view(1, 2, 1, 1, 1).double() if fp8 else kv
    cap = options.get("logits_soft_cap", 0.0)
    ref, ref_lse = attention_reference(q, ref_kv, pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len, q_len=4,
                                       logits_soft_cap=cap)
    if cap:
        plain, _ = attention_reference(q, kv, pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len, q_len=4)
        assert _error(plain, ref) > 1e-2, "the cap must move the result"
    assert _error(out, ref) < 1e-2
    assert (lse.double() - ref_lse).abs().max().item() < 1e-5


def test_nan_reaches_exactly_the_rows_that_see_it():
    """NaN in q: that (request, token, q head) row; NaN in K at a new token's position: the rows of that token and
    the later ones of its request and kv head, out and lse; other rows untouched."""
    lens, q_len, Hq, Hkv = [40, 300, 2000], 4, 8, 2
    pb, kv, q = _batch(lens, q_len, Hq, Hkv)
    attn = meld.DecodeAttention(Hq, Hkv, 64, 16, torch.bfloat16, "cpu", q_len=q_len, topology=_TOPO)
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    q[1 * q_len + 2, 5] = float("nan")                       # request 1, token 2, q head 5
    pos = lens[2] - q_len + 1                                # request 2's key seen by its tokens 1, 2, 3 only
    page = int(pb.kv_indices[int(pb.kv_indptr[2]) + pos // 16])
    kv[page, 0, pos % 16, 1] = float("nan")                  # kv head 1: q heads 4-7
    out, lse = attn.run(q, kv, return_lse=True)
    bad = torch.zeros(len(lens) * q_len, Hq, dtype=torch.bool)
    bad[1 * q_len + 2, 5] = True
    bad[2 * q_len + 1:3 * q_len, 4:] = True
    assert torch.equal(out.isnan().any(-1), bad) and torch.equal(lse.isnan(), bad)
    ref, _ = attention_reference(q.nan_to_num(0.0), kv.nan_to_num(0.0), pb.kv_indptr, pb.kv_indices,
                                 pb.kv_last_page_len, q_len=q_len)
    assert _error(out[~bad], ref[~bad]) < 1e-2


def test_rows_choose_the_unit_and_the_cost():
    """A kv head's rows are its q heads x q_len: they pick the unit size (16-row units above 8 rows, 32-row units
    above 16 with several tokens, and with them DecodeCost.default(16)'s larger item overhead: more rows, more compute
    per piece, the same KV bytes) and the units per request; the planner's line is in KV tokens either way."""
    for Hq, q_len, hpu, blocks in ((32, 1, 8, 1), (32, 2, 8, 1), (32, 4, 16, 1), (32, 8, 32, 1), (256, 1, 16, 2),
                                   (64, 8, 32, 2)):
        attn = meld.DecodeAttention(Hq, 8, 128, 16, torch.bfloat16, "cpu", q_len=q_len)
        assert (attn.heads_per_unit, attn.head_blocks, attn.units_per_request) == (hpu, blocks, 8 * blocks)
        assert attn.cost == DecodeCost.default(hpu) and attn.kernel_config.q_len == q_len
    attn = meld.DecodeAttention(64, 8, 128, 16, torch.bfloat16, "cpu", q_len=8)
    pb = paged([100, 5000], 16)
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    s = attn.schedule.validate()
    assert s.group_size == 64 and s.heads_per_item == 32 and s.num_units == 2 * 16
    assert attn.describe_unit(3) == "request 0, kv head 1, rows 96-127 (q heads 12-15 of its 8 new tokens)"


# The q_len > 1 builds: the GPU tests' (Hq 32 / Hkv 8, head_dim 128, q_len 2, 4, 8; 8 with clusters' on-chip merges,
# TMA rings and profiling; 8 with 16-row units, bench/decode.py's meld-h16) and the variants with q_len (FlashInfer's
# q_len 3 over groups of 8, FP8 with TMA rings, soft cap, batch invariance, head_dim 256 and 64; 32-row units over
# FP8 and at head_dim 64).
BUILDS = [DecodeKernelConfig.default("bfloat16", 128, group_size=4, q_len=q) for q in (2, 4, 8)]
BUILDS += [dataclasses.replace(DecodeKernelConfig.default("bfloat16", 128, onchip_merge=True, group_size=4, q_len=8),
                               tma=True, profile=True)]
BUILDS += [DecodeKernelConfig.default("bfloat16", 128, group_size=4, q_len=8, heads_per_unit=16),
           DecodeKernelConfig.default("bfloat16", 128, group_size=4, q_len=8, kv_dtype="float8_e4m3fn"),
           DecodeKernelConfig.default("float16", 64, group_size=8, q_len=3, batch_invariant=True,
                                      variant=DecodeVariant(30.0)),
           dataclasses.replace(DecodeKernelConfig.default("bfloat16", 256, group_size=4, q_len=4,
                                                          kv_dtype="float8_e4m3fn"), tma=True)]


def test_32_row_units_merge_in_passes_that_fit():
    """32-row units of head_dim 128 merge 8 rows a pass, which is what leaves room for eight warps (six beside the
    on-chip merge area); merging all 32 at once would not fit eight, and a pass must divide the unit's rows. Q's
    fragments (8 KiB) live in the merge area, so they take no room of their own; batch-invariant builds, whose chunks
    merge while Q is still needed, keep them after it."""
    cfg = DecodeKernelConfig.default("bfloat16", 128, group_size=4, q_len=8)
    assert (cfg.heads_per_unit, cfg.merge_rows, cfg.num_warps) == (32, 8, 8)
    assert DecodeKernelConfig.default("bfloat16", 128, onchip_merge=True, group_size=4, q_len=8).num_warps == 6
    with pytest.raises(ValueError, match="needs 268304 bytes of shared memory"):
        dataclasses.replace(cfg, merge_rows=0)
    assert dataclasses.replace(cfg, batch_invariant=True).smem_bytes == cfg.smem_bytes + 32 * 8 * 32   # (Q: 8 KiB)
    with pytest.raises(ValueError, match="merge_rows=16: expected 0 .* dividing heads_per_unit=8"):
        DecodeKernelConfig(heads_per_unit=8, merge_rows=16)
    assert DecodeKernelConfig.default("bfloat16", 128, group_size=4).merge_rows == 0   # one token: one pass


@pytest.mark.parametrize("q_len", [4, 8])
def test_decode_sweep_multi_token_variants_are_valid_distinct_builds(q_len):
    """bench/decode_sweep.py --q-len: every variant a build the operator takes, no two the same, the default among
    them, and 32-row ones only where a kv head has more than 16 rows."""
    from bench.decode_sweep import multi_token_configs

    cfgs = multi_token_configs(q_len)
    assert len({c.name for c in cfgs.values()}) == len(cfgs)
    assert cfgs["default"] == DecodeKernelConfig.default("bfloat16", 128, group_size=4, q_len=q_len)
    assert all(c.heads_per_unit <= 16 for c in cfgs.values()) == (q_len == 4)
    for cfg in cfgs.values():
        meld.DecodeAttention(32, 8, 128, 16, torch.bfloat16, "cpu", q_len=q_len, kernel_config=cfg)


def test_decode_sweep_cost_variants_are_distinct_valid_models():
    """bench/decode_sweep.py --q-len 8 --costs: the default model first, then distinct ones the operator takes."""
    from bench.decode_sweep import multi_token_costs

    costs = multi_token_costs(8)
    assert costs["default"] == DecodeCost.default(32) and len(set(costs.values())) == len(costs)
    for cost in costs.values():
        meld.DecodeAttention(32, 8, 128, 16, torch.bfloat16, "cpu", q_len=8, cost=cost)


@pytest.mark.parametrize("cfg", BUILDS, ids=lambda c: c.name)
def test_q_len_builds_compile_for_sm90a(cfg):
    cubin, log = nvcc(cfg.render(), cfg.name)
    assert cubin and "0 bytes spill stores" in log and "0 bytes stack frame" in log, log


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(q_len=0), ValueError, "q_len must be an int from 1 to 8 .*got 0"),
    (dict(q_len=9), ValueError, "q_len must be an int from 1 to 8 .*got 9"),
    (dict(q_len=2.0), ValueError, "q_len must be an int from 1 to 8 .*got 2.0"),
    (dict(q_len=True), ValueError, "q_len must be an int from 1 to 8 .*got True"),
    (dict(q_len=2, window_left=64), ValueError, "q_len=2 with window_left=64"),
    (dict(q_len=4, pos_encoding_mode="ROPE_LLAMA"), ValueError, "q_len=4 with pos_encoding_mode='ROPE_LLAMA'"),
    (dict(q_len=2, kernel_config=DecodeKernelConfig.default("bfloat16", 64)), ValueError, "q_len=1, kv_dtype=''; the operator is .*q_len=2"),
])
def test_bad_construction_names_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        meld.DecodeAttention(8, 2, 64, 16, torch.bfloat16, "cpu", **kwargs)


def test_bad_plan_and_run_name_the_argument_and_change_nothing():
    lens = [40, 300]
    pb, kv, q = _batch(lens, 4)
    attn = meld.DecodeAttention(8, 2, 64, 16, torch.bfloat16, "cpu", q_len=4, topology=_TOPO)
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    before = attn.run(q, kv)
    short = paged([40, 3], 16)
    with pytest.raises(ValueError, match=r"kv_indptr and kv_last_page_len give request 1 3 KV tokens, fewer than "
                                         r"q_len=4: .*empty KV range"):
        attn.plan(short.kv_indptr, short.kv_indices, short.kv_last_page_len)
    with pytest.raises(ValueError, match=r"kv_last_page_len\[1\]=17 is outside"):   # a bad table's own error first
        attn.plan(short.kv_indptr, short.kv_indices, torch.tensor([8, 17], dtype=torch.int32))
    assert torch.equal(attn.run(q, kv), before), "a plan() that raised changed the plan"
    with pytest.raises(ValueError, match=r"q must have shape \(8, 8, 64\) \(batch of the last plan\(\) x q_len=4"):
        attn.run(q[:2], kv)
    with pytest.raises(ValueError, match=r"lse must have shape \(8, 8\) \(batch \* q_len \(q_len=4\)"):
        attn.run(q, kv, lse=torch.empty(2, 8))


def _wrapper(**kw):
    return BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), "NHD", **kw)


@pytest.mark.parametrize("q_len", [2, 3])
def test_flashinfer_wrapper_q_len_per_req(q_len):
    """FlashInfer's multi-token decode through the wrapper on CPU tensors: q [batch * q_len_per_req, ...], causal,
    lse in base 2."""
    lens = [q_len, 128, 64, 100, 33]   # FlashInfer's own test's lengths, the tightest legal one first
    pb, kv, q = _batch(lens, q_len, 16, 2)
    w = _wrapper(use_tensor_cores=True)
    w.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len, 16, 2, 64, 16, q_data_type=torch.bfloat16,
           q_len_per_req=q_len)
    out, lse = w.run(q, kv, return_lse=True)
    ref, ref_lse = attention_reference(q, kv, pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len, q_len=q_len)
    assert _error(out, ref) < 1e-2
    assert (lse.double() - ref_lse / torch.log(torch.tensor(2.0)).double()).abs().max().item() < 1e-4
    with pytest.raises(ValueError, match=f"q implies q_len_per_req=1 .* but plan\\(\\) used {q_len}"):
        w.run(q[:len(lens)], kv)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert torch.equal(w.run(q, kv, q_len_per_req=q_len), out)
    assert any(issubclass(x.category, DeprecationWarning) for x in seen)
    with pytest.raises(ValueError, match=f"q_len_per_req=1 but plan\\(\\) used {q_len}"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w.run(q, kv, q_len_per_req=1)


def test_flashinfer_wrapper_q_len_rules():
    """FlashInfer 0.6.18's rules (ValueError: CUDA-core decode, a request shorter than q_len_per_req, a CUDA-graph
    wrapper's frozen q_len_per_req) and meld's refusals (NotImplementedError: more than 8, with a window or RoPE)."""
    pb = paged([20, 40], 16)
    table = (pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len, 8, 2, 64, 16)
    with pytest.raises(ValueError, match="use_tensor_cores"):
        _wrapper().plan(*table, q_len_per_req=2)
    one = paged([1, 40], 16)   # request 0 holds 1 token
    with pytest.raises(ValueError, match="empty KV range"):
        _wrapper(use_tensor_cores=True).plan(one.kv_indptr, one.kv_indices, one.kv_last_page_len, *table[3:],
                                             q_len_per_req=2)
    for kw, match in ((dict(q_len_per_req=9), "q_len_per_req=9 is not supported"),
                      (dict(q_len_per_req=2, window_left=16), "q_len_per_req=2 is not supported: .*sliding window"),
                      (dict(q_len_per_req=2, pos_encoding_mode="ROPE_LLAMA"), "q_len_per_req=2 is not supported")):
        with pytest.raises(NotImplementedError, match=match):
            _wrapper(use_tensor_cores=True).plan(*table, **kw)
    ints = dict(dtype=torch.int32)
    graph = _wrapper(use_tensor_cores=True, use_cuda_graph=True, paged_kv_indptr_buffer=torch.empty(3, **ints),
                     paged_kv_indices_buffer=torch.empty(8, **ints), paged_kv_last_page_len_buffer=torch.empty(2, **ints))
    graph.plan(*table, q_len_per_req=2)
    graph.plan(*table, q_len_per_req=2)   # the same value re-plans
    with pytest.raises(ValueError, match="frozen"):
        graph.plan(*table, q_len_per_req=3)
    assert graph._op.q_len == 2


def test_torch_op_with_q_len():
    """torch.ops.meld.decode_attention takes q [B * q_len, ...] (opcheck: schema, fake implementation, autograd
    registration)."""
    pb, kv, q = _batch([20, 300], 2)
    attn = meld.DecodeAttention(8, 2, 64, 16, torch.bfloat16, "cpu", q_len=2, topology=_TOPO)
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    torch.library.opcheck(torch.ops.meld.decode_attention.default,
                          (q, kv, torch.empty_like(q), torch.empty(4, 8), attn.handle))
