"""What the A/B scripts (bench/*_ab.py) share: the `meld` package of a side, a tree holding another
commit's package put first on the path, and the alternating rounds of worker processes.

A tree that is not there must stop the run: with the path entry missing, `import meld` would quietly find
this checkout's package and the A/B would compare the code with itself. (Trees under an ignored folder such
as `.ab/` reach the GPU machine only when the run carries them.)
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Sequence


def add_round_arguments(p: argparse.ArgumentParser) -> None:
    """--rounds, and the options a script hands its worker processes (hidden): --worker, --check, --out."""
    p.add_argument("--rounds", type=int, default=2, help="alternating base/new rounds (checks run in the first)")
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--check", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)


def add_tree_arguments(p: argparse.ArgumentParser, required: bool = True) -> None:
    """--base (the base side's tree) and --json (every round's times and the medians), then add_round_arguments'."""
    p.add_argument("--base", type=Path, required=required, help="a tree holding the base commit's `meld` package")
    p.add_argument("--json", type=Path)
    add_round_arguments(p)


def add_also_argument(p: argparse.ArgumentParser) -> None:
    """--also NAME=TREE ...: more trees timed in the same rounds against the same base, a column each (screening
    several candidates costs one base run a round, not one per candidate)."""
    p.add_argument("--also", nargs="+", default=[], metavar="NAME=TREE",
                   help="more trees timed in the same rounds against the base, a column each")


def also_trees(values: Sequence[str]) -> dict[str, Path]:
    """--also's trees by name, each checked before any worker runs (a missing one must not cost device time)."""
    trees: dict[str, Path] = {}
    for v in values:
        name, sep, tree = v.partition("=")
        if not (sep and name and tree):
            raise SystemExit(f"--also {v!r}: expected NAME=TREE")
        if name in ("base", "new") or name in trees:
            raise SystemExit(f"--also {v!r}: the name {name!r} is taken")
        if not (Path(tree) / "meld" / "__init__.py").is_file():
            raise SystemExit(f"--also {v!r}: {tree}: no meld package there (was the tree carried?)")
        trees[name] = Path(tree)
    return trees


def worker_tree_first(repo: Path) -> None:
    """In a worker process (`--worker TREE` on the command line), import `meld` from TREE before anything
    else imports it: a module imported once is never looked up again, so this must run before the
    script imports any of `bench` that uses meld."""
    if "--worker" in sys.argv:
        use_tree(Path(sys.argv[sys.argv.index("--worker") + 1]), repo)


def use_tree(tree: Path, repo: Path) -> None:
    """Import `meld` from `tree` (then `repo` for `bench`); exit naming the tree if it has no package."""
    init = Path(tree) / "meld" / "__init__.py"
    if not init.is_file():
        raise SystemExit(f"{tree}: no meld package there ({init} is missing; was the tree carried?)")
    sys.path[:0] = [str(tree), str(repo)]
    import meld

    if Path(meld.__file__).resolve() != init.resolve():
        raise SystemExit(f"{tree}: `import meld` found {meld.__file__} instead")


def medians(runs: dict[str, list[dict]]) -> dict[str, dict[str, dict[str, float]]]:
    """Per side, case and measure: the median over the rounds of `run_rounds`' {case: {measure: value}}."""
    return {side: {case: {m: statistics.median(run[case][m] for run in rs) for m in rs[0][case]} for case in rs[0]}
            for side, rs in runs.items()}


def run_rounds(sides: Sequence[str], rounds: int, command: Callable[[str, int, str], list[str]]
               ) -> dict[str, list[dict]] | None:
    """Each side's worker once a round, the sides' order alternating so that drift hits both.
    `command(side, round, out)` is the worker's command line; the worker writes its JSON to `out`.
    Returns every side's results in round order, or None after printing a failed worker's output."""
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory(prefix="meld-ab-") as tmp:
        for r in range(rounds):
            for side in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
                out = str(Path(tmp) / f"{side}{r}.json")
                res = subprocess.run(command(side, r, out), capture_output=True, text=True)
                if res.returncode:
                    print(res.stdout + res.stderr, file=sys.stderr)
                    return None
                runs[side].append(json.loads(Path(out).read_text()))
                print(f"round {r + 1}: {side} done", flush=True)
    return runs


def write_runs(path: Path | None, runs: dict[str, list[dict]], med: dict) -> None:
    """--json: every round's results and their medians (nothing when `path` is None)."""
    if path:
        path.write_text(json.dumps({"runs": runs, "median": med}, indent=1))


def report_new_over_base(runs: dict[str, list[dict]], measure: str, rounds: int, path: Path | None) -> None:
    """The table of a base-against-new A/B of one measure (µs a case): the base's time, then each other side's
    (new, and --also's) and its ratio to the base; its note, and --json."""
    from bench.harness import print_aligned   # (imports meld: never in a worker before its tree)

    med = medians(runs)
    others = [side for side in runs if side != "base"]
    rows = [[case, f"{base[measure]:.1f}"] + [x for side in others for x in
                                               (f"{med[side][case][measure]:.1f}",
                                                f"{med[side][case][measure] / base[measure]:.3f}")]
            for case, base in med["base"].items()]
    print_aligned(["case", "base µs"] + [x for side in others for x in (f"{side} µs", f"{side}/base")], rows)
    print(f"medians over {rounds} alternating rounds; {'/base, '.join(others)}/base > 1: slower than base")
    write_runs(path, runs, med)
