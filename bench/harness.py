"""The one benchmark harness: one timer, ceilings measured in the same run, a table that also dumps JSON.

Why one timer: BENCH.md compares meld with its peers by ratios measured side by side, which only hold if
every implementation is timed the same way. Device time is taken by replaying a CUDA graph (so launch
overhead is the same for everyone) and bracketing each replay with CUDA events; we report the median and
the p10/p90 spread of at least 30 replays. Before each timed replay a buffer several times the L2 is
read, so every replay starts with a cold L2 as a real decode step would (a read, not a memset: a memset
leaves dirty lines whose write-back would be charged to the next kernel).

Example:
    >>> t = graph_time_us(lambda: torch.mm(a, b))          # doctest: +SKIP
    >>> print(f"{t.median_us:.1f} µs (p10 {t.p10_us:.1f}, p90 {t.p90_us:.1f})")  # doctest: +SKIP
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from meld.runtime.cuda_graphs import capture

try:  # Triton is on the GPU machine; without it the read ceiling falls back to torch (and says so).
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None

REPO_ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30
MIN_REPS = 30
QUICK_REPS = 30  # what --quick caps the timed replays at


@dataclass(frozen=True)
class Timing:
    """Median and spread of repeated measurements, in microseconds."""

    median_us: float
    p10_us: float
    p90_us: float
    n: int

    @staticmethod
    def of(samples_us: Sequence[float]) -> "Timing":
        s = sorted(samples_us)
        q = statistics.quantiles(s, n=10, method="inclusive") if len(s) > 1 else [s[0]] * 9
        return Timing(statistics.median(s), q[0], q[-1], len(s))

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


# ---------------------------------------------------------------------------------------------- timers

_flush_buf: torch.Tensor | None = None


def flush_l2() -> None:
    """Read a buffer of 4x the L2 size (at least 256 MiB) so the next kernel finds none of its data cached."""
    global _flush_buf
    if _flush_buf is None:
        l2 = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 0)
        _flush_buf = torch.ones(max(4 * (l2 or 64 << 20), 256 << 20) // 4, dtype=torch.float32, device="cuda")
    _flush_buf.sum()


def _queue_ahead() -> None:
    """Keep the GPU busy ~1 ms so the host enqueues the timed loop ahead of it: host gaps then never count."""
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(2_000_000)


def graph_time_us(fn: Callable[[], Any], warmup: int = 5, reps: int = 50, flush: bool = True) -> Timing:
    """Device time of `fn` from CUDA-graph replays.

    `fn` must be launch-only (no host syncs, no allocations that change between calls). It is warmed up
    on a side stream, captured once, replayed `warmup` times untimed, then `reps` times each bracketed
    by its own pair of CUDA events (an L2 flush before each, outside the events, when `flush`).

    Args:
        fn: the work to time; its outputs are kept alive by the graph's private pool.
        warmup: untimed calls before capture and untimed replays after it.
        reps: timed replays (at least 30).
        flush: read a buffer larger than L2 before each replay.
    Returns:
        Timing of one replay in µs.
    """
    reps = max(reps, MIN_REPS)
    graph, _ = capture(fn, warmup=warmup)
    for _ in range(warmup):
        graph.replay()
    if flush:
        flush_l2()  # allocate the flush buffer before the timed loop
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    _queue_ahead()
    for start, end in events:
        if flush:
            flush_l2()
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    graph.reset()
    return Timing.of([s.elapsed_time(e) * 1e3 for s, e in events])


def eager_time_us(fn: Callable[[], Any], warmup: int = 5, reps: int = 30, flush: bool = True) -> Timing:
    """Latency of one eager call, host launch cost included.

    The GPU is idle when the start event is recorded (we synchronise first), so the time from the start
    event to the end of `fn`'s last kernel includes the host work `fn` does before and between launches.
    That is the cost a CUDA graph removes; the difference to `graph_time_us` shows it.
    """
    reps = max(reps, MIN_REPS)
    for _ in range(warmup):
        fn()
    samples = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(reps):
        if flush:
            flush_l2()
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    return Timing.of(samples)


def back_to_back_us(fn: Callable[[], Any], calls: int = 32, rounds: int = 9, graph: bool = False) -> Timing:
    """Time per call of `calls` calls issued back to back, no synchronisation between them (L2 as they leave it):
    a round's span over `calls`, one sample a round. This is what a model's layer loop sees, where the host
    issues the next call while the GPU runs this one. `graph`: replays of `fn` captured once (as `graph_time_us`).
    Eager less graph is the host work per call that the GPU's own time does not hide."""
    call = fn
    if graph:
        g, _ = capture(fn)
        call = g.replay
    for _ in range(3):
        call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start.record()
        for _ in range(calls):
            call()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    if graph:
        g.reset()
    return Timing.of(samples)


def host_time_us(fn: Callable[[], Any], reps: int = 50, max_s: float = 2.0, min_reps: int = 5) -> Timing:
    """Host wall time of `fn` (e.g. a `plan()`): pending device work is drained first so it is not charged."""
    samples: list[float] = []
    deadline = time.perf_counter() + max_s
    while len(samples) < reps and (len(samples) < min_reps or time.perf_counter() < deadline):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    return Timing.of(samples)


# -------------------------------------------------------------------------------------------- ceilings
# Each ceiling allocates GiBs; the caller calls torch.cuda.empty_cache() once they are all measured.

if triton is not None:

    @triton.jit
    def _read_kernel(x_ptr, out_ptr, n_per_prog, BLOCK: tl.constexpr):
        # One contiguous chunk per program; BLOCK/(32*num_warps) int32 per thread in 4-wide (16-byte) loads.
        base = x_ptr + tl.program_id(0).to(tl.int64) * n_per_prog
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(0, n_per_prog, BLOCK):
            idx = tl.max_contiguous(tl.multiple_of(start + offs, BLOCK), BLOCK)
            acc += tl.load(base + idx)
        tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))


READ_BLOCK = 4096  # int32 elements per program per iteration: 256 threads x 4 loads of 16 bytes
READ_WARPS = 8


def read_reduce(x: torch.Tensor, out: torch.Tensor) -> None:
    """Sum int32 `x` in `out.numel()` equal contiguous chunks, one partial per program (pure streaming read).

    `x.numel()` must be a multiple of `out.numel() * READ_BLOCK`.
    """
    nprog = out.numel()
    n_per_prog = x.numel() // nprog
    assert x.dtype == torch.int32 and n_per_prog * nprog == x.numel() and n_per_prog % READ_BLOCK == 0
    _read_kernel[(nprog,)](x, out, n_per_prog, BLOCK=READ_BLOCK, num_warps=READ_WARPS)


def read_ceiling_tbps(gib: float = 4.0, reps: int = 30) -> tuple[float, str]:
    """Pure-read bandwidth (TB/s) of a streaming reduction over >= `gib` GiB, and the method used.

    Why Triton and not `x.sum()`: torch's reduction does not reliably issue 16-byte loads with enough bytes
    in flight; BENCH.md's 4.57 TB/s reference comes from a kernel like this one.
    """
    if triton is not None:
        try:
            return _read_ceiling_triton(gib, reps)
        except Exception as e:  # noqa: BLE001 - a ceiling must not stop the benchmark; say what was used
            print(f"warning: triton read kernel failed ({e!r}); falling back to torch sum", flush=True)
    x = torch.ones(int(gib * GIB) // 4, dtype=torch.float32, device="cuda")
    t = graph_time_us(lambda: x.sum(), reps=reps, flush=False)
    return int(gib * GIB) // 4 * 4 / (t.median_us * 1e-6) / 1e12, f"torch float32 sum (no triton), {gib:.1f} GiB"


def _read_ceiling_triton(gib: float, reps: int) -> tuple[float, str]:
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    nprog = 8 * sms  # 8 CTAs of 8 warps fill an SM's 64 warps: every chunk is resident at once
    per_prog = math.ceil(gib * GIB / 4 / nprog / READ_BLOCK) * READ_BLOCK
    x = torch.empty(nprog * per_prog, dtype=torch.int32, device="cuda").random_()
    out = torch.empty(nprog, dtype=torch.int32, device="cuda")
    t = graph_time_us(lambda: read_reduce(x, out), reps=reps, flush=False)
    nbytes = x.numel() * x.element_size()
    return (nbytes / (t.median_us * 1e-6) / 1e12,
            f"triton int32 streaming sum, {nprog} programs x {READ_WARPS} warps, 16-byte loads, {nbytes / GIB:.1f} GiB")


def read_floor_us(nbytes: int, warmup: int = 5, reps: int = 50, flush: bool = True) -> float | None:
    """About how fast a kernel that must read `nbytes` once can be here: the best CUDA-graph time (same timer
    and L2 flush as the implementations) of the Triton streaming read with 1, 2, 4 or 8 programs per SM,
    over `nbytes` rounded up to whole blocks of the programs and scaled down to exactly `nbytes` (more
    than one program per SM only where the rounding adds at most 10%). The scaling flatters the floor,
    so a speedup bound taken from it errs high. None without Triton."""
    if triton is None:
        return None
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    best = math.inf
    for per_sm in (1, 2, 4, 8):
        nprog = per_sm * sms
        grain = nprog * READ_BLOCK
        n = -(-nbytes // 4 // grain) * grain
        if 4 * n > 1.1 * nbytes and per_sm > 1:   # a coarser grain never rounds up by less
            break
        x = torch.empty(n, dtype=torch.int32, device="cuda").random_()
        out = torch.empty(nprog, dtype=torch.int32, device="cuda")
        t = graph_time_us(lambda: read_reduce(x, out), warmup=warmup, reps=reps, flush=flush)
        best = min(best, t.median_us * nbytes / (4 * n))
    return best


def copy_ceiling_tbps(gib: float = 2.0, reps: int = 30) -> float:
    """Device-to-device copy bandwidth (TB/s), counting bytes read plus bytes written."""
    src = torch.empty(int(gib * GIB) // 4, dtype=torch.int32, device="cuda").random_()
    dst = torch.empty_like(src)
    t = graph_time_us(lambda: dst.copy_(src), reps=reps, flush=False)
    return 2 * src.numel() * src.element_size() / (t.median_us * 1e-6) / 1e12


def matmul_ceiling_tflops(n: int = 8192, reps: int = 30) -> float:
    """Dense bf16 tensor-core rate (TFLOP/s) of an n x n x n `torch.matmul` on random data."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    t = graph_time_us(lambda: a @ b, reps=reps, flush=False)
    return 2 * n**3 / (t.median_us * 1e-6) / 1e12


# ------------------------------------------------------------------------------------------ environment

def _git(*args: str) -> str | None:
    try:
        r = subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def env_info() -> dict[str, Any]:
    """What a result needs to be reproduced: date, GPU, software versions, git commit of the repo.

    MELD_BENCH_COMMIT names the commit where the copy being run has no .git of its own, or a stale one
    (a GPU machine that receives the working tree); `dirty` is then unknown (None).
    """
    commit = os.environ.get("MELD_BENCH_COMMIT")
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": getattr(triton, "__version__", None),
        "commit": commit or _git("rev-parse", "--short", "HEAD"),
        "dirty": None if commit else bool(_git("status", "--porcelain", "--untracked-files=no")),
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        info.update(gpu=p.name, sm_count=p.multi_processor_count, gpu_mem_gib=round(p.total_memory / GIB, 1),
                    l2_mib=round(getattr(p, "L2_cache_size", 0) / (1 << 20), 1))
    return info


# ------------------------------------------------------------------------------------------------- runs
# What every benchmark script does around its own build-and-check code. A result is a dict per
# implementation and case (Timing values under "graph" and "eager", a list under "errors", a reason under
# "skipped"); a failure is printed, kept and recorded in the result, never raised: one broken implementation
# costs its cells, not the run, and the exit status still says it failed.

Fail = Callable[[str, str], None]
"""`fail(what, detail)`: record one failure of the implementation being measured (`failure_recorder`)."""


def median_trace(run: Callable[[], Any], op: Any, runs: int = 5):
    """`op.last_trace()` of `run` (a profiled build) replayed `runs` times in a CUDA graph with a cold L2, as it
    is timed: the launch with the median span."""
    graph, _ = capture(run)
    traces = []
    for _ in range(runs):
        flush_l2()
        graph.replay()
        traces.append(op.last_trace())
    graph.reset()
    traces.sort(key=lambda tr: tr.span_ns)
    return traces[len(traces) // 2]


def write_trace(run: Callable[[], Any], op: Any, stem: Path, runs: int = 5) -> str:
    """Per-SM timeline of `op` (built with MELD_PROFILE=1) running `run`, replayed in a CUDA graph with a cold
    L2 (as it is timed): the launch with the median span goes to stem.trace.json (Chrome) and stem.png, as
    `meld timeline` renders them. Returns the trace's summary and what was written."""
    from meld.runtime.profile import render_png

    tr = median_trace(run, op, runs)
    lines = [tr.summary(), tr.busy_table()]
    written = [str(tr.write_chrome(stem.with_suffix(".trace.json")))]
    try:
        written.append(str(render_png(tr, stem.with_suffix(".png"))))
    except Exception as e:  # noqa: BLE001 - the JSON is still worth having
        lines.append(f"no PNG: {type(e).__name__}: {e}")
    return "\n".join(lines + ["wrote " + " and ".join(written)])


def free_cuda() -> None:
    """Collect garbage, then hand the allocator's cached blocks back to the driver.

    Why both: buffers kept alive by reference cycles (closures, tracebacks) die only in `gc.collect()`, and
    torch's caching allocator keeps their memory until `empty_cache()`; then the next implementation (and a
    library with its own allocator) starts from the same free memory as the one before. Safe without CUDA."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def median_us(res: Mapping[str, Any], key: str = "graph") -> float | None:
    """The median in µs of the Timing under `key` of a result; None where there is none (not run, failed)."""
    t = res.get(key)
    return t.median_us if isinstance(t, Timing) else None


def result_cell(results: Mapping[str, Mapping[str, Any]], name: str) -> Any:
    """Implementation `name`'s table cell: its graph median, or why there is none ("skip", "FAIL"; None when
    it was not selected), so a missing number never reads as a slow or a fast one."""
    r = results.get(name)
    if r is None:
        return None
    return "skip" if r.get("skipped") else "FAIL" if r.get("errors") else median_us(r)


def timing_parts(res: Mapping[str, Any]) -> list[str]:
    """`graph 12.3 µs`, `eager 15.0 µs`: a result's times as the progress lines print them."""
    return [f"{k} {median_us(res, k):.1f} µs" for k in ("graph", "eager") if median_us(res, k) is not None]


def print_aligned(head: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """A plain table: every column right-aligned to its widest cell (the A/B scripts' output)."""
    width = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        print("  ".join(x.rjust(w) for x, w in zip(r, width)))


def worst(values: Sequence[float]) -> float:
    """The largest error, NaN if any is NaN (max() alone depends on where the NaN sits)."""
    return math.nan if any(math.isnan(v) for v in values) else max(values)


def record_failure(failures: list[str], msg: str, indent: str = "") -> None:
    """Print `msg` as a '!!! FAIL' line (the summary line points at them) and keep it for the JSON and the
    exit status."""
    print(f"{indent}!!! FAIL {msg}", flush=True)
    failures.append(msg)


def failure_recorder(where: str, res: dict[str, Any], failures: list[str]) -> Fail:
    """The `fail(what, detail)` of one implementation on one case (`where` names both): the failure is
    printed and kept as "WHERE: WHAT: DETAIL", and "WHAT: DETAIL" goes into `res["errors"]`, which turns the
    implementation's table cell into FAIL."""

    def fail(what: str, detail: str) -> None:
        record_failure(failures, f"{where}: {what}: {detail}", indent="  ")
        res.setdefault("errors", []).append(f"{what}: {detail}")

    return fail


def keep_available(names: Sequence[str], probe: Callable[[str], None], failures: list[str],
                   why: Callable[[str], str] = lambda name: "unavailable") -> list[str]:
    """The names whose `probe(name)` does not raise, in order. One that raises is dropped and is one failure,
    "NAME: why(NAME): Error: message": reported once before the cases, not once per case, while the run goes
    on without it."""
    kept = []
    for name in names:
        try:
            probe(name)
        except Exception as e:  # noqa: BLE001 - the rest of the run goes on without it
            traceback.print_exc(limit=-3)
            record_failure(failures, f"{name}: {why(name)}: {type(e).__name__}: {e}")
            continue
        kept.append(name)
    return kept


def run_recorded(body: Callable[[], None], res: dict[str, Any], fail: Fail) -> None:
    """Run one implementation's build-check-time `body`; an exception is recorded as an "error" failure (its
    traceback also in `res["traceback"]`, for the JSON), never raised; CUDA memory is freed afterwards.

    Why a function to call and not a `with` block: what `body` builds is its own local, gone once `body`
    returns or raises, so `free_cuda()` really gives its buffers back before the next implementation."""
    try:
        body()
    except Exception as e:  # noqa: BLE001 - one broken implementation must not stop the run
        traceback.print_exc(limit=-4)
        fail("error", f"{type(e).__name__}: {e}")
        res["traceback"] = traceback.format_exc()
    finally:
        free_cuda()


def time_impl(run: Callable[[], Any], res: dict[str, Any], fail: Fail, *, warmup: int, reps: int, flush: bool,
              eager: bool) -> None:
    """Time a checked implementation into `res`: "graph" (`graph_time_us`), and "eager" (`eager_time_us`)
    too when `eager`.

    A capture failure is recorded as a "graph timing" failure and the eager timing still runs: that it
    cannot be captured is a finding, and its eager latency still says how fast it is. An eager failure
    raises (to `run_recorded`)."""
    try:
        res["graph"] = graph_time_us(run, warmup=warmup, reps=reps, flush=flush)
    except Exception as e:  # noqa: BLE001 - a capture failure must not stop the other timings
        traceback.print_exc(limit=-4)
        fail("graph timing", repr(e))
    if eager:
        res["eager"] = eager_time_us(run, warmup=warmup, reps=reps, flush=flush)


def measure_ceilings() -> dict[str, Any]:
    """The ceilings a table's ratios are taken against, measured in this run: pure read (TB/s, and the
    method), device copy (TB/s, read + write) and dense bf16 matmul (TFLOP/s). Their buffers are freed."""
    read_tbps, read_method = read_ceiling_tbps()
    ceilings = {"read_tbps": read_tbps, "read_method": read_method, "copy_tbps": copy_ceiling_tbps(),
                "matmul_bf16_tflops": matmul_ceiling_tflops()}
    free_cuda()
    return ceilings


def ceilings_line(ceilings: Mapping[str, Any], matmul: str = "bf16 matmul") -> str:
    """The `measure_ceilings()` result as the run prints it before the cases (`matmul` names the matmul)."""
    return (f"ceilings: pure read {ceilings['read_tbps']:.2f} TB/s ({ceilings['read_method']}); copy "
            f"{ceilings['copy_tbps']:.2f} TB/s (read+write); {matmul} {ceilings['matmul_bf16_tflops']:.0f} TFLOP/s")


def env_line(env: Mapping[str, Any]) -> str:
    """The environment as the run prints it first: `env: key=value, ...` in `env`'s order."""
    return "env: " + ", ".join(f"{k}={v}" for k, v in env.items())


def failure_head(failures: Sequence[str]) -> str:
    """The verdict of a summary line: how many failures (and where to look), or that every check passed."""
    return f"{len(failures)} FAILURE(S) — see '!!! FAIL' lines above" if failures else "all checks passed"


def speedup_span(rows: Sequence[Mapping[str, Any]], key: str = "speedup") -> str | None:
    """How the rows' float `key`s spread, as the summary lines say it: "over N cases: geomean G.GGx (min A.AAx
    at CASE, max B.BBx at CASE)"; None when no row has one. A geometric mean because ratios multiply: a 2x
    and a 0.5x cancel, as they should."""
    ratios = [(r[key], r["case"]) for r in rows if isinstance(r.get(key), float)]
    if not ratios:
        return None
    geo = math.exp(statistics.fmean(math.log(s) for s, _ in ratios))
    lo, hi = min(ratios), max(ratios)
    return f"over {len(ratios)} cases: geomean {geo:.2f}x (min {lo[0]:.2f}x at {lo[1]}, max {hi[0]:.2f}x at {hi[1]})"


# ----------------------------------------------------------------------------------------- command line

def add_timing_args(p: argparse.ArgumentParser) -> None:
    """--reps, --warmup and --no-flush: the timer's knobs, spelled and defaulted the same in every script."""
    p.add_argument("--reps", type=int, default=50, help="timed graph replays per measurement (>= 30)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--no-flush", action="store_true", help="do not clear L2 before each timed replay")


def timed_reps(reps: int, quick: bool) -> int:
    """The --reps a run records and uses: at most QUICK_REPS with --quick, never fewer than MIN_REPS (the
    p10/p90 spread needs them)."""
    return max(min(reps, QUICK_REPS) if quick else reps, MIN_REPS)


# ------------------------------------------------------------------------------------------------ table

@dataclass(frozen=True)
class Column:
    """One table column: the row key it shows, its header, a format spec for numbers, and alignment."""

    key: str
    header: str
    fmt: str = ""
    align: str = ">"  # "<" for text columns


class Table:
    """An aligned text table whose rows are dicts; the same rows dump to JSON.

    Example:
        >>> t = Table([Column("b", "B"), Column("dist", "dist", align="<"), Column("us", "µs", ".1f")])
        >>> t.add({"b": 8, "dist": "skewed", "us": 34.81}); print(t.render())
        B  dist      µs
        -  ------  ----
        8  skewed  34.8
    """

    def __init__(self, columns: Sequence[Column]):
        self.columns = list(columns)
        self.rows: list[dict[str, Any]] = []

    def add(self, row: Mapping[str, Any]) -> None:
        self.rows.append(dict(row))

    @staticmethod
    def _cell(value: Any, fmt: str) -> str:
        if value is None:
            return "-"
        if isinstance(value, float) and not math.isfinite(value):
            return str(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return format(value, fmt)
        return str(value)

    def render(self) -> str:
        cells = [[self._cell(r.get(c.key), c.fmt) for c in self.columns] for r in self.rows]
        widths = [max([len(c.header)] + [len(row[i]) for row in cells]) for i, c in enumerate(self.columns)]

        def line(items: Sequence[str]) -> str:
            return "  ".join(format(s, f"{c.align}{w}") for s, w, c in zip(items, widths, self.columns)).rstrip()

        out = [line([c.header for c in self.columns]), line(["-" * w for w in widths])]
        return "\n".join(out + [line(row) for row in cells])

    def print(self) -> None:
        print(self.render(), flush=True)

    def dump_json(self, path: str | Path, **extra: Any) -> None:
        """Write `{**extra, "rows": rows}` to `path` (Timing and other dataclasses as dicts)."""

        def default(o: Any) -> Any:
            return asdict(o) if hasattr(o, "__dataclass_fields__") else str(o)

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**extra, "rows": self.rows}, indent=1, default=default) + "\n")


# ------------------------------------------------------------------------------------------ attention impls

@dataclass
class Impl:
    """A planned implementation: `run` is launch-only (graph-capturable); `outputs` runs it for checking,
    returning (label, out, lse or None) triples."""

    run: Callable[[], Any]
    outputs: Callable[[], list[tuple[str, torch.Tensor, Optional[torch.Tensor]]]]
    plan: Optional[Timing] = None
    plan_first_us: Optional[float] = None
    init_us: Optional[float] = None  # constructor wall time (meld compiles its kernel there)
    op: Any = None  # meld's operator, where a tool reads its profile (last_trace)


REL_TOL = 1e-2  # on ‖out − ref‖ / ‖ref‖ against float64 (BENCH.md)
LSE_TOL = 1e-3  # on |lse - ref| / max(1, |ref|)


def check_output(out: torch.Tensor, ref: torch.Tensor, lse: Optional[torch.Tensor] = None,
                 ref_lse: Optional[torch.Tensor] = None, rel_tol: float = REL_TOL
                 ) -> tuple[float, Optional[float], list[str]]:
    """Relative error of `out` (and of `lse`) against the float64 reference, and the problems found (`rel_tol`:
    BENCH.md's 1e-2; issue 41's FP8 caches 2e-2)."""
    problems: list[str] = []
    if out.shape != ref.shape:
        return math.nan, None, [f"out shape {tuple(out.shape)} != {tuple(ref.shape)}"]
    nans = int(torch.isnan(out).sum())
    if nans:
        problems.append(f"{nans} NaN in out (unwritten or broken)")
    err = float((out.double() - ref).norm() / ref.norm())
    if not err < rel_tol:
        problems.append(f"rel err {err:.2e} >= {rel_tol:.0e}")
    lse_err = None
    if lse is not None and ref_lse is not None:
        if lse.shape != ref_lse.shape:
            problems.append(f"lse shape {tuple(lse.shape)} != {tuple(ref_lse.shape)}")
        else:
            lse_err = float(((lse.double() - ref_lse).abs() / ref_lse.abs().clamp(min=1)).max())
            if not lse_err < LSE_TOL:  # NaN fails too
                problems.append(f"lse err {lse_err:.2e} >= {LSE_TOL:.0e} (natural log expected)")
    return err, lse_err, problems


def check_impl(impl: Impl, ref: tuple[torch.Tensor, torch.Tensor], rel_tol: float = REL_TOL
               ) -> tuple[float, Optional[float], list[str]]:
    """Worst relative errors over all of `impl`'s checked outputs, and every problem (outputs freed on return)."""
    errs, lse_errs, problems = [], [], []
    for label, out, lse in impl.outputs():
        err, lse_err, probs = check_output(out, ref[0], lse, ref[1], rel_tol)
        errs.append(err)
        lse_errs += [] if lse_err is None else [lse_err]
        problems += [f"{label}: {p}" for p in probs]
    return worst(errs), max(lse_errs) if lse_errs else None, problems


def measure(build: Callable[[], Impl], where: str, ref: tuple[torch.Tensor, torch.Tensor], args: argparse.Namespace,
            failures: list[str], eager: bool, rel_tol: float = REL_TOL) -> dict[str, Any]:
    """Build, check, then time one implementation on one case (`where` names both); errors are recorded, never
    raised. `eager`: also time it launched eagerly."""
    res: dict[str, Any] = {}
    fail = failure_recorder(where, res, failures)

    def build_check_time() -> None:
        impl = build()
        res.update(plan=impl.plan, plan_first_us=impl.plan_first_us, init_us=impl.init_us)
        rel_err, lse_err, problems = check_impl(impl, ref, rel_tol)
        res.update(rel_err=rel_err, lse_err=lse_err)
        if problems:
            fail("correctness", "; ".join(problems))
            return
        time_impl(impl.run, res, fail, warmup=args.warmup, reps=args.reps, flush=not args.no_flush, eager=eager)

    run_recorded(build_check_time, res, fail)
    return res


def progress(r: dict[str, Any]) -> str:
    """One line per implementation while the run goes, so a run cut short still shows its numbers."""
    if r.get("skipped"):
        return f"skipped: {r['skipped']}"
    parts = timing_parts(r)
    parts += [f"rel err {r['rel_err']:.1e}"] if r.get("rel_err") is not None else []
    parts += [f"lse err {r['lse_err']:.1e}"] if r.get("lse_err") is not None else []
    parts += [f"plan {median_us(r, 'plan'):.0f} µs"] if median_us(r, "plan") is not None else []
    parts += [f"first plan {r['plan_first_us'] / 1e3:.1f} ms"] if r.get("plan_first_us") else []
    parts += ["FAIL"] if r.get("errors") else []
    return ", ".join(parts)
