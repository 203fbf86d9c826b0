"""meld.codegen: every kernel configuration the tests and benchmarks use compiles for sm_90a with nvcc
(and NVRTC where it is installed), the parameter struct's host/device layouts agree (static_asserts
in the generated source), and the compile cache is keyed by content."""
import dataclasses
import re
import shutil

import pytest

from meld import config
from meld.codegen import compiler
from meld.codegen import (DECODE_PARAMS, CompileError, DecodeKernelConfig, DecodePlanKernelConfig, DecodeVariant,
                          compile_nvcc, compile_source)
from tests.kernel_matrix import nvcc

CONFIGS = [DecodeKernelConfig.default(dt, d) for dt in ("bfloat16", "float16") for d in (64, 128, 256)]
# The variants the GPU tests, MELD_PROFILE and bench/decode_ablation.py build.
CONFIGS += [dataclasses.replace(CONFIGS[1], profile=True), dataclasses.replace(CONFIGS[1], onchip_merge=True),
            dataclasses.replace(CONFIGS[1], onchip_merge=True, profile=True),
            DecodeKernelConfig.default("bfloat16", 64, onchip_merge=True)]
CONFIGS += [dataclasses.replace(c, tma=True) for c in CONFIGS[:2] + CONFIGS[4:5]]   # TMA rings (d64/d128)
CONFIGS += [dataclasses.replace(CONFIGS[2], tma=True),
            dataclasses.replace(CONFIGS[1], tma=True, onchip_merge=True, profile=True)]
# 16-head units (groups of 9-16): head_dim 64 and 128, with every option.
CONFIGS += [DecodeKernelConfig.default(dt, d, group_size=16) for dt in ("bfloat16", "float16") for d in (64, 128)]
CONFIGS += [DecodeKernelConfig.default("bfloat16", 128, onchip_merge=True, group_size=16),
            dataclasses.replace(DecodeKernelConfig.default("bfloat16", 128, group_size=16), tma=True, onchip_merge=True,
                                profile=True)]
# Batch-invariant kernels (chunked walk), every head dim and unit size, with TMA; the watchdog's debug build.
CONFIGS += [DecodeKernelConfig.default("bfloat16", d, group_size=g, batch_invariant=True)
            for d, g in ((64, 4), (128, 4), (256, 4), (128, 16))]
CONFIGS += [dataclasses.replace(DecodeKernelConfig.default("bfloat16", 128, batch_invariant=True), tma=True, profile=True),
            dataclasses.replace(CONFIGS[1], tma=True, debug_withhold_signal=True, watchdog_ms=200)]
# Sequence-parallel ranks (meld.distributed): the default builds, with clusters and TMA, 16-head units.
CONFIGS += [dataclasses.replace(CONFIGS[1], xrank="peer"), dataclasses.replace(CONFIGS[1], xrank="peer", onchip_merge=True),
            dataclasses.replace(CONFIGS[0], xrank="peer", tma=True),
            dataclasses.replace(DecodeKernelConfig.default("bfloat16", 128, group_size=16), xrank="peer"),
            dataclasses.replace(CONFIGS[1], xrank="peer", watchdog_ms=100)]
CONFIGS += [dataclasses.replace(CONFIGS[1], xrank="proxy"), dataclasses.replace(CONFIGS[1], xrank="proxy", onchip_merge=True),
            dataclasses.replace(DecodeKernelConfig.default("bfloat16", 128, group_size=16), xrank="proxy")]
# FP8 caches: every head dim and MMA type, TMA rings at every head dim (head_dim 64: 64-byte rows and swizzle),
# 16-head units with clusters, a profiled TMA build and a batch-invariant one.
FP8 = "float8_e4m3fn"
CONFIGS += [DecodeKernelConfig.default(dt, d, kv_dtype=FP8) for dt in ("bfloat16", "float16") for d in (64, 128, 256)]
CONFIGS += [dataclasses.replace(DecodeKernelConfig.default("bfloat16", d, kv_dtype=FP8), tma=True) for d in (64, 128, 256)]
CONFIGS += [DecodeKernelConfig.default("bfloat16", 128, onchip_merge=True, group_size=16, kv_dtype=FP8),
            dataclasses.replace(DecodeKernelConfig.default("float16", 64, group_size=16, kv_dtype=FP8), tma=True,
                                profile=True),
            DecodeKernelConfig.default("bfloat16", 128, batch_invariant=True, kv_dtype=FP8)]
# e5m2 caches (only the conversion differs from e4m3): both MMA types, cp.async and TMA rings (head_dim 64's
# 64-byte rows), 8- and 16-head units.
E5M2 = "float8_e5m2"
CONFIGS += [DecodeKernelConfig.default("bfloat16", 128, kv_dtype=E5M2),
            dataclasses.replace(DecodeKernelConfig.default("float16", 64, group_size=16, kv_dtype=E5M2), tma=True)]
# Decode variants (soft cap, sliding window): alone, together, with TMA rings, FP8, 16-head units, clusters and
# batch-invariant walks, at every head dim.
CAP, WIN, BOTH = DecodeVariant(50.0), DecodeVariant(window_left=100), DecodeVariant(30.0, 4095)
CONFIGS += [DecodeKernelConfig.default("bfloat16", 128, variant=CAP),
            DecodeKernelConfig.default("float16", 64, group_size=16, onchip_merge=True, variant=WIN),
            DecodeKernelConfig.default("bfloat16", 256, variant=BOTH),
            dataclasses.replace(DecodeKernelConfig.default("bfloat16", 128, variant=BOTH), tma=True, profile=True),
            dataclasses.replace(DecodeKernelConfig.default("bfloat16", 64, kv_dtype=FP8, variant=BOTH), tma=True),
            DecodeKernelConfig.default("float16", 128, batch_invariant=True, kv_dtype=FP8, variant=BOTH)]
# RoPE (16-bit caches): every head dim, with a cap and a window, TMA rings, 16-head units and batch-invariant walks.
ROPE = DecodeVariant(rope_theta=5e5, rope_scale=8.0)
CONFIGS += [DecodeKernelConfig.default("bfloat16", 128, variant=ROPE),
            dataclasses.replace(DecodeKernelConfig.default("float16", 64, group_size=16, variant=DecodeVariant(
                30.0, 4095, 1e4)), tma=True),
            DecodeKernelConfig.default("bfloat16", 256, batch_invariant=True, variant=ROPE)]
# RoPE over FP8 caches (keys rotated in registers): every head dim, both formats and MMA types (e5m2 with f16: halved
# keys), TMA rings, 16-head units with a cap and a window, a batch-invariant walk.
CONFIGS += [DecodeKernelConfig.default("bfloat16", 128, kv_dtype=FP8, variant=ROPE),
            dataclasses.replace(DecodeKernelConfig.default("float16", 64, group_size=16, kv_dtype=E5M2,
                                                           variant=DecodeVariant(30.0, 4095, 1e4)), tma=True),
            dataclasses.replace(DecodeKernelConfig.default("bfloat16", 256, kv_dtype=FP8, variant=ROPE), tma=True),
            DecodeKernelConfig.default("bfloat16", 128, group_size=16, batch_invariant=True, kv_dtype=FP8,
                                       variant=ROPE)]
# head_dim 512 (Q's fragments in shared memory, two warps): 16-bit and FP8 caches, both formats and MMA types, RoPE
# (in shared memory and in registers), a cap and a window, TMA rings, batch-invariant walks, multi-token rows.
CONFIGS += [DecodeKernelConfig.default("bfloat16", 512), DecodeKernelConfig.default("float16", 512, variant=ROPE),
            DecodeKernelConfig.default("float16", 512, kv_dtype=FP8, variant=ROPE),
            DecodeKernelConfig.default("float16", 512, kv_dtype=E5M2, variant=DecodeVariant(30.0, 4095, 1e4)),
            dataclasses.replace(DecodeKernelConfig.default("bfloat16", 512, kv_dtype=FP8, batch_invariant=True,
                                                           variant=BOTH), tma=True),
            dataclasses.replace(DecodeKernelConfig.default("float16", 512, group_size=16, q_len=2), tma=True,
                                profile=True)]
# FP8 caches with bf16 q on bf16 tensor cores (fp8_math="": the default builds above compute in f16): both formats,
# cp.async and TMA rings, every head dim, RoPE in registers (e5m2: halved keys), a cap and a window, 16-head units with
# clusters, batch-invariant walks, multi-token rows.
CONFIGS += [dataclasses.replace(c, fp8_math="") for c in (
    DecodeKernelConfig.default("bfloat16", 128, kv_dtype=FP8),
    dataclasses.replace(DecodeKernelConfig.default("bfloat16", 64, group_size=16, kv_dtype=E5M2), tma=True),
    dataclasses.replace(DecodeKernelConfig.default("bfloat16", 256, kv_dtype=FP8, variant=ROPE), tma=True),
    DecodeKernelConfig.default("bfloat16", 128, onchip_merge=True, group_size=16, kv_dtype=E5M2, variant=ROPE),
    DecodeKernelConfig.default("bfloat16", 128, batch_invariant=True, kv_dtype=FP8, variant=BOTH),
    dataclasses.replace(DecodeKernelConfig.default("bfloat16", 128, group_size=4, kv_dtype=E5M2, q_len=4), tma=True),
    DecodeKernelConfig.default("bfloat16", 512, kv_dtype=FP8, variant=ROPE),
    dataclasses.replace(DecodeKernelConfig.default("bfloat16", 512, kv_dtype=E5M2, batch_invariant=True,
                                                   variant=BOTH), tma=True))]
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")


@needs_nvcc
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_kernel_compiles_with_nvcc_for_sm90a(cfg):
    cubin, log = nvcc(cfg.render(), cfg.name)
    assert cubin[:4] == b"\x7fELF"
    assert "0 bytes spill stores" in log, log       # registers must not spill to local memory
    assert set(re.findall(r"(\d+) bytes stack frame", log)) == {"0"}, log   # nor keep arrays in local memory
    assert cfg.smem_bytes <= 227 * 1024


@pytest.mark.parametrize("cfg", CONFIGS[:3] + [c for c in CONFIGS if c.kv_dtype and c.head_dim == 64 and c.tma][:1] +
                         [DecodeKernelConfig.default("bfloat16", 128, kv_dtype=FP8)] +
                         [c for c in CONFIGS if c.kv_dtype and c.dtype == "bfloat16" and not c.fp8_math][:1],
                         ids=lambda c: c.name)
def test_kernel_compiles_with_nvrtc(cfg):
    pytest.importorskip("cuda.bindings.nvrtc")
    with config.scope(MELD_COMPILER="nvrtc"):
        c = compile_source(cfg.render(), cfg.name)
    assert c.cubin[:4] == b"\x7fELF" and c.compiler.startswith("nvrtc")


@pytest.mark.parametrize("token_requests", [False, True])
@pytest.mark.parametrize("compiler", ["nvcc", "nvrtc"])
def test_planner_compiles(compiler, token_requests):
    """The GPU planner, with both compilers: NVRTC (what run time uses) rejects some C++ nvcc accepts; and its
    build for DecodeMLA's multi-token decode."""
    pc = DecodePlanKernelConfig(token_requests=token_requests)
    assert pc.name == "meld_decode_plan_t1024" + ("_tokens" if token_requests else "")
    if compiler == "nvcc":
        if shutil.which("nvcc") is None:
            pytest.skip("nvcc is not on PATH")
        cubin, log = nvcc(pc.render(), pc.name)
        assert "0 bytes spill stores" in log, log
    else:
        pytest.importorskip("cuda.bindings.nvrtc")
        with config.scope(MELD_COMPILER="nvrtc"):
            cubin = compile_source(pc.render(), pc.name).cubin
    assert cubin[:4] == b"\x7fELF"


def test_nvrtc_leaves_python_objects_alone(tmp_path):
    """NVRTC writes its log and cubin into buffers we pass: they must be our own, never a shared bytes
    object (an empty log once overwrote CPython's cached b" " with a NUL, process-wide)."""
    pytest.importorskip("cuda.bindings.nvrtc")
    space = bytes([32])
    with config.scope(MELD_COMPILER="nvrtc", MELD_CACHE_DIR=str(tmp_path)):
        c = compile_source('extern "C" __global__ void meld_empty() {}', "meld_empty")
    assert c.log == "" and c.cubin[:4] == b"\x7fELF"
    assert space == b"\x20" and space * 3 == b"   ", "a cached bytes object was overwritten"


@needs_nvcc
def test_layout_mismatch_fails_to_compile():
    cfg = CONFIGS[1]
    off = DECODE_PARAMS.ctype.v.offset
    bad = cfg.render().replace(f"DecodeParams, v) == {off},", f"DecodeParams, v) == {off + 8},")
    assert bad != cfg.render()
    with pytest.raises(CompileError, match="host and device layouts differ"):
        compile_nvcc(bad, cfg.name, "sm_90a")


def test_cache_hits_and_keys_on_content(tmp_path, monkeypatch):
    cfg = CONFIGS[1]
    with config.scope(MELD_CACHE_DIR=str(tmp_path)):
        first = compile_source(cfg.render(), cfg.name)
        other = compile_source(cfg.render() + "\n// changed\n", cfg.name)
        monkeypatch.setattr(compiler, "_compile_nvrtc", None)       # a hit must not compile
        monkeypatch.setattr(compiler, "compile_nvcc", None)
        again = compile_source(cfg.render(), cfg.name)
    assert again == first                                            # the same cubin, source and log
    cubins = sorted(p.name for p in tmp_path.glob("*.cubin"))
    assert len(cubins) == 2 and all(n.startswith(cfg.name) for n in cubins)
    assert len(list(tmp_path.glob("*.cu"))) == 2 and len(list(tmp_path.glob("*.log"))) == 2   # kept beside each
    assert other.cubin[:4] == b"\x7fELF"


@needs_nvcc
def test_cache_keeps_the_nvcc_log(tmp_path, monkeypatch):
    """A hit returns ptxas's log as the compile left it (the CPU tests check its spills); an entry without
    a log (written before logs were kept) compiles again."""
    src = 'extern "C" __global__ void meld_empty() {}'
    with config.scope(MELD_COMPILER="nvcc", MELD_CACHE_DIR=str(tmp_path)):
        first = compile_source(src, "meld_empty")
        (log,) = tmp_path.glob("*.log")
        log.unlink()
        again = compile_source(src, "meld_empty")
        monkeypatch.setattr(compiler, "compile_nvcc", None)
        hit = compile_source(src, "meld_empty")
    assert "0 bytes spill stores" in first.log and first.compiler.startswith("nvcc")
    assert log.exists() and hit == again and "0 bytes spill stores" in hit.log   # (nvcc's logs carry timings)


def test_config_rejects_unsupported():
    with pytest.raises(ValueError, match="head_dim=96"):
        DecodeKernelConfig("bfloat16", 96)
    with pytest.raises(ValueError, match="dtype"):
        DecodeKernelConfig("float32", 128)
    with pytest.raises(ValueError, match="shared memory"):
        DecodeKernelConfig("bfloat16", 256, 8, 2)   # 256 KiB of rings
    with pytest.raises(ValueError, match="batch_invariant kernels merge through global memory"):
        DecodeKernelConfig("bfloat16", 128, 8, 2, onchip_merge=True, batch_invariant=True)
    with pytest.raises(ValueError, match="debug_withhold_signal needs tma=True"):
        DecodeKernelConfig("bfloat16", 128, debug_withhold_signal=True)
    with pytest.raises(ValueError, match="watchdog_ms=0"):
        DecodeKernelConfig("bfloat16", 128, watchdog_ms=0)
    with pytest.raises(ValueError, match=r"kv_dtype='float8_e4m3fnuz': expected one of \('', 'float8_e4m3fn', "
                                         r"'float8_e5m2'\)"):
        DecodeKernelConfig("bfloat16", 128, kv_dtype="float8_e4m3fnuz")
    with pytest.raises(ValueError, match="xrank kernels read 16-bit caches"):
        DecodeKernelConfig("bfloat16", 128, kv_dtype=FP8, xrank="peer")


def test_params_pack_checks_fields():
    with pytest.raises(TypeError, match="missing"):
        DECODE_PARAMS.pack(q=0)


def test_dump_dir_gets_every_stage(tmp_path):
    """(On a cache hit too: the run's cache may hold this kernel already.)"""
    import torch

    import meld
    from meld.workloads import paged

    dump = tmp_path / "dump"
    with config.scope(MELD_DUMP_DIR=str(dump)):
        attn = meld.DecodeAttention(8, 2, 64, 16, torch.bfloat16, "cpu")
        pb = paged([100, 7], 16)
        attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
        cfg = attn.kernel_config
        compile_source(cfg.render(), cfg.name)
    names = {p.name for p in dump.iterdir()}
    assert {"decode_attention.taskgraph.json", "decode_attention.schedule.json", f"{cfg.name}.cu",
            f"{cfg.name}.cubin"} <= names


def test_every_wait_site_in_the_templates_is_named():
    """A kernel's watchdog record names what it waited for by a site number; the host describes it from
    watchdog.SITES, so every number a template passes needs its entry."""
    import re
    from importlib import resources

    from meld.runtime.watchdog import SITES

    text = "".join(f.read_text() for f in resources.files("meld.codegen").joinpath("templates").iterdir()
                   if f.name.endswith(".cuh"))
    used = {int(n) for pattern in (r"_site\(p, (\d+)", r"watchdog_kernel, (\d+)") for n in re.findall(pattern, text)}
    assert {10, 12, 16} <= used and used <= set(SITES), sorted(used - set(SITES))


def test_no_generic_lambdas_in_the_templates():
    """NVRTC 13.0, the runtime compiler on the GPU machines, takes a generic lambda's call operator
    (`[&](auto x)`) in device code for a host function and rejects the kernel; nvcc 13.0 and NVRTC 13.5,
    which the CPU tests have, accept it. So the templates use none (a template member function instead)."""
    import re
    from importlib import resources

    hits = [f"{f.name}: {m.group(0)}" for f in resources.files("meld.codegen").joinpath("templates").iterdir()
            if f.name.endswith((".cuh", ".h")) for m in re.finditer(r"\]\s*\([^)]*\bauto\b[^)]*\)", f.read_text())]
    assert not hits, hits


def test_every_kernel_struct_carries_the_kernel_header_once():
    from meld.codegen import params as P

    structs = [P.DECODE_PARAMS, P.MLA_PARAMS, P.MOE_PARAMS, P.TP_PARAMS, P.EP_PARAMS]
    for s in structs:
        names = [f.name for f in s.fields]
        assert all(names.count(n) == 1 for n in P.KERNEL_HEADER), s.name
        assert all(f is P.KERNEL_HEADER[f.name] for f in s.fields if f.name in P.KERNEL_HEADER), s.name
    with pytest.raises(ValueError, match="KERNEL_HEADER"):   # a header field declared a second time, elsewhere
        P._with_header("Bad", [P.Field("watchdog", "ptr", "void*")])
    with pytest.raises(ValueError, match="KERNEL_HEADER"):
        P._with_header("Bad", [*P.header("prof"), *P.header("prof")])


def test_single_gpu_decode_builds_carry_no_rank_fields():
    from meld.codegen import params as P

    assert not [f.name for f in P.DECODE_PARAMS.fields if f.name.startswith("x")]
    assert {"xreq", "xpeers", "x_rank", "x_world", "xring"} <= {f.name for f in P.SEQ_PARALLEL_DECODE_PARAMS.fields}
    single, ranked = DecodeKernelConfig(), dataclasses.replace(DecodeKernelConfig(), xrank="proxy")
    assert single.params is P.DECODE_PARAMS and ranked.params is P.SEQ_PARALLEL_DECODE_PARAMS
    from meld.codegen.source import template

    edge = template("decode_xrank.cuh")
    assert edge not in single.render() and edge in ranked.render()
