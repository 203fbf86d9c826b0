"""Run meld's whole GPU suite on one GPU in parallel pytest workers; print one summary line.

    python tools/gpu_suite.py [--workers N] [--budget S] [--out DIR] [--durations FILE] [--shard K/N]
        [-- extra pytest args]

On the GPU machine, from the repository root (children get PYTHONPATH=<root>). Every `gpu` test is
collected (the `trap` tests included: nothing is left out) and dealt to N worker processes that share the
GPU, longest first onto the least loaded worker, by the per-test seconds in --durations (default
tools/gpu_durations.json; a test not listed counts as the median). Each worker is one pytest process, so
CUDA initialisation and kernel loading are paid once per worker, not per test. The run writes each test's
measured seconds to DIR/gpu_durations.json; copy it over tools/gpu_durations.json to rebalance. `--shard K/N`
runs the K-th of N shards dealt the same way (the shared tests and the alone tests each split N ways), for device
calls too short for the whole suite: shards 1/N .. N/N, each run at the same tree, are the whole suite.

The `trap` tests run last, alone on the GPU: each bounds how long its child's watchdog takes to trip, a
bound that time-slicing with the other workers' kernels broke (6.2 s against 3.2 s, 2026-12-02). So do the
`whole_gpu` tests, which need most of its memory (beside 14 workers, a FlashInfer port case ran out of it while
the DeepSeek serving test held ~75 GB, 2026-12-03).

Exit 0 only when every collected test ran and none failed or errored; a worker still running when the
--budget ends is killed (its process group) and the test it was in is named, and what it had reported before
(its -v lines) still counts: the tests it passed, the ids of those it failed, how many never ran. Skips are counted and their
reasons listed (on one GPU the two-GPU tests skip, saying so), so a skip is never silent.

A test that leaves its process's CUDA context lost (a crashed kernel: "unspecified launch failure", an illegal
address) would fail every test after it in that worker; tests/conftest.py stops the worker there ("sticky CUDA
error"), and the tests it had not reached go on in a fresh worker process, within the budget -- except the rest of
the crashed test's file, which are held back and reported as not run: a broken kernel usually breaks every test
of its file, and each would cost a fresh worker its start and CUDA context (2026-12-05: one broken FP8 MoE kernel
restarted workers 34 times and left the budget short of 76 other tests).

Why not pytest-xdist alone: its scheduling knows nothing of durations, and a few two-rank tests take minutes
while most take seconds; dealt by measured seconds, those start first and the workers end together.
"""
from __future__ import annotations

import argparse
import heapq
import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from sanitize import ROOT, child_env, collect, kill_group, parse_pytest   # tools/ is this script's path[0]

DURATIONS = ROOT / "tools" / "gpu_durations.json"
_DURATION_LINE = re.compile(r"^\s*([\d.]+)s (setup|call|teardown)\s+(\S+::\S.*?)\s*$")
_SKIP_LINE = re.compile(r"^SKIPPED \[(\d+)\] ([^:]+:\d+): (.*)$")


@dataclass
class Worker:
    index: int
    ids: list[str] = field(default_factory=list)
    expected_s: float = 0.0
    out: str = ""
    rc: int | None = None
    wall_s: float = 0.0
    timed_out: bool = False


SHARED, ALONE = "gpu and not (trap or whole_gpu)", "gpu and (trap or whole_gpu)"   # (dealt to workers / run alone)


@dataclass
class Crashes:
    """Test files one of whose tests lost a worker's CUDA context: the first such test of each, and the file's tests
    then held back instead of run."""
    first: dict[str, str] = field(default_factory=dict)        # file name -> the test that crashed first
    held: dict[str, list[str]] = field(default_factory=dict)   # file name -> its tests not run


def deal_lpt(ids: list[str], seconds: dict[str, float], workers: int) -> list[Worker]:
    """Longest processing time first: each test to the worker with the least expected time so far (unknown
    tests count as the median), keeping collection order inside a worker (module-scoped fixtures stay shared)."""
    default = statistics.median(seconds.values()) if seconds else 1.0
    cost = {i: seconds.get(i, default) for i in ids}
    pool = [Worker(k) for k in range(max(1, min(workers, len(ids))))]
    heap = [(0.0, w.index) for w in pool]
    for i in sorted(ids, key=lambda i: -cost[i]):
        load, k = heapq.heappop(heap)
        pool[k].ids.append(i)
        pool[k].expected_s = load + cost[i]
        heapq.heappush(heap, (pool[k].expected_s, k))
    order = {i: n for n, i in enumerate(ids)}
    for w in pool:
        w.ids.sort(key=order.__getitem__)
    return pool


def shard(ids: list[str], seconds: dict[str, float], k: int, n: int) -> list[str]:
    """Shard k (1-based) of n: the tests dealt longest first to the least loaded of n shards (deal_lpt), so the
    shards take about the same time and every test is in exactly one; collection order inside a shard."""
    shards = deal_lpt(ids, seconds, n) if ids else []
    return shards[k - 1].ids if k <= len(shards) else []


def parse_shard(text: str) -> tuple[int, int]:
    """"K/N" -> (K, N), 1 <= K <= N."""
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard must be K/N (e.g. 1/2), got {text!r}") from None
    if not 1 <= k <= n:
        raise argparse.ArgumentTypeError(f"--shard K/N needs 1 <= K <= N, got {text!r}")
    return k, n


def parse_durations(text: str) -> dict[str, float]:
    """Seconds per test (setup + call + teardown) from pytest's `--durations=0 --durations-min=0` report."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if m := _DURATION_LINE.match(line):
            out[m.group(3)] = out.get(m.group(3), 0.0) + float(m.group(1))
    return out


def parse_skips(text: str) -> dict[str, int]:
    """Skip reasons with their counts from pytest's `-rs` short summary."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        if m := _SKIP_LINE.match(line):
            out[m.group(3)] = out.get(m.group(3), 0) + int(m.group(1))
    return out


STICKY_STOP = "sticky CUDA error"   # (tests/conftest.py's stop reason)


def _file_and_test(node_id: str) -> str:
    """A node id as the file's name and the test (-v lines print paths relative to pytest's rootdir)."""
    path, _, test = node_id.partition("::")
    return f"{Path(path).name}::{test}"


def _file(node_id: str) -> str:
    return Path(node_id.partition("::")[0]).name


def run(pool: list[Worker], todo: list[Worker], extra: list[str], outdir: Path, budget: float,
        crashes: Crashes) -> None:
    """Runs `todo` (workers of `pool`) to their ends or the budget's; a worker stopped by a sticky CUDA error
    hands the tests it had not reached to a new worker, appended to `pool`, but for those of a file that crashed
    a worker (`crashes`: recorded and held back)."""
    procs = {}

    def start(w: Worker) -> None:
        w.out = str(outdir / f"worker{w.index}.out")
        fh = open(w.out, "w")   # noqa: SIM115 -- the worker's stdout; closed when it ends
        cmd = [sys.executable, "-m", "pytest", "-v", "-rfEs", "-p", "no:cacheprovider", "--durations=0",
               "--durations-min=0", *extra, *w.ids]
        # COLUMNS: pytest cuts each short-summary line to the terminal's width, message first
        fh.write("$ " + " ".join(cmd[:12]) + f" ... ({len(w.ids)} tests)\n\n")
        fh.flush()
        procs[w.index] = (subprocess.Popen(cmd, cwd=ROOT, env={**child_env(None), "COLUMNS": "400"}, stdout=fh,
                                           stderr=subprocess.STDOUT, start_new_session=True), fh, time.monotonic())

    for w in todo:
        start(w)
    deadline = time.monotonic() + budget
    by_index = {w.index: w for w in pool}
    while procs:
        time.sleep(0.5)
        for k, (p, fh, t0) in list(procs.items()):
            w = by_index[k]
            if p.poll() is None and time.monotonic() < deadline:
                continue
            if p.poll() is None:
                w.timed_out = True
                kill_group(p)
            fh.close()
            w.rc, w.wall_s = p.returncode, time.monotonic() - t0
            del procs[k]
            text = Path(w.out).read_text(errors="replace")
            c = parse_pytest(text)
            print(f"worker {k}: {len(w.ids)} tests, {w.wall_s:.0f} s (expected {w.expected_s:.0f} s)"
                  f"{', timed out' if w.timed_out else ''}: {c.summary_line or 'no pytest summary'}", flush=True)
            done = {_file_and_test(i) for i in c.reported}
            rest = [i for i in w.ids if _file_and_test(i) not in done]
            if STICKY_STOP in text and 0 < len(rest) < len(w.ids) and not w.timed_out and time.monotonic() < deadline:
                crashed = c.failed_ids[-1] if c.failed_ids else "?"
                if c.failed_ids:
                    crashes.first.setdefault(_file(crashed), crashed)
                held = [i for i in rest if _file(i) in crashes.first]
                for i in held:
                    crashes.held.setdefault(_file(i), []).append(i)
                rest = [i for i in rest if _file(i) not in crashes.first]
                if not rest:
                    print(f"worker {k}: stopped at a {STICKY_STOP} in {crashed}; its {len(held)} remaining tests "
                          "are of crashed files: held back", flush=True)
                    continue
                nw = Worker(len(pool), rest, w.expected_s * len(rest) / len(w.ids))
                pool.append(nw)
                by_index[nw.index] = nw
                print(f"worker {k}: stopped at a {STICKY_STOP} in {crashed}; its {len(rest)} remaining tests go on "
                      f"in worker {nw.index}" + (f" ({len(held)} of crashed files held back)" if held else ""), flush=True)
                start(nw)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=8, help="pytest processes sharing the GPU (default 8)")
    ap.add_argument("--budget", type=float, default=530, help="seconds for the whole run (default 530)")
    ap.add_argument("--out", default=str(Path(os.environ["OUT"]) / "gpu_suite") if os.environ.get("OUT")
                    else str(ROOT / "build" / "gpu_suite"), help="worker logs and gpu_durations.json")
    ap.add_argument("--durations", type=Path, default=DURATIONS, help="per-test seconds used to balance workers")
    ap.add_argument("--shard", type=parse_shard, default=(1, 1), metavar="K/N",
                    help="run only shard K of N (balanced by --durations), for a device call too short for the whole "
                         "suite: the N shards together are the whole suite")
    args = ap.parse_args(argv)
    if args.workers < 1 or args.budget <= 0:
        ap.error(f"--workers and --budget must be positive, got {args.workers} and {args.budget}")
    t0 = time.monotonic()
    outdir = Path(args.out).resolve()
    outdir.mkdir(parents=True, exist_ok=True)
    selected = collect({SHARED, ALONE}, extra)
    (shared, error), (alone, error_alone) = selected[SHARED], selected[ALONE]
    if error or error_alone or not shared + alone:
        why = error or error_alone
        print(f"gpu suite: FAIL -- collection {'failed: ' + why if why else 'selected no tests'}", flush=True)
        return 1
    seconds = json.loads(args.durations.read_text()) if args.durations.is_file() else {}
    k, n = args.shard
    shared, alone = shard(shared, seconds, k, n), shard(alone, seconds, k, n)
    ids = shared + alone
    label = f"gpu suite (shard {k}/{n})" if n > 1 else "gpu suite"
    workers = deal_lpt(shared, seconds, args.workers) if shared else []
    print(f"{label}: {len(ids)} tests on {len(workers)} workers, then {len(alone)} alone ...", flush=True)
    crashes = Crashes()
    run(workers, list(workers), extra, outdir, args.budget - (time.monotonic() - t0), crashes)
    for i in (i for i in alone if _file(i) in crashes.first):
        crashes.held.setdefault(_file(i), []).append(i)
    alone = [i for i in alone if _file(i) not in crashes.first]
    if alone:   # (after the others: the GPU to themselves)
        workers.append(Worker(len(workers), alone, sum(seconds.get(i, 1.0) for i in alone)))
        run(workers, workers[-1:], extra, outdir, args.budget - (time.monotonic() - t0), crashes)
    passed = failed = skipped = xfailed = 0
    problems, skips, measured = [], {}, {}
    for w in workers:
        text = Path(w.out).read_text(errors="replace")
        c = parse_pytest(text)
        passed, failed, skipped = passed + c.passed + c.xpassed, failed + c.failed + c.errors, skipped + c.skipped
        xfailed += c.xfailed
        measured.update(parse_durations(text))
        for reason, n in parse_skips(text).items():
            skips[reason] = skips.get(reason, 0) + n
        if w.timed_out:
            problems.append(f"worker {w.index} killed at the budget" + (f" in {c.last_started}" if c.last_started else ""))
            if c.summary_line is None:   # (its -v lines: the failures' ids, their messages lost with the summary)
                problems += [f"FAILED {i} (message lost: worker {w.index} was killed before its summary)"
                             for i in c.failed_ids]
        elif c.summary_line is None:
            problems.append(f"worker {w.index} printed no pytest summary (exit {w.rc}; {w.out})")
        # pytest's short summary line of each failure (-rfE): its id and the first line of its message, which
        # is all that reaches the caller when the device returns only a few of the workers' logs
        problems += [line[:600] for line in text.splitlines() if re.match(r"^(FAILED|ERROR) \S+::", line)]
    held = sum(len(v) for v in crashes.held.values())
    for name, tests in crashes.held.items():
        problems.append(f"{len(tests)} tests of {name} not run: {crashes.first[name]} lost its worker's CUDA context")
    ran = passed + failed + skipped + xfailed + held
    if ran < len(ids):   # (a test that fails and then errors in its teardown counts twice)
        problems.append(f"{len(ids) - ran} collected tests did not report")
    if passed == 0 and ids:
        problems.append("no test passed (is the GPU visible?)")
    (outdir / "gpu_durations.json").write_text(json.dumps({k: round(v, 1) for k, v in sorted(measured.items())},
                                                          indent=0))
    for reason, n in sorted(skips.items(), key=lambda kv: -kv[1]):
        print(f"  skipped {n}: {reason}")
    for p in problems:
        print(f"  FAIL {p}")
    ok = not problems and failed == 0
    print(f"{label}: {'PASS' if ok else 'FAIL'} -- {len(ids)} collected, {passed} passed, {failed} failed, "
          f"{skipped} skipped, {xfailed} xfailed in {time.monotonic() - t0:.0f} s on {len(workers)} workers", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
