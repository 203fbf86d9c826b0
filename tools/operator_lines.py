"""How much of each operator is its own code, outside the shared runtime: lines per operator at git commits.

    python tools/operator_lines.py [COMMIT ...]      (default: HEAD)

An operator's own files are those only it uses (its Python class, graph, kernel config, template, planner and
reference walk); everything else under meld/ is the shared runtime (IR, lowering, compiler, driver, checks,
the operator shell, the skeleton, the cross-rank protocol, tools). Counts non-blank lines that are not only a
comment, per operator and in total, one column per commit, so that a move of code from operators into the
shared runtime shows as a drop in the operators' rows. A file listed for an operator but absent at a commit
counts 0 there.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

OPERATORS = {
    "DecodeAttention": ["meld/ops/decode_attention.py", "meld/ops/decode_graph.py", "meld/codegen/decode_kernel.py",
                        "meld/codegen/templates/decode_attention.cuh", "meld/codegen/templates/decode_plan.cuh",
                        "meld/codegen/templates/decode_plan.h", "meld/scheduler/decode_plan.py",
                        "meld/scheduler/decode_plan_host.py", "meld/runtime/host/decode_plan.cpp"],
    "DecodeMLA": ["meld/ops/decode_mla.py", "meld/ops/mla_graph.py", "meld/codegen/mla_kernel.py",
                  "meld/codegen/templates/mla_decode.cuh"],
    "MoE": ["meld/ops/moe.py", "meld/ops/moe_graph.py", "meld/ops/moe_weights.py", "meld/codegen/moe_kernel.py",
            "meld/codegen/templates/moe.cuh", "meld/codegen/templates/moe_plan.h", "meld/scheduler/moe_plan.py",
            "meld/runtime/moe_reference.py", "meld/runtime/host/moe_plan.cpp"],
    "SeqParallelDecode": ["meld/distributed/seq_parallel.py", "meld/distributed/seq_decode.py",
                          "meld/distributed/shard.py", "meld/codegen/templates/decode_xrank.cuh"],
    "RowParallelLinear": ["meld/distributed/tp_linear.py", "meld/distributed/tp_matmul.py",
                          "meld/ops/tp_linear_graph.py", "meld/codegen/tp_kernel.py",
                          "meld/codegen/templates/tp_linear.cuh"],
    "ExpertParallelMoE": ["meld/distributed/expert_parallel.py", "meld/distributed/ep_moe.py",
                          "meld/codegen/ep_kernel.py", "meld/codegen/templates/ep_moe.cuh"],
    "CascadeDecode": ["meld/ops/cascade_decode.py", "meld/ops/cascade_graph.py",
                      "meld/scheduler/split_reduce_plan.py", "meld/codegen/templates/split_reduce_plan.h",
                      "meld/runtime/host/split_reduce_plan.cpp"],
}


def code_lines(text: str) -> int:
    """Lines that are neither blank nor only a comment (# for Python, // for C/C++/CUDA)."""
    return sum(1 for line in text.splitlines() if line.strip() and not line.strip().startswith(("#", "//")))


def files_at(commit: str) -> dict[str, str]:
    names = subprocess.run(["git", "ls-tree", "-r", "--name-only", commit, "meld"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    keep = [n for n in names if n.endswith((".py", ".cuh", ".h", ".c", ".cpp"))]
    return {n: subprocess.run(["git", "show", f"{commit}:{n}"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout for n in keep}


def count(commit: str) -> dict[str, int]:
    files = files_at(commit)
    owned = {f for fs in OPERATORS.values() for f in fs}
    rows = {op: sum(code_lines(files.get(f, "")) for f in fs) for op, fs in OPERATORS.items()}
    rows["operators, total"] = sum(rows.values())
    rows["shared runtime"] = sum(code_lines(t) for n, t in files.items() if n not in owned)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("commits", nargs="*", default=["HEAD"])
    args = ap.parse_args()
    table = {c: count(c) for c in args.commits}
    print(f"| operator | {' | '.join(args.commits)} |")
    print(f"|---|{'---:|' * len(args.commits)}")
    for row in next(iter(table.values())):
        print(f"| {row} | {' | '.join(str(table[c][row]) for c in args.commits)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
