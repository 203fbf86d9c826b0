"""Run NVIDIA compute-sanitizer over meld's GPU tests; fail on any error in a meld kernel.

    python tools/sanitize.py [--tools memcheck synccheck initcheck racecheck] [--jobs N] [--out DIR]
                             [--timeout S] [--budget S] [-- extra pytest args for the selection]

On the GPU machine, from the repository root: `python tools/sanitize.py` (children get PYTHONPATH=<root>;
logs, SANITIZE.md and sanitize.json go to $OUT/sanitize when $OUT is set, else build/sanitize). Exit 1 on
failure, 0 when clean, 2 when compute-sanitizer is not found.

Why shards: sanitized runs are slow and device time comes in 10-minute calls, so the selected tests
are collected once per marker expression, dealt round-robin into shards (round-robin spreads each
test's parametrizations, which share a cost, over the shards) and run as separate processes on the
one GPU, at most --jobs at a time, longest-expected first. Every shard gets its own sanitizer log
(DIR/<tool>-shardK.log) and pytest output (DIR/<tool>-shardK.out); a shard that outlives its
timeout is killed (its whole process group) and fails, naming the test it was in; one the whole-run
--budget leaves under 30 s for is not started, and fails.

Why parse the log instead of trusting exit codes: compute-sanitizer exits with the target's status,
and its ERROR SUMMARY also counts errors that are not meld's. Each error block is attributed to the
device function(s) it names ("at <fn>+0x..", "at 0x.. in file:line:<fn>", "Device Frame:<fn>") and
classified: `meld` (a function whose name starts with meld_) fails the run; `filtered` is exactly
the cuGetProcAddress/_v2 CUDA_ERROR_INVALID_VALUE block that symbol probing in torch/cuda-python
produces; `other` (torch's kernels, other API errors) is reported but does not fail, because meld
cannot fix it -- and a failure it causes in a meld test shows up as a pytest failure, which does
fail. `internal` (the sanitizer's own errors), a missing summary, summary counts that the parsed
blocks do not account for (print limit hit, unknown format), a pytest failure under the sanitizer,
a shard that passed no tests (e.g. everything skipped because the GPU was not seen) and an empty
selection all fail the run too: each means nothing was proven for some tests.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ("memcheck", "synccheck", "initcheck", "racecheck")
# initcheck does not see the stores of cuBLAS's Hopper GEMMs (TMA): a torch kernel reading a GEMM's output
# is reported as reading uninitialised memory (tools/probes/init_probe.py), so would a meld kernel be.
MARKERS = {"memcheck": "gpu and not trap", "synccheck": "gpu and not trap",
           "initcheck": "gpu and not trap and not cublas_output", "racecheck": "racecheck and not trap"}
# Per-tool flags. A flag the installed compute-sanitizer's --help does not list is dropped (with a warning)
# rather than failing every shard.
COMMON_FLAGS = ["--target-processes", "all",   # follow pytest's children (compilers, subprocess tests)
                "--print-limit", "1000"]       # default 100 would hide blocks the summary still counts
TOOL_FLAGS = {
    # padding: an overrun that would land in the next (back-to-back) allocation lands in a pad and is caught.
    # destroy-on-device-error kernel: one bad launch ends that kernel, not the context, so the rest of the
    # shard's tests still run and are still checked (context destruction would fail them all).
    "memcheck": ["--padding", "512", "--destroy-on-device-error", "kernel"],
    "synccheck": ["--destroy-on-device-error", "kernel"],
    "initcheck": [],
    # analysis: one report per racing pair of code locations; `hazard`/`all` print one block per byte and
    # thread pair, megabytes of log for one bug. memcpy-async (the default, stated): checks meld's cp.async
    # rings are read only after their wait. kns=meld_: races in torch's kernels are not ours, and skipping
    # their instrumentation is most of racecheck's cost.
    "racecheck": ["--racecheck-report", "analysis", "--racecheck-memcpy-async", "yes", "--kernel-name", "kns=meld_"],
}
# Rough sanitized seconds per test (measured: memcheck 56 tests ~80 s, synccheck/initcheck 15 tests a few s,
# racecheck ~95 s for one large test; the racecheck-marked tests are small). Used only to size and order shards.
SECONDS_PER_TEST = {"memcheck": 1.5, "synccheck": 0.4, "initcheck": 0.4, "racecheck": 20.0}
STARTUP_S = 15.0          # python + torch + CUDA init under the sanitizer, kernels from the compile cache
TARGET_SHARD_S = 45.0     # shorter shards balance better; each one pays STARTUP_S again
# Caching allocator pools hide out-of-bounds accesses (and initcheck's view of fresh memory) inside blocks.
# Tests marked `caching_allocator` allocate inside CUDA-graph capture, which only the caching allocator can
# serve (a cudaMalloc while capturing fails, and the failed capture breaks the process's later tests): they
# run in shards of their own with it.
TOOL_ENV = {"memcheck": {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}, "initcheck": {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}}
# Tests per process at most: an initcheck process keeps growing with every test it runs (on the H200,
# 2026-12-02, three shards of ~98 tests each ran out of device memory from about their 60th test on, 76
# failures, none with an error reported), and a fresh process starts small again. Shards beyond --jobs wait.
MAX_TESTS_PER_SHARD = {"memcheck": 40, "initcheck": 40}
CACHING = "caching_allocator"

# --- log parsing ------------------------------------------------------------------------------------
PREFIX = re.compile(r"^={8,}(.*)$")
ERROR_SUMMARY = re.compile(r"ERROR SUMMARY:\s*(\d+)\s+errors?")
RACE_SUMMARY = re.compile(r"RACECHECK SUMMARY:\s*(\d+)\s+hazards?\s+displayed\s*"
                          r"\((\d+)\s+errors?,\s*(\d+)\s+warnings?\)")
INFO_HEADER = re.compile(r"^(COMPUTE-SANITIZER|.*\bSUMMARY:)")
CONTINUATION = re.compile(r"^(at |by thread|Address |Access to |and |in |Saved host backtrace|Host Frame|Device Frame|"
                          r"(Read|Write) Thread|Current Value|Not written)")
# The one filtered block: torch/cuda-python probing driver symbols that this driver does not have.
FILTERED_API = re.compile(r'^Program hit CUDA_ERROR_INVALID_VALUE \(error 1\) due to "invalid argument" '
                          r"on CUDA API call to cuGetProcAddress(_v2)?\.?$")
API_CALL = re.compile(r"on CUDA API call to (\w+)")
INTERNAL = re.compile(r"(?i)internal (sanitizer )?error|no attachable process|before first instrumented API call|"
                      r"^error: (?!race reported)(?!.*hazard)")
TARGET_EXIT = re.compile(r"^(Error: )?Target application returned an error")
HAZARD = re.compile(r"(?i)race reported|hazard detected|^potential invalid __shared__")
AT_NEW = re.compile(r"^(?P<fn>(?!0x).+?)(?:\+|:)0x[0-9a-fA-F]+\b")       # at meld_x+0x1a0 in f.cu:12 / at k():0x160
AT_OLD = re.compile(r"^0x[0-9a-fA-F]+\s+in\s+(?P<where>.+?)\s*$")        # at 0x578 in f.cu:120:k(int*) / at 0x100 in k


@dataclass
class ErrorBlock:
    """One report: its first line without the prefix, the lines verbatim, and what it was judged to be."""
    header: str
    lines: list[str]
    functions: list[str] = field(default_factory=list)   # device functions named, in order of appearance
    category: str = "other"                               # meld | filtered | other | internal | exit
    kernel: str | None = None     # the first meld function named, else the outermost one (last device frame)
    api_call: str | None = None


@dataclass
class LogReport:
    error_summary: int | None = None        # sum of "ERROR SUMMARY: N errors" lines (one per sanitizer session)
    race_summary: list[int] | None = None   # [hazards, errors, warnings] of "RACECHECK SUMMARY"
    blocks: list[ErrorBlock] = field(default_factory=list)

    def count(self, category: str) -> int:
        return sum(b.category == category for b in self.blocks)

    def unaccounted(self) -> int:
        """Errors the summary counts that no parsed block shows (print limit, a format not understood)."""
        n = 0
        if self.error_summary is not None:
            n = max(n, self.error_summary - sum(not HAZARD.search(b.header) for b in self.blocks))
        if self.race_summary is not None:
            n = max(n, self.race_summary[0] - sum(bool(HAZARD.search(b.header)) for b in self.blocks))
        return n


def is_meld(function: str) -> bool:
    """meld's kernels are extern "C" meld_*, its device functions live in namespace meld (meld::mla_store(...),
    which a race report may name instead of the kernel); C++ names may carry a return type and arguments."""
    name = re.sub(r"^(?:void|static|__global__|__device__)\s+", "", function.strip())
    first = re.split(r"[\s(<]", name, maxsplit=1)[0]
    return first.startswith("meld_") or first.startswith("meld::")


def _function(text: str) -> str | None:
    """The device function an "at ..." / "Device Frame:..." location names, in any of the formats seen."""
    if m := AT_NEW.match(text):
        return m.group("fn").strip()
    if m := AT_OLD.match(text):
        where = m.group("where")
        return re.split(r":\d+:", where)[-1].strip() if re.search(r":\d+:", where) else where
    return None


def classify(block: ErrorBlock) -> ErrorBlock:
    for line in [block.header] + [PREFIX.match(x).group(1).strip() for x in block.lines[1:] if PREFIX.match(x)]:
        if line.startswith("Host Frame"):
            continue
        rest = line.split("Device Frame:", 1)[1].strip() if "Device Frame:" in line else None
        if rest is None and (m := re.search(r"(?:^|.*\s)at\s+(.+)$", line)):
            rest = m.group(1)     # the last " at ": "... starting at (32,0,0) ... at kernel()+0x2b0"
        if rest and (fn := _function(rest)):
            block.functions.append(fn)
    meld = [f for f in block.functions if is_meld(f)]
    block.kernel = meld[0] if meld else (block.functions[-1] if block.functions else None)
    if m := API_CALL.search(" ".join(block.lines)):
        block.api_call = m.group(1)
    if TARGET_EXIT.match(block.header):        # pytest failed: judged from its own output
        block.category = "exit"
    elif INTERNAL.search(block.header):
        block.category = "internal"
    elif FILTERED_API.match(block.header) and not block.functions:
        block.category = "filtered"
    elif meld:
        block.category = "meld"
    return block


def parse_log(text: str) -> LogReport:
    """Split a compute-sanitizer log into summaries and error blocks. A block starts at a prefix line
    with one space then text that is not a continuation keyword; indented lines continue it; a bare
    prefix line ends it."""
    report, current = LogReport(), None
    for raw in text.splitlines():
        m = PREFIX.match(raw)
        if not m:
            continue
        body = m.group(1)
        if s := ERROR_SUMMARY.search(body):
            report.error_summary = (report.error_summary or 0) + int(s.group(1))
        if s := RACE_SUMMARY.search(body):
            vals = [int(v) for v in s.groups()]
            report.race_summary = vals if report.race_summary is None else [a + b for a, b in
                                                                          zip(report.race_summary, vals)]
        stripped = body.strip()
        if not stripped:
            current = None
        elif body.startswith(" ") and not body.startswith("  ") and not CONTINUATION.match(stripped):
            current = None
            if not INFO_HEADER.match(stripped):
                current = ErrorBlock(stripped, [raw])
                report.blocks.append(current)
        elif current is not None:
            current.lines.append(raw)
    for b in report.blocks:
        classify(b)
    return report


# --- pytest output ----------------------------------------------------------------------------------
@dataclass
class PytestCounts:
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    xfailed: int = 0             # (expected failures and unexpected passes report like any other outcome)
    xpassed: int = 0
    summary_line: str | None = None
    failed_ids: list[str] = field(default_factory=list)
    last_started: str | None = None     # with -v: the test a killed shard was running
    reported: list[str] = field(default_factory=list)   # with -v: every test with an outcome, in first-report order


_OUTCOME = {"PASSED": "passed", "FAILED": "failed", "SKIPPED": "skipped", "ERROR": "errors", "XFAIL": "xfailed",
            "XPASS": "xpassed"}


def parse_pytest(text: str) -> PytestCounts:
    """The counts of pytest's summary line; a run killed before it (no summary) counts what its -v lines report,
    so a partial run still says what passed and which tests failed (their messages are in the lost summary)."""
    c = PytestCounts()
    outcomes: dict[str, str] = {}
    for line in text.splitlines():
        if re.search(r"\b\d+ (passed|failed|errors?|skipped|deselected)\b.* in [\d.]+s", line):
            c.summary_line = line.strip("= ")
        if m := re.match(r"^(FAILED|ERROR) (\S+)", line):
            c.failed_ids.append(m.group(2))
        if m := re.match(r"^(\S+::.*?)(?:\s+(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b.*)?\s*$", line):
            c.last_started = None if m.group(2) else m.group(1)
            if m.group(2):
                outcomes[m.group(1)] = m.group(2)
    c.reported = list(outcomes)
    if c.summary_line:
        for n, word in re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)", c.summary_line):
            key = "errors" if word.startswith("error") else word
            setattr(c, key, int(n))
    else:
        for test, word in outcomes.items():
            setattr(c, _OUTCOME[word], getattr(c, _OUTCOME[word]) + 1)
            if word in ("FAILED", "ERROR") and test not in c.failed_ids:
                c.failed_ids.append(test)
    return c


# --- shards -----------------------------------------------------------------------------------------
@dataclass
class Shard:
    tool: str
    index: int
    count: int
    ids: list[str]
    log: str
    out: str
    caching: bool = False        # run with torch's caching allocator (TOOL_ENV not applied)
    cmd: list[str] = field(default_factory=list)
    rc: int | None = None
    start: float | None = None
    wall_s: float = 0.0
    timed_out: bool = False
    not_started: bool = False
    report: LogReport = field(default_factory=LogReport)
    pytest: PytestCounts = field(default_factory=PytestCounts)
    problems: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.tool} shard {self.index}/{self.count}"


def deal(ids: list[str], n: int) -> list[list[str]]:
    """Round-robin: neighbouring parametrizations (similar cost) land on different shards."""
    n = max(1, min(n, len(ids)))
    return [ids[k::n] for k in range(n)] if ids else []


def shard_count(tool: str, n_tests: int, jobs: int) -> int:
    """As many shards as --jobs runs at once when the work fills them, more when a tool's processes may
    not run more than MAX_TESTS_PER_SHARD tests each."""
    by_cost = min(jobs, n_tests, math.ceil(n_tests * SECONDS_PER_TEST[tool] / TARGET_SHARD_S))
    by_size = math.ceil(n_tests / MAX_TESTS_PER_SHARD.get(tool, n_tests or 1))
    return max(1, by_cost, by_size)


def judge(shard: Shard, log_text: str, out_text: str) -> Shard:
    """Fill in the shard's parsed log, pytest counts and the list of reasons it fails (empty: it passed)."""
    shard.report, shard.pytest = parse_log(log_text), parse_pytest(out_text)
    r, p, why = shard.report, shard.pytest, shard.problems
    if shard.not_started:
        why.append("not started: the run's --budget was spent")
        return shard
    if shard.timed_out:
        why.append(f"timed out after {shard.wall_s:.0f} s"
                   + (f" while running {p.last_started}" if p.last_started else ""))
    # racecheck ends with "RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)", the others "ERROR SUMMARY"
    finished = r.error_summary is not None or (shard.tool == "racecheck" and r.race_summary is not None)
    if not finished and not shard.timed_out:
        tail = out_text.split("\n\n", 1)[-1].strip()[-300:]          # past the "$ command" line
        why.append(f"no {'RACECHECK' if shard.tool == 'racecheck' else 'ERROR'} SUMMARY in {shard.log} "
                   f"(the sanitizer did not finish)" + (f"; its output ends: {tail!r}" if not log_text else ""))
    if n := r.count("internal"):
        headers = "; ".join(b.header for b in r.blocks if b.category == "internal")
        why.append(f"{n} sanitizer internal error(s): {headers[:300]}")
    if n := r.count("meld"):
        why.append(f"{n} error(s) in meld kernels")
    if n := r.unaccounted():
        why.append(f"the summary counts {n} error(s) more than the log shows (print limit or unknown format)")
    if not shard.timed_out:
        if p.summary_line is None:
            why.append(f"no pytest summary line in {shard.out} (exit status {shard.rc})")
        elif p.failed or p.errors or shard.rc not in (0, None):
            why.append(f"pytest: {p.summary_line} (exit status {shard.rc})" +
                       (f"; failed: {', '.join(p.failed_ids[:5])}" if p.failed_ids else ""))
        elif p.passed == 0:
            why.append(f"passed no tests ({p.summary_line})")
    return shard


# --- running ----------------------------------------------------------------------------------------
def find_sanitizer(explicit: str | None) -> str | None:
    for c in (explicit, shutil.which("compute-sanitizer"), "/usr/local/cuda/bin/compute-sanitizer"):
        if c and Path(c).is_file():
            return c
    return None


def supported(flags: list[str], help_text: str) -> tuple[list[str], list[str]]:
    """Keep the --options (with their values) that the installed sanitizer lists in --help."""
    kept, dropped, i = [], [], 0
    trust = "--tool" in help_text          # a help text of another shape filters nothing
    while i < len(flags):
        j = i + 1 if i + 1 < len(flags) and not flags[i + 1].startswith("--") else i
        (dropped if trust and flags[i] not in help_text else kept).extend(flags[i:j + 1])
        i = j + 1
    return kept, dropped


def child_env(tool: str | None, caching: bool = False) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(TOOL_ENV.get(tool, {}) if tool and not caching else {}))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def collect(markers: set[str], extra: list[str]) -> dict[str, tuple[list[str], str]]:
    """Node ids per marker expression (collections run side by side), plus the output for diagnostics."""
    procs = {m: subprocess.Popen([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                                  "-m", m, *extra], cwd=ROOT, env=child_env(None), text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for m in sorted(markers)}
    out = {}
    for m, p in procs.items():
        try:
            text, _ = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            p.kill()
            text = p.communicate()[0] + "\n(collection timed out after 300 s)"
        ids = []
        for line in text.splitlines():
            if not line.strip() or line.startswith("="):
                break                   # ids come first; warnings/summary after a blank line
            if "::" in line and not line.startswith(" "):
                ids.append(line.strip())
        out[m] = (ids, "" if p.returncode in (0, 5) else text[-2000:])
    return out


def run_shards(shards: list[Shard], jobs: int, timeout: float, deadline: float) -> None:
    """At most `jobs` sanitizer processes at once, each in its own process group (killed whole on timeout)."""
    queue, running, done = list(shards), {}, 0
    while queue or running:
        while queue and len(running) < jobs:
            s = queue.pop(0)
            left = deadline - time.monotonic()
            limit = min(timeout, left)
            if left < min(30.0, timeout):       # too little of the budget left to be worth starting
                s.not_started = True
                judge(s, "", "")
                done += 1
                print(f"[{done}/{len(shards)}] {s.name}: not started (budget spent)", flush=True)
                continue
            Path(s.log).unlink(missing_ok=True)     # a stale log from an earlier run must not pass for this one
            fh = open(s.out, "w")   # noqa: SIM115 -- the shard's stdout; closed when it ends
            fh.write("$ " + " ".join(s.cmd) + "\n\n")
            fh.flush()
            s.start = time.monotonic()
            p = subprocess.Popen(s.cmd, cwd=ROOT, env=child_env(s.tool, s.caching), stdout=fh, stderr=subprocess.STDOUT,
                                 start_new_session=True)
            running[p.pid] = (s, p, fh, s.start + limit)
        time.sleep(0.5)
        for pid, (s, p, fh, end) in list(running.items()):
            if p.poll() is None and time.monotonic() < end:
                continue
            if p.poll() is None:
                s.timed_out = True
                kill_group(p)
            fh.close()
            del running[pid]
            s.rc, s.wall_s = p.returncode, time.monotonic() - s.start
            log = Path(s.log).read_text(errors="replace") if Path(s.log).exists() else ""
            judge(s, log, Path(s.out).read_text(errors="replace"))
            done += 1
            r = s.report
            print(f"[{done}/{len(shards)}] {s.name}: {len(s.ids)} tests, {s.wall_s:.0f} s, pytest "
                  f"{s.pytest.passed} passed {s.pytest.failed} failed; meld {r.count('meld')}, filtered "
                  f"{r.count('filtered')}, other {r.count('other')} -- "
                  f"{'FAIL: ' + '; '.join(s.problems) if s.problems else 'ok'}", flush=True)


def kill_group(p: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(p.pid, sig)
            p.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            p.wait()
            return


# --- report -----------------------------------------------------------------------------------------
@dataclass
class ToolResult:
    tool: str
    marker: str
    tests: int
    flags: list[str]
    shards: list[Shard]
    problems: list[str] = field(default_factory=list)

    def total(self, what: str) -> int:
        return sum(s.report.count(what) for s in self.shards)

    def pytest(self, what: str) -> int:
        return sum(getattr(s.pytest, what) for s in self.shards)

    @property
    def wall_s(self) -> float:
        ran = [s for s in self.shards if s.start is not None]
        return max((s.start + s.wall_s for s in ran), default=0) - min((s.start for s in ran), default=0)

    @property
    def failed(self) -> bool:
        return bool(self.problems) or any(s.problems for s in self.shards)


def exit_status(results: list[ToolResult]) -> int:
    """1 if any tool or shard failed (see the module docstring for what fails), else 0."""
    return 1 if any(r.failed for r in results) else 0


def markdown(results: list[ToolResult], header: str, max_groups: int = 20, max_lines: int = 40) -> str:
    ok = exit_status(results) == 0
    columns = ["tool", "tests", "shards", "wall s", "meld errors", "filtered API errors", "other errors", "passed",
               "failed", "skipped", "status"]
    out = ["# compute-sanitizer over meld's GPU tests", "", header, "", f"**{'PASS' if ok else 'FAIL'}**", "",
           "| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for r in results:
        row = [r.tool, r.tests, len(r.shards), f"{r.wall_s:.0f}", r.total("meld"), r.total("filtered"),
               r.total("other"), r.pytest("passed"), r.pytest("failed") + r.pytest("errors"), r.pytest("skipped"),
               "FAIL" if r.failed else "ok"]
        out.append("| " + " | ".join(map(str, row)) + " |")
    fails = [f"- {r.tool}: {p}" for r in results for p in r.problems]
    fails += [f"- {s.name} ({s.log}): {p}" for r in results for s in r.shards for p in s.problems]
    if fails:
        out += ["", "## Failures", "", *fails]
    for title, category in (("Errors in meld kernels", "meld"), ("Other errors (reported, not failing)", "other")):
        groups: dict[tuple, list] = {}
        for r in results:
            for s in r.shards:
                for b in s.report.blocks:
                    if b.category == category:
                        key = (r.tool, re.sub(r"0x[0-9a-fA-F]+|\(\d+,\d+,\d+\)", "#", " ".join(b.lines[:2])))
                        groups.setdefault(key, [s, b, 0])[2] += 1
        if not groups:
            continue
        out += ["", f"## {title}", ""]
        for (tool, _), (s, b, n) in list(groups.items())[:max_groups]:
            out.append(f"### {tool}: {b.header} -- kernel {b.kernel or '?'} -- {n} like it, first in {s.log}")
            if category == "meld":
                more = [f"... ({len(b.lines) - max_lines} more lines)"] if len(b.lines) > max_lines else []
                out += ["", "```", *b.lines[:max_lines], *more, "```", ""]
        if len(groups) > max_groups:
            out.append(f"... and {len(groups) - max_groups} more kinds; see the JSON and the logs")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(usage="%(prog)s [--tools T ...] [--jobs N] [--out DIR] [--timeout S] [--budget S] "
                                       "[--sanitizer PATH] [-- pytest args]", description=__doc__.split("\n\n")[0],
                                 epilog="Arguments after -- go to the test collection (e.g. -k tma).")
    ap.add_argument("--tools", nargs="+", choices=TOOLS, default=list(TOOLS))
    ap.add_argument("--jobs", type=int, default=6, help="sanitizer processes at once on the GPU (default 6: 12 ran the H200 out of memory)")
    ap.add_argument("--out", default=str(Path(os.environ["OUT"]) / "sanitize") if os.environ.get("OUT")
                    else str(ROOT / "build" / "sanitize"), help="logs, SANITIZE.md, sanitize.json")
    ap.add_argument("--timeout", type=float, default=480, help="seconds per shard (default 480)")
    ap.add_argument("--budget", type=float, default=540, help="seconds for the whole run; later shards get "
                    "what is left and are not started under 30 s (default 540)")
    ap.add_argument("--sanitizer", help="compute-sanitizer binary (default: PATH, then /usr/local/cuda/bin)")
    args = ap.parse_args(argv)
    if args.jobs < 1 or args.timeout <= 0:
        ap.error("--jobs and --timeout must be positive")
    t0 = time.monotonic()
    deadline = t0 + args.budget
    sanitizer = find_sanitizer(args.sanitizer)
    if sanitizer is None:
        print("compute-sanitizer not found (PATH, /usr/local/cuda/bin); pass --sanitizer", file=sys.stderr)
        return 2
    outdir = Path(args.out).resolve()
    outdir.mkdir(parents=True, exist_ok=True)
    version = subprocess.run([sanitizer, "--version"], capture_output=True, text=True,
                             check=False).stdout.strip().splitlines()
    help_text = subprocess.run([sanitizer, "--help"], capture_output=True, text=True, check=False).stdout
    print(f"{sanitizer}: {version[-1] if version else '?'}; collecting ...", flush=True)
    selections = collect({MARKERS[t] for t in args.tools} | {CACHING}, extra)
    cached = set(selections[CACHING][0])
    results, shards = [], []
    for tool in args.tools:
        ids, error = selections[MARKERS[tool]]
        flags, dropped = supported(COMMON_FLAGS + TOOL_FLAGS[tool], help_text)
        r = ToolResult(tool, MARKERS[tool], len(ids), flags, [])
        if dropped:
            print(f"warning: {tool}: this compute-sanitizer does not list {dropped}; running without", flush=True)
        if error:
            r.problems.append(f"collection failed: {error}")
        elif not ids:
            r.problems.append(f"no tests selected by -m {MARKERS[tool]!r} {' '.join(extra)}".rstrip())
        own_env = tool in TOOL_ENV and cached.intersection(ids)
        plain = [i for i in ids if i not in cached] if own_env else ids
        groups = [(g, False) for g in deal(plain, shard_count(tool, len(plain), args.jobs))]
        groups += [([i for i in ids if i in cached], True)] if own_env else []
        for k, (group, caching) in enumerate(groups, 1):
            name = f"{tool}-shard{k}" + ("-caching" if caching else "")
            s = Shard(tool, k, len(groups), group, str(outdir / f"{name}.log"), str(outdir / f"{name}.out"), caching)
            s.cmd = [sanitizer, "--tool", tool, "--log-file", s.log, *flags,
                     sys.executable, "-m", "pytest", "-v", "-rfE", "-p", "no:cacheprovider", *group]
            r.shards.append(s)
        results.append(r)
        shards += r.shards
        print(f"{tool}: {len(ids)} tests in {len(groups)} shard(s); flags {' '.join(flags)}", flush=True)
    shards.sort(key=lambda s: -(STARTUP_S + len(s.ids) * SECONDS_PER_TEST[s.tool]))   # longest first
    run_shards(shards, args.jobs, args.timeout, deadline)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, check=False).stdout.strip() or "?"
    except OSError:
        commit = "?"
    header = (f"{version[-1] if version else sanitizer} · commit {commit} · {time.monotonic() - t0:.0f} s wall · "
              f"--jobs {args.jobs} · logs in {outdir}")
    md = markdown(results, header)
    (outdir / "SANITIZE.md").write_text(md)
    (outdir / "sanitize.json").write_text(json.dumps(
        {"sanitizer": sanitizer, "version": version, "commit": commit, "extra_pytest_args": extra,
         "wall_s": time.monotonic() - t0, "passed": exit_status(results) == 0,
         "tools": [dataclasses.asdict(r) for r in results]}, indent=1))
    table = [line for line in md.splitlines() if line.startswith("|")]
    print("\n" + md + "\n" + "\n".join(table) + f"\n\n{'PASS' if exit_status(results) == 0 else 'FAIL'} -- "
          f"{outdir / 'SANITIZE.md'}", flush=True)       # the table again: the caller may see only the tail
    return exit_status(results)


if __name__ == "__main__":
    sys.exit(main())
