"""MLA decode attention without a GPU: the kernel compiled by nvcc (and NVRTC) for sm_90a without spills,
the schedule the shared planner cuts for its 64-head units and 64-token blocks, the CPU reference executor
running that schedule against float64 attention, non-finite inputs, and bad input."""
import shutil

import numpy as np
import pytest
import torch

import meld
from meld import config
from meld.codegen import compile_source
from meld.codegen.mla_kernel import MlaKernelConfig
from meld.runtime.reference import mla_reference
from meld.workloads import lengths, paged
from tests.kernel_matrix import nvcc

SCALE = 192 ** -0.5


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("cfg", [MlaKernelConfig(), MlaKernelConfig(profile=True), MlaKernelConfig(watchdog_ms=50),
                                 MlaKernelConfig(schedule="seesaw"), MlaKernelConfig(schedule="seesaw", profile=True),
                                 MlaKernelConfig(schedule="split"), MlaKernelConfig(schedule="split", profile=True),
                                 MlaKernelConfig.for_cache("float8_e4m3fn"),
                                 MlaKernelConfig.for_cache("float8_e4m3fn", profile=True),
                                 MlaKernelConfig.for_cache("float8_e4m3fn", num_stages=3),
                                 MlaKernelConfig(profile=True, phases=True),
                                 MlaKernelConfig(schedule="seesaw", profile=True, phases=True),
                                 MlaKernelConfig(schedule="split", profile=True, phases=True),
                                 MlaKernelConfig.for_cache("float8_e4m3fn", profile=True, phases=True)],
                         ids=lambda c: c.name)
def test_kernel_compiles_with_nvcc_for_sm90a_without_spills(cfg):
    """No spills, no local arrays (unprofiled builds: an accumulator array indexed by a loop variable lands in
    local memory without a spill; the profiler's records take 8 bytes), and no wgmma that ptxas serialises (C7520:
    a wgmma in flight across divergent code)."""
    cubin, log = nvcc(cfg.render(), cfg.name)
    assert cubin[:4] == b"\x7fELF"
    spills = [line for line in log.splitlines() if "spill stores" in line]
    assert spills and all(" 0 bytes spill stores" in line for line in spills), log
    assert cfg.profile or all(line.strip().startswith("0 bytes stack frame") for line in spills), log
    assert "serialized" not in log, log
    assert cfg.smem_bytes <= 227 * 1024


def test_seesaw_build():
    """The seesaw: 64-token blocks in two stages, P in each stage's rope box (no P buffer), a full mbarrier
    per box; the setmaxnreg budget checked in the source; the default build's source does not name it."""
    cfg = MlaKernelConfig(schedule="seesaw")
    assert (cfg.stages, cfg.name) == (2, "meld_mla_decode_bf16_b64_s2_seesaw")
    assert cfg.smem_bytes < MlaKernelConfig().smem_bytes
    assert "#define MLA_SEESAW 1" in cfg.render() and "MLA_SEESAW 1" not in MlaKernelConfig().render()
    assert "static_assert(LOAD_REGS + 2 * MATH_REGS <= 3 * (65536 / 384 / 8 * 8)" in cfg.render()


def test_halves_build():
    """The halves, the default build of a bf16 cache: 64-token blocks in two stages in the split build's shared
    memory (its statistics in Stats' room); 32-token blocks and FP8 caches run the split schedule; the other builds'
    sources do not name it."""
    cfg = MlaKernelConfig()
    assert cfg == MlaKernelConfig(schedule="halves")
    assert (cfg.stages, cfg.name) == (2, "meld_mla_decode_bf16_b64_s2_halves")
    assert cfg.smem_bytes == MlaKernelConfig(schedule="split").smem_bytes
    assert MlaKernelConfig(block_tokens=32).schedule == "split"
    assert MlaKernelConfig.for_cache("float8_e4m3fn").schedule == "split"
    assert "#define MLA_HALVES 1" in cfg.render()
    for other in (MlaKernelConfig(schedule="split"), MlaKernelConfig(schedule="seesaw")):
        assert "MLA_HALVES 1" not in other.render()


def test_phases_build():
    """The phase stamps' build (a diagnostic): profiled, its sums' shared memory beside the barriers, the stages of
    the plain build; its profile records include every role's phases; the plain build's source defines no clock."""
    import dataclasses

    from meld.runtime.profile import PHASES

    for plain in (MlaKernelConfig(), MlaKernelConfig(schedule="seesaw"), MlaKernelConfig(schedule="split"),
                  MlaKernelConfig.for_cache("float8_e4m3fn")):
        cfg = dataclasses.replace(plain, profile=True, phases=True)
        assert "_phases" in cfg.name and (cfg.stages, cfg.raw_stages) == (plain.stages, plain.raw_stages)
        assert cfg.smem_bytes == plain.smem_bytes + 4 * 3 * len(PHASES)
        assert cfg.phase_records == 3 * len(PHASES) and plain.phase_records == 0
        assert "#define MLA_PHASES 1" in cfg.render() and "MLA_PHASES 1" not in plain.render()


@pytest.mark.parametrize("kwargs,match", [
    (dict(schedule="pingpong"), "schedule='pingpong': expected one of \\('split', 'seesaw', 'halves'\\)"),
    (dict(phases=True), "phases=True needs profile=True"),
    (dict(schedule="seesaw", block_tokens=32), "block_tokens=32: the seesaw schedule runs 64-token blocks"),
    (dict(schedule="halves", block_tokens=32), "block_tokens=32: the halves schedule runs 64-token blocks"),
    (dict(schedule="halves", kv_dtype="float8_e4m3fn", block_tokens=32), "an FP8 cache runs the split schedule"),
])
def test_bad_kernel_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MlaKernelConfig(**kwargs)


def test_kernel_compiles_with_nvrtc(tmp_path):
    pytest.importorskip("cuda.bindings.nvrtc")
    cfg = MlaKernelConfig()
    with config.scope(MELD_COMPILER="nvrtc", MELD_CACHE_DIR=str(tmp_path)):
        assert compile_source(cfg.render(), cfg.name).cubin[:4] == b"\x7fELF"


def _inputs(lens, H, P, seed=0):
    g = torch.Generator().manual_seed(seed)
    pb = paged(lens, P, generator=g)
    B = len(lens)
    ckv = torch.randn(pb.num_pages, P, 512, generator=g).bfloat16()
    kpe = torch.randn(pb.num_pages, P, 64, generator=g).bfloat16()
    qn = (torch.randn(B, H, 512, generator=g) / 3 ** 0.5).bfloat16()
    qp = (torch.randn(B, H, 64, generator=g) / 3 ** 0.5).bfloat16()
    return pb, qn, qp, ckv, kpe


@pytest.mark.parametrize("lens,H,P", [
    ([0, 1, 63, 64, 65, 700, 3000, 20000], 128, 64),   # empties, block edges, split units
    ([65536], 128, 64),                                 # one request over every CTA
    ([5, 300, 2048, 9000], 100, 16),                    # a head count no multiple of 64, small pages
    ([1, 40, 4097], 16, 128),                           # one padded unit, pages of two blocks
])
def test_cpu_executor_matches_float64(lens, H, P):
    pb, qn, qp, ckv, kpe = _inputs(lens, H, P)
    mla = meld.DecodeMLA(H, P, torch.bfloat16, "cpu", sm_scale=SCALE)
    mla.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    out, lse = mla.run(qn, qp, ckv, kpe, return_lse=True)
    ref, ref_lse = mla_reference(qn, qp, ckv, kpe, pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len, SCALE)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert (lse.double() - ref_lse)[finite].abs().max().item() < 1e-4


@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("dist", ["uniform2k", "skewed", "one-long"])
def test_the_gpu_tests_plan_check_holds_on_the_host_plan(dist, q_len):
    """tests/gpu_checks.py's oracle comparison (what every MLA GPU test asserts first) on the host planner's
    plan: head-major schedules against the oracle's plan of the requests repeated (it once compared them with the
    request-major plan, and every MLA GPU test failed)."""
    from tests.gpu_checks import assert_plan_matches_oracle

    pb = paged(lengths(dist, 16), 64)
    mla = meld.DecodeMLA(128, 64, torch.bfloat16, "cpu", sm_scale=SCALE, q_len=q_len)
    mla.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    assert assert_plan_matches_oracle(mla).head_major


def test_schedule_cuts_whole_blocks_and_covers_every_token():
    """The shared planner on the MLA unit: one unit per request and 64 heads, every cut inside a unit on a
    64-token block, every token of every unit in exactly one piece, split units' slots distinct."""
    lens = lengths("skewed", 64)
    pb = paged(lens, 64)
    mla = meld.DecodeMLA(128, 64, torch.bfloat16, "cpu", sm_scale=SCALE)
    mla.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    s = mla.schedule.validate()
    it = s.items()
    assert s.units_per_request == 2 and s.heads_per_item == 64
    assert (it["kv_begin"] % 64 == 0).all()
    assert s.head_major   # unit u: q heads 64 (u // B) on of request u % B
    assert ((it["kv_end"] % 64 == 0) | (it["kv_end"] == np.tile(lens, 2)[it["unit"]])).all()
    assert np.array_equal(it["req"], it["unit"] % len(lens)) and np.array_equal(it["q_head"], it["unit"] // len(lens) * 64)
    covered = np.zeros(len(lens) * 2, dtype=np.int64)
    np.add.at(covered, it["unit"], it["kv_end"] - it["kv_begin"])
    assert np.array_equal(covered, np.tile(lens, 2))
    slots = it["slot"][it["slot"] >= 0]
    assert len(set(slots.tolist())) == len(slots)


def test_non_finite_inputs_reach_exactly_their_rows():
    pb, qn, qp, ckv, kpe = _inputs([300, 5000, 64], 128, 64)
    qn[0, 3, 7] = float("nan")
    page = int(pb.kv_indices[pb.kv_indptr[2]])
    ckv[page, 5, 1] = float("inf")
    mla = meld.DecodeMLA(128, 64, torch.bfloat16, "cpu", sm_scale=SCALE)
    mla.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    out, lse = mla.run(qn, qp, ckv, kpe, return_lse=True)
    bad = torch.zeros(3, 128, dtype=torch.bool)
    bad[0, 3] = True
    bad[2] = True
    assert torch.equal(torch.isnan(out).all(-1), bad) and torch.equal(torch.isnan(out).any(-1), bad)
    assert torch.equal(torch.isnan(lse), bad)


def test_inputs_that_require_grad_run_and_backward_says_there_is_none():
    pb, qn, qp, ckv, kpe = _inputs([100, 3000], 128, 64)
    mla = meld.DecodeMLA(128, 64, torch.bfloat16, "cpu", sm_scale=SCALE)
    mla.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    want = mla.run(qn, qp, ckv, kpe)
    qg = torch.nn.Parameter(qn.clone())
    out = mla.run(qg, qp, ckv, kpe)
    assert torch.equal(out, want) and out.requires_grad
    with pytest.raises(NotImplementedError, match="no backward"):
        out.float().sum().backward()


def test_describe_unit():
    mla = meld.DecodeMLA(100, 64, torch.bfloat16, "cpu", sm_scale=SCALE)
    assert mla.describe_unit(3) == "unit 3 is out of range: the plans so far have no units (no plan so far)"
    pb = paged([5, 70], 64)
    mla.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    assert mla.describe_unit(3) == "request 1, q heads 64-99"
    assert "out of range" in mla.describe_unit(4) and "units 0-3" in mla.describe_unit(-1)


@pytest.mark.parametrize("kwargs,match", [
    (dict(page_size=48), "page_size must be 8, 16, 32 or a multiple of 64, got 48"),
    (dict(page_size=0), "page_size"),
    (dict(num_heads=0), "num_heads"),
    (dict(dtype=torch.float16), "dtype must be torch.bfloat16"),
    (dict(head_dim_ckv=256), "head_dim_ckv=256"),
    (dict(sm_scale=float("nan")), "sm_scale"),
    (dict(max_batch_size=0), "max_batch_size"),
])
def test_bad_construction(kwargs, match):
    args = dict(num_heads=128, page_size=64, dtype=torch.bfloat16, device="cpu", sm_scale=SCALE) | kwargs
    with pytest.raises(ValueError, match=match):
        meld.DecodeMLA(**args)


def test_sm_scale_is_required():
    with pytest.raises(TypeError, match="sm_scale"):
        meld.DecodeMLA(128, 64, torch.bfloat16, "cpu")


def test_bad_run_inputs_name_the_argument():
    pb, qn, qp, ckv, kpe = _inputs([100, 70], 128, 64)
    mla = meld.DecodeMLA(128, 64, torch.bfloat16, "cpu", sm_scale=SCALE, max_batch_size=4)
    with pytest.raises(RuntimeError, match="call plan"):
        mla.run(qn, qp, ckv, kpe)
    mla.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    cases = [
        ((qn[:1], qp, ckv, kpe), "q_nope must have shape"),
        ((qn, qp.float(), ckv, kpe), "q_pe must have dtype"),
        ((qn, qp, ckv[:, :32], kpe), "ckv_cache must have shape"),
        ((qn, qp, ckv, kpe[:1]), "pages but kpe_cache"),
        ((qn, qp, ckv[:1], kpe[:1]), "reference page"),
        ((qn, qp, ckv.transpose(0, 1).contiguous().transpose(0, 1), kpe), "ckv_cache must hold"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            mla.run(*args)
    with pytest.raises(ValueError, match="out must have shape"):
        mla.run(qn, qp, ckv, kpe, out=torch.empty(2, 128, 256, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="exceeds max_batch_size=4"):
        big = paged([1] * 5, 64)
        mla.plan(big.kv_indptr, big.kv_indices, big.kv_last_page_len)
    # the plan that raised left the last one in place
    assert mla.run(qn, qp, ckv, kpe).shape == (2, 128, 512)


def test_graph_lowers_to_the_mla_family():
    mla = meld.DecodeMLA(128, 64, torch.bfloat16, "cpu", sm_scale=SCALE)
    assert mla.lowering.family == "mla_decode" and mla.lowering.combiner == "online_softmax"


# --- multi-token decode (q_len new tokens per request) ------------------------------------------------------------
_TOPO = meld.scheduler.Topology(16)   # (a small grid: split units and merges at lengths the executor runs quickly)


def _mtp(lens, q_len, H=64, P=16, seed=0):
    """A batch whose q_nope and q_pe hold q_len rows per request, and its operator planned."""
    pb, _, _, ckv, kpe = _inputs(lens, H, P, seed)
    g = torch.Generator().manual_seed(seed + 1)
    qn = (torch.randn(len(lens) * q_len, H, 512, generator=g) / 3 ** 0.5).bfloat16()
    qp = (torch.randn(len(lens) * q_len, H, 64, generator=g) / 3 ** 0.5).bfloat16()
    mla = meld.DecodeMLA(H, P, torch.bfloat16, "cpu", sm_scale=SCALE, q_len=q_len, topology=_TOPO)
    mla.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    return mla, pb, qn, qp, ckv, kpe


@pytest.mark.parametrize("q_len,H,P", [(2, 64, 16), (4, 100, 64), (8, 16, 8)])
def test_multi_token_matches_the_causal_float64_reference(q_len, H, P):
    """Poisoned outputs all written, split units merged, each new token masked at its own position: lengths off the
    64-token blocks, a request of exactly q_len tokens (its first token sees key 0 alone)."""
    lens = [1500, q_len, 77, 130, 900]
    mla, pb, qn, qp, ckv, kpe = _mtp(lens, q_len, H, P)
    s = mla.schedule.validate()
    assert (s.items()["slot"] >= 0).any(), "the test must exercise split units and merges"
    assert np.array_equal(s.kv_len, [n - q_len + 1 + t for n in lens for t in range(q_len)])
    out = torch.full_like(qn, float("nan"))
    lse = torch.full(qn.shape[:2], float("nan"))
    mla.run(qn, qp, ckv, kpe, out=out, lse=lse)
    ref, ref_lse = mla_reference(qn, qp, ckv, kpe, pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len, SCALE, q_len)
    assert not out.isnan().any() and not lse.isnan().any()
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2
    assert (lse.double() - ref_lse).abs().max().item() < 1e-5
    # the mask matters: without it every token would equal the last one's (plain decode over all keys)
    last = slice(q_len - 1, None, q_len)
    flat, _ = mla_reference(qn[last], qp[last], ckv, kpe, pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len, SCALE)
    assert ((out[last].double() - flat).norm() / flat.norm()).item() < 1e-2
    assert (out[0::q_len].double() - flat).norm() / flat.norm() > 1e-1


def test_multi_token_nan_in_one_q_row_reaches_that_row_only():
    lens, q_len = [300, 4, 1000], 4
    mla, pb, qn, qp, ckv, kpe = _mtp(lens, q_len)
    qp[1 * q_len + 2, 5, 3] = float("nan")   # request 1, new token 2, q head 5
    out, lse = mla.run(qn, qp, ckv, kpe, return_lse=True)
    bad = torch.zeros(len(lens) * q_len, 64, dtype=torch.bool)
    bad[1 * q_len + 2, 5] = True
    assert torch.equal(out.isnan().all(-1), bad) and torch.equal(out.isnan().any(-1), bad)
    assert torch.equal(lse.isnan(), bad)


@pytest.mark.parametrize("dist", ["uniform2k", "skewed", "one-long"])
@pytest.mark.parametrize("batch", [1, 8, 128])
def test_the_two_head_blocks_of_a_request_run_on_ctas_half_the_grid_apart(dist, batch):
    """Head-major planning: with the line's halves alike, CTA c + active / 2 runs exactly CTA c's pieces for the
    other 64 heads, so the two read each KV block at the same time (once from DRAM, then L2)."""
    lens = np.asarray(lengths(dist, batch))
    pb = paged(lens, 64)
    mla = meld.DecodeMLA(128, 64, torch.bfloat16, "cpu", sm_scale=SCALE)
    mla.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    s = mla.schedule
    it, half = s.items(), s.meta["active_ctas"] // 2
    assert s.meta["active_ctas"] % 2 == 0
    hb = it["q_head"] // 64
    pieces = [sorted(zip(it["cta"][hb == h] - h * half, it["req"][hb == h], it["kv_begin"][hb == h],
                         it["kv_end"][hb == h])) for h in (0, 1)]
    assert len(pieces[0]) and pieces[0] == pieces[1]


def test_multi_token_units_and_their_names():
    mla, *_ = _mtp([5, 70], 2, H=100, P=64)
    assert mla.schedule.num_units == 2 * 2 * 2 and mla.shape_bucket == "H100/C512/R64/P64/q2"
    # head-major: units 0-3 are the four planned requests' (request, new token) heads 0-63, units 4-7 their 64-99
    assert mla.describe_unit(3) == "request 1, new token 1 of 2, q heads 0-63"
    assert mla.describe_unit(5) == "request 0, new token 1 of 2, q heads 64-99"
    assert "units 0-7" in mla.describe_unit(8)


@pytest.mark.parametrize("q_len", [0, 9, 2.0, True])
def test_multi_token_bad_q_len(q_len):
    with pytest.raises(ValueError, match=f"q_len must be an int from 1 to 8 .*got {q_len!r}"):
        meld.DecodeMLA(128, 64, torch.bfloat16, "cpu", sm_scale=SCALE, q_len=q_len)


def test_multi_token_bad_plan_and_run_name_the_argument_and_change_nothing():
    mla, pb, qn, qp, ckv, kpe = _mtp([40, 300], 4)
    before = mla.run(qn, qp, ckv, kpe)
    short = paged([40, 3], 16)
    with pytest.raises(ValueError, match=r"kv_indptr and kv_last_page_len give request 1 3 KV tokens, fewer than "
                                         r"q_len=4: .*empty KV range"):
        mla.plan(short.kv_indptr, short.kv_indices, short.kv_last_page_len)
    assert torch.equal(mla.run(qn, qp, ckv, kpe), before), "a plan() that raised changed the plan"
    with pytest.raises(ValueError, match=r"q_nope must have shape \(8, 64, 512\) \(batch of the last plan\(\) x "
                                         r"q_len=4, num_heads, head_dim_ckv\)"):
        mla.run(qn[:2], qp, ckv, kpe)
    with pytest.raises(ValueError, match=r"q_pe must have shape \(8, 64, 64\)"):
        mla.run(qn, qp[:2], ckv, kpe)
    with pytest.raises(ValueError, match=r"lse must have shape \(8, 64\) \(batch \* q_len \(q_len=4\)"):
        mla.run(qn, qp, ckv, kpe, lse=torch.empty(2, 64))
