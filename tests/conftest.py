"""Test setup: fixed seeds, the `gpu` marker (skipped with a reason where no Hopper GPU is present),
the `perf` and `full_matrix` markers (off unless asked for with `-m perf`, `-m full_matrix`), and one
compile cache for the run; the `fp8_math` fixture, which runs an FP8 GPU test on bf16-math builds too; and a
stop at the first test that loses the process's CUDA context (below)."""
import os
import random
import re
import shutil
import tempfile

# One thread for NumPy's BLAS (as for torch's ops, below): OpenBLAS's second thread spins while it waits,
# so the tests' small matmuls cost about twice the CPU time (emulated ranks, CPU executors: 45 s -> 28 s of
# CPU for the same wall time), taken from the other test worker. Read when NumPy loads: below, and in
# every test worker and child process, which inherit it.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402


def _gpu_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine (torch.cuda.is_available() is False)"
    major, minor = torch.cuda.get_device_capability()
    if major < 9:
        return f"GPU is sm_{major}{minor}; meld's kernels need sm_90 or newer"
    return None


# One thread for torch's CPU ops. With its default (one per core) every op on a tiny tensor is an OpenMP
# region that waits for all of its threads, and on a busy machine (CI's two cores, two test workers, or
# anything else running) each wait is a scheduler time slice: 3000 one-token requests' float64 reference
# took 19 s beside one busy process, against 1 s on one thread. The tests' tensors are small; the
# results do not depend on it (every comparison is to a float64 reference, or bit for bit between meld's
# own runs in one process).
torch.set_num_threads(1)

_made_cache_dir: str | None = None


def pytest_configure(config):
    """Kernels compile into one cache for the run (MELD_CACHE_DIR, unless it is set already): pytest's own
    cache folder (.pytest_cache/d/meld, git-ignored; `--cache-clear` empties it), so a rerun compiles only
    what changed, or a temporary folder removed at the end where the cache plugin is off. Not the user's
    ~/.cache/meld, which runs of other checkouts share. Set before any worker or child process starts,
    which inherit it, so all of them share the cache (its entries are written atomically)."""
    global _made_cache_dir
    if "MELD_CACHE_DIR" in os.environ:
        return
    if getattr(config, "cache", None) is not None:
        os.environ["MELD_CACHE_DIR"] = str(config.cache.mkdir("meld"))
    else:
        os.environ["MELD_CACHE_DIR"] = _made_cache_dir = tempfile.mkdtemp(prefix="meld-test-cache-")


def pytest_unconfigure(config):
    if _made_cache_dir is not None:
        shutil.rmtree(_made_cache_dir, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    reason = _gpu_reason()
    perf_asked = "perf" in (config.getoption("-m") or "")
    full_asked = "full_matrix" in (config.getoption("-m") or "")
    for item in items:
        if reason and "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))
        if "perf" in item.keywords and not perf_asked:
            item.add_marker(pytest.mark.skip(reason="performance test: run with -m perf"))
        if "full_matrix" in item.keywords and not full_asked:
            item.add_marker(pytest.mark.skip(reason="a case the pairwise default leaves out: run with -m full_matrix"))


# CUDA errors after which the process's context is lost: every later CUDA call in it fails the same way, so one
# crashed kernel would fail every test after it in the process. The run stops at that test instead (pytest's
# "Interrupted: sticky CUDA error ..."), and tools/gpu_suite.py (which looks for those words) runs the rest in
# a fresh process. (Not in pytest-xdist's workers, whose controller would stop every worker.)
_STICKY_CUDA = re.compile(r"unspecified launch failure|illegal memory access|an illegal instruction|misaligned "
                          r"address|device-side assert|hardware stack error|CUDA error: unknown error")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if report.when == "call":
        item.call_outcome = report.outcome   # (fixtures' teardowns read it: fp8_math)
    if (report.failed and call.excinfo is not None and not hasattr(item.config, "workerinput")
            and _STICKY_CUDA.search(str(call.excinfo.value))):
        item.session.shouldstop = f"sticky CUDA error in {item.nodeid}: this process's CUDA context is lost"


@pytest.fixture(autouse=True)
def _seed():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _free_gpu_memory(request):
    """Hand the caching allocator's blocks back after each GPU test: several test processes share one
    GPU under tools/sanitize.py, and a process holding the peak of every test it ran starves the others."""
    yield
    if "gpu" in request.keywords and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@pytest.fixture(params=["f16", ""], ids=["math-f16", "math-bf16"])
def fp8_math(request, monkeypatch):
    """Runs a GPU test twice: on the builds as they are (an FP8 build for bf16 q computes in f16, fp8_math="f16",
    DecodeKernelConfig.default's choice), and with every such build that DecodeKernelConfig.default makes (the
    operator's, and the tests' own) computing in bf16 instead (fp8_math=""). A float16 case (a `dtype` parameter)
    runs once: its builds compute in f16 either way. A test that passes with the flip left without a bf16-math build
    fails at teardown, so each math-bf16 case runs that kernel (one that skipped, say for a missing peer, built
    none)."""
    import dataclasses

    from meld.codegen import DecodeKernelConfig

    if request.param:
        yield "f16"
        return
    params = getattr(request.node, "callspec", None)
    if params is not None and params.params.get("dtype") in (torch.float16, "float16"):
        pytest.skip("float16 builds compute in f16 either way")
    default, flipped = DecodeKernelConfig.default, []

    def bf16_default(*args, **kwargs):
        c = default(*args, **kwargs)
        if not c.fp8_math:
            return c
        flipped.append(c)
        return dataclasses.replace(c, fp8_math="")

    monkeypatch.setattr(DecodeKernelConfig, "default", staticmethod(bf16_default))
    yield ""
    assert flipped or getattr(request.node, "call_outcome", None) != "passed", \
        "the test built no FP8 kernel for bf16 q: fp8_math='' was never used"
