"""The old spelling of `meld timeline`, kept so existing scripts keep working:

    python bench/timeline.py TRACE.json [OUT.png] [--width N] [--row-height N]

is `meld timeline TRACE.json [-o OUT.png] ...`, with the same one-line errors (exit status 2).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `meld` imports as-is
from meld.cli import main  # noqa: E402


def forward(argv: list[str]) -> list[str]:
    """The old positional OUT.png (a second argument that is not an option) becomes -o OUT.png."""
    plain = [i for i, a in enumerate(argv) if not a.startswith("-") and (i == 0 or not argv[i - 1].startswith("--"))]
    if len(plain) >= 2:
        i = plain[1]
        argv = argv[:i] + ["-o", argv[i]] + argv[i + 1:]
    return ["timeline", *argv]


if __name__ == "__main__":
    sys.exit(main(forward(sys.argv[1:])))
