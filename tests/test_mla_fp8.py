"""MLA decode over an e4m3 latent cache without a GPU: the FP8 build's layout (its nvcc compile is in
tests/test_mla_cpu.py) and the bf16 build's source untouched by it, the CPU executor against float64 attention over the dequantised
cache, NaN in the cache, and bad input: the scale, an FP8 cache where bf16 is expected and the reverse. The GPU
tests are tests/test_mla_fp8_gpu.py; `fp8_inputs` is theirs too."""
import pytest
import torch

import meld
from meld.codegen.mla_kernel import MlaKernelConfig
from meld.compat.flashinfer import BatchMLAPagedAttentionWrapper
from meld.ops.torch_ops import decode_mla
from meld.runtime.reference import mla_reference
from meld.workloads import paged

SCALE = 192 ** -0.5
E4M3 = torch.float8_e4m3fn
KV_SCALE = 0.02   # the cache holds values ~50 (of e4m3's 448): a scale as a calibrated cache's


def fp8_inputs(lens, H, P, seed=0, device="cpu", q_len=1, kv_scale=KV_SCALE):
    """A batch's page table, q (q_len rows a request, bf16) and one e4m3 cache [pages, P, 576] (latent then rope
    channels: FlashMLA's combined row) whose values stand for ~N(0, 1) at `kv_scale`; one byte in 64 is an e4m3
    subnormal (codes 1-7, either sign), which the conversion must keep."""
    g = torch.Generator().manual_seed(seed)
    pb = paged(lens, P, generator=g)
    cache = (torch.randn(pb.num_pages, P, 576, generator=g) / kv_scale).to(E4M3)
    sub = torch.randint(0, 64, cache.shape, generator=g) == 0
    codes = torch.randint(1, 8, cache.shape, generator=g, dtype=torch.uint8) \
        | torch.randint(0, 2, cache.shape, generator=g, dtype=torch.uint8) << 7   # (either sign)
    cache.view(torch.uint8)[sub] = codes[sub]
    rows = len(lens) * q_len
    qn = (torch.randn(rows, H, 512, generator=g) / 3 ** 0.5).bfloat16()
    qp = (torch.randn(rows, H, 64, generator=g) / 3 ** 0.5).bfloat16()
    return pb, qn.to(device), qp.to(device), cache.to(device)


def fp8_reference(pb, qn, qp, cache, kv_scale=KV_SCALE, q_len=1):
    """float64 MLA over the dequantised cache (cache x kv_scale, keys and values alike), computed where the inputs
    are (a GPU's float64 is quick), returned on the CPU."""
    deq = cache.double() * kv_scale
    out, lse = mla_reference(qn, qp, deq[..., :512], deq[..., 512:], pb.kv_indptr, pb.kv_indices,
                             pb.kv_last_page_len, SCALE, q_len=q_len)
    return out.cpu(), lse.cpu()


def rel_err(out, ref):
    return ((out.cpu().double() - ref).norm() / ref.norm()).item()


def test_fp8_build_layout():
    """32-token blocks, two bf16 stages and four FP8 staging stages beside Q and P, within an SM's shared memory
    (its compile without spills: tests/test_mla_cpu.py)."""
    cfg = MlaKernelConfig.for_cache("float8_e4m3fn")
    assert (cfg.block_tokens, cfg.stages, cfg.raw_stages) == (32, 2, 4) and cfg.smem_bytes <= 227 * 1024


def test_fp8_build_is_compile_time():
    """The FP8 build names itself and defines MLA_KV_FP8; the bf16 builds' source does not name it."""
    cfg = MlaKernelConfig.for_cache("float8_e4m3fn")
    assert cfg.name == "meld_mla_decode_bf16_b32_s2_e4m3_r4"
    assert "#define MLA_KV_FP8 1" in cfg.render() and "#define RAW_STAGES 4" in cfg.render()
    assert "#define MLA_KV_FP8" not in MlaKernelConfig().render()
    assert MlaKernelConfig.for_cache("") == MlaKernelConfig()
    # its Q.K^T is an e4m3 wgmma (m64n32k32, K from the staging stage); no bf16 build emits one
    assert "m64n32k32.f32.e4m3.e4m3" in cfg.render()
    assert not any("e4m3.e4m3" in c.render() for c in (MlaKernelConfig(), MlaKernelConfig(block_tokens=32)))


@pytest.mark.parametrize("kwargs,match", [
    (dict(kv_dtype="float8_e5m2"), "kv_dtype='float8_e5m2': expected one of"),
    (dict(kv_dtype="float8_e4m3fn"), "block_tokens=64: an FP8 cache runs the split schedule on 32-token blocks"),
    (dict(kv_dtype="float8_e4m3fn", block_tokens=32, num_stages=4), "num_stages=4: .* two FP8 staging stages"),
])
def test_bad_fp8_kernel_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MlaKernelConfig(**kwargs)


@pytest.mark.parametrize("lens,H,P", [
    ([0, 1, 31, 33, 700, 3001, 6000], 128, 64),    # empties, 32-token block edges, split units
    ([5, 300, 2047, 9000], 100, 16),               # a head count no multiple of 64, small pages
    ([1, 40, 4097], 16, 8),                        # one padded unit, 8-token pages
])
def test_cpu_executor_matches_float64_over_the_dequantised_cache(lens, H, P):
    pb, qn, qp, cache = fp8_inputs(lens, H, P)
    mla = meld.DecodeMLA(H, P, torch.bfloat16, "cpu", sm_scale=SCALE, kv_dtype=E4M3)
    mla.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    out, lse = mla.run(qn, qp, cache[..., :512], cache[..., 512:], return_lse=True, kv_scale=KV_SCALE)
    ref, ref_lse = fp8_reference(pb, qn, qp, cache)
    assert rel_err(out, ref) < 2e-2
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert (lse.double() - ref_lse)[finite].abs().max().item() < 1e-4
    # two tensors instead of the views; the torch op; the same values
    two = mla.run(qn, qp, cache[..., :512].contiguous(), cache[..., 512:].contiguous(), kv_scale=KV_SCALE)
    assert torch.equal(two, out)
    assert torch.equal(decode_mla(mla, qn, qp, cache[..., :512], cache[..., 512:], kv_scale=KV_SCALE), out)


def test_multi_token_fp8_matches_the_causal_reference():
    lens, H, P = [2, 65, 900], 128, 64
    pb, qn, qp, cache = fp8_inputs(lens, H, P, q_len=2)
    mla = meld.DecodeMLA(H, P, torch.bfloat16, "cpu", sm_scale=SCALE, kv_dtype=E4M3, q_len=2)
    mla.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    out = mla.run(qn, qp, cache[..., :512], cache[..., 512:], kv_scale=KV_SCALE)
    ref, _ = fp8_reference(pb, qn, qp, cache, q_len=2)
    assert rel_err(out, ref) < 2e-2


def test_nan_in_the_cache_reaches_exactly_its_request():
    """An e4m3 NaN (0x7f) in one token's latent: every head of its request NaN (out and lse), the rest finite."""
    lens = [300, 5000, 64]
    pb, qn, qp, cache = fp8_inputs(lens, 128, 64)
    page = int(pb.kv_indices[pb.kv_indptr[1] + 2])
    cache.view(torch.uint8)[page, 7, 100] = 0x7F
    mla = meld.DecodeMLA(128, 64, torch.bfloat16, "cpu", sm_scale=SCALE, kv_dtype=E4M3)
    mla.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    out, lse = mla.run(qn, qp, cache[..., :512], cache[..., 512:], return_lse=True, kv_scale=KV_SCALE)
    bad = torch.zeros(3, 128, dtype=torch.bool)
    bad[1] = True
    assert torch.equal(torch.isnan(out).all(-1), bad) and torch.equal(torch.isnan(out).any(-1), bad)
    assert torch.equal(torch.isnan(lse), bad)


def test_flashinfer_wrapper_takes_the_fp8_cache():
    """kv_data_type=float8_e4m3fn plans the FP8 build; run()'s ckv_scale = kpe_scale dequantise it."""
    lens, H, P = [5, 0, 70, 33], 16, 16
    pb, qn, qp, cache = fp8_inputs(lens, H, P)
    w = BatchMLAPagedAttentionWrapper(torch.empty(16, dtype=torch.uint8))
    kv_len = torch.tensor(lens, dtype=torch.int32)
    w.plan(torch.arange(len(lens) + 1, dtype=torch.int32), pb.kv_indptr, pb.kv_indices, kv_len, H, 512, 64, P,
           False, SCALE, torch.bfloat16, E4M3)
    out = w.run(qn, qp, cache[..., :512], cache[..., 512:], ckv_scale=KV_SCALE, kpe_scale=KV_SCALE)
    ref, _ = fp8_reference(pb, qn, qp, cache)
    assert rel_err(out, ref) < 2e-2
    with pytest.raises(NotImplementedError, match="kpe_scale=None"):
        w.run(qn, qp, cache[..., :512], cache[..., 512:], ckv_scale=KV_SCALE)
    with pytest.raises(ValueError, match="ckv_cache must have dtype torch.float8_e4m3fn"):
        w.run(qn, qp, cache[..., :512].bfloat16(), cache[..., 512:].bfloat16())


def _ops():
    pb, qn, qp, cache = fp8_inputs([100, 700], 128, 64)
    fp8 = meld.DecodeMLA(128, 64, torch.bfloat16, "cpu", sm_scale=SCALE, kv_dtype=E4M3)
    bf16 = meld.DecodeMLA(128, 64, torch.bfloat16, "cpu", sm_scale=SCALE)
    for op in (fp8, bf16):
        op.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    return fp8, bf16, qn, qp, cache


@pytest.mark.parametrize("scale,match", [
    (float("nan"), "kv_scale must be a finite number, got nan"),
    (float("inf"), "kv_scale must be a finite number, got inf"),
    (0.0, "kv_scale must be positive"),
    (-0.5, "kv_scale must be positive"),
    (torch.tensor(0.5), "kv_scale must be a finite number, got tensor"),
    (torch.ones(2), "kv_scale must be a finite number, got tensor"),
    ("0.5", "kv_scale must be a finite number, got '0.5'"),
    (1e39, "kv_scale must have a magnitude below"),
])
def test_bad_scale_is_named_and_changes_nothing(scale, match):
    fp8, _, qn, qp, cache = _ops()
    before = fp8.run(qn, qp, cache[..., :512], cache[..., 512:], kv_scale=KV_SCALE)
    with pytest.raises(ValueError, match=match):
        fp8.run(qn, qp, cache[..., :512], cache[..., 512:], kv_scale=scale)
    with pytest.raises(ValueError, match=match):
        decode_mla(fp8, qn, qp, cache[..., :512], cache[..., 512:], kv_scale=scale)
    assert torch.equal(fp8.run(qn, qp, cache[..., :512], cache[..., 512:], kv_scale=KV_SCALE), before)


def test_fp8_cache_to_a_bf16_operator_and_the_reverse_are_named():
    fp8, bf16, qn, qp, cache = _ops()
    with pytest.raises(ValueError, match="ckv_cache must have dtype torch.bfloat16, got torch.float8_e4m3fn"):
        bf16.run(qn, qp, cache[..., :512], cache[..., 512:])
    with pytest.raises(ValueError, match="kv_scale=0.5: the scale dequantises an FP8 cache"):
        bf16.run(qn, qp, cache[..., :512].bfloat16(), cache[..., 512:].bfloat16(), kv_scale=0.5)
    with pytest.raises(ValueError, match="ckv_cache must have dtype torch.float8_e4m3fn, got torch.bfloat16"):
        fp8.run(qn, qp, cache[..., :512].bfloat16(), cache[..., 512:].bfloat16())
    with pytest.raises(ValueError, match="kpe_cache must have dtype torch.float8_e4m3fn, got torch.bfloat16"):
        fp8.run(qn, qp, cache[..., :512], cache[..., 512:].bfloat16())


@pytest.mark.parametrize("kwargs,match", [
    (dict(kv_dtype=torch.float8_e5m2), "kv_dtype must be None .* or torch.float8_e4m3fn, got torch.float8_e5m2"),
    (dict(kv_dtype=torch.float16), "kv_dtype must be None"),
    (dict(kv_dtype="float8_e4m3fn"), "kv_dtype must be None"),
    (dict(kv_dtype=E4M3, kernel_config=MlaKernelConfig()), "kernel_config reads kv_dtype=''"),
    (dict(kernel_config=MlaKernelConfig.for_cache("float8_e4m3fn")), "kernel_config reads kv_dtype='float8_e4m3fn'"),
])
def test_bad_fp8_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        meld.DecodeMLA(128, 64, torch.bfloat16, "cpu", sm_scale=SCALE, **kwargs)
