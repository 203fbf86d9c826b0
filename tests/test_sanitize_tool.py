"""tools/sanitize.py on the CPU: the compute-sanitizer log parser and classifier on synthetic logs in the
formats compute-sanitizer prints, the verdict per shard and for the run, shard dealing, and one run of
main() end to end with a fake compute-sanitizer wrapping CPU tests (no GPU, no real sanitizer)."""
import importlib.util
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "tools" / "sanitize.py"
_spec = importlib.util.spec_from_file_location("meld_tools_sanitize", _PATH)
san = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = san          # dataclasses resolve their module through sys.modules
_spec.loader.exec_module(san)


def log(body: str) -> str:
    return textwrap.dedent(body).strip("\n") + "\n"


CLEAN = log("""
    ========= COMPUTE-SANITIZER
    ========= ERROR SUMMARY: 0 errors
""")
PROC_ADDRESS = log('''
    ========= Program hit CUDA_ERROR_INVALID_VALUE (error 1) due to "invalid argument" on CUDA API call to cuGetProcAddress.
    =========     Saved host backtrace up to driver entry point at error
    =========         Host Frame: cuGetProcAddress [0x2f1a20] in libcuda.so.1
    =========         Host Frame: cudaGetDriverEntryPoint [0x5b2c1] in libcudart.so.13
    =========''')
PROC_ADDRESS_V2 = PROC_ADDRESS.replace("cuGetProcAddress.", "cuGetProcAddress_v2.")
MELD_READ = log("""
    ========= Invalid __global__ read of size 4 bytes
    =========     at meld_decode_attention+0x1a30 in meld_decode_attention_bf16_d128.cu:412
    =========     by thread (37,0,0) in block (5,0,0)
    =========     Access to 0x7f0a3c001000 is out of bounds
    =========     and is 1 bytes after the nearest allocation at 0x7f0a3c000000 of size 4,095 bytes
    =========     Saved host backtrace up to driver entry point at kernel launch time
    =========         Host Frame: cuLaunchKernelEx [0x2f6a10] in libcuda.so.1
    =========         Host Frame: _PyEval_EvalFrameDefault [0x1a2b3c] in python3.12
    =========""")
TORCH_INIT = log("""
    ========= Uninitialized __global__ memory read of size 4 bytes
    =========     at void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MaxOps<float>, unsigned int, float, 4>>(T3)+0x1c0 in Reduce.cuh:1047
    =========     by thread (0,0,0) in block (0,0,0)
    =========     Address 0x7f0a3c000200
    =========     Saved host backtrace up to driver entry point at kernel launch time
    =========         Host Frame: cudaLaunchKernel [0x6e3a1] in libcudart.so.13
    =========""")
RACE = log("""
    ========= COMPUTE-SANITIZER
    ========= Error: Race reported between Write access at meld_decode_attention+0x3f0 in meld_decode_attention_bf16_d128.cu:220
    =========     and Read access at meld_decode_attention+0x5c0 in meld_decode_attention_bf16_d128.cu:231 [256 hazards]
    =========
    ========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)
""")
PYTEST_OK = log("""
    tests/test_decode_gpu.py::test_batches[uniform2k-1] PASSED                [ 50%]
    tests/test_decode_gpu.py::test_batches[uniform2k-7] PASSED                [100%]

    ============================== 2 passed in 12.34s ==============================
""")


def shard(tool="memcheck", rc=0, log_text=CLEAN, out=PYTEST_OK, **kw):
    s = san.Shard(tool, 1, 1, ["tests/test_decode_gpu.py::test_batches[uniform2k-1]"], f"{tool}-shard1.log",
                  f"{tool}-shard1.out", rc=rc, **kw)
    return san.judge(s, log_text, out)


def verdict(*shards):
    return san.exit_status([san.ToolResult(s.tool, san.MARKERS[s.tool], len(s.ids), [], [s]) for s in shards])


def test_a_clean_log_passes():
    s = shard(log_text=CLEAN)
    assert s.report.error_summary == 0 and s.report.blocks == []
    assert s.problems == [] and verdict(s) == 0


def test_an_invalid_read_in_meld_decode_attention_fails():
    text = "========= COMPUTE-SANITIZER\n" + MELD_READ + "========= ERROR SUMMARY: 1 error\n"
    s = shard(log_text=text)
    [b] = s.report.blocks
    assert b.category == "meld" and b.kernel == "meld_decode_attention"
    assert b.header == "Invalid __global__ read of size 4 bytes"
    assert len(b.lines) == 8                      # the whole block, verbatim, to its last host frame
    assert any("error(s) in meld kernels" in p for p in s.problems)
    assert verdict(s) == 1
    md = san.markdown([san.ToolResult("memcheck", "gpu and not trap", 1, [], [s])], "h")
    assert "at meld_decode_attention+0x1a30" in md and "| memcheck | 1 | 1 |" in md and "**FAIL**" in md


def test_cugetprocaddress_api_errors_only_are_filtered_and_pass():
    text = ("========= COMPUTE-SANITIZER\n" + PROC_ADDRESS + PROC_ADDRESS_V2 + PROC_ADDRESS
            + "========= ERROR SUMMARY: 3 errors\n")
    s = shard(log_text=text)
    assert [b.category for b in s.report.blocks] == ["filtered"] * 3
    assert [b.api_call for b in s.report.blocks] == ["cuGetProcAddress", "cuGetProcAddress_v2", "cuGetProcAddress"]
    assert s.report.unaccounted() == 0
    assert s.problems == [] and verdict(s) == 0


@pytest.mark.parametrize("variant", [
    ("cuGetProcAddress.", "cuMemAlloc."),                                    # another API
    ("cuGetProcAddress.", "cuGetProcAddress_v3."),                           # not the two names
    ("CUDA_ERROR_INVALID_VALUE (error 1) due to \"invalid argument\"",       # another error
     "CUDA_ERROR_NOT_FOUND (error 500) due to \"named symbol not found\""),
])
def test_the_filter_is_narrow(variant):
    text = PROC_ADDRESS.replace(*variant) + "========= ERROR SUMMARY: 1 error\n"
    [b] = san.parse_log(text).blocks
    assert b.category == "other"


def test_a_racecheck_hazard_in_a_meld_kernel_fails():
    s = shard("racecheck", log_text=RACE)
    [b] = s.report.blocks
    assert b.category == "meld" and b.kernel == "meld_decode_attention"
    assert b.functions == ["meld_decode_attention", "meld_decode_attention"]
    assert s.report.race_summary == [1, 1, 0] and s.report.unaccounted() == 0
    assert verdict(s) == 1


def test_a_racecheck_hazard_between_meld_device_functions_fails():
    """Reports of warp-specialised kernels name namespaced device functions, not the meld_ kernel (the MLA
    kernel's races were filed as other errors and passed)."""
    race = RACE.replace("at meld_decode_attention+0x3f0", "at meld::mla_value(const MlaParams &, const meld::"
                        "UnitWalk &, unsigned int)+0x14c0").replace(
        "at meld_decode_attention+0x5c0", "at meld::mla_score(const MlaParams &, meld::Stats &)+0x910")
    s = shard("racecheck", log_text=race)
    [b] = s.report.blocks
    assert b.category == "meld" and b.kernel.startswith("meld::mla_value")
    assert verdict(s) == 1
    assert not san.is_meld("at::native::vectorized_elementwise_kernel<4>") and not san.is_meld("meldx::f()")


def test_a_racecheck_hazard_in_the_older_format_is_attributed_too():
    old = RACE.replace("at meld_decode_attention+0x3f0 in meld_decode_attention_bf16_d128.cu:220",
                       "at 0x000003f0 in /tmp/meld_decode_attention.cu:220:meld_decode_attention")
    assert san.parse_log(old).blocks[0].functions[0] == "meld_decode_attention"


@pytest.mark.parametrize("block,kernel", [
    # the format of the documentation's example, "at <kernel>():0x<offset>"
    (["Invalid __global__ write of size 4 bytes", "    at meld_decode_plan():0x160 in plan.cu:6"],
     "meld_decode_plan()"),
    # the location split over two lines, the source in the second
    (["Invalid __shared__ read of size 16 bytes", "    at meld_decode_attention+0x70",
      "       in /tmp/meld_decode_attention.cu:53"], "meld_decode_attention"),
    # a non-inlined helper at the top of the device backtrace, the meld kernel below it
    (["Barrier error detected. Divergent thread(s) in warp", "    at cp_async_wait_all+0x30 in common.cuh:88",
      "    by thread (37,0,0) in block (0,0,0)", "    Device Frame:cp_async_wait_all+0x30 in common.cuh:88",
      "    Device Frame:meld_decode_attention+0x900 in meld.cu:301"], "meld_decode_attention"),
    # two " at "s in one line: the location is the last one
    (["Deadlock detected in Cuda::barrier wait called by threads starting at (0,0,0) in block (0,0,0), (active "
      + "mask: 0xffffffff), barrier address: 0x0 at meld_decode_attention+0x1190 in meld.cu:98"],
     "meld_decode_attention"),
])
def test_meld_kernels_are_found_in_every_location_format(block, kernel):
    text = "".join(f"========= {line}\n" for line in block) + "=========\n========= ERROR SUMMARY: 1 error\n"
    [b] = san.parse_log(text).blocks
    assert b.category == "meld" and b.kernel == kernel


def test_lines_that_only_look_like_locations_name_no_function():
    text = log("""
        ========= Host API memory access error at host access to 0x7f7941430200 of size 16 bytes
        =========     Uninitialized access at 0x7f7941430200 on access by cudaMemcpy source
        =========     Saved host backtrace up to driver entry point at error
        =========         Host Frame: cudaMemcpy [0x4f2a1] in libcudart.so.13
        =========""")
    [b] = san.parse_log(text).blocks
    assert b.functions == [] and b.category == "other" and b.kernel is None


def test_target_exit_and_sanitizer_startup_errors_are_told_apart():
    text = log("""
        ========= Target application returned an error
        ========= Error: Target application terminated before first instrumented API call
        ========= ERROR SUMMARY: 1 error""")
    assert [b.category for b in san.parse_log(text).blocks] == ["exit", "internal"]


def test_an_error_in_a_torch_kernel_is_other_and_does_not_fail():
    s = shard("initcheck", log_text="========= COMPUTE-SANITIZER\n" + TORCH_INIT + "========= ERROR SUMMARY: 1 error\n")
    [b] = s.report.blocks
    assert b.category == "other" and b.kernel.startswith("void at::native::reduce_kernel<512")
    assert s.problems == [] and verdict(s) == 0


def test_a_log_without_a_summary_fails_the_shard():
    s = shard(log_text="========= COMPUTE-SANITIZER\n" + PROC_ADDRESS)     # killed before the summary
    assert any("no ERROR SUMMARY" in p for p in s.problems)
    assert verdict(s) == 1
    r = shard("racecheck", log_text=RACE.replace("RACECHECK SUMMARY", "RACECHECK"))
    assert any("no RACECHECK SUMMARY" in p for p in r.problems)


def test_a_sanitizer_internal_error_fails_the_shard():
    text = CLEAN.replace("========= ERROR",
                         "========= Internal Sanitizer Error: Failed to patch module\n========= ERROR")
    s = shard(log_text=text)
    assert s.report.blocks[0].category == "internal" and any("internal error" in p for p in s.problems)


def test_errors_the_summary_counts_but_the_log_does_not_show_fail():
    s = shard(log_text="========= COMPUTE-SANITIZER\n" + PROC_ADDRESS + "========= ERROR SUMMARY: 101 errors\n")
    assert s.report.unaccounted() == 100 and verdict(s) == 1


@pytest.mark.parametrize("out,rc,reason", [
    (PYTEST_OK.replace("2 passed", "1 failed, 1 passed") + "FAILED tests/x.py::test_a - AssertionError\n",
     1, "tests/x.py::test_a"),
    (PYTEST_OK.replace("2 passed", "2 skipped"), 0, "passed no tests"),
    ("Fatal Python error: Segmentation fault\n", -11, "no pytest summary line"),
])
def test_pytest_failures_under_the_sanitizer_fail(out, rc, reason):
    s = shard(out=out, rc=rc)
    assert any(reason in p for p in s.problems), s.problems
    assert verdict(s) == 1


def test_a_timed_out_shard_names_the_test_it_was_running():
    out = "tests/test_decode_gpu.py::test_batches[uniform2k-1] PASSED   [ 50%]\ntests/test_ir.py::test_x[part count] "
    s = shard(log_text="========= COMPUTE-SANITIZER\n", out=out, rc=-15, timed_out=True, wall_s=480.0)
    assert s.problems == ["timed out after 480 s while running tests/test_ir.py::test_x[part count]"]
    assert verdict(s) == 1


def test_an_empty_selection_fails_the_tool():
    r = san.ToolResult("racecheck", "racecheck and not trap", 0, [], [], ["no tests selected"])
    assert san.exit_status([r]) == 1


def test_shards_are_dealt_round_robin():
    ids = [f"t::{i}" for i in range(10)]
    shards = san.deal(ids, 3)
    assert shards == [["t::0", "t::3", "t::6", "t::9"], ["t::1", "t::4", "t::7"], ["t::2", "t::5", "t::8"]]
    assert san.deal(ids, 50) == [[i] for i in ids] and san.deal([], 4) == []


def test_shard_counts_follow_cost_and_jobs():
    assert san.shard_count("memcheck", 141, 12) == 5      # 141 x 1.5 s / 45 s
    assert san.shard_count("synccheck", 300, 3) == 3      # never more than --jobs by cost ...
    assert san.shard_count("initcheck", 295, 3) == 8      # ... but at most 40 tests in an initcheck process
    assert san.shard_count("memcheck", 141, 3) == 4
    assert san.shard_count("initcheck", 0, 3) == 1
    assert san.shard_count("racecheck", 2, 12) == 1 or san.SECONDS_PER_TEST["racecheck"] > 22.5
    assert san.shard_count("synccheck", 1, 12) == 1


def test_flags_the_installed_sanitizer_does_not_list_are_dropped():
    kept, dropped = san.supported(["--padding", "512", "--racecheck-memcpy-async", "yes", "--kill"],
                                  "  --tool arg\n  --padding arg\n  --kill\n")
    assert kept == ["--padding", "512", "--kill"] and dropped == ["--racecheck-memcpy-async", "yes"]
    assert san.supported(["--padding", "512"], "unexpected help")[0] == ["--padding", "512"]


FAKE = '''#!{python}
"""A stand-in for compute-sanitizer: writes a log per FAKE_MODE and runs the wrapped command."""
import os, subprocess, sys, time
args = sys.argv[1:]
if args[:1] == ["--version"]:
    print("Compute Sanitizer fake\\nVersion 2099.1.0"); sys.exit(0)
if args[:1] == ["--help"]:
    print("--tool --log-file --target-processes --print-limit --padding --destroy-on-device-error"); sys.exit(0)
logf = args[args.index("--log-file") + 1]
cmd = args[args.index("-m") - 1:]
mode = os.environ.get("FAKE_MODE", "clean")
if mode == "hang":
    time.sleep(600)
rc = subprocess.call(cmd)
body = "========= Invalid __global__ write of size 16 bytes\\n=========     at meld_decode_plan+0x80\\n=========\\n"
with open(logf, "w") as f:
    f.write("========= COMPUTE-SANITIZER\\n" + (body if mode == "meld" else "")
            + "========= ERROR SUMMARY: %d errors\\n" % (mode == "meld"))
sys.exit(rc)
'''


@pytest.mark.parametrize("mode,status", [("clean", 0), ("meld", 1), ("hang", 1)])
def test_main_end_to_end_with_a_fake_sanitizer(tmp_path, monkeypatch, mode, status):
    fake = tmp_path / "compute-sanitizer"
    fake.write_text(FAKE.format(python=sys.executable))
    fake.chmod(0o755)
    monkeypatch.setenv("FAKE_MODE", mode)
    out = tmp_path / "out"
    out.mkdir()
    for tool in ("memcheck", "synccheck"):              # a previous run's clean logs must not count for this one
        (out / f"{tool}-shard1.log").write_text(CLEAN)
    argv = ["--tools", "memcheck", "synccheck", "--jobs", "2", "--out", str(out), "--sanitizer", str(fake),
            "--timeout", "3" if mode == "hang" else "120", "--", "-m", "not gpu", "tests/test_ir.py"]
    assert san.main(argv) == status
    report = json.loads((out / "sanitize.json").read_text())
    shards = [s for t in report["tools"] for s in t["shards"]]
    assert report["passed"] is (status == 0) and len(shards) == 2
    assert all(s["ids"] and s["ids"][0].startswith("tests/test_ir.py::") for s in shards)
    md = (out / "SANITIZE.md").read_text()
    if mode == "clean":
        assert all(s["pytest"]["passed"] == len(s["ids"]) for s in shards) and "**PASS**" in md
    if mode == "meld":
        assert "at meld_decode_plan+0x80" in md and report["tools"][0]["shards"][0]["report"]["blocks"][0]["kernel"] \
            == "meld_decode_plan"
    if mode == "hang":
        assert all(s["timed_out"] and s["report"]["error_summary"] is None for s in shards)
        assert "timed out after" in md


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_racecheck_probe_compiles_for_sm90a(tmp_path):
    """The probes behind tools/SANITIZE.md's notes on what racecheck models stay buildable."""
    src = _PATH.parent / "probes" / "racecheck_probe.cu"
    run = subprocess.run(["nvcc", "-arch=sm_90a", "-O3", "-o", str(tmp_path / "probe"), str(src)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_initcheck_leaves_out_tests_that_feed_meld_a_cublas_output():
    assert "not cublas_output" in san.MARKERS["initcheck"]
    assert all("cublas_output" not in m for t, m in san.MARKERS.items() if t != "initcheck")
